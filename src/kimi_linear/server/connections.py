"""Connection limits under uvicorn's HTTP/1.1 (h11) protocol, and rate-limited logging of refusals.

uvicorn bounds header size (``h11_max_incomplete_event_size``), idle keep-alive time (``timeout_keep_alive``) and
requests in progress (``limit_concurrency``, which answers 503 but keeps the sockets), but it neither caps open
connections nor times out a client that trickles its request head a byte at a time (its keep-alive timer restarts
on every byte): ~20,000 such sockets exhaust the file descriptors. :func:`guarded_h11` adds both:

- ``max_connections``: at the cap, a new connection first closes the *oldest connection still waiting for a
  request head* (fresh or idle keep-alive, i.e. holding no request), so a flood of idle or trickling sockets cannot
  lock out real clients; when every open connection holds a request, the new one is answered 503 (OpenAI error
  JSON) and closed at once.
- ``timeout_request_head``: a connection must deliver a complete request head within this many seconds of
  connecting (or of its previous response), however slowly it trickles, or it is closed.
- ``timeout_send``: a client that reads nothing of a pending response for this many seconds is cut off (nginx's
  ``send_timeout``). A response is written to the transport whole, so one that the socket cannot take waits in
  memory until the client reads it: an echoed prompt with 20 alternatives per token is ~560 bytes a token, up to
  ~150 MB for the largest request ``--max-scored-prompt-tokens`` allows, held for as long as a stalled client keeps
  its connection open. While the transport's buffer is above its high-water mark, a timer checks every
  ``timeout_send`` seconds that the bytes still to send (the transport's buffer and, on Linux, the socket's send
  queue: the transport only refills the socket once a third of its buffer, MBs on loopback, has drained) have
  shrunk; if not, the connection is aborted, which frees the buffer (and, for a stream still running, ends its
  request). A slow reader that keeps reading is never cut.

The cap bounds connections the protocol has seen, not descriptors: asyncio accepts up to ``backlog`` sockets in
one event-loop turn, creates their transports a turn later and calls ``connection_made`` (where the cap evicts) a
turn after that, and a closed transport frees its descriptor one more turn on. So while a flood arrives, three
accept batches can be descriptors beside the ``max_connections`` admitted ones; once the loop catches up the
flood's sockets are closed. :func:`fit_open_file_limit` sizes both to the process's open-file limit. A large
``backlog`` is still the better default: a smaller one makes the kernel drop new connections' SYNs during a flood,
and a real client then waits a second or more for its retransmission before the cap can admit it.

Log lines about refusals (ours and uvicorn's "Exceeded concurrency limit." / "Invalid HTTP request received.",
asyncio's accept errors, 503 access lines) go through :class:`RateLimitFilter`: the first per kind every
``period`` seconds, then one line saying how many were suppressed.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from typing import Any

from .protocol import APIError

log = logging.getLogger("kimi_linear.server")

REFUSAL_MESSAGES = ("Exceeded concurrency limit.", "Invalid HTTP request received.",
                    "socket.accept() out of system resource", "refused a connection", "closed a connection",
                    "cut off a client")


class RateLimitFilter(logging.Filter):
    """Lets the first record of each flood-prone kind through per ``period`` seconds; the next one that passes
    says how many were dropped in between. Other records pass untouched."""

    def __init__(self, period: float = 10.0) -> None:
        super().__init__()
        self.period = period
        self._lock = threading.Lock()
        self._state: dict[str, list[float]] = {}          # kind -> [window start, dropped]

    @staticmethod
    def kind(record: logging.LogRecord) -> str | None:
        msg = str(record.msg)
        for m in REFUSAL_MESSAGES:
            if msg.startswith(m):
                return m
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) >= 5 \
                and record.args[4] in (503, 408, 413):
            return f"access {record.args[4]}"
        return None

    def filter(self, record: logging.LogRecord) -> bool:
        k = self.kind(record)
        if k is None:
            return True
        now = time.monotonic()
        with self._lock:
            st = self._state.setdefault(k, [-1e9, 0])
            if now - st[0] < self.period:
                st[1] += 1
                return False
            dropped, st[0], st[1] = int(st[1]), now, 0
        if dropped:
            record.msg = f"{record.msg} [{dropped} more like this in the previous {self.period:g} s not logged]"
        return True


def install_log_rate_limit(period: float = 10.0) -> RateLimitFilter:
    f = RateLimitFilter(period)
    for name in ("uvicorn.error", "uvicorn.access", "asyncio", "kimi_linear.server"):
        logging.getLogger(name).addFilter(f)
    return f


RESERVED_DESCRIPTORS = 64     # the model's files, the listening socket, threads, /proc reads, logs


def peak_descriptors(max_connections: int, backlog: int) -> int:
    """Descriptors the server may hold during a connection flood (see the module docstring): the admitted
    connections, three accept batches of up to ``backlog + 1`` sockets (Linux queues one more than asked) and a
    reserve for everything else."""
    return max_connections + 3 * (backlog + 1) + RESERVED_DESCRIPTORS


def fit_open_file_limit(max_connections: int, backlog: int) -> tuple[int, int]:
    """``(max_connections, backlog)`` that fit the process's open-file limit, raising its soft limit towards the
    hard one first when it is short (as Go's runtime does at start): a flood then gets asyncio's EMFILE pause at
    worst, never a failed open elsewhere in the server. Where even the hard limit is short, the backlog shrinks
    first (to a quarter of what is left, at least 16), then the connection cap."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = peak_descriptors(max_connections, backlog)
    if soft != resource.RLIM_INFINITY and soft < need:
        want = need if hard == resource.RLIM_INFINITY else min(hard, need)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (OSError, ValueError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= need:
        return max_connections, backlog
    room = max(1, soft - RESERVED_DESCRIPTORS)
    backlog = min(backlog, max(16, room // 4 // 3))
    return max(1, min(max_connections, room - 3 * (backlog + 1))), backlog


def unsent_bytes(transport: Any) -> int:
    """Bytes a transport still has to deliver: its own buffer plus, where the platform tells (Linux's SIOCOUTQ),
    the socket's send queue (unsent and unacknowledged)."""
    size = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            import fcntl
            import struct
            import termios

            size += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
        except (ImportError, OSError, AttributeError):
            pass
    return size


def _refusal_bytes(max_connections: int) -> bytes:
    """The whole 503 a refused connection gets, written to its socket before any app runs."""
    err = APIError(503, f"the server has {max_connections} connections open, each with a request in progress "
                        "(--max-connections); retry later", code="too_many_connections", type_="server_error")
    body = json.dumps(err.body()).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"retry-after: 1\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def guarded_h11(max_connections: int, timeout_request_head: float, timeout_send: float) -> type:
    """A subclass of uvicorn's h11 protocol with a cap on open connections, a request-head deadline and a send
    timeout (see the module docstring); pass it as ``uvicorn.Config(http=...)``."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    bad_request = json.dumps(APIError(400, "invalid HTTP request (malformed, or a request head over "
                                           "--max-header-bytes)", code="invalid_http_request").body()).encode()
    live: set[Any] = set()                                  # accepted and not being closed by us
    waiting: OrderedDict[Any, None] = OrderedDict()         # live connections waiting for a request head, oldest first
    refusal = _refusal_bytes(max_connections)

    class GuardedH11Protocol(H11Protocol):
        _refused = False
        _head_timer: Any = None
        _send_timer: Any = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            if len(live) >= max_connections and not self._evict_oldest_waiting():
                self._refused = True
                self.transport = transport
                log.warning("refused a connection: %d open, all with a request in progress (--max-connections)",
                            len(live))
                transport.write(refusal)
                transport.close()
                return
            live.add(self)
            super().connection_made(transport)
            self._await_head()

        @staticmethod
        def _evict_oldest_waiting() -> bool:
            if not waiting:
                return False
            old, _ = waiting.popitem(last=False)
            old._stop_head_timer()
            live.discard(old)
            log.warning("closed a connection that held no request to admit a new one (--max-connections %d)",
                        max_connections)
            old.transport.close()
            return True

        def _await_head(self) -> None:
            waiting[self] = None
            waiting.move_to_end(self)
            self._stop_head_timer()
            self._head_timer = self.loop.call_later(timeout_request_head, self._head_timed_out)

        def _stop_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self in waiting:
                waiting.pop(self, None)
                live.discard(self)
                log.warning("closed a connection that sent no complete request head in %g s "
                            "(--timeout-request-head)", timeout_request_head)
                self.transport.close()

        def pause_writing(self) -> None:
            """The transport's buffer passed its high-water mark: watch that the client drains it."""
            super().pause_writing()
            self._watch_send(unsent_bytes(self.transport))

        def resume_writing(self) -> None:
            super().resume_writing()
            self._stop_send_timer()

        def _watch_send(self, size: int) -> None:
            self._stop_send_timer()
            self._send_timer = self.loop.call_later(timeout_send, self._check_send, size)

        def _stop_send_timer(self) -> None:
            if self._send_timer is not None:
                self._send_timer.cancel()
                self._send_timer = None

        def _check_send(self, size: int) -> None:
            self._send_timer = None
            if self.transport.is_closing():
                return
            now = unsent_bytes(self.transport)
            if now < size:                   # the client read something: watch on
                self._watch_send(now)
                return
            log.warning("cut off a client that read nothing of its response in %g s (%d bytes waiting; "
                        "--timeout-send)", timeout_send, now)
            self.transport.abort()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            super().data_received(data)
            if self in waiting and self.conn.their_state is not h11.IDLE:     # a whole request head arrived
                waiting.pop(self, None)
                self._stop_head_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if (self in live and not self.transport.is_closing() and self.conn.our_state is h11.IDLE
                    and self.conn.their_state is h11.IDLE):
                self._await_head()

        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to a request h11 cannot parse, as OpenAI error JSON instead of plain text."""
            headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                          h11.Data(data=bad_request), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            waiting.pop(self, None)
            live.discard(self)
            self._stop_head_timer()
            self._stop_send_timer()
            if self._refused:
                return
            super().connection_lost(exc)

    return GuardedH11Protocol
