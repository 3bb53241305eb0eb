"""One-token decoding over pooled caches with fixed shapes, replayed as CUDA graphs per batch bucket.

A decode step of the hybrid model reads every active weight once and each row's cache once; on a GPU it is bound
by memory and, at small batches, by kernel launches. A CUDA graph replays the whole step as one launch, but fixes
every shape and address and cannot read a device value on the host. The step therefore works on *pools*:

- KDA layers: a conv-window pool and a float32 memory pool with one row per slot; the decode kernel reads and
  writes the memory in place through the rows' slot indices (:class:`~kimi_linear.layers.PooledKDAState`);
- MLA layers: a pool of latent blocks per layer and one block table ``[slots, max_blocks]`` (int32, on the device,
  row = slot) that says which blocks hold a slot's tokens in order; attention reads the latents through it
  (:class:`~kimi_linear.layers.PagedLatentView`, the paged decode kernel on CUDA);
- its inputs are three int64 vectors (token id, slot, cached length per row), so a graph depends on the batch
  size alone: one graph per batch bucket (1, 2, 4, ..., ``max_batch``), whatever the rows' context lengths;
- padding rows point at the pools' scratch slot, whose block-table row names only the scratch block: they write
  nowhere else, and no real row reads scratch memory (not even NaN there can reach a real row);
- nothing on the path reads a device value on the host: the model's ``forward`` (whose input-id check reads the ids
  back) is bypassed for embedding -> ``run_layers`` -> norm -> lm_head, and MoE layers use their static dispatch.

Users: the serving engine (its pools) and :func:`~kimi_linear.model.generation.generate` on CUDA (its own small
pools, :meth:`DecodePools.allocate`). Weights must not change once graphs are captured (a graph holds their
addresses).
"""

from __future__ import annotations

import gc
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kimi_linear.layers import PagedLatentView, PooledKDAState, SparseMoE
from kimi_linear.ops.greedy import logits_and_greedy, logits_and_greedy_torch
from kimi_linear.ops.paged import paged_decode_rows

if TYPE_CHECKING:
    from .modeling import KimiLinearForCausalLM

log = logging.getLogger("kimi_linear.decode")


def batch_buckets(max_batch: int) -> list[int]:
    """Padded batch sizes: powers of two below ``max_batch``, then ``max_batch``."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


@dataclass
class DecodePools:
    """The tensors a fixed-shape decode step reads and writes (bookkeeping of who owns what lives elsewhere).

    conv: per KDA layer [slots, W-1, 3*H*d]; rec: per KDA layer [slots, H, d, d] float32; latents: per MLA layer
    [blocks, block_size, width]; block_table: [slots, max_blocks] int32, row s = the blocks of the sequence in
    slot s, in order (entries past its length: any valid block). scratch_slot / scratch_block: what padding rows
    use; the scratch slot's block-table row holds only the scratch block.
    """

    conv: list[torch.Tensor]
    rec: list[torch.Tensor]
    latents: list[torch.Tensor]
    block_table: torch.Tensor
    block_size: int
    scratch_slot: int
    scratch_block: int

    @classmethod
    def allocate(cls, model: KimiLinearForCausalLM, num_slots: int, max_tokens: int,
                 block_size: int = 64) -> DecodePools:
        """Pools for ``num_slots`` sequences of up to ``max_tokens`` tokens each, slot s owning blocks
        ``s * max_blocks ..`` (what :func:`generate` needs), plus the scratch slot and block."""
        layers = model.model.layers
        kda = [layer.self_attn for layer in layers if layer.is_kda]
        widths = [layer.self_attn.cache_width for layer in layers if not layer.is_kda]
        dtype, device = model.dtype, model.device
        nb = max(1, math.ceil(max_tokens / block_size))
        rows, blocks = num_slots + 1, num_slots * nb + 1
        table = torch.arange(num_slots * nb, dtype=torch.int32, device=device).view(num_slots, nb)
        table = torch.cat([table, torch.full((1, nb), blocks - 1, dtype=torch.int32, device=device)])
        states = [m.empty_state(rows, dtype, device) for m in kda]
        return cls(
            conv=[st.conv for st in states], rec=[st.recurrent for st in states],
            latents=[torch.zeros(blocks, block_size, w, dtype=dtype, device=device) for w in widths],
            block_table=table, block_size=block_size, scratch_slot=num_slots, scratch_block=blocks - 1,
        )

    @property
    def max_tokens(self) -> int:
        return self.block_table.shape[1] * self.block_size


def decode_step(model: KimiLinearForCausalLM, pools: DecodePools, ids: torch.Tensor, slots: torch.Tensor,
                lens: torch.Tensor) -> torch.Tensor:
    """One token of every row: ids, slots, lens [b] int64 (lens = tokens already cached) -> logits [b, vocab]
    float32. Appends each row's KDA state and latent to its slot and block in place. Fixed shapes, no host sync."""
    return decode_logits(model, pools, ids, slots, lens).float()


