"""Host side of the chunk pipeline: the forward as four small kernels, and the backward.

Forward (docs/kda.md §4-6), each kernel with a bounded working set:

    (a) chunk_prepare.py  gate -> gP (16-row sub-block sums), l2norm row factors rq, rk
    (b) chunk_wy.py       scores: Aqk, Akk per chunk, separable chunks in one product per channel step (two launches)
    (c, d) chunk_wy.py    (I + beta Akk)^-1 by 16x16 blocks; w, u, qg, kg, decay
    (e) chunk_state.py    the state scan: per chunk vn = u - w h and o = scale (qg h + Aqk vn), final state

Backward: recompute (a)-(e), the scan storing h per chunk and vn instead of forming o (in training,
:class:`Kept`: the forward's gate sums, score matrices and inverse are kept, as fla keeps its own, so (a), (b) and
(c) are skipped; the per-chunk states are never kept), the reverse state scan (chunk_state.py), then five per-chunk
kernels (chunk_bwd.py): products with the states and the WY factors' key side, the inverse and value side, the
score matrices (separable chunks whole, chunks bounded per sub-block by halves, the rest per 16-row sub-block),
the gate's cumulative sum and formula, and q/k (GVA sum, l2norm).

Intermediates that the products read (w, u, qg, kg, vn, h, Aqk) are kept in the *storage dtype*: bfloat16 for
bfloat16 inputs by default (``store="input"``; tensor-core operands as they are), float32 with ``store="float32"``
and for every other input dtype. gP, the inverse and the state in the scan are always float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..gate import KernelOptions
from .chunk_bwd import (
    chunk_kda_bwd_gate_kernel,
    chunk_kda_bwd_inter_kernel,
    chunk_kda_bwd_intra_kernel,
    chunk_kda_bwd_list_kernel,
    chunk_kda_bwd_listed_kernel,
    chunk_kda_bwd_qk_kernel,
    chunk_kda_bwd_wy_kernel,
)
from .chunk_common import BC, BT
from .chunk_prepare import chunk_kda_prepare_kernel
from .chunk_state import chunk_kda_bwd_dh_kernel, chunk_kda_fwd_h_kernel
from .chunk_wy import chunk_kda_fwd_scores_kernel, chunk_kda_fwd_wy_kernel
from .device import num_sms
from .ints import cdiv, next_pow2
from .tma import tensor_descriptor_class, tma_supported


@dataclass(frozen=True)
class LaunchConfig:
    """Launch shapes and the storage dtype (benchmarks sweep these; defaults are the tested ones)."""

    store: str = "input"              # "input": bf16 intermediates for bf16 inputs; "float32": always float32
    scores_bks: int = 32              # key channels per step in the scores kernel
    scores_warps: int = 4
    scores_stages: int = 3            # software pipelining of its channel loop (1: none); see scores_tma
    # Chunks not separable as a whole but whose every 16-row sub-block's gate falls by less than 60 go through
    # two products per channel step (chunk_wy.halves_scores) inside the other chunks' launch
    # (chunk_wy.blocked_scores), for 16-bit inputs (float32 takes the blocked scheme: the by-halves launch needs
    # more shared memory than the card has). H200, 2026-12-01, scores kernel ms at 16 x 2048 softplus /
    # lower_bound: 0.90 / 0.66, against 1.60 / 0.66 without them (with an earlier form of the blocked path) and
    # 0.95 / 0.72 in a launch of their own. (Not a setting.)
    # Training: the forward keeps the gate sums gP, Aqk, Akk, the inverse and the l2norm factors for the backward
    # (1,032 bytes per token and value head at K=V=128 with bf16 inputs, l2norm and the gate in the kernels, else
    # 1,160; the inputs are ~1 KiB; fla keeps its float32 gate sums, Aqk and its inverse in bf16 and l2-normalised
    # copies of q and k, ~1.3 KiB), which then skips the prepare, the scores and the inverse (H100, 16 x 2048: the
    # prepare alone 0.28 ms of ~14.5). False: recompute everything
    keep_scores: bool = True
    # With keep_scores, also the WY factors (w, u, qg, kg in the storage dtype: 1 KiB more per token and value head
    # at K=V=128 in bf16), so that the backward skips the WY kernel: H100, 16 x 2048 (2026-12-05), forward +
    # backward -1.3 to -1.4 ms (-9%) in every gate regime with the gate sums kept here too (the WY recompute 1.05
    # ms of it), the forward unchanged. Off by default for its memory; chunk_kda's disable_recompute=True (fla's
    # name for this trade) turns it on
    keep_factors: bool = False
    wy_bks: int = 32                  # key columns per step in the inverse + WY kernel
    # value columns per step of the WY kernel's u loop (two bf16 products each): H100, 16 x 2048 (2026-12-06), WY
    # kernel 1.221-1.234 ms with 64 against 1.267-1.276 with 32 and 1.248-1.260 with 128, in every gate regime.
    # Where it does not divide V the key step is taken, so that the tiles stay on TMA (tile_descriptors)
    wy_bv: int = 64
    wy_warps: int = 4
    wy_stages: int = 3                # software pipelining of the WY kernel's channel loops (3: Triton's default)
    # The WY products' k, v and gP tiles through TMA tensor descriptors (chunk_wy.chunk_tile), which Triton's
    # software pipeliner prefetches into shared memory (Nsight Compute, 2026-12-01: the products waited on their
    # pointer loads, which it does not pipeline). H200: WY kernel 1.77 -> 1.64 ms, the backward's recompute 1.12 ->
    # 0.98, outputs bit-identical. Used on sm_90+ where the widths divide by the channel step, else pointer loads.
    # q always by pointers: it feeds no product, so its descriptor load was waited on at once (chunk_wy.wy_products)
    wy_tma: bool = True
    # The same for the scores' q, k and gP tiles in all three paths (chunk_wy.separable_scores, halves_scores,
    # blocked_scores); it needs scores_stages > 1 to prefetch. H200 sweeps (2026-12-01), 16 x 2048, with
    # scores_stages=3 (2: 0.71, 4: 0.66 at lower_bound): separable scores 0.98 -> 0.89 ms softplus, 0.73 -> 0.65
    # lower_bound, outputs bit-identical; the full-size checks pass. In the other two paths (2026-12-02, with an
    # earlier form of the blocked path; offline sm_90 255 registers with 184 B of spills -> 247, none): strong
    # decay's 3.67 -> 3.31 ms, the by-halves path 1.009 -> 1.018 (lower_bound saturated), the rest unchanged
    scores_tma: bool = True
    # value columns per program of the state scans (forward and backward); 0: 64 when that still gives two programs
    # per SM (16 x 2048 tokens, H=32: fwd 0.47 / bwd 0.72 ms against 0.60 / 1.10 with 32 on the H200), else 32
    # (1 x 32768: 0.95 against 1.09 with 64). The forward scan, which forms the output, swept again at 1 x 32768
    # (H100, 2026-12-06, `--sweep --sweep-fwd`): 32 columns 0.82 ms, 64: 0.85, 16: 1.24; 8 warps 1.19, 2 warps
    # 3.73; 2 stages 1.12 (4 need 248 KiB of shared memory)
    h_bv: int = 0
    h_warps: int = 4
    # software pipelining of the backward's state scans (its recompute and the reverse scan); 0: 3 for few sequences
    # (1 x 32768, H=32: forward scan 0.77 against 0.96 ms with 2), 2 otherwise (16 x 2048: 0.48 against 0.59 with
    # 3; both measured before the forward scan formed the output); the same rule as h_bv's
    h_stages: int = 0
    # the same for the forward's scan, which forms the output; 0: 3 for 16-bit intermediates at K <= 128, whatever
    # the shape (H200, 16 x 2048, 2026-12-04: 0.469 against 0.653 ms with 2, in every gate regime)
    h_out_stages: int = 0
    bwd_bk: int = 64                  # key channels per program of the backward's per-chunk kernels
    # value columns per step of the backward's WY kernel (dv, and the value side of dbeta and dAkk): H100, 16 x 2048
    # (2026-12-06), 1.11-1.12 ms at 32 against 1.20-1.21 at bwd_bk's 64 in every gate regime (246 registers and no
    # stack offline, against 255 and 168 B)
    bwd_wy_bv: int = 32
    bwd_warps: int = 4
    # warps of the inter kernel alone (0: bwd_warps): 8 timed 3.23 ms against 3.75 with 4 (H200, 2026-12-01), no
    # spills (936 bytes of stack at 4)
    bwd_inter_warps: int = 8
    # The score-gradient kernel: key channels per program, warps (0: bwd_warps) and the products of 16-bit inputs.
    # tf32 (operands rounded, tf32_round) with 32 channels and 2 warps timed 6.08 ms against 8.05 for tf32x3 with
    # 64 and 4 (H200, 2026-12-01); the gradients then differ from tf32x3's by 1e-3 (dq, dk) and 5e-3 (dg), and
    # from the float64 reference at full size by at most 4.4e-3 (dA_log 6.7e-3; bar 2e-2). bfloat16 inputs only:
    # float16 inputs take tf32x3, float32 inputs ieee (Problem.prec_exact says why)
    bwd_intra_bk: int = 32
    bwd_intra_warps: int = 2
    bwd_intra_prec: str = "tf32"
    # Score gradients of separable chunks (chunk_common.chunk_separable) by one program per chunk and value head,
    # four [64, 64] x [64, BK] products per key block (chunk_bwd.separable_grads); H200 (16 x 2048 lower_bound):
    # 3.32 ms against 5.08 by sub-blocks. A program per key block as well cost K3's saturated gates 0.228 ms and
    # strong decay 0.398 in programs that find no separable chunk (0.068 / 0.262 looping over the key blocks;
    # 0.03 ms more where every chunk is separable)
    bwd_sep_bk: int = 32              # its key channels per loop step (64 spills heavily on sm_90)
    bwd_sep_warps: int = 4
    # Programs per SM of the score gradients by halves (chunk_bwd.chunk_kda_bwd_listed_kernel, looping over the
    # chunks that need them; 255 registers at 4 warps fit two an SM). H200, 16 x 2048, K3's saturated gates (every
    # chunk listed): 3.93 ms, against 5.52 for the same chunks by sub-blocks. H100, the same input (2026-12-06): 3.93
    # ms as set, 6.29 at 8 warps one an SM (236 registers, no stack), 6.71 capped at 168 three an SM (976 B of stack)
    bwd_halves_per_sm: int = 2
    # The same for the other listed chunks' sub-block scheme (chunk_bwd.sub_block_grads; 255 registers at 2 warps
    # fit four an SM). H200, 16 x 2048 fwd+bwd, against a launch of one program per chunk and sub-block over every
    # chunk: strong decay 19.56 -> 19.22 ms, the other regimes 0.39-0.44 ms faster (their idle programs); 2 an SM:
    # strong decay 22.82. Uncapped it takes 255 registers and fits four an SM; capped at 168 (672 B of stack on
    # sm_90) six: H100, 16 x 2048 fwd+bwd, strong decay 18.21 -> 17.66 ms (the launch 5.15 -> 4.61), K3's
    # saturated gates 15.57 -> 15.68, the rest within 0.04 ms; 200 registers and five an SM: strong decay 21.19
    bwd_sub_per_sm: int = 6
    bwd_sub_regs: int = 168           # that launch's register cap (0: bwd_regs)
    # Register caps (ptxas maxnreg; 0: the compiler's choice). Uncapped, ptxas gives the small-tile kernels
    # 200-255 registers a thread, which leaves room for one or two programs per SM and nothing to hide latency.
    # The defaults are the fastest of the H200 sweeps of 2026-12-01 (`bench/kda_kernels.py --sweep`, BENCHMARKS.md)
    # unless a later measurement is named beside one.
    # The separable chunks' launch: capped at 128 (40 B of stack offline) it runs four programs an SM where
    # uncapped (160, no spills) it ran three. H100, 16 x 2048 (2026-12-06, bench/kda_ab.py, two rounds), scores
    # kernel 0.629 / 0.643 / 1.018 / 0.738 / 0.567 ms against 0.645 / 0.660 / 1.032 / 0.750 / 0.583 in the grid's
    # five gate regimes; at 8 warps (101 registers, two an SM) 0.770-0.794 in the mild regimes. 16-bit inputs
    # only: float32 inputs' exact products hold far more (offline: 1848 B of stack capped against 1040 uncapped)
    scores_regs: int = 128
    # The other chunks' launch (halves and blocked schemes; offline sm_90 capped at 168: 296 B of stack): capped at
    # 168 it runs two programs an SM. H200, 2026-12-03 (an earlier blocked path), scores kernel ms at 16x2048,
    # bench gates / layer init / strong decay / lower_bound saturated / active: 0.637 / 0.663 / 2.721 / 0.871 /
    # 0.577; uncapped 0.02-0.16 ms slower in every regime but strong decay, 0.03 ms faster there; H100, 2026-12-05,
    # the blocked scheme uncapped (236 registers, no spills) 0.15 ms slower under strong decay
    scores_rest_regs: int = 168
    wy_regs: int = 168
    bwd_regs: int = 0

    def __post_init__(self):
        # Launches of these kernels with fewer than 4 warps hit an illegal address on the H200 (Triton 3.6, the
        # 2026-12-01 sweep; the faulting kernel was not isolated), so they are refused here.
        for name in ("scores_warps", "wy_warps"):
            if getattr(self, name) < 4:
                raise ValueError(f"LaunchConfig.{name} must be >= 4 (got {getattr(self, name)}): 2-warp launches "
                                 "faulted on the H200")
        # The persistent launches' sizes: with no program the listed chunks' score gradients would silently be
        # left undone.
        for name in ("bwd_halves_per_sm", "bwd_sub_per_sm"):
            if getattr(self, name) < 1:
                raise ValueError(f"LaunchConfig.{name} must be >= 1 (got {getattr(self, name)}): programs per SM "
                                 "of a launch that loops over listed chunks")
        # Channel and column steps are tile widths: Triton's aranges need powers of two and its products 16 or more.
        for name in ("scores_bks", "wy_bks", "wy_bv", "bwd_bk", "bwd_wy_bv", "bwd_intra_bk", "bwd_sep_bk", "h_bv"):
            n = getattr(self, name)
            if not (n == 0 and name == "h_bv") and (n < 16 or n & (n - 1)):
                raise ValueError(f"LaunchConfig.{name} must be a power of two >= 16 (got {n})"
                                 + (" or 0 (the shape's rule)" if name == "h_bv" else ""))
        if self.store not in ("input", "float32"):
            raise ValueError(f"LaunchConfig.store must be 'input' or 'float32', got {self.store!r}")
        if self.bwd_intra_prec not in ("tf32", "tf32x3", "ieee"):
            raise ValueError(f"LaunchConfig.bwd_intra_prec must be 'tf32', 'tf32x3' or 'ieee', got "
                             f"{self.bwd_intra_prec!r}")


def reg_cap(n: int) -> dict:
    """Launch keywords capping registers per thread at n (none for 0)."""
    return dict(maxnreg=n) if n else {}


DEFAULT_CONFIG = LaunchConfig()


def varlen_tables(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(chunk_indices [NT, 2] int32: sequence and chunk within it; chunk_offsets [N+1] int32: first flat chunk of
    each sequence; NT)."""
    bounds = cu_seqlens.tolist()
    counts = [cdiv(e - s, BT) for s, e in zip(bounds[:-1], bounds[1:])]
    pairs = [(n, c) for n, m in enumerate(counts) for c in range(m)]
    offsets = [0]
    for m in counts:
        offsets.append(offsets[-1] + m)
    dev = cu_seqlens.device
    table = torch.tensor(pairs if pairs else [(0, 0)], dtype=torch.int32, device=dev)
    return table, torch.tensor(offsets, dtype=torch.int32, device=dev), len(pairs)


