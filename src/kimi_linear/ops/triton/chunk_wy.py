"""Chunk pipeline, stages (b)-(d): the intra-chunk score matrices, the inverse, and the WY factors.

:func:`chunk_kda_fwd_scores_kernel`, one program per (chunk, value head), writes

    Aqk[i, j] = sum_c q_ic k_jc exp(G_ic - G_jc)    (j <= i)       Akk[i, j] = same with k_i, j < i (no beta)

as [BT, BKS] x [BKS, BT] tensor-core products per channel step. Two launches: chunks whose gate falls by less than
HALF_LIMIT over each 32-row half (chunk_common.chunk_separable, most chunks) need one product per step
(:func:`separable_scores`); of the others, those whose gate falls by less than HALVES_LIMIT over each 16-row
sub-block go by halves (:func:`halves_scores`), 16-bit inputs whose gate falls by more than BAND_LIMIT over
sub-blocks 1 and 2 in every channel by bands (:func:`banded_scores`: the diagonal blocks and the ones just below
them; the rest are below exp(-BAND_LIMIT)), and the rest by column blocks (:func:`blocked_scores`): each
16-row block of columns against the rows after it, with factors all <= 1 linked between blocks by per-channel
vectors, so nothing overflows at any gate. Their diagonal blocks take a pass of their own: one batched product
through gate steps clamped at -DIAG_CLAMP for 16-bit inputs (:func:`clamped_diagonal`; strong decay, e.g.
padding gates of -1000, included), or for float32 ``exp(gP_i - gP_r) exp(gP_r - gP_j)``
through a reference row r between j and i, both factors <= 1, in two batched products per matrix (one per level
of 16 and 8 rows, over the four sub-blocks at once), and the pairs inside 4-row blocks elementwise
(:func:`diagonal_levels`). With l2norm the paths run on raw q and k and :func:`finish_scores` applies (and stores)
the row factors.

:func:`chunk_kda_fwd_wy_kernel`, one program per (chunk, value head), inverts ``I + diag(beta) Akk`` by 16x16
blocks (chunk_common.diagonal_block_inverses on the diagonal blocks, block products below), assembles the blocks
into one [64, 64] tile in registers (stored as ``Tm`` only when a backward will read it), and writes

    w = Tm (beta k exp(G))      u = Tm (beta v)      qg = q exp(G)      kg = k exp(G_C - G)      decay = exp(G_C)

which is everything the state scan (chunk_state.py) reads.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .chunk_common import (
    bf16_split,
    block_of,
    channel_halves,
    chunk_coords,
    chunk_gate_terms,
    chunk_separable,
    clamped_diagonal_factors,
    diagonal_block_inverses,
    gate_terms,
    grid_coords,
    halves_exponents,
    level_factor,
    level_pairs,
    load_beta,
    load_norms,
    load_rows,
    mm,
    mm_rounded,
    mm_split,
    own_totals,
    prefetch_rows,
    row_halves,
    row_inv_norms,
    separable_exponent,
    separable_offset,
    store_row_norms,
    store_rows,
    sub_block_totals,
    sub_blocks_kind,
    tf32_operand,
    vector_halves,
)
from .fastmath import fast_exp


@triton.jit
def store_scores(Aqk, Akk, b_aq, b_ak, bos, t0, T_n, i_hv, HV: tl.constexpr, BT: tl.constexpr):
    """Store a chunk's score tiles ([BT, BT] each): Aqk on and below the diagonal, Akk strictly below, zeros above
    (where the separable products may hold overflowed values)."""
    o_t = tl.arange(0, BT)
    store_rows(Aqk, tl.where(o_t[:, None] >= o_t[None, :], b_aq, 0.0), bos, t0, T_n, i_hv, HV, BT, o_t, BT)
    store_rows(Akk, tl.where(o_t[:, None] > o_t[None, :], b_ak, 0.0), bos, t0, T_n, i_hv, HV, BT, o_t, BT)


@triton.jit
def level_products(b_aq, b_ak, b_q, b_k, gP, b_P, bos, t0, T_n, i_hv, o_k,
                   HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BKS: tl.constexpr,
                   PREC: tl.constexpr, S: tl.constexpr):
    """One channel step of level S of :func:`diagonal_levels`, added to its [NB, BC, BC] tiles (b_aq, b_ak): rows
    ``q_i f_i`` (``k_i f_i``) of upper halves against columns ``k_j f_j`` of lower halves, one batched product per
    16-row sub-block (f: chunk_common.level_factor, all <= 1)."""
    NB: tl.constexpr = BT // BC
    m_up = ((tl.arange(0, BT) % S) >= S // 2)[:, None]                    # [BT, 1] rows of upper halves
    b_f = level_factor(gP, b_P, bos, t0, T_n, i_hv, HV, K, o_k, S, BT)    # [BT, BKS], all <= 1
    b_kf = b_k * b_f
    b_ct = tl.trans(tl.reshape(tf32_operand(tl.where(m_up, 0.0, b_kf), PREC), [NB, BC, BKS]), 0, 2, 1)
    b_aq = mm_rounded(tl.reshape(tf32_operand(tl.where(m_up, b_q * b_f, 0.0), PREC), [NB, BC, BKS]), b_ct,
                      b_aq, PREC)                                         # [NB, BC, BC]
    b_ak = mm_rounded(tl.reshape(tf32_operand(tl.where(m_up, b_kf, 0.0), PREC), [NB, BC, BKS]), b_ct, b_ak, PREC)
    return b_aq, b_ak


@triton.jit
def level_sum(b_x8, b_x16, BC: tl.constexpr):
    """The product levels' [NB, BC, BC] tiles, each kept on its own pairs (chunk_common.level_pairs), summed."""
    o_i = tl.arange(0, BC)
    return (tl.where(level_pairs(o_i, o_i, 8)[None, :, :], b_x8, 0.0)
            + tl.where(level_pairs(o_i, o_i, 16)[None, :, :], b_x16, 0.0))


# Pairs inside blocks of NEAR_ROWS rows go elementwise (near_pairs), the ones across those blocks by the product
# levels 16 and 8. H200, 16 x 2048, strong decay, 2026-12-05 (bench/kda_ab.py, one round): scores 2.446 ms against
# 2.631 with the four product levels (16, 8, 4, 2) and 2.710 with 8-row blocks elementwise (only level 16 a
# product); the other gate regimes within 0.01 ms of the levels
NEAR_ROWS: tl.constexpr = tl.constexpr(4)


