"""Triton ``chunk_kda``.

Forward: five small kernels with bounded register use (chunk_pipeline.py: gate sums, scores, inverse + WY, state
scan, output). The first Triton forward (one large intra-chunk kernel plus a scan) was 2.8x slower on the H200 and
spilled registers on sm_90; it was removed once the pipeline had been checked and timed there (BENCHMARKS.md).

Backward (:class:`ChunkKDAFunction`): the pipeline's Triton backward, with the forward's score matrices and inverse
kept (``LaunchConfig.keep_scores``, as fla keeps its own) and the rest recomputed (per-chunk states are never held
between forward and backward); with ``KIMI_LINEAR_CHUNK_BWD=torch``, the PyTorch
chunkwise path, recomputed and differentiated (the reference and the fallback).
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from ..checks import KDAShape, check_gate_params
from ..chunk import delta_rule_chunked
from ..gate import KernelOptions
from .chunk_pipeline import DEFAULT_CONFIG, Kept, chunk_kda_bwd_pipeline, chunk_kda_fwd_keeping
from .chunk_pipeline import chunk_kda_fwd_pipeline as chunk_kda_fwd  # the forward, on contiguous inputs


def default_backward() -> str:
    bwd = os.environ.get("KIMI_LINEAR_CHUNK_BWD", "triton")
    if bwd not in ("triton", "torch"):
        raise ValueError(f"KIMI_LINEAR_CHUNK_BWD must be 'triton' or 'torch', got {bwd!r}")
    return bwd


class ChunkKDAFunction(torch.autograd.Function):
    """Triton forward. Backward: the pipeline's Triton kernels (chunk_pipeline.py) unless ``KIMI_LINEAR_CHUNK_BWD``
    is "torch"; then the PyTorch chunkwise path, recomputed and differentiated (the reference and the fallback)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, A_log, dt_bias, scale, output_final_state, opts, cu_seqlens,
                cfg):
        keep = cfg.keep_scores and default_backward() == "triton"
        o, ht, kept = chunk_kda_fwd_keeping(q, k, v, g, beta, scale, initial_state, output_final_state, opts,
                                            cu_seqlens, cfg, keep)
        ctx.has_kept = kept is not None
        ctx.save_for_backward(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens,
                              *(kept.tensors() if kept is not None else ()))
        ctx.scale, ctx.opts, ctx.cfg = scale, opts, cfg
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        if default_backward() == "triton":
            dx = ChunkKDAFunction._triton_backward(ctx, do, dht)
        else:
            dx = ChunkKDAFunction._recompute_backward(ctx, do, dht)
        dx = [d if need else None for d, need in zip(dx, ctx.needs_input_grad[:8])]
        return (*dx, None, None, None, None, None)

    @staticmethod
    def _triton_backward(ctx, do, dht):
        q, k, v, g, beta, h0, A_log, dt_bias, cu_seqlens, *kept = ctx.saved_tensors
        kept = Kept.from_tensors(kept) if ctx.has_kept else None
        opts = ctx.opts
        if opts.use_gate_in_kernel:                                # the saved (autograd-tracked) parameters
            opts = KernelOptions(opts.use_qk_l2norm_in_kernel, True, opts.use_beta_sigmoid_in_kernel,
                                 opts.allow_neg_eigval, A_log, dt_bias, opts.lower_bound)
        r = chunk_kda_bwd_pipeline(q, k, v, g, beta, ctx.scale, h0, opts, cu_seqlens, do.contiguous(),
                                   None if dht is None else dht.float().contiguous(), ctx.cfg, kept)
        dh0 = None if r.dh0 is None else r.dh0.to(h0.dtype)
        return [r.dq, r.dk, r.dv, r.dg, r.dbeta, dh0, r.dA_log, r.ddt_bias]

    @staticmethod
    def _recompute_backward(ctx, do, dht):
        q, k, v, g, beta, h0, A_log, dt_bias, cu_seqlens = ctx.saved_tensors[:9]
        leaves = [x.detach().requires_grad_(need) if x is not None else None
                  for x, need in zip((q, k, v, g, beta, h0, A_log, dt_bias), ctx.needs_input_grad[:8])]
        with torch.enable_grad():
            o_ = ctx.opts
            opts = KernelOptions(o_.use_qk_l2norm_in_kernel, o_.use_gate_in_kernel, o_.use_beta_sigmoid_in_kernel,
                                 o_.allow_neg_eigval, leaves[6], leaves[7], o_.lower_bound)
            qq, kk, gg, bb = opts.apply(leaves[0], leaves[1], leaves[3], leaves[4])
            B, T, H, K = q.shape
            N = B if cu_seqlens is None else cu_seqlens.numel() - 1
            shape = KDAShape(B=B, T=T, H=H, HV=v.shape[2], K=K, V=v.shape[3], N=N)
            o, ht, _ = delta_rule_chunked(qq, kk, leaves[2], gg, bb, shape, ctx.scale, leaves[5], cu_seqlens)
            outs, grads = [o], [do.to(o.dtype)]
            if dht is not None:
                outs.append(ht)
                grads.append(dht.to(ht.dtype))
            wrt = [x for x in leaves if x is not None and x.requires_grad]
            got = iter(torch.autograd.grad(outs, wrt, grads, allow_unused=True))
        dx = [next(got) if x is not None and x.requires_grad else None for x in leaves]
        return [None if d is None else d.to(x.dtype) for d, x in zip(dx, (q, k, v, g, beta, h0, A_log, dt_bias))]


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    allow_neg_eigval: bool = False,
    disable_recompute: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton ``chunk_kda``: same contract as :func:`kimi_linear.ops.chunk_kda` (inputs validated there).
    ``disable_recompute`` (fla's option) runs ``LaunchConfig.keep_factors``: the forward also keeps its WY
    factors, and the backward skips recomputing them."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    scale = K ** -0.5 if scale is None else scale
    if use_gate_in_kernel:
        check_gate_params(HV, K, A_log, dt_bias, lower_bound)
    elif A_log is not None or dt_bias is not None or lower_bound is not None:
        raise ValueError("`A_log`, `dt_bias` and `lower_bound` only apply with `use_gate_in_kernel=True`")
    if use_beta_sigmoid_in_kernel:
        # Once, in float32, by torch's own sigmoid (differentiated by autograd), as fla does before its kernels:
        # beta given as logits then reaches the kernels with the same bits as sigmoid(beta.float()) computed by the
        # caller. Recomputed inside the kernels (Triton's sigmoid: approximate exp and division on the GPU), beta
        # differed from torch's by a few ulps, which moved the bf16 outputs and gradients by up to 6e-5 relative
        # at T=512 and past fla's 1e-4 bar at T=8192 (its test_chunk_use_beta_sigmoid_in_kernel).
        beta = torch.sigmoid(beta.float())
        beta = 2 * beta if allow_neg_eigval else beta
        use_beta_sigmoid_in_kernel = allow_neg_eigval = False
    opts = KernelOptions(use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                         A_log, dt_bias, lower_bound)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    tensors = (q, k, v, g, beta, initial_state, A_log, dt_bias)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors):
        cfg = replace(DEFAULT_CONFIG, keep_factors=True) if disable_recompute else DEFAULT_CONFIG
        o, ht = ChunkKDAFunction.apply(*tensors, scale, output_final_state, opts, cu_seqlens, cfg)
        return o, (ht if output_final_state else None)
    return chunk_kda_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, opts, cu_seqlens, DEFAULT_CONFIG)