@dataclass
class Factors:
    """The WY factors, kept by a forward with ``disable_recompute`` (fla's option: memory for the backward's
    time): per token and value head w, qg, kg (K each) and u (V) in the storage dtype, and the per-chunk decay."""

    w: torch.Tensor
    u: torch.Tensor
    qg: torch.Tensor
    kg: torch.Tensor
    decay: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.w, self.u, self.qg, self.kg, self.decay


@dataclass
class Kept:
    """What the forward keeps for the backward with ``LaunchConfig(keep_scores=True)`` (as fla keeps its gate sums,
    Aqk and inverse): per token and value head the 64 scores Aqk (storage dtype), Akk (float16 for 16-bit inputs
    with l2norm and the gate in the kernels, else float32) and the inverse Tm (float32), the l2norm row factors,
    and the gate sums gP (float32, K). The backward then recomputes only the WY factors and the states, or only
    the states when ``factors`` are kept too (``disable_recompute``)."""

    Aqk: torch.Tensor
    Akk: torch.Tensor
    Tm: torch.Tensor
    rq: torch.Tensor | None
    rk: torch.Tensor | None
    gP: torch.Tensor
    factors: Factors | None = None

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """Every kept tensor in a flat tuple (autograd's saved tensors); :meth:`from_tensors` reads it back."""
        own = (self.Aqk, self.Akk, self.Tm, self.rq, self.rk, self.gP)
        return own + (self.factors.tensors() if self.factors else ())

    @classmethod
    def from_tensors(cls, tensors) -> Kept:
        tensors = list(tensors)
        factors = Factors(*tensors[6:]) if len(tensors) > 6 else None
        return cls(*tensors[:6], factors=factors)


