"""Where a decode step's time goes on the GPU: kernel times of the fixed-shape step, grouped, beside the graph replay.

    python bench/profile_decode.py                      # 8-layer Kimi-Linear-48B shape, 32 experts, bf16
    python bench/profile_decode.py --batches 1,128 --context 4096
    python bench/profile_decode.py --smoke              # CPU, tiny preset (checks the script)
    python bench/profile_decode.py --engine --context 131072   # the engine's step beside generate's, batch 1

For each batch: the CUDA-graph replay time of one step (median), the sum of the step's kernel times (the eager
fixed-shape step under torch.profiler: what the graph replays, minus launch gaps), the number of kernels, and the
kernels grouped by name (top rows by time) with the bytes-per-step floor beside them.

--engine: one sequence's decode at batch 1 through ``LLMEngine`` (a real prefill of ``--context`` tokens, its
16-token blocks, its pipelined steps) against ``generate``'s step (graph replays over DecodePools of 64-token
blocks at the same length): the time per step of each, and the kernels of ``--reps`` steps of each under the
profiler, grouped by name with the difference (kernels replayed inside CUDA graphs are in the profiler's trace).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_gpu import active_bytes, bench_engine, build, cache_bytes_per_step, copy_bandwidth, sync  # noqa: E402
from kimi_linear.model.paged import DecodeGraphs, DecodePools  # noqa: E402


def trace_step(graphs, inputs: torch.Tensor, batch: int, limit: int) -> None:
    """The step's kernel launches in order: the op that launched each kernel and the innermost kimi_linear
    frame (the line of our code responsible), the first ``limit`` launches."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.inference_mode(), torch.profiler.profile(activities=acts, with_stack=True) as prof:
        graphs.forward(inputs, batch)
        torch.cuda.synchronize()
    rows = []
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CPU and ev.kernels and not any(
                c.kernels for c in ev.cpu_children):
            ours = [f for f in (ev.stack or []) if "kimi_linear" in f]
            where = ours[0].split("kimi_linear/")[-1] if ours else "?"
            rows.append((ev.time_range.start, ev.name, len(ev.kernels), where))
    rows.sort()
    print(f"\n### batch {batch}: {len(rows)} kernel-launching ops, in order (first {limit})\n")
    for _, name, n, where in rows[:limit]:
        print(f"{name[:40]:40s} {n:2d}  {where}")


def kernel_groups(prof: torch.profiler.profile, reps: int) -> dict[str, list[float]]:
    """The profiled CUDA kernels grouped by name: name -> [ms, calls], each per repetition (``reps`` profiled)."""
    groups: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            g = groups[ev.name[:90]]
            g[0] += ev.device_time / reps / 1e3
            g[1] += 1 / reps
    return dict(groups)


def profiled(fn, cuda: bool) -> tuple[torch.profiler.profile, dict[str, list[float]]]:
    """Run ``fn`` once under the profiler (CUDA activity too on a GPU): the profile and its kernel groups."""
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        sync()
    return prof, kernel_groups(prof, 1)


def profile_batch(model, batch: int, context: int, reps: int, top: int, bw: float, trace: int = 0) -> None:
    cuda = model.device.type == "cuda"
    pools = DecodePools.allocate(model, batch, context + 8, block_size=16)
    graphs = DecodeGraphs(model, pools, batch, capture=cuda)
    rng = random.Random(0)
    ids = torch.tensor([rng.randrange(model.config.vocab_size) for _ in range(batch)], device=model.device)
    slots = torch.arange(batch, device=model.device)
    lens = torch.full((batch,), context, device=model.device)
    graphs.run_device(ids, slots, lens)                      # capture (or warm up)
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        graphs.run_device(ids, slots, lens)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    replay = 1e3 * statistics.median(times)
    inputs = torch.cat([ids, slots, lens])
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.inference_mode():
        graphs.forward(inputs, batch)
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(3):
                graphs.forward(inputs, batch)
            if cuda:
                torch.cuda.synchronize()
    if cuda and trace:
        trace_step(graphs, inputs, batch, trace)
    groups = kernel_groups(prof, 3)
    n_kernels = 3 * sum(g[1] for g in groups.values())
    total = sum(g[0] for g in groups.values())
    floor = 1e3 * (active_bytes(model, batch) + cache_bytes_per_step(model, batch, context)) / bw if cuda else 0
    print(f"\n### batch {batch}, context {context}: graph replay {replay:.3f} ms, kernel time {total:.3f} ms in "
          f"{n_kernels / 3:.0f} kernels, floor {floor:.3f} ms\n")
    print("| kernel | ms / step | calls / step | share |")
    print("|---|---:|---:|---:|")
    for name, (ms, calls) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"| `{name}` | {ms:.4f} | {calls:.0f} | {100 * ms / max(total, 1e-9):.1f}% |")


