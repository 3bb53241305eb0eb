"""A/B of the chunk kernels across source trees: every tree's per-kernel times (CUDA profiler) of the forward (and
with ``--backward`` of forward + backward) for every gate regime of ``bench/kda_kernels.py``, rounds interleaved
(tree A, B, ..., then A, B, ... again) so that drift of the card shows as a spread rather than as a difference, one
table per regime with the median over rounds.

A variant that lives in the git history (an experiment committed and reverted) is measured without checking it
out: ``prepare`` exports ``src/`` of each revision into a folder here (no model assets), which a device call then
carries beside the working tree::

    python bench/kda_ab.py prepare HEAD 82a80b2 --into .gl/ab          # here, needs git
    python3 bench/kda_ab.py run .gl/ab --rounds 2 [--check] [--backward] [--shape 1x32768] [--save $OUT/ab.json]
    python bench/kda_ab.py table ab1.json ab2.json      # the tables again, from runs saved by one or more calls

A launch-config variant of a revision is a tree of its own: ``prepare REV --name NAME --config JSON`` exports REV
as NAME with ``config.json`` beside its ``src/``, and every run on it passes that JSON as ``kda_kernels.py
--config`` (LaunchConfig fields)::

    python bench/kda_ab.py prepare d0ee2b9 --name d0ee2b9-cap168 --config '{"scores_regs": 168}'

``--check`` also runs each tree's full-size GPU checks (``kda_kernels.py --check``: forward, backward, 1M tokens,
every gate regime's gradients against float64, varlen float32 extreme gates) and says which passed. ``--save
FILE`` writes every profile to FILE (JSON) as it lands, so a call cut short by its time limit still leaves its
rounds, and runs split across calls combine in ``table``. ``--smoke`` runs on the CPU under the interpreter, tiny
shapes, to check the script (no kernel times there).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = "config.json"                                   # a tree's launch config (prepare --config)
LINE = re.compile(r"regime profile (\S+) (.+?), ours (fwd|fwd\+bwd): ([\d.]+) ms of kernels: (.*)$")
KERNEL = re.compile(r"(chunk_kda_\w+?)_kernel ([\d.]+) ms x\d+")


def prepare(revs: list[str], into: str, name: str = "", config: str = "") -> int:
    """``src/`` of each revision (model assets left out) into ``into/<rev>`` (``into/<name>`` for one revision),
    with ``config`` (LaunchConfig fields, JSON) as the tree's ``config.json``."""
    if name and len(revs) != 1:
        print("--name takes exactly one revision", file=sys.stderr)
        return 2
    if config:
        json.loads(config)                                     # a clear error here, not one per run on the GPU
    os.makedirs(into, exist_ok=True)
    for rev in revs:
        dest = os.path.join(into, name or rev)
        os.makedirs(dest, exist_ok=True)
        archive = subprocess.run(["git", "archive", rev, "src", ":(exclude)src/kimi_linear/assets"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
        if config:
            with open(os.path.join(dest, CONFIG), "w") as f:
                f.write(config)
        print(f"{rev}: {dest}/src")
    return 0


def kda_kernels(tree: str, args: list[str], smoke: bool) -> subprocess.CompletedProcess:
    """``bench/kda_kernels.py args`` (this checkout's script) on ``tree``'s package, in a process of its own, under
    the tree's launch config if it has one."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(tree, "src"), os.environ.get("PYTHONPATH", "")]))
    if os.path.exists(os.path.join(tree, CONFIG)):
        with open(os.path.join(tree, CONFIG)) as f:
            args = [*args, "--config", f.read()]
    cmd = [sys.executable, os.path.join(HERE, "kda_kernels.py"), *args] + (["--smoke"] if smoke else [])
    return subprocess.run(cmd, env=env, capture_output=True, text=True)


def profile(tree: str, smoke: bool, backward: bool, shape: str = "") -> dict[str, dict[str, float]]:
    """regime -> {"total": ms of kernels, kernel: ms} for one run of ``tree``'s kernels at ``shape`` (BxT; default
    kda_kernels.py's first); with ``backward`` also "regime, fwd+bwd" -> the same for forward + backward (its twelve
    largest kernels)."""
    out = kda_kernels(tree, ["--regimes", "--profile", "--no-fla", "--no-decode", "--only", "profile gate"]
                      + ([] if backward else ["--no-backward"]) + (["--shapes", shape] if shape else []), smoke).stdout
    times = {}
    for line in out.splitlines():
        m = LINE.search(line)
        if m:
            what = f"{m.group(1)} {m.group(2)}" + (", fwd+bwd" if m.group(3) == "fwd+bwd" else "")
            times[what] = {"total": float(m.group(4)), **{k: float(t) for k, t in KERNEL.findall(m.group(5))}}
    return times


def check(tree: str, smoke: bool) -> str:
    """PASS, or FAIL with the first failing check lines, of ``tree``'s full-size checks."""
    res = kda_kernels(tree, ["--check", "--no-decode", "--no-fla", "--only", "check"], smoke)
    fails = [ln.strip() for ln in res.stdout.splitlines() if "FAIL" in ln]
    if res.returncode == 0 and not fails:
        return "PASS"
    return f"FAIL (rc {res.returncode}): " + "; ".join(fails[:4] or [res.stderr.strip()[-300:]])


def table(runs: dict[str, list[dict]]) -> None:
    """One table per regime: every tree's total and per-kernel ms, median over its rounds with the spread."""
    trees = sorted(runs)
    regimes = list(dict.fromkeys(g for t in trees for one in runs[t] for g in one))   # the script's order
    for g in regimes:
        names = sorted({k for t in trees for one in runs[t] for k in one.get(g, {})}, key=lambda k: k != "total")
        rounds = max(sum(g in one for one in runs[t]) for t in trees)
        print(f"\n### {g} (ms, median of {rounds}; spread in parentheses)\n")
        print("| tree | " + " | ".join(names) + " |")
        print("|---|" + "---:|" * len(names))
        for t in trees:
            cells = []
            for k in names:
                vals = [one[g][k] for one in runs[t] if k in one.get(g, {})]
                cells.append(f"{statistics.median(vals):.3f} ({max(vals) - min(vals):.3f})" if vals else "-")
            print(f"| {t} | " + " | ".join(cells) + " |")


def run(into: str, rounds: int, with_check: bool, smoke: bool, backward: bool = False, save: str = "",
        shape: str = "") -> int:
    trees = sorted(d for d in os.listdir(into) if os.path.isdir(os.path.join(into, d, "src")))
    if not trees:
        print(f"no trees under {into}: run `prepare` first", file=sys.stderr)
        return 2
    runs = {t: [] for t in trees}
    for r in range(rounds):
        for t in trees:
            runs[t].append(profile(os.path.join(into, t), smoke, backward, shape))
            print(f"round {r + 1} {t}: {len(runs[t][-1])} regimes", flush=True)
            if save:
                with open(save, "w") as f:
                    json.dump(runs, f)
    table(runs)
    if with_check:
        print("\n### full-size checks\n")
        for t in trees:
            print(f"- {t}: {check(os.path.join(into, t), smoke)}", flush=True)
    return 0


def merged(files: list[str]) -> dict[str, list[dict]]:
    """The rounds of several saved runs, per tree (a tree may be missing from some)."""
    runs: dict[str, list[dict]] = {}
    for path in files:
        with open(path) as f:
            for t, rs in json.load(f).items():
                runs.setdefault(t, []).extend(rs)
    return runs


def prepare_parser(sub: argparse._SubParsersAction, into: str) -> argparse.ArgumentParser:
    """The ``prepare`` subcommand's arguments (this script's and bench/decode_ab.py's), trees into ``into``."""
    p = sub.add_parser("prepare", help="export src/ of git revisions (here)")
    p.add_argument("revs", nargs="+")
    p.add_argument("--into", default=into)
    p.add_argument("--name", default="", help="the tree's folder name (one revision; default the revision)")
    return p


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = prepare_parser(sub, ".gl/ab")
    p.add_argument("--config", default="", metavar="JSON", help="LaunchConfig fields the tree runs under")
    r = sub.add_parser("run", help="profile every prepared tree (GPU)")
    r.add_argument("into", nargs="?", default=".gl/ab")
    r.add_argument("--rounds", type=int, default=2)
    r.add_argument("--check", action="store_true", help="also each tree's full-size GPU checks")
    r.add_argument("--backward", action="store_true", help="also forward + backward per regime")
    r.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny shapes: checks the script")
    r.add_argument("--save", default="", metavar="FILE", help="write the profiles to FILE (JSON) as they land")
    r.add_argument("--shape", default="", metavar="BxT",
                   help="the profiles' shape (default kda_kernels.py's first, 16x2048), e.g. 1x32768")
    t = sub.add_parser("table", help="the tables from runs saved with --save (here)")
    t.add_argument("files", nargs="+")
    a = ap.parse_args()
    if a.cmd == "prepare":
        return prepare(a.revs, a.into, a.name, a.config)
    if a.cmd == "table":
        table(merged(a.files))
        return 0
    return run(a.into, a.rounds, a.check, a.smoke, a.backward, a.save, a.shape)


if __name__ == "__main__":
    raise SystemExit(main())
