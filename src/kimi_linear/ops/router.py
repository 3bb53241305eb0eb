"""The MoE router of Kimi Linear (SPEC section 4, FFN) as one operator: sigmoid scores, biased top-k choice,
unbiased weights.

For a token x [D] and router weight R [E, D] (float32):

    s      = sigmoid(R x)                         scores in float32
    chosen = top-k of (s + bias)                  bias: the load-balancing correction, float32
    w_j    = s[chosen_j]  (/ sum_j s[chosen_j] when renormalising)  * routed_scaling_factor

On CUDA tensors and small batches (a decode step: N <= ``FUSED_MAX_TOKENS``) :func:`sigmoid_topk_route` runs the
one-kernel Triton router of :mod:`kimi_linear.ops.triton.router`; it replaces about ten small kernels per MoE layer
(cast, product, sigmoid, bias, two top-k passes, gather, sum, divide, scale), which at batch 1 cost more than the
experts' weights take to read. Group-limited routing (``n_group > 1``) stays in the layer's PyTorch code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import triton_op

FUSED_MAX_TOKENS = 1024


def sigmoid_topk_route_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int,
                             renormalize: bool = True, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch path and reference: x [N, D], weight [E, D] -> (weights [N, k] float32, ids [N, k] int64)."""
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32      # float32 at least, never less
    s = F.linear(x.to(dtype), weight.to(dtype)).sigmoid()
    ids = (s + bias).topk(k, dim=-1)[1]
    w = s.gather(1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True).add_(1e-20)
    return (w * scale if scale != 1.0 else w), ids


def sigmoid_topk_route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int,
                       renormalize: bool = True, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Route N tokens: x [N, D] (any float dtype), weight [E, D] float32, bias [E] float32 -> (weights [N, k]
    float32, expert ids [N, k] int64), ids in descending order of ``s + bias`` (module docstring)."""
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"sigmoid_topk_route: x must be [N, D] and weight [E, D], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    E = weight.shape[0]
    if tuple(bias.shape) != (E,):
        raise ValueError(f"sigmoid_topk_route: bias must be [E={E}], got {tuple(bias.shape)}")
    if not 1 <= k <= E:
        raise ValueError(f"sigmoid_topk_route: k must be in [1, E={E}], got {k}")
    fast = triton_op("sigmoid_topk_route", x)
    if fast is not None and x.shape[0] <= FUSED_MAX_TOKENS and weight.dtype == torch.float32 \
            and not torch.is_grad_enabled():
        return fast(x, weight, bias, k, renormalize, scale)
    return sigmoid_topk_route_torch(x, weight, bias, k, renormalize, scale)
