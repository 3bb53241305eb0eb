"""Fused mixture of experts (:mod:`kimi_linear.ops.moe`) in Triton: grouped GEMMs over the (token, expert) pairs
sorted by expert, with every shape fixed by (N, k, E), so a decode step can be captured in a CUDA graph.

Pipeline (``K = k + S`` pairs per token, S shared experts; ``M = N * K`` pairs; pair ``p = n * K + j`` is token
n's j-th choice for j < k, its shared expert ``E + j - k`` after; :func:`pair_expert`):

1. align (one program): counts of pairs per expert (``tl.histogram``), each expert's segment padded to a multiple
   of ``BM`` slots, and ``slot_pair`` [P]: the pair in each slot, ``M`` for padding, placed by an atomic cursor
   per expert (a counting sort: no ``torch.sort``, whose radix sort alone took 6-28 us a layer on the H200). The
   order of pairs inside a segment is not fixed, and need not be: every output row of a block's products
   depends on its own pair's row only. Blocks of BM slots hold one expert's pairs each; a segment of c pairs
   takes ceil(c / BM) blocks, so there are at most ``NB = ceil(M / BM) + min(E + S, M)`` blocks, and
   ``P = NB * BM`` slots. Blocks past the real count hold only padding: their programs read the sentinel in the
   first slot and exit, so the launch grids depend on (N, k, E, S) only and nothing is read on the host.
2. gate/up: per block and BN1 columns of I, ``glu(x_rows @ w1[e]^T, x_rows @ w3[e]^T)`` with float32
   accumulators, the GLU in the epilogue in float32 -> ``h`` [P, I] in x's dtype (rounded there, as the layers do).
3. down: per block and BN2 columns of W, ``h_rows @ w2[e]^T`` times each pair's routing weight (1 for a shared
   expert) -> ``y`` [M, W] float32 at the pair's row.
4. combine: ``out[n] = sum_j y[n * K + j]`` in a fixed order (deterministic, no atomics), cast to x's dtype.

One token (N = 1, a batch-1 decode step) skips step 1: its K pairs go to K different experts (top-k ids are
distinct; a repeated or out-of-range id is still computed correctly below), so block j simply holds pair j. That
``slot_pair`` depends on (K, BM) only and is built once per device (:func:`one_token_slots`), and the step is one
launch shorter. The kernels exit for a block whose pair has no expert (a routed id outside [0, E)), as the sort
leaves such pairs out; combine adds 0 for them.

Decoding is bound by reading the chosen experts' weights: a block reads its expert's weights once per column
tile, so BM is chosen at or above the typical number of tokens per expert (:func:`moe_launch`), and the column
tiles (16 per expert for I = 1024, BN1 = 64) keep every SM streaming even at N = 1.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .chunk_common import cast
from .fastmath import INTERPRET
from .ints import cdiv, next_pow2
from .pdl import pdl_args, pdl_entry, prefetch_args, prefetch_l2
from .tma import tensor_descriptor_class, tma_supported


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
    # The expert weights' tiles through TMA descriptors (:func:`weight_descriptors`) where they can be made (else
    # pointer loads: the CPU's packed layout, the interpreter). Offline sm_90 build of the gate/up kernel at N = 1
    # (E = 32, W = 2304, I = 1024): pointer loads compile to 255 registers with spills and register-staged loads;
    # descriptors to 114 registers and four stages of weight tiles in 110 KB of shared memory. H200, 2026-12-02,
    # routed experts in a CUDA graph (`bench/moe_gpu.py --E 32 --N 1,8,128,256` without / with `--tma`):
    # 40.8 / 116.2 / 145.6 / 171.7 us against 38.5 / 114.4 / 141.7 / 172.3 with descriptors, checks passed.
    tma: bool = True


def moe_launch(N: int, k: int, E: int, W: int, I: int, dtype: torch.dtype) -> MoELaunch:
    """The launch shape for N tokens choosing k of E experts [2I, W] / [W, I] (a fixed table, no autotuning: the
    choice must not depend on anything but shapes, and autotuning inside a CUDA graph capture is not safe).

    While the step is bound by weight bandwidth (up to thousands of pairs for E = 256), a block should hold all
    of an expert's tokens: its weights are then read once. With balanced routing an expert gets about
    ``N k / E`` tokens (Poisson spread), so BM grows with that mean. One token has a row of its own, timed in the
    decode step on the H200; the others are not yet tuned on a GPU (``bench/moe_gpu.py --sweep`` / ``--grid`` time
    alternatives)."""
    mean = N * k / E
    if N == 1:
        # the one-token layout (one block a pair): H200, 2026-12-04, the 48B-shaped decode step at batch 1 (9 pairs
        # with the shared expert), kernel times under the profiler, two rounds: gate/up 25.6 -> 24.0 us a call at 3
        # stages against 4, down 13.3 -> 12.7 (BK 64 at 4-8 stages, BN 128, 8 warps, BN 16-32: all slower); TPOT,
        # means of two rounds, engine 0.941 -> 0.931 ms at 4k of context and 1.058 -> 1.047 at 128k, generate
        # 0.946 -> 0.934 and 1.056 -> 1.036
        cfg = MoELaunch(BM=16, BN1=64, BK1=128, warps1=4, stages1=3, BN2=64, BK2=128, warps2=4, stages2=3)
    elif mean <= 8:
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
def pair_expert(ids, p, m, K_TOP: tl.constexpr, K_ALL: tl.constexpr, E):
    """Expert of pairs p (int, where m): token p // K_ALL's choice ``ids[n, j]`` for j = p % K_ALL < K_TOP (-1 if
    outside [0, E), the routed experts), else its shared expert E + j - K_TOP; -1 where masked."""
    n, j = p // K_ALL, p % K_ALL
    m_r = m & (j < K_TOP)
    b_e = tl.load(ids + n * K_TOP + j, mask=m_r, other=-1).to(tl.int32)
    b_e = tl.where((b_e >= 0) & (b_e < E), b_e, -1)
    return tl.where(m_r, b_e, tl.where(m, E + j - K_TOP, -1))


@triton.jit
def moe_align_kernel(
    ids,                    # [N * k] routed expert ids, token-major
    cursor,                 # scratch int32 [BE]
    slot_pair,              # out: int32 [P], the pair in each slot, M for padding
    M, P, E, E_ALL,
    K_TOP: tl.constexpr, K_ALL: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BS: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program (module docstring, step 1). Routed ids outside [0, E) are left out (counted in bin BE - 1,
    which no expert uses: BE > E_ALL). The barrier orders the cursor's plain stores before the atomics of other
    threads."""
    pdl_entry(PDL)
    o_e = tl.arange(0, BE)
    b_count = tl.zeros([BE], dtype=tl.int32)
    for i0 in range(0, M, BS):
        o_i = i0 + tl.arange(0, BS)
        b_e = pair_expert(ids, o_i, o_i < M, K_TOP, K_ALL, E)                          # [BS]
        b_count += tl.histogram(tl.where(b_e >= 0, b_e, BE - 1), BE)
    b_count = tl.where(o_e < E_ALL, b_count, 0)
    b_pad = (b_count + BM - 1) // BM * BM
    tl.store(cursor + o_e, tl.cumsum(b_pad, 0) - b_pad)                                 # each segment's first slot
    for s0 in range(0, P, BS):
        o_s = s0 + tl.arange(0, BS)
        tl.store(slot_pair + o_s, tl.zeros([BS], dtype=tl.int32) + M, mask=o_s < P)
    tl.debug_barrier()
    for i0 in range(0, M, BS):
        o_i = i0 + tl.arange(0, BS)
        b_e = pair_expert(ids, o_i, o_i < M, K_TOP, K_ALL, E)
        m_e = b_e >= 0
        b_slot = tl.atomic_add(cursor + b_e, tl.zeros([BS], dtype=tl.int32) + 1, mask=m_e)
        tl.store(slot_pair + b_slot, o_i, mask=m_e)


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
    x, w13, slot_pair, ids,            # [N, W], [E + S, 2I, W] (strides s_we, s_wn, s_wk), [P] int32, [N * k] ids
    h,                                 # out: [P, I] in x's dtype, rows of padding slots untouched
    M, W, I, E, NT, s_xn, s_we, s_wn, s_wk, beta, linear_beta,
    K_TOP: tl.constexpr, K_ALL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, SITU: tl.constexpr,
    d_w, TMA: tl.constexpr,            # w13's [(E + S) 2I, W] view with [BN, BK] blocks (MoELaunch.tma), else w13
    PDL: tl.constexpr,
):
    pdl_entry(PDL)
    i_p = tl.program_id(0)
    i_b, i_n = i_p // NT, i_p % NT
    first = tl.load(slot_pair + i_b * BM)
    if first >= M:                                                      # a block past the real ones
        return
    i_e = pair_expert(ids, first, first >= 0, K_TOP, K_ALL, E).to(tl.int64)
    if i_e < 0:                                                         # one-token layout: a pair without expert
        return
    o_m = i_b * BM + tl.arange(0, BM)
    b_pair = tl.load(slot_pair + o_m)                                   # [BM]
    m_m = b_pair < M
    b_tok = tl.where(m_m, b_pair // K_ALL, 0).to(tl.int64)
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = (o_n < I) | EVEN_N
    o_k = tl.arange(0, BK)
    p_x = x + b_tok[:, None] * s_xn + o_k[None, :]                      # [BM, BK]
    p_g = w13 + i_e * s_we + o_n[None, :].to(tl.int64) * s_wn + o_k[:, None] * s_wk           # [BK, BN]
    p_u = p_g + I * s_wn
    r_g = (i_e * 2 * I + i_n * BN).to(tl.int32)                         # the gate tile's first row in d_w
    b_acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    b_acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, W, BK):
        m_k = (o_k < W - k0) | EVEN_K
        b_x = tl.load(p_x, mask=m_m[:, None] & m_k[None, :], other=0.0)                        # [BM, BK]
        if TMA:
            # columns past W read zeros; rows past this expert's gate (or up) rows belong to columns of h that
            # the store leaves out
            b_wg = tl.trans(d_w.load([r_g, k0]))                                                # [BK, BN]
            b_wu = tl.trans(d_w.load([r_g + I, k0]))                                            # [BK, BN]
        else:
            b_wg = tl.load(p_g, mask=m_k[:, None] & m_n[None, :], other=0.0)                   # [BK, BN]
            b_wu = tl.load(p_u, mask=m_k[:, None] & m_n[None, :], other=0.0)                   # [BK, BN]
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
    h, w2, slot_pair, ids, topk_weights,   # [P, I], [E + S, W, I] (strides s_we, s_wn, s_wk), [P], [N * k] x 2
    y,                                     # out: [M, W] float32, each pair's weighted expert output
    M, W, I, E, NT, s_we, s_wn, s_wk,
    K_TOP: tl.constexpr, K_ALL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    d_w, TMA: tl.constexpr,                # w2's [(E + S) W, I] view with [BN, BK] blocks (MoELaunch.tma), else w2
    PDL: tl.constexpr,
):
    pdl_entry(PDL)
    i_p = tl.program_id(0)
    i_b, i_n = i_p // NT, i_p % NT
    first = tl.load(slot_pair + i_b * BM)
    if first >= M:
        return
    i_e = pair_expert(ids, first, first >= 0, K_TOP, K_ALL, E).to(tl.int64)
    if i_e < 0:
        return
    o_m = i_b * BM + tl.arange(0, BM)
    b_pair = tl.load(slot_pair + o_m)                                   # [BM]
    m_m = b_pair < M
    o_n = i_n * BN + tl.arange(0, BN)
    m_n = (o_n < W) | EVEN_N
    o_k = tl.arange(0, BK)
    p_h = h + o_m[:, None].to(tl.int64) * I + o_k[None, :]               # [BM, BK]
    p_w = w2 + i_e * s_we + o_n[None, :].to(tl.int64) * s_wn + o_k[:, None] * s_wk            # [BK, BN]
    r_w = (i_e * W + i_n * BN).to(tl.int32)                             # the tile's first row in d_w
    b_acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, I, BK):
        m_k = (o_k < I - k0) | EVEN_K
        b_h = tl.load(p_h, mask=m_m[:, None] & m_k[None, :], other=0.0)                        # [BM, BK]
        if TMA:
            b_w = tl.trans(d_w.load([r_w, k0]))      # [BK, BN]; as in the gate/up kernel, extra rows are not stored
        else:
            b_w = tl.load(p_w, mask=m_k[:, None] & m_n[None, :], other=0.0)                    # [BK, BN]
        b_acc = mma(b_h, b_w, b_acc)
        p_h += BK
        p_w += BK * s_wk
    b_n, b_j = b_pair // K_ALL, b_pair % K_ALL
    b_r = tl.load(topk_weights + b_n * K_TOP + b_j, mask=m_m & (b_j < K_TOP), other=1.0)        # [BM] 1: shared
    p_y = y + b_pair[:, None].to(tl.int64) * W + o_n[None, :]
    tl.store(p_y, b_acc * b_r[:, None], mask=m_m[:, None] & m_n[None, :])


