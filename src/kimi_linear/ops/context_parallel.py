"""Context parallelism for KDA: one long sequence split along time across the ranks of a process group.

Rank r holds tokens ``[t_r, t_{r+1})`` of every sequence. The recurrence makes the split exact: rank r starts from
the state rank r-1 ended with, so the ranks run one after another (rank 0 first), each passing its final state
[B, HV, K, V] to the next; the backward runs in reverse, each rank passing the gradient of its initial state back.
What is split is memory (activations of 1/world of the sequence per rank), not time: this is how a sequence that
fits no single device is trained. (MLA layers, which attend to every earlier token, need the latents of all earlier
ranks instead; that belongs to the layer, not to this operator.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .chunk import chunk_kda


class _ContextParallelKDA(torch.autograd.Function):
    """Receives the incoming state, runs ``chunk_kda`` on the local tokens, sends the outgoing state; backward the
    reverse. The local computation is recorded in its own autograd graph so the backward can run it on demand."""

    @staticmethod
    def forward(ctx, options, group, q, k, v, g, beta, A_log, dt_bias):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        B, HV, K, V = q.shape[0], v.shape[2], q.shape[3], v.shape[3]
        S_in = torch.zeros(B, HV, K, V, dtype=torch.float32, device=q.device)
        if rank > 0:
            dist.recv(S_in, src=dist.get_global_rank(group, rank - 1) if group else rank - 1, group=group)
        inputs = (q, k, v, g, beta, A_log, dt_bias)
        with torch.enable_grad():
            leaves = [None if x is None else x.detach().requires_grad_(x.requires_grad) for x in inputs]
            S_leaf = S_in.requires_grad_(rank > 0)
            o, S_out = chunk_kda(*leaves[:5], initial_state=S_leaf, output_final_state=True, A_log=leaves[5],
                                 dt_bias=leaves[6], **options)
        if rank < world - 1:
            dist.send(S_out.detach(), dst=dist.get_global_rank(group, rank + 1) if group else rank + 1, group=group)
        ctx.group, ctx.leaves, ctx.S_leaf, ctx.outputs = group, leaves, S_leaf, (o, S_out)
        return o.detach(), S_out.detach()

    @staticmethod
    def backward(ctx, do, dS_final):
        group = ctx.group
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        o, S_out = ctx.outputs
        dS_out = torch.zeros_like(S_out)
        if rank < world - 1:
            dist.recv(dS_out, src=dist.get_global_rank(group, rank + 1) if group else rank + 1, group=group)
        if dS_final is not None:
            dS_out = dS_out + dS_final
        do = torch.zeros_like(o) if do is None else do
        torch.autograd.backward([o, S_out], [do, dS_out])
        if rank > 0:
            grad_in = ctx.S_leaf.grad if ctx.S_leaf.grad is not None else torch.zeros_like(ctx.S_leaf)
            dist.send(grad_in, dst=dist.get_global_rank(group, rank - 1) if group else rank - 1, group=group)
        return (None, None, *[None if x is None or not x.requires_grad else x.grad for x in ctx.leaves])


def context_parallel_chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunk_kda`` over a sequence split along T across ``group`` (rank order = time order).

    Inputs are this rank's tokens ([B, T_local, ...], any T_local per rank, no ``cu_seqlens`` and no
    ``initial_state``: the state comes from the previous rank). ``options`` are chunk_kda's keyword options
    (``scale``, ``use_qk_l2norm_in_kernel``, ``use_gate_in_kernel``, ``use_beta_sigmoid_in_kernel``,
    ``lower_bound``, ...). Returns ``(o, state)``: the local output and the state after the local tokens (on the
    last rank, the sequence's final state). Differentiable in every tensor; every rank of ``group`` must call it.
    """
    for name in ("initial_state", "cu_seqlens", "output_final_state"):
        if name in options:
            raise ValueError(f"`{name}` is not supported by context_parallel_chunk_kda (the state flows between "
                             "ranks; one sequence per batch row)")
    if not dist.is_initialized():
        raise ValueError("context_parallel_chunk_kda needs an initialised torch.distributed process group")
    return _ContextParallelKDA.apply(options, group, q, k, v, g, beta, A_log, dt_bias)
