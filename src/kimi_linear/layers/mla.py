"""NoPE Multi-head Latent Attention (docs/model.md §4) with a cache of the 576-wide latent, not expanded keys."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kimi_linear.ops import absorb_query, expand_values, paged_mla_decode
from kimi_linear.ops.attention import attention_lse, merge_attention
from kimi_linear.ops.backend import triton_op
from kimi_linear.ops.mla_heads import absorb_query_torch, expand_values_torch
from kimi_linear.ops.native.mla import mla_block_decode
from kimi_linear.ops.paged import pool_rows
from kimi_linear.ops.rms_norm import rms_norm_write

from .context_parallel import ContextParallel
from .linear import Linear
from .norm import RMSNorm, upcast
from .packing import PackedLinears


class LatentCache:
    """Growing per-token cache of one MLA layer: ``[normed latent | k_rope]`` per token, one row per sequence.

    Stored in a buffer whose capacity doubles, so appending one token is O(1) amortised instead of a full copy.
    """

    def __init__(self, batch_size: int, width: int, dtype: torch.dtype, device: torch.device) -> None:
        self.buf = torch.empty(batch_size, 0, width, dtype=dtype, device=device)
        self.length = 0

    def append(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, T, width] -> every cached entry so far, [B, length, width] (a view)."""
        entries = self.extend(x.shape[1])
        entries[:, self.length - x.shape[1] :] = x
        return entries

    def extend(self, T: int) -> torch.Tensor:
        """Room for T more tokens, counted as cached: every entry, [B, length + T, width] (a view), whose last T
        the caller writes."""
        need = self.length + T
        if need > self.buf.shape[1]:
            cap = max(need, 2 * self.buf.shape[1], 16)
            grown = self.buf.new_empty(self.buf.shape[0], cap, self.buf.shape[2])
            grown[:, : self.length] = self.buf[:, : self.length]
            self.buf = grown
        self.length = need
        return self.buf[:, :need]

    def nbytes(self) -> int:
        """Bytes of the cached tokens (not the spare capacity)."""
        return self.buf.shape[0] * self.length * self.buf.shape[2] * self.buf.element_size()

    def select(self, rows: torch.Tensor) -> None:
        self.buf = self.buf[rows]


@dataclass
class PagedLatentView:
    """One MLA layer's paged block pool as seen by a batch of one-token decode rows (the engine builds one per layer
    and step). Passed to :meth:`NoPEMLA.forward` as ``cache``, the layer writes each row's new entry into the pool
    and attends over the row's blocks in place (:func:`kimi_linear.ops.paged_mla_decode`): the history is never
    gathered into a dense buffer, and nothing reads a device value on the host (CUDA-graph capturable).

    data: [num_blocks, block_size, kv_lora_rank + rope] the layer's pool (contiguous; written in place).
    block_table: int32/int64 [B, max_blocks] each row's blocks in order (entries past the row's length unread).
    seq_lens: int32/int64 [B] keys of each row *including* the new token (1 <= seq_lens <= max_blocks * block_size).
    dst: int64 [B] flat row ``block * block_size + offset`` of ``data`` where each row's new entry goes (its
        position seq_lens - 1). Padding rows point at a scratch block that no real row reads.
    num_splits: override the kernel's split count (None: picked from the static shapes).
    """

    data: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    dst: torch.Tensor
    num_splits: int | None = None

    def write_normed(self, kv: torch.Tensor, norm: RMSNorm) -> None:
        """Store each row's new entry ``[norm(latent) | rope key]`` at ``dst``, from the layer's projection kv [B,
        latent + rope] (:func:`kimi_linear.ops.rms_norm.rms_norm_write`: one kernel on CUDA)."""
        rms_norm_write(kv, norm.weight, norm.eps, self.data.view(-1, self.data.shape[-1]), self.dst)


