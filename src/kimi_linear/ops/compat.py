"""fla-core 0.6's extra arguments of ``chunk_kda`` / ``fused_recurrent_kda`` / ``fused_kda_gate``, mapped onto ours.

fla's callers (its tests, vLLM, transformers) pass options that change nothing in our arithmetic (``safe_gate``,
``cu_seqlens_cpu``; ``disable_recompute`` changes only what the Triton forward keeps for the backward) or that are
a layout (``state_v_first``: states stored ``[V, K]``), or the bounded gate without a decay rate (``A_log=None``
with ``lower_bound``). This module gives each its meaning once, so the public functions stay readable:

- ``safe_gate``: fla's promise that gates lie in ``[lower_bound, 0)`` so it may use faster 16-row products; ours
  are exact for any gate, so it is only validated (with the in-kernel gate it needs ``-5 <= lower_bound < 0``).
- ``lower_bound`` without the in-kernel gate: the bound the caller's precomputed gates respect; unused.
- ``A_log=None`` with ``lower_bound``: ``g = lower_bound * sigmoid(g + dt_bias)``, i.e. ``A_log = 0``.
- ``chunk_size``: 32 or 64, as fla takes them (others are refused with fla's message). It chooses how fla tiles the
  work, not what is computed: our kernels run 64-token chunks for either, except where the chunks are visible,
  ``return_intermediate_states`` (the state at the start of every ``chunk_size`` tokens).
- ``transpose_state_layout``: fla's deprecated name of ``state_v_first`` (a DeprecationWarning; both at once is an
  error, as in fla).
"""

from __future__ import annotations

import warnings

import torch

CHUNK_SIZE = 64
CHUNK_SIZES = (32, 64)


def gate_params(use_gate_in_kernel: bool, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
                lower_bound: float | None, safe_gate: bool, HV: int, device: torch.device
                ) -> tuple[torch.Tensor | None, torch.Tensor | None, float | None]:
    """(A_log, dt_bias, lower_bound) as our kernels take them, after fla's rules (module docstring)."""
    if not use_gate_in_kernel:
        return A_log, dt_bias, None
    if safe_gate:
        if lower_bound is None:
            raise ValueError("`lower_bound` must be given when `safe_gate=True` and `use_gate_in_kernel=True`")
        if not -5 <= lower_bound < 0:
            raise ValueError(f"`lower_bound` must be in the safe range [-5, 0) with `safe_gate=True`, got "
                             f"{lower_bound}")
    if A_log is None and lower_bound is not None:
        A_log = torch.zeros(HV, dtype=torch.float32, device=device)      # exp(0) = 1: lower_bound*sigmoid(g+b)
    return A_log, dt_bias, lower_bound


def check_chunk_size(chunk_size: int) -> None:
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"`chunk_size` must be either 32 or 64 for KDA, got {chunk_size!r}")


def resolve_state_v_first(state_v_first: bool, transpose_state_layout: bool | None) -> bool:
    """``state_v_first``, after fla's deprecated spelling ``transpose_state_layout`` (module docstring)."""
    if transpose_state_layout is None:
        return state_v_first
    if state_v_first:
        raise ValueError("Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`.")
    warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.", DeprecationWarning,
                  stacklevel=3)
    return bool(transpose_state_layout)


def k_first(state: torch.Tensor | None, state_v_first: bool) -> torch.Tensor | None:
    """A state given as ``[..., V, K]`` (``state_v_first``) in our ``[..., K, V]`` layout."""
    if state is None or not state_v_first:
        return state
    return state.transpose(-1, -2).contiguous()


def v_first(state: torch.Tensor | None, state_v_first: bool) -> torch.Tensor | None:
    """Our ``[..., K, V]`` state back in the caller's layout."""
    if state is None or not state_v_first:
        return state
    return state.transpose(-1, -2).contiguous()


def check_cu_seqlens_cpu(cu_seqlens: torch.Tensor | None, cu_seqlens_cpu: torch.Tensor | None) -> None:
    """``cu_seqlens_cpu`` is the host copy of ``cu_seqlens`` (fla reads it to avoid a device sync)."""
    if cu_seqlens_cpu is None:
        return
    if cu_seqlens is None:
        raise ValueError("`cu_seqlens_cpu` is the host copy of `cu_seqlens`, which is missing")
    if cu_seqlens_cpu.device.type != "cpu" or tuple(cu_seqlens_cpu.shape) != tuple(cu_seqlens.shape):
        raise ValueError(f"`cu_seqlens_cpu` must be a CPU tensor shaped like `cu_seqlens` "
                         f"{tuple(cu_seqlens.shape)}, got {cu_seqlens_cpu.device} {tuple(cu_seqlens_cpu.shape)}")
