"""The decode step: KDA token by token (docs/kda.md §7) in one Triton kernel, with a serving engine's state pool.

One program owns one value-head's state block ``[K, BV]`` in registers for the whole sequence: it reads the state
once, runs every token of the sequence (one for decode, a few for short prompts or speculative tokens), and writes
the state once. The in-kernel transforms (l2norm of q/k, the gate formula, the beta sigmoid) run on the token's
vectors as they are loaded, so nothing but the state and the token's inputs and output touches memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import check_gate_params
from .ints import cdiv, next_pow2
from .pdl import pdl_args, pdl_entry
from .transforms import beta_transform, kda_gate, l2_normalize


@triton.jit
def fused_recurrent_kda_fwd_kernel(
    q, k, v, g, beta, o,             # [B, T, H, K] x2, [B, T, HV, V], [B, T, HV, K], [B, T, HV], [B, T, HV, V]
    h0, ht,                           # [N or slots, HV, K, V] float32 (ht may be h0: the in-place pool)
    A_log, dt_bias,                   # [HV], [HV, K] (in-kernel gate only)
    cu_seqlens, state_indices,        # [N + 1], [N] (optional)
    s_q, s_k, s_v, s_g, s_b,          # elements from one token to the next in q, k, v, g, beta (views welcome)
    scale, lower_bound, T,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, USE_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
    USE_STATE_INDICES: tl.constexpr, USE_QK_L2NORM: tl.constexpr, USE_GATE: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr, HAS_DT_BIAS: tl.constexpr, USE_BETA_SIGMOID: tl.constexpr,
    NEG_EIGVAL: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_entry(PDL)
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)                                   # grouped value heads share q/k head i_h
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T_n = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
    else:
        bos = i_n.to(tl.int64) * T
        T_n = T
    i_s = i_n.to(tl.int64)
    if USE_STATE_INDICES:
        i_s = tl.load(state_indices + i_n).to(tl.int64)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_h = m_k[:, None] & m_v[None, :]

    p_q = q + bos * s_q + i_h * K + o_k
    p_k = k + bos * s_k + i_h * K + o_k
    p_v = v + bos * s_v + i_hv * V + o_v
    p_o = o + (bos * HV + i_hv) * V + o_v
    p_g = g + bos * s_g + i_hv * K + o_k
    p_beta = beta + bos * s_b + i_hv
    o_h = (i_s * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]

    b_h = tl.zeros([BK, BV], dtype=tl.float32)                 # [BK, BV]
    if USE_INITIAL_STATE:
        b_h += tl.load(h0 + o_h, mask=m_h, other=0.0)
    if USE_GATE:
        b_a = tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        b_bias = tl.zeros([BK], dtype=tl.float32)              # [BK]
        if HAS_DT_BIAS:
            b_bias += tl.load(dt_bias + i_hv * K + o_k, mask=m_k, other=0.0).to(tl.float32)

    for _ in range(0, T_n):
        b_q = tl.load(p_q, mask=m_k, other=0.0).to(tl.float32)          # [BK]
        b_k = tl.load(p_k, mask=m_k, other=0.0).to(tl.float32)          # [BK]
        b_v = tl.load(p_v, mask=m_v, other=0.0).to(tl.float32)          # [BV]
        b_g = tl.load(p_g, mask=m_k, other=0.0).to(tl.float32)          # [BK]
        b_beta = tl.load(p_beta).to(tl.float32)
        if USE_QK_L2NORM:
            b_q = l2_normalize(b_q, 0)
            b_k = l2_normalize(b_k, 0)
        if USE_GATE:
            b_g = kda_gate(b_g, b_bias, b_a, lower_bound, USE_LOWER_BOUND)
        b_beta = beta_transform(b_beta, USE_BETA_SIGMOID, NEG_EIGVAL)

        b_h *= tl.exp(b_g)[:, None]                                      # forget, per key channel
        b_err = b_v - tl.sum(b_h * b_k[:, None], 0)                      # [BV] v - S^T k
        b_h += b_k[:, None] * (b_beta * b_err)[None, :]                  # delta-rule write
        b_o = tl.sum(b_h * b_q[:, None], 0) * scale                      # [BV] read with the query
        tl.store(p_o, b_o.to(p_o.dtype.element_ty), mask=m_v)

        p_q += s_q
        p_k += s_k
        p_v += s_v
        p_o += HV * V
        p_g += s_g
        p_beta += s_b

    if STORE_FINAL_STATE:
        tl.store(ht + o_h, b_h, mask=m_h)


def token_stride(x: torch.Tensor) -> int | None:
    """Elements from one token to the next of x [B, T, ...] when its per-token part is packed and (B, T) fold into
    one token axis; else None. The decode step's q, k, v and beta are views into the packed projection's output
    (one row per token): reading them in place saves a copy kernel each, which at batch 1 costs as much as the
    recurrence itself."""
    expected = 1
    for d in range(x.dim() - 1, 1, -1):
        if x.shape[d] != 1 and x.stride(d) != expected:
            return None
        expected *= x.shape[d]
    B, T = x.shape[0], x.shape[1]
    if T == 1:
        return x.stride(0) if B > 1 else expected
    if B == 1 or x.stride(0) == T * x.stride(1):
        return x.stride(1)
    return None


def packed_tokens(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(x or a contiguous copy, its token stride)."""
    s = token_stride(x)
    if s is None:
        x = x.contiguous()
        s = token_stride(x)
    return x, s


