"""Which implementation runs an op: the Triton kernels on CUDA tensors when present, else PyTorch.

``KIMI_LINEAR_BACKEND=torch`` forces the PyTorch path everywhere (debugging, or to compare the two).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

import torch


def triton_op(name: str, x: torch.Tensor) -> Callable | None:
    """The Triton implementation of ``name`` from :mod:`kimi_linear.ops.triton` if ``x`` lives on a CUDA
    device, Triton imports, and that module provides it; otherwise None (use PyTorch)."""
    if not x.is_cuda or os.environ.get("KIMI_LINEAR_BACKEND", "").lower() == "torch":
        return None
    try:
        module = importlib.import_module("kimi_linear.ops.triton")
    except ImportError:
        return None
    return getattr(module, name, None)
