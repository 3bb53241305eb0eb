"""Context parallelism through the whole model on CPU (gloo, 2 processes): each row split along time into two
pieces of 77 tokens (the split is not a KDA chunk boundary), forward and backward equal one process on the whole
rows -- plain, with activation checkpointing, and with every Kimi K3 switch -- and an FSDP2 training step over the
pieces equals a single-process step on the whole batch."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from kimi_linear.layers.context_parallel import GlobalCausal
from kimi_linear.model import KimiLinearForCausalLM, preset_config
from kimi_linear.model.context_parallel import (
    ContextParallel,
    enable_context_parallel,
    new_context_parallel_groups,
)
from kimi_linear.train.data import TaskSource
from kimi_linear.train.distributed import (
    ContextParallelSource,
    ContextParallelTrainer,
    checkpoint_layers,
    full_model_state,
    shard_model,
)
from kimi_linear.train.tasks import get_task
from kimi_linear.train.trainer import TrainConfig, Trainer, evaluate

B, T = 2, 154                       # 77 tokens per rank: rank 1 starts inside the second 64-token chunk
VOCAB = 64
# Two KDA and two MLA layers, interleaved; MoE from layer 2 on (tiny's first_k_dense_replace = 1).
LAYOUT = dict(kda_layers=[1, 3], full_attn_layers=[2, 4], head_dim=32, num_heads=2, short_conv_kernel_size=4)
VARIANTS = ("plain", "checkpointed", "k3")
TASK = get_task("mqar", num_keys=32, num_values=32, num_noise=8, max_pairs=4)
# AdamW's first step moves a weight by ~lr whatever its gradient's size, so a gradient that is zero up to summation
# order (the pieces sum in another order than one process) can move either way; a small lr keeps that in bounds.
STEP = TrainConfig(steps=1, lr=2e-4, warmup=1, progress=False)


def make_model(variant: str, vocab: int = VOCAB) -> KimiLinearForCausalLM:
    sizes = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4)
    if variant == "k3":             # AttnRes, gate lower bound, full-rank gate, gated MLA, LatentMoE, SiTU
        lac = {**LAYOUT, "gate_lower_bound": -5.0, "use_full_rank_gate": True}
        config = preset_config("k3-tiny", **sizes, routed_expert_hidden_size=32, linear_attn_config=lac)
    else:
        config = preset_config("tiny", **sizes, linear_attn_config=LAYOUT)
    model = KimiLinearForCausalLM(config).init_weights(seed=0)
    with torch.no_grad():           # non-zero AttnRes pseudo-queries, so the depth mixes are not uniform
        for name, p in model.named_parameters():
            if name.endswith("res_proj.weight"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return checkpoint_layers(model) if variant == "checkpointed" else model


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (B, T + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


def loss_and_grads(model, ids, labels, n_total: int, **kwargs):
    """Summed cross-entropy over the given tokens / n_total (so the pieces' losses add up to the whole's mean)."""
    logits = model(ids, **kwargs).logits
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / n_total
    loss.backward()
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    return logits.detach(), loss.detach(), grads


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _errors(cp: ContextParallel, ids: torch.Tensor) -> dict[str, str]:
    """Misuse raises ValueError on every rank (checks come before, or agree across, any collective)."""
    model = make_model("plain")
    piece = cp.split(ids)
    cases = {
        "mask": lambda: model(piece, attention_mask=torch.ones_like(piece), context_parallel=cp),
        "unequal": lambda: model(piece[:, : 70 + 7 * cp.rank], context_parallel=cp),
        "short": lambda: model(piece[:, :2], context_parallel=cp),
        "split": lambda: cp.split(ids[:, :7]),
    }
    out = {}
    for name, call in cases.items():
        try:
            call()
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    return out


def _worker(rank: int, world: int, port: int, out_dir: str, job: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        cp, dp_rank, dp_world = new_context_parallel_groups(world)     # a real subgroup, not the default one
        if job == "model":
            ids, labels = data()
            result = {}
            for variant in VARIANTS:
                model = make_model(variant)
                logits, loss, grads = loss_and_grads(model, cp.split(ids), cp.split(labels), labels.numel(),
                                                     context_parallel=cp)
                for g in grads.values():        # every rank's loss reaches every rank's parameters
                    dist.all_reduce(g, group=cp.group)
                dist.all_reduce(loss, group=cp.group)
                result[variant] = {"logits": logits, "loss": loss, "grads": grads}
            result["errors"] = _errors(cp, ids)
        else:  # one Trainer step, FSDP2 over the two ranks, each holding its piece of every row
            model = shard_model(make_model("plain", TASK.vocab_size))
            enable_context_parallel(model, cp)
            source = ContextParallelSource(TaskSource(TASK, batch_size=4, seq_len=96, seed=0), cp, dp_rank, dp_world)
            trainer = ContextParallelTrainer(model, source, STEP)
            record = trainer.train_step()
            result = {"loss": record["loss"], "state": full_model_state(trainer.model),
                      "eval": evaluate(trainer.model, source, torch.device("cpu"))}
        torch.save(result, os.path.join(out_dir, f"{job}-r{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _spawn(out_dir, job: str) -> list[dict]:
    mp.spawn(_worker, args=(2, _free_port(), str(out_dir), job), nprocs=2, join=True)
    return [torch.load(out_dir / f"{job}-r{r}.pt", weights_only=False) for r in range(2)]


@pytest.fixture(scope="module")
def model_run(tmp_path_factory):
    return _spawn(tmp_path_factory.mktemp("cp"), "model")


@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_and_backward_equal_one_process(model_run, variant):
    ids, labels = data()
    logits, loss, grads = loss_and_grads(make_model(variant), ids, labels, labels.numel())
    _, _, exact = loss_and_grads(make_model(variant).double(), ids, labels, labels.numel())
    r0, r1 = (r[variant] for r in model_run)
    assert rel(torch.cat([r0["logits"], r1["logits"]], 1), logits) < 1e-5
    assert abs(r0["loss"].item() - loss.item()) <= 1e-6 * abs(loss.item())
    assert torch.equal(r0["grads"]["lm_head.weight"], r1["grads"]["lm_head.weight"])     # the same sum on both
    assert len(grads) == len(r0["grads"])
    # 1e-5 relative, or twice float32's own error (against float64) where a gradient is a sum that cancels that
    # much (K3's AttnRes pseudo-queries: ~7e-5 in one process alone).
    bad = {}
    for n, g in grads.items():
        err, tol = rel(r0["grads"][n], g), max(1e-5, 2 * rel(g.double(), exact[n]))
        if err > tol:
            bad[n] = (err, tol)
    assert not bad, bad


def test_misuse_names_the_argument(model_run):
    for errors in (r["errors"] for r in model_run):
        assert "`context_parallel` cannot be combined with `cache`, `attention_mask`" in errors["mask"]
        assert "`input_ids` pieces differ in length" in errors["unequal"] and "[70, 77]" in errors["unequal"]
        assert "shorter than the 3 rows the short conv reads" in errors["short"]
        assert "`x` has 7 positions along dim 1, not divisible by the 2 ranks" in errors["split"]


@pytest.mark.slow
def test_fsdp2_context_parallel_step_equals_one_process(tmp_path):
    r0, r1 = _spawn(tmp_path, "trainer")
    trainer = Trainer(make_model("plain", TASK.vocab_size), TaskSource(TASK, batch_size=4, seq_len=96, seed=0),
                      STEP)
    loss = trainer.train_step()["loss"]
    # MQAR's labels all sit in the second half of a row: rank 0's piece has none, so only a loss normalised by the
    # whole batch's labelled tokens (ContextParallelTrainer) matches one process.
    assert r0["loss"] == r1["loss"]
    assert abs(r0["loss"] - loss) <= 1e-5 * abs(loss), (r0["loss"], loss)
    ref = trainer.model.state_dict()
    bad = {n: rel(v, ref[n]) for n, v in r0["state"].items() if rel(v, ref[n]) > 1e-5}
    assert not bad, bad
    held_out = evaluate(trainer.model, trainer.source, torch.device("cpu"))     # whole rows, every rank alike
    for r in (r0, r1):
        assert abs(r["eval"]["loss"] - held_out["loss"]) <= 1e-5 * held_out["loss"]
        assert r["eval"]["accuracy"] == held_out["accuracy"]


def test_global_causal_mask_matches_materialised_and_takes_mixed_dtypes():
    """Queries at global positions 3..5 of 6 keys: lower-right causal. MLA's k can be float32 next to a bf16 q under
    autocast; the mask casts to one dtype (PyTorch's own CausalBias hands mixed dtypes to kernels that refuse them)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 3, 8, generator=gen).bfloat16()
    k, v = torch.randn(1, 2, 6, 8, generator=gen), torch.randn(1, 2, 6, 8, generator=gen).bfloat16()
    allowed = torch.ones(3, 6, dtype=torch.bool).tril(3)
    ref = F.scaled_dot_product_attention(q.float(), k, v.float(), attn_mask=allowed)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=GlobalCausal(3, 6))
    assert out.dtype == torch.float32 and torch.equal(out, ref)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=GlobalCausal(3, 6))
    assert out.dtype == torch.bfloat16 and rel(out.float(), ref) < 1e-2
