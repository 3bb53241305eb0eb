"""Pipelined greedy decoding (``EngineConfig.pipeline_decode``): each step launches the next decode step, fed on the
device with the greedy ids of the step in flight, before it reads that step's tokens back. On CPU the fixed-shape
step runs eagerly through the very same code. Every test compares the pipelined engine with the serial one
(``pipeline_decode=False``) output for output, and checks that the pipeline really ran."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable

import pytest
import torch

import kimi_linear.model.paged as paged_mod
from kimi_linear.engine import EngineConfig, LLMEngine, SamplingParams
from kimi_linear.engine.offline import run_batch
from kimi_linear.engine.sequence import RequestOutput
from kimi_linear.model import KimiLinearForCausalLM, preset_config

EOS = 256
Requests = dict[str, tuple[list[int], SamplingParams]]
Outputs = dict[str, list[RequestOutput]]


@pytest.fixture(scope="module")
def model() -> KimiLinearForCausalLM:
    torch.manual_seed(0)
    return KimiLinearForCausalLM(preset_config("tiny", eos_token_id=EOS)).init_weights(0).eval()


class ToyTokenizer:
    """One letter per token: texts and stop strings without a real vocabulary."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids if not (skip_special_tokens and t == EOS))


def make_engine(model, pipeline: bool, tokenizer=None, **cfg) -> LLMEngine:
    engine = LLMEngine(model, EngineConfig(cuda_graphs=True, pipeline_decode=pipeline, **cfg), tokenizer)
    assert engine.graphs is not None and engine.cfg.pipeline_decode is pipeline
    return engine


def add_all(engine: LLMEngine, reqs: Requests, outs: Outputs) -> None:
    for k, (p, sp) in reqs.items():
        outs.setdefault(k, [])
        engine.add_request(k, p, sp, outs[k].append)


def run(engine: LLMEngine, reqs: Requests, before_step: Callable[[LLMEngine, Outputs], None] | None = None
        ) -> Outputs:
    """Every output of every request, in order; ``before_step`` is called before each step."""
    outs: Outputs = {}
    add_all(engine, reqs, outs)
    for _ in range(10_000):
        if not engine.has_work():
            break
        if before_step is not None:
            before_step(engine, outs)
        engine.step()
    assert not engine.has_work(), "engine did not drain"
    assert all(o and o[-1].finished for o in outs.values())
    s = engine.stats()
    assert s["kda_slots_used"] == s["mla_blocks_used"] == s["running"] == s["waiting"] == 0
    assert engine._inflight is None
    return outs


def tokens(outs: Outputs) -> dict[str, list[int]]:
    return {k: [t for o in v for t in o.token_ids] for k, v in outs.items()}


def spy_decode_rows(engine: LLMEngine) -> tuple[Counter, list[list[str]]]:
    """How many decode forwards each request rode in (serial or pipelined), and the pipelined steps' rows."""
    per_request: Counter = Counter()
    launched: list[list[str]] = []
    decode, launch = engine.runner.decode, engine.runner.launch_decode

    def spy_decode(seqs):
        per_request.update(s.request_id for s in seqs)
        return decode(seqs)

    def spy_launch(seqs, fed):
        per_request.update(s.request_id for s in seqs)
        launched.append([s.request_id for s in seqs])
        return launch(seqs, fed)

    engine.runner.decode = spy_decode  # type: ignore[method-assign]
    engine.runner.launch_decode = spy_launch  # type: ignore[method-assign]
    return per_request, launched


def greedy_requests(seed: int, n: int, max_prompt: int, max_new: int, **kw) -> Requests:
    rng = random.Random(seed)
    return {f"r{i}": ([rng.randrange(256) for _ in range(rng.randrange(1, max_prompt))],
                      SamplingParams(max_tokens=rng.randrange(1, max_new), temperature=0, **kw)) for i in range(n)}


