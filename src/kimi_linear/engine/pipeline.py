"""A pipelined decode step in flight: launched on the device, its greedy ids not read back yet.

The engine (``EngineConfig.pipeline_decode``, see :mod:`.engine`) launches decode step N before it reads step N-1's
tokens back. What it keeps of step N meanwhile is an :class:`InFlight`: the rows as launched, their greedy ids on
the device (step N+1's input ids) and a copy of them on its way to the host, with an event that fires when that copy
has landed: reading the tokens back waits for that event alone, not for steps launched after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .sequence import Sequence, Status


def start_readback(ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """Start copying device ``ids`` to the host: (host tensor, CUDA event recorded after the copy, or None on a
    CPU, where the copy is done on return). Valid on the host once the event has fired."""
    if ids.device.type != "cuda":
        return ids.clone(), None
    host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
    host.copy_(ids, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A host list as an int64 tensor on ``device``, without waiting for the device (page-locked staging)."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass
class InFlight:
    """One launched decode step. ``slots``: each row's KDA slot at launch; a row that has finished (EOS, stop,
    abort, error) since the launch is no longer *live*, and its token from this step is discarded."""

    rows: list[Sequence]
    slots: list[int]
    greedy: torch.Tensor            # [n] int64 on the device (-1: NaN logits)
    host: torch.Tensor              # [n] their host copy, valid once ``ready`` has fired
    ready: Any                      # torch.cuda.Event, or None on a CPU

    @classmethod
    def launched(cls, rows: list[Sequence], greedy: torch.Tensor) -> InFlight:
        host, ready = start_readback(greedy)
        return cls(list(rows), [s.slot for s in rows], greedy, host, ready)  # type: ignore[misc]

    def is_live(self, r: int) -> bool:
        s = self.rows[r]
        return s.status == Status.RUNNING and s.slot == self.slots[r]

    def live_rows(self) -> list[Sequence]:
        return [s for r, s in enumerate(self.rows) if self.is_live(r)]

    def tokens(self) -> list[int]:
        """The rows' greedy ids on the host: waits for this step's copy only."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()

    def ids_for(self, rows: list[Sequence]) -> torch.Tensor:
        """The greedy ids of ``rows`` (a subsequence of this step's rows) on the device, in that order: the next
        step's input ids, never through the host."""
        if len(rows) == len(self.rows):
            return self.greedy
        pos = {id(s): r for r, s in enumerate(self.rows)}
        return self.greedy.index_select(0, to_device([pos[id(s)] for s in rows], self.greedy.device))
