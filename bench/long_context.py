"""One million tokens on one GPU (issue 21): Kimi-Linear-48B's shape against its all-MLA twin, through the engine.

One model per process (``--model hybrid`` or ``--model mla``): the ``kimi-linear-48b`` preset (27 layers, 256
experts, top-8, hidden 2304, vocabulary 163840; ``--layers N`` cuts the depth) or its twin with every layer MLA,
random bf16 weights built directly on the GPU (``long_context_model.py``; ~98 GB, no float32 copy), then, through
``LLMEngine`` (its scheduler, cache manager, CUDA-graph decode with the paged MLA kernel, chunked prefill):

- decode (``--contexts``): time per output token at batch 1 and at the largest batch whose pools fit the free
  memory, contexts placed with random cache contents through the engine's own pools and block tables
  (``long_context_engine.decode_point``);
- prefill (``--prefill``): one sequence chunked through the engine, timed to its first token, then decoded from
  that real cache (``--real-prefill N``, default 131072, adds N to the default list);
- cache bytes the engine allocated per sequence beside ``kimi-linear info``'s prediction;
- floors: decode = (active weight bytes + cache bytes read, KDA states read and written) / the copy bandwidth
  measured in this run; prefill = counted FLOPs (projections and top-k experts, MLA's causal T^2 terms, the KDA
  chunk products) / the bf16 matmul rate measured in this run;
- ``--check``: correctness at length in float32 (``long_context_check.py``): engine greedy tokens after a
  131,072-token prompt = one plain forward's, and the KDA final state after a 2^20-token chunked prefill = the
  recurrent kernel's.

Markdown tables on stdout, JSON in ``--out`` (``long_context_<model>[_<tag>].json``, rewritten after every point,
so a run cut short keeps what it measured); ``--plot DIR`` merges the JSON of several processes into ratio tables
beside the report's numbers (TPOT 1.84 vs 11.48 ms at 1M = 6.3x; prefill 2.9x at 1M; ~75% less cache) and
``DIR/long_context.png``. ``--plan`` prints each point's memory and a time estimate without a GPU (a meta model),
``--budget S`` skips points whose estimate would pass S seconds from the start. ``--smoke`` runs every step on the
CPU with tiny shapes (both models, the check, the plot) for CI.

Two device calls of <= 9 minutes on one H200, from the repository root (``--plan`` with the same arguments prints
each point's memory and time estimate first; on the project's device machine prefix ``PYTHONPATH=/tmp/site:src``
if fla's wheel is wanted, it is not needed here). A ``--deadline`` shared by the processes of a call skips the
points that would end after it (each is written to the JSON as skipped):

    # call 1 (measured 2026-12-02: 484 s on a warm machine, 329 of them the 1M prefill): the hybrid's decode points
    # (4k..1M, batch 1 and the largest batch) and its prefill 4k..1M (128k and up decoded from their real caches)
    export PYTHONPATH=src; D=$(( $(date +%s) + 580 ))
    python3 bench/long_context.py --model hybrid --prefill 4096,32768,131072,262144,1048576 --out $OUT --deadline $D

    # call 2 (measured 137 + 93 s): the same for the all-MLA twin (prefill to 256k), then the float32 checks
    export PYTHONPATH=src; D=$(( $(date +%s) + 525 ))
    python3 bench/long_context.py --model mla --out $OUT --deadline $D
    python3 bench/long_context.py --check --out $OUT --deadline $D

    # then, anywhere (CPU): both calls' JSON files in one folder -> ratio tables, DIR/long_context.{png,md}
    python3 bench/long_context.py --plot DIR

"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from floors import WeightSplit, copy_bandwidth, decode_cache_bytes, matmul_rate, prefill_flops  # noqa: E402
from kimi_linear.ops.attention import attention_kernel, attention_lse, attention_lse_torch  # noqa: E402
from long_context_check import engine_vs_forward, kda_state  # noqa: E402
from long_context_engine import decode_point, prefill_point  # noqa: E402
from long_context_model import (  # noqa: E402
    KINDS,
    GiB,
    build,
    decode_reserve,
    largest_batch,
    meta_model,
    model_config,
    prefill_reserve,
    seq_cache_bytes,
)
from long_context_report import check_table, decode_table, plot, prefill_table, table  # noqa: E402

CONTEXTS = [4096, 32768, 131072, 524288, 1048576]
PREFILL = {"hybrid": [4096, 32768, 131072, 262144, 1048576], "mla": [4096, 32768, 131072, 262144]}
SMOKE_CONTEXTS = [64, 256]
SMOKE_PREFILL = {"hybrid": [64], "mla": [64]}          # + --real-prefill (256 in smoke)
# --plan's yardsticks when no GPU measures them: an H200's copy bandwidth and bf16 matmul rate (BENCHMARKS.md)
NOMINAL_BW, NOMINAL_RATE = 4.2e12, 6.7e14


def parse_list(text: str | None, name: str) -> list[int] | None:
    """"4096,32768" -> [4096, 32768]; "none" -> []; None -> None (the default)."""
    if text is None:
        return None
    if text.strip().lower() in ("", "none"):
        return []
    try:
        out = [int(float(x)) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"`--{name}` must be a comma-separated list of token counts or 'none', got {text!r}") from None
    if any(n < 2 for n in out):
        raise SystemExit(f"`--{name}`: every context must be >= 2 tokens, got {out}")
    return out


def args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=KINDS, help="which model this process measures")
    p.add_argument("--out", default=".", help="folder for the JSON (and, with --smoke, the plot)")
    p.add_argument("--tag", default="", help="suffix of this process's JSON file name")
    p.add_argument("--contexts", help=f"decode contexts (default {','.join(map(str, CONTEXTS))}; 'none')")
    p.add_argument("--prefill", help="prefill contexts (default hybrid 4k..1M, mla 4k..256k; 'none')")
    p.add_argument("--real-prefill", type=int, default=131072,
                   help="a context reached by a real chunked prefill and decoded from there (added to the default "
                        "--prefill list; 0: none)")
    p.add_argument("--no-batch-max", action="store_true", help="decode at batch 1 only")
    p.add_argument("--max-batch", type=int, default=1024, help="cap of the largest batch")
    p.add_argument("--layers", type=int, help="cut the depth to N layers (tests, small GPUs)")
    p.add_argument("--prefill-chunk", type=int, default=16384, help="engine prefill chunk (tokens)")
    p.add_argument("--block-size", type=int, default=16, help="engine MLA block size (tokens)")
    # 3 warm-up and 20 timed steps once gave the engine's host share of a batch-1 step as 0.3-0.5 ms beside 0.10 ms
    # over 200 steps after 30 (same code, 48B shape, 4k): more of both, at a few ms a step
    p.add_argument("--steps", type=int, default=50, help="timed decode steps per point")
    p.add_argument("--warmup", type=int, default=20, help="decode steps before timing (the first captures)")
    p.add_argument("--check", action="store_true", help="the correctness checks (float32, own small model)")
    p.add_argument("--check-prompt", type=int, default=131072, help="prompt of the engine-vs-forward check")
    p.add_argument("--check-new", type=int, default=8, help="greedy tokens of the engine-vs-forward check")
    p.add_argument("--kda-tokens", type=int, default=1 << 20, help="sequence of the KDA state check")
    p.add_argument("--budget", type=float, default=0.0, help="seconds from the start; later points that would "
                   "pass it (by their estimate) are skipped (0: no budget)")
    p.add_argument("--deadline", type=float, default=0.0, help="the same as a wall-clock time (seconds since the "
                   "epoch, e.g. $(( $(date +%%s) + 520 ))): one deadline shared by several processes of one call")
    p.add_argument("--plan", action="store_true", help="print memory and time estimates per point; no GPU")
    p.add_argument("--card-gib", type=float, default=139.0, help="--plan: the card's memory (GiB; an H200 shows ~139)")
    p.add_argument("--plot", metavar="DIR", help="merge DIR's JSON files into ratio tables and DIR/long_context.png")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, every step (CI)")
    return p


# ------------------------------------------------------------------------------------------------- setup
class Run:
    """This process's settings, results and JSON file."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.start = time.time()
        self.smoke = a.smoke
        self.device = "cuda" if torch.cuda.is_available() and not a.smoke else "cpu"
        self.dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        if a.smoke:
            torch.set_num_threads(1)       # tiny shapes gain nothing from threads, and lose much on a shared CPU
            a.steps, a.warmup, a.prefill_chunk = min(a.steps, 2), 1, 64
            a.check_prompt, a.check_new, a.kda_tokens = 200, 3, 512
            if a.real_prefill == 131072:
                a.real_prefill = 256
        self.models = ([a.model] if a.model else []) if not a.smoke else list(KINDS)
        self.contexts = parse_list(a.contexts, "contexts")
        self.prefill_lists = {k: self.prefill_for(k) for k in KINDS}
        self.doc: dict[str, Any] = dict(meta=self.meta(), models={}, check=None)
        self.slow_attention = False
        os.makedirs(a.out, exist_ok=True)
        name = "_".join(["long_context", *(self.models if not a.smoke else ["smoke"]), *([a.tag] if a.tag else [])])
        self.path = os.path.join(a.out, (name if self.models or a.smoke else "long_context_check") + ".json")

    def prefill_for(self, kind: str) -> list[int]:
        a = self.a
        got = parse_list(a.prefill, "prefill")
        if got is None:
            got = list((SMOKE_PREFILL if a.smoke else PREFILL)[kind])
            if a.real_prefill and a.real_prefill not in got:
                got.append(a.real_prefill)
        return sorted(got)

    def decode_contexts(self) -> list[int]:
        if self.contexts is not None:
            return self.contexts
        return SMOKE_CONTEXTS if self.smoke else CONTEXTS

    def max_context(self, kind: str) -> int:
        a = self.a
        longest = max([*self.decode_contexts(), *self.prefill_lists[kind], 64])
        return math.ceil((longest + a.warmup + a.steps + 64) / a.block_size) * a.block_size

    def meta(self) -> dict[str, Any]:
        m = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), argv=sys.argv[1:],
                 torch=torch.__version__, python=platform.python_version(), device=self.device,
                 dtype=str(self.dtype).removeprefix("torch."))
        if self.device == "cuda":
            m["gpu"] = torch.cuda.get_device_name()
            m["gpu_memory_gb"] = torch.cuda.get_device_properties(0).total_memory / 1e9
            try:
                import triton

                m["triton"] = triton.__version__
            except ImportError:
                pass
        return m

    def elapsed(self) -> float:
        return time.time() - self.start

    def fits(self, estimate_s: float) -> bool:
        """Whether a step estimated at ``estimate_s`` seconds ends before the budget and the deadline."""
        a = self.a
        return (not a.budget or self.elapsed() + estimate_s <= a.budget) and \
            (not a.deadline or time.time() + estimate_s <= a.deadline)

    def save(self) -> None:
        self.doc["meta"]["elapsed_s"] = self.elapsed()
        with open(self.path, "w") as f:
            json.dump(self.doc, f, indent=1, default=str)