def both(model, reqs: Requests, tokenizer=None, **cfg) -> tuple[Outputs, Outputs, LLMEngine, LLMEngine]:
    serial, piped = make_engine(model, False, tokenizer, **cfg), make_engine(model, True, tokenizer, **cfg)
    return run(serial, reqs), run(piped, reqs), serial, piped


# ------------------------------------------------------------------------------------------------------ tests
def test_config_defaults_and_checks():
    assert EngineConfig().resolved("cuda").pipeline_decode is True
    assert EngineConfig().resolved("cpu").pipeline_decode is False
    assert EngineConfig(cuda_graphs=True).resolved("cpu").pipeline_decode is True
    assert EngineConfig(cuda_graphs=True, pipeline_decode=False).resolved("cuda").pipeline_decode is False
    with pytest.raises(ValueError, match="`pipeline_decode` needs"):
        EngineConfig(pipeline_decode=True).resolved("cpu")
    with pytest.raises(ValueError, match="`pipeline_decode` must be"):
        EngineConfig(pipeline_decode="yes").validate()  # type: ignore[arg-type]


def test_pipelined_batch_matches_serial(model):
    """Greedy requests with different prompt lengths and max_tokens, more than the slots (they queue, join and
    leave): the same outputs, request by request, output by output; the same counters (no EOS here, so not one
    forward more); every request rides in exactly as many decode forwards as serially (none past its length)."""
    reqs = greedy_requests(1, 9, 40, 30, ignore_eos=True)
    cfg = dict(max_num_seqs=4, prefill_chunk=16)
    serial, piped = make_engine(model, False, **cfg), make_engine(model, True, **cfg)
    rows_serial, _ = spy_decode_rows(serial)
    rows_piped, launched = spy_decode_rows(piped)
    want, got = run(serial, reqs), run(piped, reqs)
    assert got == want
    assert rows_piped == rows_serial
    c, ref = piped.counters, serial.counters
    assert c["pipelined_steps"] > 10 and len(launched) > c["pipelined_steps"] and c["discarded_tokens"] == 0
    for name in ("generation_tokens", "prefill_tokens", "requests_finished", "decode_forwards", "prefill_forwards",
                 "graph_decode_forwards", "steps"):
        assert c[name] == ref[name], name
    assert ref["pipelined_steps"] == 0


