"""A few rows times a weight matrix, ``y = x @ W^T``, for decode steps (:mod:`kimi_linear.ops.gemv`).

A decode step's projections are matrix-vector products bound by reading W once. cuBLAS runs the narrow-output ones
(e.g. a 4096 -> 2304 output projection) as a split-K product plus a reduction kernel; here one program per BN
output features walks all of K, so there is one launch and no partial sums in memory. The rows (up to BM = 16) are
one tensor-core tile: the products are free beside the bytes. W may be row- or column-major.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..gemv import GEMV_MAX_ROWS
from .chunk_common import cast, mm


@triton.jit
def gemv_kernel(
    x, w, y,                     # [M, K] (row stride s_xm), [N, K] (strides s_wn, s_wk), out [M, N] contiguous
    M, N, K, s_xm, s_wn, s_wk,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
):
    i_n = tl.program_id(0)
    o_m = tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    m_m, m_n = o_m < M, o_n < N
    p_x = x + o_m[:, None].to(tl.int64) * s_xm + o_k[None, :]                                    # [BM, BK]
    p_w = w + o_k[:, None].to(tl.int64) * s_wk + o_n[None, :].to(tl.int64) * s_wn                # [BK, BN]
    b_acc = tl.zeros([BM, BN], dtype=tl.float32)                                                  # [BM, BN]
    for k0 in range(0, K, BK):
        m_k = o_k < K - k0
        b_x = tl.load(p_x, mask=m_m[:, None] & m_k[None, :], other=0.0)                          # [BM, BK]
        b_w = tl.load(p_w, mask=m_k[:, None] & m_n[None, :], other=0.0)                          # [BK, BN]
        b_acc += mm(b_x, b_w, PREC)
        p_x += BK
        p_w += BK * s_wk
    tl.store(y + o_m[:, None].to(tl.int64) * N + o_n[None, :], cast(b_acc, y.dtype.element_ty),
             mask=m_m[:, None] & m_n[None, :])


def gemv(x: torch.Tensor, weight: torch.Tensor, block_n: int = 16, block_k: int = 256, num_warps: int = 4,
         num_stages: int = 4) -> torch.Tensor:
    """Triton :func:`kimi_linear.ops.gemv.gemv` (arguments checked there): x [M <= 16, K], weight [N, K] -> [M, N]
    in x's dtype. block_n / block_k / num_warps / num_stages: the launch (benchmarks sweep them)."""
    M, K = x.shape
    N = weight.shape[0]
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    gemv_kernel[(triton.cdiv(N, block_n),)](
        x, weight, y, M, N, K, x.stride(0), weight.stride(0), weight.stride(1),
        BM=GEMV_MAX_ROWS, BN=block_n, BK=block_k, PREC=prec, num_warps=num_warps, num_stages=num_stages,
    )
    return y
