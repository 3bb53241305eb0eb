"""Block AttnRes in the model against a direct softmax over the stored sublayer outputs (float64)."""

from __future__ import annotations

import pytest
import torch

from kimi_linear.model import KimiLinearForCausalLM
from tests.model.helpers import randomize, tokens

from .helpers import k3_config


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def mix(sources: list[torch.Tensor], q: torch.Tensor, norm_w: torch.Tensor, eps: float) -> torch.Tensor:
    """sum_s softmax_s(q . RMSNorm(v_s)) v_s, written out."""
    logits = torch.stack([(rms(v, norm_w, eps) * q).sum(-1) for v in sources])          # [S, B, T]
    w = torch.exp(logits - logits.max(0).values)
    w = w / w.sum(0)
    return sum(w[i, ..., None] * v for i, v in enumerate(sources))


@pytest.mark.parametrize("kinds,block", [("KKMKM", 2), ("KMKKM", 1), ("KKMKM", 3), ("KKMKM", 5)])
def test_block_attn_res_is_a_softmax_over_stored_outputs(kinds, block):
    """Record every sublayer's input (the mix) and output; rebuild each input from the embedding and the block
    sums of the recorded outputs: sources at sublayer s = [embedding] + [sum of outputs of block j, up to s)]."""
    model = randomize(KimiLinearForCausalLM(k3_config(kinds, attn_res_block_size=block)), seed=block).double()
    layers = model.model.layers
    n_sub = 2 * len(layers)
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(layers):
        ffn = layer.block_sparse_moe if layer.is_moe else layer.mlp
        for s, (norm, mod) in enumerate([(layer.input_layernorm, layer.self_attn),
                                         (layer.post_attention_layernorm, ffn)]):
            idx = 2 * i + s
            hooks.append(norm.register_forward_hook(lambda m, a, o, idx=idx: inputs.__setitem__(idx, a[0])))
            hooks.append(mod.register_forward_hook(lambda m, a, o, idx=idx: outputs.__setitem__(idx, o)))
    hooks.append(model.model.norm.register_forward_hook(lambda m, a, o: inputs.__setitem__(n_sub, a[0])))
    ids = tokens(2, 13, seed=block + 100)
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    emb = model.model.embed_tokens(ids)
    per_block = 2 * block
    eps = model.config.rms_norm_eps
    for s in range(n_sub + 1):
        sources = [emb] + [sum(outputs[t] for t in range(j * per_block, min((j + 1) * per_block, s)))
                           for j in range(-(-s // per_block))]
        if s == n_sub:
            q, w = model.model.output_attn_res_proj.weight[0], model.model.output_attn_res_norm.weight
        else:
            layer = layers[s // 2]
            res = ("attn", "mlp")[s % 2]
            q, w = getattr(layer, f"{res}_res_proj").weight[0], getattr(layer, f"{res}_res_norm").weight
        ref = mix(sources, q.detach(), w.detach(), eps)
        err = (inputs[s] - ref).abs().max().item()
        assert err < 1e-11 * max(1.0, ref.abs().max().item()), (s, err)
        # the plain residual stream (sum of everything) is a different input once there are several sources
        if len(sources) > 1:
            assert (inputs[s] - sum(sources)).abs().max() > 1e-2


def test_zero_queries_give_a_uniform_mix():
    """init_weights zeroes the pseudo-queries (as the paper does): every source then weighs 1/S."""
    model = KimiLinearForCausalLM(k3_config()).init_weights(seed=0)
    names = [n for n, _ in model.named_parameters() if n.endswith("res_proj.weight")]
    assert len(names) == 2 * 5 + 1
    assert all(float(p.detach().abs().max()) == 0 for n, p in model.named_parameters() if n.endswith("res_proj.weight"))
