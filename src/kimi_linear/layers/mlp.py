"""Dense SwiGLU feed-forward (the FFN of the first ``first_k_dense_replace`` layers, and the MoE shared expert)."""

from __future__ import annotations

import torch
from torch import nn

from ..ops.native.moe import glu_mlp
from .activation import GLU, silu_glu
from .linear import Linear
from .packing import PackedLinears


class SwiGLUMLP(nn.Module):
    """``down_proj(SiLU(gate_proj(x)) * up_proj(x))``; checkpoint names ``{gate,up,down}_proj.weight``.

    glu: the GLU activation (default SiLU; K3 uses :class:`~kimi_linear.layers.activation.SiTUGLU`)."""

    def __init__(self, hidden_size: int, intermediate_size: int, glu: GLU = silu_glu) -> None:
        super().__init__()
        self.glu = glu
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self._pack: PackedLinears | None = None

    def pack(self) -> None:
        """Pack gate_proj and up_proj (both read x) into one matrix; see ``PackedLinears``. Nothing to do while they
        are packed already (e.g. as the shared expert stacked with the routed ones by ``SparseMoE.pack``)."""
        if self._pack is None or not self._pack.intact():
            self._pack = PackedLinears([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., hidden] -> [..., hidden]."""
        if self._pack is not None:
            if x.device.type == "cpu" and self.glu is silu_glu and self._pack.valid():
                # a CPU decode step's rows: one C call (kimi_linear.ops.native.moe.glu_mlp), None where it cannot run
                out = glu_mlp(x.reshape(-1, x.shape[-1]), self._pack.weight, self.down_proj.weight)
                if out is not None:
                    return out.view(x.shape)
            gate, up = self._pack(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.glu(gate, up))