# A prefill chunk after cached tokens expands the cached latents into per-head keys and values this many bytes at a
# time (Kimi-Linear-48B: ~40 KB a key in bf16, so ~26k keys a block), whatever the context: at 1M tokens all at
# once would be 43 GB.
KEY_BLOCK_BYTES = 1 << 30


@dataclass
class PagedPrefillView:
    """One MLA layer's paged block pool as seen by a prefill chunk whose rows all have ``past`` tokens cached (the
    engine builds one per layer and chunk). Passed to :meth:`NoPEMLA.forward` as ``cache``, the layer writes the
    chunk's entries into the pool and attends to the cached ones block by block, read straight from the pool: the
    history is never copied into a dense buffer, and no ``[T, past + T]`` mask is built.

    data: [num_blocks, block_size, kv_lora_rank + rope] the layer's pool (contiguous; written in place).
    block_table: int32/int64 [B, >= ceil((past + T) / block_size)] each row's blocks in order, on data's device.
    past: tokens already cached in every row (a host int: it sizes the key blocks).
    first_block: with one row whose cached tokens sit in consecutive blocks ``first_block, first_block + 1, ..``
        (what a long prompt gets from a fresh pool), those blocks are read as a view of the pool instead of gathered:
        a chunked prefill reads its whole history once per chunk, and at 1M tokens a gather would copy ~1.2 GB a
        layer and chunk. None: gathered through the table.
    """

    data: torch.Tensor
    block_table: torch.Tensor
    past: int
    first_block: int | None = None

    def write(self, entry: torch.Tensor) -> None:
        """Store the chunk's entries [B, T, width] at positions past .. past + T - 1 (one scatter, int64 rows)."""
        B, T, W = entry.shape
        bs = self.data.shape[1]
        pos = torch.arange(self.past, self.past + T, device=self.data.device).expand(B, T)
        rows = pool_rows(self.block_table, pos, bs)                                               # [B, T]
        self.data.view(-1, W).index_copy_(0, rows.reshape(-1), entry.reshape(B * T, W).to(self.data.dtype))

    def read(self, start: int, end: int) -> torch.Tensor:
        """Cached entries start .. end - 1 of every row (end <= past): [B, end - start, width]."""
        B = self.block_table.shape[0]
        bs, W = self.data.shape[1], self.data.shape[2]
        b0, b1 = start // bs, -(-end // bs)
        if self.first_block is not None and B == 1:
            blocks = self.data[self.first_block + b0 : self.first_block + b1]                       # a view
        else:
            blocks = self.data.index_select(0, self.block_table[:, b0:b1].reshape(-1).long())
        return blocks.reshape(B, (b1 - b0) * bs, W)[:, start - b0 * bs : end - b0 * bs]


