"""The OpenAI-compatible HTTP API (FastAPI): models, completions, chat completions, SSE streaming, health,
Prometheus metrics, optional API key.

Request bodies are size- and time-limited before the routes see them (:class:`.limits.BodyLimitMiddleware`), then
parsed, validated (:mod:`.protocol`) and tokenized in worker threads, so the event loop only moves bytes: /health
and the token streams of running requests never wait behind a large or hostile request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kimi_linear.engine.background import EngineLoop
from kimi_linear.engine.sequence import RequestOutput

from .budget import default_limit, pending_body_bytes, pending_tokens
from .limits import RELEASE_BODY, BodyLimitMiddleware, ServerLimits, prompt_char_bound
from .memory import malloc_trim
from .metrics import render_metrics
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ParsedRequest,
    fallback_chat_prompt,
    is_prompt_list,
    parse_json,
    sampling_params,
    short,
    validate,
)

log = logging.getLogger("kimi_linear.server")


class ServerState:
    """What the routes share: the engine loop, the tokenizer, the served model names, the limits, the worker
    threads that parse and tokenize requests, the requests in flight (for a graceful shutdown).

    ``model_name`` is the model id responses carry; requests may name it or any of ``aliases`` (the checkpoint
    directory's name and path). /v1/models lists the id and the aliases that are plain names (not paths)."""

    def __init__(self, loop: EngineLoop, tokenizer: Any, model_name: str, aliases: tuple[str, ...] = (),
                 limits: ServerLimits | None = None) -> None:
        self.loop, self.tokenizer, self.model_name = loop, tokenizer, model_name
        self.names = {model_name, *aliases}
        self.ids = list(dict.fromkeys([model_name] + [a for a in aliases if a and "/" not in a and "\\" not in a]))
        self.created = int(time.time())
        self.started = time.monotonic()
        self.limits = (limits or ServerLimits()).validate()
        self.max_prompt_chars = self.limits.max_prompt_chars or (
            prompt_char_bound(tokenizer, loop.engine.max_context) if tokenizer is not None else None)
        e = loop.engine
        self.pending = pending_tokens(self.limits.max_pending_tokens or default_limit(
            e.token_capacity(), e.cfg.max_num_seqs, e.max_context))
        self.pending_bodies = pending_body_bytes(self.limits.max_pending_body_bytes)
        # Parsing, validation and tokenization of a request body (up to --max-body-bytes) run here, not on the
        # event loop, so /health and the token streams of other requests never wait for them.
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kimi-linear-http")
        self.active: set[str] = set()           # request ids handed to the engine and not yet answered
        self.preparing = 0                       # requests being parsed / tokenized
        self.draining = False
        self.used = False                        # anything happened since memory was last given back
        self.event_loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []

    def tok_str(self, t: int) -> str:
        return self.tokenizer.decode([t]) if self.tokenizer is not None else str(t)

    async def offload(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # ------------------------------------------------------------------------------------------------- shutdown
    def begin_shutdown(self) -> None:
        """Called from the signal handler: stop admitting requests, give running ones ``shutdown_timeout`` seconds,
        then abort the rest (their streams end with an error event, non-streaming ones get 503)."""
        if self.event_loop is not None and not self.draining:
            self.event_loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self.draining:
            return
        self.draining = True
        log.warning("shutting down: no new requests; %d running get up to %g s to finish (--shutdown-timeout)",
                    len(self.active), self.limits.shutdown_timeout)
        self._tasks.append(asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.limits.shutdown_timeout
        while (self.active or self.preparing) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.active:
            log.warning("shutting down: aborting %d requests still running after %g s", len(self.active),
                        self.limits.shutdown_timeout)
        for rid in list(self.active):
            self.loop.abort(rid)

    def check_admitting(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down and admits no new requests", code="server_shutting_down",
                           type_="server_error")

    # ------------------------------------------------------------------------------------------------- memory
    async def give_back_memory_when_idle(self, period: float = 1.0) -> None:
        """Once nothing runs (engine and HTTP), return the C allocator's free pages to the OS (see .memory)."""
        while True:
            await asyncio.sleep(period)
            st = self.loop.stats()
            if self.used and not self.active and not self.preparing and not st["running"] and not st["waiting"]:
                self.used = False
                await asyncio.get_running_loop().run_in_executor(None, malloc_trim)


class APIKeyMiddleware:
    """``Authorization: Bearer KEY`` on every route but /health. Plain ASGI (not BaseHTTPMiddleware), so the
    routes still see the client's disconnect message."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            headers = dict(scope.get("headers") or [])
            got = headers.get(b"authorization", b"")
            token = got[7:] if got.lower().startswith(b"bearer ") else b""
            if not hmac.compare_digest(token, self.key):
                err = APIError(401, "Incorrect API key provided (send it as `Authorization: Bearer KEY`)",
                               code="invalid_api_key")
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(state: ServerState, api_key: str | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.event_loop = asyncio.get_running_loop()
        state._tasks.append(asyncio.ensure_future(state.give_back_memory_when_idle()))
        try:
            yield
        finally:
            for t in state._tasks:
                t.cancel()
            state.pool.shutdown(wait=False)

    app = FastAPI(title="kimi-linear", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.kl = state

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        err = APIError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception) -> JSONResponse:
        log.error("internal error: %s: %s", type(e).__name__, e)
        err = APIError(500, f"internal server error ({type(e).__name__})", type_="server_error")
        return JSONResponse(err.body(), status_code=500)

    # Outermost first: the API key (cheap), then the body size / time limit, then the routes.
    app.add_middleware(BodyLimitMiddleware, max_bytes=state.limits.max_body_bytes,
                       timeout=state.limits.timeout_request_body,
                       pending=state.pending_bodies)
    if api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.draining:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        stats = {**state.loop.stats(), "pending_prompt_tokens": state.pending.used,
                 "pending_prompt_tokens_limit": state.pending.limit, "pending_body_bytes": state.pending_bodies.used,
                 "pending_body_bytes_limit": state.pending_bodies.limit}
        return PlainTextResponse(render_metrics(stats, time.monotonic() - state.started),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": state.created, "owned_by": "kimi-linear",
             "max_model_len": state.loop.engine.max_context} for name in state.ids]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _handle(state, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _handle(state, request, chat=True)

    return app


@dataclass
class Prepared:
    """A validated request: engine parameters, each prompt's token ids, and each prompt's text as the client sent
    it (None when sent as token ids: echo decodes them)."""

    req: ParsedRequest
    prompts: list[list[int]]
    texts: list[str | None]
    chat: bool


async def _handle(state: ServerState, request: Request, chat: bool) -> Response:
    state.check_admitting()
    state.used = True
    # Read from the stream, not request.body(), which would keep the bytes on the request until it ends.
    raw = b"".join([chunk async for chunk in request.stream()])
    state.preparing += 1
    try:
        prep = await state.offload(prepare, state, raw, chat)
    finally:
        state.preparing -= 1
        del raw
        request.scope.get(RELEASE_BODY, lambda: None)()      # parsed: its bytes no longer count
    state.check_admitting()
    return await _serve(state, prep, request)


def _precheck_prompt(state: ServerState, v: Any) -> None:
    """Cheap length checks on the raw ``prompt`` before every element is validated: the number of prompts, and
    token-id lists at or past the context."""
    ctx = state.loop.engine.max_context
    too_long = APIError(400, "", "prompt", code="context_length_exceeded")
    if not isinstance(v, list):
        return
    if not is_prompt_list(v):
        if len(v) >= ctx:
            too_long.message = f"`prompt` has {len(v)} tokens; the model's context is {ctx} tokens"
            raise too_long
        return
    limit = state.limits.max_prompts_per_request
    if len(v) > limit:
        raise APIError(400, f"`prompt` holds {len(v)} prompts; this server takes at most {limit} in one request "
                       "(--max-prompts-per-request)", "prompt")
    for i, p in enumerate(v):
        if isinstance(p, list) and len(p) >= ctx:
            raise APIError(400, f"`prompt[{i}]` has {len(p)} tokens; the model's context is {ctx} tokens",
                           f"prompt[{i}]", code="context_length_exceeded")


def prepare(state: ServerState, raw: bytes, chat: bool) -> Prepared:
    """Body -> validated request and each prompt's token ids (in a worker thread). Raises APIError."""
    body = parse_json(raw, state.limits.max_json_depth)
    if not chat:
        _precheck_prompt(state, body.get("prompt"))
    r = validate(ChatCompletionRequest if chat else CompletionRequest, body)
    if r.model not in state.names:
        also = [f"`{n}`" for n in state.ids[1:]]
        raise APIError(404, f"The model {short(r.model, 200)} does not exist; this server serves "
                       f"`{state.model_name}`" + (f" (also as {', '.join(also)})" if also else ""), "model",
                       code="model_not_found")
    req = sampling_params(r, chat)
    tok = state.tokenizer
    if chat:
        field = "messages"
        msgs = [{"role": m.role, "content": m.content} for m in r.messages]
        _check_chars(state, sum(len(m["content"]) for m in msgs), field)
        if tok is None:
            raise APIError(400, "this server has no tokenizer: use /v1/completions with token ids", field)
        if getattr(tok, "chat_template", None):
            prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        else:
            prompt = fallback_chat_prompt(msgs)
        fields, texts, prompts = [field], [None], [tok.encode(prompt, add_special_tokens=False)]
    else:
        several = len(r.prompt) > 1
        fields = [f"prompt[{i}]" if several else "prompt" for i in range(len(r.prompt))]
        texts = [p if isinstance(p, str) else None for p in r.prompt]
        prompts = []
        for field, p in zip(fields, r.prompt):
            if isinstance(p, str):
                _check_chars(state, len(p), field)
                if tok is None:
                    raise APIError(400, "this server has no tokenizer: send `prompt` as token ids", field)
                prompts.append(tok.encode(p, add_special_tokens=False))
            else:
                prompts.append(p)
    engine = state.loop.engine
    params = req.params
    scored, limit = sum(map(len, prompts)), state.limits.max_scored_prompt_tokens
    if params.prompt_logprobs is not None and scored > limit:
        raise APIError(400, f"`prompt` has {scored} tokens to score (`echo` with `logprobs`); this server scores at "
                       f"most {limit} in one request (--max-scored-prompt-tokens)", "prompt")
    for field, ids in zip(fields, prompts):
        p = replace(params, max_tokens=max(engine.max_context - len(ids), 0)) if params.max_tokens < 0 else params
        try:
            engine.check_request(ids, p)
        except ValueError as e:
            code = "context_length_exceeded" if "context" in str(e) or "pool" in str(e) else None
            msg = str(e).replace("`prompt`", f"`{field}`") if field.startswith("prompt[") else str(e)
            raise APIError(400, msg, field, code=code) from e
    return Prepared(req, prompts, texts, chat)


def _check_chars(state: ServerState, n: int, field: str) -> None:
    """Refuse a prompt string that cannot fit the context, before tokenizing it."""
    if state.max_prompt_chars is not None and n > state.max_prompt_chars:
        raise APIError(400, f"`{field}` has {n} characters, more than any prompt that fits the context of "
                       f"{state.loop.engine.max_context} tokens can have ({state.max_prompt_chars}, "
                       "--max-prompt-chars)", field, code="context_length_exceeded")


def _usage(lasts: list[RequestOutput]) -> dict[str, Any]:
    """Usage summed over the prompts of a request (each prompt's last output holds its totals)."""
    p = sum(o.prompt_tokens for o in lasts)
    c = sum(o.completion_tokens for o in lasts)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in lasts)}}


