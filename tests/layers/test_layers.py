"""Each layer against a direct float64 transcription of docs/model.md §3-5, plus its decode and packing paths."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from kimi_linear.layers import KimiDeltaAttention, NoPEMLA, RMSNorm, SparseMoE, SwiGLUMLP
from kimi_linear.ops import naive_recurrent_kda


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@torch.no_grad()
def randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        r = torch.randn(t.shape, generator=gen, dtype=torch.float64)
        if name.endswith("A_log"):
            v = torch.empty(t.shape, dtype=torch.float64).uniform_(0.0, 2.5, generator=gen).log()
        elif name.endswith("dt_bias"):
            v = r * 0.5 - 2.0
        elif "norm" in name:
            v = 1.0 + 0.2 * r
        elif t.ndim == 2:
            v = r / t.shape[-1] ** 0.5
        else:
            v = r * 0.3
        t.copy_(v.to(t.dtype))
    return module


def kda_reference(m: KimiDeltaAttention, x: torch.Tensor) -> torch.Tensor:
    """The KDA block (docs/model.md §3) step by step, float64, straight from the parameters."""
    x = x.double()
    B, T, _ = x.shape
    H, d, W = m.num_heads, m.head_dim, m.conv_size
    p = {n: t.double() for n, t in m.named_parameters()}

    def conv(y, w):  # causal depthwise: out_t = sum_j w[j] * y_{t - (W-1) + j}
        yp = F.pad(y, (0, 0, W - 1, 0))
        return F.silu(sum(yp[:, j : j + T] * w[:, 0, j] for j in range(W)))

    q = conv(x @ p["q_proj.weight"].T, p["q_conv1d.weight"]).view(B, T, H, d)
    k = conv(x @ p["k_proj.weight"].T, p["k_conv1d.weight"]).view(B, T, H, d)
    v = conv(x @ p["v_proj.weight"].T, p["v_conv1d.weight"]).view(B, T, H, d)
    f = (x @ p["f_a_proj.weight"].T @ p["f_b_proj.weight"].T + p["dt_bias"]).view(B, T, H, d)
    g = -p["A_log"].view(H, 1).exp() * F.softplus(f)
    beta = torch.sigmoid(x @ p["b_proj.weight"].T)
    q, k = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt(), k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    o, _ = naive_recurrent_kda(q, k, v, g, beta, scale=d**-0.5)
    gate = (x @ p["g_a_proj.weight"].T @ p["g_b_proj.weight"].T).view(B, T, H, d)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + m.o_norm.eps) * p["o_norm.weight"] * torch.sigmoid(gate)
    return o.reshape(B, T, H * d) @ p["o_proj.weight"].T


@pytest.fixture
def kda() -> KimiDeltaAttention:
    return randomize(KimiDeltaAttention(hidden_size=48, num_heads=3, head_dim=16, conv_size=4), seed=1).eval()


def test_kda_layer_matches_spec(kda):
    x = torch.randn(2, 75, 48, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel_err(kda(x), kda_reference(kda, x)) < 1e-5


def test_kda_step_by_step_equals_prefill_and_state_is_fixed(kda):
    """Prefill 70 tokens (two chunks) then 10 single-token steps == one pass over 80 tokens."""
    x = torch.randn(2, 80, 48, generator=torch.Generator().manual_seed(3))
    state = kda.empty_state(2, torch.float32, torch.device("cpu"))
    size = state.nbytes()
    with torch.no_grad():
        parts = [kda(x[:, :70], state)] + [kda(x[:, t : t + 1], state) for t in range(70, 80)]
        full = kda(x)
    assert rel_err(torch.cat(parts, 1), full) < 1e-5
    assert state.nbytes() == size and state.recurrent.shape == (2, 3, 16, 16)


def test_kda_left_padding_is_exact(kda):
    x = torch.randn(1, 20, 48, generator=torch.Generator().manual_seed(4))
    padded = torch.cat([torch.randn(1, 7, 48), x], 1)  # garbage in the padding slots must not matter
    mask = torch.cat([torch.zeros(1, 7), torch.ones(1, 20)], 1)
    with torch.no_grad():
        assert rel_err(kda(padded, padding_mask=mask)[:, 7:], kda(x)) < 1e-5


def test_packed_projections_equal_separate_and_train(kda):
    """Packed (inference) and separate (autograd) paths give the same output; gradients reach every weight."""
    x = torch.randn(1, 9, 48, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        separate = kda(x)
    kda.pack()
    assert kda._pack is not None and kda.q_proj.weight.data_ptr() == kda._pack.weight.data_ptr()
    with torch.no_grad():
        assert kda._pack.valid()
        assert rel_err(kda(x), separate) < 1e-6
    out = kda(x)
    assert not kda._pack.valid()  # grad mode: the parameters themselves are used
    out.square().sum().backward()
    for name, p in kda.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_kda_layer_with_triton_conv_and_norm(kda, monkeypatch):
    """The layer with its short conv and gated norm dispatched to the Triton kernels (run here under the
    interpreter; on a GPU the dispatch is by device) against the PyTorch path: a prefill with state, single-token
    steps through the conv window, packed documents, and the gradients of every weight."""
    import kimi_linear.ops.conv as conv_op
    import kimi_linear.ops.norm as norm_op
    from kimi_linear.ops.triton.conv import short_conv as tri_conv
    from kimi_linear.ops.triton.norm import gated_rms_norm as tri_norm

    pytest.importorskip("triton")
    monkeypatch.setenv("KIMI_LINEAR_NATIVE", "0")      # decode tokens through the conv op, not the C kernel
    x = torch.randn(2, 40, 48, generator=torch.Generator().manual_seed(6))
    packed = torch.randn(1, 40, 48, generator=torch.Generator().manual_seed(7))
    cu = torch.tensor([0, 3, 25, 40])

    def run():
        state = kda.empty_state(2, torch.float32, torch.device("cpu"))
        with torch.no_grad():
            steps = torch.cat([kda(x[:, :35], state)] + [kda(x[:, t:t + 1], state) for t in range(35, 40)], 1)
        kda.zero_grad()
        kda(packed, cu_seqlens=cu).square().sum().backward()
        return steps, state.conv.clone(), {n: p.grad.clone() for n, p in kda.named_parameters()}

    ref = run()
    monkeypatch.setattr(conv_op, "triton_op", lambda name, x: tri_conv)
    monkeypatch.setattr(norm_op, "triton_op", lambda name, x: tri_norm)
    got = run()
    assert rel_err(got[0], ref[0]) < 1e-5
    assert torch.equal(got[1], ref[1])
    for n, g in ref[2].items():
        assert rel_err(got[2][n], g) < 1e-4, n



def test_kda_pooled_decode_with_triton_conv_decode(kda, monkeypatch):
    """Decode steps on a pool of states (PooledKDAState, as the fixed-shape decode step runs them): with the
    conv's gather / conv / write-back dispatched to the one decode kernel (interpreter) they give the PyTorch
    path's outputs and pool rows; rows in shuffled slots, two padding rows on one scratch slot."""
    import kimi_linear.ops.conv as conv_op
    from kimi_linear.layers import PooledKDAState
    from kimi_linear.ops.triton.conv import short_conv_decode as tri_decode

    pytest.importorskip("triton")
    monkeypatch.setenv("KIMI_LINEAR_NATIVE", "0")      # decode tokens through the conv op, not the C kernel
    x = torch.randn(3, 12, 48, generator=torch.Generator().manual_seed(8))
    index = torch.tensor([4, 1, 0, 5, 5])                   # rows 0-2 live, rows 3-4 padding on scratch slot 5
    xs = torch.cat([x, torch.randn(2, 12, 48)], 0)

    def run():
        prefill = kda.empty_state(3, torch.float32, torch.device("cpu"))
        pool = kda.empty_state(6, torch.float32, torch.device("cpu"))
        with torch.no_grad():
            kda(x[:, :8], prefill)
            pool.conv[index[:3]], pool.recurrent[index[:3]] = prefill.conv, prefill.recurrent
            state = PooledKDAState(pool.conv, pool.recurrent, index)
            out = torch.cat([kda(xs[:, t:t + 1], state) for t in range(8, 12)], 1)
        return out[:3], pool.conv[:5].clone(), pool.recurrent[:5].clone()

    ref = run()
    monkeypatch.setattr(conv_op, "triton_op", lambda name, x: tri_decode if name == "short_conv_decode" else None)
    got = run()
    assert rel_err(got[0], ref[0]) < 1e-5
    assert torch.equal(got[1], ref[1]) and rel_err(got[2], ref[2]) < 1e-5
    with torch.no_grad():                                   # and the pooled steps continue the prefill exactly
        assert rel_err(got[0], kda(x)[:, 8:]) < 1e-5


