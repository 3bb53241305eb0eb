"""The task's documents: the JSONL next to this file (written by bench/eval_task.py)."""

from pathlib import Path

import datasets

DATA = Path(__file__).resolve().parent / "kimi_linear_stdlib_next_line.jsonl"


def load(**kwargs) -> datasets.DatasetDict:
    return datasets.load_dataset("json", data_files={"test": str(DATA)})
