"""The in-kernel input transforms (docs/kda.md §2) as Triton device functions, shared by every KDA kernel.

All of them compute in float32 on blocks that are already in registers.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def l2_normalize(b_x, axis: tl.constexpr):
    """``x / sqrt(sum(x^2) + 1e-6)`` along ``axis`` (float32 block)."""
    return b_x * tl.rsqrt(tl.expand_dims(tl.sum(b_x * b_x, axis), axis) + 1e-6)


@triton.jit
def softplus(b_x):
    """``log(1 + exp(x))`` without overflow for large x nor total cancellation for very negative x."""
    b_e = tl.exp(tl.minimum(b_x, 20.0))
    # For e < 1e-4 the series e - e^2/2 is exact to float32; log(1 + e) would round 1 + e.
    b_small = b_e * (1.0 - 0.5 * b_e)
    return tl.where(b_x > 20.0, b_x, tl.where(b_e < 1e-4, b_small, tl.log(1.0 + b_e)))


@triton.jit
def kda_gate(b_g, b_bias, a, lower_bound, USE_LOWER_BOUND: tl.constexpr):
    """Log decay from the raw gate: ``-a * softplus(g + bias)``, or ``lower_bound * sigmoid(a * (g + bias))``.

    ``a = exp(A_log[h])`` (scalar), ``b_bias`` the head's dt_bias broadcastable to ``b_g``; float32 in and out.
    """
    b_x = b_g + b_bias
    if USE_LOWER_BOUND:
        return lower_bound * tl.sigmoid(a * b_x)
    return -a * softplus(b_x)


@triton.jit
def beta_transform(b_beta, USE_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr):
    """``sigmoid(beta)`` (``2 * sigmoid`` with negative eigenvalues allowed) or beta unchanged."""
    if USE_SIGMOID:
        b_beta = tl.sigmoid(b_beta)
        if NEG_EIGVAL:
            b_beta = 2.0 * b_beta
    return b_beta

