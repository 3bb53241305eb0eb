"""One decode step of NoPE MLA in latent space over a paged pool of cached entries (issue 18).

Every cached token holds one entry ``[latent (C = kv_lora_rank) | k_rope (R)]`` shared by all heads. With the
absorbed query ``q = [q_nope W_k | q_rope]`` ([B, H, C + R]) the step of row b and head h is

    s_j   = scale * q_bh . K_bj                 j < seq_lens[b]   (K_bj: the row's j-th entry, all C + R columns)
    ctx_bh = sum_j softmax(s)_j * K_bj[:C]      ([C]; the layer multiplies by W_v afterwards)

Row b's j-th entry lives at ``cache[block_table[b, j // block_size], j % block_size]``. On CUDA tensors
:func:`paged_mla_decode` runs the flash-decoding kernels of :mod:`kimi_linear.ops.triton.mla_decode`, which read
each entry once straight from its block (for all heads of a head block at once) and never copy the history; this
module's PyTorch path gathers the blocks into a dense buffer and is the reference and the CPU path. Neither reads
a device value on the host, so both can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from .backend import triton_op

_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INDEX = (torch.int32, torch.int64)


def check_paged_mla_decode_inputs(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                                  seq_lens: torch.Tensor, scale: float, kv_lora_rank: int,
                                  num_splits: int | None = None) -> None:
    """Shapes, dtypes and devices of :func:`paged_mla_decode`'s arguments; a ValueError names the one that is off.

    The values of ``block_table`` and ``seq_lens`` are not read (that would synchronise with the device and break
    CUDA-graph capture): keeping them in range is the caller's contract.
    """
    def need(name: str, t: object) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"paged_mla_decode: `{name}` must be a torch.Tensor, got {type(t).__name__}")
        return t

    need("q", q)
    if q.dim() != 3 or q.dtype not in _FLOAT:
        raise ValueError(f"paged_mla_decode: `q` must be a floating [B, H, C + R] tensor, got {q.dtype} "
                         f"{tuple(q.shape)}")
    B, H, W = q.shape
    need("cache", cache)
    if cache.dim() != 3 or cache.dtype not in _FLOAT or cache.shape[2] != W:
        raise ValueError(f"paged_mla_decode: `cache` must be a floating [num_blocks, block_size, C + R = {W}] "
                         f"tensor, got {cache.dtype} {tuple(cache.shape)}")
    if cache.shape[0] < 1 or cache.shape[1] < 1:
        raise ValueError(f"paged_mla_decode: `cache` has no blocks or an empty block size: {tuple(cache.shape)}")
    if not cache.is_contiguous():
        # the pool is written in place by the layer and read by flat row index: a copy would be gigabytes, silently
        raise ValueError("paged_mla_decode: `cache` must be contiguous (a block pool, not a view of one)")
    if isinstance(kv_lora_rank, bool) or not isinstance(kv_lora_rank, int) or not 0 < kv_lora_rank <= W:
        raise ValueError(f"paged_mla_decode: `kv_lora_rank` must be an int in [1, {W}] (the latent part of the "
                         f"entry), got {kv_lora_rank!r}")
    need("block_table", block_table)
    if block_table.dim() != 2 or block_table.shape[0] != B or block_table.shape[1] < 1 \
            or block_table.dtype not in _INDEX:
        raise ValueError(f"paged_mla_decode: `block_table` must be an int32/int64 [B = {B}, max_blocks >= 1] "
                         f"tensor, got {block_table.dtype} {tuple(block_table.shape)}")
    need("seq_lens", seq_lens)
    if tuple(seq_lens.shape) != (B,) or seq_lens.dtype not in _INDEX:
        raise ValueError(f"paged_mla_decode: `seq_lens` must be an int32/int64 [B = {B}] tensor, got "
                         f"{seq_lens.dtype} {tuple(seq_lens.shape)}")
    for name, t in (("cache", cache), ("block_table", block_table), ("seq_lens", seq_lens)):
        if t.device != q.device:
            raise ValueError(f"paged_mla_decode: `{name}` is on {t.device}, `q` on {q.device}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < float(scale) < float("inf"):
        raise ValueError(f"paged_mla_decode: `scale` must be a positive finite number, got {scale!r}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or num_splits < 1):
        raise ValueError(f"paged_mla_decode: `num_splits` must be None or an int >= 1, got {num_splits!r}")


def paged_mla_decode_torch(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`paged_mla_decode` in PyTorch: gather every table block ([B, max_blocks * block_size, C + R]), then
    dense float32 (float64 for float64 inputs) attention with the keys at or past ``seq_lens`` masked. Returns
    ``(ctx [B, H, C] in q's dtype, lse [B, H] in that float32 / float64)``.

    Masked keys are zeroed as well as given no weight: a block past a row's length may hold anything, NaN
    included, and ``0 * NaN`` would leak it into the product.
    """
    B, H, W = q.shape
    bs = cache.shape[1]
    nb = block_table.shape[1]
    L = nb * bs
    acc = torch.promote_types(torch.promote_types(q.dtype, cache.dtype), torch.float32)   # float64 stays float64
    entry = cache.index_select(0, block_table.reshape(-1).long()).view(B, L, W).to(acc)   # [B, L, W]
    valid = torch.arange(L, device=q.device)[None] < seq_lens[:, None]                    # [B, L]
    entry = entry.masked_fill(~valid[..., None], 0.0)
    s = torch.einsum("bhw,blw->bhl", q.to(acc), entry) * float(scale)                     # [B, H, L]
    s = s.masked_fill(~valid[:, None], float("-inf"))
    lse = torch.logsumexp(s, -1)                                                           # [B, H]; -inf: no keys
    # a row without keys (seq_len 0, e.g. a padding row) gets ctx 0, not the NaN of an empty softmax
    p = torch.where(valid[:, None], torch.exp(s - lse[..., None]), 0.0)
    ctx = torch.einsum("bhl,blc->bhc", p, entry[..., :kv_lora_rank])
    return ctx.to(q.dtype), lse


