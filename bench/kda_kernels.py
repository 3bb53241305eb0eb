# Timed lambdas close over loop variables on purpose: each is called (and finished) inside its own iteration.
# ruff: noqa: B023
"""KDA kernels on one GPU: ours (Triton) vs fla-core 0.6 vs PyTorch SDPA causal, plus the card's ceilings.

    python bench/kda_kernels.py                          # timings: one table (ms, tokens/s, fla/ours, % of floor)
    python bench/kda_kernels.py --check                  # correctness at full size on the GPU (no timings)
    python bench/kda_kernels.py --check --bench --profile --no-decode --budget 240    # the issue-4 run, < 5 min
    python bench/kda_kernels.py --smoke                  # CPU + Triton interpreter, tiny shapes: this script's logic
    python bench/kda_kernels.py --offline-sm90           # no GPU: compile every pipeline kernel for sm_90, regs/spills
    python bench/kda_kernels.py --offline-sm90 --kernel scores --sass-dir /tmp/sass   # and keep their SASS
    python bench/kda_kernels.py --regimes                # every gate regime (mild to strong) beside fla, worst last
    python bench/kda_kernels.py --regimes --profile      # and each regime's per-kernel times, ours and fla's
    python bench/kda_kernels.py --sweep                  # per-kernel times of launch configs (how defaults are set)
    python bench/kda_kernels.py --config '{"scores_bks": 64}' --check --bench    # every step under another config

Shapes (BENCHMARKS.md, KDA kernels on the H200): bf16, H=32, K=V=128; chunk forward and forward+backward at 16 x 2048
and 1 x 32768 tokens with l2norm, gate and beta sigmoid in kernel, once with the softplus gate (fla: the same) and
once with the ``lower_bound=-5`` gate (fla: ``safe_gate=True, lower_bound=-5``); the decode step at batch 1 and 256
(plain launch and CUDA-graph replay, which is how a server runs it). Floors: bytes moved once over the copy bandwidth
measured in this run, FLOPs (6 T d^2 per head forward, 3x that with the backward) over the bf16 matmul rate measured
in this run; the larger of the two. fla comes from the carried wheel (see BENCHMARKS.md for the command).

Steps run in priority order (checks of the default chunk path and its timings first, then the 1M-token check,
every gate regime's gradients, the profile, varlen, SDPA, decode); each step is fenced (a failure is printed and the
next step runs) and, with ``--budget``, steps that would start after the budget are skipped and listed, so a run
always ends with its table.
``kernels.log`` and ``kernels.json`` are rewritten after every step (``--out``, default $OUT).

Timings are medians of ``triton.testing.do_bench`` (events; median mode) or of CUDA-graph replays.
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:                                   # before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import replace  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kimi_linear.ops as kops  # noqa: E402
import kimi_linear.ops.triton.chunk as tri_chunk  # noqa: E402
from kimi_linear.ops.gate import KernelOptions  # noqa: E402
from kimi_linear.ops.triton.chunk import ChunkKDAFunction, chunk_kda_fwd  # noqa: E402
from kimi_linear.ops.triton.chunk_pipeline import (  # noqa: E402
    DEFAULT_CONFIG,
    LaunchConfig,
    chunk_kda_bwd_pipeline,
    chunk_kda_fwd_keeping,
)
from kimi_linear.ops.triton.recurrent import fused_recurrent_kda as tri_recurrent  # noqa: E402


class Setup:
    """Device and sizes: the H200 shapes, or tiny CPU shapes for ``--smoke``."""

    def __init__(self, smoke: bool):
        self.smoke = smoke
        self.dev = "cpu" if smoke else "cuda"
        self.H, self.D = (1, 32) if smoke else (32, 128)
        self.shapes = ((1, 70), (1, 66)) if smoke else ((16, 2048), (1, 32768))
        self.million = (130, 1) if smoke else (1 << 20, 4)          # (tokens, heads)
        self.varlen = ([0, 1, 2, 70, 71, 90] if smoke else [0, 1, 2, 1000, 1001, 5000, 8192], 2 if smoke else 16)


S = Setup(False)
ROWS: list[dict] = []
LOG: list[str] = []
OUT = "."
START = time.time()
BUDGET = 0.0                                                    # seconds from START; 0: no budget
SASS_DIR = ""                                                   # --sass-dir: --offline-sm90 writes each kernel's SASS
SASS_KERNEL = ""                                                # --kernel: --offline-sm90 compiles only these
NO_FLA = False                                                  # --no-fla: no anchor columns (saves its compile)
TRAIN_OPTS: dict = {}                  # --disable-recompute: chunk_kda options of the forward + backward rows
NO_BACKWARD = False                                             # --no-backward: forward steps and sweep rows only


def over_budget() -> bool:
    return bool(BUDGET) and time.time() - START > BUDGET


def say(*a):
    line = " ".join(str(x) for x in a)
    print(line, flush=True)
    LOG.append(line)


def save() -> None:
    with open(os.path.join(OUT, "kernels.log"), "w") as f:
        f.write("\n".join(LOG) + "\n")
    with open(os.path.join(OUT, "kernels.json"), "w") as f:
        json.dump(ROWS, f, indent=1)


def sync():
    if S.dev == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, rep: int = 100) -> float:
    if S.smoke:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def graph_ms(fn, calls: int = 20, replays: int = 20) -> float:
    """Median per-call time of ``calls`` back-to-back calls captured in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return statistics.median(times)


@contextlib.contextmanager
def torch_backend():
    """Run the public ops on their PyTorch path (the reference) inside the block."""
    old = os.environ.get("KIMI_LINEAR_BACKEND")
    os.environ["KIMI_LINEAR_BACKEND"] = "torch"
    try:
        yield
    finally:
        if old is None:
            del os.environ["KIMI_LINEAR_BACKEND"]
        else:
            os.environ["KIMI_LINEAR_BACKEND"] = old


class Poison:
    """torch.empty returns NaN-filled floating memory inside the block: unwritten outputs show up."""

    def __enter__(self):
        self.real = torch.empty

        def empty(*a, **kw):
            t = self.real(*a, **kw)
            return t.fill_(float("nan")) if t.is_floating_point() else t
        torch.empty = empty

    def __exit__(self, *exc):
        torch.empty = self.real


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-20)).item()


def fla_ops():
    if S.smoke or NO_FLA:
        return None, None
    try:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
        return chunk_kda, fused_recurrent_kda
    except Exception as e:  # noqa: BLE001 - report and carry on without the anchor
        say(f"fla not importable ({type(e).__name__}: {e}); fla columns left empty")
        return None, None


def make(B: int, T: int, h: int | None = None, hv: int | None = None, dtype=torch.bfloat16, seed: int = 0,
         lb: bool = False):
    """Raw inputs for the in-kernel options: q, k, v, raw gate, beta logits; gate parameters."""
    h = h or S.H
    hv = hv or h
    D = S.D
    gen = torch.Generator(device=S.dev).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=S.dev)
    x = dict(q=rnd(B, T, h, D).to(dtype), k=rnd(B, T, h, D).to(dtype), v=rnd(B, T, hv, D).to(dtype),
             g=rnd(B, T, hv, D).to(dtype), beta=rnd(B, T, hv).to(dtype))
    x["A_log"] = (rnd(hv) * 0.5).float()
    x["dt_bias"] = (rnd(hv * D) * 0.5 - (4.0 if lb else 0.0)).float()
    return x


