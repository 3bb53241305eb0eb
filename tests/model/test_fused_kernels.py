"""The whole model with the small fused kernels a GPU runs (RMSNorm, residual add + RMSNorm and on decode steps the
output projection folded into it, MLA's normed cache-entry write, the in-place decode short conv, the decode step's
paged-pool rows, the MoE router's logits; Triton's interpreter here) gives the PyTorch path's tokens and logits
through ``generate``'s fixed-shape decode path: every RMSNorm user (decoder layers, final norm, MLA's q / kv norms,
K3's latent MoE norm and depth mixes), and training keeps the PyTorch path (gradients unchanged, no kernel call)."""

from __future__ import annotations

import pytest
import torch

import kimi_linear.ops.conv as conv_op
import kimi_linear.ops.moe as moe_op
import kimi_linear.ops.paged as paged_op
import kimi_linear.ops.rms_norm as rms_op
from kimi_linear import KimiLinearForCausalLM

from .helpers import make_config, randomize, rel_err, tokens


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """Dispatch the three ops to their Triton kernels for CPU tensors (on a GPU the dispatch is by device); the
    list records which ran."""
    pytest.importorskip("triton")
    from kimi_linear.ops import triton as tri

    calls: list[str] = []

    def pick(name, x):
        kernel = getattr(tri, name)
        return lambda *args: calls.append(name) or kernel(*args)

    monkeypatch.setattr(rms_op, "triton_op", pick)
    monkeypatch.setattr(conv_op, "triton_op", lambda name, x: pick(name, x) if name == "short_conv_decode" else None)
    monkeypatch.setattr(paged_op, "triton_op", pick)
    monkeypatch.setattr(moe_op, "triton_op", lambda name, x: pick(name, x) if name == "router_logits" else None)
    return calls


def run(m: KimiLinearForCausalLM):
    prompts = [tokens(1, n, seed=80 + n)[0] % m.config.vocab_size for n in (5, 11)]
    batch = torch.zeros(2, 11, dtype=torch.long)
    mask = torch.zeros(2, 11, dtype=torch.long)
    for r, p in enumerate(prompts):
        batch[r, 11 - len(p):], mask[r, 11 - len(p):] = p, 1
    out, logits = m.generate(batch, attention_mask=mask, max_new_tokens=6, return_logits=True, cuda_graphs=True)
    return out, torch.stack(logits).float()


@pytest.mark.parametrize("k3", [False, True])
def test_generate_with_fused_kernels_equals_torch_path(k3, request, monkeypatch):
    monkeypatch.setenv("KIMI_LINEAR_NATIVE", "0")     # the CPU decode kernels off: Triton against PyTorch ops
    if k3:
        from kimi_linear.model import preset_config

        torch.manual_seed(0)
        m = KimiLinearForCausalLM(preset_config("k3-tiny")).init_weights(0).eval()
    else:
        m = randomize(KimiLinearForCausalLM(make_config("KKM", q_lora_rank=24)), seed=12).eval()
    ref = run(m)
    calls = request.getfixturevalue("kernels_on_cpu")
    got = run(m)
    # K3's block AttnRes replaces the residual adds by depth mixes: no add + norm there
    assert set(calls) == {"rms_norm", "rms_norm_write", "short_conv_decode", "paged_decode_rows",
                          "router_logits"} | (set() if k3 else {"add_rms_norm", "project_add_rms_norm"})
    assert torch.equal(got[0], ref[0])
    assert rel_err(got[1], ref[1]) < 1e-5


def test_training_keeps_the_torch_path(kernels_on_cpu):
    m = randomize(KimiLinearForCausalLM(make_config("KM", moe=False)), seed=13)
    ids = tokens(2, 9, seed=14)

    def grads():
        m.zero_grad()
        m(ids).logits.square().mean().backward()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    g = grads()
    assert kernels_on_cpu == []
    assert g.keys() == {n for n, _ in m.named_parameters()}
    assert all(v.abs().sum() > 0 for n, v in g.items() if "norm" in n)
