"""Deterministic batch sources for the trainer: synthetic tasks (and, later, packed text)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .tasks import Task, get_task

EVAL_SEED_OFFSET = 1_000_003  # held-out batches come from seeds no training step uses


def _generator(seed: int, step: int, micro: int) -> torch.Generator:
    return torch.Generator().manual_seed(hash((seed, step, micro)) & 0x7FFF_FFFF_FFFF_FFFF)


class TaskSource:
    """Batches of a synthetic task; batch ``(step, micro)`` is the same on every run with the same seed."""

    def __init__(self, task: str | Task, batch_size: int, seq_len: int, seed: int = 0, eval_batches: int = 4):
        self.task = get_task(task) if isinstance(task, str) else task
        self.batch_size, self.seq_len, self.seed, self.n_eval = batch_size, seq_len, seed, eval_batches

    def batch(self, step: int, micro: int = 0) -> dict[str, torch.Tensor]:
        ids, labels = self.task.batch(self.batch_size, self.seq_len, _generator(self.seed, step, micro))
        return {"input_ids": ids, "labels": labels}

    def eval_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        for i in range(self.n_eval):
            ids, labels = self.task.batch(self.batch_size, self.seq_len,
                                          _generator(self.seed + EVAL_SEED_OFFSET, i, 0))
            yield {"input_ids": ids, "labels": labels}
