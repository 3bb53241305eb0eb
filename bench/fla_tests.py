"""fla-core 0.6's own KDA tests (``tests/ops/test_kda.py`` of flash-linear-attention 0.6.0) against
``kimi_linear.ops`` (issue 20), with pass / fail / skip / deselect counts per test function.

    python bench/fla_tests.py --prepare         # with network: fla's test file and the wheels into .fla/ (git-ignored)
    python bench/fla_tests.py                   # run them: every case but the deselected ones with CUDA, the
                                                # CPU-capable ones without (tests/fla_suite/conftest.py says which)
    python bench/fla_tests.py -k test_chunk_varlen      # a subset (pytest's -k)
    python bench/fla_tests.py --budget 420      # cases that would start after 420 s are skipped (and counted)
    python bench/fla_tests.py --jobs 8          # the cases spread over 8 processes (Triton compiles in parallel)

fla-core 0.6.0 (pure Python; it needs einops) is installed aside, never into the environment: with ``fla``
importable, transformers' KimiLinear (the reference model of tests/model) would switch to fla's kernels. Its wheels
come from ``.fla/wheels`` or ``.whl`` (a machine without network, such as the GPU machine, is given ``.fla``), else
from the package index into ``$XDG_CACHE_HOME/kimi-linear/fla-0.6.0/wheels``; they are installed into ``site`` next
to them. The tests live in ``tests/fla_suite`` (how fla's file is found and its imports rewritten:
``tests/fla_suite/source.py``); this script puts fla on the path, runs them with pytest in this process and prints
the counts. Exit status: 0 nothing failed, 1 failures, 2 fla's test file not found, 3 fla-core not available.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLA_DIR = REPO / ".fla"
WHEELS = FLA_DIR / "wheels"
PYTEST_WHEELS = FLA_DIR / "pytest-wheels"    # only for a machine without pytest
SITE = FLA_DIR / "site"
FLA_CORE_WHEEL = "fla_core-0.6.0-*.whl"
sys.path[:0] = [str(REPO), str(REPO / "src")]

from tests.fla_suite.source import (  # noqa: E402
    REPO_COPY,
    VALIDATED_SHA256,
    cache_dir,
    find_test_file,
    sha256,
)

SUITE = REPO / "tests" / "fla_suite" / "fla_kda.py"
NOT_FOUND, NO_FLA = 2, 3


def prepare() -> int:
    """Copy fla's test file into .fla/ and download the wheels fla-core 0.6.0 needs (needs the package index)."""
    src = find_test_file()
    if src is None:
        print(f"fla's tests/ops/test_kda.py (0.6.0) not found; put a copy at {REPO_COPY}", file=sys.stderr)
        return 1
    if src.resolve() != REPO_COPY.resolve():
        REPO_COPY.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, REPO_COPY)
    WHEELS.mkdir(parents=True, exist_ok=True)
    download(WHEELS)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--dest", str(PYTEST_WHEELS), "pytest"],
                   check=True)
    text = REPO_COPY.read_text()
    print(f"{REPO_COPY.relative_to(REPO)}: sha256 {sha256(text)} "
          f"({'the validated copy' if sha256(text) == VALIDATED_SHA256 else 'NOT the validated copy'})")
    for w in sorted(WHEELS.glob("*.whl")) + sorted(PYTEST_WHEELS.glob("*.whl")):
        print(f"{w.relative_to(REPO)}: {w.stat().st_size} bytes")
    print("carry: .fla")
    return 0


def download(dest: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--dest", str(dest),
                    "fla-core==0.6.0", "einops"], check=True)


