"""One request's failure in its own post-processing (NaN logits, a sampling error, a detokenizer that raises) ends
that request alone with finish_reason "error"; the others in the batch produce exactly their one-by-one tokens.
Temperatures too small to divide by sample greedily; seeds outside 64 bits are refused."""

from __future__ import annotations

import random

import pytest
import torch

import kimi_linear.engine.engine as engine_mod
from kimi_linear.engine import EngineConfig, LLMEngine, SamplingParams
from kimi_linear.engine.sampling import SamplingError, sample
from kimi_linear.model import KimiLinearForCausalLM, preset_config

EOS = 256


@pytest.fixture(scope="module")
def model() -> KimiLinearForCausalLM:
    torch.manual_seed(0)
    return KimiLinearForCausalLM(preset_config("tiny", eos_token_id=EOS)).init_weights(0).eval()


def run(engine: LLMEngine, reqs: dict[str, tuple[list[int], SamplingParams]], hook=None):
    toks: dict[str, list[int]] = {k: [] for k in reqs}
    ends: dict[str, tuple[str, str | None]] = {}

    def sink(o):
        toks[o.request_id].extend(o.token_ids)
        if o.finished:
            ends[o.request_id] = (o.finish_reason, o.error)

    for k, (p, sp) in reqs.items():
        seq = engine.add_request(k, p, sp, sink)
        if hook is not None:
            hook(k, seq)
    for _ in range(2_000):
        if not engine.has_work():
            break
        engine.step()
    assert not engine.has_work() and set(ends) == set(reqs)
    return toks, ends


def good_requests() -> dict[str, tuple[list[int], SamplingParams]]:
    rng = random.Random(7)
    reqs = {f"g{i}": ([rng.randrange(256) for _ in range(rng.randrange(3, 40))],
                      SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)) for i in range(3)}
    reqs["seeded"] = ([5, 6, 7, 8], SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True))
    return reqs


def one_by_one(model, reqs):
    out = {}
    for k, r in reqs.items():
        toks, ends = run(LLMEngine(model, EngineConfig(max_num_seqs=4)), {k: r})
        assert ends[k][0] == "length"
        out[k] = toks[k]
    return out


def test_a_failing_request_ends_alone(model, monkeypatch):
    reqs = good_requests()
    alone = one_by_one(model, reqs)
    bad_nan = SamplingParams(max_tokens=12, temperature=0.7, seed=1, ignore_eos=True)
    bad_greedy_nan = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    calls = {"nan": 0}

    def poisoned(logits, params, generator):
        # The two bad requests get NaN logits from their third token on (a model blowing up on one row).
        if params is bad_nan or params is bad_greedy_nan:
            calls["nan"] += 1
            if calls["nan"] > 4:
                logits = logits * float("nan")
        return sample(logits, params, generator)

    monkeypatch.setattr(engine_mod, "sample", poisoned)

    def broken_detok(k, seq):
        if k == "bad_detok":
            def boom(ids):
                if len(ids) > 3:
                    raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a tokenizer that fails on this output")
                return ""
            seq.detok.decode = boom

    all_reqs = {**reqs, "bad_nan": ([1, 2, 3], bad_nan), "bad_greedy_nan": ([9, 9], bad_greedy_nan),
                "bad_detok": ([4, 4, 4], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))}
    engine = LLMEngine(model, EngineConfig(max_num_seqs=8))
    toks, ends = run(engine, all_reqs, hook=broken_detok)
    for k in ("bad_nan", "bad_greedy_nan"):
        assert ends[k][0] == "error" and "NaN" in ends[k][1], ends[k]
    assert ends["bad_detok"][0] == "error" and "UnicodeDecodeError" in ends["bad_detok"][1]
    for k in reqs:
        assert ends[k][0] == "length" and toks[k] == alone[k], k
    s = engine.stats()
    assert s["running"] == s["waiting"] == s["kda_slots_used"] == s["mla_blocks_used"] == 0


def test_tiny_temperatures_sample_greedily(model):
    prompt = [3, 1, 4, 1, 5]
    greedy = one_by_one(model, {"g": (prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))})["g"]
    for t in (1e-38, 5e-324, 1e-3):
        toks, ends = run(LLMEngine(model, EngineConfig(max_num_seqs=2)),
                         {"t": (prompt, SamplingParams(max_tokens=10, temperature=t, seed=3, ignore_eos=True))})
        assert ends["t"][0] == "length" and toks["t"] == greedy, t


def test_sample_refuses_nan_and_seed_range():
    logits = torch.zeros(8)
    logits[3] = float("nan")
    for p in (SamplingParams(temperature=0), SamplingParams(temperature=1.0)):
        with pytest.raises(SamplingError):
            sample(logits, p, torch.Generator())
    for seed in (-(2**63), 0, 2**64 - 1):
        SamplingParams(seed=seed).validate()
    for seed in (2**64, -(2**63) - 1, True, 1.5):
        with pytest.raises(ValueError, match="`seed`"):
            SamplingParams(seed=seed).validate()
