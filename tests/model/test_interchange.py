"""Same weights, same logits: checkpoints move both ways between ours and transformers' KimiLinearForCausalLM."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from transformers import KimiLinearForCausalLM as HFKimiLinear

from kimi_linear import KimiLinearForCausalLM

from .helpers import make_config, randomize, rel_err, tokens

# (layer kinds, MoE on, expert groups, q LoRA rank): several layouts, MoE on and off, grouped routing, q LoRA.
CASES = [
    ("KKKM", True, 1, None),
    ("MKKM", False, 1, None),
    ("KMKK", True, 2, None),
    ("KK", True, 1, None),
    ("MM", False, 1, 24),
]
IDS = ["kkkm-moe", "mkkm-dense", "kmkk-moe-grouped", "kda-only", "mla-only-qlora"]


def hf_logits(model: HFKimiLinear, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, use_cache=False).logits.float()


@pytest.mark.parametrize("kinds,moe,n_group,q_lora", CASES, ids=IDS)
def test_transformers_checkpoint_loads_into_ours(tmp_path, kinds, moe, n_group, q_lora):
    config = make_config(kinds, moe=moe, n_group=n_group, q_lora_rank=q_lora)
    hf = randomize(HFKimiLinear(config).eval(), seed=len(kinds) + n_group)
    hf.save_pretrained(tmp_path)
    ours = KimiLinearForCausalLM.from_pretrained(tmp_path)
    ids = tokens(2, 80, seed=3)  # longer than one 64-token chunk
    with torch.no_grad():
        got = ours(ids).logits
    assert rel_err(got, hf_logits(hf, ids)) < 1e-4


@pytest.mark.parametrize("kinds,moe,n_group,q_lora", CASES, ids=IDS)
def test_our_checkpoint_loads_into_transformers(tmp_path, kinds, moe, n_group, q_lora):
    config = make_config(kinds, moe=moe, n_group=n_group, q_lora_rank=q_lora)
    ours = randomize(KimiLinearForCausalLM(config), seed=7 + len(kinds)).eval()
    ours.save_pretrained(tmp_path)
    hf = HFKimiLinear.from_pretrained(tmp_path).eval()
    ids = tokens(2, 70, seed=4)
    with torch.no_grad():
        want = ours(ids).logits
    assert rel_err(hf_logits(hf, ids), want) < 1e-4


def test_saved_files_use_published_names(tmp_path):
    """On disk: the published names of docs/checkpoint.md §3 (dense FFN under `mlp.`, MoE under
    `block_sparse_moe.`, per-expert w1/w2/w3, separate q/k/v convs) and a config.json with the 1-indexed
    `linear_attn_config` lists."""
    ours = randomize(KimiLinearForCausalLM(make_config("KKKM")), seed=1)
    ours.save_pretrained(tmp_path)
    with safe_open(os.path.join(tmp_path, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_slice("model.layers.0.self_attn.q_conv1d.weight").get_shape() == [64, 1, 4]
        assert f.get_slice("model.layers.0.self_attn.A_log").get_shape() == [1, 1, 4, 1]
        assert f.get_slice("model.layers.0.self_attn.dt_bias").get_dtype() == "F32"
    for name in ["model.layers.0.mlp.gate_proj.weight", "model.layers.1.block_sparse_moe.experts.3.w2.weight",
                 "model.layers.1.block_sparse_moe.gate.e_score_correction_bias",
                 "model.layers.3.self_attn.kv_a_proj_with_mqa.weight", "lm_head.weight", "model.norm.weight"]:
        assert name in keys
    cfg = json.load(open(os.path.join(tmp_path, "config.json")))
    assert cfg["model_type"] == "kimi_linear"
    assert cfg["linear_attn_config"]["kda_layers"] == [1, 2, 3]
    assert cfg["linear_attn_config"]["full_attn_layers"] == [4]
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_round_trip(tmp_path, dtype):
    """bf16/fp16 checkpoints keep their dtype when asked (router and gate constants stay float32) and load
    bit-exactly; in half precision our logits are as close to the float32 result on the same weights as
    transformers' are. ``dtype="auto"`` (the default) computes a 16-bit checkpoint in float32 on a CPU."""
    ours = randomize(KimiLinearForCausalLM(make_config("KKKM", moe=False)), seed=2).cast(dtype).eval()
    ours.save_pretrained(tmp_path)
    assert KimiLinearForCausalLM.from_pretrained(tmp_path).dtype == torch.float32
    assert KimiLinearForCausalLM.from_pretrained(tmp_path, dtype="auto").dtype == torch.float32
    back = KimiLinearForCausalLM.from_pretrained(tmp_path, dtype=dtype)
    assert back.dtype == dtype
    assert back.model.layers[1].self_attn.dt_bias.dtype == torch.float32
    for (n, a), (_, b) in zip(ours.state_dict().items(), back.state_dict().items()):
        assert a.dtype == b.dtype and torch.equal(a, b), n
    ids = tokens(1, 20, seed=5)
    with torch.no_grad():
        half = back(ids).logits
        assert torch.equal(ours(ids).logits, half)
        ref = KimiLinearForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)(ids).logits
    hf = HFKimiLinear.from_pretrained(tmp_path, dtype=dtype).eval()
    err_hf = rel_err(hf_logits(hf, ids), ref)
    assert rel_err(half.float(), ref) <= 1.5 * err_hf + 0.02


def test_sharded_save_and_load(tmp_path):
    """Large checkpoints are split with an index; both ours and transformers read the shards; re-saving
    unsharded removes the stale shards."""
    ours = randomize(KimiLinearForCausalLM(make_config("KKKM")), seed=3).eval()
    ours.save_pretrained(tmp_path, max_shard_size="200KB")
    files = sorted(os.listdir(tmp_path))
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 2 and "model.safetensors.index.json" in files
    index = json.load(open(os.path.join(tmp_path, "model.safetensors.index.json")))
    assert set(index["weight_map"]) == set(ours.state_dict())
    ids = tokens(1, 30, seed=6)
    with torch.no_grad():
        want = ours(ids).logits
        assert torch.equal(KimiLinearForCausalLM.from_pretrained(tmp_path)(ids).logits, want)
    assert rel_err(hf_logits(HFKimiLinear.from_pretrained(tmp_path).eval(), ids), want) < 1e-4
    ours.save_pretrained(tmp_path)
    assert sorted(f for f in os.listdir(tmp_path) if "safetensors" in f) == ["model.safetensors"]