# --------------------------------------------------------------------------------------------- estimates
def decode_estimate_s(model: Any, context: int, batch: int, steps: int, warmup: int, bw: float) -> float:
    """Seconds of one decode point (a guess for --plan and --budget): building the requests on the host (~150 ns
    a prompt token), filling the pools, the first step's graph capture (~0.1 s a layer), then warm-up, timed steps
    and graph replays at ~2.5x the floor plus ~0.25 ms a layer of launches and ~40 us a row of engine work."""
    L = len(model.model.layers)
    floor = (WeightSplit.of(model).decode_bytes(batch) + decode_cache_bytes(model, batch, context)) / bw
    step = 2.5 * floor + 2.5e-4 * L + 4e-5 * batch
    setup = 0.5 + batch * context * 1.5e-7 + batch * seq_cache_bytes(model.config, context, 16, model.dtype) / 5e11
    return setup + 0.1 * L + (warmup + 2 * steps) * step


def prefill_estimate_s(model: Any, context: int, chunk: int, steps: int, warmup: int, bw: float,
                       rate: float) -> float:
    """Seconds of one prefill point (a guess): MLA attention at 45% of the matmul rate (flash attention with the
    values padded to the key width), the rest at 35%, ~10 ms a layer per chunk of host and small kernels, then the
    decode steps."""
    f = prefill_flops(model, context, chunk)
    L = len(model.model.layers)
    chunks = math.ceil(context / chunk)
    compute = f["mla_attention"] / (0.45 * rate) + (f["total"] - f["mla_attention"]) / (0.35 * rate)
    return compute + chunks * 0.01 * L + context * 3e-7 + decode_estimate_s(model, context, 1, steps, warmup, bw)


