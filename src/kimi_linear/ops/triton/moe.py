"""Fused mixture of experts (:mod:`kimi_linear.ops.moe`) in Triton: grouped GEMMs over the (token, expert) pairs
sorted by expert, with every shape fixed by (N, k, E), so a decode step can be captured in a CUDA graph.

Pipeline (``M = N * k`` pairs; pair ``p = n * k + j`` is token n's j-th choice):

1. ``torch.sort`` of the M expert ids (stable): each expert's pairs become one segment, in pair order.
2. align (one program): segment bounds, each segment padded to a multiple of ``BM`` slots, and ``slot_pair``
   [P]: the pair in each slot, ``M`` for padding. Blocks of BM slots hold one expert's pairs each; a segment of
   c pairs takes ceil(c / BM) blocks, so there are at most ``NB = ceil(M / BM) + min(E, M)`` blocks, and
   ``P = NB * BM`` slots. Blocks past the real count hold only padding: their programs read the sentinel in the
   first slot and exit, so the launch grids depend on (N, k, E) only and nothing is read on the host.
3. gate/up: per block and BN1 columns of I, ``glu(x_rows @ w1[e]^T, x_rows @ w3[e]^T)`` with float32
   accumulators, the GLU in the epilogue in float32 -> ``h`` [P, I] in x's dtype (rounded there, as the layers do).
4. down: per block and BN2 columns of W, ``h_rows @ w2[e]^T`` times each pair's routing weight -> ``y`` [M, W]
   float32 at the pair's row.
5. combine: ``out[n] = sum_j y[n * k + j]`` in a fixed order (deterministic, no atomics), cast to x's dtype.

Decoding is bound by reading the chosen experts' weights: a block reads its expert's weights once per column
tile, so BM is chosen at or above the typical number of tokens per expert (:func:`moe_launch`), and the column
tiles (16 per expert for I = 1024, BN1 = 64) keep every SM streaming even at N = 1.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .chunk_common import INTERPRET, cast


@dataclass(frozen=True)
class MoELaunch:
    """Launch shape of the fused MoE kernels. BM: slots per block (every expert's segment is padded to a multiple
    of it; >= 16 for the tensor cores). Gate/up kernel: BN1 columns of I per program, steps of BK1 over W, warps1
    warps, stages1 pipeline stages; down kernel: BN2 columns of W, steps of BK2 over I, warps2, stages2."""

    BM: int = 16
    BN1: int = 64
    BK1: int = 128
    warps1: int = 4
    stages1: int = 4
    BN2: int = 64
    BK2: int = 128
    warps2: int = 4
    stages2: int = 4


def moe_launch(N: int, k: int, E: int, W: int, I: int, dtype: torch.dtype) -> MoELaunch:
    """The launch shape for N tokens choosing k of E experts [2I, W] / [W, I] (a fixed table, no autotuning: the
    choice must not depend on anything but shapes, and autotuning inside a CUDA graph capture is not safe).

    While the step is bound by weight bandwidth (up to thousands of pairs for E = 256), a block should hold all
    of an expert's tokens: its weights are then read once. With balanced routing an expert gets about
    ``N k / E`` tokens (Poisson spread), so BM grows with that mean. Not yet tuned on a GPU:
    ``bench/moe_gpu.py --sweep`` times alternatives."""
    mean = N * k / E
    if mean <= 8:
        cfg = MoELaunch(BM=16, BN1=64, BK1=128, warps1=4, stages1=4, BN2=64, BK2=128, warps2=4, stages2=4)
    elif mean <= 20:
        cfg = MoELaunch(BM=32, BN1=64, BK1=128, warps1=4, stages1=4, BN2=64, BK2=128, warps2=4, stages2=4)
    elif mean <= 40:
        cfg = MoELaunch(BM=64, BN1=64, BK1=64, warps1=4, stages1=4, BN2=128, BK2=64, warps2=4, stages2=4)
    else:
        cfg = MoELaunch(BM=128, BN1=64, BK1=64, warps1=8, stages1=3, BN2=128, BK2=64, warps2=8, stages2=3)
    if dtype == torch.float32:      # twice the bytes per tile: halve the steps to keep shared memory in bounds
        cfg = replace(cfg, BK1=cfg.BK1 // 2, BK2=cfg.BK2 // 2, stages1=min(cfg.stages1, 3),
                      stages2=min(cfg.stages2, 3))
    return cfg


@triton.jit
def moe_align_kernel(
    ids_sorted, order,      # [M] the expert ids sorted (stable), [M] the pair at each sorted position
    tables,                 # scratch int32 [2, BE]
    slot_pair,              # out: int32 [P], the pair in each slot, M for padding
    M, P, E,
    BM: tl.constexpr, BE: tl.constexpr, BS: tl.constexpr,
):
    """One program. Sorted position i of expert e goes to slot ``i + shift_e`` with ``shift_e = pstart_e -
    start_e`` (pstart: exclusive cumsum of the padded segment lengths). Ids outside [0, E) are left out. The
    barriers order the global writes and reads of the program's threads between phases; the loads of what this
    program wrote are volatile (never served from a non-coherent cache)."""
    o_e = tl.arange(0, BE)
    p_start, p_end = tables + o_e, tables + BE + o_e
    tl.store(p_start, tl.zeros([BE], dtype=tl.int32))
    tl.store(p_end, tl.zeros([BE], dtype=tl.int32))
    for s0 in range(0, P, BS):
        o_s = s0 + tl.arange(0, BS)
        tl.store(slot_pair + o_s, tl.zeros([BS], dtype=tl.int32) + M, mask=o_s < P)
    tl.debug_barrier()
    # segment [start_e, end_e) of each expert present: where the sorted id changes
    for i0 in range(0, M, BS):
        o_i = i0 + tl.arange(0, BS)
        m_i = o_i < M
        b_e = tl.load(ids_sorted + o_i, mask=m_i, other=-1)                               # [BS]
        b_prev = tl.load(ids_sorted + o_i - 1, mask=m_i & (o_i > 0), other=-1)
        b_next = tl.load(ids_sorted + o_i + 1, mask=o_i + 1 < M, other=-1)
        m_e = m_i & (b_e >= 0) & (b_e < E)
        tl.store(tables + b_e, o_i, mask=m_e & (b_e != b_prev))
        tl.store(tables + BE + b_e, o_i + 1, mask=m_e & (b_e != b_next))
    tl.debug_barrier()
    b_start = tl.load(p_start, volatile=True)                                              # [BE]
    b_pad = (tl.load(p_end, volatile=True) - b_start + BM - 1) // BM * BM
    b_shift = tl.cumsum(b_pad, 0) - b_pad - b_start
    tl.debug_barrier()                                                                     # all read before the write
    tl.store(p_end, b_shift)
    tl.debug_barrier()
    for i0 in range(0, M, BS):
        o_i = i0 + tl.arange(0, BS)
        m_i = o_i < M
        b_e = tl.load(ids_sorted + o_i, mask=m_i, other=-1)
        m_e = m_i & (b_e >= 0) & (b_e < E)
        b_slot = o_i + tl.load(tables + BE + b_e, mask=m_e, other=0, volatile=True)
        b_pair = tl.load(order + o_i, mask=m_e, other=0).to(tl.int32)
        tl.store(slot_pair + b_slot, b_pair, mask=m_e)


@triton.jit
def mma(b_a, b_b, b_acc):
    """``b_acc + b_a @ b_b`` with float32 accumulation: 16-bit operands on the tensor cores, float32 ones exact
    (ieee). The interpreter's bf16 dot multiplies raw bit patterns, so there the operands are widened first
    (exact products either way)."""
    if INTERPRET:
        return tl.dot(b_a.to(tl.float32), b_b.to(tl.float32), b_acc, input_precision="ieee")
    if b_a.dtype == tl.float32:
        return tl.dot(b_a, b_b, b_acc, input_precision="ieee")
    return tl.dot(b_a, b_b, b_acc)


@triton.jit
def tanh(b_x):
    """float32 tanh: an odd Taylor polynomial below |x| = 0.3 (where 1 - exp(-2|x|) would cancel; truncation
    error < 2e-8 relative), else ``(1 - exp(-2|x|)) / (1 + exp(-2|x|))`` with x's sign (no overflow)."""
    b_a = tl.abs(b_x)
    b_x2 = b_x * b_x
    b_p = b_x * (1.0 + b_x2 * (-1.0 / 3.0 + b_x2 * (2.0 / 15.0 + b_x2 * (-17.0 / 315.0 + b_x2 * (62.0 / 2835.0)))))
    b_q = tl.exp(-2.0 * b_a)
    b_t = (1.0 - b_q) / (1.0 + b_q)
    return tl.where(b_a < 0.3, b_p, tl.where(b_x < 0, -b_t, b_t))


