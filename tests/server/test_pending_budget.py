"""--max-pending-tokens: the prompt tokens of all requests in progress are bounded server-wide (each is held as
token lists until its request ends); past the bound a request gets 503 `server_overloaded` with Retry-After, and
every way a request ends (finished, client gone mid-stream, non-streaming) gives its tokens back."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from kimi_linear.server.budget import DEFAULT_FLOOR, default_limit, pending_tokens
from kimi_linear.server.metrics import COUNTERS, GAUGES, render_metrics
from kimi_linear.server.protocol import APIError

from .conftest import start_server, stop_server

LIMIT = 5000


def test_pending_tokens_admit_and_release():
    p = pending_tokens(100)
    r1 = p.admit(60)
    r2 = p.admit(40)                                  # exactly at the limit
    with pytest.raises(APIError) as e:
        p.admit(1)
    assert e.value.status == 503 and e.value.code == "server_overloaded" and e.value.headers == {"retry-after": "1"}
    assert "--max-pending-tokens" in e.value.message
    r1()
    r1()                                              # a second release is a no-op
    assert p.used == 40
    r2()
    big = p.admit(500)                                # nothing pending: a request past the limit still runs alone
    assert p.used == 500
    with pytest.raises(APIError):
        p.admit(1)
    big()
    assert p.used == 0


def test_default_limit_scales_with_the_cache():
    assert default_limit(1000, 16, 8192) == DEFAULT_FLOOR
    assert default_limit(10_000_000, 16, 8192) == 40_000_000
    assert default_limit(0, 256, 131_072) == 4 * 256 * 131_072


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 31 + j * 7) % 250 + 1 for j in range(n)]


def pending(s) -> float:
    return s.metrics()["pending_prompt_tokens"]


def wait_pending(s, value: float) -> None:
    for _ in range(600):                                # polled, not timed
        if pending(s) == value:
            return
        time.sleep(0.05)
    raise AssertionError(f"pending prompt tokens {pending(s)}, expected {value}")


@pytest.fixture(scope="module")
def srv(checkpoint):
    s = start_server(checkpoint, "--max-num-seqs", "4", "--max-pending-tokens", str(LIMIT))
    yield s
    stop_server(s)


def test_over_the_budget_gets_503_then_room_again(srv):
    assert srv.metrics()["pending_prompt_tokens_limit"] == LIMIT
    lines: list[str] = []
    stop = threading.Event()

    def stream() -> None:
        body = {"model": "tiny", "prompt": prompt(3000, 1), "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                lines.append(line)
                if stop.is_set():
                    return                                  # the client leaves mid-stream
    t = threading.Thread(target=stream)
    t.start()
    try:
        wait_pending(srv, 3000)
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": prompt(2500, 2), "max_tokens": 1},
                       timeout=120)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "server_overloaded" and r.headers["retry-after"] == "1"
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": prompt(1500, 3), "max_tokens": 2},
                       timeout=120)                         # fits beside the stream: admitted, and given back
        assert r.status_code == 200, r.text
        assert pending(srv) == 3000
    finally:
        stop.set()
        t.join(timeout=120)
    assert lines
    wait_pending(srv, 0)                                    # the stream's client left: its tokens are back
    r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": [prompt(2500, 4), prompt(2000, 5)],
                                                       "max_tokens": 1}, timeout=120)
    assert r.status_code == 200, r.text                     # 4,500 together: room again
    assert pending(srv) == 0


def test_bodies_read_and_not_parsed_are_bounded(checkpoint):
    """--max-pending-body-bytes 1MiB: a body declared at 800 KB and still arriving holds its bytes, so a 500 KB body
    beside it gets 503 at once; once the first is parsed (its stream running on), the same 500 KB body is served."""
    s = start_server(checkpoint, "--max-num-seqs", "2", "--max-pending-body-bytes", "1MiB")
    try:
        port = int(s.url.rsplit(":", 1)[1])
        slow_body = json.dumps({"model": "tiny", "prompt": "x" * 10, "max_tokens": 3000, "ignore_eos": True,
                                "stream": True, "pad": "y" * 800_000}).encode()
        c = socket.create_connection(("127.0.0.1", port), timeout=60)
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\ncontent-length: "
                  + str(len(slow_body)).encode() + b"\r\n\r\n" + slow_body[:1000])
        body = {"model": "tiny", "prompt": "x" * 10, "max_tokens": 1, "pad": "z" * 500_000}
        for _ in range(100):                        # polled until the slow body's head has been read
            r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
            if r.status_code == 503:
                break
            time.sleep(0.05)
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "server_overloaded" and "--max-pending-body-bytes" in err["message"]
        assert r.headers["retry-after"] == "1"
        c.sendall(slow_body[1000:])
        assert c.recv(64).startswith(b"HTTP/1.1 200")         # parsed (unknown fields are ignored): streaming
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        m = s.metrics()
        assert m["running"] == 1 and m["pending_body_bytes"] == 0    # the stream runs on; its body was given back
        assert m["pending_body_bytes_limit"] == 2**20
        c.close()
    finally:
        stop_server(s)


def test_metrics_print_large_counts_in_full():
    """Budgets and counters past a million printed exactly (they were ``:g``: 1,048,576 came out 1.04858e+06)."""
    stats = dict.fromkeys(GAUGES, 0.0) | {"pending_body_bytes_limit": float(2**28), "generation_tokens_per_s": 12.5}
    stats |= dict.fromkeys(COUNTERS, 123_456_789.0)
    text = render_metrics(stats, 1.5)
    assert "kimi_linear_pending_body_bytes_limit 268435456\n" in text
    assert "kimi_linear_prompt_tokens_total 123456789\n" in text
    assert "kimi_linear_generation_tokens_per_s 12.5\n" in text
