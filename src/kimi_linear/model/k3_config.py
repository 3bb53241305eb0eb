"""Kimi K3 config switches (docs/model.md §7): reading and checking them, and the K3 presets.

Every switch is optional; with all of them absent (or off) the model is exactly Kimi Linear. Field names are the
released K3 ``config.json``'s: ``linear_attn_config.{gate_lower_bound, use_full_rank_gate}``,
``mla_use_output_gate``, ``attn_res_block_size``, ``routed_expert_hidden_size`` (+ ``use_latent_moe``,
``latent_moe_use_norm``), ``hidden_act: "situ"`` with ``activation_situ_beta`` / ``activation_situ_linear_beta``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

HIDDEN_ACTS = ("silu", "situ")


@dataclass(frozen=True)
class K3Options:
    """The K3 switches of one config, checked. ``None`` / ``False`` = off (Kimi Linear behaviour)."""

    gate_lower_bound: float | None = None
    use_full_rank_gate: bool = False
    mla_use_output_gate: bool = False
    attn_res_block_size: int | None = None
    routed_expert_hidden_size: int | None = None
    latent_moe_use_norm: bool = False
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0


def _flag(value: Any, field: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise TypeError(f"config field `{field}` must be true or false, got {value!r}")
    return value


def _number(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"config field `{field}` must be a finite number, got {value!r}")
    return float(value)


def _positive_int(value: Any, field: str, off_hint: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"config field `{field}` must be a positive integer ({off_hint}), got {value!r}")
    if value <= 0:
        raise ValueError(f"config field `{field}` must be a positive integer ({off_hint}), got {value}")
    return value


def k3_options(config: Any) -> K3Options:
    """Read and check the K3 fields of a ``KimiLinearConfig`` (or anything with those attributes).

    Raises ValueError / TypeError naming the field."""
    lac = getattr(config, "linear_attn_config", None) or {}
    lb = lac.get("gate_lower_bound")
    if lb is not None:
        lb = _number(lb, "linear_attn_config.gate_lower_bound")
        if lb >= 0:
            raise ValueError("config field `linear_attn_config.gate_lower_bound` must be negative (the log-decay "
                             f"floor of one step, K3: -5), got {lb}")
    full_rank = _flag(lac.get("use_full_rank_gate"), "linear_attn_config.use_full_rank_gate")
    mla_gate = _flag(getattr(config, "mla_use_output_gate", None), "mla_use_output_gate")
    block = _positive_int(getattr(config, "attn_res_block_size", None), "attn_res_block_size",
                          "decoder layers per AttnRes block; null turns AttnRes off")
    if block is not None and block > config.num_hidden_layers:
        raise ValueError(f"config field `attn_res_block_size` ({block}) exceeds `num_hidden_layers` "
                         f"({config.num_hidden_layers})")
    latent = _positive_int(getattr(config, "routed_expert_hidden_size", None), "routed_expert_hidden_size",
                           "the LatentMoE width; null turns LatentMoE off")
    use_latent = getattr(config, "use_latent_moe", None)
    if use_latent is not None and not _flag(use_latent, "use_latent_moe"):
        latent = None
    elif use_latent and latent is None:
        raise ValueError("config field `use_latent_moe` is true but `routed_expert_hidden_size` is not set")
    latent_norm = _flag(getattr(config, "latent_moe_use_norm", None), "latent_moe_use_norm")
    if latent_norm and latent is None:
        raise ValueError("config field `latent_moe_use_norm` is true but LatentMoE is off "
                         "(`routed_expert_hidden_size` not set)")
    act = getattr(config, "hidden_act", "silu")
    if act not in HIDDEN_ACTS:
        raise ValueError(f"config field `hidden_act` must be one of {HIDDEN_ACTS}, got {act!r}")
    betas = {}
    for field, default in (("activation_situ_beta", 4.0), ("activation_situ_linear_beta", 25.0)):
        v = getattr(config, field, None)
        v = default if v is None else _number(v, field)
        if v <= 0:
            raise ValueError(f"config field `{field}` must be positive, got {v}")
        betas[field] = v
    return K3Options(
        gate_lower_bound=lb, use_full_rank_gate=full_rank, mla_use_output_gate=mla_gate, attn_res_block_size=block,
        routed_expert_hidden_size=latent, latent_moe_use_norm=latent_norm,
        situ_beta=betas["activation_situ_beta"], situ_linear_beta=betas["activation_situ_linear_beta"],
    )


# Every K3 switch on at a size that trains in seconds on a CPU (tests, `kimi-linear init --preset k3-tiny`).
K3_TINY: dict[str, Any] = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
    v_head_dim=32, num_experts=8, num_experts_per_token=2, num_shared_experts=1, first_k_dense_replace=1,
    routed_scaling_factor=1.0, model_max_length=4096,
    hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
    mla_use_output_gate=True, attn_res_block_size=2, use_latent_moe=True, routed_expert_hidden_size=64,
    latent_moe_use_norm=True,
    linear_attn_config=dict(kda_layers=[1, 2, 3], full_attn_layers=[4], head_dim=32, num_heads=4,
                            short_conv_kernel_size=4, gate_lower_bound=-5.0, use_full_rank_gate=True),
)

# The shape of moonshotai/Kimi-K3 as far as public reads of its files give it (for `kimi-linear info`): 93 layers,
# 69 KDA + 24 gated MLA (every 4th and the last), hidden 7168, 896 experts top-16 in a 3584 latent with
# intermediate 3072, two shared experts (6144 wide together), AttnRes blocks of 12 layers, 96 KDA heads of 128.
# `intermediate_size` (the one dense layer) and `vocab_size` were not in those reads: K2's values are assumed.
_K3_MLA = [i for i in range(4, 93, 4)] + [93]
KIMI_K3: dict[str, Any] = dict(
    vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=3072, num_hidden_layers=93,
    num_attention_heads=96, num_key_value_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, num_experts=896, num_experts_per_token=16, num_shared_experts=2,
    first_k_dense_replace=1, routed_scaling_factor=1.0, model_max_length=262144,
    hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
    mla_use_output_gate=True, attn_res_block_size=12, use_latent_moe=True, routed_expert_hidden_size=3584,
    latent_moe_use_norm=True,
    linear_attn_config=dict(kda_layers=[i for i in range(1, 94) if i not in _K3_MLA], full_attn_layers=_K3_MLA,
                            head_dim=128, num_heads=96, short_conv_kernel_size=4, gate_lower_bound=-5.0,
                            use_full_rank_gate=True),
)