# Gate regimes from mild to strong (issue 20): name -> (A_log, dt_bias) draws for HV heads of width D, and whether
# the gate is K3's lower_bound form. The raw gate g ~ N(0, 1) in every row.
def _softplus_inv(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))


REGIMES = {
    "bench (A_log, dt_bias ~ 0.5 N)": (lambda gen, hv, D: (0.5 * torch.randn(hv, generator=gen),
                                                           0.5 * torch.randn(hv * D, generator=gen)), False),
    "layer init": (lambda gen, hv, D: (torch.empty(hv).uniform_(1, 16, generator=gen).log(),
                                       _softplus_inv(torch.empty(hv * D).uniform_(1e-3, 0.1, generator=gen))), False),
    "strong decay": (lambda gen, hv, D: (torch.empty(hv).uniform_(1, 16, generator=gen).log(),
                                         0.1 * torch.randn(hv * D, generator=gen)), False),
    "lower_bound -5, dt_bias ~ 0": (lambda gen, hv, D: (0.5 * torch.randn(hv, generator=gen),
                                                        0.1 * torch.randn(hv * D, generator=gen)), True),
    "lower_bound -5, active gates": (lambda gen, hv, D: (0.5 * torch.randn(hv, generator=gen),
                                                         0.5 * torch.randn(hv * D, generator=gen) - 4.0), True),
}


def make_regime(B: int, T: int, regime: str, seed: int = 0):
    """``make``'s inputs with the gate parameters of ``regime`` (REGIMES); returns (x, lower_bound flag)."""
    x = make(B, T, seed=seed)
    draw, lb = REGIMES[regime]
    A_log, dt_bias = draw(torch.Generator().manual_seed(seed + 1), x["v"].shape[2], S.D)
    x["A_log"], x["dt_bias"] = A_log.float().to(S.dev), dt_bias.float().to(S.dev)
    return x, lb


def mean_log_decay(x, lb: bool) -> float:
    """Mean per-step log decay of the regime's gate (what makes a chunk strong or mild)."""
    g = kops.fused_kda_gate(x["g"].float(), x["A_log"], x["dt_bias"], -5.0 if lb else None)
    return float(g.mean())


# Issue 20's goals for the grid: every regime's forward >= 1.3x fla and forward + backward >= 1.2x, and the median
# regime's forward >= 1.7x
REGIME_GOALS = {"fwd": 1.3, "fwd+bwd": 1.2}
MEDIAN_GOAL = 1.7


def regime_summary(ratios: dict[str, list[tuple[float, str]]]) -> list[str]:
    """The grid against REGIME_GOALS and MEDIAN_GOAL: per pass ("fwd", "fwd+bwd"), from its (fla / ours, row)
    pairs, the worst row, the median and how many rows meet the pass's bar."""
    lines = []
    for step, rs in ratios.items():
        if not rs:
            continue
        worst = min(rs)
        median = statistics.median(r for r, _ in rs)
        met = sum(r >= REGIME_GOALS[step] for r, _ in rs)
        line = (f"  {step}: worst {worst[0]:.2f}x fla ({worst[1]}), median {median:.2f}x; {met} of {len(rs)} rows "
                f">= {REGIME_GOALS[step]}x")
        if step == "fwd":
            line += f"; median >= {MEDIAN_GOAL}x: {'met' if median >= MEDIAN_GOAL else 'missed'}"
        lines.append(line)
    return lines


def bench_regimes(bw: float, tf: float, fla_chunk, backward: bool) -> None:
    """Forward of every gate regime at both shapes beside fla, then (``backward``) forward+backward of each: a
    budget that ends the run early cuts the backward rows, whose compilation and fla's autotuning take longest,
    and leaves the whole forward grid. Last, the rows against issue 20's goals (:func:`regime_summary`)."""
    ratios: dict[str, list[tuple[float, str]]] = {"fwd": [], "fwd+bwd": []}
    for pass_backward in (False, True) if backward else (False,):
        for B, T in S.shapes:
            for regime in REGIMES:
                if over_budget():
                    say(f"  regimes: {'fwd+bwd' if pass_backward else 'fwd'} {B}x{T} {regime} skipped (over the "
                        "time budget)")
                    continue
                x, lb = make_regime(B, T, regime)
                what = f"{B}x{T} {regime} (mean log decay {mean_log_decay(x, lb):.2f})"
                ms, fla_ms = chunk_ms(x, lb, fla_chunk, pass_backward)
                step = ("fwd+bwd" + (" disable_recompute" if TRAIN_OPTS else "")) if pass_backward else "fwd"
                row(f"regime {step} {what}", ms, B * T, fla_ms,
                    chunk_floor(B * T, bw, tf, pass_backward))
                if fla_ms is not None:
                    ratios["fwd+bwd" if pass_backward else "fwd"].append((fla_ms / ms, what))
                save()
    for line in regime_summary(ratios):
        say(line)


def profile_regimes(fla_chunk, backward: bool) -> None:
    """Per-kernel times (CUDA profiler) of the forward (and forward+backward) of every gate regime at the first
    shape, ours and fla's: which kernels' speed depends on the gate."""
    B, T = S.shapes[0]
    for regime in REGIMES:
        if over_budget():
            say(f"  regime profile: {regime} skipped (over the time budget)")
            continue
        x, lb = make_regime(B, T, regime)
        runs = [("ours fwd", lambda: kops.chunk_kda(*args5(x), output_final_state=True, **opts(x, lb)))]
        if fla_chunk is not None:
            runs += [("fla fwd", lambda: fla_chunk(*args5(x), output_final_state=True, **fla_opts(x, lb)))]
        if backward:
            runs += [("ours fwd+bwd", fwd_bwd_runner(
                lambda L: kops.chunk_kda(*args5(L), output_final_state=True, **opts(L, lb), **TRAIN_OPTS)[0], x))]
        for what, fn in runs:
            rows = kernel_times(fn) if S.dev == "cuda" else []
            say(f"  regime profile {B}x{T} {regime}, {what}: {kernel_summary(rows, 12)}")
        save()


def float64_reference(L, lb: bool):
    """``(o, final state)`` of the float64 recurrence (ops.naive_recurrent_kda) with the in-kernel transforms
    (l2norm, gate, beta sigmoid) applied to float64 leaves ``L``, differentiably."""
    q, k, g, beta = KernelOptions(**opts(L, lb)).apply(L["q"], L["k"], L["g"], L["beta"])
    return kops.naive_recurrent_kda(q, k, L["v"], g, beta, initial_state=L["initial_state"], output_final_state=True)


def opts(x, lb: bool) -> dict:
    return dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=-5.0 if lb else None)


