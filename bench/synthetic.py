"""The synthetic-task comparison of the Kimi Linear report: KDA vs Gated DeltaNet vs softmax attention.

    python bench/synthetic.py --out out/synthetic.json            # the grid (GPU: minutes; CPU: use --quick)
    python bench/synthetic.py --report out/synthetic.json         # table (markdown) + bench/synthetic.png

Every model has 2 layers, 2 heads of width 128 (the report's setup) and the same budget per task (steps, batch,
learning rate). Accuracy is on held-out examples (answer positions only), evaluated every ``--eval-every`` steps.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from kimi_linear.train import TaskSource, TrainConfig, Trainer, get_task
from kimi_linear.train.models import MIXERS, build_task_model

TASK_SIZES = {"mqar": {}, "palindrome": {}, "stack": {}}


def run_one(task_name: str, mixer: str, seq_len: int, a: argparse.Namespace, device: str) -> dict:
    task = get_task(task_name, **TASK_SIZES[task_name])
    model = build_task_model(mixer, task.vocab_size, hidden_size=a.hidden, num_heads=a.heads, head_dim=a.head_dim,
                             max_len=max(seq_len, 8192), seed=a.seed).to(device)
    source = TaskSource(task, batch_size=a.batch, seq_len=seq_len, seed=a.seed, eval_batches=a.eval_batches)
    config = TrainConfig(steps=a.steps, lr=a.lr, warmup=max(1, a.steps // 20), eval_every=a.eval_every,
                         progress=False, weight_decay=0.01)
    t0 = time.perf_counter()
    history = Trainer(model, source, config).fit()
    curve = [(r["step"], r["eval_accuracy"]) for r in history if "eval_accuracy" in r]
    return {"task": task_name, "mixer": mixer, "seq_len": seq_len, "steps": a.steps, "batch": a.batch,
            "final_accuracy": curve[-1][1], "curve": curve, "chance": task.chance,
            "final_loss": history[-1]["loss"], "seconds": time.perf_counter() - t0, "device": device}


def steps_to(curve: list, level: float) -> int | None:
    """First evaluated step reaching ``level`` accuracy (None if never)."""
    return next((s for s, acc in curve if acc >= level), None)


def report(path: str, png: str) -> str:
    runs = [json.loads(line) for line in open(path, encoding="utf-8")]
    tasks = sorted({r["task"] for r in runs})
    lens = sorted({r["seq_len"] for r in runs})
    mixers = [m for m in ("kda", "gdn", "attention") if any(r["mixer"] == m for r in runs)]
    by = {(r["task"], r["mixer"], r["seq_len"]): r for r in runs}
    lines = ["| task | model | " + " | ".join(f"acc @ {n}" for n in lens) + " | steps to 90% (per length) |",
             "|---|---|" + "---|" * len(lens) + "---|"]
    for t in tasks:
        for m in mixers:
            accs = [f"{by[t, m, n]['final_accuracy']:.3f}" if (t, m, n) in by else "-" for n in lens]
            reach = [str(steps_to(by[t, m, n]["curve"], 0.9) or ">" + str(by[t, m, n]["steps"]))
                     if (t, m, n) in by else "-" for n in lens]
            lines.append(f"| {t} | {m} | " + " | ".join(accs) + " | " + ", ".join(reach) + " |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4), squeeze=False)
    styles = dict(zip(lens, ["-", "--", "-.", ":", (0, (1, 1))]))
    colors = {"kda": "tab:red", "gdn": "tab:blue", "attention": "tab:gray"}
    for ax, t in zip(axes[0], tasks):
        for (tt, m, n), r in sorted(by.items()):
            if tt == t:
                steps, acc = zip(*r["curve"])
                ax.plot(steps, acc, color=colors.get(m), linestyle=styles.get(n, "-"), label=f"{m} T={n}")
        ax.set_title(t)
        ax.set_xlabel("training step")
        ax.set_ylabel("held-out accuracy")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out/synthetic.jsonl", help="results, one JSON line per run (appended)")
    p.add_argument("--report", metavar="JSONL", help="only write the table and the plot from saved results")
    p.add_argument("--png", default="bench/synthetic.png")
    p.add_argument("--tasks", default="mqar,palindrome,stack")
    p.add_argument("--mixers", default=",".join(MIXERS))
    p.add_argument("--lengths", default="256,512,1024,2048")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a tiny CPU smoke run of the whole pipeline")
    a = p.parse_args()
    if a.report:
        print(report(a.report, a.png))
        return
    if a.quick:
        a.lengths, a.steps, a.batch, a.eval_every, a.hidden, a.head_dim = "64", 20, 4, 10, 64, 32
    device = "cuda" if torch.cuda.is_available() else "cpu"
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    for task in a.tasks.split(","):
        for n in map(int, a.lengths.split(",")):
            for mixer in a.mixers.split(","):
                r = run_one(task, mixer, n, a, device)
                print(f"{task:10s} {mixer:9s} T={n:5d}  acc {r['final_accuracy']:.3f}  "
                      f"loss {r['final_loss']:.3f}  {r['seconds']:.0f}s", flush=True)
                with open(a.out, "a", encoding="utf-8") as f:
                    f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
