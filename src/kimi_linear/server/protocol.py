"""OpenAI request parsing (with errors that name the field) and the OpenAI error body."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kimi_linear.engine import SamplingParams


class APIError(Exception):
    """An error the client caused (or an auth failure): rendered as OpenAI's error JSON with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _num(body: dict, name: str, default: Any, kind: type | tuple = (int, float)) -> Any:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, kind):
        raise APIError(400, f"`{name}` must be {'an integer' if kind is int else 'a number'}, got {v!r}", name)
    return v


@dataclass
class ParsedRequest:
    prompt_text: str | None
    prompt_ids: list[int] | None
    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool


def parse_common(body: dict, chat: bool) -> ParsedRequest:
    """Sampling fields shared by completions and chat completions."""
    if chat:
        mt = body.get("max_completion_tokens", body.get("max_tokens"))
        mt_name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    else:
        mt, mt_name = body.get("max_tokens"), "max_tokens"
    if mt is None:
        mt = 16 if not chat else None
    if mt is not None and (isinstance(mt, bool) or not isinstance(mt, int) or mt < 0):
        raise APIError(400, f"`{mt_name}` must be a non-negative integer, got {mt!r}", mt_name)
    n = _num(body, "n", 1, int)
    if n != 1:
        raise APIError(400, f"`n` must be 1 (this server returns one choice per request), got {n}", "n")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise APIError(400, "`stop` must be a non-empty string or a list of up to 4 non-empty strings", "stop")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) for t in stop_ids):
        raise APIError(400, "`stop_token_ids` must be a list of integers", "stop_token_ids")
    if chat:
        lp = body.get("logprobs")
        if lp is not None and not isinstance(lp, bool):
            raise APIError(400, f"`logprobs` must be a boolean for chat completions, got {lp!r}", "logprobs")
        top = _num(body, "top_logprobs", 0, int)
        logprobs = top if lp else None
        if top and not lp:
            raise APIError(400, "`top_logprobs` needs `logprobs: true`", "top_logprobs")
    else:
        logprobs = _num(body, "logprobs", None, int)
    seed = _num(body, "seed", None, int)
    params = SamplingParams(
        max_tokens=mt if mt is not None else -1,
        temperature=float(_num(body, "temperature", 1.0)),
        top_p=float(_num(body, "top_p", 1.0)),
        top_k=_num(body, "top_k", 0, int),
        seed=seed, stop=stop, stop_token_ids=stop_ids,
        ignore_eos=bool(body.get("ignore_eos", False)),
        logprobs=logprobs,
    )
    try:
        if params.max_tokens >= 0:
            params.validate()
        else:
            params.max_tokens = 0
            params.validate()
            params.max_tokens = -1
    except ValueError as e:
        field = str(e).split("`")[1] if "`" in str(e) else None
        raise APIError(400, str(e), field) from e
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, f"`stream` must be a boolean, got {stream!r}", "stream")
    so = body.get("stream_options") or {}
    if not isinstance(so, dict):
        raise APIError(400, "`stream_options` must be an object", "stream_options")
    return ParsedRequest(None, None, params, stream, bool(so.get("include_usage", False)),
                         bool(body.get("return_token_ids", False)))


def parse_prompt(body: dict) -> tuple[str | None, list[int] | None]:
    """``prompt``: a string, a list of token ids, or a one-element list of either."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise APIError(400, "`prompt` is empty", "prompt")
        return p, None
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return None, p
    raise APIError(400, "`prompt` must be a non-empty string or list of token ids (one prompt per request)",
                   "prompt")


def parse_messages(body: dict) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, "`messages` must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"`messages[{i}]` must be an object with a string `role`", f"messages[{i}]")
        c = m.get("content")
        if isinstance(c, list):   # [{type: text, text: ...}, ...]
            if not all(isinstance(x, dict) and x.get("type") == "text" and isinstance(x.get("text"), str) for x in c):
                raise APIError(400, f"`messages[{i}].content` parts must be text parts", f"messages[{i}].content")
            c = "".join(x["text"] for x in c)
        if c is None:
            c = ""
        if not isinstance(c, str):
            raise APIError(400, f"`messages[{i}].content` must be a string or a list of text parts",
                           f"messages[{i}].content")
        out.append({"role": m["role"], "content": c})
    return out


def fallback_chat_prompt(messages: list[dict[str, str]]) -> str:
    """Used when the tokenizer has no chat template: one ``role: content`` line per message, then
    ``assistant:`` to cue the reply."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