def build_estimate_s(weight_bytes: int) -> float:
    """Model construction, in-place initialisation and packing: 98 GB took 5.4-6.4 s on the H200 (2026-12-02);
    ~2 s of Python plus ~25 GB/s."""
    return 2 + weight_bytes / 25e9


def check_estimate_s(a: argparse.Namespace, rate: float) -> float:
    """The float32 checks: the 4-layer model's prefill twice (engine, plain forward) at a tenth of the bf16 rate
    (CUDA-core float32), plus the KDA state check (~10 s at 2^20 tokens)."""
    meta = meta_model(model_config("hybrid", 4, a.check_prompt + 128, a.smoke, experts=16), torch.float32)
    f = prefill_flops(meta, a.check_prompt, a.prefill_chunk)["total"]
    return 30 + 2 * f / (0.1 * rate) + 10 * a.kda_tokens / 2**20


# ----------------------------------------------------------------------------------------------------- plan
def plan(run: Run) -> int:
    a = run.a
    card = int(a.card_gib * GiB)
    overhead = int(1.5 * GiB)                           # CUDA context, cuBLAS / Triton workspaces
    total = 0.0
    for kind in run.models or list(KINDS):
        meta = meta_model(model_config(kind, a.layers, run.max_context(kind), a.smoke), torch.bfloat16)
        w = WeightSplit.of(meta).total
        free = card - w - overhead
        rows = [["build", "-", "-", gb_(w), "-", f"{build_estimate_s(w):.0f} s (+ ~60 s of Triton compiles on a "
                 "fresh machine)"]]
        secs = build_estimate_s(w) + 60
        for n in run.decode_contexts():
            batches = [1]
            if not a.no_batch_max:
                bmax = largest_batch(free, meta.config, n, a.block_size, meta.dtype, a.max_batch)
                if bmax > 1:
                    batches.append(bmax)
            for b in batches:
                mem = w + overhead + b * seq_cache_bytes(meta.config, n, a.block_size, meta.dtype) + \
                    decode_reserve(meta.config, b)
                est = decode_estimate_s(meta, n, b, a.steps, a.warmup, NOMINAL_BW)
                secs += est
                rows.append(["decode", f"{n:,}", b, gb_(mem), "yes" if mem <= card else "NO", f"{est:.0f} s"])
        for n in run.prefill_lists[kind]:
            mem = w + overhead + seq_cache_bytes(meta.config, n, a.block_size, meta.dtype) + \
                prefill_reserve(a.prefill_chunk)
            est = prefill_estimate_s(meta, n, a.prefill_chunk, a.steps, a.warmup, NOMINAL_BW, NOMINAL_RATE)
            secs += est
            rows.append(["prefill", f"{n:,}", 1, gb_(mem), "yes" if mem <= card else "NO", f"{est:.0f} s"])
        table(f"### Plan: --model {kind} (card {gb_(card)}; weights {gb_(w)}; free after them {gb_(free)}); "
              f"estimated {secs:.0f} s in all", ["step", "context", "batch", "memory", "fits",
                                                                "time (estimate)"], rows)
        total += secs
    if a.check:
        est = check_estimate_s(a, NOMINAL_RATE)
        total += est
        print(f"check: ~{est:.0f} s (float32, 4 layers, {a.check_prompt:,}-token prompt twice; KDA state over "
              f"{a.kda_tokens:,} tokens)\n")
    print(f"estimated total: {total:.0f} s ({total / 60:.1f} min) for the processes above\n")
    return 0


