"""Triton kernels for KDA on CUDA (issue 4). :mod:`kimi_linear.ops.backend` dispatches CUDA tensors here.

Imports cleanly without a GPU (the tests run the kernels under ``TRITON_INTERPRET=1`` on CPU tensors).
"""

from .chunk import chunk_kda
from .recurrent import fused_recurrent_kda

# The short-conv and gated-norm kernels (conv.py, norm.py) are tested under the interpreter but have not yet run on
# a GPU: the public ops dispatch to them once bench/kda_layer.py's full-size check passes there (add them here).
__all__ = ["chunk_kda", "fused_recurrent_kda"]
