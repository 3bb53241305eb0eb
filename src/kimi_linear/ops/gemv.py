"""A decode step's dense projection ``y = x W^T`` for a few rows of x (docs/serving.md §4, the decode step).

On CUDA (sm_90, where TMA descriptors exist), for up to :data:`GEMV_MAX_ROWS` rows of 16-bit x and a contiguous
16-bit W, one Triton kernel (:mod:`kimi_linear.ops.triton.decode_gemv`): W streamed through TMA, float32 accumulation,
one launch with programmatic dependent launch. Everything else, and the reference: ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import for_inference, triton_op

GEMV_MAX_ROWS = 16      # one tensor-core tile of rows: a decode batch up to 16; more rows take cuBLAS's GEMM


def gemv_eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The Triton kernel takes x [M <= GEMV_MAX_ROWS, K] (unit column stride) and weight [N, K]: same 16-bit
    dtype, W contiguous with 16-byte rows at a 16-byte address (a TMA descriptor's terms)."""
    return (
        x.dim() == 2 and weight.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS and x.shape[1] == weight.shape[1]
        and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16) and x.stride(1) == 1
        and weight.is_contiguous() and (weight.shape[1] * 2) % 16 == 0 and weight.data_ptr() % 16 == 0
    )


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T``: x [M, K], weight [N, K] -> [M, N] in x's dtype. The Triton kernel when
    :func:`gemv_eligible`, on a device with TMA and without autograd; else ``F.linear``."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv: x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    fast = for_inference(triton_op("gemv", x), x, weight, dtypes=(torch.bfloat16, torch.float16))
    if fast is not None and gemv_eligible(x, weight):
        from .triton.tma import tma_supported  # (imported here: ops.triton is optional)

        if tma_supported(x.device):
            return fast(x, weight)
    return F.linear(x, weight)
