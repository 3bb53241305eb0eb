"""The KDA block's short convolution (causal, depthwise, width W, SiLU; :mod:`kimi_linear.ops.conv`) in Triton.

In PyTorch the convolution is W shifted multiply-adds and a SiLU, each a pass over [B, T, C] in memory, and its
backward keeps every intermediate. Here the forward reads x once (the W shifted tiles of a program overlap in
L1) and writes y; the backward recomputes the pre-activation and writes dx (and dpast) and per-program partial
sums of dw, so training keeps nothing but x.

:func:`short_conv_decode` is the one-token step straight on a pool of windows (a serving engine's slots): it
reads each row's window through its slot index, and shifts the new input into it in place.

Indices: ``full = [past; x]`` has W - 1 + T rows; output t reads full rows t .. t + W - 1 (tap j at full row
t + j, the input W - 1 - j steps back), dropped with ``pos`` when ``pos_t < W - 1 - j``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunk_common import cast
from .ints import cdiv, next_pow2
from .pdl import pdl_args, pdl_entry


@triton.jit
def load_full(x, past, i_b, r, o_c, T, C, W: tl.constexpr, HAS_PAST: tl.constexpr):
    """Rows r ([BT] full-row indices, any of them out of range) of ``[past; x]`` at channels o_c, float32 [BT, BC];
    zero outside (and in the past without HAS_PAST)."""
    m_c = (o_c < C)[None, :]
    s = r - (W - 1)                                                        # row of x
    p_x = x + (i_b * T + s)[:, None] * C + o_c[None, :]
    b_x = tl.load(p_x, mask=((s >= 0) & (s < T))[:, None] & m_c, other=0.0).to(tl.float32)
    if HAS_PAST:
        p_p = past + (i_b * (W - 1) + r)[:, None] * C + o_c[None, :]
        b_x += tl.load(p_p, mask=((r >= 0) & (s < 0))[:, None] & m_c, other=0.0).to(tl.float32)
    return b_x


@triton.jit
def tap_valid(pos, t, T, j, W: tl.constexpr, HAS_POS: tl.constexpr):
    """Whether tap j of outputs t ([BT]) is inside the token's document (always without HAS_POS)."""
    if HAS_POS:
        b_pos = tl.load(pos + t, mask=(t >= 0) & (t < T), other=0)
        return b_pos >= W - 1 - j
    return t == t


@triton.jit
def pre_activation(x, w, past, pos, i_b, t, o_c, T, C, W: tl.constexpr, HAS_PAST: tl.constexpr,
                   HAS_POS: tl.constexpr):
    """``z_t = sum_j w_j full_{t + j}`` for outputs t ([BT]) at channels o_c: [BT, BC] float32."""
    b_z = tl.zeros([t.shape[0], o_c.shape[0]], dtype=tl.float32)
    for j in tl.static_range(W):
        b_w = tl.load(w + j * C + o_c, mask=o_c < C, other=0.0).to(tl.float32)          # [BC]
        b_x = load_full(x, past, i_b, t + j, o_c, T, C, W, HAS_PAST)                    # [BT, BC]
        b_z += tl.where(tap_valid(pos, t, T, j, W, HAS_POS)[:, None], b_x, 0.0) * b_w[None, :]
    return b_z


@triton.jit
def short_conv_fwd_kernel(
    x, w, past, pos,                  # [B, T, C], [W, C], [B, W-1, C] (HAS_PAST), [T] (HAS_POS)
    y,                                # out: [B, T, C] in x's dtype
    T, C,
    W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_PAST: tl.constexpr, HAS_POS: tl.constexpr,
):
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    t = i_t * BT + tl.arange(0, BT)
    o_c = i_c * BC + tl.arange(0, BC)
    b_z = pre_activation(x, w, past, pos, i_b, t, o_c, T, C, W, HAS_PAST, HAS_POS)      # [BT, BC]
    b_y = b_z * tl.sigmoid(b_z)
    tl.store(y + (i_b * T + t)[:, None] * C + o_c[None, :], cast(b_y, y.dtype.element_ty),
             mask=(t < T)[:, None] & (o_c < C)[None, :])