@triton.jit
def moe_combine_kernel(
    y, ids, residual,        # [N * K, W] float32, [N * k] routed expert ids, [N, W] (row stride s_rn) if RESIDUAL
    out,                     # out: [N, W] in x's dtype
    W, E, s_rn,
    K_TOP: tl.constexpr, K_ALL: tl.constexpr, BW: tl.constexpr, RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    """``out[n] = residual[n] + sum_j y[n K + j]`` over j in order (shared experts last), float32 until the one
    rounding; a routed pair whose id is outside [0, E) (never computed) adds 0."""
    pdl_entry(PDL)
    i_t, i_w = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_w = i_w * BW + tl.arange(0, BW)
    m_w = o_w < W
    b_o = tl.zeros([BW], dtype=tl.float32)                                                          # [BW]
    for j in tl.static_range(K_ALL):
        if j < K_TOP:
            b_e = tl.load(ids + i_t * K_TOP + j + o_w * 0)              # [BW] the pair's id, broadcast
            m_j = (b_e >= 0) & (b_e < E)
        else:
            m_j = o_w >= 0
        b_o += tl.load(y + (i_t * K_ALL + j) * W + o_w, mask=m_w & m_j, other=0.0)
    if RESIDUAL:
        b_o += tl.load(residual + i_t * s_rn + o_w, mask=m_w, other=0.0).to(tl.float32)
    tl.store(out + i_t * W + o_w, cast(b_o, out.dtype.element_ty), mask=m_w)


_ONE_TOKEN_SLOTS: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def one_token_slots(K: int, BM: int, device: torch.device) -> torch.Tensor:
    """``slot_pair`` [K * BM] int32 of one token's K pairs, block j holding pair j (the rest padding, M = K): made
    once per (K, BM, device) with device operations (so also inside a CUDA-graph capture) and kept."""
    key = (K, BM, device)
    slots = _ONE_TOKEN_SLOTS.get(key)
    if slots is None:
        slots = torch.full((K * BM,), K, dtype=torch.int32, device=device)
        slots[::BM] = torch.arange(K, dtype=torch.int32, device=device)
        _ONE_TOKEN_SLOTS[key] = slots
    return slots


def weight_descriptors(w13: torch.Tensor, w2: torch.Tensor, cfg: MoELaunch) -> tuple[object | None, object | None]:
    """TMA descriptors of the expert weights when ``cfg.tma`` and the device allow (ops/triton/tma.py): w13
    [E + S, 2I, W] as its [(E + S) 2I, W] view in [BN1, BK1] tiles, w2 [E + S, W, I] as [(E + S) W, I] in [BN2, BK2]
    tiles. Each needs contiguous rows of 16-byte multiples (a strided or transposed layout, such as the CPU's packed
    experts, keeps pointer loads: None)."""
    if not (cfg.tma and tma_supported(w13.device)):
        return None, None
    TensorDescriptor = tensor_descriptor_class()

    def desc(w: torch.Tensor, block: list[int]):
        if not w.is_contiguous() or (w.shape[2] * w.element_size()) % 16 or w.data_ptr() % 16:
            return None
        return TensorDescriptor.from_tensor(w.view(-1, w.shape[2]), block)

    return desc(w13, [cfg.BN1, cfg.BK1]), desc(w2, [cfg.BN2, cfg.BK2])


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu", situ_beta: float = 4.0,
              situ_linear_beta: float = 25.0, launch: MoELaunch | None = None, num_shared: int = 0,
              residual: torch.Tensor | None = None) -> torch.Tensor:
    """Triton ``fused_moe``: same contract as :func:`kimi_linear.ops.fused_moe` (arguments checked there). No host
    synchronisation; every allocation and grid depends on (N, k, E, S) and the weight shapes only. ``launch``
    overrides :func:`moe_launch` (benchmarks)."""
    N, W = x.shape
    E_all, I, k = w13.shape[0], w2.shape[2], topk_ids.shape[1]
    E, K = E_all - num_shared, k + num_shared
    M = N * K
    out = torch.empty(N, W, dtype=x.dtype, device=x.device)
    if N == 0:
        return out
    cfg = launch or moe_launch(N, K, E_all, W, I, x.dtype)
    BM = cfg.BM
    x = x if x.stride(1) == 1 else x.contiguous()
    ids = topk_ids.reshape(-1)
    ids = ids if ids.stride(0) == 1 else ids.contiguous()
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    if N == 1:
        slot_pair = one_token_slots(K, BM, x.device)
        NB = K
    else:
        NB = cdiv(M, BM) + min(E_all, M)
        BE = next_pow2(E_all + 1)
        cursor = torch.empty(BE, dtype=torch.int32, device=x.device)
        slot_pair = torch.empty(NB * BM, dtype=torch.int32, device=x.device)
        moe_align_kernel[(1,)](ids, cursor, slot_pair, M, NB * BM, E, E_all, K_TOP=k, K_ALL=K, BM=BM, BE=BE, BS=256,
                               num_warps=4, **pdl_args(x.device))
    P = NB * BM
    d_w13, d_w2 = weight_descriptors(w13, w2, cfg)

    h = torch.empty(P, I, dtype=x.dtype, device=x.device)
    NT1 = cdiv(I, cfg.BN1)
    moe_gate_up_kernel[(NB * NT1,)](
        x, w13, slot_pair, ids, h, M, W, I, E, NT1, x.stride(0), *w13.stride(), float(situ_beta),
        float(situ_linear_beta), K_TOP=k, K_ALL=K, BM=BM, BN=cfg.BN1, BK=cfg.BK1, EVEN_K=W % cfg.BK1 == 0,
        EVEN_N=I % cfg.BN1 == 0, SITU=activation == "situ", d_w=w13 if d_w13 is None else d_w13,
        TMA=d_w13 is not None, num_warps=cfg.warps1, num_stages=cfg.stages1, **pdl_args(x.device),
    )
    y = torch.empty(M, W, dtype=torch.float32, device=x.device)
    NT2 = cdiv(W, cfg.BN2)
    moe_down_kernel[(NB * NT2,)](
        h, w2, slot_pair, ids, weights, y, M, W, I, E, NT2, *w2.stride(), K_TOP=k, K_ALL=K, BM=BM, BN=cfg.BN2,
        BK=cfg.BK2, EVEN_K=I % cfg.BK2 == 0, EVEN_N=W % cfg.BN2 == 0, d_w=w2 if d_w2 is None else d_w2,
        TMA=d_w2 is not None, num_warps=cfg.warps2, num_stages=cfg.stages2, **pdl_args(x.device),
    )
    BW = min(1024, next_pow2(W))
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    moe_combine_kernel[(N, cdiv(W, BW))](
        y, ids, out if residual is None else residual, out, W, E, 0 if residual is None else residual.stride(0),
        K_TOP=k, K_ALL=K, BW=BW, RESIDUAL=residual is not None, num_warps=4, **pdl_args(x.device),
    )
    return out


