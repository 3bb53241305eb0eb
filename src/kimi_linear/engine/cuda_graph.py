"""The engine's batched decode step with fixed shapes, captured as CUDA graphs on a GPU (issue 6).

A decode step of a small model on a GPU is bound by launches: hundreds of small kernels, each a few microseconds of
work and as much Python and launch overhead. A CUDA graph replays the whole step as one launch, but it fixes every
shape and address and cannot read a device value on the host. So:

- a batch is padded to a batch bucket (1, 2, 4, ..., ``max_num_seqs``) and its context to a length bucket (256,
  512, ..., ``cuda_graph_max_len``); one graph per (batch, length) pair, captured on first use (or all at once by
  :meth:`DecodeGraphs.capture_all`), all sharing one memory pool;
- each graph reads one static int64 buffer (token ids, KDA slot indices, cached lengths, MLA block tables) that the
  host fills before a replay: one host-to-device copy per step;
- KDA states are gathered from the slot pool by index and scattered back in place; each row's new MLA latent is
  written into its paged block at its next position, then the rows' first L latents are read back through the
  block table, keys past a row's length masked;
- padding rows point at the pools' scratch slot and scratch block, which no sequence ever owns; a real row's unused
  block-table columns repeat its own first block, so a real row never reads scratch memory (not even NaN there can
  reach it) and a padding row never writes outside it;
- nothing on the path reads a device value on the host: the model's ``forward`` (whose input-id check reads the ids
  back) is bypassed for embedding -> ``run_layers`` -> norm -> lm_head, and MoE layers switch to a static dispatch
  (``SparseMoE.static_dispatch``) instead of routing on the host: the fused MoE op on CUDA (sorts by expert on the
  device), every expert on every row elsewhere.

On CPU (``EngineConfig(cuda_graphs=True)``) the same step runs eagerly: the tests compare it with the normal path.
Weights must not change once graphs are captured (a graph holds their addresses and the MoE's stacked experts).
"""

from __future__ import annotations

import logging
import time
from array import array
from dataclasses import dataclass
from typing import Any

import torch

from kimi_linear.layers import KDAState, SparseMoE

from .pools import BlockPool, StatePool
from .sequence import Sequence

log = logging.getLogger("kimi_linear.engine")


def batch_buckets(max_batch: int) -> list[int]:
    """Padded batch sizes: powers of two below ``max_batch``, then ``max_batch``."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


def length_buckets(block_size: int, max_len: int, start: int = 256) -> list[int]:
    """Context buckets (multiples of ``block_size``): ``start`` doubling up to ``max_len`` (both rounded up to a
    whole block)."""
    cap = -(-max_len // block_size) * block_size
    L = min(cap, -(-start // block_size) * block_size)
    out = [L]
    while L < cap:
        L = min(2 * L, cap)
        out.append(L)
    return out


class PagedLatents:
    """Stands in for an MLA layer's ``LatentCache`` in the fixed-shape step (``NoPEMLA`` only calls ``append``).

    data: the layer's block pool [num_blocks + 1, block_size, width]; table: [B, nb] block ids; dst: [B] flat
    index (block * block_size + offset) of each row's new token.
    """

    def __init__(self, data: torch.Tensor, table: torch.Tensor, dst: torch.Tensor) -> None:
        self.data, self.table, self.dst = data, table, dst

    def append(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, 1, width]: store each row's new latent, return its first L = nb * block_size latents [B, L, width]
        (positions past the row's length hold whatever the blocks hold; the attention mask hides them)."""
        B, nb = self.table.shape
        bs, w = self.data.shape[1:]
        self.data.view(-1, w).index_copy_(0, self.dst, x[:, 0])
        return self.data.index_select(0, self.table.reshape(-1)).view(B, nb * bs, w)


