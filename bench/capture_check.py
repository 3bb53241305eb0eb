"""Which pieces of the decode step capture into a CUDA graph, at every batch bucket (a GPU diagnostic).

    python bench/capture_check.py            # 8-layer Kimi-Linear-48B shape, 32 experts, bf16

For each piece (the router, the fused MoE op, the whole fixed-shape step) and each
batch size: the eager warm-up runs under ``torch.cuda.set_sync_debug_mode("error")`` (a host synchronisation
raises with its Python line), then a capture and a replay. Prints one markdown row per (piece, batch).
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_gpu import build  # noqa: E402
from kimi_linear.model.paged import DecodeGraphs, DecodePools  # noqa: E402
from kimi_linear.ops import fused_moe  # noqa: E402


def try_capture(fn: Callable[[], object]) -> str:
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            torch.cuda.set_sync_debug_mode("error")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode(0)
    except Exception as e:
        tb = traceback.extract_tb(e.__traceback__)
        where = next((f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(tb)
                      if "kimi_linear" in f.filename), "?")
        return f"warm-up sync at {where}: {str(e)[:120]}"
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            fn()
    except Exception as e:
        return f"capture: {type(e).__name__}: {str(e)[:160]}"
    graph.replay()
    torch.cuda.synchronize()
    return "ok"


def main() -> int:
    torch.manual_seed(0)
    dev = "cuda"
    model = build("48b-8l-32e", torch.bfloat16, dev, smoke=False)
    moe = model.model.layers[1].block_sparse_moe
    E, k = moe.gate.num_experts, moe.gate.top_k
    W = model.config.hidden_size
    packed = moe._packed_experts()
    print("| piece | batch | result |\n|---|---:|---|")

    def pieces(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> list:
        def static() -> torch.Tensor:
            moe.static_dispatch = True
            try:
                return moe(x)
            finally:
                moe.static_dispatch = False

        return [("router", lambda: moe.gate(x)),
                ("fused_moe op", lambda: fused_moe(x, packed[0], packed[1], w, idx, num_shared=int(packed[2]))),
                ("SparseMoE static", static)]

    with torch.inference_mode():
        for n in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            x = torch.randn(n, W, device=dev, dtype=torch.bfloat16)
            w, idx = moe.gate(x)
            for name, fn in pieces(x, torch.randint(0, E, (n * k,), device=dev), w, idx):
                print(f"| {name} | {n} | {try_capture(fn)} |", flush=True)
        for b in (16, 32, 64, 128, 256):
            pools = DecodePools.allocate(model, b, 1024, block_size=16)
            graphs = DecodeGraphs(model, pools, b, capture=False)
            inputs = torch.cat([torch.zeros(b, dtype=torch.long, device=dev), torch.arange(b, device=dev),
                                torch.full((b,), 100, device=dev)])
            result = try_capture(lambda g=graphs, i=inputs, b=b: g.forward(i, b))
            print(f"| whole step | {b} | {result} |", flush=True)
            del graphs, pools
    return 0


if __name__ == "__main__":
    sys.exit(main())
