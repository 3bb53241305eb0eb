"""Chunk pipeline, stages (b)-(d): the intra-chunk score matrices, the inverse, and the WY factors.

:func:`chunk_kda_fwd_scores_kernel`, one program per (chunk, 16-row sub-block I, value head), writes rows I of

    Aqk[i, j] = sum_c q_ic k_jc exp(G_ic - G_jc)    (j <= i)       Akk[i, j] = same with k_i, j < i (no beta)

Off-diagonal blocks (J < I) factor the decay through the row r before sub-block I: ``exp(G_i - G_r)`` on the rows
and ``exp(G_r - G_j)`` on the columns, both <= 1 and both plain sums (chunk_common.py), so all of them are one
product of a [16, BKS] and a [BKS, 64] operand (columns from sub-block I on zeroed) and nothing overflows at any
gate. Diagonal blocks use ``exp(gP_i) exp(-gP_j)``
when the sub-block's gate sums are mild (|gP| < 60 everywhere, the common case: one product), else every (i, j)
pair's ``exp(gP_i - gP_j)`` explicitly on [16, 16, BKD] slices (strong decay, e.g. padding gates of -1000).

:func:`chunk_kda_fwd_wy_kernel`, one program per (chunk, value head), inverts ``I + diag(beta) Akk`` by 16x16
blocks (forward substitution on the diagonal blocks, block products below), stores the inverse ``Tm`` (read
again at once as one [64, 64] tile, and by the backward), and writes

    w = Tm (beta k exp(G))      u = Tm (beta v)      qg = q exp(G)      kg = k exp(G_C - G)      decay = exp(G_C)

which is everything the state scan and the output kernel (chunk_state.py) read.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .chunk_common import (
    SAFE_EXP,
    chunk_coords,
    chunk_gate_terms,
    earlier_factor,
    load_beta,
    load_norms,
    load_rows,
    mm,
    store_cols,
    store_rows,
    sub_block_total,
    unit_lower_inverse,
)


@triton.jit
def diagonal_scores(
    q, k, gP, b_rq, b_rk, bos, r0, T_n, i_h, i_hv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, BKS: tl.constexpr, BKD: tl.constexpr,
    PREC: tl.constexpr,
):
    """(Aqk, Akk) of the diagonal block of the sub-block at row r0: [BC, BC] each, zero above the diagonal (Aqk)
    and on and above it (Akk)."""
    o_r = tl.arange(0, BC)
    m_low = o_r[:, None] >= o_r[None, :]                                   # [BC, BC] j <= i
    m_pair = m_low & ((r0 + o_r) < T_n)[:, None]                            # ... and row i inside the sequence
    b_aq = tl.zeros([BC, BC], dtype=tl.float32)
    b_ak = tl.zeros([BC, BC], dtype=tl.float32)
    for c0 in range(0, K, BKS):
        o_k = c0 + tl.arange(0, BKS)
        b_P = load_rows(gP, bos, r0, T_n, i_hv, HV, K, o_k, BC)            # [BC, BKS]
        if tl.max(tl.abs(b_P)) < SAFE_EXP:
            b_q = load_rows(q, bos, r0, T_n, i_h, H, K, o_k, BC).to(tl.float32) * b_rq[:, None]   # [BC, BKS]
            b_k = load_rows(k, bos, r0, T_n, i_h, H, K, o_k, BC).to(tl.float32) * b_rk[:, None]   # [BC, BKS]
            b_e = tl.exp(b_P)
            b_kt = tl.trans(b_k * tl.exp(-b_P))                            # [BKS, BC]
            b_aq += mm(b_q * b_e, b_kt, PREC)
            b_ak += mm(b_k * b_e, b_kt, PREC)
        else:
            # (names differ from the other branch's: the two branches' blocks have different widths)
            for c1 in range(c0, c0 + BKS, BKD):
                o_d = c1 + tl.arange(0, BKD)
                b_qd = load_rows(q, bos, r0, T_n, i_h, H, K, o_d, BC).to(tl.float32) * b_rq[:, None]  # [BC, BKD]
                b_kd = load_rows(k, bos, r0, T_n, i_h, H, K, o_d, BC).to(tl.float32) * b_rk[:, None]  # [BC, BKD]
                b_pd = load_rows(gP, bos, r0, T_n, i_hv, HV, K, o_d, BC)   # [BC, BKD]
                m3 = m_pair[:, :, None]                                    # [BC, BC, 1]
                # exp only where j <= i on valid rows, where the exponent is <= 0; elsewhere it could overflow.
                b_f = tl.where(m3, tl.exp(tl.where(m3, b_pd[:, None, :] - b_pd[None, :, :], 0.0)), 0.0)
                b_f = b_f * b_kd[None, :, :]                               # [BC, BC, BKD] k_j exp(P_i - P_j)
                b_aq += tl.sum(b_qd[:, None, :] * b_f, 2)
                b_ak += tl.sum(b_kd[:, None, :] * b_f, 2)
    return tl.where(m_low, b_aq, 0.0), tl.where(o_r[:, None] > o_r[None, :], b_ak, 0.0)


@triton.jit
def sub_block_scores(
    q, k, gP, rq, rk, Aqk, Akk, bos, t0, I, T_n, i_h, i_hv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BKS: tl.constexpr, BKD: tl.constexpr, USE_QK_L2NORM: tl.constexpr, PREC: tl.constexpr,
):
    """Rows of sub-block I (of the chunk at t0) of Aqk and Akk, every column: the earlier sub-blocks, the diagonal
    block, zeros right of it."""
    rI = t0 + I * BC                                                       # first row of sub-block I
    o_j = tl.arange(0, BC)
    o_t = tl.arange(0, BT)
    b_rqI, b_rkI = load_norms(rq, rk, bos, rI, T_n, i_h, H, BC, USE_QK_L2NORM)   # [BC] x2

    # Every earlier column at once: one [BC, BKS] x [BKS, BT] product per channel step, the column operand zero
    # from sub-block I on (those columns are written below: the diagonal block, zeros right of it).
    b_aq = tl.zeros([BC, BT], dtype=tl.float32)                            # [BC, BT]
    b_ak = tl.zeros([BC, BT], dtype=tl.float32)                            # [BC, BT]
    if I > 0:
        b_unused, b_rk = load_norms(rq, rk, bos, t0, T_n, i_h, H, BT, USE_QK_L2NORM)   # [BT]
        for c0 in range(0, K, BKS):
            o_k = c0 + tl.arange(0, BKS)
            b_P = load_rows(gP, bos, t0, T_n, i_hv, HV, K, o_k, BT)                  # [BT, BKS]
            b_f = earlier_factor(b_P, sub_block_total(gP, bos, t0, 0, T_n, i_hv, HV, K, o_k, BC),
                                 sub_block_total(gP, bos, t0, 1, T_n, i_hv, HV, K, o_k, BC),
                                 sub_block_total(gP, bos, t0, 2, T_n, i_hv, HV, K, o_k, BC), I, BT, BC)
            b_c = load_rows(k, bos, t0, T_n, i_h, H, K, o_k, BT).to(tl.float32) * b_rk[:, None] * b_f
            b_e = tl.exp(load_rows(gP, bos, rI, T_n, i_hv, HV, K, o_k, BC))          # [BC, BKS] exp(G_i - G_r)
            b_q = load_rows(q, bos, rI, T_n, i_h, H, K, o_k, BC).to(tl.float32) * (b_rqI[:, None] * b_e)
            b_k = load_rows(k, bos, rI, T_n, i_h, H, K, o_k, BC).to(tl.float32) * (b_rkI[:, None] * b_e)
            b_ct = tl.trans(b_c)                                                     # [BKS, BT]
            b_aq += mm(b_q, b_ct, PREC)
            b_ak += mm(b_k, b_ct, PREC)
    m_off = (o_t // BC) != I
    store_cols(Aqk, b_aq, bos, rI, T_n, i_hv, HV, BT, o_t, m_off, BC)
    store_cols(Akk, b_ak, bos, rI, T_n, i_hv, HV, BT, o_t, m_off, BC)

    b_aq, b_ak = diagonal_scores(q, k, gP, b_rqI, b_rkI, bos, rI, T_n, i_h, i_hv, H, HV, K, BC, BKS, BKD, PREC)
    store_rows(Aqk, b_aq, bos, rI, T_n, i_hv, HV, BT, I * BC + o_j, BC)
    store_rows(Akk, b_ak, bos, rI, T_n, i_hv, HV, BT, I * BC + o_j, BC)



@triton.jit
def chunk_kda_fwd_scores_kernel(
    q, k, gP, rq, rk,                 # [B, T, H, K] x2, [B, T, HV, K] f32, [B, T, H] f32 x2 (l2norm only)
    Aqk, Akk,                         # out: [B, T, HV, BT] each (Akk float32, without beta)
    cu_seqlens, chunk_indices,        # varlen only
    T, NT,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BKS: tl.constexpr, BKD: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_QK_L2NORM: tl.constexpr, PREC: tl.constexpr,
):
    NC: tl.constexpr = BT // BC
    i_cs, i_hv = tl.program_id(0), tl.program_id(1)
    i_c, I = i_cs // NC, i_cs % NC
    _, i_t, bos, T_n = chunk_coords(i_c, cu_seqlens, chunk_indices, T, NT, IS_VARLEN)
    sub_block_scores(q, k, gP, rq, rk, Aqk, Akk, bos, i_t * BT, I, T_n, i_hv // (HV // H), i_hv, H, HV, K, BT, BC,
                     BKS, BKD, USE_QK_L2NORM, PREC)


@triton.jit
def load_A_block(Akk, b_beta, bos, t0, I: tl.constexpr, J: tl.constexpr, T_n, i_hv, HV: tl.constexpr,
                 BT: tl.constexpr, BC: tl.constexpr):
    """Block (I, J) of ``diag(beta) Akk``: [BC, BC] float32."""
    b_a = load_rows(Akk, bos, t0 + I * BC, T_n, i_hv, HV, BT, J * BC + tl.arange(0, BC), BC)
    return b_a * b_beta[:, None]


@triton.jit
def wy_factors(
    q, k, v, beta, gP, rq, rk, Akk, Tm, w, u, qg, kg, decay, i_c, bos, t0, T_n, i_h, i_hv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BKS: tl.constexpr, BV: tl.constexpr, USE_QK_L2NORM: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr,
    NEG_EIGVAL: tl.constexpr, PREC: tl.constexpr,
):
    """The inverse and the WY factors of the chunk at t0 (flat chunk index i_c) from its Akk rows in memory."""
    tl.static_assert(BT == 4 * BC)
    o_j = tl.arange(0, BC)

    # (I + diag(beta) Akk)^-1 by 16x16 blocks: Tm_II by substitution, Tm_IJ = -Tm_II sum_{J<=M<I} A_IM Tm_MJ.
    b_b0 = load_beta(beta, bos, t0, T_n, i_hv, HV, BC, USE_BETA_SIGMOID, NEG_EIGVAL)          # [BC]
    b_b1 = load_beta(beta, bos, t0 + BC, T_n, i_hv, HV, BC, USE_BETA_SIGMOID, NEG_EIGVAL)
    b_b2 = load_beta(beta, bos, t0 + 2 * BC, T_n, i_hv, HV, BC, USE_BETA_SIGMOID, NEG_EIGVAL)
    b_b3 = load_beta(beta, bos, t0 + 3 * BC, T_n, i_hv, HV, BC, USE_BETA_SIGMOID, NEG_EIGVAL)
    b_T00 = unit_lower_inverse(load_A_block(Akk, b_b0, bos, t0, 0, 0, T_n, i_hv, HV, BT, BC), BC)  # [BC, BC]
    b_T11 = unit_lower_inverse(load_A_block(Akk, b_b1, bos, t0, 1, 1, T_n, i_hv, HV, BT, BC), BC)
    b_T22 = unit_lower_inverse(load_A_block(Akk, b_b2, bos, t0, 2, 2, T_n, i_hv, HV, BT, BC), BC)
    b_T33 = unit_lower_inverse(load_A_block(Akk, b_b3, bos, t0, 3, 3, T_n, i_hv, HV, BT, BC), BC)
    b_A10 = load_A_block(Akk, b_b1, bos, t0, 1, 0, T_n, i_hv, HV, BT, BC)                        # [BC, BC]
    b_A20 = load_A_block(Akk, b_b2, bos, t0, 2, 0, T_n, i_hv, HV, BT, BC)
    b_A21 = load_A_block(Akk, b_b2, bos, t0, 2, 1, T_n, i_hv, HV, BT, BC)
    b_A30 = load_A_block(Akk, b_b3, bos, t0, 3, 0, T_n, i_hv, HV, BT, BC)
    b_A31 = load_A_block(Akk, b_b3, bos, t0, 3, 1, T_n, i_hv, HV, BT, BC)
    b_A32 = load_A_block(Akk, b_b3, bos, t0, 3, 2, T_n, i_hv, HV, BT, BC)
    # Small products of the inverse in full float32: its error feeds every w and u row.
    b_T10 = -mm(b_T11, mm(b_A10, b_T00, "ieee"), "ieee")
    b_T21 = -mm(b_T22, mm(b_A21, b_T11, "ieee"), "ieee")
    b_T20 = -mm(b_T22, mm(b_A20, b_T00, "ieee") + mm(b_A21, b_T10, "ieee"), "ieee")
    b_T32 = -mm(b_T33, mm(b_A32, b_T22, "ieee"), "ieee")
    b_T31 = -mm(b_T33, mm(b_A31, b_T11, "ieee") + mm(b_A32, b_T21, "ieee"), "ieee")
    b_T30 = -mm(b_T33, mm(b_A30, b_T00, "ieee") + mm(b_A31, b_T10, "ieee") + mm(b_A32, b_T20, "ieee"), "ieee")

    b_z = tl.zeros([BC, BC], dtype=tl.float32)
    store_rows(Tm, b_T00, bos, t0, T_n, i_hv, HV, BT, o_j, BC)
    store_rows(Tm, b_z, bos, t0, T_n, i_hv, HV, BT, BC + o_j, BC)
    store_rows(Tm, b_z, bos, t0, T_n, i_hv, HV, BT, 2 * BC + o_j, BC)
    store_rows(Tm, b_z, bos, t0, T_n, i_hv, HV, BT, 3 * BC + o_j, BC)
    store_rows(Tm, b_T10, bos, t0 + BC, T_n, i_hv, HV, BT, o_j, BC)
    store_rows(Tm, b_T11, bos, t0 + BC, T_n, i_hv, HV, BT, BC + o_j, BC)
    store_rows(Tm, b_z, bos, t0 + BC, T_n, i_hv, HV, BT, 2 * BC + o_j, BC)
    store_rows(Tm, b_z, bos, t0 + BC, T_n, i_hv, HV, BT, 3 * BC + o_j, BC)
    store_rows(Tm, b_T20, bos, t0 + 2 * BC, T_n, i_hv, HV, BT, o_j, BC)
    store_rows(Tm, b_T21, bos, t0 + 2 * BC, T_n, i_hv, HV, BT, BC + o_j, BC)
    store_rows(Tm, b_T22, bos, t0 + 2 * BC, T_n, i_hv, HV, BT, 2 * BC + o_j, BC)
    store_rows(Tm, b_z, bos, t0 + 2 * BC, T_n, i_hv, HV, BT, 3 * BC + o_j, BC)
    store_rows(Tm, b_T30, bos, t0 + 3 * BC, T_n, i_hv, HV, BT, o_j, BC)
    store_rows(Tm, b_T31, bos, t0 + 3 * BC, T_n, i_hv, HV, BT, BC + o_j, BC)
    store_rows(Tm, b_T32, bos, t0 + 3 * BC, T_n, i_hv, HV, BT, 2 * BC + o_j, BC)
    store_rows(Tm, b_T33, bos, t0 + 3 * BC, T_n, i_hv, HV, BT, 3 * BC + o_j, BC)
    # The same program reads the inverse back as one tile: make every thread's stores visible first.
    tl.debug_barrier()

    o_t = tl.arange(0, BT)
    b_T = load_rows(Tm, bos, t0, T_n, i_hv, HV, BT, o_t, BT)                  # [BT, BT]
    b_beta = load_beta(beta, bos, t0, T_n, i_hv, HV, BT, USE_BETA_SIGMOID, NEG_EIGVAL)   # [BT]
    b_rq, b_rk = load_norms(rq, rk, bos, t0, T_n, i_h, H, BT, USE_QK_L2NORM)             # [BT] x2
    for c0 in range(0, K, BKS):
        o_k = c0 + tl.arange(0, BKS)
        b_G, b_Gs, b_GC = chunk_gate_terms(gP, bos, t0, T_n, i_hv, HV, K, o_k, BT, BC)   # [BT, BKS] x2, [BKS]
        b_eG = tl.exp(b_G)
        b_k = load_rows(k, bos, t0, T_n, i_h, H, K, o_k, BT).to(tl.float32) * b_rk[:, None]   # [BT, BKS]
        b_q = load_rows(q, bos, t0, T_n, i_h, H, K, o_k, BT).to(tl.float32) * b_rq[:, None]   # [BT, BKS]
        store_rows(w, mm(b_T, b_k * b_eG * b_beta[:, None], PREC), bos, t0, T_n, i_hv, HV, K, o_k, BT)
        store_rows(qg, b_q * b_eG, bos, t0, T_n, i_hv, HV, K, o_k, BT)
        store_rows(kg, b_k * tl.exp(b_Gs), bos, t0, T_n, i_hv, HV, K, o_k, BT)
        tl.store(decay + (i_c.to(tl.int64) * HV + i_hv) * K + o_k, tl.exp(b_GC), mask=o_k < K)
    for c0 in range(0, V, BV):
        o_v = c0 + tl.arange(0, BV)
        b_v = load_rows(v, bos, t0, T_n, i_hv, HV, V, o_v, BT).to(tl.float32) * b_beta[:, None]  # [BT, BV]
        store_rows(u, mm(b_T, b_v, PREC), bos, t0, T_n, i_hv, HV, V, o_v, BT)


@triton.jit
def chunk_kda_fwd_wy_kernel(
    q, k, v, beta, gP, rq, rk, Akk,   # inputs (Akk from the scores kernel)
    Tm, w, u, qg, kg, decay,          # out: [B, T, HV, BT] f32; [B, T, HV, K|V] (storage dtype); [NT, HV, K] f32
    cu_seqlens, chunk_indices,
    T, NT,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BKS: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_QK_L2NORM: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr,
    NEG_EIGVAL: tl.constexpr, PREC: tl.constexpr,
):
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    _, i_t, bos, T_n = chunk_coords(i_c, cu_seqlens, chunk_indices, T, NT, IS_VARLEN)
    wy_factors(q, k, v, beta, gP, rq, rk, Akk, Tm, w, u, qg, kg, decay, i_c, bos, i_t * BT, T_n, i_hv // (HV // H),
               i_hv, H, HV, K, V, BT, BC, BKS, BV, USE_QK_L2NORM, USE_BETA_SIGMOID, NEG_EIGVAL, PREC)


@triton.jit
def chunk_kda_fwd_intra_kernel(
    q, k, v, beta, gP, rq, rk,        # inputs
    Aqk, Akk, Tm, w, u, qg, kg, decay,    # out: what the scores and the WY kernels write
    cu_seqlens, chunk_indices,
    T, NT,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    SBKS: tl.constexpr, BKD: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_QK_L2NORM: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr,
    NEG_EIGVAL: tl.constexpr, PREC: tl.constexpr,
):
    """The scores and WY kernels fused, one program per (chunk, value head) (``LaunchConfig(fuse_intra=True)``):
    one launch, and the chunk's q, k and gP read again from L1/L2 rather than from memory."""
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    _, i_t, bos, T_n = chunk_coords(i_c, cu_seqlens, chunk_indices, T, NT, IS_VARLEN)
    t0 = i_t * BT
    for I in range(0, BT // BC):
        sub_block_scores(q, k, gP, rq, rk, Aqk, Akk, bos, t0, I, T_n, i_h, i_hv, H, HV, K, BT, BC, SBKS, BKD,
                         USE_QK_L2NORM, PREC)
    # The WY part reads Akk rows other threads of this program stored: make them visible first.
    tl.debug_barrier()
    wy_factors(q, k, v, beta, gP, rq, rk, Akk, Tm, w, u, qg, kg, decay, i_c, bos, t0, T_n, i_h, i_hv, H, HV, K, V,
               BT, BC, BKS, BV, USE_QK_L2NORM, USE_BETA_SIGMOID, NEG_EIGVAL, PREC)
