"""Triton kernels on CUDA: KDA (chunked and recurrent), its short convolution (and its in-place decode step) and
gated output norm, the residual stream's RMSNorm (and residual add), the paged MLA decode attention (and its
per-head products), the fused MoE and a decode step's float32 logits with their greedy tokens.
:mod:`kimi_linear.ops.backend` dispatches CUDA tensors to what this module exports; dropping a name here sends its
callers to the PyTorch path.

Imports cleanly without a GPU (the tests run the kernels under ``TRITON_INTERPRET=1`` on CPU tensors). Each kernel
is checked at full size on an H200 by its bench script (kda_kernels.py, kda_layer.py, mla_decode_gpu.py,
moe_gpu.py, fused_small_gpu.py; BENCHMARKS.md).
"""

from .chunk import chunk_kda
from .conv import short_conv, short_conv_decode
from .greedy import logits_and_greedy
from .mla_decode import paged_mla_decode
from .mla_heads import absorb_query, expand_values
from .moe import fused_moe, router_logits, sigmoid_topk
from .norm import gated_rms_norm
from .paged import paged_decode_rows
from .recurrent import fused_recurrent_kda
from .rms_norm import add_rms_norm, project_add_rms_norm, rms_norm, rms_norm_write

__all__ = [
    "absorb_query", "add_rms_norm", "chunk_kda", "expand_values", "fused_moe", "fused_recurrent_kda",
    "gated_rms_norm", "logits_and_greedy", "paged_decode_rows", "paged_mla_decode", "project_add_rms_norm",
    "rms_norm", "rms_norm_write", "router_logits", "short_conv", "short_conv_decode", "sigmoid_topk",
]
