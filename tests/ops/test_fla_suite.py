"""fla-core 0.6's own KDA test file (tests/ops/test_kda.py of flash-linear-attention 0.6.0) against
kimi_linear.ops, its CPU-capable cases (issue 20; which ones: tests/fla_suite/conftest.py).

It runs as ``bench/fla_tests.py`` in a process of its own: that script installs fla-core (the reference side of
fla's tests) aside and puts it on its own path, and fla must stay out of this process, where transformers'
KimiLinear, the reference model of tests/model, would switch to fla's kernels once ``fla`` imports.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from ..fla_suite import fla_utils
from ..fla_suite.source import ENV_VAR, IMPORTS, REPO_COPY, cache_dir, find_test_file, rewrite_imports

REPO = Path(__file__).resolve().parents[2]
NO_FLA = 3                                   # bench/fla_tests.py's exit status when fla-core cannot be had
# The CPU selection holds 32 passing cases; fewer would mean cases silently dropped out of it.
MIN_PASSED = 30


@pytest.mark.slow
def test_fla_kda_tests_cpu_cases():
    if find_test_file() is None:
        pytest.skip(f"fla's tests/ops/test_kda.py (0.6.0) not found: set ${ENV_VAR}, or put it at {REPO_COPY} or "
                    f"{cache_dir()}")
    r = subprocess.run([sys.executable, str(REPO / "bench" / "fla_tests.py")], cwd=REPO, capture_output=True,
                       text=True, timeout=1500)
    if r.returncode == NO_FLA:
        pytest.skip("fla-core 0.6.0 not available (no wheel carried, none downloadable): " + r.stdout[-300:])
    out = r.stdout[-6000:] + r.stderr[-2000:]
    assert r.returncode == 0, out
    summary = r.stdout.strip().splitlines()[-1]                # "N passed, 0 failed, K skipped, D deselected"
    assert int(summary.split()[0]) >= MIN_PASSED and " 0 failed" in summary, out


def test_rewrite_changes_the_import_lines_only():
    body = ["import torch", "", "def test_x():", "    assert chunk_kda",
            "    from fla.ops.backends import BackendRegistry"]
    text = "\n".join(list(IMPORTS) + ["from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda"] + body)
    out = rewrite_imports(text).split("\n")
    assert out[:len(IMPORTS)] == list(IMPORTS.values()) and out[len(IMPORTS):] == text.split("\n")[len(IMPORTS):]
    assert all("kimi_linear.ops" in line or "tests.fla_suite.fla_utils" in line for line in out[:len(IMPORTS)])
    with pytest.raises(ValueError, match="expected the line"):               # another version of the file
        rewrite_imports(text.replace("from fla.ops.kda import chunk_kda, fused_recurrent_kda", ""))
    with pytest.raises(ValueError, match="unexpected fla import"):           # an fla import nobody looked at
        rewrite_imports(text + "\nfrom fla.ops.kda.chunk import chunk_kda_fwd")


def test_assert_close_has_flas_meaning_without_its_ci_leniency(monkeypatch):
    monkeypatch.setenv("FLA_CI_ENV", "1")                  # fla would only warn below 1e-2 here; the shim asserts
    ref = torch.linspace(1, 2, 100)
    fla_utils.assert_close("x", ref, ref * (1 + 1e-3), 2e-3)                 # ratio ~1e-3 < 2e-3
    with pytest.raises(AssertionError, match="ratio"):
        fla_utils.assert_close("x", ref, ref * (1 + 1e-3), 5e-4)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fla_utils.assert_close("dA", ref, ref * (1 + 1e-3), 5e-4, warning=True)   # fla's warning-only checks
    assert len(w) == 1
    fla_utils.assert_close("x", ref, ref + 5e-7, 0.0)                         # within err_atol: passes
    with pytest.raises(AssertionError, match="NaN"):
        fla_utils.assert_close("x", ref, torch.full_like(ref, float("nan")), 1.0)
    c = fla_utils.RECORDS[-1]
    assert c.prefix == "x" and c.bar == 1.0
