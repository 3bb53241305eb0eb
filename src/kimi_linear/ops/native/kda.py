"""The KDA layer's decode token between its projections as one C call (``kda_decode_f32`` in ``decode.c``)."""

from __future__ import annotations

import torch

from . import cpu_float32_inference, library


def _rows_ok(t: torch.Tensor, D: int = 1) -> bool:
    """Each row of t ([B, 1, n] or [B, 1, H, D]) contiguous; the rows themselves may lie apart (columns of a packed
    projection's output)."""
    return t.stride(-1) == 1 and (t.dim() < 4 or t.stride(-2) == D)


def kda_decode(
    qkv: torch.Tensor, g: torch.Tensor, gate: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor,
    window: torch.Tensor, memory: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    lower_bound: float | None, norm_weight: torch.Tensor, norm_eps: float, scale: float,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """One token of a KDA layer for B sequences after its input projections, or None where the kernels do not
    apply (then the caller runs its PyTorch ops): not CPU float32, gradients wanted, or an unsupported layout.

    qkv [B, 1, 3*H*D] projected q|k|v; g [B, 1, H, D] the raw forget gate; gate [B, 1, H, D] the output gate's
    pre-activation; beta [B, 1, H] raw; conv_weight [W, 3*H*D]; window [S, W-1, 3*H*D] and memory [S, H, D, D]
    the conv inputs and recurrent memory; A_log [H], dt_bias [H*D]; norm_weight [D].

    rows None: S == B, the state of sequence b is row b, and new state tensors are returned (the given ones are
    not modified). rows [B] int64: window and memory are serving pools, updated in place in those rows.
    Returns (o [B, 1, H*D]: RMSNorm(o) * norm_weight * sigmoid(gate) per head, new window, new memory).
    """
    lib = library()
    if lib is None:
        return None
    if not cpu_float32_inference(qkv, g, gate, beta, conv_weight, window, memory, A_log, dt_bias, norm_weight):
        return None
    B, H, D = g.shape[0], g.shape[-2], g.shape[-1]
    W, C, S = conv_weight.shape[0], 3 * H * D, window.shape[0]
    expected = {"qkv": (qkv, (B, 1, C)), "g": (g, (B, 1, H, D)), "gate": (gate, (B, 1, H, D)),
                "beta": (beta, (B, 1, H)), "conv_weight": (conv_weight, (W, C)), "window": (window, (S, W - 1, C)),
                "memory": (memory, (S, H, D, D)), "rows": (rows, (B,))}
    for name, (t, shape) in expected.items():
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"kda_decode: `{name}` must be {list(shape)}, got {list(t.shape)}")
    if rows is None and S != B:
        raise ValueError(f"kda_decode: without `rows` the states hold one row per sequence ({B}), got {S}")
    if not (_rows_ok(qkv) and _rows_ok(beta) and _rows_ok(g, D) and _rows_ok(gate, D) and W >= 2
            and conv_weight.is_contiguous() and A_log.numel() == H and dt_bias.numel() == H * D
            and A_log.is_contiguous() and dt_bias.is_contiguous() and norm_weight.is_contiguous()):
        return None
    if rows is None:
        window, memory = window.contiguous(), memory.contiguous()
        new_window, new_memory = torch.empty_like(window), torch.empty_like(memory)
        rows_ptr = None
    else:
        if not (window.is_contiguous() and memory.is_contiguous() and rows.dtype == torch.int64
                and rows.is_contiguous() and rows.device.type == "cpu"):
            return None
        new_window, new_memory, rows_ptr = window, memory, rows.data_ptr()
    out = torch.empty(B, 1, H * D, dtype=torch.float32)
    status = lib.kda_decode_f32(
        B, H, D, W, S,
        qkv.data_ptr(), qkv.stride(0), g.data_ptr(), g.stride(0), gate.data_ptr(), gate.stride(0), beta.data_ptr(),
        beta.stride(0),
        conv_weight.data_ptr(), window.data_ptr(), new_window.data_ptr(), memory.data_ptr(), new_memory.data_ptr(),
        rows_ptr, A_log.data_ptr(), dt_bias.data_ptr(), lower_bound is not None,
        0.0 if lower_bound is None else lower_bound, norm_weight.data_ptr(), norm_eps, scale, out.data_ptr(),
        torch.get_num_threads(),
    )
    if status != 0:
        raise IndexError(f"kda_decode: `rows` must name rows of the {S}-row state pools, got {rows.tolist()}")
    return out, new_window, new_memory
