"""Hypothesis fuzzing of the real server: a few hundred JSON bodies built from the OpenAI request schema (every
field present or not, each with a valid value or a random JSON value of any type, lone surrogates, deep nesting,
huge numbers), sometimes cut short or mangled bytes. No 5xx, every 4xx is OpenAI's error JSON, no hang (each
request has a 60 s bound; the valid ones ask for a few tokens), and the server is healthy and idle afterwards."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from .conftest import start_server, stop_server

# Any JSON value, lone surrogates and deep nesting included.
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0, 1, -1, 2**63, 2**64, 1e-38, 5e-324, 1e308, 0.5, 2.0]), st.text(max_size=20),
    st.sampled_from(["", "\ud800", "a\udfffb", "user", "false", "true", "0", "\x00", "assistant\nuser"]),
)
anything = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)


def field(valid):
    """A field's value: a valid one nine times in ten, else anything."""
    return st.integers(0, 9).flatmap(lambda i: anything if i == 0 else valid)


def _long(v) -> bool:      # a valid token count that would generate for seconds (or, None in chat, to the context)
    return v is None or (isinstance(v, int) and not isinstance(v, bool) and v > 6)


max_tokens = st.integers(0, 9).flatmap(lambda i: anything.filter(lambda v: not _long(v)) if i == 0
                                       else st.integers(0, 6))


text_part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": field(st.text(max_size=30))})
message = st.fixed_dictionaries(
    {"role": field(st.sampled_from(["system", "user", "assistant", "tool"]))},
    optional={"content": field(st.one_of(st.text(max_size=40), st.lists(text_part, max_size=3), st.none())),
              "name": field(st.text(max_size=10))})
MODEL = {"model": field(st.just("tiny"))}
SAMPLING = {
    "max_tokens": max_tokens,
    "temperature": field(st.one_of(st.floats(0, 2), st.sampled_from([0, 1e-38, 1e-3]))),
    "top_p": field(st.floats(0.01, 1)),
    "top_k": field(st.integers(-1, 600)),
    "n": field(st.just(1)),
    "seed": field(st.integers(-(2**63), 2**64 - 1)),
    "stop": field(st.one_of(st.text(min_size=1, max_size=4), st.lists(st.text(min_size=1, max_size=4), max_size=4))),
    "stop_token_ids": field(st.lists(st.integers(0, 600), max_size=4)),
    "presence_penalty": field(st.just(0)),
    "frequency_penalty": field(st.just(0)),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({}, optional={"include_usage": field(st.booleans())})),
    "user": field(st.text(max_size=10)),
    "ignore_eos": field(st.booleans()),
    "return_token_ids": field(st.booleans()),
}
completion = st.fixed_dictionaries(
    {**MODEL, "prompt": field(st.one_of(
        st.text(min_size=1, max_size=60), st.lists(st.integers(0, 300), min_size=1, max_size=40),
        st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=3),                # several prompts
        st.lists(st.lists(st.integers(0, 300), min_size=1, max_size=12), min_size=1, max_size=3)))},
    optional={**SAMPLING, "logprobs": field(st.integers(0, 5)), "echo": field(st.booleans()),
              "extra": anything})
chat = st.fixed_dictionaries(
    {**MODEL, "messages": field(st.lists(message, min_size=1, max_size=3)), "max_tokens": max_tokens},
    optional={**{k: v for k, v in SAMPLING.items() if k != "max_tokens"}, "logprobs": field(st.booleans()),
              "top_logprobs": field(st.integers(0, 5)), "max_completion_tokens": max_tokens})


def mangle(raw: bytes, how: int, data) -> bytes:
    if how == 1:       # cut short
        return raw[: data.draw(st.integers(0, max(len(raw) - 1, 0)))]
    if how == 2:       # one byte replaced
        i = data.draw(st.integers(0, max(len(raw) - 1, 0)))
        return raw[:i] + bytes([data.draw(st.integers(0, 255))]) + raw[i + 1:]
    if how == 3:       # deeply nested somewhere
        d = data.draw(st.sampled_from([65, 1_000, 20_000]))
        return raw[:-1] + b', "deep": ' + b"[" * d + b"]" * d + b"}" if raw.endswith(b"}") else raw
    return raw


@pytest.fixture(scope="module")
def fuzz_server(checkpoint):
    s = start_server(checkpoint, "--max-num-seqs", "4", "--max-json-depth", "64", "--max-body-bytes", "1MiB")
    s.http = httpx.Client(base_url=s.url, timeout=60)
    yield s
    s.http.close()
    stop_server(s)


def check(r: httpx.Response) -> None:
    assert r.status_code < 500, r.text[:500]
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and err["type"] and "param" in err, err
    elif "text/event-stream" not in r.headers.get("content-type", ""):
        assert r.json()["choices"], r.text[:500]


@settings(max_examples=300, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(data=st.data())
def test_random_openai_bodies(fuzz_server, data):
    is_chat = data.draw(st.booleans())
    body = data.draw(chat if is_chat else completion)
    raw = json.dumps(body).encode()         # ensure_ascii: lone surrogates travel as \ud800 escapes
    raw = mangle(raw, data.draw(st.sampled_from([0, 0, 0, 0, 1, 2, 3])), data)
    path = "/v1/chat/completions" if is_chat else "/v1/completions"
    r = fuzz_server.http.post(path, content=raw, headers={"content-type": "application/json"})
    check(r)
    event(f"{r.status_code} {r.json()['error']['param'] if r.status_code >= 400 else ''}")


def test_healthy_and_idle_after_fuzzing(fuzz_server):
    assert httpx.get(fuzz_server.url + "/health", timeout=10).status_code == 200
    for _ in range(100):
        m = fuzz_server.metrics()
        if m["running"] == m["waiting"] == m["kda_slots_used"] == m["mla_blocks_used"] == 0:
            break
        time.sleep(0.1)
    assert m["running"] == m["waiting"] == m["kda_slots_used"] == m["mla_blocks_used"] == 0, m
    r = fuzz_server.http.post("/v1/completions", json={"model": "tiny", "prompt": "ok", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
