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


def _peer(group: dist.ProcessGroup | None, rank: int) -> int:
    """Global rank of ``rank`` within ``group``."""
    return dist.get_global_rank(group, rank) if group else rank


class _ContextParallelKDA(torch.autograd.Function):
    """Receives the incoming state, runs ``chunk_kda`` on the local tokens, sends the outgoing state; backward the
    reverse. The forward keeps only its inputs and the incoming state (``save_for_backward``, so activation
    checkpointing can drop them too); the backward recomputes the local operator with gradients and differentiates
    it (one more local forward, the same trade as the Triton kernels' own recomputing backward)."""

    @staticmethod
    def forward(ctx, options, group, q, k, v, g, beta, A_log, dt_bias):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        B, HV, K, V = q.shape[0], v.shape[2], q.shape[3], v.shape[3]
        S_in = torch.zeros(B, HV, K, V, dtype=torch.float32, device=q.device)
        if rank > 0:
            dist.recv(S_in, src=_peer(group, rank - 1), group=group)
        o, S_out = chunk_kda(q, k, v, g, beta, initial_state=S_in, output_final_state=True, A_log=A_log,
                             dt_bias=dt_bias, **options)
        if rank < world - 1:
            dist.send(S_out, dst=_peer(group, rank + 1), group=group)
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, S_in)
        ctx.group, ctx.options = group, options
        return o, S_out

    @staticmethod
    def backward(ctx, do, dS_final):
        group = ctx.group
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        # Unpack first: under activation checkpointing this re-runs the layer's forward, whose messages must
        # flow in step on every rank before any rank waits for a backward message.
        *inputs, S_in = ctx.saved_tensors
        needs = ctx.needs_input_grad[2:]
        dS_out = torch.zeros_like(S_in)
        if rank < world - 1:
            dist.recv(dS_out, src=_peer(group, rank + 1), group=group)
        if dS_final is not None:
            dS_out = dS_out + dS_final
        with torch.enable_grad():
            leaves = [None if x is None else x.detach().requires_grad_(need) for x, need in zip(inputs, needs)]
            S_leaf = S_in.detach().requires_grad_(rank > 0)
            o, S_out = chunk_kda(*leaves[:5], initial_state=S_leaf, output_final_state=True, A_log=leaves[5],
                                 dt_bias=leaves[6], **ctx.options)
            wrt = [x for x in (*leaves, S_leaf) if x is not None and x.requires_grad]
            do = torch.zeros_like(o) if do is None else do
            got = iter(torch.autograd.grad([o, S_out], wrt, [do, dS_out], allow_unused=True))
        grads = [next(got) if x is not None and x.requires_grad else None for x in leaves]
        if rank > 0:
            grad_in = next(got)
            dist.send(torch.zeros_like(S_in) if grad_in is None else grad_in, dst=_peer(group, rank - 1), group=group)
        return (None, None, *grads)


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
