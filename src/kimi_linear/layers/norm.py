"""RMSNorm and the gated per-head RMSNorm of the KDA output (docs/model.md §1, §3)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kimi_linear.ops.norm import gated_rms_norm, upcast

__all__ = ["GatedRMSNorm", "RMSNorm", "upcast"]


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim.

    The normalisation runs in float32 and is cast back to the input dtype *before* the weight multiply, which is
    what the published checkpoints were trained with (and what transformers does), so bf16 logits match.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., hidden_size] -> same shape and dtype."""
        # F.rms_norm is the same formula (x * rsqrt(mean(x^2) + eps)) in one fused op: decoding is dominated by
        # per-op overhead, and a norm runs twice per layer. When nothing is cast, the weight goes in too.
        if x.dtype == self.weight.dtype and x.dtype in (torch.float32, torch.float64):
            return F.rms_norm(x, (x.shape[-1],), self.weight, eps=self.eps)
        return self.weight * F.rms_norm(upcast(x), (x.shape[-1],), eps=self.eps).to(x.dtype)

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