def decode_logits(model: KimiLinearForCausalLM, pools: DecodePools, ids: torch.Tensor, slots: torch.Tensor,
                  lens: torch.Tensor) -> torch.Tensor:
    """:func:`decode_step` with the LM head's logits in the model's dtype."""
    m = model.model
    caches: list[Any] = []
    kda_j = mla_j = 0
    if pools.latents:
        # each row's table [b, max_blocks], flat write row [b] and key count [b] (one kernel on CUDA)
        table, dst, seq_lens = paged_decode_rows(pools.block_table, slots, lens, pools.block_size)
    for layer in m.layers:
        if layer.is_kda:
            caches.append(PooledKDAState(pools.conv[kda_j], pools.rec[kda_j], slots))
            kda_j += 1
        else:
            caches.append(PagedLatentView(pools.latents[mla_j], table, seq_lens, dst))
            mla_j += 1
    moes = model.__dict__.get("_moe_layers")
    if moes is None:            # walking every module costs more than a small step's work: once per model
        moes = model.__dict__["_moe_layers"] = [mod for mod in model.modules() if isinstance(mod, SparseMoE)]
    for moe in moes:
        moe.static_dispatch = True
    try:
        x = m.run_layers(m.embed_tokens(ids[:, None]), caches, None, None)
        return model.lm_head(m.norm(x))[:, -1]
    finally:
        for moe in moes:
            moe.static_dispatch = False


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """Every row's argmax, -1 for a row with a NaN logit: logits [b, vocab] -> int64 [b]."""
    return logits_and_greedy_torch(logits)[1]


@dataclass
class _Bucket:
    """One padded batch size: its static input buffer ids | slots | lens (int64 [3b]), and on CUDA its graph,
    output logits [b, vocab] and their :func:`greedy_ids` [b] (in the graph: a greedy engine step then reads back
    b integers and launches nothing else)."""

    inputs: torch.Tensor
    graph: Any = None
    logits: torch.Tensor | None = None
    greedy: torch.Tensor | None = None


