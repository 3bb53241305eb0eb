"""A KDA layer's decode token between its projections as one Triton kernel (:func:`kimi_linear.ops.kda_decode`).

At batch 1 a decode step of the layer after its packed input projection and the gates' up-projection used to be
three kernels (the short convolution on its window pool, the recurrent step, the gated output norm), each a few
microseconds of launch and round trips for a few kilobytes of data. Here one program per (row, head) runs the
whole token for its head, with the head's [D, D] memory in registers:

    q, k, v = silu(conv(window, x))  (the head's channels; the window shifted in place)
    q, k = l2norm(q) * scale, l2norm(k);  g = kda_gate(g_raw);  beta = sigmoid(beta_raw)
    S = diag(exp(g)) S;  S += k (beta (v - S^T k))^T;  o = S^T q            (docs/kda.md §7)
    o = o / sqrt(mean(o^2) + eps) * w * sigmoid(gate)                         (the gated RMSNorm, per head)

Key and value heads are one-to-one (the layer's layout: H heads of D channels for q, k and v).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunk_common import cast
from .conv import window_read, window_write
from .ints import next_pow2
from .pdl import pdl_args, pdl_entry
from .transforms import kda_gate, l2_normalize


@triton.jit
def gate_values(p_x, w, o_hd, m_d, R: tl.constexpr, BR: tl.constexpr, FOLD: tl.constexpr):
    """A gate's values on the head's channels o_hd ([BD] float32): with FOLD its up-projection ``W[o_hd] @ x``
    from the low-rank x [R] at p_x (W [*, R]), BR columns a step; else loaded from ``p_x + o_hd``."""
    if FOLD:
        b_y = tl.zeros([o_hd.shape[0]], dtype=tl.float32)
        for r0 in tl.static_range(0, R, BR):
            o_r = r0 + tl.arange(0, BR)
            m_r = o_r < R
            b_x = tl.load(p_x + o_r, mask=m_r, other=0.0).to(tl.float32)                            # [BR]
            b_w = tl.load(w + o_hd[:, None] * R + o_r[None, :], mask=m_d[:, None] & m_r[None, :],
                          other=0.0).to(tl.float32)                                                 # [BD, BR]
            b_y += tl.sum(b_w * b_x[None, :], 1)
        return b_y
    return tl.load(p_x + o_hd, mask=m_d, other=0.0).to(tl.float32)


@triton.jit
def kda_decode_kernel(
    qkv, g, gate, beta,               # [B, 3*H*D], [B, H*D or R] x2, [B, H] (row strides s_x, s_g, s_o, s_b)
    conv_w, window, memory, rows,     # [W, 3*H*D], [slots, W-1, 3*H*D], [slots, H, D, D] float32, [B] int64
    A_log, dt_bias, norm_w,           # [H], [H*D], [D]
    w_f, w_g,                         # [H*D, R]: the gates' up-projections when folded (FOLD_F, FOLD_G)
    o,                                # out: [B, H*D] contiguous, qkv's dtype
    s_x, s_g, s_o, s_b, scale, lower_bound, eps,
    H: tl.constexpr, D: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, BD: tl.constexpr,
    R: tl.constexpr, BR: tl.constexpr, FOLD_F: tl.constexpr, FOLD_G: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_entry(PDL)
    i_h, i_b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    C: tl.constexpr = 3 * H * D
    i_s = tl.load(rows + i_b).to(tl.int64)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    o_hd = i_h * D + o_d                                                   # [BD] this head's channels in H*D

    # the short convolution of the head's q, k and v channels; every window row is read before any is rewritten
    p_win = window + i_s * (W - 1) * C
    p_x = qkv + i_b * s_x
    b_fq, b_q = window_read(p_win, p_x, conv_w, o_hd, C, W, WP)                                      # [WP, BD], [BD]
    b_fk, b_k = window_read(p_win, p_x, conv_w, H * D + o_hd, C, W, WP)
    b_fv, b_v = window_read(p_win, p_x, conv_w, 2 * H * D + o_hd, C, W, WP)
    tl.debug_barrier()
    window_write(p_win, b_fq, o_hd, C, W, WP)
    window_write(p_win, b_fk, H * D + o_hd, C, W, WP)
    window_write(p_win, b_fv, 2 * H * D + o_hd, C, W, WP)
    b_q = l2_normalize(tl.where(m_d, b_q, 0.0), 0) * scale
    b_k = l2_normalize(tl.where(m_d, b_k, 0.0), 0)

    b_g = gate_values(g + i_b * s_g, w_f, o_hd, m_d, R, BR, FOLD_F)                                  # [BD]
    b_bias = tl.load(dt_bias + o_hd, mask=m_d, other=0.0).to(tl.float32)
    b_g = kda_gate(b_g, b_bias, tl.exp(tl.load(A_log + i_h).to(tl.float32)), lower_bound, USE_LOWER_BOUND)
    b_beta = tl.sigmoid(tl.load(beta + i_b * s_b + i_h).to(tl.float32))

    # the memory [D_k, D_v] of the row's slot: forget, delta-rule write, read with the query
    p_h = memory + (i_s * H + i_h) * D * D + o_d[:, None] * D + o_d[None, :]
    m_h = m_d[:, None] & m_d[None, :]
    b_h = tl.load(p_h, mask=m_h, other=0.0) * tl.exp(b_g)[:, None]                                   # [BD, BD]
    b_err = b_v - tl.sum(b_h * b_k[:, None], 0)                                                      # [BD]
    b_h += b_k[:, None] * (b_beta * b_err)[None, :]
    b_o = tl.sum(b_h * b_q[:, None], 0)                                                              # [BD]
    tl.store(p_h, b_h, mask=m_h)

    # the gated RMSNorm over the head's D outputs
    b_w = tl.load(norm_w + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_s = tl.sigmoid(gate_values(gate + i_b * s_o, w_g, o_hd, m_d, R, BR, FOLD_G))
    b_o = b_o * tl.rsqrt(tl.sum(b_o * b_o, 0) / D + eps) * b_w * b_s
    tl.store(o + i_b * (H * D) + o_hd, cast(b_o, o.dtype.element_ty), mask=m_d)


def kda_decode(qkv: torch.Tensor, g: torch.Tensor, gate: torch.Tensor, beta: torch.Tensor,
               conv_weight: torch.Tensor, window: torch.Tensor, memory: torch.Tensor, A_log: torch.Tensor,
               dt_bias: torch.Tensor, lower_bound: float | None, norm_weight: torch.Tensor, norm_eps: float,
               scale: float, rows: torch.Tensor, gate_weights: tuple | None = None) -> torch.Tensor:
    """:func:`kimi_linear.ops.kda_decode` for state pools (arguments checked there; ``rows`` given, window and
    memory updated in place): o [B, 1, H*D] in qkv's dtype."""
    B, H, D = qkv.shape[0], memory.shape[1], memory.shape[2]
    W = conv_weight.shape[0]
    w_f, w_g = gate_weights if gate_weights is not None else (None, None)
    q2, g2, gate2, beta2 = (t.reshape(B, -1) for t in (qkv, g, gate, beta))   # views of a packed projection's rows
    q2, g2, gate2, beta2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (q2, g2, gate2, beta2))
    o = torch.empty(B, 1, H * D, dtype=qkv.dtype, device=qkv.device)
    if B == 0:
        return o
    BD = next_pow2(D)
    R = w_f.shape[1] if w_f is not None else 1
    kda_decode_kernel[(H, B)](
        q2, g2, gate2, beta2, conv_weight.contiguous(), window, memory, rows.contiguous(),
        A_log.contiguous(), dt_bias.contiguous(), norm_weight.contiguous(),
        w_f.contiguous() if w_f is not None else o, w_g.contiguous() if w_g is not None else o, o,
        q2.stride(0), g2.stride(0), gate2.stride(0), beta2.stride(0), scale,
        0.0 if lower_bound is None else float(lower_bound), norm_eps,
        H=H, D=D, W=W, WP=next_pow2(W), BD=BD, R=R, BR=min(32, next_pow2(R)), FOLD_F=w_f is not None,
        FOLD_G=w_g is not None, USE_LOWER_BOUND=lower_bound is not None,
        num_warps=8 if BD >= 128 else 4, **pdl_args(qkv.device),
    )
    return o
