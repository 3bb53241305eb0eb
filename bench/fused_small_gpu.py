"""The decode step's small fused kernels on the GPU (issue 18): RMSNorm, residual add + RMSNorm, the in-place
decode short conv, the step's float32 logits with their greedy tokens, and MLA's per-head products, against the
PyTorch paths they replace; then their times.

(a) Checks (bf16 and float32; batch 1 and 128; hidden 2304 and MLA's latent 512; q|k|v conv C = 3*32*128 = 12288,
    W = 4): ``rms_norm`` / ``add_rms_norm`` against ``rms_norm_torch`` (the layer's PyTorch path): the sum must be
    bit-equal to torch's add; the norm may differ by the float32 reduction order and rsqrt: bar, at most 1 ulp of
    the output dtype on any element (float32: 2e-6 relative); 2 ulp, because a 1-ulp change of the cast norm
    can move the rounded product by 2 ulp where the two mantissas sit at opposite ends of a binade), and the
    share of elements that differ is printed.
    ``short_conv_decode`` against the path it replaces (index_select, the Triton prefill conv, index_copy_), rows
    in shuffled slots, two padding rows on one scratch slot: pool rows bit-equal (they are copies), outputs'
    max |error| / max |y| <= 2^-8 (bf16) / 1e-6 (float32): a W-term float32 sum in another order, which cancels
    to near zero at some elements, so no elementwise bar. Each kernel captured in a CUDA graph and replayed
    equals eager (the scratch slot, raced by the padding rows, left out).
    ``logits_and_greedy`` (bf16 and float32 logits, batch 1, 8 and 256, vocabulary 163,840) against its PyTorch
    path: float32 logits and ids bit-equal, on rows with the maximum tied inside one chunk of the kernel and across
    chunks (the first index wins), a NaN (-1), all -inf (0) and +inf twice; captured and replayed equals eager.
    ``absorb_query`` / ``expand_values`` (48B shapes: 32 heads, nope = v = 128, latent 512; batch 1, 5, 256) against
    float64: max |error| / max |ref| <= 2^-7 (bf16) / 1e-6 (float32), the rope part copied bit-exactly.
(b) Timings in microseconds per call, 20 calls captured in one CUDA graph (the decode step's setting: no launch
    overhead from the host), median over repetitions: ours vs the PyTorch path; for the conv also the prefill
    kernel alone at T = 1 with its old [32, 64] tile and with the T-sized tile it now picks.

    PYTHONPATH=src python3 bench/fused_small_gpu.py            # (a) + (b); exit 1 if a check fails
    PYTHONPATH=src python3 bench/fused_small_gpu.py --smoke    # CPU, Triton interpreter, tiny shapes, float32
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kimi_linear.ops.triton.conv as tri_conv
from kimi_linear.ops.conv import short_conv
from kimi_linear.ops.greedy import logits_and_greedy_torch
from kimi_linear.ops.mla_heads import absorb_query_torch, expand_values_torch
from kimi_linear.ops.rms_norm import rms_norm_torch
from kimi_linear.ops.triton import (
    absorb_query,
    add_rms_norm,
    expand_values,
    logits_and_greedy,
    rms_norm,
    short_conv_decode,
)
from moe_gpu import capture, time_eager  # noqa: E402  (a sibling bench script: the graph capture it times with)

CALLS = 20          # calls per captured graph
FAILED: list[str] = []


def say(*a) -> None:
    print(*a, flush=True)


def table(title: str, rows: list[dict]) -> None:
    cols = list(dict.fromkeys(c for r in rows for c in r))
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
    say(f"\n### {title}\n")
    say("| " + " | ".join(cols) + " |")
    say("|" + "---|" * len(cols))
    for r in rows:
        say("| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |")


def ulps(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest |got - ref| in units of the spacing of ref's dtype at |ref| (float32: relative error / 1e-6, so
    the bar is 2 either way)."""
    g, r = got.double(), ref.double()
    if ref.dtype == torch.float32:
        return ((g - r).abs() / r.abs().clamp_min(1e-30)).max().item() / 1e-6
    spacing = torch.finfo(ref.dtype).eps * 2.0 ** torch.floor(torch.log2(r.abs().clamp_min(1e-30)))
    return ((g - r).abs() / spacing).max().item()


