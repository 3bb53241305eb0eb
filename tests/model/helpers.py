"""Random small Kimi Linear configs and weights shared by the model tests."""

from __future__ import annotations

import torch
from transformers import KimiLinearConfig

from kimi_linear.model import config_from_dict

VOCAB = 300


def raw_config(
    kinds: str = "KKKM",
    moe: bool = True,
    n_group: int = 1,
    q_lora_rank: int | None = None,
    context: int = 4096,
    **overrides,
) -> dict:
    """config.json dict of a small random model. kinds: one letter per layer, K = KDA, M = MLA.
    moe: layers after the first use MoE (else every FFN is dense)."""
    L = len(kinds)
    raw = dict(
        model_type="kimi_linear", vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=L, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=q_lora_rank, num_experts=8 if n_group > 1 else 4,
        num_experts_per_token=2, num_shared_experts=1, routed_scaling_factor=2.446,
        num_expert_group=n_group, topk_group=max(1, n_group // 2),
        first_k_dense_replace=1 if moe else L, model_max_length=context,
        linear_attn_config=dict(
            kda_layers=[i + 1 for i, c in enumerate(kinds) if c == "K"],
            full_attn_layers=[i + 1 for i, c in enumerate(kinds) if c == "M"],
            head_dim=16, num_heads=4, short_conv_kernel_size=4,
        ),
        pad_token_id=0, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5,
    )
    raw.update(overrides)
    return raw


def make_config(*args, **kwargs) -> KimiLinearConfig:
    return config_from_dict(raw_config(*args, **kwargs))


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Fresh random values in every tensor, at scales that keep activations O(1) but make every part matter
    (non-unit norms, a non-zero router bias, varied decay rates)."""
    gen = torch.Generator().manual_seed(seed)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        r = torch.randn(t.shape, generator=gen, dtype=torch.float32)
        if name.endswith("A_log"):
            v = torch.empty(t.shape).uniform_(0.0, 2.5, generator=gen).log()
        elif name.endswith("dt_bias"):
            v = r * 0.5 - 2.0
        elif name.endswith("e_score_correction_bias"):
            v = r * 0.1
        elif "norm" in name.rsplit(".", 2)[-2]:
            v = 1.0 + 0.2 * r
        elif name.endswith("conv1d.weight"):
            v = r * 0.5
        elif t.ndim == 2:
            v = r / t.shape[-1] ** 0.5
        else:
            v = r * 0.02
        t.copy_(v.to(t.dtype))
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def tokens(batch: int, length: int, seed: int) -> torch.Tensor:
    """Random ids avoiding the special ids 0-2."""
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def published_48b_config() -> dict:
    """config.json of moonshotai/Kimi-Linear-48B-A3B-Instruct as published (remote-code era field names)."""
    full = [4, 8, 12, 16, 20, 24, 27]
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_kimi.KimiLinearConfig",
                     "AutoModel": "modeling_kimi.KimiLinearModel",
                     "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM"},
        "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839, "first_k_dense_replace": 1,
        "hidden_act": "silu", "hidden_size": 2304, "initializer_range": 0.02, "intermediate_size": 9216,
        "kv_lora_rank": 512, "mla_use_nope": True, "model_max_length": 1048576, "model_type": "kimi_linear",
        "linear_attn_config": {"full_attn_layers": full, "head_dim": 128, "num_heads": 32,
                               "kda_layers": [i for i in range(1, 28) if i not in full], "short_conv_kernel_size": 4},
        "moe_intermediate_size": 1024, "moe_layer_freq": 1, "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid", "num_attention_heads": 32, "num_expert_group": 1,
        "num_experts": 256, "num_experts_per_token": 8, "num_hidden_layers": 27, "num_key_value_heads": 32,
        "num_nextn_predict_layers": 0, "num_shared_experts": 1, "q_lora_rank": None, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "routed_scaling_factor": 2.446,
        "tie_word_embeddings": False, "topk_group": 1, "torch_dtype": "bfloat16", "use_cache": True,
        "v_head_dim": 128, "vocab_size": 163840,
    }
