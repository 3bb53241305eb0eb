"""Launch-shape arithmetic on the host. ``triton.cdiv`` and ``triton.next_power_of_2`` are Triton constexpr
functions: called from host code each one unwraps its arguments first (~3.5 us a call on this project's CPU,
against ~0.06 us for the arithmetic), and a launch takes several, which a batch-1 decode step pays for each of its
~120 kernels when it is not replayed from a CUDA graph."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers, b > 0."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n for n >= 1, and 0 for 0 (as ``triton.next_power_of_2``)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
