"""transformers' generate arguments give the same tokens with our model and with transformers' KimiLinearForCausalLM
loaded from the same checkpoint: lengths, EOS / PAD from config.json and generation_config.json, min_new_tokens,
repetition_penalty, stop_strings with a tokenizer, a GenerationConfig, seeded sampling with transformers' defaults."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from transformers import GenerationConfig
from transformers import KimiLinearForCausalLM as HFKimiLinear

from kimi_linear import KimiLinearForCausalLM
from kimi_linear.model.tokenizer import byte_level_tokenizer

from .helpers import make_config, randomize

# The byte-level tokenizer's ids (bytes 0-255, then EOS 256, BOS 257, PAD 258) are the model's whole vocabulary,
# so every generated id decodes and stop strings can be matched.
EOS, BOS, PAD = 256, 257, 258
PROMPT = torch.tensor([list(b"def fib(n):\n    ")])
BATCH = torch.tensor([list(b"import os\n"), list(b"class A:\n ")])


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(ours, transformers') on one random checkpoint."""
    transformers.logging.set_verbosity_error()
    path = tmp_path_factory.mktemp("gen") / "ckpt"
    config = make_config("KKKM", vocab_size=259, eos_token_id=EOS, bos_token_id=BOS, pad_token_id=PAD)
    randomize(KimiLinearForCausalLM(config), seed=33).eval().save_pretrained(path)
    return KimiLinearForCausalLM.from_pretrained(path), HFKimiLinear.from_pretrained(path).eval(), path


def both(pair, ids, **kw) -> torch.Tensor:
    """Our tokens, after asserting transformers' generate gives the same with the same arguments."""
    ours, hf, _ = pair
    with torch.no_grad():
        theirs = hf.generate(ids, **kw)
    got = ours.generate(ids, **kw)
    assert got.tolist() == theirs.tolist(), kw
    return got


def greedy(pair, ids, n=24) -> list[int]:
    return pair[0].generate(ids, max_new_tokens=n, eos_token_id=None)[0, ids.shape[1]:].tolist()


@pytest.mark.slow
def test_lengths_and_the_config_eos(pair):
    """max_new_tokens; max_length (prompt included); both (max_new_tokens wins); EOS 256 from config.json by
    default: the random model emits it within 24 greedy tokens, so both stop there."""
    T = PROMPT.shape[1]
    assert both(pair, PROMPT, max_new_tokens=5).shape[1] == T + 5
    assert both(pair, PROMPT, max_length=T + 3).shape[1] == T + 3
    assert both(pair, PROMPT, max_length=T + 3, max_new_tokens=6).shape[1] == T + 6
    free = greedy(pair, PROMPT)
    assert EOS in free
    out = both(pair, PROMPT, max_new_tokens=24)
    assert out[0, T:].tolist() == free[: free.index(EOS) + 1]
    with pytest.raises(ValueError, match="`max_length`.*prompt"):
        pair[0].generate(PROMPT, max_length=T)


def test_default_length_is_transformers_20_new_tokens(pair):
    assert both(pair, PROMPT, eos_token_id=None).shape[1] == PROMPT.shape[1] + 20


def test_min_new_tokens_holds_back_eos(pair):
    free = greedy(pair, PROMPT)
    out = both(pair, PROMPT, max_new_tokens=24, min_new_tokens=free.index(EOS) + 3)
    new = out[0, PROMPT.shape[1]:].tolist()
    assert len(new) > free.index(EOS) + 1 and new[: free.index(EOS)] == free[: free.index(EOS)]
    assert EOS not in new[: free.index(EOS) + 3]
    both(pair, PROMPT, max_new_tokens=24, min_length=PROMPT.shape[1] + free.index(EOS) + 2)


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty(pair, penalty):
    out = both(pair, BATCH, max_new_tokens=16, min_new_tokens=16, repetition_penalty=penalty)
    assert out[0, BATCH.shape[1]:].tolist() != greedy(pair, BATCH[:1], 16)        # the penalty changed something