def fla_opts(x, lb: bool) -> dict:
    d = opts(x, lb)
    if lb:
        d["safe_gate"] = True
    return d


def args5(x):
    return x["q"], x["k"], x["v"], x["g"], x["beta"]


def f32(x):
    return {n: x[n].float() for n in ("q", "k", "v", "g", "beta")}


def launch_variants(base: LaunchConfig) -> dict[str, LaunchConfig]:
    """Launch configs timed by --profile, most telling first."""
    return {
        "pipeline": base,
        # float32 intermediates double the scans' tiles: value blocks of 16 keep them from spilling (sm_90 build)
        "pipeline store=f32": replace(base, store="float32", h_bv=16),
        "pipeline h_bv=64": replace(base, h_bv=64),
        "pipeline h_bv=16": replace(base, h_bv=16),
        "pipeline bwd 8 warps": replace(base, bwd_warps=8),
    }


BASE = DEFAULT_CONFIG                                          # the config every step runs (--config changes it)
VARIANTS = launch_variants(BASE)


def ours_fwd(x, lb, variant="pipeline", h0=None, final=True):
    return chunk_kda_fwd(*args5(x), S.D ** -0.5, h0, final, KernelOptions(**opts(x, lb)), None, VARIANTS[variant])


def ours_grad(leaves, lb, variant="pipeline", h0=None, cu=None):
    """(o, final state) through the autograd Function with the variant's launch config, forward and backward."""
    o_ = KernelOptions(**opts(leaves, lb))
    return ChunkKDAFunction.apply(*args5(leaves), h0, o_.A_log, o_.dt_bias, S.D ** -0.5, True, o_, cu,
                                  VARIANTS[variant])


