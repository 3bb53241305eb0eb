"""The server's bounds on what all clients together make it hold: prompt tokens of the requests in progress, and
bytes of request bodies received and not yet parsed.

Every admitted prompt is held as Python token lists (in the request, and in the engine's sequence) until its request
ends: ~65 bytes a token, measured on the shipped model (ten 11 MB requests of 256 prompts x 8,000 token ids each
took the server from 650 MiB to 1.96 GB while they waited). Per request the size is bounded (--max-body-bytes,
--max-prompts-per-request, the context), but nothing bounded the sum: 1,024 connections could hold ~130 GB.
:func:`pending_tokens` keeps that sum; a request that would take it past the limit is answered 503
``server_overloaded`` with ``Retry-After`` (the official OpenAI client retries such answers), unless nothing is
pending, so that every request the engine accepts can run alone.

Bodies are the same story one step earlier: each is read whole (up to --max-body-bytes, 16 MiB) and then waits
for one of the two parsing threads, so 1,024 connections sending 16 MiB each would hold 16 GB before any limit
on tokens applies. :func:`pending_body_bytes` bounds the bodies read and not yet parsed (--max-pending-body-bytes).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from .protocol import APIError

DEFAULT_FLOOR = 1 << 22          # 4,194,304 tokens: ~270 MB of token lists at most
CAPACITY_FACTOR = 4              # ... or 4x what the engine's cache holds at once, whichever is more


def default_limit(token_capacity: int, max_num_seqs: int, max_context: int) -> int:
    """The limit when --max-pending-tokens is not given: a queue several times as deep as the cache (the MLA
    pool's tokens, or every slot at a full context), and never below :data:`DEFAULT_FLOOR`."""
    return max(DEFAULT_FLOOR, CAPACITY_FACTOR * max(token_capacity, max_num_seqs * max_context))


class Budget:
    """Units (``unit``: "prompt tokens", "bytes of request bodies") admitted and not yet released, against
    ``limit`` (the command-line ``option`` that sets it). :meth:`admit` returns the release, which may be called
    more than once and from any thread (a garbage-collected stream's finalizer). Whatever is asked is admitted when
    nothing is held, so a request within the per-request limits can always run alone."""

    def __init__(self, limit: int, unit: str, option: str) -> None:
        self.limit, self.unit, self.option = limit, unit, option
        self.used = 0
        self._lock = threading.Lock()

    def admit(self, n: int) -> Callable[[], None]:
        with self._lock:
            if self.used and self.used + n > self.limit:
                raise APIError(503, f"this request's {n} {self.unit} would take the server past the {self.limit} it "
                               f"holds for all requests in progress ({self.used} now; {self.option}): retry later",
                               code="server_overloaded", type_="server_error", headers={"retry-after": "1"})
            self.used += n
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if not released:
                    released = True
                    self.used -= n
        return release


def pending_tokens(limit: int) -> Budget:
    return Budget(limit, "prompt tokens", "--max-pending-tokens")


def pending_body_bytes(limit: int) -> Budget:
    return Budget(limit, "bytes of request bodies", "--max-pending-body-bytes")