def ensure_fla() -> str | None:
    """Put fla-core 0.6.0 on sys.path (module docstring); returns where it comes from, or None if unavailable."""
    try:
        import fla as found
        return str(Path(found.__file__).parent)
    except ImportError:
        pass
    if WHEELS.is_dir():
        wheels, site = sorted(WHEELS.glob("*.whl")), SITE
    else:
        cached = cache_dir() / "wheels"
        if not any(cached.glob(FLA_CORE_WHEEL)):
            try:
                download(cached)
            except (subprocess.CalledProcessError, OSError) as e:
                print(f"fla-core 0.6.0 could not be downloaded ({e})", file=sys.stderr)
        wheels, site = sorted(cached.glob("*.whl")), cache_dir() / "site"
    if not any(w.match(FLA_CORE_WHEEL) for w in wheels):     # one copy: pip refuses a requirement twice
        wheels += sorted((REPO / ".whl").glob(FLA_CORE_WHEEL))
        if not any(w.match(FLA_CORE_WHEEL) for w in wheels):
            return None
    if not (site / "fla").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                        str(site), *map(str, wheels)], check=True)
    sys.path.insert(0, str(site))
    import fla as found
    return str(Path(found.__file__).parent)


def ensure_pytest() -> None:
    """pytest from .fla/pytest-wheels when this machine has none."""
    try:
        import pytest  # noqa: F401
    except ImportError:
        site = SITE / "pytest"
        if not site.is_dir():
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                            str(site), *map(str, sorted(PYTEST_WHEELS.glob("*.whl")))], check=True)
        sys.path.insert(0, str(site))


class Counts:
    """pytest plugin: outcomes per test function, deselections, the first line of each failure, and the time
    budget (cases that would start after it are skipped)."""

    def __init__(self, budget: float | None = None) -> None:
        self.by_func: dict[str, Counter] = defaultdict(Counter)
        self.failures: list[str] = []
        self.budget, self.t0, self.over = budget, time.time(), 0

    def pytest_runtest_setup(self, item) -> None:
        if self.budget is not None and time.time() - self.t0 > self.budget:
            import pytest
            self.over += 1
            pytest.skip(f"over the --budget of {self.budget:.0f} s")

    @staticmethod
    def func(nodeid: str) -> str:
        return nodeid.split("::")[-1].split("[")[0]

    def pytest_deselected(self, items) -> None:
        for item in items:
            self.by_func[self.func(item.nodeid)]["deselected"] += 1

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" or (report.when == "setup" and not report.passed):
            outcome = "skipped" if report.skipped else ("passed" if report.passed else "failed")
            self.by_func[self.func(report.nodeid)][outcome] += 1
            if report.failed:
                lines = [ln for ln in str(report.longrepr).splitlines() if ln.startswith("E ")]
                self.failures.append(f"{report.nodeid.split('::')[-1]}: {lines[0][1:].strip() if lines else '?'}")


class Collect:
    """pytest plugin: the selected case ids (after the suite's deselection) and the deselections per function."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.deselected: Counter = Counter()

    def pytest_deselected(self, items) -> None:
        for item in items:
            self.deselected[Counts.func(item.nodeid)] += 1

    def pytest_collection_finish(self, session) -> None:
        self.ids = [item.nodeid for item in session.items]


def closest(n: int = 8) -> list[list]:
    """The suite's comparisons closest to their bars (tests/fla_suite/conftest.py records them)."""
    conftest = sys.modules.get("tests.fla_suite.conftest")
    rows = [[c.ratio / c.bar if c.bar > 0 else float("inf"), nodeid.split("::")[-1], c.prefix, c.ratio, c.bar,
             c.ratio64, c.warning]
            for nodeid, cs in (conftest.COMPARISONS.items() if conftest else []) for c in cs if c.abs_err > 1e-6]
    return sorted(rows, key=lambda r: r[0], reverse=True)[:n]


def sharded(pytest, argv: list[str], jobs: int, budget: float | None, k: str | None) -> tuple[Counts, list]:
    """Run the selected cases in ``jobs`` worker processes (round robin); merged counts and closest comparisons."""
    col = Collect()
    pytest.main(argv + ["--collect-only", "-qq"] + (["-k", k] if k else []), plugins=[col])
    counts = Counts()
    for name, n in col.deselected.items():
        counts.by_func[name]["deselected"] += n
    out = REPO / ".fla" / "shards"
    out.mkdir(parents=True, exist_ok=True)
    procs = []
    for i in range(jobs):
        (out / f"{i}.ids").write_text("\n".join(col.ids[i::jobs]))
        cmd = [sys.executable, __file__, "--worker", str(out / f"{i}.ids")]
        cmd += ["--budget", str(budget)] if budget is not None else []
        procs.append(subprocess.Popen(cmd, cwd=REPO, stdout=open(out / f"{i}.log", "w"), stderr=subprocess.STDOUT))
    rows = []
    for i, proc in enumerate(procs):
        proc.wait()
        res = out / f"{i}.json"
        if not res.exists():
            counts.failures.append(f"worker {i} ended without results (rc {proc.returncode}): see {out / f'{i}.log'}")
            continue
        r = json.loads(res.read_text())
        for name, c in r["by_func"].items():
            counts.by_func[name].update(c)
        counts.failures += r["failures"]
        counts.over += r["over"]
        rows += r["closest"]
    return counts, sorted(rows, key=lambda r: r[0], reverse=True)[:8]


