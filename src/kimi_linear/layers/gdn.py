"""Gated DeltaNet: the KDA block with one scalar forget gate per head and step (the baseline KDA is compared with
in the Kimi Linear report). Everything else -- projections, short conv, beta, l2norm, output gate -- is shared."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .kda import KimiDeltaAttention
from .linear import Linear


class GatedDeltaNet(KimiDeltaAttention):
    """``g_t = -exp(A_log[h]) * softplus(f_b(f_a(x_t)) + dt_bias[h])``, one value per head, broadcast over the key
    channels. ``f_b_proj`` maps the rank-d gate projection to H scalars; ``dt_bias`` has one value per head."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, conv_size: int = 4, eps: float = 1e-5) -> None:
        super().__init__(hidden_size, num_heads, head_dim, conv_size, eps)
        self.f_b_proj = Linear(head_dim, num_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32))

    def gates(self, f_a: torch.Tensor, g_a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """The decay itself (no in-kernel gate options), broadcast [B, T, H, d], and KDA's output gate."""
        B, T, _ = f_a.shape
        raw = self.f_b_proj(f_a).float() + self.dt_bias                                    # [B, T, H]
        g = -self.A_log.view(self.num_heads).exp() * F.softplus(raw)
        return g.unsqueeze(-1).expand(B, T, self.num_heads, self.head_dim), self.output_gate(g_a), {}
