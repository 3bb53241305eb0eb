"""RMSNorm of the residual stream, and the residual add fused with it (docs/model.md: pre-norm decoder layers).

    n = x / sqrt(mean(x^2) + eps)            in float32
    y = weight * n.to(x.dtype)               (16-bit x: the cast comes *before* the weight multiply, as the
                                              published checkpoints were trained and as transformers does)
    add_rms_norm(x, delta) = (s, rms_norm(s))   with s = x + delta rounded to the dtype as torch's add does

On CUDA tensors, when no gradient is needed, both run the Triton kernels of :mod:`kimi_linear.ops.triton.rms_norm`
(one kernel for the norm, one for add + norm, instead of 4 and 5 PyTorch kernels: a decode step is dominated by
per-kernel overhead); on small CPU float32 tensors (a decode step's rows) the C kernels of
:mod:`kimi_linear.ops.native.norm`, for the same reason; this module is the PyTorch path, the training path and the
reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import for_inference, triton_op
from .native import norm as native
from .norm import upcast


def check_rms_norm_inputs(x: torch.Tensor, weight: torch.Tensor) -> None:
    """A ValueError naming the argument whose shape or device does not fit."""
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm: weight must be [x.shape[-1]] for x {tuple(x.shape)}, got {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"rms_norm: weight is on {weight.device}, x on {x.device}")


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm` in PyTorch."""
    # F.rms_norm is the formula in one fused op; when nothing is cast, the weight goes in too.
    if x.dtype == weight.dtype and x.dtype in (torch.float32, torch.float64):
        return F.rms_norm(x, (x.shape[-1],), weight, eps=eps)
    return weight * F.rms_norm(upcast(x), (x.shape[-1],), eps=eps).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x: [..., D], weight: [D] -> [..., D] (module docstring) in ``torch.promote_types(weight.dtype, x.dtype)``
    (x's dtype when they match). Differentiable (through the PyTorch path)."""
    check_rms_norm_inputs(x, weight)
    fast = for_inference(triton_op("rms_norm", x), x, weight)
    if fast is not None:
        return fast(x, weight, eps)
    y = native.rms_norm(x, weight, eps) if x.device.type == "cpu" else None
    return y if y is not None else rms_norm_torch(x, weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm: ``(s, rms_norm(s, weight))`` with ``s = x + delta``; x, delta:
    [..., D] of one shape. Returns s (x's dtype when delta's matches, else torch's promotion) and the norm as
    :func:`rms_norm` gives it."""
    check_rms_norm_inputs(x, weight)
    if delta.shape != x.shape or delta.device != x.device:
        raise ValueError(f"add_rms_norm: delta must be x's shape {tuple(x.shape)} on {x.device}, got "
                         f"{tuple(delta.shape)} on {delta.device}")
    fast = for_inference(triton_op("add_rms_norm", x), x, weight, delta) if delta.dtype == x.dtype else None
    if fast is not None:
        return fast(x, delta, weight, eps)
    done = native.add_rms_norm(x, delta, weight, eps) if x.device.type == "cpu" else None
    if done is not None:
        return done
    s = x + delta
    return s, rms_norm_torch(s, weight, eps)


def project_add_rms_norm(x: torch.Tensor, o: torch.Tensor, w_o: torch.Tensor, weight: torch.Tensor,
                         eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's output projection, residual add and next norm: ``add_rms_norm(x, o @ w_o^T)`` with the
    projection rounded to o's dtype first, as a separate projection would. x [..., D], o [..., K] (x's leading
    shape), w_o [D, K] (o_proj's weight, no bias).

    On CUDA without gradients for up to PROJECT_MAX_ROWS rows (decode steps), two Triton launches: the projection
    as split-K float32 partial sums (a [2304, 4096] projection is only 36 tiles of 64 rows: cuBLAS splits it too,
    then reduces in a kernel of its own), summed by the add + norm kernel. Else the separate projection."""
    check_rms_norm_inputs(x, weight)
    if (o.shape[:-1] != x.shape[:-1] or w_o.dim() != 2 or w_o.shape != (x.shape[-1], o.shape[-1])
            or o.dtype != x.dtype or w_o.dtype != x.dtype):
        raise ValueError(f"project_add_rms_norm: expected o [..., K] with x's leading shape and w_o [D, K] in x's "
                         f"dtype, got x {x.dtype} {tuple(x.shape)}, o {o.dtype} {tuple(o.shape)}, w_o {w_o.dtype} "
                         f"{tuple(w_o.shape)}")
    fast = _project_fast(x, o, w_o, weight)
    if fast is not None:
        return fast(x, o, w_o, weight, eps)
    return add_rms_norm(x, F.linear(o, w_o), weight, eps)


PROJECT_MAX_ROWS = 16       # the split-K kernel's row block (ops/triton/splitk.py)


def _project_fast(x: torch.Tensor, o: torch.Tensor, w_o: torch.Tensor, weight: torch.Tensor):
    fast = for_inference(triton_op("project_add_rms_norm", x), x, o, w_o, weight)
    if fast is not None and x.numel() // x.shape[-1] <= PROJECT_MAX_ROWS and w_o.stride(1) == 1:
        return fast
    return None


def project_fused(x: torch.Tensor, o_weight: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`project_add_rms_norm` runs its fused kernels for a residual x and a projection weight (a
    decoder layer folds its output projection into the norm only then: elsewhere the separate projection keeps its
    own path, e.g. the CPU's thread-parallel one-row product)."""
    return _project_fast(x, x, o_weight, weight) is not None      # (o: x's rows, dtype and gradient status)


def rms_norm_write(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor,
                   rows: torch.Tensor) -> None:
    """Rows of ``[rms_norm(x[:, :D], weight) | x[:, D:]]`` (D = weight's size) stored at rows ``rows`` of ``out``:
    x [N, W], out [M, W] (e.g. a paged pool viewed flat; written in place, cast to its dtype), rows [N] int64 (not
    range-checked: that would read them on the host). An MLA decode step's new cache entries, normed latent and
    rope key, written into the pool by one kernel on CUDA instead of a norm, a concatenation and an index copy.
    Inference only."""
    check_rms_norm_inputs(x[..., : weight.shape[0]], weight)
    N, W = x.shape if x.dim() == 2 else (None, None)
    if x.dim() != 2 or out.dim() != 2 or out.shape[1] != W or tuple(rows.shape) != (N,) \
            or rows.dtype != torch.int64 or not (out.device == rows.device == x.device):
        raise ValueError(f"rms_norm_write: x must be [N, W], out [M, W] and rows int64 [N] on x's device, got x "
                         f"{tuple(x.shape)}, out {tuple(out.shape)} on {out.device}, rows {rows.dtype} "
                         f"{tuple(rows.shape)} on {rows.device}")
    fast = for_inference(triton_op("rms_norm_write", x), x, weight, out)
    if fast is not None and out.stride(1) == 1:
        fast(x, weight, eps, out, rows)
        return
    D = weight.shape[0]
    entry = torch.cat([rms_norm_torch(x[:, :D], weight, eps), x[:, D:]], dim=-1)
    out.index_copy_(0, rows, entry.to(out.dtype))
