"""A/B of the whole decode step across source trees (issue 18): each tree's batch-1 time per output token through
the engine (and with ``--generate`` through ``model.generate``) at the given contexts, on the 48B-shaped model of
``bench/engine_gpu.py`` (8 layers, 32 experts, bf16), rounds interleaved (tree A, B, ..., then A, B, ... again) so
that drift of the card shows as a spread rather than as a difference; each tree runs in a process of its own with
its ``src/`` first on the path. One table: the median over rounds per tree and context, the spread beside it.

A variant that lives in the git history (an experiment committed and reverted) is measured without checking it
out: ``prepare`` (bench/kda_ab.py's) exports ``src/`` of each revision into a folder that a device call carries::

    python bench/decode_ab.py prepare HEAD b5fee42 --into .gl/dab           # here, needs git
    python3 bench/decode_ab.py run .gl/dab --rounds 2 [--generate] [--contexts 131072,4096] [--save $OUT/dab.json]
    python bench/decode_ab.py run .gl/dab --rounds 1 --smoke [--generate]  # CPU, tiny model: checks the script

Engine: ``engine_gpu.engine_decode`` (a real prefill of the context, then ``--steps`` timed pipelined graph steps
after a warm-up); generate: ``engine_gpu.generate_tpot`` (513 new tokens, TPOT over the last 7/8, medians of 3).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from kda_ab import prepare, prepare_parser  # noqa: E402  (a sibling bench script: the same export of src/ per revision)

TAG = "DECODE_AB "          # the prefix of a measurement line a tree's process prints


def measure(contexts: list[int], steps: int, generate: bool, smoke: bool) -> int:
    """In the tree's own process: build the model, print one TAG line of JSON per context."""
    import torch

    from engine_gpu import build, engine_decode, generate_tpot

    device = "cpu" if smoke else "cuda"
    model = build("48b-8l-32e", torch.float32 if smoke else torch.bfloat16, device, smoke)
    for ctx in contexts:
        row = {"context": ctx, "engine_ms": engine_decode(model, 1, ctx, steps, 2 if smoke else 16)["step_ms"]}
        if generate:
            row["generate_ms"] = generate_tpot(model, ctx, 5 if smoke else 513, 1 if smoke else 3)["tpot_ms"]
        print(TAG + json.dumps(row), flush=True)
    return 0


def tree_run(tree: str, contexts: list[int], steps: int, generate: bool, smoke: bool) -> list[dict]:
    """``measure`` on ``tree``'s package, in a process of its own: its rows (a failed run says why and gives
    none)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(tree, "src"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, os.path.abspath(__file__), "measure", "--contexts", ",".join(map(str, contexts)),
           "--steps", str(steps)] + (["--generate"] if generate else []) + (["--smoke"] if smoke else [])
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    rows = [json.loads(line[len(TAG):]) for line in done.stdout.splitlines() if line.startswith(TAG)]
    if done.returncode != 0 or not rows:
        print(f"{tree}: exit {done.returncode}\n{done.stderr[-3000:]}", file=sys.stderr, flush=True)
    return rows


def table(runs: dict[str, list[list[dict]]]) -> None:
    """Per tree and (path, context): the median over rounds in ms, the rounds' range beside it."""
    cols = sorted({(k, r["context"]) for rounds in runs.values() for rows in rounds for r in rows for k in r
                   if k.endswith("_ms")}, key=lambda c: (c[0], -c[1]))
    print("\n### batch-1 time per output token, ms (median over rounds; range)\n")
    print("| tree | " + " | ".join(f"{k.removesuffix('_ms')} {ctx}" for k, ctx in cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for tree, rounds in runs.items():
        cells = []
        for k, ctx in cols:
            vals = [r[k] for rows in rounds for r in rows if r["context"] == ctx and k in r]
            cells.append(f"{statistics.median(vals):.4f} ({min(vals):.4f}-{max(vals):.4f})" if vals else "")
        print(f"| {tree} | " + " | ".join(cells) + " |")


def run(into: str, rounds: int, contexts: list[int], steps: int, generate: bool, smoke: bool, save: str) -> int:
    trees = sorted(d for d in os.listdir(into) if os.path.isdir(os.path.join(into, d, "src")))
    if not trees:
        print(f"no trees under {into}: run `prepare` first", file=sys.stderr)
        return 2
    runs: dict[str, list[list[dict]]] = {t: [] for t in trees}
    for r in range(rounds):
        for t in trees:
            runs[t].append(tree_run(os.path.join(into, t), contexts, steps, generate, smoke))
            print(f"round {r + 1} {t}: {runs[t][-1]}", flush=True)
            if save:
                with open(save, "w") as f:
                    json.dump(runs, f)
    table(runs)
    return 0 if all(rows for rs in runs.values() for rows in rs) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    prepare_parser(sub, ".gl/dab")
    for name in ("run", "measure"):
        r = sub.add_parser(name, help="time every prepared tree (GPU)" if name == "run" else
                           "time this process's package (run starts it per tree)")
        if name == "run":
            r.add_argument("into", nargs="?", default=".gl/dab")
            r.add_argument("--rounds", type=int, default=2)
            r.add_argument("--save", default="", metavar="FILE", help="write the rows to FILE (JSON) as they land")
        r.add_argument("--contexts", default="131072,4096", help="comma-separated context lengths")
        r.add_argument("--steps", type=int, default=384, help="timed engine steps per context")
        r.add_argument("--generate", action="store_true", help="also generate's TPOT (~25 s more per 128k row)")
        r.add_argument("--smoke", action="store_true", help="CPU, the tiny preset, short contexts")
    a = ap.parse_args()
    if a.cmd == "prepare":
        return prepare(a.revs, a.into, a.name)
    contexts = [64] if a.smoke else [int(c) for c in a.contexts.split(",")]
    steps = 3 if a.smoke else a.steps
    if a.cmd == "measure":
        return measure(contexts, steps, a.generate, a.smoke)
    return run(a.into, a.rounds, contexts, steps, a.generate, a.smoke, a.save)


if __name__ == "__main__":
    raise SystemExit(main())
