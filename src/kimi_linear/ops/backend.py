"""Which implementation runs an op: the Triton kernels on CUDA tensors when present, else PyTorch.

``KIMI_LINEAR_BACKEND=torch`` forces the PyTorch path everywhere (debugging, or to compare the two).
``KIMI_LINEAR_BACKEND=triton`` with ``TRITON_INTERPRET=1`` also sends CPU tensors to the Triton kernels, run by
Triton's interpreter: the GPU path's arithmetic checked on a machine without a GPU (slow; tests and debugging).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

import torch


def triton_op(name: str, x: torch.Tensor) -> Callable | None:
    """The Triton implementation of ``name`` from :mod:`kimi_linear.ops.triton` if ``x`` lives on a CUDA
    device (or the interpreter is asked for, module docstring), Triton imports, and that module provides it;
    otherwise None (use PyTorch)."""
    choice = os.environ.get("KIMI_LINEAR_BACKEND", "").lower()
    interpreted = choice == "triton" and os.environ.get("TRITON_INTERPRET") == "1"
    if choice == "torch" or not (x.is_cuda or interpreted):
        return None
    try:
        module = importlib.import_module("kimi_linear.ops.triton")
    except ImportError:
        return None
    return getattr(module, name, None)


KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def for_inference(fast: Callable | None, *tensors: torch.Tensor,
                  dtypes: tuple[torch.dtype, ...] = KERNEL_DTYPES) -> Callable | None:
    """``fast`` (a :func:`triton_op` lookup, done first: it answers None for a CPU tensor at once, and CPU decoding
    pays per check) when kernels without a backward that compute in float32 may run: ``tensors[0]`` non-empty,
    every tensor's dtype in ``dtypes``, no gradient tracked through any of them (training keeps the PyTorch path);
    else None."""
    if fast is None or tensors[0].numel() == 0 or any(t.dtype not in dtypes for t in tensors):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    return fast
