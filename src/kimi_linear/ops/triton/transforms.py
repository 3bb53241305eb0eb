"""The in-kernel input transforms (docs/kda.md §2) as Triton device functions, shared by every KDA kernel.

All of them compute in float32 on blocks that are already in registers.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fastmath import fast_exp, fast_log, fast_rcp


@triton.jit
def l2_normalize(b_x, axis: tl.constexpr):
    """``x / sqrt(sum(x^2) + 1e-6)`` along ``axis`` (float32 block)."""
    return b_x * tl.rsqrt(tl.expand_dims(tl.sum(b_x * b_x, axis), axis) + 1e-6)


@triton.jit
def softplus_sigmoid(b_x):
    """``(softplus(x), sigmoid(x))`` from one exponential ``e = exp(-|x|)``: ``softplus = max(x, 0) + log(1 + e)``
    (no overflow for large x, no cancellation for very negative x) and ``sigmoid = 1 / (1 + e)`` or ``e / (1 + e)``.
    Single hardware instructions (fastmath): with libdevice's log and IEEE divisions the softplus gate's kernels
    were bound by that arithmetic (H200, 16 x 2048, H=32: prepare 0.278 -> 0.202 ms, the backward's gate kernel
    0.699 -> 0.500, now as fast as with the sigmoid gate)."""
    b_e = fast_exp(-tl.abs(b_x))
    # log(1 + e) by its series below e = 0.1 (seven terms: within 1.3e-8 relative), where rounding 1 + e and lg2's
    # absolute error (~2^-22) would cost relative accuracy (1e-3 at e = 1e-4); above, through lg2 (log >= 0.095).
    # Every coefficient is a product: Triton 3.8 compiles ``e / 7`` to a division instruction.
    b_s = b_e * (1.0 - b_e * (1 / 2 - b_e * (1 / 3 - b_e * (1 / 4 - b_e * (1 / 5 - b_e * (1 / 6 - b_e * (1 / 7)))))))
    b_l = tl.where(b_e < 0.1, b_s, fast_log(1.0 + b_e))
    b_r = fast_rcp(1.0 + b_e)
    return tl.maximum(b_x, 0.0) + b_l, tl.where(b_x >= 0, b_r, b_e * b_r)


@triton.jit
def softplus(b_x):
    """``log(1 + exp(x))`` (:func:`softplus_sigmoid`)."""
    return softplus_sigmoid(b_x)[0]


@triton.jit
def sigmoid(b_x):
    """``1 / (1 + exp(-x))`` (:func:`softplus_sigmoid`; the unused softplus is dead code to the compiler)."""
    return softplus_sigmoid(b_x)[1]


@triton.jit
def kda_gate(b_g, b_bias, a, lower_bound, USE_LOWER_BOUND: tl.constexpr):
    """Log decay from the raw gate: ``-a * softplus(g + bias)``, or ``lower_bound * sigmoid(a * (g + bias))``.

    ``a = exp(A_log[h])`` (scalar), ``b_bias`` the head's dt_bias broadcastable to ``b_g``; float32 in and out.
    """
    b_x = b_g + b_bias
    if USE_LOWER_BOUND:
        return lower_bound * sigmoid(a * b_x)
    return -a * softplus(b_x)


@triton.jit
def beta_transform(b_beta, USE_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr):
    """``sigmoid(beta)`` (``2 * sigmoid`` with negative eigenvalues allowed) or beta unchanged."""
    if USE_SIGMOID:
        b_beta = tl.sigmoid(b_beta)
        if NEG_EIGVAL:
            b_beta = 2.0 * b_beta
    return b_beta