def test_eos_and_pad_from_generation_config_json(pair, tmp_path):
    """A generation_config.json naming another EOS and PAD is what both models decode with by default; ours writes
    and reads it back. Row 0 ends early and is padded with its PAD while row 1 goes on."""
    ours, _, path = pair
    rows = [greedy(pair, BATCH[i : i + 1], 12) for i in range(2)]
    eos = next(t for t in rows[0][2:8] if t not in rows[1][:10] and t != EOS)
    for f in os.listdir(path):
        os.link(os.path.join(path, f), tmp_path / f)
    os.remove(tmp_path / "generation_config.json")
    with open(tmp_path / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": [eos], "pad_token_id": 7}, f)
    mine = KimiLinearForCausalLM.from_pretrained(tmp_path)
    assert mine.generation_config.eos_token_id == [eos]
    theirs = HFKimiLinear.from_pretrained(tmp_path).eval()
    out = both((mine, theirs, tmp_path), BATCH, max_new_tokens=10)
    end = rows[0].index(eos) + 1
    assert out[0, BATCH.shape[1] + end :].tolist() == [7] * (out.shape[1] - BATCH.shape[1] - end)
    mine.save_pretrained(tmp_path / "again")
    assert KimiLinearForCausalLM.from_pretrained(tmp_path / "again").generation_config.pad_token_id == 7
    assert ours.generation_config.eos_token_id == EOS                # the original: from config.json


@pytest.mark.slow
def test_stop_strings_with_a_tokenizer(pair):
    """A stop string taken from the greedy text (two printable bytes): both end right after it, its tokens kept."""
    tok = byte_level_tokenizer()
    free = greedy(pair, PROMPT, 40)
    at = next(i for i in range(4, 39) if all(32 <= t < 127 for t in free[i : i + 2]))
    stop = bytes(free[at : at + 2]).decode()
    out = both(pair, PROMPT, max_new_tokens=40, stop_strings=[stop, "\x00never"], tokenizer=tok, eos_token_id=None)
    new = out[0, PROMPT.shape[1]:].tolist()
    assert len(new) <= at + 2 and new == free[: len(new)] and tok.decode(out[0]).endswith(stop)
    with pytest.raises(ValueError, match="`stop_strings`.*tokenizer"):
        pair[0].generate(PROMPT, stop_strings="x")


def test_generation_config_with_overriding_kwargs(pair):
    gc = GenerationConfig(max_new_tokens=12, repetition_penalty=1.25, min_new_tokens=12, do_sample=False)
    a = both(pair, PROMPT, generation_config=gc)
    assert a.shape[1] == PROMPT.shape[1] + 12
    b = both(pair, PROMPT, generation_config=gc, max_new_tokens=6, min_new_tokens=6)
    assert b.tolist() == a[:, : PROMPT.shape[1] + 6].tolist()
    assert pair[0].generate(PROMPT, gc).tolist() == a.tolist()                        # positional, as in transformers


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.8, top_k=20), dict(temperature=1.3, top_p=0.9)])
def test_seeded_sampling_matches_transformers(pair, kw):
    """do_sample with transformers' default top_k of 50 (or given filters): with ``seed`` we draw what transformers
    draws after ``torch.manual_seed`` of the same seed."""
    ours, hf, _ = pair
    kw = dict(max_new_tokens=16, min_new_tokens=16, do_sample=True, **kw)
    torch.manual_seed(3)
    with torch.no_grad():
        theirs = hf.generate(BATCH, **kw)
    assert ours.generate(BATCH, seed=3, **kw).tolist() == theirs.tolist()
    assert ours.generate(BATCH, seed=4, **kw).tolist() != theirs.tolist()


@pytest.mark.parametrize("kw,match", [
    (dict(min_new_tokens=-1), "`min_new_tokens` must be a non-negative integer"),
    (dict(max_new_tokens=2.5), "`max_new_tokens`"),
    (dict(max_length=0), "`max_length` must be a positive integer"),
    (dict(repetition_penalty=0.0), "`repetition_penalty` must be a number > 0"),
    (dict(repetition_penalty=float("nan")), "`repetition_penalty`"),
    (dict(do_sample=True, temperature=float("nan")), r"`temperature` must be a number in \[0, 100\]"),
    (dict(do_sample=True, temperature=-1.0), "`temperature`"),
    (dict(do_sample=True, temperature=0.0), "`temperature` must be > 0 when sampling"),
    (dict(top_p=0.0), r"`top_p` must be in \(0, 1\]"),
    (dict(top_k=-2), "`top_k` must be an integer >= -1"),
    (dict(eos_token_id=259), r"`eos_token_id` must be a token id.*\[0, 259\)"),
    (dict(pad_token_id=[1, 2]), "`pad_token_id` must be one token id"),
    (dict(stop_strings=[""], tokenizer=object()), "`stop_strings` must be a non-empty string"),
    (dict(do_sample="yes"), "`do_sample` must be True or False"),
    (dict(num_beams=4), "`num_beams`=4 is not supported"),
    (dict(seed=2**64), "`seed`"),
    (dict(generation_config=GenerationConfig(top_p=1.5)), "top_p"),
    (dict(generation_config=GenerationConfig(no_repeat_ngram_size=2)), "generation_config.no_repeat_ngram_size"),
    (dict(generation_config=GenerationConfig(min_new_tokens=-3)), "`generation_config.min_new_tokens`"),
])
def test_bad_arguments_are_named(pair, kw, match):
    with pytest.raises(ValueError, match=match):
        pair[0].generate(PROMPT, **kw)


def test_unknown_and_ignored_arguments(pair):
    with pytest.raises(TypeError, match="unexpected keyword argument 'temprature'"):
        pair[0].generate(PROMPT, temprature=0.5)
    with pytest.raises(TypeError, match="GenerationConfig"):
        pair[0].generate(PROMPT, generation_config={"max_new_tokens": 3})
    # Harmless transformers arguments (and neutral values of unsupported ones) are accepted.
    out = pair[0].generate(PROMPT, max_new_tokens=3, use_cache=True, num_beams=1, output_scores=False)
    assert out.shape[1] == PROMPT.shape[1] + 3
