"""The whole model on one GPU: correctness of the fast decode path and its speed beside transformers + fla.

    python bench/engine_gpu.py --out OUT                 # one GPU: (k) + (a) + (b): every check, then the speed
    python bench/engine_gpu.py --out OUT --parts b       # speed only
    python bench/engine_gpu.py --out OUT --parts p       # the prefill comparison of (b) only
    python bench/engine_gpu.py --smoke --out /tmp/smoke  # CPU, tiny shapes: the whole script end to end

Models are random checkpoints built on the device: the ``small`` preset, and Kimi-Linear-48B's per-layer shape
cut to 8 layers (layers 1-3 and 5-7 KDA, 4 and 8 MLA; layer 1 dense, 2-8 MoE) with 32 or 256 experts.

(k) The kernels' own GPU checks, each script in a process of its own: the fused MoE against the PyTorch MoE
    (``bench/moe_gpu.py --no-bench``: random routings, experts that receive no token, every token on the same
    experts, SiTU, CUDA-graph replays) and the paged MLA decode against dense attention
    (``bench/mla_decode_gpu.py --no-bench``: contexts 1, 17, 4,096, 262,144 and 1M, CUDA-graph replays).
(a) Correctness, float32: requests of mixed prompt and output lengths (more than ``max_num_seqs``, so rows join and
    leave) greedy through the engine with CUDA graphs (scratch rows filled with NaN first), the engine without
    (eager forwards), the engine with mixed steps (decode rows and prompt chunks in one forward), ``generate``
    one by one on its fast path (graphs) and ``generate`` one by one on the hybrid cache (``cuda_graphs=False``,
    the reference). Tokens must be identical, except where the reference's top two
    log-probs are within ``--tie`` at the first different token (rounding of another batch shape may flip a
    near-tie: counted and shown, not failed).
(b) Speed, bf16, the 8-layer 48B shape with 32 experts: time per output token at batch 1 with 4k and 128k
    contexts (engine and ``generate``), ``generate`` beside transformers' ``generate`` with fla-core installed on
    the same checkpoint, decode-only engine throughput at batch 1..256, and the prefill of 32 x 2048-token prompts
    through the engine against one bare model forward over the same tokens. Floors: weight and cache bytes a step
    reads over the copy bandwidth measured in the same run.

Markdown tables on stdout; JSON in --out. Exit status 1 when a check of (k) or (a) fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from kimi_linear.engine import EngineConfig, LLMEngine, SamplingParams
from kimi_linear.model import KimiLinearForCausalLM, preset_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_timing import timed_steps  # noqa: E402
from floors import WeightSplit, copy_bandwidth, decode_cache_bytes, sync  # noqa: E402, F401  (re-exported)


def shape_48b(layers: int, experts: int, **kw: Any):
    """Kimi-Linear-48B's per-layer shape, cut to ``layers`` layers (every 4th MLA, the last one too)."""
    mla = [i for i in range(1, layers + 1) if i % 4 == 0 or i == layers]
    lac = dict(kda_layers=[i for i in range(1, layers + 1) if i not in mla], full_attn_layers=mla, head_dim=128,
               num_heads=32, short_conv_kernel_size=4)
    return preset_config("kimi-linear-48b", num_hidden_layers=layers, num_experts=experts, linear_attn_config=lac,
                         **kw)


def build(name: str, dtype: torch.dtype, device: str, smoke: bool) -> KimiLinearForCausalLM:
    """A random model built and initialised on ``device`` (no file)."""
    if name == "small" or smoke:
        config = preset_config("tiny" if smoke else "small")
    else:
        experts = int(name.split("-")[-1].removesuffix("e"))
        config = shape_48b(8, experts)
    with torch.device(device):
        model = KimiLinearForCausalLM(config)
    model.init_weights(0)
    return model.cast(dtype).eval()


# ------------------------------------------------------------------------------------------------ (a) correctness
Run = tuple[list[list[int]], list[list[float]]]        # tokens, top-2 log-prob gaps