@dataclass
class DecodeGraphs:
    """:func:`decode_step` per batch bucket, captured as CUDA graphs (``capture``) or run eagerly (CPU tests).

    broken: why capturing failed (then every step runs eagerly and :meth:`run` returns None).
    """

    model: Any
    pools: DecodePools
    max_batch: int
    capture: bool
    buckets: dict[int, _Bucket] = field(default_factory=dict)
    capture_seconds: float = 0.0
    broken: str | None = None
    greedy: torch.Tensor | None = None      # after a graph replay: its rows' greedy_ids [n]; None after eager

    def __post_init__(self) -> None:
        self.sizes = batch_buckets(self.max_batch)
        self.device = self.pools.block_table.device
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.sizes if b >= n), None)

    @torch.inference_mode()
    def run(self, ids: Sequence[int], slots: Sequence[int], lens: Sequence[int]) -> torch.Tensor | None:
        """Host lists of n rows -> logits [n, vocab] float32 (a view of the graph's output: read it before the next
        call), or None when no bucket fits or capturing failed (then the caller decodes another way). One
        host-to-device copy of 3b int64s per step."""
        n = len(ids)
        b = self.bucket(n)
        if b is None or self.broken is not None:
            return None
        return self._replay(b, self._host_inputs(ids, slots, lens, b), n)

    def _host_inputs(self, ids: Sequence[int], slots: Sequence[int], lens: Sequence[int], b: int) -> torch.Tensor:
        """Bucket b's input buffer on the host, int64 [3b] = [ids | slots | lens], n rows then the padding rows
        (token 0 at the scratch slot, length 0)."""
        pad = b - len(slots)
        return torch.tensor([*ids, *[0] * pad, *slots, *[self.pools.scratch_slot] * pad, *lens, *[0] * pad],
                            dtype=torch.int64)

    @torch.inference_mode()
    def run_device(self, ids: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor) -> torch.Tensor | None:
        """Like :meth:`run` with the rows' inputs already on the device ([n] int64 each): no host sync, so a
        generation loop can sample, feed back and replay without reading anything back."""
        n = ids.shape[0]
        b = self.bucket(n)
        if b is None or self.broken is not None:
            return None
        if b != n:
            pad = b - n
            ids = torch.cat([ids, ids.new_zeros(pad)])
            slots = torch.cat([slots, slots.new_full((pad,), self.pools.scratch_slot)])
            lens = torch.cat([lens, lens.new_zeros(pad)])
        return self._replay(b, torch.cat([ids, slots, lens]), n)

    @torch.inference_mode()
    def launch(self, ids: Sequence[int] | torch.Tensor, slots: Sequence[int], lens: Sequence[int]
               ) -> torch.Tensor | None:
        """One step of n rows for a pipelined caller: like :meth:`run`, but nothing here waits for the device (the
        host inputs travel through page-locked memory on CUDA, so the step queues behind one still running), and
        ``ids`` may be a device tensor [n] instead of a host list: the previous step's greedy ids, written into the
        step's input buffer on the device (a -1 there, a row with NaN logits, is fed as token 0: that row's output
        is the caller's to discard). Returns the rows' :func:`greedy_ids` [n] on the device (the graph's own, or
        computed from an eager step's logits; a graph's are overwritten by its next replay), or None when
        :meth:`run` would."""
        n = len(slots)
        b = self.bucket(n)
        if b is None or self.broken is not None:
            return None
        fed = ids if isinstance(ids, torch.Tensor) else None
        host = self._host_inputs([0] * n if fed is not None else ids, slots, lens, b)
        if self.device.type == "cuda":
            host = host.pin_memory()
        logits = self._replay(b, host, n, fed)
        if logits is None:
            return None
        return self.greedy if self.greedy is not None else greedy_ids(logits)

    def _replay(self, b: int, inputs: torch.Tensor, n: int, fed: torch.Tensor | None = None) -> torch.Tensor | None:
        """Copy ``inputs`` [3b] into bucket b's input buffer (``fed``: the first n ids from the device instead),
        then replay its graph or run the step eagerly; the logits of the first n rows."""
        step = self.buckets.get(b) or self._build(b)
        if step is None:
            return None
        step.inputs.copy_(inputs, non_blocking=inputs.device.type == "cpu" and inputs.is_pinned())
        if fed is not None:
            torch.clamp(fed, min=0, out=step.inputs[:n])
        return self._run_bucket(step, b, n)

    @torch.inference_mode()
    def run_next(self, ids: torch.Tensor) -> torch.Tensor | None:
        """The n rows of this object's previous step one token further: ``ids`` [n] (int64, on the device) become
        their input ids and every length grows by one, written into the bucket's input buffer in place (two small
        kernels; slots, padding rows and everything else stay as that step left them). For a caller that owns
        these graphs and steps the same rows every time (``generate``); None when that bucket was never run."""
        n = ids.shape[0]
        b = self.bucket(n)
        step = self.buckets.get(b) if b is not None and self.broken is None else None
        if step is None:
            return None
        step.inputs[:n].copy_(ids)
        step.inputs[2 * b : 2 * b + n] += 1
        return self._run_bucket(step, b, n)

    def _run_bucket(self, step: _Bucket, b: int, n: int) -> torch.Tensor:
        """Replay bucket b's graph on its input buffer as it stands (or run the step eagerly without one): the
        logits of the first n rows; :attr:`greedy` follows."""
        if step.graph is None:
            self.greedy = None
            return self.forward(step.inputs, b)[:n]
        step.graph.replay()
        assert step.logits is not None and step.greedy is not None
        self.greedy = step.greedy[:n]
        return step.logits[:n]

    def forward(self, inputs: torch.Tensor, b: int) -> torch.Tensor:
        """The step eagerly: static ``inputs`` [3b] -> logits [b, vocab] float32."""
        return self.forward_logits(inputs, b).float()

    def forward_logits(self, inputs: torch.Tensor, b: int) -> torch.Tensor:
        """The step a graph captures (before its :func:`~kimi_linear.ops.logits_and_greedy`): logits [b, vocab] in
        the model's dtype."""
        return decode_logits(self.model, self.pools, inputs[:b], inputs[b : 2 * b], inputs[2 * b :])

    @torch.inference_mode()
    def capture_all(self) -> int:
        """Build (capture) every bucket not built yet, largest first (smaller graphs then reuse the shared pool's
        memory). Returns the number of buckets held."""
        for b in reversed(self.sizes):
            if b not in self.buckets and self.broken is None:
                self._build(b)
        return len(self.buckets)

    def _build(self, b: int) -> _Bucket | None:
        step = _Bucket(torch.empty(3 * b, dtype=torch.int64, device=self.device))
        if self.capture:
            t0 = time.perf_counter()
            try:
                self._capture(step, b)
            except Exception as e:     # never fail a request over a graph: decode another way from now on
                self.broken = f"{type(e).__name__}: {e}"
                log.exception("CUDA graph capture failed for batch %d; decoding eagerly", b)
                return None
            self.capture_seconds += time.perf_counter() - t0
        self.buckets[b] = step
        return step

    def _capture(self, step: _Bucket, b: int) -> None:
        # Warm-up and capture with padding rows only: the warm-up really runs (it compiles the Triton kernels and
        # builds cached weights outside the graph) and so must touch nothing but the scratch slot and block.
        s = self.pools.scratch_slot
        step.inputs.copy_(torch.tensor([0] * b + [s] * b + [0] * b, dtype=torch.int64))
        cur = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            logits_and_greedy(self.forward_logits(step.inputs, b))
        cur.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # The garbage collector must not run inside the capture: collecting an object that owns a CUDA graph (an
        # engine or generate call that is gone) resets that graph, which a capturing stream does not permit, and
        # the capture fails (seen on the H200 at random buckets). Collect first, then hold it off.
        gc.collect()
        gc.disable()
        try:
            # thread_local: the engine runs in its own thread; other threads' CUDA calls must not abort the capture.
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                # the cast and the argmax fused (ops.logits_and_greedy: two kernels where PyTorch's five took 30 us
                # of a batch-1 step on the H200)
                step.logits, step.greedy = logits_and_greedy(self.forward_logits(step.inputs, b))
        finally:
            gc.enable()
        step.graph = graph
