"""Floors of the GPU benchmarks: the bytes a decode step must move, the FLOPs a prefill must compute, and the card's
copy bandwidth and matmul rate, measured in the same run, to divide them by.

Everything here reads the model's modules only (shapes, dtypes), so it works on a ``meta``-device model too: a
benchmark's ``--plan`` sizes a 48B model without allocating it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

# The chunked KDA algorithm's matmuls, per token and head, with chunk C and head dims K, V (ops.chunk): the
# chunk's K K^T, Q K^T (2 C^2 K each) and the WY products A K, A V (2 C^2 K, 2 C^2 V); the state's v - W S, Q S
# and S += K^T v (2 C K V each); the output's Aqk v (2 C^2 V); the triangular inverse (~2 C^3 / 3); divided by C.
KDA_CHUNK = 64


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a large device-to-device copy (read + write), the decode floor's yardstick; NaN off CUDA."""
    if device != "cuda":
        return float("nan")
    x = torch.empty(2**30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync()
    t = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync()
    return 2 * x.numel() * 10 / (time.perf_counter() - t)


def matmul_rate(device: str, dtype: torch.dtype = torch.bfloat16, n: int = 8192) -> float:
    """FLOP/s of an n x n x n matmul in ``dtype`` (the prefill floor's yardstick); NaN off CUDA."""
    if device != "cuda":
        return float("nan")
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync()
    t = time.perf_counter()
    reps = 20
    for _ in range(reps):
        a @ b
    sync()
    return 2 * n**3 * reps / (time.perf_counter() - t)


def _bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


@dataclass
class WeightSplit:
    """Where a model's weight bytes sit: all of them, the embedding table (one row read per token), and the routed
    experts (a step reads only the ones its rows choose)."""

    total: int
    embedding: int
    embedding_row: int
    expert: int             # bytes of one routed expert
    moe_layers: int
    experts: int            # E
    top_k: int

    @classmethod
    def of(cls, model: Any) -> WeightSplit:
        c = model.config
        emb = model.model.embed_tokens.weight
        expert, moe_layers = 0, 0
        for layer in model.model.layers:
            if layer.is_moe:
                moe_layers += 1
                expert = _bytes(layer.block_sparse_moe.experts[0])
        return cls(total=_bytes(model), embedding=emb.numel() * emb.element_size(),
                   embedding_row=emb.shape[1] * emb.element_size(), expert=expert, moe_layers=moe_layers,
                   experts=c.num_local_experts, top_k=c.num_experts_per_tok)

    def decode_bytes(self, batch: int) -> int:
        """Weight bytes one decode step of ``batch`` rows reads: everything but the embedding table and the routed
        experts, one embedding row per row, and the distinct experts the rows choose (expected count for uniform
        top-k routing)."""
        E, k = self.experts, self.top_k
        distinct = E * (1 - (1 - k / E) ** batch) if E else 0.0
        routed = self.moe_layers * E * self.expert
        return int(self.total - self.embedding + batch * self.embedding_row - routed
                   + self.moe_layers * distinct * self.expert)


def decode_cache_bytes(model: Any, batch: int, context: int) -> int:
    """Cache bytes one decode step moves at ``context`` tokens: each KDA layer's float32 memory read and written and
    its conv window read and written, each MLA layer's latents read (the new one written: negligible)."""
    elt = model.dtype.itemsize
    n = 0
    for layer in model.model.layers:
        a = layer.self_attn
        if layer.is_kda:
            width = 3 * a.num_heads * a.head_dim
            n += batch * (2 * a.num_heads * a.head_dim**2 * 4 + 2 * (a.conv_size - 1) * width * elt)
        else:
            n += batch * context * a.cache_width * elt
    return n


def prefill_flops(model: Any, tokens: int, chunk: int) -> dict[str, float]:
    """FLOPs of one sequence's prefill of ``tokens`` tokens in chunks of ``chunk`` (logits for each chunk's last
    token only), by part: ``linear`` (every projection a token passes through: attention, KDA, dense MLP, router,
    shared and top-k routed experts, MLA's kv_b expansion once per token), ``lm_head``, ``mla_attention`` (the causal
    T^2/2 score and value products per head), ``kda`` (the chunked delta rule's matmuls, see KDA_CHUNK), ``total``."""
    c = model.config
    per_token = 0
    mla_attn = kda = 0.0
    for layer in model.model.layers:
        for name, p in layer.named_parameters():
            if p.dim() < 2 or ".experts." in f".{name}":
                continue
            per_token += p.numel()
        if layer.is_moe:
            per_token += c.num_experts_per_tok * sum(p.numel() for p in layer.block_sparse_moe.experts[0].parameters())
        a = layer.self_attn
        if layer.is_kda:
            C, K, V = KDA_CHUNK, a.head_dim, a.head_dim
            kda += tokens * a.num_heads * 2 * (3 * C * K + 2 * C * V + 3 * K * V + C * C / 3)
        else:
            mla_attn += a.num_heads * 2 * (a.qk_dim + a.v_dim) * tokens * (tokens + 1) / 2
    linear = 2.0 * per_token * tokens
    lm_head = 2.0 * model.lm_head.weight.numel() * -(-tokens // chunk)
    return dict(linear=linear, lm_head=lm_head, mla_attention=mla_attn, kda=kda,
                total=linear + lm_head + mla_attn + kda)
