"""Token-by-token KDA for decoding (SPEC section 1), with in-place updates of a serving engine's state pool."""

from __future__ import annotations

import torch

from .backend import triton_op
from .checks import check_kda_inputs
from .chunk import compute_dtype
from .gate import L2NORM_EPS, KernelOptions, as_float32, fused_kda_gate
from .layout import SequenceLayout, expand_heads


def recurrent_step(
    S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for a batch of states. S: [N, HV, K, V]; q (already scaled), k, g: [N, HV, K]; v: [N, HV, V];
    beta: [N, HV]. Returns (o [N, HV, V], S_new)."""
    S = S * g.exp()[..., None]
    err = v - (k.unsqueeze(-2) @ S).squeeze(-2)                           # v - S^T k
    S = S + (beta[..., None] * k).unsqueeze(-1) * err.unsqueeze(-2)
    o = (q.unsqueeze(-2) @ S).squeeze(-2)
    return o, S


def _inv_norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x [M, 1, K] -> 1 / sqrt(sum(x^2) + eps) as [M, 1, 1] (the sum of squares as one batched dot product)."""
    return torch.rsqrt(torch.bmm(x, x.transpose(1, 2)).add_(eps))


def single_token_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
    S: torch.Tensor, opts: KernelOptions,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode step with the fewest kernel calls, taking q, k [N, H, K], v [N, HV, V], g [N, HV, K] and
    beta [N, HV] *before* the in-kernel transforms of ``opts``; S [N, HV, K, V] float32 (not modified).
    Returns (o [N, HV, V] float32, S_new [N, HV, K, V]).

    On CPU a decode step is bound by per-call overhead (a few microseconds an op), not arithmetic, so the math of
    the general path is rearranged into ~20 ops on [N*HV]-batched matrices. The l2 norms of q and k are
    per-(sequence, head) scalars r, applied after the products instead of before: with k_hat = r_k k,
    ``k_hat^T S = r_k (k^T S)`` and ``beta k_hat err^T = (beta r_k) k err^T``, and ``o = r_q scale (q^T S)``.
    """
    N, HV, V = v.shape
    K = k.shape[-1]
    M = N * HV
    if q.shape[1] != HV:  # grouped values: value head j reads q/k head j // (HV // H)
        q, k = q.repeat_interleave(HV // q.shape[1], dim=1), k.repeat_interleave(HV // k.shape[1], dim=1)
    q3, k3 = as_float32(q).reshape(M, 1, K), as_float32(k).reshape(M, 1, K)
    log_decay = fused_kda_gate(g, opts.A_log, opts.dt_bias, opts.lower_bound) if opts.use_gate_in_kernel else g
    S = (S * as_float32(log_decay).exp().unsqueeze(-1)).view(M, K, V)                    # forget
    b = as_float32(beta).reshape(M, 1, 1)
    if opts.use_beta_sigmoid_in_kernel:
        b = torch.sigmoid(b) * 2 if opts.allow_neg_eigval else torch.sigmoid(b)
    kS = torch.bmm(k3, S)                                                                 # [M, 1, V] k^T S
    v3 = as_float32(v).reshape(M, 1, V)
    if opts.use_qk_l2norm_in_kernel:
        r_k = _inv_norm(k3)                                                               # [M, 1, 1]
        err = torch.addcmul(v3, r_k, kS, value=-1)                                        # v - k_hat^T S
        S = torch.baddbmm(S, (k3 * (b * r_k)).transpose(1, 2), err)                       # + beta k_hat err^T
        o = torch.bmm(q3, S) * (_inv_norm(q3) * scale)
    else:
        S = torch.baddbmm(S, (k3 * b).transpose(1, 2), v3 - kS)
        o = torch.bmm(q3, S) * scale
    return o.view(N, HV, V), S.view(N, HV, K, V)


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    allow_neg_eigval: bool = False,
    state_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA one token at a time: the decode path. Same contract as :func:`~kimi_linear.ops.chunk_kda`, plus:

    state_indices: [N] int. When given, ``initial_state`` is a state pool ``[num_slots, HV, K, V]`` float32;
        sequence n starts from row ``state_indices[n]`` and its final state is written back into that row in
        place. Rows not named are not touched. The returned final state is then the pool itself (or None).
    """
    shape = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens, state_indices=state_indices)
    s = shape
    scale = s.K ** -0.5 if scale is None else scale
    opts = KernelOptions(use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                         A_log, dt_bias, lower_bound)
    fast = triton_op("fused_recurrent_kda", q)
    if fast is not None:
        return fast(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                    cu_seqlens=cu_seqlens, state_indices=state_indices, **opts.kwargs())
    out_dtype = q.dtype
    if s.T == 1 and cu_seqlens is None and q.dtype != torch.float64:
        # One token per sequence (decode): no layout work, no loop, transforms folded in.
        S0 = initial_state[state_indices] if state_indices is not None else initial_state
        S0 = q.new_zeros(s.N, s.HV, s.K, s.V, dtype=torch.float32) if S0 is None else S0
        o, S = single_token_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], scale, S0, opts)
        return _finish(o.unsqueeze(1).to(out_dtype), S, initial_state, state_indices, output_final_state)
    q, k, g, beta = opts.apply(q, k, g, beta)
    dtype = compute_dtype(q)
    layout = SequenceLayout(s.B, s.T, cu_seqlens, 1, q.device)
    rows = lambda x: layout.to_rows(x.to(dtype))                          # [N, L, ...]
    qr, kr = rows(expand_heads(q, s.HV)) * scale, rows(expand_heads(k, s.HV))
    vr, gr, br = rows(v), rows(g), rows(beta)

    if state_indices is not None:
        S = initial_state[state_indices].to(dtype)
    elif initial_state is not None:
        S = initial_state.to(dtype)
    else:
        S = qr.new_zeros(s.N, s.HV, s.K, s.V)
    # Padding steps are exact no-ops (k = v = beta = g = 0), so ragged sequences need no masking.
    outs = []
    for t in range(layout.L if s.T > 0 else 0):
        o_t, S = recurrent_step(S, qr[:, t], kr[:, t], vr[:, t], gr[:, t], br[:, t])
        outs.append(o_t)
    o = torch.stack(outs, dim=1) if outs else vr.new_zeros(s.N, 0, s.HV, s.V)
    return _finish(layout.from_rows(o).to(out_dtype), S, initial_state, state_indices, output_final_state)


def _finish(o, S, initial_state, state_indices, output_final_state):
    """Write final states back into the pool rows (in place) or return them."""
    if state_indices is not None:
        initial_state[state_indices] = S.to(initial_state.dtype)
        return o, (initial_state if output_final_state else None)
    return o, (S.float() if output_final_state else None)
