"""A decode step's wide input projection (ops.wide_projection; Triton's interpreter, where num_sms is 4, so
"wide" means 4-8 row tiles of 64, N = 193-512): the product against float64 through the TMA descriptor and by
pointers, in float32 and bf16, K not a multiple of the kernel's step, 1-16 rows; None outside its range (too few or
too many row tiles, more than 16 rows, autograd, CPU without the interpreter); and a KDA layer whose packed
projection qualifies decodes through it to the same outputs."""

import copy

import pytest
import torch

import kimi_linear.ops.projection as proj_op
from kimi_linear.ops.projection import wide_projection

from .triton_cases import poison_empty  # noqa: F401  (autouse fixture)


@pytest.fixture
def on_triton(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("KIMI_LINEAR_BACKEND", "triton")


def case(M, N, K, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(M, K, generator=gen).to(dtype), (torch.randn(N, K, generator=gen) / K**0.5).to(dtype)


@pytest.mark.parametrize("tma", [True, False], ids=["descriptor", "pointers"])
@pytest.mark.parametrize("dtype,bar", [(torch.float32, 1e-5), (torch.bfloat16, 2**-7)])
@pytest.mark.parametrize("M, N, K", [(1, 256, 300), (5, 452, 129), (16, 193, 64)])
def test_product_against_float64(on_triton, monkeypatch, M, N, K, dtype, bar, tma):
    from kimi_linear.ops.triton import splitk

    if not tma:
        monkeypatch.setattr(splitk, "weight_descriptor", lambda w: None)
    x, w = case(M, N, K, dtype)
    y = wide_projection(x, w)
    assert y is not None and y.dtype == dtype and y.shape == (M, N)
    want = x.double() @ w.double().t()
    assert (y.double() - want).abs().max() <= bar * want.abs().max()


def test_declines_outside_its_range(on_triton, monkeypatch):
    x, w = case(2, 256, 64, torch.float32)
    assert wide_projection(x, w[:192]) is None                       # 3 row tiles: fewer than the SMs
    assert wide_projection(x, torch.cat([w, w, w])[:520]) is None     # 9 row tiles: more than two a SM
    assert wide_projection(torch.randn(17, 64), w) is None            # more rows than the kernel's row block
    assert wide_projection(x.bfloat16(), w) is None                  # mixed dtypes
    assert wide_projection(x.requires_grad_(), w) is None             # autograd
    y = wide_projection(torch.randn(3, 1, 64), w)                     # leading dims kept
    assert y is not None and y.shape == (3, 1, 256)
    monkeypatch.delenv("KIMI_LINEAR_BACKEND")
    assert wide_projection(x.detach(), w) is None                    # CPU tensors stay on the caller's path
    with pytest.raises(ValueError, match="agree on K"):
        wide_projection(x, w[:, :10])


def test_kda_layer_decodes_through_it(on_triton, monkeypatch):
    """4 heads of 32: the packed projection has 452 rows (8 row tiles), so a pooled decode step takes the wide
    projection; outputs and memories as the layer's float64 PyTorch path."""
    from kimi_linear.layers.kda import KDAState, PooledKDAState

    from ..layers.test_layers import rel_err
    from ..layers.test_native_decode import kda_layer

    used = []
    real = proj_op.triton_op
    monkeypatch.setattr(proj_op, "triton_op", lambda name, x: used.append(name) or real(name, x))
    m = kda_layer("init", head_dim=32)
    assert m._pack.weight.shape[0] == 452
    gen = torch.Generator().manual_seed(3)
    conv, rec = torch.randn(3, 3, 384, generator=gen), torch.randn(3, 4, 32, 32, generator=gen) * 0.2
    index = torch.tensor([2, 0])
    x = torch.randn(2, 3, 48, generator=gen)
    ref = copy.deepcopy(m).double()
    state64 = KDAState(conv[index].double(), rec[index].clone())
    monkeypatch.delenv("KIMI_LINEAR_BACKEND")
    with torch.no_grad():
        want = torch.cat([ref(x[:, t : t + 1].double(), state64) for t in range(3)], 1)
    monkeypatch.setenv("KIMI_LINEAR_BACKEND", "triton")
    got_rec = rec.clone()
    state = PooledKDAState(conv.clone(), got_rec, index)
    with torch.no_grad():
        got = torch.cat([m(x[:, t : t + 1], state) for t in range(3)], 1)
    assert used.count("wide_rows_product") == 3
    assert rel_err(got, want) < 2e-5 and rel_err(got_rec[index], state64.recurrent) < 2e-5
