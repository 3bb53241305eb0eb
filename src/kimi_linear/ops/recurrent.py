"""Token-by-token KDA for decoding (docs/kda.md §7), with in-place updates of a serving engine's state pool."""

from __future__ import annotations

import torch

from .backend import triton_op
from .checks import check_kda_inputs
from .chunk import compute_dtype
from .compat import gate_params, k_first, resolve_state_v_first, v_first
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
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    state_indices: torch.Tensor | None = None,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    inplace_final_state: bool | None = None,
    out: torch.Tensor | None = None,
    transpose_state_layout: bool | None = None,
    trusted_indices: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA one token at a time: the decode path. fla-core 0.6's signature; the options mean what they mean for
    :func:`~kimi_linear.ops.chunk_kda` (``state_v_first``: states ``[.., V, K]``; ``transpose_state_layout``: its
    deprecated name), plus:

    state_indices: [N] int. When given, ``initial_state`` is a state pool ``[num_slots, HV, K, V]`` float32;
        sequence n starts from row ``state_indices[n]`` and its final state is written back into that row in
        place. Rows not named are not touched. The returned final state is then the pool itself (or None).
    ssm_state_indices, num_accepted_tokens, inplace_final_state: vLLM's continuous batching with speculative
        decoding over a pool (``initial_state``): sequence n starts from row ``ssm_state_indices[n, a]``, a =
        ``num_accepted_tokens[n] - 1`` (0 without it), and the state after its token t is stored in row
        ``ssm_state_indices[n, t]`` (1-D indices: one token per sequence, row ``ssm_state_indices[n]``). With
        ``inplace_final_state=False`` the pool is not written and the final states come back as [N, HV, K, V].
    out: a tensor [B, T, HV, V] to write the output into (returned).
    trusted_indices: CUDA ``state_indices`` are checked on the device (five small kernels a call: a comparison
        chain and an asynchronous assert); a caller that allocated the pool rows itself (the model's decode step)
        passes True to skip that. Out-of-range rows then read and write out of bounds: never pass user input.
    """
    state_v_first = resolve_state_v_first(state_v_first, transpose_state_layout)
    options = dict(scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                   use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                   allow_neg_eigval=allow_neg_eigval, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    if ssm_state_indices is not None:
        o, final = _continuous_batching(q, k, v, g, beta, initial_state, ssm_state_indices, num_accepted_tokens,
                                        inplace_final_state is not False, state_v_first, cu_seqlens, options)
    else:
        if inplace_final_state or num_accepted_tokens is not None:
            raise ValueError("`inplace_final_state` and `num_accepted_tokens` need `ssm_state_indices`")
        state = k_first(initial_state, state_v_first)
        o, final = _recurrent(q, k, v, g, beta, initial_state=state, output_final_state=output_final_state,
                              cu_seqlens=cu_seqlens, state_indices=state_indices, trusted_indices=trusted_indices,
                              **options)
        if state_indices is not None and state_v_first and initial_state is not None:
            # the rows were updated in a [K, V] copy of the pool: put them back into the V-first pool
            initial_state.transpose(-1, -2)[state_indices] = state[state_indices]
            final = initial_state if output_final_state else None
        else:
            final = v_first(final, state_v_first)
    if out is not None:
        if out.shape != v.shape:
            raise ValueError(f"`out` must have v's shape {tuple(v.shape)}, got {tuple(out.shape)}")
        out.copy_(o)
        o = out
    return o, final


def fused_recurrent_kda_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    output_final_state: bool = False,
    inplace_final_state: bool = True,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla-core 0.6's ``fused_recurrent_kda_fwd`` (``fla.ops.kda.fused_recurrent``), the forward that serving
    engines call: :func:`fused_recurrent_kda` with fla's argument order and ``inplace_final_state=True`` by default,
    i.e. ``initial_state`` is a state pool that receives the final states and is returned: into rows
    ``ssm_state_indices`` (their meaning in :func:`fused_recurrent_kda`), or without them row n for sequence n.
    With ``inplace_final_state=False`` the final states come back as new tensors when ``output_final_state``.
    Returns (o [B, T, HV, V], the pool or the final states or None)."""
    options = dict(A_log=A_log, dt_bias=dt_bias, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                   use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                   allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound, state_v_first=state_v_first,
                   cu_seqlens=cu_seqlens, out=out)
    if ssm_state_indices is not None:
        return fused_recurrent_kda(q, k, v, g, beta, initial_state=initial_state,
                                   output_final_state=output_final_state, ssm_state_indices=ssm_state_indices,
                                   num_accepted_tokens=num_accepted_tokens, inplace_final_state=inplace_final_state,
                                   **options)
    if not inplace_final_state:
        return fused_recurrent_kda(q, k, v, g, beta, initial_state=initial_state,
                                   output_final_state=output_final_state, **options)
    if initial_state is None:
        raise ValueError("`inplace_final_state=True` needs `initial_state`: the states to update in place")
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    rows = torch.arange(N, device=initial_state.device)
    o, _ = fused_recurrent_kda(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                               state_indices=rows, **options)
    return o, initial_state


def _continuous_batching(q, k, v, g, beta, pool, indices, num_accepted, inplace, state_v_first, cu_seqlens,
                         options) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fused_recurrent_kda` with ``ssm_state_indices``: token by token over all sequences at once (a
    speculative step has a handful of tokens), each token's state stored in its row."""
    if pool is None:
        raise ValueError("`ssm_state_indices` needs `initial_state`: the state pool")
    B, T = q.shape[:2]
    if cu_seqlens is None:
        N, lens, starts = B, [T] * B, [n * T for n in range(B)]
    else:
        cs = cu_seqlens.tolist()
        N, lens, starts = len(cs) - 1, [b - a for a, b in zip(cs[:-1], cs[1:])], cs[:-1]
    if indices.ndim not in (1, 2) or indices.shape[0] != N:
        raise ValueError(f"`ssm_state_indices` must be [N={N}] or [N={N}, T], got shape {tuple(indices.shape)}")
    if indices.ndim == 1:
        if max(lens, default=0) > 1:
            raise ValueError("1-D `ssm_state_indices` hold one row per sequence: one token each; pass [N, T] for "
                             "more")
        indices = indices[:, None]
    if max(lens, default=0) > indices.shape[1]:
        raise ValueError(f"`ssm_state_indices` has {indices.shape[1]} columns for sequences of up to "
                         f"{max(lens)} tokens")
    rows = pool.transpose(-1, -2) if state_v_first else pool                 # [S, HV, K, V] view
    first = (num_accepted.long() - 1) if num_accepted is not None else torch.zeros(N, dtype=torch.long,
                                                                                  device=q.device)
    S = rows[indices.gather(1, first.to(indices.device)[:, None])[:, 0].long()].float()
    flat = [x.reshape(B * T, *x.shape[2:]) for x in (q, k, v, g, beta)]
    o = torch.empty_like(v).reshape(B * T, *v.shape[2:])
    for t in range(max(lens, default=0)):
        act = [n for n in range(N) if lens[n] > t]
        act_t = torch.tensor(act, device=q.device)
        pos = torch.tensor([starts[n] + t for n in act], device=q.device)
        o_t, S_t = _recurrent(*(x[pos][:, None] for x in flat), initial_state=S[act_t], output_final_state=True,
                              **options)
        o[pos] = o_t[:, 0]
        S[act_t] = S_t
        if inplace:
            rows[indices[act_t, t].long()] = S_t.to(pool.dtype)
    return o.view_as(v), (pool if inplace else v_first(S, state_v_first))


def _recurrent(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
               use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, A_log, dt_bias, lower_bound,
               cu_seqlens=None, state_indices=None, trusted_indices=False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The recurrence on states in our [K, V] layout (the body of :func:`fused_recurrent_kda`)."""
    shape = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens, state_indices=state_indices,
                             trusted_indices=trusted_indices)
    s = shape
    scale = s.K ** -0.5 if scale is None else scale
    A_log, dt_bias, lower_bound = gate_params(use_gate_in_kernel, A_log, dt_bias, lower_bound, False, s.HV, q.device)
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
