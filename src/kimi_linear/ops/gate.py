"""The KDA forget gate and the other "in-kernel" input transforms (docs/kda.md §2), in PyTorch."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from .checks import check_gate_params

# fla's in-kernel l2norm epsilon: x / sqrt(sum(x^2) + eps).
L2NORM_EPS = 1e-6


def as_float32(x: torch.Tensor) -> torch.Tensor:
    """``x.float()`` without the call when x already is float32 (decode steps pay per call)."""
    return x if x.dtype == torch.float32 else x.float()


def fused_kda_gate(
    g: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    output_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Log-space per-channel decay from the raw gate projection (fla-core 0.6's signature), computed in float32
    and returned in ``output_dtype``.

    g: [..., HV, K] raw gate; A_log: HV values; dt_bias: HV*K values or None.
    Without ``lower_bound``:  ``-exp(A_log[h]) * softplus(g + dt_bias[h])``  (every entry <= 0).
    With ``lower_bound`` (K3: -5): ``lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h]))``, so one step
    decays by at most ``exp(lower_bound)``; ``A_log=None`` then means ``lower_bound * sigmoid(g + dt_bias[h])``.
    """
    if g.ndim < 2:
        raise ValueError(f"`g` must be [..., HV, K], got shape {tuple(g.shape)}")
    HV, K = g.shape[-2:]
    if A_log is None and lower_bound is not None:
        A_log = torch.zeros(HV, dtype=torch.float32, device=g.device)
    check_gate_params(HV, K, A_log, dt_bias, lower_bound)
    x = as_float32(g)
    if dt_bias is not None:
        x = x + as_float32(dt_bias).reshape(HV, K)
    a = as_float32(A_log).reshape(HV, 1).exp()
    out = -a * F.softplus(x) if lower_bound is None else lower_bound * torch.sigmoid(a * x)
    return out if output_dtype == torch.float32 else out.to(output_dtype)


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension, computed in float32 (fla's in-kernel l2norm)."""
    xf = as_float32(x)
    return xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)


@dataclass(frozen=True)
class KernelOptions:
    """The optional input transforms a fused KDA kernel performs before the recurrence (fla-core's names)."""

    use_qk_l2norm_in_kernel: bool = False
    use_gate_in_kernel: bool = False
    use_beta_sigmoid_in_kernel: bool = False
    allow_neg_eigval: bool = False
    A_log: torch.Tensor | None = None
    dt_bias: torch.Tensor | None = None
    lower_bound: float | None = None

    def __post_init__(self) -> None:
        if not self.use_gate_in_kernel and (
            self.A_log is not None or self.dt_bias is not None or self.lower_bound is not None
        ):
            raise ValueError("`A_log`, `dt_bias` and `lower_bound` only apply with `use_gate_in_kernel=True`")

    def kwargs(self) -> dict:
        """As keyword arguments of the public functions (how a backend receives them)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def apply(
        self, q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Transform (q, k, g, beta) in PyTorch, differentiably; transformed tensors come back in float32."""
        if self.use_qk_l2norm_in_kernel:
            q, k = l2norm(q), l2norm(k)
        if self.use_beta_sigmoid_in_kernel:
            beta = torch.sigmoid(beta.float()) * (2 if self.allow_neg_eigval else 1)
        if self.use_gate_in_kernel:
            g = fused_kda_gate(g, self.A_log, self.dt_bias, self.lower_bound)
        return q, k, g, beta
