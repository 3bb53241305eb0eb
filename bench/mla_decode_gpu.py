# Timed lambdas close over loop variables on purpose: each is called (and finished) inside its own iteration.
# ruff: noqa: B023
"""GPU check and timings of the paged MLA decode kernel (issue 18), in one command:

    python bench/mla_decode_gpu.py                    # H200: (a) checks, then (b) timings; exit 1 if a check fails
    python bench/mla_decode_gpu.py --sweep            # and (c) times of other tiles / warps / split counts
    python bench/mla_decode_gpu.py --smoke            # CPU + Triton interpreter, tiny shapes: the script's logic
    python bench/mla_decode_gpu.py --no-check --no-bench --parts 1x131072 --block-size 64   # (d) only
    python bench/mla_decode_gpu.py --offline-sm90     # no GPU: build the kernels for sm_90 (registers, spills, smem)

Shapes of Kimi-Linear-48B's MLA: H = 32 heads, entries of C = 512 latent + R = 64 rope, bf16, block size 16.

(a) ``kimi_linear.ops.paged_mla_decode`` (so the dispatch to the Triton kernels too) against dense float32 attention
    row by row, at contexts 1, 17, 4096, 262144 for B in {1, 32, 128} (row 0 at the full context, the other rows of
    random lengths in [1, context]), one row at 1,048,576 in a pool of more than 2^31 elements (int64 offsets), and
    block sizes 64 and 256 at 4096. Blocks are shuffled; every pool slot and table entry no row may read is NaN.
    Then the op captured in a CUDA graph (B = 32 up to 4096 keys, B = 1 up to 1M) and replayed with new queries,
    lengths, tables and pool contents. Bars: ctx max error / max |ref| < 1e-2, lse max abs error < 1e-3.
(b) Median time per call (``triton.testing.do_bench``: CUDA events, L2 flushed before each call) at B = 1 for 4k,
    32k, 128k and 1M keys and B = 128 / 256 at 4k: the op launched eagerly and as a CUDA-graph replay, and the
    path it replaces (the graph step's gather of every row's blocks into a dense buffer, then dense attention).
    Bandwidth = bytes of the keys read (B * len * 576 * 2) / time, against --peak (4.2 TB/s) and a device copy.
(c) --sweep: the same op with other (BH, BN, warps, stages) and split counts, at B = 1 x 1M, 1 x 32k and 256 x 4k.
(d) --parts 1x131072,1x4096: where a call's time goes (the split launch alone, the merge as the difference, both
    with every row cut to 64 keys: the fixed costs of the same grid; the stream as the difference and its rate).

Markdown tables on stdout; with --out DIR also mla_decode.json there.
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:                                   # before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from functools import partial  # noqa: E402
from itertools import product  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

from kimi_linear.ops import paged_mla_decode  # noqa: E402
from kimi_linear.ops.triton import mla_decode as tri  # noqa: E402

CTX_BAR, LSE_BAR = 1e-2, 1e-3
LAUNCH_KEYS = ("block_h", "block_n", "num_warps", "num_stages")
# A launch (BH, BN, warps, stages) the checks run beside the default at every context: the long splits' tiles, which
# the default picks only for long splits (a new candidate from (c) goes here before it becomes a default).
CANDIDATE = tri.LAUNCH_LONG
FAILED: list[str] = []
RESULTS: dict[str, list[dict]] = {"checks": [], "timings": [], "sweep": []}


class Setup:
    """Sizes: the H200's, or tiny CPU ones for --smoke (the interpreter runs programs one at a time)."""

    def __init__(self, smoke: bool) -> None:
        self.smoke = smoke
        self.dev = torch.device("cpu" if smoke else "cuda")
        self.dtype = torch.bfloat16
        if smoke:
            self.H, self.C, self.R, self.bs = 20, 64, 16, 16
            # (rows, context, block size, pool tokens at least)
            self.checks = [(b, L, 16, 0) for b in (1, 3) for L in (1, 17, 100)] + [(1, 300, 16, 1 << 14),
                                                                                  (3, 100, 64, 0)]
            self.graph: list[tuple[int, int, int]] = []
            self.timings = [(1, 64), (1, 256), (4, 64)]
            self.sweep_cases = [(1, 256)]
        else:
            self.H, self.C, self.R, self.bs = 32, 512, 64, 16
            self.checks = [(b, L, 16, 0) for b in (1, 32, 128) for L in (1, 17, 4096, 262144)]
            # the 1M row's blocks are drawn from a pool of 4M tokens: 2.4e9 elements, past int32 offsets
            self.checks += [(32, 4096, 64, 0), (32, 4096, 256, 0), (1, 1 << 20, 16, 1 << 22)]
            self.graph = [(32, 4096, 0), (1, 1 << 20, 1 << 22)]     # (rows, longest context, pool tokens)
            self.timings = [(1, 4096), (1, 32768), (1, 131072), (1, 1 << 20), (128, 4096), (256, 4096)]
            self.sweep_cases = [(1, 1 << 20), (1, 32768), (256, 4096)]
        self.W = self.C + self.R
        self.scale = 192 ** -0.5                             # (nope 128 + rope 64) ** -0.5


