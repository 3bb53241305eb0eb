"""The KDA block's short convolution and gated output norm on the GPU (issue 4: "if profiling shows they matter in
the layer"): ours (Triton), the PyTorch path and fla-core 0.6's kernels (``causal_conv1d``, ``rms_norm_gated``)
side by side, forward and forward + backward, at the issue-4 shapes (H=32, K=V=128, bf16; the conv runs over q|k|v,
3 x 4096 channels), beside ``chunk_kda`` at the same shape so their share is visible; then the whole KDA block
(projections, conv, gate, chunk_kda, norm, output projection) with the PyTorch conv and norm against the Triton
ones. Before timing, the Triton outputs and gradients are checked against the PyTorch path in float32 on the same
bf16 values (bars 5e-3 / 2e-2).

    PYTHONPATH=/tmp/site:src python3 bench/kda_layer.py [--no-fla] [--out DIR]
    PYTHONPATH=src python3 bench/kda_layer.py --smoke        # CPU, interpreter, tiny shapes: the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager
from functools import partial

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

import kimi_linear.ops.triton as tri
from kimi_linear.layers.kda import KimiDeltaAttention
from kimi_linear.ops import chunk_kda
from kimi_linear.ops.conv import short_conv_torch
from kimi_linear.ops.norm import gated_rms_norm_torch
from kimi_linear.ops.triton.conv import short_conv as tri_short_conv
from kimi_linear.ops.triton.norm import gated_rms_norm as tri_gated_rms_norm

ROWS: list[dict] = []


def say(*a):
    print(*a, flush=True)


def median_ms(fn, smoke: bool, rep: int = 200) -> float:
    if smoke:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def runner(fn, inputs: list[torch.Tensor], backward: bool):
    """fn(*inputs) (forward) or fn(*inputs).backward(dy) with fresh gradients."""
    if not backward:
        return lambda: fn(*inputs)
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    dy = torch.randn_like(fn(*inputs))

    def run():
        for t in leaves:
            t.grad = None
        fn(*leaves).backward(dy)
    return run


def check(name: str, ours, ref, inputs: list[torch.Tensor]) -> bool:
    """Ours against the PyTorch path in float32 on the same values: output and every input's gradient."""
    a = [t.detach().clone().requires_grad_() for t in inputs]
    b = [t.detach().float().clone().requires_grad_() for t in inputs]
    ya, yb = ours(*a), ref(*b)
    dy = torch.randn_like(yb)
    ya.float().mul(dy).sum().backward()
    yb.mul(dy).sum().backward()
    errs = [rel(ya, yb)] + [rel(x.grad, y.grad) for x, y in zip(a, b)]
    ok = errs[0] < 5e-3 and all(e < 2e-2 for e in errs[1:])
    say(f"check {name}: output {errs[0]:.2e}, gradients " + ", ".join(f"{e:.2e}" for e in errs[1:])
        + f" {'PASS' if ok else 'FAIL'}")
    return ok


@contextmanager
def dispatch(**ops):
    """Inside, the public op of each name dispatches to the given Triton function, or (None) takes its PyTorch
    path: ops.backend looks Triton ops up by name in kimi_linear.ops.triton."""
    saved = {n: getattr(tri, n, None) for n in ops}
    try:
        for n, f in ops.items():
            setattr(tri, n, f)
        yield
    finally:
        for n, f in saved.items():
            setattr(tri, n, f)


def bench_op(what: str, tokens: int, variants: dict, inputs: list[torch.Tensor], floor_bytes: tuple[int, int],
             bw: float, smoke: bool) -> None:
    for backward in (False, True):
        times = {}
        for label, fn in variants.items():
            if fn is None:
                continue
            try:
                times[label] = median_ms(runner(fn, inputs, backward), smoke)
            except Exception as e:  # noqa: BLE001 - an anchor that does not run leaves its column empty
                say(f"  {what} {label}: {type(e).__name__}: {str(e)[:200]}")
        floor = floor_bytes[backward] / bw / 1e9 if bw else None
        r = dict(what=f"{what} {'fwd+bwd' if backward else 'fwd'}", tokens=tokens, floor_ms=floor,
                 **{f"{k} ms": v for k, v in times.items()})
        ROWS.append(r)
        say(json.dumps(r))


def kda_output(q, k, v, g, beta, A_log):
    """chunk_kda's output with the layer's in-kernel options."""
    return chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                     use_beta_sigmoid_in_kernel=True, A_log=A_log)[0]


