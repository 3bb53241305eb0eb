"""RMSNorm and the gated per-head RMSNorm of the KDA output (SPEC sections 3-4)."""

from __future__ import annotations

import torch
from torch import nn


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
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class GatedRMSNorm(nn.Module):
    """Per-head output norm of KDA: ``RMSNorm(o) * weight * sigmoid(gate)``, all in float32 (SPEC section 3, step 5).

    ``weight`` has one entry per channel of a head (``[d]``) and is shared by every head.
    """

    def __init__(self, head_dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.eps = eps

    def forward(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """o, gate: [..., H, d] -> [..., H, d] in o's dtype."""
        dtype = o.dtype
        of = o.float()
        of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.eps)
        of = of * self.weight.float() * torch.sigmoid(gate.float())
        return of.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
