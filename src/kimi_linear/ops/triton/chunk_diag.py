"""Chunk pipeline, stage (b) for strong decay: the diagonal 16x16 blocks of the score matrices on the CUDA cores.

Inside a diagonal block (rows i, columns j of one 16-row sub-block, j <= i)

    Aqk[i, j] = sum_c q_ic k_jc E_j[i, c]      Akk[i, j] = sum_c k_ic k_jc E_j[i, c]  (j < i)
    E_j[i, c] = exp(gP_ic - gP_jc)

and no factorisation ``exp(gP_i) exp(-gP_j)`` fits float32 when a sub-block's gate falls by more than SAFE_EXP
(strong decay, padding gates of -1000). Walking the columns from the last row of the sub-block to its first, E is a
running product of single steps,

    E_j[i] = E_{j+1}[i] exp(gP_{j+1} - gP_j)   (i > j),      E_j[j] = 1,

every factor the decay of one step (<= 1): no overflow at any gate, underflow only where the exact value does, one
exponential per channel and column for all 16 rows (a pair-by-pair ``exp(gP_i - gP_j)`` takes one per pair), and
float32 products throughout. Column j of both blocks is then one multiply and two row sums over the channels.

One program per (sub-block, value head) runs its block (16 columns one after another), only for the chunks that
:func:`kimi_linear.ops.triton.chunk_wy.chunk_kda_fwd_scores_kernel` hands to its sub-block scheme with a strong
step (:func:`needs_diagonal_kernel`: the same tests on the same numbers); that launch leaves their diagonal blocks at
zero and this one, launched after it, overwrites them (l2norm row factors from the rq, rk the scores kernel stored).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .chunk_common import (
    SAFE_EXP,
    cast,
    chunk_coords,
    grid_coords,
    halves_fall_little,
    load_norms,
    load_rows,
    sub_block_totals,
    sub_blocks_fall_little,
)
from .fastmath import fast_exp


@triton.jit
def totals_safe(b_t0, b_t1, b_t2, b_t3):
    """Whether every sub-block's gate sum over the channels given ([n] each) is above -SAFE_EXP: then
    ``exp(gP_i) exp(-gP_j)`` (<= 1.2e26 each) takes a diagonal block in one product."""
    return tl.min(tl.minimum(tl.minimum(b_t0, b_t1), tl.minimum(b_t2, b_t3))) > -SAFE_EXP


@triton.jit
def needs_diagonal_kernel(b_t0, b_t1, b_t2, b_t3, HALVES: tl.constexpr):
    """From the chunk's four sub-block totals over all channels: whether its diagonal blocks come from
    :func:`chunk_kda_fwd_diag_kernel` (not separable, not taken by halves, some sub-block falling by SAFE_EXP or
    more), the routing of the scores kernel."""
    other = not halves_fall_little(b_t0, b_t1, b_t2, b_t3)
    if HALVES:
        other = other and not sub_blocks_fall_little(b_t0, b_t1, b_t2, b_t3)
    return other and not totals_safe(b_t0, b_t1, b_t2, b_t3)


@triton.jit
def diagonal_block(q, k, gP, rq, rk, Aqk, Akk, bos, r0, c0, T_n, i_h, i_hv, H: tl.constexpr, HV: tl.constexpr,
                   K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                   USE_QK_L2NORM: tl.constexpr):
    """Store the diagonal block of the sub-block at row r0 (columns c0 .. c0 + BC of its rows in Aqk and Akk): Aqk
    on and below the diagonal, Akk below it (the scores kernel left zeros everywhere in the block). Each column
    goes to memory from the row sums' own layout (gathering them into a [BC, BC] tile cost a layout conversion
    through shared memory per column). l2norm's row factors scale q and k before the products."""
    o_k = tl.arange(0, BK)
    o_i = tl.arange(0, BC)
    b_rq, b_rk = load_norms(rq, rk, bos, r0, T_n, i_h, H, BC, USE_QK_L2NORM)                     # [BC] x2
    b_q = load_rows(q, bos, r0, T_n, i_h, H, K, o_k, BC).to(tl.float32) * b_rq[:, None]          # [BC, BK]
    b_k = load_rows(k, bos, r0, T_n, i_h, H, K, o_k, BC).to(tl.float32) * b_rk[:, None]          # [BC, BK]
    p_k = k + ((bos + r0) * H + i_h) * K + o_k                                                   # [BK] row r0
    p_g = gP + ((bos + r0) * HV + i_hv) * K + o_k
    p_a = ((bos + r0 + o_i) * HV + i_hv) * BT + c0                                               # [BC] int64
    m_i = (r0 + o_i) < T_n
    m_k = o_k < K
    b_E = tl.zeros([BC, BK], dtype=tl.float32)                                                   # [BC, BK]
    b_gn = tl.zeros([BK], dtype=tl.float32)                   # gP of row j + 1 (unused for the last row)
    for jj in range(BC):
        j = BC - 1 - jj
        m_j = m_k & (r0 + j < T_n)
        b_gj = tl.load(p_g + j * (HV * K), mask=m_j, other=0.0)                                  # [BK]
        b_kj = tl.load(p_k + j * (H * K), mask=m_j, other=0.0).to(tl.float32)                    # [BK]
        if USE_QK_L2NORM:
            b_kj = b_kj * tl.load(rk + (bos + r0 + j) * H + i_h, mask=r0 + j < T_n, other=0.0)
        # one step's decay exp(gP_{j+1} - gP_j) <= 1 on rows i > j; row j starts at 1. Rows i < j are set to 0,
        # not multiplied: from a row past T_n (gP 0) into a strong one the step's factor is inf, and 0 * inf NaN
        b_a = fast_exp(b_gn - b_gj)                                                              # [BK]
        b_E = tl.where((o_i > j)[:, None], b_E * b_a[None, :], tl.where((o_i == j)[:, None], 1.0, 0.0))
        b_gn = b_gj
        b_kE = b_E * b_kj[None, :]                                                               # [BC, BK]
        tl.store(Aqk + p_a + j, cast(tl.sum(b_q * b_kE, 1), Aqk.dtype.element_ty), mask=m_i & (o_i >= j))
        tl.store(Akk + p_a + j, cast(tl.sum(b_k * b_kE, 1), Akk.dtype.element_ty), mask=m_i & (o_i > j))


@triton.jit
def chunk_kda_fwd_diag_kernel(
    q, k, gP, rq, rk,                 # [B, T, H, K] x2, [B, T, HV, K] f32, [B, T, H] f32 x2 (l2norm only)
    Aqk, Akk,                         # in/out: [B, T, HV, BT] each; only the diagonal blocks are written
    cu_seqlens, chunk_indices,        # varlen only
    T, NT,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_QK_L2NORM: tl.constexpr, HALVES: tl.constexpr,
):
    i_c, i_s, i_hv = grid_coords(BT // BC, HV)
    _, i_t, bos, T_n = chunk_coords(i_c, cu_seqlens, chunk_indices, T, NT, IS_VARLEN)
    t0, i_h = i_t * BT, i_hv // (HV // H)
    r0 = t0 + i_s * BC
    if r0 < T_n:
        b_t0, b_t1, b_t2, b_t3 = sub_block_totals(gP, bos, t0, T_n, i_hv, HV, K, tl.arange(0, BK), BC)   # [BK] x4
        if needs_diagonal_kernel(b_t0, b_t1, b_t2, b_t3, HALVES):
            diagonal_block(q, k, gP, rq, rk, Aqk, Akk, bos, r0, i_s * BC, T_n, i_h, i_hv, H, HV, K, BT, BC, BK,
                           USE_QK_L2NORM)
