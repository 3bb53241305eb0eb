"""Triton kernels for KDA (issue 4) and the fused MoE (issue 18) on CUDA. :mod:`kimi_linear.ops.backend` dispatches
CUDA tensors here.

Imports cleanly without a GPU (the tests run the kernels under ``TRITON_INTERPRET=1`` on CPU tensors).
"""

from .chunk import chunk_kda
from .mla_decode import paged_mla_decode
from .moe import fused_moe
from .recurrent import fused_recurrent_kda

# The short-conv and gated-norm kernels (conv.py, norm.py) are tested under the interpreter but have not yet run on
# a GPU: the public ops dispatch to them once bench/kda_layer.py's full-size check passes there (add them here).
# paged_mla_decode (H200-checked by bench/mla_decode_gpu.py) and fused_moe (bench/moe_gpu.py) are the decode
# step's kernels (issue 18); dropping one here sends its callers to the PyTorch path.
__all__ = ["chunk_kda", "fused_moe", "fused_recurrent_kda", "paged_mla_decode"]