def run_engine(model: KimiLinearForCausalLM, cfg: EngineConfig, reqs: list[tuple[list[int], int]]) -> Run:
    engine = LLMEngine(model, cfg)
    if engine.graphs is not None:
        for t in engine.slots.conv + engine.slots.rec + engine.blocks.data:
            t[-1] = float("nan")                        # what padding rows read: must never reach a real row
    toks: list[list[int]] = [[] for _ in reqs]
    gaps: list[list[float]] = [[] for _ in reqs]

    def sink(i: int):
        def f(o):
            toks[i].extend(o.token_ids)
            gaps[i].extend(alts[0][1] - alts[1][1] for _, _, alts in o.logprobs)
        return f

    for i, (p, n) in enumerate(reqs):
        engine.add_request(str(i), p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2),
                           sink(i))
    while engine.has_work():
        engine.step()
    return toks, gaps


def run_single(model: KimiLinearForCausalLM, reqs: list[tuple[list[int], int]], graphs: bool) -> Run:
    toks, gaps = [], []
    for p, n in reqs:
        ids, logits = model.generate(torch.tensor([p], device=model.device), max_new_tokens=n, eos_token_id=None,
                                     return_logits=True, cuda_graphs=graphs)
        toks.append(ids[0, len(p):].tolist())
        top = [lg[0].float().log_softmax(-1).topk(2).values.tolist() for lg in logits]
        gaps.append([a - b for a, b in top])
    return toks, gaps


def agreement(a: Run, ref: Run, tie: float) -> dict:
    """Identical requests; of the others, first differences at a near-tie of the reference, and real mismatches."""
    same = ties = bad = 0
    for x, y, g in zip(a[0], ref[0], ref[1]):
        i = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None)
        if i is None and len(x) == len(y):
            same += 1
        elif i is not None and g[i] < tie:
            ties += 1
        else:
            bad += 1
    return dict(identical=same, near_tie_flips=ties, mismatches=bad, of=len(a[0]))


def part_a(args: argparse.Namespace) -> tuple[dict, bool]:
    res: dict[str, Any] = {}
    ok = True
    # Each model's row is printed as soon as it is checked, so a run cut by a time limit keeps what it finished.
    block = args.block_size or EngineConfig().resolved(torch.device(args.device).type).block_size
    print(f"\n## (a) float32 greedy tokens against generate on the hybrid cache, {args.requests} requests (prompts "
          f"1-{args.max_prompt - 1}, outputs 4-{args.max_new - 1}), max_num_seqs {args.max_num_seqs}, the engine's "
          f"MLA blocks {block} tokens\n")
    print("| model | engine, CUDA graphs | engine, eager | engine, mixed steps | generate, CUDA graphs | pass | s |")
    print("|---|---|---|---|---|---|---|", flush=True)
    f = lambda a: f"{a['identical']}/{a['of']} (near-ties {a['near_tie_flips']}, other {a['mismatches']})"
    for name in args.check_models:
        model = build(name, torch.float32, args.device, args.smoke)
        vocab = model.config.vocab_size
        rng = random.Random(0)
        reqs = [([rng.randrange(vocab) for _ in range(rng.randrange(1, args.max_prompt))],
                 rng.randrange(4, args.max_new)) for _ in range(args.requests)]
        cfg = dict(max_num_seqs=args.max_num_seqs, block_size=block)
        t0 = time.perf_counter()
        ref = run_single(model, reqs, graphs=False)
        runs = dict(engine_graphs=run_engine(model, EngineConfig(cuda_graphs=True, **cfg), reqs),
                    engine_eager=run_engine(model, EngineConfig(cuda_graphs=False, **cfg), reqs),
                    engine_mixed=run_engine(model, EngineConfig(cuda_graphs=True, mixed_steps=True, **cfg), reqs),
                    generate_graphs=run_single(model, reqs, graphs=True))
        r = {k: agreement(v, ref, args.tie) for k, v in runs.items()}
        r["pass"] = all(v["mismatches"] == 0 for v in r.values())
        r["seconds"] = time.perf_counter() - t0
        ok &= r["pass"]
        res[name] = r
        print(f"| {name} | {f(r['engine_graphs'])} | {f(r['engine_eager'])} | {f(r['engine_mixed'])} | "
              f"{f(r['generate_graphs'])} | {'yes' if r['pass'] else 'NO'} | {r['seconds']:.0f} |", flush=True)
        del model
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return res, ok


