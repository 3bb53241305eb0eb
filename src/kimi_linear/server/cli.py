"""``kimi-linear serve``: argument parsing and start-up (the lead wires these into the main CLI).

    kimi-linear serve ./tiny --port 8000 --max-num-seqs 16 --memory 2GiB [--api-key KEY]
    python -m kimi_linear.server ./tiny ...          # the same, without the main CLI
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .connections import guarded_h11, install_log_rate_limit


def add_serve_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory (config.json + safetensors + tokenizer); default: the small model "
                        "shipped with the package")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    s.add_argument("--served-model-name", default=None,
                   help="model id that responses carry and /v1/models lists first (default: the checkpoint "
                        "directory's name; `kimi-linear-default` for the shipped model). Requests may also name "
                        "the checkpoint directory's name or the path given")
    s.add_argument("--api-key", default=os.environ.get("KIMI_LINEAR_API_KEY"),
                   help="require `Authorization: Bearer KEY` on every route but /health "
                        "(default: $KIMI_LINEAR_API_KEY, else no key)")
    s.add_argument("--max-num-seqs", type=int, default=16, help="sequences running at once = KDA state slots")
    s.add_argument("--memory", default=None,
                   help="bytes for the cache pools, e.g. 2GiB (default: room for max-num-seqs full-context "
                        "sequences, at most 4 GiB of MLA blocks)")
    s.add_argument("--num-blocks", type=int, default=None, help="MLA latent blocks (overrides --memory)")
    s.add_argument("--block-size", type=int, default=None,
                   help="tokens per MLA block, the granularity of prefix sharing (default: 64 on a GPU, 16 on CPU)")
    s.add_argument("--prefill-chunk", type=int, default=None,
                   help="most prompt tokens of one request per step, a multiple of --block-size; also where KDA "
                        "states are snapshotted for prefix caching (default 64 on CPU, 2048 on a GPU)")
    s.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one engine step: decode rows plus prompt chunks, equal-length chunks "
                        "batched in one forward (default: --prefill-chunk on CPU, 32768 on a GPU)")
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
    add_limit_arguments(s)


def add_limit_arguments(s: argparse.ArgumentParser) -> None:
    """Limits against careless and hostile clients (defaults: :class:`kimi_linear.server.limits.ServerLimits`)."""
    from .limits import ServerLimits

    d = ServerLimits()
    g = s.add_argument_group("limits", "what one client may send and hold, and what all together may make the "
                                       "server hold (refusals are OpenAI error JSON)")
    g.add_argument("--max-body-bytes", default=str(d.max_body_bytes),
                   help=f"largest request body, e.g. 16MiB: 413 beyond (default {d.max_body_bytes // 2**20} MiB)")
    g.add_argument("--max-json-depth", type=int, default=d.max_json_depth,
                   help=f"deepest JSON nesting in a body, at most 512: 400 beyond (default {d.max_json_depth})")
    g.add_argument("--max-prompt-chars", type=int, default=None,
                   help="longest prompt string (or chat messages' text together), refused before tokenizing "
                        "(default: the context x the tokenizer's longest token, which no prompt that fits exceeds)")
    g.add_argument("--timeout-request-body", type=float, default=d.timeout_request_body,
                   help=f"seconds to receive a whole request body: 408 after (default {d.timeout_request_body:g})")
    g.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="open connections at most; at the cap a new one closes the oldest connection that holds no "
                        "request, or is answered 503 when all do (default "
                        f"{d.max_connections}, lowered to fit the open-file limit)")
    g.add_argument("--backlog", type=int, default=d.backlog,
                   help="the listening socket's queue, and the most connections accepted in one event-loop turn: "
                        "a flood holds up to --max-connections + 3 x this many descriptors until the cap closes its "
                        "sockets; smaller makes new clients wait for SYN retransmissions during a flood (default "
                        f"{d.backlog}, uvicorn's; the soft open-file limit is raised to fit both, or they are lowered)")
    g.add_argument("--timeout-request-head", type=float, default=d.timeout_request_head,
                   help="seconds a connection has to send a complete request head, however it trickles "
                        f"(default {d.timeout_request_head:g})")
    g.add_argument("--timeout-send", type=float, default=d.timeout_send,
                   help="seconds a client may read nothing of a pending response before its connection is cut "
                        f"(nginx's send_timeout; a slow reader that keeps reading is never cut) (default "
                        f"{d.timeout_send:g})")
    g.add_argument("--timeout-keep-alive", type=int, default=d.timeout_keep_alive,
                   help=f"uvicorn's: idle keep-alive seconds (default {d.timeout_keep_alive})")
    g.add_argument("--max-header-bytes", type=int, default=d.max_header_bytes,
                   help="uvicorn's h11_max_incomplete_event_size: bytes of a request head still incomplete, 400 beyond "
                        f"(default {d.max_header_bytes})")
    g.add_argument("--limit-concurrency", type=int, default=d.limit_concurrency,
                   help="uvicorn's: open connections + requests in progress beyond which requests get 503; counts "
                        "idle connections too (default: off, --max-connections bounds connections)")
    g.add_argument("--max-prompts-per-request", type=int, default=d.max_prompts_per_request,
                   help="most prompts in one /v1/completions request (`prompt` as a list): 400 beyond (default "
                        f"{d.max_prompts_per_request})")
    g.add_argument("--max-scored-prompt-tokens", type=int, default=d.max_scored_prompt_tokens,
                   help="prompt tokens one request may have scored (`echo` with `logprobs`), over all its prompts: "
                        f"400 beyond (default {d.max_scored_prompt_tokens})")
    g.add_argument("--max-pending-body-bytes", default=str(d.max_pending_body_bytes),
                   help="bytes of request bodies read and not yet parsed, all requests together, e.g. 256MiB: 503 "
                        f"server_overloaded beyond (default {d.max_pending_body_bytes // 2**20} MiB)")
    g.add_argument("--max-pending-tokens", type=int, default=None,
                   help="prompt tokens of all requests in progress together (each held as token lists until its "
                        "request ends): a request that would pass it gets 503 server_overloaded with Retry-After "
                        "(default: 4 x what the cache holds at once, at least 4,194,304)")
    g.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                   help="on SIGINT/SIGTERM, seconds running requests get to finish before they are aborted "
                        f"(streams end with an error event) (default {d.shutdown_timeout:g})")


def limits_from_args(args: argparse.Namespace) -> Any:
    """The server's limits from the parsed options, each checked (a bad one raises ValueError naming it)."""
    from kimi_linear.engine import parse_bytes

    from .limits import ServerLimits

    sizes = {}
    for name in ("max_body_bytes", "max_pending_body_bytes"):
        try:
            sizes[name] = parse_bytes(getattr(args, name))
        except ValueError:
            raise ValueError(f"`--{name.replace('_', '-')}` must be a size like 16MiB or 1000000, got "
                             f"{getattr(args, name)!r}") from None
    return ServerLimits(
        max_body_bytes=sizes["max_body_bytes"], max_pending_body_bytes=sizes["max_pending_body_bytes"],
        max_json_depth=args.max_json_depth,
        max_prompt_chars=args.max_prompt_chars, timeout_request_body=args.timeout_request_body,
        max_connections=args.max_connections, backlog=args.backlog, timeout_request_head=args.timeout_request_head,
        timeout_send=args.timeout_send,
        timeout_keep_alive=args.timeout_keep_alive, max_header_bytes=args.max_header_bytes,
        limit_concurrency=args.limit_concurrency, shutdown_timeout=args.shutdown_timeout,
        max_prompts_per_request=args.max_prompts_per_request, max_scored_prompt_tokens=args.max_scored_prompt_tokens,
        max_pending_tokens=args.max_pending_tokens,
    ).validate()


