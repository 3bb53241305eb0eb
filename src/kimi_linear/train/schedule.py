"""Learning-rate schedules as pure functions of the step (so a resumed run needs no scheduler state)."""

from __future__ import annotations

import math

SCHEDULES = ("cosine", "wsd", "constant")


def lr_at(step: int, *, peak: float, total: int, warmup: int, schedule: str = "cosine", min_ratio: float = 0.1,
          decay_fraction: float = 0.2) -> float:
    """Learning rate for optimizer step ``step`` (0-based).

    Linear warmup over ``warmup`` steps to ``peak``, then
    - ``cosine``: cosine decay to ``min_ratio * peak`` at ``total``;
    - ``wsd`` (warmup-stable-decay): flat at ``peak``, then linear decay to ``min_ratio * peak`` over the last
      ``decay_fraction`` of the steps;
    - ``constant``: flat.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {SCHEDULES}")
    if step < warmup:
        return peak * (step + 1) / warmup
    floor = peak * min_ratio
    if schedule == "constant" or total <= warmup:
        return peak
    if schedule == "cosine":
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_start = total - int(decay_fraction * total)
    if step < decay_start:
        return peak
    progress = min(1.0, (step - decay_start) / max(1, total - decay_start))
    return peak + (floor - peak) * progress