# ------------------------------------------------------------------------------------------------------ (b) speed
def active_bytes(model: KimiLinearForCausalLM, batch: int) -> int:
    """Weight bytes one decode step of ``batch`` rows reads (see ``floors.WeightSplit.decode_bytes``)."""
    return WeightSplit.of(model).decode_bytes(batch)


cache_bytes_per_step = decode_cache_bytes


def bench_engine(model: KimiLinearForCausalLM, seqs: int, tokens: int, block_size: int | None = None,
                 **cfg: Any) -> LLMEngine:
    """An engine for ``seqs`` sequences of up to ``tokens`` tokens each (MLA blocks for all of them, two spare a
    sequence), without prefix caching or snapshots (every prompt computed), graphs captured; ``block_size`` None:
    EngineConfig's default for the model's device; ``cfg``: more EngineConfig fields."""
    block = block_size or EngineConfig().resolved(next(model.parameters()).device.type).block_size
    engine = LLMEngine(model, EngineConfig(max_num_seqs=seqs, num_blocks=seqs * (math.ceil(tokens / block) + 2),
                                           num_snapshots=0, prefix_caching=False, block_size=block, **cfg))
    engine.capture_cuda_graphs()
    return engine


def engine_decode(model: KimiLinearForCausalLM, batch: int, prompt_len: int, steps: int, warmup: int,
                  **cfg: Any) -> dict:
    """Decode-only engine steps with ``batch`` rows past their prompts: tokens/s and step latency."""
    engine = bench_engine(model, batch, 2 * prompt_len + warmup + steps + 4, **cfg)
    rng = random.Random(batch)
    vocab = model.config.vocab_size
    for i in range(batch):
        # Rows prefilled in a later step start decoding later: no row may run out of tokens in the timed window.
        engine.add_request(str(i), [rng.randrange(vocab) for _ in range(prompt_len)],
                           SamplingParams(max_tokens=prompt_len + warmup + steps + 2, temperature=0,
                                          ignore_eos=True))
    t = time.perf_counter()
    # (a row whose prompt is done has 1 uncomputed token, or 0 while its next token is in a pipelined step)
    while len(engine.running) < batch or any(s.num_tokens() - s.num_computed > 1 for s in engine.running):
        engine.step()
    sync()
    prefill_s = time.perf_counter() - t
    for _ in range(warmup):
        engine.step()
    sync()
    timed = timed_steps(engine, steps)
    assert len(engine.running) == batch, "a request finished inside the timed window"
    for s in list(engine.running):
        engine.abort(s.request_id)
    out = dict(batch=batch, prompt=prompt_len, tok_per_s=batch * 1e3 / timed["step_ms"], step_ms=timed["step_ms"],
               step_ms_p50=timed["step_ms_median"], prefill_s=prefill_s, host_ms=timed["host_ms"],
               wait_ms=timed["wait_ms"],
               graph_steps=engine.counters["graph_decode_forwards"],
               pipelined_steps=engine.counters.get("pipelined_steps", 0))
    del engine
    return out


def generate_tpot(model: Any, prompt_len: int, new: int, reps: int, **kw: Any) -> dict:
    """Time per output token of ``generate`` at batch 1: (t(new) - t(short)) / (new - short) with short =
    (new - 1) // 8 + 1, medians of ``reps``; TTFT: t(1). Both timed calls prefill the same prompt and set up the
    same decode, so their difference is decode steps only; with t(1) as the base, a 128k prompt's prefill (1.4 s,
    varying by a few ms between calls) moved a 128-token TPOT by tens of microseconds."""
    rng = random.Random(1)
    ids = torch.tensor([[rng.randrange(model.config.vocab_size) for _ in range(prompt_len)]], device="cuda"
                       if torch.cuda.is_available() else "cpu")

    def timed(n: int) -> float:
        sync()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=n, do_sample=False, **{"eos_token_id": None, **kw})
        sync()
        return time.perf_counter() - t

    short = (new - 1) // 8 + 1
    timed(new)                                   # warm-up: kernels compiled, graphs captured
    t1 = statistics.median(timed(1) for _ in range(reps))
    ts = statistics.median(timed(short) for _ in range(reps)) if short > 1 else t1
    tn = statistics.median(timed(new) for _ in range(reps))
    return dict(prompt=prompt_len, new=new, ttft_s=t1, tpot_ms=1e3 * (tn - ts) / (new - short))


