"""Model configs for the synthetic-task comparison: the same decoder with KDA or softmax-attention layers."""

from __future__ import annotations

from transformers import KimiLinearConfig

from kimi_linear.layers.gdn import GatedDeltaNet
from kimi_linear.model import KimiLinearForCausalLM, config_from_dict

MIXERS = ("kda", "gdn", "attention")


def task_model_config(mixer: str, vocab_size: int, *, hidden_size: int = 256, num_layers: int = 2,
                      num_heads: int = 2, head_dim: int = 128, max_len: int = 8192) -> KimiLinearConfig:
    """``num_layers`` layers of one mixer (``kda``: KDA; ``gdn``: the same config, whose KDA layers
    :func:`build_task_model` turns into Gated DeltaNet; ``attention``: NoPE MLA softmax attention), dense SwiGLU
    FFNs (no MoE), ``num_heads`` heads of ``head_dim`` (the report's setup: 2 layers, 2 heads of 128)."""
    if mixer not in MIXERS:
        raise ValueError(f"unknown mixer {mixer!r}; choose one of {MIXERS}")
    layers = list(range(1, num_layers + 1))
    kda, full = ([], layers) if mixer == "attention" else (layers, [])
    return config_from_dict(dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers, first_k_dense_replace=num_layers, moe_intermediate_size=hidden_size,
        num_experts=1, num_experts_per_token=1,
        num_attention_heads=num_heads, num_key_value_heads=num_heads, kv_lora_rank=head_dim,
        qk_nope_head_dim=head_dim, qk_rope_head_dim=head_dim // 2, v_head_dim=head_dim,
        # A task row has no end: no EOS / BOS (id 0 is a real token, e.g. MQAR's first key).
        model_max_length=max_len, pad_token_id=0, bos_token_id=None, eos_token_id=None,
        linear_attn_config=dict(kda_layers=kda, full_attn_layers=full, head_dim=head_dim, num_heads=num_heads,
                                short_conv_kernel_size=4),
    ))


def build_task_model(mixer: str, vocab_size: int, *, seed: int = 0, **sizes) -> KimiLinearForCausalLM:
    """A freshly initialised model for :func:`task_model_config`. For ``gdn`` every KDA block is replaced by a
    :class:`~kimi_linear.layers.gdn.GatedDeltaNet` of the same sizes (such a model trains and evaluates like any
    other, but its checkpoints are not in the Kimi Linear format: transformers has no Gated DeltaNet layer here)."""
    config = task_model_config(mixer, vocab_size, **sizes)
    model = KimiLinearForCausalLM(config)
    if mixer == "gdn":
        for layer in model.model.layers:
            a = layer.self_attn
            layer.self_attn = GatedDeltaNet(a.hidden_size, a.num_heads, a.head_dim, a.conv_size, a.o_norm.eps)
    return model.init_weights(seed=seed)
