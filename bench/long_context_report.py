"""Tables and the plot of ``bench/long_context.py``: markdown tables of one process's points, and ``--plot DIR``,
which merges the JSON files of the processes (one model each) into one table of ratios beside the Kimi Linear
report's numbers and a PNG: TPOT vs context (log x, both models, floors dashed), prefill time vs context, cache
bytes per sequence vs context."""

from __future__ import annotations

import glob
import json
import os
from typing import Any

# The Kimi Linear technical report's efficiency claims at 1M tokens (their hardware and serving stack).
REPORT = dict(tpot_hybrid_ms=1.84, tpot_mla_ms=11.48, decode_speedup=6.3, prefill_speedup=2.9, cache_saving=0.75)


def table(title: str, header: list[str], rows: list[list[Any]]) -> str:
    """A markdown table under a title line; printed and returned."""
    lines = [title, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    return text


def ctx_name(n: int) -> str:
    if n >= 2**20 and n % 2**20 == 0:
        return f"{n // 2**20}M ({n:,})"
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def gb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e9:.3f} GB" if n >= 1e7 else f"{n / 1e6:.3f} MB"


def f3(x: float | None) -> str:
    return "-" if x is None or x != x else f"{x:.3f}"


def ratio(a: float | None, b: float | None) -> str:
    """``a / b`` as "1.23x", or "-" when either is missing or not a number (floors off a GPU)."""
    if a is None or b is None or a != a or b != b or not b:
        return "-"
    return f"{a / b:.2f}x"


def decode_table(model: str, rows: list[dict]) -> str:
    """TPOT per (context, batch): engine step (median), the bucket's graph replayed alone, floor, cache bytes."""
    body = []
    for r in rows:
        if r.get("skipped"):
            body.append([model, ctx_name(r["context"]), r.get("batch", "-"), "skipped: " + r["skipped"]] + ["-"] * 8)
            continue
        fill = r["fill"] if not r.get("graphs_broken") else f"{r['fill']}, EAGER (capture failed)"
        body.append([model, ctx_name(r["context"]), r["batch"], fill, f3(r["step_ms"]), f3(r.get("replay_ms")),
                     f3(r["floor_ms"]), ratio(r["step_ms"], r["floor_ms"]), f"{r['tok_per_s']:,.0f}",
                     gb(r["seq_cache_bytes"]), gb(r["info_cache_bytes"])])
    return table(f"### Decode, {model}: time per output token (engine step, median)",
                 ["model", "context", "batch", "cache", "TPOT ms", "graph replay ms", "floor ms", "TPOT / floor",
                  "tok/s", "cache / seq (engine)", "`kimi-linear info`"], body)


def prefill_table(model: str, rows: list[dict]) -> str:
    body = []
    for r in rows:
        if r.get("skipped"):
            body.append([model, ctx_name(r["context"]), "skipped: " + r["skipped"]] + ["-"] * 8)
            continue
        body.append([model, ctx_name(r["context"]), r["chunk"], f3(r["prefill_s"]), f"{r['prefill_tok_per_s']:,.0f}",
                     f3(r["floor_s"]), ratio(r["prefill_s"], r["floor_s"]), f3(r["decode_step_ms"]),
                     f3(r["decode_floor_ms"]), gb(r["seq_cache_bytes"]), gb(r["info_cache_bytes"])])
    return table(f"### Prefill, {model}: one sequence, chunked through the engine (then decoded from that cache)",
                 ["model", "context", "chunk", "prefill s", "tok/s", "floor s (FLOPs / matmul rate)",
                  "prefill / floor", "TPOT after it, ms", "decode floor ms", "cache / seq (engine)",
                  "`kimi-linear info`"], body)


def check_table(check: dict) -> str:
    rows = []
    e = check.get("engine_vs_forward")
    if e:
        rows.append(["engine vs one plain forward, float32", f"{e['prompt']:,}-token prompt, {e['new_tokens']} "
                     f"greedy tokens", "identical" if e["identical"] else f"first difference at {e['first_difference']}"
                     f" (top-2 gap {e['top2_gap_there']})", "PASS" if e["ok"] else "FAIL"])
    k = check.get("kda_state")
    if k:
        rows.append(["KDA final state, chunked vs recurrent, float32", f"{k['tokens']:,} tokens, chunks of "
                     f"{k['chunk']:,}, {k['heads']} heads of {k['dim']}", f"rel. error {k['rel_error']:.2e} "
                     f"(bar {k['bar']:.0e})", "PASS" if k["ok"] else "FAIL"])
    return table("### Correctness at length", ["check", "what", "result", "verdict"], rows)


