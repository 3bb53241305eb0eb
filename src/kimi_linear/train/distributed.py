"""Training on several processes with PyTorch's own stack: ``torchrun`` + FSDP2 (``fully_shard``).

    torchrun --nproc-per-node 2 -m kimi_linear.cli train --task mqar --out runs/mqar   (see ``kimi-linear train``)

- Each decoder layer is its own FSDP2 unit (parameters gathered just before the layer runs, freed after), then the
  root module (embeddings, final norm, head).
- Data parallel: every rank builds the same global batch (sources are deterministic in the step) and keeps rows
  ``rank::world`` of it, so ``world`` ranks with batch B see exactly what one process with batch B sees.
- Checkpoints: ``torch.distributed.checkpoint`` (DCP) writes each rank's shards with the global layout, so a run
  saved on N ranks loads on M ranks; rank 0 also exports the full model in the Hugging Face format
  (docs/checkpoint.md) for ``kimi-linear generate``, transformers and vLLM.
- Context parallel (``--context-parallel C``): consecutive blocks of C ranks each split every row along time
  (:class:`ContextParallelSource`, :mod:`kimi_linear.model.context_parallel`); the blocks are data parallel. FSDP2
  still shards over all ranks; :class:`ContextParallelTrainer` scales each rank's loss so that FSDP's average over
  ranks is the whole batch's mean loss.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kimi_linear.layers.context_parallel import ContextParallel

from .tasks import IGNORE
from .trainer import BatchSource, Trainer

DCP_DIR = "dcp"


def init_distributed() -> tuple[int, int, torch.device]:
    """Join the process group that ``torchrun`` describes (NCCL on GPUs, gloo on CPUs); (rank, world, device)."""
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


def shard_model(model: torch.nn.Module, bf16: bool = False) -> torch.nn.Module:
    """FSDP2: one unit per decoder layer, then the root. ``bf16``: compute in bfloat16, reduce in float32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # FSDP2 shards each parameter's storage, so parameters must own contiguous memory: undo the CPU decode layout
    # (weights stored transposed or as views of one packed matrix; the packed fast paths notice and step aside).
    with torch.no_grad():
        for p in model.parameters():
            if not p.is_contiguous() or p.storage_offset() or p.untyped_storage().nbytes() != p.nbytes:
                p.data = p.data.contiguous().clone()
    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    kw = {"mesh": mesh, **({"mp_policy": mp} if mp is not None else {})}
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


class ShardedSource:
    """Rows ``rank::world`` of every training batch of ``source`` (which must hold [B, T] rows with B divisible by
    ``world``); evaluation batches are not split (every rank evaluates all, as FSDP needs every rank in every
    forward)."""

    def __init__(self, source: BatchSource, rank: int, world: int) -> None:
        self.source, self.rank, self.world = source, rank, world

    def batch(self, step: int, micro: int) -> dict[str, torch.Tensor]:
        full = self.source.batch(step, micro)
        if "cu_seqlens" in full:
            raise ValueError("packed (cu_seqlens) batches cannot be split by rows; give each rank its own source")
        B = full["input_ids"].shape[0]
        if B % self.world:
            raise ValueError(f"batch size {B} is not divisible by the world size {self.world}")
        return {k: v[self.rank :: self.world] for k, v in full.items()}

    def eval_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        return self.source.eval_batches()


