"""FSDP2 on CPU (gloo, 2 processes) with every K3 switch on: one training step equals a single process.

AttnRes layers receive the depth state instead of a tensor; this checks that FSDP2 still unshards each layer's
parameters (the state goes through the layer's ``forward``, so FSDP's hooks fire) and reduces their gradients."""

from __future__ import annotations

import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kimi_linear.model import KimiLinearForCausalLM, preset_config
from kimi_linear.train.data import TaskSource
from kimi_linear.train.distributed import ShardedSource, full_model_state, shard_model
from kimi_linear.train.tasks import get_task
from kimi_linear.train.trainer import TrainConfig, Trainer

TASK = get_task("mqar", num_keys=32, num_values=32, num_noise=8, max_pairs=4)


def make_trainer(world_rank: tuple[int, int] | None = None) -> Trainer:
    config = preset_config("k3-tiny", vocab_size=TASK.vocab_size, hidden_size=64, intermediate_size=128,
                           moe_intermediate_size=32, routed_expert_hidden_size=32, num_experts=4)
    model = KimiLinearForCausalLM(config).init_weights(seed=0)
    with torch.no_grad():  # non-zero pseudo-queries, so the depth mixes are not uniform
        for name, p in model.named_parameters():
            if name.endswith("res_proj.weight"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    source = TaskSource(TASK, batch_size=4, seq_len=32, seed=0)
    if world_rank is not None:
        model = shard_model(model)
        source = ShardedSource(source, *world_rank)
    # lr: AdamW's first step moves a weight by ~lr whatever its gradient's size, so a gradient that is zero up to
    # summation order (ranks reduce in another order) can move either way; a small lr keeps that inside the bound
    # (2e-4 gave 5.8e-5 with MQAR's scattered queries). A weight still moves by ~1e-5, ~5e-4 of its tensor's norm,
    # so gradients that disagree in sign across many entries still fail the 1e-5 bound by far.
    return Trainer(model, source, TrainConfig(steps=1, lr=1e-5, warmup=1, progress=False))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        trainer = make_trainer((rank, world))
        loss = trainer.train_step()["loss"]
        state = full_model_state(trainer.model)
        if rank == 0:
            torch.save({"loss": loss, "state": state}, os.path.join(out_dir, "fsdp.pt"))
    finally:
        dist.destroy_process_group()
    # Results written, group destroyed: leave without the interpreter's teardown, where a gloo rank aborted in CI
    # ('terminate called without an active exception', 2026-12-01, once here, twice in bench/distributed.py, which
    # takes the same mitigation). An error above still propagates and fails the spawn.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.slow
def test_fsdp2_step_with_k3_switches_equals_single_process(tmp_path):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    result = torch.load(tmp_path / "fsdp.pt", weights_only=False)
    single = make_trainer()
    loss = single.train_step()["loss"]
    assert abs(result["loss"] - loss) <= 1e-5 * abs(loss), (result["loss"], loss)
    ref = single.model.state_dict()
    start = make_trainer().model.state_dict()
    assert any(n.endswith("attn_res_proj.weight") for n in result["state"])
    moved = [n for n, v in result["state"].items() if not torch.equal(v, start[n])]
    assert len(moved) > 0.9 * len(start), sorted(set(start) - set(moved))[:5]
    for name, value in result["state"].items():
        err = ((value - ref[name]).norm() / ref[name].norm().clamp_min(1e-12)).item()
        assert err < 1e-5, (name, err)
