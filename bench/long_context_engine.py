"""The measurements of ``bench/long_context.py``, all through :class:`kimi_linear.engine.LLMEngine`:

- :func:`decode_point`: time per output token of ``batch`` sequences at ``context`` tokens. The contexts are put in
  place without a prefill: the requests are admitted by the engine's scheduler, their MLA blocks taken from the
  engine's block pool by its cache manager (``grow``), and the pools (latent blocks, KDA slots) filled with random
  values of the right shapes; each sequence is marked as having computed all but its last prompt token. From there
  the engine decodes exactly as after a real prefill (its block table is synced to the device on the first step,
  the CUDA graph of the batch bucket captured, the paged MLA kernel reads the blocks).
- :func:`prefill_point`: one sequence's prompt of ``context`` tokens prefilled through the engine in chunks (its
  scheduler, its runner's chunk forwards), timed to the first token; then decoded for the same TPOT measurement
  from the real cache.

Each returns a JSON-ready dict with the cache bytes the engine allocated for a sequence beside ``kimi-linear
info``'s prediction (:func:`kimi_linear.model.memory.cache_bytes`, the function the CLI calls) and the point's
floor.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from engine_timing import timed_steps
from floors import WeightSplit, decode_cache_bytes, prefill_flops, sync
from kimi_linear.engine import EngineConfig, LLMEngine, SamplingParams
from kimi_linear.model.memory import cache_bytes


def engine_config(batch: int, tokens: int, block_size: int, chunk: int) -> EngineConfig:
    """Pools for ``batch`` sequences of up to ``tokens`` tokens (plus the scheduler's one-block headroom per running
    sequence); no prefix caching (nothing is shared, and its KDA snapshots would take 4 x batch more slots); the
    fixed-shape decode step (CUDA graphs on a GPU, the same step eagerly on a CPU)."""
    per = math.ceil(tokens / block_size) + 1
    return EngineConfig(max_num_seqs=batch, num_blocks=batch * (per + 1), block_size=block_size,
                        prefill_chunk=chunk, max_num_batched_tokens=chunk, prefix_caching=False, num_snapshots=0,
                        cuda_graphs=True)


def memory_row(engine: LLMEngine, model: Any, context: int) -> dict[str, Any]:
    """Cache bytes of the engine's first running sequence (its KDA slot + its blocks) against ``kimi-linear
    info``'s prediction for ``context`` tokens, and the pools' total."""
    seq = engine.running[0]
    got = engine.slots.slot_bytes() + len(seq.block_table) * engine.blocks.block_bytes()
    want = cache_bytes(model.config, context, model.dtype)
    return dict(seq_cache_bytes=got, info_cache_bytes=want.hybrid, info_all_mla_bytes=want.all_mla,
                seq_blocks=len(seq.block_table), pool_bytes=sum(engine.allocated_bytes().values()))


def _timed_steps(engine: LLMEngine, warmup: int, steps: int) -> dict[str, float]:
    """``warmup`` engine steps (the first captures the bucket's graph), then ``steps`` timed ones (TPOT: their wall
    time over ``steps``, and the host's own share: ``engine_timing.timed_steps``); then the same bucket's graph
    replayed alone ``steps`` times (the device's share, without the engine's host work)."""
    for _ in range(warmup):
        engine.step()
    sync()
    out = dict(timed_steps(engine, steps), steps=steps, pipelined_steps=engine.counters.get("pipelined_steps", 0))
    graphs = engine.runner.graphs
    # a failed capture decodes eagerly from then on (far slower): the row says so
    out.update(graph_steps=engine.counters["graph_decode_forwards"],
               graphs_broken=graphs.broken if graphs is not None else "no graphs")
    bucket = graphs.buckets.get(graphs.bucket(len(engine.running))) if graphs is not None else None
    if bucket is not None and bucket.graph is not None:
        sync()
        t = time.perf_counter()
        for _ in range(steps):
            bucket.graph.replay()      # re-runs the last step's inputs: rewrites that step's entries, harmless
        sync()
        out["replay_ms"] = 1e3 * (time.perf_counter() - t) / steps
    return out


def _release(engine: LLMEngine) -> None:
    for s in list(engine.running) + list(engine.waiting):
        engine.abort(s.request_id)
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _peak_reset() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak() -> float | None:
    return torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None


def decode_point(model: Any, context: int, batch: int, warmup: int, steps: int, block_size: int, chunk: int,
                 bw: float, seed: int = 0) -> dict[str, Any]:
    """TPOT of ``batch`` sequences decoding at ``context`` tokens, contexts placed with random cache contents (see
    the module docstring)."""
    _peak_reset()
    t0 = time.perf_counter()
    engine = LLMEngine(model, engine_config(batch, context + warmup + steps + 2, block_size, chunk))
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(model.config.vocab_size, (context,), generator=gen).tolist()
    params = SamplingParams(max_tokens=warmup + steps + 2, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"d{i}", prompt, params)
    engine.scheduler.admit()
    if len(engine.running) != batch:
        raise RuntimeError(f"decode point {context} x {batch}: the scheduler admitted {len(engine.running)} of "
                           f"{batch} sequences (pool of {engine.blocks.num_blocks} blocks)")
    for s in engine.running:
        if not engine.cache.grow(s, context):
            raise RuntimeError(f"decode point {context} x {batch}: the block pool ran out")
        s.num_computed = context - 1            # the last prompt token is the first decode step's input
    fill_pools(engine, seed)
    setup_s = time.perf_counter() - t0
    row = dict(kind="decode", context=context, batch=batch, fill="random", setup_s=setup_s,
               **memory_row(engine, model, context))            # before decoding adds blocks
    row.update(_timed_steps(engine, warmup, steps))
    row.update(floors_decode(model, batch, context, bw), tok_per_s=1e3 * batch / row["step_ms"], peak_gb=_peak())
    _release(engine)
    return row


@torch.no_grad()
def fill_pools(engine: LLMEngine, seed: int) -> None:
    """Random contents of the right scale in every pool tensor: normed latents and rope keys ~ N(0, 1), conv
    windows ~ N(0, 1), KDA memories ~ N(0, 0.05^2) (a bounded delta-rule state). Drawn on the pools' device."""
    for i, t in enumerate(engine.blocks.data + engine.slots.conv + engine.slots.rec):
        gen = torch.Generator(device=t.device).manual_seed(seed + i)
        t.normal_(0.0, 1.0, generator=gen)
    for t in engine.slots.rec:
        t.mul_(0.05)


def floors_decode(model: Any, batch: int, context: int, bw: float) -> dict[str, float]:
    w = WeightSplit.of(model).decode_bytes(batch)
    c = decode_cache_bytes(model, batch, context)
    return dict(weight_bytes=w, cache_read_bytes=c, floor_ms=1e3 * (w + c) / bw)


def floors_prefill(model: Any, context: int, chunk: int, rate: float) -> dict[str, float]:
    f = prefill_flops(model, context, chunk)
    return dict(flops=f["total"], flops_parts=f, floor_s=f["total"] / rate)


_WARM: set[tuple] = set()


def warm_prefill(model: Any, block_size: int, chunk: int) -> None:
    """Compile the prompt-chunk kernels (a first chunk and a chunk after it) outside any timing, once per model."""
    key = (id(model), chunk)
    if key in _WARM:
        return
    n = chunk + 2 * block_size
    engine = LLMEngine(model, engine_config(1, n + 4, block_size, chunk))
    engine.add_request("warm", [i % model.config.vocab_size for i in range(n)],
                       SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    while engine.has_work():
        engine.step()
    sync()
    _release(engine)
    _WARM.add(key)


def prefill_point(model: Any, context: int, warmup: int, steps: int, block_size: int, chunk: int, bw: float,
                  rate: float, seed: int = 1, progress: Callable[[int, float], None] | None = None,
                  every_s: float = 15.0) -> dict[str, Any]:
    """One sequence of ``context`` prompt tokens prefilled in chunks of ``chunk`` through the engine, timed to its
    first token; then ``warmup`` + ``steps`` decode steps from the real cache. ``progress(tokens, seconds)`` is
    called about every ``every_s`` seconds of the prefill (so a run cut short still says how far it got)."""
    warm_prefill(model, block_size, chunk)
    _peak_reset()
    engine = LLMEngine(model, engine_config(1, context + warmup + steps + 2, block_size, chunk))
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(model.config.vocab_size, (context,), generator=gen).tolist()
    first: list[float] = []
    engine.add_request("p", prompt, SamplingParams(max_tokens=warmup + steps + 2, temperature=0, ignore_eos=True),
                       lambda out: first.append(time.perf_counter()) if out.token_ids and not first else None)
    sync()
    t0 = time.perf_counter()
    chunks = 0
    reported = t0
    while not first:
        engine.step()
        chunks += 1
        now = time.perf_counter()
        if progress is not None and now - reported >= every_s and not first:
            reported = now
            progress(sum(s.num_computed for s in engine.running), now - t0)
    prefill_s = first[0] - t0
    peak_prefill = _peak()
    row = dict(kind="prefill", context=context, batch=1, fill="prefill", prefill_s=prefill_s, chunk=chunk,
               chunk_steps=chunks, prefill_tok_per_s=context / prefill_s, peak_prefill_gb=peak_prefill,
               **memory_row(engine, model, context), **floors_prefill(model, context, chunk, rate))
    row.update({f"decode_{k}": v for k, v in _timed_steps(engine, warmup, steps).items()})
    row.update({f"decode_{k}": v for k, v in floors_decode(model, 1, context, bw).items()})
    row["peak_gb"] = _peak()
    _release(engine)
    return row