def gb_(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


# ------------------------------------------------------------------------------------------------- measure
def attention_preflight(device: str, dtype: torch.dtype) -> dict[str, Any]:
    """The prompt chunks' attention kernel on this device (MLA's shapes: 192-wide keys, 128-wide values), checked
    against the PyTorch path on a small case, plain and causal. A fused kernel that raises falls back to the
    PyTorch path for good, which long prompts cannot afford: then the long prefill points are skipped."""
    g = torch.Generator(device=device).manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g, device=device).to(dtype)
    q, k, v = r(1, 4, 64, 192), r(1, 4, 96, 192), r(1, 4, 96, 128)
    errs = []
    for causal, kk, vv in ((False, k, v), (True, k[:, :, :64], v[:, :, :64])):
        out, lse = attention_lse(q, kk, vv, 0.07, causal)
        ref, ref_lse = attention_lse_torch(q, kk, vv, 0.07, causal)
        errs.append(max(float((out.float() - ref.float()).abs().max()), float((lse - ref_lse).abs().max())))
    kernel = attention_kernel(q, 128)
    bar = 5e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
    return dict(kernel=kernel, max_error=max(errs), ok=max(errs) <= bar and (device != "cuda" or kernel != "torch"))


def free_bytes() -> int:
    """Memory the pools may take now: the driver's free memory plus what the allocator holds unused."""
    if not torch.cuda.is_available():
        return 8 * GiB                                  # CPU smoke: the caps keep it tiny
    free, _ = torch.cuda.mem_get_info()
    return int(free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated())


