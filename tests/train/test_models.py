"""The synthetic-task models: KDA, Gated DeltaNet (scalar gate) and softmax attention from one decoder."""

import pytest
import torch
import torch.nn.functional as F

from kimi_linear.layers.gdn import GatedDeltaNet
from kimi_linear.layers.kda import KimiDeltaAttention
from kimi_linear.train.models import build_task_model


@pytest.mark.parametrize("mixer", ["kda", "gdn", "attention"])
def test_task_models_decode_with_cache_like_full_forward(mixer):
    model = build_task_model(mixer, 50, hidden_size=64, num_heads=2, head_dim=32, seed=1).eval()
    kinds = {type(layer.self_attn).__name__ for layer in model.model.layers}
    assert kinds == {"kda": {"KimiDeltaAttention"}, "gdn": {"GatedDeltaNet"}, "attention": {"NoPEMLA"}}[mixer]
    ids = torch.randint(0, 50, (2, 70), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache(2)
        prefix = model(ids[:, :66], cache=cache).logits
        steps = [model(ids[:, t:t + 1], cache=cache).logits[:, 0] for t in range(66, 70)]
    assert torch.allclose(prefix, full[:, :66], atol=1e-5)
    assert torch.allclose(torch.stack(steps, 1), full[:, 66:], atol=1e-5)


def test_gdn_gate_is_one_scalar_per_head_and_step():
    layer = GatedDeltaNet(32, 2, 16)
    with torch.no_grad():
        layer.A_log.copy_(torch.tensor([0.3, -0.2]).view(1, 1, 2, 1))
        layer.dt_bias.copy_(torch.tensor([0.5, -1.0]))
    f_a, g_a = torch.randn(3, 5, 16), torch.randn(3, 5, 16)
    g, gate, args = layer.gates(f_a, g_a)
    assert args == {} and g.shape == (3, 5, 2, 16)
    assert torch.equal(gate, layer.g_b_proj(g_a).view(3, 5, 2, 16))               # KDA's output gate
    assert torch.equal(g, g[..., :1].expand_as(g))                                # same on every key channel
    expected = -torch.tensor([0.3, -0.2]).exp() * F.softplus(layer.f_b_proj(f_a) + torch.tensor([0.5, -1.0]))
    assert torch.allclose(g[..., 0], expected, atol=1e-6)
    assert isinstance(layer, KimiDeltaAttention)
