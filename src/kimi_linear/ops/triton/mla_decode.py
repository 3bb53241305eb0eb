"""Paged MLA decode attention (:mod:`kimi_linear.ops.mla_decode`) as flash decoding in Triton (issue 18).

A decode step reads every cached entry of every row once: at 1M tokens that is 1.2 GB of 576-wide bf16 entries per
layer, so the step is a stream over the pool and the kernel's job is to keep HBM busy. Two launches:

1. split: one program per (head block, context split, row). It walks its split's keys BN at a time, looking each
   key's block up in the row's block table (any block size: keys of one tile may sit in several blocks), loads the
   [BN, C + R] key tile once for the BH heads of its head block, and keeps an online softmax:

       s = scale * q K^T             [BH, BN]   (latent and rope parts as two tl.dot's: 512 + 64 is no power of 2)
       m' = max(m, max_j s);  l = l e^(m - m') + sum_j e^(s - m');  acc = acc e^(m - m') + e^(s - m') K[:, :C]

   then writes acc / l ([BH, C] float32) and lse = m + log l of its split. Splits are cut from the row's own length
   (read on the device), so every split of a row gets the same share; the ones past a short row's keys do nothing.
2. merge: one program per (channel block, head, row) combines the row's used splits:
   ``ctx = sum_s e^(lse_s - M) o_s / sum_s e^(lse_s - M)`` with M the largest lse_s.
   With one split the first kernel writes the output itself and the merge is skipped.

The grid and the split count depend on static shapes only (batch, heads, table width, block size), never on
``seq_lens``' values, so a step can be captured in a CUDA graph and replayed with new lengths. Softmax runs in base 2
(scale folded with log2 e); lse is returned in natural log. Addresses of pool rows are int64 (a 1M-token pool of
576-wide bf16 entries is 1.2 GB, and a pool holds many sequences).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunk_common import cast, mm
from .device import num_sms
from .ints import cdiv, next_pow2
from .pdl import pdl_args, pdl_entry

LOG2E = 1.4426950408889634
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)

# Tiles (BH heads x BN keys), warps and pipeline stages per pool dtype. BH = 16 is the smallest M of a tensor-core
# product; every tile here runs on mma.sync (M <= 32 is too small for Hopper's wgmma). 3 stages keep two key tiles in
# flight (the block ids are loaded a tile ahead for that: see the split kernel). H200 sweep of 2026-12-02
# (bench/mla_decode_gpu.py --sweep, bf16, H = 32, graph replays, best split count), ms at 1 x 1M / 1 x 128k /
# 128 x 4k / 1 x 4k: [32, 64] at 8 warps 0.460 / 0.077 / 0.236 / 0.0176 with 3 stages (2.6 TB/s at 1M) against
# 0.589 / 0.096 / 0.313 / 0.0172 with 2 (one buffer: each tile waited for after the products); [16, 32] at 4 warps
# 0.604 / 0.091 / 0.322 / 0.0159 with 3 stages, 0.663 / 0.107 / 0.351 / 0.0165 with 2; slower at every size: [32, 64]
# at 16 warps, [32, 32] at 8 warps with 3 or 4 stages (also with registers capped at 128 for two programs per SM),
# [32, 128] at 16 warps with 2. [32, 64] tiles serve splits of >= LONG_SPLIT_KEYS keys, [16, 32] shorter ones.
# Float32 pools (exact products, for checks) keep 2 stages: their [16, 32] tiles at 3 would take 182 KB of shared
# memory, one program per SM (offline sm_90 build: 110 KB and 157-176 registers at 2 stages, no spills).
LAUNCH = {2: (16, 32, 4, 3), 4: (16, 32, 8, 2)}     # pool element size -> (BH, BN, num_warps, num_stages)
LAUNCH_LONG = (32, 64, 8, 3)                 # 16-bit pools, splits of >= LONG_SPLIT_KEYS keys (184 KB of shared memory)
LONG_SPLIT_KEYS = 512   # 1 row x 128k in 132 splits of ~1k keys: 0.077 ms with these tiles, 0.091 with LAUNCH's
LONG_PER_SM = 1         # one [32, 64] program per SM fills it (128 rows x 4k: 1 split, no merge pass; 2 were slower)
# Merge programs of MERGE_BV channels taking up to MERGE_BS splits a loop step: 1 x 128k (128 used splits of 132) in
# one step of 8 x 32 x 1 programs. H200, graph replays of the whole op, three runs each: 76.5-76.8 us at 1 x 128k and
# 456.5-456.9 at 1 x 1M against 79.9 / 460.2-460.7 with 128 channels and 64 splits a step (4k: one split, no merge).
MERGE_BV = 64
MERGE_BS = 128

# Split heuristic (default_num_splits): about PROGRAMS_PER_SM split programs per SM in flight (two fit by registers
# and shared memory), a full-length row cut into pieces of at most MAX_SPLIT_KEYS keys (lengths are unknown on the
# host: a batch may hold one long row among short ones, whose single program would finish last), no piece shorter
# than MIN_SPLIT_KEYS keys, at most MAX_SPLITS. That cutting stops at LONG_ROW_PROGRAMS_PER_SM programs per SM in
# all: a large batch fills the card without it, and its float32 partials grow as batch * heads * splits (256 rows
# of a 1M-token table cut into 128 splits would take 2 GB and a merge pass over them every step).
PROGRAMS_PER_SM = 2
LONG_ROW_PROGRAMS_PER_SM = 16
MIN_SPLIT_KEYS = 64     # a split walks its keys one dependent tile load after another: few rows want short ones
MAX_SPLIT_KEYS = 8192
MAX_SPLITS = 512


@triton.jit
def split_range(seq_lens, i_b, NS, MB, BS: tl.constexpr, BN: tl.constexpr):
    """Row i_b's length L (cut at the table's MB * BS keys), its number of BN-key tiles NT and tiles per split TPS
    (>= 1): split s covers tiles [s TPS, min((s + 1) TPS, NT)), so splits 0 .. cdiv(NT, TPS) - 1 hold keys."""
    L = tl.minimum(tl.load(seq_lens + i_b).to(tl.int32), MB * BS)
    L = tl.maximum(L, 0)
    NT = tl.cdiv(L, BN)
    TPS = tl.maximum(tl.cdiv(NT, NS), 1)
    return L, NT, TPS


@triton.jit
def finish(b_m, b_l):
    """An online softmax's ``(1 / l, m + log2 l)``; ``(0, -inf)`` where no key was seen (l = 0), computed without
    dividing by 0 or taking log2(0)."""
    b_seen = b_l > 0
    b_ls = tl.where(b_seen, b_l, 1.0)
    return tl.where(b_seen, 1.0 / b_ls, 0.0), tl.where(b_seen, b_m + tl.log2(b_ls), float("-inf"))


@triton.jit
def tile_blocks(p_t, i_t, hi, BS: tl.constexpr, BN: tl.constexpr):
    """Pool block of each key of tile i_t ([BN] int64); 0 for keys at or past ``hi`` (their table entries may hold
    anything, NaN included in the pool: they are never read)."""
    o_n = i_t * BN + tl.arange(0, BN)
    return tl.load(p_t + o_n // BS, mask=o_n < hi, other=0).to(tl.int64)


@triton.jit
def tile_keys(cache, i_t, b_blk, hi, BS: tl.constexpr, BN: tl.constexpr, C: tl.constexpr, R: tl.constexpr,
              BC: tl.constexpr, BR: tl.constexpr):
    """Tile i_t's entries: latent part [BN, BC] and rope part [BN, BR] (0 past ``hi``, C and R)."""
    W: tl.constexpr = C + R          # constexpr: row offsets are multiples of W, so loads of a row vectorise
    o_n = i_t * BN + tl.arange(0, BN)
    o_c, o_r = tl.arange(0, BC), tl.arange(0, BR)
    m_n = o_n < hi
    o_row = (b_blk * BS + o_n % BS) * W                                                              # [BN] int64
    b_k = tl.load(cache + o_row[:, None] + o_c[None, :], mask=m_n[:, None] & (o_c < C)[None, :], other=0.0)
    b_kr = tl.load(cache + o_row[:, None] + C + o_r[None, :], mask=m_n[:, None] & (o_r < R)[None, :], other=0.0)
    return b_k, b_kr


