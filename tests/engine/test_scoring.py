"""The engine's prompt scoring (SamplingParams.prompt_logprobs): scored prompts share one forward, equal a plain
forward's log-probs, then generate the same greedy tokens as unscored requests; failures and aborts stay local."""

from __future__ import annotations

import random

import pytest
import torch

from kimi_linear.engine import EngineConfig, LLMEngine, SamplingParams
from kimi_linear.engine.offline import RequestFailed, run_batch
from kimi_linear.model import KimiLinearForCausalLM, preset_config

from .test_engine import EOS, reference


@pytest.fixture(scope="module")
def model() -> KimiLinearForCausalLM:
    torch.manual_seed(0)
    return KimiLinearForCausalLM(preset_config("tiny", eos_token_id=EOS)).init_weights(0).eval()


def prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(EOS) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def check_prompt_logprobs(model, prompt: list[int], got: list, top: int) -> None:
    assert got[0] is None and len(got) == len(prompt)
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    for t in range(1, len(prompt)):
        tok, lp, alts = got[t]
        assert tok == prompt[t]
        assert abs(lp - float(ref[t - 1, tok])) < 2e-5
        assert len(alts) == top
        if top:
            assert alts[0][0] == int(ref[t - 1].argmax()) and abs(alts[0][1] - float(ref[t - 1].max())) < 2e-5


@pytest.mark.parametrize("budget", [4096, 24])     # one packed forward / prompts over the budget run chunked
def test_scored_prompts_equal_a_plain_forward_and_share_forwards(model, budget):
    ps = prompts(6)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=4, max_num_scored_tokens=budget))
    outs = run_batch(engine, [(p, SamplingParams(max_tokens=0, prompt_logprobs=i % 3)) for i, p in enumerate(ps)])
    for i, (p, o) in enumerate(zip(ps, outs)):
        assert o.finish_reason == "length" and o.token_ids == [] and o.completion_tokens == 0
        check_prompt_logprobs(model, p, o.prompt_logprobs, i % 3)
    c = engine.counters
    assert c["scored_tokens"] == sum(map(len, ps)) and c["prefill_forwards"] == c["decode_forwards"] == 0
    if budget == 4096:
        assert c["score_forwards"] == 1
    assert engine.stats()["mla_blocks_used"] == 0 and engine.stats()["kda_slots_used"] == 0


def test_scored_requests_then_generate_the_same_greedy_tokens(model):
    ps = prompts(5, seed=1)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=3, prefill_chunk=16))
    reqs = [(p, SamplingParams(max_tokens=n, temperature=0, logprobs=1, prompt_logprobs=1 if i % 2 == 0 else None))
            for i, (p, n) in enumerate(zip(ps, [1, 6, 9, 1, 12]))]
    outs = run_batch(engine, reqs)
    for (p, sp), o in zip(reqs, outs):
        assert o.token_ids == reference(model, p, sp.max_tokens)
        assert len(o.logprobs) == len(o.token_ids)
        if sp.prompt_logprobs is None:
            assert o.prompt_logprobs is None
        else:
            check_prompt_logprobs(model, p, o.prompt_logprobs, 1)
            # The first token came from the scoring forward: its log-prob is that forward's at the last position.
            with torch.no_grad():
                last = model(torch.tensor([p])).logits[0, -1].float().log_softmax(-1)
            assert abs(o.logprobs[0][1] - float(last[o.token_ids[0]])) < 2e-5


def test_prompt_logprobs_come_once_in_the_first_output(model):
    engine = LLMEngine(model, EngineConfig(max_num_seqs=2))
    seen = []
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                      prompt_logprobs=0), seen.append)
    while engine.has_work():
        engine.step()
    assert len(seen) == 4 and seen[0].prompt_logprobs is not None and len(seen[0].prompt_logprobs) == 3
    assert all(o.prompt_logprobs is None for o in seen[1:])


def test_abort_while_waiting_to_be_scored(model):
    engine = LLMEngine(model, EngineConfig(max_num_seqs=2))
    ends = []
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=0, prompt_logprobs=0), ends.append)
    assert engine.stats()["waiting"] == 1 and engine.has_work()
    assert engine.abort("a") and not engine.has_work()
    assert [o.finish_reason for o in ends] == ["abort"] and engine.stats()["waiting"] == 0


def test_a_failing_scoring_forward_fails_its_requests_alone(model, monkeypatch):
    engine = LLMEngine(model, EngineConfig(max_num_seqs=2))

    def boom(seqs, top):
        raise RuntimeError("scoring broke")

    monkeypatch.setattr(engine.runner, "score", boom)
    with pytest.raises(RequestFailed, match="scoring broke"):
        run_batch(engine, [([1, 2], SamplingParams(max_tokens=1, prompt_logprobs=0))])
    assert not engine.has_work() and engine.stats()["kda_slots_used"] == 0
    # Requests that do not score are unaffected.
    (o,) = run_batch(engine, [([1, 2], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))])
    assert o.token_ids == reference(model, [1, 2], 2, eos=False)


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True, "1"])
def test_prompt_logprobs_is_validated(bad):
    with pytest.raises(ValueError, match="`prompt_logprobs` must be an integer in"):
        SamplingParams(prompt_logprobs=bad).validate()


def test_run_batch_refuses_bad_requests_before_running_any(model):
    engine = LLMEngine(model, EngineConfig(max_num_seqs=2))
    with pytest.raises(ValueError, match=r"request 1: `prompt` is empty"):
        run_batch(engine, [([1], SamplingParams(max_tokens=1)), ([], SamplingParams(max_tokens=1))])
    assert not engine.has_work()