def prefill_prompts(model: KimiLinearForCausalLM, n: int, T: int) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(model.config.vocab_size) for _ in range(T)] for _ in range(n)]


def prefill_engine(model: KimiLinearForCausalLM, n: int, T: int, budget: int | None,
                   block_size: int | None = None) -> LLMEngine:
    """An engine for n prompts of T tokens (a cold prefill) at the step token budget ``budget``."""
    return bench_engine(model, n, T, block_size, max_num_batched_tokens=budget)


def prefill_round(engine: LLMEngine, prompts: list[list[int]], tag: str) -> float:
    """Seconds to prefill every prompt (and sample its one token) through ``engine``."""
    sync()
    t = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, SamplingParams(max_tokens=1, temperature=0))
    while engine.has_work():
        engine.step()
    sync()
    return time.perf_counter() - t


def prefill_compare(model: KimiLinearForCausalLM, n: int, T: int, budgets: list[int | None] | None = None,
                    block_size: int | None = None) -> dict:
    """n prompts of T tokens through the engine (decode of one token each) vs one bare forward over them; with
    ``budgets``, one engine per step token budget (``max_num_batched_tokens``; None: the default), the first
    budget's result at the top level and every budget's under ``by_budget``. ``block_size``: the engine's
    (None: EngineConfig's)."""
    prompts = prefill_prompts(model, n, T)
    ids = torch.tensor(prompts, device=model.device)
    with torch.inference_mode():
        model(ids, logits_to_keep=1)              # warm-up at the full shape (kernels compiled for it)
        times = []
        for _ in range(3):
            sync()
            t = time.perf_counter()
            model(ids, logits_to_keep=1)
            sync()
            times.append(time.perf_counter() - t)
        bare = statistics.median(times)
    results = []
    for budget in budgets or [None]:
        engine = prefill_engine(model, n, T, budget, block_size)
        # round 0 warms up the batched prefill shapes, as the bare forward
        eng = statistics.mean([prefill_round(engine, prompts, str(r)) for r in range(3)][1:])
        results.append(dict(prompts=n, tokens=T, bare_tok_per_s=n * T / bare, engine_tok_per_s=n * T / eng,
                            ratio=bare / eng, budget=engine.cfg.max_num_batched_tokens))
        engine = None
    return dict(results[0], by_budget=results)


def hf_model(model: KimiLinearForCausalLM, tmp: str) -> Any:
    """transformers' KimiLinearForCausalLM on the same weights (fla's kernels when fla-core imports)."""
    from transformers import KimiLinearForCausalLM as HF

    path = os.path.join(tmp, "ckpt")
    model.save_pretrained(path)
    hf = HF.from_pretrained(path, dtype=model.dtype).to(model.device).eval()
    return hf


