"""Bad K3 config values are refused with an error naming the field; good ones round-trip through config.json."""

from __future__ import annotations

import json

import pytest

from kimi_linear.model import config_from_dict, config_to_dict, load_config

from .helpers import k3_raw, with_fields

BAD = [
    ("linear_attn_config.gate_lower_bound", 5.0, ValueError),
    ("linear_attn_config.gate_lower_bound", 0, ValueError),
    ("linear_attn_config.gate_lower_bound", "-5", TypeError),
    ("linear_attn_config.gate_lower_bound", float("nan"), TypeError),
    ("linear_attn_config.use_full_rank_gate", "yes", TypeError),
    ("mla_use_output_gate", 1, TypeError),
    ("attn_res_block_size", 0, ValueError),
    ("attn_res_block_size", -2, ValueError),
    ("attn_res_block_size", 2.5, TypeError),
    ("attn_res_block_size", 99, ValueError),
    ("routed_expert_hidden_size", 0, ValueError),
    ("routed_expert_hidden_size", "64", TypeError),
    ("latent_moe_use_norm", "true", TypeError),
    ("use_latent_moe", "no", TypeError),
    ("hidden_act", "gelu", ValueError),
    ("activation_situ_beta", 0.0, ValueError),
    ("activation_situ_beta", True, TypeError),
    ("activation_situ_linear_beta", -25.0, ValueError),
    ("routed_scaling_factor", 0.0, ValueError),
    ("routed_scaling_factor", float("inf"), ValueError),
]


@pytest.mark.parametrize("field,value,error", BAD, ids=[f"{f}={v!r}" for f, v, _ in BAD])
def test_bad_value_is_refused_naming_the_field(field, value, error):
    with pytest.raises(error, match=f"`{field}`"):
        config_from_dict(with_fields(k3_raw(), {field: value}))


def test_inconsistent_latent_fields_are_refused():
    with pytest.raises(ValueError, match="`latent_moe_use_norm`"):
        config_from_dict(with_fields(k3_raw(), {"routed_expert_hidden_size": None}))
    with pytest.raises(ValueError, match="`use_latent_moe`"):
        config_from_dict(with_fields(k3_raw(), {"routed_expert_hidden_size": None, "latent_moe_use_norm": False,
                                                "use_latent_moe": True}))


def test_k3_config_round_trips_through_config_json(tmp_path):
    c = config_from_dict(k3_raw())
    (tmp_path / "config.json").write_text(json.dumps(config_to_dict(c)))
    back = load_config(tmp_path)
    for key in ("mla_use_output_gate", "attn_res_block_size", "routed_expert_hidden_size", "latent_moe_use_norm",
                "hidden_act", "routed_scaling_factor"):
        assert getattr(back, key) == getattr(c, key), key
    assert back.linear_attn_config["gate_lower_bound"] == -5.0
    assert back.linear_attn_config["use_full_rank_gate"] is True
