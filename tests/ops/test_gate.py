"""fused_kda_gate: both formulas (docs/kda.md §2) against plain float64 math."""

import pytest
import torch
import torch.nn.functional as F

from kimi_linear.ops import fused_kda_gate


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_formulas(lower_bound, dtype):
    gen = torch.Generator().manual_seed(0)
    g = (3 * torch.randn(2, 7, 4, 16, generator=gen)).to(dtype)
    A_log = torch.randn(1, 1, 4, 1, generator=gen)
    dt_bias = torch.randn(4 * 16, generator=gen)
    out = fused_kda_gate(g, A_log, dt_bias, lower_bound=lower_bound)
    z = g.double() + dt_bias.double().view(4, 16)
    a = A_log.double().view(4, 1).exp()
    ref = -a * F.softplus(z) if lower_bound is None else lower_bound * torch.sigmoid(a * z)
    assert out.dtype == torch.float32 and out.shape == g.shape
    assert torch.allclose(out.double(), ref, rtol=1e-6, atol=1e-6)
    assert (out <= 0).all()
    if lower_bound is not None:
        assert (out >= lower_bound).all()


def test_gate_without_bias_and_gradients():
    """Float32 out by contract; gradients agree with float64 autograd through the formula."""
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(3, 2, 8, generator=gen, requires_grad=True)
    A_log = torch.randn(2, generator=gen, requires_grad=True)
    w = torch.randn(3, 2, 8, generator=gen, dtype=torch.float64)
    (fused_kda_gate(g, A_log).double() * w).sum().backward()
    g64, a64 = g.detach().double().requires_grad_(), A_log.detach().double().requires_grad_()
    ((-a64.exp()[:, None] * F.softplus(g64)) * w).sum().backward()
    assert torch.allclose(g.grad.double(), g64.grad, rtol=1e-5, atol=1e-6)
    assert torch.allclose(A_log.grad.double(), a64.grad, rtol=1e-5, atol=1e-6)