def measure(run: Run, kind: str, bw: float, rate: float) -> None:
    a = run.a
    res: dict[str, Any] = dict(decode=[], prefill=[])
    run.doc["models"][kind] = res
    config = model_config(kind, a.layers, run.max_context(kind), a.smoke)
    t = time.perf_counter()
    model = build(config, run.device, run.dtype)
    if run.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()        # the packing's freed per-expert pieces: back to the driver for the pools
    split = WeightSplit.of(model)
    res["model"] = dict(layers=config.layer_types, experts=config.num_local_experts,
                        top_k=config.num_experts_per_tok, hidden=config.hidden_size, vocab=config.vocab_size,
                        weight_bytes=split.total, build_s=time.perf_counter() - t, free_after_build=free_bytes(),
                        max_context=run.max_context(kind))
    print(f"## {kind}: {len(config.layer_types)} layers ({config.layer_types.count('full_attention')} MLA), "
          f"{split.total / 1e9:.1f} GB of {str(model.dtype).removeprefix('torch.')} weights built in "
          f"{res['model']['build_s']:.1f} s; {free_bytes() / 1e9:.1f} GB free\n", flush=True)
    run.save()
    for n in run.decode_contexts():
        batches = [1]
        if not a.no_batch_max:
            cap = min(a.max_batch, 2) if a.smoke else a.max_batch
            bmax = largest_batch(free_bytes(), config, n, a.block_size, model.dtype, cap)
            if bmax > 1:
                batches.append(bmax)
        for b in batches:
            est = decode_estimate_s(model, n, b, a.steps, a.warmup, bw if bw == bw else NOMINAL_BW)
            if not run.fits(est):
                res["decode"].append(dict(context=n, batch=b, skipped=f"budget (estimate {est:.0f} s)"))
                continue
            row = decode_point(model, n, b, a.warmup, a.steps, a.block_size, a.prefill_chunk, bw)
            row["estimate_s"] = est
            res["decode"].append(row)
            print(f"decode {kind} {n:,} x {b}: {row['step_ms']:.3f} ms (floor {row['floor_ms']:.3f})", flush=True)
            run.save()
    for n in run.prefill_lists[kind]:
        est = prefill_estimate_s(model, n, a.prefill_chunk, a.steps, a.warmup, bw if bw == bw else NOMINAL_BW,
                                 rate if rate == rate else NOMINAL_RATE)
        if run.slow_attention and n > 32768:
            res["prefill"].append(dict(context=n, skipped="the fused attention kernel failed its preflight"))
            continue
        if not run.fits(est):
            res["prefill"].append(dict(context=n, skipped=f"budget (estimate {est:.0f} s)"))
            continue
        # a placeholder that says how far the prefill got, in case the call is cut before it ends
        res["prefill"].append(dict(context=n, skipped="cut before its first token (0 tokens prefilled)"))

        def progress(done: int, seconds: float, n: int = n) -> None:
            res["prefill"][-1]["skipped"] = (f"cut before its first token: {done:,} of {n:,} tokens prefilled in "
                                             f"{seconds:.0f} s")
            run.save()

        run.save()
        row = prefill_point(model, n, a.warmup, a.steps, a.block_size, a.prefill_chunk, bw, rate, progress=progress,
                            every_s=0.0 if a.smoke else 15.0)
        row["estimate_s"] = est
        res["prefill"][-1] = row
        print(f"prefill {kind} {n:,}: {row['prefill_s']:.2f} s, then {row['decode_step_ms']:.3f} ms a token",
              flush=True)
        run.save()
    print()
    decode_table(kind, res["decode"])
    prefill_table(kind, res["prefill"])
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def check(run: Run, rate: float) -> None:
    a = run.a
    est = check_estimate_s(a, rate if rate == rate else NOMINAL_RATE)
    if not run.fits(est):
        run.doc["check"] = dict(skipped=f"budget (estimate {est:.0f} s)")
        return
    res: dict[str, Any] = {}
    run.doc["check"] = res
    res["engine_vs_forward"] = engine_vs_forward(run.device, a.check_prompt, a.check_new, a.prefill_chunk, a.smoke)
    run.save()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    res["kda_state"] = kda_state(run.device, a.kda_tokens, a.prefill_chunk)
    run.save()
    check_table(res)


