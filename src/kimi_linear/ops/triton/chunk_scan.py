"""Chunk forward, part 2: the state carried from chunk to chunk, and the output, in one pass (SPEC section 2).

One program owns one value-head's state block ``[K, BV]`` (float32, in registers) and walks the chunks of its
sequence in order. Per chunk, with the intra-chunk products of chunk_intra.py:

    Delta  = U - W S                              # the delta-rule writes of the chunk   [BT, BV]
    O      = scale * (qg S + Aqk Delta)           # output, reading S before the chunk
    S      = Diag(decay) S + kend^T Delta

Fusing the output into the scan means the per-chunk states never go to memory. Precision: the state and every
operand here are float32 (tf32 products for 16-bit inputs); W, U, qg and Aqk are stored in float32 by part 1, only
kend in the input's 16-bit type (it touches the state alone): rounding W, U, qg, Aqk or the state to bf16 tripled
the output error against the float64 reference in our tests, past the 5e-3 bar. Loads for the next chunk do not
depend on the state, so the compiler's software pipelining overlaps them with this chunk's products.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def chunk_kda_fwd_scan_kernel(
    qg, kend, w, u, Aqk, decay,       # [B, T, HV, K] x3, [B, T, HV, V], [B, T, HV, BT], [NT, HV, K]
    o, h0, ht,                        # [B, T, HV, V]; [N, HV, K, V] float32 x2
    cu_seqlens, chunk_offsets,        # [N + 1] tokens, [N + 1] chunks; varlen only
    scale, T,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
    PREC: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T_n = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
        c_first = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        T_n = T
        c_first = i_n.to(tl.int64) * tl.cdiv(T, BT)
    NT_n = tl.cdiv(T_n, BT)

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    o_h = (i_nh.to(tl.int64) * K + o_k[:, None]) * V + o_v[None, :]
    m_h = m_k[:, None] & m_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)                        # [BK, BV]
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + o_h, mask=m_h, other=0.0)

    for i_t in range(0, NT_n):
        o_i = i_t * BT + o_t
        m_i = o_i < T_n
        r = (bos + o_i) * HV + i_hv                                    # [BT] token-head rows
        m_tk = m_i[:, None] & m_k[None, :]
        m_tv = m_i[:, None] & m_v[None, :]
        b_w = tl.load(w + r[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)        # [BT, BK]
        b_qg = tl.load(qg + r[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)      # [BT, BK]
        b_ke = tl.load(kend + r[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)  # [BT, BK]
        b_u = tl.load(u + r[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)        # [BT, BV]
        b_A = tl.load(Aqk + r[:, None] * BT + o_t[None, :], mask=m_i[:, None], other=0.0)  # [BT, BT]
        b_d = tl.load(decay + ((c_first + i_t) * HV + i_hv) * K + o_k, mask=m_k, other=0.0)  # [BK]

        b_delta = b_u - tl.dot(b_w, b_h, input_precision=PREC)                          # [BT, BV]
        b_o = tl.dot(b_qg, b_h, input_precision=PREC) + tl.dot(b_A, b_delta, input_precision=PREC)
        tl.store(o + r[:, None] * V + o_v[None, :], (b_o * scale).to(o.dtype.element_ty), mask=m_tv)
        b_h = b_h * b_d[:, None] + tl.dot(tl.trans(b_ke), b_delta, input_precision=PREC)

    if STORE_FINAL_STATE:
        tl.store(ht + o_h, b_h, mask=m_h)