def engine_vs_generate(model, context: int, reps: int, top: int) -> None:
    """Batch 1 at ``context`` tokens: the engine's steps against generate's graph replays (see the docstring)."""
    from kimi_linear.engine import SamplingParams

    cuda = model.device.type == "cuda"
    steps = 3 * reps + 8
    engine = bench_engine(model, 1, context + steps)
    rng = random.Random(0)
    engine.add_request("0", [rng.randrange(model.config.vocab_size) for _ in range(context)],
                       SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True))
    while not engine.running or engine.running[0].num_tokens() - engine.running[0].num_computed > 1:
        engine.step()                                        # the prompt, chunked under the step budget
    for _ in range(4):
        engine.step()

    eng_ms, eng_k = per_step(engine.step, reps, cuda)

    pools = DecodePools.allocate(model, 1, context + steps)
    graphs = DecodeGraphs(model, pools, 1, capture=cuda)
    ids = torch.zeros(1, dtype=torch.long, device=model.device)
    slots = torch.zeros(1, dtype=torch.long, device=model.device)
    lens = torch.full((1,), context, device=model.device)

    graphs.run_device(ids, slots, lens)                      # capture
    gen_ms, gen_k = per_step(lambda: graphs.run_device(ids, slots, lens), reps, cuda)
    te, tg = sum(g[0] for g in eng_k.values()), sum(g[0] for g in gen_k.values())
    print(f"\n### batch 1, context {context}: engine {eng_ms:.3f} ms a step (kernels {te:.3f} ms), generate's "
          f"step {gen_ms:.3f} ms (kernels {tg:.3f} ms)\n")
    kernel_diff(("engine", eng_k), ("generate", gen_k), top, unit=("us", 1e3))


def per_step(step, reps: int, cuda: bool) -> tuple[float, dict[str, list[float]]]:
    """``reps`` calls of ``step``: ms per call (timed), then the kernels of ``reps`` more under the profiler,
    grouped by name, per call."""
    def steps() -> None:
        for _ in range(reps):
            step()

    sync()
    t = time.perf_counter()
    steps()
    sync()
    ms = 1e3 * (time.perf_counter() - t) / reps
    _, groups = profiled(steps, cuda)
    return ms, {name: [g[0] / reps, g[1] / reps] for name, g in groups.items()}


def kernel_diff(a: tuple[str, dict], b: tuple[str, dict], top: int, unit: tuple[str, float] = ("ms", 1.0)) -> None:
    """Markdown table of two runs' kernel groups (name -> [ms, calls]), largest differences first."""
    (na, ka), (nb, kb), (u, f) = a, b, unit
    print(f"| kernel | {na} {u} | calls | {nb} {u} | calls | {na} - {nb} {u} |")
    print("|---|---:|---:|---:|---:|---:|")
    names = sorted(set(ka) | set(kb), key=lambda k: -abs(ka.get(k, [0, 0])[0] - kb.get(k, [0, 0])[0]))
    for name in names[:top]:
        x, y = ka.get(name, [0.0, 0]), kb.get(name, [0.0, 0])
        print(f"| `{name}` | {f * x[0]:.2f} | {x[1]:.1f} | {f * y[0]:.2f} | {y[1]:.1f} | {f * (x[0] - y[0]):+.2f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="48b-8l-32e")
    ap.add_argument("--batches", default="1,128")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--trace", type=int, default=0, help="also list the first N kernel launches in order")
    ap.add_argument("--engine", action="store_true", help="the engine's step beside generate's at batch 1 instead")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    model = build(args.model, torch.bfloat16 if device == "cuda" else torch.float32, device, args.smoke)
    bw = copy_bandwidth(device)
    print(f"## decode step profile: {args.model}, {device}, copy bandwidth {bw / 1e9:.0f} GB/s")
    if args.engine:
        engine_vs_generate(model, 64 if args.smoke else args.context, 3 if args.smoke else args.reps, args.top)
        return 0
    for b in [int(x) for x in args.batches.split(",")]:
        profile_batch(model, b, 64 if args.smoke else args.context, 3 if args.smoke else args.reps, args.top, bw,
                      args.trace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
