"""Chunk pipeline, stage (a): the gate in 16-row sub-block sums, and the l2norm row factors of q and k.

One program per (chunk, value head). It applies the gate formula (``use_gate_in_kernel``) to the raw gate and stores
``gP``, the inclusive sum of the gate inside each 16-row sub-block (float32; see chunk_common.py for how every
later kernel turns it into decay factors without overflow or large-sum cancellation). With l2norm and
``LaunchConfig(norms_in_scores=False)``, the program of the first value head of each q/k head also stores
``rq = 1 / sqrt(sum q^2 + 1e-6)`` and ``rk`` per row (by default the scores kernel does, chunk_wy.finish_scores,
so that this kernel reads only the gate): later kernels multiply rows of q and k by them as they load, so
normalised copies of q and k never go to memory.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .chunk_common import chunk_coords, grid_coords, load_rows, row_inv_norms, store_row_norms, store_rows
from .transforms import kda_gate


@triton.jit
def chunk_kda_prepare_kernel(
    q, k, g,                          # [B, T, H, K] x2, [B, T, HV, K] raw (or log) gate
    A_log, dt_bias,                   # [HV], [HV, K]: the in-kernel gate's parameters
    gP, rq, rk,                       # out: [B, T, HV, K] float32; [B, T, H] float32 x2 (l2norm only)
    cu_seqlens, chunk_indices,        # [N + 1], [NT, 2]: varlen only
    lower_bound, T, NT,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_GATE: tl.constexpr, USE_LOWER_BOUND: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr, ORDER: tl.constexpr,
):
    i_c, _, i_hv = grid_coords(1, HV, ORDER)
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

    if USE_QK_L2NORM:
        i_h = i_hv // (HV // H)
        if i_hv % (HV // H) == 0:                                          # only the writer computes them here
            b_rq = row_inv_norms(q, bos, t0, T_n, i_h, H, K, BT, BK)      # [BT], the whole row in one step
            b_rk = row_inv_norms(k, bos, t0, T_n, i_h, H, K, BT, BK)
            store_row_norms(rq, rk, b_rq, b_rk, bos, t0, T_n, i_h, i_hv, H, HV, BT)
