"""Each K3 piece against its formula written plainly in float64 (docs/model.md §7)."""

from __future__ import annotations

import math

import pytest
import torch

from kimi_linear.layers import KimiDeltaAttention, NoPEMLA, SiTUGLU, SparseMoE
from kimi_linear.layers.moe import Expert
from tests.model.helpers import randomize


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


# ------------------------------------------------------------------------------------------------------- SiTU
def situ_ref(gate: torch.Tensor, up: torch.Tensor, b: float, b_lin: float) -> torch.Tensor:
    g, u = gate.double(), up.double()
    return (b * torch.tanh(g / b) * (1 / (1 + torch.exp(-g)))) * (b_lin * torch.tanh(u / b_lin))


@pytest.mark.parametrize("b,b_lin", [(4.0, 25.0), (1.5, 7.0)])
def test_situ_matches_its_formula(b, b_lin):
    """Over a range that reaches both soft caps (|gate| >> b, |up| >> b_lin), in float32 and bfloat16."""
    g = torch.Generator().manual_seed(int(b * 10))
    gate, up = torch.randn(4096, generator=g) * 30, torch.randn(4096, generator=g) * 60
    act = SiTUGLU(b, b_lin)
    ref = situ_ref(gate, up, b, b_lin)
    out = act(gate, up)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert ref.abs().max() > 0.9 * b * b_lin  # the caps were reached
    # bf16 inputs: computed in float32 from the bf16 values, rounded once at the end
    gb, ub = gate.bfloat16(), up.bfloat16()
    outb = act(gb, ub)
    assert outb.dtype == torch.bfloat16
    torch.testing.assert_close(outb.float(), situ_ref(gb, ub, b, b_lin).bfloat16().float(), rtol=8e-3, atol=1e-30)


def test_expert_with_situ_is_the_glu_formula():
    e = randomize(Expert(24, 40, SiTUGLU(4.0, 25.0)).double(), seed=1)
    x = torch.randn(7, 24, dtype=torch.float64, generator=gen(2)) * 3
    ref = situ_ref(x @ e.w1.weight.T, x @ e.w3.weight.T, 4.0, 25.0) @ e.w2.weight.T
    torch.testing.assert_close(e(x), ref, rtol=1e-12, atol=1e-12)
    silu = (torch.nn.functional.silu(x @ e.w1.weight.T) * (x @ e.w3.weight.T)) @ e.w2.weight.T
    assert (ref - silu).abs().max() > 1e-3  # SiTU is not SiLU


# ----------------------------------------------------------------------------------------- KDA gate switches
def kda_ref(layer: KimiDeltaAttention, x: torch.Tensor) -> torch.Tensor:
    """The KDA block (docs/model.md §3) in float64, one token at a time, with the K3 gate options."""
    B, T, _ = x.shape
    H, d, W = layer.num_heads, layer.head_dim, layer.conv_size
    x = x.double()

    def conv(proj, convw):
        y = x @ proj.weight.double().T                                               # [B, T, H*d]
        w = convw.weight.double()[:, 0]                                              # [H*d, W]
        pad = torch.cat([y.new_zeros(B, W - 1, y.shape[-1]), y], 1)
        out = sum(pad[:, j : j + T] * w[:, j] for j in range(W))
        return torch.nn.functional.silu(out).view(B, T, H, d)

    q, k, v = conv(layer.q_proj, layer.q_conv1d), conv(layer.k_proj, layer.k_conv1d), conv(layer.v_proj, layer.v_conv1d)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    raw = (x @ layer.f_a_proj.weight.double().T @ layer.f_b_proj.weight.double().T).view(B, T, H, d)
    raw = raw + layer.dt_bias.double().view(H, d)
    a = layer.A_log.double().view(H, 1).exp()
    if layer.gate_lower_bound is None:
        g = -a * torch.log1p(torch.exp(raw))
    else:
        g = layer.gate_lower_bound / (1 + torch.exp(-a * raw))
    beta = 1 / (1 + torch.exp(-(x @ layer.b_proj.weight.double().T)))               # [B, T, H]
    S = x.new_zeros(B, H, d, d)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None]
        kt, vt = k[:, t], v[:, t]
        pred = torch.einsum("bhk,bhkv->bhv", kt, S)
        S = S + beta[:, t, :, None, None] * kt[..., None] * (vt - pred)[:, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S) * d**-0.5)
    o = torch.stack(outs, 1)                                                         # [B, T, H, d]
    if layer.full_rank_gate:
        gate = x @ layer.g_proj.weight.double().T
    else:
        gate = x @ layer.g_a_proj.weight.double().T @ layer.g_b_proj.weight.double().T
    gate = gate.view(B, T, H, d)
    o = rms(o, layer.o_norm.weight.double(), layer.o_norm.eps) / (1 + torch.exp(-gate))
    return o.reshape(B, T, H * d) @ layer.o_proj.weight.double().T


