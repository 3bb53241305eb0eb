"""The KDA block's gated output norm (ops.norm): the PyTorch path against a float64 formula, and the Triton
kernels (under the interpreter) against it, forward and gradients (o, gate, weight), with the gate a strided
slice of a packed projection as the layer passes it, a row count that is not a multiple of the kernel's row
block, and a head size that is not a power of two. Bars: float32 1e-5, bf16 5e-3 forward / 2e-2 gradients."""

import pytest
import torch

from kimi_linear.ops.norm import gated_rms_norm

from .kda_cases import rel_err
from .triton_cases import poison_empty  # noqa: F401  (autouse fixture)


def naive(o, gate, weight, eps):
    o, gate, weight = o.double(), gate.double(), weight.double()
    return o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + eps) * weight * torch.sigmoid(gate)


def make(B, T, H, d, dtype, strided, seed=0):
    gen = torch.Generator().manual_seed(seed)
    o = torch.randn(B, T, H, d, generator=gen).to(dtype)
    packed = torch.randn(B, T, 3 + H * d + 5, generator=gen).to(dtype)
    gate = packed[..., 3:3 + H * d].view(B, T, H, d) if strided else torch.randn(B, T, H, d, generator=gen).to(dtype)
    weight = 1.0 + 0.1 * torch.randn(d, generator=gen)
    return o, gate, weight


def test_torch_path_float64():
    o, gate, w = make(2, 5, 3, 16, torch.float64, strided=True)
    assert rel_err(gated_rms_norm(o, gate, w, 1e-6), naive(o, gate, w, 1e-6)) < 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B, T, H, d, strided", [(2, 9, 3, 32, True), (1, 1, 2, 24, False), (1, 13, 4, 128, True)])
def test_triton_forward_and_gradients(B, T, H, d, strided, dtype):
    from kimi_linear.ops.triton.norm import gated_rms_norm as tri

    o, gate, w = make(B, T, H, d, dtype, strided, seed=1)
    leaves = [t.detach().clone().requires_grad_() for t in (o, gate, w)]
    if strided:   # the gate as the layer passes it: a view into a packed projection's output
        packed = torch.zeros(B, T, H * d + 7, dtype=dtype)
        packed[..., 2:2 + H * d] = gate.reshape(B, T, H * d)
        packed.requires_grad_()
        gate_in = packed[..., 2:2 + H * d].view(B, T, H, d)
    else:
        gate_in = leaves[1]
    y = tri(leaves[0], gate_in, leaves[2], 1e-6)
    refs = [t.detach().double().requires_grad_() for t in (o, gate, w)]
    y_ref = naive(*refs, 1e-6)
    assert y.dtype == dtype and y.shape == o.shape
    fwd_bar, grad_bar = (1e-5, 1e-5) if dtype == torch.float32 else (5e-3, 2e-2)
    assert rel_err(y, y_ref) < fwd_bar
    dy = torch.randn(o.shape, generator=torch.Generator().manual_seed(2))
    (y.double() * dy).sum().backward()
    (y_ref * dy).sum().backward()
    got_gate = packed.grad[..., 2:2 + H * d].reshape(B, T, H, d) if strided else leaves[1].grad
    if strided:
        assert packed.grad[..., :2].abs().sum() == 0 and packed.grad[..., 2 + H * d:].abs().sum() == 0
    for name, got, ref in (("o", leaves[0].grad, refs[0].grad), ("gate", got_gate, refs[1].grad),
                           ("weight", leaves[2].grad, refs[2].grad)):
        assert rel_err(got, ref) < grad_bar, (name, rel_err(got, ref))


@pytest.mark.parametrize("bad, match", [
    (dict(o=torch.zeros(4)), "o must be"),
    (dict(gate=torch.zeros(2, 3, 5)), "gate must"),
    (dict(weight=torch.zeros(3)), "weight must be"),
])
def test_bad_inputs(bad, match):
    args = dict(o=torch.zeros(2, 3, 4), gate=torch.zeros(2, 3, 4), weight=torch.ones(4))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        gated_rms_norm(**args)
