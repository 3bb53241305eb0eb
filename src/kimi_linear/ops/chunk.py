"""Chunkwise KDA (docs/kda.md §4-5) in PyTorch: prefill and training on any device torch supports."""

from __future__ import annotations

import torch

from .backend import triton_op
from .checks import KDAShape, check_kda_inputs
from .compat import (
    CHUNK_SIZE,
    check_chunk_size,
    check_cu_seqlens_cpu,
    gate_params,
    k_first,
    resolve_state_v_first,
    v_first,
)
from .gate import KernelOptions
from .intra import ChunkIntra, safe_exp, wy_representation
from .layout import SequenceLayout, expand_heads
from .scan import ChunkStateScan


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float64 inputs compute in float64 (tests); everything else in float32 (the state's dtype)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    shape: KDAShape,
    scale: float,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunkwise algorithm on validated, already-transformed inputs; returns (o in float32/64, S_final, the
    state at the start of every chunk [N, HV, NC, K, V]).

    Works on rows ``[N, HV, NC, C, *]``: all intra-chunk work is batched over every chunk at once; only the state
    passes from chunk to chunk (:class:`ChunkStateScan`).
    """
    s, C = shape, chunk_size
    dtype = compute_dtype(q)
    layout = SequenceLayout(s.B, s.T, cu_seqlens, C, q.device)
    NC = layout.L // C

    def rows(x: torch.Tensor) -> torch.Tensor:
        # [B, T, HV, X] -> [N, HV, NC, C, X]
        x = layout.to_rows(x.to(dtype))
        return x.reshape(s.N, NC, C, s.HV, -1).permute(0, 3, 1, 2, 4).contiguous()

    qc, kc = rows(expand_heads(q, s.HV)), rows(expand_heads(k, s.HV))
    vc, gc = rows(v), rows(g)
    bc = rows(beta.unsqueeze(-1)).squeeze(-1)                                  # [N, HV, NC, C]

    A_qk, A_kk, G, G_to_end = ChunkIntra.apply(qc, kc, gc)                     # G_i and G_C - G_i
    decay_start = safe_exp(G)
    k_start = kc * decay_start                                                 # k_i * exp(G_i)
    k_end = kc * safe_exp(G_to_end)                                            # k_j * exp(G_C - G_j)
    decay = decay_start[..., -1, :]                                            # exp(G_C)  [N, HV, NC, K]
    W, U = wy_representation(A_kk, k_start, vc, bc)

    S0 = qc.new_zeros(s.N, s.HV, s.K, s.V) if initial_state is None else initial_state.to(dtype)
    S_starts, Delta, S_final = ChunkStateScan.apply(W, U, k_end, decay, S0)
    o = scale * ((qc * decay_start) @ S_starts + A_qk @ Delta)                     # [N, HV, NC, C, V]
    o = o.permute(0, 2, 3, 1, 4).reshape(s.N, layout.L, s.HV, s.V)
    return layout.from_rows(o), S_final, S_starts


def chunk_kda(
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
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    *,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
    transpose_state_layout: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Kimi Delta Attention, chunkwise (chunk 64); differentiable in every tensor input. fla-core 0.6's signature.

    Args (fla-core 0.6 names, order and layout):
        q, k: [B, T, H, K]. v: [B, T, HV, V], HV a multiple of H (value head j uses q/k head j // (HV // H)).
        g: [B, T, HV, K] log decay (<= 0), or the raw gate when ``use_gate_in_kernel``.
        beta: [B, T, HV] write strength, or its logits when ``use_beta_sigmoid_in_kernel``.
        scale: query scale, default K^-1/2.
        initial_state: [N, HV, K, V] float32 ([N, HV, V, K] with ``state_v_first``), N = B or the number of
            packed sequences.
        output_final_state: also return the final state (float32, the same layout).
        use_qk_l2norm_in_kernel: l2-normalise q and k per head first.
        use_gate_in_kernel: ``g <- fused_kda_gate(g, A_log, dt_bias, lower_bound)``; ``A_log=None`` with
            ``lower_bound`` means ``lower_bound * sigmoid(g + dt_bias)``.
        use_beta_sigmoid_in_kernel: ``beta <- sigmoid(beta)`` (``2 * sigmoid`` with ``allow_neg_eigval``).
        safe_gate, cu_seqlens_cpu: accepted with fla's meaning; they change nothing here
            (:mod:`kimi_linear.ops.compat` says why).
        disable_recompute: fla's trade of memory for the backward's time: the Triton forward keeps its gate sums
            and WY factors for the backward (about 1.5 KiB more per token and value head at K=V=128 in bf16),
            which then skips recomputing them. The same arithmetic either way.
        return_intermediate_states: also return the state at the start of every chunk of ``chunk_size`` tokens,
            [B, NT, HV, K, V] in q's dtype (NT chunks per sequence; with ``cu_seqlens`` B = 1 and NT counts every
            sequence's chunks), for inference (no gradient). Runs the PyTorch path.
        state_v_first: states in and out are ``[.., V, K]`` (``transpose_state_layout``: fla's deprecated name).
        cu_seqlens: [N+1] int offsets of packed sequences (B must be 1), one state per sequence.
        chunk_size: 32 or 64 as in fla; it changes only the chunks of ``return_intermediate_states`` (the kernels
            run 64-token chunks, the same function).

    Returns ``(o, final_state)`` (or ``(o, final_state, h)``): o [B, T, HV, V] in q's dtype; final_state or None.
    """
    check_chunk_size(chunk_size)
    check_cu_seqlens_cpu(cu_seqlens, cu_seqlens_cpu)
    state_v_first = resolve_state_v_first(state_v_first, transpose_state_layout)
    initial_state = k_first(initial_state, state_v_first)
    shape = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    scale = shape.K ** -0.5 if scale is None else scale
    A_log, dt_bias, lower_bound = gate_params(use_gate_in_kernel, A_log, dt_bias, lower_bound, safe_gate, shape.HV,
                                              q.device)
    opts = KernelOptions(use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                         A_log, dt_bias, lower_bound)
    fast = triton_op("chunk_kda", q)
    if fast is not None and not return_intermediate_states:
        o, final = fast(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                        disable_recompute=disable_recompute, **opts.kwargs())
        return o, v_first(final, state_v_first)
    out_dtype = q.dtype
    # The PyTorch path picks its own precision (float32 products, float64 for float64 inputs); bf16 autocast
    # (training) would round the chunk products to bf16 and mismatch its float32 out= buffers.
    with torch.autocast(q.device.type, enabled=False):
        q, k, g, beta = opts.apply(q, k, g, beta)
        C = chunk_size if return_intermediate_states else CHUNK_SIZE
        o, final, starts = delta_rule_chunked(q, k, v, g, beta, shape, scale, initial_state, cu_seqlens, C)
    final = v_first(final.float(), state_v_first) if output_final_state else None
    if not return_intermediate_states:
        return o.to(out_dtype), final
    return o.to(out_dtype), final, v_first(chunk_starts(starts, cu_seqlens, C).to(out_dtype), state_v_first)


def chunk_starts(starts: torch.Tensor, cu_seqlens: torch.Tensor | None, chunk_size: int) -> torch.Tensor:
    """Per-chunk start states [N, HV, NC, K, V] (every sequence padded to NC chunks) in fla's layout: [B, NC, HV,
    K, V], or [1, NT, HV, K, V] with each packed sequence's own ceil(len / chunk_size) chunks back to back."""
    h = starts.transpose(1, 2)                                                 # [N, NC, HV, K, V]
    if cu_seqlens is None:
        return h
    n_chunks = [-(-n // chunk_size) for n in cu_seqlens.diff().tolist()]
    return torch.cat([h[i, :c] for i, c in enumerate(n_chunks)])[None]


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated DeltaNet: KDA with one scalar log decay per head and step, ``g: [B, T, HV]``.

    Same contract as :func:`chunk_kda` otherwise; the scalar gate is broadcast over the key channels.
    """
    if isinstance(g, torch.Tensor) and isinstance(q, torch.Tensor):
        check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens, scalar_gate=True)
        g = g.unsqueeze(-1).expand(*g.shape, q.shape[-1])
    return chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                     cu_seqlens=cu_seqlens)
