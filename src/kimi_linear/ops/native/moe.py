"""A decode token's MoE layer (router, routed and shared experts, residual add) and dense SwiGLU MLP as one C call
each (``moe_decode_f32`` / ``glu_experts_f32`` in ``decode.c``)."""

from __future__ import annotations

import torch

from . import library


def _strides(w: torch.Tensor) -> tuple[int, int, int] | None:
    """(expert, row, column) strides of a stack [E, out, in] whose matrices have a contiguous row or column (the
    layouts ``SparseMoE.pack`` and ``optimize_layout`` make), else None."""
    se, so, si = w.stride()
    return (se, so, si) if so == 1 or si == 1 else None


def _usable(*tensors: torch.Tensor | None) -> bool:
    ts = [t for t in tensors if t is not None]
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in ts):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in ts))


def _single_row(x: torch.Tensor, residual: torch.Tensor | None, D: int) -> bool:
    return x.shape == (1, D) and x.is_contiguous() and (
        residual is None or (residual.shape == (1, D) and residual.is_contiguous()))


def moe_decode(
    x: torch.Tensor, router_weight: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool,
    scaling: float, w13: torch.Tensor, w2: torch.Tensor, shared: int | None, residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """One token through a sigmoid-routed MoE layer with one expert group, or None where the kernel does not
    apply (then the caller runs its PyTorch path): not CPU float32, gradients wanted, or another layout.

    x [1, D]; router_weight [E, D]; bias [E]; w13 [E', 2I, D] gate|up and w2 [E', D, I] down projections of the
    stacked experts (E' >= E); shared: the stack index of a shared expert added with weight 1, or None;
    residual [1, D] added to the output. Returns (out [1, D], experts [1, top_k] int64, weights [1, top_k]).
    """
    lib = library()
    if lib is None or not _usable(x, router_weight, bias, w13, w2, residual):
        return None
    E, D = router_weight.shape
    I = w2.shape[2]
    s13, s2 = _strides(w13), _strides(w2)
    if (s13 is None or s2 is None or not _single_row(x, residual, D) or not router_weight.is_contiguous()
            or tuple(w13.shape[1:]) != (2 * I, D) or tuple(w2.shape[1:]) != (D, I) or w13.shape[0] < E
            or not bias.is_contiguous() or bias.numel() != E or not 0 < top_k <= E):
        return None
    out = torch.empty(1, D)
    experts = torch.empty(1, top_k, dtype=torch.int64)
    weights = torch.empty(1, top_k)
    hidden = torch.empty(top_k + 1, I)
    lib.moe_decode_f32(
        x.data_ptr(), D, I, router_weight.data_ptr(), bias.data_ptr(), E, top_k, renormalize, scaling,
        -1 if shared is None else shared, w13.data_ptr(), *s13, w2.data_ptr(), *s2,
        None if residual is None else residual.data_ptr(), out.data_ptr(), hidden.data_ptr(), experts.data_ptr(),
        weights.data_ptr(), torch.get_num_threads(),
    )
    return out, experts, weights


def glu_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
            residual: torch.Tensor | None = None) -> torch.Tensor | None:
    """``residual + w2 (silu(gate) * up)`` with ``gate|up = w13 x`` for one token x [1, D]; w13 [2I, D], w2 [D, I]
    with a contiguous row or column; None where the kernel does not apply (see :func:`moe_decode`)."""
    lib = library()
    if lib is None or not _usable(x, w13, w2, residual):
        return None
    D, I = w2.shape
    s13, s2 = _strides(w13.unsqueeze(0)), _strides(w2.unsqueeze(0))
    if s13 is None or s2 is None or not _single_row(x, residual, D) or tuple(w13.shape) != (2 * I, D):
        return None
    out = torch.empty(1, D)
    hidden = torch.empty(1, I)
    lib.glu_experts_f32(
        x.data_ptr(), D, I, 1, None, None, w13.data_ptr(), *s13, w2.data_ptr(), *s2,
        None if residual is None else residual.data_ptr(), out.data_ptr(), hidden.data_ptr(), torch.get_num_threads(),
    )
    return out