def test_rmsnorm_formula():
    m = randomize(RMSNorm(32, eps=1e-5), seed=6)
    x = torch.randn(4, 32)
    want = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * m.weight.double()
    assert rel_err(m(x), want) < 1e-6


def mla_reference(m: NoPEMLA, x: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention with keys [k_nope | k_rope], k_rope shared by all heads and never rotated."""
    x = x.double()
    B, T, _ = x.shape
    H, n, r, vd, C = m.num_heads, m.nope, m.rope, m.v_dim, m.kv_lora_rank
    p = {k: t.double() for k, t in m.named_parameters()}
    q = (x @ p["q_proj.weight"].T).view(B, T, H, n + r)
    c = x @ p["kv_a_proj_with_mqa.weight"].T
    lat = c[..., :C]
    lat = lat * torch.rsqrt(lat.pow(2).mean(-1, keepdim=True) + 1e-6) * p["kv_a_layernorm.weight"]
    kv = (lat @ p["kv_b_proj.weight"].T).view(B, T, H, n + vd)
    k = torch.cat([kv[..., :n], c[..., None, C:].expand(B, T, H, r)], -1)
    s = torch.einsum("bthe,bshe->bhts", q, k) * (n + r) ** -0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("bhts,bshv->bthv", s.softmax(-1), kv[..., n:])
    return o.reshape(B, T, H * vd) @ p["o_proj.weight"].T


def test_mla_prefill_and_absorbed_decode_match_spec():
    m = randomize(NoPEMLA(48, num_heads=3, kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4,
                          v_head_dim=6), seed=7).eval()
    x = torch.randn(2, 30, 48, generator=torch.Generator().manual_seed(8))
    want = mla_reference(m, x)
    cache = m.empty_cache(2, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        assert rel_err(m(x), want) < 1e-5
        parts = [m(x[:, :20], cache)] + [m(x[:, t : t + 1], cache) for t in range(20, 30)]
    assert rel_err(torch.cat(parts, 1), want) < 1e-5
    assert cache.length == 30 and cache.nbytes() == 2 * 30 * (24 + 4) * 4


@pytest.mark.parametrize("q_lora_rank, output_gate, bias", [(None, False, False), (16, True, False),
                                                             (16, False, True)])
def test_mla_packed_projections_equal_separate_and_train(q_lora_rank, output_gate, bias):
    """The projections that read x packed into one matrix (q or q_a, kv_a, K3's output gate) give the separate
    ones' outputs, prefill and decode; under autograd the parameters themselves run and every one gets a gradient.
    With biases (``attention_bias``) nothing is packed."""
    m = randomize(NoPEMLA(48, num_heads=3, kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                          q_lora_rank=q_lora_rank, bias=bias, output_gate=output_gate), seed=11).eval()
    x = torch.randn(2, 9, 48, generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        cache = m.empty_cache(2, torch.float32, torch.device("cpu"))
        separate = torch.cat([m(x[:, :6], cache), m(x[:, 6:7], cache)], 1)
    m.pack()
    assert (m._pack is None) == bias
    with torch.no_grad():
        cache = m.empty_cache(2, torch.float32, torch.device("cpu"))
        packed = torch.cat([m(x[:, :6], cache), m(x[:, 6:7], cache)], 1)
    assert rel_err(packed, separate) < 1e-6
    m(x).square().sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def moe_reference(m: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, docs/model.md §5: choose with the bias, weight without it, renormalise (when the router
    does), scale; plus the shared experts (when there are). Float64 copies of the experts."""
    g = m.gate
    out = []
    for t in x.double():
        s = torch.sigmoid(g.weight.double() @ t)
        chosen = (s + g.e_score_correction_bias.double()).topk(g.top_k).indices
        w = s[chosen] / (s[chosen].sum() if g.renormalize else 1.0) * g.routed_scaling_factor
        y = sum(wi * copy.deepcopy(m.experts[e]).double()(t) for wi, e in zip(w, chosen.tolist()))
        if m.shared_experts is not None:
            y = y + copy.deepcopy(m.shared_experts).double()(t)
        out.append(y)
    return torch.stack(out)


def test_moe_matches_per_token_reference():
    m = randomize(SparseMoE(32, 16, num_experts=6, top_k=2, num_shared_experts=1, routed_scaling_factor=2.5), 9)
    with torch.no_grad():
        m.gate.e_score_correction_bias.copy_(torch.randn(6) * 0.3)  # large enough to change choices
        x = torch.randn(40, 32, generator=torch.Generator().manual_seed(10))
        got = m(x)
        for mod in m.modules():
            if hasattr(mod, "_pack"):
                mod._pack = None
        assert rel_err(got, moe_reference(m, x)) < 1e-5
        # single-token path (decode) agrees with the batched dispatch
        assert rel_err(torch.cat([m(x[i : i + 1]) for i in range(5)]), got[:5]) < 1e-6


def test_router_group_limit_and_bias():
    from kimi_linear.layers import SigmoidTopKRouter

    r = SigmoidTopKRouter(8, num_experts=8, top_k=2, n_group=4, topk_group=1)
    with torch.no_grad():
        r.weight.zero_()
        r.e_score_correction_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.4]))
    w, idx = r(torch.randn(3, 8))
    assert sorted(idx[0].tolist()) == [6, 7]                 # the biased group wins
    assert torch.allclose(w, torch.full_like(w, 0.5))         # weights ignore the bias: sigmoid(0)=0.5, renormed
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        SigmoidTopKRouter(8, num_experts=2, top_k=3)


def test_swiglu():
    m = randomize(SwiGLUMLP(16, 24), seed=11)
    x = torch.randn(3, 16)
    want = (F.silu(x.double() @ m.gate_proj.weight.double().T) * (x.double() @ m.up_proj.weight.double().T)
            ) @ m.down_proj.weight.double().T
    assert rel_err(m(x), want) < 1e-6
