"""Reading, checking and writing Kimi Linear configs (``transformers.KimiLinearConfig``), plus size presets.

The config class is transformers' own, so a ``config.json`` published for Kimi-Linear-48B (``linear_attn_config``
with 1-indexed ``kda_layers`` / ``full_attn_layers``) and one written by transformers (``layer_types``) both load;
extra fields (K3 options, ``auto_map`` ...) ride along as attributes.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

from transformers import KimiLinearConfig

from .k3_config import K3_TINY, KIMI_K3, k3_options

MODEL_TYPE = "kimi_linear"
LAYER_KINDS = ("linear_attention", "full_attention")
MLP_KINDS = ("dense", "sparse")

# Named sizes for `kimi-linear init` / `info`. Fields are config.json fields (the published checkpoint's spelling).
PRESETS: dict[str, dict[str, Any]] = {
    # Seconds on a laptop CPU: for trying the CLI and for tests.
    "tiny": dict(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, num_experts=8, num_experts_per_token=2, num_shared_experts=1, first_k_dense_replace=1,
        routed_scaling_factor=2.446, model_max_length=4096,
        linear_attn_config=dict(kda_layers=[1, 2, 3], full_attn_layers=[4], head_dim=32, num_heads=4,
                                short_conv_kernel_size=4),
    ),
    # The CPU benchmark's shape (issue 3): 6 KDA + 2 MLA, hidden 512, 8 KDA heads of 64, 8 experts top-2.
    "small": dict(
        vocab_size=16384, hidden_size=512, intermediate_size=1408, moe_intermediate_size=256, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
        v_head_dim=64, num_experts=8, num_experts_per_token=2, num_shared_experts=1, first_k_dense_replace=1,
        routed_scaling_factor=2.446, model_max_length=65536,
        linear_attn_config=dict(kda_layers=[1, 2, 3, 5, 6, 7], full_attn_layers=[4, 8], head_dim=64, num_heads=8,
                                short_conv_kernel_size=4),
    ),
    # The shape of moonshotai/Kimi-Linear-48B-A3B-Instruct (for `info`; `init` of it needs ~200 GB of memory).
    "kimi-linear-48b": dict(
        vocab_size=163840, hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024,
        num_hidden_layers=27, num_attention_heads=32, num_key_value_heads=32, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_experts=256, num_experts_per_token=8,
        num_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.446, model_max_length=1048576,
        linear_attn_config=dict(
            kda_layers=[i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
            full_attn_layers=[4, 8, 12, 16, 20, 24, 27], head_dim=128, num_heads=32, short_conv_kernel_size=4,
        ),
    ),
    # Kimi K3 (docs/model.md §7): every K3 switch on, tiny; and the released K3 shape (for `info`).
    "k3-tiny": K3_TINY,
    "kimi-k3": KIMI_K3,
}
# Special ids of the byte-level tokenizer `init` writes (bytes are ids 0-255).
PRESET_TOKENS = dict(eos_token_id=256, bos_token_id=257, pad_token_id=258)


def _check_layer_lists(raw: dict[str, Any]) -> None:
    """The 1-indexed ``kda_layers`` / ``full_attn_layers`` must cover every layer exactly once."""
    lac = raw.get("linear_attn_config")
    if lac is None:
        return
    if not isinstance(lac, dict):
        raise TypeError(f"config field `linear_attn_config` must be a dict, got {type(lac).__name__}")
    L = raw.get("num_hidden_layers", KimiLinearConfig().num_hidden_layers)
    if "kda_layers" not in lac and "full_attn_layers" not in lac:
        return
    seen: dict[int, str] = {}
    for field in ("kda_layers", "full_attn_layers"):
        layers = lac.get(field)
        if not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
            raise TypeError(f"config field `linear_attn_config.{field}` must be a list of 1-indexed layer numbers")
        for i in layers:
            if not 1 <= i <= L:
                raise ValueError(f"config field `linear_attn_config.{field}` has layer {i}, outside 1..{L} "
                                 f"(`num_hidden_layers`={L}; the lists are 1-indexed)")
            if i in seen:
                raise ValueError(f"config: layer {i} appears in both `linear_attn_config.{seen[i]}` and "
                                 f"`linear_attn_config.{field}`" if seen[i] != field else
                                 f"config field `linear_attn_config.{field}` lists layer {i} twice")
            seen[i] = field
    missing = [i for i in range(1, L + 1) if i not in seen]
    if missing:
        raise ValueError(f"config: layers {missing} are in neither `linear_attn_config.kda_layers` nor "
                         f"`linear_attn_config.full_attn_layers` (every one of the {L} layers needs a kind)")


def validate_config(config: KimiLinearConfig) -> KimiLinearConfig:
    """Check the fields the model relies on; raise ValueError/TypeError naming the field."""
    if not isinstance(config, KimiLinearConfig):
        raise TypeError(f"expected a transformers.KimiLinearConfig, got {type(config).__name__}")
    if config.model_type != MODEL_TYPE:
        raise ValueError(f"config field `model_type` must be {MODEL_TYPE!r}, got {config.model_type!r}")
    L = config.num_hidden_layers
    for field, kinds in (("layer_types", LAYER_KINDS), ("mlp_layer_types", MLP_KINDS)):
        val = getattr(config, field)
        if val is None or len(val) != L:
            raise ValueError(f"config field `{field}` must have one entry per layer ({L}), got {val!r}")
        bad = [(i, t) for i, t in enumerate(val) if t not in kinds]
        if bad:
            i, t = bad[0]
            raise ValueError(f"config field `{field}`[{i}] is {t!r}; expected one of {kinds} "
                             "(a layer missing from the kind lists?)")
    if getattr(config, "moe_router_activation_func", "sigmoid") != "sigmoid":
        raise ValueError("config field `moe_router_activation_func` must be 'sigmoid', got "
                         f"{config.moe_router_activation_func!r}")
    if getattr(config, "mla_use_nope", True) is False:
        raise ValueError("config field `mla_use_nope` is false: rotary MLA is not part of Kimi Linear (NoPE only)")
    # Kimi K3 switches (docs/model.md §7) and `hidden_act` ("silu", or K3's "situ"): checked, naming the field.
    k3_options(config)
    rsf = config.routed_scaling_factor
    if isinstance(rsf, bool) or not isinstance(rsf, (int, float)) or not rsf > 0 or rsf == float("inf"):
        raise ValueError(f"config field `routed_scaling_factor` must be a positive number, got {rsf!r}")
    if "sparse" in config.mlp_layer_types:
        if config.num_experts_per_tok > config.num_local_experts:
            raise ValueError(f"config field `num_experts_per_token` ({config.num_experts_per_tok}) exceeds "
                             f"`num_experts` ({config.num_local_experts})")
    for field in ("hidden_size", "linear_num_heads", "linear_head_dim", "num_attention_heads", "kv_lora_rank",
                  "vocab_size", "linear_conv_kernel_dim"):
        if getattr(config, field) <= 0:
            raise ValueError(f"config field `{field}` must be positive, got {getattr(config, field)}")
    return config


def config_from_dict(raw: dict[str, Any]) -> KimiLinearConfig:
    """Build and check a config from a ``config.json`` dict."""
    if not isinstance(raw, dict):
        raise TypeError(f"config must be a dict, got {type(raw).__name__}")
    model_type = raw.get("model_type", MODEL_TYPE)
    if model_type != MODEL_TYPE:
        raise ValueError(f"config field `model_type` must be {MODEL_TYPE!r}, got {model_type!r}")
    _check_layer_lists(raw)
    raw = {k: v for k, v in raw.items() if k != "model_type"}
    return validate_config(KimiLinearConfig.from_dict(raw))


def load_config(path: str | os.PathLike) -> KimiLinearConfig:
    """Read ``config.json`` from a checkpoint directory (or the file itself)."""
    path = os.fspath(path)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        if os.path.isdir(path):
            raise FileNotFoundError(f"{path} has no config.json: not a model checkpoint directory (one holds "
                                    "config.json, *.safetensors and tokenizer files, as `kimi-linear init DIR` writes)")
        raise FileNotFoundError(f"no config.json at {path!r}")
    try:
        with open(file, encoding="utf-8") as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON ({e})") from e
    return config_from_dict(raw)


def preset_config(name: str, **overrides: Any) -> KimiLinearConfig:
    """The config of a named preset (``tiny``, ``small``, ``kimi-linear-48b``, ``k3-tiny``, ``kimi-k3``), with
    field overrides."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    tokens = dict(PRESET_TOKENS)
    if name in ("kimi-linear-48b", "kimi-k3"):
        tokens.update(pad_token_id=163839, bos_token_id=163584, eos_token_id=163586)
    return config_from_dict({**copy.deepcopy(PRESETS[name]), **tokens, **overrides})


def config_to_dict(config: KimiLinearConfig) -> dict[str, Any]:
    """``config.json`` content: transformers' fields plus ``linear_attn_config`` (which vLLM and the published
    remote code read), kept consistent with ``layer_types``."""
    d = config.to_dict()
    lac = dict(d.get("linear_attn_config") or {})
    lac.update(
        kda_layers=[i + 1 for i, t in enumerate(config.layer_types) if t == "linear_attention"],
        full_attn_layers=[i + 1 for i, t in enumerate(config.layer_types) if t == "full_attention"],
        head_dim=config.linear_head_dim, num_heads=config.linear_num_heads,
        short_conv_kernel_size=config.linear_conv_kernel_dim,
    )
    d["linear_attn_config"] = lac
    d["model_type"] = MODEL_TYPE
    d.setdefault("architectures", ["KimiLinearForCausalLM"])
    return d
