"""Sigmoid-routed mixture of experts with a correction bias and shared experts (docs/model.md §5), and Kimi K3's
LatentMoE (docs/model.md §7): routed experts in a narrower latent space."""

from __future__ import annotations

import torch
from torch import nn

from ..ops.moe import fused_moe, fused_moe_available, router_logits, sigmoid_topk
from ..ops.native.moe import moe_decode
from .activation import GLU, SiTUGLU, silu_glu
from .linear import Linear, linear
from .mlp import SwiGLUMLP
from .norm import RMSNorm, upcast
from .packing import PackedLinears


class Expert(nn.Module):
    """One routed expert, ``w2(SiLU(w1 x) * w3 x)``; checkpoint names ``w1`` (gate), ``w2`` (down), ``w3`` (up).
    ``glu`` replaces ``SiLU(a) * b`` (K3: SiTU)."""

    def __init__(self, hidden_size: int, intermediate_size: int, glu: GLU = silu_glu) -> None:
        super().__init__()
        self.glu = glu
        self.w1 = Linear(hidden_size, intermediate_size, bias=False)
        self.w2 = Linear(intermediate_size, hidden_size, bias=False)
        self.w3 = Linear(hidden_size, intermediate_size, bias=False)
        self._pack: PackedLinears | None = None

    def pack(self) -> None:
        """Pack w1 and w3 (both read x) into one matrix; see ``PackedLinears``. Nothing to do while they are packed
        already (e.g. into the stack of all experts by ``SparseMoE.pack``, which runs first)."""
        if self._pack is None or not self._pack.intact():
            self._pack = PackedLinears([self.w1, self.w3])

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """``glu(w1 x, w3 x)``: [..., D] -> [..., intermediate]."""
        if self._pack is not None and self._pack.valid():
            gate, up = linear(x, self._pack.weight).chunk(2, dim=-1)
        else:
            gate, up = self.w1(x), self.w3(x)
        return self.glu(gate, up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self.hidden(x), self.w2.weight)


class SigmoidTopKRouter(nn.Module):
    """Router: float32 logits, ``s = sigmoid(logits)``, choose top-k of ``s + e_score_correction_bias`` (optionally
    limited to the best ``topk_group`` of ``n_group`` expert groups), weight by the *unbiased* ``s``, optionally
    renormalise to sum 1, multiply by ``routed_scaling_factor``.

    ``weight`` and ``e_score_correction_bias`` stay float32 whatever the model dtype: the bias is a load-balancing
    offset of order 1e-3 that bf16 would erase.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        routed_scaling_factor: float = 1.0,
        renormalize: bool = True,
        n_group: int = 1,
        topk_group: int = 1,
    ) -> None:
        super().__init__()
        if top_k > num_experts:
            raise ValueError(f"`num_experts_per_tok` ({top_k}) must be <= `num_experts` ({num_experts})")
        if n_group < 1 or num_experts % n_group:
            raise ValueError(f"`n_group` ({n_group}) must divide `num_experts` ({num_experts})")
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        self.num_experts, self.top_k = num_experts, top_k
        self.routed_scaling_factor, self.renormalize = routed_scaling_factor, renormalize
        self.n_group, self.topk_group = n_group, topk_group

    def forward(self, x: torch.Tensor, prefetch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, D] -> (weights [N, k] float32, expert indices [N, k] int64). ``prefetch``: weights the caller
        reads next whatever the routing (:func:`kimi_linear.ops.router_logits`: a hint, no effect on results)."""
        # float32 (float64 for float64 inputs): x widened first
        logits = router_logits(x, self.weight, prefetch=prefetch)
        if self.n_group == 1:       # one Triton kernel on a GPU when no gradient is needed (ops.sigmoid_topk)
            return sigmoid_topk(logits, self.e_score_correction_bias, self.top_k, self.renormalize,
                                self.routed_scaling_factor)
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        if self.n_group > 1:
            # Group-limited routing (DeepSeek-V3 style): keep the topk_group groups whose two best experts score
            # highest, then choose the top-k experts inside them.
            grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(-1)
            keep = group_scores.topk(self.topk_group, dim=-1)[1]
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = grouped.masked_fill(~group_mask[..., None], float("-inf")).view(-1, self.num_experts)
        idx = choice.topk(self.top_k, dim=-1)[1]
        w = scores.gather(1, idx)
        if self.renormalize:
            w = w / w.sum(-1, keepdim=True).add_(1e-20)
        return (w * self.routed_scaling_factor if self.routed_scaling_factor != 1.0 else w), idx


