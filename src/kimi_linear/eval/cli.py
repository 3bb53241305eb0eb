"""``python -m kimi_linear.eval``: lm-evaluation-harness on a checkpoint, in-process (a thin wrapper around
``lm_eval.simple_evaluate`` with the ``kimi_linear`` model class registered).

    python -m kimi_linear.eval --model DIR --tasks TASK [TASK ...] [--include_path DIR] [--batch_size 16]
    python -m kimi_linear.eval lm_eval --model kimi_linear --model_args pretrained=DIR --tasks ...

The second form is lm-eval's own command line (every option it has) with ``kimi_linear`` registered.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from . import INSTALL_HINT

# The package's own tasks (kimi_linear_stdlib_next_line), always on the task path.
OWN_TASKS = str(Path(__file__).resolve().parent / "tasks")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kimi_linear.eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="checkpoint directory (default: the small model shipped with the package)")
    p.add_argument("--tasks", nargs="+", required=True,
                   help="lm-eval task names (several, or comma-separated); local tasks need --include_path")
    p.add_argument("--include_path", default=None,
                   help="a directory of task YAML files to add to lm-eval's (the package's own tasks, e.g. "
                        "kimi_linear_stdlib_next_line, are always there)")
    p.add_argument("--batch_size", default="16",
                   help="requests handed to the engine at once, or `auto` (all of them) (default 16)")
    p.add_argument("--num_fewshot", type=int, default=None, help="few-shot examples (default: the task's)")
    p.add_argument("--limit", type=float, default=None, help="documents per task (a fraction when below 1)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto (default)")
    p.add_argument("--max_gen_toks", type=int, default=256, help="default generation length (default 256)")
    p.add_argument("--max_num_seqs", type=int, default=16, help="sequences the engine generates at once")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--output_path", default=None, help="write the results (JSON) to this file")
    p.add_argument("--log_samples", action="store_true", help="keep each document's answers in --output_path")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Evaluate; returns lm-eval's results dict."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from .lm import KimiLinearLM

    if args.threads < 0:
        raise ValueError(f"`--threads` must be >= 0, got {args.threads}")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    tasks = [t for arg in args.tasks for t in arg.split(",") if t]
    paths = [OWN_TASKS] + ([args.include_path] if args.include_path else [])
    # Indexing lm-eval's thousands of task files takes a while: skip it when the local paths have every task.
    manager = TaskManager(include_path=paths, include_defaults=False)
    if not all(t in manager.all_tasks for t in tasks):
        manager = TaskManager(include_path=paths)
    missing = [t for t in tasks if t not in manager.all_tasks]
    if missing:
        where = f" (searched lm-eval's tasks and {args.include_path})" if args.include_path else \
            " (a local task needs --include_path DIR)"
        raise ValueError(f"`--tasks`: unknown task {', '.join(map(repr, missing))}{where}")
    lm = KimiLinearLM(pretrained=args.model, dtype=args.dtype, device=args.device, batch_size=args.batch_size,
                      max_gen_toks=args.max_gen_toks, max_num_seqs=args.max_num_seqs)
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=args.num_fewshot, limit=args.limit,
                                   task_manager=manager, log_samples=args.log_samples)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if find_spec("lm_eval") is None:
        print(f"error: {INSTALL_HINT}", file=sys.stderr)
        return 2
    if argv[:1] == ["lm_eval"]:
        from lm_eval.__main__ import cli_evaluate

        from . import lm  # noqa: F401  (registers kimi_linear)

        sys.argv = ["lm_eval", *argv[1:]]
        cli_evaluate()
        return 0
    args = parse_args(argv)
    try:
        results = run(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from lm_eval.utils import make_table

    print(make_table(results))
    if args.output_path:
        from lm_eval.utils import handle_non_serializable

        with open(args.output_path, "w", encoding="utf-8") as f:
            json.dump({k: v for k, v in results.items() if k in ("results", "configs", "versions", "n-shot",
                                                                  "samples", "config")},
                      f, indent=2, default=handle_non_serializable)
    return 0