@pytest.mark.parametrize("lower_bound,full_rank", [(-5.0, False), (-5.0, True), (-2.0, True), (None, True)])
def test_kda_gate_options_match_the_formula(lower_bound, full_rank):
    """Bounded gate ``lb * sigmoid(exp(A_log) * (g + dt_bias))`` and the full-rank output gate, in the layer.

    The layer runs in float64, but the operators (kimi_linear.ops) form the gate and the memory in float32, so the
    agreement is to ~1e-7; the other gate formula is checked to miss by orders of magnitude more."""
    layer = KimiDeltaAttention(32, 2, 16, gate_lower_bound=lower_bound, full_rank_gate=full_rank)
    layer = randomize(layer, seed=4).double()
    x = torch.randn(2, 19, 32, dtype=torch.float64, generator=gen(5))
    ref = kda_ref(layer, x)
    torch.testing.assert_close(layer(x), ref, rtol=1e-5, atol=2e-6)
    # The decode path (conv window + recurrent state, one token a step) agrees too.
    state = layer.empty_state(2, torch.float64, x.device)
    steps = torch.cat([layer(x[:, t : t + 1], state) for t in range(x.shape[1])], 1)
    torch.testing.assert_close(steps, ref, rtol=1e-5, atol=2e-6)
    layer.gate_lower_bound = -3.0 if lower_bound is None else None  # the reference with the other gate formula
    assert (kda_ref(layer, x) - ref).abs().max() > 1e-3
    assert hasattr(layer, "g_proj") == full_rank and hasattr(layer, "g_a_proj") == (not full_rank)


def test_bounded_gate_differs_from_the_softplus_gate_and_bounds_the_decay():
    layer = randomize(KimiDeltaAttention(32, 2, 16, gate_lower_bound=-5.0), seed=6).double()
    x = torch.randn(1, 9, 32, dtype=torch.float64, generator=gen(7))
    with torch.no_grad():
        layer.dt_bias.fill_(30.0)  # a huge pre-activation: softplus would give a decay far below exp(-5)
    g_raw, _, args = layer.gates(x @ layer.f_a_proj.weight.T, x @ layer.g_a_proj.weight.T)
    assert args["lower_bound"] == -5.0
    from kimi_linear.ops import fused_kda_gate

    g = fused_kda_gate(g_raw, args["A_log"], args["dt_bias"], args["lower_bound"])
    assert g.min() >= -5.0 and g.min() < -4.9
    unbounded = KimiDeltaAttention(32, 2, 16).double()
    unbounded.load_state_dict(layer.state_dict())
    assert (unbounded(x) - layer(x)).abs().max() > 1e-3


