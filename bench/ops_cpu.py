"""CPU benchmark of ``chunk_kda``: ours vs transformers' pure-PyTorch Kimi Linear path, side by side.

    python bench/ops_cpu.py                 # B=1, T=4096, H=8, K=V=128, float32, 2 threads
    python bench/ops_cpu.py --T 1024 --reps 3

The anchor is ``transformers.models.kimi_linear.modeling_kimi_linear.chunk_kimi_delta_attention`` (what
transformers runs when fla is not installed). Both get the same inputs (l2-normalised q/k in kernel, log-sigmoid
gates, sigmoid betas). Prints a table of medians; paste it into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kimi_linear.ops import chunk_kda


def make_inputs(B: int, T: int, H: int, K: int, V: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=gen)
    return dict(q=rnd(B, T, H, K), k=rnd(B, T, H, K), v=rnd(B, T, H, V),
                g=F.logsigmoid(rnd(B, T, H, K)), beta=torch.sigmoid(rnd(B, T, H)))


def ours(x: dict[str, torch.Tensor]) -> torch.Tensor:
    return chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm_in_kernel=True)[0]


def anchor(x: dict[str, torch.Tensor]) -> torch.Tensor:
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    return chunk_kimi_delta_attention(x["q"], x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm_in_kernel=True)[0]


def timed(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def forward_backward(impl: Callable, x: dict[str, torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        leaves = {n: t.detach().requires_grad_() for n, t in x.items()}
        out = impl(leaves)
        out.backward(torch.ones_like(out))
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--H", type=int, default=8)
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--V", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5, help="repetitions of ours (median); the anchor gets --anchor-reps")
    p.add_argument("--anchor-reps", type=int, default=3)
    p.add_argument("--skip-anchor", action="store_true", help="time ours only")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    x = make_inputs(a.B, a.T, a.H, a.K, a.V)
    print(f"chunk_kda on CPU: B={a.B} T={a.T} H={a.H} K={a.K} V={a.V} float32, {a.threads} threads, "
          f"torch {torch.__version__}, {platform.processor() or platform.machine()}")
    with torch.no_grad():
        ours(x)  # warm up caches and allocator
    rows = []
    for name, impl, reps in (("ours", ours, a.reps), ("transformers", anchor, a.anchor_reps)):
        if name == "transformers" and a.skip_anchor:
            continue
        with torch.no_grad():
            fwd = timed(lambda impl=impl: impl(x), reps)
        fwd_bwd = timed(forward_backward(impl, x), reps)
        rows.append((name, fwd, fwd_bwd))
    print("| impl | forward (s) | forward+backward (s) | fwd speed-up | fwd+bwd speed-up |")
    print("|---|---|---|---|---|")
    base = rows[-1]
    for name, fwd, fb in rows:
        print(f"| {name} | {fwd:.3f} | {fb:.3f} | {base[1] / fwd:.1f}x | {base[2] / fb:.1f}x |")


if __name__ == "__main__":
    main()