@triton.jit
def near_pairs(b_q, b_k, b_P, k, gP, bos, t0, T_n, i_h, i_hv, o_k,
               H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, D: tl.constexpr,
               W: tl.constexpr):
    """One channel step of the pairs (i, i - D) inside W-row blocks (i % W >= D): ``q_i k_j exp(gP_i - gP_j)`` and
    ``k_i k_j exp(gP_i - gP_j)`` summed over the step's channels, [BT] each (zero on other rows). The exponent is
    a difference of gate sums over at most W - 1 steps (<= 0), so each factor is exact at any gate; the key and
    gate rows of j are a second load of the chunk's rows shifted by D (L1 hits), not a product."""
    o_t = tl.arange(0, BT)
    m_t = ((o_t % W) >= D) & (t0 + o_t < T_n)                                    # [BT] rows with a pair
    o_j = tl.where(m_t, o_t - D, o_t)                                           # [BT] row j (any valid row else)
    m = m_t[:, None] & (o_k < K)[None, :]
    b_kj = tl.load(k + ((bos + t0) * H + i_h) * K + (o_j * (H * K))[:, None] + o_k[None, :], mask=m,
                   other=0.0).to(tl.float32)                                    # [BT, BKS]
    b_Pj = tl.load(gP + ((bos + t0) * HV + i_hv) * K + (o_j * (HV * K))[:, None] + o_k[None, :], mask=m,
                   other=0.0)                                                   # [BT, BKS]
    b_kj = b_kj * fast_exp(tl.where(m, b_P - b_Pj, 0.0))
    return tl.sum(b_q * b_kj, 1), tl.sum(b_k * b_kj, 1)


@triton.jit
def off_diagonal(b_x, D: tl.constexpr, BT: tl.constexpr):
    """[BT] values -> the [BT, BT] tile holding b_x[i] at (i, i - D), zero elsewhere."""
    o_t = tl.arange(0, BT)
    return tl.where(o_t[None, :] == (o_t - D)[:, None], b_x[:, None], 0.0)


@triton.jit
def block_diagonal(b_x, BT: tl.constexpr, BC: tl.constexpr):
    """[NB, BC, BC] blocks -> the [BT, BT] tile holding them on its diagonal, zero elsewhere."""
    NB: tl.constexpr = BT // BC
    o_b = tl.arange(0, NB)
    m_e = (o_b[:, None] == o_b[None, :])[:, None, :, None]                # [NB, 1, NB, 1]
    return tl.reshape(tl.where(m_e, b_x[:, :, None, :], 0.0), [BT, BT])


@triton.jit
def diagonal_step_tiles(q, k, gP, bos, t0, T_n, i_h, i_hv, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
                        BT: tl.constexpr, o_k):
    """A diagonal pass's tiles at channels o_k: gP, and k and q as float32, [BT, len(o_k)] each."""
    b_P = load_rows(gP, bos, t0, T_n, i_hv, HV, K, o_k, BT)
    b_k = load_rows(k, bos, t0, T_n, i_h, H, K, o_k, BT).to(tl.float32)
    b_q = load_rows(q, bos, t0, T_n, i_h, H, K, o_k, BT).to(tl.float32)
    return b_P, b_k, b_q


@triton.jit
def diagonal_levels(
    q, k, gP, bos, t0, T_n, i_h, i_hv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BKS: tl.constexpr,
    PREC: tl.constexpr,
):
    """The diagonal 16x16 blocks of (Aqk, Akk) of a chunk :func:`blocked_scores` takes, float32 inputs, exact at
    any gate (e.g. padding gates of -1000): [BT, BT] float32 tiles, zero off the diagonal blocks and above the
    diagonal (and on it for Akk).

    Every pair j < i of a block that crosses a 4-row boundary is covered by exactly one level S = 16, 8 (the same
    S-row block, i in its upper half, j in its lower half: chunk_common.level_pairs) and factored through the last
    row r of that lower half, ``exp(gP_i - gP_j) = exp(gP_i - gP_r) exp(gP_r - gP_j)`` with j <= r < i, so both
    factors are <= 1 (chunk_common.level_factor): nothing overflows at any gate, and a factor underflows only where
    the exact one does. Each level is one batched tensor-core product per matrix and channel step over the chunk's
    four 16-row sub-blocks ([NB, BC, BKS] x [NB, BKS, BC]: a quarter of a [BT, BT] product's work), rows
    ``q_i f_i`` (``k_i f_i``) of upper halves against columns ``k_j f_j`` of lower halves; each level accumulates
    into tiles of its own, kept on its own pairs at the end (the product also pairs rows and columns of different
    S-row blocks: finite, every factor <= 1, and dropped there). The pairs inside 4-row blocks (offsets 1-3, six
    per block) go elementwise on the CUDA cores (:func:`near_pairs`), where levels 4 and 2 took two more batched
    products each with their layout changes. All share one pass over the channels (the tiles are loaded once a
    step). Aqk's diagonal is ``q_i . k_i`` (factor 1), summed in float32."""
    NEAR: tl.constexpr = NEAR_ROWS         # 4: level 8 holds the pairs across 4-row blocks of an 8-row block
    NB: tl.constexpr = BT // BC
    o_t = tl.arange(0, BT)
    o_w = tl.arange(0, NEAR)
    b_q8 = tl.zeros([NB, BC, BC], dtype=tl.float32)
    b_k8 = tl.zeros([NB, BC, BC], dtype=tl.float32)
    b_q16 = tl.zeros([NB, BC, BC], dtype=tl.float32)
    b_k16 = tl.zeros([NB, BC, BC], dtype=tl.float32)
    b_nq = tl.zeros([BT, NEAR], dtype=tl.float32)          # column D: the pair (i, i - D) of row i
    b_nk = tl.zeros([BT, NEAR], dtype=tl.float32)
    b_d = tl.zeros([BT], dtype=tl.float32)
    for c0 in range(0, K, BKS):
        o_k = c0 + tl.arange(0, BKS)
        b_P, b_k, b_q = diagonal_step_tiles(q, k, gP, bos, t0, T_n, i_h, i_hv, H, HV, K, BT, o_k)
        b_d += tl.sum(b_q * b_k, 1)
        for D in tl.static_range(1, NEAR):
            b_aj, b_kj = near_pairs(b_q, b_k, b_P, k, gP, bos, t0, T_n, i_h, i_hv, o_k, H, HV, K, BT, D, NEAR)
            b_nq += tl.where((o_w == D)[None, :], b_aj[:, None], 0.0)
            b_nk += tl.where((o_w == D)[None, :], b_kj[:, None], 0.0)
        b_q8, b_k8 = level_products(b_q8, b_k8, b_q, b_k, gP, b_P, bos, t0, T_n, i_hv, o_k,
                                    HV, K, BT, BC, BKS, PREC, 8)
        b_q16, b_k16 = level_products(b_q16, b_k16, b_q, b_k, gP, b_P, bos, t0, T_n, i_hv, o_k,
                                      HV, K, BT, BC, BKS, PREC, 16)
    b_aq = block_diagonal(level_sum(b_q8, b_q16, BC), BT, BC)
    b_ak = block_diagonal(level_sum(b_k8, b_k16, BC), BT, BC)
    for D in tl.static_range(1, NEAR):
        b_aq += off_diagonal(tl.sum(tl.where((o_w == D)[None, :], b_nq, 0.0), 1), D, BT)
        b_ak += off_diagonal(tl.sum(tl.where((o_w == D)[None, :], b_nk, 0.0), 1), D, BT)
    return b_aq + tl.where(o_t[:, None] == o_t[None, :], b_d[:, None], 0.0), b_ak


