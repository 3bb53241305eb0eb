"""Test-session settings that must exist before any test module imports its libraries."""

import os

# The Triton kernels are tested on CPU through Triton's interpreter. The switch is read when a kernel is decorated,
# and importing transformers' models already imports triton, so it is set here, before any test module loads.
os.environ.setdefault("TRITON_INTERPRET", "1")
