"""``kimi-linear train``: train a Kimi Linear model on a synthetic task or on the offline Python-stdlib corpus.

    kimi-linear train --task mqar --mixer kda --steps 2000 --out runs/mqar      # a synthetic task
    kimi-linear train --corpus stdlib --preset tiny --steps 5000 --out runs/py    # text: BPE + packed documents
    kimi-linear train --resume runs/py/step-2000 --steps 5000 --out runs/py       # continue exactly
    torchrun --nproc-per-node 2 -m kimi_linear.cli train --task mqar --context-parallel 2 --seq-len 65536 ...

Checkpoints (``OUT/step-N``) are ordinary model directories (config.json, safetensors, tokenizer) that
``kimi-linear generate`` and transformers load, plus ``trainer_state.pt`` for exact resume. A synthetic task's
tokenizer writes token i as the number i: ``kimi-linear generate OUT/step-N "3 260 17"``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .schedule import SCHEDULES
from .tasks import TASKS


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="train on a synthetic task or the offline stdlib corpus",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    data = p.add_argument_group("data (one of --task / --corpus)")
    data.add_argument("--task", choices=sorted(TASKS), help="a synthetic task of the Kimi Linear report")
    data.add_argument("--mixer", default="kda", choices=("kda", "gdn", "attention"),
                      help="token mixer for --task models (2 layers, 2 heads of 128); gdn = Gated DeltaNet")
    data.add_argument("--corpus", choices=("stdlib",), help="text: this Python's standard library sources")
    data.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary for --corpus")
    data.add_argument("--max-files", type=int, default=0,
                      help="use only the first N stdlib files of each split (quick trials; 0 = all)")
    model = p.add_argument_group("model")
    model.add_argument("--preset", default="tiny", help="model preset for --corpus (see `kimi-linear info`)")
    model.add_argument("--config", help="a config.json to train instead of a preset")
    model.add_argument("--hidden", type=int, default=256, help="hidden size for --task models")
    model.add_argument("--resume", help="a checkpoint written by this command: continue it exactly")
    opt = p.add_argument_group("optimisation")
    opt.add_argument("--steps", type=int, default=1000, help="total optimizer steps")
    opt.add_argument("--batch-size", type=int, default=16, help="sequences per micro-batch")
    opt.add_argument("--seq-len", type=int, default=512)
    opt.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    opt.add_argument("--lr", type=float, default=1e-3)
    opt.add_argument("--schedule", default="cosine", choices=SCHEDULES)
    opt.add_argument("--warmup", type=int, default=100)
    opt.add_argument("--weight-decay", type=float, default=0.1)
    opt.add_argument("--grad-clip", type=float, default=1.0)
    opt.add_argument("--no-bf16", action="store_true", help="no bf16 autocast on GPU")
    run = p.add_argument_group("run")
    run.add_argument("--out", required=True, help="directory for checkpoints (OUT/step-N)")
    run.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: at the end)")
    run.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: at the end)")
    run.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    run.add_argument("--seed", type=int, default=0)
    dist = p.add_argument_group("several processes (under torchrun)")
    dist.add_argument("--context-parallel", type=int, default=1, metavar="C",
                      help="split every row along time across C ranks (consecutive ranks; the world size must be a "
                           "multiple of C, the rest is data parallel); --task data only")
    dist.add_argument("--activation-checkpointing", action="store_true",
                      help="keep only each decoder layer's input, recompute the layer in backward (long sequences)")
    return p


def _text_source(args, tokenizer_dir: str | None):
    """Tokenizer (trained, or loaded from a resumed checkpoint) and the packed stdlib source, tokens cached."""
    import torch

    from kimi_linear.model.tokenizer import load_tokenizer

    from .corpus import PackedTextSource, encode_documents, read_texts, split_files, stdlib_files, train_bpe_tokenizer

    train_files, eval_files = split_files(stdlib_files())
    if args.max_files:
        train_files, eval_files = train_files[: args.max_files], eval_files[: args.max_files]
    if tokenizer_dir:
        tokenizer = load_tokenizer(tokenizer_dir)
    else:
        print(f"training a {args.vocab_size}-token BPE on {len(train_files)} stdlib files ...", file=sys.stderr)
        tokenizer = train_bpe_tokenizer(read_texts(train_files), args.vocab_size)
    cache = os.path.join(args.out, f"tokens-{len(tokenizer)}-{args.max_files or 'all'}.pt")
    if os.path.isfile(cache):
        train_docs, eval_docs = torch.load(cache)
    else:
        print("tokenizing the corpus ...", file=sys.stderr)
        train_docs = encode_documents(tokenizer, read_texts(train_files))
        eval_docs = encode_documents(tokenizer, read_texts(eval_files))
        os.makedirs(args.out, exist_ok=True)
        torch.save((train_docs, eval_docs), cache)
    print(f"corpus: {sum(map(len, train_docs)) / 1e6:.1f}M train tokens, {sum(map(len, eval_docs)) / 1e6:.2f}M "
          "held-out", file=sys.stderr)
    source = PackedTextSource(train_docs, eval_docs, args.batch_size, args.seq_len, seed=args.seed,
                              grad_accum=args.grad_accum)
    return source, tokenizer


def _context_parallel_problem(args: argparse.Namespace, world: int) -> str | None:
    """Why ``--context-parallel`` cannot run with these arguments (checked on every rank alike), or None."""
    C = args.context_parallel
    if world % C:
        return f"needs torchrun with a multiple of {C} processes, got a world of {world}"
    if args.task is None:
        return "--corpus packs documents into rows (cu_seqlens), which cannot be split along time; use --task"
    if args.mixer == "gdn":
        return "Gated DeltaNet layers have no context-parallel path (KDA and MLA do)"
    if args.seq_len % C:
        return f"--seq-len {args.seq_len} is not divisible by {C}"
    if args.batch_size % (world // C):
        return f"--batch-size {args.batch_size} is not divisible by the {world // C} data-parallel replicas"
    return None


def run_train(args: argparse.Namespace) -> int:
    import torch

    from kimi_linear.model import KimiLinearForCausalLM, load_config, preset_config

    from .data import TaskSource
    from .models import build_task_model
    from .tasks import get_task
    from .trainer import TrainConfig, Trainer, resume

    if (args.task is None) == (args.corpus is None):
        print("error: give exactly one of --task or --corpus", file=sys.stderr)
        return 2
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cp_size = args.context_parallel
    if cp_size > 1:
        problem = _context_parallel_problem(args, world)
        if problem:
            print(f"error: --context-parallel {cp_size}: {problem}", file=sys.stderr)
            return 2
    rank = 0
    if world > 1:  # under torchrun: FSDP2 data parallel
        from .distributed import init_distributed

        rank, world, dev = init_distributed()
        device = str(dev)
    config = TrainConfig(steps=args.steps, lr=args.lr, warmup=args.warmup, schedule=args.schedule,
                         weight_decay=args.weight_decay, grad_clip=args.grad_clip, grad_accum=args.grad_accum,
                         eval_every=args.eval_every, save_every=args.save_every, out_dir=args.out,
                         bf16=not args.no_bf16)
    tokenizer, model = None, None
    if args.task:
        from kimi_linear.model.tokenizer import id_tokenizer

        task = get_task(args.task)
        source = TaskSource(task, args.batch_size, args.seq_len, seed=args.seed)
        tokenizer = id_tokenizer(task.vocab_size)       # saved beside each checkpoint, so `generate` can load it
        if args.mixer == "gdn" and args.resume:
            print("error: Gated DeltaNet runs are not in the Kimi Linear checkpoint format; they cannot --resume",
                  file=sys.stderr)
            return 2
        model = build_task_model(args.mixer, task.vocab_size, hidden_size=args.hidden,
                                 max_len=max(8192, args.seq_len), seed=args.seed)
    else:
        source, tokenizer = _text_source(args, args.resume)
        if args.config:
            model_config = load_config(args.config)
        else:
            model_config = preset_config(args.preset, vocab_size=len(tokenizer),
                                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                                         pad_token_id=tokenizer.pad_token_id)
        if model_config.vocab_size < len(tokenizer):
            print(f"error: model vocab_size {model_config.vocab_size} < tokenizer size {len(tokenizer)}",
                  file=sys.stderr)
            return 2
    if world > 1:
        from .distributed import (
            ContextParallelSource,
            ContextParallelTrainer,
            ShardedSource,
            checkpoint_layers,
            load_sharded,
            shard_model,
        )

        cp = None
        if cp_size > 1:
            from kimi_linear.model.context_parallel import new_context_parallel_groups

            cp, dp_rank, dp_world = new_context_parallel_groups(cp_size)
            source = ContextParallelSource(source, cp, dp_rank, dp_world)
        else:
            source = source.shard(rank, world) if hasattr(source, "shard") else ShardedSource(source, rank, world)
        if model is None:
            model = (KimiLinearForCausalLM.from_pretrained(args.resume, dtype=torch.float32) if args.resume else
                     KimiLinearForCausalLM(model_config).init_weights(args.seed))
        if args.activation_checkpointing:
            checkpoint_layers(model)
        model = shard_model(model.to(device), bf16=device.startswith("cuda") and not args.no_bf16)
        if cp is not None:
            from kimi_linear.model.context_parallel import enable_context_parallel

            enable_context_parallel(model, cp)
        trainer = (ContextParallelTrainer if cp is not None else Trainer)(model, source, config)
        trainer.sharded = True
        if args.resume:
            load_sharded(trainer, args.resume)
    elif args.resume:
        trainer = resume(args.resume, source, config, device=device)
    else:
        torch.manual_seed(args.seed)
        if model is None:
            model = KimiLinearForCausalLM(model_config).init_weights(args.seed)
        trainer = Trainer(model.to(device), source, config)
    if args.activation_checkpointing and world == 1:
        from .distributed import checkpoint_layers

        checkpoint_layers(trainer.model)
    trainer.tokenizer = tokenizer
    n_params = sum(p.numel() for p in trainer.model.parameters())
    print(f"training {n_params / 1e6:.2f}M parameters on {device}, step {trainer.step} -> {args.steps}",
          file=sys.stderr)
    history = trainer.fit()
    last = history[-1] if history else {}
    if rank == 0:
        print(json.dumps({k: v for k, v in last.items() if isinstance(v, int | float)}))
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0
