"""The synthetic-task comparison of the Kimi Linear report: KDA vs Gated DeltaNet vs softmax attention.

GPU (one H200, shared with other jobs; every cell a 2-layer model, bf16 autocast, Triton KDA forward):

    PYTHONPATH=src python3 bench/synthetic.py --jobs 10 --time-budget 450 \\
        --out out/synthetic.jsonl --png out/synthetic.png > out/synthetic.log 2>&1
    python3 bench/synthetic.py --report out/synthetic.jsonl --png bench/synthetic.png   # table + plot, any time

CPU smoke test of the whole pipeline: ``python bench/synthetic.py --quick --jobs 2 --out /tmp/syn.jsonl``.

The grid is tasks x lengths x mixers (cells run in that order, so MQAR and Palindrome come first and the three
mixers of one task and length run side by side). Every model has 2 layers, 2 heads of width 128 (the report's
setup) and the same budget per task: ``--steps`` optimizer steps of ``--batch`` sequences at ``--lr``, cosine
schedule (MQAR: its own sizes, lr and batch from ``TASK_SIZES`` / ``TASK_HPARAMS`` unless given on the command
line). ``--jobs N`` runs N cells at once as worker processes on the same device; ``--time-budget S`` gives the
whole grid S seconds of wall time: each cell, when it starts, gets ``time left / rounds of cells left`` and stops
when its share is spent (its schedule is annealed in time, see ``kimi_linear.train.budget``), still recording its
steps and its learning curve. Held-out accuracy (answer positions only) is evaluated every ``--eval-every`` steps.

Results: one JSON line per finished cell, appended to ``--out`` under a file lock (safe with many workers); while a
cell runs, its latest curve sits in ``OUT.partial/`` (so a killed run still reports what it had). ``--report``
reads both and states the steps each cell actually ran, which cells were cut by time, and KDA vs Gated DeltaNet at
the same step.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import sys
import time
import traceback

import torch

# MQAR retuned (2026-12-01): the first GPU grid (256 keys and values, 64 noise ids, up to 64 pairs, lr 1e-3) left
# every mixer at chance after 400-650 steps. Queries now sit at random distances (see tasks.MQAR), and the grid uses
# 32 keys / 32 values, 16 noise ids and N = 16 pairs at every length (the length then only adds distance and noise):
# on CPU a 2-layer KDA leaves chance after ~150 steps at T=128 with these sizes, but not within 300 steps with 256
# or 64 keys. lr 3e-3 and batch 32 for MQAR only (lr 1e-2 stayed at chance on CPU; batch 32 leaves chance sooner).
TASK_SIZES: dict[str, dict] = {"mqar": {"num_keys": 32, "num_values": 32, "num_noise": 16, "max_pairs": 16},
                               "palindrome": {}, "stack": {}}
# Per-task --lr / --batch; a value given on the command line wins (see parse_args).
BASE_HPARAMS: dict[str, float | int] = {"lr": 1e-3, "batch": 16}
TASK_HPARAMS: dict[str, dict] = {"mqar": {"lr": 3e-3, "batch": 32}}
MIXER_ORDER = ("kda", "gdn", "attention")
QUICK = {"lengths": "64", "steps": 20, "batch": 4, "eval_every": 10, "hidden": 64, "head_dim": 32}
COLORS = {"kda": "tab:red", "gdn": "tab:blue", "attention": "tab:gray"}


# ----------------------------------------------------------------------------------------------------- one cell
def cell_name(task: str, mixer: str, seq_len: int) -> str:
    return f"{task}-{mixer}-{seq_len}"


def run_cell(task_name: str, mixer: str, seq_len: int, a: argparse.Namespace, device: str,
             seconds: float | None = None) -> dict:
    """Train and evaluate one (task, mixer, length) cell for at most ``a.steps`` steps and ``seconds``."""
    from kimi_linear.train import TaskSource, TrainConfig, Trainer, get_task
    from kimi_linear.train.budget import fit_within
    from kimi_linear.train.models import build_task_model

    task = get_task(task_name, **TASK_SIZES[task_name])
    hp = {k: v for k, v in TASK_HPARAMS.get(task_name, {}).items() if k not in getattr(a, "explicit", ())}
    lr, batch = hp.get("lr", a.lr), hp.get("batch", a.batch)
    model = build_task_model(mixer, task.vocab_size, hidden_size=a.hidden, num_heads=a.heads, head_dim=a.head_dim,
                             max_len=max(seq_len, 8192), seed=a.seed).to(device)
    source = TaskSource(task, batch_size=batch, seq_len=seq_len, seed=a.seed, eval_batches=a.eval_batches)
    config = TrainConfig(steps=a.steps, lr=lr, warmup=max(1, a.steps // 20), progress=False, weight_decay=0.01)
    base = {"task": task_name, "mixer": mixer, "seq_len": seq_len, "steps_planned": a.steps, "batch": batch,
            "lr": lr, "chance": task.chance, "time_cap": seconds, "device": device,
            "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
            "params": sum(p.numel() for p in model.parameters())}

    def record(history: list[dict], steps: int, stopped_by: str, elapsed: float, partial: bool) -> dict:
        evals = [r for r in history if "eval_accuracy" in r]
        every = max(1, len(history) // 200)
        return {**base, "steps": steps, "stopped_by": stopped_by, "partial": partial, "seconds": elapsed,
                "final_accuracy": evals[-1]["eval_accuracy"] if evals else None,
                "eval_loss": evals[-1]["eval_loss"] if evals else None,
                "final_loss": history[-1]["loss"] if history else None,
                "curve": [(r["step"], r["eval_accuracy"]) for r in evals],
                "loss_curve": [(r["step"], r["loss"]) for r in history[::every]]}

    def on_eval(rec: dict, clock) -> None:
        if a.out:
            write_partial(a.out, cell_name(task_name, mixer, seq_len),
                          record(trainer.history, trainer.step, "running", clock.elapsed(), True))

    trainer = Trainer(model, source, config)
    result = fit_within(trainer, seconds, eval_every=a.eval_every, on_eval=on_eval)
    return record(result.history, result.steps, result.stopped_by, result.seconds, False)


# ------------------------------------------------------------------------------------------------ result files
def partial_dir(out: str) -> str:
    return out + ".partial"


def write_partial(out: str, name: str, rec: dict) -> None:
    """Latest state of a running cell, replaced atomically (a reader never sees half a file)."""
    d = partial_dir(out)
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f".{name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(rec, f)
    os.replace(tmp, os.path.join(d, name + ".json"))


def append_result(out: str, rec: dict) -> None:
    """Append one JSON line under an exclusive lock (one write per line, so lines of workers never interleave),
    then drop the cell's partial file."""
    line = json.dumps(rec) + "\n"
    with open(out, "a", encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(partial_dir(out), cell_name(rec["task"], rec["mixer"], rec["seq_len"]) + ".json"))


