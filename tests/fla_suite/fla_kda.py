"""fla-core 0.6's own KDA tests (``tests/ops/test_kda.py`` of flash-linear-attention 0.6.0) run against
``kimi_linear.ops``: the file is read from a local copy, its imports are rewritten (source.py says how and why)
and its test functions are defined in this module, so pytest collects them under their own names
(``tests/fla_suite/fla_kda.py::test_chunk[...]``). Which cases run, and why some do not: conftest.py.

Not named test_*.py on purpose: the suite needs fla-core, and with fla importable transformers' KimiLinear (the
reference of tests/model) switches to fla's kernels, so it runs in a process of its own, ``bench/fla_tests.py``
(``tests/ops/test_fla_suite.py`` starts it), which installs fla-core aside. Skipped as a whole when no copy of the
file is found (source.py lists where it is looked for) or fla-core 0.6.0, whose reference implementations the tests
compare against, does not import.
"""

import pytest

from .source import ENV_VAR, REPO_COPY, cache_dir, find_test_file, rewrite_imports

_path = find_test_file()
if _path is None:
    pytest.skip(f"fla's tests/ops/test_kda.py (0.6.0) not found: set ${ENV_VAR}, or put it at {REPO_COPY} or "
                f"{cache_dir()} (bench/fla_tests.py --prepare copies it there)", allow_module_level=True)
pytest.importorskip("fla.ops.kda.naive", reason="fla-core 0.6.0 (the reference side of fla's tests) is missing")

# Compiled under the copy's own path: with one line replaced by one line, tracebacks show fla's line numbers.
exec(compile(rewrite_imports(_path.read_text()), str(_path), "exec", dont_inherit=True), globals())
