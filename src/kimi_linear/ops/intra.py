"""Inside one chunk: decay sums, the decayed score matrices and the WY form of the delta rule (docs/kda.md §4-5).

Every decay factor here is ``exp`` of a sum of gates over a run of tokens, built as that sum directly, never as the
difference of two prefix sums: all gates are <= 0, so a sum of them has no cancellation, stays accurate in float32
even next to a step of ``g = -1000``, and every factor is at most 1 (no overflow, gradients stay finite).

The strictly lower triangle of a ``C x C`` score matrix is split recursively: a ``2b x 2b`` diagonal block has an
off-diagonal ``b x b`` block (rows in its second half, columns in its first) whose decay factors through the split
point ``r`` (the last row of the first half):  exp(G_i - G_j) = exp(G_i - G_r) * exp(G_r - G_j), both <= 1.
Per level b = C/2, ..., 1 that is one exp and two products over the chunk and one batch of ``b x b`` matmuls.
The run sums of every level come from one recursion over block sizes (two additions per level): ``prefix_b`` sums
from the start of each aligned b-block through the row, ``suffix_b`` sums after the row to the block's end.
"""

from __future__ import annotations

from functools import cache

import torch

# exp(-80) ~ 1.8e-35: below it every factor is zero for any purpose, and keeping exp's input above it keeps its
# result out of the denormal range, where CPUs run element-wise math tens of times slower.
EXP_FLOOR = -80.0


def safe_exp(x: torch.Tensor) -> torch.Tensor:
    """``exp(max(x, EXP_FLOOR))`` for log decays ``x <= 0``."""
    return x.clamp_min(EXP_FLOOR).exp()


@cache
def _levels(C: int) -> tuple[int, ...]:
    """Block sizes b of the off-diagonal blocks, largest first: C/2, C/4, ..., 1."""
    if C < 2 or C & (C - 1):
        raise ValueError(f"chunk size must be a power of two >= 2, got {C}")
    return tuple(C >> s for s in range(1, C.bit_length()))


def _off_diagonal_blocks(A: torch.Tensor, b: int) -> torch.Tensor:
    """View of the level-b blocks of A [..., C, C] as [..., P, b, b]: rows of the second half of each aligned
    2b-block, columns of its first half."""
    *lead, C, _ = A.shape
    P = C // (2 * b)
    A6 = A.view(*lead, P, 2, b, P, 2, b)
    return A6.diagonal(dim1=-6, dim2=-3)[..., 1, :, 0, :, :].movedim(-1, -3)


