"""The KDA block's output norm (docs/model.md §3, step 5): per head, ``RMSNorm(o) * weight * sigmoid(gate)``, all in
float32, cast back to o's dtype. On CUDA tensors :func:`gated_rms_norm` runs the Triton kernels of
:mod:`kimi_linear.ops.triton.norm` (forward and backward); this is the PyTorch path and the reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import triton_op


def upcast(x: torch.Tensor) -> torch.Tensor:
    """x in float32, or float64 when it already is (so float64 reference runs stay float64 end to end; for
    float32 / bf16 / fp16 this is exactly ``x.float()``). A tensor that already is float32/64 comes back without
    a call: decoding pays a few microseconds per op, and norms run several times per layer."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def check_gated_rms_norm_inputs(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor) -> None:
    """A ValueError naming the argument whose shape or device does not fit."""
    if o.dim() < 2:
        raise ValueError(f"gated_rms_norm: o must be [..., H, d], got shape {tuple(o.shape)}")
    if gate.shape != o.shape:
        raise ValueError(f"gated_rms_norm: gate must have o's shape {tuple(o.shape)}, got {tuple(gate.shape)}")
    if weight.shape != o.shape[-1:]:
        raise ValueError(f"gated_rms_norm: weight must be [d={o.shape[-1]}], got shape {tuple(weight.shape)}")
    for name, t in (("gate", gate), ("weight", weight)):
        if t.device != o.device:
            raise ValueError(f"gated_rms_norm: {name} is on {t.device}, o on {o.device}")


def gated_rms_norm_torch(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`gated_rms_norm` in PyTorch."""
    of = upcast(o)
    y = F.rms_norm(of, (o.shape[-1],), weight.to(of.dtype), eps=eps) * torch.sigmoid(upcast(gate))
    return y if y.dtype == o.dtype else y.to(o.dtype)


def gated_rms_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``o / sqrt(mean(o^2) + eps) * weight * sigmoid(gate)`` over the last dim, in float32; o, gate: [..., d],
    weight: [d]. Returns o's shape and dtype; differentiable in all three."""
    check_gated_rms_norm_inputs(o, gate, weight)
    fast = triton_op("gated_rms_norm", o)
    return fast(o, gate, weight, eps) if fast is not None else gated_rms_norm_torch(o, gate, weight, eps)