@dataclass
class _Step:
    """One (batch, length) bucket: its static input buffer and, on CUDA, its graph and output."""

    inputs: torch.Tensor                    # int64 [b * (3 + L // block_size)]: ids | slots | lengths | table
    graph: Any = None                       # torch.cuda.CUDAGraph
    logits: torch.Tensor | None = None      # the graph's output [b, vocab] float32


class DecodeGraphs:
    """Fixed-shape decode steps over the engine's pools (see the module docstring).

    capture: record CUDA graphs (CUDA models); False runs the same step eagerly.
    lengths: the context buckets (default :func:`length_buckets` up to ``max_len``).
    """

    def __init__(self, model: Any, slots: StatePool, blocks: BlockPool, kda_idx: list[int], mla_idx: list[int],
                 max_batch: int, max_len: int, capture: bool, lengths: list[int] | None = None) -> None:
        if slots.scratch is None or blocks.scratch is None:
            raise ValueError("`slots` and `blocks` need a scratch row (StatePool/BlockPool(..., scratch=True))")
        self.model, self.slots, self.blocks = model, slots, blocks
        self.scratch_slot, self.scratch_block = slots.scratch, blocks.scratch
        self.kda_idx, self.mla_idx = kda_idx, mla_idx
        self.bs = blocks.block_size
        self.batches = batch_buckets(max_batch)
        self.lengths = list(lengths) if lengths is not None else length_buckets(self.bs, max_len)
        if any(L % self.bs for L in self.lengths):
            raise ValueError(f"`lengths` must be multiples of the block size {self.bs}, got {self.lengths}")
        self.capture = capture
        self.device = model.device
        self.moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
        self.num_layers = len(model.model.layers)
        self.positions = torch.arange(self.lengths[-1], device=self.device)
        self.steps: dict[tuple[int, int], _Step] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.capture_seconds = 0.0
        self.broken: str | None = None          # why capturing failed (then every step runs eagerly)

    # ---------------------------------------------------------------------------------------------- buckets
    def bucket(self, n: int, need: int) -> tuple[int, int] | None:
        """(batch, length) bucket for ``n`` rows whose longest needs ``need`` keys, or None (run eagerly)."""
        b = next((x for x in self.batches if x >= n), None)
        L = next((x for x in self.lengths if x >= need), None)
        return None if b is None or L is None else (b, L)

    # ----------------------------------------------------------------------------------------------- step
    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """Logits [len(seqs), vocab] float32 of each sequence's last token (the one uncomputed token), with the KDA
        slots and MLA blocks updated in place; None when no bucket fits or capturing failed (the caller runs the
        eager step). Does not advance ``num_computed``."""
        key = self.bucket(len(seqs), max(s.num_computed for s in seqs) + 1)
        if key is None or self.broken is not None:
            return None
        step = self.steps.get(key) or self._build(*key)
        if step is None:
            return None
        b, L = key
        step.inputs.copy_(self._host_inputs(seqs, b, L))
        if step.graph is None:
            return self.forward(step.inputs, b, L)[: len(seqs)]
        step.graph.replay()
        assert step.logits is not None
        return step.logits[: len(seqs)]

    def _host_inputs(self, seqs: list[Sequence], b: int, L: int) -> torch.Tensor:
        """The static buffer's contents (CPU int64): ids | slots | lengths | block table [b, L // block_size];
        rows past ``len(seqs)`` are padding (token 0, scratch slot, length 0, scratch blocks). Built with
        ``array`` (C-speed list appends, then one zero-copy view): this runs on the host every decode step."""
        n, nb = len(seqs), L // self.bs
        pad = b - n
        for s in seqs:
            if s.slot is None or len(s.block_table) * self.bs <= s.num_computed:
                raise RuntimeError(f"request {s.request_id!r} has no KDA slot or no block for position "
                                   f"{s.num_computed}")
        buf = array("q", [(s.output_ids or s.prompt_ids)[-1] for s in seqs])  # a decode row's one new token: its last
        buf.extend([0] * pad)
        buf.extend([s.slot for s in seqs])
        buf.extend([self.scratch_slot] * pad)
        buf.extend([s.num_computed for s in seqs])
        buf.extend([0] * pad)
        for s in seqs:
            t = s.block_table[:nb]
            buf.extend(t)
            buf.extend([t[0]] * (nb - len(t)))  # masked keys: read the row's own block, never scratch memory
        buf.extend([self.scratch_block] * (pad * nb))
        return torch.frombuffer(buf, dtype=torch.int64)

    def forward(self, inputs: torch.Tensor, b: int, L: int) -> torch.Tensor:
        """The step a graph captures: static ``inputs`` -> logits [b, vocab] float32; pools updated in place."""
        nb = L // self.bs
        ids, slots, lens = inputs[:b], inputs[b : 2 * b], inputs[2 * b : 3 * b]
        table = inputs[3 * b :].view(b, nb)
        caches: list[Any] = [None] * self.num_layers
        for j, li in enumerate(self.kda_idx):
            caches[li] = KDAState(conv=self.slots.conv[j].index_select(0, slots),
                                  recurrent=self.slots.rec[j].index_select(0, slots))
        if self.mla_idx:
            dst = table.gather(1, (lens // self.bs)[:, None])[:, 0] * self.bs + lens % self.bs
            for j, li in enumerate(self.mla_idx):
                caches[li] = PagedLatents(self.blocks.data[j], table, dst)
        mask = (self.positions[:L][None] <= lens[:, None])[:, None, None]                  # [b, 1, 1, L]
        m = self.model
        for moe in self.moes:
            moe.static_dispatch = True
        try:
            x = m.model.embed_tokens(ids[:, None])
            x = m.model.run_layers(x, caches, None, mask)
            logits = m.lm_head(m.model.norm(x))[:, -1].float()
        finally:
            for moe in self.moes:
                moe.static_dispatch = False
        for j, li in enumerate(self.kda_idx):
            st = caches[li]
            # Padding rows all name the scratch slot: which of their identical writes lands there does not matter.
            self.slots.conv[j].index_copy_(0, slots, st.conv.to(self.slots.conv[j].dtype))
            self.slots.rec[j].index_copy_(0, slots, st.recurrent.float())
        return logits

    # -------------------------------------------------------------------------------------------- capture
    def capture_all(self) -> int:
        """Capture every (batch, length) bucket not captured yet, largest first (smaller graphs then reuse the
        shared pool's memory). Returns the number of graphs held."""
        with torch.inference_mode():
            for b in reversed(self.batches):
                for L in reversed(self.lengths):
                    if (b, L) not in self.steps and self.broken is None:
                        self._build(b, L)
        return len(self.steps)

    def _build(self, b: int, L: int) -> _Step | None:
        step = _Step(torch.empty(b * (3 + L // self.bs), dtype=torch.int64, device=self.device))
        if self.capture:
            t0 = time.perf_counter()
            try:
                self._capture(step, b, L)
            except Exception as e:     # never fail a request over a graph: run eagerly from now on
                self.broken = f"{type(e).__name__}: {e}"
                log.exception("CUDA graph capture failed for batch %d, length %d; decoding eagerly", b, L)
                return None
            self.capture_seconds += time.perf_counter() - t0
        self.steps[(b, L)] = step
        return step

    def _capture(self, step: _Step, b: int, L: int) -> None:
        # Warm-up and capture with padding rows only: the warm-up really runs (it compiles the Triton kernels and
        # builds cached weights outside the graph) and so must touch nothing but the scratch slot and block.
        step.inputs.copy_(self._host_inputs([], b, L))
        cur = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            self.forward(step.inputs, b, L)
        cur.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the engine runs in its own thread; other threads' CUDA calls must not abort the capture.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            step.logits = self.forward(step.inputs, b, L)
        step.graph = graph
