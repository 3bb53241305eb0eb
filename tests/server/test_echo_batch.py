"""/v1/completions as evaluation harnesses use it (vLLM's shape): `echo` with `logprobs` returns every prompt token's
log-prob (the first null) before the completion's, `max_tokens: 0` included; a list of prompts gives one choice per
prompt in order; the model id also answers to the checkpoint directory's name; bad new fields are 400s naming
the field."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from kimi_linear.model import default
from kimi_linear.model.tokenizer import byte_level_tokenizer

from .conftest import EOS, reference, start_server, stop_server

TOK = byte_level_tokenizer()
MAX_PROMPTS = 8


@pytest.fixture(scope="module")
def srv(checkpoint):
    """Served as `other`: the checkpoint directory's name (`tiny`) and path are aliases."""
    s = start_server(checkpoint, "--served-model-name", "other", "--max-prompts-per-request", str(MAX_PROMPTS),
                     "--max-scored-prompt-tokens", "3000")
    s.http = httpx.Client(base_url=s.url, timeout=120)
    yield s
    s.http.close()
    stop_server(s)


def post(s, body: dict) -> httpx.Response:
    raw = json.dumps({"model": "tiny", **body})         # ensure_ascii: a lone surrogate travels as \ud800
    return s.http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})


def ok(s, body: dict) -> dict:
    r = post(s, body)
    assert r.status_code == 200, r.text
    return r.json()


def error(r: httpx.Response, param: str, code: str | None = None) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and (code is None or err["code"] == code), err
    return err["message"]


