"""The KDA layer's decode token between its projections as one C call (``kda_decode_f32`` in ``decode.c``)."""

from __future__ import annotations

import torch

from . import cpu_float32_inference, library, matrix_strides, norm_args

# Rows up to which kda_block_decode runs: its products are plain loops over the weights, which beat the per-op
# overhead of the PyTorch path on a few rows and lose to BLAS's matrix products on many. `small` preset, the
# attention half of a KDA decoder layer with its weights cold, Intel box, 2 threads, us, one call / the norms,
# BLAS projections and kda_decode: 353 / 481 at 1 row, 486 / 600 at 4, 700 / 758 at 8, 1092 / 1022 at 16.
MAX_BLOCK_ROWS = 8


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


def kda_block_decode(
    x: torch.Tensor, packed: torch.Tensor, f_b: torch.Tensor, g_b: torch.Tensor | None, conv_weight: torch.Tensor,
    window: torch.Tensor, memory: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
    lower_bound: float | None, norm_weight: torch.Tensor, norm_eps: float, scale: float, o_weight: torch.Tensor,
    in_norm: tuple[torch.Tensor, float] | None = None, post_norm: tuple[torch.Tensor, float] | None = None,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor] | None:
    """A KDA layer's decode token from its input to its output projection, for B sequences, in one C call; or None
    where it does not apply (not CPU float32, gradients wanted, more than MAX_BLOCK_ROWS rows, other layouts):
    then the caller runs :func:`kda_decode` between its own projections.

    x [B, 1, Dm]; packed [3*H*D + R + G + H, Dm] the input projection's rows q|k|v, f_a, g_a, beta (G = R, or H*D
    with g_b None: g_a is the output gate); f_b, g_b [H*D, R]; o_weight [Dm, H*D]; the state and gate arguments
    as in :func:`kda_decode` (window, memory updated in place when ``rows`` is given, else new ones returned).
    in_norm (weight [Dm], eps): x is normed first. post_norm (weight [Dm], eps): the residual add and the next norm
    follow, ``out = x + o_proj(o)`` and ``normed = rms_norm(out)``; without it ``out = o_proj(o)``, normed None.
    Returns (out [B, 1, Dm], normed, window, memory)."""
    lib = library()
    if lib is None or x.dim() != 3 or x.shape[1] != 1 or not 0 < x.shape[0] <= MAX_BLOCK_ROWS:
        return None
    norms = [pair[0] for pair in (in_norm, post_norm) if pair is not None]
    if not cpu_float32_inference(x, packed, f_b, g_b, conv_weight, window, memory, A_log, dt_bias, norm_weight,
                                 o_weight, *norms):
        return None
    x = x.contiguous()
    B, Dm = x.shape[0], x.shape[2]
    H, HD = A_log.numel(), o_weight.shape[1]
    D, R, W, S = HD // H, f_b.shape[1], conv_weight.shape[0], window.shape[0]
    G = HD if g_b is None else R
    strides = [matrix_strides(w) for w in (packed, f_b, o_weight)] + [(0, 0) if g_b is None else
                                                                        matrix_strides(g_b)]
    if (any(s is None for s in strides) or H * D != HD or tuple(packed.shape) != (3 * HD + R + G + H, Dm)
            or tuple(f_b.shape) != (HD, R) or (g_b is not None and tuple(g_b.shape) != (HD, R))
            or tuple(o_weight.shape) != (Dm, HD) or tuple(conv_weight.shape) != (W, 3 * HD) or W < 2
            or tuple(window.shape) != (S, W - 1, 3 * HD) or tuple(memory.shape) != (S, H, D, D)
            or dt_bias.numel() != HD or not all(t.is_contiguous() for t in (conv_weight, A_log, dt_bias,
                                                                              norm_weight, *norms))):
        return None
    if rows is None:
        if S != B:
            return None
        window, memory = window.contiguous(), memory.contiguous()
        new_window, new_memory, rows_ptr = torch.empty_like(window), torch.empty_like(memory), None
    else:
        if not (window.is_contiguous() and memory.is_contiguous() and rows.dtype == torch.int64
                and tuple(rows.shape) == (B,) and rows.is_contiguous() and rows.device.type == "cpu"):
            return None
        new_window, new_memory, rows_ptr = window, memory, rows.data_ptr()
    out = torch.empty(B, 1, Dm)
    normed = torch.empty(B, 1, Dm) if post_norm is not None else None
    (p_so, p_si), (f_so, f_si), (o_so, o_si), (g_so, g_si) = strides
    status = lib.kda_block_decode_f32(
        B, Dm, H, D, R, W, S,
        x.data_ptr(), *norm_args(in_norm),
        packed.data_ptr(), p_so, p_si, f_b.data_ptr(), f_so, f_si, None if g_b is None else g_b.data_ptr(), g_so,
        g_si, conv_weight.data_ptr(), window.data_ptr(), new_window.data_ptr(), memory.data_ptr(),
        new_memory.data_ptr(), rows_ptr, A_log.data_ptr(), dt_bias.data_ptr(), lower_bound is not None,
        0.0 if lower_bound is None else lower_bound, norm_weight.data_ptr(), norm_eps, scale,
        o_weight.data_ptr(), o_so, o_si, *norm_args(post_norm), out.data_ptr(),
        None if normed is None else normed.data_ptr(),
        torch.get_num_threads(),
    )
    if status == -1:
        raise IndexError(f"kda_block_decode: `rows` must name rows of the {S}-row state pools, got {rows.tolist()}")
    if status != 0:
        raise MemoryError(f"kda_block_decode: no memory for the scratch of {B} rows")
    return out, normed, new_window, new_memory