def _echo_text(state: ServerState, prep: Prepared, i: int) -> str:
    """Prompt i's text for ``echo``: as sent, or its token ids decoded."""
    text = prep.texts[i]
    if text is not None:
        return text
    return state.tokenizer.decode(prep.prompts[i]) if state.tokenizer is not None else ""


LogprobItem = tuple[int, float, list[tuple[int, float]]]


def _logprobs(state: ServerState, outs: list[RequestOutput], chat: bool,
              prompt: list[LogprobItem | None] | None = None, prompt_ids: list[int] | None = None
              ) -> dict[str, Any] | None:
    """The ``logprobs`` object of one choice: the generated tokens of ``outs``, after the prompt's tokens
    ``prompt_ids`` when ``prompt`` holds their log-probs (echo; the first entry is None: nothing precedes the first
    prompt token)."""
    items = [x for o in outs for x in o.logprobs]
    if chat:
        def entry(t: int, lp: float) -> dict[str, Any]:
            s = state.tok_str(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in alts]}
                            for t, lp, alts in items]}
    def top(alts: list[tuple[int, float]]) -> dict[str, float]:
        # Keyed by token text: tokens that decode alike (partial UTF-8, special tokens) share a key, which keeps
        # the best log-prob (alternatives come best first), so max() over it is still the top one's.
        d: dict[str, float] = {}
        for a, b in alts:
            d.setdefault(state.tok_str(a), b)
        return d

    toks, lps, tops = [], [], []
    for t, x in zip(prompt_ids or [], prompt or []):
        toks.append(state.tok_str(t))
        lps.append(None if x is None else x[1])        # the first prompt token has none (null, as vLLM sends)
        tops.append(None if x is None else top(x[2]))
    for t, lp, alts in items:
        toks.append(state.tok_str(t))
        lps.append(lp)
        tops.append(top(alts))
    offsets, pos = [], 0
    for s in toks:
        offsets.append(pos)
        pos += len(s)
    return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


