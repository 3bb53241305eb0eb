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

from .chunk_common import chunk_coords, grid_coords, load_rows, store_rows
from .transforms import kda_gate


@triton.jit
def chunk_kda_prepare_kernel(
    g,                                # [B, T, HV, K] raw (or log) gate
    A_log, dt_bias,                   # [HV], [HV, K]: the in-kernel gate's parameters
    gP,                               # out: [B, T, HV, K] float32
    cu_seqlens, chunk_indices,        # [N + 1], [NT, 2]: varlen only
    lower_bound, T, NT,
    HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_GATE: tl.constexpr, USE_LOWER_BOUND: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
):
    i_c, _, i_hv = grid_coords(1, HV)
    _, i_t, bos, T_n = chunk_coords(i_c, cu_seqlens, chunk_indices, T, NT, IS_VARLEN)
    t0 = i_t * BT
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    if USE_GATE:
        b_a = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        b_bias = tl.zeros([BK], dtype=tl.float32)                          # [BK]
        if HAS_DT_BIAS:
            b_bias += tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.0).to(tl.float32)

    for I in tl.static_range(BT // BC):
        r0 = t0 + I * BC
        m_r = (r0 + tl.arange(0, BC)) < T_n
        b_g = load_rows(g, bos, r0, T_n, i_hv, HV, K, o_k, BC).to(tl.float32)  # [BC, BK]
        if USE_GATE:
            b_g = kda_gate(b_g, b_bias[None, :], b_a, lower_bound, USE_LOWER_BOUND)
        # Rows past the sequence end add nothing (their gate would otherwise be softplus(dt_bias)).
        b_g = tl.where(m_r[:, None] & m_k[None, :], b_g, 0.0)
        store_rows(gP, tl.cumsum(b_g, 0), bos, r0, T_n, i_hv, HV, K, o_k, BC)

