"""Chunk pipeline, stage (a): the gate in 16-row sub-block sums.

One program per (chunk, value head). It applies the gate formula (``use_gate_in_kernel``) to the raw gate and stores
``gP``, the inclusive sum of the gate inside each 16-row sub-block (float32; see chunk_common.py for how every
later kernel turns it into decay factors without overflow or large-sum cancellation). It reads only the gate: the
l2norm row factors ``rq = 1 / sqrt(sum q^2 + 1e-6)`` and ``rk`` come from the scores kernel
(chunk_wy.finish_scores), and later kernels multiply rows of q and k by them as they load, so normalised copies of
q and k never go to memory.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .chunk_common import HALF_LIMIT, chunk_coords, grid_coords, load_rows, store_rows
from .transforms import kda_gate


@triton.jit
def sub_block_gate(g, b_bias, b_a, lower_bound, bos, r0, T_n, i_hv, HV: tl.constexpr, K: tl.constexpr, o_k,
                   BC: tl.constexpr, USE_GATE: tl.constexpr, USE_LOWER_BOUND: tl.constexpr):
    """The log decay of rows r0 .. r0 + BC ([BC, BK] float32): the gate formula on the raw gate, zero on rows past
    the sequence end (their gate would otherwise be softplus(dt_bias)) and on channels past K."""
    m = ((r0 + tl.arange(0, BC)) < T_n)[:, None] & (o_k < K)[None, :]
    b_g = load_rows(g, bos, r0, T_n, i_hv, HV, K, o_k, BC).to(tl.float32)      # [BC, BK]
    if USE_GATE:
        b_g = kda_gate(b_g, b_bias[None, :], b_a, lower_bound, USE_LOWER_BOUND)
    return tl.where(m, b_g, 0.0)


@triton.jit
def chunk_kda_prepare_kernel(
    g,                                # [B, T, HV, K] raw (or log) gate
    A_log, dt_bias,                   # [HV], [HV, K]: the in-kernel gate's parameters
    gP, separable,                    # out: [B, T, HV, K] float32; [NT, HV] int8
    cu_seqlens, chunk_indices,        # [N + 1], [NT, 2]: varlen only
    lower_bound, T, NT,
    HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_GATE: tl.constexpr, USE_LOWER_BOUND: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    STORE_ALL: tl.constexpr,
):
    """gP (module docstring) and whether each chunk is separable (chunk_common.halves_fall_little on its halves'
    sums), which both scores launches read so that they cannot disagree. Separable chunks' scores and the WY
    factors come from the raw gate, so gP is stored only for the other chunks, or for all with ``STORE_ALL`` (a
    backward will keep it)."""
    i_c, _, i_hv = grid_coords(1, HV)
    _, i_t, bos, T_n = chunk_coords(i_c, cu_seqlens, chunk_indices, T, NT, IS_VARLEN)
    t0 = i_t * BT
    o_k = tl.arange(0, BK)
    b_a = 1.0
    b_bias = tl.zeros([BK], dtype=tl.float32)                              # [BK]
    if USE_GATE:
        b_a = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        if HAS_DT_BIAS:
            b_bias += tl.load(dt_bias + i_hv * K + o_k, mask=o_k < K, other=0.0).to(tl.float32)
    b_h0 = tl.zeros([BK], dtype=tl.float32)                                # [BK] the halves' sums
    b_h1 = tl.zeros([BK], dtype=tl.float32)
    for I in tl.static_range(BT // BC):
        b_s = tl.sum(sub_block_gate(g, b_bias, b_a, lower_bound, bos, t0 + I * BC, T_n, i_hv, HV, K, o_k, BC,
                                    USE_GATE, USE_LOWER_BOUND), 0)
        if I < BT // BC // 2:
            b_h0 += b_s
        else:
            b_h1 += b_s
    sep = tl.max(tl.maximum(-b_h0, -b_h1)) < HALF_LIMIT
    tl.store(separable + i_c.to(tl.int64) * HV + i_hv, sep.to(tl.int8))
    if STORE_ALL or not sep:
        for I in tl.static_range(BT // BC):
            r0 = t0 + I * BC
            b_g = sub_block_gate(g, b_bias, b_a, lower_bound, bos, r0, T_n, i_hv, HV, K, o_k, BC, USE_GATE,
                                 USE_LOWER_BOUND)                          # [BC, BK]
            store_rows(gP, tl.cumsum(b_g, 0), bos, r0, T_n, i_hv, HV, K, o_k, BC)
