"""Per-request sampling: greedy or temperature / top-k / top-p with the request's own seeded generator.

Temperatures below :data:`MIN_TEMPERATURE` sample greedily: dividing logits by 1e-38 overflows them to inf and the
softmax to NaN, and anything that small is greedy in effect. Non-finite logits raise :class:`SamplingError`, which
the engine turns into an error for that request alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kimi_linear.model.generation import sample_next

# Below this a temperature is treated as 0 (greedy). At 1e-2 logits of magnitude up to 1e36 stay finite in float32.
MIN_TEMPERATURE = 1e-2
# What torch.Generator.manual_seed accepts: any 64-bit integer, signed or unsigned.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
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
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 0:
            raise ValueError(f"`max_tokens` must be a non-negative integer, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature <= 100:
            raise ValueError(f"`temperature` must be a number in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"`top_p` must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"`top_k` must be an integer >= -1 (0 or -1 = off), got {self.top_k!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"`{name}` must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"`seed` must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("`stop` must be a non-empty string or a list of non-empty strings")
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
