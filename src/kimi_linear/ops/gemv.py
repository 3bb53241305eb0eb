"""``y = x @ W^T`` for a few rows (decode steps): one Triton kernel on CUDA (:mod:`kimi_linear.ops.triton.gemv`),
``F.linear`` otherwise. Products accumulate in float32 and round once to x's dtype, as cuBLAS does; the sums run in
another order, so results agree to rounding, not bit for bit.

Not yet on the model's path: ``bench/gemv_gpu.py`` times it against ``F.linear`` (cuBLAS) at the decode shapes of
Kimi-Linear-48B, and the layers take it where it wins.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import for_inference, triton_op

GEMV_MAX_ROWS = 16      # the rows of one tensor-core tile


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] with M <= 16, weight [N, K] (row- or column-major, x's dtype and device) -> [M, N]."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gemv: x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype != weight.dtype or x.device != weight.device:
        raise ValueError(f"gemv: weight must have x's dtype and device, got {weight.dtype} on {weight.device} for "
                         f"{x.dtype} on {x.device}")
    fast = for_inference(triton_op("gemv", x), x, weight) if x.shape[0] <= GEMV_MAX_ROWS else None
    return fast(x, weight) if fast is not None else F.linear(x, weight)
