"""Checks of the arguments that decide generated tokens, shared by ``generate`` and the engine's ``SamplingParams``
(and so by the server and the CLI): one rule per argument, one ``ValueError`` that names it.

Temperatures below :data:`MIN_TEMPERATURE` sample greedily: dividing logits by 1e-38 overflows them to inf and the
softmax to NaN, and anything that small is greedy in effect.
"""

from __future__ import annotations

import math
from typing import Any

# Below this a temperature is treated as 0 (greedy). At 1e-2 logits of magnitude up to 1e36 stay finite in float32.
MIN_TEMPERATURE = 1e-2
# The largest temperature accepted: far above any useful value, and a typo (1000 for 1.0) is caught.
MAX_TEMPERATURE = 100
# What torch.Generator.manual_seed accepts: any 64-bit integer, signed or unsigned.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


def is_int(value: Any) -> bool:
    """An ``int`` that is not a ``bool`` (``True`` is an int to Python, never a count or an id here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """A finite int or float (no bool, NaN or inf)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_count(name: str, value: Any, minimum: int = 0) -> int:
    """An integer >= ``minimum`` (token counts and lengths)."""
    if not is_int(value) or value < minimum:
        what = "non-negative" if minimum == 0 else ("positive" if minimum == 1 else f">= {minimum}")
        raise ValueError(f"`{name}` must be a {what} integer, got {value!r}")
    return value


def check_temperature(value: Any, name: str = "temperature") -> float:
    """A number in [0, MAX_TEMPERATURE]; 0 (and anything below MIN_TEMPERATURE) is greedy."""
    if not is_real(value) or not 0 <= value <= MAX_TEMPERATURE:
        raise ValueError(f"`{name}` must be a number in [0, {MAX_TEMPERATURE}], got {value!r}")
    return float(value)


def check_top_p(value: Any, name: str = "top_p") -> float:
    if not is_real(value) or not 0 < value <= 1:
        raise ValueError(f"`{name}` must be in (0, 1], got {value!r}")
    return float(value)


def check_top_k(value: Any, name: str = "top_k") -> int:
    """An integer >= -1; 0 and -1 both mean no top-k filtering (transformers says 0, vLLM -1)."""
    if not is_int(value) or value < -1:
        raise ValueError(f"`{name}` must be an integer >= -1 (0 or -1 = off), got {value!r}")
    return value


def check_seed(value: Any, name: str = "seed") -> int | None:
    if value is not None and (not is_int(value) or not SEED_MIN <= value <= SEED_MAX):
        raise ValueError(f"`{name}` must be an integer in [-2**63, 2**64 - 1], got {value!r}")
    return value


def check_penalty(value: Any, name: str = "repetition_penalty") -> float:
    """A finite number > 0 (1 = off): logits of seen tokens are divided by it (multiplied when negative)."""
    if not is_real(value) or not value > 0:
        raise ValueError(f"`{name}` must be a number > 0 (1 = off), got {value!r}")
    return float(value)


def check_stop_strings(value: Any, name: str = "stop") -> list[str]:
    """A non-empty string or a list of them -> the list (None -> [])."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
        raise ValueError(f"`{name}` must be a non-empty string or a list of non-empty strings, got {value!r}")
    return list(items)


def check_token_ids(name: str, value: Any, vocab_size: int) -> list[int]:
    """One token id or a list of them, each in [0, vocab_size) -> the list (None -> [])."""
    if value is None:
        return []
    if hasattr(value, "tolist"):           # a tensor, as transformers' generation config may hold
        value = value.tolist()
    items = [value] if is_int(value) else value
    if not isinstance(items, (list, tuple)) or not all(is_int(i) and 0 <= i < vocab_size for i in items):
        raise ValueError(f"`{name}` must be a token id or a list of token ids in [0, {vocab_size}), got {value!r}")
    return list(items)
