"""fla-core 0.6's call interface of chunk_kda / fused_recurrent_kda / fused_kda_gate: the extra arguments its callers
pass (safe_gate, disable_recompute, chunk_size, cu_seqlens_cpu, state_v_first and its deprecated name
transpose_state_layout, return_intermediate_states, the bounded gate without A_log, vLLM's ssm_state_indices /
num_accepted_tokens / inplace_final_state, out, fused_recurrent_kda_fwd), each with fla's meaning, against our own
results computed without them (PyTorch path, float32/float64). fla's own test file runs in tests/fla_suite."""

from __future__ import annotations

import pytest
import torch

from kimi_linear.ops import chunk_kda, fused_kda_gate, fused_recurrent_kda
from kimi_linear.ops.recurrent import fused_recurrent_kda_fwd

from .kda_cases import make_inputs, rel_err


def args5(x):
    return x["q"], x["k"], x["v"], x["g"], x["beta"]


def test_options_that_change_nothing_here():
    x = make_inputs(B=2, T=70, H=2, K=16, V=16, seed=1)
    ref = chunk_kda(*args5(x), initial_state=x["initial_state"], output_final_state=True)
    for kw in (dict(safe_gate=True), dict(disable_recompute=True), dict(lower_bound=-5.0), dict(chunk_size=64),
               dict(chunk_size=32)):
        got = chunk_kda(*args5(x), initial_state=x["initial_state"], output_final_state=True, **kw)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), kw


def test_argument_errors_name_the_argument():
    x = make_inputs(B=1, T=20, H=2, K=16, V=16, seed=2, raw=True)
    with pytest.raises(ValueError, match="`chunk_size` must be either 32 or 64"):
        chunk_kda(*args5(x), chunk_size=16)
    with pytest.raises(ValueError, match="`lower_bound` must be given"):
        chunk_kda(*args5(x), use_gate_in_kernel=True, A_log=torch.zeros(2), safe_gate=True)
    with pytest.raises(ValueError, match="safe range"):
        chunk_kda(*args5(x), use_gate_in_kernel=True, A_log=torch.zeros(2), safe_gate=True, lower_bound=-7.0)
    with pytest.raises(ValueError, match="`cu_seqlens_cpu`"):
        chunk_kda(*args5(x), cu_seqlens_cpu=torch.tensor([0, 20]))
    with pytest.raises(ValueError, match="`inplace_final_state`"):
        fused_recurrent_kda(*args5(x), inplace_final_state=True)