@dataclass
class Pieces:
    """What the forward kernels (a)-(e) produce; the backward recomputes them."""

    gP: torch.Tensor
    rq: torch.Tensor | None
    rk: torch.Tensor | None
    Aqk: torch.Tensor
    Akk: torch.Tensor
    Tm: torch.Tensor
    w: torch.Tensor
    u: torch.Tensor
    qg: torch.Tensor
    kg: torch.Tensor
    decay: torch.Tensor
    h: torch.Tensor
    vn: torch.Tensor
    ht: torch.Tensor | None
    o: torch.Tensor | None = None     # the forward's output (forward_pieces with a scale)


class Problem:
    """Shapes, chunk tables and the flags every kernel takes, computed once per call."""

    def __init__(self, q, v, cu_seqlens, opts: KernelOptions, cfg: LaunchConfig):
        self.B, self.T, self.H, self.K = q.shape
        self.HV, self.V = v.shape[2], v.shape[3]
        self.N = self.B if cu_seqlens is None else cu_seqlens.numel() - 1
        self.cu_seqlens = cu_seqlens
        if cu_seqlens is None:
            self.NT_seq = cdiv(self.T, BT)
            self.NT, self.chunk_indices, self.chunk_offsets = self.B * self.NT_seq, None, None
        else:
            self.NT_seq = 0
            self.chunk_indices, self.chunk_offsets, self.NT = varlen_tables(cu_seqlens)
        # tl.dot needs every dimension >= 16: narrower heads run in masked 16-wide blocks.
        self.BK = max(16, next_pow2(self.K))
        self.BVmax = max(16, next_pow2(self.V))
        self.dtype, self.device = q.dtype, q.device
        half = q.dtype in (torch.bfloat16, torch.float16)
        # float32 inputs: exact float32 products; 16-bit inputs: tf32 for the float32 operands. The score gradients
        # (prec_exact): LaunchConfig.bwd_intra_prec for bfloat16 inputs, whose 8-bit mantissas tf32's 10 bits
        # exceed; tf32x3 for float16 inputs, whose 10 bits tf32 does not. Their dG is a difference of row and column
        # shares that the gate's reverse cumulative sum then adds up over the sequence, so rounding its products to
        # the inputs' own precision showed in dt_bias's gradient: fla's test_chunk_varlen (float16, 90% of gates
        # masked) measured 6.3e-3 on the H200 against its 5e-3 bar with tf32; under the interpreter 5.0e-3 with
        # tf32 against 3.6e-4 with tf32x3 (A_log's gradient 1.4e-2 against 1.4e-3; float64 reference).
        self.prec = "tf32" if half else "ieee"
        self.prec_exact = {torch.bfloat16: cfg.bwd_intra_prec, torch.float16: "tf32x3"}.get(q.dtype, "ieee")
        self.sdt = torch.bfloat16 if (q.dtype == torch.bfloat16 and cfg.store == "input") else torch.float32
        self.opts, self.cfg = opts, cfg
        wide = self.fills_sms(64)
        big_k = self.K > 128
        self.h_bv = min(cfg.h_bv or (64 if wide and not big_k else 32), self.BVmax)
        # 3 stages of float32 tiles need 256 KiB of shared memory in the backward scan (the H200 has 227 KiB: GPU
        # check of 2026-12-01, varlen float32), so float32 intermediates keep 2. K = 256 (offline sm_90 build):
        # the backward scan needs 352 / 242 KiB (bf16, 3 / 2 stages) and 248 KiB (float32, 2), and 64 value
        # columns spill even with one stage, so wide keys scan 32 columns with one stage (60 / 88 KiB)
        self.h_stages = cfg.h_stages or (1 if big_k else 2 if wide or self.sdt == torch.float32 else 3)
        self.h_out_stages = cfg.h_out_stages or (1 if big_k else 2 if self.sdt == torch.float32 else 3)
        self.dummy = torch.empty(1, dtype=torch.float32, device=q.device)

    def fills_sms(self, bv: int) -> bool:
        """Whether state scans of bv value columns a program (N * HV * V / bv programs) fill every SM twice. The
        scan is sequential over chunks: for few long sequences, fewer and wider programs would leave SMs idle."""
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" else 132
        return self.N * self.HV * cdiv(self.V, bv) >= 2 * sms

    def ptr(self, x):
        return self.dummy if x is None else x

    def grid(self, NB: int, NH: int, n: int | None = None) -> tuple[int, ...]:
        """The one-dimensional grid of a per-chunk kernel over (n, default every chunk) x NB column blocks x NH
        heads, heads fastest (chunk_common.grid_coords)."""
        n = self.NT if n is None else n
        return (n * NB * NH,)

    def varlen(self) -> dict:
        return dict(cu_seqlens=self.ptr(self.cu_seqlens), chunk_indices=self.ptr(self.chunk_indices))

    def empty(self, *shape, dtype=torch.float32):
        return torch.empty(*shape, dtype=dtype, device=self.device)

    def gate(self) -> dict:
        """The in-kernel gate's arguments, as the prepare kernel (forward) and the gate kernel (backward) take them."""
        o = self.opts
        use = o.use_gate_in_kernel
        dt_bias = o.dt_bias.contiguous() if use and o.dt_bias is not None else None
        return dict(A_log=self.ptr(o.A_log.contiguous() if use else None), dt_bias=self.ptr(dt_bias),
                    lower_bound=float(o.lower_bound) if o.lower_bound is not None else 0.0, USE_GATE=use,
                    USE_LOWER_BOUND=o.lower_bound is not None, HAS_DT_BIAS=dt_bias is not None)