SHUTDOWN_ERROR = {"message": "the server is shutting down: this request was stopped before it finished",
                  "type": "server_error", "param": None, "code": "server_shutting_down"}


async def _serve(state: ServerState, prep: Prepared, request: Request) -> Response:
    req, chat = prep.req, prep.chat
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    rids = [rid] if len(prep.prompts) == 1 else [f"{rid}-{i}" for i in range(len(prep.prompts))]
    params = req.params
    engine = state.loop.engine
    reqs = [(r, ids, replace(params, max_tokens=max(engine.max_context - len(ids), 0)) if params.max_tokens < 0
             else params) for r, ids in zip(rids, prep.prompts)]
    release = state.pending.admit(sum(map(len, prep.prompts)))
    gen = state.loop.generate_many(reqs)
    if req.stream:
        stream = _sse(state, prep, gen, rid, rids, created, release)
        weakref.finalize(stream, release)     # a stream never started (its client gone first) never ends itself
        return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    state.active.update(rids)
    try:
        got = await _collect(gen, request)
    finally:
        state.active.difference_update(rids)
        release()
    if got is None:                       # the client went away: the requests were aborted, nobody reads this
        return Response(status_code=499)
    outs: list[list[RequestOutput]] = [[] for _ in rids]
    for i, o in got:
        outs[i].append(o)
    for i, o in enumerate(outs):
        if o[-1].finish_reason == "error":
            where = f" (prompt {i})" if len(outs) > 1 else ""
            raise APIError(500, f"the engine failed on this request{where}: {o[-1].error or 'internal error'}",
                           type_="server_error")
    if any(o[-1].finish_reason == "abort" for o in outs):   # only a shutdown aborts a request whose client is there
        return JSONResponse({"error": SHUTDOWN_ERROR}, status_code=503)
    body = await state.offload(_response_body, state, prep, outs, rid, created)
    return Response(body, media_type="application/json")