class SparseMoE(nn.Module):
    """Routed experts plus shared SwiGLU experts; checkpoint prefix ``block_sparse_moe``.

    LatentMoE (K3, ``latent_size`` set): the router still reads the full-width x, but the routed experts run on
    ``z = routed_expert_down_proj(x)`` [.., latent_size]; their weighted sum is RMS-normed (``routed_expert_norm``,
    when ``latent_norm``) and mapped back by ``routed_expert_up_proj``. The norm sits after the weighted sum, as in
    the released K3 (norm of the aggregate, then up-projection). Shared experts stay full width.

    Routed experts, by device and mode (all the same math):

    - CUDA, no gradient needed: :func:`kimi_linear.ops.fused_moe` (Triton grouped GEMMs over the experts' packed
      weights; fixed shapes, no host sync, so also the CUDA-graph step's path);
    - static_dispatch (set by the fixed-shape decode step, ``model/paged.py``) otherwise: every
      expert on every row, :meth:`_dense` (fixed shapes, never reads routing results on the host);
    - else one token: its k experts one after the other (:meth:`_one_token`); a batch: sorted by expert, one
      matmul pair per expert with tokens (:meth:`_dispatch`).

    :meth:`pack` (run by the model's ``optimize_layout``) stacks the experts' weights into w13 [E, 2I, W] and w2
    [E, W, I] and makes every expert's ``w1/w3/w2.weight`` a view into them: the fused and dense paths read the
    stacks, nothing is duplicated (the 48B model's experts are ~90 GB in bf16), ``state_dict()`` is unchanged.
    """

    static_dispatch: bool = False
    _stacked: tuple | None = None      # a stacked copy, only while the packed views are broken (_stacked_experts)
    _packed: tuple | None = None       # from pack(): the experts' weight dicts, their data pointers, stack layouts

    def __init__(
        self,
        hidden_size: int,
        moe_intermediate_size: int,
        num_experts: int,
        top_k: int,
        num_shared_experts: int = 1,
        routed_scaling_factor: float = 1.0,
        renormalize: bool = True,
        n_group: int = 1,
        topk_group: int = 1,
        glu: GLU = silu_glu,
        latent_size: int | None = None,
        latent_norm: bool = False,
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.gate = SigmoidTopKRouter(
            hidden_size, num_experts, top_k, routed_scaling_factor, renormalize, n_group, topk_group
        )
        self.latent_size = latent_size
        width = latent_size or hidden_size
        if latent_size is not None:
            self.routed_expert_down_proj = Linear(hidden_size, latent_size, bias=False)
            self.routed_expert_up_proj = Linear(latent_size, hidden_size, bias=False)
            self.routed_expert_norm = RMSNorm(latent_size, eps) if latent_norm else None
        self.experts = nn.ModuleList(Expert(width, moe_intermediate_size, glu) for _ in range(num_experts))
        self.shared_experts = (
            SwiGLUMLP(hidden_size, moe_intermediate_size * num_shared_experts, glu) if num_shared_experts > 0
            else None
        )

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x: [..., D] -> [..., D]; plus ``residual`` (x's shape) when given: the decoder layer's residual add,
        which the fused op folds into its combine when nothing comes after the experts (one kernel less a layer)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if self.latent_size is None:
            z = flat
            fused = self._fused_weights(z)
            if fused is None and not self.static_dispatch and flat.device.type == "cpu":
                out = self._decode_native(flat, residual)
                if out is not None:
                    return out.view(shape)
            # The shared expert's gate/up weights (the fused op reads them whatever the routing) go to L2 while
            # the router runs.
            weights, idx = self.gate(flat, prefetch=fused[0][-1] if fused is not None and fused[2] else None)
        else:
            weights, idx = self.gate(flat)
            z = self.routed_expert_down_proj(flat)                                   # [N, latent]
            fused = self._fused_weights(z)
        shared_done = False
        if fused is not None:
            w13, w2, shared_done = fused
            last = self.latent_size is None and (shared_done or self.shared_experts is None)
            folded = residual.reshape(flat.shape) if last and residual is not None else None
            out = fused_moe(z, w13, w2, weights, idx, num_shared=int(shared_done), residual=folded,
                            **self._activation())
            if folded is not None:
                return out.view(shape)
        elif self.static_dispatch:
            out = self._dense(z, weights, idx)
        elif flat.shape[0] == 1:
            out = self._one_token(z, weights, idx)
        else:
            out = torch.zeros_like(z)
            self._dispatch(z, weights, idx, out)
        if self.latent_size is not None:
            if self.routed_expert_norm is not None:
                out = self.routed_expert_norm(out)
            out = self.routed_expert_up_proj(out)
        if self.shared_experts is not None and not shared_done:
            out = out + self.shared_experts(flat)
        out = out.view(shape)
        return out if residual is None else residual + out

    def _decode_native(self, flat: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor | None:
        """A CPU decode step's rows through the whole layer in one C call (:func:`kimi_linear.ops.native.moe.
        moe_decode`: router, experts, shared expert, residual add) when the experts are packed with the shared expert
        stacked last (or none), SiLU experts, one expert group, no latent space, and the rows within the kernel's
        limits (``MAX_ROWS``, ``MAX_WORK``); else None (the PyTorch paths run)."""
        if self.latent_size is not None or self.experts[0].glu is not silu_glu or self.gate.n_group != 1:
            return None
        packed = self._packed_experts()
        if packed is None or (self.shared_experts is not None and not packed[2]):
            return None
        w13, w2, shared = packed
        router = self.gate
        done = moe_decode(flat, router.weight, router.e_score_correction_bias, router.top_k, router.renormalize,
                          router.routed_scaling_factor, w13, w2, len(self.experts) if shared else None,
                          None if residual is None else residual.reshape(flat.shape))
        return None if done is None else done[0]

    def _one_token(self, z: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Decode: z [1, W] through its k experts, no sort / bincount machinery (pure overhead at this size).
        Each down projection accumulates into the sum in place, scaled by its routing weight (decoding is bound
        by per-op overhead)."""
        out = None
        for e, w in zip(idx[0].tolist(), weights[0].tolist()):
            expert = self.experts[e]
            y = linear(expert.hidden(z), expert.w2.weight)
            out = y.mul_(w) if out is None else out.add_(y, alpha=w)
        return out

    def _dense(self, z: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Every expert on every row, combined with the routing weights scattered into a dense [N, E] matrix (0
        for experts not chosen). z [N, W] -> [N, W]. Capture-safe (a CUDA graph): fixed shapes, no host sync, no
        value-dependent branch. E/k times the expert FLOPs of the routed paths, which a GPU decode step of a few
        dozen rows has to spare (it reads every expert's weights anyway once N*k >= E)."""
        w13, w2 = self._stacked_experts()
        gate, up = torch.matmul(z, w13.transpose(1, 2)).chunk(2, dim=-1)                   # [E, N, I] each
        y = torch.bmm(self.experts[0].glu(gate, up), w2.transpose(1, 2))                   # [E, N, W]
        dense = torch.zeros(z.shape[0], len(self.experts), dtype=torch.float32, device=z.device)
        dense.scatter_(1, idx, weights.float())                                             # [N, E]
        return torch.einsum("enw,ne->nw", upcast(y), dense).to(z.dtype)

    # ------------------------------------------------------------------------------------------ packed experts
    @torch.no_grad()
    def pack(self) -> None:
        """Stack the experts' weights, w1|w3 into w13 [E, 2I, W] and w2 into [E, W, I], and make every expert's
        weights views into the stacks (its ``_pack`` the view w13[e]). One transient copy of this layer's experts
        while it runs; afterwards the experts' memory once. In-place updates of the weights (``load_state_dict``,
        an optimizer step) write through the views; replacing a weight (``assign=True``, ``.data = ``) breaks
        them, which :meth:`_packed_experts` notices. Skipped (the experts pack themselves) unless all weights share
        one dtype and device and are plain tensors (not e.g. FSDP's DTensors).

        A shared expert of the routed experts' shape (one shared expert, no latent space: Kimi Linear) is stacked
        last, at index E, its gate|up and down projections views like the experts': the fused op then runs it as
        one more pair per token (``num_shared=1``) instead of three more matmuls, an activation and an add.

        Layout: on CUDA both stacks are row-major (each row of w13 and w2 contiguous: the kernels read along W and
        I). On CPU each expert matrix keeps its longer dimension contiguous, as ``PackedLinears`` and the model's
        ``optimize_layout`` store them (faster CPU matrix-vector products)."""
        mats = [(ex.w1, ex.w3, ex.w2) for ex in self.experts]
        sh = self.shared_experts
        if (sh is not None and self.latent_size is None and type(sh.glu) is type(self.experts[0].glu)
                and sh.gate_proj.weight.shape == self.experts[0].w1.weight.shape):
            mats.append((sh.gate_proj, sh.up_proj, sh.down_proj))
        lins = [lin for trio in mats for lin in trio]
        ws = [lin.weight for lin in lins]
        self._packed, self._stacked = None, None
        if len({(w.dtype, w.device, type(w.data)) for w in ws}) != 1 or type(ws[0].data) is not torch.Tensor:
            return
        E, (I, W) = len(mats), ws[0].shape
        dev, dt = ws[0].device, ws[0].dtype
        cpu = dev.type == "cpu"
        w13 = (torch.empty(E, W, 2 * I, dtype=dt, device=dev).transpose(1, 2) if cpu and 2 * I > W
               else torch.empty(E, 2 * I, W, dtype=dt, device=dev))
        w2 = (torch.empty(E, I, W, dtype=dt, device=dev).transpose(1, 2) if cpu and W > I
              else torch.empty(E, W, I, dtype=dt, device=dev))
        for e, (gate, up, down) in enumerate(mats):
            owner = self.experts[e] if e < len(self.experts) else sh
            owner._pack = PackedLinears([gate, up], into=w13[e])
            w2[e].copy_(down.weight)
            down.weight.data = w2[e]
        dicts = [lin._parameters for lin in lins]
        # The stacks themselves are not kept: only the views hold their memory, so it goes once they are replaced.
        self._packed = (dicts, [d["weight"].data_ptr() for d in dicts], (w13.shape, w13.stride()),
                        (w2.shape, w2.stride()), len(mats) > len(self.experts))

    def _packed_experts(self) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
        """The stacks of :meth:`pack` (w13 [E (+1), 2I, W], w2 [E (+1), W, I], whether the shared expert is the last)
        while every weight is still its view into them, else None. Checks one data pointer per weight (through the
        kept parameter dicts, which skips ``nn.Module.__getattr__``: this runs every decode step), then views the
        stacks again from the first expert's w1 and w2, which start them."""
        if self._packed is None:
            return None
        dicts, ptrs, (s13, st13), (s2, st2), shared = self._packed
        try:
            if [d["weight"].data_ptr() for d in dicts] != ptrs:
                return None
        except RuntimeError:        # a weight without storage (e.g. FSDP's sharded DTensor)
            return None
        return (dicts[0]["weight"].detach().as_strided(s13, st13, 0),
                dicts[2]["weight"].detach().as_strided(s2, st2, 0), shared)

    def _apply(self, fn, recurse: bool = True):
        """``.to()``, ``.half()``, ...: each expert weight moves on its own (``nn.Module._apply``), which breaks the
        packed views; pack again on the new device / dtype, and drop the old stacks."""
        was_packed = self._packed is not None
        self._packed, self._stacked = None, None
        super()._apply(fn, recurse)
        if was_packed:
            self.pack()
        return self

    def _stacked_experts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed experts' weights stacked, w1|w3 [E, 2I, W] and w2 [E, W, I]: the packed stacks of :meth:`pack`
        (without a shared expert stacked after them), or, when those are broken or were never made (a layer used
        on its own), a stacked copy (the routed experts' memory again), rebuilt when a weight changes (storage or
        in-place version)."""
        packed = self._packed_experts()
        if packed is not None:
            E = len(self.experts)
            return packed[0][:E], packed[1][:E]
        ws = [w for e in self.experts for w in (e.w1.weight, e.w3.weight, e.w2.weight)]
        key = tuple((w.data_ptr(), w._version, w.dtype) for w in ws)
        if self._stacked is None or self._stacked[0] != key:
            with torch.no_grad():
                w13 = torch.stack([torch.cat([e.w1.weight, e.w3.weight]) for e in self.experts])
                w2 = torch.stack([e.w2.weight for e in self.experts])
            self._stacked = (key, w13, w2)
        return self._stacked[1], self._stacked[2]

    def _activation(self) -> dict:
        """The experts' GLU as :func:`kimi_linear.ops.fused_moe` arguments ({} for SiLU)."""
        glu = self.experts[0].glu
        if isinstance(glu, SiTUGLU):
            return {"activation": "situ", "situ_beta": glu.beta, "situ_linear_beta": glu.linear_beta}
        return {}

    def _fused_weights(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
        """(w13, w2, whether the shared expert is stacked last) for :func:`kimi_linear.ops.fused_moe` when it runs
        the Triton kernels (CUDA) on z and nothing needs a gradient (the fused op has no backward), else None. The
        packed stacks; while they are broken, the CUDA-graph step (``static_dispatch``) takes a stacked copy (it
        cannot run the host-synchronising paths), the eager step the per-expert paths (no second copy of the
        experts in memory)."""
        glu = self.experts[0].glu
        if not (glu is silu_glu or isinstance(glu, SiTUGLU)) or not fused_moe_available(z):
            return None
        if torch.is_grad_enabled() and (z.requires_grad or any(p.requires_grad for p in self.experts.parameters())):
            return None
        packed = self._packed_experts()
        if packed is None and self.static_dispatch:
            packed = (*self._stacked_experts(), False)
        return packed

    def _dispatch(self, flat: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> None:
        """Add every token's weighted expert outputs into ``out`` [N, W] (W = expert width: D, or the latent);
        one matmul per expert over its tokens."""
        k = idx.shape[1]
        flat_idx = idx.reshape(-1)
        order = flat_idx.argsort(stable=True)
        counts = torch.bincount(flat_idx, minlength=len(self.experts)).tolist()
        token_of = order // k
        w_sorted = weights.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            tok = token_of[start : start + n]
            y = self.experts[e](flat[tok]) * w_sorted[start : start + n, None]
            out.index_add_(0, tok, y.to(out.dtype))
            start += n
