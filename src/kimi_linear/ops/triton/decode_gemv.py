"""A decode step's dense projections, ``y = x W^T`` for a few rows of x (:func:`kimi_linear.ops.gemv.gemv`), in
Triton.

A decode step at batch 1 is a chain of matrix-vector products over weights that do not stay in L2: each is a
stream of W from HBM, and what it costs beyond bytes / bandwidth is the ramp at its start, the tail at its end
and the launch between it and its neighbours. cuBLAS picks split-K for the [2304, 4096] output projections (two
kernels a call: the partial products, then a reduction) and, as a library kernel, never takes part in the step's
programmatic dependent launch (ops/triton/pdl.py). This kernel is one launch that does:

- programs of BN rows of W (a contiguous slab of BN x K) and BM rows of x, stepping over K by BK;
- W's tiles through a TMA descriptor, ``num_stages - 1`` steps ahead (the pipelined copies keep enough bytes in
  flight per SM to stream, where register loads one step at a time do not: BENCHMARKS.md, fused MoE);
- x's tile [BM, BK] by pointer loads (x is small and comes from L2), the product on the tensor cores with a
  float32 accumulator, rounded once to x's dtype;
- PDL: launched while its predecessor still runs, waiting for it before the first load.

BN = 16 keeps many programs per SM (each with its own stages in flight) and the last wave short: [2304, 4096] is
144 programs, the 48B shape's packed KDA projection [12,576, 2304] 786.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .chunk_common import cast
from .moe import mma
from .pdl import pdl_args, pdl_entry
from .tma import tensor_descriptor_class


@dataclass(frozen=True)
class GemvLaunch:
    """BM rows of x and BN rows of W per program, steps of BK over K, warps and pipeline stages."""

    BM: int = 16
    BN: int = 16
    BK: int = 256
    warps: int = 4
    stages: int = 4


LAUNCH = GemvLaunch()


@triton.jit
def gemv_kernel(
    x, y,                  # [M, K] (row stride s_xm, unit column stride), out: [M, N] contiguous in x's dtype
    d_w,                   # W [N, K] as a TMA descriptor of [BN, BK] blocks (rows past N and columns past K: zeros)
    M, N, K, s_xm,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_entry(PDL)
    i_n, i_m = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    m_m = o_m < M
    p_x = x + o_m[:, None].to(tl.int64) * s_xm + o_k[None, :]                                     # [BM, BK]
    b_acc = tl.zeros([BM, BN], dtype=tl.float32)                                                  # [BM, BN]
    for k0 in range(0, K, BK):
        m_k = (o_k < K - k0) | EVEN_K
        b_x = tl.load(p_x, mask=m_m[:, None] & m_k[None, :], other=0.0)                           # [BM, BK]
        b_w = tl.trans(d_w.load([i_n * BN, k0]))                                                  # [BK, BN]
        b_acc = mma(b_x, b_w, b_acc)
        p_x += BK
    p_y = y + o_m[:, None].to(tl.int64) * N + o_n[None, :]
    tl.store(p_y, cast(b_acc, y.dtype.element_ty), mask=m_m[:, None] & (o_n < N)[None, :])


_DESCRIPTORS: dict[tuple, object] = {}


def weight_descriptor(w: torch.Tensor, BN: int, BK: int):
    """W's TMA descriptor in [BN, BK] blocks, made once per (storage, shape, block) and kept: a descriptor is a
    host object of ~10 us, and a decode step's eager path makes ~30 of these calls. The cache holds no tensor
    (a freed weight's address reused by another of the same shape gets a descriptor of the same values)."""
    key = (w.data_ptr(), tuple(w.shape), w.stride(0), w.dtype, w.device, BN, BK)
    desc = _DESCRIPTORS.get(key)
    if desc is None:
        if len(_DESCRIPTORS) > 4096:
            _DESCRIPTORS.clear()
        desc = tensor_descriptor_class().from_tensor(w, [BN, BK])
        _DESCRIPTORS[key] = desc
    return desc


def gemv(x: torch.Tensor, w: torch.Tensor, launch: GemvLaunch = LAUNCH) -> torch.Tensor:
    """``x @ w^T``: x [M, K] with unit column stride, w [N, K] contiguous with 16-byte rows and address (checked by
    :func:`kimi_linear.ops.gemv.gemv`) -> [M, N] in x's dtype."""
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    cfg = launch
    BK = min(cfg.BK, max(16, triton.next_power_of_2(K)))
    grid = (triton.cdiv(N, cfg.BN), triton.cdiv(M, cfg.BM))
    gemv_kernel[grid](x, y, weight_descriptor(w, cfg.BN, BK), M, N, K, x.stride(0),
                      BM=cfg.BM, BN=cfg.BN, BK=BK, EVEN_K=K % BK == 0,
                      num_warps=cfg.warps, num_stages=cfg.stages, **pdl_args(x.device))
    return y