# ----------------------------------------------------------------------------------------------------------- ceilings
def ceilings() -> tuple[float, float]:
    if S.smoke:
        return 1.0, 1.0
    n = 1 << 30                                                     # 1 GiB each way
    src = torch.randn(n // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    bw = 2 * n / ms / 1e9                                           # TB/s
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms_mm = median_ms(lambda: a @ b)
    tf = 2 * 8192 ** 3 / ms_mm / 1e9                                # TFLOP/s
    say(f"card: {torch.cuda.get_device_name()}; copy {bw:.2f} TB/s (read+write, 1 GiB); bf16 matmul {tf:.0f} TFLOP/s")
    return bw, tf


def row(name, ms, tokens, fla_ms=None, floor_ms=None, note=""):
    r = dict(name=name, ms=ms, tok_s=tokens / ms * 1e3 if ms else None, fla_ms=fla_ms,
             vs_fla=(fla_ms / ms) if (fla_ms and ms) else None,
             floor_ms=floor_ms, of_floor=(floor_ms / ms) if (floor_ms and ms) else None, note=note)
    ROWS.append(r)
    say(json.dumps(r))


# ------------------------------------------------------------------------------------------------------------- checks
class Checks:
    """Correctness at full size against the PyTorch path (float32 compute on the same bf16 values); every check
    prints a PASS/FAIL line, and ``ok`` is the conjunction."""

    def __init__(self, fla_chunk):
        self.ok = True
        self.fla_chunk = fla_chunk
        self.failed: list[str] = []

    def verdict(self, name, err, bar):
        good = err == err and err < bar                             # NaN fails
        self.ok &= good
        if not good:
            self.failed.append(name)
        say(f"check {name}: rel err {err:.2e} (bar {bar:.0e}) {'PASS' if good else 'FAIL'}")

    def flag(self, name, good, note=""):
        self.ok &= good
        if not good:
            self.failed.append(name)
        say(f"check {name}: {'PASS' if good else 'FAIL'} {note}")

    def chunk_forward(self):
        """The pipeline forward (default bf16 intermediates, and float32 intermediates) at both shapes, with an
        initial state; fla's error on the same inputs for context."""
        for i, (B, T) in enumerate(S.shapes):
            lb = i == 1
            x = make(B, T, lb=lb, seed=1)
            h0 = torch.randn(B, S.H, S.D, S.D, device=S.dev)
            with torch_backend():
                o_r, S_r = kops.chunk_kda(*args5(f32(x)), initial_state=h0, output_final_state=True, **opts(x, lb))
            tag = f"chunk fwd {B}x{T} {'lower_bound' if lb else 'softplus'} h0"
            for variant in ("pipeline", "pipeline store=f32"):
                with Poison():
                    o, St = ours_fwd(x, lb, variant, h0=h0)
                self.verdict(f"{tag} [{variant}] o", rel(o, o_r), 5e-3)
                self.verdict(f"{tag} [{variant}] final state", rel(St, S_r), 5e-3)
            if self.fla_chunk is not None:
                with contextlib.suppress(Exception):
                    o_f, S_f = self.fla_chunk(*args5(x), initial_state=h0.clone(), output_final_state=True,
                                              **fla_opts(x, lb))
                    say(f"  (fla on the same inputs: o {rel(o_f, o_r):.2e}, final state {rel(S_f, S_r):.2e})")

    def chunk_backward(self):
        """Triton backward (default variant) vs the PyTorch path's autograd at both shapes: every input's gradient,
        with an initial state and a final-state cotangent; fla's gradient errors for context."""
        for i, (B, T) in enumerate(S.shapes):
            lb = i == 1
            self.gradients(f"chunk bwd {B}x{T} {'lower_bound' if lb else 'softplus'}", make(B, T, lb=lb, seed=4), lb,
                           with_fla=True)

    def regime_gradients(self):
        """The same gradient check on every gate regime of REGIMES at 2 x 2048 against the float64 recurrence (the
        gate and l2norm applied in float64): each of the score gradients' paths (separable, by sub-blocks with the
        diagonal levels) at full size on the GPU. (The float32 PyTorch path is no reference for dA_log
        under strong decay: one float32 sum of terms that cancel, 0.19 off float64 in the smoke run.) In the smoke
        run (one head) dA_log is a single number, whose error moved between 4e-3 and 4e-2 with the random cotangents
        before they were seeded."""
        B, T = (1, 130) if S.smoke else (2, 2048)
        for regime in REGIMES:
            x, lb = make_regime(B, T, regime, seed=5)
            self.gradients(f"regime bwd {B}x{T} {regime}", x, lb, with_fla=False, reference=float64_reference)

    def gradients(self, tag, x, lb, with_fla, reference=None):
        """Our gradients of every input against ``reference(leaves, lb) -> (o, final state)`` (default: the
        PyTorch path in float32) at the bar 2e-2, with an initial state and random cotangents."""
        B = x["q"].shape[0]
        gen = torch.Generator(device=S.dev).manual_seed(3)          # the same state and cotangents every run
        x["initial_state"] = torch.randn(B, S.H, S.D, S.D, device=S.dev, generator=gen)
        do = torch.randn(x["v"].shape, device=S.dev, generator=gen)
        dht = torch.randn(x["initial_state"].shape, device=S.dev, generator=gen)
        names = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")

        def grads(fn, cast):
            leaves = {n: cast(t).detach().clone().requires_grad_() for n, t in x.items()}
            o, St = fn(leaves)
            ((o.float() * do.float()).sum() + (St * dht).sum()).backward()
            out = {n: leaves[n].grad for n in names}
            del leaves, o, St
            return out

        if reference is None:
            with torch_backend():
                ref = grads(lambda L: kops.chunk_kda(*args5(L), initial_state=L["initial_state"],
                                                     output_final_state=True, **opts(L, lb)), lambda t: t.float())
        else:
            ref = grads(lambda L: reference(L, lb), lambda t: t.double())
        with Poison():
            got = grads(lambda L: ours_grad(L, lb, h0=L["initial_state"]), lambda t: t)
        for n in names:
            self.verdict(f"{tag} d{n}", rel(got[n], ref[n]), 2e-2)
        if with_fla and self.fla_chunk is not None:
            try:
                fl = grads(lambda L: self.fla_chunk(*args5(L), initial_state=L["initial_state"],
                                                    output_final_state=True, **fla_opts(L, lb)), lambda t: t)
                say("  (fla's gradients on the same inputs: " + ", ".join(
                    f"d{n} {rel(fl[n], ref[n]):.1e}" for n in names if fl[n] is not None) + ")")
            except Exception as e:  # noqa: BLE001
                say(f"  (fla's gradients failed: {type(e).__name__}: {e})")
        del ref, got

    def varlen_gva_extreme_gates(self):
        """varlen with length-1 sequences, GVA, float32, extreme gates (-1000 every 7th step, exactly 0 every 5th):
        forward of both chunk forwards and the recurrent kernel, and the pipeline's gradients."""
        bounds, H2 = S.varlen
        cu = torch.tensor(bounds, device=S.dev)
        T = bounds[-1]
        x = make(1, T, h=H2 // 2, hv=H2, dtype=torch.float32, seed=2)
        x["k"] = F.normalize(x["k"], dim=-1)
        x["g"] = F.logsigmoid(x["g"])
        x["g"][:, ::7] = -1000.0
        x["g"][:, 3::5] = 0.0
        x["beta"] = x["beta"].sigmoid()
        N = len(bounds) - 1
        h0 = torch.randn(N, H2, S.D, S.D, device=S.dev)
        plain = lambda L: (L["q"], L["k"], L["v"], L["g"], L["beta"])
        with torch_backend():
            o_r, S_r = kops.chunk_kda(*plain(x), initial_state=h0, output_final_state=True, cu_seqlens=cu)
        with Poison():
            o, St = chunk_kda_fwd(*plain(x), S.D ** -0.5, h0, True, KernelOptions(), cu)
        self.verdict("chunk varlen GVA fp32 extreme gates o", rel(o, o_r), 1e-4)
        self.verdict("chunk varlen GVA fp32 extreme gates final state", rel(St, S_r), 1e-4)
        with Poison():
            o, St = kops.fused_recurrent_kda(*plain(x), initial_state=h0, output_final_state=True, cu_seqlens=cu)
        self.verdict("recurrent varlen GVA fp32 extreme gates o", rel(o, o_r), 1e-5)
        # gradients
        do = torch.randn_like(o_r)
        dht = torch.randn_like(S_r)
        res = []
        for backend in ("torch", "triton"):
            L = {n: t.detach().clone().requires_grad_() for n, t in dict(x, initial_state=h0).items()
                 if n in ("q", "k", "v", "g", "beta", "initial_state")}
            ctx = torch_backend() if backend == "torch" else Poison()
            with ctx:
                o, St = kops.chunk_kda(*plain(L), initial_state=L["initial_state"], output_final_state=True,
                                       cu_seqlens=cu)
                ((o * do).sum() + (St * dht).sum()).backward()
            res.append({n: t.grad for n, t in L.items()})
        for n in res[0]:
            self.verdict(f"chunk varlen GVA fp32 extreme gates d{n}", rel(res[1][n], res[0][n]), 1e-3)

    def million_tokens(self):
        """One sequence of 2^20 tokens: forward finite, final state and o = the recurrent kernel's; backward
        finite."""
        T, h = S.million
        x = make(1, T, h=h, lb=True, seed=5)
        t0 = time.time()
        with Poison():
            o, St = kops.chunk_kda(*args5(x), output_final_state=True, **opts(x, True))
        sync()
        t1 = time.time()
        o_rec, S_rec = kops.fused_recurrent_kda(*args5(x), output_final_state=True, **opts(x, True))
        sync()
        t2 = time.time()
        self.flag("1M tokens fwd finite", bool(torch.isfinite(o).all() and torch.isfinite(St).all()),
                  f"(chunk {t1 - t0:.2f} s incl. compile, recurrent {t2 - t1:.2f} s)")
        self.verdict("1M tokens final state vs recurrent", rel(St, S_rec), 5e-3)
        self.verdict("1M tokens o vs recurrent", rel(o, o_rec), 5e-3)
        del o, St, o_rec, S_rec
        leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
        t0 = time.time()
        with Poison():
            o, St = kops.chunk_kda(*args5(leaves), output_final_state=True, **opts(leaves, True))
            (o.float().sum() + St.sum()).backward()
        sync()
        finite = all(bool(torch.isfinite(t.grad).all()) for t in leaves.values())
        self.flag("1M tokens fwd+bwd gradients finite", finite, f"({time.time() - t0:.2f} s)")

    def decode_state_pool(self):
        """decode: batch 1 and 256 from a pool, rows not named untouched; a 16-token multi-token step."""
        for N, T in ((1, 1), (256, 1), (64, 16)):
            x = make(N, T, seed=3)
            pool = torch.randn(N + 37, S.H, S.D, S.D, device=S.dev)
            slots = torch.randperm(N + 37, device=S.dev)[:N]
            before = pool.clone()
            with Poison():
                o, _ = kops.fused_recurrent_kda(*args5(x), initial_state=pool, state_indices=slots, **opts(x, False))
            ref_pool = before.clone()
            with torch_backend():
                o_r, _ = kops.fused_recurrent_kda(*args5(f32(x)), initial_state=ref_pool, state_indices=slots,
                                                  **opts(x, False))
            self.verdict(f"decode N={N} T={T} o", rel(o, o_r), 5e-3)
            self.verdict(f"decode N={N} T={T} pool rows", rel(pool, ref_pool), 1e-5)
            mask = torch.ones(N + 37, dtype=torch.bool, device=S.dev)
            mask[slots] = False
            self.flag(f"decode N={N} rows not named untouched", torch.equal(pool[mask], before[mask]))


# -------------------------------------------------------------------------------------------------------------- bench
def chunk_floor(T_total: int, bw: float, tf: float, backward: bool) -> float:
    """Floor in ms: bf16 q, k, v, raw gate and o (and beta) once each; with the backward, the inputs again plus do
    and the five gradients. bw in TB/s, tf in TFLOP/s."""
    elems = T_total * S.H * S.D
    fwd_bytes = elems * 2 * 5 + T_total * S.H * 2
    fwd_flops = 6 * T_total * S.D * S.D * S.H
    if not backward:
        return max(fwd_bytes / bw, fwd_flops / tf) / 1e9
    fb_bytes = 2 * fwd_bytes + elems * 2 * 5
    return max(fb_bytes / bw, 3 * fwd_flops / tf) / 1e9


def fwd_bwd_runner(call, x):
    """A closure running ``o = call(leaves)`` and ``o.backward(do)`` (fixed cotangent) with fresh leaf gradients;
    q, k, v, g and beta require grad."""
    leaves = {n: t.detach().clone().requires_grad_(n in ("q", "k", "v", "g", "beta")) for n, t in x.items()}
    do = torch.randn_like(x["v"])

    def run():
        for t in leaves.values():
            t.grad = None
        call(leaves).backward(do)
    return run


def bench_chunk(bw: float, tf: float, fla_chunk, backward: bool) -> None:
    """The public op (default implementation) against fla at both shapes and gates. With the backward, both shapes
    of the softplus gate come first: fla's autotuned backward compiles again for ``safe_gate`` (minutes)."""
    order = [(B, T, lb) for B, T in S.shapes for lb in (False, True)]
    if backward:
        order.sort(key=lambda r: r[2])
    for B, T, lb in order:
        tag = f"{B}x{T} {'lower_bound -5' if lb else 'softplus'}"
        if over_budget():
            say(f"  chunk {'fwd+bwd' if backward else 'fwd'} {tag}: skipped (over the time budget)")
            continue
        x = make(B, T, lb=lb)
        ms, fla_ms = chunk_ms(x, lb, fla_chunk, backward)
        if not backward:
            row(f"chunk fwd {tag}", ms, B * T, fla_ms, chunk_floor(B * T, bw, tf, False))
            continue
        row(f"chunk fwd+bwd {tag}", ms, B * T, fla_ms, chunk_floor(B * T, bw, tf, True), "Triton fwd + bwd")
        save()


def chunk_ms(x, lb: bool, fla_chunk, backward: bool) -> tuple[float, float | None]:
    """Median ms of ``chunk_kda`` on ``x``, ours and fla's (None without fla; fla timed first): the forward, or
    forward + backward over 200 ms of timing (about a dozen runs of a 16 ms step; 50 ms gave three)."""
    def timed(fn, kw) -> float:
        if backward:
            return median_ms(fwd_bwd_runner(lambda L: fn(*args5(L), output_final_state=True, **kw(L, lb),
                                                         **TRAIN_OPTS)[0], x), rep=200)
        return median_ms(lambda: fn(*args5(x), output_final_state=True, **kw(x, lb)))

    fla_ms = timed(fla_chunk, fla_opts) if fla_chunk is not None else None
    return timed(kops.chunk_kda, opts), fla_ms


def bench_sdpa(backward: bool) -> None:
    if S.smoke:
        return
    for B, T in S.shapes:
        q, k, v = (torch.randn(B, S.H, T, S.D, device=S.dev, dtype=torch.bfloat16, requires_grad=backward)
                   for _ in range(3))
        if backward:
            do = torch.randn_like(q)
            fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)
        else:
            fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
        row(f"SDPA causal {'fwd+bwd' if backward else 'fwd'} {B}x{T}", median_ms(fn, rep=50), B * T)


def bench_decode(bw: float, fla_rec) -> None:
    if S.smoke:
        return
    H, D = S.H, S.D
    for N in (1, 256):
        x = make(N, 1)
        h0 = torch.randn(N, H, D, D, device="cuda")
        ours = lambda: kops.fused_recurrent_kda(*args5(x), initial_state=h0, output_final_state=True, **opts(x, False))
        state_bytes = N * H * D * D * 4 * 2
        io_bytes = N * H * D * 2 * 5
        floor = (state_bytes + io_bytes) / bw / 1e9
        fla_ms = fla_g = None
        if fla_rec is not None:
            h0f = h0.clone()
            fl = lambda: fla_rec(*args5(x), initial_state=h0f, output_final_state=True, **opts(x, False))
            fla_ms = median_ms(fl)
            with contextlib.suppress(Exception):
                fla_g = graph_ms(fl)
        ms = median_ms(ours)
        row(f"decode B={N} (plain launch)", ms, N, fla_ms, floor, f"state {state_bytes / ms / 1e9:.2f} TB/s")
        gms = graph_ms(ours)
        row(f"decode B={N} (CUDA graph)", gms, N, fla_g, floor, f"state {state_bytes / gms / 1e9:.2f} TB/s "
            f"= {state_bytes / gms / 1e9 / bw:.0%} of copy")
        pool = torch.randn(2 * N + 3, H, D, D, device="cuda")
        slots = torch.randperm(2 * N + 3, device="cuda")[:N]
        pms = median_ms(lambda: tri_recurrent(*args5(x), initial_state=pool, state_indices=slots, **opts(x, False)))
        row(f"decode B={N} state pool, kernel call", pms, N, None, floor, "state_indices in place")


# ------------------------------------------------------------------------------------------------------------ profile
def kernel_times(fn, iters: int = 5) -> list[tuple[str, float, int]]:
    """(kernel name, ms per call of ``fn``, launches per call) from the CUDA profiler, largest first."""
    fn()
    sync()
    acts = [torch.profiler.ProfilerActivity.CUDA] if S.dev == "cuda" else [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(iters):
            fn()
        sync()
    out = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if t:
            out.append((e.key, t / 1e3 / iters, e.count // iters))
    return sorted(out, key=lambda r: -r[1])


def kernel_summary(rows: list[tuple[str, float, int]], top: int) -> str:
    """``kernel_times`` rows as one line: their total, then the ``top`` largest."""
    return (f"{sum(r[1] for r in rows):.3f} ms of kernels: "
            + "; ".join(f"{name[:40]} {ms:.3f} ms x{n}" for name, ms, n in rows[:top]))


def profile_chunk(bw: float, tf: float, fla_chunk) -> None:
    """Where the time goes (per kernel, default pipeline, forward and forward+backward), then every variant of
    ``VARIANTS``: checked against the PyTorch path at the first shape (o, and with the backward dq, dg), and timed
    forward and forward+backward at both shapes."""
    for B, T in S.shapes:
        x = make(B, T, seed=7)
        for what, fn in (("fwd", lambda: ours_fwd(x, False)),
                         ("fwd+bwd", fwd_bwd_runner(lambda L: ours_grad(L, False)[0], x))):
            if S.dev != "cuda":
                continue
            say(f"  profile {B}x{T} {what} (default pipeline): {kernel_summary(kernel_times(fn), 14)}")
        save()
    for B, T in S.shapes:
        x = make(B, T, seed=7)
        ref = ref_g = None
        if (B, T) == S.shapes[0]:
            do = torch.randn_like(x["v"])
            with torch_backend():
                L = {n: t.float().detach().clone().requires_grad_() for n, t in x.items()}
                o_r, _ = kops.chunk_kda(*args5(L), **opts(L, False))
                o_r.backward(do.float())
                ref, ref_g = o_r.detach(), {n: L[n].grad for n in ("q", "g")}
                del L
        for variant in VARIANTS:
            if over_budget():
                say(f"  variant {B}x{T} {variant}: skipped (over the time budget)")
                continue
            try:
                err = ""
                if ref is not None:
                    with Poison():
                        o, _ = ours_fwd(x, False, variant)
                    err = f"o err {rel(o, ref):.1e}"
                    L = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
                    o, _ = ours_grad(L, False, variant)
                    o.backward(do)
                    err += ", " + ", ".join(f"d{n} err {rel(L[n].grad, ref_g[n]):.1e}" for n in ref_g)
                    del L
                t_f = median_ms(lambda: ours_fwd(x, False, variant), 50)
                t_fb = median_ms(fwd_bwd_runner(lambda L: ours_grad(L, False, variant)[0], x), 50)
                say(f"  variant {B}x{T} {variant}: fwd {t_f:.3f} ms, fwd+bwd {t_fb:.3f} ms"
                    + (f"; {err}" if err else ""))
            except Exception as e:  # noqa: BLE001 - one failing variant must not lose the others
                say(f"  variant {B}x{T} {variant} failed: {type(e).__name__}: {str(e)[:300]}")
            save()


# -------------------------------------------------------------------------------------------------------------- sweep
# Launch shapes tried by --sweep. Each kernel reads only its own fields, so one list row tries one shape of every
# kernel at once, and the profiler splits the time per kernel.
SWEEP_FWD = [dict()]
# Launches with fewer than 4 warps faulted once (LaunchConfig.__post_init__): these rows run after everything else.
SWEEP_FEW_WARPS: list[tuple[str, dict]] = []
SWEEP_BWD = [dict(), dict(bwd_intra_bk=64, bwd_intra_warps=4)]


def sweep_configs(fla_chunk, case: str = "", fwd_fields: list[dict] | None = None) -> None:
    """Per-kernel times (CUDA profiler; 16 x 2048, softplus gate, or ``case``: "BxT" and/or "lb" for the
    lower_bound gate) of the forward kernels under ``fwd_fields`` (default SWEEP_FWD) and of the backward under
    SWEEP_BWD, each output checked against the default config's; then fla's own kernels."""
    B, T = S.shapes[0]
    shape = [w for w in case.split() if "x" in w]
    if shape:
        B, T = (int(n) for n in shape[0].split("x"))
    lb = "lb" in case.split()
    x = make(B, T, seed=3, lb=lb)
    o_opts = KernelOptions(**opts(x, lb))
    do = torch.randn_like(x["v"])

    def fwd(cfg):
        return chunk_kda_fwd(*args5(x), S.D ** -0.5, None, True, o_opts, None, cfg)[0]

    def bwd(cfg):
        # as in training: from what the forward kept (unless the row turns keep_scores off); that forward untimed
        kept = chunk_kda_fwd_keeping(*args5(x), S.D ** -0.5, None, True, o_opts, None, cfg)[2] if cfg.keep_scores \
            else None
        return lambda: chunk_kda_bwd_pipeline(*args5(x), S.D ** -0.5, None, o_opts, None, do, None, cfg, kept)

    o_ref = fwd(BASE)
    g_ref = bwd(BASE)()

    def run(kind, fields):
        if over_budget():
            say(f"  sweep {kind} {fields}: skipped (over the time budget)")
            return
        cfg = replace(BASE, **fields)
        try:
            with Poison():
                if kind == "fwd":
                    err = f"o err {rel(fwd(cfg), o_ref):.1e}"
                else:
                    run_bwd = bwd(cfg)
                    r = run_bwd()
                    err = ", ".join(f"d{n} err {rel(getattr(r, 'd' + n), getattr(g_ref, 'd' + n)):.1e}"
                                    for n in ("q", "k", "v", "g", "beta"))
            rows = kernel_times((lambda: fwd(cfg)) if kind == "fwd" else run_bwd)
            say(f"  sweep {kind} {fields}: {sum(r[1] for r in rows):.3f} ms; " + "; ".join(
                f"{name.replace('chunk_kda_', '')[:28]} {ms:.3f}" for name, ms, n in rows[:10]) + f"; {err}")
        except Exception as e:  # noqa: BLE001 - one failing shape must not lose the others
            say(f"  sweep {kind} {fields} failed: {type(e).__name__}: {str(e)[:300]}")
        save()

    for fields in SWEEP_FWD if fwd_fields is None else fwd_fields:
        run("fwd", fields)
    for fields in [] if NO_BACKWARD else SWEEP_BWD:
        run("bwd", fields)
    if fla_chunk is not None:
        for what, fn in (("fwd", lambda: fla_chunk(*args5(x), output_final_state=True, **fla_opts(x, lb))),
                         ("fwd+bwd", fwd_bwd_runner(lambda L: fla_chunk(*args5(L), output_final_state=True,
                                                                        **fla_opts(L, lb))[0], x))):
            rows = kernel_times(fn)
            say(f"  fla {'safe_gate' if lb else 'softplus'} {what}: {sum(r[1] for r in rows):.3f} ms; " + "; ".join(
                f"{name[:40]} {ms:.3f} x{n}" for name, ms, n in rows[:16]))
            save()
    for kind, fields in SWEEP_FEW_WARPS:            # last: a fault here takes the process down
        run(kind, fields)


# ------------------------------------------------------------------------------------------------- offline sm_90 build
def offline_sm90(cfg_json: str) -> int:
    """Compile every kernel launch of the pipeline's forward and backward (and of the block's short conv and gated
    norm) for sm_90 without a GPU (Triton's own
    ptxas and cuobjdump) and print registers, stack (spills), shared memory against the H200's limit and product
    instructions per kernel, for bf16 and for float32 inputs. The launches are captured from a CPU run with the
    kernels not executed; pointer and int arguments get the 16-divisibility the JIT would see on real allocations
    (without it every load compiles scalar), tensor descriptors their block types. Caveat: ptxas of the local
    Triton, not the GPU machine's 3.6 (the 16-bit kernels matched it so far; float32 ones show 32 registers and
    large stacks here, not yet compared with the GPU)."""
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction, mangle_type
    from triton.tools.tensor_descriptor import TensorDescriptor

    from kimi_linear.ops.triton.chunk_pipeline import LaunchConfig, chunk_kda_bwd_pipeline, chunk_kda_fwd_pipeline
    from kimi_linear.ops.triton.conv import short_conv as tri_conv
    from kimi_linear.ops.triton.norm import gated_rms_norm as tri_norm

    launches, inputs = [], {}
    JITFunction.run = lambda self, *a, grid, warmup, **kw: launches.append((self, kw, inputs["dtype"]))
    # tensor descriptors (LaunchConfig.wy_tma / scores_tma) are built off the GPU only for the interpreter; the
    # kernels themselves were already compiled for the hardware path at import
    os.environ["TRITON_INTERPRET"] = "1"
    B, T, H, HV, K, V = 1, 256, 2, 2, S.D, S.D
    cfg = LaunchConfig(**json.loads(cfg_json or "{}"))
    for dt in (torch.bfloat16, torch.float32):          # float32 inputs: exact products, float32 intermediates
        inputs["dtype"] = "f32" if dt == torch.float32 else "bf16"
        rnd = lambda *s: torch.randn(*s).to(dt)  # noqa: E731
        x = dict(q=rnd(B, T, H, K), k=rnd(B, T, H, K), v=rnd(B, T, HV, V), g=rnd(B, T, HV, K), beta=rnd(B, T, HV))
        for lb in (None, -5.0):
            o_ = KernelOptions(True, True, True, False, torch.randn(HV), torch.randn(HV * K), lb)
            h0 = torch.randn(B, HV, K, V)
            chunk_kda_fwd_pipeline(*args5(x), K ** -0.5, h0, True, o_, None, cfg)
            chunk_kda_bwd_pipeline(*args5(x), K ** -0.5, h0, o_, None, rnd(B, T, HV, V), torch.randn(B, HV, K, V),
                                   cfg)
        # the block's short conv (training: no window; serving: a window and document positions) and gated norm
        C = 3 * H * K
        for extra in ((), (rnd(B, 3, C), torch.arange(T))):
            tri_conv(rnd(B, T, C).requires_grad_(), rnd(4, C).requires_grad_(), *extra).backward(rnd(B, T, C))
        tri_norm(*(rnd(B, T, HV, V).requires_grad_() for _ in range(2)), torch.randn(V).requires_grad_(),
                 1e-6).backward(rnd(B, T, HV, V))
    ptr = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int8: "*i8",
           torch.int32: "*i32", torch.int64: "*i64"}
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    seen = set()
    for fn, kw, dtypes in launches:
        nw, ns, nreg = kw.pop("num_warps", 4), kw.pop("num_stages", 3), kw.pop("maxnreg", None)
        sig, const, attrs = {}, {}, {}
        for prm in fn.params:
            val = kw[prm.name]
            if prm.is_constexpr:
                sig[prm.name], const[prm.name] = "constexpr", val
            elif isinstance(val, torch.Tensor):
                sig[prm.name] = ptr[val.dtype]
                attrs[(prm.num,)] = [["tt.divisibility", 16]]
            elif isinstance(val, TensorDescriptor):
                sig[prm.name] = mangle_type(val)                          # "tensordesc<bf16[64, 32]>"
            elif isinstance(val, int):
                sig[prm.name] = "i32"
                if val % 16 == 0:
                    attrs[(prm.num,)] = [["tt.divisibility", 16]]
            else:
                sig[prm.name] = "fp32"
        key = (fn.__name__, json.dumps(const, default=str, sort_keys=True), json.dumps(sig), nw, ns, nreg)
        if key in seen or SASS_KERNEL not in fn.__name__:
            continue
        seen.add(key)
        try:
            ck = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 128),
                                options=dict(num_warps=nw, num_stages=ns, maxnreg=nreg))
        except Exception as e:  # noqa: BLE001
            say(f"{fn.__name__}: COMPILE ERROR {type(e).__name__}: {str(e)[-1500:]}")
            continue
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(ck.asm["cubin"])
            f.flush()
            use = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", f.name],
                                 capture_output=True, text=True).stdout
            sass = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-sass", f.name],
                                  capture_output=True, text=True).stdout
        if SASS_DIR:
            os.makedirs(SASS_DIR, exist_ok=True)
            with open(os.path.join(SASS_DIR, f"{fn.__name__}.{len(seen)}.sass"), "w") as f_out:
                f_out.write(sass)
        # the kernel's own line (a cubin may list helper functions before it)
        m = (re.search(rf"Function {fn.__name__}:.*?(REG:\d+ STACK:\d+)", use, re.S)
             or re.search(r"(REG:\d+ STACK:\d+)", use))
        ops = " ".join(f"{o} {len(re.findall(o, sass))}" for o in ("HGMMA", "HMMA", "STL", "LDL"))
        say(f"{fn.__name__:28s} {dtypes:4s} warps {nw} stages {ns}: {m.group(1) if m else '?'} "
            f"SMEM:{ck.metadata.shared} (H200: 232448); {ops}")
    return 0


