"""The OpenAI request schema at the HTTP boundary, and the OpenAI error body.

Requests are pydantic v2 models with strict types and bounds (``"ignore_eos": "false"`` is a 400, not ``True``):
integers are integers, booleans booleans, strings valid Unicode (no lone surrogates, which JSON's ``\\ud800`` escapes
can produce and which cannot be encoded back), chat roles one of ``system``, ``user``, ``assistant``, ``tool``.
Unknown fields are ignored. Every refusal is an :class:`APIError` whose ``param`` names the field
(``messages[2].role``, ``stream_options.include_usage``).

Bodies are parsed by :func:`parse_json`, which refuses ``NaN`` / ``Infinity`` literals and nesting deeper than a
limit (naming the top-level field where it happens) before anything walks the parsed object.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainValidator, ValidationError

from kimi_linear.engine import SamplingParams
from kimi_linear.engine.sampling import MAX_LOGPROBS, MIN_TEMPERATURE, SEED_MAX, SEED_MIN

INT64_MAX = 2**63 - 1
ROLES = ("system", "user", "assistant", "tool")
MAX_STOP = 16           # OpenAI allows 4; evaluation tasks send more (lm-evaluation-harness: `until` + EOS)


class APIError(Exception):
    """An error the client caused (or an auth failure): rendered as OpenAI's error JSON with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def short(v: Any, n: int = 60) -> str:
    """A client's value for an error message: ASCII-only repr (lone surrogates escaped), cut to ``n`` characters."""
    r = ascii(v)
    return r if len(r) <= n else r[: n - 3] + "..."


# ------------------------------------------------------------------------------------------------ JSON parsing
def _no_constant(name: str) -> Any:
    raise ValueError(f"`{name}` is not valid JSON (non-finite numbers are not allowed)")


# A string token as an unrolled loop (runs of plain characters matched in one go: fast on a megabyte prompt), or
# one structural character.
_JSON_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}:]', re.S)
_SURROGATE = re.compile("[\ud800-\udfff]")


def _too_deep_at(text: str, limit: int) -> str | None:
    """The top-level key under which ``text`` (valid JSON up to its deepest point) nests deeper than ``limit``
    levels, "" when not under a key, None when it does not. Linear: strings are skipped by one regex match each,
    and the scan stops at the first level past the limit."""
    depth, key, last = 0, "", None
    for m in _JSON_TOKENS.finditer(text):
        t = m.group()
        if t in ("[", "{"):
            depth += 1
            if depth > limit:
                return key
        elif t in ("]", "}"):
            depth -= 1
        elif t == ":":
            if depth == 1 and last is not None:
                try:
                    key = str(json.loads(last))
                except ValueError:
                    key = ""
        else:
            last = t
    return None


def parse_json(raw: bytes, max_depth: int) -> dict[str, Any]:
    """A request body -> a dict, or APIError 400 (malformed JSON, not an object, nested deeper than ``max_depth``)."""
    try:
        text = raw.decode("utf-8")
        body = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        body = None                 # nested far past any sane limit: _too_deep_at names the field below
    except ValueError as e:         # JSONDecodeError, UnicodeDecodeError, a number with too many digits
        raise APIError(400, f"request body is not valid JSON: {short(str(e), 200)}", code="invalid_json") from None
    if body is None or text.count("[") + text.count("{") > max_depth:
        where = _too_deep_at(text, max_depth)
        if where is not None or body is None:
            field = where or None
            raise APIError(400, f"request body nests JSON deeper than {max_depth} levels"
                           + (f" in `{field}`" if field else "") + " (the server's --max-json-depth)", field,
                           code="json_too_deep")
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    return body


# ----------------------------------------------------------------------------------------------------- schema
def valid_unicode(s: str) -> str:
    """JSON's escapes can spell lone surrogates (``"\\ud800"``), which are no Unicode text: nothing can encode them
    (a tokenizer, a log line, the JSON response), so they are refused here. Pairs were joined by the parser."""
    m = _SURROGATE.search(s)
    if m is not None:
        raise ValueError(f"is not valid Unicode (a lone surrogate U+{ord(m.group()):04X} at index {m.start()})")
    return s