def worker(pytest, argv: list[str], ids_file: Path, budget: float | None) -> int:
    """One shard: run its case ids, write counts and closest comparisons next to the ids file (.json)."""
    counts = Counts(budget)
    ids = [x for x in ids_file.read_text().split("\n") if x]
    rc = pytest.main(argv + ids, plugins=[counts]) if ids else 0
    ids_file.with_suffix(".json").write_text(json.dumps(dict(
        by_func={k: dict(v) for k, v in counts.by_func.items()}, failures=counts.failures, over=counts.over,
        closest=closest())))
    return rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prepare", action="store_true", help="fetch the wheels and copy the test file into .fla/")
    ap.add_argument("-k", default=None, help="pytest -k expression (a subset)")
    ap.add_argument("--budget", type=float, default=None, help="seconds after which no case starts")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (each compiles its own kernels)")
    ap.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.prepare:
        return prepare()

    import torch
    if torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "0")        # tests/conftest.py would default it to 1 (CPU runs)
    path = find_test_file()
    if path is None:
        print(f"fla's test file not found (run --prepare, or carry .fla); looked first at {REPO_COPY}")
        return NOT_FOUND
    fla_from = ensure_fla()
    if fla_from is None:
        print("fla-core 0.6.0 is not available: no wheel in .fla/wheels or .whl, and none could be downloaded")
        return NO_FLA
    ensure_pytest()
    import pytest

    argv = [str(SUITE), "-q", "--tb=line", "-p", "no:cacheprovider", "-rs", f"--rootdir={REPO}"]
    if args.worker:
        return worker(pytest, argv[1:], args.worker, args.budget)
    digest = sha256(path.read_text())
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (CPU-capable cases only)"
    print(f"fla's {path} (sha256 {digest[:16]}..., {'validated' if digest == VALIDATED_SHA256 else 'NOT validated'}"
          f" copy) against kimi_linear.ops on {dev}; fla-core from {fla_from}; torch {torch.__version__}", flush=True)
    t0 = time.time()
    if args.jobs > 1:
        counts, rows = sharded(pytest, argv, args.jobs, args.budget, args.k)
        rc = 0
        print("\ncomparisons closest to fla's bars (all workers):")
        for frac, name, prefix, ratio, bar, ratio64, warn in rows:
            print(f"{frac:6.2f} of bar  {prefix:>8} ratio {ratio:.3g} < {bar:g}{' (fla only warns)' if warn else ''} "
                  f"(in float64 {ratio64:.3g})  {name}")
    else:
        counts = Counts(args.budget)
        rc = pytest.main(argv + (["-k", args.k] if args.k else []), plugins=[counts])
    total = Counter()
    print(f"\n{'test function':<48} {'passed':>7} {'failed':>7} {'skipped':>8} {'deselected':>11}")
    for name in sorted(counts.by_func):
        c = counts.by_func[name]
        total.update(c)
        print(f"{name:<48} {c['passed']:>7} {c['failed']:>7} {c['skipped']:>8} {c['deselected']:>11}")
    print(f"{'total':<48} {total['passed']:>7} {total['failed']:>7} {total['skipped']:>8} {total['deselected']:>11}"
          f"   ({time.time() - t0:.0f} s)")
    for line in counts.failures:
        print("FAILED", line)
    if counts.over:
        print(f"{counts.over} cases skipped for the budget: run them with -k")
    print(f"{total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped, "
          f"{total['deselected']} deselected")
    return 0 if rc in (0, 5) and not total["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
