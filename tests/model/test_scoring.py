"""Prompt scoring (kimi_linear.model.scoring): packed and chunked forwards give every prompt token's log-prob
as a plain forward over that prompt alone does."""

from __future__ import annotations

import random

import pytest
import torch

from kimi_linear.model import KimiLinearForCausalLM, preset_config
from kimi_linear.model.scoring import score_prompts


@pytest.fixture(scope="module")
def model() -> KimiLinearForCausalLM:
    torch.manual_seed(0)
    return KimiLinearForCausalLM(preset_config("tiny")).init_weights(0).eval()


def plain(model: KimiLinearForCausalLM, prompt: list[int]) -> torch.Tensor:
    """log-softmax [T, vocab] of one prompt's own forward."""
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)


@pytest.mark.parametrize("chunk", [4096, 16])      # everything packed in one forward / long prompts chunked
def test_scores_match_a_forward_per_prompt(model, chunk):
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (1, 2, 33, 37, 90, 5)]
    got = score_prompts(model, prompts, top=3, chunk=chunk, rows=7)
    assert len(got) == len(prompts)
    for p, s in zip(prompts, got):
        ref = plain(model, p)
        assert s.logprobs.shape == (len(p) - 1,) and s.top_ids.shape == s.top_logprobs.shape == (len(p) - 1, 3)
        if len(p) > 1:
            want = ref[:-1].gather(-1, torch.tensor(p[1:])[:, None])[:, 0]
            torch.testing.assert_close(s.logprobs, want, atol=2e-5, rtol=0)
            torch.testing.assert_close(s.top_logprobs, ref[:-1].topk(3, -1).values, atol=2e-5, rtol=0)
            # The top ids are the argmax order (no near-ties in a random model's 512 logits).
            assert (s.top_ids[:, 0] == ref[:-1].argmax(-1)).all()
        torch.testing.assert_close(s.last_logits.log_softmax(-1), ref[-1], atol=2e-5, rtol=0)


def test_without_alternatives_and_bad_arguments(model):
    s = score_prompts(model, [[1, 2, 3]])[0]
    assert s.top_ids.shape == (2, 0) and s.top_logprobs.shape == (2, 0)
    with pytest.raises(ValueError, match=r"`prompts\[1\]` is empty"):
        score_prompts(model, [[1], []])
    with pytest.raises(ValueError, match="`top`"):
        score_prompts(model, [[1]], top=-1)
    with pytest.raises(ValueError, match="`chunk`"):
        score_prompts(model, [[1]], chunk=0)