@triton.jit
def glu(b_g, b_u, beta, linear_beta, SITU: tl.constexpr):
    """``silu(g) * u``, or SiTU ``beta tanh(g / beta) sigmoid(g) * linear_beta tanh(u / linear_beta)``; float32."""
    if SITU:
        return (beta * tanh(b_g / beta) * tl.sigmoid(b_g)) * (linear_beta * tanh(b_u / linear_beta))
    return b_g * tl.sigmoid(b_g) * b_u


@triton.jit
def moe_gate_up_kernel(
    x, w13, slot_pair, ids,            # [N, W], [E, 2I, W] (strides s_we, s_wn, s_wk), [P] int32, [M] expert ids
    h,                                 # out: [P, I] in x's dtype, rows of padding slots untouched
    M, W, I, K_TOP, NT, s_xn, s_we, s_wn, s_wk, beta, linear_beta,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    SITU: tl.constexpr,
):
    i_p = tl.program_id(0)
    i_b, i_n = i_p // NT, i_p % NT
    first = tl.load(slot_pair + i_b * BM)
    if first >= M:                                                      # a block past the real ones
        return
    i_e = tl.load(ids + first).to(tl.int64)
    o_m = i_b * BM + tl.arange(0, BM)
    b_pair = tl.load(slot_pair + o_m)                                   # [BM]
    m_m = b_pair < M
    b_tok = tl.where(m_m, b_pair // K_TOP, 0).to(tl.int64)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = (o_n < I) | EVEN_N
    o_k = tl.arange(0, BK)
    p_x = x + b_tok[:, None] * s_xn + o_k[None, :]                      # [BM, BK]
    p_g = w13 + i_e * s_we + o_n[None, :].to(tl.int64) * s_wn + o_k[:, None] * s_wk           # [BK, BN]
    p_u = p_g + I * s_wn
    b_acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    b_acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, W, BK):
        m_k = (o_k < W - k0) | EVEN_K
        b_x = tl.load(p_x, mask=m_m[:, None] & m_k[None, :], other=0.0)                        # [BM, BK]
        b_wg = tl.load(p_g, mask=m_k[:, None] & m_n[None, :], other=0.0)                       # [BK, BN]
        b_wu = tl.load(p_u, mask=m_k[:, None] & m_n[None, :], other=0.0)                       # [BK, BN]
        b_acc_g = mma(b_x, b_wg, b_acc_g)
        b_acc_u = mma(b_x, b_wu, b_acc_u)
        p_x += BK
        p_g += BK * s_wk
        p_u += BK * s_wk
    b_h = glu(b_acc_g, b_acc_u, beta, linear_beta, SITU)                                        # [BM, BN]
    p_h = h + o_m[:, None].to(tl.int64) * I + o_n[None, :]
    tl.store(p_h, cast(b_h, h.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


@triton.jit
def moe_down_kernel(
    h, w2, slot_pair, ids, topk_weights,   # [P, I], [E, W, I] (strides s_we, s_wn, s_wk), [P], [M], [M] float32
    y,                                     # out: [M, W] float32, each pair's weighted expert output
    M, W, I, NT, s_we, s_wn, s_wk,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
):
    i_p = tl.program_id(0)
    i_b, i_n = i_p // NT, i_p % NT
    first = tl.load(slot_pair + i_b * BM)
    if first >= M:
        return
    i_e = tl.load(ids + first).to(tl.int64)
    o_m = i_b * BM + tl.arange(0, BM)
    b_pair = tl.load(slot_pair + o_m)                                   # [BM]
    m_m = b_pair < M
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = (o_n < W) | EVEN_N
    o_k = tl.arange(0, BK)
    p_h = h + o_m[:, None].to(tl.int64) * I + o_k[None, :]               # [BM, BK]
    p_w = w2 + i_e * s_we + o_n[None, :].to(tl.int64) * s_wn + o_k[:, None] * s_wk            # [BK, BN]
    b_acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, I, BK):
        m_k = (o_k < I - k0) | EVEN_K
        b_h = tl.load(p_h, mask=m_m[:, None] & m_k[None, :], other=0.0)                        # [BM, BK]
        b_w = tl.load(p_w, mask=m_k[:, None] & m_n[None, :], other=0.0)                        # [BK, BN]
        b_acc = mma(b_h, b_w, b_acc)
        p_h += BK
        p_w += BK * s_wk
    b_r = tl.load(topk_weights + b_pair, mask=m_m, other=0.0)                                   # [BM]
    p_y = y + b_pair[:, None].to(tl.int64) * W + o_n[None, :]
    tl.store(p_y, b_acc * b_r[:, None], mask=m_m[:, None] & m_n[None, :])


@triton.jit
def moe_combine_kernel(
    y, ids,                  # [N * k, W] float32, [N * k] expert ids
    out,                     # out: [N, W] in x's dtype
    W, E,
    K_TOP: tl.constexpr, BW: tl.constexpr,
):
    """``out[n] = sum_j y[n k + j]`` over j in order; a pair whose id is outside [0, E) (never computed) adds 0."""
    i_t, i_w = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_w = i_w * BW + tl.arange(0, BW)
    m_w = o_w < W
    b_o = tl.zeros([BW], dtype=tl.float32)
    for j in tl.static_range(K_TOP):
        b_e = tl.load(ids + i_t * K_TOP + j + o_w * 0)                  # [BW] the pair's id, broadcast
        b_o += tl.load(y + (i_t * K_TOP + j) * W + o_w, mask=m_w & (b_e >= 0) & (b_e < E), other=0.0)
    tl.store(out + i_t * W + o_w, cast(b_o, out.dtype.element_ty), mask=m_w)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu", situ_beta: float = 4.0,
              situ_linear_beta: float = 25.0, launch: MoELaunch | None = None) -> torch.Tensor:
    """Triton ``fused_moe``: same contract as :func:`kimi_linear.ops.fused_moe` (arguments checked there). No host
    synchronisation; every allocation and grid depends on (N, k, E) and the weight shapes only. ``launch``
    overrides :func:`moe_launch` (benchmarks)."""
    N, W = x.shape
    E, I, k = w13.shape[0], w2.shape[2], topk_ids.shape[1]
    M = N * k
    out = torch.empty(N, W, dtype=x.dtype, device=x.device)
    if N == 0:
        return out
    cfg = launch or moe_launch(N, k, E, W, I, x.dtype)
    BM = cfg.BM
    NB = triton.cdiv(M, BM) + min(E, M)
    P = NB * BM
    x = x if x.stride(1) == 1 else x.contiguous()
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    ids_sorted, order = torch.sort(ids, stable=True)
    BE = triton.next_power_of_2(E + 1)
    tables = torch.empty(2 * BE, dtype=torch.int32, device=x.device)
    slot_pair = torch.empty(P, dtype=torch.int32, device=x.device)
    moe_align_kernel[(1,)](ids_sorted, order, tables, slot_pair, M, P, E, BM=BM, BE=BE, BS=1024, num_warps=4)

    h = torch.empty(P, I, dtype=x.dtype, device=x.device)
    NT1 = triton.cdiv(I, cfg.BN1)
    moe_gate_up_kernel[(NB * NT1,)](
        x, w13, slot_pair, ids, h, M, W, I, k, NT1, x.stride(0), *w13.stride(), float(situ_beta),
        float(situ_linear_beta), BM=BM, BN=cfg.BN1, BK=cfg.BK1, EVEN_K=W % cfg.BK1 == 0, EVEN_N=I % cfg.BN1 == 0,
        SITU=activation == "situ", num_warps=cfg.warps1, num_stages=cfg.stages1,
    )
    y = torch.empty(M, W, dtype=torch.float32, device=x.device)
    NT2 = triton.cdiv(W, cfg.BN2)
    moe_down_kernel[(NB * NT2,)](
        h, w2, slot_pair, ids, weights, y, M, W, I, NT2, *w2.stride(), BM=BM, BN=cfg.BN2, BK=cfg.BK2,
        EVEN_K=I % cfg.BK2 == 0, EVEN_N=W % cfg.BN2 == 0, num_warps=cfg.warps2, num_stages=cfg.stages2,
    )
    BW = min(1024, triton.next_power_of_2(W))
    moe_combine_kernel[(N, triton.cdiv(W, BW))](y, ids, out, W, E, K_TOP=k, BW=BW, num_warps=4)
    return out
