"""Context-parallel KDA over 2 CPU ranks (gloo): forward and backward equal one process on the whole sequence."""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kimi_linear.ops import chunk_kda
from kimi_linear.ops.context_parallel import context_parallel_chunk_kda

from .kda_cases import make_inputs, rel_err

SPLIT = 77                   # rank 0 holds tokens [0, 77), rank 1 [77, 200): not a chunk boundary on purpose
OPTIONS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
               lower_bound=-5.0)


def inputs():
    x = make_inputs(B=2, T=200, H=2, HV=4, raw=True, initial_state=False, seed=31)
    gen = torch.Generator().manual_seed(32)
    x["A_log"], x["dt_bias"] = torch.randn(4, generator=gen), torch.randn(4 * 32, generator=gen)
    return x


def names():
    return ("q", "k", "v", "g", "beta", "A_log", "dt_bias")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        x = inputs()
        sl = slice(0, SPLIT) if rank == 0 else slice(SPLIT, None)
        local = {n: (x[n][:, sl] if n not in ("A_log", "dt_bias") else x[n]).clone().requires_grad_() for n in names()}
        o, S = context_parallel_chunk_kda(*(local[n] for n in ("q", "k", "v", "g", "beta")), A_log=local["A_log"],
                                          dt_bias=local["dt_bias"], **OPTIONS)
        w = torch.randn(2, 200, 4, 16, generator=torch.Generator().manual_seed(33))[:, sl]
        loss = (o * w).sum() + (S.square().sum() if rank == world - 1 else 0)
        loss.backward()
        torch.save({"o": o, "S": S, "grads": {n: t.grad for n, t in local.items()}}, os.path.join(out, f"r{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_context_parallel_equals_single_process(tmp_path):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"r{i}.pt", weights_only=False) for i in range(2))
    x = inputs()
    full = {n: x[n].clone().requires_grad_() for n in names()}
    o, S = chunk_kda(*(full[n] for n in ("q", "k", "v", "g", "beta")), A_log=full["A_log"], dt_bias=full["dt_bias"],
                     output_final_state=True, **OPTIONS)
    w = torch.randn(2, 200, 4, 16, generator=torch.Generator().manual_seed(33))
    ((o * w).sum() + S.square().sum()).backward()
    assert rel_err(torch.cat([r0["o"], r1["o"]], 1), o) < 1e-5
    assert rel_err(r1["S"], S) < 1e-5
    for n in ("q", "k", "v", "g", "beta"):
        assert rel_err(torch.cat([r0["grads"][n], r1["grads"][n]], 1), full[n].grad) < 1e-4, n
    for n in ("A_log", "dt_bias"):                                   # shared parameters: the ranks' grads add up
        assert rel_err(r0["grads"][n] + r1["grads"][n], full[n].grad) < 1e-4, n


def test_activation_checkpointing_drops_the_operator_inputs(tmp_path):
    """Under non-reentrant checkpointing nothing of the operator outlives the forward but what the checkpoint keeps
    (the function's inputs): the operator's own inputs, intermediates of the checkpointed function, are freed and
    recomputed in the backward, which still gives the un-checkpointed gradients. One rank (gloo) suffices."""
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils.checkpoint import checkpoint

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        x = inputs()
        leaves = {n: x[n].clone().requires_grad_() for n in names()}
        seen = []

        def layer(q, k, v, g, beta):
            q2 = q * 1.5                                        # an activation the operator takes as input
            seen.append(StorageWeakRef(q2.untyped_storage()))       # views and detached copies share it
            o, S = context_parallel_chunk_kda(q2, k, v, g, beta, A_log=leaves["A_log"], dt_bias=leaves["dt_bias"],
                                              **OPTIONS)
            return o.square().sum() + S.square().sum()

        args = [leaves[n] for n in ("q", "k", "v", "g", "beta")]
        loss = checkpoint(layer, *args, use_reentrant=False)
        gc.collect()
        assert seen[0].expired(), "the operator kept its input alive through the forward"
        loss.backward()
        got = {n: t.grad.clone() for n, t in leaves.items()}
        for t in leaves.values():
            t.grad = None
        layer(*args).backward()
        for n in names():
            assert rel_err(got[n], leaves[n].grad) < 1e-6, n
    finally:
        dist.destroy_process_group()
