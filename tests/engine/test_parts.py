"""The engine's three parts on their own: the scheduler's plan under a token budget, the cache manager's block
tables, the model runner's batched prompt chunks."""

from __future__ import annotations

import random

import pytest
import torch

from kimi_linear.engine import EngineConfig, SamplingParams
from kimi_linear.engine import model_runner as runner_mod
from kimi_linear.engine.cache_manager import CacheManager
from kimi_linear.engine.model_runner import ModelRunner
from kimi_linear.engine.scheduler import Scheduler
from kimi_linear.engine.sequence import Sequence, Status
from kimi_linear.model import KimiLinearForCausalLM, preset_config

EOS = 256


@pytest.fixture(scope="module")
def model() -> KimiLinearForCausalLM:
    torch.manual_seed(0)
    return KimiLinearForCausalLM(preset_config("tiny", eos_token_id=EOS)).init_weights(0).eval()


def seq(rid: str, n: int, seed: int = 0) -> Sequence:
    rng = random.Random(seed)
    return Sequence(rid, [rng.randrange(256) for _ in range(n)], SamplingParams(max_tokens=4, temperature=0), None,
                    None, [EOS])


def parts(model, paged: bool = False, **cfg) -> tuple[CacheManager, Scheduler]:
    c = EngineConfig(**cfg).resolved("cpu")
    cache = CacheManager(model, c, paged=paged)
    return cache, Scheduler(c, cache, c.max_num_batched_tokens)


def test_plan_respects_the_token_budget_and_always_runs_one_chunk(model):
    cache, sched = parts(model, max_num_seqs=4, prefill_chunk=32, max_num_batched_tokens=40)
    for i, n in enumerate((100, 20, 10)):
        sched.waiting.append(seq(str(i), n, i))
    plan = sched.plan()
    # 32 of the first prompt, then the 20-token prompt would exceed 40: only one chunk.
    assert [(s.request_id, T) for s, T in plan.prefill] == [("0", 32)] and not plan.decode
    assert [s.request_id for s in sched.running] == ["0", "1", "2"]
    for s, T in plan.prefill:
        s.num_computed += T
    plan = sched.plan()
    assert [(s.request_id, T) for s, T in plan.prefill] == [("0", 32)]
    # A budget smaller than one chunk still runs one chunk (prompts progress).
    cache2, small = parts(model, max_num_seqs=2, prefill_chunk=32, max_num_batched_tokens=8)
    small.waiting.append(seq("x", 50))
    assert [T for _, T in small.plan().prefill] == [32]


def test_plan_puts_decode_rows_first_and_fills_the_rest(model):
    cache, sched = parts(model, max_num_seqs=4, prefill_chunk=16, max_num_batched_tokens=64)
    a, b = seq("a", 5, 1), seq("b", 40, 2)
    sched.waiting.extend([a, b])
    sched.admit()
    a.num_computed = 4                                  # one token left: a decode row
    plan = sched.plan()
    assert plan.decode == [a]
    assert [(s.request_id, T) for s, T in plan.prefill] == [("b", 16)]
    assert len(a.block_table) * 16 >= 5 and len(b.block_table) * 16 >= 16


def test_preemption_frees_the_newest_and_it_waits_first(model):
    cache, sched = parts(model, max_num_seqs=3, num_blocks=4, block_size=16, prefill_chunk=16, prefix_caching=False)
    s1, s2 = seq("1", 20, 1), seq("2", 20, 2)
    sched.waiting.extend([s1, s2])
    sched.admit()
    assert sched.running == [s1, s2]
    assert sched.reserve(s1, 20) and sched.reserve(s2, 20) and cache.blocks.num_free() == 0
    assert sched.reserve(s1, 40)                          # needs a third block: s2 (newest) is preempted
    assert s2.status == Status.WAITING and sched.waiting[0] is s2 and s2.slot is None and sched.preemptions == 1
    assert sched.hold_admission


def test_block_tables_reach_the_device_table_once(model):
    cache, sched = parts(model, paged=True, max_num_seqs=2, num_blocks=20, block_size=16, prefill_chunk=16)
    s = seq("a", 40)
    sched.waiting.append(s)
    sched.admit()
    table = cache.pools.block_table
    scratch = cache.blocks.scratch
    assert sched.reserve(s, 40)
    assert (table == scratch).all()                       # nothing pushed yet
    cache.sync_tables([s])
    assert table[s.slot, : len(s.block_table)].tolist() == s.block_table and s.table_synced == len(s.block_table)
    assert cache.grow(s, 80)
    table[s.slot, 0] = -7                                 # an entry already synced is not pushed again
    cache.sync_tables([s])
    assert table[s.slot, 1 : len(s.block_table)].tolist() == s.block_table[1:] and int(table[s.slot, 0]) == -7
    cache.release(s)
    assert s.table_synced == 0 and s.slot is None


