"""Load test of `kimi-linear serve` on loopback vs a sequential transformers `generate` baseline (issue 6).

    python bench/serve.py                      # tiny preset, 16 concurrent requests of 128 prompt + 128 output
    python bench/serve.py --model ./ckpt --requests 32 --concurrency 16 --json out.json
    python bench/serve.py --device cuda --preset small --dtype bfloat16 --compare-graphs   # GPU, graphs on and off

Starts the real server (python -m kimi_linear.server) on 127.0.0.1, sends a bounded number of streaming
completions over plain HTTP (httpx; ``ignore_eos`` so every request makes exactly --output-len tokens),
records time to first token (TTFT) and time per output token (TPOT, (last - first) / (n - 1)) per request, then
stops the server and runs the baseline: `transformers.KimiLinearForCausalLM.generate`, greedy, one request after
another on the same checkpoint and the same prompts (on --device, in --dtype). --compare-graphs serves twice,
with and without CUDA graphs for the decode step.
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


def start_server(model: str, args: argparse.Namespace, graphs: bool | None = None) -> tuple[subprocess.Popen, str]:
    """``graphs``: pass --cuda-graphs / --no-cuda-graphs (None: the server's default)."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "kimi_linear.server", model, "--port", str(port), "--served-model-name", "bench",
           "--max-num-seqs", str(args.max_num_seqs), "--prefill-chunk", str(args.prefill_chunk),
           "--device", args.device, "--dtype", args.dtype]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if graphs is not None:
        cmd += ["--cuda-graphs" if graphs else "--no-cuda-graphs"]
    # stderr kept (a file, not a pipe nobody reads): the start-up line says how many graphs were captured.
    log = open(os.path.join(tempfile.gettempdir(), f"kl-bench-server-{port}.log"), "w")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    log.close()
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            with open(log.name, encoding="utf-8", errors="replace") as f:
                tail = f.read()[-3000:]
            raise SystemExit(f"server exited with {proc.returncode} (log: {log.name}); its last lines:\n{tail}")
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

    async def one(ac: httpx.AsyncClient, prompt: list[int], max_tokens: int = args.output_len) -> None:
        body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
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
            if len(stamps) != max_tokens:
                raise SystemExit(f"a request returned {len(stamps)} tokens, expected {max_tokens}")
            recs.append((t0, stamps))

    limits = httpx.Limits(max_connections=args.concurrency + 1)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as ac:
        # Warm-up, not counted: a few full-length prompts at once, so the batched prefill and decode shapes (and on
        # the GPU the Triton kernels' JIT compilation, seconds) are paid before the clock starts.
        await asyncio.gather(*(one(ac, p, 4) for p in prompts[: min(4, len(prompts))]))
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
    kw = {} if args.dtype == "auto" else {"dtype": getattr(torch, args.dtype)}
    m = transformers.KimiLinearForCausalLM.from_pretrained(model_path, **kw).to(args.device).eval()
    ids = lambda p: torch.tensor([p], device=args.device)
    recs = []
    with torch.inference_mode():
        m.generate(ids(prompts[0][:8]), max_new_tokens=2, do_sample=False)   # warm-up
        t = time.perf_counter()
        for p in prompts[: args.baseline_requests]:
            st = _Stamps()
            t0 = time.perf_counter()
            m.generate(ids(p), max_new_tokens=args.output_len, min_new_tokens=args.output_len,
                       do_sample=False, streamer=st)
            recs.append((t0, st.t))
        wall = time.perf_counter() - t
    del m
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return summarize(recs, wall)


def main(argv: list[str] | None = None) -> dict:
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
    ap.add_argument("--device", default="cpu", help="where the server and the baseline run (cpu, cuda)")
    ap.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto (= the checkpoint's)")
    ap.add_argument("--compare-graphs", action="store_true",
                    help="serve twice: with CUDA graphs for decode steps and without (GPU)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.requests > 256 or args.concurrency > 256:
        raise SystemExit("bounded load test: at most 256 requests / 256 concurrent")
    with tempfile.TemporaryDirectory(prefix="kl-bench-") as tmp:
        model = args.model
        if model is None:
            model = os.path.join(tmp, args.preset)
            make_checkpoint(args.preset, model)
        rng = random.Random(0)
        prompts = [[rng.randrange(256) for _ in range(args.prompt_len)] for _ in range(args.requests)]
        servers: dict[str, dict] = {}
        variants = [("kimi-linear serve, CUDA graphs", True), ("kimi-linear serve, no CUDA graphs", False)] \
            if args.compare_graphs else [("kimi-linear serve", None)]
        for name, graphs in variants:
            proc, url = start_server(model, args, graphs)
            try:
                servers[name] = asyncio.run(load(url, prompts, args))
            finally:
                proc.terminate()
                proc.wait(timeout=30)
        served = servers[variants[0][0]]
        # The baseline at 1 thread and at torch's default; the faster one counts (on a shared machine, OpenMP's
        # default thread count can be much slower than 1 thread). On a GPU the thread count hardly matters.
        default_threads = args.threads or torch.get_num_threads()
        threads = {default_threads} if args.device != "cpu" else {1, default_threads}
        bases = {t: baseline(model, prompts, args, t) for t in sorted(threads)}
        best_t = max(bases, key=lambda t: bases[t]["out_tok_per_s"])
        base = bases[best_t]
    speedup = served["out_tok_per_s"] / base["out_tok_per_s"]
    print(f"# {args.requests} requests x ({args.prompt_len} prompt + {args.output_len} output), concurrency "
          f"{args.concurrency}, preset/model {args.model or args.preset}, dtype {args.dtype}, device {args.device}"
          f"{' (' + torch.cuda.get_device_name() + ')' if args.device.startswith('cuda') else ''}; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}; "
          f"server torch threads: {args.threads or 'default - 1'}")
    print("| | requests/s | output tok/s | TTFT p50 / p90 / p99 (s) | TPOT p50 / p90 / p99 (ms) |")
    print("|---|---:|---:|---|---|")
    rows = list(servers.items()) + [
        (f"transformers generate, sequential, {t} thread{'s' if t > 1 else ''}{' (baseline)' if t == best_t else ''}",
         r) for t, r in bases.items()]
    for name, r in rows:
        print(f"| {name} | {r['req_per_s']:.3f} | {r['out_tok_per_s']:.1f} | {r['ttft_p50']:.3f} / "
              f"{r['ttft_p90']:.3f} / {r['ttft_p99']:.3f} | {r['tpot_p50'] * 1e3:.1f} / {r['tpot_p90'] * 1e3:.1f} / "
              f"{r['tpot_p99'] * 1e3:.1f} |")
    print(f"\noutput tokens/s speed-up: {speedup:.2f}x (goal >= 4x)")
    result = dict(args=vars(args), served=served, servers=servers, baselines=bases, baseline_threads=best_t,
                  speedup=speedup)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
