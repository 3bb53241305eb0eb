"""GLU activations: SiLU (Kimi Linear) and SiTU (Kimi K3, docs/model.md §7).

A GLU activation maps the two projections ``gate`` and ``up`` [..., I] to the product fed to the down projection.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .norm import upcast

GLU = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``SiLU(gate) * up`` in the input dtype (the Kimi Linear expert/MLP activation)."""
    return F.silu(gate) * up


@dataclass(frozen=True)
class SiTUGLU:
    """Kimi K3's SiTU GLU: ``gate' = b * tanh(gate / b) * sigmoid(gate)``, ``up' = b_lin * tanh(up / b_lin)``,
    ``out = gate' * up'``, computed in float32 (float64 for float64 inputs) and cast back to the input dtype.

    The two tanh soft-caps bound the product by ``b * b_lin`` (4 * 25 = 100 at the published values), which is
    what keeps the MXFP4-trained expert activations in range; near 0 SiTU behaves like SiLU-GLU.
    """

    beta: float = 4.0
    linear_beta: float = 25.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        g, u = upcast(gate), upcast(up)
        g = self.beta * torch.tanh(g / self.beta) * torch.sigmoid(g)
        u = self.linear_beta * torch.tanh(u / self.linear_beta)
        return (g * u).to(gate.dtype)


def make_glu(hidden_act: str = "silu", situ_beta: float = 4.0, situ_linear_beta: float = 25.0) -> GLU:
    """The GLU activation named by the config's ``hidden_act`` (``"silu"`` or ``"situ"``)."""
    if hidden_act == "silu":
        return silu_glu
    if hidden_act == "situ":
        return SiTUGLU(float(situ_beta), float(situ_linear_beta))
    raise ValueError(f"config field `hidden_act` must be 'silu' or 'situ', got {hidden_act!r}")