def part_b(args: argparse.Namespace, tmp: str) -> dict:
    bw = copy_bandwidth(args.device)
    model = build(args.speed_model, torch.bfloat16, args.device, args.smoke)
    res: dict[str, Any] = dict(copy_bandwidth_GBps=bw / 1e9, model=args.speed_model)
    floor = lambda b, ctx: 1e3 * (active_bytes(model, b) + cache_bytes_per_step(model, b, ctx)) / bw
    rows = []
    for ctx in args.tpot_contexts:
        e = engine_decode(model, 1, ctx, args.steps, args.warmup, **args.engine_cfg)
        g = generate_tpot(model, ctx, args.gen_new, args.reps)
        rows.append(dict(context=ctx, engine_ms=e["step_ms"], engine_host_ms=e["host_ms"], generate_ms=g["tpot_ms"],
                         floor_ms=floor(1, ctx),
                         engine_prefill_s=e["prefill_s"], generate_ttft_s=g["ttft_s"]))
        print(f"tpot {ctx}: {rows[-1]}", flush=True)
    res["tpot"] = rows
    eager = generate_tpot(model, args.hf_prompt, args.hf_new, 1, cuda_graphs=False)
    # ours over many tokens: at ~1 ms a token, 28 timed steps moved by +-0.1 ms between runs (transformers' 15 ms
    # steps do not need that)
    ours = generate_tpot(model, args.hf_prompt, args.gen_new, args.reps)
    res["generate"] = dict(ours=ours, ours_eager=eager)
    if not args.no_hf:
        try:
            import fla  # noqa: F401
            has_fla = True
        except ImportError:
            has_fla = False
        hf = hf_model(model, tmp)
        res["generate"]["transformers"] = generate_tpot(hf, args.hf_prompt, args.hf_new, 1)
        res["generate"]["transformers"]["fla"] = has_fla
        del hf
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    print(f"generate: {res['generate']}", flush=True)
    thr = []
    for b in args.batches:
        r = engine_decode(model, b, args.prompt_len, args.steps, args.warmup, **args.engine_cfg)
        ctx = args.prompt_len + args.warmup + args.steps // 2
        r["floor_ms"] = floor(b, ctx)
        thr.append(r)
        print(f"decode batch {b}: {r}", flush=True)
    res["throughput"] = thr
    res["prefill"] = prefill_compare(model, args.prefill_n, args.prefill_T, **args.engine_cfg)
    print(f"prefill: {res['prefill']}", flush=True)

    print(f"\n## (b) {args.speed_model}, bf16, copy bandwidth {bw / 1e9:.0f} GB/s")
    table("Time per output token at batch 1 (floor: active weights + cache read once):",
          ["context", "engine ms", "engine host ms", "generate ms", "floor ms", "engine / floor"],
          [[r["context"], f"{r['engine_ms']:.3f}", f"{r['engine_host_ms']:.3f}", f"{r['generate_ms']:.3f}",
            f"{r['floor_ms']:.3f}", f"{r['engine_ms'] / r['floor_ms']:.2f}x"] for r in rows])
    labels = dict(ours="kimi-linear generate (CUDA graph)", ours_eager="kimi-linear generate, cuda_graphs=False")
    table(f"`generate`, {args.hf_prompt}-token prompt, batch 1 (TPOT over the last 7/8 of the new tokens):",
          ["path", "new tokens", "TTFT s", "TPOT ms", "tok/s"],
          [[labels.get(k, f"transformers generate ({'fla-core' if v.get('fla') else 'no fla'})"), v["new"],
            f"{v['ttft_s']:.3f}", f"{v['tpot_ms']:.3f}", f"{1e3 / v['tpot_ms']:.0f}"]
           for k, v in res["generate"].items()])
    table(f"Decode-only engine throughput, {args.prompt_len}-token prompts:",
          ["batch", "tok/s", "step ms (mean / p50)", "host ms", "floor ms", "step / floor"],
          [[r["batch"], f"{r['tok_per_s']:,.0f}", f"{r['step_ms']:.3f} / {r['step_ms_p50']:.3f}",
            f"{r['host_ms']:.3f}", f"{r['floor_ms']:.3f}", f"{r['step_ms'] / r['floor_ms']:.2f}x"] for r in thr])
    p = res["prefill"]
    print(f"\nPrefill of {p['prompts']} x {p['tokens']} tokens: engine {p['engine_tok_per_s']:,.0f} tok/s, one bare "
          f"forward {p['bare_tok_per_s']:,.0f} tok/s: {100 * p['ratio']:.0f}% (token budget {p['budget']})")
    return res


def timed_round(engine: LLMEngine, reqs: list[list[int]], new: int, tag: str
                ) -> tuple[list[list[float]], list[list[int]], float]:
    """All of ``reqs`` queued at once and run to the end: each token's arrival time, the tokens, the wall time."""
    stamps: list[list[float]] = [[] for _ in reqs]
    toks: list[list[int]] = [[] for _ in reqs]

    def sink(i: int):
        def f(o):
            stamps[i].extend([time.perf_counter()] * len(o.token_ids))
            toks[i].extend(o.token_ids)
        return f
    sync()
    t = time.perf_counter()
    for i, p in enumerate(reqs):
        engine.add_request(f"{tag}-{i}", p, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True), sink(i))
    while engine.has_work():
        engine.step()
    sync()
    return stamps, toks, time.perf_counter() - t


