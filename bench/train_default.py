"""Train the small model shipped with the package (issue 5), or its same-size all-MLA twin, on the Python stdlib.

GPU (one H200; the two variants side by side as two processes: same tokenizer, data order, steps and schedule):

    export PYTHONPATH=src PYTHONUNBUFFERED=1; mkdir -p out
    python3 bench/train_default.py --variant default --minutes 6 --out out/default > out/default.log 2>&1 &
    python3 bench/train_default.py --variant mla --minutes 6 --out out/mla > out/mla.log 2>&1 &
    wait

CPU smoke test (about a minute): ``python bench/train_default.py --minutes 0.2 --max-files 50 --seq-len 128
--batch-size 4 --eval-rows 8 --out /tmp/td/default``

Ship the default (from the repository root): ``rm -rf src/kimi_linear/assets/default && mkdir -p
src/kimi_linear/assets/default && cp out/default/{config.json,tokenizer.json,tokenizer_config.json,train_log.json}
out/default/*.safetensors* src/kimi_linear/assets/default/``

What it does: trains a byte-level BPE (``--vocab-size``) on the training split of this interpreter's stdlib
sources (held-out: 1 file in 20, chosen by name, see ``corpus.split_files``), once per ``--cache`` directory (the
first process builds it under a file lock, the other one waits and reuses it); cuts every file into pieces of
``--seq-len`` tokens (``kimi_linear.train.chunks``: whole files are trained on, nothing crosses a file boundary);
trains with AdamW, warmup + WSD (flat, then linear decay over the last 20%), bf16 autocast on CUDA, sign-rule
router balancing, for ``--steps`` steps or ``--minutes`` of training, whichever comes first (when time binds, the
schedule decays in time instead: ``kimi_linear.train.budget``); evaluates the held-out loss every
``--eval-every`` steps and at the end; writes to ``--out`` the checkpoint in bfloat16 (config.json, safetensors
shards under ``--max-shard-size``, tokenizer files) and ``train_log.json`` (command, steps, tokens, minutes, card,
held-out loss of the float32 weights and of the saved bfloat16 ones, bits per byte, loss curves).

Model (``--variant default``): Kimi Linear, 8 layers (KDA 1-3, 5-7; NoPE MLA 4, 8: 3:1), hidden 320, 5 heads of
64, MoE 8 experts top-2 + 1 shared (expert width 112; layer 1 dense, 1280), vocabulary 4096, untied embeddings:
14.5M parameters (10.0M active per token). ``--variant mla``: the same with every layer MLA (14.0M).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import fcntl
import json
import math
import os
import platform
import shlex
import sys
import sysconfig
import time

import torch

SHAPE = dict(
    hidden_size=320, intermediate_size=1280, moe_intermediate_size=112, num_hidden_layers=8,
    num_attention_heads=5, num_key_value_heads=5, kv_lora_rank=160, qk_nope_head_dim=64, qk_rope_head_dim=32,
    v_head_dim=64, num_experts=8, num_experts_per_token=2, num_shared_experts=1, first_k_dense_replace=1,
    routed_scaling_factor=2.446, model_max_length=8192, tie_word_embeddings=False,
    linear_attn_config=dict(kda_layers=[1, 2, 3, 5, 6, 7], full_attn_layers=[4, 8], head_dim=64, num_heads=5,
                            short_conv_kernel_size=4),
)
VARIANTS = ("default", "mla")


def model_config(variant: str, tokenizer):
    """The shipped shape (``default``) or its all-MLA twin (``mla``), sized to the tokenizer."""
    from kimi_linear.model import config_from_dict

    if variant not in VARIANTS:
        raise ValueError(f"`variant` must be one of {VARIANTS}, got {variant!r}")
    raw = copy.deepcopy(SHAPE)
    if variant == "mla":
        raw["linear_attn_config"].update(kda_layers=[], full_attn_layers=list(range(1, raw["num_hidden_layers"] + 1)))
    raw.update(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    return config_from_dict(raw)


# ------------------------------------------------------------------------------------------------------ corpus
def prepare_corpus(cache: str, vocab_size: int, max_files: int) -> tuple:
    """(tokenizer, train docs, held-out docs, info), built once per cache directory under a file lock."""
    from kimi_linear.model.tokenizer import load_tokenizer
    from kimi_linear.train.corpus import encode_documents, read_texts, split_files, stdlib_files, train_bpe_tokenizer

    os.makedirs(cache, exist_ok=True)
    tok_dir, tokens = os.path.join(cache, "tokenizer"), os.path.join(cache, "tokens.pt")
    with open(os.path.join(cache, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isfile(tokens) and os.path.isfile(os.path.join(tok_dir, "tokenizer.json")):
            print(f"corpus: reusing {cache}", flush=True)
            data = torch.load(tokens)
            return load_tokenizer(tok_dir), data["train"], data["eval"], data["info"]
        t0 = time.perf_counter()
        train_files, eval_files = split_files(stdlib_files())
        if max_files:
            train_files, eval_files = train_files[:max_files], eval_files[:max_files]
        train_texts, eval_texts = read_texts(train_files), read_texts(eval_files)
        print(f"corpus: training a {vocab_size}-token BPE on {len(train_files)} stdlib files ...", flush=True)
        tokenizer = train_bpe_tokenizer(train_texts, vocab_size)
        train_docs, eval_docs = encode_documents(tokenizer, train_texts), encode_documents(tokenizer, eval_texts)
        info = {"stdlib": sysconfig.get_paths()["stdlib"], "python": platform.python_version(),
                "train_files": len(train_files), "eval_files": len(eval_files),
                "train_tokens": sum(map(len, train_docs)), "eval_tokens": sum(map(len, eval_docs)),
                "train_bytes": sum(len(t.encode()) for t in train_texts),
                "eval_bytes": sum(len(t.encode()) for t in eval_texts), "vocab_size": len(tokenizer),
                "seconds": round(time.perf_counter() - t0, 1)}
        tokenizer.save_pretrained(tok_dir)
        tmp = f"{tokens}.tmp-{os.getpid()}"
        torch.save({"train": train_docs, "eval": eval_docs, "info": info}, tmp)
        os.replace(tmp, tokens)
        print(f"corpus: {info['train_tokens'] / 1e6:.2f}M train tokens ({info['train_bytes'] / 1e6:.1f} MB), "
              f"{info['eval_tokens'] / 1e6:.2f}M held-out, in {info['seconds']:.0f} s", flush=True)
        return tokenizer, train_docs, eval_docs, info


# ---------------------------------------------------------------------------------------------------- training
def clear_router_inputs(trainer) -> None:
    """Forget router inputs recorded outside a training step (warm-up or evaluation forwards)."""
    if trainer.routers is not None:
        for inputs in trainer.routers.inputs.values():
            inputs.clear()


def warm_up(trainer) -> None:
    """One forward and backward of the first batch before the clock starts (Triton compiles its kernels, CUDA
    allocates); no weight, optimizer or router state changes."""
    from kimi_linear.train.trainer import forward_logits, lm_loss

    batch = {k: v.to(trainer.device) for k, v in trainer.source.batch(0).items()}
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=trainer.device.type == "cuda"):
        logits = forward_logits(trainer.model, batch)
    lm_loss(logits, batch["labels"]).backward()
    trainer.optimizer.zero_grad(set_to_none=True)
    clear_router_inputs(trainer)
    trainer.source.served_tokens = 0


class Progress:
    """Prints step, loss, learning rate and real (non-padding) tokens/s every ``every`` seconds."""

    def __init__(self, trainer, source, seconds: float | None, every: float) -> None:
        self.trainer, self.source, self.seconds, self.every = trainer, source, seconds, every
        self.last = -math.inf

    def __call__(self, rec: dict, clock) -> None:
        t = clock.elapsed()
        if rec["step"] == 10:
            per = t / 10
            print(f"  first 10 steps: {per:.3f} s/step -> {per * self.trainer.config.steps:.0f} s for "
                  f"{self.trainer.config.steps} steps (budget {self.seconds or math.inf:.0f} s)", flush=True)
        if t - self.last >= self.every or rec["step"] == self.trainer.config.steps:
            self.last = t
            print(f"step {rec['step']:5d}/{self.trainer.config.steps}  loss {rec['loss']:.4f}  lr {rec['lr']:.2e}  "
                  f"{self.source.served_tokens / t:,.0f} tok/s  {t:.0f}s", flush=True)


def eval_bytes(source, tokenizer) -> int:
    """UTF-8 bytes of the held-out tokens that are scored (for bits per byte)."""
    return sum(len(tokenizer.decode(ids, skip_special_tokens=True).encode()) for ids in source.eval_label_ids())


def saved_copy(model, config, device) -> torch.nn.Module:
    """The weights as they will ship: a fresh model holding a bfloat16 copy (router and gate constants stay
    float32, as the format keeps them)."""
    from kimi_linear.model import KimiLinearForCausalLM

    shipped = KimiLinearForCausalLM(config)
    shipped.load_state_dict({k: v.detach().cpu() for k, v in model.state_dict().items()})
    return shipped.cast(torch.bfloat16).to(device).eval()


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from kimi_linear.model.memory import parameter_counts
    from kimi_linear.train.budget import fit_within
    from kimi_linear.train.chunks import DocumentChunkSource
    from kimi_linear.train.trainer import TrainConfig, Trainer, evaluate, perplexity

    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.backends.cuda.matmul.allow_tf32 = True
    started = time.perf_counter()
    cache = a.cache or os.path.join(os.path.dirname(os.path.normpath(a.out)) or ".", "stdlib-corpus")
    cache = os.path.join(cache, f"v{a.vocab_size}-{a.max_files or 'all'}")
    tokenizer, train_docs, eval_docs, corpus = prepare_corpus(cache, a.vocab_size, a.max_files)

    config = model_config(a.variant, tokenizer)
    counts = parameter_counts(config)
    from kimi_linear.model import KimiLinearForCausalLM

    torch.manual_seed(a.seed)
    model = KimiLinearForCausalLM(config).init_weights(a.seed).to(device)
    source = DocumentChunkSource(train_docs, eval_docs, a.batch_size, a.seq_len, pad_id=tokenizer.pad_token_id,
                                 seed=a.seed, eval_rows=a.eval_rows)
    train_cfg = TrainConfig(steps=a.steps, lr=a.lr, warmup=min(a.warmup, max(1, a.steps // 10)),
                            schedule=a.schedule, weight_decay=a.weight_decay, grad_clip=1.0, bf16=True,
                            balance="sign", balance_rate=1e-3, progress=False)
    trainer = Trainer(model, source, train_cfg)
    print(f"{a.variant}: {counts['total'] / 1e6:.2f}M parameters ({counts['active'] / 1e6:.2f}M active) on "
          f"{device}; {len(source.train_pieces)} training rows of {a.seq_len} (fill {source.fill:.3f}), "
          f"{len(source.eval_pieces)} held-out rows", flush=True)
    warm_up(trainer)
    budget = a.minutes * 60 if a.minutes > 0 else None

    def on_eval(rec: dict, clock) -> None:
        clear_router_inputs(trainer)
        print(f"  eval @ {rec['step']}: held-out loss {rec['eval_loss']:.4f} (ppl {perplexity(rec['eval_loss']):.1f})"
              f"  {clock.elapsed():.0f}s", flush=True)

    result = fit_within(trainer, budget, eval_every=a.eval_every,
                        on_step=Progress(trainer, source, budget, a.log_every), on_eval=on_eval)
    if result.steps == 0:
        print("error: no training step ran inside the time budget (raise --minutes)", file=sys.stderr)
        return 1
    final = result.history[-1]
    shipped = saved_copy(model, config, device)
    bf16_eval = evaluate(shipped, source, device)
    n_bytes = eval_bytes(source, tokenizer)
    n_scored = sum(len(ids) for ids in source.eval_label_ids())
    bpb = bf16_eval["loss"] * n_scored / math.log(2) / max(1, n_bytes)
    os.makedirs(a.out, exist_ok=True)
    shipped.save_pretrained(a.out, max_shard_size=a.max_shard_size)
    tokenizer.save_pretrained(a.out)
    every = max(1, len(result.history) // 300)
    log = {
        "command": "python3 " + " ".join(shlex.quote(x) for x in [sys.argv[0], *(sys.argv[1:] if argv is None
                                                                                  else argv)]),
        "variant": a.variant, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "card": torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu"),
        "torch": torch.__version__, "parameters": counts,
        "steps": result.steps, "steps_planned": a.steps, "stopped_by": result.stopped_by,
        "tokens_seen": source.served_tokens, "tokens_with_padding": result.tokens,
        "epochs": round(source.served_tokens / corpus["train_tokens"], 2),
        "train_minutes": round(result.seconds / 60, 2), "total_minutes": round((time.perf_counter() - started) / 60, 2),
        "tokens_per_second": round(source.served_tokens / result.seconds),
        "final_train_loss": final["loss"],
        "held_out_loss_float32": final["eval_loss"], "held_out_loss": bf16_eval["loss"],
        "held_out_perplexity": perplexity(bf16_eval["loss"]), "held_out_bits_per_byte": bpb,
        "held_out_tokens": n_scored, "held_out_bytes": n_bytes,
        "hyperparameters": {"seq_len": a.seq_len, "batch_size": a.batch_size, "lr": a.lr,
                            "warmup": train_cfg.warmup, "schedule": a.schedule, "weight_decay": a.weight_decay,
                            "min_lr_ratio": train_cfg.min_lr_ratio, "decay_fraction": train_cfg.decay_fraction,
                            "betas": list(train_cfg.betas), "grad_clip": train_cfg.grad_clip, "bf16_autocast":
                            device.type == "cuda", "router_balance": "sign 1e-3", "seed": a.seed,
                            "minutes": a.minutes},
        "corpus": corpus,
        "eval_curve": [{"step": r["step"], "loss": r["eval_loss"], "elapsed": round(r.get("elapsed", 0.0), 1)}
                       for r in result.evals],
        "loss_curve": [[r["step"], round(r["loss"], 4)] for r in result.history[::every]],
    }
    with open(os.path.join(a.out, "train_log.json"), "w", encoding="utf-8") as f:
        json.dump(log, f, indent=1)
    print(json.dumps({k: log[k] for k in ("variant", "steps", "stopped_by", "tokens_seen", "train_minutes",
                                          "tokens_per_second", "held_out_loss", "held_out_loss_float32",
                                          "held_out_bits_per_byte", "card")}), flush=True)
    with contextlib.suppress(Exception):
        files = sorted(os.listdir(a.out))
        print(f"wrote {a.out}: {', '.join(files)}", flush=True)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from kimi_linear.train.schedule import SCHEDULES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", default="default", choices=VARIANTS, help="default (KDA:MLA 3:1) or mla (all MLA)")
    p.add_argument("--out", required=True, help="output directory (checkpoint + train_log.json)")
    p.add_argument("--minutes", type=float, default=6.0, help="training time limit (0: none); prep not counted")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps (the schedule's length)")
    p.add_argument("--batch-size", type=int, default=32, help="rows per step")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100, help="warmup steps (at most a tenth of --steps)")
    p.add_argument("--schedule", default="wsd", choices=SCHEDULES)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--max-files", type=int, default=0, help="first N stdlib files of each split (0: all)")
    p.add_argument("--eval-every", type=int, default=500, help="held-out evaluation every N steps (and at the end)")
    p.add_argument("--eval-rows", type=int, default=0, help="held-out rows evaluated (0: every held-out piece)")
    p.add_argument("--cache", default=None, help="tokenizer + token cache (default: OUT/../stdlib-corpus)")
    p.add_argument("--max-shard-size", default="15MiB", help="largest safetensors shard (the package limit: 16 MiB)")
    p.add_argument("--log-every", type=float, default=15.0, help="seconds between progress lines")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "vocab_size"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.minutes < 0:
        p.error(f"--minutes must be >= 0, got {a.minutes}")
    return a


if __name__ == "__main__":
    sys.exit(main())
