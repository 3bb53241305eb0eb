"""The engine's model runner: turns a step plan into forwards and last-position logits.

Prompts to score (``SamplingParams.prompt_logprobs``) run without the pools: packed into one forward that
returns every position's log-probabilities (:mod:`kimi_linear.model.scoring`).

Decode rows go through the fixed-shape step (:mod:`kimi_linear.model.paged`, CUDA graphs per batch bucket) when
the engine has one, else through the eager forward; a pipelined engine launches them without waiting for the
device (:meth:`ModelRunner.launch_decode`, input ids fed from the previous step's greedy ids on the device).

Prompt chunks run eagerly: chunks of equal length from several sequences share one batched forward ([b, T]; each
row continues from its own slot). When the rows have equal cached lengths (one long prompt, prompts admitted
together) the MLA layers read and write the paged pool in place (:class:`~kimi_linear.layers.PagedPrefillView`: no
copy of the history, no mask, memory independent of the context), as do eager one-token rows
(:class:`~kimi_linear.layers.PagedLatentView`); otherwise each row's latents are gathered left-padded to the longest
history and masked (exact, but a [b, T, longest] mask: rows with different long histories run as separate forwards
instead).
"""

from __future__ import annotations

from typing import Any

import torch

from kimi_linear.layers import (
    LatentCache,
    PagedLatentView,
    PagedPrefillView,
    VarlenKDAState,
    VarlenLatents,
    pool_rows,
)
from kimi_linear.model.cache import HybridCache
from kimi_linear.model.paged import DecodeGraphs
from kimi_linear.model.scoring import PromptScores, score_prompts

from .cache_manager import CacheManager
from .sequence import Sequence

# Rows of one prompt-chunk forward with different cached lengths share it through the dense left-padded path only
# while its [b, T, longest history] mask stays this small; past that, one forward per cached length.
DENSE_MASK_ELEMENTS = 1 << 24


def consecutive_start(blocks: list[int], n: int) -> int | None:
    """blocks[0] when the first n blocks are consecutive (blocks[i] == blocks[0] + i), else None."""
    if n == 0 or len(blocks) < n:
        return None
    b0 = blocks[0]
    return b0 if blocks[:n] == list(range(b0, b0 + n)) else None


def next_ids(seqs: list[Sequence]) -> list[int]:
    """Each decode row's input: its first token not computed yet."""
    return [s.token_slice(s.num_computed, s.num_computed + 1)[0] for s in seqs]


