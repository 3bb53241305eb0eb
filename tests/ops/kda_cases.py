"""Random KDA inputs and comparison helpers shared by the operator tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Norm of the difference over norm of the reference, in float64.

    A reference that is exactly zero (e.g. the gradient of an initial state erased by g = -1000 at step 0) is
    compared in absolute terms against a floor of 1e-20: our decay factors bottom out at exp(-80) ~ 1e-35, not 0.
    """
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-20)).item()


def make_inputs(
    B: int = 2,
    T: int = 100,
    H: int = 2,
    HV: int | None = None,
    K: int = 32,
    V: int = 16,
    *,
    N: int | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    raw: bool = False,
    strong_decay: bool = False,
    initial_state: bool = True,
) -> dict[str, torch.Tensor | None]:
    """Fresh random inputs (never zeros) in the layout of docs/kda.md §3.

    ``raw``: q, k unnormalised, g the raw gate projection and beta logits (for the in-kernel options); otherwise
    unit-norm k, log-sigmoid decays and betas in (0, 1). ``strong_decay`` sets every 7th step's gate to -1000 and
    every 5th to exactly 0 on top. ``N`` is the number of states (default B).
    """
    HV = HV or H
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)
    q, k, v = rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, HV, V)
    g, beta = rnd(B, T, HV, K), rnd(B, T, HV)
    if not raw:
        k = F.normalize(k, dim=-1)
        g = F.logsigmoid(2 * g)
        beta = torch.sigmoid(beta)
        if strong_decay:
            g[:, ::7] = -1000.0
            g[:, 3::5] = 0.0
    h0 = rnd(N or B, HV, K, V).float() if initial_state else None
    out = {n: x.to(dtype) for n, x in dict(q=q, k=k, v=v, g=g, beta=beta).items()}
    out["initial_state"] = h0
    return out


def as_reference(inputs: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    """The same values in float64, detached leaves that require grad (for autograd through the reference)."""
    return {n: None if x is None else x.detach().double().requires_grad_() for n, x in inputs.items()}


def as_leaves(inputs: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
    return {n: None if x is None else x.detach().clone().requires_grad_() for n, x in inputs.items()}


def loss_weights(shape: torch.Size, seed: int = 1) -> torch.Tensor:
    """A fixed random cotangent so every output element matters to the gradient."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
