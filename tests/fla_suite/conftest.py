"""Which of fla's KDA test cases run (fla_kda.py), and a report of how close they came to fla's bars.

Deselected everywhere (:data:`DESELECTED`): tests that run no kimi_linear code, only fla's own internals.

Deselected on a machine without CUDA: the cases that are not CPU-capable. On CPU both sides are Python loops
over tokens (fla's ``naive_recurrent_kda`` reference, with autograd, and our recurrent path), so a case's time
grows with its token count: a case runs when its batch holds at most :data:`CPU_MAX_TOKENS` tokens (``B * T``, or
the packed length ``cu_seqlens[-1]``; cases without size parameters, which check arguments and shapes, always
run). 512 tokens keeps each case within seconds on two cores (the whole CPU selection, 38 cases: 6 s on an idle
machine, 30-60 s on a shared one); the next size up in fla's file is 1000-2048 tokens at head dims 100-128, 10-50 s
a case on a shared machine. ``KIMI_LINEAR_FLA_ALL=1``
runs every case on CPU anyway. With CUDA every case but :data:`DESELECTED` runs.
"""

from __future__ import annotations

import os

import pytest

from .fla_utils import RECORDS, Comparison, device

SUITE = "fla_kda.py"
CPU_MAX_TOKENS = 512
FLASH_KDA = ("fla's FlashKDA backend: asserts that fla dispatched the call to the flash_kda package's CUTLASS "
             "kernel (our chunk_kda is checked on the same inputs by test_chunk / test_chunk_varlen)")
DESELECTED = {
    "test_naive_chunk": "compares fla's naive_chunk_kda with fla's naive_recurrent_kda: both are fla's reference "
                        "code, nothing of kimi_linear runs",
    "test_flash_kda_chunk": FLASH_KDA,
    "test_flash_kda_chunk_varlen": FLASH_KDA,
    "test_triton_ascend_backend_routing": "fla's Triton-Ascend (NPU) backend registry: spies on fla's dispatch "
                                          "to its Ascend kernels",
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "smoke: fla's own marker for its quick cases (fla's test_kda.py)")


def tokens(item: pytest.Item) -> int | None:
    """Tokens in one case's batch (module docstring), or None for a case without size parameters."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "cu_seqlens" in params:
        return int(params["cu_seqlens"][-1])
    if "B" in params and "T" in params:
        return int(params["B"]) * int(params["T"])
    if "B" in params:                                  # one token per sequence (vLLM-style decode)
        return int(params["B"])
    return None


def deselect_reason(item: pytest.Item) -> str | None:
    name = item.originalname if isinstance(item, pytest.Function) else item.name
    if name in DESELECTED:
        return DESELECTED[name]
    n = tokens(item)
    if device == "cpu" and n is not None and n > CPU_MAX_TOKENS and os.environ.get("KIMI_LINEAR_FLA_ALL") != "1":
        return f"not CPU-capable: {n} tokens > {CPU_MAX_TOKENS} (runs on the GPU)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep, drop = [], []
    for item in items:
        reason = deselect_reason(item) if item.path.name == SUITE and item.path.parent.name == "fla_suite" else None
        (drop if reason else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


COMPARISONS: dict[str, list[Comparison]] = {}


@pytest.fixture(autouse=True)
def _record_comparisons(request: pytest.FixtureRequest):
    """Keep each test's assert_close comparisons by test id (the summary below reads them)."""
    start = len(RECORDS)
    yield
    COMPARISONS[request.node.nodeid] = RECORDS[start:]


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """The comparisons that came closest to fla's bar (error ratio / bar), when fla's tests ran."""
    rows = [(c.ratio / c.bar if c.bar > 0 else float("inf"), nodeid, c)
            for nodeid, cs in COMPARISONS.items() for c in cs if c.abs_err > 1e-6]
    if not rows:
        return
    rows.sort(key=lambda r: r[0], reverse=True)
    terminalreporter.section("fla's KDA tests: closest to fla's bars")
    for frac, nodeid, c in rows[:8]:
        flag = " (fla only warns)" if c.warning else ""
        terminalreporter.write_line(f"{frac:6.2f} of bar  {c.prefix:>8} ratio {c.ratio:.3g} < {c.bar:g}{flag} "
                                    f"(in float64 {c.ratio64:.3g})  {nodeid.split('::')[-1]}")
