"""EXPERIMENT (committed and reverted): the paged MLA split kernel with keys / channels as the products' M (wgmma on
sm_90); measured slower than mla_decode.py's default on the H200 (BENCHMARKS.md, "Kernels on their own")."""
import triton
import triton.language as tl
from kimi_linear.ops.triton.chunk_common import cast, mm
from kimi_linear.ops.triton.pdl import pdl_entry
from kimi_linear.ops.triton.mla_decode import split_range, finish, tile_blocks, tile_keys, LN2


@triton.jit
def attend_t(b_qt, b_qrt, b_k, b_kr, m_n, qk_scale, b_m, b_l, b_acc, PREC: tl.constexpr):
    b_s = mm(b_k, b_qt, PREC) + mm(b_kr, b_qrt, PREC)                                  # [BN, BH]
    b_s = tl.where(m_n[:, None], b_s * qk_scale, float("-inf"))
    b_m_new = tl.maximum(b_m, tl.max(b_s, 0))                                          # [BH]
    b_alpha = tl.exp2(b_m - b_m_new)
    b_p = tl.exp2(b_s - b_m_new[None, :])                                              # [BN, BH]
    b_l = b_l * b_alpha + tl.sum(b_p, 0)
    b_acc = b_acc * b_alpha[None, :] + mm(tl.trans(b_k), cast(b_p, b_k.dtype), PREC)   # [BC, BH]
    return b_m_new, b_l, b_acc


@triton.jit
def mla_decode_split_kernel(
    q, cache, block_table, seq_lens, o_part, lse_part, o, lse,
    qk_scale, stride_t, H, NS, MB,
    C: tl.constexpr, R: tl.constexpr, BS: tl.constexpr,
    BH: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr,
    PREC: tl.constexpr, SINGLE: tl.constexpr, PDL: tl.constexpr,
):
    pdl_entry(PDL)
    i_hb, i_s, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    W: tl.constexpr = C + R
    L, NT, TPS = split_range(seq_lens, i_b, NS, MB, BS, BN)
    t0 = i_s * TPS
    t1 = tl.minimum(t0 + TPS, NT)
    hi = tl.minimum(t1 * BN, L)
    o_h = i_hb * BH + tl.arange(0, BH)
    o_c = tl.arange(0, BC)
    o_r = tl.arange(0, BR)
    m_h, m_c, m_r = o_h < H, o_c < C, o_r < R
    dt = cache.dtype.element_ty
    p_q = q + (i_b * H + o_h)[None, :] * W
    b_qt = cast(tl.load(p_q + o_c[:, None], mask=m_h[None, :] & m_c[:, None], other=0.0), dt)      # [BC, BH]
    b_qrt = cast(tl.load(p_q + C + o_r[:, None], mask=m_h[None, :] & m_r[:, None], other=0.0), dt)  # [BR, BH]
    b_m = tl.full([BH], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BH], dtype=tl.float32)
    b_acc = tl.zeros([BC, BH], dtype=tl.float32)                                                   # [BC, BH]
    p_t = block_table + i_b * stride_t
    b_blk = tile_blocks(p_t, t0, hi, BS, BN)
    for i_t in range(t0, t1):
        b_k, b_kr = tile_keys(cache, i_t, b_blk, hi, BS, BN, C, R, BC, BR)
        b_blk = tile_blocks(p_t, i_t + 1, hi, BS, BN)
        m_n = i_t * BN + tl.arange(0, BN) < hi
        b_m, b_l, b_acc = attend_t(b_qt, b_qrt, b_k, b_kr, m_n, qk_scale, b_m, b_l, b_acc, PREC)
    m_w = tl.where(t0 < t1, m_h, False)
    b_inv, b_lse = finish(b_m, b_l)
    b_o = b_acc * b_inv[None, :]                                                                   # [BC, BH]
    if SINGLE:
        tl.store(o + (i_b * H + o_h)[None, :] * C + o_c[:, None], cast(b_o, o.dtype.element_ty),
                 mask=m_h[None, :] & m_c[:, None])
        tl.store(lse + i_b * H + o_h, b_lse * LN2, mask=m_h)
    else:
        o_p = (i_b * H + o_h) * NS + i_s
        tl.store(o_part + o_p[None, :] * C + o_c[:, None], b_o, mask=m_w[None, :] & m_c[:, None])
        tl.store(lse_part + o_p, b_lse, mask=m_w)


import torch  # noqa: E402
from kimi_linear.ops.triton import mla_decode as tri  # noqa: E402
from kimi_linear.ops.triton.pdl import pdl_args  # noqa: E402


def decode_t(q, cache, block_table, seq_lens, scale, C, BH=32, BN=64, warps=4, stages=2, per_sm=1, num_splits=None):
    B, H, W = q.shape
    R = W - C
    BS, MB = cache.shape[1], block_table.shape[1]
    NS = num_splits or tri.default_num_splits(B, H, MB, BS, tri.num_sms(q.device), BH, per_sm)
    o = torch.empty(B, H, C, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, dtype=torch.float32, device=q.device)
    BC, BR = max(16, triton.next_power_of_2(C)), max(16, triton.next_power_of_2(R))
    single = NS == 1
    if single:
        o_part, lse_part = o, lse
    else:
        o_part = torch.empty(B, H, NS, C, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(B, H, NS, dtype=torch.float32, device=q.device)
    mla_decode_split_kernel[(triton.cdiv(H, BH), NS, B)](
        q, cache, block_table, seq_lens, o_part, lse_part, o, lse,
        scale * tri.LOG2E, block_table.stride(0), H, NS, MB,
        C=C, R=R, BS=BS, BH=BH, BN=BN, BC=BC, BR=BR, PREC="tf32", SINGLE=single,
        num_warps=warps, num_stages=stages, **pdl_args(q.device))
    if not single:
        BV = min(tri.MERGE_BV, BC)
        tri.mla_decode_merge_kernel[(triton.cdiv(C, BV), H, B)](
            o_part, lse_part, seq_lens, o, lse, H, NS, MB,
            C=C, BS=BS, BN=BN, BV=BV, BSP=min(tri.MERGE_BS, triton.next_power_of_2(NS)), num_warps=4,
            **pdl_args(q.device))
    return o, lse
