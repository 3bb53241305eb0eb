"""A decode step's output projection as split-K partial sums (:func:`kimi_linear.ops.rms_norm.project_add_rms_norm`
sums them inside the residual add + RMSNorm that follows, so no reduction launch of its own).

An output projection of a decode step is a few rows against a [D, K] weight (D = 2304 rows, K = 4096 at the 48B
shape): tiles of BN weight rows give only D / BN programs (36), too few to stream 19 MB at the card's rate, so the
reduction is cut into S slices as well and each program writes its float32 partial sums."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunk_common import mm
from .device import num_sms
from .ints import cdiv
from .pdl import pdl_args, pdl_entry
from .tma import tensor_descriptor_class, tma_supported

BM = 16         # rows of x a program takes (the smallest M of a tensor-core product; decode steps have <= 16)
BN = 64         # weight rows a program
BK = 128        # reduction steps
MAX_ROWS = BM


@triton.jit
def split_k_kernel(
    x, w, d_w,               # [M, K] (row stride s_xm), [N, K] (row stride s_wn), one dtype; d_w: w's descriptor
    p,                       # out: [S, M, N] float32 partial sums
    M, N, K, KS, s_xm, s_wn,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (column block j, slice s): ``p[s, :, jBN:(j+1)BN] = x[:, sKS:(s+1)KS] @ w[jBN:(j+1)BN, sKS:(s+1)KS]^T``
    in float32 (KS a multiple of BK). With ``TMA`` the weight's [BN, BK] tiles come through the tensor descriptor
    ``d_w`` (zero past N and K), which Triton's pipeliner issues ``num_stages - 1`` steps ahead into shared memory;
    pointer loads feeding a product are left waiting in registers (tma.py)."""
    pdl_entry(PDL)
    i_n, i_s = tl.program_id(0), tl.program_id(1)
    o_m = tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    m_m, m_n = o_m < M, o_n < N
    k0 = i_s * KS
    k_end = tl.minimum(k0 + KS, K)
    p_x = x + o_m[:, None].to(tl.int64) * s_xm + k0 + o_k[None, :]                               # [BM, BK]
    p_w = w + o_n[None, :].to(tl.int64) * s_wn + k0 + o_k[:, None]                                # [BK, BN]
    b_acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k in range(k0, k_end, BK):
        m_k = o_k < k_end - k
        b_x = tl.load(p_x, mask=m_m[:, None] & m_k[None, :], other=0.0)                          # [BM, BK]
        if TMA:
            b_w = tl.trans(d_w.load([i_n * BN, k]))                                              # [BK, BN]
        else:
            b_w = tl.load(p_w, mask=m_k[:, None] & m_n[None, :], other=0.0)                      # [BK, BN]
        b_acc += mm(b_x, b_w, PREC)
        p_x += BK
        p_w += BK
    p_p = p + (i_s * M + o_m[:, None]).to(tl.int64) * N + o_n[None, :]
    tl.store(p_p, b_acc, mask=m_m[:, None] & m_n[None, :])


PROGRAMS_PER_SM = 2     # [64, 128] weight tiles 4 stages deep: ~80 KB of shared memory a program


def split_k_partials(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M <= MAX_ROWS, K], w [N, K] (unit column strides) -> float32 partial sums [S, M, N] whose sum over S is
    ``x @ w^T``. S: as many slices as keep every program in one wave (PROGRAMS_PER_SM an SM: a 37th-of-a-wave tail
    would cost a whole tile pass), each slice a multiple of BK, at most 16."""
    M, K = x.shape
    N = w.shape[0]
    blocks = cdiv(N, BN)
    S = max(1, min(16, (PROGRAMS_PER_SM * num_sms(x.device)) // blocks, cdiv(K, BK)))
    KS = cdiv(cdiv(K, S), BK) * BK
    S = cdiv(K, KS)                                   # no empty slice
    p = torch.empty(S, M, N, dtype=torch.float32, device=x.device)
    d_w = weight_descriptor(w)
    split_k_kernel[(blocks, S)](x, w, w if d_w is None else d_w, p, M, N, K, KS, x.stride(0), w.stride(0),
                                BM=BM, BN=BN, BK=BK, PREC="ieee" if x.dtype == torch.float32 else "tf32",
                                TMA=d_w is not None, num_warps=4, num_stages=4, **pdl_args(x.device))
    return p


def weight_descriptor(w: torch.Tensor):
    """w's TMA descriptor with [BN, BK] blocks where the device and w's layout allow (16-byte row stride, unit
    column stride), else None (pointer loads)."""
    TensorDescriptor = tensor_descriptor_class()
    if (not tma_supported(w.device) or w.stride(1) != 1 or (w.stride(0) * w.element_size()) % 16
            or w.data_ptr() % 16):
        return None
    return TensorDescriptor(w, list(w.shape), list(w.stride()), [BN, BK])