# --------------------------------------------------------------------------------------------------------------- main
def main() -> int:
    global S, OUT, BUDGET, BASE, NO_BACKWARD, NO_FLA, SASS_DIR, SASS_KERNEL, TRAIN_OPTS
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="correctness at full size (GPU) against PyTorch")
    p.add_argument("--bench", action="store_true", help="timings (the default without --check/--profile)")
    p.add_argument("--profile", action="store_true",
                   help="per-kernel times and the chunk variants; with --regimes, per-kernel times of every gate "
                        "regime (ours and fla's) instead")
    p.add_argument("--no-backward", action="store_true", help="skip the forward+backward rows")
    p.add_argument("--regimes", action="store_true",
                   help="time every gate regime (mild to strong, softplus and lower_bound) at both shapes beside "
                        "fla and report the worst ratio")
    p.add_argument("--no-decode", action="store_true", help="skip the decode checks and rows")
    p.add_argument("--only", nargs="+", metavar="STEP", default=None,
                   help="run just the steps named, or whose names contain one of these words, whatever the other "
                        "flags (e.g. --only 'forward+backward' 1M profile); names are printed as '== step'")
    p.add_argument("--config", default="", metavar="JSON",
                   help="LaunchConfig fields overriding the defaults for every step, e.g. '{\"bwd_bk\": 32}'")
    p.add_argument("--sweep", action="store_true",
                   help="per-kernel times of many launch configs (forward and backward), and fla's kernels")
    p.add_argument("--sweep-case", default="", metavar="CASE",
                   help="the sweep's inputs: a shape 'BxT' (default: the first benchmark shape) and/or 'lb' for the "
                        "lower_bound gate, e.g. '1x32768 lb'")
    p.add_argument("--sweep-fwd", default="", metavar="JSON",
                   help="with --sweep: the forward's configs, a JSON list of LaunchConfig field dicts, e.g. "
                        "'[{}, {\"h_bv\": 16}]' (default: the script's SWEEP_FWD)")
    p.add_argument("--budget", type=float, default=0.0, help="seconds; later steps are skipped past it (0: none)")
    p.add_argument("--shapes", nargs="+", default=None, metavar="BxT",
                   help="the benchmark and check shapes instead of 16x2048 and 1x32768, e.g. --shapes 1x32768 (a "
                        "call too short for the whole grid)")
    p.add_argument("--head-dim", type=int, default=0,
                   help="K = V of every shape (default 128; e.g. 256 with --offline-sm90 for its shared memory)")
    p.add_argument("--sass-dir", default="", help="with --offline-sm90: write each kernel's SASS here (NAME.N.sass)")
    p.add_argument("--kernel", default="", help="with --offline-sm90: only kernels whose name contains this")
    p.add_argument("--no-fla", action="store_true", help="leave fla out (no anchor columns; saves its compile time)")
    p.add_argument("--disable-recompute", action="store_true",
                   help="forward + backward rows (and profiles) with chunk_kda(disable_recompute=True), ours and "
                        "fla's: the forward keeps its WY factors for the backward (memory for time)")
    p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes (script logic only)")
    p.add_argument("--offline-sm90", metavar="CFG_JSON", nargs="?", const="{}", default=None,
                   help="no GPU needed: compile the pipeline's kernels for sm_90, print registers/spills "
                        "(optionally with LaunchConfig fields as JSON)")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for kernels.json and kernels.log")
    a = p.parse_args()
    S, OUT, BUDGET, NO_BACKWARD, NO_FLA = Setup(a.smoke), a.out, a.budget, a.no_backward, a.no_fla
    TRAIN_OPTS = {"disable_recompute": True} if a.disable_recompute else {}
    if a.head_dim:
        S.D = a.head_dim
    if a.shapes:
        try:
            S.shapes = tuple(tuple(int(n) for n in shape.lower().split("x")) for shape in a.shapes)
        except ValueError:
            S.shapes = ()
        if not S.shapes or any(len(shape) != 2 or min(shape) <= 0 for shape in S.shapes):
            p.error(f"--shapes takes positive BxT pairs such as 1x32768, got {' '.join(a.shapes)}")
    SASS_DIR, SASS_KERNEL = a.sass_dir, a.kernel
    os.makedirs(OUT, exist_ok=True)
    if a.config:
        # The public ops read the module's default at call time: every step, checks included, runs this config.
        BASE = replace(DEFAULT_CONFIG, **json.loads(a.config))
        tri_chunk.DEFAULT_CONFIG = BASE
        VARIANTS.update(launch_variants(BASE))
    try:
        sweep_fwd = json.loads(a.sweep_fwd) if a.sweep_fwd else None
        if sweep_fwd is not None and not (isinstance(sweep_fwd, list) and all(isinstance(f, dict) for f in sweep_fwd)):
            raise ValueError("not a list of objects")
    except ValueError as e:
        p.error(f"--sweep-fwd takes a JSON list of LaunchConfig field objects: {e}")
    if a.offline_sm90 is not None:
        return offline_sm90(a.offline_sm90)
    if not a.smoke and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --smoke)")
        return 2
    bench = a.bench or not (a.check or a.profile or a.sweep or a.regimes)
    # the checks' initial states and cotangents come from the global generator: a fixed seed makes a run repeatable
    torch.manual_seed(int(os.environ.get("KDA_KERNELS_SEED", "0")))
    import triton
    dev = torch.cuda.get_device_name() if S.dev == "cuda" else "CPU (interpreter)"
    say(f"{time.strftime('%Y-%m-%d')} {dev} torch {torch.__version__} triton {triton.__version__} "
        f"python {platform.python_version()}")
    fla_chunk, fla_rec = fla_ops()
    checks = Checks(fla_chunk)
    ceil: list[float] = []

    def need_ceilings():
        if not ceil:
            ceil.extend(ceilings())
        return ceil

    steps = []                                                      # (name, wanted, fn) in priority order
    steps += [("check chunk forward", a.check, checks.chunk_forward)]
    steps += [("bench chunk forward", bench, lambda: bench_chunk(*need_ceilings(), fla_chunk, False))]
    steps += [("check chunk backward", a.check, checks.chunk_backward)]
    steps += [("check 1M tokens", a.check, checks.million_tokens)]
    steps += [("check regime gradients", a.check, checks.regime_gradients)]
    steps += [("profile chunk", a.profile and not a.regimes, lambda: profile_chunk(*need_ceilings(), fla_chunk))]
    steps += [("sweep launch configs", a.sweep, lambda: sweep_configs(fla_chunk, a.sweep_case, sweep_fwd))]
    steps += [("check varlen GVA extreme gates", a.check, checks.varlen_gva_extreme_gates)]
    # last of the chunk steps: fla's autotuned backward kernels take minutes to compile
    steps += [("bench chunk forward+backward", bench and not a.no_backward,
               lambda: bench_chunk(*need_ceilings(), fla_chunk, True))]
    steps += [("bench gate regimes", a.regimes,
               lambda: bench_regimes(*need_ceilings(), fla_chunk, not a.no_backward))]
    steps += [("profile gate regimes", a.regimes and a.profile, lambda: profile_regimes(fla_chunk, not a.no_backward))]
    steps += [("bench SDPA", bench, lambda: (bench_sdpa(False), None if a.no_backward else bench_sdpa(True)))]
    steps += [("check decode", a.check and not a.no_decode, checks.decode_state_pool)]
    steps += [("bench decode", bench and not a.no_decode, lambda: bench_decode(need_ceilings()[0], fla_rec))]
    if a.only:
        names = {name for name, _, _ in steps}
        # a word that is a whole step name picks that step alone ('bench chunk forward' is also a part of
        # 'bench chunk forward+backward'); any other word, every step whose name contains it
        steps = [(name, any(w == name if w in names else w in name for w in a.only)
                  and not (a.no_decode and "decode" in name), fn) for name, _, fn in steps]
        a.check = any(wanted and name.startswith("check") for name, wanted, _ in steps)
    skipped = []
    try:
        for name, wanted, fn in steps:
            if not wanted:
                continue
            if over_budget():
                skipped.append(name)
                continue
            t0 = time.time()
            say(f"== {name} (t = {t0 - START:.0f} s)")
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - one failing step must not lose the others' numbers
                checks.ok &= not name.startswith("check")
                if name.startswith("check"):
                    checks.failed.append(f"{name} (crashed)")
                say(f"step {name} failed: {type(e).__name__}: {str(e)[:500]}")
                say("".join(traceback.format_exc().splitlines(keepends=True)[-6:]))
            if S.dev == "cuda":
                torch.cuda.empty_cache()
            save()
        if skipped:
            say(f"skipped (over the {a.budget:.0f} s budget): {', '.join(skipped)}")
        if a.check:
            not_run = [n for n in skipped if n.startswith("check")]
            say(f"CHECK {'PASS' if checks.ok else 'FAIL'}" + (f": {', '.join(checks.failed)}" if checks.failed else "")
                + (f" (not run: {', '.join(not_run)})" if not_run else ""))
        if ROWS:
            print_table(*need_ceilings())
    finally:
        save()
    return 0 if checks.ok else 1


def print_table(bw: float, tf: float) -> None:
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    say(f"\ncopy {bw:.2f} TB/s, bf16 matmul {tf:.0f} TFLOP/s; 'fla/ours' > 1 means ours is faster; "
        "'floor/ours' is the share of the floor reached")
    say("| what | ours ms | tokens/s | fla ms | fla/ours | floor ms | floor/ours | note |")
    say("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in ROWS:
        say(f"| {r['name']} | {fmt(r['ms'], '.4f')} | {fmt(r['tok_s'], '.3g')} | {fmt(r['fla_ms'], '.4f')} | "
            f"{fmt(r['vs_fla'], '.2f')} | {fmt(r['floor_ms'], '.4f')} | {fmt(r['of_floor'], '.0%')} | {r['note']} |")


if __name__ == "__main__":
    sys.exit(main())
