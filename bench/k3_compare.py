"""Kimi Linear vs the Kimi K3 switches (issue 7): same size, same data, same steps; held-out losses.

    python bench/k3_compare.py --steps 2000 --out runs/k3cmp           # on the GPU (bf16 autocast)
    python bench/k3_compare.py --steps 20 --max-files 50 --seq-len 128 --batch-size 4 --out /tmp/k3cmp  # smoke test

Variants, all on the `small` preset's shape (8 layers: 6 KDA + 2 MLA, hidden 512, 8 experts top-2) and the same
BPE tokenizer, stdlib files cut into seq_len pieces (kimi_linear.train.chunks), seed and schedule:
  kimi-linear  the preset as is
  attn-res     + block attention residuals (`attn_res_block_size`, default 2 layers per block)
  k3-all       + every K3 switch: bounded gate (-5), full-rank KDA output gate, gated MLA, AttnRes, LatentMoE
               (latent = hidden/2, with norm), SiTU (4, 25), routed_scaling_factor 1.0, quantile router balancing
Prints a markdown table (held-out loss at each evaluation, final train loss, parameters, seconds) and writes
OUT/results.json. Report what it shows, whichever way it goes.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from kimi_linear.model import KimiLinearForCausalLM, preset_config
from kimi_linear.train.budget import fit_within
from kimi_linear.train.chunks import DocumentChunkSource
from kimi_linear.train.corpus import (
    encode_documents,
    read_texts,
    split_files,
    stdlib_files,
    train_bpe_tokenizer,
)
from kimi_linear.train.trainer import TrainConfig, Trainer


def variants(block: int) -> dict[str, tuple[dict, str | None]]:
    """name -> (config overrides on the `small` preset, router balancing rule)."""
    lac = dict(preset_config("small").linear_attn_config)
    k3_lac = {**lac, "gate_lower_bound": -5.0, "use_full_rank_gate": True}
    return {
        "kimi-linear": ({}, None),
        "attn-res": ({"attn_res_block_size": block}, None),
        "k3-all": ({"attn_res_block_size": block, "linear_attn_config": k3_lac, "mla_use_output_gate": True,
                    "use_latent_moe": True, "routed_expert_hidden_size": 256, "latent_moe_use_norm": True,
                    "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
                    "routed_scaling_factor": 1.0}, "quantile"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--minutes", type=float, default=0.0,
                   help="per-variant training time limit (0: none); a variant cut by time is marked in the table "
                        "and its schedule anneals in time (kimi_linear.train.budget); compare at equal steps")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--max-files", type=int, default=0, help="limit the corpus (0: all stdlib files)")
    p.add_argument("--block", type=int, default=2, help="AttnRes layers per block")
    p.add_argument("--only", nargs="*", help="run only these variants")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="directory for results.json (required unless --report)")
    p.add_argument("--report", nargs="+", metavar="DIR",
                   help="only print the combined table of runs saved in these directories (e.g. one per variant, "
                        "run as parallel processes with --only)")
    a = p.parse_args()
    if a.report:
        results = {}
        for d in a.report:
            with open(os.path.join(d, "results.json"), encoding="utf-8") as f:
                results.update(json.load(f)["results"])
        print_table(results)
        return
    if not a.out:
        p.error("--out is required (or --report)")
    os.makedirs(a.out, exist_ok=True)

    train_files, eval_files = split_files(stdlib_files())
    if a.max_files:
        train_files, eval_files = train_files[: a.max_files], eval_files[: a.max_files]
    tokenizer = train_bpe_tokenizer(read_texts(train_files), a.vocab_size)
    train_docs = encode_documents(tokenizer, read_texts(train_files))
    eval_docs = encode_documents(tokenizer, read_texts(eval_files))
    ids = dict(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
               pad_token_id=tokenizer.pad_token_id)

    results = {}
    for name, (overrides, balance) in variants(a.block).items():
        if a.only and name not in a.only:
            continue
        # Whole files cut into pieces (every token of the corpus is trained on), not rows packed from file starts:
        # those see only each file's first seq_len tokens, which a 40M model memorizes within a few epochs.
        source = DocumentChunkSource(train_docs, eval_docs, a.batch_size, a.seq_len, pad_id=tokenizer.pad_token_id,
                                     seed=a.seed)
        torch.manual_seed(a.seed)
        model = KimiLinearForCausalLM(preset_config("small", **ids, **overrides)).init_weights(a.seed)
        config = TrainConfig(steps=a.steps, lr=a.lr, warmup=a.warmup, eval_every=a.eval_every, progress=False,
                             balance=balance)
        trainer = Trainer(model.to(a.device), source, config)
        t = time.time()
        run = fit_within(trainer, a.minutes * 60 if a.minutes > 0 else None)   # evaluates every config.eval_every
        history = run.history
        evals = [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h]
        results[name] = dict(evals=evals, final_train_loss=history[-1]["loss"], seconds=time.time() - t,
                             steps=run.steps, stopped_by=run.stopped_by,
                             parameters=sum(p.numel() for p in model.parameters()), overrides=overrides,
                             balance=balance)
        print(f"{name}: held-out {evals[-1][1]:.4f} after {run.steps} steps, stopped by {run.stopped_by} "
              f"({results[name]['seconds']:.0f} s)", flush=True)
    with open(os.path.join(a.out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(dict(args=vars(a), results=results), f, indent=2)
    print_table(results)


def print_table(results: dict) -> None:
    """Markdown table: held-out loss at each evaluation step, final train loss, parameters, seconds."""
    steps = sorted({s for r in results.values() for s, _ in r["evals"]})
    print("| variant | params | " + " | ".join(f"held-out @ {s}" for s in steps)
          + " | steps run | train loss | seconds |")
    print("|---|---|" + "---|" * len(steps) + "---|---|---|")
    for name, r in results.items():
        ev = dict(r["evals"])
        cells = " | ".join(f"{ev[s]:.4f}" if s in ev else "" for s in steps)
        ran = f"{r.get('steps', '?')}" + (" (time)" if r.get("stopped_by") == "time" else "")
        print(f"| {name} | {r['parameters'] / 1e6:.1f}M | {cells} | {ran} | {r['final_train_loss']:.4f} | "
              f"{r['seconds']:.0f} |")


if __name__ == "__main__":
    main()