def load_results(path: str) -> list[dict]:
    """Finished cells from the JSONL file (the last line of a cell wins; unreadable lines are skipped), plus the
    partial files of cells that never finished (``partial: true``)."""
    runs: dict[tuple, dict] = {}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                with contextlib.suppress(json.JSONDecodeError):
                    r = json.loads(line)
                    runs[r["task"], r["mixer"], r["seq_len"]] = r
    d = partial_dir(path)
    if os.path.isdir(d):
        for name in sorted(os.listdir(d)):
            if name.endswith(".json") and not name.startswith("."):
                with contextlib.suppress(json.JSONDecodeError, OSError):
                    r = json.load(open(os.path.join(d, name), encoding="utf-8"))
                    runs.setdefault((r["task"], r["mixer"], r["seq_len"]), r)
    return list(runs.values())


# ------------------------------------------------------------------------------------------------------ workers
def grid(a: argparse.Namespace) -> list[tuple[str, str, int]]:
    mixers = a.mixers.split(",")
    return [(t, m, n) for t in a.tasks.split(",") for n in map(int, a.lengths.split(",")) for m in mixers]


def cell_seconds(deadline: float | None, index: int, total: int, jobs: int) -> float | None:
    """Fair share of the time left for the cell at ``index`` of ``total``: time left / rounds of cells left, where
    the cells left are those not started (this one included) plus those the other workers are running."""
    if deadline is None:
        return None
    rounds = math.ceil((total - index + min(index, jobs - 1)) / jobs)
    return max(1.0, (deadline - time.time()) / rounds)


def do_cell(cell: tuple[str, str, int], index: int, total: int, a: argparse.Namespace, device: str,
            deadline: float | None) -> dict:
    task, mixer, n = cell
    seconds = cell_seconds(deadline, index, total, a.jobs)
    if seconds is not None and deadline - time.time() < 5:
        rec = {"task": task, "mixer": mixer, "seq_len": n, "steps": 0, "skipped": "time budget spent", "curve": []}
    else:
        try:
            rec = run_cell(task, mixer, n, a, device, seconds)
        except Exception as e:  # one broken cell must not take the grid down; the report shows the error
            traceback.print_exc()
            rec = {"task": task, "mixer": mixer, "seq_len": n, "steps": 0, "error": f"{type(e).__name__}: {e}",
                   "curve": []}
    if a.out:
        append_result(a.out, rec)
    acc = rec.get("final_accuracy")
    print(f"[{index + 1}/{total}] {task:10s} {mixer:9s} T={n:5d}  steps {rec.get('steps', 0):5d}"
          f" ({rec.get('stopped_by', rec.get('skipped', rec.get('error', '?')))})  acc "
          f"{'-' if acc is None else f'{acc:.3f}'}  {rec.get('seconds', 0):.0f}s", flush=True)
    return rec


