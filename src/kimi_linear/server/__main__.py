"""``python -m kimi_linear.server CHECKPOINT [options]`` (same options as ``kimi-linear serve``)."""

import sys

from .cli import main

sys.exit(main())
