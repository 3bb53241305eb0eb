"""The small model shipped inside the package (``kimi_linear/assets/default``): where it lives, and a clear error
when this installation does not carry it.

It is a Kimi Linear checkpoint like any other (``config.json``, safetensors shards, tokenizer files), trained by
``bench/train_default.py`` on the Python standard library's sources. ``kimi-linear generate`` and
``kimi-linear serve`` use it when no model directory is given.
"""

from __future__ import annotations

import os
from pathlib import Path

# Looked up at call time (not import time), so tests can point it at a temporary checkpoint.
ASSET_DIR = Path(__file__).resolve().parent.parent / "assets" / "default"
NAME = "kimi-linear-default"
REQUIRED = ("config.json", "tokenizer.json")


class DefaultModelMissing(FileNotFoundError):
    """The shipped default model is not installed (or incomplete)."""


def missing_files(path: str | os.PathLike) -> list[str]:
    """Files a checkpoint directory lacks to be loadable: config, tokenizer, and at least one safetensors file."""
    path = Path(path)
    missing = [f for f in REQUIRED if not (path / f).is_file()]
    if not path.is_dir() or not any(p.suffix == ".safetensors" for p in path.iterdir()):
        missing.append("*.safetensors")
    return missing


def default_model_dir() -> str:
    """The shipped default checkpoint's directory; raises :class:`DefaultModelMissing` (naming what is missing and
    how to pass a model instead) when it is not installed."""
    path = Path(ASSET_DIR)
    missing = missing_files(path)
    if missing:
        raise DefaultModelMissing(
            f"the default model is not installed ({', '.join(missing)} missing in {path}). Pass a checkpoint "
            "directory instead, e.g. `kimi-linear generate --model DIR \"def f(x):\"` or `kimi-linear serve DIR` "
            "(`kimi-linear init DIR` writes a random one; `kimi-linear train` or bench/train_default.py trains one)")
    return str(path)


def resolve_model(path: str | os.PathLike | None) -> str:
    """``path`` when given, else the shipped default's directory."""
    return default_model_dir() if path is None else os.fspath(path)