def main() -> int:
    a = args_parser().parse_args()
    if a.plot and not (a.model or a.check or a.smoke):
        plot(a.plot)
        return 0
    if not (a.model or a.check or a.smoke or a.plan):
        raise SystemExit("nothing to do: give --model, --check, --plot, --plan or --smoke")
    for name in ("steps", "warmup", "prefill_chunk", "block_size", "max_batch"):
        if getattr(a, name) < 1:
            raise SystemExit(f"`--{name.replace('_', '-')}` must be >= 1, got {getattr(a, name)}")
    if a.prefill_chunk % a.block_size:
        raise SystemExit(f"`--prefill-chunk` ({a.prefill_chunk}) must be a multiple of `--block-size` ({a.block_size})")
    run = Run(a)
    if a.plan:
        return plan(run)
    bw, rate = copy_bandwidth(run.device), matmul_rate(run.device)
    run.doc["meta"].update(copy_bandwidth_GBps=bw / 1e9, matmul_TFLOPs=rate / 1e12)
    pre = run.doc["meta"]["prefill_attention"] = attention_preflight(run.device, run.dtype)
    run.slow_attention = not pre["ok"]
    print(f"# long context on {run.doc['meta'].get('gpu', run.device)}: copy {bw / 1e9:.0f} GB/s, matmul "
          f"{rate / 1e12:.0f} TFLOP/s, prefill attention kernel '{pre['kernel']}' (error {pre['max_error']:.1e}"
          f"{'' if pre['ok'] else ': NOT OK, prefill points past 32k skipped'})\n", flush=True)
    for kind in run.models:
        measure(run, kind, bw, rate)
    if a.check or a.smoke:
        check(run, rate)
    run.save()
    print(f"wrote {run.path} ({run.elapsed():.0f} s)")
    if a.smoke or a.plot:
        plot(a.plot or a.out)
    failed = run.doc["check"] is not None and not all(v.get("ok", True) for v in run.doc["check"].values()
                                                      if isinstance(v, dict))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
