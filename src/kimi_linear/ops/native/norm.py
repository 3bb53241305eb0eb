"""The residual stream's RMSNorm, and the residual add fused with it, for a decode step's few rows as one C call
(``rms_norm_f32`` / ``add_rms_norm_f32`` in ``decode.c``)."""

from __future__ import annotations

import torch

from . import cpu_float32_inference, library

# Above this many elements an op is not overhead-bound any more and PyTorch's (multi-threaded) op runs.
MAX_ELEMENTS = 1 << 14


def _applies(x: torch.Tensor, weight: torch.Tensor, *more: torch.Tensor) -> bool:
    ts = (x, weight, *more)
    return (0 < x.numel() <= MAX_ELEMENTS and cpu_float32_inference(*ts) and all(t.is_contiguous() for t in ts))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``F.rms_norm(x, weight)`` over the last dim for a small CPU float32 x, else None (use PyTorch)."""
    lib = library()
    if lib is None or not _applies(x, weight):
        return None
    n = x.shape[-1]
    y = torch.empty_like(x)
    lib.rms_norm_f32(x.data_ptr(), n, weight.data_ptr(), eps, x.numel() // n, n, y.data_ptr())
    return y


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(s, rms_norm(s))`` with ``s = x + delta`` for small CPU float32 tensors of one shape, else None."""
    lib = library()
    if lib is None or not _applies(x, weight, delta):
        return None
    n = x.shape[-1]
    s, y = torch.empty_like(x), torch.empty_like(x)
    lib.add_rms_norm_f32(x.data_ptr(), delta.data_ptr(), weight.data_ptr(), eps, x.numel() // n, n, s.data_ptr(),
                         y.data_ptr())
    return s, y