def tile_descriptors(p: Problem, wanted: bool, tensors: dict, bks: int, bv: int) -> dict:
    """Tensor-descriptor arguments of a kernel (chunk_wy.chunk_tile): TMA descriptors of the ``tensors`` ([B, T,
    heads, width] each, named ``d_*``; v's width steps by bv, the others' by bks) over their [rows, heads x
    width] views with [BT, step] blocks, when ``wanted`` and the shapes allow (widths divisible by the steps,
    16-byte row strides), else the tensors themselves (unused) and ``TMA=False``."""
    usable = (wanted and tma_supported(p.device) and p.K % bks == 0 and ("d_v" not in tensors or p.V % bv == 0)
              and all(x.is_contiguous() and (x.shape[2] * x.shape[3] * x.element_size()) % 16 == 0
                      for x in tensors.values()))
    if not usable:
        return dict(tensors, TMA=False)
    TensorDescriptor = tensor_descriptor_class()

    def desc(x, step):
        return TensorDescriptor.from_tensor(x.view(-1, x.shape[2] * x.shape[3]), [BT, step])

    return dict({n: desc(x, bv if n == "d_v" else bks) for n, x in tensors.items()}, TMA=True)


def forward_pieces(p: Problem, q, k, v, g, beta, initial_state, output_final_state: bool,
                   kept: Kept | None = None, scale: float | None = None, keep: bool = True) -> Pieces:
    """Kernels (a)-(e) on contiguous inputs; with ``kept`` (the backward, LaunchConfig.keep_scores) the score
    matrices, the inverse, the l2norm factors and the gate sums come from the forward, and (d) recomputes the WY
    factors. With
    ``scale`` (the forward) the scan forms the output ``Pieces.o`` and stores neither the per-chunk states nor vn;
    without it (the backward's recompute) it stores both for the gradient kernels. ``keep=False`` (a forward no
    backward follows) leaves the inverse in registers: ``Pieces.Tm`` is then None. With ``kept.factors`` the WY
    factors come from the forward too, and only (e) runs."""
    B, T, H, HV, K, V, NT, cfg, opts = p.B, p.T, p.H, p.HV, p.K, p.V, p.NT, p.cfg, p.opts
    use_l2 = opts.use_qk_l2norm_in_kernel
    norms = use_l2 and kept is None                                    # rq, rk written by the scores kernel
    factors = kept.factors if kept is not None else None
    rq = p.empty(B, T, H) if norms else (kept.rq if kept is not None else None)
    rk = p.empty(B, T, H) if norms else (kept.rk if kept is not None else None)
    IS_VARLEN = p.cu_seqlens is not None
    if kept is None:
        gP = p.empty(B, T, HV, K)
        chunk_kda_prepare_kernel[p.grid(1, HV)](
            g=g, gP=gP, **p.varlen(), **p.gate(), T=T, NT=p.NT_seq,
            HV=HV, K=K, BT=BT, BC=BC, BK=p.BK, IS_VARLEN=IS_VARLEN,
            num_warps=4,
        )
    else:
        gP = kept.gP
    if factors is None:
        w, qg, kg = (p.empty(B, T, HV, K, dtype=p.sdt) for _ in range(3))
        u = p.empty(B, T, HV, V, dtype=p.sdt)
        decay = p.empty(max(NT, 1), HV, K)
    else:
        w, u, qg, kg, decay = factors.tensors()
    if kept is None:
        Aqk = p.empty(B, T, HV, BT, dtype=p.sdt)
        # 16-bit inputs, l2norm and the gate formula in the kernels (log decays <= 0): |Akk| <= 1, and its tf32
        # products carry 2^-11 relative rounding already, so float16 (11-bit significand) loses no more than half
        # that and halves the bytes the inverse reads. (A caller's own gate may rise, and Akk then exceed 65504.)
        half_akk = p.prec == "tf32" and use_l2 and opts.use_gate_in_kernel
        Akk = p.empty(B, T, HV, BT, dtype=torch.float16 if half_akk else torch.float32)
        Tm = p.empty(B, T, HV, BT) if keep or scale is None else None
    else:
        Aqk, Akk, Tm = kept.Aqk, kept.Akk, kept.Tm
    bks = min(cfg.scores_bks, p.BK)
    flags = dict(IS_VARLEN=IS_VARLEN, USE_QK_L2NORM=use_l2, PREC=p.prec)
    shared = dict(q=q, k=k, gP=gP, rq=p.ptr(rq), rk=p.ptr(rk), **p.varlen(), T=T, NT=p.NT_seq, H=H, HV=HV, K=K, BT=BT,
                  BC=BC, **flags)
    if kept is None:
        # two launches: the separable chunks, and the rest (by halves, banded or blocked, chunk_wy)
        # float32 inputs take the blocked scheme: the by-halves launch with exact float32 products needs more shared
        # memory than the card has (LaunchConfig's note on the by-halves chunks)
        halves = p.prec == "tf32"
        sep_regs = cfg.scores_regs if halves else 0       # float32's separable launch uncapped (scores_regs says why)
        tiles = tile_descriptors(p, cfg.scores_tma, dict(d_q=q, d_k=k, d_gP=gP), bks, bks)
        for separable in (True, False):
            chunk_kda_fwd_scores_kernel[p.grid(1, HV)](
                Aqk=Aqk, Akk=Akk, BK=p.BK, BKS=bks, SEPARABLE=separable, HALVES=halves, **tiles,
                num_warps=cfg.scores_warps, num_stages=cfg.scores_stages,
                **reg_cap(sep_regs if separable else cfg.scores_rest_regs), **shared,
            )
    # STAGE 0: the inverse and the WY factors in one program; 2: the factors from the inverse kept in memory
    if factors is None:
        wy_bv = min(cfg.wy_bv, p.BVmax)
        wy_bv = wy_bv if p.V % wy_bv == 0 else min(cfg.wy_bks, p.BVmax)
        wy = dict(v=v, beta=beta, Akk=Akk, Tm=p.ptr(Tm), STORE_T=Tm is not None and kept is None, w=w, u=u, qg=qg,
                  kg=kg, decay=decay, V=V, BKS=min(cfg.wy_bks, p.BK), BV=wy_bv,
                  USE_BETA_SIGMOID=opts.use_beta_sigmoid_in_kernel, NEG_EIGVAL=opts.allow_neg_eigval)
        wy.update(tile_descriptors(p, cfg.wy_tma, dict(d_k=k, d_v=v, d_gP=gP), wy["BKS"], wy["BV"]))
        chunk_kda_fwd_wy_kernel[p.grid(1, HV)](STAGE=2 if kept is not None else 0, num_warps=cfg.wy_warps,
                                               num_stages=cfg.wy_stages, **reg_cap(cfg.wy_regs), **wy, **shared)
    fused = scale is not None                                          # the forward: o formed in the scan
    h = p.dummy if fused else p.empty(max(NT, 1), HV, K, V, dtype=p.sdt)
    vn = p.dummy if fused else p.empty(B, T, HV, V, dtype=p.sdt)
    o = p.empty(B, T, HV, V, dtype=p.dtype) if fused else None
    ht = p.empty(p.N, HV, K, V) if output_final_state else None
    BV = p.h_bv
    chunk_kda_fwd_h_kernel[(cdiv(V, BV), p.N * HV)](
        w=w, u=u, kg=kg, decay=decay, h=h, vn=vn, h0=p.ptr(initial_state), ht=p.ptr(ht),
        qg=qg, Aqk=Aqk, o=p.ptr(o),
        cu_seqlens=p.ptr(p.cu_seqlens), chunk_offsets=p.ptr(p.chunk_offsets),
        scale=scale if fused else 1.0, T=T,
        HV=HV, K=K, V=V, BT=BT, BK=p.BK, BV=BV, IS_VARLEN=IS_VARLEN, USE_INITIAL_STATE=initial_state is not None,
        STORE_FINAL_STATE=output_final_state, OUTPUT=fused, PREC=p.prec,
        num_warps=cfg.h_warps, num_stages=p.h_out_stages if fused else p.h_stages,
    )
    return Pieces(gP, rq, rk, Aqk, Akk, Tm, w, u, qg, kg, decay, h, vn, ht, o)


