"""A decode step's wide input projection (a KDA layer's packed q|k|v|gates|beta weight, 12,576 rows at the 48B
shape) as one Triton launch on CUDA: a few rows against a weight whose [64, K] row tiles alone fill the card, the
tiles read through TMA descriptors 4 stages deep (:func:`kimi_linear.ops.triton.splitk.wide_rows_product`)."""

from __future__ import annotations

import torch

from .backend import for_inference, triton_op


def wide_projection(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``x @ weight^T`` (x [..., K], weight [N, K], same dtype) by the Triton kernel where it applies: CUDA (or the
    interpreter), no gradient, at most 16 rows, a unit column stride, and N wide enough (one to two row tiles per
    SM); else None, and the caller runs its own product."""
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"wide_projection: x [..., K] and weight [N, K] must agree on K, got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    fast = for_inference(triton_op("wide_rows_product", x), x, weight)
    if fast is None or x.dtype != weight.dtype or weight.stride(1) != 1:
        return None
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        return None
    y = fast(x2, weight)
    return None if y is None else y.view(*x.shape[:-1], weight.shape[0])
