"""Timing an engine's decode steps (the GPU benchmarks' shared loop).

With the engine's pipelined decode a step returns once the step before it is read back, while its own still runs,
so one call's time is not its step's; the wall time of many calls is. The host's own time a step is that wall less
the read-backs' waits for the device: near the wall when the host is the bound, near 0 when the device is.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

from floors import sync
from kimi_linear.engine.pipeline import InFlight


@contextlib.contextmanager
def readback_waits() -> Iterator[list[float]]:
    """Seconds each pipelined step's token read-back waits for the device, collected while the block runs."""
    waits: list[float] = []
    tokens = InFlight.tokens

    def timed(step: InFlight) -> list[int]:
        t = time.perf_counter()
        out = tokens(step)
        waits.append(time.perf_counter() - t)
        return out

    InFlight.tokens = timed  # type: ignore[method-assign]
    try:
        yield waits
    finally:
        InFlight.tokens = tokens  # type: ignore[method-assign]


def timed_steps(engine: Any, steps: int) -> dict[str, float]:
    """``steps`` engine steps, timed: ms a step over their wall time (``step_ms``), per call (median, min), and
    the host's own ms a step and the read-backs' wait (module docstring)."""
    lat = []
    with readback_waits() as waits:
        t0 = time.perf_counter()
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            lat.append(time.perf_counter() - t)
        sync()
        wall = time.perf_counter() - t0
    return dict(step_ms=1e3 * wall / steps, step_ms_median=1e3 * statistics.median(lat),
                step_ms_min=1e3 * min(lat), host_ms=1e3 * (wall - sum(waits)) / steps,
                wait_ms=1e3 * sum(waits) / steps)
