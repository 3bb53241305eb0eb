"""Context parallelism inside the layers: one sequence split along time into equal contiguous pieces, one per rank.

Rank r of the group holds tokens ``[r * T, (r + 1) * T)`` of every row. Three things cross a rank boundary, each
through a differentiable collective defined here:

- KDA's short causal conv reads the last W-1 projected inputs of the previous rank (:meth:`previous_rows`);
- KDA's recurrence starts from the state the previous rank ended with (:meth:`chunk_kda`, the ops-level operator
  :func:`kimi_linear.ops.context_parallel.context_parallel_chunk_kda`);
- MLA attends to every earlier token: it gathers the latents of all ranks (:meth:`gather_latents`) and attends
  causally from this rank's global query positions. NoPE: nothing else about a position matters.

MoE, MLP, norms, embeddings and the head are token-local and run unchanged on the local piece.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.attention.bias import CausalBias, CausalVariant

from kimi_linear.ops.context_parallel import context_parallel_chunk_kda


class GlobalCausal(CausalBias):
    """SDPA mask for T queries at global positions ``L - T .. L - 1`` against keys ``0 .. L - 1``: PyTorch's
    lower-right ``CausalBias`` (flash attention on GPUs, nothing materialised), with q, k, v brought to one dtype
    first. A ``CausalBias`` dispatches to the fused kernels itself, before autocast would cast SDPA's inputs; given
    mixed dtypes (MLA's k_rope comes through a float32-weighted norm under autocast) the kernels refuse and PyTorch
    falls back to materialising a [T, L] mask, which at long context does not fit."""

    def __init__(self, T: int, L: int) -> None:
        super().__init__(CausalVariant.LOWER_RIGHT, T, L)

    @staticmethod
    def _dispatch(query, key, value, attn_mask, *args, **kwargs):  # type: ignore[override]
        device = query.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
        else:
            dtype = torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)
        return CausalBias._dispatch(query.to(dtype), key.to(dtype), value.to(dtype), attn_mask, *args, **kwargs)


class _GatherTime(torch.autograd.Function):
    """[B, T, C] on each rank -> [B, world * T, C], rank order along time. Backward: the gradient of the gathered
    tensor summed over ranks (each rank's loss reads every piece), this rank's slice of it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None, world: int, rank: int) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x, group=group)
        ctx.group, ctx.world, ctx.rank, ctx.T = group, world, rank, x.shape[1]
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        B, _, C = grad.shape
        T, world = ctx.T, ctx.world
        # Reduce in float32: the pieces of a bf16 gradient from different ranks are added once, here. A
        # reduce-scatter (NCCL, and gloo in the torch this package pins) sends half the bytes of an all-reduce; it
        # scatters along dim 0, so time goes first.
        pieces = grad.float().reshape(B, world, T, C).transpose(0, 1).contiguous()       # [world, B, T, C]
        mine = pieces.new_empty(B, T, C)
        dist.reduce_scatter_tensor(mine, pieces.view(world * B, T, C), group=ctx.group)
        return mine.to(grad.dtype), None, None, None


class _PreviousRows(torch.autograd.Function):
    """The last ``n`` rows of the previous rank's x ([B, n, C]; zeros on rank 0). Backward: the gradient goes back
    to the rank that owns those rows (an all-gather of the tails forward, an all-reduce backward: n is a few rows)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, n: int, group: dist.ProcessGroup | None, world: int, rank: int):
        tail = x[:, x.shape[1] - n :].contiguous()
        parts = [torch.empty_like(tail) for _ in range(world)]
        dist.all_gather(parts, tail, group=group)
        ctx.group, ctx.world, ctx.rank, ctx.n, ctx.shape = group, world, rank, n, x.shape
        return parts[rank - 1] if rank > 0 else torch.zeros_like(tail)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        B, n, C = grad.shape
        world, rank = ctx.world, ctx.rank
        # Row p of `tails` collects the gradient of rank p's tail: this rank's gradient lands in row rank-1.
        tails = grad.new_zeros(world, B, n, C, dtype=torch.float32)
        if rank > 0:
            tails[rank - 1] = grad.float()
        dist.all_reduce(tails, group=ctx.group)
        dx = grad.new_zeros(ctx.shape)
        dx[:, ctx.shape[1] - n :] = tails[rank].to(grad.dtype)
        return dx, None, None, None, None


@dataclass(frozen=True)
class ContextParallel:
    """This rank's place in a sequence split along time across ``group`` (group rank order = time order).

    Every rank of the group must run the same layers in the same order (the layers communicate), on pieces of equal
    length. ``ContextParallel.of(group)`` builds it from an initialised process group.
    """

    group: dist.ProcessGroup | None
    rank: int
    world: int

    @classmethod
    def of(cls, group: dist.ProcessGroup | None = None) -> ContextParallel:
        """This process's description in ``group`` (None: the default group)."""
        if not dist.is_initialized():
            raise ValueError("context parallelism needs an initialised torch.distributed process group")
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    def offset(self, local_len: int) -> int:
        """Global position of this rank's first token when every piece holds ``local_len`` tokens."""
        return self.rank * local_len

    def split(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's equal, contiguous piece of a whole sequence ``x`` along ``dim`` (for data and tests)."""
        n = x.shape[dim]
        if n % self.world:
            raise ValueError(f"`x` has {n} positions along dim {dim}, not divisible by the {self.world} ranks")
        size = n // self.world
        return x.narrow(dim, self.rank * size, size)

    # ------------------------------------------------------------------------------------------- layer pieces
    def previous_rows(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """x: [B, T, C] -> [B, n, C], the previous rank's last ``n`` rows (zeros on rank 0): what a width-(n+1)
        causal conv reads before this rank's first token. Differentiable; needs T >= n on every rank."""
        if x.shape[1] < n:
            raise ValueError(f"context-parallel piece of {x.shape[1]} tokens is shorter than the {n} rows the short "
                             "conv reads from the previous rank; use longer pieces")
        return _PreviousRows.apply(x, n, self.group, self.world, self.rank)

    def gather_latents(self, entry: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """MLA: entry [B, T, W] (latent | k_rope of this rank's tokens) -> (every token's entry up to this rank's
        last one [B, offset + T, W], the causal mask for this rank's queries at global positions: a
        :class:`GlobalCausal` [T, offset + T] that SDPA runs with flash attention on GPUs, or None on rank 0 where
        plain causal attention is exact). Later ranks' latents are gathered too (an all-gather moves equal pieces) but
        not attended to."""
        T = entry.shape[1]
        L = self.offset(T) + T
        everything = _GatherTime.apply(entry, self.group, self.world, self.rank)
        return everything[:, :L], (None if L == T else GlobalCausal(T, L))

    def chunk_kda(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        scale: float | None = None,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        cu_seqlens: torch.Tensor | None = None,
        **options,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``ops.chunk_kda``'s contract on this rank's piece: the initial state comes from the previous rank, so
        ``initial_state`` and ``cu_seqlens`` must be None. Returns (o [B, T, HV, V], state after the local tokens
        when ``output_final_state``)."""
        if initial_state is not None or cu_seqlens is not None:
            raise ValueError("context parallelism takes no `initial_state`/cache and no `cu_seqlens` (packed "
                             "documents): the state flows from rank to rank through one sequence per row")
        # The operator keeps only its inputs (saved for backward, so activation checkpointing drops and recomputes
        # them like the layer's other activations) and recomputes its local graph in its backward.
        o, S = context_parallel_chunk_kda(q, k, v, g, beta, group=self.group, scale=scale, **options)
        return o, (S if output_final_state else None)