S = Setup(False)


def say(line: str = "") -> None:
    print(line, flush=True)


def table(title: str, rows: list[dict]) -> None:
    if not rows:
        return
    keys = list(rows[0])
    say(f"\n### {title}\n")
    say("| " + " | ".join(keys) + " |")
    say("|" + "|".join("---" for _ in keys) + "|")
    for r in rows:
        say("| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()) + " |")


def sync() -> None:
    if S.dev.type == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------------- inputs
class Case:
    """Rows of lengths ``lens`` in a shuffled pool of at least ``pool_tokens`` tokens; every slot that no row may read
    (unowned blocks, the tail of a row's last block, table columns past its blocks) is NaN."""

    def __init__(self, lens: list[int], bs: int, pool_tokens: int = 0, seed: int = 0) -> None:
        gen = torch.Generator(device=S.dev).manual_seed(seed)
        self.lens_list, self.bs = lens, bs
        B = len(lens)
        need = [-(-L // bs) for L in lens]
        self.max_blocks = max(need)
        num_blocks = max(sum(need), -(-pool_tokens // bs)) + 1          # + the all-NaN block the table pads with
        self.cache = torch.full((num_blocks, bs, S.W), float("nan"), dtype=S.dtype, device=S.dev)
        nan_block = num_blocks - 1
        perm = torch.randperm(num_blocks - 1, generator=gen, device=S.dev)[: sum(need)]
        self.table = torch.full((B, self.max_blocks), nan_block, dtype=torch.int32, device=S.dev)
        at = 0
        for i, n in enumerate(need):
            self.table[i, :n] = perm[at : at + n].int()
            at += n
        self.refill(gen)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device=S.dev)
        self.q = (2.0 * torch.randn(B, S.H, S.W, generator=gen, device=S.dev)).to(S.dtype)

    def refill(self, gen: torch.Generator) -> None:
        """Fresh random entries in every owned block, NaN in the tails past each row's length."""
        for i, L in enumerate(self.lens_list):
            n = -(-L // self.bs)
            ids = self.table[i, :n].long()
            self.cache[ids] = torch.randn(n, self.bs, S.W, generator=gen, device=S.dev).to(S.dtype)
            if L % self.bs:
                self.cache[ids[-1], L % self.bs :] = float("nan")

    def args(self) -> tuple:
        return self.q, self.cache, self.table, self.seq_lens, S.scale, S.C

    def nbytes(self) -> int:
        """Bytes of the keys a step reads."""
        return sum(self.lens_list) * S.W * self.cache.element_size()


def mixed_lengths(B: int, L: int, seed: int) -> list[int]:
    """Row 0 at the full context, the others of random lengths in [1, L]."""
    g = torch.Generator().manual_seed(seed)
    return [L] + torch.randint(1, L + 1, (B - 1,), generator=g).tolist()


def reference_row(c: Case, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense float32 attention of row b: (ctx [H, C], lse [H])."""
    L = int(c.lens_list[b])
    n = -(-L // c.bs)
    K = c.cache[c.table[b, :n].long()].flatten(0, 1)[:L].float()                           # [L, W]
    s = c.q[b].float() @ K.T * S.scale                                                      # [H, L]
    return s.softmax(-1) @ K[:, : S.C], s.logsumexp(-1)


def compare(c: Case, ctx: torch.Tensor, lse: torch.Tensor, rows: list[int] | None = None) -> tuple[float, float]:
    """Largest ctx error over the largest |ref| and largest lse error, over ``rows`` (default all)."""
    err = lerr = 0.0
    for b in rows if rows is not None else range(len(c.lens_list)):
        r, rl = reference_row(c, b)
        d = (ctx[b].float() - r).abs().max() / r.abs().max()
        err = max(err, float(d) if torch.isfinite(d) else float("inf"))
        dl = (lse[b].float() - rl).abs().max()
        lerr = max(lerr, float(dl) if torch.isfinite(dl) else float("inf"))
    return err, lerr


# ---------------------------------------------------------------------------------------------------- (a) checks
def run_checks() -> None:
    rows = []
    for i, (B, L, bs, pool) in enumerate(S.checks):
        name = f"B={B} ctx={L} bs={bs}"
        try:
            lens = mixed_lengths(B, L, seed=i) if L != 1 else [1] * B
            c = Case(lens, bs, pool_tokens=pool, seed=i)
            ctx, lse = paged_mla_decode(*c.args(), return_lse=True)
            sync()
            err, lerr = compare(c, ctx, lse)
            # the candidate launch too (override), on the same case
            ctx_t, lse_t = tri.paged_mla_decode(*c.args(), **dict(zip(LAUNCH_KEYS, CANDIDATE)))
            sync()
            err_t, lerr_t = compare(c, ctx_t, lse_t)
            ok = max(err, err_t) < CTX_BAR and max(lerr, lerr_t) < LSE_BAR
            ns = tri.default_num_splits(B, S.H, c.max_blocks, bs, tri.num_sms(S.dev))
            rows.append(dict(case=name, splits=ns, pool_elements=c.cache.numel(), ctx_err=err, lse_err=lerr,
                             candidate_ctx_err=err_t, candidate_lse_err=lerr_t, ok="yes" if ok else "**NO**"))
            if not ok:
                FAILED.append(f"check {name}: ctx {err:.3g} lse {lerr:.3g}, candidate {err_t:.3g} {lerr_t:.3g}")
            ctx_t = lse_t = None
            c = ctx = lse = None
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            rows.append(dict(case=name, splits="", pool_elements="", ctx_err="", lse_err="", candidate_ctx_err="",
                             candidate_lse_err="", ok=f"**{type(e).__name__}**"))
            FAILED.append(f"check {name}: {type(e).__name__}: {e}")
        empty_cache()
    table("(a) paged_mla_decode vs dense float32 attention (bf16 pool, shuffled blocks, NaN elsewhere)", rows)
    RESULTS["checks"] += rows
    if S.dev.type == "cuda":
        graph_checks()


def graph_checks() -> None:
    """The op captured once per shape, replayed with new queries, lengths, tables and pool contents."""
    rows = []
    for B, L, pool in S.graph:
        name = f"graph B={B} up to {L}"
        try:
            c = Case([L] * B, S.bs, pool_tokens=pool, seed=99)
            gen = torch.Generator(device=S.dev).manual_seed(7)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                paged_mla_decode(*c.args(), return_lse=True)          # compiles outside the capture
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                ctx, lse = paged_mla_decode(*c.args(), return_lse=True)
            for rnd, lens in enumerate(replay_lengths(B, L)):
                # new lengths and a reshuffled table in the captured buffers (same shapes), new entries and queries
                perm = torch.randperm(c.cache.shape[0] - 1, generator=gen, device=S.dev)
                c.cache.fill_(float("nan"))
                c.table.fill_(c.cache.shape[0] - 1)
                at = 0
                for b, n in enumerate(-(-x // S.bs) for x in lens):
                    c.table[b, :n] = perm[at : at + n].int()
                    at += n
                c.lens_list = lens
                c.refill(gen)
                c.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
                c.q.copy_((2.0 * torch.randn(c.q.shape, generator=gen, device=S.dev)).to(S.dtype))
                g.replay()
                sync()
                err, lerr = compare(c, ctx, lse)
                ok = err < CTX_BAR and lerr < LSE_BAR
                rows.append(dict(case=name, replay=rnd, lengths=short(lens), ctx_err=err, lse_err=lerr,
                                 ok="yes" if ok else "**NO**"))
                if not ok:
                    FAILED.append(f"{name} replay {rnd}: ctx {err:.3g} lse {lerr:.3g}")
            g = c = ctx = lse = None
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            rows.append(dict(case=name, replay="", lengths="", ctx_err="", lse_err="", ok=f"**{type(e).__name__}**"))
            FAILED.append(f"{name}: {type(e).__name__}: {e}")
        empty_cache()
    table("(a) inside a CUDA graph, replayed with new lengths / tables / entries", rows)
    RESULTS["checks"] += rows


def replay_lengths(B: int, L: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(B + L)
    rand = lambda hi: torch.randint(1, hi + 1, (B,), generator=g).tolist()
    return [rand(L), [1] * B, [L] * (B - 1) + [17], rand(max(1, L // 100))]


def short(lens: list[int]) -> str:
    return str(lens) if len(lens) <= 3 else f"{min(lens)}..{max(lens)} ({len(lens)} rows)"


def empty_cache() -> None:
    if S.dev.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------- (b) timings
def gather_dense(q: torch.Tensor, cache: torch.Tensor, table_: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                 C: int) -> torch.Tensor:
    """The path the kernel replaces: the graph step's PagedLatents.append (every table block gathered into a dense
    [B, max_blocks * bs, W] buffer) and NoPEMLA._absorbed's masked dense attention."""
    B, nb = table_.shape
    bs, W = cache.shape[1:]
    entry = cache.index_select(0, table_.reshape(-1)).view(B, nb * bs, W)
    mask = torch.arange(nb * bs, device=q.device)[None] < seq_lens[:, None]              # [B, L]
    scores = (q[:, :, None] @ entry[:, None].transpose(-1, -2)).float() * scale          # [B, H, 1, L]
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    p = scores.softmax(-1).to(entry.dtype)
    return (p @ entry[:, None, :, :C])[:, :, 0]


def bench_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds per call: CUDA events with an L2 flush before each call; on CPU, wall time."""
    if S.dev.type == "cuda":
        return float(triton.testing.do_bench(fn, warmup=10, rep=200, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def graph_of(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` captured in a CUDA graph (after one eager warm-up call): its replay."""
    fn()
    sync()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write counted): what streaming can reach on this card."""
    n = (1 << 30) if S.dev.type == "cuda" else (1 << 20)
    a = torch.empty(n, dtype=torch.uint8, device=S.dev)
    b = torch.empty_like(a)
    ms = bench_ms(lambda: b.copy_(a))
    return 2 * n / (ms * 1e-3)


def run_timings(peak: float) -> None:
    copy_bw = copy_bandwidth()
    rows = []
    for B, L in S.timings:
        name = f"B={B} ctx={L}"
        try:
            c = Case([L] * B, S.bs, seed=B + L)
            args = c.args()
            ours = bench_ms(lambda: paged_mla_decode(*args))
            graph = bench_ms(graph_of(lambda: paged_mla_decode(*args))) if S.dev.type == "cuda" else float("nan")
            table_long = c.table.long()
            old = bench_ms(lambda: gather_dense(c.q, c.cache, table_long, c.seq_lens, S.scale, S.C))
            best = min(ours, graph) if graph == graph else ours
            bw = c.nbytes() / (best * 1e-3)
            rows.append(dict(case=name, splits=tri.default_num_splits(B, S.H, c.max_blocks, S.bs, tri.num_sms(S.dev)),
                             MB_read=c.nbytes() / 1e6, ours_ms=ours, graph_ms=graph, old_ms=old,
                             speedup=old / best, GB_s=bw / 1e9, pct_peak=100 * bw / peak,
                             pct_copy=100 * bw / copy_bw))
            c = args = None                                  # free the pool before the next case
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            rows.append(dict(case=name, splits="", MB_read="", ours_ms="", graph_ms="", old_ms="",
                             speedup=f"**{type(e).__name__}**", GB_s="", pct_peak="", pct_copy=""))
        empty_cache()
    table(f"(b) time per call, bf16, H={S.H}, C+R={S.W}, block {S.bs} (peak {peak / 1e12:.2f} TB/s, device copy "
          f"{copy_bw / 1e12:.2f} TB/s; GB/s from the better of eager / graph)", rows)
    RESULTS["timings"] = rows


def run_sweep(cases: list[tuple[int, int]] | None = None, launches: list[tuple[int, ...]] | None = None) -> None:
    # (BH, BN, warps, stages): both defaults, the candidate, their neighbours and both defaults with 2 stages (one
    # key buffer). Since the block ids are loaded one tile ahead, 3 stages double-buffer the key tiles (offline sm_90
    # build, local Triton: [32, 64] at 8 warps 175 registers, 184 KB of shared memory; at 16 warps 106, 184 KB;
    # [32, 32] at 8 warps 171, 110 KB, 4 stages 146 KB; [16, 32] at 4 warps 183, 91 KB).
    configs = list(dict.fromkeys([tri.LAUNCH[2], tri.LAUNCH_LONG, CANDIDATE, *(launches or [(32, 64, 16, 3),
                                  (32, 32, 8, 3), (32, 32, 8, 4), (16, 32, 4, 2), (32, 64, 8, 2), (32, 128, 16, 2)])]))
    rows = []
    for B, L in cases or S.sweep_cases:
        c = Case([L] * B, S.bs, seed=B + L)
        chosen = tri.launch_shape(2, B, S.H, c.max_blocks, S.bs, tri.num_sms(S.dev))
        base = tri.default_num_splits(B, S.H, c.max_blocks, S.bs, tri.num_sms(S.dev), chosen[0],
                                      tri.LONG_PER_SM if chosen == tri.LAUNCH_LONG else tri.PROGRAMS_PER_SM)
        for BH, BN, nw, ns in configs:
            base_bh = tri.default_num_splits(B, S.H, c.max_blocks, S.bs, tri.num_sms(S.dev), BH,
                                             tri.LONG_PER_SM if BH >= 32 else tri.PROGRAMS_PER_SM)
            most = max(1, L // 16)
            for splits in sorted({min(most, max(1, s)) for s in (base_bh // 2, base_bh, 2 * base_bh, 4 * base_bh)}):
                row = dict(case=f"B={B} ctx={L}", BH=BH, BN=BN, warps=nw, stages=ns,
                           splits=splits)
                try:
                    fn = partial(tri.paged_mla_decode, *c.args(), num_splits=splits, block_h=BH, block_n=BN,
                                 num_warps=nw, num_stages=ns)
                    ms = bench_ms(graph_of(fn) if S.dev.type == "cuda" else fn)   # no host time in short cases
                    rows.append(dict(row, default=(BH, BN, nw, ns) == chosen and splits == base, ms=ms,
                                     GB_s=c.nbytes() / (ms * 1e-3) / 1e9))
                except Exception as e:  # noqa: BLE001
                    rows.append(dict(row, default=False, ms=f"**{type(e).__name__}**", GB_s=""))
        c = None
        empty_cache()
    table("(c) sweep: tiles (BH heads x BN keys), warps, stages, splits", rows)
    RESULTS["sweep"] = rows


class NoLaunch:
    """Stands in for a Triton kernel object: ``kernel[grid](...)`` launches nothing (run_parts)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def run_parts(cases: list[tuple[int, int]]) -> None:
    """(d) where a call's time goes, graph replays: the whole op, the split launch alone (the merge replaced by
    no launch), and both again with every row cut to its first tile's keys (the same grid and split count: what
    a call costs that streams almost nothing). Whole minus split is the merge; whole minus its cut form is the
    stream, whose bytes give the rate it streams at."""
    rows = []
    for B, L in cases:
        c = Case([L] * B, S.bs, seed=B + L)
        args = c.args()
        run = graph_of if S.dev.type == "cuda" else (lambda f: f)
        times = {}
        for cut in (False, True):
            if cut:
                c.seq_lens.fill_(min(L, 64))
            times[cut, "whole"] = bench_ms(run(lambda: tri.paged_mla_decode(*args)))
            merge, tri.mla_decode_merge_kernel = tri.mla_decode_merge_kernel, NoLaunch()
            try:
                times[cut, "split"] = bench_ms(run(lambda: tri.paged_mla_decode(*args)))
            finally:
                tri.mla_decode_merge_kernel = merge
        stream = times[False, "whole"] - times[True, "whole"]
        rows.append(dict(case=f"B={B} ctx={L}", whole_us=1e3 * times[False, "whole"],
                         split_us=1e3 * times[False, "split"],
                         merge_us=1e3 * (times[False, "whole"] - times[False, "split"]),
                         cut_whole_us=1e3 * times[True, "whole"], cut_split_us=1e3 * times[True, "split"],
                         stream_us=1e3 * stream, stream_GB_s=c.nbytes() / max(stream * 1e-3, 1e-12) / 1e9))
        c = args = None
        empty_cache()
    table(f"(d) parts of a call, block {S.bs}, graph replays, us (cut: every row's keys cut to 64, same grid)", rows)
    RESULTS["parts"] = rows


# ----------------------------------------------------------------------------------------- offline sm_90 build
def offline_sm90() -> int:
    """Compile both kernels for sm_90 without a GPU (the local Triton's ptxas) and print registers, stack (spills)
    and shared memory of each launch the op makes for bf16 / fp16 / fp32 pools and block sizes 16 / 64 / 256."""
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    rows = []

    def build(fn, sig: dict, const: dict, nw: int, ns: int) -> str:
        sig = dict(sig, **{k: "constexpr" for k in const})
        attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params) if sig[p.name].startswith("*")}
        ck = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 128),
                            options=dict(num_warps=nw, num_stages=ns))
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(ck.asm["cubin"])
            f.flush()
            use = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", f.name],
                                 capture_output=True, text=True).stdout
        m = re.search(r"REG:(\d+) STACK:(\d+)", use)
        return f"{m.group(1)} regs, {m.group(2)} B stack, {ck.metadata.shared} B smem" if m else "?"

    for dt in (torch.bfloat16, torch.float16, torch.float32):
        launches = [tri.LAUNCH[torch.empty(0, dtype=dt).element_size()]]
        if dt != torch.float32:
            launches = list(dict.fromkeys([*launches, tri.LAUNCH_LONG, CANDIDATE]))
        for (BH, BN, nw, ns), bs, single in product(launches, (16, 64, 256), (True, False)):
            d = "*" + name[dt]
            sig = dict(q=d, cache=d, block_table="*i32", seq_lens="*i32", o_part="*fp32", lse_part="*fp32",
                       o=d, lse="*fp32", qk_scale="fp32", stride_t="i32", H="i32", NS="i32", MB="i32")
            const = dict(C=512, R=64, BS=bs, BH=BH, BN=BN, BC=512, BR=64,
                         PREC="ieee" if dt == torch.float32 else "tf32", SINGLE=single, PDL=False)
            try:
                res = build(tri.mla_decode_split_kernel, sig, const, nw, ns)
            except Exception as e:  # noqa: BLE001
                res = f"**{type(e).__name__}**: {str(e)[-300:]}"
            rows.append(dict(kernel="split" + (" (one split)" if single else ""), dtype=name[dt], block=bs,
                             tiles=f"{BH}x{BN}", warps=nw, stages=ns,
                             build=res))
        sig = dict(o_part="*fp32", lse_part="*fp32", seq_lens="*i32", o="*" + name[dt], lse="*fp32", H="i32",
                   NS="i32", MB="i32")
        const = dict(C=512, BS=16, BN=BN, BV=tri.MERGE_BV, BSP=tri.MERGE_BS, PDL=False)
        rows.append(dict(kernel="merge", dtype=name[dt], block=16, tiles=f"{tri.MERGE_BS}x{tri.MERGE_BV}", warps=4,
                         stages=3, build=build(tri.mla_decode_merge_kernel, sig, const, 4, 3)))
    table("offline sm_90 build (C = 512, R = 64)", rows)
    return 0