def fit_to_open_files(lim: Any) -> Any:
    """``lim`` with the connection cap and the backlog fitted to this process's open-file limit, whose soft value
    is raised towards the hard one first (:func:`.connections.fit_open_file_limit`): a step of starting the server,
    not of reading its options."""
    import dataclasses

    from .connections import fit_open_file_limit

    try:
        max_conn, backlog = fit_open_file_limit(lim.max_connections, lim.backlog)
    except ImportError:         # no `resource` module (Windows): the limits stand as given
        return lim
    return dataclasses.replace(lim, max_connections=max_conn, backlog=backlog)


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
    from .memory import cpu_16bit_without_onednn

    limits = fit_to_open_files(limits_from_args(args))
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
    if cpu_16bit_without_onednn(model):
        print(f"kimi-linear serve: {model.dtype} on a CPU: oneDNN off (its per-shape kernel cache grows by GBs over "
              "long generations); --dtype float32 is faster on most CPUs", file=sys.stderr, flush=True)
    tok = load_tokenizer(args.model)
    engine = LLMEngine(model, cfg, tok)
    engine.capture_cuda_graphs()      # before serving: no request waits for a capture
    loop = EngineLoop(engine)
    dir_name = os.path.basename(os.path.normpath(args.model))
    name = args.served_model_name or dir_name
    state = ServerState(loop, tok, name, aliases=(dir_name, args.model, os.path.normpath(args.model)), limits=limits)
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
        print(f"kimi-linear serve: {len(e.graphs.buckets)} CUDA graphs captured in {e.graphs.capture_seconds:.1f} s"
              + (f" (capture failed, decoding eagerly: {e.graphs.broken})" if e.graphs.broken else ""),
              file=sys.stderr, flush=True)
    state = app.state.kl
    lim = state.limits
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level,
        http=guarded_h11(lim.max_connections, lim.timeout_request_head, lim.timeout_send),
        limit_concurrency=lim.limit_concurrency, timeout_keep_alive=lim.timeout_keep_alive,
        h11_max_incomplete_event_size=lim.max_header_bytes, backlog=lim.backlog,
        # A backstop only: the app aborts what still runs after --shutdown-timeout, which ends every response.
        timeout_graceful_shutdown=int(lim.shutdown_timeout) + 10,
    )
    install_log_rate_limit()        # after uvicorn.Config, which (re)configures its loggers
    try:
        _make_server(config, on_exit=state.begin_shutdown).run()
    except KeyboardInterrupt:       # uvicorn re-raises the SIGINT it handled once it has shut down
        pass
    finally:
        loop.close()
    return 0


def _make_server(config: Any, on_exit: Any) -> Any:
    """uvicorn's server, telling the app (``on_exit``) the moment SIGINT / SIGTERM arrives: uvicorn itself only
    stops accepting connections and then waits for every response to end, however long."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if first:
                on_exit()

    return Server(config)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kimi_linear.server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_arguments(p)
    return run_serve(p.parse_args(argv))
