"""Per-request sampling: greedy or temperature / top-k / top-p with the request's own seeded generator.

Temperatures below :data:`MIN_TEMPERATURE` sample greedily (see :mod:`kimi_linear.model.arg_checks`, whose checks
``generate`` shares). Non-finite logits raise :class:`SamplingError`, which the engine turns into an error for that
request alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kimi_linear.model.arg_checks import (
    MIN_TEMPERATURE,
    SEED_MAX,
    SEED_MIN,
    check_count,
    check_seed,
    check_stop_strings,
    check_temperature,
    check_top_k,
    check_top_p,
    is_int,
)
from kimi_linear.model.generation import sample_next

__all__ = ["MAX_LOGPROBS", "MIN_TEMPERATURE", "SEED_MAX", "SEED_MIN", "SamplingError", "SamplingParams",
           "make_generator", "sample", "token_logprobs"]

# Most alternatives per token a request may ask for (log-probs of the generated and of the prompt tokens).
MAX_LOGPROBS = 20


class SamplingError(ArithmeticError):
    """One request's logits or sampling went wrong (NaN / inf): that request ends with an error, not the batch."""


@dataclass
class SamplingParams:
    """What one request asks for. ``temperature == 0`` is greedy; ``logprobs`` = top alternatives per token
    (None: no log-probs); ``stop`` strings end the text (not included); ``ignore_eos`` keeps going after EOS;
    ``prompt_logprobs`` = top alternatives per prompt token, whose own log-probabilities (each given the tokens
    before it) come back in the request's first output (None: the prompt is not scored)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def validate(self) -> SamplingParams:
        check_count("max_tokens", self.max_tokens)
        check_temperature(self.temperature)
        check_top_p(self.top_p)
        check_top_k(self.top_k)
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"`{name}` must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        check_seed(self.seed)
        if not isinstance(self.stop, list):
            raise ValueError("`stop` must be a non-empty string or a list of non-empty strings")
        check_stop_strings(self.stop)
        return self

    def is_greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A private generator per request: a seeded request samples the same tokens whatever else is running."""
    if params.is_greedy():
        return None
    g = torch.Generator()
    if params.seed is not None:
        g.manual_seed(params.seed)
    else:
        g.seed()
    return g


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits [vocab] (float32) -> one token id. Raises :class:`SamplingError` for NaN logits, or for
    probabilities that are not finite after temperature and filtering."""
    if bool(torch.isnan(logits).any()):
        raise SamplingError("the model produced NaN logits")
    if params.is_greedy():
        return int(logits.argmax())
    top_k = params.top_k if params.top_k > 0 else 0
    try:
        return int(sample_next(logits[None], params.temperature, top_k, params.top_p, generator)[0])
    except RuntimeError as e:       # torch.multinomial: "probability tensor contains either inf, nan or element < 0"
        raise SamplingError(f"sampling failed: {e}") from e


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """Log-probability of ``token`` under the model's (untempered) distribution and the ``top`` best tokens."""
    lp = logits.float().log_softmax(-1)
    alts: list[tuple[int, float]] = []
    if top > 0:
        v, i = lp.topk(top)
        alts = [(int(a), float(b)) for a, b in zip(i, v)]
    return float(lp[token]), alts
