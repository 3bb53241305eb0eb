"""Chunk forward, part 1 split in two kernels with one 16-row sub-block live at a time (not yet the default).

The fused intra kernel (chunk_intra.py) keeps q, k and the gate sums of all four sub-blocks of a chunk in registers
at once and spills heavily (ptxas for sm_90: a 4.4 KB stack per thread). Here:

- :func:`chunk_kda_fwd_scores_kernel` walks the row sub-blocks I = 0..3 of a chunk; for each it computes and
  stores qg, kend, beta * k * exp(G) (into ``w``, as scratch), the diagonal block and, reloading each earlier column
  sub-block J from memory (L2), the blocks (I, J) of Aqk and of Akk (into a scratch ``Akk``).
- :func:`chunk_kda_fwd_wy_kernel` inverts ``I + Akk`` by blocks and writes ``W = T (beta k exp(G))`` over the
  scratch (row sub-blocks in descending order, so every input row is read before it is overwritten) and
  ``U = T (beta v)``.

Same numerics and outputs as the fused kernel (see chunk_intra.py); the scan (chunk_scan.py) is unchanged.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .chunk_intra import (
    cross_scores,
    diagonal_scores_sliced,
    load_sub_block,
    load_v,
    mm,
    store_rows,
    unit_lower_inverse,
)
from .transforms import beta_transform, kda_gate


@triton.jit
def block_sum(b_s0, b_s1, b_s2, b_s3, LO: tl.constexpr, HI: tl.constexpr):
    """Sum of the sub-block gate totals s_m for LO <= m < HI (a plain sum: no cancellation)."""
    b_x = tl.zeros_like(b_s0)
    if LO <= 0:
        if HI > 0:
            b_x += b_s0
    if LO <= 1:
        if HI > 1:
            b_x += b_s1
    if LO <= 2:
        if HI > 2:
            b_x += b_s2
    if LO <= 3:
        if HI > 3:
            b_x += b_s3
    return b_x


@triton.jit
def sub_block_total(g, b_a, b_bias, lower_bound, bos, T_n, t0, i_hv,
                    HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr,
                    USE_GATE: tl.constexpr, USE_LOWER_BOUND: tl.constexpr):
    """Sum of the (transformed) gate over rows t0 .. t0 + BC of the sequence: [BK]."""
    o_i = t0 + tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    m = (o_i < T_n)[:, None] & (o_k < K)[None, :]
    b_g = tl.load(g + ((bos + o_i) * HV + i_hv)[:, None] * K + o_k[None, :], mask=m, other=0.0).to(tl.float32)
    if USE_GATE:
        b_g = kda_gate(b_g, b_bias[None, :], b_a, lower_bound, USE_LOWER_BOUND)
    return tl.sum(tl.where(m, b_g, 0.0), 0)


@triton.jit
def chunk_kda_fwd_scores_kernel(
    q, k, g, beta,                    # [B, T, H, K] x2, [B, T, HV, K], [B, T, HV]
    A_log, dt_bias,                   # [HV], [HV, K] (in-kernel gate only)
    cu_seqlens, chunk_indices,        # varlen only
    qg, kend, kgb, Aqk, Akk, decay,   # [B, T, HV, K] x3, [B, T, HV, BT] x2, [NT, HV, K]
    lower_bound, T, NT,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, DIAG_BKS: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_QK_L2NORM: tl.constexpr, USE_GATE: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr, HAS_DT_BIAS: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr,
    NEG_EIGVAL: tl.constexpr, PREC: tl.constexpr,
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

    b_s0 = sub_block_total(g, b_a, b_bias, lower_bound, bos, T_n, t0, i_hv, HV, K, BK, BC, USE_GATE, USE_LOWER_BOUND)
    b_s1 = sub_block_total(g, b_a, b_bias, lower_bound, bos, T_n, t0 + BC, i_hv, HV, K, BK, BC, USE_GATE,
                           USE_LOWER_BOUND)
    b_s2 = sub_block_total(g, b_a, b_bias, lower_bound, bos, T_n, t0 + 2 * BC, i_hv, HV, K, BK, BC, USE_GATE,
                           USE_LOWER_BOUND)
    b_s3 = sub_block_total(g, b_a, b_bias, lower_bound, bos, T_n, t0 + 3 * BC, i_hv, HV, K, BK, BC, USE_GATE,
                           USE_LOWER_BOUND)
    tl.store(decay + (i_c * HV + i_hv) * K + o_k, tl.exp(b_s0 + b_s1 + b_s2 + b_s3), mask=m_k)
    b_z = tl.zeros([BC, BC], dtype=tl.float32)

    for I in tl.static_range(4):
        tI = t0 + I * BC
        b_q, b_k, b_b, b_P, b_X, b_s, b_rq, b_rk = load_sub_block(
            q, k, g, beta, b_a, b_bias, lower_bound, bos, T_n, tI, i_h, i_hv, H, HV, K, BK, BC,
            USE_QK_L2NORM, USE_GATE, USE_LOWER_BOUND, USE_BETA_SIGMOID, NEG_EIGVAL)
        b_G = b_P + block_sum(b_s0, b_s1, b_s2, b_s3, 0, I)[None, :]        # [BC, BK] chunk prefix
        b_eG = tl.exp(b_G)
        store_rows(qg, b_q * b_eG, bos, T_n, tI, i_hv, HV, K, 0, BC, BK)
        store_rows(kgb, b_k * b_eG * b_b[:, None], bos, T_n, tI, i_hv, HV, K, 0, BC, BK)
        b_after = block_sum(b_s0, b_s1, b_s2, b_s3, I + 1, 4)
        store_rows(kend, b_k * tl.exp(b_X + b_after[None, :]), bos, T_n, tI, i_hv, HV, K, 0, BC, BK)

        b_Aqk_d, b_Akk_d = diagonal_scores_sliced(
            q, k, g, dt_bias, b_a, lower_bound, b_rq, b_rk, bos, T_n, tI, i_h, i_hv, H, HV, K, BC, DIAG_BKS,
            USE_GATE, USE_LOWER_BOUND, HAS_DT_BIAS)
        store_rows(Aqk, b_Aqk_d, bos, T_n, tI, i_hv, HV, BT, I * BC, BC, BC)
        store_rows(Akk, b_Akk_d * b_b[:, None], bos, T_n, tI, i_hv, HV, BT, I * BC, BC, BC)
        for J in tl.static_range(I + 1, 4):
            store_rows(Aqk, b_z, bos, T_n, tI, i_hv, HV, BT, J * BC, BC, BC)
            store_rows(Akk, b_z, bos, T_n, tI, i_hv, HV, BT, J * BC, BC, BC)

        b_eP = tl.exp(b_P)
        b_qP = b_q * b_eP
        b_kP = b_k * b_eP
        for J in tl.static_range(0, I):
            _, b_kJ, _, _, b_XJ, _, _, _ = load_sub_block(
                q, k, g, beta, b_a, b_bias, lower_bound, bos, T_n, t0 + J * BC, i_h, i_hv, H, HV, K, BK, BC,
                USE_QK_L2NORM, USE_GATE, USE_LOWER_BOUND, USE_BETA_SIGMOID, NEG_EIGVAL)
            b_between = block_sum(b_s0, b_s1, b_s2, b_s3, J + 1, I)
            b_Aqk_o, b_Akk_o = cross_scores(b_qP, b_kP, b_kJ, b_XJ, b_between, b_b, PREC)
            store_rows(Aqk, b_Aqk_o, bos, T_n, tI, i_hv, HV, BT, J * BC, BC, BC)
            store_rows(Akk, b_Akk_o, bos, T_n, tI, i_hv, HV, BT, J * BC, BC, BC)


@triton.jit
def load_block(p, bos, T_n, r0, c0, i_hv, HV: tl.constexpr, W: tl.constexpr, BR: tl.constexpr, BW: tl.constexpr):
    """Rows r0 .. r0 + BR, columns c0 .. c0 + BW of a [*, HV, W] tensor as float32 (zero past T_n or W)."""
    o_i = r0 + tl.arange(0, BR)
    o_c = c0 + tl.arange(0, BW)
    m = (o_i < T_n)[:, None] & (o_c < W)[None, :]
    return tl.load(p + ((bos + o_i) * HV + i_hv)[:, None] * W + o_c[None, :], mask=m, other=0.0).to(tl.float32)


@triton.jit
def chunk_kda_fwd_wy_kernel(
    v, beta, Akk, w, u,               # [B, T, HV, V], [B, T, HV], [B, T, HV, BT], [B, T, HV, K] (in: beta k exp(G);
    cu_seqlens, chunk_indices,        # out: W), [B, T, HV, V] out
    T, NT,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr, PREC: tl.constexpr,
):
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
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

    # T = (I + A)^-1 by blocks (A = Akk already carries beta on its rows).
    b_T00 = unit_lower_inverse(load_block(Akk, bos, T_n, t0, 0, i_hv, HV, BT, BC, BC), BC)
    b_T11 = unit_lower_inverse(load_block(Akk, bos, T_n, t0 + BC, BC, i_hv, HV, BT, BC, BC), BC)
    b_T22 = unit_lower_inverse(load_block(Akk, bos, T_n, t0 + 2 * BC, 2 * BC, i_hv, HV, BT, BC, BC), BC)
    b_T33 = unit_lower_inverse(load_block(Akk, bos, T_n, t0 + 3 * BC, 3 * BC, i_hv, HV, BT, BC, BC), BC)
    b_A10 = load_block(Akk, bos, T_n, t0 + BC, 0, i_hv, HV, BT, BC, BC)
    b_A20 = load_block(Akk, bos, T_n, t0 + 2 * BC, 0, i_hv, HV, BT, BC, BC)
    b_A21 = load_block(Akk, bos, T_n, t0 + 2 * BC, BC, i_hv, HV, BT, BC, BC)
    b_A30 = load_block(Akk, bos, T_n, t0 + 3 * BC, 0, i_hv, HV, BT, BC, BC)
    b_A31 = load_block(Akk, bos, T_n, t0 + 3 * BC, BC, i_hv, HV, BT, BC, BC)
    b_A32 = load_block(Akk, bos, T_n, t0 + 3 * BC, 2 * BC, i_hv, HV, BT, BC, BC)
    b_T10 = -mm(b_T11, mm(b_A10, b_T00, "ieee"), "ieee")
    b_T21 = -mm(b_T22, mm(b_A21, b_T11, "ieee"), "ieee")
    b_T20 = -mm(b_T22, mm(b_A20, b_T00, "ieee") + mm(b_A21, b_T10, "ieee"), "ieee")
    b_T32 = -mm(b_T33, mm(b_A32, b_T22, "ieee"), "ieee")
    b_T31 = -mm(b_T33, mm(b_A31, b_T11, "ieee") + mm(b_A32, b_T21, "ieee"), "ieee")
    b_T30 = -mm(b_T33, mm(b_A30, b_T00, "ieee") + mm(b_A31, b_T10, "ieee") + mm(b_A32, b_T20, "ieee"), "ieee")

    # W over its own input, last row block first: W_I reads input rows J <= I only.
    b_w = mm(b_T30, load_block(w, bos, T_n, t0, 0, i_hv, HV, K, BC, BK), PREC)
    b_w += mm(b_T31, load_block(w, bos, T_n, t0 + BC, 0, i_hv, HV, K, BC, BK), PREC)
    b_w += mm(b_T32, load_block(w, bos, T_n, t0 + 2 * BC, 0, i_hv, HV, K, BC, BK), PREC)
    b_w += mm(b_T33, load_block(w, bos, T_n, t0 + 3 * BC, 0, i_hv, HV, K, BC, BK), PREC)
    tl.debug_barrier()
    store_rows(w, b_w, bos, T_n, t0 + 3 * BC, i_hv, HV, K, 0, BC, BK)
    b_w = mm(b_T20, load_block(w, bos, T_n, t0, 0, i_hv, HV, K, BC, BK), PREC)
    b_w += mm(b_T21, load_block(w, bos, T_n, t0 + BC, 0, i_hv, HV, K, BC, BK), PREC)
    b_w += mm(b_T22, load_block(w, bos, T_n, t0 + 2 * BC, 0, i_hv, HV, K, BC, BK), PREC)
    tl.debug_barrier()
    store_rows(w, b_w, bos, T_n, t0 + 2 * BC, i_hv, HV, K, 0, BC, BK)
    b_w = mm(b_T10, load_block(w, bos, T_n, t0, 0, i_hv, HV, K, BC, BK), PREC)
    b_w += mm(b_T11, load_block(w, bos, T_n, t0 + BC, 0, i_hv, HV, K, BC, BK), PREC)
    tl.debug_barrier()
    store_rows(w, b_w, bos, T_n, t0 + BC, i_hv, HV, K, 0, BC, BK)
    b_w = mm(b_T00, load_block(w, bos, T_n, t0, 0, i_hv, HV, K, BC, BK), PREC)
    tl.debug_barrier()
    store_rows(w, b_w, bos, T_n, t0, i_hv, HV, K, 0, BC, BK)

    # U = T (beta v), one block of value columns at a time.
    b_b0 = load_beta(beta, bos, T_n, t0, i_hv, HV, BC, USE_BETA_SIGMOID, NEG_EIGVAL)
    b_b1 = load_beta(beta, bos, T_n, t0 + BC, i_hv, HV, BC, USE_BETA_SIGMOID, NEG_EIGVAL)
    b_b2 = load_beta(beta, bos, T_n, t0 + 2 * BC, i_hv, HV, BC, USE_BETA_SIGMOID, NEG_EIGVAL)
    b_b3 = load_beta(beta, bos, T_n, t0 + 3 * BC, i_hv, HV, BC, USE_BETA_SIGMOID, NEG_EIGVAL)
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


@triton.jit
def load_beta(beta, bos, T_n, t0, i_hv, HV: tl.constexpr, BC: tl.constexpr, USE_SIGMOID: tl.constexpr,
              NEG_EIGVAL: tl.constexpr):
    """beta of rows t0 .. t0 + BC, transformed, zero past T_n: [BC]."""
    o_i = t0 + tl.arange(0, BC)
    m_i = o_i < T_n
    b_beta = tl.load(beta + (bos + o_i) * HV + i_hv, mask=m_i, other=0.0).to(tl.float32)
    return tl.where(m_i, beta_transform(b_beta, USE_SIGMOID, NEG_EIGVAL), 0.0)
