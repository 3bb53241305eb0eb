"""Engine settings: pool sizes come from a memory budget (bytes) or explicit counts."""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


def parse_bytes(text: str | int) -> int:
    """``"2GiB"``, ``"512MB"``, ``"1e9"`` or an int -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"`memory` must be a size like 2GiB, 512MB or 1000000, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass
class EngineConfig:
    """How the engine schedules and how big its two cache pools are.

    max_num_seqs: KDA state slots = most sequences running at once (each needs one fixed-size slot).
    memory: bytes for all cache pools (KDA slots + prefix snapshots + MLA blocks); the MLA block count is what is
        left after the fixed parts. Ignored when ``num_blocks`` is given. ``None`` with no ``num_blocks``: room for
        ``max_num_seqs`` sequences of the full context, at most 4 GiB of MLA blocks.
    num_blocks: MLA latent blocks in the paged pool (each ``block_size`` tokens for every MLA layer).
    block_size: tokens per MLA block, and the granularity of prefix sharing.
    prefill_chunk: most prompt tokens one prefill forward processes (a multiple of ``block_size``). Prefill forwards
        end at multiples of it, and the KDA state is snapshotted there for prefix caching: it is the prefix-cache
        granularity of the KDA layers.
    max_prefill_forwards: prefill forwards run per engine step (between two decode steps).
    prefix_caching: share full MLA blocks by hash chain and restore KDA snapshots.
    num_snapshots: KDA snapshot slots for prefix caching (LRU); default ``4 * max_num_seqs``.
    cuda_graphs: run batched decode steps through the fixed-shape step of ``cuda_graph.py``, captured as CUDA graphs
        per (batch, context) bucket. ``None``: on for a CUDA model, off otherwise. ``True`` on CPU runs the same
        fixed-shape step eagerly (what the tests check; slower than the normal CPU path).
    cuda_graph_max_len: longest context (cached tokens + the new one) a captured decode step covers; a decode batch
        with a longer sequence runs eagerly. Buckets double from 256 tokens up to it.
    """

    max_num_seqs: int = 16
    memory: int | None = None
    num_blocks: int | None = None
    block_size: int = 16
    prefill_chunk: int = 64
    max_prefill_forwards: int = 1
    prefix_caching: bool = True
    num_snapshots: int | None = None
    cuda_graphs: bool | None = None
    cuda_graph_max_len: int = 8192

    def validate(self) -> EngineConfig:
        for name in ("max_num_seqs", "block_size", "prefill_chunk", "max_prefill_forwards", "cuda_graph_max_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"`{name}` must be a positive int, got {v!r}")
        if self.prefill_chunk % self.block_size:
            raise ValueError(f"`prefill_chunk` ({self.prefill_chunk}) must be a multiple of `block_size` "
                             f"({self.block_size})")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"`num_blocks` must be >= 1, got {self.num_blocks}")
        if self.num_snapshots is not None and self.num_snapshots < 0:
            raise ValueError(f"`num_snapshots` must be >= 0, got {self.num_snapshots}")
        if self.cuda_graphs not in (None, True, False):
            raise ValueError(f"`cuda_graphs` must be True, False or None (auto), got {self.cuda_graphs!r}")
        if self.memory is not None and self.memory <= 0:
            raise ValueError(f"`memory` must be > 0 bytes, got {self.memory}")
        return self
