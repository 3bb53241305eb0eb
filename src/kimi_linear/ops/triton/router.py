"""The MoE router in one kernel (:func:`kimi_linear.ops.sigmoid_topk_route`): float32 logits of BN tokens at a time
against every expert (an exact float32 product, as the PyTorch path's), sigmoid, bias, then k rounds of "take the
largest, mask it" for the top-k, the weights gathered, renormalised and scaled in registers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def router_kernel(
    x, weight, bias,            # [N, D] (row stride s_x), [E, D] float32, [E] float32
    topk_w, topk_ids,           # out: [N, K_TOP] float32, [N, K_TOP] int64
    N, D, E, s_x, scale,
    K_TOP: tl.constexpr, RENORM: tl.constexpr, BN: tl.constexpr, BE: tl.constexpr, BD: tl.constexpr,
):
    i_n = tl.program_id(0)
    o_n = i_n * BN + tl.arange(0, BN)
    o_e = tl.arange(0, BE)
    o_d = tl.arange(0, BD)
    m_n, m_e = o_n < N, o_e < E
    b_acc = tl.zeros([BN, BE], dtype=tl.float32)                                   # [BN, BE]
    for d0 in range(0, D, BD):
        m_d = (d0 + o_d) < D
        b_x = tl.load(x + o_n[:, None].to(tl.int64) * s_x + d0 + o_d[None, :], mask=m_n[:, None] & m_d[None, :],
                      other=0.0).to(tl.float32)                                    # [BN, BD]
        b_w = tl.load(weight + o_e[None, :] * D + d0 + o_d[:, None], mask=m_d[:, None] & m_e[None, :],
                      other=0.0)                                                   # [BD, BE]
        # float32 products, not tf32: the choice must match the PyTorch router's up to summation order
        b_acc = tl.dot(b_x, b_w, b_acc, input_precision="ieee")
    b_s = tl.sigmoid(b_acc)                                                        # [BN, BE]
    b_c = tl.where(m_e[None, :], b_s + tl.load(bias + o_e, mask=m_e, other=0.0)[None, :], float("-inf"))
    # a row of NaN (a padding row of a fixed-shape step reads scratch memory) must still name real experts
    b_c = tl.where(b_c == b_c, b_c, float("-inf"))
    o_k = tl.arange(0, K_TOP)
    b_w_top = tl.zeros([BN, K_TOP], dtype=tl.float32)                              # [BN, K_TOP]
    b_i_top = tl.zeros([BN, K_TOP], dtype=tl.int64)                                # [BN, K_TOP]
    for j in tl.static_range(K_TOP):
        b_best = tl.minimum(tl.argmax(b_c, axis=1), E - 1)                         # [BN] first of equal maxima
        b_hit = o_e[None, :] == b_best[:, None]                                    # [BN, BE]
        b_wj = tl.sum(tl.where(b_hit, b_s, 0.0), axis=1)                           # [BN]
        b_w_top = tl.where(o_k[None, :] == j, b_wj[:, None], b_w_top)
        b_i_top = tl.where(o_k[None, :] == j, b_best[:, None].to(tl.int64), b_i_top)
        b_c = tl.where(b_hit, float("-inf"), b_c)
    if RENORM:
        b_w_top = b_w_top / (tl.sum(b_w_top, axis=1)[:, None] + 1e-20)
    b_w_top = b_w_top * scale
    o_out = o_n[:, None].to(tl.int64) * K_TOP + o_k[None, :]
    tl.store(topk_w + o_out, b_w_top, mask=m_n[:, None])
    tl.store(topk_ids + o_out, b_i_top, mask=m_n[:, None])


def sigmoid_topk_route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int, renormalize: bool = True,
                       scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``sigmoid_topk_route`` (arguments checked by :func:`kimi_linear.ops.sigmoid_topk_route`). k must be a
    power of two for the register tile (Kimi Linear: 8); other k take the PyTorch path."""
    N, D = x.shape
    E = weight.shape[0]
    if k & (k - 1) or E > 512:
        from ..router import sigmoid_topk_route_torch

        return sigmoid_topk_route_torch(x, weight, bias, k, renormalize, scale)
    if x.stride(1) != 1:
        x = x.contiguous()
    weight, bias = weight.contiguous(), bias.contiguous()
    w = torch.empty(N, k, dtype=torch.float32, device=x.device)
    ids = torch.empty(N, k, dtype=torch.int64, device=x.device)
    BE = max(16, triton.next_power_of_2(E))
    BN = 16
    BD = 64 if BE <= 64 else 32
    router_kernel[(triton.cdiv(N, BN),)](x, weight, bias, w, ids, N, D, E, x.stride(0), float(scale), K_TOP=k,
                                         RENORM=renormalize, BN=BN, BE=BE, BD=BD, num_warps=4)
    return w, ids