def paged_mla_decode(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, kv_lora_rank: int, num_splits: int | None = None,
                     return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of one absorbed query per row and head over the row's paged latent entries.

    q: [B, H, C + R] the absorbed query ``[q_nope W_k | q_rope]`` (any float dtype; float32 accumulation).
    cache: [num_blocks, block_size, C + R] one MLA layer's block pool (contiguous).
    block_table: int32/int64 [B, max_blocks] row b's blocks in order; entries at or past
        ``ceil(seq_lens[b] / block_size)`` are never read (they may be anything).
    seq_lens: int32/int64 [B] keys of row b, the new token's entry already written; 1 <= seq_lens[b] <=
        max_blocks * block_size (longer is cut there; 0 gives ctx 0 and lse -inf).
    scale: the softmax scale ((nope + rope) ** -0.5 for NoPEMLA). kv_lora_rank: C, the latent width.
    num_splits: how many pieces each row's keys are cut into on the GPU (flash decoding); None picks it from the
        static shapes only (:func:`kimi_linear.ops.triton.mla_decode.default_num_splits`), so the launch can be
        captured in a CUDA graph. Ignored by the PyTorch path.

    Returns ctx [B, H, C] in q's dtype ``= softmax(scale * q K^T) K[:, :C]``, and with ``return_lse`` also
    lse [B, H] float32 (float64 for float64 inputs), the natural log of the softmax denominator (for merging
    with other key sets).
    """
    check_paged_mla_decode_inputs(q, cache, block_table, seq_lens, scale, kv_lora_rank, num_splits)
    fast = triton_op("paged_mla_decode", q)
    if fast is not None and q.dtype != torch.float64 and cache.dtype != torch.float64:
        ctx, lse = fast(q, cache, block_table, seq_lens, float(scale), kv_lora_rank, num_splits=num_splits)
    else:
        ctx, lse = paged_mla_decode_torch(q, cache, block_table, seq_lens, scale, kv_lora_rank)
    return (ctx, lse) if return_lse else ctx
