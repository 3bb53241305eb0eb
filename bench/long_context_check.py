"""Correctness at length for ``bench/long_context.py --check`` (float32):

1. engine vs one plain forward: a model of Kimi-Linear-48B's widths cut to 4 layers (KDA, KDA, KDA, MLA; fewer
   experts), greedy tokens after a ``prompt``-token prompt prefilled in chunks and decoded through the engine (CUDA
   graphs and the paged MLA kernel on a GPU) must equal the argmax of one plain forward over prompt + generated
   tokens (no cache, logits of the generated positions only). At the first difference the plain forward's top-2
   log-probability gap is shown (a near-tie can flip under other rounding).
2. KDA final state over a long sequence: ``chunk_kda`` run chunk by chunk (the engine's prefill: each chunk starts
   from the previous final state) against ``fused_recurrent_kda`` over the whole sequence in one call, one
   head set (4 heads of 128), float32, with gates mixing fast decay and near-1 decay (channels that remember the
   whole sequence, so rounding accumulates over all of it). Bar: relative error (Frobenius) <= 1e-4, ten times the
   operator's float32 bar for one call (1e-5, tests/ops), for the chained calls and the 2^20-step recurrence.
"""

from __future__ import annotations

import gc
import math
import time
from typing import Any

import torch

from floors import sync
from kimi_linear.engine import LLMEngine, SamplingParams
from kimi_linear.ops import chunk_kda, fused_recurrent_kda
from long_context_model import build, model_config

KDA_BAR = 1e-4


def engine_vs_forward(device: str, prompt_len: int, new_tokens: int, chunk: int, smoke: bool,
                      experts: int = 16, block_size: int = 16) -> dict[str, Any]:
    """Check 1 (see the module docstring)."""
    from long_context_engine import engine_config

    config = model_config("hybrid", 4, prompt_len + new_tokens + 64, smoke, experts=None if smoke else experts)
    model = build(config, device, torch.float32, seed=7)
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(config.vocab_size, (prompt_len,), generator=gen).tolist()
    engine = LLMEngine(model, engine_config(1, prompt_len + new_tokens + 2, block_size, chunk))
    out: list[int] = []
    engine.add_request("c", prompt, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True),
                       lambda o: out.extend(o.token_ids))
    t = time.perf_counter()
    while engine.has_work():
        engine.step()
    sync()
    engine_s = time.perf_counter() - t
    graph_steps = engine.counters["graph_decode_forwards"]
    del engine
    gc.collect()                                # the engine's pools and graphs, before the long plain forward
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    t = time.perf_counter()
    with torch.inference_mode():
        ids = torch.tensor([prompt + out[:-1]], device=device)
        logits = model(ids, logits_to_keep=len(out)).logits[0].float()          # [new, vocab]
    sync()
    forward_s = time.perf_counter() - t
    want = logits.argmax(-1).tolist()
    first = next((i for i, (a, b) in enumerate(zip(out, want)) if a != b), None)
    gap = None
    if first is not None:
        top = logits[first].log_softmax(-1).topk(2).values
        gap = float(top[0] - top[1])
    del model, logits
    return dict(prompt=prompt_len, new_tokens=len(out), engine_tokens=out, forward_tokens=want,
                identical=first is None, first_difference=first, top2_gap_there=gap, engine_s=engine_s,
                forward_s=forward_s, graph_decode_steps=graph_steps, experts=config.num_local_experts,
                layers=config.layer_types, ok=first is None)


def kda_state(device: str, tokens: int, chunk: int, heads: int = 4, dim: int = 128, seed: int = 5) -> dict[str, Any]:
    """Check 2 (see the module docstring)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=gen, device=device)
    q, k, v = rnd(1, tokens, heads, dim), rnd(1, tokens, heads, dim), rnd(1, tokens, heads, dim)
    # per channel a decay rate from 1e-6 (remembers ~1M steps) to 0.5 per step, with 10% noise per step
    rate = torch.logspace(-6, math.log10(0.5), heads * dim, device=device)[torch.randperm(heads * dim, generator=gen,
                                                                                            device=device)]
    g = -(rate.view(heads, dim) * (1 + 0.1 * rnd(1, tokens, heads, dim)).abs())
    beta = torch.sigmoid(rnd(1, tokens, heads))
    opts = dict(use_qk_l2norm_in_kernel=True, output_final_state=True)
    t = time.perf_counter()
    state = None
    for a in range(0, tokens, chunk):
        b = min(tokens, a + chunk)
        _, state = chunk_kda(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], initial_state=state, **opts)
    sync()
    chunk_s = time.perf_counter() - t
    t = time.perf_counter()
    _, ref = fused_recurrent_kda(q, k, v, g, beta, **opts)
    sync()
    rec_s = time.perf_counter() - t
    rel = float((state.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
    return dict(tokens=tokens, chunk=chunk, heads=heads, dim=dim, rel_error=rel, bar=KDA_BAR, ok=rel <= KDA_BAR,
                finite=bool(torch.isfinite(state).all()), state_norm=float(ref.norm()), chunked_s=chunk_s,
                recurrent_s=rec_s)
