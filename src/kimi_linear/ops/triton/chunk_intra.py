"""Chunk forward, part 1: everything inside one chunk of 64 tokens, all chunks in parallel (SPEC section 2).

One program takes one chunk of one value head and writes what the sequential part (chunk_scan.py) needs:

    qg   = q * exp(G)                  W = T (beta * k * exp(G))       decay = exp(G_C)       [BK]
    kend = k * exp(G_C - G)            U = T (beta * v)                Aqk[i, j] = sum_c q_ic k_jc exp(G_ic - G_jc)

with ``T = (I + A)^-1``, ``A[i, j] = beta_i sum_c k_ic k_jc exp(G_ic - G_jc)`` for j < i.

Numerics. The chunk is four sub-blocks of 16 rows. Every decay exponent is a plain sum of gates (all <= 0), never a
difference of two large prefix sums: per sub-block the inclusive prefix ``P`` (from the sub-block start through the
row), the exclusive suffix ``X`` (after the row through the sub-block end; a cumulative sum of the gate loaded one row
later) and the total. For rows i of sub-block I and columns j of an earlier sub-block J,
``G_i - G_j = P_i + (totals strictly between J and I) + X_j``: three non-positive terms, each factor <= 1, so a gate
of -1000 underflows to an exact 0 instead of overflowing. Only inside a 16-row diagonal block is ``P_i - P_j`` a
difference (of two sums over at most 16 steps), computed column by column.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .transforms import beta_transform, kda_gate


@triton.jit
def load_sub_block(
    q, k, g, beta, b_a, b_bias, lower_bound, bos, T_n, t0, i_h, i_hv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, USE_GATE: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
    USE_BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr,
):
    """Rows ``t0 .. t0 + BC`` of one sequence, transformed: q, k [BC, BK]; beta [BC]; the gate's inclusive
    prefix P and exclusive suffix X inside the sub-block [BC, BK]; its total [BK]; the inverse row norms of q and k
    [BC] (ones without l2norm). Rows past T_n are zero."""
    o_r = tl.arange(0, BC)
    o_i = t0 + o_r                                                   # rows within the sequence
    o_k = tl.arange(0, BK)
    m_i, m_k = o_i < T_n, o_k < K
    m = m_i[:, None] & m_k[None, :]
    o_qk = ((bos + o_i) * H + i_h)[:, None] * K + o_k[None, :]
    o_g = ((bos + o_i) * HV + i_hv)[:, None] * K + o_k[None, :]
    b_q = tl.load(q + o_qk, mask=m, other=0.0).to(tl.float32)        # [BC, BK]
    b_k = tl.load(k + o_qk, mask=m, other=0.0).to(tl.float32)        # [BC, BK]
    b_g = tl.load(g + o_g, mask=m, other=0.0).to(tl.float32)         # [BC, BK]
    # The gate one row later (within this sub-block): its reversed cumsum is the exclusive suffix, a plain sum.
    m_x = (m_i & (o_i + 1 < T_n) & (o_r < BC - 1))[:, None] & m_k[None, :]
    b_gx = tl.load(g + o_g + HV * K, mask=m_x, other=0.0).to(tl.float32)  # [BC, BK]
    if USE_GATE:
        b_g = kda_gate(b_g, b_bias[None, :], b_a, lower_bound, USE_LOWER_BOUND)
        b_gx = kda_gate(b_gx, b_bias[None, :], b_a, lower_bound, USE_LOWER_BOUND)
    b_g = tl.where(m, b_g, 0.0)
    b_gx = tl.where(m_x, b_gx, 0.0)
    b_rq = tl.full([BC], 1.0, dtype=tl.float32)                      # [BC] inverse row norms (l2norm)
    b_rk = tl.full([BC], 1.0, dtype=tl.float32)
    if USE_QK_L2NORM:
        b_rq = tl.rsqrt(tl.sum(b_q * b_q, 1) + 1e-6)
        b_rk = tl.rsqrt(tl.sum(b_k * b_k, 1) + 1e-6)
        b_q = b_q * b_rq[:, None]
        b_k = b_k * b_rk[:, None]
    b_beta = tl.load(beta + (bos + o_i) * HV + i_hv, mask=m_i, other=0.0).to(tl.float32)  # [BC]
    b_beta = tl.where(m_i, beta_transform(b_beta, USE_BETA_SIGMOID, NEG_EIGVAL), 0.0)
    b_P = tl.cumsum(b_g, 0)                                          # [BC, BK]
    b_X = tl.cumsum(b_gx, 0, reverse=True)                           # [BC, BK]
    return b_q, b_k, b_beta, b_P, b_X, tl.sum(b_g, 0), b_rq, b_rk


@triton.jit
def diagonal_scores(b_q, b_k, b_P, BC: tl.constexpr):
    """Inside one sub-block: Aqk [BC, BC] (j <= i) and Akk (j < i), one column at a time so that the decay
    ``exp(P_i - P_j)`` is only formed where i >= j (at most 1)."""
    o_i = tl.arange(0, BC)
    b_Aqk = tl.zeros([BC, BC], dtype=tl.float32)
    b_Akk = tl.zeros([BC, BC], dtype=tl.float32)
    for j in range(0, BC):
        m_j = (o_i == j)[:, None]
        b_kj = tl.sum(tl.where(m_j, b_k, 0.0), 0)                    # [BK] row j of k
        b_Pj = tl.sum(tl.where(m_j, b_P, 0.0), 0)                    # [BK]
        m_low = (o_i >= j)[:, None]
        b_f = tl.where(m_low, tl.exp(tl.where(m_low, b_P - b_Pj[None, :], 0.0)), 0.0)  # [BC, BK]
        b_kf = b_kj[None, :] * b_f
        b_sq = tl.sum(b_q * b_kf, 1)                                 # [BC] column j of Aqk
        b_sk = tl.sum(b_k * b_kf, 1)                                 # [BC] column j of Akk
        m_col = (o_i == j)[None, :]
        b_Aqk += tl.where(m_col & m_low, b_sq[:, None], 0.0)
        b_Akk += tl.where(m_col & (o_i > j)[:, None], b_sk[:, None], 0.0)
    return b_Aqk, b_Akk


@triton.jit
def diagonal_scores_sliced(
    q, k, g, dt_bias, b_a, lower_bound, b_rq, b_rk, bos, T_n, t0, i_h, i_hv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, BKS: tl.constexpr,
    USE_GATE: tl.constexpr, USE_LOWER_BOUND: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
):
    """:func:`diagonal_scores` without the column loop: all (i, j) pairs at once as a [BC, BC, BKS] block, over
    slices of BKS key channels reloaded from memory (the gate's prefix sums are per channel, so a slice needs only
    its own channels; l2norm comes in as the row factors b_rq, b_rk)."""
    o_r = tl.arange(0, BC)
    o_i = t0 + o_r
    m_i = o_i < T_n
    m_low = (o_r[:, None] >= o_r[None, :])[:, :, None]               # [BC, BC, 1]
    b_Aqk = tl.zeros([BC, BC], dtype=tl.float32)
    b_Akk = tl.zeros([BC, BC], dtype=tl.float32)
    for c0 in range(0, K, BKS):
        o_k = c0 + tl.arange(0, BKS)
        m_k = o_k < K
        m = m_i[:, None] & m_k[None, :]
        o_qk = ((bos + o_i) * H + i_h)[:, None] * K + o_k[None, :]
        b_q = tl.load(q + o_qk, mask=m, other=0.0).to(tl.float32) * b_rq[:, None]     # [BC, BKS]
        b_k = tl.load(k + o_qk, mask=m, other=0.0).to(tl.float32) * b_rk[:, None]     # [BC, BKS]
        b_g = tl.load(g + ((bos + o_i) * HV + i_hv)[:, None] * K + o_k[None, :], mask=m, other=0.0).to(tl.float32)
        if USE_GATE:
            b_bias = tl.zeros([BKS], dtype=tl.float32)
            if HAS_DT_BIAS:
                b_bias += tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_g = kda_gate(b_g, b_bias[None, :], b_a, lower_bound, USE_LOWER_BOUND)
        b_P = tl.cumsum(tl.where(m, b_g, 0.0), 0)                    # [BC, BKS]
        b_d = b_P[:, None, :] - b_P[None, :, :]                       # [BC, BC, BKS] P_i - P_j
        b_kf = tl.where(m_low, tl.exp(tl.where(m_low, b_d, 0.0)), 0.0) * b_k[None, :, :]
        b_Aqk += tl.sum(b_q[:, None, :] * b_kf, 2)
        b_Akk += tl.sum(b_k[:, None, :] * b_kf, 2)
    return b_Aqk, tl.where(o_r[:, None] > o_r[None, :], b_Akk, 0.0)


@triton.jit
def unit_lower_inverse(b_A, BC: tl.constexpr):
    """``(I + A)^-1`` of a strictly lower triangular [BC, BC] block, by forward substitution row by row."""
    o_i = tl.arange(0, BC)
    b_T = tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0)           # [BC, BC]
    for i in range(1, BC):
        m_i = (o_i == i)[:, None]
        b_a = tl.sum(tl.where(m_i, b_A, 0.0), 0)                     # [BC] row i of A
        b_row = -tl.sum(b_a[:, None] * b_T, 0)                       # -sum_m A[i, m] T[m, :]
        b_T = tl.where(m_i, b_row[None, :] + tl.where(o_i == i, 1.0, 0.0)[None, :], b_T)
    return b_T


@triton.jit
def cross_scores(b_qP, b_kP, b_k, b_X, b_between, b_beta, PREC: tl.constexpr):
    """Scores between rows of sub-block I (left factors q exp(P), k exp(P)) and columns of an earlier sub-block J
    (k_J, its exclusive suffix X_J, and the totals strictly between them): (Aqk, beta * Akk) [BC, BC]."""
    b_r = b_k * tl.exp(b_X + b_between[None, :])                     # [BC, BK] k_j exp(G_s - G_j), s = I's start
    b_rt = tl.trans(b_r)
    b_Aqk = tl.dot(b_qP, b_rt, input_precision=PREC)
    b_Akk = tl.dot(b_kP, b_rt, input_precision=PREC) * b_beta[:, None]
    return b_Aqk, b_Akk


@triton.jit
def mm(b_a, b_b, PREC: tl.constexpr):
    return tl.dot(b_a, b_b, input_precision=PREC)


@triton.jit
def store_rows(p, b_x, bos, T_n, t0, i_hv, HV: tl.constexpr, W: tl.constexpr, c0, BC: tl.constexpr,
               BW: tl.constexpr):
    """Store b_x [BC, BW] into rows t0.. of a [*, HV, W] tensor, columns c0.. (rows past T_n skipped)."""
    o_i = t0 + tl.arange(0, BC)
    o_c = c0 + tl.arange(0, BW)
    m = (o_i < T_n)[:, None] & (o_c < W)[None, :]
    tl.store(p + ((bos + o_i) * HV + i_hv)[:, None] * W + o_c[None, :], b_x.to(p.dtype.element_ty), mask=m)


@triton.jit
def load_v(v, bos, T_n, t0, i_hv, c0, HV: tl.constexpr, V: tl.constexpr, BC: tl.constexpr, BV: tl.constexpr):
    o_i = t0 + tl.arange(0, BC)
    o_v = c0 + tl.arange(0, BV)
    m = (o_i < T_n)[:, None] & (o_v < V)[None, :]
    return tl.load(v + ((bos + o_i) * HV + i_hv)[:, None] * V + o_v[None, :], mask=m, other=0.0).to(tl.float32)


@triton.jit
def chunk_kda_fwd_intra_kernel(
    q, k, v, g, beta,                 # inputs: [B, T, H, K] x2, [B, T, HV, V], [B, T, HV, K], [B, T, HV]
    A_log, dt_bias,                   # [HV], [HV, K] (in-kernel gate only)
    cu_seqlens, chunk_indices,        # [N + 1], [NT, 2] (sequence, chunk within it); varlen only
    qg, kend, w, u, Aqk, decay,       # outputs: [B, T, HV, K] x3, [B, T, HV, V], [B, T, HV, BT], [NT, HV, K]
    lower_bound, T, NT,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_QK_L2NORM: tl.constexpr, USE_GATE: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr, HAS_DT_BIAS: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr,
    NEG_EIGVAL: tl.constexpr, PREC: tl.constexpr, DIAG_BKS: tl.constexpr,
):
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_c * 2).to(tl.int64)
        i_t = tl.load(chunk_indices + i_c * 2 + 1)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T_n = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    else:
        i_n = (i_c // NT).to(tl.int64)
        i_t = i_c % NT
        bos = i_n * T
        T_n = T
    t0 = i_t * BT
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    b_a = 1.0
    b_bias = tl.zeros([BK], dtype=tl.float32)
    if USE_GATE:
        b_a = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        if HAS_DT_BIAS:
            b_bias += tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.0).to(tl.float32)

    b_q0, b_k0, b_b0, b_P0, b_X0, b_s0, b_rq0, b_rk0 = load_sub_block(
        q, k, g, beta, b_a, b_bias, lower_bound, bos, T_n, t0, i_h, i_hv, H, HV, K, BK, BC,
        USE_QK_L2NORM, USE_GATE, USE_LOWER_BOUND, USE_BETA_SIGMOID, NEG_EIGVAL)
    b_q1, b_k1, b_b1, b_P1, b_X1, b_s1, b_rq1, b_rk1 = load_sub_block(
        q, k, g, beta, b_a, b_bias, lower_bound, bos, T_n, t0 + BC, i_h, i_hv, H, HV, K, BK, BC,
        USE_QK_L2NORM, USE_GATE, USE_LOWER_BOUND, USE_BETA_SIGMOID, NEG_EIGVAL)
    b_q2, b_k2, b_b2, b_P2, b_X2, b_s2, b_rq2, b_rk2 = load_sub_block(
        q, k, g, beta, b_a, b_bias, lower_bound, bos, T_n, t0 + 2 * BC, i_h, i_hv, H, HV, K, BK, BC,
        USE_QK_L2NORM, USE_GATE, USE_LOWER_BOUND, USE_BETA_SIGMOID, NEG_EIGVAL)
    b_q3, b_k3, b_b3, b_P3, b_X3, b_s3, b_rq3, b_rk3 = load_sub_block(
        q, k, g, beta, b_a, b_bias, lower_bound, bos, T_n, t0 + 3 * BC, i_h, i_hv, H, HV, K, BK, BC,
        USE_QK_L2NORM, USE_GATE, USE_LOWER_BOUND, USE_BETA_SIGMOID, NEG_EIGVAL)

    # Chunk decay and, per sub-block, the gate sums before it (chunk prefix) and after it (to the chunk end).
    b_s12 = b_s1 + b_s2
    b_s23 = b_s2 + b_s3
    b_s012 = b_s0 + b_s12
    tl.store(decay + (i_c * HV + i_hv) * K + o_k, tl.exp(b_s012 + b_s3), mask=m_k)

    # Diagonal blocks.
    if DIAG_BKS > 0:
        b_Aqk00, b_Akk00 = diagonal_scores_sliced(
            q, k, g, dt_bias, b_a, lower_bound, b_rq0, b_rk0, bos, T_n, t0, i_h, i_hv, H, HV, K, BC, DIAG_BKS,
            USE_GATE, USE_LOWER_BOUND, HAS_DT_BIAS)
        b_Aqk11, b_Akk11 = diagonal_scores_sliced(
            q, k, g, dt_bias, b_a, lower_bound, b_rq1, b_rk1, bos, T_n, t0 + BC, i_h, i_hv, H, HV, K, BC, DIAG_BKS,
            USE_GATE, USE_LOWER_BOUND, HAS_DT_BIAS)
        b_Aqk22, b_Akk22 = diagonal_scores_sliced(
            q, k, g, dt_bias, b_a, lower_bound, b_rq2, b_rk2, bos, T_n, t0 + 2 * BC, i_h, i_hv, H, HV, K, BC,
            DIAG_BKS, USE_GATE, USE_LOWER_BOUND, HAS_DT_BIAS)
        b_Aqk33, b_Akk33 = diagonal_scores_sliced(
            q, k, g, dt_bias, b_a, lower_bound, b_rq3, b_rk3, bos, T_n, t0 + 3 * BC, i_h, i_hv, H, HV, K, BC,
            DIAG_BKS, USE_GATE, USE_LOWER_BOUND, HAS_DT_BIAS)
    else:
        b_Aqk00, b_Akk00 = diagonal_scores(b_q0, b_k0, b_P0, BC)
        b_Aqk11, b_Akk11 = diagonal_scores(b_q1, b_k1, b_P1, BC)
        b_Aqk22, b_Akk22 = diagonal_scores(b_q2, b_k2, b_P2, BC)
        b_Aqk33, b_Akk33 = diagonal_scores(b_q3, b_k3, b_P3, BC)

    # Off-diagonal blocks through the sub-block boundaries.
    zero = tl.zeros([BK], dtype=tl.float32)
    b_e1 = tl.exp(b_P1)
    b_e2 = tl.exp(b_P2)
    b_e3 = tl.exp(b_P3)
    b_qP1, b_kP1 = b_q1 * b_e1, b_k1 * b_e1
    b_qP2, b_kP2 = b_q2 * b_e2, b_k2 * b_e2
    b_qP3, b_kP3 = b_q3 * b_e3, b_k3 * b_e3
    b_Aqk10, b_Akk10 = cross_scores(b_qP1, b_kP1, b_k0, b_X0, zero, b_b1, PREC)
    b_Aqk20, b_Akk20 = cross_scores(b_qP2, b_kP2, b_k0, b_X0, b_s1, b_b2, PREC)
    b_Aqk21, b_Akk21 = cross_scores(b_qP2, b_kP2, b_k1, b_X1, zero, b_b2, PREC)
    b_Aqk30, b_Akk30 = cross_scores(b_qP3, b_kP3, b_k0, b_X0, b_s12, b_b3, PREC)
    b_Aqk31, b_Akk31 = cross_scores(b_qP3, b_kP3, b_k1, b_X1, b_s2, b_b3, PREC)
    b_Aqk32, b_Akk32 = cross_scores(b_qP3, b_kP3, b_k2, b_X2, zero, b_b3, PREC)

    # Aqk rows, blocks above the diagonal stored as zeros (the scan reads full [BT, BT] tiles).
    b_z = tl.zeros([BC, BC], dtype=tl.float32)
    store_rows(Aqk, b_Aqk00, bos, T_n, t0, i_hv, HV, BT, 0, BC, BC)
    store_rows(Aqk, b_z, bos, T_n, t0, i_hv, HV, BT, BC, BC, BC)
    store_rows(Aqk, b_z, bos, T_n, t0, i_hv, HV, BT, 2 * BC, BC, BC)
    store_rows(Aqk, b_z, bos, T_n, t0, i_hv, HV, BT, 3 * BC, BC, BC)
    store_rows(Aqk, b_Aqk10, bos, T_n, t0 + BC, i_hv, HV, BT, 0, BC, BC)
    store_rows(Aqk, b_Aqk11, bos, T_n, t0 + BC, i_hv, HV, BT, BC, BC, BC)
    store_rows(Aqk, b_z, bos, T_n, t0 + BC, i_hv, HV, BT, 2 * BC, BC, BC)
    store_rows(Aqk, b_z, bos, T_n, t0 + BC, i_hv, HV, BT, 3 * BC, BC, BC)
    store_rows(Aqk, b_Aqk20, bos, T_n, t0 + 2 * BC, i_hv, HV, BT, 0, BC, BC)
    store_rows(Aqk, b_Aqk21, bos, T_n, t0 + 2 * BC, i_hv, HV, BT, BC, BC, BC)
    store_rows(Aqk, b_Aqk22, bos, T_n, t0 + 2 * BC, i_hv, HV, BT, 2 * BC, BC, BC)
    store_rows(Aqk, b_z, bos, T_n, t0 + 2 * BC, i_hv, HV, BT, 3 * BC, BC, BC)
    store_rows(Aqk, b_Aqk30, bos, T_n, t0 + 3 * BC, i_hv, HV, BT, 0, BC, BC)
    store_rows(Aqk, b_Aqk31, bos, T_n, t0 + 3 * BC, i_hv, HV, BT, BC, BC, BC)
    store_rows(Aqk, b_Aqk32, bos, T_n, t0 + 3 * BC, i_hv, HV, BT, 2 * BC, BC, BC)
    store_rows(Aqk, b_Aqk33, bos, T_n, t0 + 3 * BC, i_hv, HV, BT, 3 * BC, BC, BC)

    # q exp(G) and k exp(G_C - G) per sub-block; k exp(G) (times beta) feeds W below.
    b_G = b_P0
    store_rows(qg, b_q0 * tl.exp(b_G), bos, T_n, t0, i_hv, HV, K, 0, BC, BK)
    b_kb0 = b_k0 * tl.exp(b_G) * b_b0[:, None]
    store_rows(kend, b_k0 * tl.exp(b_X0 + (b_s12 + b_s3)[None, :]), bos, T_n, t0, i_hv, HV, K, 0, BC, BK)
    b_G = b_P1 + b_s0[None, :]
    store_rows(qg, b_q1 * tl.exp(b_G), bos, T_n, t0 + BC, i_hv, HV, K, 0, BC, BK)
    b_kb1 = b_k1 * tl.exp(b_G) * b_b1[:, None]
    store_rows(kend, b_k1 * tl.exp(b_X1 + b_s23[None, :]), bos, T_n, t0 + BC, i_hv, HV, K, 0, BC, BK)
    b_G = b_P2 + (b_s0 + b_s1)[None, :]
    store_rows(qg, b_q2 * tl.exp(b_G), bos, T_n, t0 + 2 * BC, i_hv, HV, K, 0, BC, BK)
    b_kb2 = b_k2 * tl.exp(b_G) * b_b2[:, None]
    store_rows(kend, b_k2 * tl.exp(b_X2 + b_s3[None, :]), bos, T_n, t0 + 2 * BC, i_hv, HV, K, 0, BC, BK)
    b_G = b_P3 + b_s012[None, :]
    store_rows(qg, b_q3 * tl.exp(b_G), bos, T_n, t0 + 3 * BC, i_hv, HV, K, 0, BC, BK)
    b_kb3 = b_k3 * tl.exp(b_G) * b_b3[:, None]
    store_rows(kend, b_k3 * tl.exp(b_X3), bos, T_n, t0 + 3 * BC, i_hv, HV, K, 0, BC, BK)

    # T = (I + A)^-1 by blocks: diagonal blocks by substitution, then T_IJ = -T_II sum_{J<=M<I} A_IM T_MJ.
    b_T00 = unit_lower_inverse(b_Akk00 * b_b0[:, None], BC)
    b_T11 = unit_lower_inverse(b_Akk11 * b_b1[:, None], BC)
    b_T22 = unit_lower_inverse(b_Akk22 * b_b2[:, None], BC)
    b_T33 = unit_lower_inverse(b_Akk33 * b_b3[:, None], BC)
    b_T10 = -mm(b_T11, mm(b_Akk10, b_T00, "ieee"), "ieee")
    b_T21 = -mm(b_T22, mm(b_Akk21, b_T11, "ieee"), "ieee")
    b_T20 = -mm(b_T22, mm(b_Akk20, b_T00, "ieee") + mm(b_Akk21, b_T10, "ieee"), "ieee")
    b_T32 = -mm(b_T33, mm(b_Akk32, b_T22, "ieee"), "ieee")
    b_T31 = -mm(b_T33, mm(b_Akk31, b_T11, "ieee") + mm(b_Akk32, b_T21, "ieee"), "ieee")
    b_T30 = -mm(b_T33, mm(b_Akk30, b_T00, "ieee") + mm(b_Akk31, b_T10, "ieee") + mm(b_Akk32, b_T20, "ieee"),
                "ieee")

    # W = T (beta k exp(G)).
    store_rows(w, mm(b_T00, b_kb0, PREC), bos, T_n, t0, i_hv, HV, K, 0, BC, BK)
    store_rows(w, mm(b_T10, b_kb0, PREC) + mm(b_T11, b_kb1, PREC), bos, T_n, t0 + BC, i_hv, HV, K, 0, BC, BK)
    store_rows(w, mm(b_T20, b_kb0, PREC) + mm(b_T21, b_kb1, PREC) + mm(b_T22, b_kb2, PREC),
               bos, T_n, t0 + 2 * BC, i_hv, HV, K, 0, BC, BK)
    store_rows(w, mm(b_T30, b_kb0, PREC) + mm(b_T31, b_kb1, PREC) + mm(b_T32, b_kb2, PREC)
               + mm(b_T33, b_kb3, PREC), bos, T_n, t0 + 3 * BC, i_hv, HV, K, 0, BC, BK)

    # U = T (beta v), one block of value columns at a time.
    for c0 in range(0, V, BV):
        b_v0 = load_v(v, bos, T_n, t0, i_hv, c0, HV, V, BC, BV) * b_b0[:, None]
        b_v1 = load_v(v, bos, T_n, t0 + BC, i_hv, c0, HV, V, BC, BV) * b_b1[:, None]
        b_v2 = load_v(v, bos, T_n, t0 + 2 * BC, i_hv, c0, HV, V, BC, BV) * b_b2[:, None]
        b_v3 = load_v(v, bos, T_n, t0 + 3 * BC, i_hv, c0, HV, V, BC, BV) * b_b3[:, None]
        store_rows(u, mm(b_T00, b_v0, PREC), bos, T_n, t0, i_hv, HV, V, c0, BC, BV)
        store_rows(u, mm(b_T10, b_v0, PREC) + mm(b_T11, b_v1, PREC), bos, T_n, t0 + BC, i_hv, HV, V, c0, BC, BV)
        store_rows(u, mm(b_T20, b_v0, PREC) + mm(b_T21, b_v1, PREC) + mm(b_T22, b_v2, PREC),
                   bos, T_n, t0 + 2 * BC, i_hv, HV, V, c0, BC, BV)
        store_rows(u, mm(b_T30, b_v0, PREC) + mm(b_T31, b_v1, PREC) + mm(b_T32, b_v2, PREC)
                   + mm(b_T33, b_v3, PREC), bos, T_n, t0 + 3 * BC, i_hv, HV, V, c0, BC, BV)
