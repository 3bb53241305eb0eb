"""The per-head products around an MLA decode step (:mod:`kimi_linear.ops.mla_heads`) in Triton."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunk_common import cast, mm
from .ints import cdiv, next_pow2
from .pdl import pdl_args, pdl_entry

BB = 16         # rows of a program (the smallest M of a tensor-core product; a batch-1 step pads 15)
BK = 64         # reduction steps
# Columns a program: the narrowest width (absorb 64, expand 16) gives a batch-1 step 256 programs of 32 heads; a
# larger batch has enough row blocks to fill the card with wider ones, and each program then reads its [K, BN]
# weight slab for more columns at once. H200, batch 256, 48B shapes: expand_values 23.8 -> 14.1 us, absorb_query
# 14.5 -> 13.0 (cuBLAS: 4.7 and 27.3, so ops.mla_heads leaves expansions of more than 16 rows to cuBLAS).
TARGET_PROGRAMS = 256
WIDEST = 128    # [BB, 128] float32 accumulator: 16 registers a thread at 4 warps


@triton.jit
def head_products_kernel(
    x, w,                    # [B, H, *] (strides s_xb, s_xh, unit), [H, K, N] (strides s_wh, s_wk, s_wn)
    out,                     # out: [B, H, W_OUT] contiguous, columns 0 .. N (and N .. N + R with COPY)
    B, H, K, N, s_xb, s_xh, s_wh, s_wk, s_wn,
    W_OUT: tl.constexpr, R: tl.constexpr, BB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    BR: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr,
):
    """Program (head h, column block j, row block i): ``out[b, h, jBN:(j+1)BN] = x[b, h, :K] @ w[h, :, jBN:]`` for
    the block's rows, float32 accumulation, one rounding. With R > 0, column block 0 also copies ``x[b, h, K:K+R]``
    to ``out[b, h, N:N+R]`` (the absorbed query's rope part)."""
    pdl_entry(PDL)
    i_h, i_j, i_i = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    o_b = i_i * BB + tl.arange(0, BB)
    o_n = i_j * BN + tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    m_b, m_n = o_b < B, o_n < N
    p_x = x + o_b[:, None].to(tl.int64) * s_xb + i_h * s_xh + o_k[None, :]                      # [BB, BK]
    p_w = w + i_h * s_wh + o_k[:, None].to(tl.int64) * s_wk + o_n[None, :].to(tl.int64) * s_wn  # [BK, BN]
    b_acc = tl.zeros([BB, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        m_k = o_k < K - k0
        b_x = tl.load(p_x, mask=m_b[:, None] & m_k[None, :], other=0.0)                            # [BB, BK]
        b_w = tl.load(p_w, mask=m_k[:, None] & m_n[None, :], other=0.0)                            # [BK, BN]
        b_acc += mm(b_x, b_w, PREC)
        p_x += BK
        p_w += BK * s_wk
    p_o = out + (o_b[:, None].to(tl.int64) * H + i_h) * W_OUT
    tl.store(p_o + o_n[None, :], cast(b_acc, out.dtype.element_ty), mask=m_b[:, None] & m_n[None, :])
    if R > 0:
        if i_j == 0:
            o_r = tl.arange(0, BR)
            m_r = m_b[:, None] & (o_r < R)[None, :]
            b_r = tl.load(x + o_b[:, None].to(tl.int64) * s_xb + i_h * s_xh + K + o_r[None, :], mask=m_r)
            tl.store(p_o + N + o_r[None, :], b_r, mask=m_r)


def columns(B: int, H: int, N: int, narrowest: int) -> int:
    """Columns a program: the widest power of two from ``narrowest`` up to WIDEST (and N's next power of two)
    that still gives the launch TARGET_PROGRAMS programs."""
    BN = narrowest
    while BN < min(WIDEST, next_pow2(N)) and H * cdiv(N, 2 * BN) * cdiv(B, BB) >= TARGET_PROGRAMS:
        BN *= 2
    return BN


def _launch(x: torch.Tensor, w: torch.Tensor, K: int, N: int, s_w: tuple[int, int, int], R: int,
            narrowest: int) -> torch.Tensor:
    B, H = x.shape[:2]
    BN = columns(B, H, N, narrowest)
    if x.stride(2) != 1:
        x = x.contiguous()
    out = torch.empty(B, H, N + R, dtype=x.dtype, device=x.device)
    if B:
        head_products_kernel[(H, cdiv(N, BN), cdiv(B, BB))](
            x, w, out, B, H, K, N, x.stride(0), x.stride(1), *s_w, W_OUT=N + R, R=R, BB=BB, BN=BN, BK=BK,
            BR=max(16, 1 << max(R - 1, 0).bit_length()), PREC="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=4, **pdl_args(x.device),
        )
    return out


def absorb_query(q: torch.Tensor, w_k: torch.Tensor) -> torch.Tensor:
    """Triton :func:`kimi_linear.ops.mla_heads.absorb_query` (arguments checked there). 64 latent columns a
    program at batch 1 (256 programs for 32 heads and C = 512), more at large batches (:func:`columns`)."""
    nope, C = w_k.shape[1], w_k.shape[2]
    return _launch(q, w_k, nope, C, (w_k.stride(0), w_k.stride(1), w_k.stride(2)), q.shape[2] - nope, 64)


def expand_values(ctx: torch.Tensor, w_v: torch.Tensor) -> torch.Tensor:
    """Triton :func:`kimi_linear.ops.mla_heads.expand_values` (arguments checked there): W_v [H, v, C] read as
    [H, C, v]; 16 value columns a program at batch 1 (256 programs for 32 heads and v = 128), more at large
    batches (:func:`columns`)."""
    v, C = w_v.shape[1], w_v.shape[2]
    return _launch(ctx, w_v, C, v, (w_v.stride(0), w_v.stride(2), w_v.stride(1)), 0, 16)
