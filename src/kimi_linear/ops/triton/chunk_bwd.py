"""Chunk pipeline backward: the per-chunk kernels after the reverse state scan (chunk_state.py).

Per chunk n with start state S = h[n], the gradient dS' = dh[n] reaching the state after it, and (chunk_wy.py)
``qg = q exp(G)``, ``kg = k exp(G_C - G)``, ``Kb = beta k exp(G)``, ``w = Tm Kb``, ``u = Tm (beta v)``:

    o  = scale (qg S + Aqk vn)       vn = u - w S        S' = diag(exp(G_C)) S + kg^T vn

The reverse scan wrote dvn = scale Aqk^T do + kg dS'. Then, with ``hat`` the l2-normalised q/k:

- :func:`chunk_kda_bwd_inter_kernel` (chunk, key block, value head): the products with the states,
  ``dqg = scale do S^T``, ``dkg = vn dS'^T``, ``dw = -dvn S^T``, and through ``w = Tm Kb``: ``dKb = Tm^T dw``; it
  writes the parts of dq_hat, dk_hat and dG (the gradient of the chunk prefix G) these give, and per key block
  partial sums of dTm = dw Kb^T and of dbeta.
- :func:`chunk_kda_bwd_wy_kernel` (chunk, value head): ``dTm += du (beta v)^T`` with du = dvn, dv = beta Tm^T du,
  the inverse's gradient ``dA = -Tm^T dTm Tm^T`` (strictly lower), dbeta (then through the sigmoid), and
  dAqk = scale do vn^T (lower triangle with the diagonal).
- the score matrices' gradients into q_hat, k_hat and G, with the same overflow-free factorisations as the
  forward scores: :func:`chunk_kda_bwd_intra_kernel` (chunk, key block, value head) takes the separable chunks
  whole in four products; :func:`chunk_kda_bwd_list_kernel` lists the others, and
  :func:`chunk_kda_bwd_listed_kernel` takes them by halves (16-bit inputs, chunks bounded per sub-block) or by
  16-row sub-blocks (every earlier column in one product, every later row in one product, or in a chunk the
  forward took by bands only the neighbouring sub-blocks, :func:`band_grads`; the diagonal block by
  ``exp(gP_i) exp(-gP_j)`` or, under strong decay, by the clamped gate steps or the forward's four levels of
  reference rows: :func:`diagonal_grads`).
- :func:`chunk_kda_bwd_gate_kernel` (chunk, key block, value head): dg = the reverse cumulative sum of dG inside the
  chunk, and the gate formula's backward (dg raw, and partial sums for dA_log, ddt_bias).
- :func:`chunk_kda_bwd_qk_kernel` (chunk, q/k head): sums the value heads of a group (GVA) and runs the l2norm
  backward ``dx = r (dx_hat - x_hat (x_hat . dx_hat))``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .chunk_common import (
    SAFE_EXP,
    cast,
    channel_halves,
    chunk_coords,
    chunk_gate_terms,
    chunk_kind,
    chunk_separable,
    clamped_diagonal_factors,
    earlier_factor,
    gate_tiles,
    grid_coords,
    halves_exponents,
    later_factor,
    level_factor,
    level_pairs,
    load_beta,
    load_norms,
    load_row_scalars,
    load_rows,
    load_state,
    mm,
    mm_rounded,
    row_halves,
    separable_exponent,
    store_rows,
    sub_block_total,
    sub_block_totals,
    sub_blocks_far,
    tf32_operand,
)
from .fastmath import fast_exp
from .transforms import sigmoid, softplus_sigmoid


@triton.jit
def chunk_kda_bwd_inter_kernel(
    q, k, beta, gP, rq, rk, Tm,       # inputs and recomputed forward pieces
    h, dh, vn, dvn, do,               # [NT, HV, K, V] x2 (storage dtype), [B, T, HV, V] x3
    dq_p, dk_p, dg_p, db_p, dT_p,     # out: [B, T, HV, K] f32 x3; [NK, B, T, HV] f32; [NK, B, T, HV, BT] f32
    cu_seqlens, chunk_indices,
    scale, T, NT, STRIDE_NK,          # STRIDE_NK = B * T * HV
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_QK_L2NORM: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr,
    NEG_EIGVAL: tl.constexpr, PREC: tl.constexpr,
):
    i_c, i_k, i_hv = grid_coords((K + BK - 1) // BK, HV)
    i_h = i_hv // (HV // H)
    _, i_t, bos, T_n = chunk_coords(i_c, cu_seqlens, chunk_indices, T, NT, IS_VARLEN)
    t0 = i_t * BT
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    p_h = h + (i_c.to(tl.int64) * HV + i_hv) * K * V
    p_dh = dh + (i_c.to(tl.int64) * HV + i_hv) * K * V

    b_dqg = tl.zeros([BT, BK], dtype=tl.float32)                          # [BT, BK]
    b_dkg = tl.zeros([BT, BK], dtype=tl.float32)                          # [BT, BK]
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)                           # [BT, BK]
    b_dgc = tl.zeros([BK], dtype=tl.float32)                              # [BK] sum_v S dS'
    for c0 in range(0, V, BV):
        o_v = c0 + tl.arange(0, BV)
        b_h = load_state(p_h, o_k, o_v, K, V)                                           # [BK, BV]
        b_dh = load_state(p_dh, o_k, o_v, K, V)                                         # [BK, BV]
        b_vn = load_rows(vn, bos, t0, T_n, i_hv, HV, V, o_v, BT)                        # [BT, BV]
        b_dvn = load_rows(dvn, bos, t0, T_n, i_hv, HV, V, o_v, BT)                      # [BT, BV]
        b_do = load_rows(do, bos, t0, T_n, i_hv, HV, V, o_v, BT).to(b_vn.dtype)         # [BT, BV]
        b_dqg += mm(b_do, tl.trans(b_h), PREC)
        b_dkg += mm(b_vn, tl.trans(b_dh), PREC)
        b_dw -= mm(b_dvn, tl.trans(b_h), PREC)
        b_dgc += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), 1)
    b_dqg *= scale

    b_G, b_Gs, b_GC = chunk_gate_terms(gP, bos, t0, T_n, i_hv, HV, K, o_k, BT, BC)   # [BT, BK] x2, [BK]
    b_rq, b_rk = load_norms(rq, rk, bos, t0, T_n, i_h, H, BT, USE_QK_L2NORM)         # [BT] x2
    b_beta = load_beta(beta, bos, t0, T_n, i_hv, HV, BT, USE_BETA_SIGMOID, NEG_EIGVAL)   # [BT]
    b_q = load_rows(q, bos, t0, T_n, i_h, H, K, o_k, BT).to(tl.float32) * b_rq[:, None]  # [BT, BK]
    b_k = load_rows(k, bos, t0, T_n, i_h, H, K, o_k, BT).to(tl.float32) * b_rk[:, None]  # [BT, BK]
    b_eG = tl.exp(b_G)
    b_eS = tl.exp(b_Gs)
    b_kn = b_k * b_eG                                                      # [BT, BK] k exp(G), no beta
    b_kg = b_k * b_eS                                                      # [BT, BK]
    b_T = load_rows(Tm, bos, t0, T_n, i_hv, HV, BT, o_t, BT)              # [BT, BT]
    b_dKb = mm(tl.trans(b_T), b_dw, PREC)                                  # [BT, BK]

    b_dq = b_dqg * b_eG
    b_dk = b_dkg * b_eS + b_beta[:, None] * b_dKb * b_eG
    b_dg = b_dqg * (b_q * b_eG) - b_dkg * b_kg + b_beta[:, None] * b_dKb * b_kn
    # G_C (the chunk's total) enters kg and the decay: its gradient belongs to the last valid row's G.
    b_dgc = tl.sum(b_dkg * b_kg, 0) + tl.exp(b_GC) * b_dgc
    last = tl.minimum(T_n - t0, BT) - 1
    b_dg += tl.where(o_t[:, None] == last, b_dgc[None, :], 0.0)
    store_rows(dq_p, b_dq, bos, t0, T_n, i_hv, HV, K, o_k, BT)
    store_rows(dk_p, b_dk, bos, t0, T_n, i_hv, HV, K, o_k, BT)
    store_rows(dg_p, b_dg, bos, t0, T_n, i_hv, HV, K, o_k, BT)

    # This key block's share of dbeta and of dTm = dw Kb^T, into its slice of the partial buffers.
    p_db = db_p + (i_k.to(tl.int64) * STRIDE_NK + (bos + t0) * HV + i_hv)
    tl.store(p_db + o_t * HV, tl.sum(b_dKb * b_kn, 1), mask=t0 + o_t < T_n)
    b_dT = mm(b_dw, tl.trans(b_kn * b_beta[:, None]), PREC)                # [BT, BT]
    store_rows(dT_p + i_k.to(tl.int64) * STRIDE_NK * BT, b_dT, bos, t0, T_n, i_hv, HV, BT, o_t, BT)


@triton.jit
def chunk_kda_bwd_wy_kernel(
    v, beta, Akk, Tm, vn, dvn, do,    # inputs and recomputed pieces
    db_p, dT_p,                       # partial sums from the inter kernel
    dv, dbeta, dAqk, dAkk,            # out: [B, T, HV, V], [B, T, HV] (input dtypes); [B, T, HV, BT] f32 x2
    cu_seqlens, chunk_indices,
    scale, T, NT, STRIDE_NK,
    HV: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, NK: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr, PREC: tl.constexpr,
):
    i_c, _, i_hv = grid_coords(1, HV)
    _, i_t, bos, T_n = chunk_coords(i_c, cu_seqlens, chunk_indices, T, NT, IS_VARLEN)
    t0 = i_t * BT
    o_t = tl.arange(0, BT)
    m_t = t0 + o_t < T_n
    b_T = load_rows(Tm, bos, t0, T_n, i_hv, HV, BT, o_t, BT)              # [BT, BT]
    b_dT = tl.zeros([BT, BT], dtype=tl.float32)                            # [BT, BT]
    b_db = tl.zeros([BT], dtype=tl.float32)                                # [BT]
    stride = bos * 0 + STRIDE_NK                                           # int64: the buffers pass 2^31 elements
    for i_k in range(0, NK):                                               # the inter kernel's key blocks
        b_dT += load_rows(dT_p + i_k * stride * BT, bos, t0, T_n, i_hv, HV, BT, o_t, BT)
        b_db += load_row_scalars(db_p + i_k * stride, bos, t0, T_n, i_hv, HV, BT)
    b_beta = load_beta(beta, bos, t0, T_n, i_hv, HV, BT, USE_BETA_SIGMOID, NEG_EIGVAL)   # [BT]

    b_dAqk = tl.zeros([BT, BT], dtype=tl.float32)                          # [BT, BT]
    for c0 in range(0, V, BV):
        o_v = c0 + tl.arange(0, BV)
        b_du = load_rows(dvn, bos, t0, T_n, i_hv, HV, V, o_v, BT).to(tl.float32)     # [BT, BV]
        b_v = load_rows(v, bos, t0, T_n, i_hv, HV, V, o_v, BT).to(tl.float32)        # [BT, BV]
        b_dT += mm(b_du, tl.trans(b_v * b_beta[:, None]), PREC)
        b_dVb = mm(tl.trans(b_T), b_du, PREC)                              # [BT, BV] gradient of beta v
        store_rows(dv, b_dVb * b_beta[:, None], bos, t0, T_n, i_hv, HV, V, o_v, BT)
        b_db += tl.sum(b_dVb * b_v, 1)
        b_vn = load_rows(vn, bos, t0, T_n, i_hv, HV, V, o_v, BT)                      # [BT, BV]
        b_do = load_rows(do, bos, t0, T_n, i_hv, HV, V, o_v, BT).to(b_vn.dtype)       # [BT, BV]
        b_dAqk += mm(b_do, tl.trans(b_vn), PREC)

    # Tm = (I + A)^-1, A = diag(beta) Akk strictly lower: dA = -Tm^T dTm Tm^T on A's free entries.
    b_dA = -mm(tl.trans(b_T), mm(b_dT, tl.trans(b_T), PREC), PREC)        # [BT, BT]
    b_dA = tl.where(o_t[:, None] > o_t[None, :], b_dA, 0.0)
    b_Akk = load_rows(Akk, bos, t0, T_n, i_hv, HV, BT, o_t, BT)           # [BT, BT]
    b_db += tl.sum(b_dA * b_Akk, 1)
    store_rows(dAkk, b_dA * b_beta[:, None], bos, t0, T_n, i_hv, HV, BT, o_t, BT)
    store_rows(dAqk, tl.where(o_t[:, None] >= o_t[None, :], scale * b_dAqk, 0.0), bos, t0, T_n, i_hv, HV, BT,
               o_t, BT)
    if USE_BETA_SIGMOID:
        b_s = tl.sigmoid(load_row_scalars(beta, bos, t0, T_n, i_hv, HV, BT))
        b_db = b_db * b_s * (1.0 - b_s)
        if NEG_EIGVAL:
            b_db = 2.0 * b_db
    tl.store(dbeta + ((bos + t0) * HV + i_hv) + o_t * HV, cast(b_db, dbeta.dtype.element_ty), mask=m_t)


@triton.jit
def diagonal_level_grads(b_dq, b_dkr, b_dkc, b_dG, b_dAq, b_dAk, b_q, b_k, b_P, gP, bos, r0, T_n, i_hv, o_k,
                         HV: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr, S: tl.constexpr):
    """Level S of :func:`diagonal_grads`' strong path added to (dq, dk from rows, dk from columns, dG): with f the
    level's factors (chunk_common.level_factor, all <= 1), dA kept on the level's pairs (chunk_common.level_pairs;
    masked before the products, so nothing outside the level is ever formed) and the operands ``Q' = q f``,
    ``K' = k f`` (rounded once for PREC, :func:`tf32_operand`),

        dq += f (dAq K')      dk_rows += f (dAk K')      dk_cols += f (dAq^T Q' + dAk^T K')
        dG += Q' (dAq K') + K' (dAk K') - K' (dAq^T Q' + dAk^T K')

    four [BC, BC] x [BC, BK] tensor-core products. dG is formed from the rounded operands themselves, so each
    pair's row share and column share are the same real number and cancel up to float32 accumulation; ``q dq`` from
    tf32 products would leave each pair's operand rounding behind (bf16 strong decay, interpreter: dt_bias's
    gradient 1.5e-2 off the float64 reference, against 3e-3 with exact products)."""
    o_r = tl.arange(0, BC)
    b_f = level_factor(gP, b_P, bos, r0, T_n, i_hv, HV, K, o_k, S, BC)            # [BC, BK]
    m_l = level_pairs(o_r, o_r, S)                                                # [BC, BC]
    b_aq = tf32_operand(tl.where(m_l, b_dAq, 0.0), PREC)
    b_ak = tf32_operand(tl.where(m_l, b_dAk, 0.0), PREC)
    b_kf = tf32_operand(b_k * b_f, PREC)
    b_qf = tf32_operand(b_q * b_f, PREC)
    b_rq = mm_rounded(b_aq, b_kf, tl.zeros_like(b_kf), PREC)                     # [BC, BK] dAq K'
    b_rk = mm_rounded(b_ak, b_kf, tl.zeros_like(b_kf), PREC)                     # dAk K'
    b_c = mm_rounded(tl.trans(b_ak), b_kf, mm_rounded(tl.trans(b_aq), b_qf, tl.zeros_like(b_kf), PREC), PREC)
    b_dq += b_f * b_rq
    b_dkr += b_f * b_rk
    b_dkc += b_f * b_c
    b_dG += b_qf * b_rq + b_kf * (b_rk - b_c)
    return b_dq, b_dkr, b_dkc, b_dG


@triton.jit
def clamped_diagonal_grads(b_dq, b_dkr, b_dkc, b_dG, b_dAq, b_dAk, b_q, b_k, b_P, gP, bos, r0, T_n, i_hv, o_k,
                           HV: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr):
    """:func:`diagonal_grads`' strong path for 16-bit inputs, added to (dq, dk from rows, dk from columns, dG): the
    forward's clamped gate steps (chunk_common.clamped_diagonal_factors, 16-bit precision at any gate) give row
    factors ``e = exp(c - m)`` and column factors ``1 / e``, and with the operands ``Q' = q e``, ``K'r = k e``,
    ``K'c = k / e`` (rounded once for PREC)

        dq += e (dAq K'c)      dk_rows += e (dAk K'c)      dk_cols += (dAq^T Q' + dAk^T K'r) / e
        dG += Q' (dAq K'c) + K'r (dAk K'c) - K'c (dAq^T Q' + dAk^T K'r)

    four [BC, BC] x [BC, BK] products, one set for the block, where the levels take four sets. dG comes from the
    rounded operands themselves, as in :func:`diagonal_level_grads`, so each pair's row and column shares cancel.
    dA is strictly lower: a kept pair j < i has ``c_j >= c_i``, so ``e_i / e_j <= 1`` and nothing overflows."""
    b_e, b_ie = clamped_diagonal_factors(gP, b_P, bos, r0, T_n, i_hv, HV, K, o_k, BC, BC, "tf32x3")   # [BC, BK] x2
    b_aq = tf32_operand(b_dAq, PREC)
    b_ak = tf32_operand(b_dAk, PREC)
    b_qr = tf32_operand(b_q * b_e, PREC)
    b_kr = tf32_operand(b_k * b_e, PREC)
    b_kc = tf32_operand(b_k * b_ie, PREC)
    b_rq = mm_rounded(b_aq, b_kc, tl.zeros_like(b_kc), PREC)                     # [BC, BK] dAq K'c
    b_rk = mm_rounded(b_ak, b_kc, tl.zeros_like(b_kc), PREC)                     # dAk K'c
    b_c = mm_rounded(tl.trans(b_ak), b_kr, mm_rounded(tl.trans(b_aq), b_qr, tl.zeros_like(b_kc), PREC), PREC)
    b_dq += b_e * b_rq
    b_dkr += b_e * b_rk
    b_dkc += b_ie * b_c
    b_dG += b_qr * b_rq + b_kr * b_rk - b_kc * b_c
    return b_dq, b_dkr, b_dkc, b_dG


@triton.jit
def diagonal_grads(b_dq, b_dkr, b_dkc, b_dAq, b_dAk, b_q, b_k, b_P, gP, bos, r0, T_n, i_hv, o_k,
                   HV: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr):
    """The diagonal block's score gradients added to the sub-block's (dq, dk from rows, dk from columns), [BC, BK]
    each, for q, k (normalised), gP of one sub-block (rows r0 .. r0 + BC, channels o_k) and the block's dAqk,
    dAkk, both strictly lower (Aqk's diagonal is the caller's, see :func:`separable_grads`); returned with the
    sub-block's gate gradient ``dG = q dq + k (dk_rows - dk_columns)``.

    When every |gP| < SAFE_EXP, ``exp(gP_i - gP_j) = exp(gP_i) exp(-gP_j)`` (both factors fit float32): four
    products. Otherwise (strong decay, e.g. padding gates of -1000, where ``exp(-gP_j)`` overflows): for 16-bit
    inputs (``PREC`` not "ieee") through the forward's clamped gate steps, four products
    (:func:`clamped_diagonal_grads`); for float32 every pair j < i is factored through a reference row r,
    j <= r < i, ``exp(gP_i - gP_r) exp(gP_r - gP_j)``, both factors <= 1, by the four levels S = 16, 8, 4, 2 of the
    forward (chunk_wy.diagonal_levels): four products per level (:func:`diagonal_level_grads`), exact at any gate.
    Both strong paths also add the block's share of dG."""
    if tl.max(tl.abs(b_P)) < SAFE_EXP:
        b_e = tl.exp(b_P)
        b_ie = tl.exp(-b_P)
        b_kie = b_k * b_ie
        b_dq += b_e * mm(b_dAq, b_kie, PREC)
        b_dkr += b_e * mm(b_dAk, b_kie, PREC)
        b_dkc += b_ie * (mm(tl.trans(b_dAq), b_q * b_e, PREC) + mm(tl.trans(b_dAk), b_k * b_e, PREC))
        b_dG = b_q * b_dq + b_k * (b_dkr - b_dkc)
    else:
        b_dG = b_q * b_dq + b_k * (b_dkr - b_dkc)                            # the earlier and later blocks' share
        if PREC != "ieee":
            b_dq, b_dkr, b_dkc, b_dG = clamped_diagonal_grads(b_dq, b_dkr, b_dkc, b_dG, b_dAq, b_dAk, b_q, b_k, b_P,
                                                              gP, bos, r0, T_n, i_hv, o_k, HV, K, BC, PREC)
        else:
            for L in tl.static_range(4):                                    # levels S = 16, 8, 4, 2
                b_dq, b_dkr, b_dkc, b_dG = diagonal_level_grads(b_dq, b_dkr, b_dkc, b_dG, b_dAq, b_dAk, b_q, b_k,
                                                                b_P, gP, bos, r0, T_n, i_hv, o_k, HV, K, BC, PREC,
                                                                16 >> L)
    return b_dq, b_dkr, b_dkc, b_dG


