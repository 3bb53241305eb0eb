"""A decode step's float32 logits and greedy tokens (:mod:`kimi_linear.ops.greedy`) in two Triton launches."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .ints import cdiv, next_pow2
from .pdl import pdl_args, pdl_entry

# Logits a program of the first launch reads: 40 programs a row for a 163,840-word vocabulary, each loading 8 KB
# of bf16 (batch 1 is bound by latency, not bytes: a few waves of wide loads, not many small programs).
BV = 4096


@triton.jit
def greedy_chunk_kernel(
    logits,                  # [B, V] (row stride s_l) float32, bfloat16 or float16
    out, c_max, c_idx, c_nan,  # out: [B, V] float32; per chunk [B, NC]: float32 max, int32 its index, int32 NaN seen
    V, NC, s_l,
    BV: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (row r, chunk c): logits ``c BV .. (c + 1) BV`` of row r in float32 to ``out``, and the chunk's
    largest value with NaNs taken as -inf (its first index: ``tl.max`` breaks ties to the left, and padding past V
    holds -inf at the chunk's end, so a chunk of all -inf gives its first real index) and whether it holds a NaN."""
    pdl_entry(PDL)
    i_r, i_c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_v = i_c * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_x = tl.load(logits + i_r * s_l + o_v, mask=m_v, other=float("-inf")).to(tl.float32)          # [BV]
    tl.store(out + i_r * V + o_v, b_x, mask=m_v)
    b_nan = b_x != b_x
    b_m, b_i = tl.max(tl.where(b_nan, float("-inf"), b_x), 0, return_indices=True,
                      return_indices_tie_break_left=True)
    tl.store(c_max + i_r * NC + i_c, b_m)
    tl.store(c_idx + i_r * NC + i_c, (i_c * BV + b_i).to(tl.int32))
    tl.store(c_nan + i_r * NC + i_c, tl.max(b_nan.to(tl.int32), 0))


@triton.jit
def greedy_pick_kernel(
    c_max, c_idx, c_nan,     # [B, NC] from greedy_chunk_kernel
    ids,                     # out: [B] int64
    NC,
    BC: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program r: the first chunk holding row r's maximum (chunks are in order, so its first index is the row's
    first index of the maximum), -1 if any chunk saw a NaN."""
    pdl_entry(PDL)
    i_r = tl.program_id(0).to(tl.int64)
    o_c = tl.arange(0, BC)
    m_c = o_c < NC
    b_m = tl.load(c_max + i_r * NC + o_c, mask=m_c, other=float("-inf"))                            # [BC]
    _, b_j = tl.max(b_m, 0, return_indices=True, return_indices_tie_break_left=True)
    b_i = tl.load(c_idx + i_r * NC + b_j).to(tl.int64)
    b_nan = tl.max(tl.load(c_nan + i_r * NC + o_c, mask=m_c, other=0), 0)
    tl.store(ids + i_r, tl.where(b_nan > 0, -1, b_i))


def logits_and_greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`kimi_linear.ops.greedy.logits_and_greedy` (arguments checked there)."""
    B, V = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    NC = cdiv(V, BV)
    out = torch.empty(B, V, dtype=torch.float32, device=dev)
    c_max = torch.empty(B, NC, dtype=torch.float32, device=dev)
    c_idx = torch.empty(B, NC, dtype=torch.int32, device=dev)
    c_nan = torch.empty(B, NC, dtype=torch.int32, device=dev)
    ids = torch.empty(B, dtype=torch.int64, device=dev)
    greedy_chunk_kernel[(B, NC)](logits, out, c_max, c_idx, c_nan, V, NC, logits.stride(0), BV=BV, num_warps=4,
                                 **pdl_args(dev))
    greedy_pick_kernel[(B,)](c_max, c_idx, c_nan, ids, NC, BC=next_pow2(NC), num_warps=1, **pdl_args(dev))
    return out, ids
