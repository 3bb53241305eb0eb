"""The OpenAI-compatible HTTP API (FastAPI): models, completions, chat completions, SSE streaming, health,
Prometheus metrics, optional API key."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kimi_linear.engine.background import EngineLoop
from kimi_linear.engine.sequence import RequestOutput

from .metrics import render_metrics
from .protocol import APIError, ParsedRequest, fallback_chat_prompt, parse_common, parse_messages, parse_prompt


class ServerState:
    """What the routes share: the engine loop, the tokenizer, the served model names."""

    def __init__(self, loop: EngineLoop, tokenizer: Any, model_name: str, aliases: tuple[str, ...] = ()) -> None:
        self.loop, self.tokenizer, self.model_name = loop, tokenizer, model_name
        self.names = {model_name, *aliases}
        self.created = int(time.time())
        self.started = time.monotonic()

    def tok_str(self, t: int) -> str:
        return self.tokenizer.decode([t]) if self.tokenizer is not None else str(t)


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
    app = FastAPI(title="kimi-linear", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.kl = state

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        err = APIError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=e.status_code)

    if api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(render_metrics(state.loop.stats(), time.monotonic() - state.started),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "kimi-linear",
             "max_model_len": state.loop.engine.max_context}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _json(request)
        _check_model(state, body)
        req = parse_common(body, chat=False)
        text, ids = parse_prompt(body)
        if body.get("echo"):
            raise APIError(400, "`echo` is not supported", "echo")
        if ids is None:
            ids = state.tokenizer.encode(text, add_special_tokens=False)
        return await _serve(state, req, ids, chat=False, request=request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await _json(request)
        _check_model(state, body)
        req = parse_common(body, chat=True)
        msgs = parse_messages(body)
        tok = state.tokenizer
        if getattr(tok, "chat_template", None):
            prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        else:
            prompt = fallback_chat_prompt(msgs)
        ids = tok.encode(prompt, add_special_tokens=False)
        return await _serve(state, req, ids, chat=True, request=request)

    return app


async def _json(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from e
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    return body


def _check_model(state: ServerState, body: dict[str, Any]) -> None:
    m = body.get("model")
    if not isinstance(m, str):
        raise APIError(400, "`model` is required (a string; see /v1/models)", "model")
    if m not in state.names:
        raise APIError(404, f"The model `{m}` does not exist; this server serves `{state.model_name}`", "model",
                       code="model_not_found")


def _usage(out: RequestOutput) -> dict[str, Any]:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}


def _logprobs(state: ServerState, outs: list[RequestOutput], chat: bool) -> dict[str, Any] | None:
    items = [x for o in outs for x in o.logprobs]
    if chat:
        def entry(t: int, lp: float) -> dict[str, Any]:
            s = state.tok_str(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in alts]}
                            for t, lp, alts in items]}
    toks = [state.tok_str(t) for t, _, _ in items]
    offsets, pos = [], 0
    for s in toks:
        offsets.append(pos)
        pos += len(s)
    return {"tokens": toks, "token_logprobs": [lp for _, lp, _ in items],
            "top_logprobs": [{state.tok_str(a): b for a, b in alts} for _, _, alts in items], "text_offset": offsets}


async def _serve(state: ServerState, req: ParsedRequest, ids: list[int], chat: bool, request: Request) -> Response:
    params = req.params
    engine = state.loop.engine
    if params.max_tokens < 0:
        params.max_tokens = max(engine.max_context - len(ids), 0)
    try:
        engine.check_request(ids, params)
    except ValueError as e:
        code = "context_length_exceeded" if "context" in str(e) or "pool" in str(e) else None
        raise APIError(400, str(e), "messages" if chat else "prompt", code=code) from e
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    obj = "chat.completion" if chat else "text_completion"
    gen = state.loop.generate(rid, ids, params)
    if req.stream:
        return StreamingResponse(_sse(state, req, gen, rid, created, chat), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    outs = await _collect(gen, request)
    if outs is None:                      # the client went away: the request was aborted, nobody reads this
        return Response(status_code=499)
    last = outs[-1]
    if last.finish_reason == "error":
        raise APIError(500, f"the engine failed on this request: {last.error or 'internal error'}",
                       type_="server_error")
    text = "".join(o.text for o in outs)
    choice: dict[str, Any] = {"index": 0, "finish_reason": last.finish_reason,
                              "logprobs": _logprobs(state, outs, chat) if params.logprobs is not None else None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    if req.return_token_ids:
        choice["token_ids"] = [t for o in outs for t in o.token_ids]
        choice["prompt_token_ids"] = ids
    return JSONResponse({"id": rid, "object": obj, "created": created, "model": state.model_name,
                         "choices": [choice], "usage": _usage(last)})


async def _collect(gen: AsyncIterator[RequestOutput], request: Request) -> list[RequestOutput] | None:
    """All outputs of a non-streaming request, or None if the client disconnected first (then the engine
    request is aborted, freeing its slot and blocks, instead of running to max_tokens for nobody)."""

    async def run() -> list[RequestOutput]:
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


async def _sse(state: ServerState, req: ParsedRequest, gen: AsyncIterator[RequestOutput], rid: str, created: int,
               chat: bool) -> AsyncIterator[bytes]:
    obj = "chat.completion.chunk" if chat else "text_completion"
    base = {"id": rid, "object": obj, "created": created, "model": state.model_name}

    def event(payload: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(payload).encode() + b"\n\n"

    if chat:
        yield event({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]})
    last = None
    async for out in gen:     # closing this generator (client gone) aborts the request in the engine
        last = out
        if not out.text and not out.token_ids and not out.finished:
            continue
        choice: dict[str, Any] = {"index": 0, "finish_reason": out.finish_reason,
                                  "logprobs": _logprobs(state, [out], chat) if req.params.logprobs is not None
                                  else None}
        if chat:
            choice["delta"] = {"content": out.text} if out.text or not out.finished else {}
        else:
            choice["text"] = out.text
        if req.return_token_ids:
            choice["token_ids"] = out.token_ids
        yield event({**base, "choices": [choice]})
    if req.include_usage and last is not None:
        yield event({**base, "choices": [], "usage": _usage(last)})
    yield b"data: [DONE]\n\n"
