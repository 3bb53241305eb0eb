"""Load balancing of sigmoid-routed experts through the router's correction bias (no auxiliary loss).

Routing picks the top-k experts of ``s + b`` (scores s, bias b). Two update rules for b, applied after each
optimizer step from the scores the step's tokens produced:

- ``sign`` (DeepSeek-V3's auxiliary-loss-free rule): ``b_e += rate * sign(mean load - load_e)``. A fixed step, so it
  needs many steps to move and then oscillates around the balance point by about ``rate``.
- ``quantile`` (Kimi K3): set ``b_e`` directly to the bias that would let expert e win exactly its share k/E of the
  tokens. For token t, e enters the top-k iff ``s_te + b_e`` beats the k-th largest biased score among the *other*
  experts, i.e. iff ``b_e >= margin_te = kth_others_t - s_te``. So the k/E quantile of ``margin_e`` over the
  batch is that bias. All experts move at once (and each move shifts the others' cut-offs), so the new value is
  blended in with ``damping`` and converges in a few steps.
"""

from __future__ import annotations

import torch

RULES = ("sign", "quantile")


def expert_load(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """Tokens routed to each expert: scores [N, E], bias [E] -> counts [E] (float)."""
    idx = (scores + bias).topk(k, dim=-1)[1]
    return torch.bincount(idx.flatten(), minlength=scores.shape[-1]).float()


def imbalance(load: torch.Tensor) -> float:
    """max / mean expert load (1.0 is perfect balance)."""
    return (load.max() / load.mean().clamp_min(1e-12)).item()


def sign_update(bias: torch.Tensor, scores: torch.Tensor, k: int, rate: float = 1e-3) -> torch.Tensor:
    load = expert_load(scores, bias, k)
    return bias + rate * torch.sign(load.mean() - load)


def quantile_update(bias: torch.Tensor, scores: torch.Tensor, k: int, damping: float = 0.5) -> torch.Tensor:
    N, E = scores.shape
    biased = scores + bias
    top = biased.topk(min(k + 1, E), dim=-1)[0]                                  # [N, k+1]
    kth, kth_next = top[:, k - 1:k], top[:, k:k + 1] if k < E else top[:, k - 1:k]
    # The k-th largest among the others: if e itself is in the top-k, one place further down.
    in_top = biased >= kth
    kth_others = torch.where(in_top, kth_next, kth)                              # [N, E]
    margin = kth_others - scores                                                 # bias e needs to win token t
    target = torch.quantile(margin.float(), k / E, dim=0)                        # P(margin <= b_e) = k/E
    return bias + damping * (target - bias)


def update_bias(rule: str, bias: torch.Tensor, scores: torch.Tensor, k: int, **kw) -> torch.Tensor:
    if rule not in RULES:
        raise ValueError(f"unknown balancing rule {rule!r}; choose one of {RULES}")
    return (sign_update if rule == "sign" else quantile_update)(bias, scores, k, **kw)


def router_stress_test(rule: str, steps: int = 200, tokens: int = 4096, experts: int = 64, k: int = 8,
                       dim: int = 32, skew: float = 2.0, seed: int = 0, **kw) -> list[float]:
    """A synthetic router with strongly skewed expert preferences (logit offsets ~ N(0, skew)) and a drifting token
    distribution; returns max/mean load after each update, measured on a fresh batch."""
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(dim, experts, generator=gen) / dim ** 0.5
    offset = skew * torch.randn(experts, generator=gen)
    drift = torch.randn(dim, generator=gen)
    bias = torch.zeros(experts)

    def batch(step: int) -> torch.Tensor:
        x = torch.randn(tokens, dim, generator=gen) + 0.5 * drift * (step / steps)
        return torch.sigmoid(x @ W + offset)

    history = []
    for step in range(steps):
        bias = update_bias(rule, bias, batch(step), k, **kw)
        history.append(imbalance(expert_load(batch(step), bias, k)))
    return history
