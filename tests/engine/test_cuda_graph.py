"""The fixed-shape decode step that the engine captures as CUDA graphs (``kimi_linear.model.paged``), run eagerly
on CPU (``cuda_graphs=True``): it gives the tokens and log-probs of the normal engine path at any context length,
and its padding rows cannot change real state. (Capturing a graph needs a GPU: ``bench/engine_gpu.py`` does that.)"""

from __future__ import annotations

import random
from functools import partial

import pytest
import torch

from kimi_linear.engine import EngineConfig, LLMEngine, SamplingParams
from kimi_linear.layers import SparseMoE
from kimi_linear.layers.activation import SiTUGLU, silu_glu
from kimi_linear.model import KimiLinearForCausalLM, preset_config
from kimi_linear.model.paged import batch_buckets, greedy_ids

from .test_engine import EOS, run_all


@pytest.fixture(scope="module")
def model() -> KimiLinearForCausalLM:
    torch.manual_seed(0)
    return KimiLinearForCausalLM(preset_config("tiny", eos_token_id=EOS)).init_weights(0).eval()


def static_engine(model: KimiLinearForCausalLM, **cfg) -> LLMEngine:
    """An engine whose decode batches go through the fixed-shape step, eagerly (no GPU here)."""
    engine = LLMEngine(model, EngineConfig(cuda_graphs=True, **cfg))
    assert engine.graphs is not None and not engine.graphs.capture
    return engine


def record_buckets(engine: LLMEngine) -> list[tuple[int, int]]:
    """(rows, padded batch) of every fixed-shape step the engine runs."""
    seen: list[tuple[int, int]] = []
    graphs = engine.graphs
    assert graphs is not None
    inner = graphs.bucket

    def bucket(n: int):
        b = inner(n)
        if b is not None:
            seen.append((n, b))
        return b

    graphs.bucket = bucket  # type: ignore[method-assign]
    return seen


def mixed_requests(seed: int, n: int, max_prompt: int, max_new: int) -> dict[str, tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    return {str(i): ([rng.randrange(256) for _ in range(rng.randrange(1, max_prompt))],
                     SamplingParams(max_tokens=rng.randrange(1, max_new), temperature=0, logprobs=0))
            for i in range(n)}


def run_with_logprobs(engine: LLMEngine, reqs) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
    lps: dict[str, list[float]] = {k: [] for k in reqs}
    outs = run_all(engine, reqs, lambda o: lps[o.request_id].extend(lp for _, lp, _ in o.logprobs))
    return outs, lps


def test_buckets():
    assert batch_buckets(1) == [1] and batch_buckets(16) == [1, 2, 4, 8, 16] and batch_buckets(6) == [1, 2, 4, 6]


def test_cpu_default_is_the_eager_path(model):
    engine = LLMEngine(model, EngineConfig(max_num_seqs=2))
    assert engine.graphs is None and engine.slots.scratch is None and engine.blocks.scratch is None
    assert "graph_scratch" not in engine.allocated_bytes()


def test_fixed_shape_step_matches_the_eager_engine(model):
    """Greedy tokens equal and log-probs within float32 rounding; rows join and leave (5 slots, 8 requests),
    batches are padded (3 rows -> bucket 4), contexts grow across many blocks (no length limit: the step reads
    latents through the block table) and every decode batch takes the fixed-shape step."""
    reqs = mixed_requests(1, 8, 50, 30)
    ref_out, ref_lp = run_with_logprobs(LLMEngine(model, EngineConfig(max_num_seqs=5, prefill_chunk=32)), reqs)
    engine = static_engine(model, max_num_seqs=5, prefill_chunk=32)
    seen = record_buckets(engine)
    out, lp = run_with_logprobs(engine, reqs)
    assert out == ref_out
    for k in reqs:
        assert lp[k] == pytest.approx(ref_lp[k], abs=1e-5), k
    c = engine.counters
    assert c["graph_decode_forwards"] == c["decode_forwards"] > 0
    assert any(n < b for n, b in seen)
    assert engine.stats()["kda_slots_used"] == 0 and engine.stats()["mla_blocks_used"] == 0


def test_fixed_shape_step_after_preemption_and_prefix_hits(model):
    """Block tables follow slots: a preempted sequence readmitted into another slot, and sequences that start from
    shared prefix blocks, decode exactly as the eager engine does."""
    rng = random.Random(3)
    base = [rng.randrange(256) for _ in range(40)]
    reqs = {str(i): (base + [rng.randrange(256) for _ in range(rng.randrange(1, 20))],
                     SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)) for i in range(5)}
    cfg = dict(max_num_seqs=4, num_blocks=14, prefill_chunk=16)
    ref_out, ref_lp = run_with_logprobs(LLMEngine(model, EngineConfig(**cfg)), reqs)
    engine = static_engine(model, **cfg)
    out, lp = run_with_logprobs(engine, reqs)
    assert out == ref_out and engine.counters["preemptions"] > 0 and engine.counters["prefix_cache_hits"] > 0
    for k in reqs:
        assert lp[k] == pytest.approx(ref_lp[k], abs=1e-5), k


