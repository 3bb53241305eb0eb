"""Prometheus text exposition of the engine's gauges and counters."""

from __future__ import annotations

import math

GAUGES = {
    "running": "requests running (holding a KDA state slot)",
    "waiting": "requests queued for a slot, cache blocks or prompt scoring",
    "kda_slots_used": "KDA state slots in use", "kda_slots_total": "KDA state slots",
    "kda_snapshots_used": "KDA prefix-cache snapshots held", "kda_snapshots_total": "KDA snapshot slots",
    "mla_blocks_used": "MLA latent blocks referenced by requests",
    "mla_blocks_cached_free": "unreferenced MLA blocks kept for prefix reuse (evictable)",
    "mla_blocks_total": "MLA latent blocks in the pool",
    "generation_tokens_per_s": "generated tokens per second over the last 10 s",
    "pending_prompt_tokens": "prompt tokens of the requests in progress (server-wide budget, --max-pending-tokens)",
    "pending_prompt_tokens_limit": "the --max-pending-tokens budget",
    "pending_body_bytes": "bytes of request bodies read and not yet parsed (server-wide, --max-pending-body-bytes)",
    "pending_body_bytes_limit": "the --max-pending-body-bytes budget",
}
COUNTERS = {
    "prompt_tokens": "prompt tokens received",
    "generation_tokens": "tokens generated",
    "prefill_tokens": "tokens run through prefill forwards (prompt tokens minus prefix-cache hits, plus recompute)",
    "prefix_cache_hit_tokens": "prompt tokens served from the prefix cache",
    "prefix_cache_queries": "requests looked up in the prefix cache",
    "prefix_cache_hits": "requests that reused a cached prefix",
    "preemptions": "sequences preempted for cache blocks (recomputed later)",
    "requests_finished": "requests finished", "requests_aborted": "requests aborted (client gone)",
    "steps": "engine steps", "decode_forwards": "batched decode forwards", "prefill_forwards": "prefill forwards",
    "graph_decode_forwards": "batched decode forwards replayed as CUDA graphs (fixed-shape step)",
    "pipelined_steps": "decode steps launched before the previous step's tokens were read back (fed on the device)",
    "discarded_tokens": "tokens computed for requests that had already ended when their pipelined step ran",
    "scored_tokens": "prompt tokens scored for their log-probs (echo with logprobs)",
    "score_forwards": "prompt-scoring forwards",
}


def _number(v: float) -> str:
    """A sample value in Prometheus' text format: integers in full (``:g`` printed 1,048,576 as 1.04858e+06),
    NaN / +Inf / -Inf spelled its way, others as Python's shortest round-trip repr."""
    v = float(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return str(int(v)) if v.is_integer() else repr(v)


def render_metrics(stats: dict[str, float], uptime_s: float) -> str:
    lines = []
    for name, help_ in GAUGES.items():
        lines += [f"# HELP kimi_linear_{name} {help_}", f"# TYPE kimi_linear_{name} gauge",
                  f"kimi_linear_{name} {_number(stats[name])}"]
    for name, help_ in COUNTERS.items():
        lines += [f"# HELP kimi_linear_{name}_total {help_}", f"# TYPE kimi_linear_{name}_total counter",
                  f"kimi_linear_{name}_total {_number(stats[name])}"]
    lines += ["# HELP kimi_linear_uptime_seconds seconds since start", "# TYPE kimi_linear_uptime_seconds gauge",
              f"kimi_linear_uptime_seconds {uptime_s:.3f}"]
    return "\n".join(lines) + "\n"