@triton.jit
def sigmoid_topk_kernel(
    logits, bias,            # [N, E] float32, [E] float32
    weights, ids,            # out: [N, K_TOP] float32, [N, K_TOP] int64
    E, scale,
    K_TOP: tl.constexpr, BK: tl.constexpr, BE: tl.constexpr, RENORM: tl.constexpr,
    PDL: tl.constexpr,
):
    """One token per program: the K_TOP largest ``sigmoid(logit) + bias`` in decreasing order (first index on a
    tie), by K_TOP passes of max / argmin-index / knock-out over the row held in registers."""
    pdl_entry(PDL)
    i_n = tl.program_id(0).to(tl.int64)
    o_e = tl.arange(0, BE)
    m_e = o_e < E
    b_s = tl.sigmoid(tl.load(logits + i_n * E + o_e, mask=m_e, other=0.0))                  # [BE]
    b_c = b_s + tl.load(bias + o_e, mask=m_e, other=0.0)
    # NaN ranks first, as in torch.topk (it then reaches the output, as on the PyTorch path, instead of an
    # out-of-range id that the fused MoE would silently drop).
    b_c = tl.where(m_e, tl.where(b_c != b_c, float("inf"), b_c), float("-inf"))             # [BE]
    o_k = tl.arange(0, BK)
    b_w = tl.zeros([BK], dtype=tl.float32)
    b_i = tl.zeros([BK], dtype=tl.int32)
    for j in tl.static_range(K_TOP):
        b_best = tl.min(tl.where(b_c == tl.max(b_c, 0), o_e, BE), 0)                       # first index of the max
        b_w = tl.where(o_k == j, tl.sum(tl.where(o_e == b_best, b_s, 0.0), 0), b_w)
        b_i = tl.where(o_k == j, b_best, b_i)
        b_c = tl.where(o_e == b_best, float("-inf"), b_c)
    if RENORM:
        b_w = b_w / (tl.sum(b_w, 0) + 1e-20)
    m_k = o_k < K_TOP
    tl.store(weights + i_n * K_TOP + o_k, b_w * scale, mask=m_k)
    tl.store(ids + i_n * K_TOP + o_k, b_i.to(tl.int64), mask=m_k)


