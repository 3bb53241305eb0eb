"""Fused mixture of experts (``kimi_linear.ops.fused_moe``, Triton) on the GPU, issue 18: checks, then timings.

(a) Checks, at the Kimi-Linear-48B expert shape (W=2304, I=1024, k=8) with E=32 and E=256, N = 1, 8, 32, 128,
    256, 2048: ours against the PyTorch MoE on the same bf16 values, for random routings (top-k of random scores),
    routings where one expert gets no token, and every token on the same k experts; SiTU; the SparseMoE layer
    (router + fused experts) eagerly and in a captured CUDA graph (static dispatch); the op captured once in a
    CUDA graph and replayed with new inputs and routings (must equal the eager op bit for bit). Reference: the
    PyTorch path (``fused_moe_torch``: sort, per-expert matmuls) in float32 on the bf16 values; bar: relative
    (norm-wise) error < 2^-8 = 3.9e-3 (bf16's unit roundoff: ours rounds the hidden and the output to bf16 once
    each). The PyTorch path in bf16 (the layer's own arithmetic) is printed beside it for scale.
(b) Timings, median over repetitions timed with CUDA events: ours in a CUDA graph (the decode engine's case) and
    eagerly; the dense static dispatch that CUDA graphs ran before (``SparseMoE._dense``, every expert on every
    row; up to N = 256) in a graph; the per-expert loop (``SparseMoE._one_token`` / ``_dispatch``, reads the
    routing on the host) eagerly; those two with the shared expert's PyTorch MLP added, as the layer adds it.
    Weight bandwidth = bytes of the distinct experts the routing chose (and the shared one) / time, against the
    measured copy bandwidth and the card's ~4.2 TB/s; TFLOP/s = 2 N (k + shared) 3 W I / time.
(c) ``--sweep``: a coordinate search over the launch shape (``MoELaunch``) at a few shapes, starting from the
    table (``moe_launch``); prints the best shape found per case, checked against the reference.

    PYTHONPATH=src python3 bench/moe_gpu.py [--json FILE]       # (a) + (b); exit 1 if a check fails
    PYTHONPATH=src python3 bench/moe_gpu.py --no-bench          # (a) only (bench/engine_gpu.py's part k)
    PYTHONPATH=src python3 bench/moe_gpu.py --sweep [--E 256 --N 1,32,256]   # (c), ~30 shapes per (E, N)
    PYTHONPATH=src python3 bench/moe_gpu.py --grid --E 32 --N 1   # (c) with each kernel's fields jointly, 36 shapes
    PYTHONPATH=src python3 bench/moe_gpu.py --no-tma             # (a) + (b) with pointer loads of the weights
    PYTHONPATH=src python3 bench/moe_gpu.py --smoke [--sweep]    # CPU, Triton interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from functools import partial

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

import kimi_linear.ops.moe as moe_op
from kimi_linear.layers import SparseMoE
from kimi_linear.ops import fused_moe
from kimi_linear.ops.moe import fused_moe_torch
from kimi_linear.ops.triton.moe import MoELaunch, moe_launch
from kimi_linear.ops.triton.moe import fused_moe as tri_fused_moe

BAR = 2.0**-8
CARD_TBPS = 4.2
ROWS: list[dict] = []


def say(*a) -> None:
    print(*a, flush=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def table(title: str, rows: list[dict]) -> None:
    if not rows:
        return
    cols = list(dict.fromkeys(c for r in rows for c in r))
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else ("" if v is None else str(v))
    say(f"\n### {title}\n")
    say("| " + " | ".join(cols) + " |")
    say("|" + "---|" * len(cols))
    for r in rows:
        say("| " + " | ".join(fmt(r.get(c)) for c in cols) + " |")


class Setup:
    """One MoE layer of E experts [2I, W] / [W, I] (bf16, packed), with ``shared`` (0 or 1) shared experts stacked
    after them as the layer packs them (one more pair per token in the fused op: Kimi Linear's layers have one),
    and float32 copies of its stacked weights for the reference."""

    def __init__(self, E: int, W: int, I: int, k: int, device: str, seed: int = 0, shared: int = 0) -> None:
        self.E, self.W, self.I, self.k, self.device = E, W, I, k, device
        with torch.device(device):
            moe = SparseMoE(W, I, E, k, num_shared_experts=shared, routed_scaling_factor=2.446)
        moe.experts.to(torch.bfloat16)
        if moe.shared_experts is not None:
            moe.shared_experts.to(torch.bfloat16)
        moe.pack()
        moe.requires_grad_(False).eval()
        self.moe = moe
        self.w13, self.w2, stacked = moe._packed_experts()
        self.shared = int(stacked)
        if self.shared != shared:
            raise RuntimeError(f"the layer stacked {self.shared} shared experts, asked for {shared}")
        self.gen = torch.Generator(device).manual_seed(seed)
        with torch.no_grad():
            self.w13.copy_(self.randn(self.w13.shape) / W**0.5)
            self.w2.copy_(self.randn(self.w2.shape) / I**0.5)
            moe.gate.weight.copy_(self.randn(moe.gate.weight.shape, torch.float32) / W**0.5)
        self.w13f, self.w2f = self.w13.float(), self.w2.float()

    def randn(self, shape, dtype=torch.bfloat16) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen, device=self.device).to(dtype)

    def routing(self, N: int, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights [N, k] float32, topk_ids [N, k] int64), duplicate-free per token. mode "random": top-k of
        uniform scores; "idle": expert 0 never chosen; "one": every token on experts 0..k-1 (shuffled)."""
        scores = torch.rand(N, self.E, generator=self.gen, device=self.device)
        if mode == "idle":
            scores[:, 0] = -1.0
        elif mode == "one":
            scores[:, : self.k] += 2.0
        ids = scores.topk(self.k, dim=-1).indices
        weights = torch.rand(N, self.k, generator=self.gen, device=self.device) + 0.1
        return weights, ids

    def distinct_bytes(self, ids: torch.Tensor) -> int:
        return (int(ids.unique().numel()) + self.shared) * 3 * self.W * self.I * self.w13.element_size()

    def op(self, x, weights, ids, fn=fused_moe, **kw) -> torch.Tensor:
        """``fn`` (the public op by default) on this layer's stacked experts."""
        return fn(x, self.w13, self.w2, weights, ids, num_shared=self.shared, **kw)

    def table_launch(self, N: int) -> MoELaunch:
        """The launch the op picks for N tokens (the shared experts are pairs and experts of their own)."""
        return moe_launch(N, self.k + self.shared, self.E + self.shared, self.W, self.I, torch.bfloat16)

    def reference(self, x, weights, ids, **act) -> torch.Tensor:
        return fused_moe_torch(x.float(), self.w13f, self.w2f, weights, ids, num_shared=self.shared, **act)


# ---------------------------------------------------------------------------------------------------- timing
def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_eager(fn, device: str, reps: int) -> float:
    """Median microseconds of fn() between CUDA events (host overhead included: the GPU waits for the host)."""
    fn()
    if device != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    sync(device)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def capture(fn, device: str, calls: int = 1):
    """fn called ``calls`` times in one CUDA graph after a warm-up on a side stream (compiles the kernels);
    returns (replay, output of the last call). On CPU the same contract without a graph: replay makes the calls
    again and copies a tensor result into that one output."""
    if device != "cuda":
        out = fn()

        def replay() -> None:
            for _ in range(calls):
                new = fn()
                if isinstance(out, torch.Tensor):
                    out.copy_(new)

        return replay, out
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            out = fn()
    return graph.replay, out


def time_graph(fn, device: str, reps: int) -> float:
    replay, _ = capture(fn, device)
    return time_eager(replay, device, reps)


def copy_bandwidth(device: str) -> float:
    """TB/s of a 512 MiB device-to-device copy (read + write)."""
    if device != "cuda":
        return 0.0
    x = torch.empty(1 << 29, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    us = time_eager(lambda: y.copy_(x), device, 20)
    return 2 * x.numel() / us / 1e6


# ----------------------------------------------------------------------------------------------------- checks
def check_routings(s: Setup, Ns: list[int], modes: list[str], act: dict) -> bool:
    ok_all = True
    rows = []
    for N in Ns:
        for mode in modes:
            x = s.randn((N, s.W))
            weights, ids = s.routing(N, mode)
            with torch.inference_mode():
                ours = s.op(x, weights, ids, **act)
                ref = s.reference(x, weights, ids, **act)
                torch_bf16 = s.op(x, weights, ids, fn=fused_moe_torch, **act)
            err = rel(ours, ref)
            ok = err < BAR and bool(torch.isfinite(ours).all())
            ok_all &= ok
            rows.append(dict(E=s.E, N=N, routing=mode, act=act.get("activation", "silu"),
                             experts=int(ids.unique().numel()), **{"ours err": err, "torch bf16 err":
                                                                   rel(torch_bf16, ref), "ok": "ok" if ok else "FAIL"}))
    table(f"check: fused vs PyTorch (float32 reference on bf16 values), E={s.E}, bar {BAR:.2g}", rows)
    ROWS.extend(dict(check="routing", **r) for r in rows)
    return ok_all


def check_graph(s: Setup, Ns: list[int]) -> bool:
    """The op captured once per N with static inputs, replayed with three new inputs and routings (random, idle,
    one): equal to the eager op bit for bit, and within the bar of the reference. Then the SparseMoE layer with
    static_dispatch (the engine's CUDA-graph step) the same way."""
    ok_all = True
    rows = []
    for N in Ns:
        x = s.randn((N, s.W))
        weights, ids = s.routing(N, "random")
        with torch.inference_mode():
            replay, out = capture(partial(s.op, x, weights, ids), s.device)
            for mode in ("random", "idle", "one"):
                w_new, ids_new = s.routing(N, mode)
                x.copy_(s.randn((N, s.W)))
                weights.copy_(w_new)
                ids.copy_(ids_new)
                replay()
                sync(s.device)
                eager = s.op(x, weights, ids)
                err = rel(out, s.reference(x, weights, ids))
                ok = bool(torch.equal(out, eager)) and err < BAR
                ok_all &= ok
                rows.append(dict(what="op", E=s.E, N=N, routing=mode, **{"== eager": torch.equal(out, eager),
                                                                           "err": err, "ok": "ok" if ok else "FAIL"}))
            # the layer: router + routed experts, static dispatch, captured
            s.moe.static_dispatch = True
            try:
                replay, out = capture(partial(s.moe, x), s.device)
                for _ in range(2):
                    x.copy_(s.randn((N, s.W)))
                    replay()
                    sync(s.device)
                    w_l, ids_l = s.moe.gate(x)
                    err = rel(out, s.reference(x, w_l, ids_l))
                    eager = s.moe(x)
                    ok = bool(torch.equal(out, eager)) and err < BAR
                    ok_all &= ok
                    rows.append(dict(what="layer static", E=s.E, N=N, routing="router",
                                     **{"== eager": torch.equal(out, eager), "err": err, "ok": "ok" if ok else "FAIL"}))
            finally:
                s.moe.static_dispatch = False
            # and the eager layer (its normal path) against the reference
            x.copy_(s.randn((N, s.W)))
            w_l, ids_l = s.moe.gate(x)
            err = rel(s.moe(x), s.reference(x, w_l, ids_l))
            ok_all &= err < BAR
            rows.append(dict(what="layer eager", E=s.E, N=N, routing="router",
                             **{"== eager": None, "err": err, "ok": "ok" if err < BAR else "FAIL"}))
    table(f"check: CUDA graph capture and the SparseMoE layer, E={s.E}", rows)
    ROWS.extend(dict(check="graph", **r) for r in rows)
    return ok_all


# ----------------------------------------------------------------------------------------------------- timing
def loop_path(moe: SparseMoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The layer's routed paths before the fused op: one token through its k experts, or sorted per expert."""
    if x.shape[0] == 1:
        return moe._one_token(x, weights, ids)
    out = torch.zeros_like(x)
    moe._dispatch(x, weights, ids, out)
    return out


def plus_shared(s: Setup, routed: Callable[..., torch.Tensor], x: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor) -> torch.Tensor:
    """A routed-only path's output plus the shared expert's, as the layer adds it: the same work as the fused op,
    which runs the shared expert as one more pair."""
    out = routed(s.moe, x, weights, ids)
    return out + s.moe.shared_experts(x) if s.shared else out


def bench(s: Setup, Ns: list[int], bw: float, reps: int, dense_max: int) -> None:
    rows = []
    for N in Ns:
        x = s.randn((N, s.W))
        weights, ids = s.routing(N, "random")
        nbytes = s.distinct_bytes(ids)
        flops = 2 * N * (s.k + s.shared) * 3 * s.W * s.I
        ours = partial(s.op, x, weights, ids)
        with torch.inference_mode():
            ours_g = time_graph(ours, s.device, reps)
            ours_e = time_eager(ours, s.device, reps)
            dense = (time_graph(partial(plus_shared, s, SparseMoE._dense, x, weights, ids), s.device,
                                max(3, reps // 4)) if N <= dense_max else None)
            looped = time_eager(partial(plus_shared, s, loop_path, x, weights, ids), s.device, max(3, reps // 4))
        gbs = nbytes / ours_g / 1e3
        r = {"E": s.E, "N": N, "experts read": int(ids.unique().numel()), "weights MB": nbytes / 1e6,
             "ours graph us": ours_g, "GB/s": gbs, "% copy bw": 100 * gbs / 1e3 / bw if bw else None,
             f"% {CARD_TBPS} TB/s": 100 * gbs / 1e3 / CARD_TBPS, "TFLOP/s": flops / ours_g / 1e6,
             "ours eager us": ours_e, "dense graph us": dense, "loop eager us": looped,
             "x vs dense": dense / ours_g if dense else None, "x vs loop": looped / ours_g,
             "launch": "BM{BM} BN{BN1}/{BN2} BK{BK1}/{BK2} w{warps1}/{warps2} s{stages1}/{stages2} tma {tma}".format(
                 **asdict(s.table_launch(N)))}
        rows.append(r)
        say(json.dumps(r))
    table(f"time: routed experts{' and the shared one' if s.shared else ''}, bf16, W={s.W} I={s.I} k={s.k} E={s.E} "
          "(median of CUDA-event timings)", rows)
    ROWS.extend(dict(bench="moe", **r) for r in rows)


SWEEP = dict(tma=[False, True], BM=[16, 32, 64, 128], BN1=[32, 64, 128], BK1=[64, 128, 256], warps1=[4, 8],
             stages1=[2, 3, 4, 5],
             BN2=[32, 64, 128, 256], BK2=[64, 128, 256], warps2=[4, 8], stages2=[2, 3, 4, 5])


def time_sweep_point(s: Setup, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, reps: int,
                     cfg: MoELaunch) -> float:
    return time_graph(partial(s.op, x, weights, ids, fn=tri_fused_moe, launch=cfg), s.device, reps)


def time_or_skip(timed: Callable[[MoELaunch], float], cfg: MoELaunch) -> float | None:
    """``timed(cfg)``, or None (said) for a shape that fails to compile or run, e.g. out of shared memory."""
    try:
        return timed(cfg)
    except Exception as e:  # noqa: BLE001 - not a candidate
        say(f"  skip {cfg}: {type(e).__name__}: {str(e)[:120]}")
        return None


def best_error(s: Setup, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, ref: torch.Tensor,
               best: MoELaunch) -> float:
    """The search's best shape against the reference (relative error)."""
    with torch.inference_mode():
        return rel(s.op(x, weights, ids, fn=tri_fused_moe, launch=best), ref)


def sweep(s: Setup, Ns: list[int], reps: int, smoke: bool) -> bool:
    """One pass of coordinate search per N: each field of MoELaunch in turn over its candidates, keeping the best;
    a shape that fails to compile or run is skipped. The best is checked against the reference."""
    rows, ok_all = [], True
    space = {k: v[:2] for k, v in SWEEP.items()} if smoke else SWEEP
    for N in Ns:
        x = s.randn((N, s.W))
        weights, ids = s.routing(N, "random")
        ref = s.reference(x, weights, ids)

        timed = partial(time_sweep_point, s, x, weights, ids, reps)

        start = s.table_launch(N)
        best, best_t = start, timed(start)
        t0 = best_t
        for field, values in space.items():
            for v in values:
                cfg = replace(best, **{field: v})
                if cfg == best:
                    continue
                t = time_or_skip(timed, cfg)
                if t is None:
                    continue
                if t < best_t:
                    best, best_t = cfg, t
        err = best_error(s, x, weights, ids, ref, best)
        ok_all &= err < BAR
        r = {"E": s.E, "N": N, "table us": t0, "best us": best_t, "speedup": t0 / best_t, "err": err,
             "ok": "ok" if err < BAR else "FAIL", "best": str(asdict(best)),
             "GB/s": s.distinct_bytes(ids) / best_t / 1e3}
        rows.append(r)
        say(json.dumps(r))
    table(f"sweep: E={s.E}", rows)
    ROWS.extend(dict(sweep="moe", **r) for r in rows)
    return ok_all

# --grid: each kernel's fields jointly (a coordinate search moves one field at a time and can miss pairs that only
# pay together, e.g. fewer stages so that two programs share an SM, with the tile size that fills the grid then)
GRID = (dict(BN1=[16, 32, 64, 128], BK1=[128, 256], stages1=[2, 3, 4]),
        dict(BN2=[16, 32, 64, 128], BK2=[128, 256], stages2=[2, 3, 4]))


def grid(s: Setup, Ns: list[int], reps: int, smoke: bool) -> bool:
    """Per N: every gate/up shape of GRID with the table's down shape, then every down shape with the best gate/up
    one; each row with its programs per kernel (pairs' blocks x column tiles) against the SMs. The best is checked
    against the reference."""
    from itertools import product

    rows, ok_all = [], True
    sms = torch.cuda.get_device_properties(0).multi_processor_count if s.device == "cuda" else 1
    for N in Ns:
        x = s.randn((N, s.W))
        weights, ids = s.routing(N, "random")
        ref = s.reference(x, weights, ids)
        best = s.table_launch(N)
        best_t = time_sweep_point(s, x, weights, ids, reps, best)
        blocks = s.k + s.shared if N == 1 else None     # the one-token layout: one block a pair
        for space in GRID:
            space = {k: v[:2] for k, v in space.items()} if smoke else space
            start = best
            for values in product(*space.values()):
                cfg = replace(start, **dict(zip(space, values)))
                t = time_or_skip(partial(time_sweep_point, s, x, weights, ids, reps), cfg)
                if t is None:
                    continue
                up = "BN1" in space
                BN, BK, stages = values
                cols = -(-(s.I if up else s.W) // BN)
                rows.append({"E": s.E, "N": N, "kernel": "gate/up" if up else "down", "BN": BN, "BK": BK,
                             "stages": stages, "op us": t,
                             "programs": "" if blocks is None else f"{blocks * cols} on {sms} SMs"})
                say(json.dumps(rows[-1]))
                if t < best_t:
                    best, best_t = cfg, t
        err = best_error(s, x, weights, ids, ref, best)
        ok_all &= err < BAR
        say(f"best at E={s.E} N={N}: {best_t:.1f} us, {asdict(best)}, err {err:.2e} {'ok' if err < BAR else 'FAIL'}")
    table(f"grid: E={s.E}", rows)
    ROWS.extend(dict(grid="moe", **r) for r in rows)
    return ok_all


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU under the Triton interpreter, tiny shapes")
    p.add_argument("--sweep", action="store_true", help="only the launch-shape sweep (c)")
    p.add_argument("--grid", action="store_true",
                   help="only a joint grid over each kernel's tile / step / stages (GRID), at --E and --N")
    p.add_argument("--json", default=None, help="also write every row to this file")
    p.add_argument("--no-bench", action="store_true", help="the checks (a) only, no timings")
    p.add_argument("--no-tma", action="store_true",
                   help="every launch with pointer loads of the weights instead of the TMA descriptors "
                        "(MoELaunch.tma=False), checks included: the A/B of the default")
    p.add_argument("--E", default=None, help="comma-separated expert counts (default 32,256; sweep: 256)")
    p.add_argument("--shared", type=int, choices=(0, 1), default=1,
                   help="shared experts stacked after the routed ones, one more pair per token (default 1, as in "
                        "Kimi Linear's MoE layers; 0: routed experts alone, the tables before 2026-12-04)")
    p.add_argument("--N", default=None, help="comma-separated token counts (default 1,8,32,128,256,2048; "
                                              "sweep: 1,32,256)")
    a = p.parse_args()
    ints = lambda v: [int(t) for t in v.split(",")]
    if a.no_tma:
        # fused_moe reads the table through its module's global: every path (op, layer, graph) gets pointer loads
        import kimi_linear.ops.triton.moe as tri_moe

        table_launch = tri_moe.moe_launch
        tri_moe.moe_launch = lambda *args: replace(table_launch(*args), tma=False)
        globals()["moe_launch"] = tri_moe.moe_launch            # the rows report what ran
    torch.backends.cuda.matmul.allow_tf32 = False          # the float32 reference in float32
    if a.smoke:
        device, W, I, k, Es = "cpu", 64, 32, 2, [4, 8]
        Ns, graph_Ns, reps, sweep_Es, sweep_Ns = [1, 5], [3], 1, [4], [1, 5]
        # CPU tensors take the PyTorch path; run the Triton kernels (interpreter) in their place, as a GPU would
        moe_op.triton_op = lambda name, x: tri_fused_moe if name == "fused_moe" else None
    else:
        if not torch.cuda.is_available():
            say("no CUDA device (use --smoke on CPU)")
            return 1
        device, W, I, k, Es = "cuda", 2304, 1024, 8, [32, 256]
        Ns, graph_Ns, reps, sweep_Es, sweep_Ns = [1, 8, 32, 128, 256, 2048], [1, 8, 256], 50, [256], [1, 32, 256]
        say(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    import triton

    say(f"triton {triton.__version__}")
    ok = True
    if a.sweep or a.grid:
        for E in ints(a.E) if a.E else sweep_Es:
            s = Setup(E, W, I, k, device, shared=a.shared)
            ok &= (grid if a.grid else sweep)(s, ints(a.N) if a.N else sweep_Ns, max(reps // 2, 1), a.smoke)
            del s
    else:
        bw = copy_bandwidth(device)
        if bw:
            say(f"copy bandwidth: {bw:.2f} TB/s")
        Es, Ns = ints(a.E) if a.E else Es, ints(a.N) if a.N else Ns
        for E in Es:
            s = Setup(E, W, I, k, device, shared=a.shared)
            ok &= check_routings(s, Ns, ["random", "idle", "one"], {})
            if E == Es[-1]:
                situ = {"activation": "situ", "situ_beta": 4.0, "situ_linear_beta": 25.0}
                ok &= check_routings(s, sorted({Ns[0], Ns[len(Ns) // 2], Ns[-1]}), ["random"], situ)
            ok &= check_graph(s, graph_Ns)
            if not a.no_bench:
                bench(s, Ns, bw, reps, dense_max=256)
            del s
            if device == "cuda":
                torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(ROWS, f, indent=1)
    say("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