def chunk_kda_fwd_pipeline(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
    initial_state: torch.Tensor | None, output_final_state: bool, opts: KernelOptions,
    cu_seqlens: torch.Tensor | None, cfg: LaunchConfig = DEFAULT_CONFIG,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The pipeline forward on contiguous inputs: (o [B, T, HV, V] in q's dtype, final state float32 or None)."""
    return chunk_kda_fwd_keeping(q, k, v, g, beta, scale, initial_state, output_final_state, opts, cu_seqlens, cfg,
                                 keep=False)[:2]


def chunk_kda_fwd_keeping(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
    initial_state: torch.Tensor | None, output_final_state: bool, opts: KernelOptions,
    cu_seqlens: torch.Tensor | None, cfg: LaunchConfig = DEFAULT_CONFIG, keep: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, Kept | None]:
    """:func:`chunk_kda_fwd_pipeline` and what the backward may keep of it (:class:`Kept`; None when empty or
    without ``keep``; with ``cfg.keep_factors`` the WY factors too, :class:`Factors`)."""
    p = Problem(q, v, cu_seqlens, opts, cfg)
    if p.T == 0 or p.NT == 0:
        o = torch.zeros(p.B, p.T, p.HV, p.V, dtype=q.dtype, device=q.device)
        ht = None
        if output_final_state:
            ht = initial_state.clone() if initial_state is not None else q.new_zeros(p.N, p.HV, p.K, p.V,
                                                                                     dtype=torch.float32)
        return o, ht, None
    x = forward_pieces(p, q, k, v, g, beta, initial_state, output_final_state, scale=scale, keep=keep)
    if not keep:
        return x.o, x.ht, None
    factors = Factors(x.w, x.u, x.qg, x.kg, x.decay) if cfg.keep_factors else None
    return x.o, x.ht, Kept(x.Aqk, x.Akk, x.Tm, x.rq, x.rk, x.gP, factors)


@dataclass
class Grads:
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dg: torch.Tensor
    dbeta: torch.Tensor
    dh0: torch.Tensor | None
    dA_log: torch.Tensor | None
    ddt_bias: torch.Tensor | None


def chunk_kda_bwd_pipeline(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
    initial_state: torch.Tensor | None, opts: KernelOptions, cu_seqlens: torch.Tensor | None,
    do: torch.Tensor, dht: torch.Tensor | None, cfg: LaunchConfig = DEFAULT_CONFIG, kept: Kept | None = None,
) -> Grads:
    """Gradients of every input, in the inputs' dtypes (contiguous inputs; do, dht contiguous). ``kept``: what the
    forward kept (:func:`chunk_kda_fwd_keeping`); without it the backward recomputes every forward piece."""
    p = Problem(q, v, cu_seqlens, opts, cfg)
    B, T, H, HV, K, V, NT = p.B, p.T, p.H, p.HV, p.K, p.V, p.NT
    use_gate = opts.use_gate_in_kernel
    if T == 0 or NT == 0:
        zero = lambda x: None if x is None else torch.zeros_like(x)
        dh0 = None if initial_state is None else (dht.clone() if dht is not None else torch.zeros_like(initial_state))
        return Grads(zero(q), zero(k), zero(v), zero(g), zero(beta), dh0, zero(opts.A_log) if use_gate else None,
                     zero(opts.dt_bias) if use_gate else None)
    IS_VARLEN = p.cu_seqlens is not None
    x = forward_pieces(p, q, k, v, g, beta, initial_state, output_final_state=False, kept=kept)

    dh = p.empty(NT, HV, K, V, dtype=p.sdt)
    dvn = p.empty(B, T, HV, V, dtype=p.sdt)
    dh0 = p.empty(p.N, HV, K, V)
    BV = p.h_bv
    chunk_kda_bwd_dh_kernel[(cdiv(V, BV), p.N * HV)](
        qg=x.qg, kg=x.kg, w=x.w, Aqk=x.Aqk, decay=x.decay, do=do, dh=dh, dvn=dvn, dht=p.ptr(dht), dh0=dh0,
        cu_seqlens=p.ptr(p.cu_seqlens), chunk_offsets=p.ptr(p.chunk_offsets), scale=scale, T=T,
        HV=HV, K=K, V=V, BT=BT, BK=p.BK, BV=BV, IS_VARLEN=IS_VARLEN, USE_FINAL_STATE_GRADIENT=dht is not None,
        PREC=p.prec, num_warps=cfg.h_warps, num_stages=p.h_stages,
    )

    BKb = min(cfg.bwd_bk, p.BK)
    NK = cdiv(K, BKb)
    BVb = min(cfg.bwd_bk, p.BVmax)
    stride_nk = B * T * HV
    dq_p, dk_p, dg_p = (p.empty(B, T, HV, K) for _ in range(3))
    db_p = p.empty(NK, B, T, HV)
    dT_p = p.empty(NK, B, T, HV, BT)
    flags = dict(IS_VARLEN=IS_VARLEN, USE_QK_L2NORM=opts.use_qk_l2norm_in_kernel)
    beta_flags = dict(USE_BETA_SIGMOID=opts.use_beta_sigmoid_in_kernel, NEG_EIGVAL=opts.allow_neg_eigval)
    chunk_kda_bwd_inter_kernel[p.grid(NK, HV)](
        q=q, k=k, beta=beta, gP=x.gP, rq=p.ptr(x.rq), rk=p.ptr(x.rk), Tm=x.Tm, h=x.h, dh=dh, vn=x.vn, dvn=dvn,
        do=do, dq_p=dq_p, dk_p=dk_p, dg_p=dg_p, db_p=db_p, dT_p=dT_p, **p.varlen(), scale=scale, T=T,
        NT=p.NT_seq, STRIDE_NK=stride_nk, H=H, HV=HV, K=K, V=V, BT=BT, BC=BC, BK=BKb, BV=BVb, **flags,
        **beta_flags, PREC=p.prec, num_warps=cfg.bwd_inter_warps or cfg.bwd_warps,
        **reg_cap(cfg.bwd_regs),
    )
    dv, dbeta = torch.empty_like(v), torch.empty_like(beta)
    dAqk, dAkk = p.empty(B, T, HV, BT), p.empty(B, T, HV, BT)
    chunk_kda_bwd_wy_kernel[p.grid(1, HV)](
        v=v, beta=beta, Akk=x.Akk, Tm=x.Tm, vn=x.vn, dvn=dvn, do=do, db_p=db_p, dT_p=dT_p, dv=dv, dbeta=dbeta,
        dAqk=dAqk, dAkk=dAkk, **p.varlen(), scale=scale, T=T, NT=p.NT_seq, STRIDE_NK=stride_nk,
        HV=HV, V=V, BT=BT, BV=min(cfg.bwd_wy_bv, p.BVmax), NK=NK, IS_VARLEN=IS_VARLEN,
        **beta_flags, PREC=p.prec,
        num_warps=cfg.bwd_warps,
        **reg_cap(cfg.bwd_regs),
    )
    BKi = min(cfg.bwd_intra_bk, p.BK)
    intra = dict(q=q, k=k, gP=x.gP, rq=p.ptr(x.rq), rk=p.ptr(x.rk), dAqk=dAqk, dAkk=dAkk, dq_p=dq_p, dk_p=dk_p,
                 dg_p=dg_p, **p.varlen(), T=T, NT=p.NT_seq, H=H, HV=HV, K=K, BT=BT, BC=BC, BK=BKi, BKA=p.BK, **flags,
                 PREC=p.prec_exact,
                 num_warps=cfg.bwd_intra_warps or cfg.bwd_warps, **reg_cap(cfg.bwd_regs))
    BKs = min(cfg.bwd_sep_bk, p.BK)
    # Separable chunks whole by a launch over every chunk; the others listed on the device (the lists' lengths
    # never go to the host) and taken by persistent launches: with 16-bit inputs (as in the forward) those bounded
    # per sub-block whole by halves, the rest by sub-blocks
    chunk_kda_bwd_intra_kernel[p.grid(1, HV)](**dict(intra, BK=BKs, num_warps=cfg.bwd_sep_warps))
    by_halves = p.prec == "tf32"
    count = torch.zeros(2, dtype=torch.int32, device=q.device)
    L = p.NT * HV
    chunks = torch.empty(L, dtype=torch.int32, device=q.device)
    chunk_kda_bwd_list_kernel[(p.NT, HV)](gP=x.gP, chunks=chunks, count=count, **p.varlen(), T=T, NT=p.NT_seq, L=L,
                                          HV=HV, K=K, BT=BT, BC=BC, BKA=p.BK, IS_VARLEN=IS_VARLEN, HALVES=by_halves)
    listed = dict({n: v for n, v in intra.items() if n not in ("BK", "num_warps")}, chunks=chunks,
                  count=count, L=L)
    if by_halves:
        chunk_kda_bwd_listed_kernel[(cfg.bwd_halves_per_sm * num_sms(q.device),)](
            **listed, SUB=False, BK=BKs, num_warps=cfg.bwd_sep_warps, num_stages=1)
    chunk_kda_bwd_listed_kernel[(cfg.bwd_sub_per_sm * num_sms(q.device),)](
        **dict(listed, **reg_cap(cfg.bwd_sub_regs)), SUB=True, BK=BKi, num_warps=cfg.bwd_intra_warps or cfg.bwd_warps)
    dg = torch.empty_like(g)
    dA_p = p.empty(NT, NK, HV) if use_gate else None
    ddt_p = p.empty(NT, HV, K) if use_gate else None
    chunk_kda_bwd_gate_kernel[p.grid(NK, HV)](
        g=g, dG=dg_p, dg=dg, dA_p=p.ptr(dA_p), ddt_p=p.ptr(ddt_p), **p.varlen(), **p.gate(), T=T, NT=p.NT_seq,
        HV=HV, K=K, BT=BT, BK=BKb, NK=NK, IS_VARLEN=IS_VARLEN, num_warps=4,
    )
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    chunk_kda_bwd_qk_kernel[p.grid(1, H)](
        q=q, k=k, rq=p.ptr(x.rq), rk=p.ptr(x.rk), dq_p=dq_p, dk_p=dk_p, dq=dq, dk=dk, **p.varlen(), T=T,
        NT=p.NT_seq, H=H, HV=HV, K=K, BT=BT, BC=BC, BK=p.BK, **flags,
        num_warps=cfg.bwd_warps, **reg_cap(cfg.bwd_regs),
    )
    dA_log = ddt_bias = None
    if use_gate:
        dA_log = dA_p.sum((0, 1)).reshape(opts.A_log.shape).to(opts.A_log.dtype)
        if opts.dt_bias is not None:
            ddt_bias = ddt_p.sum(0).reshape(opts.dt_bias.shape).to(opts.dt_bias.dtype)
    return Grads(dq, dk, dv, dg, dbeta, dh0 if initial_state is not None else None, dA_log, ddt_bias)