def test_eos_and_stop_ids_mid_run(model, monkeypatch):
    """EOS (the model's, taken from the serial run's tokens) and a stop token id end requests while other rows
    keep decoding: the finished row's token of the step in flight is discarded, its slot goes to a waiting request,
    and every output equals the serial engine's."""
    reqs = greedy_requests(2, 6, 30, 40)
    free = {k: (p, SamplingParams(max_tokens=sp.max_tokens, temperature=0, ignore_eos=True)) for k, (p, sp) in
            reqs.items()}
    cfg = dict(max_num_seqs=3, prefill_chunk=16)
    plain = tokens(run(make_engine(model, False, **cfg), free))
    long = max(plain, key=lambda k: len(plain[k]))
    eos = plain[long][len(plain[long]) // 3]                 # ends that request a third of the way
    others = [k for k in plain if k != long and len(plain[k]) > 4]
    stop_id = plain[others[0]][3]
    reqs[others[0]] = (reqs[others[0]][0], SamplingParams(max_tokens=reqs[others[0]][1].max_tokens, temperature=0,
                                                          stop_token_ids=[stop_id], ignore_eos=True))
    monkeypatch.setattr(model.config, "eos_token_id", eos)
    want, got, serial, piped = both(model, reqs, **cfg)
    assert got == want
    assert want[long][-1].finish_reason == "stop" and want[others[0]][-1].finish_reason == "stop"
    assert len(tokens(want)[long]) < len(plain[long])
    c, ref = piped.counters, serial.counters
    assert c["pipelined_steps"] > 0 and c["discarded_tokens"] > 0
    assert c["generation_tokens"] == ref["generation_tokens"]
    assert ref["decode_forwards"] <= c["decode_forwards"] <= ref["decode_forwards"] + c["discarded_tokens"]


def test_stop_string(model):
    """A stop string (found by the detokenizer after the token is read back) ends a request in flight: the same
    text, cut before the stop string, and the same outputs."""
    tok = ToyTokenizer()
    reqs = greedy_requests(3, 3, 20, 30, ignore_eos=True)
    plain = run(make_engine(model, False, tok, max_num_seqs=4), reqs)
    key = max(plain, key=lambda k: len(tokens(plain)[k]))
    text = "".join(o.text for o in plain[key])
    i = next(i for i in range(4, len(text) - 2) if text.find(text[i : i + 2]) == i)
    p, sp = reqs[key]
    reqs[key] = (p, SamplingParams(max_tokens=sp.max_tokens, temperature=0, ignore_eos=True, stop=[text[i : i + 2]]))
    want, got, _, piped = both(model, reqs, tok, max_num_seqs=4)
    assert got == want
    assert want[key][-1].finish_reason == "stop" and "".join(o.text for o in want[key]) == text[:i]
    assert piped.counters["pipelined_steps"] > 0 and piped.counters["discarded_tokens"] > 0


def abort_at(key: str, n: int, flag: dict[str, bool]) -> Callable[[LLMEngine, Outputs], None]:
    """Abort request ``key`` before the first step at which it has emitted ``n`` tokens."""

    def hook(engine: LLMEngine, outs: Outputs) -> None:
        if not flag.get(key) and sum(len(o.token_ids) for o in outs[key]) >= n:
            flag[key] = True
            if engine._inflight is not None:
                flag["in_flight"] = any(s.request_id == key for s in engine._inflight.rows)
            assert engine.abort(key)

    return hook


def test_abort_in_flight(model):
    """Aborting a request whose next token is in flight: the same outputs as aborting it serially after the same
    tokens (its pending token dropped); the other rows go on."""
    reqs = greedy_requests(4, 4, 20, 30, ignore_eos=True)
    key = max(reqs, key=lambda k: reqs[k][1].max_tokens)
    serial_flags: dict[str, bool] = {}
    piped_flags: dict[str, bool] = {}
    want = run(make_engine(model, False, max_num_seqs=4), reqs, abort_at(key, 8, serial_flags))
    piped = make_engine(model, True, max_num_seqs=4)
    got = run(piped, reqs, abort_at(key, 8, piped_flags))
    assert got == want and want[key][-1].finish_reason == "abort" and len(tokens(want)[key]) == 8
    assert piped_flags["in_flight"] and piped.counters["discarded_tokens"] == 1
    assert piped.counters["requests_aborted"] == 1


def test_abort_everything_in_flight(model):
    """Aborting every row of the step in flight reads it back at once: nothing is left behind."""
    engine = make_engine(model, True, max_num_seqs=4)
    outs: Outputs = {}
    add_all(engine, greedy_requests(5, 3, 20, 30, ignore_eos=True), outs)
    while engine.counters["pipelined_steps"] < 2:
        engine.step()
    assert engine._inflight is not None
    for k in list(outs):
        engine.abort(k)
    assert engine._inflight is None and not engine.has_work()
    assert all(v[-1].finish_reason == "abort" for v in outs.values())
    assert engine.stats()["kda_slots_used"] == engine.stats()["mla_blocks_used"] == 0


def test_request_arriving_while_pipelined(model):
    """A request added while the pipeline runs drains it (it is admitted at the next step, as serially) and the
    pipeline picks up again afterwards."""
    reqs = greedy_requests(6, 2, 20, 40, ignore_eos=True)
    late = {"late": ([7, 8, 9, 10, 11], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))}
    first = next(iter(reqs))

    def add_late(flag: dict[str, int]):
        def hook(engine: LLMEngine, outs: Outputs) -> None:
            if "late" not in outs and sum(len(o.token_ids) for o in outs[first]) >= 6:
                flag["pipelined_before"] = engine.counters["pipelined_steps"]
                add_all(engine, late, outs)
        return hook

    cfg = dict(max_num_seqs=4, prefill_chunk=16)
    f_serial: dict[str, int] = {}
    f_piped: dict[str, int] = {}
    want = run(make_engine(model, False, **cfg), reqs, add_late(f_serial))
    piped = make_engine(model, True, **cfg)
    got = run(piped, reqs, add_late(f_piped))
    assert got == want and "late" in got
    assert 0 < f_piped["pipelined_before"] < piped.counters["pipelined_steps"]


