"""Where the engine's prefill loses to one bare forward (issue 18's prefill goal: >= 80% of its tokens/s).

    python bench/profile_prefill.py                     # 8-layer Kimi-Linear-48B shape, 32 experts, bf16, 32 x 2048
    python bench/profile_prefill.py --budget 65536
    python bench/profile_prefill.py --smoke             # CPU, tiny preset (checks the script)

The same prompts as ``bench/engine_gpu.py``'s prefill row: one bare forward over all of them (``logits_to_keep=1``)
against the engine taking them in steps of at most ``--budget`` tokens. Prints both wall times, the engine's steps
(host time of ``engine.step`` without a sync beside the wall time: a step whose host time nears its wall time waits
on Python, not the GPU), the CUDA kernels of both grouped by name with the difference (what the engine's packed
forwards run longer or extra), and the engine's top host-side ops.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from kimi_linear.engine import SamplingParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_gpu import build, prefill_engine, prefill_prompts, prefill_round, sync  # noqa: E402
from profile_decode import kernel_diff, profiled  # noqa: E402


def step_times(engine, prompts: list[list[int]]) -> list[tuple[float, float]]:
    """(host s, wall s) of each step of one round: host = the step call's own time, wall = up to the next sync."""
    for i, p in enumerate(prompts):
        engine.add_request(f"steps-{i}", p, SamplingParams(max_tokens=1, temperature=0))
    out = []
    while engine.has_work():
        sync()
        t0 = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
        sync()
        out.append((t1 - t0, time.perf_counter() - t0))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="48b-8l-32e")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=None, help="the engine's step token budget (default: its own)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and not a.smoke
    model = build(a.model, torch.bfloat16 if cuda else torch.float32, "cuda" if cuda else "cpu", a.smoke)
    n, T = (4, 64) if a.smoke else (a.prompts, a.tokens)
    prompts = prefill_prompts(model, n, T)
    ids = torch.tensor(prompts, device=model.device)

    def bare() -> None:
        with torch.inference_mode():
            model(ids, logits_to_keep=1)

    bare()                                                   # compile / warm at the full shape
    bare_s = statistics.median(_timed(bare) for _ in range(3))
    _, bare_k = profiled(bare, cuda)
    engine = prefill_engine(model, n, T, a.budget)
    rounds = [prefill_round(engine, prompts, str(r)) for r in range(3)]     # round 0 warms up
    steps = step_times(engine, prompts)
    prof, eng_k = profiled(lambda: prefill_round(engine, prompts, "prof"), cuda)
    eng_s = statistics.mean(rounds[1:])

    print(f"## prefill profile: {a.model}, {n} x {T} tokens, budget {engine.cfg.max_num_batched_tokens}, "
          f"{'cuda' if cuda else 'cpu'}")
    print(f"\nbare forward {1e3 * bare_s:.1f} ms ({n * T / bare_s:,.0f} tok/s); engine {1e3 * eng_s:.1f} ms "
          f"({n * T / eng_s:,.0f} tok/s): {100 * bare_s / eng_s:.0f}%")
    tb, te = sum(g[0] for g in bare_k.values()), sum(g[0] for g in eng_k.values())
    print(f"kernel time: bare {tb:.1f} ms in {sum(g[1] for g in bare_k.values()):.0f} kernels, engine {te:.1f} ms "
          f"in {sum(g[1] for g in eng_k.values()):.0f}")
    print("\n| engine step | host ms | wall ms |\n|---:|---:|---:|")
    for i, (h, w) in enumerate(steps):
        print(f"| {i} | {1e3 * h:.1f} | {1e3 * w:.1f} |")
    if cuda:
        print()
        kernel_diff(("engine", eng_k), ("bare", bare_k), a.top)
    print("\nengine round, host-side ops by self CPU time:\n")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
    return 0


def _timed(fn) -> float:
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


if __name__ == "__main__":
    sys.exit(main())
