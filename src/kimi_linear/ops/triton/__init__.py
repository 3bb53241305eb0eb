"""Triton kernels for KDA (issue 4) and the fused MoE (issue 18) on CUDA. :mod:`kimi_linear.ops.backend` dispatches
CUDA tensors here.

Imports cleanly without a GPU (the tests run the kernels under ``TRITON_INTERPRET=1`` on CPU tensors).
"""

from .chunk import chunk_kda
from .moe import fused_moe
from .recurrent import fused_recurrent_kda

# The short-conv and gated-norm kernels (conv.py, norm.py) are tested under the interpreter but have not yet run on
# a GPU: the public ops dispatch to them once bench/kda_layer.py's full-size check passes there (add them here).
# fused_moe is dispatched from the start (the MoE layer's CUDA path, issue 18); bench/moe_gpu.py checks it on a GPU
# (remove it here to fall back to the PyTorch paths).
__all__ = ["chunk_kda", "fused_moe", "fused_recurrent_kda"]
