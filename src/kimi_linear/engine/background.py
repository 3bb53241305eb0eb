"""Runs an :class:`LLMEngine` in its own thread and hands outputs to asyncio consumers.

The model call blocks for milliseconds to seconds, so it must not run on the event loop. Requests and aborts
cross into the engine thread through a queue (the engine itself is single-threaded); outputs come back through
``loop.call_soon_threadsafe`` into a per-request ``asyncio.Queue``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator
from typing import Any

from .engine import LLMEngine
from .sampling import SamplingParams
from .sequence import RequestOutput, merge

log = logging.getLogger("kimi_linear.engine")


class EngineLoop:
    """Background thread that steps the engine whenever it has work."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._cmds: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        self.lock = threading.Lock()       # held during a step; readers of engine state (metrics) take it too
        self._stats = engine.stats()
        self._outbox: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue, Any]] = []
        self._thread = threading.Thread(target=self._run, name="kimi-linear-engine", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, on_output: Any) -> None:
        """Validate now (raises ValueError for the HTTP layer), enqueue for the engine thread."""
        self.submit_many([(request_id, prompt_ids, params, on_output)])

    def submit_many(self, requests: list[tuple[str, list[int], SamplingParams, Any]]) -> None:
        """Validate every request (ValueError before any is enqueued), then enqueue them as one command: the engine
        adds them in the same step, so prompts to score share one forward."""
        for _, prompt_ids, params, _ in requests:
            self.engine.check_request(prompt_ids, params)
        self._cmds.put(("add", requests))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))
        self._wake.set()

    def stats(self) -> dict[str, float]:
        """The snapshot published after the latest step: never waits for a running step (the event loop calls
        this, and blocking it would stall every connection)."""
        return self._stats

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams
                       ) -> AsyncIterator[RequestOutput]:
        """Yield outputs until the request finishes; aborts it if the consumer stops early (client gone)."""
        async with contextlib.aclosing(self.generate_many([(request_id, prompt_ids, params)])) as outs:
            async for _, out in outs:
                yield out

    async def generate_many(self, requests: list[tuple[str, list[int], SamplingParams]]
                            ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Submit ``requests`` together (at the first iteration) and yield (index, output) as they come, until
        every one has finished; aborts those still running if the consumer stops early (client gone)."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()

        def sink(i: int) -> Any:
            # Called in the engine thread: collected, then handed to the event loop once per step (see _flush).
            return lambda o: self._outbox.append((loop, q, (i, o)))

        self.submit_many([(rid, ids, p, sink(i)) for i, (rid, ids, p) in enumerate(requests)])
        running = set(range(len(requests)))
        try:
            while running:
                items = [await q.get()]
                while not q.empty():              # the consumer fell behind: one merged update per request
                    items.append(q.get_nowait())
                merged: dict[int, RequestOutput] = {}
                for i, o in items:
                    merged[i] = merge(merged[i], o) if i in merged else o
                for i, o in merged.items():
                    if o.finished:
                        running.discard(i)
                    yield i, o
        finally:
            for i in running:
                self.abort(requests[i][0])

    def _drain(self) -> None:
        while True:
            try:
                kind, arg = self._cmds.get_nowait()
            except queue.Empty:
                return
            try:
                if kind == "add":
                    for req in arg:
                        self._add(req)
                else:
                    self.engine.abort(arg)
            except Exception:  # a bad request must not take the engine down
                log.exception("engine: %s failed", kind)

    def _add(self, req: tuple[str, list[int], SamplingParams, Any]) -> None:
        try:
            self.engine.add_request(*req)
        except Exception as e:  # this request fails alone; the others of its command are still added
            log.exception("engine: adding request %s failed", req[0])
            if req[3] is not None:
                req[3](RequestOutput(req[0], [], "", finished=True, finish_reason="error", error=str(e)))

    def _flush(self) -> None:
        """One wake-up of the event loop per step for all outputs (not one per token per request)."""
        if not self._outbox:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for loop, q, o in self._outbox:
            by_loop.setdefault(loop, []).append((q, o))
        self._outbox = []
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:     # that loop is closed: its consumers are gone
                pass

    def _run(self) -> None:
        while not self._stop:
            self._wake.clear()         # before draining: a submit after this point wakes the next wait
            with self.lock:
                self._drain()
                busy = self.engine.has_work()
                if busy:
                    try:
                        self.engine.step()
                    except Exception as e:  # never leave clients hanging: fail what is running, keep serving
                        log.exception("engine step failed")
                        for seq in self.engine.unfinished():
                            self.engine.fail_request(seq, f"the engine step failed: {type(e).__name__}: {e}")
                        del e
                self._stats = self.engine.stats()
                self._flush()
            if not busy:
                self._wake.wait(timeout=0.5)


def _deliver(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, o in items:
        q.put_nowait(o)