@triton.jit
def attend(b_q, b_qr, b_k, b_kr, m_n, qk_scale, b_m, b_l, b_acc, PREC: tl.constexpr):
    """One tile of the online softmax (base 2): scores s = scale q K^T [BH, BN] (latent and rope parts as two
    products: 512 + 64 is no power of 2), then the running max m, sum l and output acc rescaled and updated.
    A split's first tile always holds a key, so m is finite from the first tile on."""
    b_s = mm(b_q, tl.trans(b_k), PREC) + mm(b_qr, tl.trans(b_kr), PREC)                             # [BH, BN]
    b_s = tl.where(m_n[None, :], b_s * qk_scale, float("-inf"))
    b_m_new = tl.maximum(b_m, tl.max(b_s, 1))                                                        # [BH]
    b_alpha = tl.exp2(b_m - b_m_new)
    b_p = tl.exp2(b_s - b_m_new[:, None])                                                            # [BH, BN]
    b_l = b_l * b_alpha + tl.sum(b_p, 1)
    b_acc = b_acc * b_alpha[:, None] + mm(cast(b_p, b_k.dtype), b_k, PREC)                          # [BH, BC]
    return b_m_new, b_l, b_acc


@triton.jit
def mla_decode_split_kernel(
    q, cache, block_table, seq_lens,  # [B, H, W], [num_blocks, BS, W], [B, >= MB] (row stride stride_t), [B]
    o_part, lse_part,                 # out: [B, H, NS, C] float32, [B, H, NS] float32 (base 2); unused if SINGLE
    o, lse,                           # out if SINGLE: [B, H, C] in q's dtype, [B, H] float32 (natural log)
    qk_scale, stride_t, H, NS, MB,
    C: tl.constexpr, R: tl.constexpr, BS: tl.constexpr,
    BH: tl.constexpr, BN: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr,
    PREC: tl.constexpr, SINGLE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_entry(PDL)
    # head blocks fastest: the programs that read the same key tiles start side by side and share them in L2
    i_hb, i_s, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    W: tl.constexpr = C + R
    L, NT, TPS = split_range(seq_lens, i_b, NS, MB, BS, BN)
    t0 = i_s * TPS
    t1 = tl.minimum(t0 + TPS, NT)
    hi = tl.minimum(t1 * BN, L)      # this split's keys end here

    o_h = i_hb * BH + tl.arange(0, BH)
    o_c = tl.arange(0, BC)
    o_r = tl.arange(0, BR)
    m_h, m_c, m_r = o_h < H, o_c < C, o_r < R
    dt = cache.dtype.element_ty
    p_q = q + (i_b * H + o_h)[:, None] * W
    b_q = cast(tl.load(p_q + o_c[None, :], mask=m_h[:, None] & m_c[None, :], other=0.0), dt)         # [BH, BC]
    b_qr = cast(tl.load(p_q + C + o_r[None, :], mask=m_h[:, None] & m_r[None, :], other=0.0), dt)    # [BH, BR]

    b_m = tl.full([BH], float("-inf"), dtype=tl.float32)                                             # [BH]
    b_l = tl.zeros([BH], dtype=tl.float32)                                                           # [BH]
    b_acc = tl.zeros([BH, BC], dtype=tl.float32)                                                     # [BH, BC]
    p_t = block_table + i_b * stride_t
    # The next tile's block ids are loaded one iteration ahead and carried: a key load whose addresses come from a
    # load of the same iteration is one Triton's pipeliner leaves single-buffered (it waits for each tile after
    # the two products), while addresses carried in from the previous iteration let it keep num_stages - 1 key
    # tiles in flight (offline sm_90 build: 2 buffers at 3 stages, 1 before whatever the stages).
    b_blk = tile_blocks(p_t, t0, hi, BS, BN)                                                         # [BN]
    for i_t in range(t0, t1):
        b_k, b_kr = tile_keys(cache, i_t, b_blk, hi, BS, BN, C, R, BC, BR)                           # [BN, BC|BR]
        b_blk = tile_blocks(p_t, i_t + 1, hi, BS, BN)          # past the split's keys: masked, nothing read
        m_n = i_t * BN + tl.arange(0, BN) < hi
        b_m, b_l, b_acc = attend(b_q, b_qr, b_k, b_kr, m_n, qk_scale, b_m, b_l, b_acc, PREC)

    # an empty split (past the row's keys) writes nothing; the merge skips it. (tl.where rather than `m_h & (t0 <
    # t1)`: the interpreter turns a vector & scalar of booleans into integers, which it refuses as a mask.)
    m_w = tl.where(t0 < t1, m_h, False)                                                              # [BH]
    b_inv, b_lse = finish(b_m, b_l)                                                                  # [BH], [BH]
    b_o = b_acc * b_inv[:, None]                                                                     # [BH, BC]
    if SINGLE:
        # one split: this is the answer (a row without keys: ctx 0, lse -inf)
        tl.store(o + (i_b * H + o_h)[:, None] * C + o_c[None, :], cast(b_o, o.dtype.element_ty),
                 mask=m_h[:, None] & m_c[None, :])
        tl.store(lse + i_b * H + o_h, b_lse * LN2, mask=m_h)
    else:
        o_p = (i_b * H + o_h) * NS + i_s                                                             # [BH] int64
        tl.store(o_part + o_p[:, None] * C + o_c[None, :], b_o, mask=m_w[:, None] & m_c[None, :])
        tl.store(lse_part + o_p, b_lse, mask=m_w)


@triton.jit
def mla_decode_merge_kernel(
    o_part, lse_part, seq_lens,       # [B, H, NS, C] float32, [B, H, NS] float32 (base 2), [B]
    o, lse,                           # out: [B, H, C] in q's dtype, [B, H] float32 (natural log)
    H, NS, MB,
    C: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, BV: tl.constexpr, BSP: tl.constexpr,
    PDL: tl.constexpr,
):
    """One pass over the row's used splits, BSP at a time, with the same online rescaling as the split kernel:
    each step loads its lse and partial outputs together, so at batch 1 a merge is one or two round trips to
    memory."""
    pdl_entry(PDL)
    i_v, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    L, NT, TPS = split_range(seq_lens, i_b, NS, MB, BS, BN)
    n_used = tl.cdiv(NT, TPS)         # the splits the split kernel wrote; the others hold whatever memory held
    i_bh = i_b * H + i_h
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < C

    b_M = tl.full([], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([], dtype=tl.float32)
    b_acc = tl.zeros([BV], dtype=tl.float32)                                                         # [BV]
    for i0 in range(0, n_used, BSP):
        o_sp = i0 + tl.arange(0, BSP)
        m_sp = o_sp < n_used
        b_lse = tl.load(lse_part + i_bh * NS + o_sp, mask=m_sp, other=float("-inf"))                # [BSP]
        b_op = tl.load(o_part + (i_bh * NS + o_sp)[:, None] * C + o_v[None, :],
                       mask=m_sp[:, None] & m_v[None, :], other=0.0)                                 # [BSP, BV]
        # every used split holds keys, so its lse is finite and b_M_new is from the first step on
        b_M_new = tl.maximum(b_M, tl.max(b_lse, 0))
        b_alpha = tl.exp2(b_M - b_M_new)
        b_w = tl.where(m_sp, tl.exp2(b_lse - b_M_new), 0.0)                                          # [BSP]
        b_acc = b_acc * b_alpha + tl.sum(b_w[:, None] * b_op, 0)
        b_l = b_l * b_alpha + tl.sum(b_w, 0)
        b_M = b_M_new
    b_inv, b_lse = finish(b_M, b_l)
    b_o = b_acc * b_inv                                                                              # [BV]
    tl.store(o + i_bh * C + o_v, cast(b_o, o.dtype.element_ty), mask=m_v)
    tl.store(lse + i_bh, b_lse * LN2, mask=i_v == 0)


def default_num_splits(batch: int, heads: int, max_blocks: int, block_size: int, sms: int,
                       block_h: int = 16, per_sm: int = PROGRAMS_PER_SM) -> int:
    """Splits per row from static shapes only (a CUDA graph fixes the grid; the lengths live on the device).

    Enough split programs for about ``per_sm`` per SM (batch * head blocks * splits), and enough splits that a
    row as long as the table allows is cut into pieces of at most MAX_SPLIT_KEYS keys (so one long row among short
    ones does not finish long after them) while that keeps the launch under LONG_ROW_PROGRAMS_PER_SM programs per
    SM; but no piece shorter than MIN_SPLIT_KEYS keys of that longest row, and at most MAX_SPLITS. A row's keys
    are divided among the splits by its own length on the device, and splits past a short row's keys do nothing.
    On 132 SMs with 32 heads (2 head blocks): one row at 1M tokens, 132 splits of ~8k keys (264 programs); 128 or
    256 rows at 4k, one split (no merge pass); 32 rows at 4k, 4 splits of 1k keys; 32 rows at 256k, 32 splits of
    8k keys; 256 rows of a 1M-token table (a serving engine's), 4 splits.
    """
    programs = max(1, batch * cdiv(heads, block_h))
    max_len = max_blocks * block_size
    long_row = min(cdiv(max_len, MAX_SPLIT_KEYS), max(1, (LONG_ROW_PROGRAMS_PER_SM * sms) // programs))
    want = max((per_sm * sms) // programs, long_row, 1)
    most = max(1, cdiv(max_len, MIN_SPLIT_KEYS))
    return min(want, most, MAX_SPLITS)


def launch_shape(element_size: int, batch: int, heads: int, max_blocks: int, block_size: int,
                 sms: int) -> tuple[int, int, int, int]:
    """(BH, BN, num_warps, num_stages) from static shapes: :data:`LAUNCH_LONG` for 16-bit pools when
    its split count leaves pieces of at least LONG_SPLIT_KEYS keys of a full-length row, else :data:`LAUNCH`."""
    if element_size == 2:
        splits = default_num_splits(batch, heads, max_blocks, block_size, sms, LAUNCH_LONG[0], LONG_PER_SM)
        if max_blocks * block_size >= LONG_SPLIT_KEYS * splits:
            return LAUNCH_LONG
    return LAUNCH[element_size]


def paged_mla_decode(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, kv_lora_rank: int, num_splits: int | None = None, block_h: int | None = None,
                     block_n: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kimi_linear.ops.mla_decode.paged_mla_decode` on the GPU (arguments checked there): ``(ctx [B, H, C]
    in q's dtype, lse [B, H] float32)``. q is cast to the pool's dtype for the products (float32 accumulation).
    block_h / block_n (powers of two >= 16) / num_warps / num_stages override the launch table's choice
    (benchmarks)."""
    B, H, W = q.shape
    C, R = kv_lora_rank, W - kv_lora_rank
    BS = cache.shape[1]
    MB = block_table.shape[1]
    BH, BN, warps, stages = launch_shape(cache.element_size(), B, H, MB, BS, num_sms(q.device))
    BH, BN = block_h or BH, block_n or BN
    q, seq_lens = q.contiguous(), seq_lens.contiguous()
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    per_sm = LONG_PER_SM if (BH, BN, warps) == LAUNCH_LONG[:3] else PROGRAMS_PER_SM
    NS = num_splits or default_num_splits(B, H, MB, BS, num_sms(q.device), BH, per_sm)
    o = torch.empty(B, H, C, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, dtype=torch.float32, device=q.device)
    if B == 0 or H == 0:
        return o, lse
    BC, BR = max(16, next_pow2(C)), max(16, next_pow2(R))
    prec = "ieee" if cache.dtype == torch.float32 else "tf32"     # 16-bit pools: tensor-core products either way
    single = NS == 1
    if single:
        o_part, lse_part = o, lse                                   # not written
    else:
        o_part = torch.empty(B, H, NS, C, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(B, H, NS, dtype=torch.float32, device=q.device)
    mla_decode_split_kernel[(cdiv(H, BH), NS, B)](
        q, cache, block_table, seq_lens, o_part, lse_part, o, lse,
        scale * LOG2E, block_table.stride(0), H, NS, MB,
        C=C, R=R, BS=BS, BH=BH, BN=BN, BC=BC, BR=BR, PREC=prec, SINGLE=single,
        num_warps=num_warps or warps, num_stages=num_stages or stages, **pdl_args(q.device),
    )
    if not single:
        BV = min(MERGE_BV, BC)
        mla_decode_merge_kernel[(cdiv(C, BV), H, B)](
            o_part, lse_part, seq_lens, o, lse, H, NS, MB,
            C=C, BS=BS, BN=BN, BV=BV, BSP=min(MERGE_BS, next_pow2(NS)), num_warps=4,
            **pdl_args(q.device),
        )
    return o, lse