def sigmoid_topk(logits: torch.Tensor, bias: torch.Tensor, k: int, renormalize: bool = True,
                 scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`kimi_linear.ops.moe.sigmoid_topk` (arguments checked there): (weights [N, k] float32, ids
    [N, k] int64)."""
    N, E = logits.shape
    logits = logits if logits.stride(1) == 1 and logits.stride(0) == E else logits.contiguous()
    weights = torch.empty(N, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(N, k, dtype=torch.int64, device=logits.device)
    if N:
        sigmoid_topk_kernel[(N,)](logits, bias.float().contiguous(), weights, ids, E, float(scale), K_TOP=k,
                                  BK=next_pow2(k), BE=next_pow2(E), RENORM=renormalize,
                                  num_warps=1 if E <= 256 else 4, **pdl_args(logits.device))
    return weights, ids


@triton.jit
def router_logits_kernel(
    x, w,                    # [N, D] (row stride s_xn) any float dtype, [E, D] float32 (row stride s_we)
    logits,                  # out: [N, E] float32
    N, E, D, s_xn, s_we,
    nxt, n_nxt, c_nxt,       # uint8 view of a tensor the step reads next, its n_nxt bytes, c_nxt a program's share
    BN: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr,
    PDL: tl.constexpr, PREFETCH: tl.constexpr,
):
    """BN rows x BE experts per program: float32 products (exact float32 FMA arithmetic, no tensor cores: the
    router's top-k is sensitive to the last bits) accumulated elementwise over D's steps of BK, then reduced once:
    the steps' loads have no reduction between them and overlap (a GEMV this small waits on load latency). BN is
    fixed by the wrapper, never by N, so a row's sums do not depend on the rows beside it. With PREFETCH the
    program's weight rows (contiguous) go to L2 while the predecessor (the norm that makes x) still runs, then its
    share of ``nxt`` (the shared expert's gate/up weights, which the MoE reads right after the top-k whatever the
    routing): HBM is otherwise idle while the router and the top-k run."""
    i_n, i_e = tl.program_id(0), tl.program_id(1)
    if PREFETCH:
        prefetch_l2(w + (i_e * BE).to(tl.int64) * s_we, tl.minimum(E - i_e * BE, BE) * D * 4)
        o_nxt = (i_n * tl.num_programs(1) + i_e).to(tl.int64) * c_nxt                 # bytes before this share
        if o_nxt < n_nxt:
            prefetch_l2(nxt + o_nxt, tl.minimum(n_nxt - o_nxt, c_nxt).to(tl.int32))
    pdl_entry(PDL)
    o_n = i_n * BN + tl.arange(0, BN)
    o_e = i_e * BE + tl.arange(0, BE)
    o_k = tl.arange(0, BK)
    m_n, m_e = o_n < N, o_e < E
    p_x = x + o_n[:, None].to(tl.int64) * s_xn + o_k[None, :]                                    # [BN, BK]
    p_w = w + o_e[:, None].to(tl.int64) * s_we + o_k[None, :]                                    # [BE, BK]
    b_acc = tl.zeros([BN, BE, BK], dtype=tl.float32)                                              # [BN, BE, BK]
    for k0 in range(0, D, BK):
        m_k = o_k < D - k0
        b_x = tl.load(p_x, mask=m_n[:, None] & m_k[None, :], other=0.0).to(tl.float32)          # [BN, BK]
        b_w = tl.load(p_w, mask=m_e[:, None] & m_k[None, :], other=0.0)                          # [BE, BK]
        b_acc += b_x[:, None, :] * b_w[None, :, :]
        p_x += BK
        p_w += BK
    b_l = tl.sum(b_acc, 2)                                                                        # [BN, BE]
    tl.store(logits + o_n[:, None].to(tl.int64) * E + o_e[None, :], b_l, mask=m_n[:, None] & m_e[None, :])


# Fixed for every N (a row's sums must not depend on its batch). Decode batches read W [E, D] (295 KB for 32
# experts x 2304) in E / 2 programs of 3 steps: few loads each, which is what a GEMV this small waits on.
ROUTER_BN, ROUTER_BE, ROUTER_BK = 4, 2, 1024


def prefetchable(t: torch.Tensor | None) -> bool:
    """Whether ``t`` can be asked into L2 in 16-byte multiples (:func:`~.pdl.prefetch_l2`): contiguous, its start
    16-byte aligned and its size a multiple of 16 bytes."""
    return (t is not None and t.is_contiguous() and t.data_ptr() % 16 == 0
            and (t.numel() * t.element_size()) % 16 == 0)


def prefetch_share(nbytes: int, programs: int) -> int:
    """Bytes each of ``programs`` programs asks into L2 of an ``nbytes`` tensor (a multiple of 16): program p takes
    ``[p share, min((p + 1) share, nbytes))``, so together they cover it once, each piece a multiple of 16 bytes
    (nbytes is one: :func:`prefetchable`)."""
    return cdiv(cdiv(nbytes, programs), 16) * 16


def router_logits(x: torch.Tensor, weight: torch.Tensor, prefetch: torch.Tensor | None = None) -> torch.Tensor:
    """Triton :func:`kimi_linear.ops.moe.router_logits` (shapes checked there): [N, E] float32. ``prefetch``: a
    tensor the step reads next, shared out between the programs and asked into L2 before they wait for their
    predecessor (where PDL runs and :func:`prefetchable`; a hint: no result depends on it)."""
    N, D = x.shape
    E = weight.shape[0]
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    logits = torch.empty(N, E, dtype=torch.float32, device=x.device)
    grid = (cdiv(N, ROUTER_BN), cdiv(E, ROUTER_BE))
    n_nxt = prefetch.numel() * prefetch.element_size() if prefetchable(prefetch) else 0
    c_nxt = prefetch_share(n_nxt, grid[0] * grid[1])
    nxt = prefetch.reshape(-1).view(torch.uint8) if n_nxt else logits
    router_logits_kernel[grid](x, weight, logits, N, E, D, x.stride(0), weight.stride(0), nxt, n_nxt, c_nxt,
                               BN=ROUTER_BN, BE=ROUTER_BE, BK=ROUTER_BK, num_warps=4, **pdl_args(x.device),
                               **prefetch_args(x.device, weight.stride(0) == D and D % 4 == 0
                                               and weight.data_ptr() % 16 == 0))
    return logits
