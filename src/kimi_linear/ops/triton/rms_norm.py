"""RMSNorm and residual add + RMSNorm (:mod:`kimi_linear.ops.rms_norm`) in Triton, forward only (inference).

In PyTorch a 16-bit RMSNorm is four kernels (upcast, the fused norm, cast back, weight multiply) and the add
before it a fifth; here one program reads its rows once and writes the norm (and the sum). The rounding follows
the PyTorch path step by step, so results agree up to the float32 reduction order and rsqrt (an ulp):

    s = (x + delta) rounded to x's dtype       (torch's 16-bit add: float32 sum, one rounding)
    n = s * rsqrt(mean(s^2) + eps)             float32
    y = (n rounded to x's dtype) * weight      float32 product, rounded once to y's dtype

Rows are the [..., D] vectors; the inputs may be views with a row stride (a slice of a packed projection),
outputs are contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunk_common import cast


@triton.jit
def rms_norm_kernel(
    x, delta, w,                      # [N, D] (row strides sx, sd; delta only with HAS_DELTA), [D]
    y, s,                             # out: [N, D] contiguous: the norm, and x + delta (HAS_DELTA)
    N, sx, sd, eps,
    D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, HAS_DELTA: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, BD)
    m = (rows < N)[:, None] & (o_d < D)[None, :]
    b_x = tl.load(x + rows[:, None] * sx + o_d[None, :], mask=m, other=0.0).to(tl.float32)      # [BR, BD]
    if HAS_DELTA:
        b_d = tl.load(delta + rows[:, None] * sd + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        b_s = cast(b_x + b_d, s.dtype.element_ty)           # the sum as the residual stream stores it
        tl.store(s + rows[:, None] * D + o_d[None, :], b_s, mask=m)
        b_x = b_s.to(tl.float32)
    b_r = tl.math.rsqrt(tl.sum(b_x * b_x, 1) / D + eps)                                       # [BR]
    # cast to the input dtype before the weight multiply (a no-op for float32 inputs)
    b_n = cast(b_x * b_r[:, None], x.dtype.element_ty).to(tl.float32)
    b_w = tl.load(w + o_d, mask=o_d < D, other=0.0).to(tl.float32)                            # [BD]
    tl.store(y + rows[:, None] * D + o_d[None, :], cast(b_n * b_w[None, :], y.dtype.element_ty), mask=m)


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


def launch(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
           eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(norm, sum or None), both [..., D] contiguous."""
    D = x.shape[-1]
    x_r, sx = row_view(x)
    d_r, sd = row_view(delta) if delta is not None else (x_r, sx)
    N = x_r.shape[0]
    y = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device) if delta is not None else None
    BD = triton.next_power_of_2(D)
    # a few rows per program when rows are short, so a program has at least ~2K elements of work
    BR = max(1, min(16, 2048 // BD))
    rms_norm_kernel[(triton.cdiv(N, BR),)](
        x=x_r, delta=d_r, w=weight.contiguous(), y=y, s=s if s is not None else y, N=N, sx=sx, sd=sd, eps=eps,
        D=D, BR=BR, BD=BD, HAS_DELTA=delta is not None, num_warps=max(1, min(8, BR * BD // 512)),
    )
    return y, s


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
