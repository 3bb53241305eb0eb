"""The KDA block's gated output norm (:mod:`kimi_linear.ops.norm`) in Triton: one pass over o and the gate.

    n = o / sqrt(mean(o^2) + eps)      s = sigmoid(gate)      y = n w s

In PyTorch the float32 upcasts, the norm, the sigmoid and the products are separate passes, and the backward keeps
their float32 intermediates; here the forward reads o and the gate once and writes y, and the backward recomputes
n and s from them:

    dgate = dy n w s (1 - s)      dn = dy w s      do = (dn - n mean(dn n)) / sqrt(mean(o^2) + eps)
    dw = sum over rows of dy n s  (per-program partial sums)

Rows are the [..., d] vectors; o and the gate may be views with a token stride (the gate is a slice of a packed
projection): rows of one token are contiguous, tokens are ``stride`` elements apart.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .ints import cdiv, next_pow2
from .pdl import pdl_args, pdl_entry


@triton.jit
def row_offsets(rows, stride, H: tl.constexpr, D: tl.constexpr):
    """Element offsets (int64) of rows ([BR] flat row indices over [tokens, H]) with tokens ``stride`` apart."""
    return (rows // H) * stride + (rows % H) * D


@triton.jit
def load_rows_of(p, rows, stride, N, o_d, H: tl.constexpr, D: tl.constexpr):
    """[BR, BD] float32, zero outside the N rows and the D columns."""
    m = (rows < N)[:, None] & (o_d < D)[None, :]
    return tl.load(p + row_offsets(rows, stride, H, D)[:, None] + o_d[None, :], mask=m, other=0.0).to(tl.float32)


@triton.jit
def norm_inputs(o, gate, w, rows, so_t, sg_t, N, eps, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr):
    """(n = o / sqrt(mean(o^2) + eps) [BR, BD], s = sigmoid(gate) [BR, BD], w [BD], 1 / sqrt(...) [BR]), float32."""
    o_d = tl.arange(0, BD)
    b_o = load_rows_of(o, rows, so_t, N, o_d, H, D)                         # [BR, BD]
    b_s = tl.sigmoid(load_rows_of(gate, rows, sg_t, N, o_d, H, D))
    b_w = tl.load(w + o_d, mask=o_d < D, other=0.0).to(tl.float32)          # [BD]
    b_r = 1.0 / tl.sqrt(tl.sum(b_o * b_o, 1) / D + eps)                     # [BR]
    return b_o * b_r[:, None], b_s, b_w, b_r


@triton.jit
def gated_rms_norm_fwd_kernel(
    o, gate, w, y,                    # [tokens, H, D] (token strides so_t, sg_t), [D], out: [N, D] contiguous
    N, so_t, sg_t, eps,
    H: tl.constexpr, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_entry(PDL)
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    b_n, b_s, b_w, _ = norm_inputs(o, gate, w, rows, so_t, sg_t, N, eps, H, D, BD)
    b_y = b_n * b_w[None, :] * b_s
    tl.store(y + rows[:, None] * D + o_d[None, :], b_y.to(y.dtype.element_ty),
             mask=(rows < N)[:, None] & (o_d < D)[None, :])


@triton.jit
def gated_rms_norm_bwd_kernel(
    o, gate, w, dy,                   # the forward's inputs; dy [N, D] contiguous
    do, dgate, dw_p,                  # out: [N, D] x2 contiguous, [programs, D] float32 partial sums
    N, so_t, sg_t, eps,
    H: tl.constexpr, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
):
    i_r = tl.program_id(0).to(tl.int64)
    rows = i_r * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m = (rows < N)[:, None] & (o_d < D)[None, :]
    b_n, b_s, b_w, b_r = norm_inputs(o, gate, w, rows, so_t, sg_t, N, eps, H, D, BD)
    b_dy = tl.load(dy + rows[:, None] * D + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    b_dys = b_dy * b_s
    tl.store(dgate + rows[:, None] * D + o_d[None, :],
             (b_dys * b_n * b_w[None, :] * (1.0 - b_s)).to(dgate.dtype.element_ty), mask=m)
    b_dn = b_dys * b_w[None, :]
    b_do = (b_dn - b_n * (tl.sum(b_dn * b_n, 1) / D)[:, None]) * b_r[:, None]
    tl.store(do + rows[:, None] * D + o_d[None, :], b_do.to(do.dtype.element_ty), mask=m)
    tl.store(dw_p + i_r * D + o_d, tl.sum(b_dys * b_n, 0), mask=o_d < D)


ROWS = 16


def token_view(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x [..., H, D] as a [tokens, H, D] view and its token stride; copied only where the rows of a token are not
    contiguous or the leading dims do not merge into one stride."""
    H, D = x.shape[-2], x.shape[-1]
    try:
        t = x.view(-1, H, D)
    except RuntimeError:                     # leading dims that no single stride describes
        t = None
    if t is None or t.stride(2) != 1 or t.stride(1) != D:
        t = x.contiguous().view(-1, H, D)
    return t, t.stride(0)


class GatedRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float):
        o_t, so_t = token_view(o)
        g_t, sg_t = token_view(gate)
        _, H, D = o_t.shape
        N = o_t.shape[0] * H
        y = torch.empty(o.shape, dtype=o.dtype, device=o.device)
        BD = next_pow2(D)
        gated_rms_norm_fwd_kernel[(cdiv(N, ROWS),)](
            o=o_t, gate=g_t, w=weight, y=y, N=N, so_t=so_t, sg_t=sg_t, eps=eps, H=H, D=D, BR=ROWS, BD=BD,
            **pdl_args(o.device),
        )
        ctx.save_for_backward(o_t, g_t, weight)
        ctx.meta = (so_t, sg_t, eps, o.shape, gate.dtype)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        o_t, g_t, weight = ctx.saved_tensors
        so_t, sg_t, eps, shape, gate_dtype = ctx.meta
        _, H, D = o_t.shape
        N = o_t.shape[0] * H
        dy = dy.contiguous()
        do = torch.empty(shape, dtype=o_t.dtype, device=dy.device)
        dgate = torch.empty(shape, dtype=gate_dtype, device=dy.device)
        NP = cdiv(N, ROWS)
        dw_p = torch.empty(NP, D, dtype=torch.float32, device=dy.device)
        gated_rms_norm_bwd_kernel[(NP,)](
            o=o_t, gate=g_t, w=weight, dy=dy, do=do, dgate=dgate, dw_p=dw_p, N=N, so_t=so_t, sg_t=sg_t, eps=eps,
            H=H, D=D, BR=ROWS, BD=next_pow2(D),
        )
        return do, dgate, dw_p.sum(0).to(weight.dtype), None


def gated_rms_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """:func:`kimi_linear.ops.norm.gated_rms_norm` (arguments checked there): o's shape and dtype."""
    return GatedRMSNormFunction.apply(o, gate, weight, eps)