# ------------------------------------------------------------------------------------------------ --plot
def load(folder: str) -> dict[str, dict]:
    """Every ``long_context_*.json`` in ``folder`` merged per model: {model: {"decode": [...], "prefill": [...],
    "meta": [...]}}; ``"check"`` holds the last check found."""
    merged: dict[str, dict] = {}
    for path in sorted(glob.glob(os.path.join(folder, "long_context_*.json"))):
        with open(path) as f:
            doc = json.load(f)
        for model, res in doc.get("models", {}).items():
            m = merged.setdefault(model, dict(decode=[], prefill=[], meta=[]))
            m["decode"] += [r for r in res.get("decode", []) if not r.get("skipped")]
            m["prefill"] += [r for r in res.get("prefill", []) if not r.get("skipped")]
            m["meta"].append(doc.get("meta", {}))
        if doc.get("check"):
            merged["check"] = doc["check"]
    return merged


def _batch1(rows: list[dict]) -> dict[int, dict]:
    return {r["context"]: r for r in rows if r["batch"] == 1}


def ratios(merged: dict[str, dict]) -> str:
    """MLA / hybrid at every context both measured: TPOT (batch 1), prefill time, cache per sequence."""
    h, m = merged.get("hybrid"), merged.get("mla")
    if not h or not m:
        return table("### Ratios: need both models' JSON", ["-"], [])
    text = ""
    hd, md = _batch1(h["decode"]), _batch1(m["decode"])
    rows = []
    for n in sorted(set(hd) & set(md)):
        rep = f"{REPORT['tpot_mla_ms']} / {REPORT['tpot_hybrid_ms']} ms = {REPORT['decode_speedup']}x" \
            if n == 2**20 else ""
        rows.append([ctx_name(n), f3(hd[n]["step_ms"]), f3(md[n]["step_ms"]),
                     ratio(md[n]["step_ms"], hd[n]["step_ms"]), ratio(md[n]["floor_ms"], hd[n]["floor_ms"]), rep])
    text += table("### Decode at batch 1: all-MLA / hybrid (the report: 6.3x at 1M)",
                  ["context", "hybrid TPOT ms", "all-MLA TPOT ms", "ratio", "floor ratio", "report"], rows)
    hp = {r["context"]: r for r in h["prefill"]}
    mp = {r["context"]: r for r in m["prefill"]}
    rows = [[ctx_name(n), f3(hp[n]["prefill_s"]), f3(mp[n]["prefill_s"]),
             ratio(mp[n]["prefill_s"], hp[n]["prefill_s"]), ratio(mp[n]["floor_s"], hp[n]["floor_s"])]
            for n in sorted(set(hp) & set(mp))]
    text += table(f"### Prefill: all-MLA / hybrid (the report: {REPORT['prefill_speedup']}x at 1M)",
                  ["context", "hybrid s", "all-MLA s", "ratio", "FLOP-floor ratio"], rows)
    cache: dict[int, list] = {}
    for r in h["decode"] + h["prefill"]:
        cache.setdefault(r["context"], [None, None, r["info_cache_bytes"], r["info_all_mla_bytes"]])[0] = \
            r["seq_cache_bytes"]
    for r in m["decode"] + m["prefill"]:
        if r["context"] in cache:
            cache[r["context"]][1] = r["seq_cache_bytes"]
    rows = [[ctx_name(n), gb(a), gb(b), f"{1 - a / b:.1%}" if a and b else "-", gb(i), gb(j), f"{1 - i / j:.1%}"]
            for n, (a, b, i, j) in sorted(cache.items())]
    text += table(f"### Cache per sequence: the engine's allocation (the report: ~{REPORT['cache_saving']:.0%} less "
                  "at 1M)", ["context", "hybrid (engine)", "all-MLA (engine)", "saving", "hybrid (info)",
                             "all-MLA (info)", "saving (info)"], rows)
    return text


