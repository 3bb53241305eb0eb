"""GPU check and benchmark of the engine's CUDA-graph decode step (issue 6), in one command:

    python bench/engine_gpu.py --out /tmp/engine_gpu           # one GPU: (a) + (b) + (c), about 3 minutes
    python bench/engine_gpu.py --smoke --out /tmp/engine_smoke  # CPU, tiny sizes: the whole script end to end

(a) Correctness, on a random `small` checkpoint in float32 and in bfloat16: N greedy requests of mixed prompt and
    output lengths (more than --max-num-seqs, so rows join and leave) through the engine with CUDA graphs, without,
    and one by one through ``model.generate``. With graphs the pools' scratch slot and block (what padding rows
    read) are filled with NaN first. float32 must give identical tokens in all three, except where the reference's
    top two log-probs are within --tie (1e-4) at the first different token: rounding of a different batch shape
    may flip such a near-tie, which is counted and shown, not failed. bfloat16 is reported only. Then a captured
    graph is checked directly: three rows padded to a batch of 4 change nothing outside their own slots and next
    latent positions (bit for bit), a replay with NaN in the scratch rows gives bit-identical real rows, and the
    eager step from the same state agrees to rounding.
(b) Decode speed, bfloat16: engine steps (decode only, every row past its prompt) at batch 1, 16 and 64, with and
    without graphs: tokens/s and per-step latency (end to end: scheduling, one forward, sampling, emitting), and
    the bare graph replay.
(c) The issue's load test on the GPU: ``bench/serve.py --device cuda --compare-graphs`` (the server with and without
    graphs vs transformers' ``generate`` request by request).

Markdown tables on stdout; JSON (one file per part) in --out. Exit status 1 when a hard check of (a) fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from kimi_linear.engine import EngineConfig, LLMEngine, SamplingParams
from kimi_linear.model import KimiLinearForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serve as serve_bench  # noqa: E402  (bench/serve.py: checkpoint writer and load test)

EOS = 256


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_model(path: str, dtype: str, device: str) -> KimiLinearForCausalLM:
    return KimiLinearForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), device=device).eval()


Run = tuple[list[list[int]], list[list[float]], list[list[float]]]     # tokens, their log-probs, top-2 gaps


def run_engine(model: KimiLinearForCausalLM, cfg: EngineConfig, reqs: list[tuple[list[int], int]],
               nan_scratch: bool = False) -> tuple[Run, LLMEngine]:
    """Greedy tokens, their log-probs and the top-2 log-prob gaps per request (ignore_eos: exactly the asked
    number of tokens)."""
    engine = LLMEngine(model, cfg)
    if nan_scratch:
        assert engine.graphs is not None
        for t in engine.slots.conv + engine.slots.rec + engine.blocks.data:
            t[-1] = float("nan")
    toks: list[list[int]] = [[] for _ in reqs]
    lps: list[list[float]] = [[] for _ in reqs]
    gaps: list[list[float]] = [[] for _ in reqs]

    def sink(i: int):
        def f(o):
            toks[i].extend(o.token_ids)
            lps[i].extend(lp for _, lp, _ in o.logprobs)
            gaps[i].extend(alts[0][1] - alts[1][1] for _, _, alts in o.logprobs)
        return f

    for i, (p, n) in enumerate(reqs):
        engine.add_request(str(i), p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2),
                           sink(i))
    while engine.has_work():
        engine.step()
    return (toks, lps, gaps), engine


def single(model: KimiLinearForCausalLM, reqs: list[tuple[list[int], int]]) -> Run:
    """Each request alone through ``model.generate`` (greedy)."""
    toks, lps, gaps = [], [], []
    for p, n in reqs:
        ids, logits = model.generate(torch.tensor([p], device=model.device), max_new_tokens=n, eos_token_id=None,
                                     return_logits=True)
        t = ids[0, len(p):].tolist()
        lp = [lg[0].float().log_softmax(-1) for lg in logits]
        top = [x.topk(2).values.tolist() for x in lp]
        toks.append(t)
        lps.append([float(x[i]) for x, i in zip(lp, t)])
        gaps.append([a - b for a, b in top])
    return toks, lps, gaps


def agreement(a: Run, ref: Run, tie: float) -> dict:
    """How many requests have identical tokens; of the others, how many first differ where ``ref``'s top two
    log-probs are within ``tie`` (a near-tie that rounding may flip) and how many do not (real mismatches)."""
    same = ties = 0
    worst = []
    for x, y, g in zip(a[0], ref[0], ref[2]):
        i = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None)
        if i is None:
            same += 1
        elif g[i] < tie:
            ties += 1
        else:
            worst.append(g[i])
    return dict(identical=same, near_tie_flips=ties, mismatches=len(worst), of=len(a[0]),
                mismatch_gaps=sorted(worst)[:5])


def max_lp_diff(a: list[list[float]], b: list[list[float]], ta: list[list[int]], tb: list[list[int]]) -> float:
    """Largest log-prob difference over the tokens two runs share (up to their first different token)."""
    d = 0.0
    for la, lb, xa, xb in zip(a, b, ta, tb):
        for u, v, p, q in zip(la, lb, xa, xb):
            if p != q:
                break
            d = max(d, abs(u - v))
    return d


def pool_tensors(e: LLMEngine) -> list[torch.Tensor]:
    return e.slots.conv + e.slots.rec + e.blocks.data + e.snapshots.pool.conv + e.snapshots.pool.rec


def isolation_check(model: KimiLinearForCausalLM, prompt_lens: list[int]) -> dict:
    """Three decoding rows in a batch bucket of 4 (one padding row), through a captured graph on CUDA."""
    engine = LLMEngine(model, EngineConfig(max_num_seqs=8, prefill_chunk=64, num_blocks=256, cuda_graphs=True))
    g = engine.graphs
    assert g is not None
    rng = random.Random(11)
    for i, n in enumerate(prompt_lens):
        engine.add_request(str(i), [rng.randrange(256) for _ in range(n)],
                           SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True))
    while len(engine.running) < len(prompt_lens) or any(s.num_tokens() - s.num_computed != 1 for s in engine.running):
        engine.step()
    seqs = list(engine.running)
    assert all(engine._reserve(s, s.num_computed + 1) for s in seqs)
    key = g.bucket(len(seqs), max(s.num_computed for s in seqs) + 1)
    before = [t.clone() for t in pool_tensors(engine)]
    logits = g.run(seqs)
    assert logits is not None, f"no graph step for bucket {key} ({g.broken})"
    logits = logits.clone()
    after = [t.clone() for t in pool_tensors(engine)]
    n_slot, n_blk = len(engine.slots.conv) + len(engine.slots.rec), len(engine.blocks.data)
    bs = engine.cfg.block_size
    owned = {s.slot for s in seqs} | {g.slots.scratch}
    written = {(s.block_table[s.num_computed // bs], s.num_computed % bs) for s in seqs}
    outside_ok = True
    for i, (b, a) in enumerate(zip(before, after)):
        if i < n_slot:
            keep = [r for r in range(b.shape[0]) if r not in owned]
            outside_ok &= torch.equal(b[keep], a[keep])
        elif i < n_slot + n_blk:
            changed = {(x, y) for x, y, _ in (b != a).nonzero().tolist()}
            outside_ok &= changed - {(g.blocks.scratch, 0)} <= written
        else:
            outside_ok &= torch.equal(b, a)
    for t, b in zip(pool_tensors(engine), before):
        t.copy_(b)
    for t in engine.slots.conv + engine.slots.rec + engine.blocks.data:
        t[-1] = float("nan")
    again = g.run(seqs)
    assert again is not None
    nan_ok = torch.equal(again, logits) and all(
        torch.equal(a[:-1], t[:-1]) for a, t in zip(after[: n_slot + n_blk], pool_tensors(engine)))
    for t, b in zip(pool_tensors(engine), before):
        t.copy_(b)
    eager = engine._forward(seqs, 1)
    return dict(bucket=key, rows=len(seqs), captured=g.capture and bool(g.steps), outside_unchanged=bool(outside_ok),
                nan_scratch_bit_identical=bool(nan_ok), eager_max_abs_diff=float((eager - logits).abs().max()))


def part_a(ckpt: str, args: argparse.Namespace) -> tuple[dict, bool]:
    rng = random.Random(0)
    reqs = [([rng.randrange(256) for _ in range(rng.randrange(1, args.max_prompt))],
             rng.randrange(4, args.max_new)) for _ in range(args.requests)]
    res: dict[str, Any] = {}
    ok = True
    for dtype in args.dtypes:
        model = load_model(ckpt, dtype, args.device)
        cfg = dict(max_num_seqs=args.max_num_seqs, prefill_chunk=64, num_blocks=64 * args.max_num_seqs)
        t = time.perf_counter()
        rg, eg = run_engine(model, EngineConfig(cuda_graphs=True, **cfg), reqs, nan_scratch=True)
        t_g = time.perf_counter() - t
        re_, ee = run_engine(model, EngineConfig(cuda_graphs=False, **cfg), reqs)
        rs = single(model, reqs)
        assert eg.graphs is not None
        r = dict(graph_vs_eager=agreement(rg, re_, args.tie), graph_vs_single=agreement(rg, rs, args.tie),
                 eager_vs_single=agreement(re_, rs, args.tie),
                 logprob_max_abs_diff_graph_vs_eager=max_lp_diff(rg[1], re_[1], rg[0], re_[0]),
                 graph_decode_forwards=eg.counters["graph_decode_forwards"],
                 decode_forwards=eg.counters["decode_forwards"],
                 graphs_captured=len(eg.graphs.steps), capture_s=eg.graphs.capture_seconds, graph_run_s=t_g,
                 capture_error=eg.graphs.broken)
        r["isolation"] = isolation_check(model, [5, 40, 130])
        iso = r["isolation"]
        hard = [eg.graphs.broken is None, r["graph_decode_forwards"] > 0, iso["outside_unchanged"],
                iso["nan_scratch_bit_identical"]]
        if dtype == "float32":
            hard += [r[k]["mismatches"] == 0 for k in ("graph_vs_eager", "graph_vs_single", "eager_vs_single")]
            hard += [r["logprob_max_abs_diff_graph_vs_eager"] < 1e-3, iso["eager_max_abs_diff"] < 1e-3]
        r["pass"] = all(hard)
        ok &= r["pass"] if dtype == "float32" else all(hard[:4])
        res[dtype] = r
        del model, eg, ee
        if args.device == "cuda":
            torch.cuda.empty_cache()
    print(f"\n## (a) correctness: {len(reqs)} greedy requests (prompts 1-{args.max_prompt - 1}, outputs "
          f"4-{args.max_new - 1} tokens), max_num_seqs {args.max_num_seqs}\n")
    print("| dtype | graphs == eager | graphs == single | eager == single | max abs d(logprob) graphs/eager | "
          "graph decode forwards | graphs (capture s) | padding isolation (bucket) | eager vs graph logits | pass |")
    print("|---|---|---|---|---:|---|---|---|---:|---|")
    for dtype, r in res.items():
        f = lambda a: f"{a['identical']}/{a['of']} (ties {a['near_tie_flips']}, other {a['mismatches']})"
        iso = r["isolation"]
        print(f"| {dtype} | {f(r['graph_vs_eager'])} | {f(r['graph_vs_single'])} | {f(r['eager_vs_single'])} | "
              f"{r['logprob_max_abs_diff_graph_vs_eager']:.2e} | {r['graph_decode_forwards']}/{r['decode_forwards']} | "
              f"{r['graphs_captured']} ({r['capture_s']:.2f}) | outside {iso['outside_unchanged']}, NaN scratch "
              f"{iso['nan_scratch_bit_identical']} ({iso['bucket']}) | {iso['eager_max_abs_diff']:.2e} | "
              f"{'yes' if r['pass'] else 'NO'}{'' if r['capture_error'] is None else ' ' + r['capture_error']} |")
    return res, ok


def decode_speed(engine: LLMEngine, batch: int, args: argparse.Namespace) -> dict:
    """Decode-only engine steps with ``batch`` rows that are past their prompts."""
    model, graphs = engine.model, engine.graphs is not None
    rng = random.Random(batch)
    total = args.warmup + args.steps + 2
    for i in range(batch):
        engine.add_request(str(i), [rng.randrange(256) for _ in range(args.prompt_len)],
                           SamplingParams(max_tokens=total, temperature=0, ignore_eos=True))
    while len(engine.running) < batch or any(s.num_tokens() - s.num_computed != 1 for s in engine.running):
        engine.step()
    for _ in range(args.warmup):
        engine.step()
    sync(model.device)
    g0 = engine.counters["graph_decode_forwards"]
    lat = []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        lat.append(time.perf_counter() - t)     # a step ends with reading the sampled tokens back: synchronous
    sync(model.device)
    wall = time.perf_counter() - t0
    assert len(engine.running) == batch, "a request finished inside the timed window"
    r = dict(batch=batch, graphs=graphs, steps=args.steps, tok_per_s=batch * args.steps / wall,
             step_ms_mean=1e3 * wall / args.steps, step_ms_p50=1e3 * statistics.median(lat),
             graph_steps=engine.counters["graph_decode_forwards"] - g0,
             graphs_captured=len(engine.graphs.steps) if graphs else 0,
             capture_s=engine.graphs.capture_seconds if graphs else 0.0,
             context=[min(s.num_computed for s in engine.running), max(s.num_computed for s in engine.running)])
    if graphs and engine.graphs is not None and engine.graphs.capture:
        # The bare replay of this batch's graph (no host work): the floor of a decode step.
        seqs = list(engine.running)
        key = engine.graphs.bucket(batch, max(s.num_computed for s in seqs) + 1)
        step = engine.graphs.steps[key]
        sync(model.device)
        t = time.perf_counter()
        for _ in range(args.steps):
            step.graph.replay()
        sync(model.device)
        r["replay_ms"] = 1e3 * (time.perf_counter() - t) / args.steps
    for s in list(engine.running):
        engine.abort(s.request_id)
    return r


def part_b(ckpt: str, args: argparse.Namespace) -> list[dict]:
    model = load_model(ckpt, args.speed_dtype, args.device)
    rows = []
    for graphs in (False, True):
        # Every prompt prefilled in one engine step, so all rows start decoding together at the same length.
        engine = LLMEngine(model, EngineConfig(max_num_seqs=max(args.batches), prefill_chunk=128, cuda_graphs=graphs,
                                               max_prefill_forwards=max(args.batches),
                                               num_blocks=max(args.batches) * (args.prompt_len // 16 + 16),
                                               cuda_graph_max_len=args.graph_max_len))
        engine.capture_cuda_graphs()          # all buckets up front: no capture inside a timed window
        rows += [decode_speed(engine, b, args) for b in args.batches]
        del engine
    rows.sort(key=lambda r: (r["batch"], r["graphs"]))
    print(f"\n## (b) decode speed: {args.speed_dtype}, prompts of {args.prompt_len} tokens, {args.steps} timed "
          "decode-only engine steps\n")
    print("| batch | CUDA graphs | tokens/s | step ms (mean / p50) | graph replay ms | speed-up | graph steps | "
          "context |")
    print("|---:|---|---:|---|---:|---:|---:|---|")
    eager = {r["batch"]: r for r in rows if not r["graphs"]}
    for r in rows:
        up = r["tok_per_s"] / eager[r["batch"]]["tok_per_s"]
        print(f"| {r['batch']} | {'on' if r['graphs'] else 'off'} | {r['tok_per_s']:.0f} | {r['step_ms_mean']:.2f} / "
              f"{r['step_ms_p50']:.2f} | {r.get('replay_ms', float('nan')):.3f} | {up:.2f}x | {r['graph_steps']}/"
              f"{r['steps']} | {r['context'][0]}-{r['context'][1]} |")
    cap = [r for r in rows if r["graphs"]]
    if cap:
        print(f"\ngraphs captured up front: {cap[0]['graphs_captured']} in {cap[0]['capture_s']:.1f} s "
              f"(context buckets up to {args.graph_max_len})")
    return rows


def write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for the JSON results")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny preset and sizes (checks the script on CPU)")
    ap.add_argument("--parts", default="abc", help="which parts to run (default abc)")
    ap.add_argument("--tie", type=float, default=1e-4,
                    help="top-2 log-prob gap under which a float32 token flip counts as a near-tie (default 1e-4)")
    args = ap.parse_args()
    if args.smoke:
        args.preset, args.dtypes, args.speed_dtype = "tiny", ["float32", "bfloat16"], "float32"
        args.requests, args.max_prompt, args.max_new, args.max_num_seqs = 6, 40, 8, 4
        args.batches, args.prompt_len, args.warmup, args.steps, args.graph_max_len = [1, 4], 16, 1, 3, 256
        load_argv = ["--preset", "tiny", "--requests", "4", "--concurrency", "4", "--max-num-seqs", "4",
                     "--prompt-len", "16", "--output-len", "6", "--baseline-requests", "1", "--prefill-chunk", "64"]
    else:
        args.preset, args.dtypes, args.speed_dtype = "small", ["float32", "bfloat16"], "bfloat16"
        args.requests, args.max_prompt, args.max_new, args.max_num_seqs = 32, 320, 40, 16
        args.batches, args.prompt_len, args.warmup, args.steps, args.graph_max_len = [1, 16, 64], 128, 3, 64, 2048
        load_argv = ["--preset", "small", "--requests", "64", "--concurrency", "64", "--max-num-seqs", "64",
                     "--prompt-len", "128", "--output-len", "128", "--baseline-requests", "3", "--dtype", "bfloat16"]
    os.makedirs(args.out, exist_ok=True)
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"# engine on {args.device} ({dev}), torch {torch.__version__}, preset {args.preset}")
    ok = True
    t0 = time.perf_counter()
    took = lambda part: print(f"\n({part} done at {time.perf_counter() - t0:.0f} s)", flush=True)
    with tempfile.TemporaryDirectory(prefix="kl-engine-gpu-") as tmp:
        ckpt = os.path.join(tmp, args.preset)
        serve_bench.make_checkpoint(args.preset, ckpt)
        if "a" in args.parts:
            res, ok = part_a(ckpt, args)
            write_json(os.path.join(args.out, "a_correctness.json"), res)
            took("a")
        if "b" in args.parts:
            write_json(os.path.join(args.out, "b_decode_speed.json"), part_b(ckpt, args))
            took("b")
        if "c" in args.parts:
            print("\n## (c) load test (bench/serve.py)\n", flush=True)
            serve_bench.main([*load_argv, "--device", args.device, "--compare-graphs", "--model", ckpt,
                              "--json", os.path.join(args.out, "c_load_test.json")])
            took("c")
    print(f"\n(a) hard checks: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
