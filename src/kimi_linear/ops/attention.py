"""Softmax attention that also returns each query's log-sum-exp, and the merge of partial results over key sets.

A prefill chunk of T new tokens with P tokens already cached attends to P + T keys. Building one ``[T, P + T]``
mask (2 GB of booleans for 2,048 queries at 1M keys) forces the slow masked kernels, and expanding all P cached
latents into per-head keys and values at once needs ~40 KB per key for Kimi-Linear-48B (43 GB at 1M). Instead
the keys are visited in blocks: the cached ones without any mask (every new token sees all of them), the new ones
with a square causal mask. Each block gives ``(out_i, lse_i)``; the exact softmax over the union is

    lse = log(sum_i e^lse_i),   out = sum_i e^(lse_i - lse) out_i

which :func:`merge_attention` applies one block at a time. :func:`attention_lse` runs the fused kernels where
PyTorch has them (flash attention on CUDA for 16-bit inputs, memory-efficient attention on CUDA for float32, the
CPU flash kernel) and a PyTorch path, tiled over the queries so its scores stay small, elsewhere (float64, head
widths the fused kernels refuse). Neither builds a ``[T, S]`` mask.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger("kimi_linear.ops")

# The PyTorch path computes [B, H, tile, S] scores: tile chosen to keep them near this many elements.
SCORE_ELEMENTS = 1 << 24
_FUSED_FAILED: set[tuple] = set()       # (device type, dtype) whose fused call raised once: PyTorch path from then


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    """Shapes of :func:`attention_lse`; a ValueError names the argument that is off."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or not t.is_floating_point():
            raise ValueError(f"attention_lse: `{name}` must be a floating [B, H, len, dim] tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    B, H, T, d = q.shape
    if k.shape[:2] != (B, H) or k.shape[3] != d:
        raise ValueError(f"attention_lse: `k` must be [B={B}, H={H}, S, {d}], got {tuple(k.shape)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"attention_lse: `v` must be [B={B}, H={H}, S={k.shape[2]}, dv], got {tuple(v.shape)}")
    if causal and k.shape[2] != T:
        raise ValueError(f"attention_lse: `causal` needs as many keys as queries (a square mask), got {T} queries "
                         f"and {k.shape[2]} keys")


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention and its log-sum-exp.

    q: [B, H, T, d]; k: [B, H, S, d]; v: [B, H, S, dv] (dv may differ from d); scale: the score factor.
    causal: query t sees keys 0..t only (needs S == T); otherwise every query sees every key.
    Returns ``(out [B, H, T, dv] in q's dtype, lse [B, H, T] float32, float64 for float64 inputs)`` with
    ``lse = log sum_j exp(scale * q . k_j)`` over the keys the query sees.
    """
    check_attention_inputs(q, k, v, causal)
    if q.shape[2] == 0:
        return q.new_empty(*q.shape[:3], v.shape[3]), q.new_empty(q.shape[:3], dtype=_lse_dtype(q))
    key = (q.device.type, q.dtype)
    if key not in _FUSED_FAILED:
        try:
            got = _fused(q, k, v, float(scale), causal)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as e:       # a kernel that refuses this shape or build: correct, slower path from here
            _FUSED_FAILED.add(key)
            log.warning("attention_lse: fused kernel failed on %s %s (%s); using the PyTorch path", *key, e)
            got = None
        if got is not None:
            return got
    return attention_lse_torch(q, k, v, scale, causal)


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _pad_v(v: torch.Tensor, d: int) -> torch.Tensor:
    """The flash kernels need v as wide as q and k: zero columns, dropped from the output afterwards."""
    return F.pad(v, (0, d - v.shape[3])) if v.shape[3] < d else v


def attention_kernel(q: torch.Tensor, v_dim: int | None = None) -> str:
    """Which kernel :func:`attention_lse` runs for queries like ``q`` [B, H, T, d] and values ``v_dim`` wide (default
    d): ``"flash"`` (CUDA, 16-bit), ``"efficient"`` (CUDA, float32 or head widths flash refuses), ``"cpu-flash"``,
    or ``"torch"`` (the PyTorch path; also after a fused kernel failed once on this device and dtype)."""
    d = q.shape[-1]
    dv = d if v_dim is None else v_dim
    if (q.device.type, q.dtype) in _FUSED_FAILED:
        return "torch"
    if q.device.type == "cuda":
        if q.dtype in (torch.float16, torch.bfloat16) and dv <= d <= 256 and d % 8 == 0:
            return "flash"
        if q.dtype in (torch.float32, torch.float16, torch.bfloat16) and d % 4 == 0 and dv % 4 == 0:
            return "efficient"
    elif q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16) and dv <= d:
        return "cpu-flash"
    return "torch"


def _fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           causal: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """PyTorch's fused attention kernels that return the log-sum-exp (the ones its own context-parallel ring
    attention merges with), or None where there is none for these inputs."""
    d, dv, T = q.shape[3], v.shape[3], q.shape[2]
    kernel = attention_kernel(q, dv)
    aten = torch.ops.aten
    if kernel == "flash":
        out, lse = aten._scaled_dot_product_flash_attention(q, k, _pad_v(v, d), 0.0, causal, False, scale=scale)[:2]
        return out[..., :dv], lse[..., :T].float()
    if kernel == "efficient":
        out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)[:2]
        return out, lse[..., :T].float()            # some versions pad the lse's query axis to a multiple of 32
    if kernel == "cpu-flash":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, _pad_v(v, d), 0.0, causal, scale=scale)
        return out[..., :dv], lse[..., :T].float()
    return None


def attention_lse_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_lse` in PyTorch, float32 arithmetic (float64 for float64 inputs), tiled over the queries
    so the scores of one tile stay near :data:`SCORE_ELEMENTS` elements."""
    B, H, T, _ = q.shape
    S = k.shape[2]
    acc = _lse_dtype(q)
    tile = max(1, SCORE_ELEMENTS // max(1, B * H * S))
    kf, vf = k.to(acc), v.to(acc)
    outs, lses = [], []
    for t0 in range(0, T, tile):
        t1 = min(T, t0 + tile)
        s = (q[:, :, t0:t1].to(acc) @ kf.transpose(-1, -2)) * float(scale)                  # [B, H, t, S]
        if causal:
            ahead = torch.arange(S, device=q.device)[None] > torch.arange(t0, t1, device=q.device)[:, None]
            s = s.masked_fill(ahead, float("-inf"))
        lse = torch.logsumexp(s, -1)
        outs.append((torch.exp(s - lse[..., None]) @ vf).to(q.dtype))
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2)


def merge_attention(acc: tuple[torch.Tensor, torch.Tensor] | None, out: torch.Tensor,
                    lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold one key block's ``(out [.., T, dv], lse [.., T])`` into the running ``acc`` (None before the first
    block). Returns the new ``(out, lse)``: out in float32 (float64 for float64), the softmax over the union of
    the key sets so far. Every query must see at least one key in each block (an lse of -inf in both would give
    NaN)."""
    dt = torch.float64 if lse.dtype == torch.float64 else torch.float32
    out, lse = out.to(dt), lse.to(dt)
    if acc is None:
        return out, lse
    a_out, a_lse = acc
    new = torch.logaddexp(a_lse, lse)
    w = torch.exp(lse - new)[..., None]                     # the new block's share; finite: new >= lse
    return a_out + w * (out - a_out), new
