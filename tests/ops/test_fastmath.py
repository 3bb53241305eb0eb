"""The gate transforms from one exponential (ops/triton/transforms.softplus_sigmoid) and the single-instruction
functions under them (ops/triton/fastmath.py)."""

import torch
import triton
import triton.language as tl

from kimi_linear.ops.triton.transforms import softplus_sigmoid

from .sm90 import build_sm90


@triton.jit
def softplus_sigmoid_kernel(x, sp, sg, N, BN: tl.constexpr):
    o = tl.program_id(0) * BN + tl.arange(0, BN)
    m = o < N
    b_sp, b_sg = softplus_sigmoid(tl.load(x + o, mask=m, other=0.0))
    tl.store(sp + o, b_sp, mask=m)
    tl.store(sg + o, b_sg, mask=m)


def test_softplus_sigmoid_against_float64():
    """Every branch: large positive (softplus = x), the series for exp(-|x|) < 0.1 on both sides of its bound
    (|x| = 2.3026), log(1 + e) near 0, sigmoid's two forms, and gates far past float32's exponent range (-1000: 0
    and 0, not NaN)."""
    edges = [0.0, 1e-8, -1e-8, 2.302, -2.302, 2.303, -2.303, 88.0, -88.0, -104.0, 1000.0, -1000.0, 3e38, -3e38]
    x = torch.cat([torch.linspace(-40, 40, 801), torch.tensor(edges)]).float()
    sp, sg = torch.empty_like(x), torch.empty_like(x)
    softplus_sigmoid_kernel[(triton.cdiv(x.numel(), 256),)](x, sp, sg, x.numel(), BN=256)
    x64 = x.double()
    sp_ref = torch.nn.functional.softplus(x64).float()
    sg_ref = torch.sigmoid(x64).float()
    assert torch.isfinite(sp).all() and torch.isfinite(sg).all()
    # relative to each value (float32 rounding of a few operations; log(1 + e) rounds 1 + e for e >= 0.1), with an
    # absolute floor far below any gate
    torch.testing.assert_close(sp, sp_ref, rtol=1.5e-6, atol=1e-38)
    torch.testing.assert_close(sg, sg_ref, rtol=4e-7, atol=1e-38)


BUILD_FASTMATH = """
import triton.language as tl
import triton

from kimi_linear.ops.triton.transforms import softplus_sigmoid


@triton.jit
def kernel(x, y, BN: tl.constexpr):
    o = tl.arange(0, BN)
    b_sp, b_sg = softplus_sigmoid(tl.load(x + o))
    tl.store(y + o, b_sp + b_sg)


ptx = compile(kernel, dict(x="*fp32", y="*fp32"), dict(BN=128)).asm["ptx"]
for op in ("ex2.approx.ftz.f32", "lg2.approx.ftz.f32", "rcp.approx.ftz.f32"):
    assert op in ptx, op
assert "div.rn.f32" not in ptx and "div.full" not in ptx
print("BUILT")
"""


def test_fastmath_builds_for_sm90(tmp_path):
    """The functions are inline PTX the interpreter never runs: built for sm_90, the transforms use exactly the
    three single instructions and no IEEE division."""
    build_sm90(BUILD_FASTMATH, tmp_path)
