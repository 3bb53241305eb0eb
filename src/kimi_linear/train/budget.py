"""Training inside a wall-clock budget: stop gracefully when the time is up, with the schedule annealed in time.

:func:`fit_within` runs a :class:`~kimi_linear.train.trainer.Trainer` until ``config.steps`` optimizer steps or
``seconds`` of wall time, whichever comes first, evaluating every ``eval_every`` steps and once at the end, and
says which limit stopped it. While a time limit is set, the learning rate follows the trainer's own schedule at the
*further along* of two clocks: the step (``step / steps``) and the elapsed time (``elapsed / seconds``), so a run
cut short by time still decays (cosine or WSD) to its floor instead of stopping at the peak learning rate. Without
a time limit it is exactly ``Trainer.fit``'s schedule.

Time-annealed runs are not exactly resumable (the learning rate depends on the clock); use them for benchmarks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .schedule import lr_at
from .trainer import Trainer, evaluate


@dataclass
class BudgetResult:
    """What a budgeted run did: steps taken, why it stopped (``"steps"`` or ``"time"``), wall seconds of training
    (evaluation included), tokens seen, and one record per step (``Trainer.history``'s, with ``eval_*`` keys on
    evaluated steps)."""

    steps: int
    stopped_by: str
    seconds: float
    tokens: int
    history: list[dict] = field(repr=False)

    @property
    def evals(self) -> list[dict]:
        return [r for r in self.history if "eval_loss" in r]


class Clock:
    """Elapsed wall time against an optional budget of ``seconds`` (None: no limit)."""

    def __init__(self, seconds: float | None) -> None:
        if seconds is not None and not (isinstance(seconds, (int, float)) and seconds > 0 and math.isfinite(seconds)):
            raise ValueError(f"`seconds` must be a positive number or None, got {seconds!r}")
        self.seconds = seconds
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def fraction(self) -> float:
        """Share of the budget spent (0.0 without a budget)."""
        return 0.0 if self.seconds is None else self.elapsed() / self.seconds

    def expired(self) -> bool:
        return self.seconds is not None and self.elapsed() >= self.seconds


def annealed_lr(trainer: Trainer, clock: Clock) -> Callable[[int], float]:
    """The trainer's schedule evaluated at ``max(step, fraction_of_time * steps)`` after warmup (warmup itself is by
    step). Without a budget this is ``lr_at(step, ...)`` unchanged."""
    c = trainer.config

    def lr(step: int) -> float:
        at = step if step < c.warmup else max(step, int(clock.fraction() * c.steps))
        return lr_at(min(at, c.steps), peak=c.lr, total=c.steps, warmup=c.warmup, schedule=c.schedule,
                     min_ratio=c.min_lr_ratio, decay_fraction=c.decay_fraction)

    return lr


def fit_within(
    trainer: Trainer,
    seconds: float | None,
    *,
    eval_every: int | None = None,
    on_step: Callable[[dict, Clock], None] | None = None,
    on_eval: Callable[[dict, Clock], None] | None = None,
) -> BudgetResult:
    """Train until ``trainer.config.steps`` or ``seconds`` (None: no time limit); evaluate on the trainer's source
    every ``eval_every`` steps (0: only at the end; None: the trainer's ``config.eval_every``) and always after the
    last step. ``on_step(record, clock)`` after every step and ``on_eval(record, clock)`` after every evaluation
    (progress output, partial results).

    The time check happens between steps, so a run overshoots ``seconds`` by at most one step plus the final
    evaluation. Returns a :class:`BudgetResult`."""
    if eval_every is None:
        eval_every = trainer.config.eval_every
    if not isinstance(eval_every, int) or eval_every < 0:
        raise ValueError(f"`eval_every` must be an integer >= 0, got {eval_every!r}")
    clock = Clock(seconds)
    trainer.lr = annealed_lr(trainer, clock)            # instance attribute: train_step calls self.lr(step)
    steps, tokens, stopped_by = trainer.config.steps, 0, "steps"
    try:
        while trainer.step < steps:
            if clock.expired():
                stopped_by = "time"
                break
            rec = trainer.train_step()
            tokens += rec["tokens"]
            if on_step is not None:
                on_step(rec, clock)
            if eval_every and trainer.step % eval_every == 0 and trainer.step < steps:
                _evaluate_into(trainer, rec, clock, on_eval)
        if trainer.history and "eval_loss" not in trainer.history[-1]:
            _evaluate_into(trainer, trainer.history[-1], clock, on_eval)
    finally:
        del trainer.lr                                   # back to the class's step-only schedule
    return BudgetResult(steps=trainer.step, stopped_by=stopped_by, seconds=clock.elapsed(), tokens=tokens,
                        history=trainer.history)


def _evaluate_into(trainer: Trainer, rec: dict, clock: Clock, on_eval) -> None:
    rec.update({f"eval_{k}": v for k, v in evaluate(trainer.model, trainer.source, trainer.device).items()})
    rec["elapsed"] = clock.elapsed()
    if on_eval is not None:
        on_eval(rec, clock)

