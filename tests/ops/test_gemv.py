"""The decode projection ``ops.gemv``: the Triton kernel (under the interpreter, its TMA descriptor included)
against float64 on fresh random inputs, and the dispatch that sends only what the kernel takes to it."""

import pytest
import torch
import torch.nn.functional as F

import kimi_linear.ops.gemv as gemv_op
from kimi_linear.ops.gemv import GEMV_MAX_ROWS, gemv, gemv_eligible
from kimi_linear.ops.triton import decode_gemv as tri_gemv

# bf16 output: one rounding of a float32 sum of exact products (2^-8 relative), plus the sum's own rounding
BAR = {torch.bfloat16: 8e-3, torch.float16: 1e-3}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M, N, K, launch", [
    (1, 48, 256, dict()),                              # one row, N a multiple of BN, K one step
    (3, 37, 312, dict(BK=64)),                         # N past the last tile, K not a multiple of BK
    (16, 20, 96, dict(BN=32, BK=32, stages=2)),        # a full tile of rows, one program of rows past N
    (17, 16, 64, dict()),                              # rows past one tile of x: two row programs
])
def test_triton_gemv_against_float64(M, N, K, launch, dtype):
    gen = torch.Generator().manual_seed(M * 131 + N + K)
    x = torch.randn(M, K, generator=gen).to(dtype)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(dtype)
    cfg = tri_gemv.GemvLaunch(**{**tri_gemv.LAUNCH.__dict__, **launch})
    got = tri_gemv.gemv(x, w, cfg)
    want = x.double() @ w.double().t()
    assert got.dtype == dtype and got.shape == (M, N)
    assert rel_err(got, want) < BAR[dtype]
    # every row alone gives the bits it has in the batch (a token's projection must not depend on its batch)
    assert all(torch.equal(tri_gemv.gemv(x[m : m + 1], w, cfg)[0], got[m]) for m in range(M))
    # a strided x (a column slice of a wider tensor, as a packed projection's output is) reads the same rows
    wide = torch.randn(M, K + 8, generator=gen).to(dtype)
    wide[:, 8:] = x
    assert torch.equal(tri_gemv.gemv(wide[:, 8:], w, cfg), got)


def test_gemv_dispatch(monkeypatch):
    """Only 16-bit, few-row, contiguous-W products without autograd reach the kernel; the rest is F.linear, and
    the results agree."""
    calls = []
    monkeypatch.setattr(gemv_op, "triton_op", lambda name, x: (lambda *a: calls.append(1) or tri_gemv.gemv(*a))
                        if name == "gemv" else None)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(24, 64, generator=gen).bfloat16()
    x = torch.randn(GEMV_MAX_ROWS, 64, generator=gen).bfloat16()
    got = gemv(x, w)
    assert calls == [1] and rel_err(got, x.double() @ w.double().t()) < BAR[torch.bfloat16]
    gemv(torch.randn(GEMV_MAX_ROWS + 1, 64).bfloat16(), w)                 # too many rows
    gemv(x.float(), w.float())                                             # float32: cuBLAS / CPU BLAS
    gemv(x, w.t().contiguous().t())                                        # column-major W: no descriptor
    gemv(x, w.clone().requires_grad_())                                    # autograd
    assert calls == [1]
    assert not gemv_eligible(x, torch.randn(24, 60).bfloat16())            # 120-byte rows: no TMA descriptor
    with pytest.raises(ValueError, match="gemv: x must be"):
        gemv(torch.randn(2, 63).bfloat16(), w)


def test_gemv_is_f_linear_off_the_gpu():
    x, w = torch.randn(2, 32).bfloat16(), torch.randn(8, 32).bfloat16()
    assert torch.equal(gemv(x, w), F.linear(x, w))
