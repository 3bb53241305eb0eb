"""The ground truth itself, against the matrix form of the recurrence (docs/kda.md §1) written independently."""

import torch

from kimi_linear.ops import naive_recurrent_kda

from .kda_cases import make_inputs, rel_err


def matrix_form(q, k, v, g, beta, scale, S):
    """S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T;  o_t = S_t^T (scale q_t). One head."""
    K = q.shape[-1]
    outs = []
    for t in range(q.shape[0]):
        kt = k[t][:, None]
        S = (torch.eye(K, dtype=S.dtype) - beta[t] * kt @ kt.T) @ torch.diag(g[t].exp()) @ S + beta[t] * kt @ v[t][None]
        outs.append(S.T @ (scale * q[t]))
    return torch.stack(outs), S


def test_reference_equals_matrix_form_with_grouped_heads_and_state():
    x = make_inputs(B=2, T=23, H=2, HV=4, K=8, V=5, dtype=torch.float64)
    o, S = naive_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=0.3,
                               initial_state=x["initial_state"], output_final_state=True)
    assert o.dtype == torch.float64 and S.dtype == torch.float64
    for b in range(2):
        for hv in range(4):
            h = hv // 2
            o_ref, S_ref = matrix_form(x["q"][b, :, h], x["k"][b, :, h], x["v"][b, :, hv], x["g"][b, :, hv],
                                       x["beta"][b, :, hv], 0.3, x["initial_state"][b, hv].double())
            assert rel_err(o[b, :, hv], o_ref) < 1e-12
            assert rel_err(S[b, hv], S_ref) < 1e-12


def test_reference_varlen_equals_separate_sequences():
    x = make_inputs(B=1, T=30, H=2, K=8, V=4, N=3, dtype=torch.float64)
    cu = torch.tensor([0, 1, 17, 30])
    o, S = naive_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                               output_final_state=True, cu_seqlens=cu)
    for n in range(3):
        a, e = cu[n].item(), cu[n + 1].item()
        part = {name: x[name][:, a:e] for name in ("q", "k", "v", "g", "beta")}
        o_n, S_n = naive_recurrent_kda(**part, initial_state=x["initial_state"][n:n + 1], output_final_state=True)
        assert torch.equal(o[:, a:e], o_n)
        assert torch.equal(S[n], S_n[0])


def test_reference_forgets_and_writes():
    """g = -inf-like decay erases the state; beta = 1 with unit k writes v exactly along k."""
    x = make_inputs(B=1, T=1, H=1, K=4, V=3, dtype=torch.float64)
    k = torch.nn.functional.normalize(x["k"], dim=-1)
    g = torch.full_like(x["g"], -1000.0)
    o, S = naive_recurrent_kda(x["q"], k, x["v"], g, torch.ones_like(x["beta"]), scale=1.0,
                               initial_state=x["initial_state"], output_final_state=True)
    expected = k[0, 0, 0][:, None] * x["v"][0, 0, 0][None, :]
    assert torch.allclose(S[0, 0], expected, atol=1e-12)
    assert torch.allclose(o[0, 0, 0], expected.T @ x["q"][0, 0, 0], atol=1e-12)