def test_sampled_requests_force_the_serial_path(model):
    """Greedy and sampled requests (and one asking for log-probs) together: pipelined steps hold only greedy rows
    without log-probs, and every output is the serial engine's (seeded sampling included)."""
    reqs = greedy_requests(7, 3, 20, 30, ignore_eos=True)
    reqs["s0"] = ([1, 2, 3], SamplingParams(max_tokens=6, temperature=0.8, seed=1, ignore_eos=True))
    reqs["s1"] = ([4, 5], SamplingParams(max_tokens=9, temperature=1.0, top_k=20, seed=2, ignore_eos=True))
    reqs["lp"] = ([6, 7, 8], SamplingParams(max_tokens=5, temperature=0, logprobs=2, ignore_eos=True))
    cfg = dict(max_num_seqs=6, prefill_chunk=16)
    serial, piped = make_engine(model, False, **cfg), make_engine(model, True, **cfg)
    _, launched = spy_decode_rows(piped)
    want, got = run(serial, reqs), run(piped, reqs)
    assert got == want
    assert piped.counters["pipelined_steps"] > 0
    for rows in launched:
        assert not {"s0", "s1", "lp"} & set(rows), rows


def test_preemption_with_a_tiny_block_pool(model):
    """A block pool too small for every row: pipelined rounds never take a block that is not plainly free, the
    serial rounds between them preempt and recompute, and the outputs are the serial engine's."""
    rng = random.Random(8)
    reqs = {str(i): ([rng.randrange(256) for _ in range(20)],
                     SamplingParams(max_tokens=28, temperature=0, ignore_eos=True)) for i in range(4)}
    want, got, serial, piped = both(model, reqs, max_num_seqs=4, num_blocks=7, prefill_chunk=16,
                                    prefix_caching=False)
    assert got == want
    assert piped.counters["preemptions"] > 0 and piped.counters["pipelined_steps"] > 0
    assert piped.counters["preemptions"] == serial.counters["preemptions"]


def test_preemption_and_prefix_hits(model):
    """Shared prefixes (prefix-cache hits, cached free blocks) and preemption together."""
    rng = random.Random(3)
    base = [rng.randrange(256) for _ in range(40)]
    reqs = {str(i): (base + [rng.randrange(256) for _ in range(rng.randrange(1, 20))],
                     SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)) for i in range(5)}
    want, got, serial, piped = both(model, reqs, max_num_seqs=4, num_blocks=14, prefill_chunk=16)
    assert got == want
    c = piped.counters
    assert c["preemptions"] > 0 and c["prefix_cache_hits"] > 0 and c["pipelined_steps"] > 0


