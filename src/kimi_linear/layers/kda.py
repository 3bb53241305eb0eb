"""The KDA attention block of Kimi Linear (docs/model.md §3), with its fixed-size decoding state."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from kimi_linear.ops import chunk_kda, fused_recurrent_kda, short_conv
from kimi_linear.ops.backend import triton_op
from kimi_linear.ops.conv import short_conv_decode, short_conv_varlen
from kimi_linear.ops.native.kda import kda_block_decode, kda_decode

from .context_parallel import ContextParallel
from .linear import Linear, linear
from .norm import GatedRMSNorm, RMSNorm
from .packing import PackedLinears


def stacked_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a, b [B, T, n] -> [2, B*T, n]: a strided view when b's columns follow a's in the rows of one row-major
    tensor (adjacent pieces of a packed projection), else a stacked copy."""
    B, T, n = a.shape
    adjacent = (a.stride() == b.stride() and a.stride(-1) == 1 and a.stride(0) == T * a.stride(1)
                and b.data_ptr() == a.data_ptr() + n * a.element_size() and b.shape == a.shape)
    if adjacent:
        return a.as_strided((2, B * T, n), (n, a.stride(1), 1))
    return torch.stack([a.reshape(B * T, n), b.reshape(B * T, n)])


@dataclass
class KDAState:
    """Decoding state of one KDA layer for a batch; its size does not depend on the context length.

    conv: [B, W-1, 3*H*d] the last W-1 projected q|k|v inputs (model dtype). W-1 is all a width-W causal
        convolution needs to continue; storing a W-th column would only duplicate data.
    recurrent: [B, H, d, d] float32 delta-rule memory.
    """

    conv: torch.Tensor
    recurrent: torch.Tensor

    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.recurrent.numel() * self.recurrent.element_size()

    def select(self, rows: torch.Tensor) -> None:
        """Keep only batch rows ``rows`` (for beam search / dropping finished sequences)."""
        self.conv = self.conv[rows]
        self.recurrent = self.recurrent[rows]


@dataclass
class PooledKDAState:
    """A batch's KDA states living in rows of a serving pool, read and written in place (no gathered copy).

    conv_pool: [slots, W-1, 3*H*d]; rec_pool: [slots, H, d, d] float32; index: [B] int64 pool row of each batch row.
    The one-token step updates the recurrent memory (H*d*d*4 bytes, 2 MiB a row for Kimi-Linear-48B) inside the
    decode kernel through ``state_indices``: a gather and a scatter of it would triple the bytes a decode step
    moves. The conv windows (a few KB a row) are shifted in place the same way (:func:`short_conv_decode`: one
    kernel on CUDA instead of a gather, the conv and a scatter). Rows may share an index only where the row is
    padding (the pool's scratch row): their writes race and the result there is never read.
    """

    conv_pool: torch.Tensor
    rec_pool: torch.Tensor
    index: torch.Tensor

    @property
    def conv(self) -> torch.Tensor:
        return self.conv_pool.index_select(0, self.index)

    @conv.setter
    def conv(self, window: torch.Tensor) -> None:
        self.conv_pool.index_copy_(0, self.index, window.to(self.conv_pool.dtype))


@dataclass
class VarlenKDAState:
    """The KDA states of N sequences packed into one row (``cu_seqlens``), each continuing from its pool row: a
    mixed engine step (decode rows and prompt chunks in one forward). conv_pool / rec_pool as in
    :class:`PooledKDAState`; index: [N] int64 pool row of each sequence. The conv windows and memories are gathered,
    run through the varlen conv and ``chunk_kda``, and written back."""

    conv_pool: torch.Tensor
    rec_pool: torch.Tensor
    index: torch.Tensor


