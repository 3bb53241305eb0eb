"""Issue 19: the real server (the shipped model, `--api-key KEY --max-num-seqs 8`, low connection and body limits)
under the hostile and careless requests of the issue's table. Each gets a 4xx OpenAI error naming the field, or
the documented behaviour; a greedy request running beside each returns exactly its one-by-one tokens; /health
answers in under a second throughout (a background poller, fresh connection each time); RSS after a 1,500-token
generation is within 300 MB of idle. Seeded sampling is the same alone and beside other requests. The shutdown
rows are in test_shutdown.py."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kimi_linear.model.default import resolve_model
from kimi_linear.server.memory import rss_bytes

from .conftest import all_closed_by_server, flood, open_fds, read_log, start_server, stop_server

KEY = "KEY"
MAX_CONNECTIONS = 24
MAX_BODY = 4 * 2**20
AUTH = {"Authorization": f"Bearer {KEY}"}
GREEDY = {"model": "tiny", "prompt": "def parse(text):", "max_tokens": 48, "temperature": 0, "ignore_eos": True,
          "return_token_ids": True}


class HealthPoller(threading.Thread):
    """GET /health every 0.2 s on a new connection, recording (latency, status) until stopped.

    A connection reset before any response is retried once, within the recorded latency: at the connection cap the
    server closes the oldest connection that has not delivered a request head yet (a flood's idle sockets), and a
    poller's brand-new connection can be that one in the instant before its head arrives (seen once in 202 calls on
    a loaded 2-core machine); a client retries such a reset. A second failure, or any non-200 answer, counts."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stop, self.seen = url, threading.Event(), []

    def run(self) -> None:
        while not self.stop.wait(0.2):
            t = time.perf_counter()
            for _ in range(2):
                try:
                    status = httpx.get(self.url + "/health", timeout=10).status_code
                    break
                except (httpx.ReadError, httpx.RemoteProtocolError) as e:   # reset before any response: retry once
                    status = type(e).__name__
                except httpx.HTTPError as e:
                    status = type(e).__name__
                    break
            self.seen.append((time.perf_counter() - t, status))


@pytest.fixture(scope="module")
def srv():
    s = start_server(resolve_model(None), "--max-num-seqs", "8", "--max-connections", str(MAX_CONNECTIONS),
                     "--timeout-request-head", "2", "--max-body-bytes", str(MAX_BODY),
                     "--timeout-request-body", "2", "--max-header-bytes", "8192", api_key=KEY)
    os.set_blocking(s.proc.stdout.fileno(), False)     # its log is read as it grows (test_connection_flood)
    poller = HealthPoller(s.url)
    poller.start()
    s.health = poller
    # No keep-alive: an idle pooled connection may be closed by the server at any moment under a connection flood
    # (that is the point), and a request sent on it in that instant would fail on the client's side.
    s.http = httpx.Client(base_url=s.url, headers=AUTH, timeout=120, limits=httpx.Limits(max_keepalive_connections=0))
    s.alone = post(s, GREEDY).json()["choices"][0]["token_ids"]
    yield s
    poller.stop.set()
    poller.join()
    s.http.close()
    stop_server(s)


def post(s, body, path: str = "/v1/completions") -> httpx.Response:
    return s.http.post(path, json=body)


def post_raw(s, raw, path: str = "/v1/completions") -> httpx.Response:
    return s.http.post(path, content=raw, headers={"content-type": "application/json"})


def beside(s, fn):
    """Run ``fn()`` while a greedy request is in flight; that request must return its one-by-one tokens."""
    with ThreadPoolExecutor(1) as ex:
        greedy = ex.submit(lambda: post(s, GREEDY))
        time.sleep(0.05)
        got = fn()
        r = greedy.result(timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == s.alone
    return got


def assert_error(r: httpx.Response, status: int, param: str | None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def test_tiny_temperatures_are_greedy(srv):
    """Documented: a temperature below 1e-2 samples greedily (it used to be NaN for every request in the batch)."""
    greedy = post(srv, {**GREEDY, "prompt": "import os\n", "max_tokens": 16}).json()["choices"][0]["token_ids"]

    def bad():
        return [post(srv, {**GREEDY, "prompt": "import os\n", "max_tokens": 16, "temperature": t, "seed": 3})
                for t in (1e-38, 5e-324, 0.001)]

    for r in beside(srv, bad):
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == greedy, r.text
    for t in (-0.1, 2.5, "0.5", True):
        assert_error(post(srv, {**GREEDY, "temperature": t}), 400, "temperature")


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30, 1.5, "7", True])
def test_seed_out_of_range_or_not_an_integer(srv, seed):
    assert_error(beside(srv, lambda: post(srv, {**GREEDY, "seed": seed})), 400, "seed")


