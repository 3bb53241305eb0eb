"""RMSNorm and residual add + RMSNorm (:mod:`kimi_linear.ops.rms_norm`) in Triton, forward only (inference).

In PyTorch a 16-bit RMSNorm is four kernels (upcast, the fused norm, cast back, weight multiply) and the add
before it a fifth; here one program reads its rows once and writes the norm (and the sum). The rounding follows
the PyTorch path step by step, so results agree up to the float32 reduction order and rsqrt (an ulp):

    s = (x + delta) rounded to x's dtype       (torch's 16-bit add: float32 sum, one rounding)
    n = s * rsqrt(mean(s^2) + eps)             float32
    y = (n rounded to x's dtype) * weight      float32 product, rounded once to y's dtype

Rows are the [..., D] vectors; the inputs may be views with a row stride (a slice of a packed projection),
outputs are contiguous (``rms_norm_write``: rows of a pool named by an index, the columns past D copied after
the norm).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunk_common import cast
from .ints import cdiv, next_pow2
from .pdl import pdl_args, pdl_entry
from .splitk import split_k_partials


@triton.jit
def rms_norm_kernel(
    x, delta, w,                      # [N, D (+ TAIL)] (row strides sx, sd; delta only with HAS_DELTA), [D]
    y, s,                             # out: the norm [.., D (+ TAIL)] (row stride sy), x + delta [N, D] (HAS_DELTA)
    dst,                              # [N] int64 row of y for each row of x (SCATTER), else row r -> r
    N, sx, sd, sy, eps, sp,
    D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, HAS_DELTA: tl.constexpr, SCATTER: tl.constexpr,
    TAIL: tl.constexpr, BT: tl.constexpr, PARTS: tl.constexpr,
    PDL: tl.constexpr,
):
    """The norm of each row's first D columns; with TAIL > 0 the row's next TAIL columns are copied after it
    unchanged (an MLA cache entry: normed latent | rope key), with SCATTER written to rows ``dst`` of y. With
    PARTS > 0, delta is PARTS float32 partial sums ``sp`` elements apart (split-K), summed and rounded to x's dtype
    as the projection they make up would round its output."""
    pdl_entry(PDL)
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m = (rows < N)[:, None] & (o_d < D)[None, :]
    o_y = tl.load(dst + rows, mask=rows < N, other=0) if SCATTER else rows                    # [BR] rows of y
    if TAIL > 0:
        o_t = D + tl.arange(0, BT)
        m_t = (rows < N)[:, None] & (o_t < D + TAIL)[None, :]
        b_t = tl.load(x + rows[:, None] * sx + o_t[None, :], mask=m_t, other=0.0)                # [BR, BT]
        tl.store(y + o_y[:, None] * sy + o_t[None, :], b_t.to(y.dtype.element_ty), mask=m_t)
    b_x = tl.load(x + rows[:, None] * sx + o_d[None, :], mask=m, other=0.0).to(tl.float32)      # [BR, BD]
    if HAS_DELTA:
        if PARTS > 0:
            b_d = tl.zeros([BR, BD], dtype=tl.float32)
            for i in tl.static_range(PARTS):
                b_d += tl.load(delta + i * sp + rows[:, None] * sd + o_d[None, :], mask=m, other=0.0)
            b_d = cast(b_d, x.dtype.element_ty).to(tl.float32)
        else:
            b_d = tl.load(delta + rows[:, None] * sd + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        b_s = cast(b_x + b_d, s.dtype.element_ty)           # the sum as the residual stream stores it
        tl.store(s + rows[:, None] * D + o_d[None, :], b_s, mask=m)
        b_x = b_s.to(tl.float32)
    b_r = tl.math.rsqrt(tl.sum(b_x * b_x, 1) / D + eps)                                       # [BR]
    # cast to the input dtype before the weight multiply (a no-op for float32 inputs)
    b_n = cast(b_x * b_r[:, None], x.dtype.element_ty).to(tl.float32)
    b_w = tl.load(w + o_d, mask=o_d < D, other=0.0).to(tl.float32)                            # [BD]
    tl.store(y + o_y[:, None] * sy + o_d[None, :], cast(b_n * b_w[None, :], y.dtype.element_ty), mask=m)


def row_view(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x [..., D] as a [N, D] view and its row stride; copied only where the last dim is not contiguous or the
    leading dims do not merge into one stride."""
    D = x.shape[-1]
    try:
        t = x.view(-1, D)
    except RuntimeError:                     # leading dims that no single stride describes
        t = None
    if t is None or (t.stride(1) != 1 and D > 1):
        t = x.contiguous().view(-1, D)
    return t, t.stride(0)


def launch(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
           parts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(norm, sum or None), both [..., D] contiguous. ``parts`` [S, N, D] float32 (contiguous) stands for delta as
    the sum of its S partial sums."""
    D = x.shape[-1]
    x_r, sx = row_view(x)
    has_delta = delta is not None or parts is not None
    if parts is not None:
        d_r, sd = parts, D
    else:
        d_r, sd = row_view(delta) if delta is not None else (x_r, sx)
    N = x_r.shape[0]
    y = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device) if has_delta else None
    BD = next_pow2(D)
    # a few rows per program when rows are short, so a program has at least ~2K elements of work
    BR = max(1, min(16, 2048 // BD))
    rms_norm_kernel[(cdiv(N, BR),)](
        x=x_r, delta=d_r, w=weight.contiguous(), y=y, s=s if s is not None else y, dst=x_r, N=N, sx=sx, sd=sd,
        sy=D, eps=eps, sp=N * D, D=D, BR=BR, BD=BD, HAS_DELTA=has_delta, SCATTER=False, TAIL=0, BT=1,
        PARTS=0 if parts is None else parts.shape[0], num_warps=max(1, min(8, BR * BD // 512)), **pdl_args(x.device),
    )
    return y, s


def rms_norm_write(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor,
                   rows: torch.Tensor) -> None:
    """:func:`kimi_linear.ops.rms_norm.rms_norm_write` (arguments checked there): x [N, W], out [M, W] with unit
    column stride, rows [N] int64."""
    N, W = x.shape
    D = weight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    BD = next_pow2(D)
    rms_norm_kernel[(N,)](
        x=x, delta=x, w=weight.contiguous(), y=out, s=out, dst=rows.contiguous(), N=N, sx=x.stride(0), sd=0,
        sy=out.stride(0), eps=eps, sp=0, D=D, BR=1, BD=BD, HAS_DELTA=False, SCATTER=True, TAIL=W - D,
        BT=max(1, next_pow2(W - D)), PARTS=0, num_warps=max(1, min(8, BD // 256)), **pdl_args(x.device),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """:func:`kimi_linear.ops.rms_norm.rms_norm` (arguments checked there)."""
    return launch(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kimi_linear.ops.rms_norm.add_rms_norm` (arguments checked there; delta has x's dtype):
    ``(x + delta, rms_norm(x + delta))``."""
    y, s = launch(x, delta, weight, eps)
    assert s is not None
    return s, y


def project_add_rms_norm(x: torch.Tensor, o: torch.Tensor, w_o: torch.Tensor, weight: torch.Tensor,
                         eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kimi_linear.ops.rms_norm.project_add_rms_norm` (arguments checked there): the projection as split-K
    partial sums (:mod:`.splitk`), which the add + norm kernel sums."""
    o2, _ = row_view(o)
    y, s = launch(x, None, weight, eps, parts=split_k_partials(o2, w_o))
    assert s is not None
    return s, y
