"""Parameter counts and per-sequence cache sizes from a config alone (docs/memory.md), for `kimi-linear info`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import KimiLinearConfig


@dataclass
class CacheBytes:
    """Cache bytes for one sequence of ``context`` tokens."""

    context: int
    kda_layers: int
    mla_layers: int
    kda_state: int          # all KDA layers: float32 recurrent state + conv window (fixed, whatever the length)
    mla_latent: int         # all MLA layers: (kv_lora_rank + rope) entries per token
    all_mla: int            # an all-MLA model of the same depth and MLA shape

    @property
    def hybrid(self) -> int:
        return self.kda_state + self.mla_latent

    @property
    def saving(self) -> float:
        """Fraction of the all-MLA cache that the hybrid does not need."""
        return 1.0 - self.hybrid / self.all_mla if self.all_mla else 0.0


def cache_bytes(config: KimiLinearConfig, context: int, cache_dtype: torch.dtype = torch.bfloat16) -> CacheBytes:
    """Per-sequence cache at ``context`` tokens. KDA: ``H*d*d`` float32 state plus ``(W-1) x 3*H*d`` conv inputs
    in ``cache_dtype``; MLA: ``(kv_lora_rank + qk_rope_head_dim)`` values of ``cache_dtype`` per token."""
    if context < 0:
        raise ValueError(f"`context` must be >= 0, got {context}")
    e = torch.tensor([], dtype=cache_dtype).element_size()
    H, d, W = config.linear_num_heads, config.linear_head_dim, config.linear_conv_kernel_dim
    n_kda = sum(t == "linear_attention" for t in config.layer_types)
    n_mla = len(config.layer_types) - n_kda
    per_kda = H * d * d * 4 + (W - 1) * 3 * H * d * e
    per_token_mla = (config.kv_lora_rank + config.qk_rope_head_dim) * e
    return CacheBytes(
        context=context, kda_layers=n_kda, mla_layers=n_mla, kda_state=n_kda * per_kda,
        mla_latent=n_mla * context * per_token_mla, all_mla=len(config.layer_types) * context * per_token_mla,
    )


def parameter_counts(config: KimiLinearConfig) -> dict[str, int]:
    """``total``, ``active`` (per token: non-expert weights + top-k of the routed experts), ``embedding``."""
    from .modeling import KimiLinearForCausalLM

    with torch.device("meta"):
        model = KimiLinearForCausalLM(config)
    total = active = embedding = 0
    E, k = config.num_local_experts, config.num_experts_per_tok
    for name, p in model.named_parameters():
        n = p.numel()
        total += n
        if ".experts." in name:
            active += n * k // E
        else:
            active += n
        if "embed_tokens" in name:
            embedding += n
    return {"total": total, "active": active, "embedding": embedding}


def human_count(n: float) -> str:
    """A parameter count for people: ``1.23 M``, ``48.1 B``, ``512``."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            x = n / scale
            return f"{x:.0f} {unit}" if abs(x) >= 100 else (f"{x:.1f} {unit}" if abs(x) >= 10 else f"{x:.2f} {unit}")
    return f"{int(n)}"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")