@triton.jit
def chunk_kda_bwd_intra_kernel(
    q, k, gP, rq, rk,                 # inputs and the recomputed gate sums / norms
    dAqk, dAkk,                       # [B, T, HV, BT] f32 from the WY kernel
    dq_p, dk_p, dg_p,                 # in: the inter kernel's parts; out: the totals per value head (dg_p: dG)
    cu_seqlens, chunk_indices,
    T, NT,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    BKA: tl.constexpr, IS_VARLEN: tl.constexpr, USE_QK_L2NORM: tl.constexpr, PREC: tl.constexpr,
):
    """The score matrices' gradients of the chunks :func:`chunk_separable` accepts, one program per chunk and
    value head looping over the key blocks (:func:`separable_grads`); the other chunks are listed
    (:func:`chunk_kda_bwd_list_kernel`) and taken by :func:`chunk_kda_bwd_listed_kernel`. One program per key
    block too would quadruple the programs that find their chunk not separable and return (255 registers: two
    programs an SM, so even idle ones pass through in waves)."""
    i_c, _, i_hv = grid_coords(1, HV)
    _, i_t, bos, T_n = chunk_coords(i_c, cu_seqlens, chunk_indices, T, NT, IS_VARLEN)
    t0 = i_t * BT
    if chunk_separable(gP, bos, t0, T_n, i_hv, HV, K, BKA, BC):
        for i_k in tl.range((K + BK - 1) // BK, num_stages=1):    # not pipelined: each block is whole
            separable_grads(q, k, gP, rq, rk, dAqk, dAkk, dq_p, dk_p, dg_p, bos, t0, T_n, i_k, i_hv // (HV // H),
                            i_hv, H, HV, K, BT, BC, BK, USE_QK_L2NORM, PREC)


@triton.jit
def chunk_kda_bwd_list_kernel(
    gP, chunks, count,                # in; out: [L] int32 lists, [2] int32 their lengths (zero on entry)
    cu_seqlens, chunk_indices,
    T, NT, L,
    HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BKA: tl.constexpr,
    IS_VARLEN: tl.constexpr, HALVES: tl.constexpr,
):
    """Lists ``i_c * HV + i_hv`` for every chunk and value head that is not separable (chunk_common.chunk_kind):
    with ``HALVES``, those bounded per sub-block from the front of ``chunks`` (count[0]); the others from its back
    (count[1]); in any order (each entry's work writes its own rows)."""
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    _, i_t, bos, T_n = chunk_coords(i_c, cu_seqlens, chunk_indices, T, NT, IS_VARLEN)
    sep, bounded = chunk_kind(gP, bos, i_t * BT, T_n, i_hv, HV, K, BKA, BC)
    if not sep:
        if bounded and HALVES:
            tl.store(chunks + tl.atomic_add(count, 1), i_c * HV + i_hv)
        else:
            tl.store(chunks + (L - 1 - tl.atomic_add(count + 1, 1)), i_c * HV + i_hv)


@triton.jit
def chunk_kda_bwd_listed_kernel(
    q, k, gP, rq, rk, dAqk, dAkk, dq_p, dk_p, dg_p,   # as chunk_kda_bwd_intra_kernel's
    chunks, count,                                    # chunk_kda_bwd_list_kernel's lists and their lengths
    cu_seqlens, chunk_indices,
    T, NT, L,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    BKA: tl.constexpr, IS_VARLEN: tl.constexpr, USE_QK_L2NORM: tl.constexpr, PREC: tl.constexpr, SUB: tl.constexpr,
):
    """The score gradients of the listed chunks by a fixed number of programs looping over a list, so that where
    no chunk needs a scheme its launch costs its few programs: by halves (:func:`halves_grads`, key block by key
    block) the chunks at the list's front, or (``SUB``) by sub-blocks (:func:`sub_block_grads`, sub-block by
    sub-block and key block by key block) those at its back. (H200, 16 x 2048: launches over every chunk whose
    programs mostly returned at once cost 0.3-0.4 ms where no chunk needed them, since 255 registers let few
    programs share an SM.) The work is a call of its own (``noinline``): :func:`halves_grads` inlined into this
    loop spilled 608 B a thread and took 5.7 ms for K3's saturated gates, against 3.9 as a call (112 B)."""
    NK: tl.constexpr = (K + BK - 1) // BK
    NW: tl.constexpr = NK * (BT // BC) if SUB else NK       # work items per listed chunk
    n = tl.load(count + SUB) * NW
    for it in range(tl.program_id(0), n, tl.num_programs(0)):
        if SUB:
            e = tl.load(chunks + (L - 1 - it // NW))
        else:
            e = tl.load(chunks + it // NW)
        i_c, i_hv = e // HV, e % HV
        _, i_t, bos, T_n = chunk_coords(i_c, cu_seqlens, chunk_indices, T, NT, IS_VARLEN)
        if SUB:
            sub_block_grads(q, k, gP, rq, rk, dAqk, dAkk, dq_p, dk_p, dg_p, bos, i_t * BT, (it % NW) // NK, T_n,
                            it % NK, i_hv // (HV // H), i_hv, H, HV, K, BT, BC, BK, BKA, USE_QK_L2NORM, PREC)
        else:
            halves_grads(q, k, gP, rq, rk, dAqk, dAkk, dq_p, dk_p, dg_p, bos, i_t * BT, T_n, it % NK,
                         i_hv // (HV // H), i_hv, H, HV, K, BT, BC, BK, USE_QK_L2NORM, PREC)


@triton.jit
def band_grads(q, k, gP, rq, rk, dAqk, dAkk, bos, t0, S, T_n, o_k, b_eS, i_h, i_hv,
               H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
               USE_QK_L2NORM: tl.constexpr, PREC: tl.constexpr):
    """(dq, dk from rows, dk from columns) of sub-block S's rows and columns against the neighbouring sub-blocks
    only, [BC, BK] each, for a chunk the forward took by bands (chunk_wy.banded_scores: every other pair's factor
    is below exp(-BAND_LIMIT) in every channel, and its score zero): S's rows against the columns of S - 1
    through the row before S, ``exp(gP_i) exp(tot_{S-1} - gP_j)``, and S's columns against the rows of S + 1
    through S's last row, ``exp(gP_i) exp(tot_S - gP_j)``, all factors <= 1 (the column gradient returned before
    its factor ``exp(tot_S - gP_j)``, which the caller applies as for the chunk-wide form); [BC, BC] x [BC, BK]
    products where the chunk-wide form takes [BC, BT] x [BT, BK] ones. ``b_eS``: exp(gP) of S's rows."""
    o_j = tl.arange(0, BC)
    rP = t0 + tl.maximum(S - 1, 0) * BC                     # sub-block S - 1 (S itself when S = 0: zeroed below)
    rN = t0 + tl.minimum(S + 1, 3) * BC                     # sub-block S + 1 (S itself when S = 3: zeroed below)
    b_rqP, b_rkP = load_norms(rq, rk, bos, rP, T_n, i_h, H, BC, USE_QK_L2NORM)        # [BC] x2
    b_kP = load_rows(k, bos, rP, T_n, i_h, H, K, o_k, BC).to(tl.float32) * b_rkP[:, None]    # [BC, BK]
    b_tP = sub_block_total(gP, bos, t0, tl.maximum(S - 1, 0), T_n, i_hv, HV, K, o_k, BC)  # [BK]
    b_c = tl.where(S > 0, b_kP * tl.exp(b_tP[None, :] - load_rows(gP, bos, rP, T_n, i_hv, HV, K, o_k, BC)), 0.0)
    c_P = (rP - t0) + o_j                                                             # [BC] columns of S - 1
    b_dq = mm(load_rows(dAqk, bos, t0 + S * BC, T_n, i_hv, HV, BT, c_P, BC), b_c, PREC) * b_eS      # [BC, BK]
    b_dkr = mm(load_rows(dAkk, bos, t0 + S * BC, T_n, i_hv, HV, BT, c_P, BC), b_c, PREC) * b_eS
    b_rqN, b_rkN = load_norms(rq, rk, bos, rN, T_n, i_h, H, BC, USE_QK_L2NORM)        # [BC] x2
    b_f = tl.where(S < 3, tl.exp(load_rows(gP, bos, rN, T_n, i_hv, HV, K, o_k, BC)), 0.0)   # [BC, BK]
    b_qN = load_rows(q, bos, rN, T_n, i_h, H, K, o_k, BC).to(tl.float32) * b_rqN[:, None]
    b_kN = load_rows(k, bos, rN, T_n, i_h, H, K, o_k, BC).to(tl.float32) * b_rkN[:, None]
    c_S = S * BC + o_j                                                                # [BC] columns of S
    b_dkc = (mm(tl.trans(load_rows(dAqk, bos, rN, T_n, i_hv, HV, BT, c_S, BC)), b_qN * b_f, PREC)
             + mm(tl.trans(load_rows(dAkk, bos, rN, T_n, i_hv, HV, BT, c_S, BC)), b_kN * b_f, PREC))  # [BC, BK]
    return b_dq, b_dkr, b_dkc


@triton.jit(noinline=True)
def sub_block_grads(
    q, k, gP, rq, rk, dAqk, dAkk, dq_p, dk_p, dg_p, bos, t0, S, T_n, i_k, i_h, i_hv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    BKA: tl.constexpr, USE_QK_L2NORM: tl.constexpr, PREC: tl.constexpr,
):
    """The score gradients of the rows of sub-block S (key block i_k) added to the inter kernel's parts: against
    the neighbouring sub-blocks only in a chunk the forward took by bands (:func:`band_grads`), else against every
    earlier column and every later row."""
    rS = t0 + S * BC
    o_k = i_k * BK + tl.arange(0, BK)
    o_j = tl.arange(0, BC)
    m_r = (rS + o_j) < T_n
    b_PS = load_rows(gP, bos, rS, T_n, i_hv, HV, K, o_k, BC)                         # [BC, BK]
    b_eS = tl.exp(b_PS)
    far = False
    if PREC != "ieee":
        far = sub_blocks_far(gP, bos, t0, T_n, i_hv, HV, K, BKA, BC)
    if far:
        b_dq, b_dkr, b_dkc = band_grads(q, k, gP, rq, rk, dAqk, dAkk, bos, t0, S, T_n, o_k, b_eS, i_h, i_hv,
                                        H, HV, K, BT, BC, USE_QK_L2NORM, PREC)
    else:
        o_t = tl.arange(0, BT)
        b_P = load_rows(gP, bos, t0, T_n, i_hv, HV, K, o_k, BT)                          # [BT, BK]
        b_t0, b_t1, b_t2, _ = sub_block_totals(gP, bos, t0, T_n, i_hv, HV, K, o_k, BC)   # [BK] x3
        b_rq, b_rk = load_norms(rq, rk, bos, t0, T_n, i_h, H, BT, USE_QK_L2NORM)          # [BT] x2
        b_k = load_rows(k, bos, t0, T_n, i_h, H, K, o_k, BT).to(tl.float32) * b_rk[:, None]     # [BT, BK]
        # Rows of S against every earlier column, factored through the row before S (as the forward scores): one
        # product with S's [BC, BT] row block of dA (its columns from S on meet zero rows of the operand).
        b_c = b_k * earlier_factor(b_P, b_t0, b_t1, b_t2, S, BT, BC)                    # [BT, BK]
        b_dq = mm(load_rows(dAqk, bos, rS, T_n, i_hv, HV, BT, o_t, BC), b_c, PREC) * b_eS         # [BC, BK]
        b_dkr = mm(load_rows(dAkk, bos, rS, T_n, i_hv, HV, BT, o_t, BC), b_c, PREC) * b_eS        # [BC, BK]
        # Columns of S against every later row, factored through S's last row: S's [BT, BC] column block of dA.
        b_f = later_factor(b_P, b_t1, b_t2, S, BT, BC)                                    # [BT, BK]
        b_q = load_rows(q, bos, t0, T_n, i_h, H, K, o_k, BT).to(tl.float32) * b_rq[:, None]     # [BT, BK]
        b_dAqc = load_rows(dAqk, bos, t0, T_n, i_hv, HV, BT, S * BC + o_j, BT)            # [BT, BC]
        b_dAkc = load_rows(dAkk, bos, t0, T_n, i_hv, HV, BT, S * BC + o_j, BT)            # [BT, BC]
        b_dkc = mm(tl.trans(b_dAqc), b_q * b_f, PREC) + mm(tl.trans(b_dAkc), b_k * b_f, PREC)     # [BC, BK]
    # Both forms give S's columns against later rows through S's last row r: their own factor exp(G_r - G_j)
    b_dkc *= tl.exp(sub_block_total(gP, bos, t0, S, T_n, i_hv, HV, K, o_k, BC)[None, :] - b_PS)

    # The diagonal block.
    b_rqS, b_rkS = load_norms(rq, rk, bos, rS, T_n, i_h, H, BC, USE_QK_L2NORM)         # [BC] x2
    b_qS = load_rows(q, bos, rS, T_n, i_h, H, K, o_k, BC).to(tl.float32) * b_rqS[:, None]   # [BC, BK]
    b_kS = load_rows(k, bos, rS, T_n, i_h, H, K, o_k, BC).to(tl.float32) * b_rkS[:, None]   # [BC, BK]
    b_dAq = load_rows(dAqk, bos, rS, T_n, i_hv, HV, BT, S * BC + o_j, BC)              # [BC, BC]
    b_dAk = load_rows(dAkk, bos, rS, T_n, i_hv, HV, BT, S * BC + o_j, BC)              # [BC, BC]
    m_d = o_j[:, None] == o_j[None, :]
    b_d = tl.sum(tl.where(m_d, b_dAq, 0.0), 1)                                        # [BC] Aqk's diagonal
    # d/dG_i of exp(G_i - G_j) is the term itself: rows gain q dq + k dk_rows, columns lose k dk_columns
    # (diagonal_grads). (Aqk's diagonal, factor 1, adds to dq and dk in float32 and nothing to dG: its row and
    # column shares cancel.)
    b_dq, b_dkr, b_dkc, b_dG = diagonal_grads(b_dq, b_dkr, b_dkc, tl.where(m_d, 0.0, b_dAq), b_dAk, b_qS, b_kS,
                                              b_PS, gP, bos, rS, T_n, i_hv, o_k, HV, K, BC, PREC)
    b_dq += b_d[:, None] * b_kS + load_rows(dq_p, bos, rS, T_n, i_hv, HV, K, o_k, BC)
    b_dk = b_dkr + b_dkc + b_d[:, None] * b_qS + load_rows(dk_p, bos, rS, T_n, i_hv, HV, K, o_k, BC)
    b_dG += load_rows(dg_p, bos, rS, T_n, i_hv, HV, K, o_k, BC)
    store_rows(dq_p, b_dq, bos, rS, T_n, i_hv, HV, K, o_k, BC)
    store_rows(dk_p, b_dk, bos, rS, T_n, i_hv, HV, K, o_k, BC)
    store_rows(dg_p, tl.where(m_r[:, None], b_dG, 0.0), bos, rS, T_n, i_hv, HV, K, o_k, BC)


@triton.jit
def load_diagonal(p, bos, t0, T_n, i_hv, HV: tl.constexpr, BT: tl.constexpr):
    """The diagonal of a chunk's [BT, BT] score gradient ([BT]; zero past T_n)."""
    o_t = tl.arange(0, BT)
    return tl.load(p + ((bos + t0 + o_t) * HV + i_hv) * BT + o_t, mask=t0 + o_t < T_n, other=0.0)


@triton.jit
def load_lower(p, bos, t0, T_n, i_hv, HV: tl.constexpr, BT: tl.constexpr, DIAGONAL: tl.constexpr):
    """A chunk's [BT, BT] score gradient, zero above the diagonal (and on it unless ``DIAGONAL``)."""
    o_t = tl.arange(0, BT)
    b_a = load_rows(p, bos, t0, T_n, i_hv, HV, BT, o_t, BT)
    if DIAGONAL:
        return tl.where(o_t[:, None] >= o_t[None, :], b_a, 0.0)
    return tl.where(o_t[:, None] > o_t[None, :], b_a, 0.0)


@triton.jit(noinline=True)
def separable_grads(
    q, k, gP, rq, rk, dAqk, dAkk, dq_p, dk_p, dg_p, bos, t0, T_n, i_k, i_h, i_hv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, PREC: tl.constexpr,
):
    """The score gradients of a chunk :func:`chunk_separable` accepts, all 64 rows (key block i_k)
    at once. With ``D = G - R`` (chunk_common.separable_exponent) and ``E = exp(D)``,
    Aqk = (q E)(k / E)^T and Akk = (k E)(k / E)^T on and below the diagonal, so

        dq = E (dAqk (k / E))    dk = E (dAkk (k / E)) + (dAqk^T (q E) + dAkk^T (k E)) / E

    and d/dG of each score is the score itself on its row and minus it on its column: dG = q dq + k (dk_rows -
    dk_columns). Four [BT, BT] x [BT, BK] products; the dropped entries above the diagonal are zero in dA, so the
    large factors of far columns never meet them. Aqk's diagonal (factor 1) is added in float32 beside the
    products: its share of dG cancels exactly, row against column, where tf32-rounded products would leave the
    rounding of the largest single terms behind (a noise the reverse cumsum and the dA_log sum then collect)."""
    o_k = i_k * BK + tl.arange(0, BK)
    o_t = tl.arange(0, BT)
    b_D = separable_exponent(gP, bos, t0, T_n, i_hv, HV, K, o_k, (o_t // BC)[:, None], BT, BC)   # [BT, BK]
    b_E = fast_exp(b_D)
    b_iE = fast_exp(-b_D)
    b_rq, b_rk = load_norms(rq, rk, bos, t0, T_n, i_h, H, BT, USE_QK_L2NORM)      # [BT] x2
    b_q = load_rows(q, bos, t0, T_n, i_h, H, K, o_k, BT).to(tl.float32) * b_rq[:, None]   # [BT, BK]
    b_k = load_rows(k, bos, t0, T_n, i_h, H, K, o_k, BT).to(tl.float32) * b_rk[:, None]   # [BT, BK]
    # rows (dq, dk from Akk's rows), then columns (dk from both matrices' columns), dA loaded for each: the
    # two phases never hold more than two [BT, BT] tiles
    b_d = load_diagonal(dAqk, bos, t0, T_n, i_hv, HV, BT)                # [BT] Aqk's diagonal
    b_kc = b_k * b_iE                                                   # [BT, BK] the columns' operand
    b_dq = mm(load_lower(dAqk, bos, t0, T_n, i_hv, HV, BT, False), b_kc, PREC) * b_E
    b_dk = mm(load_lower(dAkk, bos, t0, T_n, i_hv, HV, BT, False), b_kc, PREC) * b_E
    b_dG = b_q * b_dq + b_k * b_dk + load_rows(dg_p, bos, t0, T_n, i_hv, HV, K, o_k, BT)
    b_dq += b_d[:, None] * b_k + load_rows(dq_p, bos, t0, T_n, i_hv, HV, K, o_k, BT)
    store_rows(dq_p, b_dq, bos, t0, T_n, i_hv, HV, K, o_k, BT)
    b_dk += b_d[:, None] * b_q
    b_dkc = mm(tl.trans(load_lower(dAqk, bos, t0, T_n, i_hv, HV, BT, False)), b_q * b_E, PREC)
    b_dkc = (b_dkc + mm(tl.trans(load_lower(dAkk, bos, t0, T_n, i_hv, HV, BT, False)), b_k * b_E, PREC)) * b_iE
    b_dG -= b_k * b_dkc
    b_dk += b_dkc + load_rows(dk_p, bos, t0, T_n, i_hv, HV, K, o_k, BT)
    store_rows(dk_p, b_dk, bos, t0, T_n, i_hv, HV, K, o_k, BT)
    store_rows(dg_p, b_dG, bos, t0, T_n, i_hv, HV, K, o_k, BT)


@triton.jit
def cross_of(b_a, ROWS: tl.constexpr):
    """The part across the halves of a [BT, BT] tile: with ``ROWS`` (dA) columns 0-31 on rows 32-63, else
    (dA^T) columns 32-63 on rows 0-31; [BT, BT / 2], zero on the other rows."""
    BT: tl.constexpr = b_a.shape[0]
    b_l, b_r = channel_halves(b_a)
    o_t = tl.arange(0, BT)
    if ROWS:
        return tl.where((o_t >= BT // 2)[:, None], b_l, 0.0)
    return tl.where((o_t < BT // 2)[:, None], b_r, 0.0)


@triton.jit(noinline=True)
def halves_grads(
    q, k, gP, rq, rk, dAqk, dAkk, dq_p, dk_p, dg_p, bos, t0, T_n, i_k, i_h, i_hv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, PREC: tl.constexpr,
):
    """The score gradients of a chunk that is not separable but whose gate falls by less than HALF_LIMIT over every
    16-row sub-block (chunk_common.sub_blocks_fall_little), all 64 rows at once (key block i_k), by the factorisation
    of the forward's scores by halves (chunk_wy.halves_scores; D and X: chunk_common.halves_exponents). Each entry
    of dA lies inside a 32-row half (``dA_h``: factors ``E = exp(D)`` on rows, ``1 / E`` on columns) or across them
    (``dA_x``, rows 32-63 and columns 0-31: ``F = exp(X)`` on both, <= 1), so each product of
    :func:`separable_grads` becomes two, dA masked to one part:

        dq = E (dAq_h (k / E)) + F (dAq_x (k F))          dk_rows: the same with dAk
        dk_cols = (dAq_h^T (q E) + dAk_h^T (k E)) / E + F (dAq_x^T (q F) + dAk_x^T (k F))
        dG = q dq + k (dk_rows - dk_cols)

    in one program, where the sub-block scheme takes four programs a chunk (each loading the chunk's rows again)
    and, on sub-blocks past -SAFE_EXP, the diagonal levels: the three within-half products as [BT, BT] x [BT, BK]
    on dA masked to the halves, the four across the halves as [BT, BT / 2] x [BT / 2, BK] (dA_x fills a quarter
    of the matrix, so they reduce over one half: :func:`cross_of`, chunk_common.row_halves), the work of five full
    products where masked full ones took eight. Aqk's diagonal is added in float32 beside the products, as in
    :func:`separable_grads`; dG is formed from the rounded operands."""
    o_k = i_k * BK + tl.arange(0, BK)
    o_t = tl.arange(0, BT)
    s_r = (o_t // BC)[:, None]                                          # [BT, 1] sub-block of each row
    m_x = (s_r >= 2) & (o_t < 2 * BC)[None, :]                          # [BT, BT] across the halves
    b_P, b_t0, b_t1, b_t2, _ = gate_tiles(gP, bos, t0, T_n, i_hv, HV, K, o_k, BT, BC)
    b_D, b_X = halves_exponents(b_P, b_t0, b_t1, b_t2, s_r)             # [BT, BK] x2
    b_E = fast_exp(b_D)
    b_iE = fast_exp(-b_D)
    b_F = fast_exp(b_X)
    b_rq, b_rk = load_norms(rq, rk, bos, t0, T_n, i_h, H, BT, USE_QK_L2NORM)      # [BT] x2
    b_q = load_rows(q, bos, t0, T_n, i_h, H, K, o_k, BT).to(tl.float32) * b_rq[:, None]   # [BT, BK]
    b_k = load_rows(k, bos, t0, T_n, i_h, H, K, o_k, BT).to(tl.float32) * b_rk[:, None]   # [BT, BK]
    b_d = load_diagonal(dAqk, bos, t0, T_n, i_hv, HV, BT)                # [BT] Aqk's diagonal
    # The operands rounded once (PREC), and dG formed from them, so that each pair's row share and column share
    # of dG are the same real number and cancel up to float32 accumulation (as diagonal_level_grads does; from
    # q dq, bf16 dA_log was 4.5e-2 off the float64 reference in test_score_gradients_by_halves). dq's products,
    # then dk's rows, then the columns, dA loaded for each and the rounded operands formed again where needed
    # (the same numbers), so that few [BT, BK] tiles stay live.
    b_kc = tf32_operand(b_k * b_iE, PREC)                               # [BT, BK] same-half columns
    b_kF = tf32_operand(b_k * b_F, PREC)                                # [BT, BK] columns (and rows) across
    b_kF0, _ = row_halves(b_kF)                                        # [BT / 2, BK] rows 0-31 of b_kF
    b_dA = tf32_operand(load_lower(dAqk, bos, t0, T_n, i_hv, HV, BT, False), PREC)    # [BT, BT]
    b_rh = mm_rounded(tl.where(m_x, 0.0, b_dA), b_kc, tl.zeros_like(b_kc), PREC)      # [BT, BK] dAq_h (k / E)
    b_rx = mm_rounded(cross_of(b_dA, True), b_kF0, tl.zeros_like(b_kc), PREC)
    # b_rx: [BT, BK] dAq_x (k F), zero on rows 0-31
    b_dG = (tf32_operand(b_q * b_E, PREC) * b_rh + tf32_operand(b_q * b_F, PREC) * b_rx
            + load_rows(dg_p, bos, t0, T_n, i_hv, HV, K, o_k, BT))
    b_dq = b_E * b_rh + b_F * b_rx + b_d[:, None] * b_k + load_rows(dq_p, bos, t0, T_n, i_hv, HV, K, o_k, BT)
    store_rows(dq_p, b_dq, bos, t0, T_n, i_hv, HV, K, o_k, BT)
    b_dA = tf32_operand(load_lower(dAkk, bos, t0, T_n, i_hv, HV, BT, False), PREC)
    b_rh = mm_rounded(tl.where(m_x, 0.0, b_dA), b_kc, tl.zeros_like(b_kc), PREC)      # dAk_h (k / E)
    b_rx = mm_rounded(cross_of(b_dA, True), b_kF0, tl.zeros_like(b_kc), PREC)
    b_dG += tf32_operand(b_k * b_E, PREC) * b_rh + b_kF * b_rx
    b_dk = b_E * b_rh + b_F * b_rx + b_d[:, None] * b_q
    m_xt = tl.trans(m_x)
    b_dAq = tl.trans(tf32_operand(load_lower(dAqk, bos, t0, T_n, i_hv, HV, BT, False), PREC))   # [BT, BT] dAq^T
    b_dAk = tl.trans(tf32_operand(load_lower(dAkk, bos, t0, T_n, i_hv, HV, BT, False), PREC))
    b_qE = tf32_operand(b_q * b_E, PREC)
    b_kE = tf32_operand(b_k * b_E, PREC)
    b_rh = mm_rounded(tl.where(m_xt, 0.0, b_dAk), b_kE, mm_rounded(tl.where(m_xt, 0.0, b_dAq), b_qE,
                                                                    tl.zeros_like(b_kc), PREC), PREC)
    _, b_kF1 = row_halves(b_kF)                                        # [BT / 2, BK] rows 32-63
    _, b_qF1 = row_halves(tf32_operand(b_q * b_F, PREC))
    b_rx = mm_rounded(cross_of(b_dAk, False), b_kF1,
                      mm_rounded(cross_of(b_dAq, False), b_qF1,
                                 tl.zeros_like(b_kc), PREC), PREC)      # [BT, BK], zero on rows 32-63
    b_dG -= b_kc * b_rh + b_kF * b_rx
    b_dk += b_iE * b_rh + b_F * b_rx + load_rows(dk_p, bos, t0, T_n, i_hv, HV, K, o_k, BT)
    store_rows(dk_p, b_dk, bos, t0, T_n, i_hv, HV, K, o_k, BT)
    store_rows(dg_p, b_dG, bos, t0, T_n, i_hv, HV, K, o_k, BT)


@triton.jit
def chunk_kda_bwd_gate_kernel(
    g, A_log, dt_bias,                # the raw (or log) gate and the in-kernel gate's parameters
    dG,                               # [B, T, HV, K] f32: the gradient of the chunk prefix G
    dg, dA_p, ddt_p,                  # out: [B, T, HV, K] (g's dtype), [NT, NK, HV] f32, [NT, HV, K] f32
    cu_seqlens, chunk_indices,
    lower_bound, T, NT,
    HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_GATE: tl.constexpr, USE_LOWER_BOUND: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
):
    """One program per (chunk, key block, value head): G_i = sum_{m <= i} g_m inside the chunk, so
    dg_m = sum_{i >= m} dG_i; then the gate formula's backward and per-chunk partial sums for dA_log, ddt_bias."""
    i_c, i_k, i_hv = grid_coords(NK, HV)
    _, i_t, bos, T_n = chunk_coords(i_c, cu_seqlens, chunk_indices, T, NT, IS_VARLEN)
    t0 = i_t * BT
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_r = (t0 + tl.arange(0, BT)) < T_n
    b_dgs = tl.cumsum(load_rows(dG, bos, t0, T_n, i_hv, HV, K, o_k, BT), 0, reverse=True)    # [BT, BK]
    if USE_GATE:
        b_a = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        b_x = load_rows(g, bos, t0, T_n, i_hv, HV, K, o_k, BT).to(tl.float32)                # [BT, BK]
        if HAS_DT_BIAS:
            b_x += tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.0).to(tl.float32)[None, :]
        if USE_LOWER_BOUND:
            # g = lb sigmoid(a x): dg/dx = lb s (1 - s) a, dg/dA_log = (dg/dx) x
            b_s = sigmoid(b_a * b_x)
            b_dx = b_dgs * (lower_bound * b_s * (1.0 - b_s) * b_a)
            b_dA = tl.where(m_r[:, None], b_dx * b_x, 0.0)
        else:
            # g = -a softplus(x): dg/dx = -a sigmoid(x), dg/dA_log = g
            b_sp, b_s = softplus_sigmoid(b_x)
            b_dx = b_dgs * (-b_a * b_s)
            b_dA = tl.where(m_r[:, None], b_dgs * (-b_a * b_sp), 0.0)
        b_dx = tl.where(m_r[:, None], b_dx, 0.0)
        store_rows(dg, b_dx, bos, t0, T_n, i_hv, HV, K, o_k, BT)
        tl.store(dA_p + (i_c.to(tl.int64) * NK + i_k) * HV + i_hv, tl.sum(tl.sum(tl.where(m_k[None, :], b_dA, 0.0),
                                                                                1), 0))
        tl.store(ddt_p + (i_c.to(tl.int64) * HV + i_hv) * K + o_k, tl.sum(b_dx, 0), mask=m_k)
    else:
        store_rows(dg, b_dgs, bos, t0, T_n, i_hv, HV, K, o_k, BT)


@triton.jit
def chunk_kda_bwd_qk_kernel(
    q, k, rq, rk, dq_p, dk_p,         # [B, T, H, K] x2, [B, T, H] f32 x2, [B, T, HV, K] f32 x2
    dq, dk,                           # out: [B, T, H, K] in q's / k's dtype
    cu_seqlens, chunk_indices,
    T, NT,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_QK_L2NORM: tl.constexpr,
):
    i_c, _, i_h = grid_coords(1, H)
    G: tl.constexpr = HV // H
    _, i_t, bos, T_n = chunk_coords(i_c, cu_seqlens, chunk_indices, T, NT, IS_VARLEN)
    t0 = i_t * BT
    o_k = tl.arange(0, BK)
    for s in tl.static_range(BT // BC):
        r0 = t0 + s * BC
        b_dq = tl.zeros([BC, BK], dtype=tl.float32)                        # [BC, BK]
        b_dk = tl.zeros([BC, BK], dtype=tl.float32)                        # [BC, BK]
        for j in range(0, G):                                              # the value heads reading head i_h
            b_dq += load_rows(dq_p, bos, r0, T_n, i_h * G + j, HV, K, o_k, BC)
            b_dk += load_rows(dk_p, bos, r0, T_n, i_h * G + j, HV, K, o_k, BC)
        if USE_QK_L2NORM:
            b_rq, b_rk = load_norms(rq, rk, bos, r0, T_n, i_h, H, BC, USE_QK_L2NORM)     # [BC] x2
            b_q = load_rows(q, bos, r0, T_n, i_h, H, K, o_k, BC).to(tl.float32) * b_rq[:, None]   # [BC, BK]
            b_k = load_rows(k, bos, r0, T_n, i_h, H, K, o_k, BC).to(tl.float32) * b_rk[:, None]   # [BC, BK]
            b_dq = b_rq[:, None] * (b_dq - b_q * tl.sum(b_q * b_dq, 1)[:, None])
            b_dk = b_rk[:, None] * (b_dk - b_k * tl.sum(b_k * b_dk, 1)[:, None])
        store_rows(dq, b_dq, bos, r0, T_n, i_h, H, K, o_k, BC)
        store_rows(dk, b_dk, bos, r0, T_n, i_h, H, K, o_k, BC)
