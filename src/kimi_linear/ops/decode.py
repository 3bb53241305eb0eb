"""A KDA layer's decode token between its projections as one kernel: the short convolution on the conv window,
the in-kernel transforms, the recurrent step on the memory and the gated output norm (docs/model.md §3).

On the CPU the C kernel of :mod:`kimi_linear.ops.native.kda` runs it (float32); on CUDA, for serving pools, the
Triton kernel of :mod:`kimi_linear.ops.triton.decode`. Where neither applies :func:`kda_decode` answers None
and the layer runs its PyTorch ops, which are the reference for both.
"""

from __future__ import annotations

import torch

from .backend import for_inference, triton_op
from .native.kda import kda_decode_f32


def check_kda_decode_inputs(qkv: torch.Tensor, g: torch.Tensor, gate: torch.Tensor, beta: torch.Tensor,
                            conv_weight: torch.Tensor, window: torch.Tensor, memory: torch.Tensor,
                            rows: torch.Tensor | None, gate_weights: tuple | None = None) -> None:
    """Shapes of :func:`kda_decode`'s tensors (H and D from memory); a ValueError names the one that is off."""
    if memory.dim() != 4 or memory.shape[2] != memory.shape[3]:
        raise ValueError(f"kda_decode: `memory` must be [S, H, D, D], got {list(memory.shape)}")
    B, (S, H, D) = qkv.shape[0], memory.shape[:3]
    W, C = conv_weight.shape[0], 3 * H * D
    w_f, w_g = gate_weights if gate_weights is not None else (None, None)
    R = w_f.shape[-1] if w_f is not None else 0
    expected = {"qkv": (qkv, (B, 1, C)), "g": (g, (B, 1, R) if w_f is not None else (B, 1, H, D)),
                "gate": (gate, (B, 1, R) if w_g is not None else (B, 1, H, D)), "beta": (beta, (B, 1, H)),
                "conv_weight": (conv_weight, (W, C)), "window": (window, (S, W - 1, C)), "rows": (rows, (B,)),
                "gate_weights[0]": (w_f, (H * D, R)), "gate_weights[1]": (w_g, (H * D, R))}
    for name, (t, shape) in expected.items():
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"kda_decode: `{name}` must be {list(shape)}, got {list(t.shape)}")
    if rows is None and S != B:
        raise ValueError(f"kda_decode: without `rows` the states hold one row per sequence ({B}), got {S}")


def kda_decode(
    qkv: torch.Tensor, g: torch.Tensor, gate: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor,
    window: torch.Tensor, memory: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    lower_bound: float | None, norm_weight: torch.Tensor, norm_eps: float, scale: float,
    rows: torch.Tensor | None = None, gate_weights: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """One token of a KDA layer for B sequences after its input projections, or None where no kernel applies
    (gradients wanted; on the CPU: not float32, or no C compiler; on CUDA: without ``rows``, or a pool that is not
    contiguous or not float32 memory).

    qkv [B, 1, 3*H*D] projected q|k|v; g [B, 1, H, D] the raw forget gate; gate [B, 1, H, D] the output gate's
    pre-activation; beta [B, 1, H] raw; conv_weight [W, 3*H*D]; window [S, W-1, 3*H*D] and memory [S, H, D, D]
    the conv inputs and recurrent memory; A_log [H], dt_bias [H*D]; norm_weight [D]. The gate is
    ``-exp(A_log) softplus(g + dt_bias)``, or with ``lower_bound`` ``lower_bound sigmoid(exp(A_log) (g + dt_bias))``;
    beta is ``sigmoid(beta)``; q and k are l2-normalised, q scaled by ``scale``.

    rows None: S == B, the state of sequence b is row b, and new state tensors are returned (the given ones are
    not modified). rows [B] int64: window and memory are serving pools, updated in place in those rows (on the
    CPU a row outside the pool raises an IndexError before anything is written; CUDA rows are not checked: the
    pool's owner made them, and a check would cost a synchronisation every step).
    gate_weights: (f_b [H*D, R], g_b [H*D, R] or None): g (and gate, with g_b) are then the low-rank [B, 1, R]
    inputs of the gates' up-projections, which the kernel applies itself (CUDA pools only; None elsewhere).
    Returns (o [B, 1, H*D]: RMSNorm(o) * norm_weight * sigmoid(gate) per head, window, memory).
    """
    check_kda_decode_inputs(qkv, g, gate, beta, conv_weight, window, memory, rows, gate_weights)
    if qkv.device.type == "cpu" and triton_op("kda_decode", qkv) is None:
        if gate_weights is not None:
            return None
        return kda_decode_f32(qkv, g, gate, beta, conv_weight, window, memory, A_log, dt_bias, lower_bound,
                              norm_weight, norm_eps, scale, rows)
    weights = [w for w in (gate_weights or ()) if w is not None]
    fast = for_inference(triton_op("kda_decode", qkv), qkv, g, gate, beta, conv_weight, window, A_log, dt_bias,
                         norm_weight, *weights)
    H, D = memory.shape[1], memory.shape[2]
    if (fast is None or rows is None or memory.dtype != torch.float32 or not window.is_contiguous()
            or not memory.is_contiguous() or rows.dtype != torch.int64 or A_log.numel() != H
            or dt_bias.numel() != H * D):
        return None
    return fast(qkv, g, gate, beta, conv_weight, window, memory, A_log, dt_bias, lower_bound, norm_weight,
                norm_eps, scale, rows, gate_weights), window, memory