def test_cu_seqlens_cpu_is_the_host_copy():
    x = make_inputs(B=1, T=40, H=2, K=16, V=16, N=3, seed=3)
    cu = torch.tensor([0, 7, 30, 40])
    ref = chunk_kda(*args5(x), initial_state=x["initial_state"], output_final_state=True, cu_seqlens=cu)
    got = chunk_kda(*args5(x), initial_state=x["initial_state"], output_final_state=True, cu_seqlens=cu,
                    cu_seqlens_cpu=cu.clone())
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@pytest.mark.parametrize("op", ["chunk", "recurrent"])
def test_bounded_gate_without_a_log(op):
    """A_log=None with lower_bound: g = lower_bound * sigmoid(g_raw + dt_bias)."""
    x = make_inputs(B=2, T=9, H=2, K=16, V=16, seed=4, raw=True)
    dt_bias = torch.randn(2 * 16, dtype=torch.float32)
    gate = -5.0 * torch.sigmoid(x["g"] + dt_bias.view(2, 16))
    f = chunk_kda if op == "chunk" else fused_recurrent_kda
    ref = f(x["q"], x["k"], x["v"], gate, x["beta"], initial_state=x["initial_state"], output_final_state=True)
    got = f(*args5(x), initial_state=x["initial_state"], output_final_state=True, use_gate_in_kernel=True,
            dt_bias=dt_bias, lower_bound=-5.0)
    assert rel_err(got[0], ref[0]) < 1e-6 and rel_err(got[1], ref[1]) < 1e-6
    assert rel_err(fused_kda_gate(x["g"], None, dt_bias, -5.0), gate) < 1e-6
    assert fused_kda_gate(x["g"], None, dt_bias, -5.0, output_dtype=torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("op", ["chunk", "recurrent"])
def test_state_v_first(op):
    x = make_inputs(B=2, T=11, H=2, K=16, V=8, seed=5)
    f = chunk_kda if op == "chunk" else fused_recurrent_kda
    o, S = f(*args5(x), initial_state=x["initial_state"], output_final_state=True)
    o_t, S_t = f(*args5(x), initial_state=x["initial_state"].transpose(-1, -2).contiguous(), output_final_state=True,
                 state_v_first=True)
    assert S_t.shape == (2, 2, 8, 16)
    assert rel_err(o_t, o) < 1e-6 and rel_err(S_t.transpose(-1, -2), S) < 1e-6


@pytest.mark.parametrize("op", ["chunk", "recurrent"])
def test_transpose_state_layout_is_the_old_name(op):
    """fla's deprecated spelling: a DeprecationWarning and the same result; with state_v_first too, an error."""
    x = make_inputs(B=2, T=11, H=2, K=16, V=8, seed=5)
    f = chunk_kda if op == "chunk" else fused_recurrent_kda
    h0 = x["initial_state"].transpose(-1, -2).contiguous()
    ref = f(*args5(x), initial_state=h0, output_final_state=True, state_v_first=True)
    with pytest.warns(DeprecationWarning, match="`transpose_state_layout`"):
        got = f(*args5(x), initial_state=h0, output_final_state=True, transpose_state_layout=True)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    with pytest.raises(ValueError, match="`state_v_first`"):
        f(*args5(x), state_v_first=True, transpose_state_layout=True)


def test_state_v_first_pool_in_place():
    x = make_inputs(B=3, T=1, H=2, K=16, V=8, seed=6)
    pool = torch.randn(6, 2, 16, 8, dtype=torch.float32)
    slots = torch.tensor([4, 0, 2])
    ref_pool = pool.clone()
    o_ref, _ = fused_recurrent_kda(*args5(x), initial_state=ref_pool, state_indices=slots)
    pool_vf = pool.transpose(-1, -2).contiguous()
    o, ret = fused_recurrent_kda(*args5(x), initial_state=pool_vf, state_indices=slots, state_v_first=True,
                                 output_final_state=True)
    assert ret is pool_vf and torch.equal(o, o_ref) and torch.equal(pool_vf.transpose(-1, -2), ref_pool)


@pytest.mark.parametrize("C", [64, 32])
@pytest.mark.parametrize("varlen", [False, True])
def test_intermediate_states_are_the_chunk_starts(varlen, C):
    """return_intermediate_states: h[.., i] is the state at the start of chunk i (the final state of the first
    C i tokens of that sequence, C = chunk_size), fla's [B, NT, HV, K, V] (varlen: every sequence's chunks back to
    back)."""
    if varlen:
        x = make_inputs(B=1, T=200, H=2, K=16, V=8, N=3, seed=7)
        cu, seqs = torch.tensor([0, 64, 65, 200]), [(0, 64), (64, 65), (65, 200)]
    else:
        x = make_inputs(B=2, T=150, H=2, K=16, V=8, seed=7)
        cu, seqs = None, None
    with torch.inference_mode():
        o, S, h = chunk_kda(*args5(x), initial_state=x["initial_state"], output_final_state=True, cu_seqlens=cu,
                            return_intermediate_states=True, chunk_size=C)
        ref_o, ref_S = chunk_kda(*args5(x), initial_state=x["initial_state"], output_final_state=True, cu_seqlens=cu)
        assert rel_err(o, ref_o) < 1e-6 and rel_err(S, ref_S) < 1e-6
        want = []
        rows = [(b, 0, 150) for b in range(2)] if seqs is None else [(0, a, e) for a, e in seqs]
        for n, (b, a, e) in enumerate(rows):
            for c in range(-(-(e - a) // C)):
                if c == 0:
                    want.append(x["initial_state"][n])
                    continue
                part = {key: x[key][b : b + 1, a : a + C * c] for key in ("q", "k", "v", "g", "beta")}
                want.append(chunk_kda(*args5(part), initial_state=x["initial_state"][n : n + 1],
                                      output_final_state=True)[1][0])
    want = torch.stack(want).view(1 if varlen else 2, -1, 2, 16, 8)
    assert h.shape == want.shape and rel_err(h, want) < (1e-10 if C == 64 else 1e-6)


def test_out_and_fla_positional_order():
    """fused_recurrent_kda(q, k, v, g, beta, A_log, dt_bias, scale, ...) as fla orders them; ``out`` receives o."""
    x = make_inputs(B=2, T=3, H=2, K=16, V=8, seed=8, raw=True)
    A_log, dt_bias = torch.randn(2, dtype=torch.float32), torch.randn(32, dtype=torch.float32)
    ref = fused_recurrent_kda(*args5(x), scale=0.3, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)[0]
    out = torch.empty_like(x["v"])
    got, _ = fused_recurrent_kda(*args5(x), A_log, dt_bias, 0.3, None, False, False, True, out=out)
    assert got is out and torch.equal(out, ref)


@pytest.mark.parametrize("varlen", [False, True])
def test_speculative_decoding_over_a_pool(varlen):
    """ssm_state_indices [N, T] with num_accepted_tokens: sequence n starts from row idx[n, a-1] and the state after
    each of its tokens t lands in row idx[n, t]; the same as running the tokens one by one by hand."""
    N, T = 3, 4
    if varlen:
        lens = [4, 2, 3]
        x = make_inputs(B=1, T=sum(lens), H=2, K=16, V=8, N=N, seed=9)
        cu = torch.tensor([0, 4, 6, 9])
        starts = [0, 4, 6]
    else:
        lens = [T] * N
        x = make_inputs(B=N, T=T, H=2, K=16, V=8, seed=9)
        cu, starts = None, [n * T for n in range(N)]
    pool = torch.randn(16, 2, 16, 8, dtype=torch.float32)
    idx = torch.tensor([[1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]])
    accepted = torch.tensor([2, 1, 3])
    ref_pool = pool.clone()
    flat = {key: x[key].reshape(-1, *x[key].shape[2:]) for key in ("q", "k", "v", "g", "beta")}
    ref_o = torch.empty_like(flat["v"])
    for n in range(N):
        S = ref_pool[idx[n, accepted[n] - 1]][None].clone()
        for t in range(lens[n]):
            p = starts[n] + t
            o_t, S = fused_recurrent_kda(*(flat[key][p : p + 1][None] for key in ("q", "k", "v", "g", "beta")),
                                         initial_state=S, output_final_state=True)
            ref_o[p] = o_t[0, 0]
            ref_pool[idx[n, t]] = S[0]
    o, ret = fused_recurrent_kda(*args5(x), initial_state=pool, cu_seqlens=cu, ssm_state_indices=idx,
                                 num_accepted_tokens=accepted)
    assert ret is pool and rel_err(o.reshape(-1, 2, 8), ref_o) < 1e-6 and rel_err(pool, ref_pool) < 1e-6
    # Not in place: the pool is untouched and the final states come back.
    pool2 = torch.randn(16, 2, 16, 8, dtype=torch.float32)
    before = pool2.clone()
    _, finals = fused_recurrent_kda(*args5(x), initial_state=pool2, cu_seqlens=cu, ssm_state_indices=idx,
                                    num_accepted_tokens=accepted, inplace_final_state=False)
    assert torch.equal(pool2, before) and finals.shape == (N, 2, 16, 8)


def test_one_token_continuous_batching_with_1d_indices():
    x = make_inputs(B=3, T=1, H=2, K=16, V=8, seed=10)
    pool = torch.randn(8, 2, 16, 8, dtype=torch.float32)
    ref_pool = pool.clone()
    slots = torch.tensor([6, 1, 3])
    ref_o, _ = fused_recurrent_kda(*args5(x), initial_state=ref_pool, state_indices=slots)
    o, ret = fused_recurrent_kda(*args5(x), initial_state=pool, ssm_state_indices=slots)
    assert ret is pool and rel_err(o, ref_o) < 1e-6 and rel_err(pool, ref_pool) < 1e-6
    x2 = make_inputs(B=3, T=2, H=2, K=16, V=8, seed=11)
    with pytest.raises(ValueError, match="`ssm_state_indices`"):
        fused_recurrent_kda(*args5(x2), initial_state=pool, ssm_state_indices=slots)


@pytest.mark.parametrize("rows", ["ssm_state_indices", "identity"])
def test_fused_recurrent_kda_fwd_updates_the_pool(rows):
    """fla's fused_recurrent_kda_fwd: in place by default, into rows ssm_state_indices or, without them, row n for
    sequence n; the pool is returned."""
    x = make_inputs(B=3, T=1, H=2, K=16, V=8, seed=12, raw=True)
    A_log, dt_bias = torch.randn(2), torch.randn(32)
    opts = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True, lower_bound=-5.0)
    slots = torch.tensor([5, 0, 2]) if rows == "ssm_state_indices" else torch.arange(3)
    pool = torch.randn(6 if rows == "ssm_state_indices" else 3, 2, 16, 8)
    ref_pool = pool.clone()
    ref_o, _ = fused_recurrent_kda(*args5(x), initial_state=ref_pool, state_indices=slots, **opts)
    kw = dict(ssm_state_indices=slots) if rows == "ssm_state_indices" else {}
    o, ret = fused_recurrent_kda_fwd(*args5(x), initial_state=pool, **kw, **opts)
    assert ret is pool and torch.equal(o, ref_o) and torch.equal(pool, ref_pool)
    # not in place: new final states, the pool untouched
    pool2 = torch.randn(3, 2, 16, 8)
    before = pool2.clone()
    _, final = fused_recurrent_kda_fwd(*args5(x), initial_state=pool2, inplace_final_state=False,
                                       output_final_state=True, **opts)
    ref = fused_recurrent_kda(*args5(x), initial_state=before, output_final_state=True, **opts)[1]
    assert torch.equal(pool2, before) and torch.equal(final, ref)
