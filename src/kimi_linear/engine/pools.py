"""The cache pools: fixed KDA state slots and a paged pool of MLA latent blocks (docs/serving.md §3; their sizes:
docs/memory.md §3)."""

from __future__ import annotations

import math
from collections import OrderedDict

import torch

from kimi_linear.layers import KDAState


class StatePool:
    """``num_slots`` fixed-size KDA states (conv window + float32 memory) for each KDA layer.

    Used twice: running sequences own one slot each; prefix-cache snapshots live in a second pool.

    scratch: one more row, index ``num_slots`` (``self.scratch``), that is never handed out: the padding rows of a
    fixed-shape decode batch (CUDA graphs, see ``cuda_graph.py``) read and write it instead of a real slot.
    """

    def __init__(self, num_slots: int, kda_layers: list, dtype: torch.dtype, device: torch.device,
                 scratch: bool = False) -> None:
        self.num_slots = num_slots
        self.scratch: int | None = num_slots if scratch else None
        rows = num_slots + int(scratch)
        states = [m.empty_state(rows, dtype, device) for m in kda_layers]     # the layer's own (zero) state
        self.conv = [st.conv for st in states]
        self.rec = [st.recurrent for st in states]
        self.free: list[int] = list(range(num_slots - 1, -1, -1))

    def _row_bytes(self) -> int:
        return sum(math.prod(t.shape[1:]) * t.element_size() for t in self.conv + self.rec)

    def nbytes(self) -> int:
        """Bytes of the ``num_slots`` usable slots (the scratch row is :meth:`scratch_bytes`)."""
        return self._row_bytes() * self.num_slots

    def scratch_bytes(self) -> int:
        return self._row_bytes() if self.scratch is not None else 0

    def slot_bytes(self) -> int:
        return self._row_bytes() if self.num_slots else 0

    def alloc(self) -> int | None:
        return self.free.pop() if self.free else None

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def reset(self, slot: int) -> None:
        """A fresh sequence starts from a zero state."""
        for t in self.conv + self.rec:
            t[slot].zero_()

    def gather(self, slots: list[int]) -> list[KDAState]:
        """Copies of the slots' states, one KDAState per KDA layer with batch = len(slots)."""
        idx = torch.tensor(slots, device=self.conv[0].device) if self.conv else None
        return [KDAState(conv=c.index_select(0, idx), recurrent=r.index_select(0, idx))
                for c, r in zip(self.conv, self.rec)]

    def scatter(self, slots: list[int], states: list[KDAState]) -> None:
        idx = torch.tensor(slots, device=self.conv[0].device) if self.conv else None
        for c, r, s in zip(self.conv, self.rec, states):
            c.index_copy_(0, idx, s.conv.to(c.dtype))
            r.index_copy_(0, idx, s.recurrent.float())

    def copy_to(self, src: int, other: StatePool, dst: int) -> None:
        for a, b in zip(self.conv + self.rec, other.conv + other.rec):
            b[dst].copy_(a[src])