def recurrent_block_v(programs_per_block: int, V: int) -> int:
    """Value columns per program: 32 (128-byte state rows) unless the grid would then have fewer than 256
    programs, then narrower. Swept on an H200 (H=32, V=128, CUDA graph): batch 1 BV 8/16/32/64 = 3.8/3.2/3.3/3.6
    us; batch 256 = 378/284/265/273 us."""
    bv = min(32, next_pow2(V))
    while bv > 8 and programs_per_block * cdiv(V, bv) < 256:
        bv //= 2
    return bv


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
    block_v: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton ``fused_recurrent_kda``: same contract as :func:`kimi_linear.ops.fused_recurrent_kda` (inputs
    already validated there). Computes in float32 whatever the input dtype; the state stays float32.

    With ``state_indices`` the pool ``initial_state`` is updated in place (rows not named are untouched).
    ``block_v``/``num_warps`` override the launch shape (benchmarks); leave them None.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    scale = K ** -0.5 if scale is None else scale
    if use_gate_in_kernel:
        check_gate_params(HV, K, A_log, dt_bias, lower_bound)
    elif A_log is not None or dt_bias is not None or lower_bound is not None:
        raise ValueError("`A_log`, `dt_bias` and `lower_bound` only apply with `use_gate_in_kernel=True`")
    (q, s_q), (k, s_k), (v, s_v), (g, s_g), (beta, s_b) = (packed_tokens(x) for x in (q, k, v, g, beta))
    if use_gate_in_kernel:
        A_log = A_log.contiguous()
        dt_bias = dt_bias.contiguous() if dt_bias is not None else None
    o = torch.empty(B, T, HV, V, dtype=q.dtype, device=q.device)

    if state_indices is not None:
        ht = initial_state                                   # the pool, updated in place
        store = True
    else:
        store = output_final_state
        ht = q.new_empty(N, HV, K, V, dtype=torch.float32) if store else None
    if initial_state is not None and not initial_state.is_contiguous():
        raise ValueError("`initial_state` must be contiguous")

    BK = next_pow2(K)
    BV = block_v or recurrent_block_v(N * HV, V)
    dummy = o                                                 # stands in for absent pointers (never read)
    grid = (cdiv(V, BV), N * HV)
    fused_recurrent_kda_fwd_kernel[grid](
        q, k, v, g, beta, o,
        initial_state if initial_state is not None else dummy,
        ht if ht is not None else dummy,
        A_log if use_gate_in_kernel else dummy,
        dt_bias if (use_gate_in_kernel and dt_bias is not None) else dummy,
        cu_seqlens if cu_seqlens is not None else dummy,
        state_indices if state_indices is not None else dummy,
        s_q, s_k, s_v, s_g, s_b,
        scale, float(lower_bound) if lower_bound is not None else 0.0, T,
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV,
        IS_VARLEN=cu_seqlens is not None, USE_INITIAL_STATE=initial_state is not None,
        STORE_FINAL_STATE=store, USE_STATE_INDICES=state_indices is not None,
        USE_QK_L2NORM=use_qk_l2norm_in_kernel, USE_GATE=use_gate_in_kernel,
        USE_LOWER_BOUND=lower_bound is not None, HAS_DT_BIAS=dt_bias is not None,
        USE_BETA_SIGMOID=use_beta_sigmoid_in_kernel, NEG_EIGVAL=allow_neg_eigval,
        num_warps=num_warps or (4 if BV >= 32 else 2), **pdl_args(q.device),
    )
    if state_indices is not None:
        return o, (initial_state if output_final_state else None)
    return o, ht