def copy_bandwidth(smoke: bool) -> float:
    if smoke:
        return 0.0
    x = torch.empty(1 << 29, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = median_ms(lambda: y.copy_(x), smoke)
    return 2 * x.numel() / ms / 1e9          # TB/s


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU under the Triton interpreter, tiny shapes")
    p.add_argument("--no-fla", action="store_true", help="leave fla's columns out")
    p.add_argument("--out", default="bench_out", help="folder for layer.json")
    a = p.parse_args()
    dev = "cpu" if a.smoke else "cuda"
    H, D, hidden = (2, 16, 64) if a.smoke else (32, 128, 2304)
    shapes = ((1, 40),) if a.smoke else ((16, 2048), (1, 32768))
    dt = torch.bfloat16
    fla_conv = fla_norm = None
    if not (a.no_fla or a.smoke):
        try:
            from fla.modules.causal_conv1d.ops import causal_conv1d
            from fla.modules.norm.fused_norm_gate import rms_norm_gated
            fla_conv = lambda x, w: causal_conv1d(x, w.t(), activation="silu")[0]     # noqa: E731
            fla_norm = lambda o, g, w: rms_norm_gated(o, g, w, None, activation="sigmoid", eps=1e-6)  # noqa: E731
        except Exception as e:  # noqa: BLE001
            say(f"fla not importable ({type(e).__name__}: {e}); fla columns left empty")
    bw = copy_bandwidth(a.smoke)
    say(f"{time.strftime('%Y-%m-%d')} {torch.cuda.get_device_name() if dev == 'cuda' else 'CPU (interpreter)'} "
        f"torch {torch.__version__}; copy {bw:.2f} TB/s")
    ok = True
    gen = torch.Generator(device=dev).manual_seed(0)
    for B, T in shapes:
        C = 3 * H * D
        x = torch.randn(B, T, C, device=dev, dtype=dt, generator=gen)
        w = (0.5 * torch.randn(4, C, device=dev, generator=gen)).to(dt)
        o = torch.randn(B, T, H, D, device=dev, dtype=dt, generator=gen)
        g = torch.randn(B, T, H, D, device=dev, dtype=dt, generator=gen)
        nw = 1 + 0.1 * torch.randn(D, device=dev, generator=gen)
        ours_conv = lambda x, w: tri_short_conv(x, w)                              # noqa: E731
        torch_conv = lambda x, w: short_conv_torch(x, w)[0]                        # noqa: E731
        ours_norm = lambda o, g, w: tri_gated_rms_norm(o, g, w, 1e-6)              # noqa: E731
        torch_norm = lambda o, g, w: gated_rms_norm_torch(o, g, w, 1e-6)           # noqa: E731
        ok &= check(f"short conv {B}x{T}", ours_conv, torch_conv, [x, w])
        ok &= check(f"gated norm {B}x{T}", ours_norm, torch_norm, [o, g, nw])
        n = B * T * C
        bench_op(f"short conv {B}x{T}", B * T, dict(ours=ours_conv, torch=torch_conv, fla=fla_conv), [x, w],
                 (4 * n, 10 * n), bw, a.smoke)
        m = B * T * H * D
        bench_op(f"gated norm {B}x{T}", B * T, dict(ours=ours_norm, torch=torch_norm, fla=fla_norm), [o, g, nw],
                 (6 * m, 16 * m), bw, a.smoke)
        q, k, v = (torch.randn(B, T, H, D, device=dev, dtype=dt, generator=gen) for _ in range(3))
        gate = torch.randn(B, T, H, D, device=dev, dtype=dt, generator=gen)
        beta = torch.randn(B, T, H, device=dev, dtype=dt, generator=gen)
        A_log = torch.randn(H, device=dev, generator=gen)
        kda = partial(kda_output, A_log=A_log)
        bench_op(f"chunk_kda {B}x{T} (for scale)", B * T, dict(ours=kda), [q, k, v, gate, beta], (0, 0), 0.0,
                 a.smoke)
        block = KimiDeltaAttention(hidden, H, D).to(dev, dt)
        hx = torch.randn(B, T, hidden, device=dev, dtype=dt, generator=gen)
        for label, ops in (("Triton conv + norm", dict(short_conv=tri_short_conv, gated_rms_norm=tri_gated_rms_norm)),
                           ("PyTorch conv + norm", dict(short_conv=None, gated_rms_norm=None))):
            with dispatch(**ops):
                bench_op(f"KDA block {B}x{T}, {label}", B * T, dict(ours=block), [hx], (0, 0), 0.0,
                         a.smoke)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "layer.json"), "w") as f:
        json.dump(ROWS, f, indent=1)
    say("\n| what | ours ms | PyTorch ms | fla ms | floor ms |")
    say("| --- | --- | --- | --- | --- |")
    fmt = lambda v: "-" if v is None else f"{v:.4f}"                             # noqa: E731
    for r in ROWS:
        say(f"| {r['what']} | {fmt(r.get('ours ms'))} | {fmt(r.get('torch ms'))} | {fmt(r.get('fla ms'))} | "
            f"{fmt(r['floor_ms'])} |")
    say(f"CHECK {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
