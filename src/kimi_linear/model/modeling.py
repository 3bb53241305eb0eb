"""The Kimi Linear decoder (docs/model.md): pre-norm hybrid of KDA and NoPE MLA layers with dense / MoE FFNs."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig, KimiLinearConfig

from kimi_linear.layers import (
    AttnResState,
    KDAState,
    KimiDeltaAttention,
    LatentCache,
    Linear,
    NoPEMLA,
    RMSNorm,
    SparseMoE,
    SwiGLUMLP,
    depth_mix,
    make_glu,
)
from kimi_linear.layers.context_parallel import ContextParallel
from kimi_linear.ops.rms_norm import project_add_rms_norm, project_fused

from .cache import HybridCache
from .config import k3_options, validate_config
from .generation_config import default_generation_config

# Parameters kept in float32 whatever the model dtype: router weight and bias, and the forget-gate constants.
FP32_SUFFIXES = (".gate.weight", ".e_score_correction_bias", ".dt_bias", ".A_log")


def keeps_fp32(name: str) -> bool:
    return name.endswith(FP32_SUFFIXES)


@dataclass
class CausalLMOutput:
    """logits: [B, T', vocab] (T' = T, or the last ``logits_to_keep`` positions); cache: the updated cache."""

    logits: torch.Tensor
    cache: HybridCache | None = None


class KimiLinearDecoderLayer(nn.Module):
    """``h = x + Attn(RMSNorm(x))``, ``y = h + FFN(RMSNorm(h))``; Attn is KDA or MLA, FFN dense or MoE.

    With Kimi K3's block attention residuals (``attn_res_block_size``) the two residual additions are replaced
    by depth mixes (:meth:`forward_attn_res`, names ``{attn,mlp}_res_{norm,proj}.weight``).
    """

    def __init__(self, config: KimiLinearConfig, layer_idx: int) -> None:
        super().__init__()
        c = config
        k3 = k3_options(c)
        glu = make_glu(c.hidden_act, k3.situ_beta, k3.situ_linear_beta)
        self.is_kda = c.layer_types[layer_idx] == "linear_attention"
        if self.is_kda:
            self.self_attn: nn.Module = KimiDeltaAttention(
                c.hidden_size, c.linear_num_heads, c.linear_head_dim, c.linear_conv_kernel_dim, c.rms_norm_eps,
                gate_lower_bound=k3.gate_lower_bound, full_rank_gate=k3.use_full_rank_gate,
            )
        else:
            self.self_attn = NoPEMLA(
                c.hidden_size, c.num_attention_heads, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim,
                c.v_head_dim, c.q_lora_rank, c.attention_bias, output_gate=k3.mla_use_output_gate,
            )
        # Checkpoint names: dense FFN under `mlp`, MoE under `block_sparse_moe`.
        if c.mlp_layer_types[layer_idx] == "sparse":
            self.block_sparse_moe = SparseMoE(
                c.hidden_size, c.moe_intermediate_size, c.num_local_experts, c.num_experts_per_tok,
                c.n_shared_experts, c.routed_scaling_factor, c.norm_topk_prob, c.n_group, c.topk_group or 1,
                glu=glu, latent_size=k3.routed_expert_hidden_size, latent_norm=k3.latent_moe_use_norm,
                eps=c.rms_norm_eps,
            )
        else:
            self.mlp = SwiGLUMLP(c.hidden_size, c.intermediate_size, glu)
        # (not stored as a second attribute: that would register the module twice under two names)
        self.is_moe = c.mlp_layer_types[layer_idx] == "sparse"
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.attn_res = k3.attn_res_block_size is not None
        if self.attn_res:
            # Pseudo-queries [1, D] and key norms of the two depth mixes (before attention, before the FFN).
            self.starts_block = layer_idx % k3.attn_res_block_size == 0
            self.attn_res_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.attn_res_proj = nn.Linear(c.hidden_size, 1, bias=False)
            self.mlp_res_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.mlp_res_proj = nn.Linear(c.hidden_size, 1, bias=False)

    def empty_cache(self, batch_size: int, dtype: torch.dtype, device: torch.device) -> KDAState | LatentCache:
        if self.is_kda:
            return self.self_attn.empty_state(batch_size, dtype, device)
        return self.self_attn.empty_cache(batch_size, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        cache: KDAState | LatentCache | None,
        padding_mask: torch.Tensor | None,
        attn_mask: torch.Tensor | None,
        cu_seqlens: torch.Tensor | None = None,
        attn_res_blocks: list[torch.Tensor] | None = None,
        context_parallel: ContextParallel | None = None,
    ) -> torch.Tensor | tuple[list[torch.Tensor], torch.Tensor]:
        """x: hidden [B, T, D] -> [B, T, D].

        With block AttnRes, x is the running partial sum and ``attn_res_blocks`` the embedding and completed block
        summaries; returns the updated ``(blocks, partial)``. (AttnRes goes through ``forward`` with plain tensors
        in and out, so module hooks -- FSDP2's unsharding for forward and backward -- work as for any layer.)"""
        if attn_res_blocks is not None:
            state = self.forward_attn_res(AttnResState(x, attn_res_blocks), cache, padding_mask, attn_mask,
                                          cu_seqlens, context_parallel)
            assert state.partial is not None
            return state.blocks, state.partial
        norm = self.post_attention_layernorm
        o_proj = getattr(self.self_attn, "o_proj", None)
        ours = isinstance(self.self_attn, (KimiDeltaAttention, NoPEMLA)) and context_parallel is None
        block = None
        if ours and o_proj.bias is None and project_fused(x, o_proj.weight, norm.weight):
            # a decode step: the output projection's split-K partial sums go straight into the add + norm kernel
            o = self._attn(self.input_layernorm(x), cache, padding_mask, attn_mask, cu_seqlens, project=False)
            x, normed = project_add_rms_norm(x, o, o_proj.weight, norm.weight, norm.eps)
        else:
            if ours and cache is not None and padding_mask is None and attn_mask is None and cu_seqlens is None:
                # a CPU decode step: input norm, attention and the residual add + next norm as one C call
                block = self.self_attn.decode_block(x, cache, self.input_layernorm, norm)
            if block is not None:
                x, normed = block
            else:
                h = self._attn(self.input_layernorm(x), cache, padding_mask, attn_mask, cu_seqlens, context_parallel)
                # x + h and its norm in one go (one Triton kernel on CUDA at inference: decoding pays per kernel)
                normed, x = norm(h, residual=x)
        if self.is_moe:
            return self.block_sparse_moe(normed, residual=x)       # the fused MoE adds x in its combine
        return x + self.mlp(normed)

    def _attn(
        self, h: torch.Tensor, cache: KDAState | LatentCache | None, padding_mask: torch.Tensor | None,
        attn_mask: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
        context_parallel: ContextParallel | None = None, project: bool = True,
    ) -> torch.Tensor:
        # Passed only when set, so a swapped-in mixer (Gated DeltaNet) need not know the argument.
        cp = {} if context_parallel is None else {"context_parallel": context_parallel}
        if not project:
            cp["project"] = False
        if self.is_kda:
            return self.self_attn(h, cache, padding_mask, cu_seqlens, **cp)
        return self.self_attn(h, cache, attn_mask, **cp)

    def forward_attn_res(
        self,
        state: AttnResState,
        cache: KDAState | LatentCache | None,
        padding_mask: torch.Tensor | None,
        attn_mask: torch.Tensor | None,
        cu_seqlens: torch.Tensor | None = None,
        context_parallel: ContextParallel | None = None,
    ) -> AttnResState:
        """Block AttnRes form of the layer (see :mod:`kimi_linear.layers.attn_res`); updates ``state`` in place.

        Each sublayer reads the depth mix of ``state.sources()`` (embedding, block summaries, partial sum) and
        adds its output to the partial sum; the first layer of a block first snapshots the partial sum, *after*
        the attention mix (which therefore still sees the just-completed block as the partial sum).
        """
        h = depth_mix(state.sources(), self.attn_res_proj, self.attn_res_norm)
        if self.starts_block:
            state.start_block()
        state.add(self._attn(self.input_layernorm(h), cache, padding_mask, attn_mask, cu_seqlens, context_parallel))
        h = depth_mix(state.sources(), self.mlp_res_proj, self.mlp_res_norm)
        ffn = self.block_sparse_moe if self.is_moe else self.mlp
        state.add(ffn(self.post_attention_layernorm(h)))
        return state


class KimiLinearModel(nn.Module):
    """Embedding, decoder layers, final norm; checkpoint prefix ``model.``.

    With block AttnRes the final hidden state is the depth mix ``output_attn_res_{norm,proj}`` of the last
    sources instead of the residual stream (then ``norm`` as usual).
    """

    def __init__(self, config: KimiLinearConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(KimiLinearDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_res = k3_options(config).attn_res_block_size is not None
        if self.attn_res:
            self.output_attn_res_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.output_attn_res_proj = nn.Linear(config.hidden_size, 1, bias=False)

    def run_layers(
        self, x: torch.Tensor, caches: list | None, padding_mask: torch.Tensor | None,
        attn_mask: torch.Tensor | None, cu_seqlens: torch.Tensor | None = None,
        context_parallel: ContextParallel | None = None,
    ) -> torch.Tensor:
        """Embedded x [B, T, D] through every decoder layer -> hidden [B, T, D] before the final norm."""
        if not self.attn_res:
            for i, layer in enumerate(self.layers):
                x = layer(x, caches[i] if caches is not None else None, padding_mask, attn_mask, cu_seqlens,
                          context_parallel=context_parallel)
            return x
        blocks: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            blocks, x = layer(x, caches[i] if caches is not None else None, padding_mask, attn_mask, cu_seqlens,
                              attn_res_blocks=blocks, context_parallel=context_parallel)
        return depth_mix([*blocks, x], self.output_attn_res_proj, self.output_attn_res_norm)


def _mla_mask(
    key_mask: torch.Tensor | None, past: int, T: int, device: torch.device
) -> torch.Tensor | None:
    """bool [B, 1, T, past+T] (True = may attend), or None when no position is padding: then every MLA layer runs
    plain causal attention of the last T positions over all past + T keys, without a mask (a [T, past + T] mask
    would be gigabytes for a prompt chunk after a long context, and keeps SDPA off its flash kernels).

    A padding query would see no key at all (softmax of nothing = NaN, which the next KDA layer's zeroing cannot
    remove: NaN * 0 = NaN), so every query may always see itself.
    """
    if key_mask is None:
        return None
    L = past + T
    q_pos = torch.arange(past, L, device=device)[:, None]
    k_pos = torch.arange(L, device=device)[None, :]
    allowed = (k_pos <= q_pos)[None, None]
    return (allowed & key_mask[:, None, None, :]) | (k_pos == q_pos)[None, None]


class KimiLinearForCausalLM(nn.Module):
    """Kimi Linear language model with the checkpoint layout of ``transformers.KimiLinearForCausalLM``.

    ``from_pretrained`` / ``save_pretrained`` read and write Hugging Face checkpoints (safetensors, sharded when
    large); ``generate`` decodes with the hybrid cache. ``state_dict()`` keys are exactly the on-disk names.
    """

    def __init__(self, config: KimiLinearConfig) -> None:
        super().__init__()
        self.config = validate_config(config)
        self.model = KimiLinearModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        # What generate decodes with by default (transformers' attribute): from_pretrained replaces it with the
        # checkpoint's generation_config.json when there is one; save_pretrained writes it.
        self.generation_config = default_generation_config(config)
        self.optimize_layout()

    # ----------------------------------------------------------------------------------------------- properties
    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    # ------------------------------------------------------------------------------------------- initialisation
    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> KimiLinearForCausalLM:
        """Random initialisation in the published recipe's spirit (normal(0, initializer_range) for matrices,
        ones for norms, FLA's A_log / dt_bias ranges). Deterministic given ``seed`` (and the device: values are
        drawn where the model lives, so a GPU model of billions of parameters initialises in seconds)."""
        dev = self.device
        gen = torch.Generator(device=dev).manual_seed(seed) if seed is not None else None
        std = self.config.initializer_range
        empty = lambda shape: torch.empty(shape, device=dev)
        for name, p in self.named_parameters():
            if name.endswith("A_log"):
                p.copy_(empty(p.shape).uniform_(1.0, 16.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                dt = empty(p.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
                dt = dt.clamp_min(1e-4)
                p.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
            elif name.endswith("res_proj.weight"):
                p.zero_()  # AttnRes pseudo-queries start at zero: a uniform depth mix (as in the paper)
            elif "norm" in name.rsplit(".", 2)[-2]:
                p.fill_(1.0)
            elif name.endswith("conv1d.weight"):
                bound = 1 / math.sqrt(p.shape[-1])
                p.copy_(empty(p.shape).uniform_(-bound, bound, generator=gen))
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(empty(p.shape).normal_(0.0, std, generator=gen))
        for name, b in self.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()
        return self

    @torch.no_grad()
    def optimize_layout(self) -> KimiLinearForCausalLM:
        """Store each CPU ``nn.Linear`` weight so that its longer dimension is contiguous in memory.

        Same values, same shapes, same memory; only the strides change. One-token decoding is a chain of
        matrix-vector products bound by memory bandwidth, and CPU BLAS streams a weight 1.5-2.5x faster when it
        walks the longer dimension contiguously (e.g. ``lm_head``: [vocab, hidden] stored column-major).
        """
        for mod in self.modules():
            if isinstance(mod, nn.Linear) and mod.weight.device.type in ("cpu", "meta"):
                w = mod.weight.data
                out_f, in_f = w.shape
                col_major = w.stride() == (1, out_f)
                if out_f > in_f and not col_major:
                    mod.weight.data = w.t().contiguous().t()
                elif out_f < in_f and col_major:
                    mod.weight.data = w.contiguous()
        # Then pack projections that share an input (views into one matrix; see layers.packing).
        for mod in self.modules():
            if hasattr(mod, "pack") and mod is not self:
                mod.pack()
        return self

    def cast(self, dtype: torch.dtype) -> KimiLinearForCausalLM:
        """Convert weights to ``dtype`` except the float32-only ones (router, gate constants)."""
        if dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise TypeError(f"`dtype` must be float32, bfloat16 or float16, got {dtype}")
        for name, t in list(self.named_parameters()) + list(self.named_buffers()):
            t.data = t.data.to(torch.float32 if keeps_fp32(name) and dtype != torch.float64 else dtype)
        return self.optimize_layout()

    # ---------------------------------------------------------------------------------------------------- cache
    def new_cache(self, batch_size: int) -> HybridCache:
        """An empty hybrid cache for ``batch_size`` sequences."""
        return HybridCache([layer.empty_cache(batch_size, self.dtype, self.device) for layer in self.model.layers])

    # -------------------------------------------------------------------------------------------------- forward
    def _check_input_ids(self, input_ids: Any) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"`input_ids` must be a torch.Tensor, got {type(input_ids).__name__}")
        if input_ids.ndim == 1:
            input_ids = input_ids[None]
        if input_ids.ndim != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"`input_ids` must be an integer tensor [batch, seq], got {input_ids.dtype} "
                             f"{tuple(input_ids.shape)}")
        if input_ids.shape[1] == 0:
            raise ValueError("`input_ids` is empty (sequence length 0)")
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= self.config.vocab_size:
            raise ValueError(f"`input_ids` holds ids in [{lo}, {hi}], outside the vocabulary [0, "
                             f"{self.config.vocab_size})")
        return input_ids

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: HybridCache | None = None,
        logits_to_keep: int = 0,
        cu_seqlens: torch.Tensor | None = None,
        context_parallel: ContextParallel | None = None,
    ) -> CausalLMOutput:
        """input_ids: [B, T]; attention_mask: [B, T] or [B, past+T], 1 = token, 0 = (left) padding;
        cache: continued and updated in place when given. Returns logits [B, T, vocab] in float32 if the model is
        float32, else in the model dtype (only the last ``logits_to_keep`` positions when > 0).

        cu_seqlens: [N+1] offsets of documents packed into one row (``B == 1``, no cache, no attention_mask), as in
        training on packed text: no KDA memory, conv window or attention crosses a document boundary.

        context_parallel: input_ids [B, T] is this rank's piece of rows split along time across a process group
        (see :mod:`kimi_linear.model.context_parallel`); every rank of the group must call forward together."""
        input_ids = self._check_input_ids(input_ids)
        if context_parallel is not None:
            from .context_parallel import forward_context_parallel

            return forward_context_parallel(self, input_ids, context_parallel, attention_mask=attention_mask,
                                            cache=cache, cu_seqlens=cu_seqlens, logits_to_keep=logits_to_keep)
        B, T = input_ids.shape
        if cu_seqlens is not None:
            return self._forward_packed(input_ids, cu_seqlens, cache, attention_mask, logits_to_keep)
        past = cache.seq_len if cache is not None else 0
        limit = self.config.max_position_embeddings
        if past + T > limit:
            raise ValueError(f"sequence of {past + T} tokens ({past} cached + {T} new) exceeds the configured "
                             f"context `max_position_embeddings`/`model_max_length` = {limit}")
        mask = None
        if attention_mask is not None:
            if attention_mask.ndim != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] not in (T, past + T):
                raise ValueError(f"`attention_mask` must be [batch, seq] = [{B}, {T}] or [{B}, {past + T}], got "
                                 f"{tuple(attention_mask.shape)}")
            mask = attention_mask[:, -T:].to(device=input_ids.device).bool()
            if bool(mask.all()):
                mask = None
        if cache is not None:
            if len(cache.layers) != len(self.model.layers):
                raise ValueError(f"`cache` has {len(cache.layers)} layers, the model {len(self.model.layers)}")
            cache.append_mask(mask, B, T, input_ids.device)
            key_mask = cache.key_mask
        else:
            key_mask = mask
        attn_mask = _mla_mask(key_mask, past, T, input_ids.device)

        x = self.model.embed_tokens(input_ids)
        x = self.model.run_layers(x, cache.layers if cache is not None else None, mask, attn_mask)
        if logits_to_keep > 0:
            x = x[:, -logits_to_keep:]
        logits = self.lm_head(self.model.norm(x))
        return CausalLMOutput(logits=logits, cache=cache)

    def _forward_packed(
        self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, cache: HybridCache | None,
        attention_mask: torch.Tensor | None, logits_to_keep: int,
    ) -> CausalLMOutput:
        """Packed documents: KDA runs varlen (``cu_seqlens``), MLA attends causally inside each document only."""
        from kimi_linear.ops.checks import check_cu_seqlens

        if cache is not None or attention_mask is not None:
            raise ValueError("`cu_seqlens` (packed documents) cannot be combined with `cache` or `attention_mask`")
        B, T = input_ids.shape
        check_cu_seqlens(cu_seqlens, B, T)
        if T > self.config.max_position_embeddings:
            raise ValueError(f"packed row of {T} tokens exceeds the configured context "
                             f"`max_position_embeddings`/`model_max_length` = {self.config.max_position_embeddings}")
        cu = cu_seqlens.to(device=input_ids.device, dtype=torch.int64)
        doc = torch.repeat_interleave(torch.arange(len(cu) - 1, device=cu.device), cu.diff())
        pos = torch.arange(T, device=cu.device)
        attn_mask = ((pos[None, :] <= pos[:, None]) & (doc[None, :] == doc[:, None]))[None, None]
        x = self.model.embed_tokens(input_ids)
        x = self.model.run_layers(x, None, None, attn_mask, cu)
        if logits_to_keep > 0:
            x = x[:, -logits_to_keep:]
        return CausalLMOutput(logits=self.lm_head(self.model.norm(x)), cache=None)

    # ------------------------------------------------------------------------------------ files and generation
    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu",
        progress: bool = False,
    ) -> KimiLinearForCausalLM:
        """Load a checkpoint directory (``config.json`` + safetensors, and ``generation_config.json`` as the
        model's ``generation_config`` when present). ``dtype`` defaults to the checkpoint's."""
        from .checkpoint import load_pretrained

        return load_pretrained(cls, path, dtype=dtype, device=device, progress=progress)

    def save_pretrained(
        self, path: str | os.PathLike, max_shard_size: int | str = "5GB", progress: bool = False
    ) -> None:
        """Write ``config.json``, ``generation_config.json`` and safetensors (sharded with an index when over
        ``max_shard_size``)."""
        from .checkpoint import save_pretrained

        save_pretrained(self, path, max_shard_size=max_shard_size, progress=progress)

    def generate(self, input_ids: torch.Tensor, generation_config: GenerationConfig | None = None,
                 **kwargs: Any) -> Any:
        """Decode with the hybrid cache, taking transformers' generation arguments (``max_new_tokens``,
        ``min_new_tokens``, ``eos_token_id``, ``repetition_penalty``, ``stop_strings`` + ``tokenizer`` ...) and a
        ``GenerationConfig``; see :func:`kimi_linear.model.generation.generate`."""
        from .generation import generate

        return generate(self, input_ids, generation_config=generation_config, **kwargs)
