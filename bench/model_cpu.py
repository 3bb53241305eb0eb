"""Kimi Linear on CPU: ours vs transformers' KimiLinearForCausalLM on the same random checkpoint (issue 3).

Shape: the `small` preset (8 layers = 6 KDA + 2 MLA, hidden 512, 8 KDA heads of 64, MoE 8 experts top-2 + 1
shared), float32, 2 threads. Measures, side by side in one process, median of several runs:
  - prefill: one forward over a 1024-token prompt that also builds the decoding cache (last-position logits);
  - greedy decode: tokens/s of `generate` (32-token prompt, 64 new tokens, end to end); and again with our C
    decode kernels off (KIMI_LINEAR_NATIVE=0: PyTorch ops alone, what a machine without a C compiler runs).
The two models run in alternating rounds; the speed-up is the median of the per-round ratios.

    python bench/model_cpu.py [--threads 2] [--prefill 1024] [--new-tokens 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time

import torch
import transformers
from transformers import KimiLinearForCausalLM as HFKimiLinear

from kimi_linear import KimiLinearForCausalLM
from kimi_linear.model import preset_config
from kimi_linear.ops import native


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def paired_times(fn_a, fn_b, repeats: int) -> tuple[float, float, float]:
    """Alternate a and b (after one warm-up each) so that drift in machine load hits both alike; returns
    (median time a, median time b, median of the per-round ratios a / b)."""
    fn_a(), fn_b()
    ta, tb = [], []
    for _ in range(repeats):
        for fn, ts in ((fn_a, ta), (fn_b, tb)):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return statistics.median(ta), statistics.median(tb), statistics.median(a / b for a, b in zip(ta, tb))


def without_native(fn):
    """fn with the C decode kernels off (kimi_linear.ops.native reads KIMI_LINEAR_NATIVE at every call): ours
    through PyTorch ops alone, what a machine without a C compiler runs."""

    def run():
        old = os.environ.get("KIMI_LINEAR_NATIVE")
        os.environ["KIMI_LINEAR_NATIVE"] = "0"
        try:
            return fn()
        finally:
            if old is None:
                del os.environ["KIMI_LINEAR_NATIVE"]
            else:
                os.environ["KIMI_LINEAR_NATIVE"] = old

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=32, help="prompt length of the decode benchmark")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    config = preset_config("small")
    hf = HFKimiLinear(config).eval()
    with torch.no_grad():  # a non-zero correction bias, so routing really uses it
        for name, buf in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0, 0.05)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = KimiLinearForCausalLM.from_pretrained(d, dtype=torch.float32)
        hf = HFKimiLinear.from_pretrained(d, dtype=torch.float32).eval()

    ids = torch.randint(0, config.vocab_size, (1, args.prefill), generator=torch.Generator().manual_seed(1))
    prompt = ids[:, : args.prompt]
    with torch.inference_mode():
        a = hf(ids, logits_to_keep=1).logits[:, -1]
        b = ours(ids, logits_to_keep=1).logits[:, -1]
        rel = ((a - b).abs().max() / a.abs().max()).item()
        hf_gen = hf.generate(prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                             do_sample=False)
        our_gen = ours.generate(prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
        same = bool((hf_gen == our_gen).all())

        t_hf_pre, t_our_pre, x_pre = paired_times(lambda: hf(ids, use_cache=True, logits_to_keep=1),
                                                  lambda: ours(ids, cache=ours.new_cache(1), logits_to_keep=1),
                                                  args.repeats)
        hf_generate = lambda: hf.generate(prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                          do_sample=False)
        our_generate = lambda: ours.generate(prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
        t_hf_dec, t_our_dec, x_dec = paired_times(hf_generate, our_generate, args.repeats)
        if native.library() is not None:
            t_hf_torch, t_our_torch, x_torch = paired_times(hf_generate, without_native(our_generate), args.repeats)
            same_torch = bool((without_native(our_generate)() == hf_gen).all())

    n = args.new_tokens
    print(f"# {cpu_name()} ({os.cpu_count()} cores visible), torch {torch.__version__}, transformers "
          f"{transformers.__version__}, {args.threads} threads, float32, median of {args.repeats} alternating rounds")
    print(f"# last-token logits rel. error ours vs transformers: {rel:.2e}; greedy tokens identical: {same}")
    print("| what | transformers | kimi-linear | speed-up |")
    print("| --- | --- | --- | --- |")
    print(f"| prefill {args.prefill} tokens | {t_hf_pre * 1e3:.0f} ms | {t_our_pre * 1e3:.0f} ms | "
          f"{x_pre:.2f}x |")
    print(f"| greedy generate ({args.prompt}-token prompt + {n} new) | {n / t_hf_dec:.1f} tok/s | "
          f"{n / t_our_dec:.1f} tok/s | {x_dec:.2f}x |")
    if native.library() is None:
        print("# the C decode kernels are not available here (no C compiler?): ours ran on PyTorch ops alone")
    else:
        print(f"| same, ours on PyTorch ops alone (KIMI_LINEAR_NATIVE=0) | {n / t_hf_torch:.1f} tok/s | "
              f"{n / t_our_torch:.1f} tok/s | {x_torch:.2f}x |")
        print(f"# greedy tokens identical with the C kernels off: {same_torch}")


if __name__ == "__main__":
    main()
