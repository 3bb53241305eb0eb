"""RMSNorm and the gated per-head RMSNorm of the KDA output (docs/model.md §1, §3)."""

from __future__ import annotations

from typing import overload

import torch
from torch import nn

from kimi_linear.ops.norm import gated_rms_norm, upcast
from kimi_linear.ops.rms_norm import add_rms_norm, rms_norm

__all__ = ["GatedRMSNorm", "RMSNorm", "upcast"]


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim.

    The normalisation runs in float32 and is cast back to the input dtype *before* the weight multiply, which is
    what the published checkpoints were trained with (and what transformers does), so bf16 logits match.
    (:func:`kimi_linear.ops.rms_norm.rms_norm`: one Triton kernel on CUDA when no gradient is needed.)
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x: [..., hidden_size] -> same shape and dtype.

        With ``residual`` (x's shape): the residual add fused in front, ``s = residual + x``; returns
        ``(norm(s), s)`` (:func:`kimi_linear.ops.rms_norm.add_rms_norm`, one kernel instead of an add and a norm).
        """
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        s, y = add_rms_norm(residual, x, self.weight, self.eps)
        return y, s

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class GatedRMSNorm(nn.Module):
    """Per-head output norm of KDA: ``RMSNorm(o) * weight * sigmoid(gate)``, all in float32 (docs/model.md §3, step 5).

    ``weight`` has one entry per channel of a head (``[d]``) and is shared by every head.
    """

    def __init__(self, head_dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.eps = eps

    def forward(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """o, gate: [..., H, d] -> [..., H, d] in o's dtype (:func:`kimi_linear.ops.norm.gated_rms_norm`, Triton
        on CUDA)."""
        return gated_rms_norm(o, gate, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
