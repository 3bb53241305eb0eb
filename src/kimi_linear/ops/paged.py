"""Where a one-token decode step reads and writes a paged latent pool: each row's table, write row and length.

A batch row r decodes the sequence in pool slot ``slots[r]`` with ``lens[r]`` tokens cached. Its new latent goes to
position ``lens[r]``, which lives in block ``block_table[slots[r], lens[r] // block_size]`` at offset ``lens[r] %
block_size``; attention then sees ``lens[r] + 1`` keys through the slot's table row:

    table[r]    = block_table[slots[r]]                                   [B, max_blocks]
    dst[r]      = block_table[slots[r], lens[r] // bs] * bs + lens[r] % bs   (flat pool row, int64)
    seq_lens[r] = lens[r] + 1                                               (int32)

On CUDA one Triton kernel (:mod:`kimi_linear.ops.triton.paged`) computes all three: the PyTorch path is eight
small kernels (index_select, division, gather, cast, product, remainder, two adds), launched every decode step.
"""

from __future__ import annotations

import torch

from .backend import triton_op


def pool_rows(block_table: torch.Tensor, pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat rows ``block * block_size + offset`` of a paged pool (viewed [blocks * block_size, width]) holding the
    positions ``pos`` ([B, n] int64, per row of ``block_table`` [B, max_blocks]): int64 [B, n]."""
    return block_table.gather(1, pos // block_size).long() * block_size + pos % block_size


def paged_decode_rows_torch(block_table: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor,
                            block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`paged_decode_rows` in PyTorch."""
    table = block_table.index_select(0, slots)
    return table, pool_rows(table, lens[:, None], block_size)[:, 0], (lens + 1).to(torch.int32)


def paged_decode_rows(block_table: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor,
                      block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(table [B, max_blocks] in block_table's dtype, dst [B] int64, seq_lens [B] int32) of the module docstring.

    block_table: int32/int64 [slots, max_blocks]; slots, lens: int64 [B] (a row's ``lens // block_size`` must be
    a column of the table: values are not checked, that would read them on the host). No host sync."""
    if block_table.dim() != 2 or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"paged_decode_rows: block_table must be an int32/int64 [slots, max_blocks] tensor, got "
                         f"{block_table.dtype} {tuple(block_table.shape)}")
    for name, t in (("slots", slots), ("lens", lens)):
        if t.dim() != 1 or t.shape != slots.shape or t.dtype != torch.int64 or t.device != block_table.device:
            raise ValueError(f"paged_decode_rows: {name} must be an int64 [B] tensor on the table's device, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"paged_decode_rows: block_size must be an int >= 1, got {block_size!r}")
    fast = triton_op("paged_decode_rows", block_table)
    if fast is None or slots.numel() == 0:
        return paged_decode_rows_torch(block_table, slots, lens, block_size)
    return fast(block_table, slots, lens, block_size)
