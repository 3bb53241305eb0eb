"""Triton ``chunk_kda``.

Forward implementations (``impl``; the default is ``KIMI_LINEAR_CHUNK_IMPL`` from the environment, else
"pipeline"):

- "pipeline": five small kernels with bounded register use (chunk_pipeline.py: gate sums, scores, inverse + WY,
  state scan, output).
- "fused" / "split": the first Triton forward, kept selectable until the GPU numbers decide between them: part 1
  in one kernel (chunk_intra.py) or two (chunk_split.py), then a scan that also writes the output (chunk_scan.py).

Backward (:class:`ChunkKDAFunction`): after the pipeline forward, the pipeline's Triton backward, which recomputes
the forward's intermediates (nothing per chunk is held between forward and backward). After the first forward, or
with ``KIMI_LINEAR_CHUNK_BWD=torch``: the PyTorch chunkwise path, recomputed and differentiated.
"""

from __future__ import annotations

import os

import torch
import triton

from ..checks import KDAShape, check_gate_params
from ..chunk import delta_rule_chunked
from ..gate import KernelOptions
from .chunk_intra import chunk_kda_fwd_intra_kernel
from .chunk_pipeline import (
    DEFAULT_CONFIG,
    LaunchConfig,
    chunk_kda_bwd_pipeline,
    chunk_kda_fwd_pipeline,
    varlen_tables,
)
from .chunk_scan import chunk_kda_fwd_scan_kernel
from .chunk_split import chunk_kda_fwd_scores_kernel, chunk_kda_fwd_wy_kernel

BT = 64        # chunk size
BC = 16        # sub-block inside a chunk
IMPLS = ("pipeline", "fused", "split")


def default_impl() -> str:
    impl = os.environ.get("KIMI_LINEAR_CHUNK_IMPL", "pipeline")
    if impl not in IMPLS:
        raise ValueError(f"KIMI_LINEAR_CHUNK_IMPL must be one of {IMPLS}, got {impl!r}")
    return impl


