"""Decoding with the hybrid cache equals full forward passes; left-padded batches equal rows decoded alone."""

from __future__ import annotations

import pytest
import torch
from transformers import KimiLinearForCausalLM as HFKimiLinear

from kimi_linear import KimiLinearForCausalLM

from .helpers import make_config, randomize, rel_err, tokens


@pytest.fixture(scope="module")
def model() -> KimiLinearForCausalLM:
    return randomize(KimiLinearForCausalLM(make_config("KKKMKKKM")), seed=11).eval()


def test_incremental_decode_equals_full_forward(model):
    """A 70-token prompt (more than one 64-token chunk), then 64 greedy steps with the cache: every step's logits
    equal those of one full forward pass over the final sequence, and so do the greedy tokens."""
    prompt = tokens(1, 70, seed=21)
    ids, step_logits = model.generate(prompt, max_new_tokens=64, return_logits=True)
    assert ids.shape == (1, 134)
    with torch.no_grad():
        full = model(ids).logits[0, 69:-1]                       # position t predicts token t + 1
    steps = torch.stack([s[0] for s in step_logits])
    assert rel_err(steps, full) < 1e-4
    assert torch.equal(full.argmax(-1), ids[0, 70:])


def test_multi_token_continuation_with_cache(model):
    """Feeding a sequence in pieces (prefill, a multi-token chunk, single tokens) equals one pass."""
    ids = tokens(2, 150, seed=22)
    cache = model.new_cache(2)
    with torch.no_grad():
        parts = [model(ids[:, a:b], cache=cache).logits for a, b in [(0, 67), (67, 131), (131, 132), (132, 150)]]
        full = model(ids).logits
    assert rel_err(torch.cat(parts, 1), full) < 1e-4


def test_kda_state_does_not_grow(model):
    """KDA state bytes are the same after 10 and 300 tokens; the MLA latent grows by exactly 576-style entries
    (kv_lora_rank + rope) per token per MLA layer."""
    cache = model.new_cache(1)
    with torch.no_grad():
        model(tokens(1, 10, seed=23), cache=cache)
        kda_10, mla_10 = cache.kda_bytes(), cache.mla_bytes()
        model(tokens(1, 290, seed=24), cache=cache)
    assert cache.kda_bytes() == kda_10 > 0
    per_token = 2 * (32 + 8) * 4  # 2 MLA layers, latent 32 + rope 8, float32
    assert mla_10 == 10 * per_token and cache.mla_bytes() == 300 * per_token


def test_left_padded_batch_equals_rows_alone(model):
    """Prompts of 5, 70 and 23 tokens, left-padded into one batch: each row generates exactly the tokens it
    generates alone, and its logits match."""
    prompts = [tokens(1, n, seed=30 + n)[0] for n in (5, 70, 23)]
    T = max(len(p) for p in prompts)
    batch = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for i, p in enumerate(prompts):
        batch[i, T - len(p):] = p
        mask[i, T - len(p):] = 1
    out, logits = model.generate(batch, attention_mask=mask, max_new_tokens=24, return_logits=True)
    for i, p in enumerate(prompts):
        alone, alone_logits = model.generate(p[None], max_new_tokens=24, return_logits=True)
        assert torch.equal(out[i, T:], alone[0, len(p):]), f"row {i}"
        assert rel_err(torch.stack([s[i] for s in logits]), torch.stack([s[0] for s in alone_logits])) < 1e-4


def test_greedy_matches_transformers_generate(tmp_path, model):
    """Same checkpoint, same prompt: our greedy tokens equal transformers' generate()."""
    model.save_pretrained(tmp_path)
    hf = HFKimiLinear.from_pretrained(tmp_path).eval()
    prompt = tokens(1, 40, seed=40)
    theirs = hf.generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert torch.equal(model.generate(prompt, max_new_tokens=24), theirs)


