"""The server's limits (one place for their defaults, which README's serving section lists), the request-body
guard, and the prompt-length bound checked before a string is tokenized."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .budget import Budget
from .protocol import APIError

MiB = 2**20


@dataclass
class ServerLimits:
    """max_body_bytes: larger request bodies get 413 (from Content-Length before reading, else once the body
        grows past it).
    max_json_depth: deeper nesting gets 400 ``json_too_deep`` (at most 512: Python's parser recurses).
    max_prompt_chars: a prompt string (or the chat messages' text together) longer than this gets 400
        ``context_length_exceeded`` without being tokenized. None: derived from the model and tokenizer by
        :func:`prompt_char_bound` (no prompt that fits the context is ever that long).
    timeout_request_body: seconds a client has to send its whole body once the head is in (408 after).
    max_connections, backlog, timeout_request_head, timeout_send: see :mod:`.connections`.
    timeout_keep_alive: uvicorn's: idle seconds before a keep-alive connection is closed.
    max_header_bytes: uvicorn's ``h11_max_incomplete_event_size``: a request head still incomplete past this many
        bytes gets 400.
    limit_concurrency: uvicorn's: beyond this many connections + requests in progress, requests get 503 (it counts
        open connections too, so below ``max_connections`` a flood of idle sockets makes it refuse everyone: off
        unless set).
    shutdown_timeout: on SIGINT / SIGTERM, seconds running requests get to finish before they are aborted.
    max_prompts_per_request: a completions ``prompt`` that is a list of more prompts than this gets 400 (each
        prompt is a request to the engine).
    max_scored_prompt_tokens: prompt tokens whose log-probs one request may ask for (``echo`` with ``logprobs``),
        summed over its prompts: 400 beyond (each comes back as a JSON entry with its alternatives).
    max_pending_tokens: prompt tokens of all requests in progress together; a request that would pass it gets 503
        ``server_overloaded`` (:mod:`.budget`). None: :func:`.budget.default_limit` of the engine.
    max_pending_body_bytes: bytes of request bodies read and not yet parsed, all requests together: 503
        ``server_overloaded`` beyond (:mod:`.budget`).
    """

    max_body_bytes: int = 16 * MiB
    max_json_depth: int = 64
    max_prompt_chars: int | None = None
    timeout_request_body: float = 30.0
    max_connections: int = 1024
    backlog: int = 2048
    timeout_request_head: float = 10.0
    timeout_send: float = 60.0
    timeout_keep_alive: int = 5
    max_header_bytes: int = 16 * 1024
    limit_concurrency: int | None = None
    shutdown_timeout: float = 30.0
    max_prompts_per_request: int = 256
    max_scored_prompt_tokens: int = 262_144
    max_pending_tokens: int | None = None
    max_pending_body_bytes: int = 256 * MiB

    def validate(self) -> ServerLimits:
        for name in ("max_body_bytes", "max_pending_body_bytes", "max_connections", "backlog", "max_header_bytes",
                     "max_prompts_per_request", "max_scored_prompt_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.max_json_depth <= 512:
            raise ValueError(f"`max_json_depth` must be in [1, 512], got {self.max_json_depth}")
        for name in ("timeout_request_body", "timeout_request_head", "timeout_send", "timeout_keep_alive",
                     "shutdown_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"`{name}` must be > 0 seconds, got {getattr(self, name)}")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError(f"`max_prompt_chars` must be >= 1, got {self.max_prompt_chars}")
        if self.max_pending_tokens is not None and self.max_pending_tokens < 1:
            raise ValueError(f"`max_pending_tokens` must be >= 1, got {self.max_pending_tokens}")
        if self.limit_concurrency is not None and self.limit_concurrency < 1:
            raise ValueError(f"`limit_concurrency` must be >= 1, got {self.limit_concurrency}")
        return self


def prompt_char_bound(tokenizer: Any, max_context: int) -> int:
    """Characters beyond which a prompt cannot fit ``max_context`` tokens: every token stands for at most as many
    characters as its longest vocabulary entry has (byte-level entries spell one character per byte, and a
    character is at least one byte). A tokenizer with a normalizer (which may merge characters) gets 4x room."""
    try:
        longest = max(len(t) for t in tokenizer.get_vocab())
    except Exception:       # a tokenizer without a string vocabulary: a generous guess
        longest = 64
    backend = getattr(tokenizer, "backend_tokenizer", None)
    factor = 1 if backend is not None and getattr(backend, "normalizer", None) is None else 4
    return max_context * max(longest, 1) * factor


def _error(err: APIError) -> tuple[dict, bytes]:
    """The ASGI response start and body of ``err`` (OpenAI error JSON), closing the connection."""
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")] + [(k.encode(), v.encode()) for k, v in (err.headers or {}).items()]
    return {"type": "http.response.start", "status": err.status, "headers": headers}, body


RELEASE_BODY = "kimi_linear.release_body"    # scope key: the app calls it once it has parsed the body


class BodyLimitMiddleware:
    """Reads a request's body before the app sees it: 413 past ``max_bytes`` (from Content-Length when the client
    sends one, so a 50 MB upload is refused before it is read), 408 when it takes longer than ``timeout``, 503
    ``server_overloaded`` when the bodies read and not yet parsed, all requests together, would pass ``pending``
    (:mod:`.budget`). The app then gets the body in one message (the middleware keeps no reference to it) and the
    client's later messages (disconnect) as they come; it gives the body's bytes back to ``pending`` by calling
    ``scope[RELEASE_BODY]()`` once parsed (at the latest, the middleware does when the app returns)."""

    def __init__(self, app: Any, max_bytes: int, timeout: float, pending: Budget) -> None:
        self.app, self.max_bytes, self.timeout, self.pending = app, max_bytes, timeout, pending

    async def _refuse(self, send: Any, err: APIError) -> None:
        start, body = _error(err)
        await send(start)
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        releases: list[Callable[[], None]] = []

        def release() -> None:
            for r in releases:
                r()
        try:
            try:
                body = await self._read(scope, receive, send, releases)
            except APIError as e:                      # the bodies' budget
                await self._refuse(send, e)
                return
            if body is None:                           # refused, or the client left
                return

            async def replay() -> dict:
                nonlocal body
                if body is not None:
                    msg, body = {"type": "http.request", "body": body, "more_body": False}, None
                    return msg
                return await receive()

            await self.app({**scope, RELEASE_BODY: release}, replay, send)
        finally:
            release()

    async def _read(self, scope: dict, receive: Any, send: Any, releases: list[Callable[[], None]]) -> bytes | None:
        """The whole body, each part admitted to ``pending`` (Content-Length's at once); None once refused with
        413 / 408 or the client gone."""
        declared = None
        for k, v in scope.get("headers") or []:
            if k == b"content-length" and v.isdigit():
                declared = int(v)
                if declared > self.max_bytes:
                    await self._refuse(send, APIError(413, f"request body is {declared} bytes; this server accepts at "
                                                      f"most {self.max_bytes} (--max-body-bytes)",
                                                      code="request_too_large"))
                    return None
        if declared:
            releases.append(self.pending.admit(declared))
        chunks, size, deadline = [], 0, time.monotonic() + self.timeout
        while True:
            try:
                msg = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.001))
            except asyncio.TimeoutError:
                await self._refuse(send, APIError(408, f"request body not received within {self.timeout:g} s "
                                                  "(--timeout-request-body)", code="request_timeout"))
                return None
            if msg["type"] == "http.disconnect":
                return None
            chunk = msg.get("body", b"")
            size += len(chunk)
            if declared is None and chunk:         # chunked upload: admitted as it comes
                releases.append(self.pending.admit(len(chunk)))
            if size > self.max_bytes:
                await self._refuse(send, APIError(413, f"request body is over {self.max_bytes} bytes, the most this "
                                                  "server accepts (--max-body-bytes)", code="request_too_large"))
                return None
            chunks.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(chunks)
