"""A decode step's dense projections on the GPU: ``kimi_linear.ops.gemv`` (Triton, TMA, PDL) against cuBLAS
(``F.linear``) on the shapes the 8-layer 48B-shaped model projects at batch 1, then 8 and 16 rows.

The shapes are recorded from one decode forward of the model (every call of ``ops.gemv``: packed projections of
the KDA and MLA layers, the output projections, the dense MLP, the KDA gates' second factors, the LM head). Each
is checked against float64 (relative max error < 8e-3: one bf16 rounding of a float32 sum) and timed as a CUDA
graph of calls over rotating copies of the weight (more bytes than L2 holds, so every call streams from HBM),
median of repetitions per call. Bandwidth = weight bytes / time, beside the copy bandwidth of the same run.

    PYTHONPATH=src python3 bench/gemv_gpu.py                  # table; exit 1 if a check fails
    PYTHONPATH=src python3 bench/gemv_gpu.py --sweep          # also each shape's best launch at one row
    PYTHONPATH=src python3 bench/gemv_gpu.py --smoke          # CPU, interpreter, tiny preset (checks the script)
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from dataclasses import replace

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("KIMI_LINEAR_BACKEND", "triton")

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import kimi_linear.layers.linear as linear_mod  # noqa: E402
from engine_gpu import build  # noqa: E402
from kimi_linear.ops.triton import decode_gemv  # noqa: E402
from moe_gpu import capture, copy_bandwidth, time_eager  # noqa: E402

BAR = 8e-3
L2_BYTES = 60 << 20
SWEEP = dict(BN=[16, 32, 64], BK=[128, 256], stages=[3, 4, 6], warps=[4, 8])


def say(*a) -> None:
    print(*a, flush=True)


def step_shapes(model, device: str) -> list[tuple[int, int]]:
    """(N, K) of every projection one batch-1 decode forward makes through ``ops.gemv``, in order, distinct."""
    seen: list[tuple[int, int]] = []
    real = linear_mod.gemv

    def record(x, w):
        if (w.shape[0], w.shape[1]) not in seen:
            seen.append((w.shape[0], w.shape[1]))
        return real(x, w)

    linear_mod.gemv = record
    try:
        with torch.inference_mode():
            cache = model.new_cache(1)
            ids = torch.randint(0, model.config.vocab_size, (1, 4), device=device)
            model(ids, cache=cache)
            seen.clear()
            model(ids[:, -1:], cache=cache)
    finally:
        linear_mod.gemv = real
    # on the CPU (--smoke) the layers take F.linear and record nothing: two small shapes check the script
    return seen or [(48, 64), (40, 96)]


def timed_us(fn_of_w, weights: list[torch.Tensor], device: str, reps: int) -> float:
    """Per-call microseconds of a graph that calls ``fn_of_w`` once on each of ``weights`` (rotating copies)."""
    replay, _ = capture(lambda: [fn_of_w(w) for w in weights][-1], device)
    return time_eager(replay, device, reps) / len(weights)


def copies(w: torch.Tensor, device: str) -> list[torch.Tensor]:
    n = 1 if device != "cuda" else max(2, -(-2 * L2_BYTES // (w.numel() * w.element_size())))
    return [w] + [w.clone() for _ in range(min(n, 64) - 1)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also search each shape's launch at one row")
    ap.add_argument("--rows", default="1,8,16")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    reps = 2 if args.smoke else args.reps
    torch.manual_seed(0)
    model = build("tiny" if args.smoke else "48b-8l-32e", torch.bfloat16, device, args.smoke)
    shapes = step_shapes(model, device)
    del model
    bw = copy_bandwidth(device)
    say(f"## decode projections, {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, "
        f"copy bandwidth {bw:.2f} TB/s\n")
    say("| N x K | rows | MB | cuBLAS us | ours us | cuBLAS TB/s | ours TB/s | ours / cuBLAS | err | check |")
    say("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    ok_all = True
    for N, K in shapes:
        w = (torch.randn(N, K, device=device) / K**0.5).bfloat16()
        ws = copies(w, device)
        mb = w.numel() * 2 / 1e6
        for M in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(M, K, device=device).bfloat16()
            with torch.inference_mode():
                got = decode_gemv.gemv(x, w)
            ref = x.double() @ w.double().t()
            err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
            ok = err < BAR
            ok_all &= ok
            t_cub = timed_us(lambda w_, x=x: F.linear(x, w_), ws, device, reps)
            t_our = timed_us(lambda w_, x=x: decode_gemv.gemv(x, w_), ws, device, reps)
            say(f"| {N} x {K} | {M} | {mb:.1f} | {t_cub:.1f} | {t_our:.1f} | {mb / t_cub:.2f} | {mb / t_our:.2f} | "
                f"{t_our / t_cub:.2f} | {err:.1e} | {'ok' if ok else 'FAIL'} |")
    if args.sweep:
        say("\n### launch search at one row (joint grid)\n")
        say("| N x K | default us | best us | best launch |")
        say("|---|---:|---:|---|")
        space = {k: v[:2] for k, v in SWEEP.items()} if args.smoke else SWEEP
        for N, K in shapes:
            w = (torch.randn(N, K, device=device) / K**0.5).bfloat16()
            ws = copies(w, device)
            x = torch.randn(1, K, device=device).bfloat16()
            base = timed_us(lambda w_, x=x: decode_gemv.gemv(x, w_), ws, device, reps)
            best, best_t = decode_gemv.LAUNCH, base
            for values in itertools.product(*space.values()):
                cfg = replace(decode_gemv.LAUNCH, **dict(zip(space, values)))
                try:
                    t = timed_us(lambda w_, c=cfg, x=x: decode_gemv.gemv(x, w_, c), ws, device, reps)
                except Exception as e:  # noqa: BLE001 - a shape that does not fit is no candidate
                    say(f"  skip {cfg}: {type(e).__name__}")
                    continue
                if t < best_t:
                    best, best_t = cfg, t
            say(f"| {N} x {K} | {base:.1f} | {best_t:.1f} | {best} |")
    say("\nall checks passed" if ok_all else "\nCHECK FAILED")
    return 0 if ok_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