def _choice(state: ServerState, prep: Prepared, i: int, outs: list[RequestOutput], first: bool) -> dict[str, Any]:
    """Choice ``i`` of a response (all of its outputs) or of a stream chunk (the outputs since the last chunk;
    ``first``: the prompt's first chunk, which carries the echo)."""
    req, chat = prep.req, prep.chat
    last = outs[-1]
    text = "".join(o.text for o in outs)
    echo = req.echo and first
    prompt_lps = next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None) if echo else None
    choice: dict[str, Any] = {"index": i, "finish_reason": last.finish_reason,
                              "logprobs": _logprobs(state, outs, chat, prompt_lps, prep.prompts[i])
                              if req.params.logprobs is not None else None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = (_echo_text(state, prep, i) if echo else "") + text
    if req.return_token_ids:
        choice["token_ids"] = [t for o in outs for t in o.token_ids]
        if first and not req.stream:
            choice["prompt_token_ids"] = prep.prompts[i]
    return choice


def _response_body(state: ServerState, prep: Prepared, outs: list[list[RequestOutput]], rid: str,
                   created: int) -> bytes:
    """A non-streaming response (in a worker thread: log-probs decode every token)."""
    choices = [_choice(state, prep, i, o, first=True) for i, o in enumerate(outs)]
    return json.dumps({"id": rid, "object": "chat.completion" if prep.chat else "text_completion",
                       "created": created, "model": state.model_name, "choices": choices,
                       "usage": _usage([o[-1] for o in outs])}).encode()


async def _collect(gen: AsyncIterator[tuple[int, RequestOutput]], request: Request
                   ) -> list[tuple[int, RequestOutput]] | None:
    """All (prompt index, output) of a non-streaming request, or None if the client disconnected first (then the
    engine requests are aborted, freeing their slots and blocks, instead of running to max_tokens for nobody)."""

    async def run() -> list[tuple[int, RequestOutput]]:
        return [o async for o in gen]

    task = asyncio.ensure_future(run())
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            await gen.aclose()            # runs its `finally`: abort in the engine
            return None


async def _sse(state: ServerState, prep: Prepared, gen: AsyncIterator[tuple[int, RequestOutput]], rid: str,
               rids: list[str], created: int, release: Callable[[], None]) -> AsyncIterator[bytes]:
    req, chat = prep.req, prep.chat
    obj = "chat.completion.chunk" if chat else "text_completion"
    base = {"id": rid, "object": obj, "created": created, "model": state.model_name}

    def event(payload: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(payload).encode() + b"\n\n"

    if chat:
        yield event({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]})
    lasts: dict[int, RequestOutput] = {}
    state.active.update(rids)
    try:
        async for i, out in gen:  # closing this generator (client gone) aborts the requests in the engine
            first = i not in lasts
            lasts[i] = out
            if out.finish_reason == "abort":      # the server is shutting down (a gone client reads nothing)
                yield event({"error": SHUTDOWN_ERROR})
                yield b"data: [DONE]\n\n"
                return
            if not out.text and not out.token_ids and not out.finished and not (first and req.echo):
                continue
            choice = _choice(state, prep, i, [out], first)
            if chat:
                del choice["message"]
                choice["delta"] = {"content": out.text} if out.text or not out.finished else {}
            yield event({**base, "choices": [choice]})
    finally:
        state.active.difference_update(rids)
        await gen.aclose()        # runs its `finally`: requests not finished (client gone) are aborted
        release()
    if req.include_usage and lasts:
        yield event({**base, "choices": [], "usage": _usage(list(lasts.values()))})
    yield b"data: [DONE]\n\n"