def test_sampling_is_seeded_and_filters(model):
    prompt = tokens(2, 12, seed=50)
    kw = dict(max_new_tokens=16, do_sample=True, temperature=0.8, top_p=0.9, top_k=20)
    a = model.generate(prompt, seed=123, **kw)
    assert torch.equal(a, model.generate(prompt, seed=123, **kw))
    assert not torch.equal(a, model.generate(prompt, seed=124, **kw))
    # top_k=1 leaves only the argmax: sampling must then reproduce greedy decoding.
    assert torch.equal(model.generate(prompt, max_new_tokens=16, do_sample=True, top_k=1, seed=5),
                       model.generate(prompt, max_new_tokens=16))


def test_eos_stops_and_pads(model):
    prompt = tokens(1, 8, seed=60)
    greedy = model.generate(prompt, max_new_tokens=10)
    eos = int(greedy[0, 8 + 3])  # pretend the 4th generated token is end-of-sequence
    out = model.generate(prompt, max_new_tokens=10, eos_token_id=eos)
    first = (out[0, 8:] == eos).nonzero()[0, 0].item()
    assert out.shape[1] == 8 + first + 1 and torch.equal(out[0], greedy[0, : out.shape[1]])


def test_streamer_gets_prompt_then_each_token(model):
    seen = []

    class Recorder:
        def put(self, value):
            seen.append(value.clone())

        def end(self):
            seen.append(None)

    prompt = tokens(1, 6, seed=70)
    out = model.generate(prompt, max_new_tokens=5, streamer=Recorder())
    assert torch.equal(seen[0], prompt) and seen[-1] is None
    assert torch.equal(torch.cat([s for s in seen[1:-1]]), out[0, 6:])


@pytest.mark.parametrize("k3", [False, True])
def test_fixed_shape_decode_path_equals_the_cache_path(model, k3):
    """generate's GPU fast path (pools, paged latents, the fixed-shape step; run eagerly here) gives the tokens and
    the step logits of the hybrid-cache path: a left-padded batch, greedy, then sampled with a seed; a second call
    reuses the held pools and a longer one replaces them. Also with a repetition penalty and min_new_tokens."""
    if k3:
        from kimi_linear.model import preset_config

        torch.manual_seed(0)
        m = KimiLinearForCausalLM(preset_config("k3-tiny")).init_weights(0).eval()
    else:
        m = model
    prompts = [tokens(1, n, seed=40 + n)[0] % m.config.vocab_size for n in (9, 33, 20)]
    T = max(len(p) for p in prompts)
    batch = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for r, p in enumerate(prompts):
        batch[r, T - len(p):], mask[r, T - len(p):] = p, 1
    # (the rules of transformers' arguments act on the logits either path returns: the graph path honours them)
    for kw in (dict(), dict(do_sample=True, temperature=0.8, top_k=20, seed=3),
               dict(repetition_penalty=1.4, min_new_tokens=10, eos_token_id=[2, int(batch[0, -1])])):
        ref, ref_logits = m.generate(batch, attention_mask=mask, max_new_tokens=12, return_logits=True,
                                     cuda_graphs=False, **kw)
        got, got_logits = m.generate(batch, attention_mask=mask, max_new_tokens=12, return_logits=True,
                                     cuda_graphs=True, **kw)
        assert torch.equal(got, ref)
        assert rel_err(torch.stack(got_logits).float(), torch.stack(ref_logits).float()) < 1e-5
    held = m._paged_decoder
    m.generate(batch, attention_mask=mask, max_new_tokens=5, cuda_graphs=True)
    assert m._paged_decoder is held                                  # same batch, fits: reused
    long = torch.cat([batch, batch[:, :1].repeat(1, 3000)], dim=1)
    m.generate(long, max_new_tokens=2, cuda_graphs=True)
    assert m._paged_decoder is held                                  # capacity rounded up to 4096 tokens
    m.generate(batch[:2], max_new_tokens=2, cuda_graphs=True)
    assert m._paged_decoder is not held                              # another batch size: new pools