class ContextParallelSource:
    """Batches for ranks that are context parallel inside a group and data parallel across groups: rows
    ``dp_rank::dp_world`` of every training batch, and of each row this rank's contiguous piece along time
    (``cp.split``), plus ``loss_scale`` (see :class:`ContextParallelTrainer`). Evaluation batches are whole rows:
    :func:`~kimi_linear.model.context_parallel.enable_context_parallel` runs eval-mode forwards unsplit."""

    def __init__(self, source: BatchSource, cp: ContextParallel, dp_rank: int = 0, dp_world: int = 1) -> None:
        self.source, self.cp, self.dp_rank, self.dp_world = source, cp, dp_rank, dp_world

    def batch(self, step: int, micro: int) -> dict[str, torch.Tensor]:
        full = self.source.batch(step, micro)
        if "cu_seqlens" in full:
            raise ValueError("packed (cu_seqlens) batches cannot be split along time: context parallelism trains on "
                             "whole [B, T] rows (e.g. `--task`), not on packed documents")
        B = full["input_ids"].shape[0]
        if B % self.dp_world:
            raise ValueError(f"batch size {B} is not divisible by the {self.dp_world} data-parallel replicas")
        labelled = int((full["labels"] != IGNORE).sum())
        piece = {k: self.cp.split(v[self.dp_rank :: self.dp_world]) for k, v in full.items()}
        piece["loss_scale"] = torch.tensor(self.dp_world * self.cp.world / max(1, labelled))
        return piece

    def eval_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        return self.source.eval_batches()


class ContextParallelTrainer(Trainer):
    """A :class:`Trainer` whose loss is normalised by the labelled tokens of the whole global batch.

    A piece of a row may hold any share of its labels (MQAR's queries all sit at the end of the row), so each
    rank's mean over its own labels, averaged over ranks by FSDP, would weight pieces instead of tokens (and be 0/0
    on a piece with none). Here rank r's loss is ``sum(CE over its labels) * loss_scale`` with ``loss_scale = world
    / N``, N the labelled tokens of the global batch (every rank builds the whole batch, so N needs no
    communication): FSDP's average over the ranks is the whole batch's mean, as one process computes it, and so is
    the reported loss.
    """

    def batch_loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        ce = F.cross_entropy(logits.float().flatten(0, -2), batch["labels"].flatten(), ignore_index=IGNORE,
                             reduction="sum")
        return ce * batch["loss_scale"]


def checkpoint_layers(model: torch.nn.Module) -> torch.nn.Module:
    """Activation checkpointing per decoder layer (non-reentrant): the forward keeps only each layer's inputs and
    the backward recomputes the layer. Call before :func:`shard_model`, so FSDP2 gathers the weights around the
    recomputation too. Parameter names are unchanged (the layer's ``forward`` is wrapped, not the module)."""
    from torch.utils.checkpoint import checkpoint

    for layer in model.model.layers:
        def forward(*args, _inner=layer.forward, **kwargs):
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        layer.forward = forward
    return model


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict on CPU: every rank takes part in the gather, rank 0 receives the tensors (the
    other ranks get an empty dict: with ``cpu_offload`` PyTorch keeps the full copy on rank 0 only)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_sharded(trainer, path: str | os.PathLike, tokenizer=None) -> None:
    """DCP checkpoint of model + optimizer (+ step) under ``path/dcp``; rank 0 exports the full model (and the
    tokenizer) to ``path``. Written under a temporary name that rank 0 renames once every rank has finished."""
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from kimi_linear.model import KimiLinearForCausalLM

    path = os.fspath(path)
    tmp = f"{path}.tmp-dist"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(tmp, DCP_DIR))
    full = full_model_state(trainer.model)
    if dist.get_rank() == 0:
        export = KimiLinearForCausalLM(trainer.model.config)
        export.generation_config = trainer.model.generation_config
        export.load_state_dict(full)
        export.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        torch.save({"step": trainer.step, "history": trainer.history}, os.path.join(tmp, "dist_state.pt"))
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    dist.barrier()


def load_sharded(trainer, path: str | os.PathLike) -> None:
    """Load a :func:`save_sharded` checkpoint into ``trainer`` (any world size, sharded or not)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = os.fspath(path)
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=os.path.join(path, DCP_DIR))
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    meta = torch.load(os.path.join(path, "dist_state.pt"), weights_only=False)
    trainer.step, trainer.history = int(meta["step"]), list(meta["history"])
