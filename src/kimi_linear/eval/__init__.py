"""Evaluation with EleutherAI's lm-evaluation-harness (``pip install -e ".[eval]"``).

Importing this package registers the model class ``kimi_linear`` with lm-eval (:class:`.lm.KimiLinearLM`:
``loglikelihood``, ``loglikelihood_rolling``, ``generate_until``, batched on :class:`kimi_linear.engine.LLMEngine`).
Without lm-eval installed the import succeeds and registers nothing; ``python -m kimi_linear.eval`` then says what
to install. ``import kimi_linear`` never imports this package.

    python -m kimi_linear.eval --model DIR --tasks TASK [TASK ...] [--include_path DIR] [--batch_size 16]
    python -m kimi_linear.eval lm_eval --model kimi_linear --model_args pretrained=DIR --tasks ...
"""

from __future__ import annotations

from importlib.util import find_spec
from typing import Any

INSTALL_HINT = 'lm-evaluation-harness is not installed: pip install -e ".[eval]" (or pip install "lm-eval>=0.4.8,<0.5")'

if find_spec("lm_eval") is not None:
    from .lm import KimiLinearLM  # noqa: F401  (registers "kimi_linear")


def __getattr__(name: str) -> Any:
    if name == "KimiLinearLM":
        raise ImportError(INSTALL_HINT)
    raise AttributeError(name)
