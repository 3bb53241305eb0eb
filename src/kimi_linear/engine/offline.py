"""Driving an :class:`~.engine.LLMEngine` in the caller's thread: a batch of requests in, one merged output per
request out (what evaluation and scripts use; the server drives the engine from its own thread instead)."""

from __future__ import annotations

from .engine import LLMEngine
from .sampling import SamplingParams
from .sequence import RequestOutput, merge


class RequestFailed(RuntimeError):
    """A request of the batch ended with ``finish_reason="error"``."""


def run_batch(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]],
              id_prefix: str = "offline") -> list[RequestOutput]:
    """Add every request at once (so prompts to score share forwards and decodes share batches), step the engine
    until all have finished, and return each request's outputs merged into one, in the given order: token ids,
    text, log-probs, prompt log-probs, finish reason. The engine must have no other work.

    Raises ValueError for a request the engine refuses (before any runs), :class:`RequestFailed` when one fails.
    """
    if engine.has_work():
        raise RuntimeError("run_batch needs an idle engine (it steps until every request has finished)")
    for i, (ids, params) in enumerate(requests):
        try:
            engine.check_request(ids, params)
        except ValueError as e:
            raise ValueError(f"request {i}: {e}") from None
    got: list[RequestOutput | None] = [None] * len(requests)

    def sink(i: int):
        def on_output(o: RequestOutput) -> None:
            prev = got[i]
            got[i] = o if prev is None else merge(prev, o)
        return on_output

    for i, (ids, params) in enumerate(requests):
        engine.add_request(f"{id_prefix}-{i}", ids, params, sink(i))
    while engine.has_work():
        engine.step()
    for i, o in enumerate(got):
        if o is None or not o.finished:
            raise RequestFailed(f"request {i} did not finish")
        if o.finish_reason == "error":
            raise RequestFailed(f"request {i} failed: {o.error}")
    return got  # type: ignore[return-value]