@triton.jit
def short_conv_bwd_kernel(
    x, w, past, pos, dy,              # the forward's inputs; [B, T, C] the output's gradient
    dx, dpast, dw_p,                  # out: [B, T, C], [B, W-1, C] (HAS_PAST), [B * NR, W, C] float32 partial sums
    T, C, NR,
    W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_PAST: tl.constexpr, HAS_POS: tl.constexpr,
):
    """One program per block of BT full rows r (rows of dpast, then of dx): ``d full_r = sum_j w_j dz_{r - j}``
    over the outputs that read row r, with ``dz = dy silu'(z)`` recomputed for each shift (W^2 tile loads, which
    overlap in L1). Output t = r (the shift j = 0) is this program's own: it adds ``dz_t full_{t + j}`` to dw."""
    i_r, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    r = i_r * BT + tl.arange(0, BT)                                        # [BT] full rows
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    b_dfull = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(W):
        t = r - j                                                          # outputs whose tap j reads row r
        m_t = (t >= 0) & (t < T)
        b_z = pre_activation(x, w, past, pos, i_b, t, o_c, T, C, W, HAS_PAST, HAS_POS)  # [BT, BC]
        b_s = tl.sigmoid(b_z)
        b_dy = tl.load(dy + (i_b * T + t)[:, None] * C + o_c[None, :], mask=m_t[:, None] & m_c[None, :],
                       other=0.0).to(tl.float32)
        b_dz = b_dy * b_s * (1.0 + b_z * (1.0 - b_s))                      # silu'(z) = s (1 + z (1 - s)); 0 off rows
        b_wj = tl.load(w + j * C + o_c, mask=m_c, other=0.0).to(tl.float32)
        b_dfull += tl.where(tap_valid(pos, t, T, j, W, HAS_POS)[:, None], b_dz, 0.0) * b_wj[None, :]
        if j == 0:
            # the outputs t = r, each counted by exactly one program: their share of every tap's dw
            for jj in tl.static_range(W):
                b_x = load_full(x, past, i_b, t + jj, o_c, T, C, W, HAS_PAST)
                b_dzv = tl.where(tap_valid(pos, t, T, jj, W, HAS_POS)[:, None], b_dz, 0.0)
                b_dwj = tl.sum(b_dzv * b_x, 0)                             # [BC]
                tl.store(dw_p + ((i_b * NR + i_r) * W + jj) * C + o_c, b_dwj, mask=m_c)
    s = r - (W - 1)
    tl.store(dx + (i_b * T + s)[:, None] * C + o_c[None, :], cast(b_dfull, dx.dtype.element_ty),
             mask=((s >= 0) & (s < T))[:, None] & m_c[None, :])
    if HAS_PAST:
        tl.store(dpast + (i_b * (W - 1) + r)[:, None] * C + o_c[None, :], cast(b_dfull, dpast.dtype.element_ty),
                 mask=(s < 0)[:, None] & m_c[None, :])


@triton.jit
def short_conv_decode_kernel(
    x, w, pool, index,                # [B, C] (row stride sx), [W, C], [slots, W-1, C] (slot stride sp), [B] int64
    y,                                # out: [B, C] contiguous, x's dtype
    C, sx, sp,
    W: tl.constexpr, WP: tl.constexpr, BC: tl.constexpr,
    PDL: tl.constexpr,
):
    """One token of each row: ``full = [pool[index[b]]; x_b]`` (W rows), ``y_b = silu(sum_j w_j full_j)``, and
    pool row ``index[b]`` becomes ``full[1:]``. A program owns (row, channel block): it reads the whole window,
    then (after a barrier, because the shifted rows live in other threads) writes it back shifted by one."""
    pdl_entry(PDL)
    i_b, i_c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = (o_c < C)[None, :]
    r = tl.arange(0, WP)[:, None]                                          # [WP, 1] rows of full
    p_win = pool + tl.load(index + i_b).to(tl.int64) * sp + o_c[None, :]   # the row's window, [.., BC]
    b_full = tl.load(p_win + r * C, mask=(r < W - 1) & m_c, other=0.0).to(tl.float32)          # [WP, BC]
    b_x = tl.load(x + i_b * sx + o_c, mask=o_c < C, other=0.0).to(tl.float32)                  # [BC]
    b_full = tl.where(r == W - 1, b_x[None, :], b_full)
    b_w = tl.load(w + r * C + o_c[None, :], mask=(r < W) & m_c, other=0.0).to(tl.float32)
    b_z = tl.sum(b_full * b_w, 0)                                          # [BC]
    tl.store(y + i_b * C + o_c, cast(b_z * tl.sigmoid(b_z), y.dtype.element_ty), mask=o_c < C)
    tl.debug_barrier()                     # every thread's window read is done before any row is overwritten
    tl.store(p_win + (r - 1) * C, cast(b_full, pool.dtype.element_ty), mask=(r >= 1) & (r < W) & m_c)


