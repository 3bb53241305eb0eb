"""Context parallelism for the whole model: rows split along time into equal pieces across a process group.

    cp = ContextParallel.of(group)                      # this rank's place (group rank order = time order)
    piece = cp.split(input_ids)                         # [B, T] -> [B, T / world], this rank's contiguous piece
    logits = model(piece, context_parallel=cp).logits   # forward and backward equal one process on the whole rows

Every rank of the group must run the forward (and the backward) together: KDA layers pass their state and their
conv window from rank to rank, MLA layers gather the latents (see :mod:`kimi_linear.layers.context_parallel`).
Losses are local: a rank's loss over its own tokens. Gradients of parameters from one rank's loss arrive on every
rank whose activations it read, so the sum over the group of every rank's parameter gradients is the gradient of the
sum of the ranks' losses (FSDP2's reduce-scatter over the same ranks averages it: a per-rank mean loss then gives
the global mean, for equal label counts per piece).

Not supported with context parallelism: a cache (decoding), ``attention_mask`` (padding) and ``cu_seqlens`` (packed
documents); KDA and MLA mixers only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from kimi_linear.layers import KimiDeltaAttention, NoPEMLA
from kimi_linear.layers.context_parallel import ContextParallel

__all__ = ["ContextParallel", "enable_context_parallel", "forward_context_parallel", "new_context_parallel_groups"]


def _check_equal_pieces(T: int, cp: ContextParallel, device: torch.device) -> None:
    """Every rank's piece must have the same length (the latent all-gather moves equal pieces)."""
    mine = torch.tensor([T], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(mine) for _ in range(cp.world)]
    dist.all_gather(lengths, mine, group=cp.group)
    got = [int(n) for n in torch.cat(lengths).tolist()]
    if len(set(got)) != 1:
        raise ValueError(f"`input_ids` pieces differ in length across the context-parallel ranks: {got}; split "
                         "each row into equal contiguous pieces (ContextParallel.split)")


def forward_context_parallel(
    model: nn.Module,
    input_ids: torch.Tensor,
    cp: ContextParallel,
    attention_mask: torch.Tensor | None = None,
    cache: object | None = None,
    cu_seqlens: torch.Tensor | None = None,
    logits_to_keep: int = 0,
):
    """``KimiLinearForCausalLM.forward`` on this rank's piece input_ids [B, T] (checked ids) -> CausalLMOutput with
    logits [B, T, vocab] of the local tokens (the last ``logits_to_keep`` local positions when > 0)."""
    from .modeling import CausalLMOutput

    if cache is not None or attention_mask is not None or cu_seqlens is not None:
        raise ValueError("`context_parallel` cannot be combined with `cache`, `attention_mask` or `cu_seqlens`: it "
                         "trains on whole rows split along time")
    if not isinstance(cp, ContextParallel):
        raise TypeError(f"`context_parallel` must be a ContextParallel, got {type(cp).__name__}")
    for i, layer in enumerate(model.model.layers):
        if not isinstance(layer.self_attn, KimiDeltaAttention | NoPEMLA):
            raise ValueError(f"`context_parallel` supports KDA and MLA layers; layer {i} is "
                             f"{type(layer.self_attn).__name__}")
    B, T = input_ids.shape
    _check_equal_pieces(T, cp, input_ids.device)
    limit = model.config.max_position_embeddings
    if T * cp.world > limit:
        raise ValueError(f"sequence of {T * cp.world} tokens ({cp.world} pieces of {T}) exceeds the configured "
                         f"context `max_position_embeddings`/`model_max_length` = {limit}")
    x = model.model.embed_tokens(input_ids)
    x = model.model.run_layers(x, None, None, None, context_parallel=cp)
    if logits_to_keep > 0:
        x = x[:, -logits_to_keep:]
    return CausalLMOutput(logits=model.lm_head(model.model.norm(x)), cache=None)


def enable_context_parallel(model: nn.Module, cp: ContextParallel) -> RemovableHandle:
    """Make every later training-mode ``model(...)`` call run context-parallel under ``cp`` (a forward pre-hook adds
    ``context_parallel=cp``), for code that calls the model without knowing about it (the Trainer). In eval mode
    calls run unchanged, on whole rows (held-out evaluation then needs no split: every rank evaluates everything,
    as under data parallelism). Call it after ``fully_shard``; ``handle.remove()`` undoes it."""
    if not isinstance(cp, ContextParallel):
        raise TypeError(f"`cp` must be a ContextParallel, got {type(cp).__name__}")

    def add_cp(module, args, kwargs):
        if module.training:
            kwargs.setdefault("context_parallel", cp)
        return args, kwargs

    return model.register_forward_pre_hook(add_cp, with_kwargs=True)


def new_context_parallel_groups(size: int) -> tuple[ContextParallel, int, int]:
    """Split the default group into consecutive blocks of ``size`` ranks, one context-parallel group each (on one
    host these share the fastest links); the blocks are the data-parallel replicas. Returns (this rank's
    ContextParallel, data-parallel rank, data-parallel world). Every rank must call it (``new_group`` is
    collective)."""
    if not dist.is_initialized():
        raise ValueError("context parallelism needs an initialised torch.distributed process group")
    world, rank = dist.get_world_size(), dist.get_rank()
    if size < 1 or world % size:
        raise ValueError(f"`size` (context-parallel ranks) must divide the world size {world}, got {size}")
    mine = None
    for first in range(0, world, size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            mine = group
    return ContextParallel.of(mine), rank // size, world // size
