"""Chunk pipeline, stages (e)-(f) and the backward's reverse scan: the state passed from chunk to chunk.

:func:`chunk_kda_fwd_h_kernel`, one program per (value block, sequence, value head), owns a ``[K, BV]`` float32
state in registers and walks the sequence's chunks; per chunk (w, u, kg, decay from chunk_wy.py):

    h[n]  = S                        (stored: the output kernel and the backward read it)
    vn    = u - w S                  (stored: the chunk's delta-rule writes)
    S     = diag(decay) S + kg^T vn

:func:`chunk_kda_fwd_o_kernel`, fully parallel over (chunk, value block, value head):
``o = scale * (qg h[n] + Aqk vn)``; or, with ``LaunchConfig.fused_output``, the scan forms each chunk's output
itself, and h and vn never go to memory.

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
    chunk_coords,
    grid_coords,
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
    STORE_STATES: tl.constexpr, OUTPUT: tl.constexpr, PREC: tl.constexpr,
):
    """The state scan (module docstring). ``OUTPUT``: each chunk's output ``scale (qg h[n] + Aqk vn)`` is formed
    here from the state and vn in registers, with the operands rounded as :func:`chunk_kda_fwd_o_kernel` gets them
    from memory, and neither h nor vn is stored (the forward alone: the backward reads both)."""
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
        if STORE_STATES:
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
def chunk_kda_fwd_o_kernel(
    qg, h, Aqk, vn,                   # [B, T, HV, K], [NT, HV, K, V], [B, T, HV, BT], [B, T, HV, V]
    o,                                # out: [B, T, HV, V] in the input dtype
    cu_seqlens, chunk_indices,
    scale, T, NT,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BKS: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, PREC: tl.constexpr,
):
    i_c, i_v, i_hv = grid_coords((V + BV - 1) // BV, HV)
    _, i_t, bos, T_n = chunk_coords(i_c, cu_seqlens, chunk_indices, T, NT, IS_VARLEN)
    t0 = i_t * BT
    o_v = i_v * BV + tl.arange(0, BV)
    p_h = h + (i_c.to(tl.int64) * HV + i_hv) * K * V
    b_o = tl.zeros([BT, BV], dtype=tl.float32)                             # [BT, BV]
    for c0 in range(0, K, BKS):
        o_k = c0 + tl.arange(0, BKS)
        b_qg = load_rows(qg, bos, t0, T_n, i_hv, HV, K, o_k, BT)             # [BT, BKS]
        b_h = load_state(p_h, o_k, o_v, K, V)                               # [BKS, BV]
        b_o += mm(b_qg, b_h, PREC)
    b_A = load_rows(Aqk, bos, t0, T_n, i_hv, HV, BT, tl.arange(0, BT), BT)  # [BT, BT]
    b_o += mm(b_A, load_rows(vn, bos, t0, T_n, i_hv, HV, V, o_v, BT), PREC)
    store_rows(o, b_o * scale, bos, t0, T_n, i_hv, HV, V, o_v, BT)


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