@dataclass
class VarlenLatents:
    """The latents of N sequences packed into one row (a mixed engine step: decode rows and prompt chunks in one
    forward). past: [N, P, width] each sequence's cached entries, left-padded (row n's are the last past_len[n]);
    past_len: [N] int64; cu_seqlens: [N + 1] the new tokens' offsets in the row. Each new token attends to its own
    sequence's past and causally to its sequence's new tokens; the layer leaves the new entries in ``new``
    [T, width] for the caller to store."""

    past: torch.Tensor
    past_len: torch.Tensor
    cu_seqlens: torch.Tensor
    new: torch.Tensor | None = None

    def layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(idx [N, Tm] flat index of row n's t-th new token (clamped), valid [N, Tm]) with Tm the longest."""
        lens = self.cu_seqlens.diff()
        Tm = int(lens.max())
        t = torch.arange(Tm, device=lens.device)
        valid = t[None] < lens[:, None]
        idx = torch.where(valid, self.cu_seqlens[:-1, None] + t[None], self.cu_seqlens[:-1, None])
        return idx, valid


class NoPEMLA(nn.Module):
    """MLA without positional encoding: the ``k_rope`` slice is shared by all heads and never rotated.

    Prefill expands the latent into per-head keys and values and calls SDPA; a single-token step uses the
    "absorbed" form (``q_nope`` is mapped into latent space through ``kv_b_proj``) so each step costs
    O(context * latent) instead of re-expanding the whole cache.

    output_gate (Kimi K3 gated MLA, ``mla_use_output_gate``): the attention output [.., H*v] is multiplied by
    ``sigmoid(g_proj(x))`` (float32 sigmoid, one gate per output channel, full rank) before ``o_proj``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None = None,
        bias: bool = False,
        eps: float = 1e-6,
        output_gate: bool = False,
    ) -> None:
        super().__init__()
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.output_gate = output_gate
        self.nope, self.rope, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_dim = qk_nope_head_dim + qk_rope_head_dim
        self.scale = self.qk_dim**-0.5
        if q_lora_rank is None:
            self.q_proj = Linear(hidden_size, num_heads * self.qk_dim, bias=False)
        else:
            self.q_a_proj = Linear(hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps=1e-6)
            self.q_b_proj = Linear(q_lora_rank, num_heads * self.qk_dim, bias=False)
        self.q_lora_rank = q_lora_rank
        self.kv_a_proj_with_mqa = Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps=1e-6)
        self.kv_b_proj = Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = Linear(num_heads * v_head_dim, hidden_size, bias=bias)
        if output_gate:
            self.g_proj = Linear(hidden_size, num_heads * v_head_dim, bias=False)
        self._pack: PackedLinears | None = None

    def _x_projections(self) -> list[nn.Linear]:
        """The projections that read x: the query's first (q_proj or q_a_proj), the latent / rope key's, and K3's
        output gate."""
        first = self.q_proj if self.q_lora_rank is None else self.q_a_proj
        return [first, self.kv_a_proj_with_mqa] + ([self.g_proj] if self.output_gate else [])

    def pack(self) -> None:
        """Pack the projections that read x into one matrix (``PackedLinears``: one GEMV a decode step instead of
        two or three); left separate when they carry biases (``attention_bias``)."""
        try:
            self._pack = PackedLinears(self._x_projections())
        except ValueError:
            self._pack = None

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(the query [B, T, H*qk], kv [B, T, latent + rope], the output gate's pre-activation or None)."""
        parts = self._pack(x) if self._pack is not None else [lin(x) for lin in self._x_projections()]
        q = parts[0] if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(parts[0]))
        return q, parts[1], parts[2] if self.output_gate else None

    @property
    def cache_width(self) -> int:
        """Entries cached per token: latent + shared rope key (576 for Kimi-Linear-48B)."""
        return self.kv_lora_rank + self.rope

    def empty_cache(self, batch_size: int, dtype: torch.dtype, device: torch.device) -> LatentCache:
        return LatentCache(batch_size, self.cache_width, dtype, device)

    def decode_block(self, x: torch.Tensor, cache: LatentCache | PagedLatentView, in_norm: RMSNorm | None = None,
                     post_norm: RMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """A CPU decode token from the layer's input to its output projection as one C call
        (:func:`kimi_linear.ops.native.mla.mla_block_decode`), appending to ``cache``; with the decoder layer's
        input norm in front and its residual add and next norm behind, as
        :meth:`kimi_linear.layers.kda.KimiDeltaAttention.decode_block`. For a dense cache without a mask (no
        padding) or a paged view; None where the call does not apply (then run :meth:`forward`): CUDA, 16-bit,
        autograd, more rows than it takes, a low-rank query, K3's output gate, biases, unpacked weights."""
        if (x.device.type != "cpu" or x.dim() != 3 or x.shape[1] != 1 or self.q_lora_rank is not None
                or self.output_gate or self._pack is None or not self._pack.valid() or self.o_proj.bias is not None
                or not isinstance(cache, (LatentCache, PagedLatentView))
                or triton_op("paged_mla_decode", x) is not None):      # (CPU under the Triton interpreter)
            return None
        norm = self.kv_a_layernorm
        args = dict(num_heads=self.num_heads, nope=self.nope, rope=self.rope, scale=self.scale,
                    in_norm=None if in_norm is None else (in_norm.weight, in_norm.eps),
                    post_norm=None if post_norm is None else (post_norm.weight, post_norm.eps))
        weights = (self._pack.weight, (norm.weight, norm.eps), self.kv_b_proj.weight, self.o_proj.weight)
        if isinstance(cache, PagedLatentView):
            return mla_block_decode(x, *weights, cache=cache.data, lengths=cache.seq_lens.long(),
                                    block_table=cache.block_table.long(), dst=cache.dst.long(), **args)
        if cache.buf.dtype != x.dtype:
            return None
        entries = cache.extend(1)                                                    # [B, L, C + rope]
        done = mla_block_decode(x, *weights, cache=entries, lengths=torch.tensor([entries.shape[1]]), **args)
        if done is None:
            cache.length -= 1                                                        # nothing written
        return done

    def forward(
        self,
        x: torch.Tensor,
        cache: LatentCache | PagedLatentView | PagedPrefillView | VarlenLatents | None = None,
        attn_mask: torch.Tensor | None = None,
        context_parallel: ContextParallel | None = None,
        project: bool = True,
    ) -> torch.Tensor:
        """x: [B, T, D] -> [B, T, D] (``project=False``: the input of o_proj, [B, T, H v], for a caller that folds
        the projection into what follows, :func:`kimi_linear.ops.project_add_rms_norm`).

        cache: appended to in place when given. attn_mask: bool [B, 1, T, L] (True = may attend) over all L cached
            keys, or None for a plain causal mask with no past and no padding (the model builds it).
            A :class:`PagedLatentView` (one token per row, T == 1) is written and attended in place; its
            ``seq_lens`` say which keys each row sees and attn_mask is ignored. A :class:`PagedPrefillView` (a
            prompt chunk after ``past`` cached tokens in every row) likewise: causal over past + T, no mask.
        context_parallel: x is this rank's piece of a sequence split along time (no cache, no attn_mask): the
            queries attend to the latents of every earlier rank and causally to their own.
        """
        B, T, _ = x.shape
        H = self.num_heads
        q, kv, gate = self._project(x)                                             # kv: [B, T, latent | rope]
        q = q.view(B, T, H, self.qk_dim).transpose(1, 2)                           # [B, H, T, qk]
        if isinstance(cache, PagedLatentView):
            if T != 1 or context_parallel is not None:
                raise ValueError(f"NoPEMLA: a PagedLatentView cache takes one token per row without context "
                                 f"parallelism, got T={T}")
            cache.write_normed(kv[:, 0], self.kv_a_layernorm)
            out = self._paged(q, cache)
            return self._output(out, gate, project)
        latent, k_rope = kv.split([self.kv_lora_rank, self.rope], dim=-1)
        entry = torch.cat([self.kv_a_layernorm(latent), k_rope], dim=-1)           # [B, T, 576]
        if isinstance(cache, VarlenLatents):
            if B != 1 or context_parallel is not None:
                raise ValueError("NoPEMLA: VarlenLatents takes the packed sequences as one row (B == 1)")
            cache.new = entry[0]
            out = self._varlen(q, entry, cache)
        elif isinstance(cache, PagedPrefillView):
            if context_parallel is not None or _needs_grad(q):
                raise ValueError("NoPEMLA: a PagedPrefillView serves inference prefill (no gradient, no context "
                                 "parallelism)")
            cache.write(entry)
            out = self._chunked(q, entry, cache.past, cache.read)
        else:
            out = self._dense(q, entry, cache, attn_mask, context_parallel)
        return self._output(out, gate, project)

    def _output(self, out: torch.Tensor, gate: torch.Tensor | None, project: bool = True) -> torch.Tensor:
        """Attention output [B, H, T, v] -> [B, T, D]: heads merged, K3's output gate (``g_proj(x)``), o_proj
        (unless not ``project``)."""
        B, H, T, _ = out.shape
        out = out.transpose(1, 2).reshape(B, T, H * self.v_dim)
        if gate is not None:
            out = (upcast(out) * torch.sigmoid(upcast(gate))).to(out.dtype)
        return self.o_proj(out) if project else out

    def _dense(self, q: torch.Tensor, entry: torch.Tensor, cache: LatentCache | None,
               attn_mask: torch.Tensor | None, context_parallel: ContextParallel | None) -> torch.Tensor:
        """Attention over a dense latent history (LatentCache, or none). q: [B, H, T, qk]; entry: [B, T, 576]
        the new entries. Returns [B, H, T, v].

        attn_mask None with cached tokens before the new ones means plain causal attention of the last T
        positions (no padding): the cached keys are attended in blocks without a mask (:meth:`_chunked`)."""
        T = q.shape[2]
        if cache is not None:
            entry = cache.append(entry)                                            # [B, L, 576]
        if context_parallel is not None:
            entry, attn_mask = context_parallel.gather_latents(entry)             # [B, offset + T, 576]
        if T == 1 and cache is not None:
            return self._absorbed(q, entry, attn_mask)
        L = entry.shape[1]
        if attn_mask is None and L > T:
            if not _needs_grad(q):
                past = entry[:, : L - T]
                return self._chunked(q, entry[:, L - T :], L - T, lambda a, b: past[:, a:b])
            # training through a cache (not a serving path): the explicit bottom-right causal mask, differentiable
            attn_mask = torch.ones(T, L, dtype=torch.bool, device=q.device).tril(L - T)[None, None]
        return self._expanded(q, entry, attn_mask)

    def _expand(self, entry: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent entries [B, L, 576] -> per-head keys [B, H, L, qk] (``[k_nope | shared k_rope]``) and values
        [B, H, L, v]."""
        B, L, _ = entry.shape
        H = self.num_heads
        latent, k_rope = entry.split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(latent).view(B, L, H, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        return torch.cat([k_nope, k_rope[:, None].expand(B, H, L, self.rope)], dim=-1), v

    def _expanded(self, q: torch.Tensor, entry: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        """Prefill: expand every cached latent into per-head keys and values. attn_mask None: causal with as many
        keys as queries. Returns [B, H, T, v]."""
        k, v = self._expand(entry)
        # SDPA's fused CPU/GPU kernels need equal q/k and v head widths (else it falls back to the slow math path,
        # ~4x slower here): pad v with zeros to the q/k width and drop the padded output columns.
        if self.v_dim < self.qk_dim:
            v = F.pad(v, (0, self.qk_dim - self.v_dim))
        if attn_mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=self.scale)
        return o[..., : self.v_dim]

    def _chunked(self, q: torch.Tensor, new: torch.Tensor, past: int,
                 read: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
        """A chunk of T new tokens after ``past`` cached ones, no padding, inference only. q: [B, H, T, qk]; new:
        [B, T, 576] the chunk's entries; read(a, b) -> [B, b - a, 576] cached entries a .. b - 1. Returns
        [B, H, T, v].

        The cached keys are expanded and attended a block at a time (about :data:`KEY_BLOCK_BYTES` of keys and
        values, any context), every query seeing every cached key; then the chunk's own keys under a square
        causal mask; the blocks' results are merged exactly through their log-sum-exps
        (:func:`kimi_linear.ops.attention.merge_attention`). Memory: one block's keys, never a [T, past + T]
        mask or score matrix."""
        B, H, T, _ = q.shape
        per_key = B * H * (2 * self.qk_dim + self.nope + self.v_dim) * q.element_size()     # kv, k, padded v
        step = max(1, KEY_BLOCK_BYTES // per_key)
        acc = None
        for a in range(0, past, step):
            k, v = self._expand(read(a, min(past, a + step)))
            acc = merge_attention(acc, *attention_lse(q, k, v, self.scale))
            del k, v
        k, v = self._expand(new)
        out, _ = merge_attention(acc, *attention_lse(q, k, v, self.scale, causal=True))
        return out.to(q.dtype)

    def _absorbed(self, q: torch.Tensor, entry: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        """One query per row against the latent cache. q: [B, H, 1, qk]; entry: [B, L, 576]. Returns [B, H, 1, v]."""
        w_k, w_v = self._head_weights()
        # the PyTorch products on every device: this path is the reference the paged (Triton) step is checked against
        q_lat = absorb_query_torch(q[:, :, 0], w_k)                                 # [B, H, C + rope]
        # Every head reads the same entries: the heads are the rows of one product per sequence (a broadcast over
        # a head axis would copy the entries once per head first).
        scores = upcast(torch.bmm(q_lat, entry.transpose(1, 2))) * self.scale      # [B, H, L]
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask[:, :, 0], float("-inf"))        # mask [B, 1, 1, L]
        p = scores.softmax(-1).to(entry.dtype)
        ctx = torch.bmm(p, entry[:, :, : self.kv_lora_rank])                        # [B, H, C]
        return expand_values_torch(ctx, w_v)[:, :, None]

    def _paged(self, q: torch.Tensor, view: PagedLatentView) -> torch.Tensor:
        """The absorbed step over a paged pool (the new entries already written). q: [B, H, 1, qk]. Returns
        [B, H, 1, v]."""
        w_k, w_v = self._head_weights()
        q_lat = absorb_query(q[:, :, 0], w_k)                                       # [B, H, C + rope]
        ctx = paged_mla_decode(q_lat, view.data, view.block_table, view.seq_lens, self.scale,
                               self.kv_lora_rank, num_splits=view.num_splits)     # [B, H, C]
        return expand_values(ctx, w_v)[:, :, None]

    def _varlen(self, q: torch.Tensor, entry: torch.Tensor, cache: VarlenLatents) -> torch.Tensor:
        """Packed sequences, each over its own past and new entries. q: [1, H, T, qk]; entry: [1, T, 576]. Returns
        [1, H, T, v]. The rows are laid out padded [N, Tm] (Tm the longest chunk): keys ``[past | new]`` under a
        mask; one-token rows take the absorbed form, longer ones the expanded form (expanding the past of every
        decode row into per-head keys would cost far more than attending in latent space)."""
        idx, valid = cache.layout()                                                 # [N, Tm]
        N, Tm = idx.shape
        P = cache.past.shape[1]
        qp = q[0][:, idx].transpose(0, 1)                                           # [N, H, Tm, qk]
        keys = torch.cat([cache.past.to(entry.dtype), entry[0][idx]], dim=1)        # [N, P + Tm, 576]
        j = torch.arange(P + Tm, device=idx.device)
        t = torch.arange(Tm, device=idx.device)
        in_past = (j[None] >= P - cache.past_len[:, None]) & (j[None] < P)          # [N, L]
        key_new = torch.cat([valid.new_zeros(N, P), valid], dim=1)                  # [N, L] a real new token
        new_ok = (j[None, None] - P <= t[None, :, None]) & key_new[:, None]         # [N, Tm, L] causal
        diag = j[None, None] - P == t[None, :, None]       # a padding query still sees itself: never a NaN row
        mask = (in_past[:, None] | new_ok | diag)[:, None]                          # [N, 1, Tm, L]
        one = valid.sum(1) == 1                                                     # rows with one new token
        out = qp.new_empty(N, self.num_heads, Tm, self.v_dim)
        if bool(one.any()):
            out[one, :, :1] = self._absorbed(qp[one, :, :1], keys[one], mask[one][..., :1, :])
        if bool((~one).any()):
            out[~one] = self._expanded(qp[~one], keys[~one], mask[~one])
        return out.transpose(0, 1)[:, valid][None]                                 # [1, H, T, v]

    def _head_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight per head: (W_k [H, nope, C], W_v [H, v, C]), views."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope], w[:, self.nope :]


def _needs_grad(x: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and x.requires_grad
