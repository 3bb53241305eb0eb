"""The real server on loopback, spoken to with the official `openai` client: completions, chat, streaming,
32 concurrent streams == single-request greedy, prefix caching of a 2,000-token prefix, bad input."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import openai
import pytest

from kimi_linear.model.tokenizer import byte_level_tokenizer
from kimi_linear.server.protocol import fallback_chat_prompt

from .conftest import reference, reference_with_logprobs

TOK = byte_level_tokenizer()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_and_completion(server, ref_model):
    c = client(server)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    r = c.completions.create(model="tiny", prompt="Hello, world", max_tokens=12, temperature=0,
                             extra_body={"return_token_ids": True})
    ids = TOK.encode("Hello, world", add_special_tokens=False)
    ref = reference(ref_model, ids, 12)
    ch = r.choices[0]
    assert ch.token_ids == ref
    assert ch.text == TOK.decode(ref, skip_special_tokens=True)
    assert ch.finish_reason == ("stop" if ref[-1] == 256 else "length")
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref)


def test_streaming_completion_equals_non_streaming(server):
    c = client(server)
    kw = dict(model="tiny", prompt="The quick brown fox", max_tokens=16, temperature=0)
    full = c.completions.create(**kw).choices[0]
    chunks = list(c.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == full.finish_reason
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


def test_chat_and_chat_streaming(server, ref_model):
    c = client(server)
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0, logprobs=True,
                                  top_logprobs=3)
    ids = TOK.encode(fallback_chat_prompt(msgs), add_special_tokens=False)
    ref = reference(ref_model, ids, 10)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == TOK.decode(ref, skip_special_tokens=True)
    lp = r.choices[0].logprobs.content
    assert len(lp) == len(ref) and all(len(x.top_logprobs) == 3 for x in lp)
    assert all(x.logprob == pytest.approx(x.top_logprobs[0].logprob) for x in lp)     # greedy = the top token
    stream = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0, stream=True)
    parts = [ch.choices[0].delta.content or "" for ch in stream if ch.choices]
    assert "".join(parts) == r.choices[0].message.content


def test_32_concurrent_streams_match_single_request_greedy(server, ref_model):
    rng = random.Random(32)
    jobs = [([rng.randrange(256) for _ in range(rng.randrange(1, 80))], rng.randrange(1, 20)) for _ in range(32)]

    async def one(ac: openai.AsyncOpenAI, prompt: list[int], n: int) -> tuple[list[int], str, list[float]]:
        stream = await ac.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                             logprobs=0, extra_body={"return_token_ids": True})
        toks, text, lps = [], "", []
        async for ch in stream:
            toks += ch.choices[0].token_ids
            text += ch.choices[0].text
            lps += ch.choices[0].logprobs.token_logprobs if ch.choices[0].logprobs else []
        return toks, text, lps

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300) as ac:
            return await asyncio.gather(*(one(ac, p, n) for p, n in jobs))

    before = server.metrics()
    results = asyncio.run(main())
    after = server.metrics()
    assert after["steps_total"] > before["steps_total"]
    # Batched: on average at least two sequences per decode forward (one request at a time would give one).
    assert after["decode_forwards_total"] - before["decode_forwards_total"] < sum(n for _, n in jobs) / 2, \
        "decode steps were not batched"
    for (prompt, n), (toks, text, lps) in zip(jobs, results):
        ref, ref_lps = reference_with_logprobs(ref_model, prompt, n)
        assert toks == ref, (len(prompt), n)
        assert text == TOK.decode(ref, skip_special_tokens=True)
        # Same distributions, not only the same argmax (a random model's greedy tokens hide small errors).
        assert lps == pytest.approx(ref_lps, abs=2e-4), (len(prompt), n)


def test_prefix_cache_2000_token_prefix(server, ref_model):
    rng = random.Random(2000)
    prefix = [rng.randrange(256) for _ in range(2000)]
    a, b = prefix + [rng.randrange(256) for _ in range(23)], prefix + [rng.randrange(256) for _ in range(17)]
    c = client(server)
    kw = dict(model="tiny", max_tokens=8, temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})
    first = c.completions.create(prompt=a, **kw)
    m0 = server.metrics()
    second = c.completions.create(prompt=b, **kw)
    m1 = server.metrics()
    assert m1["prefix_cache_hit_tokens_total"] - m0["prefix_cache_hit_tokens_total"] == 2000
    assert m1["prefill_tokens_total"] - m0["prefill_tokens_total"] == 17          # only the new tokens
    assert second.usage.prompt_tokens_details.cached_tokens == 2000
    assert first.choices[0].token_ids == reference(ref_model, a, 8, eos=False)
    assert second.choices[0].token_ids == reference(ref_model, b, 8, eos=False)
    again = c.completions.create(prompt=b, **kw)                                      # identical output when cached
    assert again.choices[0].token_ids == second.choices[0].token_ids


def test_bad_input_gets_openai_errors_and_server_keeps_serving(server):
    c = client(server)
    r = httpx.post(server.url + "/v1/completions", content=b'{"model": "tiny", "prompt": ',
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="x", max_tokens=-3)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt=[65] * 5000, max_tokens=2)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="tiny", messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="tiny", prompt="x", max_tokens=2, temperature="hot")
    r = httpx.get(server.url + "/v1/nothing-here", timeout=30)
    assert r.status_code == 404 and "error" in r.json()
    ok = c.completions.create(model="tiny", prompt="still alive?", max_tokens=3, temperature=0)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_stop_string_and_seeded_sampling(server):
    c = client(server)
    kw = dict(model="tiny", prompt="stop here", temperature=0, extra_body={"ignore_eos": True})
    full = c.completions.create(max_tokens=24, **kw).choices[0].text
    cut = next(i for i in range(4, len(full) - 2) if "\ufffd" not in full[i : i + 2])
    stop = full[cut : cut + 2]
    for stream in (False, True):
        if stream:
            parts = list(c.completions.create(max_tokens=24, stop=[stop], stream=True, **kw))
            text = "".join(p.choices[0].text for p in parts)
            reason = parts[-1].choices[0].finish_reason
        else:
            r = c.completions.create(max_tokens=24, stop=[stop], **kw).choices[0]
            text, reason = r.text, r.finish_reason
        assert text == full[: full.index(stop)] and reason == "stop", (stream, text, full, stop)
    sampled = [c.completions.create(model="tiny", prompt="dice", max_tokens=12, temperature=0.9, top_p=0.95,
                                    seed=1234, extra_body={"top_k": 100, "ignore_eos": True}).choices[0].text
               for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_non_streaming_client_gone_aborts(server):
    before = server.metrics()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", timeout=1.5,
                   json={"model": "tiny", "prompt": "b" * 50, "max_tokens": 3000, "ignore_eos": True})
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["requests_aborted_total"] > before["requests_aborted_total"] and m["running"] == 0:
            break
        time.sleep(0.1)
    assert m["requests_aborted_total"] == before["requests_aborted_total"] + 1
    assert m["running"] == 0 and m["mla_blocks_used"] == 0 and m["kda_slots_used"] == 0
