"""The short convolution of the KDA block: causal, depthwise, width W (4), then SiLU (docs/model.md §3, step 1).

    y_t = silu( sum_{j < W} w_j * x_{t - (W - 1 - j)} )      per channel; tap W - 1 is the current input

The inputs before the first (``past``, the layer's conv window in a cache, or the previous rank's last rows under
context parallelism) default to zeros; with ``pos`` (packed documents) a tap that would reach back past the start
of the token's document is dropped. On CUDA tensors :func:`short_conv` runs the Triton kernels of
:mod:`kimi_linear.ops.triton.conv` (forward and backward); this module is the PyTorch path and the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import for_inference, triton_op


def check_short_conv_inputs(x: torch.Tensor, weight: torch.Tensor, past: torch.Tensor | None,
                            pos: torch.Tensor | None) -> None:
    """Shapes and dtypes of :func:`short_conv`'s arguments; a ValueError names the one that is off."""
    if x.dim() != 3:
        raise ValueError(f"short_conv: x must be [B, T, C], got shape {tuple(x.shape)}")
    B, T, C = x.shape
    if weight.dim() != 2 or weight.shape[1] != C or weight.shape[0] < 1:
        raise ValueError(f"short_conv: weight must be [W, C={C}], got shape {tuple(weight.shape)}")
    W = weight.shape[0]
    if past is not None and tuple(past.shape) != (B, W - 1, C):
        raise ValueError(f"short_conv: past must be [B={B}, W-1={W - 1}, C={C}], got shape {tuple(past.shape)}")
    if pos is not None and (pos.dim() != 1 or pos.shape[0] != T or pos.dtype.is_floating_point):
        raise ValueError(f"short_conv: pos must be an integer tensor [T={T}], got {pos.dtype} {tuple(pos.shape)}")
    for name, t in (("weight", weight), ("past", past), ("pos", pos)):
        if t is not None and t.device != x.device:
            raise ValueError(f"short_conv: {name} is on {t.device}, x on {x.device}")


def next_window(x: torch.Tensor, past: torch.Tensor | None, W: int) -> torch.Tensor:
    """The last W - 1 inputs of ``[past; x]`` ([B, W-1, C], own memory): the next call's ``past``."""
    B, T, C = x.shape
    if T >= W - 1:
        return x[:, T - (W - 1):].clone()
    before = past if past is not None else x.new_zeros(B, W - 1, C)
    return torch.cat([before[:, T:].to(x.dtype), x], dim=1)