@triton.jit
def clamped_diagonal(
    q, k, gP, bos, t0, T_n, i_h, i_hv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BKS: tl.constexpr,
    PREC: tl.constexpr,
):
    """The diagonal 16x16 blocks of (Aqk, Akk) of a chunk :func:`blocked_scores` takes, 16-bit inputs: per matrix
    and step one batched product over the chunk's four sub-blocks ([NB, BC, BKS] x [NB, BKS, BC], a quarter of a
    [BT, BT] product's work) through :func:`clamped_diagonal_factors`. Returns [BT, BT] float32 tiles, zero off the
    diagonal blocks and above the diagonal. A loop of its own after the chunk's other products, as
    :func:`diagonal_levels` is for float32, so that neither loop holds the other's tiles. BKS = 16 channels a step
    (H100, 16 x 2048, strong decay: scores 2.21 ms against 2.34 with 32-channel steps and 2.46 with the
    reference-row levels, with an earlier form of the blocked path)."""
    NB: tl.constexpr = BT // BC
    b_aq = tl.zeros([NB, BC, BC], dtype=tl.float32)
    b_ak = tl.zeros([NB, BC, BC], dtype=tl.float32)
    for c0 in range(0, K, BKS):
        o_k = c0 + tl.arange(0, BKS)
        b_P, b_k, b_q = diagonal_step_tiles(q, k, gP, bos, t0, T_n, i_h, i_hv, H, HV, K, BT, o_k)
        b_aq, b_ak = clamped_step(b_aq, b_ak, b_q, b_k, b_P, gP, bos, t0, T_n, i_hv, HV, K, o_k, BT, BC, PREC)
    return clamped_blocks(b_aq, b_ak, BT, BC)


@triton.jit
def clamped_step(b_aq, b_ak, b_q, b_k, b_P, gP, bos, t0, T_n, i_hv, HV: tl.constexpr, K: tl.constexpr, o_k,
                 BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr):
    """One channel step of :func:`clamped_diagonal` from the step's q, k, gP tiles ([BT, BKS] float32), added to
    its [NB, BC, BC] tiles."""
    NB: tl.constexpr = BT // BC
    BKS: tl.constexpr = b_P.shape[1]
    b_rf, b_cf = clamped_diagonal_factors(gP, b_P, bos, t0, T_n, i_hv, HV, K, o_k, BT, BC, "tf32")   # [BT, BKS] x2
    b_ct = tl.trans(tl.reshape(tf32_operand(b_k * b_cf, PREC), [NB, BC, BKS]), 0, 2, 1)     # [NB, BKS, BC]
    b_aq = mm_rounded(tl.reshape(tf32_operand(b_q * b_rf, PREC), [NB, BC, BKS]), b_ct, b_aq, PREC)
    b_ak = mm_rounded(tl.reshape(tf32_operand(b_k * b_rf, PREC), [NB, BC, BKS]), b_ct, b_ak, PREC)
    return b_aq, b_ak


@triton.jit
def clamped_blocks(b_aq, b_ak, BT: tl.constexpr, BC: tl.constexpr):
    """:func:`clamped_diagonal`'s [NB, BC, BC] tiles -> [BT, BT] tiles, zero off the diagonal blocks and above the
    diagonal (pairs above it may have overflowed: only ever selected away)."""
    o_i = tl.arange(0, BC)
    m_low = (o_i[:, None] >= o_i[None, :])[None, :, :]                      # [1, BC, BC] j <= i
    return (block_diagonal(tl.where(m_low, b_aq, 0.0), BT, BC),
            block_diagonal(tl.where(m_low, b_ak, 0.0), BT, BC))


@triton.jit
def block_subdiagonal(b_x, BT: tl.constexpr, BC: tl.constexpr):
    """[NB, BC, BC] blocks -> the [BT, BT] tile holding block I at rows I BC.., columns (I - 1) BC.. (block 0
    dropped), zero elsewhere."""
    NB: tl.constexpr = BT // BC
    o_b = tl.arange(0, NB)
    m_e = (o_b[:, None] == o_b[None, :] + 1)[:, None, :, None]            # [NB, 1, NB, 1]
    return tl.reshape(tl.where(m_e, b_x[:, :, None, :], 0.0), [BT, BT])