# --------------------------------------------------------------------------------------------------------- main
def parse_cases(text: str) -> list[tuple[int, int]]:
    """'1x131072,128x4096' -> [(1, 131072), (128, 4096)]: rows x context pairs of (c) and (d)."""
    return [tuple(int(v) for v in c.split("x")) for c in text.split(",") if c]


def parse_launch(text: str) -> tuple[int, int, int, int]:
    """'BH,BN,W,S' -> (BH, BN, W, S); ValueError naming the text otherwise."""
    parts = text.split(",")
    if len(parts) != 4 or not all(v.strip().isdigit() and int(v) > 0 for v in parts):
        raise ValueError(f"a launch is four positive integers BH,BN,W,S (got {text!r})")
    return tuple(int(v) for v in parts)


def main() -> int:
    global S
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny shapes")
    p.add_argument("--no-check", action="store_true", help="skip (a)")
    p.add_argument("--no-bench", action="store_true", help="skip (b)")
    p.add_argument("--sweep", action="store_true", help="(c): other tiles, warps, stages and split counts")
    p.add_argument("--sweep-cases", default="", help="(c) at these rows x context pairs instead, e.g. 1x4096,1x131072")
    p.add_argument("--parts", default="", metavar="BxL,...",
                   help="(d) at these rows x context pairs: the whole call, the split launch alone, and both with "
                        "every row cut to 64 keys, e.g. 1x131072,1x4096")
    p.add_argument("--offline-sm90", action="store_true", help="no GPU: compile the kernels for sm_90 and stop")
    p.add_argument("--launches", default="", metavar="BH,BN,W,S;...",
                   help="(c) these launches (tiles, warps, stages) beside the defaults instead of the built-in list")
    p.add_argument("--candidate", default="", metavar="BH,BN,W,S",
                   help="the launch (a) checks beside the default at every context (default: the long splits')")
    p.add_argument("--block-size", type=int, default=16,
                   help="pool block size of (b) and (c) (default 16, the engine's; generate's pools use 64)")
    p.add_argument("--peak", type=float, default=4.2e12, help="HBM bytes/s to compare with (H200: 4.2e12)")
    p.add_argument("--out", default="", help="directory for mla_decode.json")
    a = p.parse_args()
    global CANDIDATE
    try:
        launches = [parse_launch(t) for t in a.launches.split(";") if t]
        CANDIDATE = parse_launch(a.candidate) if a.candidate else CANDIDATE
    except ValueError as e:
        p.error(str(e))
    if a.offline_sm90:
        return offline_sm90()
    if not a.smoke and not torch.cuda.is_available():
        say("no CUDA device: run on the GPU, or with --smoke (CPU interpreter) / --offline-sm90")
        return 2
    S = Setup(a.smoke)
    S.bs = a.block_size
    if a.smoke:
        # CPU tensors take the op's PyTorch path: send them to the Triton kernels (interpreted) as CUDA ones would be
        import kimi_linear.ops.mla_decode as md

        md.triton_op = lambda name, x: tri.paged_mla_decode
    torch.manual_seed(0)
    dev = torch.cuda.get_device_name() if S.dev.type == "cuda" else "CPU (Triton interpreter)"
    say(f"## paged MLA decode on {dev}: torch {torch.__version__}, triton {triton.__version__}, "
        f"{tri.num_sms(S.dev)} SMs, default launch {tri.LAUNCH}")
    t0 = time.time()
    if not a.no_check:
        run_checks()
    if not a.no_bench:
        run_timings(a.peak)
    if a.sweep:
        run_sweep(parse_cases(a.sweep_cases) if a.sweep_cases else None, launches)
    if a.parts:
        run_parts(parse_cases(a.parts))
    say(f"\n{time.time() - t0:.0f} s. " + ("All checks passed." if not FAILED else "FAILED:\n- " + "\n- ".join(FAILED)))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "mla_decode.json"), "w") as f:
            json.dump(dict(RESULTS, failed=FAILED, device=dev), f, indent=1, default=str)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
