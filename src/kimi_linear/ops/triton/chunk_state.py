"""Chunk pipeline, stage (e) and the backward's reverse scan: the state passed from chunk to chunk.

:func:`chunk_kda_fwd_h_kernel`, one program per (value block, sequence, value head), owns a ``[K, BV]`` float32
state in registers and walks the sequence's chunks; per chunk (w, u, kg, decay, qg, Aqk from chunk_wy.py), with
``S = h[n]`` the state at the chunk's start:

    vn    = u - w S                  (the chunk's delta-rule writes)
    o     = scale (qg S + Aqk vn)    (the forward)
    S     = diag(decay) S + kg^T vn

The forward forms each chunk's output here, from S and vn in registers, so neither goes to memory (~0.8 GB of
writes and reads at 16 x 2048, H=32, K=V=128). H200, 2026-12-02, forward at 16 x 2048 / 1 x 32768: 3.43 / 3.48 ms
against 3.66 / 3.94 with h and vn stored and a separate, fully parallel output kernel (at 16 x 2048 the scan takes
0.65 ms with the output, against 0.47 + 0.42 for the scan and that kernel). The backward's recompute stores h[n]
and vn instead, which its gradient kernels read.

:func:`chunk_kda_bwd_dh_kernel` is the reverse walk: with ``dS`` the gradient reaching the state after chunk n,

    dh[n] = dS                       (stored)
    dvn   = scale Aqk^T do + kg dS   (stored)
    dS    = diag(decay) dS + scale qg^T do - w^T dvn

ending at the initial state's gradient. Everything but the state itself is independent of the walk, so the loads
of the next chunk overlap this chunk's products (software pipelining).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .chunk_common import (
    cast,
    load_rows,
    load_state,
    mm,
    seq_coords,
    store_rows,
    store_state,
)


@triton.jit
def chunk_kda_fwd_h_kernel(
    w, u, kg, decay,                  # [B, T, HV, K|V|K] storage dtype, [NT, HV, K] float32
    h, vn, h0, ht,                    # out: [NT, HV, K, V], [B, T, HV, V]; [N, HV, K, V] float32 in/out
    qg, Aqk, o,                       # OUTPUT only: [B, T, HV, K], [B, T, HV, BT]; out [B, T, HV, V] input dtype
    cu_seqlens, chunk_offsets,        # varlen only
    scale, T,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
    OUTPUT: tl.constexpr, PREC: tl.constexpr,
):
    """The state scan (module docstring). ``OUTPUT`` (the forward): each chunk's output ``scale (qg h[n] + Aqk vn)``
    from the state and vn in registers, both rounded to the storage dtype first as the backward stores them for its
    products; else h[n] and vn are stored."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    bos, T_n, c_first = seq_coords(i_n, cu_seqlens, chunk_offsets, T, IS_VARLEN, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    b_h = tl.zeros([BK, BV], dtype=tl.float32)                             # [BK, BV]
    if USE_INITIAL_STATE:
        b_h += load_state(h0 + i_nh.to(tl.int64) * K * V, o_k, o_v, K, V)

    for i_t in range(0, tl.cdiv(T_n, BT)):
        t0 = i_t * BT
        if not OUTPUT:
            store_state(h + ((c_first + i_t) * HV + i_hv) * K * V, b_h, o_k, o_v, K, V)
        b_w = load_rows(w, bos, t0, T_n, i_hv, HV, K, o_k, BT)               # [BT, BK]
        b_kg = load_rows(kg, bos, t0, T_n, i_hv, HV, K, o_k, BT)             # [BT, BK]
        b_u = load_rows(u, bos, t0, T_n, i_hv, HV, V, o_v, BT).to(tl.float32)   # [BT, BV]
        b_d = tl.load(decay + ((c_first + i_t) * HV + i_hv) * K + o_k, mask=o_k < K, other=0.0)   # [BK]
        b_vn = b_u - mm(b_w, cast(b_h, b_w.dtype), PREC)                        # [BT, BV]
        b_vn = cast(b_vn, b_w.dtype)                                       # the storage dtype, as stored
        if OUTPUT:
            b_qg = load_rows(qg, bos, t0, T_n, i_hv, HV, K, o_k, BT)         # [BT, BK]
            b_A = load_rows(Aqk, bos, t0, T_n, i_hv, HV, BT, tl.arange(0, BT), BT)   # [BT, BT]
            b_o = mm(b_qg, cast(b_h, b_qg.dtype), PREC) + mm(b_A, b_vn, PREC)      # [BT, BV]
            store_rows(o, b_o * scale, bos, t0, T_n, i_hv, HV, V, o_v, BT)
        else:
            store_rows(vn, b_vn, bos, t0, T_n, i_hv, HV, V, o_v, BT)
        # The state update uses vn as stored, so the output and the backward see the same writes.
        b_h = b_h * b_d[:, None] + mm(tl.trans(b_kg), b_vn, PREC)

    if STORE_FINAL_STATE:
        store_state(ht + i_nh.to(tl.int64) * K * V, b_h, o_k, o_v, K, V)


@triton.jit
def chunk_kda_bwd_dh_kernel(
    qg, kg, w, Aqk, decay, do,        # forward pieces (storage dtype; decay float32), do [B, T, HV, V]
    dh, dvn, dht, dh0,                # out: [NT, HV, K, V], [B, T, HV, V]; [N, HV, K, V] float32 in / out
    cu_seqlens, chunk_offsets,
    scale, T,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_FINAL_STATE_GRADIENT: tl.constexpr, PREC: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    bos, T_n, c_first = seq_coords(i_n, cu_seqlens, chunk_offsets, T, IS_VARLEN, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, BT)
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)                            # [BK, BV]
    if USE_FINAL_STATE_GRADIENT:
        b_dh += load_state(dht + i_nh.to(tl.int64) * K * V, o_k, o_v, K, V)

    NT_n = tl.cdiv(T_n, BT)
    for i_r in range(0, NT_n):
        i_t = NT_n - 1 - i_r
        t0 = i_t * BT
        store_state(dh + ((c_first + i_t) * HV + i_hv) * K * V, b_dh, o_k, o_v, K, V)
        b_qg = load_rows(qg, bos, t0, T_n, i_hv, HV, K, o_k, BT)             # [BT, BK]
        b_kg = load_rows(kg, bos, t0, T_n, i_hv, HV, K, o_k, BT)             # [BT, BK]
        b_w = load_rows(w, bos, t0, T_n, i_hv, HV, K, o_k, BT)               # [BT, BK]
        b_A = load_rows(Aqk, bos, t0, T_n, i_hv, HV, BT, o_t, BT)            # [BT, BT]
        b_do = load_rows(do, bos, t0, T_n, i_hv, HV, V, o_v, BT)   # [BT, BV]
        b_d = tl.load(decay + ((c_first + i_t) * HV + i_hv) * K + o_k, mask=o_k < K, other=0.0)  # [BK]
        b_dvn = scale * mm(tl.trans(b_A), b_do, PREC) + mm(b_kg, cast(b_dh, b_kg.dtype), PREC)      # [BT, BV]
        b_dvn = cast(b_dvn, dvn.dtype.element_ty)
        store_rows(dvn, b_dvn, bos, t0, T_n, i_hv, HV, V, o_v, BT)
        b_dh = (b_dh * b_d[:, None] + scale * mm(tl.trans(b_qg), b_do, PREC)
                - mm(tl.trans(b_w), b_dvn, PREC))

    store_state(dh0 + i_nh.to(tl.int64) * K * V, b_dh, o_k, o_v, K, V)
