"""The KDA layer's decode token between its projections as one C call (``kda_decode_f32`` in ``decode.c``)."""

from __future__ import annotations

import torch

from . import cpu_float32_inference, library


def _rows_ok(t: torch.Tensor, D: int = 1) -> bool:
    """Each row of t ([B, 1, n] or [B, 1, H, D]) contiguous; the rows themselves may lie apart (columns of a packed
    projection's output)."""
    return t.stride(-1) == 1 and (t.dim() < 4 or t.stride(-2) == D)


def kda_decode_f32(
    qkv: torch.Tensor, g: torch.Tensor, gate: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor,
    window: torch.Tensor, memory: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    lower_bound: float | None, norm_weight: torch.Tensor, norm_eps: float, scale: float,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """:func:`kimi_linear.ops.kda_decode` on the CPU (shapes checked there), or None where the C kernel does not
    apply: not float32, gradients wanted, no C compiler, or an unsupported layout."""
    lib = library()
    if lib is None:
        return None
    if not cpu_float32_inference(qkv, g, gate, beta, conv_weight, window, memory, A_log, dt_bias, norm_weight):
        return None
    B, H, D = g.shape[0], g.shape[-2], g.shape[-1]
    W, S = conv_weight.shape[0], window.shape[0]
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
