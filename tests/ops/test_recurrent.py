"""fused_recurrent_kda: the decode path, token by token, and the state pool it updates in place."""

import pytest
import torch

from kimi_linear.ops import chunk_kda, fused_recurrent_kda, naive_recurrent_kda

from .kda_cases import make_inputs, rel_err


def test_token_by_token_with_carried_state_equals_chunk():
    x = make_inputs(B=2, T=130, H=2, HV=4, seed=11)
    o_chunk, S_chunk = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                 output_final_state=True)
    S = x["initial_state"]
    outs = []
    for t in range(130):
        step = {n: x[n][:, t:t + 1] for n in ("q", "k", "v", "g", "beta")}
        o_t, S = fused_recurrent_kda(**step, initial_state=S, output_final_state=True)
        outs.append(o_t)
    assert rel_err(torch.cat(outs, 1), o_chunk) < 1e-5
    assert rel_err(S, S_chunk) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recurrent_matches_reference_with_options(dtype):
    x = make_inputs(B=2, T=40, H=2, HV=4, raw=True, dtype=dtype, seed=12)
    A_log, dt_bias = torch.randn(4), torch.randn(4 * 32)
    o, S = fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                               output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                               use_beta_sigmoid_in_kernel=True, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
    d = {n: x[n].double() for n in ("q", "k", "v", "g", "beta")}
    q = d["q"] / torch.sqrt(d["q"].pow(2).sum(-1, keepdim=True) + 1e-6)
    k = d["k"] / torch.sqrt(d["k"].pow(2).sum(-1, keepdim=True) + 1e-6)
    g = -5.0 * torch.sigmoid(A_log.double().exp()[:, None] * (d["g"] + dt_bias.double().view(4, 32)))
    o_ref, S_ref = naive_recurrent_kda(q, k, d["v"], g, torch.sigmoid(d["beta"]), initial_state=x["initial_state"],
                                       output_final_state=True)
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    assert o.dtype == dtype
    assert rel_err(o, o_ref) < tol and rel_err(S, S_ref) < tol


def test_recurrent_varlen_with_length_one_sequences():
    cu = torch.tensor([0, 1, 2, 30, 31])
    x = make_inputs(B=1, T=31, N=4, seed=13)
    o, S = fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                               output_final_state=True, cu_seqlens=cu)
    o_ref, S_ref = naive_recurrent_kda(*(x[n].double() for n in ("q", "k", "v", "g", "beta")),
                                       initial_state=x["initial_state"], output_final_state=True, cu_seqlens=cu)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(S, S_ref) < 1e-5


def test_state_pool_rows_updated_in_place_and_others_untouched():
    """Decode 3 sequences that live in slots 5, 0, 2 of an 8-slot pool, as a serving engine would."""
    x = make_inputs(B=3, T=1, H=2, HV=4, seed=14)
    pool = torch.randn(8, 4, 32, 16)
    before = pool.clone()
    slots = torch.tensor([5, 0, 2])
    o, ret = fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pool,
                                 output_final_state=True, state_indices=slots)
    assert ret is pool
    o_ref, S_ref = fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=before[slots],
                                       output_final_state=True)
    assert torch.equal(o, o_ref)
    assert torch.equal(pool[slots], S_ref)
    untouched = [i for i in range(8) if i not in slots.tolist()]
    assert torch.equal(pool[untouched], before[untouched])


def test_state_pool_with_varlen_prompts():
    cu = torch.tensor([0, 3, 4])
    x = make_inputs(B=1, T=4, N=2, seed=15)
    pool = torch.randn(4, 2, 32, 16)
    before = pool.clone()
    o, ret = fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pool,
                                 cu_seqlens=cu, state_indices=torch.tensor([3, 1]))
    assert ret is None
    _, S_ref = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=before[[3, 1]],
                         output_final_state=True, cu_seqlens=cu)
    assert rel_err(pool[[3, 1]], S_ref) < 1e-5
    assert torch.equal(pool[[0, 2]], before[[0, 2]])


@pytest.mark.parametrize("shape", [dict(B=1, H=4), dict(B=5, H=2, HV=4)], ids=["batch1", "batch5-gva"])
def test_single_token_fast_path_matches_reference(shape):
    """T = 1 takes the decode fast path (no layout, fused baddbmm); it must equal the float64 recurrence."""
    x = make_inputs(T=1, raw=True, seed=21, **shape)
    HV = x["v"].shape[2]
    A_log, dt_bias = torch.randn(HV), torch.randn(HV * 32)
    o, S = fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                               output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                               use_beta_sigmoid_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    d = {n: x[n].double() for n in ("q", "k", "v", "g", "beta")}
    q = d["q"] / torch.sqrt(d["q"].pow(2).sum(-1, keepdim=True) + 1e-6)
    k = d["k"] / torch.sqrt(d["k"].pow(2).sum(-1, keepdim=True) + 1e-6)
    g = -A_log.double().exp()[:, None] * torch.nn.functional.softplus(d["g"] + dt_bias.double().view(HV, 32))
    o_ref, S_ref = naive_recurrent_kda(q, k, d["v"], g, torch.sigmoid(d["beta"]), initial_state=x["initial_state"],
                                       output_final_state=True)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(S, S_ref) < 1e-5


@pytest.mark.parametrize(
    "opts",
    [
        dict(),
        dict(use_qk_l2norm_in_kernel=True),
        dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True),
        dict(use_gate_in_kernel=True, lower_bound=-5.0, use_qk_l2norm_in_kernel=True),
        dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True),
    ],
    ids=["plain", "l2norm", "neg-eigval", "bounded-gate", "gate-no-l2"],
)
def test_single_token_fast_path_options_and_gradients(opts):
    """Every option combination of the T = 1 path (which folds the transforms into the step) equals the general
    chunk path, values and gradients, including grouped value heads."""
    raw = bool(opts)
    x = make_inputs(B=3, T=1, H=2, HV=4, raw=raw, seed=31)
    gen = torch.Generator().manual_seed(32)
    if opts.get("use_gate_in_kernel"):
        opts = {**opts, "A_log": torch.randn(4, generator=gen), "dt_bias": torch.randn(4 * 32, generator=gen)}
    if raw and not opts.get("use_gate_in_kernel"):
        x["g"] = torch.nn.functional.logsigmoid(x["g"])
    if raw and not opts.get("use_beta_sigmoid_in_kernel"):
        x["beta"] = torch.sigmoid(x["beta"])
    names = ("q", "k", "v", "g", "beta")

    def run(fn):
        leaves = {n: x[n].clone().requires_grad_() for n in names}
        h0 = x["initial_state"].clone().requires_grad_()
        o, S = fn(*(leaves[n] for n in names), initial_state=h0, output_final_state=True, **opts)
        ((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() + (S * S).sum()).backward()
        return o, S, [leaves[n].grad for n in names] + [h0.grad]

    o1, S1, g1 = run(fused_recurrent_kda)
    o2, S2, g2 = run(chunk_kda)
    assert rel_err(o1, o2) < 1e-5 and rel_err(S1, S2) < 1e-5
    for name, a, b in zip((*names, "initial_state"), g1, g2):
        assert rel_err(a, b) < 1e-4, name
