"""The decode GEMV (``ops.gemv``, one Triton kernel) against ``F.linear`` (cuBLAS) at Kimi-Linear-48B's decode
projections, so the layers can take whichever is faster (issue 18: a batch-1 step spends ~1 us of gap and a
reduction kernel on each of cuBLAS's split-K GEMVs).

    PYTHONPATH=src python3 bench/gemv_gpu.py              # one GPU, ~1 minute
    PYTHONPATH=src python3 bench/gemv_gpu.py --smoke      # CPU, Triton interpreter, tiny shapes

Per shape (rows M x in K -> out N; weights row- or column-major as the layers store them) and launch: the time of
one call with its weight cold in L2 (a CUDA graph of R calls over R copies of the weight, > 256 MB in all, median
replay / R), the bandwidth that makes over the weight bytes, and the error against float64 (bf16 bar 2^-8).
Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from itertools import cycle

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kimi_linear.ops.triton.gemv import gemv  # noqa: E402
from moe_gpu import capture, time_eager  # noqa: E402

# (name, K, N, column-major): the 48B model's decode projections (column-major: packed with more outputs than inputs)
SHAPES = [
    ("KDA / MLA o_proj", 4096, 2304, False),
    ("KDA packed q, k, v, f_a, g_a, b", 2304, 3 * 4096 + 128 + 128 + 32, True),
    ("MLA packed q, kv_a", 2304, 32 * 192 + 576, True),
    ("dense MLP down", 9216, 2304, False),
]
LAUNCHES = [(16, 256, 4, 4), (32, 256, 4, 4), (16, 512, 4, 3), (64, 128, 4, 4)]   # (BN, BK, warps, stages)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


def cold_us(fn, x: torch.Tensor, ws: list[torch.Tensor], dev: str, reps: int) -> float:
    """Microseconds of one ``fn(x, w)`` with w cold in L2: a graph of len(ws) calls, each on the next copy."""
    it = cycle(ws)
    replay, _ = capture(lambda: fn(x, next(it)), dev, calls=len(ws))
    return time_eager(replay, dev, reps) / len(ws)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    dev = "cpu" if a.smoke else "cuda"
    dt = torch.float32 if a.smoke else torch.bfloat16
    shapes = [(n, 64, 40, cm) for n, _, _, cm in SHAPES[:2]] if a.smoke else SHAPES
    launches = LAUNCHES[:1] if a.smoke else LAUNCHES
    rows = [1, 3] if a.smoke else [int(r) for r in a.rows.split(",")]
    gen = torch.Generator(dev).manual_seed(0)
    head = "| projection | M | K -> N | cuBLAS us | " + " | ".join(f"ours {lc} us" for lc in launches)
    out = [head + " | best / cuBLAS | best GB/s | max err |",
           "|---|---:|---|---:|" + "---:|" * len(launches) + "---:|---:|---:|"]
    for name, K, N, col in shapes:
        w0 = torch.randn(N, K, generator=gen, device=dev).div_(K**0.5).to(dt)
        R = 2 if a.smoke else max(2, (256 << 20) // w0.nbytes + 1)
        ws = [(w0.t().contiguous().t() if col else w0.clone()) for _ in range(R)]
        for M in rows:
            x = torch.randn(M, K, generator=gen, device=dev).to(dt)
            want = x.double() @ w0.double().t()

            base = cold_us(F.linear, x, ws, dev, a.reps)
            ours, err = [], 0.0
            for BN, BK, nw, ns in launches:
                ours.append(cold_us(partial(gemv, block_n=BN, block_k=BK, num_warps=nw, num_stages=ns), x, ws, dev,
                                    a.reps))
                err = max(err, rel(gemv(x, ws[0], BN, BK, nw, ns), want))
            best = min(ours)
            gbs = w0.nbytes / (best * 1e-6) / 1e9
            out.append(f"| {name} | {M} | {K} -> {N} | {base:.2f} | " + " | ".join(f"{t:.2f}" for t in ours)
                       + f" | {best / base:.2f} | {gbs:,.0f} | {err:.2e} |")
            print(out[-1], flush=True)
        ws = None
    print("\n" + "\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