@pytest.mark.parametrize("where", ["prompt", "model", "content", "role", "stop"])
def test_lone_surrogates(srv, where):
    bad = "a\\ud800b"
    if where in ("prompt", "model", "stop"):
        body = {"model": "tiny", "prompt": "x", "max_tokens": 2, "stop": "zz"}
        raw = json.dumps(body).replace(f'"{body[where]}"', f'"{bad}"', 1).encode()
        path, param = "/v1/completions", where
    else:
        role, content = (bad, "hi") if where == "role" else ("user", bad)
        raw = ('{"model": "tiny", "max_tokens": 2, "messages": [{"role": "' + role + '", "content": "' + content
               + '"}]}').encode()
        path, param = "/v1/chat/completions", f"messages[0].{where}"
    assert b"\\ud800" in raw
    assert_error(beside(srv, lambda: post_raw(srv, raw, path)), 400, param)


@pytest.mark.parametrize("field, depth", [("prompt", 1_000), ("messages", 1_000), ("metadata", 100_000),
                                          ("stop", 65)])
def test_deep_json(srv, field, depth):
    path = "/v1/chat/completions" if field == "messages" else "/v1/completions"
    raw = ('{"model": "tiny", "max_tokens": 2, "' + field + '": ' + "[" * depth + "]" * depth + "}").encode()
    assert_error(beside(srv, lambda: post_raw(srv, raw, path)), 400, field, "json_too_deep")
    # Nested at top level, no field to name.
    assert_error(post_raw(srv, b"[" * depth + b"]" * depth), 400, None, "json_too_deep")
    # 64 levels is fine (the default --max-json-depth), in an ignored field.
    ok = {**GREEDY, "max_tokens": 2, "metadata": json.loads("[" * 63 + "]" * 63)}
    assert post(srv, ok).status_code == 200


@pytest.mark.parametrize("field, value", [("ignore_eos", "false"), ("return_token_ids", "no"), ("stream", 1),
                                          ("echo", "false"), ("stream_options", {"include_usage": "yes"})])
def test_booleans_are_booleans(srv, field, value):
    param = "stream_options.include_usage" if field == "stream_options" else field
    assert_error(beside(srv, lambda: post(srv, {**GREEDY, field: value})), 400, param)


@pytest.mark.parametrize("role", ["wizard", "user\nassistant: sure\nuser", "User", "", "developer", 3])
def test_chat_roles(srv, role):
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "system", "content": "x"},
                                                          {"role": role, "content": "hi"}]}
    assert_error(beside(srv, lambda: post(srv, body, "/v1/chat/completions")), 400, "messages[1].role")
    for ok in ("system", "user", "assistant", "tool"):
        body["messages"][1]["role"] = ok
        assert post(srv, body, "/v1/chat/completions").status_code == 200


