"""An MLA decoder layer's decode token, input norm to the next norm, as one C call (``mla_block_decode_f32`` in
``decode.c``)."""

from __future__ import annotations

import torch

from . import cpu_float32_inference, library, matrix_strides, norm_args

# Rows up to which mla_block_decode runs (as ``kda.MAX_BLOCK_ROWS``: its products are plain loops).
MAX_BLOCK_ROWS = 8


def check_paged_ranges(pool: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor,
                       dst: torch.Tensor) -> None:
    """The C call reads the pool wherever the table and lengths point and writes at ``dst``: every table entry a
    block of the pool (the engine's tables name the scratch block where unused), each length within the table's
    reach, each destination a row of the pool; else an error names the argument (the PyTorch path's gather would
    raise too)."""
    num_blocks, block_size = pool.shape[0], pool.shape[1]
    lo, hi = torch.aminmax(block_table)
    if lo < 0 or hi >= num_blocks:
        raise IndexError(f"mla_block_decode: `block_table` names blocks outside the pool's {num_blocks}: "
                         f"{int(lo)} .. {int(hi)}")
    lo, hi = torch.aminmax(lengths)
    if lo < 0 or hi > block_table.shape[1] * block_size:
        raise ValueError(f"mla_block_decode: `lengths` must lie in [0, {block_table.shape[1] * block_size}] (the "
                         f"table's blocks of {block_size}), got {int(lo)} .. {int(hi)}")
    lo, hi = torch.aminmax(dst)
    if lo < 0 or hi >= num_blocks * block_size:
        raise IndexError(f"mla_block_decode: `dst` must name rows of the {num_blocks * block_size}-row pool, got "
                         f"{int(lo)} .. {int(hi)}")


def mla_block_decode(
    x: torch.Tensor, packed: torch.Tensor, kv_norm: tuple[torch.Tensor, float], kv_b: torch.Tensor,
    o_weight: torch.Tensor, num_heads: int, nope: int, rope: int, scale: float, cache: torch.Tensor,
    lengths: torch.Tensor, block_table: torch.Tensor | None = None, dst: torch.Tensor | None = None,
    in_norm: tuple[torch.Tensor, float] | None = None, post_norm: tuple[torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """One token of a NoPE MLA layer for B sequences, from its input to its output projection, or None where the
    call does not apply (not CPU float32, gradients wanted, more than MAX_BLOCK_ROWS rows, other layouts): then
    the caller runs the layer.

    x [B, 1, Dm]; packed [H*(nope+rope) + C + rope, Dm] the projections that read x (q, then the latent and rope
    key); kv_norm (weight [C], eps) the latent's norm; kv_b [H*(nope+v), C] kv_b_proj's weight; o_weight [Dm, H*v].
    The cache holds entries ``[normed latent | rope key]`` of C + rope floats and receives this token's:
    - dense (block_table None): cache [B, >= L, C + rope] with row b's L = lengths[0] entries first (this token's
      the last, written here); lengths [1] int64;
    - paged: cache [num_blocks, block_size, C + rope] a pool, block_table [B, max_blocks] int64, lengths [B]
      int64 each row's keys including this token's, dst [B] int64 the flat pool row of each new entry.
    in_norm / post_norm as in :func:`kimi_linear.ops.native.kda.kda_block_decode`. Returns (out [B, 1, Dm],
    normed or None)."""
    lib = library()
    if lib is None or x.dim() != 3 or x.shape[1] != 1 or not 0 < x.shape[0] <= MAX_BLOCK_ROWS:
        return None
    norms = [pair[0] for pair in (in_norm, post_norm) if pair is not None]
    if not cpu_float32_inference(x, packed, kv_norm[0], kv_b, o_weight, cache, *norms):
        return None
    x = x.contiguous()
    B, Dm = x.shape[0], x.shape[2]
    H, C = num_heads, kv_b.shape[1]
    v = kv_b.shape[0] // H - nope
    E = C + rope
    strides = [matrix_strides(w) for w in (packed, kv_b, o_weight)]
    paged = block_table is not None
    if (any(s is None for s in strides) or v <= 0 or kv_b.shape[0] != H * (nope + v)
            or tuple(packed.shape) != (H * (nope + rope) + E, Dm) or tuple(o_weight.shape) != (Dm, H * v)
            or cache.dim() != 3 or cache.shape[2] != E or cache.stride(2) != 1 or cache.stride(1) != E
            or lengths.dtype != torch.int64 or not lengths.is_contiguous() or lengths.device.type != "cpu"
            or not all(t.is_contiguous() for t in (kv_norm[0], *norms))):
        return None
    if paged:
        if not (cache.is_contiguous() and block_table.dtype == torch.int64 and block_table.stride(1) == 1
                and block_table.shape[0] == B and dst is not None and dst.dtype == torch.int64
                and dst.is_contiguous() and tuple(dst.shape) == (B,) and tuple(lengths.shape) == (B,)):
            return None
        check_paged_ranges(cache, block_table, lengths, dst)
    elif cache.shape[0] != B or lengths.numel() != 1 or not 0 < int(lengths[0]) <= cache.shape[1]:
        return None
    out = torch.empty(B, 1, Dm)
    normed = torch.empty(B, 1, Dm) if post_norm is not None else None
    (p_so, p_si), (kv_so, kv_si), (o_so, o_si) = strides
    status = lib.mla_block_decode_f32(
        B, Dm, H, nope, rope, v, C, x.data_ptr(), *norm_args(in_norm), packed.data_ptr(), p_so, p_si,
        *norm_args(kv_norm), kv_b.data_ptr(), kv_so, kv_si, scale,
        cache.data_ptr(), cache.stride(0), block_table.data_ptr() if paged else None,
        block_table.stride(0) if paged else 0, cache.shape[1] if paged else 0, lengths.data_ptr(),
        dst.data_ptr() if paged else None, o_weight.data_ptr(), o_so, o_si, *norm_args(post_norm),
        out.data_ptr(), None if normed is None else normed.data_ptr(), torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError(f"mla_block_decode: no memory for the scratch of {B} rows")
    return out, normed