def test_fixed_shape_step_with_k3_switches():
    """LatentMoE (dense dispatch in the latent space, SiTU), gated MLA and block AttnRes through the same step."""
    torch.manual_seed(0)
    k3 = KimiLinearForCausalLM(preset_config("k3-tiny", eos_token_id=EOS)).init_weights(0).eval()
    reqs = mixed_requests(5, 4, 40, 8)
    ref_out, ref_lp = run_with_logprobs(LLMEngine(k3, EngineConfig(max_num_seqs=3, prefill_chunk=32)), reqs)
    engine = static_engine(k3, max_num_seqs=3, prefill_chunk=32)
    out, lp = run_with_logprobs(engine, reqs)
    assert out == ref_out and engine.counters["graph_decode_forwards"] > 0
    for k in reqs:
        assert lp[k] == pytest.approx(ref_lp[k], abs=1e-5), k


def pool_tensors(engine: LLMEngine) -> list[torch.Tensor]:
    return engine.slots.conv + engine.slots.rec + engine.blocks.data + engine.snapshots.pool.conv + \
        engine.snapshots.pool.rec


def test_padding_rows_cannot_touch_real_state(model):
    """Three decoding rows padded to a batch of 4: every slot, block and snapshot the real rows do not own is
    unchanged bit for bit (cached prefix blocks included), and NaN in the scratch slot and block (what padding rows
    read) changes nothing in the real rows' logits, states or latents, bit for bit."""
    engine = static_engine(model, max_num_seqs=6, prefill_chunk=16)
    rng = random.Random(7)
    sp = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    # A finished request leaves cached prefix blocks and a KDA snapshot behind.
    run_all(engine, {"old": ([rng.randrange(256) for _ in range(40)], SamplingParams(max_tokens=2, temperature=0))})
    for i in range(3):
        engine.add_request(str(i), [rng.randrange(256) for _ in range(5 + 9 * i)], sp)
    while not all(s.num_tokens() - s.num_computed == 1 for s in engine.running) or len(engine.running) < 3:
        engine.step()
    seqs = list(engine.running)
    assert all(engine.scheduler.reserve(s, s.num_computed + 1) for s in seqs)   # what step() does before decoding
    graphs = engine.graphs
    assert graphs is not None and graphs.bucket(3) == 4
    assert engine.blocks.num_used() < engine.blocks.num_blocks and len(engine.blocks.free_cached) > 0
    before = [t.clone() for t in pool_tensors(engine)]

    logits, _ = engine.runner.decode(seqs)
    assert logits.shape == (3, model.config.vocab_size) and logits.isfinite().all()
    logits = logits.clone()
    after = [t.clone() for t in pool_tensors(engine)]
    # What the real rows may change: their own slots, and in each MLA layer one position of their own blocks.
    owned_slots = {s.slot for s in seqs} | {engine.slots.scratch}
    written = {(s.block_table[s.num_computed // 16], s.num_computed % 16) for s in seqs}
    n_slot = len(engine.slots.conv) + len(engine.slots.rec)
    for i, (b, a) in enumerate(zip(before, after)):
        if i < n_slot:
            keep = [r for r in range(b.shape[0]) if r not in owned_slots]
            assert torch.equal(b[keep], a[keep]), i
            assert not torch.equal(b[[s.slot for s in seqs]], a[[s.slot for s in seqs]])
        elif i < n_slot + len(engine.blocks.data):
            changed = {(int(x), int(y)) for x, y, _ in (b != a).nonzero().tolist()}
            assert changed - {(engine.blocks.scratch, 0)} == written, i
        else:
            assert torch.equal(b, a), i                                     # snapshots: untouched

    # Again from the same state, with NaN where padding rows read: real rows come out identical.
    for t, b in zip(pool_tensors(engine), before):
        t.copy_(b)
    for t in engine.slots.conv + engine.slots.rec + engine.blocks.data:
        t[-1] = float("nan")                                                # the scratch row of each pool
    logits_nan, _ = engine.runner.decode(seqs)
    assert torch.equal(logits_nan, logits)
    for i, (a, t) in enumerate(zip(after, pool_tensors(engine))):
        assert torch.equal(a[:-1], t[:-1]) if i < n_slot + len(engine.blocks.data) else torch.equal(a, t), i

    # And the eager engine step from the same state agrees (to rounding: the batch shapes differ).
    for t, b in zip(pool_tensors(engine), before):
        t.copy_(b)
    eager = engine.runner.forward(seqs, 1)
    torch.testing.assert_close(eager, logits, rtol=1e-5, atol=1e-5)
    for a, t in zip(after, pool_tensors(engine)):
        torch.testing.assert_close(t[:-1], a[:-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("latent", [False, True])
def test_dense_moe_dispatch_matches_routed(latent):
    """SparseMoE.static_dispatch (every expert, dense routing weights) == the routed paths (one token, and the
    sorted dispatch of a batch), including group-limited routing and LatentMoE with SiTU."""
    torch.manual_seed(0)
    moe = SparseMoE(32, 48, 8, 2, 1, 2.5, True, n_group=2 if latent else 1, topk_group=1,
                    glu=SiTUGLU() if latent else silu_glu,
                    latent_size=16 if latent else None, latent_norm=latent).eval()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    for n in (1, 5):
        x = torch.randn(n, 32)
        with torch.inference_mode():
            ref = moe(x)
            moe.static_dispatch = True
            try:
                got = moe(x)
            finally:
                moe.static_dispatch = False
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_memory_budget_counts_the_scratch_rows(model):
    engine = LLMEngine(model, EngineConfig(max_num_seqs=4, num_snapshots=0, memory=8 * 2**20, cuda_graphs=True))
    b = engine.allocated_bytes()
    assert b["graph_scratch"] == engine.slots.slot_bytes() + engine.blocks.block_bytes()
    assert b["block_table"] == 5 * engine.cache.pools.block_table.shape[1] * 4     # int32, one row per slot
    assert sum(b.values()) <= 8 * 2**20 < sum(b.values()) + engine.blocks.block_bytes()
    with pytest.raises(ValueError, match="`max_num_batched_tokens`"):
        EngineConfig(max_num_batched_tokens=0).validate()
    with pytest.raises(ValueError, match="`cuda_graphs`"):
        EngineConfig(cuda_graphs="yes").validate()  # type: ignore[arg-type]


class _FakeStream:
    def __init__(self, device=None) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on CPU: ``replay`` re-runs the step (set by the test after capture)."""

    def __init__(self) -> None:
        self.replay_fn = None

    def replay(self) -> None:
        assert self.replay_fn is not None
        self.replay_fn()


def fake_replay(graphs, step, b: int) -> None:
    """What a captured step's replay does: the step's logits and, in the graph too, its rows' greedy ids."""
    step.logits.copy_(graphs.forward(step.inputs, b))
    step.greedy.copy_(greedy_ids(step.logits))


def test_capture_bookkeeping_with_a_fake_cuda_api(model, monkeypatch):
    """Not a CUDA graph (that needs a GPU: bench/engine_gpu.py captures real ones): the capture code path with the
    torch.cuda calls replaced, to check its bookkeeping on CPU. Capturing every bucket (whose warm-up really runs)
    touches no slot, block or snapshot but the scratch rows, and replays give the eager engine's tokens."""
    from contextlib import nullcontext

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream())
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g, pool=None, capture_error_mode=None: nullcontext())
    reqs = mixed_requests(9, 6, 40, 12)
    ref_out, _ = run_with_logprobs(LLMEngine(model, EngineConfig(max_num_seqs=4, prefill_chunk=32)), reqs)

    engine = LLMEngine(model, EngineConfig(max_num_seqs=4, prefill_chunk=32, cuda_graphs=True))
    graphs = engine.graphs
    assert graphs is not None
    graphs.capture = True                              # what a CUDA model gets (the fake API stands in)
    graphs.pool = torch.cuda.graph_pool_handle()
    for t in pool_tensors(engine):
        t.normal_()                                    # stands for other requests' state
    before = [t.clone() for t in pool_tensors(engine)]
    assert engine.capture_cuda_graphs() == 3 and graphs.broken is None          # buckets 1, 2, 4
    with_scratch = len(engine.slots.conv + engine.slots.rec + engine.blocks.data)   # pools whose last row is scratch
    for i, (b, a) in enumerate(zip(before, pool_tensors(engine))):
        if i < with_scratch:
            b, a = b[:-1], a[:-1]
        assert torch.equal(b, a), i
    for b, step in graphs.buckets.items():
        assert step.logits is not None and step.logits.shape == (b, model.config.vocab_size)
        step.graph.replay_fn = partial(fake_replay, graphs, step, b)
    out, _ = run_with_logprobs(engine, reqs)
    assert out == ref_out and engine.counters["graph_decode_forwards"] > 0
