"""The host-side launch arithmetic (ops/triton/ints.py) against Triton's own constexpr functions."""

import triton

from kimi_linear.ops.triton.ints import cdiv, next_pow2


def test_next_pow2_matches_triton():
    for n in [*range(0, 4200), 65535, 65536, 65537, 2**31 - 1, 2**31, 2**40 + 3]:
        assert next_pow2(n) == triton.next_power_of_2(n), n


def test_cdiv_matches_triton():
    for a in [*range(0, 300), 2**31 + 5, 10**12]:
        for b in (1, 2, 3, 7, 16, 64, 100, 4096):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
