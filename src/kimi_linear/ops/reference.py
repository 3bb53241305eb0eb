"""The KDA recurrence (docs/kda.md §1), token by token: the ground truth every fast path is tested against."""

from __future__ import annotations

import torch

from .checks import check_kda_inputs
from .layout import expand_heads


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``S <- Diag(exp(g_t)) S; S <- S + beta_t k_t (v_t - S^T k_t)^T; o_t = S^T (scale q_t)``.

    Computes in the dtype of ``q`` (pass float64 for ground truth); the state starts as ``initial_state`` cast to
    that dtype. Shapes: q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV];
    initial_state [N, HV, K, V]. Returns o [B, T, HV, V] in q's dtype and the final state [N, HV, K, V]
    (float32 unless q is float64) or None.
    """
    # The reference deliberately skips the float32 dtype rule so float64 ground truth can carry a float64 state.
    s = check_kda_inputs(q, k, v, g, beta, None, cu_seqlens)
    if initial_state is not None and tuple(initial_state.shape) != (s.N, s.HV, s.K, s.V):
        raise ValueError(f"`initial_state` must have shape [N={s.N}, HV={s.HV}, K={s.K}, V={s.V}], "
                         f"got {tuple(initial_state.shape)}")
    dtype = q.dtype
    scale = s.K ** -0.5 if scale is None else scale
    q, k = expand_heads(q, s.HV).to(dtype), expand_heads(k, s.HV).to(dtype)
    v, g, beta = v.to(dtype), g.to(dtype), beta.to(dtype)
    bounds = [(b, 0, s.T) for b in range(s.B)] if cu_seqlens is None else [
        (0, int(a), int(e)) for a, e in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())]
    o = torch.zeros_like(v)
    finals = []
    for n, (b, start, end) in enumerate(bounds):
        S = q.new_zeros(s.HV, s.K, s.V) if initial_state is None else initial_state[n].to(dtype)
        for t in range(start, end):
            S = S * g[b, t].exp()[..., None]                                          # forget, per key channel
            err = v[b, t] - torch.einsum("hkv,hk->hv", S, k[b, t])                    # v_t - S^T k_t
            S = S + beta[b, t][:, None, None] * k[b, t][..., None] * err[:, None, :]  # delta-rule write
            o[b, t] = torch.einsum("hkv,hk->hv", S, q[b, t] * scale)                  # read with the query
        finals.append(S)
    final = None
    if output_final_state:
        final = torch.stack(finals)
        final = final if dtype == torch.float64 else final.float()
    return o, final
