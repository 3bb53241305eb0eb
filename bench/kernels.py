# Timed lambdas close over loop variables on purpose: each is called (and finished) inside its own iteration.
# ruff: noqa: B023
"""KDA kernels on one GPU: ours (Triton) vs fla-core 0.6 vs PyTorch SDPA causal, plus the card's ceilings.

    python bench/kernels.py              # timings: one table (ms, tokens/s, fla's time over ours, % of floor)
    python bench/kernels.py --check      # correctness at full size on the GPU first (then no timings)
    python bench/kernels.py --check --bench

Shapes of SPEC section 7: bf16, H=32, K=V=128; chunk forward (and forward+backward) at 16 x 2048 and 1 x 32768
tokens with l2norm, gate and beta sigmoid in kernel, once with the softplus gate (fla: the same) and once with the
``lower_bound=-5`` gate (fla: ``safe_gate=True, lower_bound=-5``); the decode step at batch 1 and 256 (plain launch
and CUDA-graph replay, which is how a server runs it). Floors: bytes moved once over the copy bandwidth measured in
this run, FLOPs (6 T d^2 per head forward, 3x that with the backward) over the bf16 matmul rate measured in this run;
the larger of the two. fla comes from the carried wheel (see BENCHMARKS.md for the command).

Timings are medians of ``triton.testing.do_bench`` (events; median mode) or of CUDA-graph replays.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import kimi_linear.ops as kops
from kimi_linear.ops.triton.chunk import chunk_kda_fwd
from kimi_linear.ops.triton.recurrent import fused_recurrent_kda as tri_recurrent

H, D = 32, 128
ROWS: list[dict] = []
LOG: list[str] = []


def say(*a):
    line = " ".join(str(x) for x in a)
    print(line, flush=True)
    LOG.append(line)


def median_ms(fn, rep: int = 100) -> float:
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


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-20)).item()


def fla_ops():
    try:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
        return chunk_kda, fused_recurrent_kda
    except Exception as e:  # noqa: BLE001 - report and carry on without the anchor
        say(f"fla not importable ({type(e).__name__}: {e}); fla columns left empty")
        return None, None


def make(B: int, T: int, h: int = H, hv: int | None = None, dtype=torch.bfloat16, seed: int = 0, lb: bool = False):
    """Raw inputs for the in-kernel options: q, k, v, raw gate, beta logits; gate parameters; initial state."""
    hv = hv or h
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, device="cuda")
    x = dict(q=rnd(B, T, h, D).to(dtype), k=rnd(B, T, h, D).to(dtype), v=rnd(B, T, hv, D).to(dtype),
             g=rnd(B, T, hv, D).to(dtype), beta=rnd(B, T, hv).to(dtype))
    x["A_log"] = (rnd(hv) * 0.5).float()
    x["dt_bias"] = (rnd(hv * D) * 0.5 - (4.0 if lb else 0.0)).float()
    return x


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


# ----------------------------------------------------------------------------------------------------------- ceilings
def ceilings() -> tuple[float, float]:
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


# ------------------------------------------------------------------------------------------------------------- decode
def bench_decode(bw: float, fla_rec) -> None:
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
        for bv in (8, 16, 32, 64):
            t = graph_ms(lambda bv=bv: tri_recurrent(*args5(x), initial_state=h0, output_final_state=True,
                                                     block_v=bv, **opts(x, False)))
            say(f"  sweep decode B={N} BV={bv}: {t * 1e3:.1f} us")


# -------------------------------------------------------------------------------------------------------------- chunk
def chunk_floor(T_total: int, bw: float, tf: float, backward: bool) -> float:
    """Floor in ms: bf16 q, k, v, raw gate and o (and beta) once each; with the backward, the inputs again plus do
    and the five gradients. bw in TB/s, tf in TFLOP/s."""
    elems = T_total * H * D
    fwd_bytes = elems * 2 * 5 + T_total * H * 2
    fwd_flops = 6 * T_total * D * D * H
    if not backward:
        return max(fwd_bytes / bw, fwd_flops / tf) / 1e9
    fb_bytes = 2 * fwd_bytes + elems * 2 * 5
    return max(fb_bytes / bw, 3 * fwd_flops / tf) / 1e9


def bench_chunk(bw: float, tf: float, fla_chunk, backward: bool) -> None:
    for B, T in ((16, 2048), (1, 32768)):
        for lb in (False, True):
            x = make(B, T, lb=lb)
            tag = f"{B}x{T} {'lower_bound -5' if lb else 'softplus'}"
            fl = None
            if fla_chunk is not None:
                fl = lambda: fla_chunk(*args5(x), output_final_state=True, **fla_opts(x, lb))
            ours = lambda: kops.chunk_kda(*args5(x), output_final_state=True, **opts(x, lb))
            if not backward:
                fla_ms = median_ms(fl) if fl else None
                row(f"chunk fwd {tag}", median_ms(ours), B * T, fla_ms, chunk_floor(B * T, bw, tf, False))
                continue
            leaves = {n: t.detach().clone().requires_grad_(n in ("q", "k", "v", "g", "beta")) for n, t in x.items()}
            do = torch.randn_like(x["v"])

            def fb(fn):
                def run():
                    for t in leaves.values():
                        t.grad = None
                    o, _ = fn(*args5(leaves), output_final_state=True, **(fla_opts if fn is fla_chunk else opts)(
                        leaves, lb))
                    o.backward(do)
                return run
            fla_ms = median_ms(fb(fla_chunk), rep=50) if fla_chunk else None
            row(f"chunk fwd+bwd {tag}", median_ms(fb(kops.chunk_kda), rep=50), B * T, fla_ms,
                chunk_floor(B * T, bw, tf, True), "ours: Triton fwd + PyTorch recompute bwd")


def bench_sdpa(backward: bool) -> None:
    for B, T in ((16, 2048), (1, 32768)):
        q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=backward)
                   for _ in range(3))
        if backward:
            do = torch.randn_like(q)
            fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)
        else:
            fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
        row(f"SDPA causal {'fwd+bwd' if backward else 'fwd'} {B}x{T}", median_ms(fn, rep=50), B * T)


def sweep_scan() -> None:
    """Launch shape of the scan kernel (block of value columns, warps, pipeline stages) at both shapes."""
    for B, T in ((16, 2048), (1, 32768)):
        x = make(B, T)
        o_ = kops.gate.KernelOptions(**{k: v for k, v in opts(x, False).items()})
        for bv, nw, ns in ((16, 4, 2), (32, 4, 2), (32, 8, 2), (64, 4, 2), (64, 8, 3), (16, 4, 3)):
            ms = median_ms(lambda bv=bv, nw=nw, ns=ns: chunk_kda_fwd(*args5(x), D ** -0.5, None, True, o_, None,
                                                                    block_v=bv, num_warps=nw, num_stages=ns), 50)
            say(f"  sweep chunk fwd {B}x{T} BV={bv} warps={nw} stages={ns}: {ms:.3f} ms")


def profile_chunk() -> None:
    """Chunk forward variants (part 1 fused or split, warps, diagonal slice), each checked against the PyTorch path
    at 16x2048 (outputs poisoned) and timed at both shapes: the whole forward, part 1 alone and the scan alone
    (the latter on stale buffers)."""
    o_ = None
    refs = {}
    for B, T in ((16, 2048), (1, 32768)):
        x = make(B, T, seed=7)
        o_ = kops.gate.KernelOptions(**opts(x, False))
        if B == 16:
            with torch_backend():
                refs[B] = kops.chunk_kda(*args5({n: x[n].float() for n in ("q", "k", "v", "g", "beta")}),
                                         **opts(x, False))[0]
        for form, iw, ds in (("split", 8, 16), ("split", 4, 16), ("fused", 4, 16)):
            run = lambda st="both", form=form, iw=iw, ds=ds: chunk_kda_fwd(
                *args5(x), D ** -0.5, None, True, o_, None, intra_warps=iw, diag_slice=ds, stages=st, impl=form)
            with Poison():
                err = rel(run()[0], refs[B]) if B in refs else float("nan")
            t_all, t_intra = median_ms(run, 30), median_ms(lambda: run("intra"), 30)
            say(f"  profile {B}x{T} intra {form} warps={iw} diag_slice={ds}: rel err {err:.2e}; fwd {t_all:.3f} ms, "
                f"part 1 {t_intra:.3f} ms")
        for bv, nw in ((32, 4), (64, 4)):
            t = median_ms(lambda bv=bv, nw=nw: chunk_kda_fwd(*args5(x), D ** -0.5, None, True, o_, None, block_v=bv,
                                                             num_warps=nw, stages="scan"), 30)
            say(f"  profile {B}x{T} scan BV={bv} warps={nw}: {t:.3f} ms")


# -------------------------------------------------------------------------------------------------------------- check
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


def check(fla_chunk) -> bool:
    ok = True

    def verdict(name, err, bar):
        nonlocal ok
        good = err == err and err < bar                             # NaN fails
        ok &= good
        say(f"check {name}: rel err {err:.2e} (bar {bar:.0e}) {'PASS' if good else 'FAIL'}")

    def compare(name, fn, x, bar, **kw):
        with Poison():
            o, S = fn(*args5(x), **kw)
        with torch_backend():
            o_r, S_r = fn(*args5({n: x[n].float() for n in ("q", "k", "v", "g", "beta")}), **kw)
        verdict(f"{name} o", rel(o, o_r), bar)
        if S is not None:
            verdict(f"{name} final state", rel(S, S_r), bar)
        return o, S, o_r

    def chunk_full_size():
        nonlocal ok
        for B, T, lb in ((16, 2048, False), (1, 32768, True)):
            x = make(B, T, lb=lb, seed=1)
            h0 = torch.randn(B, H, D, D, device="cuda")
            o, _, o_r = compare(f"chunk {B}x{T} {'lower_bound' if lb else 'softplus'} h0", kops.chunk_kda, x, 5e-3,
                                initial_state=h0, output_final_state=True, **opts(x, lb))
            if fla_chunk is not None and not lb:
                o_f, _ = fla_chunk(*args5(x), initial_state=h0.clone(), output_final_state=True, **fla_opts(x, lb))
                say(f"  (fla on the same inputs: rel err {rel(o_f, o_r):.2e}; ours {rel(o, o_r):.2e})")

    def varlen_gva_extreme_gates():
        nonlocal ok
        # varlen with length-1 sequences, GVA, float32, extreme gates (-1000 every 7th step, exactly 0 every 5th).
        cu = torch.tensor([0, 1, 2, 1000, 1001, 5000, 8192], device="cuda")
        x = make(1, 8192, h=16, hv=32, dtype=torch.float32, seed=2)
        x["k"] = F.normalize(x["k"], dim=-1)
        x["g"] = F.logsigmoid(x["g"])
        x["g"][:, ::7] = -1000.0
        x["g"][:, 3::5] = 0.0
        x["beta"] = x["beta"].sigmoid()
        h0 = torch.randn(6, 32, D, D, device="cuda")
        compare("chunk varlen GVA fp32 extreme gates", kops.chunk_kda, x, 1e-4, initial_state=h0,
                output_final_state=True, cu_seqlens=cu)
        compare("recurrent varlen GVA fp32 extreme gates", kops.fused_recurrent_kda, x, 1e-5, initial_state=h0,
                output_final_state=True, cu_seqlens=cu)

    def decode_state_pool():
        nonlocal ok
        # decode: batch 1 and 256 from a pool, rows not named untouched; a 16-token multi-token step.
        for N, T in ((1, 1), (256, 1), (64, 16)):
            x = make(N, T, seed=3)
            pool = torch.randn(N + 37, H, D, D, device="cuda")
            slots = torch.randperm(N + 37, device="cuda")[:N]
            before = pool.clone()
            with Poison():
                o, _ = kops.fused_recurrent_kda(*args5(x), initial_state=pool, state_indices=slots, **opts(x, False))
            ref_pool = before.clone()
            with torch_backend():
                o_r, _ = kops.fused_recurrent_kda(*args5({n: x[n].float() for n in ("q", "k", "v", "g", "beta")}),
                                                  initial_state=ref_pool, state_indices=slots, **opts(x, False))
            verdict(f"decode N={N} T={T} o", rel(o, o_r), 5e-3)
            verdict(f"decode N={N} T={T} pool rows", rel(pool, ref_pool), 1e-5)
            mask = torch.ones(N + 37, dtype=torch.bool, device="cuda")
            mask[slots] = False
            same = torch.equal(pool[mask], before[mask])
            ok &= same
            say(f"check decode N={N} rows not named untouched: {'PASS' if same else 'FAIL'}")

    def gradients():
        nonlocal ok
        # gradients (Triton forward, recomputed PyTorch backward) on a mid-size problem.
        x = make(2, 300, h=4, seed=4)
        grads = []
        for backend in ("triton", "torch"):
            leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
            ctx = torch_backend() if backend == "torch" else contextlib.nullcontext()
            with ctx:
                o, _ = kops.chunk_kda(*args5(leaves), **opts(leaves, False))
            o.float().backward(torch.ones_like(o, dtype=torch.float32))
            grads.append({n: t.grad for n, t in leaves.items()})
        for n in grads[1]:
            verdict(f"chunk grad d{n}", rel(grads[0][n], grads[1][n]), 2e-2)

    def million_tokens():
        nonlocal ok
        # one sequence of 2^20 tokens, 4 heads: finite everywhere, final state = the recurrent kernel's.
        T = 1 << 20
        x = make(1, T, h=4, lb=True, seed=5)
        t0 = time.time()
        with Poison():
            o, S = kops.chunk_kda(*args5(x), output_final_state=True, **opts(x, True))
        torch.cuda.synchronize()
        t1 = time.time()
        o_rec, S_rec = kops.fused_recurrent_kda(*args5(x), output_final_state=True, **opts(x, True))
        torch.cuda.synchronize()
        finite = bool(torch.isfinite(o).all() and torch.isfinite(S).all())
        ok &= finite
        say(f"check 1M tokens: finite {'PASS' if finite else 'FAIL'} (chunk {t1 - t0:.2f} s, "
            f"recurrent {time.time() - t1:.2f} s)")
        verdict("1M tokens final state vs recurrent", rel(S, S_rec), 5e-3)
        verdict("1M tokens o vs recurrent", rel(o, o_rec), 5e-3)


    for group in (chunk_full_size, varlen_gva_extreme_gates, decode_state_pool, gradients, million_tokens):
        try:
            group()
        except Exception as e:  # noqa: BLE001 - report, keep checking
            ok = False
            say(f"check {group.__name__} crashed: {type(e).__name__}: {e}")
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="correctness at full size (GPU) against PyTorch")
    p.add_argument("--bench", action="store_true", help="with --check: time as well")
    p.add_argument("--no-backward", action="store_true", help="skip the forward+backward rows")
    p.add_argument("--sweep", action="store_true", help="also sweep launch shapes")
    p.add_argument("--profile", action="store_true", help="only the chunk-forward variants (checked, timed)")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for kernels.json and kernels.log")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    import triton
    say(f"{time.strftime('%Y-%m-%d')} {torch.cuda.get_device_name()} torch {torch.__version__} triton "
        f"{triton.__version__} python {platform.python_version()}")
    fla_chunk, fla_rec = fla_ops()
    ok = True
    try:
        if a.profile:
            profile_chunk()
            return 0
        if a.check:
            ok = check(fla_chunk)
            say(f"CHECK {'PASS' if ok else 'FAIL'}")
        if not a.check or a.bench:
            bw, tf = ceilings()
            steps = [lambda: bench_decode(bw, fla_rec), lambda: bench_chunk(bw, tf, fla_chunk, False),
                     lambda: bench_sdpa(False)]
            if not a.no_backward:
                steps += [lambda: bench_chunk(bw, tf, fla_chunk, True), lambda: bench_sdpa(True)]
            if a.sweep:
                steps.append(sweep_scan)
            for step in steps:
                try:
                    step()
                except Exception as e:  # noqa: BLE001 - one failing step must not lose the others' numbers
                    say(f"step failed: {type(e).__name__}: {e}")
            print_table(bw, tf)
    finally:
        with open(os.path.join(a.out, "kernels.log"), "w") as f:
            f.write("\n".join(LOG) + "\n")
        with open(os.path.join(a.out, "kernels.json"), "w") as f:
            json.dump(ROWS, f, indent=1)
    return 0 if ok else 1


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