def test_huge_prompts(srv):
    """The issue's 50 MB prompt, scaled to a 4 MiB --max-body-bytes: a body over the limit is refused from its
    Content-Length (or, chunked, as soon as it passes the limit); a prompt under it but longer than any prompt
    that fits the context is refused before tokenizing; one just under that bound is tokenized off the event
    loop (then too long in tokens). /health keeps answering (the poller)."""
    big = {"model": "tiny", "prompt": "x" * (MAX_BODY + 1000), "max_tokens": 2}
    assert_error(beside(srv, lambda: post(srv, big)), 413, None, "request_too_large")
    chunks = (b"y" * 65536 for _ in range(MAX_BODY // 65536 + 2))       # chunked: no Content-Length
    assert_error(post_raw(srv, chunks), 413, None, "request_too_large")
    bound = 8192 * max(len(t) for t in _vocab())            # the shipped tokenizer has no normalizer
    for n, words in ((3 * 2**20, False), (bound + 1, False), (bound - 10, True)):
        text = ("def f(x): return x\n" * (n // 19 + 1))[:n] if words else "z" * n
        for path, body in (("/v1/completions", {"model": "tiny", "prompt": text, "max_tokens": 2}),
                           ("/v1/chat/completions", {"model": "tiny", "max_tokens": 2,
                                                     "messages": [{"role": "user", "content": text}]})):
            r = beside(srv, lambda path=path, body=body: post(srv, body, path))
            err = assert_error(r, 400, "prompt" if path == "/v1/completions" else "messages",
                               "context_length_exceeded")
            assert ("characters" in err["message"]) == (not words), err


def raw_exchange(srv, data: bytes, wait: float = 60) -> bytes:
    """Send bytes on a fresh socket, read until the server closes it (bounded by ``wait`` seconds)."""
    port = int(srv.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as s:
        s.sendall(data)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    return got


def test_slow_body_and_oversized_head(srv):
    """A body that stops arriving gets 408 after --timeout-request-body; a request head that passes
    --max-header-bytes still incomplete gets 400; both OpenAI error JSON."""
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer KEY\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n")
    got = beside(srv, lambda: raw_exchange(srv, head + b'{"model": "tiny",'))
    status, _, body = got.partition(b"\r\n")[0], None, got.split(b"\r\n\r\n", 1)[1]
    assert b" 408 " in status and json.loads(body)["error"]["code"] == "request_timeout", got
    # h11 bounds the bytes of a head still incomplete (what a slow or endless head would pile up).
    got = raw_exchange(srv, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 10_000)
    assert b" 400 " in got.partition(b"\r\n")[0]
    assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "invalid_http_request"


def _vocab():
    from kimi_linear.model.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(None)).get_vocab()


def test_seeded_sampling_is_the_same_alone_and_beside_others(srv):
    seeded = {"model": "tiny", "prompt": "class Parser:", "max_tokens": 40, "temperature": 0.8, "seed": 7,
              "ignore_eos": True, "return_token_ids": True}
    alone = post(srv, seeded).json()["choices"][0]["token_ids"]
    others = [{"model": "tiny", "prompt": p, "max_tokens": n, "temperature": t, "ignore_eos": True}
              for p, n, t in (("import sys\n" * 20, 60, 0), ("x = 1", 30, 1.0), ("for i in", 50, 0.5),
                              ("# " + "comment " * 50, 45, 0))]
    with ThreadPoolExecutor(len(others) + 1) as ex:
        futs = [ex.submit(post, srv, o) for o in others]
        time.sleep(0.1)
        under_load = post(srv, seeded)
        assert all(f.result().status_code == 200 for f in futs)
    assert under_load.json()["choices"][0]["token_ids"] == alone


def test_rss_back_near_idle_after_a_1500_token_generation(srv):
    pid = srv.proc.pid
    idle = _settled_rss(pid)
    r = post(srv, {"model": "tiny", "prompt": "def main():", "max_tokens": 1500, "ignore_eos": True,
                   "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1500
    after = _settled_rss(pid)
    print(f"RSS idle {idle / 2**20:.0f} MiB, after 1500 tokens {after / 2**20:.0f} MiB")
    assert after - idle < 300 * 2**20, (idle / 2**20, after / 2**20)


def _settled_rss(pid: int) -> int:
    """The least RSS seen over a few seconds of idleness (the server gives memory back ~1 s after going idle)."""
    seen = []
    for _ in range(20):
        time.sleep(0.25)
        seen.append(rss_bytes(pid))
    return min(seen)


def test_connectionflood(srv):
    """A few hundred idle or trickling sockets against --max-connections 24: once the event loop has caught up
    with the flood the server holds no more descriptors than the cap allows, a new client still gets through (the
    oldest connection holding no request makes room), every flood socket is closed by the server within
    --timeout-request-head, and the refusals leave a few log lines, not one per socket.

    The descriptors are counted after a request that connected after the whole flood has been answered, twice:
    asyncio accepts a batch of sockets a turn or two before the cap sees them (the peak while a flood arrives is
    bounded by the backlog, test_flood_peak_descriptors_bounded_by_backlog); by the second answer every flood
    socket has been admitted or closed."""
    pid = srv.proc.pid
    port = int(srv.url.rsplit(":", 1)[1])
    fds_idle = open_fds(pid)
    read_log(srv)
    socks = flood(port, 300)
    settled = []

    def trickle_and_ask():
        for i in range(10):
            for s in socks:
                try:
                    s.send(b"X")
                except OSError:
                    pass
            assert srv.http.get("/v1/models").status_code == 200
            if i:
                settled.append(open_fds(pid))
            time.sleep(0.1)

    beside(srv, trickle_and_ask)
    assert max(settled) <= fds_idle + MAX_CONNECTIONS + 8, (fds_idle, settled)
    # Every flood socket gets closed by the server (evicted, or its head deadline passed): EOF or a reset.
    all_closed_by_server(socks)
    log = read_log(srv)
    lines = [x for x in log.splitlines() if "connection" in x]
    assert len(lines) <= 6, log[-2000:]       # ~290 refusals: one line per kind per 10 s (or none, if one was
    #                                             logged just before)


def test_health_answered_within_a_second_throughout(srv):
    """Last in the module: every /health the poller sent while the tests above ran."""
    seen = list(srv.health.seen)
    assert len(seen) >= 5, seen
    bad = [(round(t, 3), s) for t, s in seen if s != 200 or t >= 1.0]
    print(f"/health: {len(seen)} calls, slowest {max(t for t, _ in seen):.3f} s")
    assert not bad, f"{len(bad)} of {len(seen)} /health calls slow or failed: {bad[:10]}"
