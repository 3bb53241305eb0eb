"""The KDA layer's decode token on a CUDA state pool (issue 18): the fused kernel (``ops.kda_decode``, with the
gates' up-projections folded in or given) against the layer's PyTorch-op path (short conv kernel, recurrent
kernel, gated norm kernel, batched gate product), checked and timed on Kimi-Linear-48B's layer shape (hidden
2304, 32 heads of 128, conv 4).

(a) Checks, float32 and bf16, batch 1, 5 and 64 (two padding rows on a scratch slot), 4 decode steps from random
    pool rows: outputs and the live rows' memories within max |error| / max |ref| <= 1e-5 (float32) / 2^-6
    (bf16: the paths round the gates and the conv output to bf16 at different points) of the PyTorch path; the
    pool rows that no row names bit-equal to before.
(b) Times in microseconds per layer call (projections included), 20 calls captured in one CUDA graph, median of
    repetitions, bf16, batch 1 / 16 / 128: fused with folded gates, fused given the gates, the PyTorch-op path.

    PYTHONPATH=src python3 bench/kda_decode_gpu.py            # (a) + (b); exit 1 if a check fails
    PYTHONPATH=src python3 bench/kda_decode_gpu.py --smoke    # CPU, Triton interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("KIMI_LINEAR_BACKEND", "triton")

import torch

import kimi_linear.layers.kda as kda_module
from kimi_linear.layers import KimiDeltaAttention
from kimi_linear.layers.kda import PooledKDAState


def layer(hidden: int, heads: int, dim: int, dtype: torch.dtype, device: str) -> KimiDeltaAttention:
    """A KDA layer with random weights (gates at the layer's initialisation), packed as decoding packs it."""
    torch.manual_seed(0)
    m = KimiDeltaAttention(hidden, num_heads=heads, head_dim=dim, conv_size=4)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
        m.o_norm.weight.uniform_(0.5, 1.5)
    m = m.to(device=device, dtype=dtype).eval()
    m.pack()
    return m


def run_path(m, path: str, x: torch.Tensor, conv: torch.Tensor, rec: torch.Tensor, slots: torch.Tensor,
             monkey: dict) -> torch.Tensor:
    """Decode x [B, T, hidden] token by token on pool rows ``slots`` through ``path``: 'fold', 'given', 'torch'."""
    old_rows, old_fused, old_op = kda_module.FOLD_GATE_ROWS, KimiDeltaAttention._decode_fused, kda_module.kda_decode
    kda_module.FOLD_GATE_ROWS = old_rows if path == "fold" else 0
    if path == "torch":
        KimiDeltaAttention._decode_fused = lambda *a, **kw: None

    def counted(*a, **kw):                     # which kernel ran: the fused one, folded or given the gates
        out = old_op(*a, **kw)
        monkey["folded" if kw.get("gate_weights") is not None else "given"] += out is not None
        return out
    kda_module.kda_decode = counted
    try:
        state = PooledKDAState(conv, rec, slots)
        with torch.no_grad():
            return torch.cat([m(x[:, t : t + 1], state) for t in range(x.shape[1])], 1)
    finally:
        kda_module.FOLD_GATE_ROWS, KimiDeltaAttention._decode_fused = old_rows, old_fused
        kda_module.kda_decode = old_op


def check(args, device: str) -> bool:
    ok = True
    for dtype, bar in ((torch.float32, 1e-5), (torch.bfloat16, 2**-6)):
        m = layer(args.hidden, args.heads, args.dim, dtype, device)
        C = 3 * args.heads * args.dim
        for B in args.check_batches:
            gen = torch.Generator(device=device).manual_seed(B)
            S = B + 6
            conv0 = torch.randn(S, 3, C, generator=gen, device=device).to(dtype)
            rec0 = torch.randn(S, args.heads, args.dim, args.dim, generator=gen, device=device) * 0.05
            live = torch.randperm(S - 1, generator=gen, device=device)[:B]
            slots = torch.cat([live, torch.full((2,), S - 1, device=device)])
            x = torch.randn(B + 2, 4, args.hidden, generator=gen, device=device).to(dtype)
            runs = {}
            for path in ("torch", "fold", "given"):
                conv, rec, ran = conv0.clone(), rec0.clone(), {"folded": 0, "given": 0}
                out = run_path(m, path, x, conv, rec, slots, ran)
                runs[path] = (out[:B].float(), rec[live], conv, rec)
                want = {"torch": (0, 0), "fold": (4, 0), "given": (0, 4)}[path]
                if (ran["folded"], ran["given"]) != want:
                    print(f"check B={B} {path}: the fused kernel ran {ran} times, expected {want}: FAIL")
                    ok = False
            ref_o, ref_rec = runs["torch"][0], runs["torch"][1]
            others = [s for s in range(S - 1) if s not in live.tolist()]
            for path in ("fold", "given"):
                o, r, conv, rec = runs[path]
                err_o = ((o - ref_o).abs().max() / ref_o.abs().max()).item()
                err_h = ((r - ref_rec).abs().max() / ref_rec.abs().max()).item()
                kept = torch.equal(conv[others], conv0[others]) and torch.equal(rec[others], rec0[others])
                good = err_o <= bar and err_h <= bar and kept
                ok &= good
                print(f"check {str(dtype)[6:]:8s} B={B:3d} {path:5s}: o {err_o:.2e}, memory {err_h:.2e} "
                      f"(bar {bar:.1e}), other rows untouched {kept}: {'PASS' if good else 'FAIL'}", flush=True)
    return ok


def time_us(m, path: str, B: int, args, device: str) -> float:
    """One layer call per decode token, 20 captured in a CUDA graph, median over repetitions (us per call)."""
    C, S = 3 * args.heads * args.dim, B + 1
    conv = torch.randn(S, 3, C, device=device, dtype=m.o_proj.weight.dtype)
    rec = torch.randn(S, args.heads, args.dim, args.dim, device=device) * 0.05
    slots = torch.arange(B, device=device)
    x = torch.randn(B, 1, args.hidden, device=device, dtype=m.o_proj.weight.dtype)
    old_rows, old_fused = kda_module.FOLD_GATE_ROWS, KimiDeltaAttention._decode_fused
    kda_module.FOLD_GATE_ROWS = 1 << 30 if path == "fold" else 0
    if path == "torch":
        KimiDeltaAttention._decode_fused = lambda *a, **kw: None
    try:
        state = PooledKDAState(conv, rec, slots)
        with torch.no_grad():
            for _ in range(3):
                m(x, state)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(20):
                    m(x, state)
    finally:
        kda_module.FOLD_GATE_ROWS, KimiDeltaAttention._decode_fused = old_rows, old_fused
    times = []
    for _ in range(args.reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / 20)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    args.hidden, args.heads, args.dim = (48, 2, 16) if args.smoke else (2304, 32, 128)
    args.check_batches = [1, 3] if args.smoke else [1, 5, 64]
    ok = check(args, device)
    if not args.smoke:
        m = layer(args.hidden, args.heads, args.dim, torch.bfloat16, device)
        print("\n| batch | fused, gates folded (us) | fused, gates given | PyTorch-op path |\n|---:|---:|---:|---:|")
        for B in (1, 16, 128):
            t = [time_us(copy.deepcopy(m), p, B, args, device) for p in ("fold", "given", "torch")]
            print(f"| {B} | {t[0]:.1f} | {t[1]:.1f} | {t[2]:.1f} |", flush=True)
    print("ALL CHECKS PASS" if ok else "SOME CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
