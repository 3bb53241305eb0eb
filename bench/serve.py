"""Load test of `kimi-linear serve` on loopback vs a sequential transformers `generate` baseline (issue 6).

    python bench/serve.py                      # tiny preset, 16 concurrent requests of 128 prompt + 128 output
    python bench/serve.py --model ./ckpt --requests 32 --concurrency 16 --json out.json

Starts the real server (python -m kimi_linear.server) on 127.0.0.1, sends a bounded number of streaming
completions over plain HTTP (httpx; ``ignore_eos`` so every request makes exactly --output-len tokens),
records time to first token (TTFT) and time per output token (TPOT, (last - first) / (n - 1)) per request, then
stops the server and runs the baseline: `transformers.KimiLinearForCausalLM.generate`, greedy, one request after
another on the same checkpoint and the same prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time

import torch


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def make_checkpoint(preset: str, path: str) -> None:
    from kimi_linear.model import KimiLinearForCausalLM, preset_config
    from kimi_linear.model.tokenizer import byte_level_tokenizer

    torch.manual_seed(0)
    KimiLinearForCausalLM(preset_config(preset, eos_token_id=256, bos_token_id=257, pad_token_id=258)) \
        .init_weights(0).save_pretrained(path)
    byte_level_tokenizer().save_pretrained(path)


def start_server(model: str, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "kimi_linear.server", model, "--port", str(port), "--served-model-name", "bench",
           "--max-num-seqs", str(args.max_num_seqs), "--prefill-chunk", str(args.prefill_chunk)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not start")


async def load(url: str, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """Streaming completions over raw HTTP (httpx, minimal SSE parsing): a load generator that spends as little
    of the shared CPU as it can, so the numbers are the server's."""
    import httpx

    sem = asyncio.Semaphore(args.concurrency)
    recs = []

    async def one(ac: httpx.AsyncClient, prompt: list[int]) -> None:
        body = {"model": "bench", "prompt": prompt, "max_tokens": args.output_len, "temperature": 0,
                "stream": True, "ignore_eos": True, "return_token_ids": True}
        async with sem:
            t0 = time.perf_counter()
            stamps = []
            async with ac.stream("POST", url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        n = len(json.loads(line[6:])["choices"][0]["token_ids"])
                        stamps += [time.perf_counter()] * n
            if len(stamps) != args.output_len and len(prompt) == args.prompt_len:
                raise SystemExit(f"a request returned {len(stamps)} tokens, expected {args.output_len}")
            recs.append((t0, stamps))

    limits = httpx.Limits(max_connections=args.concurrency + 1)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as ac:
        await one(ac, prompts[0][:8])                      # warm-up (not counted)
        recs.clear()
        t = time.perf_counter()
        await asyncio.gather(*(one(ac, p) for p in prompts))
        wall = time.perf_counter() - t
    return summarize(recs, wall)


def summarize(recs: list[tuple[float, list[float]]], wall: float) -> dict:
    ttft = [s[0] - t0 for t0, s in recs]
    tpot = [(s[-1] - s[0]) / (len(s) - 1) for _, s in recs if len(s) > 1]
    n = sum(len(s) for _, s in recs)
    return dict(requests=len(recs), output_tokens=n, wall_s=wall, req_per_s=len(recs) / wall, out_tok_per_s=n / wall,
                ttft_p50=pct(ttft, 50), ttft_p90=pct(ttft, 90), ttft_p99=pct(ttft, 99),
                tpot_p50=pct(tpot, 50), tpot_p90=pct(tpot, 90), tpot_p99=pct(tpot, 99))


class _Stamps:
    """transformers streamer that records when each generated token arrives (the first put is the prompt)."""

    def __init__(self) -> None:
        self.first = True
        self.t: list[float] = []

    def put(self, value) -> None:
        if self.first:
            self.first = False
            return
        self.t.append(time.perf_counter())

    def end(self) -> None:
        pass


def baseline(model_path: str, prompts: list[list[int]], args: argparse.Namespace, threads: int) -> dict:
    import transformers

    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()
    m = transformers.KimiLinearForCausalLM.from_pretrained(model_path).eval()
    recs = []
    with torch.inference_mode():
        m.generate(torch.tensor([prompts[0][:8]]), max_new_tokens=2, do_sample=False)   # warm-up
        t = time.perf_counter()
        for p in prompts[: args.baseline_requests]:
            st = _Stamps()
            t0 = time.perf_counter()
            m.generate(torch.tensor([p]), max_new_tokens=args.output_len, min_new_tokens=args.output_len,
                       do_sample=False, streamer=st)
            recs.append((t0, st.t))
        wall = time.perf_counter() - t
    return summarize(recs, wall)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: a fresh random --preset one)")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--requests", type=int, default=16, help="requests sent to the server (bounded)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--prefill-chunk", type=int, default=128)
    ap.add_argument("--baseline-requests", type=int, default=4,
                    help="requests the sequential baseline runs (its tokens/s does not depend on the count)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    if args.requests > 256 or args.concurrency > 256:
        raise SystemExit("bounded load test: at most 256 requests / 256 concurrent")
    with tempfile.TemporaryDirectory(prefix="kl-bench-") as tmp:
        model = args.model
        if model is None:
            model = os.path.join(tmp, args.preset)
            make_checkpoint(args.preset, model)
        rng = random.Random(0)
        prompts = [[rng.randrange(256) for _ in range(args.prompt_len)] for _ in range(args.requests)]
        proc, url = start_server(model, args)
        try:
            served = asyncio.run(load(url, prompts, args))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        # The baseline at 1 thread and at torch's default; the faster one counts (on a shared machine, OpenMP's
        # default thread count can be much slower than 1 thread).
        default_threads = args.threads or torch.get_num_threads()
        bases = {t: baseline(model, prompts, args, t) for t in sorted({1, default_threads})}
        best_t = max(bases, key=lambda t: bases[t]["out_tok_per_s"])
        base = bases[best_t]
    speedup = served["out_tok_per_s"] / base["out_tok_per_s"]
    print(f"# {args.requests} requests x ({args.prompt_len} prompt + {args.output_len} output), concurrency "
          f"{args.concurrency}, preset/model {args.model or args.preset}; {platform.processor() or platform.machine()}"
          f", {os.cpu_count()} CPUs, torch {torch.__version__}; server torch threads: {args.threads or 'default - 1'}")
    print("| | requests/s | output tok/s | TTFT p50 / p90 / p99 (s) | TPOT p50 / p90 / p99 (ms) |")
    print("|---|---:|---:|---|---|")
    rows = [("kimi-linear serve", served)] + [
        (f"transformers generate, sequential, {t} thread{'s' if t > 1 else ''}{' (baseline)' if t == best_t else ''}",
         r) for t, r in bases.items()]
    for name, r in rows:
        print(f"| {name} | {r['req_per_s']:.3f} | {r['out_tok_per_s']:.1f} | {r['ttft_p50']:.3f} / "
              f"{r['ttft_p90']:.3f} / {r['ttft_p99']:.3f} | {r['tpot_p50'] * 1e3:.1f} / {r['tpot_p90'] * 1e3:.1f} / "
              f"{r['tpot_p99'] * 1e3:.1f} |")
    print(f"\noutput tokens/s speed-up: {speedup:.2f}x (goal >= 4x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), served=served, baselines=bases, baseline_threads=best_t, speedup=speedup),
                      f, indent=1)


if __name__ == "__main__":
    main()