def mixed_compare(model: KimiLinearForCausalLM, n: int, prompt_lens: tuple[int, int], new: int, slots: int,
                  block_size: int | None = None) -> list[dict]:
    """EngineConfig.mixed_steps off and on (each after a warm-up round), on a stream of ``n`` greedy requests of
    random prompt lengths in ``prompt_lens`` and ``new`` new tokens, all queued at once against ``slots`` slots, so
    that prompts keep arriving beside running decodes: output tokens/s, the time between a request's tokens
    (TPOT, p50 / p90 over requests, which prefill chunks beside the decode rows lengthen) and how many requests
    got the same tokens as with mixed steps off."""
    rng = random.Random(5)
    vocab = model.config.vocab_size
    reqs = [[rng.randrange(vocab) for _ in range(rng.randint(*prompt_lens))] for _ in range(n)]
    out, ref = [], None
    for mixed in (False, True):
        engine = bench_engine(model, slots, prompt_lens[1] + new, block_size, mixed_steps=mixed)
        for r in range(2):                           # round 0 warms up the shapes
            stamps, toks, wall = timed_round(engine, reqs, new, str(r))
        tpot = sorted(1e3 * (st[-1] - st[0]) / (len(st) - 1) for st in stamps if len(st) > 1)
        same = None if ref is None else sum(a == b for a, b in zip(toks, ref))
        ref = toks if ref is None else ref
        out.append(dict(mixed_steps=mixed, requests=n, out_tok_per_s=n * new / wall, wall_s=wall,
                        tpot_ms_p50=statistics.median(tpot), tpot_ms_p90=tpot[int(0.9 * (len(tpot) - 1))],
                        same_tokens_as_off=same))
        print(f"mixed {mixed}: {out[-1]}", flush=True)
        engine = None
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


