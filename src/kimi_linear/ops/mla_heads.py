"""The per-head products around a NoPE MLA decode step in latent space (:mod:`kimi_linear.ops.mla_decode`).

With ``kv_b_proj``'s weight seen as ``[H, nope + v, C]`` (``W_k`` its first ``nope`` rows per head, ``W_v`` the
rest), a decode step of row b and head h is

    q_bh   = [q_nope_bh W_k[h] | q_rope_bh]          [C + R]   the absorbed query   (:func:`absorb_query`)
    ctx_bh = attention of q_bh over the latent pool   [C]       (:func:`~kimi_linear.ops.paged_mla_decode`)
    o_bh   = W_v[h] ctx_bh                            [v]       the head's output     (:func:`expand_values`)

Both products read 4 MB of weights for the 48B shape (32 heads, C = 512, nope = v = 128): on the H200 cuBLAS's
batched products took 3.8 us each and the concatenation with ``q_rope`` 2.1 more, ~10 us of an MLA layer's decode
step. On CUDA each is one Triton launch (:mod:`kimi_linear.ops.triton.mla_heads`) that writes straight into its
output (the absorbed query with its rope part), and takes part in programmatic dependent launch with the attention
kernels beside it; expand_values only up to EXPAND_KERNEL_ROWS rows (cuBLAS is faster on larger batches).
Products accumulate in float32 and round once to the input dtype, as the PyTorch path does.
"""

from __future__ import annotations

import torch

from .backend import for_inference, triton_op

# expand_values runs its kernel for batches up to this many rows (one row block of the kernel) and cuBLAS above:
# H200, bench/fused_small_gpu.py, 48B shapes, bf16: 2.97 / 3.17 us against cuBLAS's 3.36 / 3.42 at batch 1 / 5,
# 14.1 against 4.75 at batch 256 (absorb_query's kernel wins at every batch timed: 13.0 against 27.3 at 256).
EXPAND_KERNEL_ROWS = 16


def _check(name: str, x: torch.Tensor, w: torch.Tensor, k: int) -> None:
    if x.dim() != 3 or w.dim() != 3 or w.shape[0] != x.shape[1] or w.dtype != x.dtype or w.device != x.device:
        raise ValueError(f"{name}: expected x [B, H, ...] and weights [H, ...] of one dtype and device, got "
                         f"x {x.dtype} {tuple(x.shape)} on {x.device}, weights {w.dtype} {tuple(w.shape)} on "
                         f"{w.device}")
    if k > x.shape[2]:
        raise ValueError(f"{name}: x's last dimension {x.shape[2]} is shorter than the weights' {k}")


def absorb_query_torch(q: torch.Tensor, w_k: torch.Tensor) -> torch.Tensor:
    """:func:`absorb_query` in PyTorch."""
    nope = w_k.shape[1]
    return torch.cat([torch.einsum("bhn,hnc->bhc", q[..., :nope], w_k), q[..., nope:]], dim=-1)


def absorb_query(q: torch.Tensor, w_k: torch.Tensor) -> torch.Tensor:
    """q [B, H, nope + R] (``[q_nope | q_rope]``), w_k [H, nope, C] (any strides) -> the absorbed query
    [B, H, C + R] ``[q_nope W_k | q_rope]`` in q's dtype."""
    _check("absorb_query", q, w_k, w_k.shape[1])
    fast = for_inference(triton_op("absorb_query", q), q, w_k)
    return absorb_query_torch(q, w_k) if fast is None else fast(q, w_k)


def expand_values_torch(ctx: torch.Tensor, w_v: torch.Tensor) -> torch.Tensor:
    """:func:`expand_values` in PyTorch."""
    return torch.einsum("bhc,hvc->bhv", ctx, w_v)


def expand_values(ctx: torch.Tensor, w_v: torch.Tensor) -> torch.Tensor:
    """ctx [B, H, C], w_v [H, v, C] (any strides) -> every head's output ``W_v[h] ctx_bh``: [B, H, v] in ctx's
    dtype."""
    _check("expand_values", ctx, w_v, w_v.shape[2])
    if ctx.shape[2] != w_v.shape[2]:
        raise ValueError(f"expand_values: ctx's width {ctx.shape[2]} is not W_v's latent width {w_v.shape[2]}")
    fast = None
    if ctx.shape[0] <= EXPAND_KERNEL_ROWS:
        fast = for_inference(triton_op("expand_values", ctx), ctx, w_v)
    return expand_values_torch(ctx, w_v) if fast is None else fast(ctx, w_v)
