"""One request's state inside the engine, what it emits per step, and incremental detokenization."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .sampling import SamplingParams, make_generator


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What a request gained in one engine step. ``text`` is the new text (stop strings cut off, incomplete UTF-8
    held back); ``finish_reason`` is set once: ``stop``, ``length``, ``abort`` or ``error``. ``logprobs``: per new
    token (token, log-prob, top alternatives). ``prompt_logprobs`` (in the first output of a request that asked for
    them, else None): per prompt token the same triple, None for the first token (nothing precedes it)."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[tuple[int, float, list[tuple[int, float]]] | None] | None = None


def merge(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one."""
    return RequestOutput(
        request_id=a.request_id, token_ids=a.token_ids + b.token_ids, text=a.text + b.text, finished=b.finished,
        finish_reason=b.finish_reason, logprobs=a.logprobs + b.logprobs, prompt_tokens=b.prompt_tokens,
        completion_tokens=b.completion_tokens, cached_tokens=b.cached_tokens, error=b.error,
        prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
    )


class Detokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes the whole output each time (cheap at these lengths, and exact for byte-level vocabularies whose
    tokens may split UTF-8 characters): a trailing U+FFFD is held back until the next token completes it, and the
    last ``max(len(stop)) - 1`` characters are held back so a stop string is never half-sent.
    """

    def __init__(self, decode: Callable[[list[int]], str] | None, stop: list[str]) -> None:
        self.decode, self.stop = decode, stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = 0          # characters already emitted
        self.text = ""

    def update(self, ids: list[int], final: bool) -> tuple[str, bool]:
        """Returns (new text, hit a stop string)."""
        if self.decode is None:
            return "", False
        text = self.decode(ids)
        for s in self.stop:
            i = text.find(s, max(0, self.sent - len(s)))
            if i >= 0:
                text = text[:i]
                final = True
                hit = True
                break
        else:
            hit = False
        end = len(text)
        if not final:
            if text.endswith("\ufffd"):
                end = len(text.rstrip("\ufffd"))
            end = max(self.sent, min(end, len(text) - self.hold))
        delta = text[self.sent : end]
        self.sent = max(self.sent, end)
        self.text = text[: self.sent]
        return delta, hit


class Sequence:
    """A request: prompt and generated tokens, its KDA slot, its MLA block table, its sampler."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 on_output: Callable[[RequestOutput], Any] | None, decode: Callable[[list[int]], str] | None,
                 eos_ids: list[int]) -> None:
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.on_output = on_output
        self.detok = Detokenizer(decode, params.stop)
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        self.generator: torch.Generator | None = make_generator(params)
        self.status = Status.WAITING
        self.slot: int | None = None
        self.block_table: list[int] = []
        self.num_computed = 0          # tokens whose KDA state / MLA latents are in the cache
        self.num_hashed = 0            # full blocks already registered for prefix sharing
        self.table_synced = 0          # block-table entries already on the device (fixed-shape decode step)
        self.prefill_target = 0        # tokens to (re)compute after admission before sampling
        self.cached_tokens = 0         # prompt tokens served from the prefix cache (first admission)
        self.admitted_once = False
        self.arrival = time.monotonic()
        self.pending: list[int] = []   # tokens sampled since the last emitted output
        self.pending_lp: list = []
        self.prompt_lp: list | None = None     # scored prompt (SamplingParams.prompt_logprobs), until emitted
        self.finish_reason: str | None = None
        self.error: str | None = None  # why it ended with finish_reason "error"

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """tokens[start:end] without building the whole list (prompts can be a million tokens long)."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[max(start - n, 0) : end - n]

    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)