def _halves(x: torch.Tensor, b: int) -> torch.Tensor:
    """[..., C, K] -> [..., C/2b, 2, b, K]: the two halves of every aligned 2b-block."""
    *lead, C, K = x.shape
    return x.view(*lead, C // (2 * b), 2, b, K)


def run_sums(g: torch.Tensor) -> tuple[dict[int, torch.Tensor], torch.Tensor, torch.Tensor]:
    """Log decays over runs, for every level, from per-step gates g: [..., C, K]. No autograd (see ChunkIntra).

    Returns ``(E, G, G_to_end)``: ``E[b]`` [..., C, K] holds, in the first half of each 2b-block, the sum after row
    j through the split point, and in the second half the sum after the split point through row i; ``G`` is
    ``sum_{m<=i} g_m`` and ``G_to_end`` is ``sum_{m>i} g_m`` over the whole chunk.
    """
    C = g.shape[-2]
    prefix, suffix = g.clone(), torch.zeros_like(g)                            # level b = 1
    E = {}
    for b in reversed(_levels(C)):                                             # 1, 2, 4, ..., C/2
        p2, s2 = _halves(prefix, b), _halves(suffix, b)
        E_b = suffix.clone()
        _halves(E_b, b)[..., 1, :, :] = p2[..., 1, :, :]
        E[b] = E_b
        # Grow both to blocks of 2b, in place: the second half's prefix continues after the first half's total;
        # the first half's suffix continues through the second half's total.
        first_total, second_total = p2[..., 0, -1:, :].clone(), p2[..., 1, -1:, :].clone()
        p2[..., 1, :, :] += first_total
        s2[..., 0, :, :] += second_total
    return E, prefix, suffix


def run_sums_backward(dE: dict[int, torch.Tensor], dG: torch.Tensor, dG_to_end: torch.Tensor) -> torch.Tensor:
    """The transpose of :func:`run_sums`: gradients of ``E``, ``G``, ``G_to_end`` -> gradient of g."""
    C = dG.shape[-2]
    d_prefix, d_suffix = dG, dG_to_end
    for b in _levels(C):                                                       # C/2, ..., 1
        dp2, ds2, de2 = _halves(d_prefix, b), _halves(d_suffix, b), _halves(dE[b], b)
        # prefix_2b second half = prefix_b + first_total; suffix_2b first half = suffix_b + second_total.
        d_first_total = dp2[..., 1, :, :].sum(-2, keepdim=True)
        d_second_total = ds2[..., 0, :, :].sum(-2, keepdim=True)
        dp_first = dp2[..., 0, :, :].clone()
        dp_second = dp2[..., 1, :, :] + de2[..., 1, :, :]
        dp_first[..., -1:, :] += d_first_total
        dp_second[..., -1:, :] += d_second_total
        d_prefix = torch.stack([dp_first, dp_second], dim=-3).flatten(-4, -2)
        d_suffix = torch.stack([ds2[..., 0, :, :] + de2[..., 0, :, :], ds2[..., 1, :, :]], dim=-3).flatten(-4, -2)
    return d_prefix


def _level_blocks(q: torch.Tensor, k: torch.Tensor, F: torch.Tensor, b: int):
    """Decayed halves of one level and its blocks: q2F, k2F (rows), k1F (columns), B_qk = q2F k1F^T,
    B_kk = k2F k1F^T. Shapes [..., P, b, K] and [..., P, b, b]."""
    q2, k2, F2 = _halves(q, b)[..., 1, :, :], _halves(k, b)[..., 1, :, :], _halves(F, b)[..., 1, :, :]
    k1F = _halves(k, b)[..., 0, :, :] * _halves(F, b)[..., 0, :, :]
    q2F, k2F = q2 * F2, k2 * F2
    k1F_t = k1F.transpose(-1, -2)
    return q2F, k2F, k1F, q2F @ k1F_t, k2F @ k1F_t


class ChunkIntra(torch.autograd.Function):
    """(q, k, g) [..., C, K] -> (A_qk, A_kk [..., C, C], G, G_to_end [..., C, K]).

    ``A_qk[i, j] = sum_c q_ic k_jc exp(G_ic - G_jc)`` for j <= i, ``A_kk`` the same with k for j < i, zero elsewhere.
    The backward is written by hand (per level: three matmuls and the transposed run-sum recursion) and recomputes
    the decay factors rather than storing one [C, K] tensor per level.
    """

    @staticmethod
    def forward(ctx, q, k, g):
        *lead, C, K = q.shape
        E, G, G_to_end = run_sums(g)
        A_qk, A_kk = q.new_zeros(*lead, C, C), q.new_zeros(*lead, C, C)
        for b in _levels(C):
            *_, B_qk, B_kk = _level_blocks(q, k, E[b].clamp_min_(EXP_FLOOR).exp_(), b)
            _off_diagonal_blocks(A_qk, b).copy_(B_qk)
            _off_diagonal_blocks(A_kk, b).copy_(B_kk)
        A_qk.diagonal(dim1=-2, dim2=-1).copy_((q * k).sum(-1))                 # diagonal: no decay from i to i
        ctx.save_for_backward(q, k, g)
        return A_qk, A_kk, G, G_to_end

    @staticmethod
    def backward(ctx, dA_qk, dA_kk, dG, dG_to_end):
        q, k, g = ctx.saved_tensors
        *lead, C, K = q.shape
        dA_qk = torch.zeros(*lead, C, C, dtype=q.dtype, device=q.device) if dA_qk is None else dA_qk
        dA_kk = torch.zeros_like(dA_qk) if dA_kk is None else dA_kk
        dG = torch.zeros_like(g) if dG is None else dG
        dG_to_end = torch.zeros_like(g) if dG_to_end is None else dG_to_end
        dA_qk, dA_kk = dA_qk.contiguous(), dA_kk.contiguous()
        d_diag = dA_qk.diagonal(dim1=-2, dim2=-1).unsqueeze(-1)                # [.., C, 1]
        dq, dk = d_diag * k, d_diag * q
        E, _, _ = run_sums(g)
        dE = {}
        for b in _levels(C):
            dB_qk, dB_kk = _off_diagonal_blocks(dA_qk, b), _off_diagonal_blocks(dA_kk, b)
            F = safe_exp(E[b])
            q2F, k2F, k1F, _, _ = _level_blocks(q, k, F, b)
            d_q2F, d_k2F = dB_qk @ k1F, dB_kk @ k1F                            # [.., P, b, K]
            d_k1F = dB_qk.transpose(-1, -2) @ q2F + dB_kk.transpose(-1, -2) @ k2F
            F1, F2 = _halves(F, b)[..., 0, :, :], _halves(F, b)[..., 1, :, :]
            _halves(dq, b)[..., 1, :, :] += d_q2F * F2
            _halves(dk, b)[..., 1, :, :] += d_k2F * F2
            _halves(dk, b)[..., 0, :, :] += d_k1F * F1
            # d(x * exp(E))/dE = x * exp(E); zero where the floor clamps E.
            live = E[b] > EXP_FLOOR
            dE_b = torch.stack([d_k1F * k1F, d_q2F * q2F + d_k2F * k2F], dim=-3).flatten(-4, -2)
            dE[b] = torch.where(live, dE_b, 0.0)
        dg = run_sums_backward(dE, dG, dG_to_end)
        return dq, dk, dg


class UnitLowerInverse(torch.autograd.Function):
    """``T = (I + A)^-1`` for strictly lower triangular A [..., C, C], by forward substitution.

    Backward: ``dA = -(T^T dT T^T)`` restricted to the strict lower triangle (A's free entries), two matmuls
    instead of a second triangular solve.
    """

    @staticmethod
    def forward(ctx, A):
        C = A.shape[-1]
        eye = torch.eye(C, dtype=A.dtype, device=A.device)
        T = torch.linalg.solve_triangular(A + eye, eye.expand_as(A), upper=False, unitriangular=True)
        ctx.save_for_backward(T)
        return T

    @staticmethod
    def backward(ctx, dT):
        (T,) = ctx.saved_tensors
        Tt = T.transpose(-1, -2)
        return -(Tt @ dT @ Tt).tril(-1)


def wy_representation(
    A_kk: torch.Tensor, k_decayed: torch.Tensor, v: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``W = T (beta K exp(G))`` and ``U = T (beta V)`` with ``T = (I + beta A_kk)^-1``.

    A_kk: [..., C, C] strictly lower; k_decayed (= k * exp(G)): [..., C, K]; v: [..., C, V]; beta: [..., C].
    """
    T = UnitLowerInverse.apply(beta[..., :, None] * A_kk)
    T_beta = T * beta[..., None, :]                                            # T Diag(beta)
    return T_beta @ k_decayed, T_beta @ v
