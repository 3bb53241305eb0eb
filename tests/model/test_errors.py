"""Bad input fails early with an error that names the tensor or field."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from kimi_linear import KimiLinearForCausalLM
from kimi_linear.model import config_from_dict, load_config

from .helpers import make_config, randomize, raw_config, tokens


@pytest.fixture
def checkpoint(tmp_path):
    randomize(KimiLinearForCausalLM(make_config("KKKM")), seed=1).save_pretrained(tmp_path)
    return tmp_path


def _edit_weights(path, fn):
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    fn(tensors)
    save_file(tensors, file)


def test_missing_tensor_is_named(checkpoint):
    _edit_weights(checkpoint, lambda t: t.pop("model.layers.2.self_attn.f_b_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor.*model\.layers\.2\.self_attn\.f_b_proj\.weight"):
        KimiLinearForCausalLM.from_pretrained(checkpoint)


def test_wrong_shape_is_named(checkpoint):
    def shrink(t):
        t["model.layers.3.self_attn.kv_b_proj.weight"] = torch.randn(64, 31)
    _edit_weights(checkpoint, shrink)
    with pytest.raises(ValueError, match=r"model\.layers\.3\.self_attn\.kv_b_proj\.weight.*\[64, 31\].*\[64, 32\]"):
        KimiLinearForCausalLM.from_pretrained(checkpoint)


def test_unknown_model_type(checkpoint):
    cfg_file = os.path.join(checkpoint, "config.json")
    cfg = json.load(open(cfg_file))
    cfg["model_type"] = "llama"
    json.dump(cfg, open(cfg_file, "w"))
    with pytest.raises(ValueError, match="model_type.*llama"):
        KimiLinearForCausalLM.from_pretrained(checkpoint)
    with pytest.raises(ValueError, match="model_type"):
        load_config(checkpoint)


@pytest.mark.parametrize("kda,full,match", [
    ([1, 2], [4], r"layers \[3\].*kda_layers.*full_attn_layers"),       # a layer with no kind
    ([1, 2, 3], [3, 4], r"layer 3 appears in both"),                      # a layer with two kinds
    ([0, 1, 2], [4], r"kda_layers.*layer 0.*1-indexed"),                  # 0-indexed by mistake
    ([1, 2, 3], [5], r"full_attn_layers.*layer 5.*outside 1\.\.4"),       # out of range
])
def test_layer_lists_must_cover_every_layer(kda, full, match):
    raw = raw_config("KKKM")
    raw["linear_attn_config"].update(kda_layers=kda, full_attn_layers=full)
    with pytest.raises(ValueError, match=match):
        config_from_dict(raw)


def test_layer_types_field_checked():
    raw = raw_config("KKKM")
    del raw["linear_attn_config"]
    raw["layer_types"] = ["linear_attention", "full_attention", "sliding_attention", "linear_attention"]
    with pytest.raises(ValueError, match=r"layer_types.*\[2\].*sliding_attention"):
        config_from_dict(raw)


def test_prompt_longer_than_context():
    model = randomize(KimiLinearForCausalLM(make_config("KKKM", context=32)), seed=2).eval()
    with pytest.raises(ValueError, match=r"prompt of 40 tokens exceeds.*max_position_embeddings.*32"):
        model.generate(tokens(1, 40, seed=3), max_new_tokens=4)
    with pytest.raises(ValueError, match=r"40 tokens.*exceeds.*32"):
        model(tokens(1, 40, seed=3))
    cache = model.new_cache(1)
    model(tokens(1, 30, seed=3), cache=cache)
    with pytest.raises(ValueError, match=r"30 cached \+ 3 new"):
        model(tokens(1, 3, seed=4), cache=cache)
    # Generation stops at the context instead of failing mid-way, and says so.
    with pytest.warns(UserWarning, match="capped at 2"):
        assert model.generate(tokens(1, 30, seed=3), max_new_tokens=10, eos_token_id=None).shape == (1, 32)


def test_bad_tensors_and_masks():
    model = randomize(KimiLinearForCausalLM(make_config("KKKM")), seed=2).eval()
    with pytest.raises(ValueError, match="input_ids.*vocabulary"):
        model(torch.tensor([[1, 2, 300]]))
    with pytest.raises(ValueError, match="input_ids.*integer"):
        model(torch.randn(1, 4))
    with pytest.raises(TypeError, match="input_ids"):
        model([[1, 2, 3]])
    with pytest.raises(ValueError, match="attention_mask.*left-padded"):
        model.generate(tokens(1, 4, seed=1), attention_mask=torch.tensor([[1, 1, 1, 0]]))
    with pytest.raises(ValueError, match="temperature"):
        model.generate(tokens(1, 4, seed=1), do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="dtype"):
        KimiLinearForCausalLM.from_pretrained  # noqa: B018  (exists)
        from kimi_linear.model.checkpoint import resolve_dtype
        resolve_dtype("int8")


def test_published_config_loads_and_unsupported_options_are_refused():
    """A config.json in the published Kimi-Linear-48B form (linear_attn_config, auto_map, extra fields) loads with
    the right layout; options that would change the math (or bad Kimi K3 values) are refused by name."""
    from .helpers import published_48b_config

    c = config_from_dict(published_48b_config())
    assert [i + 1 for i, t in enumerate(c.layer_types) if t == "full_attention"] == [4, 8, 12, 16, 20, 24, 27]
    assert c.mlp_layer_types[0] == "dense" and set(c.mlp_layer_types[1:]) == {"sparse"}
    assert (c.num_local_experts, c.num_experts_per_tok, c.linear_head_dim, c.dtype) == (256, 8, 128, torch.bfloat16)
    for field, value, match in [("moe_router_activation_func", "softmax", "moe_router_activation_func"),
                                ("mla_use_nope", False, "mla_use_nope"),
                                ("attn_res_block_size", 0, "attn_res_block_size")]:
        with pytest.raises(ValueError, match=match):
            config_from_dict({**published_48b_config(), field: value})
    raw = published_48b_config()
    raw["linear_attn_config"]["gate_lower_bound"] = 5.0  # K3 options are supported (issue 7); bad values are not
    with pytest.raises(ValueError, match="gate_lower_bound"):
        config_from_dict(raw)


def test_tokenizer_code_is_never_fetched(tmp_path):
    """A tokenizer that names remote code not present in the directory is refused instead of downloaded."""
    from kimi_linear.model.tokenizer import load_tokenizer

    json.dump({"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}},
              open(tmp_path / "tokenizer_config.json", "w"))
    with pytest.raises(FileNotFoundError, match="never downloads"):
        load_tokenizer(str(tmp_path))


def test_damaged_files_are_named(checkpoint):
    """A truncated safetensors file (an interrupted download) and a config.json that is not JSON: errors naming
    the file, before any tensor is read."""
    file = os.path.join(checkpoint, "model.safetensors")
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) // 2)
    with pytest.raises(ValueError, match=r"model\.safetensors is truncated or corrupt"):
        KimiLinearForCausalLM.from_pretrained(checkpoint)
    with open(os.path.join(checkpoint, "config.json"), "w") as f:
        f.write("{")
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        load_config(checkpoint)
