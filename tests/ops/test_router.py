"""The MoE router as one operator: the Triton kernel (under the interpreter) against the float64 PyTorch path, and
the layer's router through it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kimi_linear.layers import SigmoidTopKRouter  # noqa: E402
from kimi_linear.ops import sigmoid_topk_route  # noqa: E402
from kimi_linear.ops.router import sigmoid_topk_route_torch  # noqa: E402
from kimi_linear.ops.triton.router import sigmoid_topk_route as tri_route  # noqa: E402

from .triton_cases import poison_empty  # noqa: E402, F401  (autouse fixture)


@pytest.mark.parametrize("N,E,k", [(1, 32, 8), (19, 40, 4), (3, 256, 8), (33, 16, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renorm,scale", [(True, 2.446), (False, 1.0)])
def test_kernel_matches_the_float64_router(N, E, k, dtype, renorm, scale):
    torch.manual_seed(N * E + k)
    D = 72                                                       # not a multiple of the kernel's D step
    x = torch.randn(N, D).to(dtype)
    weight, bias = torch.randn(E, D) * 0.2, torch.randn(E) * 1e-2
    w, ids = tri_route(x, weight, bias, k, renorm, scale)
    w_ref, ids_ref = sigmoid_topk_route_torch(x.double(), weight.double(), bias.double(), k, renorm, scale)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == w.shape == (N, k)
    # Same experts in the same (descending) order, weights to float32 rounding.
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w.double(), w_ref, rtol=1e-5, atol=1e-6)


def test_nan_rows_still_name_real_experts():
    torch.manual_seed(1)
    x, weight = torch.randn(4, 32), torch.randn(16, 32)
    x[1] = float("nan")
    w, ids = tri_route(x, weight, torch.zeros(16), 4, True, 1.0)
    assert ((ids >= 0) & (ids < 16)).all()
    ok = [0, 2, 3]                                               # rows are independent: the others are unaffected
    assert torch.equal(ids[ok], sigmoid_topk_route_torch(x[ok], weight, torch.zeros(16), 4)[1])


def test_layer_router_goes_through_the_op(monkeypatch):
    """SigmoidTopKRouter (one group) calls the op; with the Triton kernel swapped in for CUDA dispatch it equals the
    PyTorch path; group-limited routing keeps the layer's own code."""
    import kimi_linear.ops.router as router_mod

    calls = []

    def fake_triton_op(name, x):
        calls.append(name)
        return tri_route

    monkeypatch.setattr(router_mod, "triton_op", fake_triton_op)
    torch.manual_seed(0)
    r = SigmoidTopKRouter(48, 32, 8, routed_scaling_factor=2.446)
    with torch.no_grad():
        r.weight.normal_(std=0.2)
        r.e_score_correction_bias.normal_(std=1e-2)
        x = torch.randn(5, 48)
        w, ids = r(x)
        w_ref, ids_ref = sigmoid_topk_route_torch(x, r.weight, r.e_score_correction_bias, 8, True, 2.446)
    assert calls == ["sigmoid_topk_route"] and torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)
    grouped = SigmoidTopKRouter(48, 32, 4, n_group=4, topk_group=2)
    with torch.no_grad():
        grouped(x)
    assert calls == ["sigmoid_topk_route"]


def test_argument_errors():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="weight"):
        sigmoid_topk_route(x, torch.randn(4, 7), torch.zeros(4), 2)
    with pytest.raises(ValueError, match="bias"):
        sigmoid_topk_route(x, torch.randn(4, 8), torch.zeros(5), 2)
    with pytest.raises(ValueError, match="k must be"):
        sigmoid_topk_route(x, torch.randn(4, 8), torch.zeros(4), 5)