class BlockPool:
    """Paged MLA latents: ``num_blocks`` blocks of ``block_size`` tokens, for every MLA layer at once.

    Blocks are reference counted. A full block may carry a prefix hash; when its count drops to 0 it stays in an
    LRU list of cached free blocks and can be revived by a later request with the same prefix, until it is evicted
    to make room (plain free blocks are always handed out first).

    scratch: one more block, index ``num_blocks`` (``self.scratch``), never handed out nor shared: the padding rows
    of a fixed-shape decode batch write their latents there.
    """

    def __init__(self, num_blocks: int, block_size: int, widths: list[int], dtype: torch.dtype,
                 device: torch.device, scratch: bool = False) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.scratch: int | None = num_blocks if scratch else None
        self.data = [torch.zeros(num_blocks + int(scratch), block_size, w, dtype=dtype, device=device)
                     for w in widths]
        self.ref = [0] * num_blocks
        self.free_plain: list[int] = list(range(num_blocks - 1, -1, -1))
        self.free_cached: OrderedDict[int, None] = OrderedDict()     # LRU: oldest first
        self.hash_of: dict[int, bytes] = {}                            # block -> prefix hash
        self.block_of: dict[bytes, int] = {}                           # prefix hash -> block

    def _row_bytes(self) -> int:
        return sum(math.prod(t.shape[1:]) * t.element_size() for t in self.data)

    def nbytes(self) -> int:
        """Bytes of the ``num_blocks`` usable blocks (the scratch block is :meth:`scratch_bytes`)."""
        return self._row_bytes() * self.num_blocks

    def scratch_bytes(self) -> int:
        return self._row_bytes() if self.scratch is not None else 0

    def block_bytes(self) -> int:
        return self._row_bytes() if self.num_blocks else 0

    def num_free(self) -> int:
        return len(self.free_plain) + len(self.free_cached)

    def num_used(self) -> int:
        return self.num_blocks - self.num_free()

    def alloc(self) -> int | None:
        if self.free_plain:
            b = self.free_plain.pop()
        elif self.free_cached:
            b, _ = self.free_cached.popitem(last=False)
            self.block_of.pop(self.hash_of.pop(b), None)             # evict its prefix entry
        else:
            return None
        self.ref[b] = 1
        return b

    def incref(self, b: int) -> None:
        if self.ref[b] == 0:
            self.free_cached.pop(b, None)
        self.ref[b] += 1

    def decref(self, b: int) -> None:
        self.ref[b] -= 1
        assert self.ref[b] >= 0, f"block {b} released twice"
        if self.ref[b] == 0:
            if b in self.hash_of:
                self.free_cached[b] = None
            else:
                self.free_plain.append(b)

    def register(self, b: int, h: bytes) -> None:
        """Make full block ``b`` findable by prefix hash ``h`` (first writer wins)."""
        if h not in self.block_of and b not in self.hash_of:
            self.block_of[h] = b
            self.hash_of[b] = h

    def gather(self, table: list[int], length: int) -> list[torch.Tensor]:
        """The first ``length`` cached entries of a sequence: per MLA layer [length, width]."""
        n = -(-length // self.block_size)
        if n == 0:
            return [t.new_zeros(0, t.shape[-1]) for t in self.data]
        idx = torch.tensor(table[:n], device=self.data[0].device)
        return [t.index_select(0, idx).flatten(0, 1)[:length] for t in self.data]

    def write(self, table: list[int], start: int, entries: list[torch.Tensor]) -> None:
        """Store entries [T, width] per MLA layer at token positions start..start+T-1."""
        T = entries[0].shape[0] if entries else 0
        bs = self.block_size
        pos = start
        while pos < start + T:
            b, off = table[pos // bs], pos % bs
            n = min(bs - off, start + T - pos)
            for t, e in zip(self.data, entries):
                t[b, off : off + n] = e[pos - start : pos - start + n]
            pos += n


class SnapshotCache:
    """KDA states saved at block boundaries of prefills, keyed by the prefix hash there; LRU eviction."""

    def __init__(self, pool: StatePool) -> None:
        self.pool = pool
        self.slot_of: OrderedDict[bytes, int] = OrderedDict()

    def __contains__(self, h: bytes) -> bool:
        return h in self.slot_of

    def save(self, h: bytes, src: StatePool, slot: int) -> None:
        if self.pool.num_slots == 0:
            return
        if h in self.slot_of:
            self.slot_of.move_to_end(h)
            return
        dst = self.pool.alloc()
        if dst is None:
            _, dst = self.slot_of.popitem(last=False)
        src.copy_to(slot, self.pool, dst)
        self.slot_of[h] = dst

    def restore(self, h: bytes, dst_pool: StatePool, dst: int) -> None:
        self.slot_of.move_to_end(h)
        self.pool.copy_to(self.slot_of[h], dst_pool, dst)
