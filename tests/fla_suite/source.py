"""Where fla's KDA test file comes from, and the only change made to it: its imports.

fla-core 0.6.0's wheel and the ``flash-linear-attention==0.6.0`` sdist on the package index hold no tests, so the
file (``tests/ops/test_kda.py`` of flash-linear-attention at its 0.6.0 release) is read from a local copy, never
from this repository (it is fla's code, not ours). The first of these that exists is used:

1. the path in ``$KIMI_LINEAR_FLA_TEST_KDA``;
2. ``.fla/tests/ops/test_kda.py`` in the repository root (git-ignored; what ``bench/fla_tests.py --prepare`` fills,
   and what a GPU machine without network is given);
3. ``$XDG_CACHE_HOME/kimi-linear/fla-0.6.0/tests/ops/test_kda.py`` (``~/.cache`` by default).

The rewrite replaces whole import lines, one line for one line (tracebacks keep fla's line numbers), and fails
loudly when a line it expects is missing, so a different version of the file is noticed instead of half-run:

- the side under test (``chunk_kda``, ``fused_recurrent_kda``, ``fused_recurrent_kda_fwd``, ``fused_kda_gate``)
  comes from ``kimi_linear.ops``;
- fla's reference side stays fla's own (``naive_recurrent_kda``, ``naive_chunk_kda``, ``naive_kda_gate``,
  ``naive_kda_lowerbound_gate``), from the installed fla-core 0.6.0;
- fla's test helpers (``assert_close``, ``device``, platform flags, ``FLA_CACHE_MODE``) come from
  :mod:`tests.fla_suite.fla_utils`, written here with fla's meaning.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

FLA_VERSION = "0.6.0"
UPSTREAM_PATH = "tests/ops/test_kda.py"
# sha256 of the copy this suite was written against (58013 characters; 97 test cases).
VALIDATED_SHA256 = "90cef54e47f0b35a1674701e4c40c1b38bb2450325aed85079e1407567d47a07"
ENV_VAR = "KIMI_LINEAR_FLA_TEST_KDA"
REPO_ROOT = Path(__file__).resolve().parents[2]
REPO_COPY = REPO_ROOT / ".fla" / UPSTREAM_PATH

SHIM = "tests.fla_suite.fla_utils"
IMPORTS = {
    "from fla.ops.kda import chunk_kda, fused_recurrent_kda":
        "from kimi_linear.ops import chunk_kda, fused_recurrent_kda",
    "from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd":
        "from kimi_linear.ops.recurrent import fused_recurrent_kda_fwd",
    "from fla.ops.kda.gate import fused_kda_gate, naive_kda_gate, naive_kda_lowerbound_gate":
        "from kimi_linear.ops import fused_kda_gate; from fla.ops.kda.gate import naive_kda_gate, "
        "naive_kda_lowerbound_gate",
    "from fla.ops.utils.cache import FLA_CACHE_MODE":
        f"from {SHIM} import FLA_CACHE_MODE",
    "from fla.utils import IS_INTEL_ALCHEMIST, IS_NPU, IS_NVIDIA, assert_close, device":
        f"from {SHIM} import IS_INTEL_ALCHEMIST, IS_NPU, IS_NVIDIA, assert_close, device",
}
# fla imports that stay: the reference implementations, and fla's backend registry inside the Ascend-only test.
FLA_IMPORT = re.compile(r"^(from|import) fla[.\s]")
KEPT_FLA_IMPORTS = (
    "from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda",
    "from fla.ops.backends import BackendRegistry",
)


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/kimi-linear/fla-0.6.0`` (``~/.cache`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kimi-linear" / f"fla-{FLA_VERSION}"


def candidates() -> list[Path]:
    """Where the file is looked for, in order (module docstring)."""
    env = os.environ.get(ENV_VAR)
    return ([Path(env)] if env else []) + [REPO_COPY, cache_dir() / UPSTREAM_PATH]


def find_test_file() -> Path | None:
    """The first copy of fla's test_kda.py that exists, or None."""
    return next((p for p in candidates() if p.is_file()), None)


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def rewrite_imports(text: str) -> str:
    """fla's test file with its imports pointed at kimi_linear (module docstring); nothing else changes.

    Raises ValueError naming the line when an expected import is missing or an unexpected fla import remains.
    """
    lines = text.split("\n")
    for old, new in IMPORTS.items():
        hits = [i for i, line in enumerate(lines) if line == old]
        if len(hits) != 1:
            raise ValueError(f"fla's test file: expected the line {old!r} once, found it {len(hits)} times "
                             f"(not the fla {FLA_VERSION} version?)")
        lines[hits[0]] = new
    kept = set(KEPT_FLA_IMPORTS) | set(IMPORTS.values())
    for line in lines:
        s = line.strip()
        if FLA_IMPORT.match(s) and s not in kept:
            raise ValueError(f"fla's test file: unexpected fla import left after the rewrite: {s!r}")
    return "\n".join(lines)
