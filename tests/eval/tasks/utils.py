"""Loaders for the two small local tasks: their JSONL files sit next to this file, so the tasks work from any
working directory (a YAML's `dataset_kwargs.data_files` would be read relative to the current one)."""

from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def _jsonl(name: str, **kwargs) -> datasets.DatasetDict:
    return datasets.load_dataset("json", data_files={"test": str(HERE / name)})


def toy_mc(**kwargs) -> datasets.DatasetDict:
    return _jsonl("kimi_linear_toy_mc.jsonl")


def toy_gen(**kwargs) -> datasets.DatasetDict:
    return _jsonl("kimi_linear_toy_gen.jsonl")
