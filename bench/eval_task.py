"""Build the lm-evaluation-harness task ``kimi_linear_stdlib_next_line``, and optionally score a model on it.

    python bench/eval_task.py                  # (re)write src/kimi_linear/eval/tasks/stdlib_next_line/*.jsonl
    python bench/eval_task.py --check          # the shipped JSONL equals what this interpreter's stdlib gives
    python -m kimi_linear.eval --tasks kimi_linear_stdlib_next_line           # the shipped model, in-process

The task (multiple choice, scored by log-likelihood: ``acc``, and ``acc_norm`` per byte): eight lines of a Python
standard-library file, then which of four lines comes next. The three wrong lines come from other files, with the
same indentation as the true line (so indentation alone does not tell), at least 12 characters, no comment lines,
no duplicates. Chance is 25%.

The files are the standard library's held-out split of ``kimi_linear.train.corpus.split_files`` (the CRC of a file's
name, 1 name in 20), which ``bench/train_default.py`` never trains on: the shipped model has not seen them (it was
trained on Python 3.12's sources; the held-out split is by file name, so the same names are held out in every
version). Left out as well: test suites (``test``, ``tests``, ``idle_test`` directories) and the ``encodings``
code-page tables. The JSONL shipped with the package was made from Python 3.11.7's standard library from these 27
files:

    asyncio/runners.py, copy.py, ctypes/_aix.py, ctypes/wintypes.py, doctest.py, email/_header_value_parser.py,
    glob.py, hmac.py, idlelib/colorizer.py, idlelib/parenmatch.py, lib2to3/fixes/fix_except.py,
    lib2to3/fixes/fix_getcwdu.py, modulefinder.py, multiprocessing/heap.py, multiprocessing/sharedctypes.py,
    re/_compiler.py, re/_parser.py, sched.py, shutil.py, site.py, sndhdr.py, ssl.py, symtable.py, tomllib/_parser.py,
    turtledemo/forest.py, uu.py, xml/dom/minidom.py

(every document names its file and line). Everything is drawn with ``random.Random(SEED)`` from the sorted file
list, so the same standard library gives the same JSONL.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from kimi_linear.train.corpus import split_files, stdlib_files  # noqa: E402

OUT = REPO / "src" / "kimi_linear" / "eval" / "tasks" / "stdlib_next_line" / "kimi_linear_stdlib_next_line.jsonl"
SEED = 0
CONTEXT_LINES = 8
MIN_CHARS = 12
PER_FILE = 30            # most documents from one file (a few large files would otherwise dominate)
DOCS = 400
SKIP_DIRS = {"test", "tests", "idle_test", "encodings"}


def held_out_files() -> list[Path]:
    """The held-out stdlib files the task is built from (sorted by path)."""
    _, held = split_files(stdlib_files())
    root = Path(sysconfig.get_paths()["stdlib"])
    return [f for f in held if not SKIP_DIRS & set(f.relative_to(root).parts[:-1])]


def indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def answerable(line: str) -> bool:
    """A line worth predicting (and worth offering as a wrong answer)."""
    s = line.strip()
    return len(s) >= MIN_CHARS and not s.startswith("#")


def build(files: list[Path], root: Path) -> list[dict]:
    rng = random.Random(SEED)
    lines = {f: f.read_text(encoding="utf-8", errors="replace").splitlines() for f in files}
    # Wrong answers: every answerable line of every file, by indentation.
    pool: dict[str, list[tuple[Path, str]]] = {}
    for f, ls in lines.items():
        for ln in dict.fromkeys(ls):
            if answerable(ln):
                pool.setdefault(indent(ln), []).append((f, ln.rstrip()))
    picks = []
    for f in files:
        ls = lines[f]
        spots = [i for i in range(CONTEXT_LINES, len(ls))
                 if answerable(ls[i]) and sum(1 for g, _ in pool.get(indent(ls[i]), []) if g != f) >= 3]
        picks += [(f, i) for i in sorted(rng.sample(spots, min(PER_FILE, len(spots))))]
    picks = sorted(rng.sample(picks, min(DOCS, len(picks))), key=lambda p: (str(p[0]), p[1]))
    docs = []
    for f, i in picks:
        ls = lines[f]
        true = ls[i].rstrip()
        others = sorted({ln for g, ln in pool[indent(true)] if g != f and ln != true})
        wrong = rng.sample(others, 3)
        choices = [true, *wrong]
        rng.shuffle(choices)
        docs.append({"file": str(f.relative_to(root)), "line": i + 1,
                     "context": "\n".join(ln.rstrip() for ln in ls[i - CONTEXT_LINES : i]) + "\n",
                     "choices": choices, "label": choices.index(true)})
    return docs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(OUT), help="JSONL to write (default: the task shipped in the package)")
    p.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    a = p.parse_args(argv)
    root = Path(sysconfig.get_paths()["stdlib"])
    files = held_out_files()
    docs = build(files, root)
    text = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs)
    used = sorted({d["file"] for d in docs})
    print(f"{len(docs)} documents from {len(used)} held-out files of {root} (Python {sys.version.split()[0]}): "
          + ", ".join(used), file=sys.stderr)
    if a.check:
        same = Path(a.out).read_text(encoding="utf-8") == text
        print("same as " + a.out if same else f"differs from {a.out}", file=sys.stderr)
        return 0 if same else 1
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text, encoding="utf-8")
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
