"""`kimi-linear`: try, inspect and run Kimi Linear checkpoints from the command line.

    kimi-linear init ./tiny --preset tiny            # random checkpoint + byte-level tokenizer, no downloads
    kimi-linear info ./tiny --context 1048576        # parameters, layer layout, cache bytes per sequence
    kimi-linear info kimi-linear-48b                 # the same for a preset's shape, no files needed
    kimi-linear generate "def fibonacci(n):"         # the small model shipped with the package, offline
    kimi-linear generate -m ./tiny "Hello"           # any checkpoint (greedy; --temperature > 0 samples)
    kimi-linear train --task mqar --out runs/mqar    # train (synthetic tasks or the offline stdlib corpus)
    kimi-linear serve ./tiny                         # OpenAI-compatible server on 127.0.0.1 (default: shipped model)
    echo "Hello" | kimi-linear generate ./Kimi-Linear-48B-A3B-Instruct --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import os
import sys
import time

PRESET_HELP = "a checkpoint directory, or a preset name (tiny, small, kimi-linear-48b, k3-tiny, kimi-k3)"


def _dtype(name: str):
    from kimi_linear.model.checkpoint import resolve_dtype

    return resolve_dtype(name)


def _config(source: str):
    """A preset's config, or a checkpoint directory's (or a config.json file's)."""
    from kimi_linear.model import PRESETS, load_config, preset_config

    if source in PRESETS and not os.path.isdir(source):
        return preset_config(source)
    if not os.path.exists(source) and os.sep not in source and not source.startswith("."):
        raise ValueError(f"unknown preset {source!r} (choose from {', '.join(PRESETS)}), and no directory of that "
                         "name")
    if not os.path.exists(source):
        raise FileNotFoundError(f"{source} does not exist (give a checkpoint directory or a preset name: "
                                f"{', '.join(PRESETS)})")
    return load_config(source)


# ---------------------------------------------------------------------------------------------------------- init
def cmd_init(args: argparse.Namespace) -> int:
    import torch

    from kimi_linear import KimiLinearForCausalLM
    from kimi_linear.model import preset_config
    from kimi_linear.model.tokenizer import byte_level_tokenizer

    if os.path.exists(args.path) and not os.path.isdir(args.path):
        print(f"error: {args.path} is a file, not a directory: give a new (or empty) directory for the checkpoint",
              file=sys.stderr)
        return 2
    if os.path.exists(os.path.join(args.path, "config.json")) and not args.force:
        print(f"error: {args.path} already holds a checkpoint (use --force to overwrite)", file=sys.stderr)
        return 2
    config = preset_config(args.preset, **({"model_max_length": args.context} if args.context else {}))
    torch.manual_seed(args.seed)
    print(f"initialising preset {args.preset!r} (seed {args.seed}) ...", file=sys.stderr)
    model = KimiLinearForCausalLM(config).init_weights(args.seed).cast(_dtype(args.dtype))
    model.save_pretrained(args.path, progress=True)
    tok = byte_level_tokenizer()
    if len(tok) > config.vocab_size:
        print(f"error: preset vocabulary {config.vocab_size} < tokenizer {len(tok)}", file=sys.stderr)
        return 2
    tok.save_pretrained(args.path)
    print(f"wrote {args.path}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"{args.dtype}, byte-level tokenizer")
    return 0


# ---------------------------------------------------------------------------------------------------------- info
def cmd_info(args: argparse.Namespace) -> int:
    from kimi_linear.model.memory import cache_bytes, human_bytes, human_count, parameter_counts

    c = _config(args.source)
    counts = parameter_counts(c)
    kinds = ["KDA" if t == "linear_attention" else "MLA" for t in c.layer_types]
    ffn = ["MoE" if t == "sparse" else "dense" for t in c.mlp_layer_types]
    context = args.context if args.context is not None else c.max_position_embeddings
    cb = cache_bytes(c, context, _dtype(args.cache_dtype))
    print(f"model_type      kimi_linear ({args.source})")
    print(f"parameters      {human_count(counts['total'])} total, {human_count(counts['active'])} active per token "
          f"({c.num_experts_per_tok} of {c.num_local_experts} experts)")
    print(f"hidden / vocab  {c.hidden_size} / {c.vocab_size}; context {c.max_position_embeddings}")
    print(f"KDA             {c.linear_num_heads} heads x {c.linear_head_dim}, conv {c.linear_conv_kernel_dim}")
    print(f"MLA (NoPE)      {c.num_attention_heads} heads, latent {c.kv_lora_rank} + rope {c.qk_rope_head_dim}, "
          f"nope {c.qk_nope_head_dim}, v {c.v_head_dim}")
    print(f"layers          {c.num_hidden_layers}: {cb.kda_layers} KDA + {cb.mla_layers} MLA")
    for i, (a, f) in enumerate(zip(kinds, ffn)):
        print(f"  {i + 1:3d}  {a} + {f}")
    print(f"cache per sequence at {context} tokens (state float32, conv/latent {args.cache_dtype}):")
    print(f"  KDA state ({cb.kda_layers} layers, fixed)   {human_bytes(cb.kda_state):>12}")
    print(f"  MLA latent ({cb.mla_layers} layers, growing) {human_bytes(cb.mla_latent):>12}")
    print(f"  hybrid total                   {human_bytes(cb.hybrid):>12}")
    print(f"  all-MLA model, same shape      {human_bytes(cb.all_mla):>12}")
    print(f"  saving vs all-MLA              {100 * cb.saving:11.1f}%")
    return 0


# ------------------------------------------------------------------------------------------------------ generate
def default_model_dir_or_none() -> str | None:
    from kimi_linear.model.default import DefaultModelMissing, default_model_dir

    try:
        return default_model_dir()
    except DefaultModelMissing:
        return None


def generate_inputs(args: argparse.Namespace) -> tuple[str, str | None]:
    """(checkpoint directory, prompt or None for stdin) from ``generate``'s arguments.

    ``generate "PROMPT"`` and ``generate --model DIR "PROMPT"`` take the text as the prompt; the older form
    ``generate DIR [--prompt P]`` takes it as the checkpoint when it names a directory (or when --prompt is given as
    well). Without a directory the shipped default model is used (:mod:`kimi_linear.model.default`)."""
    from kimi_linear.model.default import resolve_model

    text = args.text
    if args.model is not None:
        if text is not None and args.prompt is not None:
            raise ValueError(f"two prompts: {text!r} and --prompt {args.prompt!r}; give one")
        return args.model, text if text is not None else args.prompt
    if text is not None and (os.path.isdir(text) or args.prompt is not None):
        return text, args.prompt                       # older form: generate DIR --prompt ...
    return resolve_model(None), text if text is not None else args.prompt


# Flags of `generate` under the names the shared sampling checks use.
_FLAGS = {"max_tokens": "--max-new-tokens", "temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k",
          "seed": "--seed"}


def sampling_params(args: argparse.Namespace):
    """``generate``'s sampling flags as the engine's SamplingParams, checked by the rules the server applies
    (a ValueError naming the flag)."""
    from kimi_linear.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    try:
        params.validate()
    except ValueError as e:
        msg = str(e)
        for name, flag in _FLAGS.items():
            msg = msg.replace(f"`{name}`", flag)
        raise ValueError(msg + ("; 0 = greedy" if "--temperature" in msg else "")) from None
    if args.threads < 0:
        raise ValueError(f"--threads must be >= 0 (0 = torch's choice), got {args.threads}")
    return params


def cmd_generate(args: argparse.Namespace) -> int:
    import torch
    from transformers import TextStreamer

    from kimi_linear import KimiLinearForCausalLM
    from kimi_linear.model import load_config
    from kimi_linear.model.tokenizer import load_tokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory only; never reach out
    params = sampling_params(args)
    path, prompt = generate_inputs(args)
    if not os.path.isdir(path):
        what = "is a file, not a checkpoint directory" if os.path.exists(path) else "does not exist"
        print(f"error: checkpoint directory {path!r} {what}", file=sys.stderr)
        return 2
    shipped = path == default_model_dir_or_none()
    load_config(path)                 # what is missing first: config.json, then the tokenizer, then the weights
    prompt = prompt if prompt is not None else sys.stdin.read()
    if not prompt:
        print("error: empty prompt (give --prompt or pipe text on stdin)", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    tok = load_tokenizer(path)
    model = KimiLinearForCausalLM.from_pretrained(path, dtype=args.dtype, progress=not shipped)
    if args.chat and getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True)
    else:
        text = prompt
    try:
        ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    except Exception as e:            # the tokenizers library raises bare Exceptions (e.g. a word not in a vocabulary)
        raise ValueError(f"{path}'s tokenizer cannot encode the prompt: {e}") from e
    T, limit = ids.shape[1], model.config.max_position_embeddings
    if T >= limit:
        raise ValueError(f"the prompt has {T} tokens and the model's context is {limit}: no room for new tokens")
    n = args.max_new_tokens
    if T + n > limit:
        # A warning, not an error: the request is clear and the context is a hard limit, so generate what fits.
        print(f"warning: --max-new-tokens {n} exceeds the context ({T} prompt tokens, context {limit}): "
              f"capped at {limit - T}", file=sys.stderr)
        n = limit - T
    streamer = None if args.no_stream else TextStreamer(tok, skip_prompt=True)
    sample = not params.is_greedy()
    eos = model.generation_config.eos_token_id if tok.eos_token_id is None else tok.eos_token_id
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=n, do_sample=sample, temperature=args.temperature if sample else 1.0,
                         top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                         eos_token_id=None if args.ignore_eos else eos, streamer=streamer)
    dt = time.perf_counter() - t0
    new = out.shape[1] - ids.shape[1]
    if args.no_stream:
        print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    print(f"[{ids.shape[1]} prompt + {new} new tokens in {dt:.2f} s]", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kimi-linear", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="{init,info,generate,train,serve}")

    g = sub.add_parser("generate", help="generate text (default: the small model shipped with the package)",
                       description="Generate a continuation of a prompt, streaming tokens. Greedy by default; "
                       "--temperature > 0 samples (with --top-p / --top-k, reproducible with --seed). Without "
                       "--model the small Kimi Linear model shipped with the package is used (trained on Python "
                       "source), offline: kimi-linear generate \"def fibonacci(n):\"",
                       epilog="The older form `kimi-linear generate DIR --prompt TEXT` still works: a first "
                       "argument naming an existing directory is the checkpoint.")
    g.add_argument("text", nargs="?", metavar="PROMPT",
                   help="the prompt (default: --prompt, else stdin); or a checkpoint directory (older form)")
    g.add_argument("--model", "-m", help="checkpoint directory (config.json, safetensors, tokenizer files); "
                   "default: the shipped model")
    g.add_argument("--prompt", "-p", help="prompt text (default: the PROMPT argument, else stdin)")
    g.add_argument("--max-new-tokens", "-n", type=int, default=64,
                   help="tokens to generate (default 64; capped, with a warning, at the model's context)")
    g.add_argument("--temperature", "-t", type=float, default=0.0,
                   help="0 = greedy (default); > 0 samples (in [0, 100]; below 0.01 greedy, as the server)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1 = off)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed")
    g.add_argument("--dtype", default="auto",
                   help="float32, bfloat16, float16 or auto (= the checkpoint's; float32 on CPU for 16-bit files)")
    g.add_argument("--threads", type=int, default=0, help="CPU threads (default: torch's choice)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    g.add_argument("--ignore-eos", action="store_true", help="keep going after the end-of-sequence token")
    g.add_argument("--no-stream", action="store_true", help="print the text once at the end")
    g.set_defaults(fn=cmd_generate)

    i = sub.add_parser("info", help="parameters, layer layout and cache bytes per sequence",
                       description="Show parameters, the KDA/MLA layer layout and the per-sequence cache at a "
                       "context length: fixed KDA state vs growing MLA latent vs an all-MLA model of the same "
                       "shape (docs/memory.md).")
    i.add_argument("source", help=PRESET_HELP)
    i.add_argument("--context", type=int, default=None, help="tokens per sequence (default: the model's context)")
    i.add_argument("--cache-dtype", default="bfloat16", help="dtype of the MLA latent and conv cache (default bf16)")
    i.set_defaults(fn=cmd_info)

    n = sub.add_parser("init", help="write a randomly initialised checkpoint of a preset, with a tokenizer",
                       description="Write a random checkpoint (config.json + safetensors) of a named preset and "
                       "a byte-level tokenizer beside it, so everything can be tried without downloads.")
    n.add_argument("path", help="output directory")
    n.add_argument("--preset", default="tiny", help="tiny (default), small, kimi-linear-48b, k3-tiny, kimi-k3")
    n.add_argument("--seed", type=int, default=0)
    n.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16")
    n.add_argument("--context", type=int, default=None, help="override the preset's context length")
    n.add_argument("--force", action="store_true", help="overwrite an existing checkpoint")
    n.set_defaults(fn=cmd_init)

    from kimi_linear.server.cli import add_serve_parser, run_serve
    from kimi_linear.train.cli import add_train_parser, run_train

    add_train_parser(sub).set_defaults(fn=run_train)
    add_serve_parser(sub).set_defaults(fn=run_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except BrokenPipeError:
        # The reader went away (`kimi-linear info ... | head`): stop quietly, as Unix tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (ValueError, TypeError, OSError, ImportError) as e:
        # One line, whatever the message holds: what is wrong and what to do, no traceback.
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
