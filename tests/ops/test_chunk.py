"""chunk_kda against the float64 token-by-token reference: outputs, final states and every gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kimi_linear.ops import chunk_gated_delta_rule, chunk_kda, naive_recurrent_kda

from .kda_cases import as_leaves, as_reference, loss_weights, make_inputs, rel_err

FWD_TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-3}
GRAD_TOL = 1e-4  # float32


def reference_transforms(x, *, l2norm=False, gate=None, beta_sigmoid=False, allow_neg_eigval=False):
    """The in-kernel options (docs/kda.md §2), written plainly, applied to float64 leaves."""
    q, k, g, beta = x["q"], x["k"], x["g"], x["beta"]
    if l2norm:
        q = q / torch.sqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    if gate is not None:
        HV, K = g.shape[-2:]
        z = g + x["dt_bias"].view(HV, K)
        a = x["A_log"].view(HV, 1).exp()
        g = -a * F.softplus(z) if gate == "softplus" else gate * torch.sigmoid(a * z)
    if beta_sigmoid:
        beta = torch.sigmoid(beta) * (2 if allow_neg_eigval else 1)
    return q, k, g, beta


def run_both(x, *, cu_seqlens=None, scale=None, grads=True, l2norm=False, gate=None, beta_sigmoid=False,
             allow_neg_eigval=False):
    """Run chunk_kda on ``x`` and the reference on its float64 copy; compare o, the final state and gradients."""
    dtype = x["q"].dtype
    ours_in = as_leaves(x) if grads else x
    ref_in = as_reference(x)
    opts = dict(use_qk_l2norm_in_kernel=l2norm, use_gate_in_kernel=gate is not None,
                use_beta_sigmoid_in_kernel=beta_sigmoid, allow_neg_eigval=allow_neg_eigval)
    if gate is not None:
        lower_bound = None if gate == "softplus" else gate
        opts.update(A_log=ours_in["A_log"], dt_bias=ours_in["dt_bias"], lower_bound=lower_bound)
    o, S = chunk_kda(ours_in["q"], ours_in["k"], ours_in["v"], ours_in["g"], ours_in["beta"], scale=scale,
                     initial_state=ours_in["initial_state"], output_final_state=True, cu_seqlens=cu_seqlens, **opts)
    q, k, g, beta = reference_transforms(ref_in, l2norm=l2norm, gate=gate, beta_sigmoid=beta_sigmoid,
                                         allow_neg_eigval=allow_neg_eigval)
    o_ref, S_ref = naive_recurrent_kda(q, k, ref_in["v"], g, beta, scale=scale, initial_state=ref_in["initial_state"],
                                       output_final_state=True, cu_seqlens=cu_seqlens)
    assert o.dtype == dtype and o.shape == x["v"].shape[:3] + (x["v"].shape[-1],)
    assert S.dtype == torch.float32
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert rel_err(o, o_ref) < FWD_TOL[dtype], rel_err(o, o_ref)
    assert rel_err(S, S_ref) < FWD_TOL[dtype], rel_err(S, S_ref)
    if not grads:
        return
    w_o, w_S = loss_weights(o.shape), loss_weights(S.shape, seed=2)
    ((o.double() * w_o).sum() + (S.double() * w_S).sum()).backward()
    ((o_ref * w_o).sum() + (S_ref * w_S).sum()).backward()
    for name, leaf in ours_in.items():
        if leaf is None:
            continue
        assert leaf.grad is not None, f"no gradient for {name}"
        assert torch.isfinite(leaf.grad).all(), f"non-finite gradient for {name}"
        err = rel_err(leaf.grad, ref_in[name].grad)
        assert err < GRAD_TOL, f"gradient of {name}: relative error {err:.2e}"


@pytest.mark.parametrize(
    "shape",
    [
        dict(B=2, T=1),
        dict(B=2, T=37),
        dict(B=1, T=64),
        dict(B=2, T=64 * 3 + 7),
        dict(B=1, T=100, H=2, HV=4),          # grouped value heads
        dict(B=1, T=65, H=1, HV=3, K=16, V=48),
    ],
    ids=["T1", "T37", "T64", "T199-multichunk", "gva-2x", "gva-3x-wideV"],
)
def test_chunk_matches_reference_float32(shape):
    run_both(make_inputs(**shape))


def test_chunk_without_initial_state_and_custom_scale():
    run_both(make_inputs(B=2, T=90, initial_state=False), scale=0.37)


def test_chunk_bfloat16_forward():
    x = make_inputs(B=2, T=150, H=2, HV=4, dtype=torch.bfloat16)
    run_both(x, grads=False)


def test_chunk_strong_decay_is_finite_and_exact():
    """Per-step g of -1000 (every 7th step) and exactly 0 (every 5th): no NaN/inf anywhere, same tolerances."""
    run_both(make_inputs(B=2, T=150, strong_decay=True))


def test_chunk_all_gates_minus_1000_and_all_zero():
    x = make_inputs(B=1, T=70)
    x["g"] = torch.full_like(x["g"], -1000.0)
    run_both(x)
    x["g"] = torch.zeros_like(x["g"])
    run_both(x)


@pytest.mark.parametrize("lengths", [[1, 63, 64, 1, 70], [130], [5, 1, 1]], ids=["mixed", "single", "short"])
def test_chunk_varlen(lengths):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    x = make_inputs(B=1, T=sum(lengths), H=2, HV=4, N=len(lengths), seed=len(lengths))
    run_both(x, cu_seqlens=cu)


def test_chunk_varlen_equals_separate_calls():
    cu = torch.tensor([0, 3, 67, 167])  # lengths 3, 64, 100
    x = make_inputs(B=1, T=167, N=3)
    o, S = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                     output_final_state=True, cu_seqlens=cu)
    for n, (a, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        part = {name: x[name][:, a:e] for name in ("q", "k", "v", "g", "beta")}
        o_n, S_n = chunk_kda(**part, initial_state=x["initial_state"][n:n + 1], output_final_state=True)
        assert rel_err(o[:, a:e], o_n) < 1e-6 and rel_err(S[n], S_n[0]) < 1e-6


@pytest.mark.parametrize(
    "options",
    [
        dict(l2norm=True),
        dict(beta_sigmoid=True),
        dict(beta_sigmoid=True, allow_neg_eigval=True, l2norm=True),
        dict(gate="softplus"),
        dict(gate=-5.0),
        dict(l2norm=True, gate=-5.0, beta_sigmoid=True),
    ],
    ids=["l2norm", "beta-sigmoid", "neg-eigval", "gate-softplus", "gate-lower-bound", "all"],
)
def test_chunk_in_kernel_options(options):
    x = make_inputs(B=2, T=80, H=2, HV=4, raw=True, seed=3)
    if not options.get("l2norm"):
        x["k"] = F.normalize(x["k"], dim=-1)
    if not options.get("beta_sigmoid"):
        x["beta"] = torch.sigmoid(x["beta"])
    if options.get("gate") is None:
        x["g"] = F.logsigmoid(x["g"])
    else:
        gen = torch.Generator().manual_seed(4)
        x["A_log"] = torch.randn(1, 1, 4, 1, generator=gen)                    # the checkpoint's A_log layout
        x["dt_bias"] = torch.randn(4 * 32, generator=gen)
    run_both(x, **options)


def test_chunk_bfloat16_with_options():
    x = make_inputs(B=1, T=100, H=2, raw=True, dtype=torch.bfloat16, seed=5)
    x["A_log"] = torch.randn(2)
    x["dt_bias"] = torch.randn(2, 32)
    run_both(x, grads=False, l2norm=True, gate=-5.0, beta_sigmoid=True)


def test_chunk_gated_delta_rule_is_kda_with_a_scalar_gate():
    x = make_inputs(B=2, T=100, H=2, HV=4, seed=6)
    g = F.logsigmoid(torch.randn(2, 100, 4, generator=torch.Generator().manual_seed(7)))
    o, S = chunk_gated_delta_rule(x["q"], x["k"], x["v"], g, x["beta"], initial_state=x["initial_state"],
                                  output_final_state=True)
    g_full = g.double().unsqueeze(-1).expand_as(x["g"])
    o_ref, S_ref = naive_recurrent_kda(x["q"].double(), x["k"].double(), x["v"].double(), g_full,
                                       x["beta"].double(), initial_state=x["initial_state"], output_final_state=True)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(S, S_ref) < 1e-5
    gl = g.clone().requires_grad_()
    chunk_gated_delta_rule(x["q"], x["k"], x["v"], gl, x["beta"])[0].sum().backward()
    assert gl.grad.shape == g.shape and torch.isfinite(gl.grad).all() and gl.grad.abs().sum() > 0


def test_chunk_returns_no_state_unless_asked():
    x = make_inputs(B=1, T=10)
    o, S = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"])
    assert S is None and o.shape == x["v"].shape