class KimiDeltaAttention(nn.Module):
    """One KDA block: projections, short conv, gates, the KDA operator, gated norm, output projection.

    Parameter names are the checkpoint's (``self_attn.*`` in docs/checkpoint.md §3).

    Kimi K3 switches (docs/model.md §7; both off = Kimi Linear exactly):
    gate_lower_bound: e.g. -5. The forget gate becomes ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``
        (the operator's ``lower_bound`` formula), so one step decays the memory by at most ``exp(lower_bound)``.
    full_rank_gate: one full-rank ``g_proj`` [H*d, D] replaces the low-rank output gate ``g_a_proj/g_b_proj``.
    """

    def __init__(
        self, hidden_size: int, num_heads: int, head_dim: int, conv_size: int = 4, eps: float = 1e-5,
        gate_lower_bound: float | None = None, full_rank_gate: bool = False,
    ) -> None:
        super().__init__()
        self.gate_lower_bound = None if gate_lower_bound is None else float(gate_lower_bound)
        self.full_rank_gate = full_rank_gate
        self.hidden_size, self.num_heads, self.head_dim, self.conv_size = hidden_size, num_heads, head_dim, conv_size
        width = num_heads * head_dim
        self.q_proj = Linear(hidden_size, width, bias=False)
        self.k_proj = Linear(hidden_size, width, bias=False)
        self.v_proj = Linear(hidden_size, width, bias=False)
        self.q_conv1d = nn.Conv1d(width, width, conv_size, groups=width, bias=False)
        self.k_conv1d = nn.Conv1d(width, width, conv_size, groups=width, bias=False)
        self.v_conv1d = nn.Conv1d(width, width, conv_size, groups=width, bias=False)
        # Low-rank forget gate (rank = head_dim), per-channel bias and per-head decay rate, both float32.
        self.f_a_proj = Linear(hidden_size, head_dim, bias=False)
        self.f_b_proj = Linear(head_dim, width, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(width, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.zeros(1, 1, num_heads, 1, dtype=torch.float32))
        self.b_proj = Linear(hidden_size, num_heads, bias=False)
        if full_rank_gate:
            # K3: full-rank output gate.
            self.g_proj = Linear(hidden_size, width, bias=False)
        else:
            # Low-rank output gate.
            self.g_a_proj = Linear(hidden_size, head_dim, bias=False)
            self.g_b_proj = Linear(head_dim, width, bias=False)
        self.o_norm = GatedRMSNorm(head_dim, eps=eps)
        self.o_proj = Linear(width, hidden_size, bias=False)
        self._pack: PackedLinears | None = None
        self._derived_cache: dict[str, tuple] = {}

    def pack(self) -> None:
        """Pack the six projections that read x (q, k, v, f_a, g_a or g_proj, b) into one matrix; see
        ``PackedLinears``."""
        self._pack = PackedLinears([self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self._gate_in_proj(),
                                    self.b_proj])

    def _gate_in_proj(self) -> nn.Linear:
        """The output-gate projection that reads x: ``g_proj`` (full rank) or ``g_a_proj`` (low rank)."""
        return self.g_proj if self.full_rank_gate else self.g_a_proj

    def empty_state(self, batch_size: int, dtype: torch.dtype, device: torch.device) -> KDAState:
        """A zero state: what a sequence starts from."""
        H, d = self.num_heads, self.head_dim
        return KDAState(
            conv=torch.zeros(batch_size, self.conv_size - 1, 3 * H * d, dtype=dtype, device=device),
            recurrent=torch.zeros(batch_size, H, d, d, dtype=torch.float32, device=device),
        )

    def _conv(
        self, x: torch.Tensor, state: KDAState | PooledKDAState | VarlenKDAState | None,
        pos: torch.Tensor | None = None, prev: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal depthwise conv + SiLU over q|k|v (:func:`kimi_linear.ops.conv.short_conv`, Triton on CUDA).
        x: [B, T, 3*H*d] -> same shape; updates ``state.conv``.

        pos: [T] position of each token inside its packed document; a tap that would reach back past the
        document's start is dropped, so the window never crosses a boundary.
        prev: [B, W-1, C] the inputs before x when they are not in ``state`` (context parallelism: the previous
        rank's last inputs).
        cu_seqlens: with a :class:`VarlenKDAState`, the packed sequences, each continuing from its own window.
        """
        if isinstance(state, VarlenKDAState):
            past = state.conv_pool.index_select(0, state.index)
            y, windows = short_conv_varlen(x, self._conv_weight(x.dtype), past, cu_seqlens)
            state.conv_pool.index_copy_(0, state.index, windows.to(state.conv_pool.dtype))
            return y
        if isinstance(state, PooledKDAState) and x.shape[1] == 1 and pos is None and prev is None:
            # the decode step: gather, conv and write-back of the windows in one kernel on CUDA
            return short_conv_decode(x, self._conv_weight(x.dtype), state.conv_pool, state.index)
        past = prev if prev is not None else state.conv if state is not None else None
        y, window = short_conv(x, self._conv_weight(x.dtype), past, pos)
        if state is not None:
            state.conv = window
        return y

    def gates(self, f_a: torch.Tensor, g_a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """(the raw forget gate ``f_b(f_a)``, the output gate ``g_b(g_a)`` (``g_a`` itself with the full-rank
        gate), each [B, T, H, d], and the operator options that turn the raw gate into ``-exp(A_log) * softplus(g
        + dt_bias)`` inside the kernel, or with ``gate_lower_bound`` ``lower_bound * sigmoid(exp(A_log) * (g +
        dt_bias))``). A subclass with another forget gate (Gated DeltaNet) overrides this.

        Without autograd the two up-projections run as one batched product over the stacked ``[f_b^T, g_b^T]``
        (a decode step pays per kernel, and each is a ~1 MB GEMV); ``f_a`` and ``g_a`` are adjacent columns of
        the packed projection, so their [2, B*T, d] view is read in place."""
        args = dict(use_gate_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias)
        if self.gate_lower_bound is not None:
            args["lower_bound"] = self.gate_lower_bound
        B, T, _ = f_a.shape
        shape = (B, T, self.num_heads, self.head_dim)
        pair = (self.f_b_proj.weight, None if self.full_rank_gate else self.g_b_proj.weight)
        if self.full_rank_gate or (torch.is_grad_enabled() and any(w.requires_grad for w in pair)):
            return self.f_b_proj(f_a).view(shape), self.output_gate(g_a), args
        w = self._derived("gates", pair, f_a.dtype, lambda ws: torch.stack([v.t() for v in ws]))   # [2, d, H*d]
        out = torch.bmm(stacked_rows(f_a, g_a), w)                                                  # [2, B*T, H*d]
        return out[0].view(shape), out[1].view(shape), args

    def output_gate(self, g_a: torch.Tensor) -> torch.Tensor:
        """The output gate's pre-activation [B, T, H, d] from ``g_a`` (the gate projection of x)."""
        B, T, _ = g_a.shape
        return (g_a if self.full_rank_gate else self.g_b_proj(g_a)).view(B, T, self.num_heads, self.head_dim)

    def _derived(self, name: str, ws: tuple, dtype: torch.dtype, build) -> torch.Tensor:
        """``build(ws)`` in ``dtype``, cached between calls and rebuilt whenever a weight changes (storage or
        in-place version): decoding pays per op. Under autograd it is always rebuilt."""
        if torch.is_grad_enabled() and any(w.requires_grad for w in ws):
            return build(ws).to(dtype)
        key = (dtype, *((w.data_ptr(), w._version) for w in ws))
        hit = self._derived_cache.get(name)
        if hit is None or hit[0] != key:
            with torch.no_grad():
                hit = self._derived_cache[name] = (key, build(ws).to(dtype).contiguous())
        return hit[1]

    def _conv_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """q|k|v conv taps as one [W, 3*H*d] tensor (cached, :meth:`_derived`)."""
        ws = (self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight)
        return self._derived("conv", ws, dtype, lambda ws: torch.cat(ws, 0)[:, 0].t())

    def _native_step(self, call, state: KDAState | PooledKDAState, dtype: torch.dtype, *after) -> list | None:
        """One of the C decode calls of :mod:`kimi_linear.ops.native.kda` on ``state``: ``call`` takes the layer's
        conv taps, the state's windows and memories, its gate and norm constants, then ``after`` and the pool
        ``rows``, and returns its outputs followed by the new window and memory (or None: the call does not
        apply). A serving pool is updated in place by the call; a KDAState takes the new tensors here. Returns the
        outputs (or None)."""
        pooled = isinstance(state, PooledKDAState)
        done = call(
            self._conv_weight(dtype), state.conv_pool if pooled else state.conv,
            state.rec_pool if pooled else state.recurrent, self.A_log.view(-1), self.dt_bias, self.gate_lower_bound,
            self.o_norm.weight, self.o_norm.eps, self.head_dim**-0.5, *after, rows=state.index if pooled else None,
        )
        if done is None:
            return None
        *outputs, window, memory = done
        if not pooled:
            state.conv, state.recurrent = window, memory
        return outputs

    def _decode_native(self, qkv: torch.Tensor, g: torch.Tensor, gate: torch.Tensor, beta_raw: torch.Tensor,
                       state: KDAState | PooledKDAState) -> torch.Tensor | None:
        """A decode token's conv, gates, memory update and output norm as one CPU kernel call
        (:func:`kimi_linear.ops.native.kda.kda_decode`), updating ``state``; o [B, 1, H*d] before ``o_proj``, or
        None where the kernel does not apply (CUDA, 16-bit, autograd, no C compiler): then the PyTorch ops run."""
        if qkv.device.type != "cpu" or triton_op("short_conv", qkv) is not None:   # (CPU under the interpreter)
            return None
        done = self._native_step(partial(kda_decode, qkv, g, gate, beta_raw), state, qkv.dtype)
        return None if done is None else done[0]

    def decode_block(self, x: torch.Tensor, state: KDAState | PooledKDAState, in_norm: RMSNorm | None = None,
                     post_norm: RMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """A CPU decode token from the layer's input to its output projection as one C call
        (:func:`kimi_linear.ops.native.kda.kda_block_decode`: every op between two BLAS products costs more than
        its arithmetic there), updating ``state``; optionally with the decoder layer's input norm in front
        (``in_norm``) and its residual add and next norm behind (``post_norm``: x is then the residual stream).
        x [B, 1, D] -> (out [B, 1, D], the next norm's output or None), as ``post_norm(forward(in_norm(x)),
        residual=x)`` would give them in the other order; or None where the kernel does not apply (CUDA, 16-bit,
        autograd, more rows than it takes, unpacked weights, a subclass's own gates): then run :meth:`forward`."""
        if (x.device.type != "cpu" or x.dim() != 3 or x.shape[1] != 1 or type(self).gates is not
                KimiDeltaAttention.gates or self._pack is None or not self._pack.valid()
                or self.o_proj.bias is not None or not isinstance(state, (KDAState, PooledKDAState))
                or triton_op("short_conv", x) is not None):
            return None
        norms = [None if n is None else (n.weight, n.eps) for n in (in_norm, post_norm)]
        call = partial(kda_block_decode, x, self._pack.weight, self.f_b_proj.weight,
                       None if self.full_rank_gate else self.g_b_proj.weight)
        done = self._native_step(call, state, x.dtype, self.o_proj.weight, *norms)
        return None if done is None else (done[0], done[1])

    def forward(
        self,
        x: torch.Tensor,
        state: KDAState | PooledKDAState | VarlenKDAState | None = None,
        padding_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        context_parallel: ContextParallel | None = None,
        project: bool = True,
    ) -> torch.Tensor:
        """x: [B, T, D] -> [B, T, D] (``project=False``: the input of o_proj, [B, T, H d], for a caller that folds
        the projection into what follows, :func:`kimi_linear.ops.project_add_rms_norm`).

        cu_seqlens: [N+1] offsets of documents packed into one row (B == 1, no state): neither the conv window nor
            the recurrent memory crosses a document boundary.
        state: updated in place when given (conv window and recurrent memory); ``None`` runs a stand-alone prefill.
        padding_mask: [B, T] bool/int, 0 at padding. Padding inputs are zeroed, so with k = v = 0 they neither
            write into the memory nor into the conv window of later tokens: a left-padded row computes exactly what
            the same row computes alone.
        context_parallel: x is this rank's piece of a sequence split along time (no state, no cu_seqlens): the conv
            window reaches into the previous rank's last inputs and the memory starts from its final state.
        """
        B, T, _ = x.shape
        H, d = self.num_heads, self.head_dim
        if padding_mask is not None:
            x = x * padding_mask[..., None].to(x.dtype)
        gate_w = H * d if self.full_rank_gate else d
        if self._pack is not None and self._pack.valid():
            qkv, f_a, g_a, beta_raw = linear(x, self._pack.weight).split([3 * H * d, d, gate_w, H], dim=-1)
        else:
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
            f_a, g_a, beta_raw = self.f_a_proj(x), self._gate_in_proj()(x), self.b_proj(x)
        pos = None
        if cu_seqlens is not None:
            starts = torch.repeat_interleave(cu_seqlens[:-1], cu_seqlens.diff())
            pos = torch.arange(T, device=x.device) - starts.to(x.device)
        g, gate, gate_args = self.gates(f_a, g_a)
        if T == 1 and isinstance(state, (KDAState, PooledKDAState)) and gate_args.get("use_gate_in_kernel"):
            o = self._decode_native(qkv, g, gate, beta_raw, state)
            if o is not None:
                return self.o_proj(o) if project else o
        prev = context_parallel.previous_rows(qkv, self.conv_size - 1) if context_parallel is not None else None
        q, k, v = self._conv(qkv, state, pos, prev, cu_seqlens).view(B, T, 3, H, d).unbind(2)
        kda = fused_recurrent_kda if (state is not None and T == 1) else chunk_kda
        if context_parallel is not None:
            kda = context_parallel.chunk_kda            # chunk_kda's contract; the state comes from rank - 1
        if isinstance(state, PooledKDAState):
            if T != 1:
                raise ValueError("a PooledKDAState serves one-token decode steps only (T == 1)")
            # The pool's owner (the engine, generate's decode pools) made the indices: no device-side range check.
            memory = dict(initial_state=state.rec_pool, state_indices=state.index, output_final_state=False,
                          trusted_indices=True)
        elif isinstance(state, VarlenKDAState):
            if cu_seqlens is None or B != 1:
                raise ValueError("a VarlenKDAState needs the packed sequences' `cu_seqlens` (B == 1)")
            kda = chunk_kda
            memory = dict(initial_state=state.rec_pool.index_select(0, state.index), output_final_state=True)
        else:
            memory = dict(initial_state=state.recurrent if state is not None else None,
                          output_final_state=state is not None)
        o, final = kda(
            q, k, v, g, beta_raw,
            scale=d**-0.5,
            **memory,
            use_qk_l2norm_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            **gate_args,
            cu_seqlens=cu_seqlens,
        )
        if isinstance(state, KDAState):
            state.recurrent = final
        elif isinstance(state, VarlenKDAState):
            state.rec_pool.index_copy_(0, state.index, final)
        o = self.o_norm(o, gate).reshape(B, T, H * d)
        return self.o_proj(o) if project else o