class ModelRunner:
    """Forwards of one engine. ``graphs``: the fixed-shape decode step (``capture``: as CUDA graphs)."""

    def __init__(self, model: Any, cache: CacheManager, graphs: bool, capture: bool) -> None:
        self.model, self.cache = model, cache
        self.device = model.device
        self.graphs = DecodeGraphs(model, cache.pools, cache.cfg.max_num_seqs, capture) if graphs else None
        self.graph_forwards = 0

    def capture_all(self) -> int:
        if self.graphs is None or not self.graphs.capture:
            return 0
        return self.graphs.capture_all()

    def decode(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token of every sequence -> (logits [B, vocab] float32, their greedy ids [B] on the device when the
        graph computed them, else None); caches updated (not ``num_computed``)."""
        if self.graphs is not None:
            self.cache.sync_tables(seqs)
            logits = self.graphs.run(next_ids(seqs), [s.slot for s in seqs], [s.num_computed for s in seqs])
            if logits is not None:
                self.graph_forwards += 1
                return logits, self.graphs.greedy
        return self.forward(seqs, 1), None

    def launch_decode(self, seqs: list[Sequence], fed: torch.Tensor | None) -> torch.Tensor | None:
        """Launch one token of every sequence on the fixed-shape step without waiting for the device (a pipelined
        engine step): ``fed``, the rows' input ids on the device (the greedy ids of the step before), else their
        next tokens from the host. Returns their greedy ids [B] on the device, or None when the fixed-shape step
        cannot run (then nothing ran). Caches updated (not ``num_computed``)."""
        assert self.graphs is not None, "a pipelined decode step needs the fixed-shape step"
        self.cache.sync_tables(seqs)
        ids = fed if fed is not None else next_ids(seqs)
        greedy = self.graphs.launch(ids, [s.slot for s in seqs], [s.num_computed for s in seqs])
        if greedy is not None:
            self.graph_forwards += 1
        return greedy

    @torch.inference_mode()
    def forward(self, seqs: list[Sequence], T: int) -> torch.Tensor:
        """Run tokens [num_computed, num_computed + T) of each sequence through the model with caches gathered
        from the pools, write the new states / latents back. Returns last-position logits [B, vocab] float32.

        MLA layers read the paged pool in place through the device block table: one-token rows through
        :class:`PagedLatentView` (the paged decode attention, each row its own length), chunks of rows with equal
        cached lengths through :class:`PagedPrefillView`; only chunks of rows with different cached lengths gather
        their histories into left-padded buffers under a mask (:meth:`prefill` keeps those small)."""
        cm = self.cache
        dtype = self.model.dtype
        B = len(seqs)
        ps = [s.num_computed for s in seqs]
        L = max(ps)
        cache = HybridCache([None] * len(self.model.model.layers))  # type: ignore[list-item]
        for k, st in zip(cm.kda_idx, cm.slots.gather([s.slot for s in seqs])):
            cache.layers[k] = st
        dense = T > 1 and any(p != L for p in ps)
        if dense:
            bufs = self._histories(seqs, ps, L + T)
            for li, buf in zip(cm.mla_idx, bufs):
                lc = LatentCache(B, buf.shape[-1], dtype, self.device)
                lc.buf, lc.length = buf, L
                cache.layers[li] = lc
            cache.key_mask = torch.arange(L, device=self.device)[None] >= torch.tensor(
                [L - p for p in ps], device=self.device)[:, None]
        elif cm.widths:
            table = cm.table_rows(seqs, L + T)
            if T == 1:
                bs = cm.cfg.block_size
                lens = torch.tensor(ps, device=self.device)
                dst = pool_rows(table, lens[:, None], bs)[:, 0]
                views: list = [PagedLatentView(data, table, lens + 1, dst) for data in cm.blocks.data]
            else:
                first = consecutive_start(seqs[0].block_table, -(-L // cm.cfg.block_size)) if B == 1 else None
                views = [PagedPrefillView(data, table, L, first) for data in cm.blocks.data]
            for li, view in zip(cm.mla_idx, views):
                cache.layers[li] = view
        cache.seq_len = L
        ids = torch.tensor([s.token_slice(s.num_computed, s.num_computed + T) for s in seqs], device=self.device)
        logits = self.model(ids, cache=cache, logits_to_keep=1).logits[:, -1].float()
        cm.slots.scatter([s.slot for s in seqs], [cache.layers[k] for k in cm.kda_idx])
        if dense:
            for r, s in enumerate(seqs):
                cm.blocks.write(s.block_table, ps[r], [buf[r, L : L + T] for buf in bufs])
        return logits

    def _histories(self, seqs: list[Sequence], ps: list[int], length: int) -> list[torch.Tensor]:
        """Per MLA layer a zeroed [B, length, width] buffer holding each sequence's ps[r] cached latents
        left-padded to end at max(ps) (the rest is room for new entries)."""
        L = max(ps)
        bufs = [torch.zeros(len(seqs), length, w, dtype=self.model.dtype, device=self.device)
                for w in self.cache.widths]
        for r, s in enumerate(seqs):
            if ps[r]:
                for buf, e in zip(bufs, self.cache.blocks.gather(s.block_table, ps[r])):
                    buf[r, L - ps[r] : L] = e
        return bufs

    def prefill(self, chunks: list[tuple[Sequence, int]]) -> list[tuple[Sequence, torch.Tensor]]:
        """Prompt chunks, batched by length -> (sequence, last-position logits [vocab]) in the given order."""
        by_len: dict[int, list[Sequence]] = {}
        for s, T in chunks:
            by_len.setdefault(T, []).append(s)
        got: dict[int, torch.Tensor] = {}
        for T, seqs in by_len.items():
            for group in self._groups(seqs, T):
                logits = self.forward(group, T)
                for r, s in enumerate(group):
                    got[id(s)] = logits[r]
        return [(s, got[id(s)]) for s, _ in chunks]

    @staticmethod
    def _groups(seqs: list[Sequence], T: int) -> list[list[Sequence]]:
        """Chunks of length T that run as one forward: all of them when their cached lengths are equal (the paged
        path) or the dense path's mask stays under DENSE_MASK_ELEMENTS; else one forward per cached length."""
        ps = sorted({s.num_computed for s in seqs})
        if len(ps) == 1 or len(seqs) * T * (ps[-1] + T) <= DENSE_MASK_ELEMENTS:
            return [seqs]
        return [[s for s in seqs if s.num_computed == p] for p in ps]

    @torch.inference_mode()
    def mixed(self, chunks: list[tuple[Sequence, int]]) -> list[tuple[Sequence, torch.Tensor]]:
        """Every sequence's next tokens (decode rows: 1; prompt chunks: T) packed into one row and run as one
        forward (``cu_seqlens``): KDA layers continue each sequence from its slot through the varlen conv and
        ``chunk_kda``; MLA layers attend each sequence over its own past (gathered from its blocks) and its new
        tokens. Returns (sequence, last-position logits [vocab] float32) in the given order; states and latents
        are written back."""
        cm, dev = self.cache, self.device
        seqs = [s for s, _ in chunks]
        Ts = [T for _, T in chunks]
        ps = [s.num_computed for s in seqs]
        offsets = [0]
        for T in Ts:
            offsets.append(offsets[-1] + T)
        cu = torch.tensor(offsets, device=dev)
        ids = torch.tensor([t for s, T in chunks for t in s.token_slice(s.num_computed, s.num_computed + T)],
                           device=dev)[None]
        index = torch.tensor([s.slot for s in seqs], device=dev)
        P = max(ps)
        caches: list = [None] * len(self.model.model.layers)
        for j, li in enumerate(cm.kda_idx):
            caches[li] = VarlenKDAState(cm.slots.conv[j], cm.slots.rec[j], index)
        past_len = torch.tensor(ps, device=dev)
        views = [VarlenLatents(past, past_len, cu) for past in self._histories(seqs, ps, P)]
        for li, view in zip(cm.mla_idx, views):
            caches[li] = view
        m = self.model
        x = m.model.run_layers(m.model.embed_tokens(ids), caches, None, None, cu)
        logits = m.lm_head(m.model.norm(x[0, cu[1:] - 1])).float()                # [N, vocab]
        for r, s in enumerate(seqs):
            a, b = offsets[r], offsets[r + 1]
            cm.blocks.write(s.block_table, ps[r], [v.new[a:b] for v in views])
        return [(s, logits[r]) for r, s in enumerate(seqs)]

    def score(self, seqs: list[Sequence], top: int) -> list[PromptScores]:
        """Every prompt token's log-probability (and ``top`` alternatives) of each sequence, and the logits after
        its prompt: one packed forward when they fit ``max_num_scored_tokens``; touches no pool."""
        return score_prompts(self.model, [s.prompt_ids for s in seqs], top=top,
                             chunk=self.cache.cfg.max_num_scored_tokens)
