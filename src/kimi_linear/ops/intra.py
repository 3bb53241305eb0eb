"""Inside one chunk: the decayed score matrices and the WY form of the delta rule (SPEC section 2).

Every decay factor here is ``exp`` of a sum of gates over a run of tokens, computed as that sum directly (a
cumulative sum that starts at a split point), never as the difference of two prefix sums: all gates are <= 0, so a
sum of them carries no cancellation, stays accurate in float32 even after a step of ``g = -1000``, and every factor
is at most 1 (no overflow, and gradients stay finite).

The strictly lower triangle of a ``C x C`` score matrix is split recursively: a ``2b x 2b`` diagonal block has an
off-diagonal ``b x b`` block (rows in the second half, columns in the first) whose decay factors through the split
point ``r``:  exp(G_i - G_j) = exp(G_i - G_r) * exp(G_r - G_j), both factors <= 1. So the whole triangle costs one
small batched matmul per level (b = C/2, C/4, ..., 1) and O(C K) element-wise work per level.
"""

from __future__ import annotations

from functools import cache

import torch


def reverse_exclusive_cumsum(x: torch.Tensor, dim: int = -2) -> torch.Tensor:
    """``y_j = sum_{m > j} x_m`` along ``dim``, summed from the end so nothing cancels."""
    n = x.shape[dim]
    shifted = torch.cat([x.narrow(dim, 1, n - 1), torch.zeros_like(x.narrow(dim, 0, 1))], dim=dim)
    return shifted.flip(dim).cumsum(dim).flip(dim)


@cache
def _levels(C: int) -> tuple[int, ...]:
    if C & (C - 1):
        raise ValueError(f"chunk size must be a power of two, got {C}")
    return tuple(C >> s for s in range(1, C.bit_length()))


@cache
def _block_index(C: int, device: torch.device) -> torch.Tensor:
    """Flat ``i * C + j`` positions of every off-diagonal block entry, level by level, then the diagonal."""
    parts = []
    for b in _levels(C):
        p = torch.arange(C // (2 * b))[:, None, None]
        i = torch.arange(b)[None, :, None]
        j = torch.arange(b)[None, None, :]
        rows, cols = (2 * p + 1) * b + i, 2 * p * b + j
        parts.append((rows * C + cols).flatten())
    parts.append(torch.arange(C) * (C + 1))
    return torch.cat(parts).to(device)


def decayed_scores(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores ``sum_c x_ic k_jc exp(G_ic - G_jc)`` for ``x = q`` (j <= i) and ``x = k`` (j < i).

    q, k, g: [..., C, K] (g the per-step log decays of one chunk). Returns ``(A_qk, A_kk)``, each [..., C, C],
    zero above the diagonal (``A_kk`` also zero on it).
    """
    *lead, C, K = q.shape
    qk_vals, kk_vals = [], []
    for b in _levels(C):
        P = C // (2 * b)
        q2, k2, g2 = (x.reshape(*lead, P, 2, b, K) for x in (q, k, g))
        row_decay = g2[..., 1, :, :].cumsum(-2).exp()                        # exp(G_i - G_r), i after r  [.., P, b, K]
        col_decay = reverse_exclusive_cumsum(g2[..., 0, :, :]).exp()         # exp(G_r - G_j), j up to r  [.., P, b, K]
        rows = torch.cat([q2[..., 1, :, :], k2[..., 1, :, :]], dim=-2) * row_decay.repeat(*([1] * len(lead)), 1, 2, 1)
        cols = k2[..., 0, :, :] * col_decay
        blocks = rows @ cols.transpose(-1, -2)                               # [.., P, 2b, b]
        qk_vals.append(blocks[..., :b, :].reshape(*lead, -1))
        kk_vals.append(blocks[..., b:, :].reshape(*lead, -1))
    qk_vals.append((q * k).sum(-1))                                          # diagonal: no decay between i and i
    kk_vals.append(torch.zeros_like(qk_vals[-1]))
    index = _block_index(C, q.device)
    zeros = q.new_zeros(*lead, C * C)
    A_qk = zeros.index_copy(-1, index, torch.cat(qk_vals, -1)).view(*lead, C, C)
    A_kk = zeros.index_copy(-1, index, torch.cat(kk_vals, -1)).view(*lead, C, C)
    return A_qk, A_kk


def wy_representation(
    A_kk: torch.Tensor, k_decayed: torch.Tensor, v: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``W = T (beta K exp(G))`` and ``U = T (beta V)`` with ``T = (I + beta A_kk)^-1``.

    A_kk: [..., C, C] strictly lower; k_decayed (= k * exp(G)): [..., C, K]; v: [..., C, V]; beta: [..., C].
    One forward substitution serves both right-hand sides.
    """
    K = k_decayed.shape[-1]
    C = A_kk.shape[-1]
    L = beta[..., :, None] * A_kk + torch.eye(C, dtype=A_kk.dtype, device=A_kk.device)
    rhs = beta[..., :, None] * torch.cat([k_decayed, v], dim=-1)
    WU = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)
    return WU[..., :K], WU[..., K:]