def chunk_kda_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
    initial_state: torch.Tensor | None, output_final_state: bool, opts: KernelOptions,
    cu_seqlens: torch.Tensor | None, block_v: int | None = None, num_warps: int | None = None,
    num_stages: int | None = None, intra_warps: int = 4, diag_slice: int = 16, stages: str = "both",
    impl: str | None = None, cfg: LaunchConfig = DEFAULT_CONFIG,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward only, on contiguous inputs; returns (o [B, T, HV, V] in q's dtype, final state or None).

    ``impl``: "pipeline" (launch shapes in ``cfg``), or the first forward's part 1 as one kernel ("fused") or two
    ("split"). None: :func:`default_impl`.

    Launch-shape knobs of the first forward, for benchmarks: ``block_v``, ``num_warps``, ``num_stages`` (scan
    kernel), ``intra_warps`` and ``diag_slice`` (intra kernel: 0 = diagonal blocks column by column, 16/32 = all
    pairs at once over slices of that many key channels); ``stages`` = "intra" or "scan" runs one kernel alone.
    """
    impl = impl or default_impl()
    if impl == "pipeline":
        return chunk_kda_fwd_pipeline(q, k, v, g, beta, scale, initial_state, output_final_state, opts, cu_seqlens,
                                      cfg)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    dev = q.device
    o = torch.empty(B, T, HV, V, dtype=q.dtype, device=dev)
    ht = torch.empty(N, HV, K, V, dtype=torch.float32, device=dev) if output_final_state else None
    if T == 0:
        if ht is not None:
            ht.copy_(initial_state if initial_state is not None else torch.zeros_like(ht))
        return o, ht
    if cu_seqlens is None:
        NT_seq = triton.cdiv(T, BT)
        NT, chunk_indices, chunk_offsets = B * NT_seq, None, None
    else:
        NT_seq = 0
        chunk_indices, chunk_offsets, NT = varlen_tables(cu_seqlens)
    # Intermediates in float32 except kend (see chunk_scan.py); products in tf32 for 16-bit inputs, exact (ieee)
    # for float32 inputs.
    half = q.dtype in (torch.bfloat16, torch.float16)
    prec = "tf32" if half else "ieee"
    f32 = dict(dtype=torch.float32, device=dev)
    qg = torch.empty(B, T, HV, K, **f32)
    kend = torch.empty(B, T, HV, K, dtype=q.dtype if half else torch.float32, device=dev)
    w = torch.empty(B, T, HV, K, **f32)
    u = torch.empty(B, T, HV, V, **f32)
    Aqk = torch.empty(B, T, HV, BT, **f32)
    decay = torch.empty(max(NT, 1), HV, K, dtype=torch.float32, device=dev)
    BK = triton.next_power_of_2(K)
    dummy = o
    A_log = opts.A_log.contiguous() if opts.use_gate_in_kernel else None
    dt_bias = opts.dt_bias.contiguous() if opts.use_gate_in_kernel and opts.dt_bias is not None else None
    if NT > 0 and stages != "scan" and impl == "split":
        varlen = dict(cu_seqlens=cu_seqlens if cu_seqlens is not None else dummy,
                      chunk_indices=chunk_indices if chunk_indices is not None else dummy)
        flags = dict(IS_VARLEN=cu_seqlens is not None, USE_BETA_SIGMOID=opts.use_beta_sigmoid_in_kernel,
                     NEG_EIGVAL=opts.allow_neg_eigval, PREC=prec)
        Akk = torch.empty(B, T, HV, BT, **f32)
        chunk_kda_fwd_scores_kernel[(NT, HV)](
            q, k, g, beta, A_log if A_log is not None else dummy, dt_bias if dt_bias is not None else dummy,
            **varlen, qg=qg, kend=kend, kgb=w, Aqk=Aqk, Akk=Akk, decay=decay,
            lower_bound=float(opts.lower_bound) if opts.lower_bound is not None else 0.0, T=T, NT=NT_seq,
            H=H, HV=HV, K=K, BT=BT, BC=BC, BK=BK, DIAG_BKS=diag_slice or 16,
            USE_QK_L2NORM=opts.use_qk_l2norm_in_kernel, USE_GATE=opts.use_gate_in_kernel,
            USE_LOWER_BOUND=opts.lower_bound is not None, HAS_DT_BIAS=dt_bias is not None, **flags,
            num_warps=intra_warps,
        )
        chunk_kda_fwd_wy_kernel[(NT, HV)](
            v, beta, Akk, w, u, **varlen, T=T, NT=NT_seq,
            HV=HV, K=K, V=V, BT=BT, BC=BC, BK=BK, BV=min(64, triton.next_power_of_2(V)), **flags,
            num_warps=intra_warps,
        )
    elif NT > 0 and stages != "scan":
        chunk_kda_fwd_intra_kernel[(NT, HV)](
            q, k, v, g, beta,
            A_log if A_log is not None else dummy, dt_bias if dt_bias is not None else dummy,
            cu_seqlens if cu_seqlens is not None else dummy,
            chunk_indices if chunk_indices is not None else dummy,
            qg, kend, w, u, Aqk, decay,
            float(opts.lower_bound) if opts.lower_bound is not None else 0.0, T, NT_seq,
            H=H, HV=HV, K=K, V=V, BT=BT, BC=BC, BK=BK, BV=min(64, triton.next_power_of_2(V)),
            IS_VARLEN=cu_seqlens is not None, USE_QK_L2NORM=opts.use_qk_l2norm_in_kernel,
            USE_GATE=opts.use_gate_in_kernel, USE_LOWER_BOUND=opts.lower_bound is not None,
            HAS_DT_BIAS=dt_bias is not None, USE_BETA_SIGMOID=opts.use_beta_sigmoid_in_kernel,
            NEG_EIGVAL=opts.allow_neg_eigval, PREC=prec, DIAG_BKS=diag_slice, num_warps=intra_warps,
        )
    if stages == "intra":
        return o, ht
    # H200, H=32, V=128 (bench --profile): BV 16/32/64 = 3.56/2.05/1.30 ms at 16x2048, 3.65/1.98/2.24 at 1x32768.
    # 32 is the width checked at full size on the GPU; 64 (faster at 16x2048) is not yet.
    BV = block_v or 32
    BV = min(BV, triton.next_power_of_2(V))
    chunk_kda_fwd_scan_kernel[(triton.cdiv(V, BV), N * HV)](
        qg, kend, w, u, Aqk, decay, o,
        initial_state if initial_state is not None else dummy, ht if ht is not None else dummy,
        cu_seqlens if cu_seqlens is not None else dummy, chunk_offsets if chunk_offsets is not None else dummy,
        scale, T,
        HV=HV, K=K, V=V, BT=BT, BK=BK, BV=BV,
        IS_VARLEN=cu_seqlens is not None, USE_INITIAL_STATE=initial_state is not None,
        STORE_FINAL_STATE=output_final_state, PREC=prec,
        num_warps=num_warps or 4, num_stages=num_stages or 2,
    )
    return o, ht


def default_backward() -> str:
    bwd = os.environ.get("KIMI_LINEAR_CHUNK_BWD", "triton")
    if bwd not in ("triton", "torch"):
        raise ValueError(f"KIMI_LINEAR_CHUNK_BWD must be 'triton' or 'torch', got {bwd!r}")
    return bwd


class ChunkKDAFunction(torch.autograd.Function):
    """Triton forward. Backward: the pipeline's Triton kernels (chunk_pipeline.py) when the forward is the pipeline
    and ``KIMI_LINEAR_CHUNK_BWD`` is not "torch"; otherwise the PyTorch chunkwise path, recomputed and
    differentiated (the reference and the fallback)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, A_log, dt_bias, scale, output_final_state, opts, cu_seqlens,
                impl, cfg):
        o, ht = chunk_kda_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, opts, cu_seqlens,
                              impl=impl, cfg=cfg)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens)
        ctx.scale, ctx.opts, ctx.impl, ctx.cfg = scale, opts, impl, cfg
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        if ctx.impl == "pipeline" and default_backward() == "triton":
            dx = ChunkKDAFunction._triton_backward(ctx, do, dht)
        else:
            dx = ChunkKDAFunction._recompute_backward(ctx, do, dht)
        dx = [d if need else None for d, need in zip(dx, ctx.needs_input_grad[:8])]
        return (*dx, None, None, None, None, None, None)

    @staticmethod
    def _triton_backward(ctx, do, dht):
        q, k, v, g, beta, h0, A_log, dt_bias, cu_seqlens = ctx.saved_tensors
        opts = ctx.opts
        if opts.use_gate_in_kernel:                                # the saved (autograd-tracked) parameters
            opts = KernelOptions(opts.use_qk_l2norm_in_kernel, True, opts.use_beta_sigmoid_in_kernel,
                                 opts.allow_neg_eigval, A_log, dt_bias, opts.lower_bound)
        r = chunk_kda_bwd_pipeline(q, k, v, g, beta, ctx.scale, h0, opts, cu_seqlens, do.contiguous(),
                                   None if dht is None else dht.float().contiguous(), ctx.cfg)
        dh0 = None if r.dh0 is None else r.dh0.to(h0.dtype)
        return [r.dq, r.dk, r.dv, r.dg, r.dbeta, dh0, r.dA_log, r.ddt_bias]

    @staticmethod
    def _recompute_backward(ctx, do, dht):
        q, k, v, g, beta, h0, A_log, dt_bias, cu_seqlens = ctx.saved_tensors
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
            o, ht = delta_rule_chunked(qq, kk, leaves[2], gg, bb, shape, ctx.scale, leaves[5], cu_seqlens)
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton ``chunk_kda``: same contract as :func:`kimi_linear.ops.chunk_kda` (inputs validated there)."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    scale = K ** -0.5 if scale is None else scale
    if use_gate_in_kernel:
        check_gate_params(HV, K, A_log, dt_bias, lower_bound)
    elif A_log is not None or dt_bias is not None or lower_bound is not None:
        raise ValueError("`A_log`, `dt_bias` and `lower_bound` only apply with `use_gate_in_kernel=True`")
    opts = KernelOptions(use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                         A_log, dt_bias, lower_bound)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    tensors = (q, k, v, g, beta, initial_state, A_log, dt_bias)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors):
        o, ht = ChunkKDAFunction.apply(*tensors, scale, output_final_state, opts, cu_seqlens, default_impl(),
                                       DEFAULT_CONFIG)
        return o, (ht if output_final_state else None)
    return chunk_kda_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, opts, cu_seqlens)