# [32, 64] tiles: the backward holds about five float32 tiles at once; with 128 channels it spilled (offline sm_90
# build: 255 registers, 32-432 bytes of stack), with 64 it takes 136-214 registers and none. Not yet GPU-tuned.
# Short calls (a handful of rows) take fewer rows per tile and as many more channels, so a tile holds no more
# elements (same registers) and no program spends 31 of its 32 rows on nothing.
BT_ROWS = 32
BC_CHANNELS = 64
BC_MAX = 512


def launch_shape(x: torch.Tensor, rows: int) -> tuple[int, int, tuple[int, int, int]]:
    """(BT, BC, grid) for ``rows`` rows per batch row: BT the next power of two of rows, capped at BT_ROWS."""
    B, _, C = x.shape
    BT = min(BT_ROWS, next_pow2(max(rows, 1)))
    BC = min(max(BC_CHANNELS, BT_ROWS * BC_CHANNELS // BT), BC_MAX, next_pow2(C))
    return BT, BC, (cdiv(rows, BT), cdiv(C, BC), B)


class ShortConvFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, past: torch.Tensor | None, pos: torch.Tensor | None):
        x, weight = x.contiguous(), weight.contiguous()
        past = past.contiguous() if past is not None else None
        B, T, C = x.shape
        W = weight.shape[0]
        y = torch.empty_like(x)
        BT, BC, grid = launch_shape(x, T)
        short_conv_fwd_kernel[grid](
            x=x, w=weight, past=past if past is not None else x, pos=pos if pos is not None else x, y=y, T=T, C=C,
            W=W, BT=BT, BC=BC, HAS_PAST=past is not None, HAS_POS=pos is not None,
        )
        ctx.save_for_backward(x, weight, past, pos)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, past, pos = ctx.saved_tensors
        B, T, C = x.shape
        W = weight.shape[0]
        dy = dy.contiguous()
        dx = torch.empty_like(x)
        dpast = torch.empty_like(past) if past is not None else None
        BT, BC, grid = launch_shape(x, T + W - 1)
        NR = grid[0]
        dw_p = torch.empty(B * NR, W, C, dtype=torch.float32, device=x.device)
        short_conv_bwd_kernel[grid](
            x=x, w=weight, past=past if past is not None else x, pos=pos if pos is not None else x, dy=dy, dx=dx,
            dpast=dpast if dpast is not None else dx, dw_p=dw_p, T=T, C=C, NR=NR, W=W, BT=BT, BC=BC,
            HAS_PAST=past is not None, HAS_POS=pos is not None,
        )
        dw = dw_p.sum(0).to(weight.dtype)
        return dx, dw, dpast if ctx.needs_input_grad[2] else None, None


def short_conv(x: torch.Tensor, weight: torch.Tensor, past: torch.Tensor | None = None,
               pos: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`kimi_linear.ops.conv.short_conv`'s output (arguments checked there): [B, T, C] in x's dtype."""
    return ShortConvFunction.apply(x, weight, past, pos)


# channels per decode program: T = 1 has no row dimension to fill a tile, so a program takes a wide channel block
# (a row of Kimi-Linear-48B's q|k|v is 12,288 channels: 24 programs per row). Not yet GPU-tuned.
BC_DECODE = 512


def short_conv_decode(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor,
                      index: torch.Tensor) -> torch.Tensor:
    """:func:`kimi_linear.ops.conv.short_conv_decode` (arguments checked there): y in x's shape and dtype; updates
    conv_pool in place. Forward only."""
    B, C = x.shape[0], x.shape[-1]
    x2 = x.reshape(B, C)                     # a view for [B, 1, C] slices of a packed projection
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    weight = weight.contiguous()
    W = weight.shape[0]
    y = torch.empty(B, C, dtype=x.dtype, device=x.device)
    BC = min(BC_DECODE, next_pow2(C))
    short_conv_decode_kernel[(B, cdiv(C, BC))](
        x=x2, w=weight, pool=conv_pool, index=index.contiguous(), y=y, C=C, sx=x2.stride(0), sp=conv_pool.stride(0),
        W=W, WP=next_pow2(W), BC=BC, num_warps=4, **pdl_args(x.device),
    )
    return y.view(x.shape)