Text = Annotated[str, AfterValidator(valid_unicode)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(valid_unicode)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


class PartError(ValueError):
    """A bad part of a field: ``where`` is appended to the field's name in the error's ``param`` (``prompt[3]``)."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(message)
        self.where = where


def _one_prompt(v: Any, where: str) -> str | list[int]:
    if isinstance(v, str):
        if not v:
            raise PartError(where, "is empty")
        try:
            return valid_unicode(v)
        except ValueError as e:
            raise PartError(where, str(e)) from None
    if isinstance(v, list) and v:
        for i, t in enumerate(v):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= INT64_MAX:
                raise PartError(where, f"holds {short(t)} at index {i}, not a token id (a non-negative integer)")
        return v
    raise PartError(where, "must be a non-empty string or a non-empty list of token ids")


def is_prompt_list(v: Any) -> bool:
    """``prompt`` holds several prompts (strings or lists of token ids), not the token ids of one."""
    return isinstance(v, list) and bool(v) and isinstance(v[0], (str, list))


def _prompts(v: Any) -> list[str | list[int]]:
    """``prompt``: one prompt (a non-empty string or list of token ids) or a non-empty list of prompts, all strings
    or all token-id lists. Returns the list of prompts."""
    if not is_prompt_list(v):
        if isinstance(v, list) and not v:
            raise ValueError("is empty (send a string, a list of token ids, or a list of prompts)")
        return [_one_prompt(v, "")]
    kind = type(v[0])
    for i, p in enumerate(v):
        if type(p) is not kind:
            raise PartError(f"[{i}]", "is not of the first prompt's kind: a list of prompts holds strings only or "
                            "lists of token ids only")
    return [_one_prompt(p, f"[{i}]" if len(v) > 1 else "") for i, p in enumerate(v)]


def _stop(v: Any) -> list[str] | None:
    if v is None:
        return None
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not 1 <= len(v) <= MAX_STOP or not all(isinstance(s, str) and s for s in v):
        raise ValueError(f"must be a non-empty string or a list of 1 to {MAX_STOP} non-empty strings")
    return [valid_unicode(s) for s in v]


def _content(v: Any) -> str:
    """A message's ``content``: a string, a list of text parts, or null (= "")."""
    if v is None:
        return ""
    if isinstance(v, str):
        return valid_unicode(v)
    if isinstance(v, list):
        parts = []
        for i, x in enumerate(v):
            if not isinstance(x, dict) or x.get("type") != "text" or not isinstance(x.get("text"), str):
                raise ValueError(f"part {i} is not a text part ({{\"type\": \"text\", \"text\": \"...\"}}); only "
                                 "text is supported")
            parts.append(valid_unicode(x["text"]))
        return "".join(parts)
    raise ValueError("must be a string, a list of text parts or null")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = None


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: Annotated[str, PlainValidator(_content)] = ""
    name: Text | None = None


class _Sampling(_Strict):
    """Fields shared by completions and chat completions."""

    model: Annotated[str, Field(min_length=1, max_length=4096), AfterValidator(valid_unicode)]
    max_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=2**31 - 1)] | None = None
    n: Annotated[int, Field(ge=1, le=1)] | None = None
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stop: Annotated[list[str] | None, PlainValidator(_stop)] = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=256)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None      # only 0 is served
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None     # only 0 is served
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: Text | None = None
    # Extensions (the openai client's extra_body).
    ignore_eos: bool | None = None
    return_token_ids: bool | None = None


class CompletionRequest(_Sampling):
    prompt: Annotated[list[str | list[int]], PlainValidator(_prompts)]
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool | None = None


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=100_000)]
    max_completion_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None


_HINTS = {
    "n": " (this server returns one choice per prompt)",
    "temperature": f" (0 is greedy; values below {MIN_TEMPERATURE:g} sample greedily too)",
    "seed": " (a 64-bit integer)",
}


def _param(loc: tuple) -> str:
    out = ""
    for x in loc:
        out += f"[{x}]" if isinstance(x, int) else (f".{x}" if out else str(x))
    return out


def validate(model: type[_Strict], body: dict[str, Any]) -> Any:
    """``body`` -> ``model``, or APIError 400 naming the first bad field."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = _param(err["loc"]) or None
        if err["type"] == "value_error":
            cause = err["ctx"]["error"]
            msg = str(cause)
            if isinstance(cause, PartError) and param:
                param += cause.where
        else:
            msg = err["msg"][:1].lower() + err["msg"][1:]
            if err["type"] != "missing":
                msg += f", got {short(err['input'])}"
        top = str(err["loc"][0]) if err["loc"] else ""
        sep = " " if err["type"] == "value_error" else ": "
        raise APIError(400, f"`{param}`{sep}{msg}{_HINTS.get(top, '')}" if param else msg, param) from None


# ---------------------------------------------------------------------------------------- to engine parameters
@dataclass
class ParsedRequest:
    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool
    echo: bool = False          # completions: the prompt comes back before the completion (with its log-probs)


def sampling_params(r: CompletionRequest | ChatCompletionRequest, chat: bool) -> ParsedRequest:
    """Validated request -> engine parameters. ``max_tokens`` -1: as many as the context leaves (chat default)."""
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(r, name):
            raise APIError(400, f"`{name}` is not supported (only 0)", name)
    if chat:
        assert isinstance(r, ChatCompletionRequest)
        mt = r.max_completion_tokens if r.max_completion_tokens is not None else r.max_tokens
        if r.top_logprobs and not r.logprobs:
            raise APIError(400, "`top_logprobs` needs `logprobs: true`", "top_logprobs")
        logprobs = (r.top_logprobs or 0) if r.logprobs else None
    else:
        mt = r.max_tokens if r.max_tokens is not None else 16
        logprobs = r.logprobs
    echo = bool(getattr(r, "echo", False))
    params = SamplingParams(
        max_tokens=mt if mt is not None else -1,
        temperature=r.temperature if r.temperature is not None else 1.0,
        top_p=r.top_p if r.top_p is not None else 1.0,
        top_k=r.top_k if r.top_k is not None else 0,
        seed=r.seed, stop=r.stop or [], stop_token_ids=list(r.stop_token_ids or []),
        ignore_eos=bool(r.ignore_eos), logprobs=logprobs,
        # vLLM's echo: with `logprobs`, every prompt token's log-prob (and top alternatives) comes back too.
        prompt_logprobs=logprobs if echo else None,
    )
    so = r.stream_options
    return ParsedRequest(params, bool(r.stream), bool(so is not None and so.include_usage), bool(r.return_token_ids),
                         echo)


def fallback_chat_prompt(messages: list[dict[str, str]]) -> str:
    """Used when the tokenizer has no chat template: one ``role: content`` line per message, then
    ``assistant:`` to cue the reply."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
