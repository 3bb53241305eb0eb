"""``kimi-linear serve``: argument parsing and start-up (the lead wires these into the main CLI).

    kimi-linear serve ./tiny --port 8000 --max-num-seqs 16 --memory 2GiB [--api-key KEY]
    python -m kimi_linear.server ./tiny ...          # the same, without the main CLI
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


def add_serve_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory (config.json + safetensors + tokenizer); default: the small model "
                        "shipped with the package")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    s.add_argument("--served-model-name", default=None,
                   help="model id clients send (default: the checkpoint directory's name; its path also works)")
    s.add_argument("--api-key", default=os.environ.get("KIMI_LINEAR_API_KEY"),
                   help="require `Authorization: Bearer KEY` on every route but /health "
                        "(default: $KIMI_LINEAR_API_KEY, else no key)")
    s.add_argument("--max-num-seqs", type=int, default=16, help="sequences running at once = KDA state slots")
    s.add_argument("--memory", default=None,
                   help="bytes for the cache pools, e.g. 2GiB (default: room for max-num-seqs full-context "
                        "sequences, at most 4 GiB of MLA blocks)")
    s.add_argument("--num-blocks", type=int, default=None, help="MLA latent blocks (overrides --memory)")
    s.add_argument("--block-size", type=int, default=16, help="tokens per MLA block (default 16)")
    s.add_argument("--prefill-chunk", type=int, default=None,
                   help="most prompt tokens of one request per step, a multiple of --block-size; also where KDA "
                        "states are snapshotted for prefix caching (default 64 on CPU, 2048 on a GPU)")
    s.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one engine step: decode rows plus prompt chunks, equal-length chunks "
                        "batched in one forward (default: --prefill-chunk on CPU, 8192 on a GPU)")
    s.add_argument("--num-snapshots", type=int, default=None, help="KDA prefix snapshots (default 4 x seqs)")
    s.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    s.add_argument("--dtype", default="auto",
                   help="float32, bfloat16, float16 or auto (= the checkpoint's; float32 on CPU for 16-bit files)")
    s.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (= cuda when available, else cpu)")
    s.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay batched decode steps as CUDA graphs, one per batch bucket, any context length "
                        "(default: on for a CUDA device)")
    s.add_argument("--threads", type=int, default=0,
                   help="CPU threads for torch (default: torch's choice minus one, leaving a core for HTTP)")
    s.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``serve`` sub-command to a main parser's subparsers."""
    s = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching",
                              description="Serve a checkpoint over an OpenAI-compatible API (/v1/completions, "
                              "/v1/chat/completions, /v1/models, /health, /metrics).")
    add_serve_arguments(s)
    s.set_defaults(fn=run_serve)
    return s


def build_server(args: argparse.Namespace) -> Any:
    """Load the model and tokenizer, build the engine, its thread and the app. Returns (app, engine loop)."""
    import torch

    from kimi_linear.engine import EngineConfig, LLMEngine, parse_bytes
    from kimi_linear.engine.background import EngineLoop
    from kimi_linear.model import KimiLinearForCausalLM
    from kimi_linear.model.default import NAME, resolve_model
    from kimi_linear.model.tokenizer import load_tokenizer

    from .app import ServerState, create_app

    if args.model is None:
        args.model = resolve_model(None)
        args.served_model_name = args.served_model_name or NAME
    # The HTTP event loop needs a core too: on CPU, torch's default (all cores) makes the two fight.
    torch.set_num_threads(args.threads or max(1, torch.get_num_threads() - 1))
    cfg = EngineConfig(
        max_num_seqs=args.max_num_seqs, memory=parse_bytes(args.memory) if args.memory else None,
        num_blocks=args.num_blocks, block_size=args.block_size, prefill_chunk=args.prefill_chunk,
        prefix_caching=not args.no_prefix_caching, num_snapshots=args.num_snapshots,
        cuda_graphs=args.cuda_graphs, max_num_batched_tokens=args.max_num_batched_tokens,
    ).validate()
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    model = KimiLinearForCausalLM.from_pretrained(args.model, dtype=args.dtype, device=device)
    tok = load_tokenizer(args.model)
    engine = LLMEngine(model, cfg, tok)
    engine.capture_cuda_graphs()      # before serving: no request waits for a capture
    loop = EngineLoop(engine)
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    state = ServerState(loop, tok, name, aliases=(args.model, os.path.normpath(args.model)))
    return create_app(state, api_key=args.api_key), loop


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    try:
        app, loop = build_server(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    e = loop.engine
    b = e.allocated_bytes()
    print(f"kimi-linear serve: {args.model} on http://{args.host}:{args.port}/v1  "
          f"({e.cfg.max_num_seqs} KDA slots {b['kda_slots'] / 2**20:.1f} MiB, {e.blocks.num_blocks} MLA blocks x "
          f"{e.cfg.block_size} tokens {b['mla_blocks'] / 2**20:.1f} MiB, snapshots {b['kda_snapshots'] / 2**20:.1f} "
          f"MiB){'  [api key required]' if args.api_key else ''}", file=sys.stderr, flush=True)
    if e.graphs is not None and e.graphs.capture:
        print(f"kimi-linear serve: {len(e.graphs.steps)} CUDA graphs captured in {e.graphs.capture_seconds:.1f} s"
              + (f" (capture failed, decoding eagerly: {e.graphs.broken})" if e.graphs.broken else ""),
              file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        loop.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kimi_linear.server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_arguments(p)
    return run_serve(p.parse_args(argv))
