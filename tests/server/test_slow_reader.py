"""Clients that stop reading their response (--timeout-send): a response the socket cannot take waits in the
server's memory, so a client that reads nothing of it for --timeout-send seconds is cut off, and one that reads
slowly but steadily gets every byte. The response here is an echoed prompt with 20 alternatives a token (~10 MB
from 12 prompts of 4,000 tokens on the tiny checkpoint): more than loopback's socket buffers take (~4 MB), so part
of it waits in the transport."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from .conftest import read_log, start_server, stop_server

TIMEOUT_SEND = 2
ECHO = {"model": "tiny", "prompt": [[(i * 7 + j) % 250 + 1 for j in range(4000)] for i in range(12)],
        "max_tokens": 1, "echo": True, "logprobs": 20, "temperature": 0}


@pytest.fixture(scope="module")
def srv(checkpoint):
    s = start_server(checkpoint, "--max-num-seqs", "4", "--timeout-send", str(TIMEOUT_SEND))
    os.set_blocking(s.proc.stdout.fileno(), False)
    yield s
    stop_server(s)


def ask(s, rcvbuf: int = 64 * 1024) -> socket.socket:
    """The echo request on a raw socket with a small receive buffer; nothing read yet."""
    c = socket.create_connection(("127.0.0.1", int(s.url.rsplit(":", 1)[1])), timeout=120)
    c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    body = json.dumps(ECHO).encode()
    c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\ncontent-length: "
              + str(len(body)).encode() + b"\r\n\r\n" + body)
    return c


def content_length(head: bytes) -> int:
    return int(next(x.split(b":")[1] for x in head.split(b"\r\n") if x.lower().startswith(b"content-length")))


def read_response(c: socket.socket, chunk: int, pause: float) -> tuple[bytes, bytes]:
    """(head, body) of one HTTP/1.1 response with Content-Length, ``chunk`` bytes per read and ``pause`` seconds
    between reads; the body is short if the server closed the connection first."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += c.recv(chunk)
    head, body = data.split(b"\r\n\r\n", 1)
    length = content_length(head)
    while len(body) < length:
        time.sleep(pause)
        try:
            got = c.recv(chunk)
        except (ConnectionResetError, TimeoutError):
            break
        if not got:
            break
        body += got
    return head, body[:length] if len(body) >= length else body


def test_stalled_reader_is_cut_off(srv):
    c = ask(srv)
    try:
        log = ""
        for _ in range(600):                        # the response is made (seconds), then TIMEOUT_SEND passes
            log += read_log(srv)
            if "cut off a client" in log:
                break
            time.sleep(0.1)
        assert "cut off a client that read nothing of its response in 2 s" in log, log[-2000:]
        c.settimeout(10)
        head, body = read_response(c, 1 << 20, 0)
        assert head.startswith(b"HTTP/1.1 200")
        assert len(body) < content_length(head), "the whole response arrived: nothing was cut"
    finally:
        c.close()
    assert srv.metrics()["running"] == 0


def test_slow_steady_reader_gets_everything(srv):
    """256 KB per read (the receive buffer's size) every 0.4 s, far below what loopback carries: the transport stays
    paused for seconds at a time, draining between checks, so the connection is never cut."""
    c = ask(srv, rcvbuf=256 * 1024)
    try:
        head, body = read_response(c, 256 * 1024, 0.4)
    finally:
        c.close()
    assert head.startswith(b"HTTP/1.1 200"), head
    out = json.loads(body)
    assert len(out["choices"]) == 12 and all(len(ch["logprobs"]["tokens"]) == 4001 for ch in out["choices"])
