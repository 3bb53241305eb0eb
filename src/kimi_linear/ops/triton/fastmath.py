"""Float32 transcendental functions as single hardware instructions (``ex2`` / ``lg2`` / ``rcp.approx.ftz``).

Triton's ``tl.exp``, ``tl.log`` and float division compile to range checks, rescaling and Newton steps around
these instructions (``tl.log`` to libdevice's ``logf``). Where a kernel is bound by that arithmetic (the gate
transforms: one softplus per element of the gate), the bare instructions are enough: relative error ~2^-22, and
results below 2^-126 flushed to zero, which every caller here tolerates (a decay factor that small is zero to
float32 work anyway). Under the interpreter (``TRITON_INTERPRET=1``) they are the ordinary functions.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

INTERPRET: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def fast_exp(b_x):
    """``exp(b_x)`` for float32 as one multiply and the hardware's ``ex2.approx.ftz`` (relative error ~2^-22):
    tl.exp adds range checks and rescaling around it for results below 2^-126, which the pipeline's factors (all
    <= 1 or bounded by SAFE_EXP / HALF_LIMIT) only reach where flushing them to zero is right."""
    if INTERPRET:
        return tl.exp(b_x)
    return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [b_x * 1.4426950408889634],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def fast_log(b_x):
    """``log(b_x)`` for positive normal float32 as ``lg2.approx.ftz`` and one multiply (absolute error of the
    logarithm ~2^-22 near 1)."""
    if INTERPRET:
        return tl.log(b_x)
    return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [b_x], dtype=tl.float32,
                                     is_pure=True, pack=1) * LN2


@triton.jit
def fast_rcp(b_x):
    """``1 / b_x`` for float32 as ``rcp.approx.ftz`` (within 1 ulp)."""
    if INTERPRET:
        return 1.0 / b_x
    return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [b_x], dtype=tl.float32,
                                     is_pure=True, pack=1)
