"""layers.linear: the one-row CPU path (output features split across threads, one bmm) equals F.linear."""

import pytest
import torch
import torch.nn.functional as F

from kimi_linear.layers import Linear
from kimi_linear.layers.linear import _row_blocks, linear


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("layout", ["row-major", "col-major"])
@pytest.mark.parametrize("shape", [(512, 256), (96, 320), (7, 64)], ids=["wide", "tall", "odd-out"])
def test_one_row_matches_f_linear(two_threads, layout, shape):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(*shape, generator=gen)
    if layout == "col-major":
        w = w.t().contiguous().t()
    x = torch.randn(1, 1, shape[1], generator=gen)
    b = torch.randn(shape[0], generator=gen)
    # The split path is taken whenever the output features divide among the threads.
    assert (_row_blocks(w, 2) is not None) == (shape[0] % 2 == 0)
    with torch.no_grad():
        torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        many = torch.randn(3, 4, shape[1], generator=gen)                   # several rows: plain F.linear
        assert torch.equal(linear(many, w), F.linear(many, w))


def test_module_keeps_names_and_gradients(two_threads):
    lin = Linear(64, 32, bias=False)
    assert list(lin.state_dict()) == ["weight"]
    x = torch.randn(1, 64, requires_grad=True)
    lin(x).square().sum().backward()
    ref_x = x.detach().clone().requires_grad_()
    F.linear(ref_x, lin.weight.detach()).square().sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad)
    assert lin.weight.grad is not None