@triton.jit
def banded_scores(
    q, k, gP, bos, t0, T_n, i_h, i_hv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BKS: tl.constexpr,
    PREC: tl.constexpr,
):
    """Aqk and Akk of a chunk of 16-bit inputs whose gate falls by more than BAND_LIMIT over sub-blocks 1 and 2 in
    every channel (chunk_common.sub_blocks_far): a pair two or more sub-blocks apart then has every factor
    below exp(-BAND_LIMIT) and is left at zero (see BAND_LIMIT), so per channel step two batched products per
    matrix over the four sub-blocks ([NB, BC, BKS] x [NB, BKS, BC] each, a quarter of a [BT, BT] product's work):

    * the diagonal blocks, through clamped gate steps (:func:`clamped_step`, as :func:`clamped_diagonal`);
    * the blocks (I, I - 1) below them, through the row r before sub-block I: rows ``q_i exp(G_i - G_r) =
      q_i exp(gP_i)``, columns ``k_j exp(G_r - G_j) = k_j exp(tot_J - gP_j)``, both factors <= 1; the column rows
      are a second load of the chunk's k and gP rows shifted by BC (cache hits), so that block I - 1's rows sit in
      batch I.

    Returns [BT, BT] float32 tiles, zero above the diagonal and off the three bands."""
    NB: tl.constexpr = BT // BC
    o_t = tl.arange(0, BT)
    s_r = (o_t // BC)[:, None]                                              # [BT, 1] sub-block of each row
    m_s = ((o_t >= BC) & (t0 + o_t - BC < T_n))[:, None]                    # [BT, 1] shifted rows in the sequence
    b_dq = tl.zeros([NB, BC, BC], dtype=tl.float32)
    b_dk = tl.zeros([NB, BC, BC], dtype=tl.float32)
    b_sq = tl.zeros([NB, BC, BC], dtype=tl.float32)
    b_sk = tl.zeros([NB, BC, BC], dtype=tl.float32)
    o_s = tl.where(o_t >= BC, o_t - BC, 0)                                  # [BT] row of the shifted load
    for c0 in range(0, K, BKS):
        o_k = c0 + tl.arange(0, BKS)
        m = m_s & (o_k < K)[None, :]
        b_P, b_k, b_q = diagonal_step_tiles(q, k, gP, bos, t0, T_n, i_h, i_hv, H, HV, K, BT, o_k)
        b_dq, b_dk = clamped_step(b_dq, b_dk, b_q, b_k, b_P, gP, bos, t0, T_n, i_hv, HV, K, o_k, BT, BC, PREC)
        b_Ps = tl.load(gP + ((bos + t0) * HV + i_hv) * K + (o_s * (HV * K))[:, None] + o_k[None, :], mask=m,
                       other=0.0)                                           # [BT, BKS] gP of block I - 1 in batch I
        b_ks = tl.load(k + ((bos + t0) * H + i_h) * K + (o_s * (H * K))[:, None] + o_k[None, :], mask=m,
                       other=0.0).to(tl.float32)                            # [BT, BKS]
        b_t0, b_t1, b_t2, _ = sub_block_totals(gP, bos, t0, T_n, i_hv, HV, K, o_k, BC)   # [BKS] x3
        b_tot = tl.where(s_r == 1, b_t0[None, :], tl.where(s_r == 2, b_t1[None, :], b_t2[None, :]))   # tot_{I-1}
        b_cs = tl.where(m, b_ks * fast_exp(tl.where(m, b_tot - b_Ps, 0.0)), 0.0)            # [BT, BKS]
        b_ct = tl.trans(tl.reshape(tf32_operand(b_cs, PREC), [NB, BC, BKS]), 0, 2, 1)     # [NB, BKS, BC]
        b_rho = fast_exp(b_P)                                               # [BT, BKS] exp(G_i - G_r)
        b_sq = mm_rounded(tl.reshape(tf32_operand(b_q * b_rho, PREC), [NB, BC, BKS]), b_ct, b_sq, PREC)
        b_sk = mm_rounded(tl.reshape(tf32_operand(b_k * b_rho, PREC), [NB, BC, BKS]), b_ct, b_sk, PREC)
    b_aq, b_ak = clamped_blocks(b_dq, b_dk, BT, BC)
    return b_aq + block_subdiagonal(b_sq, BT, BC), b_ak + block_subdiagonal(b_sk, BT, BC)


@triton.jit
def row_links(b_e1, b_e2, s_r, J: tl.constexpr):
    """``exp(G_r - G_e)`` for each row (r: the row before its block I; e: column block J's last row), [BT, W] from
    ``exp(tot_1)``, ``exp(tot_2)`` ([1, W] each) and ``s_r`` ([BT, 1], each row's block): the gate summed over the
    blocks strictly between J and I, which can only be 1 and 2, as products of per-channel factors <= 1, never a
    difference; zero on the rows with I <= J, which take no column of J."""
    b_l = tl.where(s_r > J, 1.0, 0.0)
    if J < 1:
        b_l = b_l * tl.where(s_r > 1, b_e1, 1.0)
    if J < 2:
        b_l = b_l * tl.where(s_r > 2, b_e2, 1.0)
    return b_l


@triton.jit
def column_block(b_x, J: tl.constexpr):
    """Rows J BC .. (J + 1) BC of a [4 BC, W] tile, [BC, W] (register splits, no memory)."""
    b_lo, b_hi = row_halves(b_x)
    if J < 2:
        b_a, b_b = row_halves(b_lo)
    else:
        b_a, b_b = row_halves(b_hi)
    if J % 2 == 0:
        return b_a
    return b_b


@triton.jit
def block_products(b_acq, b_ack, b_qr, b_kr, b_kap, b_e1, b_e2, s_r, J: tl.constexpr, PREC: tl.constexpr):
    """Column block J against the rows after it, added to its [BT, BC] tiles: rows ``q_i exp(G_i - G_r)``
    (``k_i ...``) times :func:`row_links`, columns ``k_j exp(G_e - G_j)`` of J's rows, all factors <= 1."""
    b_c = tl.trans(tf32_operand(column_block(b_kap, J), PREC))             # [W, BC]
    b_l = row_links(b_e1, b_e2, s_r, J)                                    # [BT, W]
    b_acq = mm_rounded(tf32_operand(b_qr * b_l, PREC), b_c, b_acq, PREC)
    b_ack = mm_rounded(tf32_operand(b_kr * b_l, PREC), b_c, b_ack, PREC)
    return b_acq, b_ack


# Channels per step of blocked_scores' products, a launch step of 32 (or more) taken as two halves split in
# registers. Chosen for the batched form before the column blocks (H100, 16 x 2048, strong decay, 2026-12-05,
# bench/kda_ab.py: scores 1.549 ms against 1.903 with 32-channel products); the column blocks were timed at 16
# only (1.305 ms). The by-halves path stays for chunks bounded per sub-block, where the batched form took 1.093 ms
# against its 0.859 (K3's saturated gates)
BLOCKED_STEP: tl.constexpr = tl.constexpr(16)


@triton.jit
def blocked_step(b_q0, b_q1, b_q2, b_k0, b_k1, b_k2, b_q, b_k, b_P, b_t0, b_t1, b_t2, b_t3,
                 BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr):
    """One channel step of :func:`blocked_scores` from the step's q, k, gP tiles ([BT, W] float32) and sub-block
    totals ([W] each): column blocks 0-2 against the rows after them into [BT, BC] tiles (b_q0 ... b_k2, three
    [BT, W] x [W, BC] products per matrix)."""
    s_r = (tl.arange(0, BT) // BC)[:, None]                                # [BT, 1] sub-block of each row
    b_rho = fast_exp(b_P)                                                  # [BT, W] exp(G_i - G_r)
    b_qr = b_q * b_rho
    b_kr = b_k * b_rho
    b_kap = b_k * fast_exp(own_totals(b_t0, b_t1, b_t2, b_t3, s_r) - b_P)  # [BT, W] k_j exp(G_e - G_j)
    b_e1 = fast_exp(b_t1)[None, :]                                         # [1, W] the links' factors, once a step
    b_e2 = fast_exp(b_t2)[None, :]
    b_q0, b_k0 = block_products(b_q0, b_k0, b_qr, b_kr, b_kap, b_e1, b_e2, s_r, 0, PREC)
    b_q1, b_k1 = block_products(b_q1, b_k1, b_qr, b_kr, b_kap, b_e1, b_e2, s_r, 1, PREC)
    b_q2, b_k2 = block_products(b_q2, b_k2, b_qr, b_kr, b_kap, b_e1, b_e2, s_r, 2, PREC)
    return b_q0, b_q1, b_q2, b_k0, b_k1, b_k2


@triton.jit
def blocked_scores(
    q, k, gP, bos, t0, T_n, i_h, i_hv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BKS: tl.constexpr, PREC: tl.constexpr,
    d_q, d_k, d_gP, TMA: tl.constexpr,
):
    """Aqk and Akk of a chunk that is not separable, at any gate, with the reference of row block I at the row r
    before it and of column block J at its last row e:

    * below the diagonal blocks, per step of BLOCKED_STEP channels (:func:`blocked_step`; half the launch's BKS if
      that is larger) and column block J < 3, one [BT, 16] x [16, 16] product of all rows against J's columns:
      rows ``q_i exp(G_i - G_r) link(I, J) = q_i exp(gP_i) exp(G_r - G_e)`` (:func:`row_links`, zero on rows of
      blocks I <= J), columns ``k_j exp(G_e - G_j) = k_j exp(tot_J - gP_j)``: every factor <= 1, nothing
      overflows, and a factor underflows only where the exact one does;
    * the diagonal blocks after that in a pass of their own (:func:`clamped_diagonal` for 16-bit inputs,
      :func:`diagonal_levels` for float32).

    Returns the [BT, BT] float32 tiles (Aqk, Akk), valid on and below the diagonal (:func:`store_scores` masks
    the rest)."""
    tl.static_assert(BT == 4 * BC)
    HALF: tl.constexpr = BKS >= 2 * BLOCKED_STEP            # the launch's tiles in two halves, split in registers
    b_q0 = tl.zeros([BT, BC], dtype=tl.float32)                            # column block 0, every row
    b_q1 = tl.zeros([BT, BC], dtype=tl.float32)
    b_q2 = tl.zeros([BT, BC], dtype=tl.float32)
    b_k0 = tl.zeros([BT, BC], dtype=tl.float32)
    b_k1 = tl.zeros([BT, BC], dtype=tl.float32)
    b_k2 = tl.zeros([BT, BC], dtype=tl.float32)
    for c0 in range(0, K, BKS):
        o_k = c0 + tl.arange(0, BKS)
        b_P = chunk_tile(gP, d_gP, bos, t0, T_n, i_hv, HV, K, c0, BKS, BT, TMA)              # [BT, BKS]
        b_t0, b_t1, b_t2, b_t3 = sub_block_totals(gP, bos, t0, T_n, i_hv, HV, K, o_k, BC)   # [BKS] x4
        b_k = chunk_tile(k, d_k, bos, t0, T_n, i_h, H, K, c0, BKS, BT, TMA).to(tl.float32)   # [BT, BKS]
        b_q = chunk_tile(q, d_q, bos, t0, T_n, i_h, H, K, c0, BKS, BT, TMA).to(tl.float32)   # [BT, BKS]
        if HALF:
            b_P0, b_P1 = channel_halves(b_P)
            b_y0, b_y1 = channel_halves(b_k)
            b_x0, b_x1 = channel_halves(b_q)
            b_a0, b_a1 = vector_halves(b_t0)
            b_b0, b_b1 = vector_halves(b_t1)
            b_c0, b_c1 = vector_halves(b_t2)
            b_d0, b_d1 = vector_halves(b_t3)
            b_q0, b_q1, b_q2, b_k0, b_k1, b_k2 = blocked_step(
                b_q0, b_q1, b_q2, b_k0, b_k1, b_k2, b_x0, b_y0, b_P0, b_a0, b_b0, b_c0, b_d0, BT, BC, PREC)
            b_q0, b_q1, b_q2, b_k0, b_k1, b_k2 = blocked_step(
                b_q0, b_q1, b_q2, b_k0, b_k1, b_k2, b_x1, b_y1, b_P1, b_a1, b_b1, b_c1, b_d1, BT, BC, PREC)
        else:
            b_q0, b_q1, b_q2, b_k0, b_k1, b_k2 = blocked_step(
                b_q0, b_q1, b_q2, b_k0, b_k1, b_k2, b_q, b_k, b_P, b_t0, b_t1, b_t2, b_t3, BT, BC, PREC)
    b_z = tl.zeros([BT, BC], dtype=tl.float32)
    b_aq = side_by_side(b_q0, b_q1, b_q2, b_z)                             # [BT, BT] zero on and above the diagonal
    b_ak = side_by_side(b_k0, b_k1, b_k2, b_z)                             # blocks
    if PREC == "tf32":
        b_sq, b_sk = clamped_diagonal(q, k, gP, bos, t0, T_n, i_h, i_hv, H, HV, K, BT, BC, 16, PREC)
    else:
        b_sq, b_sk = diagonal_levels(q, k, gP, bos, t0, T_n, i_h, i_hv, H, HV, K, BT, BC, 16, PREC)
    return b_aq + b_sq, b_ak + b_sk


@triton.jit
def separable_scores(
    q, k, gP, bos, t0, T_n, i_h, i_hv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BKS: tl.constexpr, PREC: tl.constexpr,
    d_q, d_k, d_gP, TMA: tl.constexpr,
):
    """The scores of a chunk that :func:`chunk_separable` accepts (the common case): with
    ``D_i = G_i - R`` (chunk_common.separable_exponent), ``exp(G_i - G_j) = exp(D_i) exp(-D_j)``, so each channel
    step is one product of rows ``q_i exp(D_i)`` (``k_i exp(D_i)``) and columns ``k_j exp(-D_j)``. Kept pairs
    (j <= i) are <= 1; the dropped ones (j > i) may overflow, and are only ever selected away. ``TMA``
    (LaunchConfig.scores_tma): the q, k and gP tiles through the descriptors ``d_*``
    (:func:`chunk_tile`)."""
    o_t = tl.arange(0, BT)
    s_r = (o_t // BC)[:, None]                                             # [BT, 1] sub-block of each row
    b_aq = tl.zeros([BT, BT], dtype=tl.float32)
    b_ak = tl.zeros([BT, BT], dtype=tl.float32)
    for c0 in range(0, K, BKS):
        o_k = c0 + tl.arange(0, BKS)
        if TMA:
            b_t0, b_t1, b_t2, _ = sub_block_totals(gP, bos, t0, T_n, i_hv, HV, K, o_k, BC)   # [BKS] x3
            b_D = separable_offset(chunk_tile(gP, d_gP, bos, t0, T_n, i_hv, HV, K, c0, BKS, BT, TMA),
                                   b_t0, b_t1, b_t2, s_r)                  # [BT, BKS]
        else:
            b_D = separable_exponent(gP, bos, t0, T_n, i_hv, HV, K, o_k, s_r, BT, BC)   # [BT, BKS]
        b_er = fast_exp(b_D)                                               # [BT, BKS]
        b_k = chunk_tile(k, d_k, bos, t0, T_n, i_h, H, K, c0, BKS, BT, TMA).to(tl.float32)   # [BT, BKS]
        b_ct = tl.trans(tf32_operand(b_k * fast_exp(-b_D), PREC))          # [BKS, BT]
        b_q = chunk_tile(q, d_q, bos, t0, T_n, i_h, H, K, c0, BKS, BT, TMA).to(tl.float32)   # [BT, BKS]
        b_aq = mm_rounded(tf32_operand(b_q * b_er, PREC), b_ct, b_aq, PREC)
        b_ak = mm_rounded(tf32_operand(b_k * b_er, PREC), b_ct, b_ak, PREC)
    return b_aq, b_ak


# The forward's bound on a sub-block's fall for the halves path: its rows of half 1 carry exp(D) up to exp(60)
# against columns across the halves <= 1, so a column factor that underflows (below exp(-87)) drops a term below
# exp(-27); at 80 (HALF_LIMIT, the score gradients' bound) that would be exp(-7). Two products a step where
# three ran with the bound at 80 (H100, 16 x 2048, bench/kda_ab.py: K3's saturated gates' scores 0.855 -> 0.748 ms;
# the mild regimes' within 0.015 ms)
HALVES_LIMIT: tl.constexpr = tl.constexpr(60.0)


@triton.jit
def halves_scores(
    q, k, gP, bos, t0, T_n, i_h, i_hv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BKS: tl.constexpr, PREC: tl.constexpr,
    d_q, d_k, d_gP, TMA: tl.constexpr,
):
    """The scores of a chunk whose every sub-block's gate sum is above -HALVES_LIMIT
    (chunk_common.sub_blocks_fall_little) but that is not separable as a whole, two products per matrix and
    channel step with rows ``q_i exp(D_i)`` (``k_i exp(D_i)``), ``D = G - R`` and R the last row of the row's
    half's first sub-block (row 15 or 47), so ``D = gP - tot`` on sub-blocks 0 and 2 and ``D = gP`` on 1 and 3
    (|D| < HALVES_LIMIT, no sum over more than 16 rows):

    * rows of half 0 against columns ``k_j exp(-D_j)``;
    * rows of half 1 against the same columns of half 1 and, across the halves, columns of half 0 referred to row
      47 as well: ``k_j exp(G_47 - G_j) = k_j exp(X_j + tot_2)`` (X: chunk_common.halves_exponents), <= 1.

    Only dropped entries (j > i) can overflow, as in :func:`separable_scores`. A factor across the halves underflows
    at most HALVES_LIMIT above where the exact one does: below exp(HALVES_LIMIT - 87) = 1.9e-12."""
    o_t = tl.arange(0, BT)
    s_r = (o_t // BC)[:, None]                                             # [BT, 1] sub-block of each row
    m_h1 = s_r >= 2                                                        # [BT, 1] rows of half 1
    b_aq = tl.zeros([BT, BT], dtype=tl.float32)
    b_ak = tl.zeros([BT, BT], dtype=tl.float32)
    for c0 in range(0, K, BKS):
        o_k = c0 + tl.arange(0, BKS)
        b_P = chunk_tile(gP, d_gP, bos, t0, T_n, i_hv, HV, K, c0, BKS, BT, TMA)           # [BT, BKS]
        b_t0, b_t1, b_t2, _ = sub_block_totals(gP, bos, t0, T_n, i_hv, HV, K, o_k, BC)   # [BKS] x3
        b_D, b_X = halves_exponents(b_P, b_t0, b_t1, b_t2, s_r)                # [BT, BKS] x2
        b_k = chunk_tile(k, d_k, bos, t0, T_n, i_h, H, K, c0, BKS, BT, TMA).to(tl.float32)   # [BT, BKS]
        b_q = chunk_tile(q, d_q, bos, t0, T_n, i_h, H, K, c0, BKS, BT, TMA).to(tl.float32)   # [BT, BKS]
        b_kc = b_k * fast_exp(-b_D)                                        # [BT, BKS] same-half columns
        b_c0 = tl.trans(tf32_operand(b_kc, PREC))                          # [BKS, BT] for rows of half 0
        b_c1 = tl.trans(tf32_operand(tl.where(m_h1, b_kc, b_k * fast_exp(b_X + b_t2[None, :])), PREC))
        b_eD = fast_exp(b_D)
        b_qr = tf32_operand(b_q * b_eD, PREC)                              # [BT, BKS]
        b_kr = tf32_operand(b_k * b_eD, PREC)
        b_aq = mm_rounded(tl.where(m_h1, 0.0, b_qr), b_c0, b_aq, PREC)
        b_aq = mm_rounded(tl.where(m_h1, b_qr, 0.0), b_c1, b_aq, PREC)
        b_ak = mm_rounded(tl.where(m_h1, 0.0, b_kr), b_c0, b_ak, PREC)
        b_ak = mm_rounded(tl.where(m_h1, b_kr, 0.0), b_c1, b_ak, PREC)
    return b_aq, b_ak


@triton.jit
def chunk_kda_fwd_scores_kernel(
    q, k, gP, rq, rk,                 # [B, T, H, K] x2, [B, T, HV, K] f32, [B, T, H] f32 x2 (l2norm only)
    Aqk, Akk,                         # out: [B, T, HV, BT] each (Akk float32, without beta)
    cu_seqlens, chunk_indices,        # varlen only
    T, NT,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    BKS: tl.constexpr, IS_VARLEN: tl.constexpr, USE_QK_L2NORM: tl.constexpr, PREC: tl.constexpr,
    SEPARABLE: tl.constexpr, HALVES: tl.constexpr,
    d_q, d_k, d_gP, TMA: tl.constexpr,  # tensor descriptors (LaunchConfig.scores_tma), else the tensors again
):
    """The chunks :func:`chunk_separable` accepts (``SEPARABLE``), or the others: launches that evaluate the
    same tests on the same numbers, so every chunk is written exactly once, and each compiles only its own path
    (the separable one in 160 registers a thread, the other capped at 168). ``HALVES`` (16-bit inputs): of the
    others, those that chunk_common.sub_blocks_kind finds bounded per sub-block by :func:`halves_scores` (in this
    launch; a launch of their own measured slower on the H200: 0.95 against 0.90 ms), those it finds far by
    :func:`banded_scores`, the rest by :func:`blocked_scores`; without it (float32 inputs) all by
    :func:`blocked_scores`."""
    i_c, _, i_hv = grid_coords(1, HV)
    _, i_t, bos, T_n = chunk_coords(i_c, cu_seqlens, chunk_indices, T, NT, IS_VARLEN)
    t0, i_h = i_t * BT, i_hv // (HV // H)
    sep = chunk_separable(gP, bos, t0, T_n, i_hv, HV, K, BK, BC)
    if SEPARABLE:
        if sep:
            b_aq, b_ak = separable_scores(q, k, gP, bos, t0, T_n, i_h, i_hv, H, HV, K, BT, BC, BKS,
                                          PREC, d_q, d_k, d_gP, TMA)
            finish_scores(q, k, rq, rk, Aqk, Akk, b_aq, b_ak, bos, t0, T_n, i_h, i_hv, H, HV, K, BT, BKS, USE_QK_L2NORM)
    elif not sep:
        bounded, banded = False, False
        if HALVES:                                          # 16-bit inputs
            bounded, banded = sub_blocks_kind(gP, bos, t0, T_n, i_hv, HV, K, BK, BC, HALVES_LIMIT)
        if bounded:
            b_aq, b_ak = halves_scores(q, k, gP, bos, t0, T_n, i_h, i_hv, H, HV, K, BT, BC, BKS, PREC,
                                       d_q, d_k, d_gP, TMA)
            finish_scores(q, k, rq, rk, Aqk, Akk, b_aq, b_ak, bos, t0, T_n, i_h, i_hv, H, HV, K, BT, BKS, USE_QK_L2NORM)
        elif banded:
            b_aq, b_ak = banded_scores(q, k, gP, bos, t0, T_n, i_h, i_hv, H, HV, K, BT, BC, 16, PREC)
            finish_scores(q, k, rq, rk, Aqk, Akk, b_aq, b_ak, bos, t0, T_n, i_h, i_hv, H, HV, K, BT, BKS, USE_QK_L2NORM)
        else:
            b_aq, b_ak = blocked_scores(q, k, gP, bos, t0, T_n, i_h, i_hv, H, HV, K, BT, BC, BKS, PREC,
                                        d_q, d_k, d_gP, TMA)
            finish_scores(q, k, rq, rk, Aqk, Akk, b_aq, b_ak, bos, t0, T_n, i_h, i_hv, H, HV, K, BT, BKS, USE_QK_L2NORM)


@triton.jit
def finish_scores(q, k, rq, rk, Aqk, Akk, b_aq, b_ak, bos, t0, T_n, i_h, i_hv, H: tl.constexpr, HV: tl.constexpr,
                  K: tl.constexpr, BT: tl.constexpr, BKS: tl.constexpr, USE_QK_L2NORM: tl.constexpr):
    """Store a chunk's scores. With l2norm (``USE_QK_L2NORM``) the paths ran on raw q and k, and the l2norm enters
    here as ``Aqk = diag(rq) A diag(rk)``, ``Akk = diag(rk) A diag(rk)``; the program of
    the first value head of each q/k head also stores rq and rk for the later kernels (the prepare kernel then
    reads no q or k: 4 bytes per element less traffic, and q, k are in L2 here; H200, 2026-12-01, 16 x 2048:
    prepare 0.41 -> 0.28 ms softplus, 0.39 -> 0.21 lower_bound, scores +0.08 / +0.07)."""
    if USE_QK_L2NORM:
        b_rq = row_inv_norms(q, bos, t0, T_n, i_h, H, K, BT, BKS)          # [BT]
        b_rk = row_inv_norms(k, bos, t0, T_n, i_h, H, K, BT, BKS)
        b_aq = b_aq * b_rq[:, None] * b_rk[None, :]
        b_ak = b_ak * b_rk[:, None] * b_rk[None, :]
        store_row_norms(rq, rk, b_rq, b_rk, bos, t0, T_n, i_h, i_hv, H, HV, BT)
    store_scores(Aqk, Akk, b_aq, b_ak, bos, t0, T_n, i_hv, HV, BT)


@triton.jit
def load_A_block(Akk, b_beta, bos, t0, I: tl.constexpr, J: tl.constexpr, T_n, i_hv, HV: tl.constexpr,
                 BT: tl.constexpr, BC: tl.constexpr):
    """Block (I, J) of ``diag(beta) Akk``: [BC, BC] float32."""
    b_a = load_rows(Akk, bos, t0 + I * BC, T_n, i_hv, HV, BT, J * BC + tl.arange(0, BC), BC)
    return b_a * b_beta[:, None]


@triton.jit
def side_by_side(b_0, b_1, b_2, b_3):
    """Four [R, C] blocks side by side: [R, 4 C]."""
    b_x = tl.join(tl.join(b_0, b_1), tl.join(b_2, b_3))                  # [R, C, 2, 2]: block 2 o + i at [:, :, i, o]
    return tl.reshape(tl.permute(b_x, (0, 3, 2, 1)), (b_0.shape[0], 4 * b_0.shape[1]))


@triton.jit
def stacked(b_0, b_1, b_2, b_3):
    """Four [R, C] blocks one above the other: [4 R, C]."""
    b_x = tl.join(tl.join(b_0, b_1), tl.join(b_2, b_3))                  # [R, C, 2, 2]
    return tl.reshape(tl.permute(b_x, (3, 2, 0, 1)), (4 * b_0.shape[0], b_0.shape[1]))


@triton.jit
def inverse_blocks(
    beta, Akk, Tm, bos, t0, T_n, i_hv, HV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    USE_BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr, STORE_T: tl.constexpr,
):
    """``(I + diag(beta) Akk)^-1`` of the chunk at t0 from its Akk rows in memory, by 16x16 blocks: [BT, BT]
    float32, also stored in ``Tm`` with ``STORE_T`` (the backward reads it)."""
    tl.static_assert(BT == 4 * BC)

    # (I + diag(beta) Akk)^-1 by 16x16 blocks: Tm_II by substitution, Tm_IJ = -Tm_II sum_{J<=M<I} A_IM Tm_MJ.
    b_b1 = load_beta(beta, bos, t0 + BC, T_n, i_hv, HV, BC, USE_BETA_SIGMOID, NEG_EIGVAL)      # [BC]
    b_b2 = load_beta(beta, bos, t0 + 2 * BC, T_n, i_hv, HV, BC, USE_BETA_SIGMOID, NEG_EIGVAL)
    b_b3 = load_beta(beta, bos, t0 + 3 * BC, T_n, i_hv, HV, BC, USE_BETA_SIGMOID, NEG_EIGVAL)
    # The four diagonal blocks in one [4, BC, BC] substitution (H200: WY kernel 1.75 ms against 2.10 for four
    # [BC, BC] ones in turn)
    b_T = diagonal_block_inverses(Akk, beta, bos, t0, T_n, i_hv, HV, BT, BC, USE_BETA_SIGMOID, NEG_EIGVAL)
    b_T00 = block_of(b_T, 0)                                              # [BC, BC]
    b_T11 = block_of(b_T, 1)
    b_T22 = block_of(b_T, 2)
    b_T33 = block_of(b_T, 3)
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

    # One [BT, BT] tile assembled in registers: the WY products need no round trip through Tm, which only the
    # backward reads
    b_z = tl.zeros([BC, BC], dtype=tl.float32)
    b_T = stacked(side_by_side(b_T00, b_z, b_z, b_z), side_by_side(b_T10, b_T11, b_z, b_z),
                  side_by_side(b_T20, b_T21, b_T22, b_z), side_by_side(b_T30, b_T31, b_T32, b_T33))   # [BT, BT]
    if STORE_T:
        store_rows(Tm, b_T, bos, t0, T_n, i_hv, HV, BT, tl.arange(0, BT), BT)
    return b_T


@triton.jit
def wy_product(b_Th, b_x, PREC: tl.constexpr):
    """``Tm @ b_x`` ([BT, BT] x [BT, BKS] -> [BT, BKS] float32) for the WY factors, with ``b_Th`` from
    :func:`wy_inverse_operand`: tf32 operands for 16-bit inputs (``PREC`` "tf32"; one bf16 product as fla's w / u
    measured 0.16 ms faster on the H200 but doubled the output's error), exact for float32 (``PREC`` "ieee")."""
    return mm_rounded(b_Th, tf32_operand(b_x, PREC), tl.zeros_like(b_x), PREC)


@triton.jit
def wy_inverse_operand(b_T, PREC: tl.constexpr):
    """The inverse ([BT, BT] float32) rounded to tf32 once for the eight products (mm would round it again for
    each)."""
    return tf32_operand(b_T, PREC)


@triton.jit
def chunk_tile(p, d_p, bos, t0, T_n, i_h, NH: tl.constexpr, W: tl.constexpr, c0, BKS: tl.constexpr, BT: tl.constexpr,
               TMA: tl.constexpr):
    """Rows t0 .. t0 + BT of a ``[*, NH, W]`` tensor at columns c0 .. c0 + BKS of head i_h, zero past T_n: by
    pointers (:func:`chunk_common.load_rows`) or, with ``TMA``, through the tensor descriptor ``d_p`` over its
    [rows, NH * W] view (block [BT, BKS]; W a multiple of BKS), which Triton's software pipeliner can issue
    ``num_stages - 1`` steps ahead into shared memory (pointer loads that feed elementwise work first are not)."""
    if TMA:
        b_x = d_p.load([(bos + t0).to(tl.int32), i_h * W + c0])
        # rows past T_n are the next sequence's: no kept entry reads them (beta is 0 there, scores above the
        # diagonal are dropped), but zeros keep the tiles, and so every output bit, equal to the pointer loads'
        b_x = tl.where(((t0 + tl.arange(0, BT)) < T_n)[:, None], b_x, 0.0)
    else:
        b_x = load_rows(p, bos, t0, T_n, i_h, NH, W, c0 + tl.arange(0, BKS), BT)
    return b_x


@triton.jit
def wy_products(
    q, k, v, beta, gP, rq, rk, b_T, w, u, qg, kg, decay, i_c, bos, t0, T_n, i_h, i_hv,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BKS: tl.constexpr, BV: tl.constexpr, USE_QK_L2NORM: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr,
    NEG_EIGVAL: tl.constexpr, PREC: tl.constexpr, d_k, d_v, d_gP, TMA: tl.constexpr,
):
    """The WY factors of the chunk at t0 (flat chunk index i_c) from its inverse ``b_T`` ([BT, BT] float32): the
    key side (w, qg, kg, decay) and the value side (u). ``TMA`` (LaunchConfig.wy_tma): the k, v and gP tiles
    through tensor descriptors ``d_*`` (:func:`chunk_tile`); q always by pointers (below)."""
    b_beta = load_beta(beta, bos, t0, T_n, i_hv, HV, BT, USE_BETA_SIGMOID, NEG_EIGVAL)   # [BT]
    # w = Tm diag(beta) (k exp(G)) and u = Tm diag(beta) v: beta folded into the inverse's columns once per chunk
    b_Th = wy_inverse_operand(b_T * b_beta[None, :], PREC)                   # [BT, BT]
    b_rq, b_rk = load_norms(rq, rk, bos, t0, T_n, i_h, H, BT, USE_QK_L2NORM)             # [BT] x2
    for c0 in range(0, K, BKS):
        o_k = c0 + tl.arange(0, BKS)
        # q feeds no product, so Triton does not pipeline it: through a descriptor the step waited on its load at
        # once; by pointers, issued first, it overlaps the gate and k loads. Its rows still come from DRAM each
        # step, so the next step's rows are asked of L2 now (a load a step ahead held its tile and spilled)
        b_q = load_rows(q, bos, t0, T_n, i_h, H, K, o_k, BT)                 # [BT, BKS]
        prefetch_rows(q, bos, t0, T_n, i_h, H, K, tl.minimum(c0 + BKS, K - BKS), BT)
        if TMA:
            b_t0, b_t1, b_t2, b_t3 = sub_block_totals(gP, bos, t0, T_n, i_hv, HV, K, o_k, BC)   # [BKS] x4
            b_P = chunk_tile(gP, d_gP, bos, t0, T_n, i_hv, HV, K, c0, BKS, BT, TMA)          # [BT, BKS]
            b_G, b_Gs, b_GC = gate_terms(b_P, b_t0, b_t1, b_t2, b_t3, BT, BC)
        else:
            b_G, b_Gs, b_GC = chunk_gate_terms(gP, bos, t0, T_n, i_hv, HV, K, o_k, BT, BC)   # [BT, BKS] x2
        b_eG = fast_exp(b_G)
        b_k = chunk_tile(k, d_k, bos, t0, T_n, i_h, H, K, c0, BKS, BT, TMA).to(tl.float32) * b_rk[:, None]
        b_q = b_q.to(tl.float32) * b_rq[:, None]
        b_w = wy_product(b_Th, b_k * b_eG, PREC)
        store_rows(w, b_w, bos, t0, T_n, i_hv, HV, K, o_k, BT)
        store_rows(qg, b_q * b_eG, bos, t0, T_n, i_hv, HV, K, o_k, BT)
        store_rows(kg, b_k * fast_exp(b_Gs), bos, t0, T_n, i_hv, HV, K, o_k, BT)
        tl.store(decay + (i_c.to(tl.int64) * HV + i_hv) * K + o_k, tl.exp(b_GC), mask=o_k < K)
    # bf16 values: u by two bf16 products of v as loaded against the tf32 operand split in two (mm_split), the
    # same numbers as the tf32 product; other dtypes by wy_product
    SPLIT: tl.constexpr = PREC == "tf32" and v.dtype.element_ty == tl.bfloat16
    if SPLIT:
        b_Thi, b_Tlo = bf16_split(b_Th)                                      # [BT, BT] x2
    for c0 in range(0, V, BV):
        o_v = c0 + tl.arange(0, BV)
        b_v = chunk_tile(v, d_v, bos, t0, T_n, i_hv, HV, V, c0, BV, BT, TMA)                  # [BT, BV]
        if SPLIT:
            b_u = mm_split(b_Thi, b_Tlo, b_v)
        else:
            b_u = wy_product(b_Th, b_v.to(tl.float32), PREC)
        store_rows(u, b_u, bos, t0, T_n, i_hv, HV, V, o_v, BT)


@triton.jit
def chunk_kda_fwd_wy_kernel(
    q, k, v, beta, gP, rq, rk, Akk,   # inputs (Akk from the scores kernel)
    Tm, w, u, qg, kg, decay,          # out: [B, T, HV, BT] f32; [B, T, HV, K|V] (storage dtype); [NT, HV, K] f32
    cu_seqlens, chunk_indices,
    T, NT,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BKS: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_QK_L2NORM: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr,
    NEG_EIGVAL: tl.constexpr, PREC: tl.constexpr, STAGE: tl.constexpr, STORE_T: tl.constexpr,
    d_k, d_v, d_gP, TMA: tl.constexpr,  # tensor descriptors (LaunchConfig.wy_tma), else the tensors again
):
    """The inverse and the WY factors of a chunk (``STAGE`` 0; the inverse stored in ``Tm`` with ``STORE_T``), or
    the WY factors alone from an inverse kept from the forward (``STAGE`` 2: the backward's recomputation)."""
    i_c, _, i_hv = grid_coords(1, HV)
    _, i_t, bos, T_n = chunk_coords(i_c, cu_seqlens, chunk_indices, T, NT, IS_VARLEN)
    t0 = i_t * BT
    if STAGE == 0:
        b_T = inverse_blocks(beta, Akk, Tm, bos, t0, T_n, i_hv, HV, BT, BC, USE_BETA_SIGMOID, NEG_EIGVAL, STORE_T)
    else:
        b_T = load_rows(Tm, bos, t0, T_n, i_hv, HV, BT, tl.arange(0, BT), BT)      # [BT, BT]
    wy_products(q, k, v, beta, gP, rq, rk, b_T, w, u, qg, kg, decay, i_c, bos, t0, T_n, i_hv // (HV // H), i_hv,
                H, HV, K, V, BT, BC, BKS, BV, USE_QK_L2NORM, USE_BETA_SIGMOID, NEG_EIGVAL, PREC,
                d_k, d_v, d_gP, TMA)