def normwise(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def verdict(name: str, ok: bool) -> str:
    if not ok:
        FAILED.append(name)
    return "PASS" if ok else "FAIL"


def time_us(fn, device: str, reps: int) -> float:
    """Median microseconds per call of fn, CALLS calls replayed from one CUDA graph."""
    return time_eager(capture(fn, device, CALLS)[0], device, reps) / CALLS


def graph_equals_eager(fn, inputs: list[torch.Tensor], device: str, state: torch.Tensor | None = None,
                       live: int | None = None) -> bool:
    """fn captured once, replayed on new values copied into its inputs, equals fn run eagerly on them: outputs (the
    first ``live`` rows: padding rows read a raced scratch slot) and ``state``, a tensor fn updates in place, from
    the same starting values (all but its last row: the padding rows' scratch slot)."""
    out = []                 # on CUDA the capture appends the graph's static outputs once; replays refill them
    replay = capture(lambda: out.append(fn()), device)[0]
    gen = torch.Generator(device=device).manual_seed(9)
    for t in inputs:
        t.copy_(torch.randn(t.shape, generator=gen, device=device).to(t.dtype))
    start = state.clone() if state is not None else None
    replay()
    got = out[-1] if isinstance(out[-1], tuple) else (out[-1],)
    got = tuple(t[:live].clone() for t in got)
    after = state[:-1].clone() if state is not None else None
    if state is not None:
        state.copy_(start)
    want = fn()
    want = tuple(t[:live] for t in (want if isinstance(want, tuple) else (want,)))
    return all(torch.equal(a, b) for a, b in zip(got, want)) and (state is None or torch.equal(after, state[:-1]))


def norms(device: str, dtypes: list[torch.dtype], rows_list: list[int], dims: list[int], reps: int) -> None:
    checks, times = [], []
    gen = torch.Generator(device=device).manual_seed(0)
    for dtype in dtypes:
        for D in dims:
            w = (1.0 + 0.3 * torch.randn(D, generator=gen, device=device)).to(dtype)
            for N in rows_list:
                x = (3.0 * torch.randn(N, D, generator=gen, device=device)).to(dtype)
                h = torch.randn(N, D, generator=gen, device=device).to(dtype)
                y, ref = rms_norm(x, w, 1e-6), rms_norm_torch(x, w, 1e-6)
                s, y2 = add_rms_norm(x, h, w, 1e-6)
                s_ref = x + h
                ref2 = rms_norm_torch(s_ref, w, 1e-6)
                u1, u2 = ulps(y, ref), ulps(y2, ref2)
                ok = u1 <= 2 and u2 <= 2 and torch.equal(s, s_ref)
                ok = ok and graph_equals_eager(lambda x=x, w=w: rms_norm(x, w, 1e-6), [x], device)
                ok = ok and graph_equals_eager(lambda x=x, h=h, w=w: add_rms_norm(x, h, w, 1e-6), [x, h], device)
                name = f"norm {str(dtype)[6:]} N={N} D={D}"
                checks.append({"case": name, "norm ulps": u1, "norm differs": f"{(y != ref).double().mean():.2%}",
                               "add+norm ulps": u2, "sum equal": torch.equal(s, s_ref),
                               "check": verdict(name, ok)})
                if dtype == torch.bfloat16 or device != "cuda":
                    times.append({
                        "case": f"{str(dtype)[6:]} N={N} D={D}",
                        "norm ours us": time_us(lambda x=x, w=w: rms_norm(x, w, 1e-6), device, reps),
                        "norm torch us": time_us(lambda x=x, w=w: rms_norm_torch(x, w, 1e-6), device, reps),
                        "add+norm ours us": time_us(lambda x=x, h=h, w=w: add_rms_norm(x, h, w, 1e-6), device, reps),
                        "add+norm torch us": time_us(lambda x=x, h=h, w=w: rms_norm_torch(x + h, w, 1e-6), device,
                                                     reps),
                    })
    table("RMSNorm / add + RMSNorm: checks (bar: <= 2 ulp, float32 2e-6 relative; sum bit-equal)", checks)
    table(f"RMSNorm / add + RMSNorm: microseconds per call ({CALLS} calls in one CUDA graph)", times)


def conv_today(x: torch.Tensor, w: torch.Tensor, pool: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The decode conv as the layer ran it before: gather, the Triton prefill conv (on CUDA), write back."""
    past = pool.index_select(0, index)
    y, window = short_conv(x, w, past)
    pool.index_copy_(0, index, window)
    return y


def old_launch_shape(x: torch.Tensor, rows: int) -> tuple[int, int, tuple[int, int, int]]:
    """The prefill conv's launch before it picked BT from T: always [32, 64] tiles."""
    return 32, 64, (-(-rows // 32), -(-x.shape[2] // 64), x.shape[0])


def conv_case(device: str, dtype: torch.dtype, B: int, C: int, w: torch.Tensor, gen: torch.Generator,
              reps: int) -> tuple[dict, dict | None]:
    """(check row, timing row or None) of one batch: rows in shuffled slots; with B > 2 the last two rows are
    padding on one scratch slot (the pool's last)."""
    slots, n_live = B + 3, B - 2 if B > 2 else B
    pool = torch.randn(slots, w.shape[0] - 1, C, generator=gen, device=device).to(dtype)
    live = torch.randperm(slots - 1, generator=torch.Generator().manual_seed(B))[:n_live]
    index = torch.cat([live, torch.full((B - n_live,), slots - 1)]).to(device)
    x = torch.randn(B, 1, C, generator=gen, device=device).to(dtype)
    p_ours, p_ref = pool.clone(), pool.clone()
    y, y_ref = short_conv_decode(x, w, p_ours, index), conv_today(x, w, p_ref, index)
    err = normwise(y[:n_live], y_ref[:n_live])
    keep = torch.arange(slots - 1, device=device)
    pool_eq = torch.equal(p_ours[keep], p_ref[keep])
    ok = err <= (1e-6 if dtype == torch.float32 else 2.0**-8) and pool_eq
    ours = lambda: short_conv_decode(x, w, p_ours, index)
    ok = ok and graph_equals_eager(ours, [x], device, p_ours, live=n_live)
    name = f"conv {str(dtype)[6:]} B={B} C={C}"
    check = {"case": name, "y: max err / max abs": err, "pool bit-equal": pool_eq, "check": verdict(name, ok)}
    if dtype != torch.bfloat16 and device == "cuda":
        return check, None
    past = pool.index_select(0, index)
    prefill = lambda: tri_conv.short_conv(x, w, past)
    row = {"case": f"{str(dtype)[6:]} B={B} C={C}", "decode ours us": time_us(ours, device, reps),
           "decode torch path us": time_us(lambda: conv_today(x, w, p_ref, index), device, reps),
           "prefill kernel T=1 us (T-sized tile)": time_us(prefill, device, reps)}
    new_shape, tri_conv.launch_shape = tri_conv.launch_shape, old_launch_shape
    try:
        row["prefill kernel T=1 us (old 32x64 tile)"] = time_us(prefill, device, reps)
    finally:
        tri_conv.launch_shape = new_shape
    return check, row


def convs(device: str, dtypes: list[torch.dtype], batches: list[int], C: int, W: int, reps: int) -> None:
    checks, times = [], []
    gen = torch.Generator(device=device).manual_seed(1)
    for dtype in dtypes:
        w = (0.5 * torch.randn(W, C, generator=gen, device=device)).to(dtype)
        for B in batches:
            check, row = conv_case(device, dtype, B, C, w, gen, reps)
            checks.append(check)
            if row is not None:
                times.append(row)
    table("Decode short conv: checks (bar: y error 2^-8 bf16 / 1e-6 float32, norm-wise; pool rows bit-equal)",
          checks)
    table(f"Decode short conv: microseconds per call ({CALLS} calls in one CUDA graph)", times)


def greedy_rows(B: int, V: int, dtype: torch.dtype, device: str, gen: torch.Generator) -> torch.Tensor:
    """B >= 5 rows of logits (B < 5: the first B): random; the maximum tied at three columns, two of them in one
    4096-wide chunk of the kernel; a NaN; all -inf; +inf twice."""
    x = torch.randn(max(B, 5), V, generator=gen, device=device).to(dtype)
    top = x.float().max() + 1
    for j in (V // 3, V // 3 + 7, V - 2):
        x[1, j] = top
    x[2, V // 2] = float("nan")
    x[3] = float("-inf")
    x[4, 1], x[4, V - 1] = float("inf"), float("inf")
    return x[:B]


def greedy(device: str, dtypes: list[torch.dtype], batches: list[int], V: int, reps: int) -> None:
    checks, times = [], []
    gen = torch.Generator(device=device).manual_seed(2)
    for dtype in dtypes:
        for B in batches:
            x = greedy_rows(B, V, dtype, device, gen)
            (lg, ids), (lg_ref, ids_ref) = logits_and_greedy(x), logits_and_greedy_torch(x)
            eq = torch.equal(ids, ids_ref) and torch.equal(lg.nan_to_num(), lg_ref.nan_to_num())
            ok = eq and graph_equals_eager(lambda x=x: logits_and_greedy(x), [x], device)
            name = f"greedy {str(dtype)[6:]} B={B} V={V}"
            checks.append({"case": name, "ids and logits equal": eq, "first rows' ids": str(ids[:5].tolist()),
                           "check": verdict(name, ok)})
            if dtype == torch.bfloat16 or device != "cuda":
                times.append({"case": f"{str(dtype)[6:]} B={B} V={V}",
                              "ours us": time_us(lambda x=x: logits_and_greedy(x), device, reps),
                              "torch path us": time_us(lambda x=x: logits_and_greedy_torch(x), device, reps)})
    table("Float32 logits and greedy ids: checks (bit-equal to the PyTorch path)", checks)
    table(f"Float32 logits and greedy ids: microseconds per call ({CALLS} calls in one CUDA graph)", times)


def mla_heads(device: str, dtypes: list[torch.dtype], batches: list[int], H: int, nope: int, C: int,
              reps: int) -> None:
    """absorb_query / expand_values against float64 (bar: max |error| / max |ref| <= 2^-7 in bf16, 1e-6 in
    float32: one rounding of a float32 sum), the rope part copied bit-exactly, on strided views of one kv_b weight
    [H, 2 nope, C] as the layer hands them; times against the PyTorch path (einsum + cat, einsum)."""
    checks, times = [], []
    gen = torch.Generator(device=device).manual_seed(3)
    for dtype in dtypes:
        bar = 2.0**-7 if dtype == torch.bfloat16 else 1e-6
        w = (torch.randn(H, 2 * nope, C, generator=gen, device=device) / C**0.5).to(dtype)
        w_k, w_v = w[:, :nope], w[:, nope:]
        for B in batches:
            q = torch.randn(B, H, nope + 64, generator=gen, device=device).to(dtype)
            ctx = torch.randn(B, H, C, generator=gen, device=device).to(dtype)
            a, e = absorb_query(q, w_k), expand_values(ctx, w_v)
            ea = normwise(a, absorb_query_torch(q.double(), w_k.double()))
            ee = normwise(e, expand_values_torch(ctx.double(), w_v.double()))
            rope = torch.equal(a[..., C:], q[..., nope:])
            name = f"mla heads {str(dtype)[6:]} B={B}"
            checks.append({"case": name, "absorb err": ea, "expand err": ee, "rope copied": rope,
                           "check": verdict(name, ea <= bar and ee <= bar and rope)})
            if dtype == torch.bfloat16 or device != "cuda":
                fns = {"absorb us": partial(absorb_query, q, w_k),
                       "einsum + cat us": partial(absorb_query_torch, q, w_k),
                       "expand us": partial(expand_values, ctx, w_v),
                       "einsum us": partial(expand_values_torch, ctx, w_v)}
                times.append({"case": f"{str(dtype)[6:]} B={B}"} | {k: time_us(f, device, reps)
                                                                      for k, f in fns.items()})
    table("MLA decode's per-head products: checks against float64", checks)
    table(f"MLA decode's per-head products: microseconds per call ({CALLS} calls in one CUDA graph)", times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    if args.smoke:
        global CALLS
        CALLS = 1            # the interpreter is slow; the smoke run only exercises the code
        device, dtypes, reps = "cpu", [torch.float32], 1
        norms(device, dtypes, [1, 5], [48], reps)
        convs(device, dtypes, [1, 5], 300, 4, reps)
        greedy(device, dtypes, [1, 5], 300, reps)
        mla_heads(device, dtypes, [1, 17], 2, 16, 32, reps)
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device (use --smoke on CPU)")
        device, dtypes, reps = "cuda", [torch.bfloat16, torch.float32], args.reps
        say(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
        norms(device, dtypes, [1, 128, 4096], [2304, 512], reps)
        convs(device, dtypes, [1, 128], 3 * 32 * 128, 4, reps)
        greedy(device, dtypes, [1, 8, 256], 163840, reps)
        mla_heads(device, dtypes, [1, 5, 256], 32, 128, 512, reps)
    say("\nALL PASS" if not FAILED else f"\nFAIL: {', '.join(FAILED)}")
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
