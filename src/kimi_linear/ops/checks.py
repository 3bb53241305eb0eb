"""Argument checks shared by every KDA entry point.

Each check raises ``ValueError`` (wrong shape or value) or ``TypeError`` (wrong dtype or type) naming the argument,
so a caller never gets a broadcast they did not ask for or a crash deep inside a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class KDAShape:
    """Sizes read off validated inputs: batch ``B``, length ``T``, q/k heads ``H``, value heads ``HV``,
    key width ``K``, value width ``V`` and number of sequences ``N`` (``B``, or ``len(cu_seqlens) - 1``)."""

    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    N: int


def _need_tensor(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(x).__name__}")
    return x


def _need_float(name: str, x: torch.Tensor) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"`{name}` must be a floating tensor (float16/bfloat16/float32/float64), got {x.dtype}")


def check_cu_seqlens(cu_seqlens: torch.Tensor, B: int, T: int) -> int:
    """Validate ``cu_seqlens`` ([N+1] int, starts at 0, non-decreasing, ends at T, only with B == 1); return N."""
    _need_tensor("cu_seqlens", cu_seqlens)
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"`cu_seqlens` must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"`cu_seqlens` must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if B != 1:
        raise ValueError(f"`cu_seqlens` needs the batch size B == 1 (sequences packed along T), got B={B}")
    cs = cu_seqlens.tolist()
    if cs[0] != 0:
        raise ValueError(f"`cu_seqlens` must start at 0, got {cs[0]}")
    if any(b < a for a, b in zip(cs[:-1], cs[1:])):
        raise ValueError("`cu_seqlens` must be non-decreasing")
    if cs[-1] != T:
        raise ValueError(f"`cu_seqlens` must end at the packed length T={T}, got {cs[-1]}")
    return len(cs) - 1


def check_kda_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    *,
    scalar_gate: bool = False,
    state_indices: torch.Tensor | None = None,
    trusted_indices: bool = False,
) -> KDAShape:
    """Check the layout of docs/kda.md §3 and return the sizes.

    q, k: [B, T, H, K]; v: [B, T, HV, V] with HV % H == 0; g: [B, T, HV, K] ([B, T, HV] when ``scalar_gate``);
    beta: [B, T, HV]; initial_state: [N, HV, K, V] float32 (with ``state_indices``: a pool [S, HV, K, V]).
    trusted_indices: skip the range check of CUDA ``state_indices`` (the caller owns the pool and its rows).
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _need_float(name, _need_tensor(name, x))
    if q.ndim != 4:
        raise ValueError(f"`q` must be [B, T, H, K], got shape {tuple(q.shape)}")
    if k.shape != q.shape:
        raise ValueError(f"`k` must have the shape of `q` {tuple(q.shape)}, got {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.ndim != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"`v` must be [B={B}, T={T}, HV, V], got shape {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if HV % H != 0:
        raise ValueError(f"value heads HV={HV} (from `v`) must be a multiple of q/k heads H={H} (from `q`)")
    g_shape = (B, T, HV) if scalar_gate else (B, T, HV, K)
    if tuple(g.shape) != g_shape:
        raise ValueError(f"`g` must have shape {g_shape} ([B, T, HV{'' if scalar_gate else ', K'}]), "
                         f"got {tuple(g.shape)}")
    if tuple(beta.shape) != (B, T, HV):
        raise ValueError(f"`beta` must have shape {(B, T, HV)} ([B, T, HV]), got {tuple(beta.shape)}")
    devices = {x.device for x in (q, k, v, g, beta)}
    if len(devices) != 1:
        raise ValueError(f"`q`, `k`, `v`, `g`, `beta` must be on one device, got {sorted(map(str, devices))}")
    N = B if cu_seqlens is None else check_cu_seqlens(cu_seqlens, B, T)
    if state_indices is not None:
        _need_tensor("state_indices", state_indices)
        if state_indices.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"`state_indices` must be int32 or int64, got {state_indices.dtype}")
        if tuple(state_indices.shape) != (N,):
            raise ValueError(f"`state_indices` must have shape ({N},) (one slot per sequence), "
                             f"got {tuple(state_indices.shape)}")
        if initial_state is None:
            raise ValueError("`state_indices` needs `initial_state`: the state pool [num_slots, HV, K, V]")
    if initial_state is not None:
        _need_tensor("initial_state", initial_state)
        if initial_state.dtype != torch.float32:
            raise TypeError(f"`initial_state` must be float32 (the state is kept in float32), "
                            f"got {initial_state.dtype}")
        rows = initial_state.shape[0] if state_indices is not None and initial_state.ndim == 4 else N
        if tuple(initial_state.shape) != (rows, HV, K, V):
            what = "num_slots" if state_indices is not None else "N"
            raise ValueError(f"`initial_state` must have shape [{what}={rows}, HV={HV}, K={K}, V={V}], "
                             f"got {tuple(initial_state.shape)}")
        if state_indices is not None and state_indices.numel() > 0 and not (trusted_indices and state_indices.is_cuda):
            if state_indices.is_cuda:
                # Reading the values back would stall every decode step and cannot run inside a CUDA graph:
                # check on the device instead (an out-of-range slot raises a device-side assertion).
                torch._assert_async(((state_indices >= 0) & (state_indices < rows)).all())
            else:
                lo, hi = int(state_indices.min()), int(state_indices.max())
                if lo < 0 or hi >= rows:
                    raise ValueError(f"`state_indices` must lie in [0, {rows}), got values from {lo} to {hi}")
    return KDAShape(B=B, T=T, H=H, HV=HV, K=K, V=V, N=N)


def check_gate_params(
    HV: int, K: int, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, lower_bound: float | None
) -> None:
    """``A_log`` holds one value per value head (any shape with HV elements, e.g. [HV] or the checkpoint's
    [1, 1, HV, 1]); ``dt_bias`` holds HV*K values ([HV*K] or [HV, K])."""
    if A_log is None:
        raise ValueError("`A_log` is required when the gate is computed in the kernel (`use_gate_in_kernel=True`)")
    _need_float("A_log", _need_tensor("A_log", A_log))
    if A_log.numel() != HV:
        raise ValueError(f"`A_log` must hold one value per value head (HV={HV}), got shape {tuple(A_log.shape)}")
    if dt_bias is not None:
        _need_float("dt_bias", _need_tensor("dt_bias", dt_bias))
        if dt_bias.numel() != HV * K:
            raise ValueError(f"`dt_bias` must hold HV*K={HV * K} values ([HV, K] or [HV*K]), "
                             f"got shape {tuple(dt_bias.shape)}")
    if lower_bound is not None and not lower_bound < 0:
        raise ValueError(f"`lower_bound` must be negative (log-space decay bound, e.g. -5), got {lower_bound}")