def plot(folder: str) -> str:
    """Merge the folder's JSON files, print the ratio tables, write ``long_context.png`` and ``long_context.md``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    merged = load(folder)
    text = ratios(merged)
    if merged.get("check"):
        text += check_table(merged["check"])
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.2))
    colors = {"hybrid": "tab:blue", "mla": "tab:red"}
    names = {"hybrid": "Kimi Linear (hybrid)", "mla": "all-MLA twin"}
    ax = axes[0]
    for model in ("hybrid", "mla"):
        if model not in merged:
            continue
        rows = sorted(_batch1(merged[model]["decode"]).values(), key=lambda r: r["context"])
        if rows:
            x = [r["context"] for r in rows]
            ax.plot(x, [r["step_ms"] for r in rows], "o-", color=colors[model], label=f"{names[model]}: engine")
            ax.plot(x, [r["floor_ms"] for r in rows], "--", color=colors[model], alpha=0.7,
                    label=f"{names[model]}: floor (bytes / copy bandwidth)")
        # (a prefill row kept from an earlier run may leave its decode out: None)
        real = sorted((r for r in merged[model]["prefill"] if r.get("decode_step_ms") is not None),
                      key=lambda r: r["context"])
        if real:
            ax.plot([r["context"] for r in real], [r["decode_step_ms"] for r in real], "s", mfc="none", ms=9,
                    color=colors[model], label=f"{names[model]}: after a real prefill")
    ax.plot([2**20], [REPORT["tpot_hybrid_ms"]], "*", ms=14, color="tab:blue", label="report: hybrid 1.84 ms")
    ax.plot([2**20], [REPORT["tpot_mla_ms"]], "*", ms=14, color="tab:red", label="report: full MLA 11.48 ms")
    ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="time per output token (ms), batch 1",
           title="Decode")
    ax.legend(fontsize=7)
    ax = axes[1]
    for model in ("hybrid", "mla"):
        rows = sorted(merged.get(model, {}).get("prefill", []), key=lambda r: r["context"])
        if rows:
            x = [r["context"] for r in rows]
            ax.plot(x, [r["prefill_s"] for r in rows], "o-", color=colors[model], label=f"{names[model]}: engine")
            ax.plot(x, [r["floor_s"] for r in rows], "--", color=colors[model], alpha=0.7,
                    label=f"{names[model]}: floor (FLOPs / matmul rate)")
    ax.set(xscale="log", yscale="log", xlabel="prompt (tokens)", ylabel="prefill time (s), one sequence",
           title=f"Prefill (report: {REPORT['prefill_speedup']}x faster than full attention at 1M)")
    ax.legend(fontsize=7)
    ax = axes[2]
    for model in ("hybrid", "mla"):
        rows = {r["context"]: r for r in merged.get(model, {}).get("decode", []) + merged.get(model, {}).get(
            "prefill", [])}
        if rows:
            x = sorted(rows)
            ax.plot(x, [rows[n]["seq_cache_bytes"] / 1e9 for n in x], "o-", color=colors[model],
                    label=f"{names[model]}: engine")
            ax.plot(x, [rows[n]["info_cache_bytes"] / 1e9 for n in x], "--", color=colors[model], alpha=0.7,
                    label=f"{names[model]}: kimi-linear info")
    ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="cache per sequence (GB)",
           title=f"Cache (report: ~{REPORT['cache_saving']:.0%} less at 1M)")
    ax.legend(fontsize=7)
    meta = next((m["meta"][0] for m in merged.values() if isinstance(m, dict) and m.get("meta")), {})
    fig.suptitle(f"Kimi Linear vs its all-MLA twin (same widths), random {meta.get('dtype', '?')} weights, "
                 f"{meta.get('gpu', meta.get('device', '?'))}, through the engine")
    fig.tight_layout()
    png = os.path.join(folder, "long_context.png")
    fig.savefig(png, dpi=110)
    plt.close(fig)
    with open(os.path.join(folder, "long_context.md"), "w") as f:
        f.write(text)
    print(f"wrote {png}")
    return png