# ------------------------------------------------------------------------------------------------ gated MLA
def test_gated_mla_matches_the_formula():
    """``o_proj(attention(x) * sigmoid(g_proj(x)))``, causal NoPE attention written out in float64."""
    m = randomize(NoPEMLA(32, 2, 16, 8, 4, 8, output_gate=True), seed=8).double()
    B, T, H = 2, 11, 2
    x = torch.randn(B, T, 32, dtype=torch.float64, generator=gen(9))
    q = (x @ m.q_proj.weight.T).view(B, T, H, 12)
    c = x @ m.kv_a_proj_with_mqa.weight.T
    latent, k_rope = rms(c[..., :16], m.kv_a_layernorm.weight, m.kv_a_layernorm.eps), c[..., 16:]
    kv = (latent @ m.kv_b_proj.weight.T).view(B, T, H, 16)
    k = torch.cat([kv[..., :8], k_rope[:, :, None].expand(B, T, H, 4)], -1)
    v = kv[..., 8:]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(12)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v).reshape(B, T, H * 8)
    ref = (o / (1 + torch.exp(-(x @ m.g_proj.weight.T)))) @ m.o_proj.weight.T
    torch.testing.assert_close(m(x), ref, rtol=1e-10, atol=1e-10)
    cache = m.empty_cache(B, torch.float64, x.device)
    steps = torch.cat([m(x[:, t : t + 1], cache) for t in range(T)], 1)
    torch.testing.assert_close(steps, ref, rtol=1e-10, atol=1e-10)
    assert (o @ m.o_proj.weight.T - ref).abs().max() > 1e-3  # the gate matters


# ------------------------------------------------------------------------------------------------- LatentMoE
def latent_moe_ref(moe: SparseMoE, x: torch.Tensor, act) -> torch.Tensor:
    """Loop over tokens and their chosen experts, float64."""
    out = []
    for xt in x.double():
        s = 1 / (1 + torch.exp(-(moe.gate.weight.double() @ xt)))
        idx = (s + moe.gate.e_score_correction_bias.double()).topk(moe.gate.top_k).indices
        w = s[idx] / s[idx].sum() * moe.gate.routed_scaling_factor
        z = moe.routed_expert_down_proj.weight.double() @ xt
        acc = torch.zeros_like(z)
        for e, we in zip(idx.tolist(), w):
            ex = moe.experts[e]
            acc = acc + we * (ex.w2.weight.double() @ act(ex.w1.weight.double() @ z, ex.w3.weight.double() @ z))
        if moe.routed_expert_norm is not None:
            acc = rms(acc, moe.routed_expert_norm.weight.double(), moe.routed_expert_norm.eps)
        y = moe.routed_expert_up_proj.weight.double() @ acc
        sh = moe.shared_experts
        y = y + sh.down_proj.weight.double() @ act(sh.gate_proj.weight.double() @ xt, sh.up_proj.weight.double() @ xt)
        out.append(y)
    return torch.stack(out)


@pytest.mark.parametrize("latent_norm,situ", [(True, True), (False, False), (True, False)])
def test_latent_moe_matches_a_loop_over_experts(latent_norm, situ):
    def silu_glu(a, b):
        return torch.nn.functional.silu(a) * b

    act = (lambda a, b: situ_ref(a, b, 4.0, 25.0)) if situ else silu_glu
    glu = SiTUGLU(4.0, 25.0) if situ else silu_glu
    moe = SparseMoE(32, 20, 6, 2, num_shared_experts=2, routed_scaling_factor=1.7, glu=glu, latent_size=12,
                    latent_norm=latent_norm, eps=1e-5)
    moe = randomize(moe, seed=10).double()
    assert moe.routed_expert_down_proj.weight.shape == (12, 32) and moe.experts[0].w1.weight.shape == (20, 12)
    assert moe.shared_experts.gate_proj.weight.shape == (40, 32)  # shared experts stay full width
    x = torch.randn(37, 32, dtype=torch.float64, generator=gen(11)) * 2
    ref = latent_moe_ref(moe, x, act)
    torch.testing.assert_close(moe(x), ref, rtol=1e-10, atol=1e-10)          # many tokens: dispatch path
    torch.testing.assert_close(moe(x[3:4]), ref[3:4], rtol=1e-10, atol=1e-10)  # one token: decode path
    assert len(set(moe.gate(x)[1].flatten().tolist())) == 6           # every expert was exercised
