"""The decode step's paged-pool rows (:mod:`kimi_linear.ops.paged`) in one Triton kernel."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .ints import cdiv, next_pow2
from .pdl import pdl_args, pdl_entry


@triton.jit
def paged_decode_rows_kernel(
    block_table, slots, lens,          # [S, MB] (row stride s_t), [B] int64, [B] int64
    table, dst, seq_lens,              # out: [B, MB], [B] int64, [B] int32
    MB, s_t, BS,
    BM: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (row r, column block j): copies BM entries of the slot's table row; block 0 also writes the row's
    write position and length."""
    pdl_entry(PDL)
    i_r, i_j = tl.program_id(0).to(tl.int64), tl.program_id(1)
    b_slot = tl.load(slots + i_r)
    p_row = block_table + b_slot * s_t
    o_m = i_j * BM + tl.arange(0, BM)
    m_m = o_m < MB
    tl.store(table + i_r * MB + o_m, tl.load(p_row + o_m, mask=m_m), mask=m_m)
    if i_j == 0:
        b_len = tl.load(lens + i_r)
        b_blk = tl.load(p_row + b_len // BS).to(tl.int64)
        tl.store(dst + i_r, b_blk * BS + b_len % BS)
        tl.store(seq_lens + i_r, (b_len + 1).to(tl.int32))


def paged_decode_rows(block_table: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor,
                      block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton :func:`kimi_linear.ops.paged.paged_decode_rows` (arguments checked there)."""
    B, MB = slots.shape[0], block_table.shape[1]
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    table = torch.empty(B, MB, dtype=block_table.dtype, device=block_table.device)
    dst = torch.empty(B, dtype=torch.int64, device=block_table.device)
    seq_lens = torch.empty(B, dtype=torch.int32, device=block_table.device)
    BM = min(4096, next_pow2(MB))
    paged_decode_rows_kernel[(B, cdiv(MB, BM))](
        block_table, slots.contiguous(), lens.contiguous(), table, dst, seq_lens, MB, block_table.stride(0),
        block_size, BM=BM, num_warps=4, **pdl_args(block_table.device),
    )
    return table, dst, seq_lens
