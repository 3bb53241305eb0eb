"""The decode GEMV (ops.gemv): the Triton kernel under the interpreter against float64 ``x @ W^T``, for 1 to 16
rows, row- and column-major weights, sizes that are not multiples of its tiles, float32 (exact products) and
bfloat16; the public op's dispatch and argument checks.

Bars (relative, norm-wise): float32 1e-6 (products exact, float32 sums); bfloat16 2^-8 (one rounding of the
output)."""

import pytest
import torch

from kimi_linear.ops.gemv import GEMV_MAX_ROWS, gemv

from .kda_cases import rel_err

pytest.importorskip("triton")


@pytest.mark.parametrize("dtype, bar", [(torch.float32, 1e-6), (torch.bfloat16, 2.0**-8)])
@pytest.mark.parametrize("M, N, K", [(1, 40, 300), (3, 17, 64), (GEMV_MAX_ROWS, 33, 513)])
@pytest.mark.parametrize("column_major", [False, True])
def test_triton_matches_float64(M, N, K, dtype, bar, column_major):
    from kimi_linear.ops.triton.gemv import gemv as tri

    gen = torch.Generator().manual_seed(M * 1000 + N)
    x = torch.randn(M, K, generator=gen).to(dtype)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(dtype)
    if column_major:
        w = w.t().contiguous().t()
    got = tri(x, w, block_n=16, block_k=128)
    assert got.dtype == dtype and got.shape == (M, N)
    assert rel_err(got, x.double() @ w.double().t()) < bar


def test_public_op_dispatch_and_errors(monkeypatch):
    import kimi_linear.ops.gemv as op
    from kimi_linear.ops.triton.gemv import gemv as tri

    calls = []
    monkeypatch.setattr(op, "triton_op", lambda name, x: (lambda *a: calls.append(name) or tri(*a)))
    w = torch.randn(8, 32)
    gemv(torch.randn(GEMV_MAX_ROWS, 32), w)
    gemv(torch.randn(GEMV_MAX_ROWS + 1, 32), w)                 # more rows: F.linear
    gemv(torch.randn(2, 32), w.requires_grad_())                  # autograd: F.linear
    assert calls == ["gemv"]
    with pytest.raises(ValueError, match="gemv"):
        gemv(torch.randn(2, 31), w)
    with pytest.raises(ValueError, match="dtype"):
        gemv(torch.randn(2, 32).double(), w)
