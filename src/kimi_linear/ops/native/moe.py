"""A decode step's MoE layer (router, routed and shared experts, residual add) and dense SwiGLU MLP for its few
rows as one C call each (``moe_rows_f32`` / ``glu_rows_f32`` in ``decode.c``)."""

from __future__ import annotations

import torch

from . import cpu_float32_inference, library

# Rows x expert size (N * I * D) up to which the C kernels run. Their products are plain loops: they win where
# the PyTorch path's ~7 ops an expert cost more than the arithmetic (one row, a few rows, small experts) and lose
# to BLAS's matrix products on many rows of large experts. Intel box, MoE layer alone with its weights cold, us a
# layer, C / PyTorch, `small` preset (I * D = 131k): 2 threads 406 / 665 at 1 row, 847 / 1300 at 8, 1026-1369 /
# 1575-1656 at 16, 1549-2082 / 1854-2304 at 32, 2372 / 2298 at 64; 1 thread 2199 / 2583 at 16, 3124 / 3193 at 32,
# 4785 / 4522 at 64 (products streaming eight weight rows at once; with one, C lost from 32 rows on).
MAX_WORK = 1 << 22
MAX_ROWS = 256


def _strides(w: torch.Tensor) -> tuple[int, int, int] | None:
    """(expert, row, column) strides of a stack [E, out, in] whose matrices have a contiguous row or column (the
    layouts ``SparseMoE.pack`` and ``optimize_layout`` make), else None."""
    se, so, si = w.stride()
    return (se, so, si) if so == 1 or si == 1 else None


def _usable(x: torch.Tensor, D: int, I: int, residual: torch.Tensor | None, *weights: torch.Tensor) -> bool:
    """CPU float32 rows x [N, D] (and residual of x's shape), contiguous, N <= MAX_ROWS and N * I * D <= MAX_WORK,
    no gradient."""
    return (cpu_float32_inference(x, residual, *weights) and x.dim() == 2 and x.shape[1] == D
            and 0 < x.shape[0] <= MAX_ROWS and x.shape[0] * I * D <= MAX_WORK and x.is_contiguous()
            and (residual is None or (residual.shape == x.shape and residual.is_contiguous())))


def moe_decode(
    x: torch.Tensor, router_weight: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool,
    scaling: float, w13: torch.Tensor, w2: torch.Tensor, shared: int | None, residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A few rows through a sigmoid-routed MoE layer with one expert group, or None where the kernel does not
    apply (then the caller runs its PyTorch path): not CPU float32, gradients wanted, more rows than MAX_ROWS or
    MAX_WORK allow, or another layout.

    x [N, D]; router_weight [E, D]; bias [E]; w13 [E', 2I, D] gate|up and w2 [E', D, I] down projections of the
    stacked experts (E' >= E); shared: the stack index of a shared expert added with weight 1, or None;
    residual [N, D] added to the output. Returns (out [N, D], experts [N, top_k] int64, weights [N, top_k]).
    """
    lib = library()
    if lib is None:
        return None
    E, D = router_weight.shape
    I = w2.shape[2]
    s13, s2 = _strides(w13), _strides(w2)
    if (not _usable(x, D, I, residual, router_weight, bias, w13, w2) or s13 is None or s2 is None
            or not router_weight.is_contiguous() or tuple(w13.shape[1:]) != (2 * I, D)
            or tuple(w2.shape[1:]) != (D, I) or w13.shape[0] < E or not bias.is_contiguous() or bias.numel() != E
            or not 0 < top_k <= E or (shared is not None and not 0 <= shared < w13.shape[0])):
        return None
    N = x.shape[0]
    out = torch.empty(N, D)
    experts = torch.empty(N, top_k, dtype=torch.int64)
    weights = torch.empty(N, top_k)
    scratch = torch.empty(N, 3 * I + D)
    status = lib.moe_rows_f32(
        x.data_ptr(), N, D, I, router_weight.data_ptr(), bias.data_ptr(), E, top_k, renormalize, scaling,
        -1 if shared is None else shared, w13.data_ptr(), *s13, w2.data_ptr(), *s2,
        None if residual is None else residual.data_ptr(), out.data_ptr(), scratch.data_ptr(), experts.data_ptr(),
        weights.data_ptr(), torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError(f"moe_decode: no memory for the expert lists of {N} rows")
    return out, experts, weights


def glu_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
            residual: torch.Tensor | None = None) -> torch.Tensor | None:
    """``residual + w2 (silu(gate) * up)`` with ``gate|up = w13 x`` for a few rows x [N, D]; w13 [2I, D], w2 [D, I]
    with a contiguous row or column; None where the kernel does not apply (see :func:`moe_decode`)."""
    lib = library()
    if lib is None:
        return None
    D, I = w2.shape
    s13, s2 = _strides(w13.unsqueeze(0)), _strides(w2.unsqueeze(0))
    if not _usable(x, D, I, residual, w13, w2) or s13 is None or s2 is None or tuple(w13.shape) != (2 * I, D):
        return None
    N = x.shape[0]
    out = torch.empty(N, D)
    scratch = torch.empty(N, 3 * I + D)
    lib.glu_rows_f32(
        x.data_ptr(), N, D, I, w13.data_ptr(), *s13[1:], w2.data_ptr(), *s2[1:],
        None if residual is None else residual.data_ptr(), out.data_ptr(), scratch.data_ptr(), torch.get_num_threads(),
    )
    return out
