"""Small random Kimi K3 configs for the K3 tests (issue 7), built on the model tests' helpers."""

from __future__ import annotations

import copy

from transformers import KimiLinearConfig

from kimi_linear.model import config_from_dict
from tests.model.helpers import raw_config

# Every K3 switch, on. `linear_attn_config.*` keys go into the nested dict.
K3_ON = {
    "linear_attn_config.gate_lower_bound": -5.0,
    "linear_attn_config.use_full_rank_gate": True,
    "mla_use_output_gate": True,
    "attn_res_block_size": 2,
    "routed_expert_hidden_size": 24,
    "latent_moe_use_norm": True,
    "hidden_act": "situ",
}


def with_fields(raw: dict, fields: dict) -> dict:
    """A copy of ``raw`` with ``fields`` set (``linear_attn_config.x`` sets the nested key)."""
    raw = copy.deepcopy(raw)
    for key, value in fields.items():
        if key.startswith("linear_attn_config."):
            raw["linear_attn_config"][key.split(".", 1)[1]] = value
        else:
            raw[key] = value
    return raw


def k3_raw(kinds: str = "KKMKM", **overrides) -> dict:
    """config.json dict of a small model with every K3 switch on (5 layers, blocks of 2: the last block partial);
    ``overrides`` (top-level or ``linear_attn_config.x`` keys, as in :data:`K3_ON`) are applied last."""
    return with_fields(with_fields(raw_config(kinds, routed_scaling_factor=1.0), K3_ON), overrides)


def k3_config(kinds: str = "KKMKM", **overrides) -> KimiLinearConfig:
    return config_from_dict(k3_raw(kinds, **overrides))
