"""The helpers fla's KDA test file imports from ``fla.utils`` and ``fla.ops.utils.cache``, with fla-core 0.6's
meaning, written for this suite (tests/fla_suite runs that file against kimi_linear.ops).

- ``device``: "cuda" when a CUDA device is present, else "cpu" (fla's own falls back to "cuda" strings on a
  machine without a GPU, which would make every tensor move fail here).
- ``IS_NVIDIA`` / ``IS_NPU`` / ``IS_INTEL_ALCHEMIST``: the platform flags fla's tests branch on; kimi_linear runs on
  NVIDIA GPUs or the CPU, never on Ascend or Intel Arc.
- ``assert_close(prefix, ref, tri, ratio, warning=False, err_atol=1e-6)``: fla's comparison: passes when the
  largest absolute difference is at most ``err_atol``; otherwise neither side may hold NaN and the relative RMS
  error ``||ref - tri||_2 / (||ref||_2 + 1e-8)`` (over all elements, as root-mean-squares) must stay below
  ``ratio``. ``warning=True`` only warns (as fla's own does for its ``dA`` checks). fla also downgrades failures to
  warnings when its CI variable is set; this copy never does, so no bar is looser than fla's strictest reading.
- ``FLA_CACHE_MODE``: fla's kernel-config cache mode; kimi_linear has no such cache, so it reads as fla's default
  (``FLA_CACHE_MODE`` unset: no cached default configs, so no case is skipped for them).

Every comparison is also recorded in :data:`RECORDS` (the suite's conftest reports the closest ones to their bar),
with the same ratio computed in float64 beside fla's: fla squares the differences in the tensors' own dtype, so for
float16/bfloat16 outputs differences below about 2e-4 square to zero and its ratio reads low.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

device = "cuda" if torch.cuda.is_available() else "cpu"
IS_NVIDIA = torch.cuda.is_available() and torch.version.cuda is not None
IS_NPU = False
IS_INTEL_ALCHEMIST = False


@dataclass(frozen=True)
class Comparison:
    """One ``assert_close`` call: the tensor's name, its errors and the bar it was held to."""

    prefix: str
    abs_err: float
    ratio: float
    ratio64: float
    bar: float
    warning: bool

    @property
    def passed(self) -> bool:
        return self.abs_err <= 1e-6 or self.ratio < self.bar


RECORDS: list[Comparison] = []


def abs_err(ref: torch.Tensor, tri: torch.Tensor) -> float:
    """Largest absolute difference (fla's ``get_abs_err``)."""
    return (ref.detach() - tri.detach()).flatten().abs().max().item()


def err_ratio(ref: torch.Tensor, tri: torch.Tensor) -> float:
    """RMS of the difference over RMS of the reference, in the tensors' dtype (fla's ``get_err_ratio``)."""
    err = (ref.detach() - tri.detach()).flatten().square().mean().sqrt().item()
    base = ref.detach().flatten().square().mean().sqrt().item()
    return err / (base + 1e-8)


def err_ratio64(ref: torch.Tensor, tri: torch.Tensor) -> float:
    """:func:`err_ratio` computed in float64 (reported, not asserted)."""
    return err_ratio(ref.detach().double(), tri.detach().double())


def assert_close(prefix: str, ref: torch.Tensor, tri: torch.Tensor, ratio: float, warning: bool = False,
                 err_atol: float = 1e-6) -> None:
    """fla's ``assert_close`` (module docstring), without its CI leniency."""
    a, r = abs_err(ref, tri), err_ratio(ref, tri)
    RECORDS.append(Comparison(prefix, a, r, err_ratio64(ref, tri), ratio, warning))
    msg = f"{prefix:>16} diff: {a:.6f} ratio: {r:.6f}"
    if a <= err_atol:
        return
    assert not torch.isnan(ref).any(), f"{prefix}: NaN detected in ref"
    assert not torch.isnan(tri).any(), f"{prefix}: NaN detected in tri"
    if warning:
        if r > ratio:
            warnings.warn(msg, stacklevel=2)
    else:
        assert r < ratio, msg


class _CacheMode:
    """fla's ``FLA_CACHE_MODE`` as it reads with the variable unset."""

    def uses_default_config(self) -> bool:
        return False


FLA_CACHE_MODE = _CacheMode()
