"""Triton chunk_kda gradients under the interpreter (CPU)."""

import pytest
import torch

pytest.importorskip("triton")

from kimi_linear.ops import chunk_kda as torch_chunk_kda  # noqa: E402
from kimi_linear.ops.triton import chunk_kda  # noqa: E402

from .kda_cases import loss_weights, make_inputs, rel_err  # noqa: E402
from .triton_cases import poison_empty  # noqa: E402, F401  (autouse fixture)


def test_gradients_through_recompute_match_pytorch():
    """Differentiable calls run the Triton forward and a recomputed PyTorch backward: every input's gradient."""
    x = make_inputs(B=1, T=40, H=1, HV=2, K=32, V=16, raw=True, seed=36)
    A_log, dt_bias = torch.randn(2), torch.randn(2 * 32)
    leaves = lambda: {n: t.detach().clone().requires_grad_() for n, t in
                      dict(x, A_log=A_log, dt_bias=dt_bias).items()}
    grads = []
    for fn in (chunk_kda, torch_chunk_kda):
        p = leaves()
        o, S = fn(p["q"], p["k"], p["v"], p["g"], p["beta"], initial_state=p["initial_state"],
                  output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                  use_beta_sigmoid_in_kernel=True, A_log=p["A_log"], dt_bias=p["dt_bias"])
        loss = (o.double() * loss_weights(o.shape)).sum() + (S.double() * loss_weights(S.shape, 2)).sum()
        loss.backward()
        grads.append({n: t.grad for n, t in p.items()})
    for n in grads[1]:
        assert rel_err(grads[0][n], grads[1][n]) < 1e-4, n