def short_conv_torch(x: torch.Tensor, weight: torch.Tensor, past: torch.Tensor | None = None,
                     pos: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`short_conv` in PyTorch, computed time-major as W shifted multiply-adds (no transposes; faster on CPU
    than a grouped conv1d), in x's dtype. The window of a one-token call is a view (decoding pays per op)."""
    B, T, C = x.shape
    W = weight.shape[0]
    w = weight.to(x.dtype)
    before = past.to(x.dtype) if past is not None else x.new_zeros(B, W - 1, C)
    full = torch.cat([before, x], dim=1)                                                 # [B, W-1+T, C]
    if T == 1 and pos is None:
        # Decode: one output is a W-tap dot product; the new window is the last W - 1 rows of `full`.
        return F.silu((full * w).sum(1, keepdim=True)), full[:, 1:]
    if pos is not None:
        # tap j reads the input W-1-j steps back: valid only when that many earlier tokens share the document
        y = full[:, W - 1:] * w[W - 1]
        for j in range(W - 1):
            y = y + full[:, j:j + T] * (pos >= W - 1 - j)[:, None].to(x.dtype) * w[j]
    else:
        y = full[:, 0:T] * w[0]
        for j in range(1, W):
            y = y.addcmul(full[:, j:j + T], w[j])
    return F.silu(y), full[:, T:].clone()


def short_conv(x: torch.Tensor, weight: torch.Tensor, past: torch.Tensor | None = None,
               pos: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise convolution + SiLU (module docstring).

    x: [B, T, C]; weight: [W, C] (row j multiplies the input W - 1 - j steps back); past: [B, W-1, C] the inputs
    before x (zeros when None); pos: [T] integer position of each token inside its packed document (B == 1).
    Differentiable in x, weight and past. Returns ``(y [B, T, C] in x's dtype, window [B, W-1, C])``: the window
    is the last W - 1 inputs, what the next call takes as ``past``.
    """
    check_short_conv_inputs(x, weight, past, pos)
    fast = triton_op("short_conv", x)
    if fast is None:
        return short_conv_torch(x, weight, past, pos)
    return fast(x, weight, past, pos), next_window(x, past, weight.shape[0])


def short_conv_varlen(x: torch.Tensor, weight: torch.Tensor, past: torch.Tensor,
                      cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`short_conv` over N sequences packed into one row, each continuing from its own past inputs.

    x: [1, T, C] the sequences' new inputs back to back, ``cu_seqlens`` [N + 1] their offsets; past: [N, W-1, C]
    each sequence's previous W - 1 inputs. Returns ``(y [1, T, C], windows [N, W-1, C])``, the windows being what
    each sequence continues from next. Each sequence is laid out as ``[past_n; x_n]`` in one extended row and
    convolved with document positions (no tap crosses into the sequence before), so one call of the op serves the
    whole batch; the W - 1 outputs of the past rows are dropped.
    """
    N, Wm1, C = past.shape
    lens = cu_seqlens.diff().to(x.device)
    ext = lens + Wm1                                                               # [N] extended lengths
    starts = torch.cumsum(ext, 0) - ext                                            # [N] extended offsets
    total = int(x.shape[1]) + N * Wm1
    doc = torch.repeat_interleave(torch.arange(N, device=x.device), ext, output_size=total)
    pos = torch.arange(total, device=x.device) - starts[doc]                      # position inside its extension
    is_new = pos >= Wm1
    full = x.new_empty(1, total, C)
    full[0, is_new] = x[0]
    full[0, ~is_new] = past.reshape(N * Wm1, C).to(x.dtype)
    y, _ = short_conv(full, weight, None, pos)
    ends = starts + ext                                                            # [N] one past each extension
    last = ends[:, None] - Wm1 + torch.arange(Wm1, device=x.device)[None]          # [N, W-1] last W-1 rows
    return y[:, is_new], full[0, last]


def check_short_conv_decode_inputs(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor,
                                   index: torch.Tensor) -> None:
    """Shapes, dtypes and devices of :func:`short_conv_decode`'s arguments; a ValueError names the one that is off."""
    if x.dim() not in (2, 3) or (x.dim() == 3 and x.shape[1] != 1):
        raise ValueError(f"short_conv_decode: x must be [B, C] or [B, 1, C], got shape {tuple(x.shape)}")
    B, C = x.shape[0], x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != C or weight.shape[0] < 1:
        raise ValueError(f"short_conv_decode: weight must be [W, C={C}], got shape {tuple(weight.shape)}")
    W = weight.shape[0]
    if conv_pool.dim() != 3 or conv_pool.shape[1:] != (W - 1, C):
        raise ValueError(f"short_conv_decode: conv_pool must be [slots, W-1={W - 1}, C={C}], got shape "
                         f"{tuple(conv_pool.shape)}")
    if index.shape != (B,) or index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"short_conv_decode: index must be an int32/int64 tensor [B={B}], got {index.dtype} "
                         f"{tuple(index.shape)}")
    for name, t in (("weight", weight), ("conv_pool", conv_pool), ("index", index)):
        if t.device != x.device:
            raise ValueError(f"short_conv_decode: {name} is on {t.device}, x on {x.device}")


def short_conv_decode(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor,
                      index: torch.Tensor) -> torch.Tensor:
    """One token of :func:`short_conv` per row, with the windows living in a pool that is updated in place.

    x: [B, C] or [B, 1, C] (may be a slice of a packed projection); weight: [W, C]; conv_pool: [slots, W-1, C] the
    last W - 1 inputs of each slot; index: [B] the slot of each row. Returns y in x's shape and dtype; afterwards
    ``conv_pool[index[b]]`` holds the last W - 1 inputs including x_b. Rows may share a slot only where they are
    padding (a scratch slot): their writes race and what ends up there is never read.

    On CUDA, when no gradient is needed, one Triton kernel does the gather, the convolution and the write-back
    (PyTorch: index_select, the conv, the next window, index_copy_); this path is the reference and the fallback.
    """
    check_short_conv_decode_inputs(x, weight, conv_pool, index)
    # The kernel computes and stores the window in float32: float64 stays on the PyTorch path.
    fast = for_inference(triton_op("short_conv_decode", x), x, weight)
    if fast is not None and conv_pool.stride(2) == 1 and conv_pool.stride(1) == x.shape[-1]:
        return fast(x, weight, conv_pool, index)
    past = conv_pool.index_select(0, index)
    y, window = short_conv(x.reshape(x.shape[0], 1, x.shape[-1]), weight, past)
    conv_pool.index_copy_(0, index, window.to(conv_pool.dtype))
    return y.view(x.shape)