def test_runner_batches_equal_chunks_exactly(model):
    """Three prompt chunks of 16 tokens in one [3, 16] forward (rows with different histories) give the logits of
    running each alone."""
    logits = {}
    for batched in (True, False):
        cache, sched = parts(model, max_num_seqs=3, prefill_chunk=16)
        runner = ModelRunner(model, cache, graphs=False, capture=False)
        seqs = [seq(str(i), n, i) for i, n in enumerate((20, 48, 33))]
        sched.waiting.extend(seqs)
        sched.admit()
        for s, done in zip(seqs, (4, 16, 0)):             # histories of 4, 16 and 0 tokens
            if done:
                sched.reserve(s, done)
                runner.forward([s], done)
                s.num_computed += done
        chunks = [(s, 16) for s in seqs]
        for s, T in chunks:
            sched.reserve(s, s.num_computed + T)
        if batched:
            out = runner.prefill(chunks)
        else:
            out = [(s, runner.forward([s], T)[0]) for s, T in chunks]
        logits[batched] = torch.stack([lg for _, lg in out])
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-5, atol=1e-5)


def test_runner_chunks_read_the_pool_in_place(model, monkeypatch):
    """Prompt chunks never gather a history: rows with equal cached lengths share one forward that reads and writes
    the paged pool in place; rows with different long histories (here: any, the dense path's mask limit at 0) run
    one forward per cached length; one-token rows of any lengths share one forward over the pool. Logits = one
    plain forward over each sequence's tokens so far."""
    monkeypatch.setattr(runner_mod, "DENSE_MASK_ELEMENTS", 0)
    monkeypatch.setattr(ModelRunner, "_histories", lambda *a: pytest.fail("a history was gathered"))
    cache, sched = parts(model, max_num_seqs=3, prefill_chunk=16)
    runner = ModelRunner(model, cache, graphs=False, capture=False)
    seqs = [seq(str(i), 60, i) for i in range(3)]
    sched.waiting.extend(seqs)
    sched.admit()
    for s, done in zip(seqs, (32, 32, 16)):
        for _ in range(done // 16):
            sched.reserve(s, s.num_computed + 16)
            runner.forward([s], 16)
            s.num_computed += 16
    sizes = []
    forward = runner.forward
    monkeypatch.setattr(runner, "forward", lambda group, T: sizes.append(len(group)) or forward(group, T))
    for s in seqs:
        sched.reserve(s, s.num_computed + 16)
    out = runner.prefill([(s, 16) for s in seqs])
    assert sorted(sizes) == [1, 2]
    with torch.no_grad():
        for s, lg in out:
            n = s.num_computed + 16
            want = model(torch.tensor([s.prompt_ids[:n]]), logits_to_keep=1).logits[0, -1]
            torch.testing.assert_close(lg, want, rtol=1e-5, atol=1e-5)
    # One-token rows of different lengths (the eager decode step) read the pool in place too.
    for s in seqs:
        s.num_computed += 16
        sched.reserve(s, s.num_computed + 1)
    logits = forward(seqs, 1)
    with torch.no_grad():
        for s, lg in zip(seqs, logits):
            want = model(torch.tensor([s.prompt_ids[: s.num_computed + 1]]), logits_to_keep=1).logits[0, -1]
            torch.testing.assert_close(lg, want, rtol=1e-5, atol=1e-5)


def test_resolved_defaults():
    cpu, gpu = EngineConfig().resolved("cpu"), EngineConfig().resolved("cuda")
    assert (cpu.prefill_chunk, cpu.max_num_batched_tokens, cpu.cuda_graphs) == (64, 64, False)
    assert (gpu.prefill_chunk, gpu.max_num_batched_tokens, gpu.cuda_graphs) == (2048, 32768, True)
    assert (cpu.block_size, gpu.block_size) == (16, 64) and EngineConfig().block_size is None
    assert EngineConfig(block_size=48).resolved("cuda").prefill_chunk == 2016
    assert EngineConfig(block_size=16).resolved("cuda").block_size == 16
    assert EngineConfig(block_size=None, prefill_chunk=100).validate().block_size is None   # resolved later
    with pytest.raises(ValueError, match="`block_size`"):
        EngineConfig(block_size=0).validate()
    with pytest.raises(ValueError, match="`max_num_batched_tokens`"):
        EngineConfig(max_num_batched_tokens=True).validate()  # type: ignore[arg-type]


@pytest.mark.parametrize("preset", ["tiny", "k3-tiny"])
def test_mixed_steps_equal_separate_forwards(preset):
    """EngineConfig(mixed_steps=True): decode rows and prompt chunks of several requests in one packed forward give
    the tokens and log-probs of separate forwards (rows join and leave; prefix hits and a preemption included)."""
    from .test_cuda_graph import mixed_requests, run_with_logprobs
    from .test_engine import LLMEngine

    torch.manual_seed(0)
    m = KimiLinearForCausalLM(preset_config(preset, eos_token_id=EOS)).init_weights(0).eval()
    reqs = mixed_requests(11, 8, 90, 20)
    base = [256 - i for i in range(40)]                           # a shared prefix: prefix-cache hits
    reqs.update({f"p{i}": (base + [i], SamplingParams(max_tokens=6, temperature=0, logprobs=0)) for i in range(3)})
    cfg = dict(max_num_seqs=4, prefill_chunk=16, max_num_batched_tokens=48, num_blocks=14)
    ref_out, ref_lp = run_with_logprobs(LLMEngine(m, EngineConfig(**cfg)), reqs)
    engine = LLMEngine(m, EngineConfig(mixed_steps=True, **cfg))
    packed: list[tuple[int, int]] = []                            # (one-token rows, longer chunks) per forward
    inner = engine.runner.mixed

    def spy(work):
        packed.append((sum(T == 1 for _, T in work), sum(T > 1 for _, T in work)))
        return inner(work)

    engine.runner.mixed = spy
    out, lp = run_with_logprobs(engine, reqs)
    assert out == ref_out
    for k in reqs:
        assert lp[k] == pytest.approx(ref_lp[k], abs=1e-4), k
    assert engine.counters["prefix_cache_hits"] > 0 and engine.counters["preemptions"] > 0
    # Some forwards carried decode rows and several prompt chunks together.
    assert any(d >= 1 and p >= 1 for d, p in packed) and any(p >= 2 for _, p in packed), packed
    assert engine.stats()["kda_slots_used"] == 0 and engine.stats()["mla_blocks_used"] == 0


def test_prefill_rows_sample_from_one_batched_readback(model, monkeypatch):
    """On a GPU the rows that finish their prompt in a step take their greedy tokens from one batched argmax
    read-back (the CPU samples row by row): with the read-back made the device's here, every request gets the CPU
    path's tokens (greedy ones from the batch, seeded-sampling and log-prob ones still from their own row), and a
    row with NaN logits fails alone."""
    from kimi_linear.model.paged import greedy_ids

    from .test_engine import LLMEngine, run_all

    rng = random.Random(4)
    reqs = {}
    for i in range(9):
        kind = ("greedy", "greedy", "seeded", "logprobs")[i % 4]
        params = dict(greedy={}, seeded=dict(temperature=0.8, seed=i), logprobs=dict(logprobs=2))[kind]
        reqs[f"{kind}{i}"] = ([rng.randrange(256) for _ in range(rng.randrange(3, 40))],
                              SamplingParams(max_tokens=5, **{"temperature": 0.0, **params}))
    cfg = dict(max_num_seqs=6, prefill_chunk=16, max_num_batched_tokens=96)
    ref = run_all(LLMEngine(model, EngineConfig(**cfg)), reqs)
    batches: list[int] = []

    def device_readback(logits):
        batches.append(logits.shape[0])
        return greedy_ids(logits).tolist()

    monkeypatch.setattr(LLMEngine, "_greedy_readback", staticmethod(device_readback))
    assert run_all(LLMEngine(model, EngineConfig(**cfg)), reqs) == ref
    assert max(batches) >= 3                                  # several prompts ended in one step
    monkeypatch.setattr(LLMEngine, "_greedy_readback", staticmethod(
        lambda logits: [-1 if r == 1 else g for r, g in enumerate(device_readback(logits))]))
    engine = LLMEngine(model, EngineConfig(**cfg))
    reasons = {}
    for k, (p, sp) in list(reqs.items())[:3]:
        engine.add_request(k, p, sp, lambda o: o.finished and reasons.setdefault(o.request_id, o.finish_reason))
    while engine.has_work():
        engine.step()
    assert sorted(reasons.values()).count("error") >= 1 and "length" in reasons.values()
