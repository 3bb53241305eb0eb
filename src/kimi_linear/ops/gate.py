"""The KDA forget gate and the other "in-kernel" input transforms of SPEC section 1, in PyTorch."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from .checks import check_gate_params


def fused_kda_gate(
    g: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """Log-space per-channel decay from the raw gate projection, in float32.

    g: [..., HV, K] raw gate; A_log: HV values; dt_bias: HV*K values or None.
    Without ``lower_bound``:  ``-exp(A_log[h]) * softplus(g + dt_bias[h])``  (every entry <= 0).
    With ``lower_bound`` (K3: -5): ``lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h]))``, so one step
    decays by at most ``exp(lower_bound)``.
    """
    if g.ndim < 2:
        raise ValueError(f"`g` must be [..., HV, K], got shape {tuple(g.shape)}")
    HV, K = g.shape[-2:]
    check_gate_params(HV, K, A_log, dt_bias, lower_bound)
    x = g.float()
    if dt_bias is not None:
        x = x + dt_bias.float().reshape(HV, K)
    a = A_log.float().reshape(HV, 1).exp()
    if lower_bound is None:
        return -a * F.softplus(x)
    return lower_bound * torch.sigmoid(a * x)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension, computed in float32 (fla's in-kernel l2norm)."""
    xf = x.float()
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
        elif self.A_log is not None or self.dt_bias is not None or self.lower_bound is not None:
            raise ValueError("`A_log`, `dt_bias` and `lower_bound` only apply with `use_gate_in_kernel=True`")
        return q, k, g, beta
