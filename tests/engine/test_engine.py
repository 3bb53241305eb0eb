"""Engine tests, in process: batching does not change greedy tokens, pool overflow preempts and recomputes
exactly, prefix caching reuses blocks and KDA snapshots, pool bytes match `kimi-linear info`'s arithmetic."""

from __future__ import annotations

import random

import pytest
import torch

from kimi_linear.engine import EngineConfig, LLMEngine, SamplingParams
from kimi_linear.model import KimiLinearForCausalLM, preset_config
from kimi_linear.model.memory import cache_bytes

EOS = 256


@pytest.fixture(scope="module")
def model() -> KimiLinearForCausalLM:
    torch.manual_seed(0)
    return KimiLinearForCausalLM(preset_config("tiny", eos_token_id=EOS)).init_weights(0).eval()


def reference(model: KimiLinearForCausalLM, prompt: list[int], n: int, eos: bool = True) -> list[int]:
    """A single-request greedy run with the model's own generate (stops after EOS like the engine)."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, eos_token_id=EOS if eos else None)
    toks = out[0, len(prompt):].tolist()
    return toks[: toks.index(EOS) + 1] if eos and EOS in toks else toks


def run_all(engine: LLMEngine, reqs: dict[str, tuple[list[int], SamplingParams]], also=None) -> dict[str, list[int]]:
    outs: dict[str, list[int]] = {k: [] for k in reqs}
    reasons: dict[str, str] = {}

    def sink(o):
        if also is not None:
            also(o)
        outs[o.request_id].extend(o.token_ids)
        if o.finished:
            reasons[o.request_id] = o.finish_reason

    for k, (p, sp) in reqs.items():
        engine.add_request(k, p, sp, sink)
    for _ in range(10_000):
        if not engine.has_work():
            break
        engine.step()
    assert not engine.has_work(), "engine did not drain"
    assert set(reasons) == set(reqs)
    return outs


@pytest.mark.parametrize("block_size, prefill_chunk, max_prompt", [(None, 32, 50), (64, 64, 150)])
def test_continuous_batching_matches_single_request_greedy(model, block_size, prefill_chunk, max_prompt):
    """CPU's default 16-token blocks, and a GPU's default 64 (prompts long enough to span several blocks)."""
    rng = random.Random(1)
    reqs = {str(i): ([rng.randrange(256) for _ in range(rng.randrange(1, max_prompt))],
                     SamplingParams(max_tokens=rng.randrange(1, 12), temperature=0, logprobs=0)) for i in range(8)}
    # 5 slots for 8 requests: they join and leave between steps; prefill chunks interleave with decode.
    engine = LLMEngine(model, EngineConfig(max_num_seqs=5, prefill_chunk=prefill_chunk, block_size=block_size))
    assert engine.cfg.block_size == (block_size or 16)
    lps: dict[str, list[float]] = {k: [] for k in reqs}
    outs = run_all(engine, reqs, lambda o: lps[o.request_id].extend(lp for _, lp, _ in o.logprobs))
    for k, (p, sp) in reqs.items():
        assert outs[k] == reference(model, p, sp.max_tokens), k
        # Not just the same argmax: the same distribution (greedy tokens of a random model hide small errors).
        ids, logits = model.generate(torch.tensor([p]), max_new_tokens=len(outs[k]), eos_token_id=None,
                                     return_logits=True)
        ref_lp = [float(lg[0].log_softmax(-1)[t]) for lg, t in zip(logits, outs[k])]
        assert lps[k] == pytest.approx(ref_lp, abs=2e-4), k
    s = engine.stats()
    assert s["kda_slots_used"] == 0 and s["mla_blocks_used"] == 0 and s["running"] == 0


def test_pool_overflow_preempts_and_recomputes_exactly(model):
    rng = random.Random(2)
    reqs = {str(i): ([rng.randrange(256) for _ in range(20)], SamplingParams(max_tokens=28, temperature=0,
                                                                             ignore_eos=True)) for i in range(4)}
    # 7 blocks x 16 = 112 tokens for 4 sequences that each grow to 48: admitted with 2 blocks each, decode runs
    # out of blocks and preempts the newest, which is recomputed from its tokens later.
    engine = LLMEngine(model, EngineConfig(max_num_seqs=4, num_blocks=7, prefill_chunk=16, prefix_caching=False))
    outs = run_all(engine, reqs)
    assert engine.counters["preemptions"] > 0
    for k, (p, _) in reqs.items():
        assert outs[k] == reference(model, p, 28, eos=False), k
    assert engine.blocks.num_free() == 7 and len(engine.slots.free) == 4


def test_prefix_cache_reuses_blocks_and_kda_snapshot(model):
    rng = random.Random(3)
    prefix = [rng.randrange(256) for _ in range(320)]
    a, b = prefix + [1, 2, 3, 4, 5], prefix + [9, 8, 7]
    engine = LLMEngine(model, EngineConfig(max_num_seqs=2, prefill_chunk=64))
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    out_a = run_all(engine, {"a": (a, sp)})["a"]
    before = dict(engine.counters)
    lps: list[float] = []
    out_b = run_all(engine, {"b": (b, sp)}, lambda o: lps.extend(lp for _, lp, _ in o.logprobs))["b"]
    _, logits = model.generate(torch.tensor([b]), max_new_tokens=6, eos_token_id=None, return_logits=True)
    assert lps == pytest.approx([float(lg[0].log_softmax(-1)[t]) for lg, t in zip(logits, out_b)], abs=2e-4)
    assert engine.counters["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] == 320
    assert engine.counters["prefill_tokens"] - before["prefill_tokens"] == 3
    assert out_a == reference(model, a, 6, eos=False)
    assert out_b == reference(model, b, 6, eos=False)


def test_prefix_cache_extends_a_previous_prompt_to_its_last_full_block(model):
    """The next turn of a conversation contains the whole previous prompt: reused up to its last full block
    (336 of 350 tokens), not only up to the last multiple of the prefill chunk (320)."""
    rng = random.Random(4)
    first = [rng.randrange(256) for _ in range(350)]
    nxt = first + [rng.randrange(256) for _ in range(30)]
    engine = LLMEngine(model, EngineConfig(max_num_seqs=2, prefill_chunk=64))
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    run_all(engine, {"1": (first, sp)})
    before = engine.counters["prefix_cache_hit_tokens"]
    out = run_all(engine, {"2": (nxt, sp)})["2"]
    assert engine.counters["prefix_cache_hit_tokens"] - before == 336
    assert out == reference(model, nxt, 3, eos=False)


def test_abort_frees_slot_and_blocks(model):
    engine = LLMEngine(model, EngineConfig(max_num_seqs=2, prefix_caching=False))
    got = []
    engine.add_request("x", list(range(50)), SamplingParams(max_tokens=100, temperature=0, ignore_eos=True),
                       got.append)
    for _ in range(5):
        engine.step()
    assert engine.stats()["mla_blocks_used"] > 0
    assert engine.abort("x")
    assert got[-1].finished and got[-1].finish_reason == "abort"
    s = engine.stats()
    assert s["running"] == 0 and s["kda_slots_used"] == 0 and s["mla_blocks_used"] == 0


def test_seeded_sampling_is_reproducible_under_batching(model):
    sp = dict(max_tokens=12, temperature=0.8, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    alone = run_all(LLMEngine(model, EngineConfig(max_num_seqs=4)), {"s": ([5, 6, 7], SamplingParams(**sp))})["s"]
    reqs = {"s": ([5, 6, 7], SamplingParams(**sp))}
    reqs.update({f"o{i}": ([i + 1] * (i + 3), SamplingParams(max_tokens=9, temperature=1.0)) for i in range(3)})
    mixed = run_all(LLMEngine(model, EngineConfig(max_num_seqs=4)), reqs)["s"]
    assert alone == mixed and len(alone) == 12


def test_stop_string_cuts_text():
    from kimi_linear.engine.sequence import Detokenizer

    d = Detokenizer(lambda ids: bytes(ids).decode("utf-8", "replace"), ["END"])
    ids = list(b"abcEN")
    text, hit = d.update(ids, False)
    assert (text, hit) == ("abc", False)         # "EN" held back: could start "END"
    text, hit = d.update(list(b"abcENDxyz"), False)
    assert (text, hit) == ("", True) and d.text == "abc"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_allocated_bytes_match_info_table(model, dtype):
    """One sequence of `context` tokens: the engine's KDA slot + MLA blocks == memory.cache_bytes (what
    `kimi-linear info` prints) for the same config, context and cache dtype."""
    m = KimiLinearForCausalLM(model.config).cast(dtype) if dtype != torch.float32 else model
    context = 2048
    engine = LLMEngine(m, EngineConfig(max_num_seqs=1, num_blocks=context // 16, num_snapshots=0))
    cb = cache_bytes(m.config, context, cache_dtype=dtype)
    got = engine.allocated_bytes()
    assert got["kda_slots"] == cb.kda_state
    assert got["mla_blocks"] == cb.mla_latent
    assert got["kda_snapshots"] == 0


def test_memory_budget_sizes_pools_and_errors_name_the_field(model):
    engine = LLMEngine(model, EngineConfig(max_num_seqs=4, num_snapshots=0, memory=8 * 2**20))
    b = engine.allocated_bytes()
    assert sum(b.values()) <= 8 * 2**20 < sum(b.values()) + engine.blocks.block_bytes()
    with pytest.raises(ValueError, match="`memory`"):
        LLMEngine(model, EngineConfig(max_num_seqs=4, memory=1000))
    with pytest.raises(ValueError, match="`prefill_chunk`"):
        EngineConfig(prefill_chunk=20).resolved("cpu")
    with pytest.raises(ValueError, match="`prefill_chunk` \\(48\\) must be a multiple of `block_size` \\(64\\)"):
        EngineConfig(prefill_chunk=48).resolved("cuda")           # a GPU's blocks are 64 tokens, a CPU's 16
    EngineConfig(prefill_chunk=48).resolved("cpu")
    with pytest.raises(ValueError, match="`max_tokens`"):
        engine.check_request([1, 2], SamplingParams(max_tokens=-1))
    with pytest.raises(ValueError, match="context"):
        engine.check_request([1] * 4096, SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        engine.check_request([1, 999], SamplingParams())


def test_k3_options_batch_exactly_too():
    """Kimi K3 switches (gated MLA, block AttnRes, LatentMoE, ...) change no engine assumption."""
    torch.manual_seed(0)
    k3 = KimiLinearForCausalLM(preset_config("k3-tiny", eos_token_id=EOS)).init_weights(0).eval()
    rng = random.Random(5)
    reqs = {str(i): ([rng.randrange(256) for _ in range(rng.randrange(1, 60))],
                     SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)) for i in range(4)}
    outs = run_all(LLMEngine(k3, EngineConfig(max_num_seqs=3, prefill_chunk=32)), reqs)
    for k, (p, _) in reqs.items():
        assert outs[k] == reference(k3, p, 6, eos=False), k


@pytest.mark.parametrize("graphs", [False, True])
def test_long_prompt_through_the_pool_matches_one_plain_forward(graphs, monkeypatch):
    """A prompt of many chunks whose MLA attention visits the cached keys in several blocks (the key-block size cut
    to 100 keys), then greedy decoding (eager, or the fixed-shape step): the tokens are the argmax of one plain
    forward over prompt + generated tokens, and so are their log-probabilities. Weights drawn 15x larger than the
    recipe's, so that attention moves the logits (a 1% error in merging the key blocks moves them by ~1e-3)."""
    from kimi_linear.layers import mla

    torch.manual_seed(0)
    model = KimiLinearForCausalLM(preset_config("tiny", eos_token_id=EOS, initializer_range=0.3)).init_weights(0)
    model.eval()

    per_key = model.config.num_attention_heads * (2 * (model.config.qk_nope_head_dim + model.config.qk_rope_head_dim)
                                                  + model.config.qk_nope_head_dim + model.config.v_head_dim) * 4
    monkeypatch.setattr(mla, "KEY_BLOCK_BYTES", 100 * per_key)
    rng = random.Random(5)
    prompt = [rng.randrange(256) for _ in range(700)]
    engine = LLMEngine(model, EngineConfig(max_num_seqs=2, prefill_chunk=128, cuda_graphs=graphs))
    out: list[int] = []
    lps: list[float] = []

    def sink(o):
        out.extend(o.token_ids)
        lps.extend(lp for _, lp, _ in o.logprobs)

    engine.add_request("long", prompt, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=0), sink)
    while engine.has_work():
        engine.step()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out[:-1]]), logits_to_keep=len(out)).logits[0].log_softmax(-1)
    assert out == logits.argmax(-1).tolist()
    assert lps == pytest.approx([float(logits[i, t]) for i, t in enumerate(out)], abs=2e-4)