def table(title: str, header: list[str], rows: list[list[Any]]) -> None:
    """A markdown table under a title line (numbers right-aligned)."""
    print(f"\n{title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" if i == 0 and header[0] in ("path", "model") else "---:" for i in range(len(header)))
          + "|")
    for r in rows:
        print("| " + " | ".join(str(x) for x in r) + " |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for the JSON results")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny preset and sizes (checks the script on CPU)")
    ap.add_argument("--parts", default="kab", help="which parts to run (default kab; p: only the prefill of b; m: "
                    "mixed steps off and on)")
    ap.add_argument("--prefill-budgets", default="", help="part p alone: step token budgets to compare, e.g. "
                    "16384,32768 (default: the engine's)")
    ap.add_argument("--check-models", default="small,48b-8l-32e,48b-8l-256e",
                    help="models of (a), comma-separated (default small,48b-8l-32e,48b-8l-256e)")
    ap.add_argument("--speed-model", default="48b-8l-32e", help="model of (b) (default 48b-8l-32e)")
    ap.add_argument("--tie", type=float, default=1e-4,
                    help="top-2 log-prob gap under which a float32 token flip counts as a near-tie (default 1e-4)")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    ap.add_argument("--block-size", type=int, default=None,
                    help="the engine's MLA block size in (a) and (b) (default: EngineConfig's for the device: 64 on "
                         "a GPU, 16 on CPU; generate's pools use 64)")
    args = ap.parse_args()
    args.engine_cfg = {"block_size": args.block_size} if args.block_size else {}
    args.check_models = args.check_models.split(",")
    if args.smoke:
        args.check_models = ["tiny"]
        args.requests, args.max_prompt, args.max_new, args.max_num_seqs = 6, 40, 8, 4
        args.tpot_contexts, args.batches, args.prompt_len = [64], [1, 4], 16
        args.steps, args.warmup, args.reps = 3, 1, 1
        args.gen_new, args.hf_prompt, args.hf_new, args.prefill_n, args.prefill_T = 4, 16, 4, 4, 32
        args.mixed_n, args.mixed_prompts, args.mixed_new, args.mixed_slots = 6, (8, 40), 6, 3
    else:
        args.requests, args.max_prompt, args.max_new, args.max_num_seqs = 24, 300, 24, 8
        args.tpot_contexts = [4096, 131072]
        args.batches = [1, 2, 4, 8, 16, 32, 64, 128, 256]
        args.prompt_len, args.steps, args.warmup, args.reps = 512, 32, 4, 3
        args.gen_new, args.hf_prompt, args.hf_new, args.prefill_n, args.prefill_T = 513, 512, 33, 32, 2048
        args.mixed_n, args.mixed_prompts, args.mixed_new, args.mixed_slots = 128, (256, 4096), 128, 32
    os.makedirs(args.out, exist_ok=True)
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"# whole model on {args.device} ({dev}), torch {torch.__version__}", flush=True)
    ok = True
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kl-engine-gpu-") as tmp:
        if "k" in args.parts:
            k_ok = kernel_checks(args.smoke)
            print(f"\n(k) done at {time.perf_counter() - t0:.0f} s: {'PASS' if k_ok else 'FAIL'}", flush=True)
            ok &= k_ok
        if "a" in args.parts:
            res, a_ok = part_a(args)
            ok &= a_ok
            json.dump(res, open(os.path.join(args.out, "a_correctness.json"), "w"), indent=1)
            print(f"\n(a) done at {time.perf_counter() - t0:.0f} s", flush=True)
        if "b" in args.parts:
            json.dump(part_b(args, tmp), open(os.path.join(args.out, "b_speed.json"), "w"), indent=1)
            print(f"\n(b) done at {time.perf_counter() - t0:.0f} s", flush=True)
        if "m" in args.parts:
            m = mixed_compare(build(args.speed_model, torch.bfloat16, args.device, args.smoke), args.mixed_n,
                              args.mixed_prompts, args.mixed_new, args.mixed_slots, args.block_size)
            json.dump(m, open(os.path.join(args.out, "m_mixed.json"), "w"), indent=1)
            table(f"Mixed steps off / on, {args.mixed_n} requests of {args.mixed_prompts[0]}-{args.mixed_prompts[1]} "
                  f"prompt tokens and {args.mixed_new} new, {args.mixed_slots} slots, queued at once:",
                  ["mixed steps", "output tok/s", "TPOT p50 / p90 ms", "wall s", "same tokens as off"],
                  [[r["mixed_steps"], f"{r['out_tok_per_s']:,.0f}", f"{r['tpot_ms_p50']:.2f} / {r['tpot_ms_p90']:.2f}",
                    f"{r['wall_s']:.2f}", "" if r["same_tokens_as_off"] is None
                    else f"{r['same_tokens_as_off']}/{r['requests']}"] for r in m])
        if "p" in args.parts and "b" not in args.parts:
            budgets = [int(b) for b in args.prefill_budgets.split(",")] if args.prefill_budgets else None
            p = prefill_compare(build(args.speed_model, torch.bfloat16, args.device, args.smoke), args.prefill_n,
                                args.prefill_T, budgets)
            json.dump(p, open(os.path.join(args.out, "p_prefill.json"), "w"), indent=1)
            for q in p["by_budget"]:
                print(f"\nPrefill of {q['prompts']} x {q['tokens']} tokens, step budget {q['budget']}: engine "
                      f"{q['engine_tok_per_s']:,.0f} tok/s, one bare forward {q['bare_tok_per_s']:,.0f} tok/s: "
                      f"{100 * q['ratio']:.0f}%", flush=True)
    if "a" in args.parts or "k" in args.parts:   # no verdict for checks that did not run
        print(f"\n({'k' * ('k' in args.parts)}{'a' * ('a' in args.parts)}) checks: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


def kernel_checks(smoke: bool) -> bool:
    """Part (k): the fused MoE's and the paged MLA decode's GPU checks (bench/moe_gpu.py, bench/mla_decode_gpu.py
    without their timings), each in a process of its own so that one's failure or memory does not touch the other;
    their tables go to stdout as they print. True when both exit 0."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    ok = True
    for script in ("moe_gpu.py", "mla_decode_gpu.py"):
        cmd = [sys.executable, os.path.join(here, script), "--no-bench"] + (["--smoke"] if smoke else [])
        print(f"\n## (k) {' '.join(cmd[1:])}", flush=True)
        rc = subprocess.run(cmd).returncode
        print(f"(k) {script}: {'PASS' if rc == 0 else f'FAIL (exit {rc})'}", flush=True)
        ok &= rc == 0
    return ok


if __name__ == "__main__":
    sys.exit(main())