def setup_process(a: argparse.Namespace) -> None:
    torch.set_num_threads(a.threads)
    torch.backends.cuda.matmul.allow_tf32 = True       # float32 evaluation on the GPU
    torch.backends.cudnn.allow_tf32 = True


def worker(queue, a: argparse.Namespace, device: str, deadline: float | None, total: int) -> None:
    setup_process(a)
    while True:
        item = queue.get()
        if item is None:
            return
        index, cell = item
        do_cell(cell, index, total, a, device, deadline)


def run_grid(a: argparse.Namespace, device: str) -> None:
    cells = grid(a)
    deadline = time.time() + a.time_budget - a.margin if a.time_budget else None
    if a.jobs == 1:
        setup_process(a)
        for i, cell in enumerate(cells):
            do_cell(cell, i, len(cells), a, device, deadline)
        return
    import multiprocessing as mp

    ctx = mp.get_context("spawn")                      # CUDA cannot be used in forked children
    queue = ctx.Queue()
    for item in enumerate(cells):
        queue.put(item)
    for _ in range(a.jobs):
        queue.put(None)
    procs = [ctx.Process(target=worker, args=(queue, a, device, deadline, len(cells)), daemon=True)
             for _ in range(a.jobs)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    bad = [p.exitcode for p in procs if p.exitcode]
    if bad:
        print(f"warning: {len(bad)} worker(s) exited with codes {bad}", file=sys.stderr)


# ------------------------------------------------------------------------------------------------------- report
def steps_to(curve: list, level: float) -> int | None:
    """First evaluated step reaching ``level`` accuracy (None if never)."""
    return next((s for s, acc in curve if acc >= level), None)


def acc_at(curve: list, step: int) -> float | None:
    """Accuracy at the last evaluation at or before ``step``."""
    got = [acc for s, acc in curve if s <= step]
    return got[-1] if got else None


def _cell_text(r: dict | None) -> str:
    if r is None:
        return "-"
    if "error" in r or "skipped" in r:
        return "error" if "error" in r else "not run"
    acc = r.get("final_accuracy")
    mark = "" if not r.get("partial") and r.get("stopped_by") == "steps" else \
        " (killed)" if r.get("partial") else " (time)"
    return f"{'-' if acc is None else f'{acc:.3f}'} @{r.get('steps', 0)}{mark}"


def report_table(runs: list[dict]) -> str:
    """Markdown: accuracy @ steps run per cell, steps to 50%/90%, and KDA vs Gated DeltaNet at a common step."""
    tasks = [t for t in TASK_SIZES if any(r["task"] == t for r in runs)]
    lens = sorted({r["seq_len"] for r in runs})
    mixers = [m for m in MIXER_ORDER if any(r["mixer"] == m for r in runs)]
    by = {(r["task"], r["mixer"], r["seq_len"]): r for r in runs}
    lines = ["Held-out accuracy @ optimizer steps actually run ('(time)': cut by its time share, schedule annealed "
             "in time; '(killed)': last partial record of an interrupted cell).", "",
             "| task | model | " + " | ".join(f"T={n}" for n in lens) + " | steps to 50% / 90% (per length) |",
             "|---|---|" + "---|" * len(lens) + "---|"]
    for t in tasks:
        for m in mixers:
            cells = [by.get((t, m, n)) for n in lens]
            reach = [f"{steps_to(r['curve'], 0.5) or '>' + str(r.get('steps', 0))} / "
                     f"{steps_to(r['curve'], 0.9) or '>' + str(r.get('steps', 0))}" if r and r.get("curve") else "-"
                     for r in cells]
            lines.append(f"| {t} | {m} | " + " | ".join(map(_cell_text, cells)) + " | " + ", ".join(reach) + " |")
    lines += ["", "KDA vs Gated DeltaNet at the same step (the last evaluation both reached):", "",
              "| task | T | step | KDA | GDN | KDA >= GDN | KDA steps to 90% | GDN steps to 90% |",
              "|---|---|---|---|---|---|---|---|"]
    for t in tasks:
        for n in lens:
            k, g = by.get((t, "kda", n)), by.get((t, "gdn", n))
            if not (k and g and k.get("curve") and g.get("curve")):
                continue
            common = min(k["curve"][-1][0], g["curve"][-1][0])
            ak, ag = acc_at(k["curve"], common), acc_at(g["curve"], common)
            if ak is None or ag is None:
                continue
            lines.append(f"| {t} | {n} | {common} | {ak:.3f} | {ag:.3f} | {'yes' if ak >= ag else '**no**'} | "
                         f"{steps_to(k['curve'], 0.9) or '>' + str(k['steps'])} | "
                         f"{steps_to(g['curve'], 0.9) or '>' + str(g['steps'])} |")
    devices = sorted({r.get("device_name", "?") for r in runs if "device_name" in r})
    if devices:
        lines += ["", f"Device: {', '.join(devices)}; batch {sorted({r['batch'] for r in runs if 'batch' in r})}, "
                      f"planned steps {sorted({r['steps_planned'] for r in runs if 'steps_planned' in r})}."]
    return "\n".join(lines)


def report_plot(runs: list[dict], png: str) -> None:
    """Accuracy against training steps, one panel per task, color = model, line style = length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t in TASK_SIZES if any(r["task"] == t and r.get("curve") for r in runs)]
    lens = sorted({r["seq_len"] for r in runs})
    styles = dict(zip(lens, ["-", "--", "-.", ":", (0, (1, 1)), (0, (5, 1))]))
    fig, axes = plt.subplots(1, max(1, len(tasks)), figsize=(5 * max(1, len(tasks)), 4), squeeze=False)
    for ax, t in zip(axes[0], tasks):
        for r in sorted(runs, key=lambda r: (MIXER_ORDER.index(r["mixer"]) if r["mixer"] in MIXER_ORDER else 9,
                                              r["seq_len"])):
            if r["task"] == t and r.get("curve"):
                steps, acc = zip(*r["curve"])
                ax.plot(steps, acc, color=COLORS.get(r["mixer"]), linestyle=styles.get(r["seq_len"], "-"),
                        label=f"{r['mixer']} T={r['seq_len']}")
        ax.set_title(t)
        ax.set_xlabel("training step")
        ax.set_ylabel("held-out accuracy")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)


def report(path: str, png: str | None) -> str:
    runs = load_results(path)
    if not runs:
        raise SystemExit(f"error: no results in {path!r} (nor in {partial_dir(path)!r})")
    if png:
        report_plot(runs, png)
    return report_table(runs)


# --------------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out/synthetic.jsonl", help="results, one JSON line per cell (appended)")
    p.add_argument("--report", metavar="JSONL", help="only write the table and the plot from saved results")
    p.add_argument("--png", default="bench/synthetic.png", help="the plot ('' for none)")
    p.add_argument("--tasks", default="mqar,palindrome,stack")
    p.add_argument("--mixers", default=",".join(MIXER_ORDER))
    p.add_argument("--lengths", default="256,512,1024,2048")
    p.add_argument("--steps", type=int, default=1500, help="optimizer steps per cell (the schedule's length)")
    p.add_argument("--batch", type=int, default=None,
                   help=f"sequences per step (default {BASE_HPARAMS['batch']}; MQAR: TASK_HPARAMS)")
    p.add_argument("--lr", type=float, default=None,
                   help=f"peak learning rate (default {BASE_HPARAMS['lr']}; MQAR: TASK_HPARAMS)")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=1, help="cells run at once, as worker processes on one device")
    p.add_argument("--time-budget", type=float, default=0.0,
                   help="wall seconds for the whole grid (0: none); each cell gets a fair share")
    p.add_argument("--margin", type=float, default=10.0, help="seconds of the budget kept for the last evaluations")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads per worker (default: 1 on CUDA)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--quick", action="store_true", help="a tiny CPU smoke run of the whole pipeline")
    a = p.parse_args(argv)
    # Given on the command line: used for every task; left out: each task's own TASK_HPARAMS, else BASE_HPARAMS.
    a.explicit = {name for name in ("lr", "batch") if getattr(a, name) is not None}
    if a.quick:  # small shapes, for options left at their defaults
        for name, value in QUICK.items():
            if getattr(a, name) == p.get_default(name):
                setattr(a, name, value)
                if name in BASE_HPARAMS:                            # small for every task, MQAR too
                    a.explicit.add(name)
    for name, value in BASE_HPARAMS.items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    for name in ("jobs", "steps", "batch", "eval_batches"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.time_budget < 0:
        p.error(f"--time-budget must be >= 0, got {a.time_budget}")
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if a.report:
        print(report(a.report, a.png or None))
        return
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    a.threads = a.threads or (1 if device.startswith("cuda") else max(1, (os.cpu_count() or 1) // a.jobs))
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    t0 = time.time()
    run_grid(a, device)
    print(f"grid done in {time.time() - t0:.0f} s ({a.jobs} jobs); results in {a.out}", flush=True)
    with contextlib.suppress(OSError):
        os.rmdir(partial_dir(a.out))                   # only when empty: every cell finished
    with contextlib.suppress(ImportError):
        print(report(a.out, a.png or None))


if __name__ == "__main__":
    main()