def ref_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log-softmax [T, vocab] of the prompt's own forward."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def test_echo_logprobs_with_max_tokens_0_scores_the_prompt(srv, ref_model):
    prompt = "def add(a, b):\n    return"
    ids = TOK.encode(prompt, add_special_tokens=False)
    r = ok(srv, {"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 0})
    (ch,) = r["choices"]
    assert ch["index"] == 0 and ch["text"] == prompt and ch["finish_reason"] == "length"
    lp = ch["logprobs"]
    ref = ref_logprobs(ref_model, ids)
    assert lp["tokens"] == [TOK.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for t in range(1, len(ids)):
        assert abs(lp["token_logprobs"][t] - float(ref[t - 1, ids[t]])) < 1e-4
        top = lp["top_logprobs"][t]     # two entries, unless both tokens decode to the same string (a dict)
        assert 1 <= len(top) <= 2 and abs(max(top.values()) - float(ref[t - 1].max())) < 1e-4
    assert lp["text_offset"] == [len(TOK.decode(ids[:t])) for t in range(len(ids))]
    assert r["usage"]["prompt_tokens"] == len(ids) and r["usage"]["completion_tokens"] == 0


def test_lm_eval_loglikelihood_payload(srv, ref_model):
    """What lm-evaluation-harness's local-completions sends for loglikelihood with --batch_size 4 (token ids,
    echo, logprobs 1, max_tokens 1): one choice per prompt, prompt log-probs then the greedy token's."""
    prompts = [TOK.encode(p, add_special_tokens=False) for p in ("x = 1\n", "import os", "for i in range(3):", "a")]
    r = ok(srv, {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0, "seed": 1234})
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    for ids, ch in zip(prompts, r["choices"]):
        lp = ch["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1 and ch["text"].startswith(TOK.decode(ids))
        ref = ref_logprobs(ref_model, ids)
        want = [None] + [float(ref[t - 1, ids[t]]) for t in range(1, len(ids))]
        for got, w in zip(lp["token_logprobs"][:-1], want):
            assert (got is None) == (w is None) and (w is None or abs(got - w) < 1e-4)
        # The last entry is the generated (greedy) token's, from the same forward.
        (tok,) = reference(ref_model, ids, 1)
        assert abs(lp["token_logprobs"][-1] - float(ref[-1, tok])) < 1e-4
        assert lp["token_logprobs"][-1] == max(lp["top_logprobs"][-1].values())
    assert r["usage"]["prompt_tokens"] == sum(map(len, prompts)) and r["usage"]["completion_tokens"] == 4
    assert srv.metrics()["scored_tokens_total"] >= sum(map(len, prompts))


def test_a_list_of_prompts_gives_each_prompt_its_own_choice(srv, ref_model):
    texts = ["def f(x):", "class A:", "while True:", "# comment", "import sys\n"]
    r = ok(srv, {"prompt": texts, "max_tokens": 6, "temperature": 0, "return_token_ids": True})
    assert [c["index"] for c in r["choices"]] == list(range(len(texts)))
    for t, ch in zip(texts, r["choices"]):
        ids = TOK.encode(t, add_special_tokens=False)
        assert ch["token_ids"] == reference(ref_model, ids, 6) and ch["prompt_token_ids"] == ids
        alone = ok(srv, {"prompt": t, "max_tokens": 6, "temperature": 0})["choices"][0]
        assert ch["text"] == alone["text"] and ch["finish_reason"] == alone["finish_reason"]
    assert r["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in r["choices"])


def test_echo_without_logprobs_and_with_token_ids(srv, ref_model):
    ids = TOK.encode("print(", add_special_tokens=False)
    for prompt in ("print(", ids, [ids]):
        ch = ok(srv, {"prompt": prompt, "echo": True, "max_tokens": 4, "temperature": 0})["choices"][0]
        gen = reference(ref_model, ids, 4)
        assert ch["text"] == "print(" + TOK.decode(gen, skip_special_tokens=True) and ch["logprobs"] is None
    # echo with generated log-probs: the prompt's entries, then the completion's.
    ch = ok(srv, {"prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 3, "temperature": 0,
                  "ignore_eos": True})["choices"][0]
    assert len(ch["logprobs"]["tokens"]) == len(ids) + 3 and ch["logprobs"]["top_logprobs"][1] == {}


def test_streaming_several_prompts_with_echo(srv):
    texts = ["x = ", "def g():\n", "if a:"]
    body = {"prompt": texts, "echo": True, "logprobs": 1, "max_tokens": 5, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    full = ok(srv, {k: v for k, v in body.items() if k not in ("stream", "stream_options")})
    text, lps, usage = {}, {}, None
    with srv.http.stream("POST", "/v1/completions", json={"model": "tiny", **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]
            for c in ev["choices"]:
                text[c["index"]] = text.get(c["index"], "") + c["text"]
                lps.setdefault(c["index"], []).extend(c["logprobs"]["token_logprobs"])
    for i, c in enumerate(full["choices"]):
        assert text[i] == c["text"] and lps[i] == c["logprobs"]["token_logprobs"]
    assert usage == full["usage"]


def test_model_ids(srv, checkpoint):
    assert [m["id"] for m in srv.http.get("/v1/models").json()["data"]] == ["other", "tiny"]
    for name in ("other", "tiny", checkpoint):
        r = srv.http.post("/v1/completions", json={"model": name, "prompt": "a", "max_tokens": 1})
        assert r.status_code == 200 and r.json()["model"] == "other", (name, r.text)
    r = srv.http.post("/v1/completions", json={"model": "default", "prompt": "a", "max_tokens": 1})
    assert r.status_code == 404 and "`other` (also as `tiny`)" in r.json()["error"]["message"]


@pytest.mark.parametrize("prompt, param, words", [
    ([], "prompt", "is empty"),
    (["a", ""], "prompt[1]", "is empty"),
    (["a", [1, 2]], "prompt[1]", "strings only or lists of token ids only"),
    ([[1, 2], [3, -1]], "prompt[1]", "holds -1 at index 1"),
    ([[1, 2], []], "prompt[1]", "must be a non-empty string or a non-empty list of token ids"),
    ([[5, 6, -2]], "prompt", "holds -2 at index 2"),
    (["ok", "a\ud800"], "prompt[1]", "lone surrogate"),
    ([[1], [600]], "prompt[1]", "`prompt[1]` holds token id 600, outside the vocabulary"),
    (["x"] * (MAX_PROMPTS + 1), "prompt", f"at most {MAX_PROMPTS} in one request"),
    ([[1], [2] * 5000], "prompt[1]", "the model's context is 4096 tokens"),
])
def test_bad_prompt_lists(srv, prompt, param, words):
    assert words in error(post(srv, {"prompt": prompt, "max_tokens": 1}), param)


def test_scored_prompt_tokens_are_bounded(srv):
    """echo with logprobs returns an entry per prompt token: a request may have at most --max-scored-prompt-tokens
    scored, over all its prompts; without logprobs (or echo) the same prompts are fine."""
    prompts = [[7] * 1000] * 4
    assert "at most 3000 in one request" in error(post(srv, {"prompt": prompts, "echo": True, "logprobs": 0,
                                                             "max_tokens": 0}), "prompt")
    assert len(ok(srv, {"prompt": prompts, "echo": True, "max_tokens": 0})["choices"]) == 4
    assert len(ok(srv, {"prompt": prompts[:3], "echo": True, "logprobs": 0, "max_tokens": 0})["choices"]) == 3


def test_bad_echo_logprobs_and_stop(srv):
    error(post(srv, {"prompt": "a", "echo": 1}), "echo")
    error(post(srv, {"prompt": "a", "echo": True, "logprobs": 21}), "logprobs")
    error(post(srv, {"prompt": "a", "logprobs": -1, "echo": True}), "logprobs")
    error(post(srv, {"prompt": "a", "stop": [str(i) for i in range(17)]}), "stop")
    assert ok(srv, {"prompt": "a", "max_tokens": 2, "stop": [str(i) for i in range(16)]})["choices"]


def test_echo_of_the_eos_token_and_idle_after(srv):
    """A prompt holding the EOS id is scored like any other token, and nothing is left running."""
    ch = ok(srv, {"prompt": [[1, EOS, 3]], "echo": True, "logprobs": 0, "max_tokens": 0})["choices"][0]
    assert len(ch["logprobs"]["token_logprobs"]) == 3
    m = srv.metrics()
    assert m["running"] == m["waiting"] == m["kda_slots_used"] == 0


@pytest.mark.skipif(not default.ASSET_DIR.is_dir() or not any(default.ASSET_DIR.iterdir()),
                    reason="no shipped default model")
def test_the_shipped_model_answers_to_its_id_and_its_directory_name():
    """`kimi-linear serve` without a model: the id is `kimi-linear-default`; `default` (the directory) works too."""
    import argparse

    from fastapi.testclient import TestClient

    from kimi_linear.server.cli import add_serve_arguments, build_server

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    threads = torch.get_num_threads()            # build_server sets torch's (process-wide) thread count
    app, loop = build_server(p.parse_args(["--max-num-seqs", "2", "--threads", str(threads)]))
    try:
        with TestClient(app) as c:
            assert [m["id"] for m in c.get("/v1/models").json()["data"]] == [default.NAME, "default"]
            for name in (default.NAME, "default"):
                r = c.post("/v1/completions", json={"model": name, "prompt": "import", "max_tokens": 1})
                assert r.status_code == 200 and r.json()["model"] == default.NAME
    finally:
        loop.close()
        torch.set_num_threads(threads)