def test_a_failing_row_in_flight_ends_alone(model, monkeypatch):
    """NaN logits in one row of a pipelined step (greedy id -1, fed to the next step as token 0) and a tokenizer
    that fails on another request: each ends alone with an error; the others give the serial engine's outputs."""
    reqs = greedy_requests(9, 4, 20, 30, ignore_eos=True)
    reqs["nan"] = ([1, 2, 3], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    reqs["detok"] = ([3, 2, 1], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    want = run(make_engine(model, False, ToyTokenizer(), max_num_seqs=6), reqs)

    engine = make_engine(model, True, ToyTokenizer(), max_num_seqs=6)
    inner, launch = paged_mod.greedy_ids, engine.runner.launch_decode
    launching: dict[str, list] = {"rows": []}

    def remember(seqs, fed):
        launching["rows"].append([s.request_id for s in seqs])
        return launch(seqs, fed)

    def poisoned(logits: torch.Tensor) -> torch.Tensor:
        # The greedy ids of the pipelined steps' eager runs: the fifth one gives the "nan" row NaN logits.
        ids = inner(logits)
        rows = launching["rows"][-1]
        if len(launching["rows"]) == 5 and "nan" in rows:
            ids[rows.index("nan")] = -1
        return ids

    engine.runner.launch_decode = remember  # type: ignore[method-assign]
    monkeypatch.setattr(paged_mod, "greedy_ids", poisoned)
    outs: Outputs = {}
    add_all(engine, reqs, outs)
    seq = engine.by_id["detok"]
    detok = seq.detok.decode

    def boom(ids):
        if len(ids) > 6:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a tokenizer that fails on this output")
        return detok(ids)

    seq.detok.decode = boom
    while engine.has_work():
        engine.step()
    got = tokens(outs)
    assert outs["nan"][-1].finish_reason == "error" and "NaN" in outs["nan"][-1].error
    assert outs["detok"][-1].finish_reason == "error" and "UnicodeDecodeError" in outs["detok"][-1].error
    for k in ("nan", "detok"):
        assert got[k] == tokens(want)[k][: len(got[k])], k
    for k in reqs:
        if k not in ("nan", "detok"):
            assert outs[k] == want[k], k
    assert engine.counters["pipelined_steps"] > 0 and engine.counters["discarded_tokens"] >= 2
    assert engine.stats()["kda_slots_used"] == engine.stats()["mla_blocks_used"] == 0


def test_run_batch_drains_the_pipeline(model):
    """``offline.run_batch`` (``while has_work(): step()``) finishes every request of a pipelined engine."""
    reqs = greedy_requests(10, 5, 30, 20, ignore_eos=True)
    batch = list(reqs.values())
    want = run_batch(make_engine(model, False, max_num_seqs=4), batch)
    engine = make_engine(model, True, max_num_seqs=4)
    got = run_batch(engine, batch)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert engine.counters["pipelined_steps"] > 0 and not engine.has_work()


def test_an_output_callback_that_aborts_every_row(model):
    """An output callback that aborts every request while the pipelined step's tokens are emitted (the step the
    round just launched loses all its rows): the engine reads that step back and is left with nothing."""
    engine = make_engine(model, True, max_num_seqs=4)
    outs: Outputs = {}

    def sink(o: RequestOutput) -> None:
        outs[o.request_id].append(o)
        n = sum(len(x.token_ids) for x in outs["a"])
        if o.request_id == "a" and n == 6 and engine._inflight is not None:
            for k in ("a", "b"):
                engine.abort(k)

    for k, p in (("a", [1, 2, 3]), ("b", [4, 5, 6, 7])):
        outs[k] = []
        engine.add_request(k, p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), sink)
    while engine.has_work():
        engine.step()
    assert [v[-1].finish_reason for v in outs.values()] == ["abort", "abort"]
    assert sum(len(o.token_ids) for o in outs["a"]) == 6 and engine._inflight is None
    assert engine.counters["pipelined_steps"] > 0 and engine.stats()["kda_slots_used"] == 0


def test_background_loop(model):
    """The server's engine thread (``EngineLoop``) drives a pipelined engine to the serial engine's tokens."""
    import asyncio

    from kimi_linear.engine.background import EngineLoop

    reqs = greedy_requests(11, 4, 20, 20, ignore_eos=True)
    want = tokens(run(make_engine(model, False, max_num_seqs=4), reqs))
    engine = make_engine(model, True, max_num_seqs=4)
    loop = EngineLoop(engine)
    keys = list(reqs)

    async def main() -> dict[str, list[int]]:
        got: dict[str, list[int]] = {k: [] for k in keys}
        async for i, o in loop.generate_many([(k, p, sp) for k, (p, sp) in reqs.items()]):
            got[keys[i]].extend(o.token_ids)
        return got

    try:
        got = asyncio.run(main())
    finally:
        loop.close()
    assert got == want and engine.counters["pipelined_steps"] > 0 and not engine.has_work()
