"""Chunk pipeline, stage (b'): the diagonal 16x16 blocks of the scores of the chunks the sub-block scheme takes.

One program per (row i of a chunk, BH value heads). Inside a 16-row sub-block the gate sum ``gP`` is cumulative,
so for j <= i in i's sub-block ``exp(gP_i - gP_j)`` is a product of decays, <= 1 at any gate (no clamp, no
reference row, no overflow; it underflows only where the exact value does). The row loads its q, k and gP once and
walks the j of its sub-block:

    Aqk[i, j] = rq_i rk_j sum_c q_ic k_jc exp(gP_ic - gP_jc)       Akk[i, j] = rk_i rk_j sum_c k_ic k_jc exp(...)

elementwise on the CUDA cores in float32 (j < i for Akk), the k and gP rows of j coming from L1 / L2. The work
does not depend on the gate: the chunks' off-diagonal blocks stay tensor-core products (chunk_wy.chunk_scores),
which leave the diagonal blocks to this launch. The l2norm factors rq, rk are the scores kernel's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .chunk_common import chunk_coords
from .fastmath import fast_exp

DIAG_BH = 8         # value heads a program
DIAG_WARPS = 2


@triton.jit
def chunk_kda_fwd_diag_kernel(
    q, k, gP, rq, rk,                 # [B, T, H, K] x2, [B, T, HV, K] f32, [B, T, H] f32 x2 (l2norm only)
    Aqk, Akk,                         # in/out: [B, T, HV, BT] each; the diagonal blocks' entries j <= i written
    kinds,                            # [NT, HV] int8: 1 where the chunk took the sub-block scheme
    cu_seqlens, chunk_indices,        # varlen only
    T, NT,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    BH: tl.constexpr, IS_VARLEN: tl.constexpr, USE_QK_L2NORM: tl.constexpr,
):
    i_r, i_hb = tl.program_id(0), tl.program_id(1)
    i_c, r = i_r // BT, i_r % BT
    _, i_t, bos, T_n = chunk_coords(i_c, cu_seqlens, chunk_indices, T, NT, IS_VARLEN)
    t0 = i_t * BT
    o_hv = i_hb * BH + tl.arange(0, BH)
    # (tl.where, not `& (t0 + r < T_n)`: the interpreter turns a vector & scalar of booleans into integers)
    m_hv = tl.where(t0 + r < T_n, o_hv < HV, False)                                           # [BH]
    b_kind = tl.load(kinds + i_c.to(tl.int64) * HV + o_hv, mask=m_hv, other=0)                  # [BH]
    if tl.max(b_kind.to(tl.int32)) == 0:
        return
    m_h = m_hv & (b_kind != 0)                                                                  # [BH]
    o_h = o_hv // (HV // H)                                                                     # [BH] q/k heads
    o_k = tl.arange(0, BK)
    m = m_h[:, None] & (o_k < K)[None, :]                                                       # [BH, BK]
    row_i = (bos + t0 + r).to(tl.int64)
    o_qk = o_h[:, None] * K + o_k[None, :]                                                      # [BH, BK]
    o_g = o_hv[:, None] * K + o_k[None, :]
    b_q = tl.load(q + row_i * H * K + o_qk, mask=m, other=0.0).to(tl.float32)                  # [BH, BK]
    b_ki = tl.load(k + row_i * H * K + o_qk, mask=m, other=0.0).to(tl.float32)                 # [BH, BK]
    b_gi = tl.load(gP + row_i * HV * K + o_g, mask=m, other=0.0)                                # [BH, BK]
    if USE_QK_L2NORM:
        b_rqi = tl.load(rq + row_i * H + o_h, mask=m_h, other=0.0)                              # [BH]
        b_rki = tl.load(rk + row_i * H + o_h, mask=m_h, other=0.0)
    p_aq = Aqk + (row_i * HV + o_hv) * BT                                                       # [BH]
    p_ak = Akk + (row_i * HV + o_hv) * BT
    s0 = (r // BC) * BC
    for j in range(s0, r + 1):
        row_j = (bos + t0 + j).to(tl.int64)
        b_kj = tl.load(k + row_j * H * K + o_qk, mask=m, other=0.0).to(tl.float32)             # [BH, BK]
        b_gj = tl.load(gP + row_j * HV * K + o_g, mask=m, other=0.0)                            # [BH, BK]
        b_kj = b_kj * fast_exp(tl.where(m, b_gi - b_gj, 0.0))     # exponent <= 0: a product of decays
        b_aq = tl.sum(b_q * b_kj, 1)                                                            # [BH]
        b_ak = tl.sum(b_ki * b_kj, 1)
        if USE_QK_L2NORM:
            b_rkj = tl.load(rk + row_j * H + o_h, mask=m_h, other=0.0)
            b_aq = b_aq * b_rqi * b_rkj
            b_ak = b_ak * b_rki * b_rkj
        tl.store(p_aq + j, b_aq.to(Aqk.dtype.element_ty), mask=m_h)
        tl.store(p_ak + j, tl.where(j < r, b_ak, 0.0), mask=m_h)
