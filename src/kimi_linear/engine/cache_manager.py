"""The engine's cache manager: who owns which KDA slot and MLA block, prefix hashes, and the device block table.

Three pools (``pools.py``): running sequences own one KDA state slot each and a list of MLA latent blocks; KDA
snapshots saved at block boundaries serve prefix caching. A device block table ``[slots + 1, max_blocks]`` (int32)
mirrors each sequence's block list in the row of its slot; :meth:`CacheManager.sync_tables` pushes the entries that
changed since the last step in one copy, so no forward ever turns a sequence's whole block list into a tensor (at
1M tokens that list has 65,536 entries). With the fixed-shape decode step (CUDA graphs) the pools also get a
scratch slot and block for padding rows, whose table row names only the scratch block.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from typing import Any

import torch

from kimi_linear.model.paged import DecodePools

from .config import EngineConfig
from .pools import BlockPool, SnapshotCache, StatePool
from .sequence import Sequence

DEFAULT_MLA_BYTES = 4 * 2**30


class CacheManager:
    """Slots, snapshots and blocks of one engine, and the device block table. ``paged``: keep scratch rows (the
    fixed-shape decode step's padding rows use them)."""

    def __init__(self, model: Any, cfg: EngineConfig, paged: bool) -> None:
        layers = model.model.layers
        self.cfg = cfg
        self.kda_idx = [i for i, layer in enumerate(layers) if layer.is_kda]
        self.mla_idx = [i for i, layer in enumerate(layers) if not layer.is_kda]
        dtype, device = model.dtype, model.device
        self.max_context = int(model.config.max_position_embeddings)
        S = cfg.max_num_seqs
        kda_mods = [layers[i].self_attn for i in self.kda_idx]
        self.widths = [layers[i].self_attn.cache_width for i in self.mla_idx]
        self.slots = StatePool(S, kda_mods, dtype, device, scratch=paged)
        n_snap = cfg.num_snapshots if cfg.num_snapshots is not None else 4 * S
        self.snapshots = SnapshotCache(StatePool(n_snap if cfg.prefix_caching else 0, kda_mods, dtype, device))
        bs = cfg.block_size
        block_bytes = bs * sum(self.widths) * torch.tensor([], dtype=dtype).element_size()
        table_cols = math.ceil(self.max_context / bs)
        table_bytes = (S + 1) * table_cols * 4 if self.widths else 0
        num_blocks = cfg.num_blocks
        if num_blocks is None:
            if cfg.memory is not None and block_bytes:
                left = cfg.memory - self.slots.nbytes() - self.slots.scratch_bytes() - self.snapshots.pool.nbytes()
                left -= table_bytes
                num_blocks = left // block_bytes - int(paged)
                if num_blocks < 1:
                    raise ValueError(
                        f"`memory` = {cfg.memory} bytes is too small: {S} KDA slots + {n_snap} snapshots take "
                        f"{self.slots.nbytes() + self.snapshots.pool.nbytes()} bytes and one MLA block "
                        f"{block_bytes}; raise `memory` or lower `max_num_seqs` / `num_snapshots`")
            else:
                # Room for max_num_seqs full-context sequences, but at most DEFAULT_MLA_BYTES (a 1M-token context
                # would otherwise ask for >100 GB); --memory / num_blocks choose more.
                num_blocks = S * math.ceil(self.max_context / bs)
                if block_bytes:
                    num_blocks = max(1, min(num_blocks, DEFAULT_MLA_BYTES // block_bytes))
        self.blocks = BlockPool(int(num_blocks), bs, self.widths, dtype, device, scratch=paged)
        scratch = self.blocks.scratch if self.blocks.scratch is not None else 0
        # entries past a sequence's blocks are never read: they may name any block (the scratch one when paged)
        self.block_table: torch.Tensor | None = torch.full(
            (S + 1, table_cols), scratch, dtype=torch.int32, device=device) if self.widths else None
        self.pools: DecodePools | None = None
        if paged:
            table = self.block_table if self.block_table is not None else torch.full(
                (S + 1, 1), scratch, dtype=torch.int32, device=device)
            self.pools = DecodePools(self.slots.conv, self.slots.rec, self.blocks.data, table, bs,
                                     scratch_slot=S, scratch_block=scratch)

    # ------------------------------------------------------------------------------------------- accounting
    def allocated_bytes(self) -> dict[str, int]:
        """Bytes the pools hold: KDA state slots, KDA prefix snapshots, MLA latent blocks, the device block table
        (with MLA layers) and, with the paged decode step, the padding rows' scratch slot and block."""
        out = dict(kda_slots=self.slots.nbytes(), kda_snapshots=self.snapshots.pool.nbytes(),
                   mla_blocks=self.blocks.nbytes())
        if self.pools is not None:
            out["graph_scratch"] = self.slots.scratch_bytes() + self.blocks.scratch_bytes()
        if self.block_table is not None:
            out["block_table"] = self.block_table.numel() * self.block_table.element_size()
        return out

    def token_capacity(self) -> int:
        return self.blocks.num_blocks * self.cfg.block_size if self.widths else self.max_context

    # ---------------------------------------------------------------------------------------- prefix cache
    def block_hash(self, seq: Sequence, i: int) -> bytes:
        """Hash chain over full blocks: block i's hash covers every token before its end."""
        hs = seq.__dict__.setdefault("hashes", [])
        while len(hs) <= i:
            j, bs = len(hs), self.cfg.block_size
            # A cryptographic digest, not Python's hash(): int-tuple hashes are not randomised, so crafted
            # prompts could collide with another client's prefix and read its cache.
            data = (hs[-1] if hs else b"") + array("q", seq.token_slice(j * bs, (j + 1) * bs)).tobytes()
            hs.append(hashlib.blake2b(data, digest_size=16).digest())
        return hs[i]

    def match_prefix(self, seq: Sequence) -> tuple[list[int], bytes | None]:
        """Longest run of cached full blocks that ends where a KDA snapshot exists (>= 1 token left to run)."""
        if not self.cfg.prefix_caching:
            return [], None
        bs = self.cfg.block_size
        found: list[int] = []
        best, best_h = 0, None
        for i in range((seq.num_tokens() - 1) // bs):
            h = self.block_hash(seq, i)
            b = self.blocks.block_of.get(h)
            if b is None:
                break
            found.append(b)
            if h in self.snapshots:
                best, best_h = i + 1, h
        return found[:best], best_h

    def register_blocks(self, seq: Sequence, snapshot: bool) -> None:
        """Make the sequence's newly completed blocks findable; with ``snapshot``, save its KDA state when it
        ends exactly on a block boundary."""
        if not self.cfg.prefix_caching:
            return
        bs = self.cfg.block_size
        full = seq.num_computed // bs
        for i in range(seq.num_hashed, full):
            self.blocks.register(seq.block_table[i], self.block_hash(seq, i))
        seq.num_hashed = max(seq.num_hashed, full)
        if snapshot and full and seq.num_computed % bs == 0:
            self.snapshots.save(self.block_hash(seq, full - 1), self.slots, seq.slot)

    # ------------------------------------------------------------------------------------- ownership
    def blocks_needed(self, seq: Sequence, shared: list[int]) -> tuple[int, int]:
        """(new blocks to run the sequence's tokens and one more, cached-free blocks revived by sharing)."""
        revived = sum(1 for b in shared if self.blocks.ref[b] == 0)
        need = math.ceil((seq.num_tokens() + 1) / self.cfg.block_size) - len(shared)
        return need, revived

    def assign(self, seq: Sequence, shared: list[int], snapshot: bytes | None) -> None:
        """Give an admitted sequence a slot, the shared prefix blocks and its starting KDA state."""
        seq.slot = self.slots.alloc()
        for b in shared:
            self.blocks.incref(b)
        seq.block_table = list(shared)
        seq.num_hashed = len(shared)
        seq.table_synced = 0
        if snapshot is not None:
            self.snapshots.restore(snapshot, self.slots, seq.slot)
        else:
            self.slots.reset(seq.slot)
        seq.num_computed = len(shared) * self.cfg.block_size

    def release(self, seq: Sequence) -> None:
        for b in seq.block_table:
            self.blocks.decref(b)
        seq.block_table = []
        if seq.slot is not None:
            self.slots.release(seq.slot)
            seq.slot = None
        seq.num_computed = seq.num_hashed = seq.table_synced = 0

    def blocks_short(self, seq: Sequence, upto: int) -> int:
        """How many more blocks ``seq`` needs to hold tokens [0, upto) (0 when it has them)."""
        return max(0, math.ceil(upto / self.cfg.block_size) - len(seq.block_table))

    def grow(self, seq: Sequence, upto: int) -> bool:
        """Blocks for tokens [0, upto); False when the pool ran out first (the blocks taken so far stay)."""
        need = self.blocks_short(seq, upto)
        while need > 0:
            b = self.blocks.alloc()
            if b is None:
                return False
            seq.block_table.append(b)
            need -= 1
        return True

    def sync_tables(self, seqs: list[Sequence]) -> None:
        """Push the block-table entries the device has not seen yet (one host-to-device copy for the batch). On
        CUDA the copy goes through page-locked memory and does not wait for the device: a pipelined decode step
        (``EngineConfig.pipeline_decode``) syncs its rows' tables while the previous step still runs, and a
        pageable copy would wait for that step to end."""
        if self.block_table is None:
            return
        rows, cols, vals = [], [], []
        for s in seqs:
            new = s.block_table[s.table_synced :]
            if new:
                rows.extend([s.slot] * len(new))
                cols.extend(range(s.table_synced, len(s.block_table)))
                vals.extend(new)
                s.table_synced = len(s.block_table)
        if vals:
            idx = torch.tensor([rows, cols, vals], dtype=torch.int64)
            if self.block_table.is_cuda:
                idx = idx.pin_memory()
            idx = idx.to(self.block_table.device, non_blocking=True)
            self.block_table[idx[0], idx[1]] = idx[2].to(torch.int32)

    def table_rows(self, seqs: list[Sequence], upto: int) -> torch.Tensor:
        """The sequences' first ceil(upto / block_size) blocks, int32 [B, n] on the device: synced, then read from
        the device table (host work O(B) plus the new entries, whatever the context)."""
        assert self.block_table is not None, "no MLA layers, no block table"
        self.sync_tables(seqs)
        n = math.ceil(upto / self.cfg.block_size)
        slots = torch.tensor([s.slot for s in seqs], device=self.block_table.device)
        return self.block_table.index_select(0, slots)[:, :n]
