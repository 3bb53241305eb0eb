"""Device helpers shared by the kernels of the chunk pipeline (chunk_prepare.py, chunk_wy.py, chunk_state.py,
chunk_bwd.py): chunk coordinates, gate sums, products, the unit-lower-triangular inverse.

Gate representation. The prepare kernel stores ``gP``: the transformed log gate summed from the start of its 16-row
sub-block through the row (inclusive), float32. Every decay exponent the pipeline needs is built from ``gP`` and the
sub-block totals ``tot_M`` (``gP`` at the last valid row of sub-block M) as a *sum of non-positive terms*:

    G_i       = gP_i + sum_{M < I} tot_M                     chunk prefix (row i in sub-block I)
    G_C - G_j = (tot_J - gP_j) + sum_{M > J} tot_M           chunk suffix after row j
    G_r - G_j = (tot_J - gP_j) + sum_{J < M < I} tot_M       from row j to r, the row before sub-block I

so with a gate of -1000 every factor that should vanish underflows to an exact 0 and nothing overflows. The only
differences of sums are ``tot_J - gP_j`` and, inside a diagonal 16x16 block, ``gP_i - gP_r`` and ``gP_r - gP_j``
with r a reference row of the same sub-block between j and i (:func:`level_factor`; both <= 0): sums over at most
15 steps, never over the whole chunk, which keeps float32 rounding of large cumulative gates out of the factors.
(Where every sub-block's sum is above -SAFE_EXP, the score gradients' diagonal blocks take
``exp(gP_i) exp(-gP_j)`` instead; the diagonal blocks of 16-bit inputs otherwise, and in the forward's blocked
chunks always, take factors through gate steps clamped at -DIAG_CLAMP, :func:`clamped_diagonal_factors`, exact to
16-bit precision.)
"""

from __future__ import annotations

import triton
import triton.language as tl

# INTERPRET: Triton's interpreter (TRITON_INTERPRET=1, how the tests run on CPU) multiplies bfloat16 dot operands as
# their raw uint16 bit patterns; on the GPU a bf16 dot is exact products with float32 accumulation, which is what
# widening the operands to float32 first computes (mm).
from .fastmath import INTERPRET, fast_exp

BT = 64                 # chunk length
BC = 16                 # sub-block length; BT // BC = 4 sub-blocks per chunk
# |gP| below this on a 16-row block: exp(gP) and exp(-gP) (<= 1.2e26) both fit float32 with room for a dot product.
SAFE_EXP: tl.constexpr = tl.constexpr(60.0)
# A gate falling by less than this over 32 rows: exp(+-HALF_LIMIT) (<= 5.5e34) are normal float32 numbers.
HALF_LIMIT: tl.constexpr = tl.constexpr(80.0)


@triton.jit
def cast(b_x, dtype: tl.constexpr):
    """``b_x.to(dtype)``, rounding to nearest even. Under the interpreter float32 -> bfloat16 truncates (twice the
    hardware's error, and biased), so there the rounding is done on the bits first."""
    if INTERPRET:
        if dtype == tl.bfloat16:
            if b_x.dtype == tl.float32:
                b_u = b_x.to(tl.uint32, bitcast=True)
                b_u = (b_u + 0x7FFF + ((b_u >> 16) & 1)) & 0xFFFF0000
                b_x = b_u.to(tl.float32, bitcast=True)
    return b_x.to(dtype)


@triton.jit
def tf32_round(b_x):
    """float32 -> the nearest tf32 value (10 mantissa bits, ties away from zero), still as float32. A tf32 product
    *truncates* its float32 operands (Triton 3.6 on Hopper: the low 13 bits are ignored), which biases every
    product towards zero; sums of many such products (dA_log) then drift by percents. Rounding first makes the
    truncation exact. Two integer operations (half an ulp added to the magnitude's bits, the low bits cleared):
    ties away from zero rather than to even, which is as unbiased for data that is not on ties."""
    b_u = b_x.to(tl.uint32, bitcast=True)
    return ((b_u + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def mm(b_a, b_b, PREC: tl.constexpr):
    """``b_a @ b_b`` with float32 accumulation. ``b_b`` is converted to ``b_a``'s dtype; 16-bit operands go to the
    tensor cores as they are; float32 operands are exact products with ``PREC="ieee"`` (CUDA cores) or "tf32x3"
    (three tf32 products, about float32's accuracy), or with "tf32" rounded to tf32 first (see
    :func:`tf32_round`). Under the interpreter the same numbers are formed explicitly (its bf16 dot is broken and
    it has no tf32; tf32x3 is taken as exact)."""
    if b_a.dtype == tl.float32:
        b_b = b_b.to(tl.float32)
        if PREC == "tf32":
            b_a = tf32_round(b_a)
            b_b = tf32_round(b_b)
    else:
        b_b = cast(b_b, b_a.dtype)
    if INTERPRET:
        return tl.dot(b_a.to(tl.float32), b_b.to(tl.float32), input_precision="ieee")
    if b_a.dtype == tl.float32:
        return tl.dot(b_a, b_b, input_precision=PREC)
    return tl.dot(b_a, b_b)


@triton.jit
def tf32_operand(b_x, PREC: tl.constexpr):
    """A float32 operand made ready for :func:`mm_rounded`: rounded to tf32 once (``PREC="tf32"``), so that an
    operand shared by several products is not rounded again for each."""
    if PREC == "tf32":
        b_x = tf32_round(b_x)
    return b_x


@triton.jit
def mm_rounded(b_a, b_b, b_acc, PREC: tl.constexpr):
    """``b_acc + b_a @ b_b`` for float32 operands already passed through :func:`tf32_operand` (accumulating in
    the product itself keeps one accumulator live, not one per product)."""
    if INTERPRET:
        return tl.dot(b_a, b_b, b_acc, input_precision="ieee")
    return tl.dot(b_a, b_b, b_acc, input_precision=PREC)


@triton.jit
def bf16_split(b_x):
    """A tf32 value ``b_x`` (float32 with 10 mantissa bits, :func:`tf32_operand`) as two bfloat16 numbers whose sum
    is exactly ``b_x``: the nearest bf16 and the rest (8 bits each cover tf32's 11-bit significand)."""
    b_hi = cast(b_x, tl.bfloat16)
    return b_hi, cast(b_x - b_hi.to(tl.float32), tl.bfloat16)


@triton.jit
def mm_split(b_hi, b_lo, b_y):
    """``(hi + lo) @ y`` for bfloat16 ``hi``, ``lo`` (:func:`bf16_split`) and ``y``: two bf16 tensor-core products
    accumulated in float32, the same numbers as one tf32 product of ``hi + lo`` by ``y`` (``y``'s bf16 values are
    exact in tf32), with ``y`` taken as loaded (no float32 copy, rounding or shared-memory store of it)."""
    if INTERPRET:
        b_y = b_y.to(tl.float32)
        return tl.dot(b_hi.to(tl.float32), b_y, tl.dot(b_lo.to(tl.float32), b_y, input_precision="ieee"),
                      input_precision="ieee")
    return tl.dot(b_hi, b_y, tl.dot(b_lo, b_y))


@triton.jit
def row_halves(b_x):
    """[R, C] -> its first and second R / 2 rows, [R / 2, C] each (a register split, no memory)."""
    R: tl.constexpr = b_x.shape[0]
    C: tl.constexpr = b_x.shape[1]
    return tl.split(tl.permute(tl.reshape(b_x, [2, R // 2, C]), (1, 2, 0)))


@triton.jit
def channel_halves(b_x):
    """[R, 2W] -> its first and second W columns (channels), [R, W] each (a register split, no memory)."""
    R: tl.constexpr = b_x.shape[0]
    W: tl.constexpr = b_x.shape[1] // 2
    return tl.split(tl.permute(tl.reshape(b_x, [R, 2, W]), (0, 2, 1)))


@triton.jit
def vector_halves(b_x):
    """[2W] -> its first and second W entries."""
    W: tl.constexpr = b_x.shape[0] // 2
    return tl.split(tl.permute(tl.reshape(b_x, [2, W]), (1, 0)))


@triton.jit
def grid_coords(NB: tl.constexpr, NH: tl.constexpr):
    """(i_c, i_b, i_h) of this program: flat chunk, block (of key or value columns; 0 where NB == 1) and head, in
    the one-dimensional grid of chunk_pipeline.Problem.grid. The GPU starts programs in grid order, fastest index
    first, so a chunk's column blocks and its heads run side by side: they read the same rows, or rows adjacent in
    memory, which stay in L2. (H200 sweep, 2026-12-01, 16 x 2048, lower_bound / softplus, ms: forward 3.27 / 3.60
    against 3.44 / 3.75 with every chunk of one block and head first, and 3.42 / 3.73 with only the blocks side by
    side; backward 12.55 / 13.63 against 13.35 / 14.32 and 13.01 / 14.05; every kernel as fast or faster.)"""
    i = tl.program_id(0)
    return i // (NB * NH), (i // NH) % NB, i % NH


@triton.jit
def chunk_coords(i_c, cu_seqlens, chunk_indices, T, NT, IS_VARLEN: tl.constexpr):
    """Flat chunk index -> (sequence i_n, chunk within it i_t, first token bos, sequence length T_n), int64."""
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_c * 2).to(tl.int64)
        i_t = tl.load(chunk_indices + i_c * 2 + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T_n = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    else:
        i_n = (i_c // NT).to(tl.int64)
        i_t = (i_c % NT).to(tl.int64)
        bos = i_n * T
        T_n = bos * 0 + T                                                   # as an int64 tensor, like varlen
    return i_n, i_t, bos, T_n


@triton.jit
def seq_coords(i_n, cu_seqlens, chunk_offsets, T, IS_VARLEN: tl.constexpr, BT: tl.constexpr):
    """Sequence index -> (first token bos, length T_n, flat index of its first chunk), int64."""
    i_n = i_n.to(tl.int64)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T_n = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        c_first = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = i_n * T
        T_n = bos * 0 + T
        c_first = i_n * tl.cdiv(T, BT)
    return bos, T_n, c_first


@triton.jit
def load_rows(p, bos, r0, T_n, i_h, NH: tl.constexpr, W: tl.constexpr, o_c, BR: tl.constexpr):
    """Rows r0 .. r0 + BR (within the sequence) of a ``[*, NH, W]`` tensor at columns o_c, in its own dtype; zero
    past T_n or W. The row offset is int64 math on the scalar base; the tile's own offsets stay int32.

    Column blocks always start at a multiple of their width: when the width divides W every column is inside and
    the mask is per row only, constant along the contiguous dimension, which keeps the load vectorised."""
    p_x = p + ((bos + r0) * NH + i_h) * W
    o_r = tl.arange(0, BR)
    m_r = ((r0 + o_r) < T_n)[:, None]
    if W // o_c.shape[0] * o_c.shape[0] == W:                             # the width divides W
        b_x = tl.load(p_x + (o_r * (NH * W))[:, None] + o_c[None, :], mask=m_r, other=0.0)
    else:
        b_x = tl.load(p_x + (o_r * (NH * W))[:, None] + o_c[None, :], mask=m_r & (o_c < W)[None, :], other=0.0)
    return b_x


@triton.jit
def prefetch_rows(p, bos, r0, T_n, i_h, NH: tl.constexpr, W: tl.constexpr, c0, BR: tl.constexpr):
    """Ask L2 for rows r0 .. r0 + BR of a ``[*, NH, W]`` tensor at column c0 (one line a row; rows past T_n take
    the last row's address): no wait and no register held, where a load a step ahead held its tile (and spilled).
    Nothing under the interpreter."""
    if not INTERPRET:
        o_r = tl.minimum(r0 + tl.arange(0, BR), T_n - 1)
        p_x = p + ((bos + o_r) * NH + i_h) * W + c0                         # [BR] row starts
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [p_x], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def store_rows(p, b_x, bos, r0, T_n, i_h, NH: tl.constexpr, W: tl.constexpr, o_c, BR: tl.constexpr):
    """Store ``b_x [BR, len(o_c)]`` into rows r0 .. of a ``[*, NH, W]`` tensor (rows past T_n skipped; masks as in
    :func:`load_rows`)."""
    p_x = p + ((bos + r0) * NH + i_h) * W
    o_r = tl.arange(0, BR)
    m_r = ((r0 + o_r) < T_n)[:, None]
    if W // o_c.shape[0] * o_c.shape[0] == W:                             # the width divides W
        tl.store(p_x + (o_r * (NH * W))[:, None] + o_c[None, :], cast(b_x, p.dtype.element_ty), mask=m_r)
    else:
        tl.store(p_x + (o_r * (NH * W))[:, None] + o_c[None, :], cast(b_x, p.dtype.element_ty),
                 mask=m_r & (o_c < W)[None, :])


@triton.jit
def store_cols(p, b_x, bos, r0, T_n, i_h, NH: tl.constexpr, W: tl.constexpr, o_c, m_c, BR: tl.constexpr):
    """:func:`store_rows` restricted to the columns where ``m_c`` holds."""
    p_x = p + ((bos + r0) * NH + i_h) * W
    o_r = tl.arange(0, BR)
    m = (r0 + o_r < T_n)[:, None] & (m_c & (o_c < W))[None, :]
    tl.store(p_x + (o_r * (NH * W))[:, None] + o_c[None, :], cast(b_x, p.dtype.element_ty), mask=m)


@triton.jit
def state_full(o_k, o_v, K: tl.constexpr, V: tl.constexpr):
    """Whether a [len(o_k), len(o_v)] block of a K x V state (blocks start at multiples of their widths) lies
    inside it: then its loads and stores need no mask (and stay vectorised)."""
    return (K // o_k.shape[0] * o_k.shape[0] == K) & (V // o_v.shape[0] * o_v.shape[0] == V)


@triton.jit
def load_state(p, o_k, o_v, K: tl.constexpr, V: tl.constexpr):
    """Block (o_k, o_v) of the K x V state at ``p``, zero outside."""
    p_x = p + o_k[:, None] * V + o_v[None, :]
    if state_full(o_k, o_v, K, V):
        return tl.load(p_x)
    return tl.load(p_x, mask=(o_k < K)[:, None] & (o_v < V)[None, :], other=0.0)


@triton.jit
def store_state(p, b_x, o_k, o_v, K: tl.constexpr, V: tl.constexpr):
    """Store b_x into block (o_k, o_v) of the K x V state at ``p`` (in p's dtype)."""
    p_x = p + o_k[:, None] * V + o_v[None, :]
    if state_full(o_k, o_v, K, V):
        tl.store(p_x, cast(b_x, p.dtype.element_ty))
    else:
        tl.store(p_x, cast(b_x, p.dtype.element_ty), mask=(o_k < K)[:, None] & (o_v < V)[None, :])


@triton.jit
def load_row_scalars(p, bos, r0, T_n, i_h, NH: tl.constexpr, BR: tl.constexpr):
    """Rows r0 .. r0 + BR of a ``[*, NH]`` tensor as float32 (zero past T_n)."""
    o_r = tl.arange(0, BR)
    return tl.load(p + ((bos + r0) * NH + i_h) + o_r * NH, mask=r0 + o_r < T_n, other=0.0).to(tl.float32)


@triton.jit
def load_norms(rq, rk, bos, r0, T_n, i_h, H: tl.constexpr, BR: tl.constexpr, USE_QK_L2NORM: tl.constexpr):
    """Inverse row norms of q and k (l2norm), [BR] each; ones without l2norm."""
    if USE_QK_L2NORM:
        b_rq = load_row_scalars(rq, bos, r0, T_n, i_h, H, BR)
        b_rk = load_row_scalars(rk, bos, r0, T_n, i_h, H, BR)
    else:
        b_rq = tl.full([BR], 1.0, dtype=tl.float32)
        b_rk = tl.full([BR], 1.0, dtype=tl.float32)
    return b_rq, b_rk


@triton.jit
def row_inv_norms(x, bos, t0, T_n, i_h, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BKS: tl.constexpr):
    """l2norm's ``1 / sqrt(sum_c x_tc^2 + 1e-6)`` of the chunk's rows of ``x`` [B, T, H, K], BKS channels a step:
    [BT] float32."""
    b_s = tl.zeros([BT], dtype=tl.float32)
    for c0 in range(0, K, BKS):
        b_x = load_rows(x, bos, t0, T_n, i_h, H, K, c0 + tl.arange(0, BKS), BT).to(tl.float32)   # [BT, BKS]
        b_s += tl.sum(b_x * b_x, 1)
    return tl.rsqrt(b_s + 1e-6)


@triton.jit
def store_row_norms(rq, rk, b_rq, b_rk, bos, t0, T_n, i_h, i_hv, H: tl.constexpr, HV: tl.constexpr,
                    BT: tl.constexpr):
    """Store the chunk's l2norm row factors ([BT] each) into rq and rk ([B, T, H]) from the program of the first
    value head of each q/k head (one writer)."""
    if i_hv % (HV // H) == 0:
        o_t = t0 + tl.arange(0, BT)
        tl.store(rq + (bos + o_t) * H + i_h, b_rq, mask=o_t < T_n)
        tl.store(rk + (bos + o_t) * H + i_h, b_rk, mask=o_t < T_n)


@triton.jit
def beta_transform(b_b, USE_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr):
    """The in-kernel beta transform of float32 logits (sigmoid, doubled for negative eigenvalues), or as is."""
    if USE_SIGMOID:
        b_b = tl.sigmoid(b_b)
        if NEG_EIGVAL:
            b_b = 2.0 * b_b
    return b_b


@triton.jit
def load_beta(beta, bos, r0, T_n, i_hv, HV: tl.constexpr, BR: tl.constexpr, USE_SIGMOID: tl.constexpr,
              NEG_EIGVAL: tl.constexpr):
    """beta of rows r0 .. r0 + BR after the in-kernel transform, float32, zero past T_n."""
    b_b = beta_transform(load_row_scalars(beta, bos, r0, T_n, i_hv, HV, BR), USE_SIGMOID, NEG_EIGVAL)
    return tl.where(r0 + tl.arange(0, BR) < T_n, b_b, 0.0)


@triton.jit
def sub_block_total(gP, bos, t0, M, T_n, i_hv, HV: tl.constexpr, K: tl.constexpr, o_k, BC: tl.constexpr):
    """``tot_M``: the gate summed over sub-block M of the chunk starting at t0 ([len(o_k)], float32), i.e. gP at
    the sub-block's last valid row; zero when the sub-block starts at or past T_n."""
    r = tl.minimum(t0 + M * BC + BC - 1, T_n - 1)
    b_t = tl.load(gP + ((bos + r) * HV + i_hv) * K + o_k, mask=o_k < K, other=0.0)
    return tl.where(t0 + M * BC < T_n, b_t, 0.0)


@triton.jit
def sub_block_totals(gP, bos, t0, T_n, i_hv, HV: tl.constexpr, K: tl.constexpr, o_k, BC: tl.constexpr):
    """The four sub-block totals of the chunk at t0 (:func:`sub_block_total`), [len(o_k)] each."""
    b_t0 = sub_block_total(gP, bos, t0, 0, T_n, i_hv, HV, K, o_k, BC)
    b_t1 = sub_block_total(gP, bos, t0, 1, T_n, i_hv, HV, K, o_k, BC)
    b_t2 = sub_block_total(gP, bos, t0, 2, T_n, i_hv, HV, K, o_k, BC)
    b_t3 = sub_block_total(gP, bos, t0, 3, T_n, i_hv, HV, K, o_k, BC)
    return b_t0, b_t1, b_t2, b_t3


@triton.jit
def gate_tiles(gP, bos, t0, T_n, i_hv, HV: tl.constexpr, K: tl.constexpr, o_k, BT: tl.constexpr, BC: tl.constexpr):
    """The chunk's ``gP`` tile at channels o_k ([BT, len(o_k)]) and its four sub-block totals ([len(o_k)] each)."""
    tl.static_assert(BT == 4 * BC)
    b_P = load_rows(gP, bos, t0, T_n, i_hv, HV, K, o_k, BT)
    b_t0, b_t1, b_t2, b_t3 = sub_block_totals(gP, bos, t0, T_n, i_hv, HV, K, o_k, BC)
    return b_P, b_t0, b_t1, b_t2, b_t3


@triton.jit
def earlier_factor(b_P, b_t0, b_t1, b_t2, I, BT: tl.constexpr, BC: tl.constexpr):
    """``exp(G_r - G_j)`` on the rows j before sub-block I (r: the row before sub-block I), zero from sub-block I on:
    [BT, BKS] from the chunk's ``gP`` tile and the totals of sub-blocks 0-2 ([BKS] each). The exponent is
    ``(tot_J - gP_j) + sum_{J < M < I} tot_M`` (J: row j's sub-block), a sum of non-positive terms."""
    s = (tl.arange(0, BT) // BC)[:, None]                                   # [BT, 1] sub-block of each row
    b_own = tl.where(s == 0, b_t0[None, :], tl.where(s == 1, b_t1[None, :], b_t2[None, :]))
    # sub-blocks strictly between J and I can only be 1 and 2
    b_btw = tl.where((s < 1) & (I > 1), b_t1[None, :], 0.0) + tl.where((s < 2) & (I > 2), b_t2[None, :], 0.0)
    m_c = s < I
    return tl.where(m_c, tl.exp(tl.where(m_c, (b_own - b_P) + b_btw, 0.0)), 0.0)


@triton.jit
def chunk_separable(gP, bos, t0, T_n, i_hv, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr):
    """Whether the chunk at t0 is *separable*: ``exp(G_i - G_j) = exp(D_i) exp(-D_j)`` with ``D = G - R`` and both
    factors normal float32 numbers (|D| < HALF_LIMIT) for every row and channel, so that its scores are one product
    per channel step (chunk_wy.separable_scores; their gradients: chunk_bwd.py). ``R = G_31``: the gate of every
    channel falls by less than HALF_LIMIT over each 32-row half. (R at each channel's midpoint, allowing a fall of
    2 HALF_LIMIT over the chunk, was no faster on the H200: scores 1.58 against 1.59 ms.)"""
    b_t0, b_t1, b_t2, b_t3 = sub_block_totals(gP, bos, t0, T_n, i_hv, HV, K, tl.arange(0, BK), BC)   # [BK] x4
    return halves_fall_little(b_t0, b_t1, b_t2, b_t3)


@triton.jit
def halves_fall_little(b_t0, b_t1, b_t2, b_t3):
    """:func:`chunk_separable`'s test on the chunk's four sub-block totals ([BK] each)."""
    return tl.max(tl.maximum(-(b_t0 + b_t1), -(b_t2 + b_t3))) < HALF_LIMIT


@triton.jit
def sub_blocks_fall_little(b_t0, b_t1, b_t2, b_t3, LIMIT: tl.constexpr):
    """Whether the gate of every channel falls by less than LIMIT (<= HALF_LIMIT) over each 16-row sub-block, from
    the chunk's four sub-block totals ([BK] each): then its scores go by halves, each referred to a row of its own
    (chunk_wy.halves_scores, chunk_bwd.halves_grads), every factor a normal float32 number."""
    return -tl.min(tl.minimum(tl.minimum(b_t0, b_t1), tl.minimum(b_t2, b_t3))) < LIMIT


@triton.jit
def chunk_kind(gP, bos, t0, T_n, i_hv, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr):
    """(:func:`chunk_separable`, :func:`sub_blocks_fall_little` at HALF_LIMIT) of the chunk at t0 from one load of its
    sub-block totals, for the score gradients' list kernel (chunk_bwd.chunk_kda_bwd_list_kernel), which asks both."""
    b_t0, b_t1, b_t2, b_t3 = sub_block_totals(gP, bos, t0, T_n, i_hv, HV, K, tl.arange(0, BK), BC)   # [BK] x4
    return halves_fall_little(b_t0, b_t1, b_t2, b_t3), sub_blocks_fall_little(b_t0, b_t1, b_t2, b_t3, HALF_LIMIT)


@triton.jit
def sub_blocks_kind(gP, bos, t0, T_n, i_hv, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr,
                    LIMIT: tl.constexpr):
    """(:func:`sub_blocks_fall_little` at LIMIT, :func:`sub_blocks_far`) of the chunk at t0 from one load of its
    sub-block totals, for the forward's launch of the chunks that are not separable, which asks both."""
    o_k = tl.arange(0, BK)
    b_t0, b_t1, b_t2, b_t3 = sub_block_totals(gP, bos, t0, T_n, i_hv, HV, K, o_k, BC)   # [BK] x4
    return sub_blocks_fall_little(b_t0, b_t1, b_t2, b_t3, LIMIT), sub_blocks_fall_far(b_t1, b_t2, o_k, K)


# A gate falling by more than this over a 16-row sub-block in every channel: pairs across that sub-block have
# factors below exp(-BAND_LIMIT) = 2.1e-9, so an entry of theirs is at most 2.1e-9 |q_i| |k_j| (Cauchy-Schwarz over
# the channels), under float32's rounding of the chunk's unit-scale entries (2^-24 = 6e-8) and far under the tf32
# rounding (2^-11 of each operand) every 16-bit score product carries: chunk_wy.banded_scores leaves them at zero.
BAND_LIMIT: tl.constexpr = tl.constexpr(20.0)


@triton.jit
def sub_blocks_far(gP, bos, t0, T_n, i_hv, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr):
    """Whether the gate of every channel falls by more than BAND_LIMIT over sub-block 1 and over sub-block 2 of
    the chunk at t0 (the only sub-blocks that can lie strictly between two others): then only the diagonal
    sub-blocks and the ones just below them hold entries above exp(-BAND_LIMIT) (chunk_wy.banded_scores,
    chunk_bwd.band_grads)."""
    o_k = tl.arange(0, BK)
    b_t1 = sub_block_total(gP, bos, t0, 1, T_n, i_hv, HV, K, o_k, BC)
    b_t2 = sub_block_total(gP, bos, t0, 2, T_n, i_hv, HV, K, o_k, BC)
    return sub_blocks_fall_far(b_t1, b_t2, o_k, K)


@triton.jit
def sub_blocks_fall_far(b_t1, b_t2, o_k, K: tl.constexpr):
    """:func:`sub_blocks_far`'s test on the totals of sub-blocks 1 and 2 at channels o_k ([BK] each; channels past
    K, loaded as zero, left out)."""
    return tl.max(tl.where(o_k < K, tl.maximum(b_t1, b_t2), -float("inf"))) < -BAND_LIMIT


@triton.jit
def separable_exponent(gP, bos, t0, T_n, i_hv, HV: tl.constexpr, K: tl.constexpr, o_k, s_r, BT: tl.constexpr,
                       BC: tl.constexpr):
    """``D = G - R`` (see :func:`chunk_separable`) on the chunk at t0, channels o_k ([BT, len(o_k)]), from the
    sub-block sums. ``R = G_31``: gP plus tot_2 below sub-block 2; minus tot_1 (and tot_0) above row 32.
    ``s_r``: [BT, 1], the sub-block of each row."""
    # totals first, then the tile: gate_tiles' order (tile first) compiles the separable scores kernel to other
    # machine code (160 registers instead of 168) that has not been checked on the GPU yet
    b_t0, b_t1, b_t2, _ = sub_block_totals(gP, bos, t0, T_n, i_hv, HV, K, o_k, BC)   # [BKS] x3
    return separable_offset(load_rows(gP, bos, t0, T_n, i_hv, HV, K, o_k, BT), b_t0, b_t1, b_t2, s_r)


@triton.jit
def separable_offset(b_P, b_t0, b_t1, b_t2, s_r):
    """``D = G - G_31`` of :func:`separable_exponent` from the loaded gP tile ([BT, BKS]) and the totals of
    sub-blocks 0-2 ([BKS] each)."""
    return (b_P + tl.where(s_r == 3, b_t2[None, :], tl.where(s_r == 2, 0.0, -b_t1[None, :]))
            - tl.where(s_r == 0, b_t0[None, :], 0.0))


@triton.jit
def halves_exponents(b_P, b_t0, b_t1, b_t2, s_r):
    """The exponents of the scores by halves (chunk_wy.halves_scores, chunk_bwd.halves_grads) from the chunk's gP
    tile ([BT, BKS]) and the totals of sub-blocks 0-2 ([BKS] each); ``s_r``: [BT, 1], each row's sub-block.

    * ``D = G - R``, R the last row of the first sub-block of the row's half (row 15 or 47): ``gP - tot`` on
      sub-blocks 0 and 2, ``gP`` on 1 and 3; |D| < HALF_LIMIT on a chunk :func:`sub_blocks_fall_little` accepts;
    * ``X``, the factors across the halves through row 31: ``G - G_31`` on half 1, ``G_31 - G`` on half 0 (the
      columns of those products), <= 0 everywhere."""
    b_D = b_P - tl.where(s_r == 0, b_t0[None, :], tl.where(s_r == 2, b_t2[None, :], 0.0))
    b_X = tl.where(s_r == 0, (b_t0 + b_t1)[None, :] - b_P, tl.where(s_r == 1, b_t1[None, :] - b_P,
                   b_P + tl.where(s_r == 3, b_t2[None, :], 0.0)))
    return b_D, b_X


@triton.jit
def later_factor(b_P, b_t1, b_t2, S, BT: tl.constexpr, BC: tl.constexpr):
    """``exp(G_i - G_r)`` on the rows i after sub-block S (r: S's last row), zero up to S's end: [BT, BKS]. The
    exponent is ``gP_i + sum_{S < M < I} tot_M`` (I: row i's sub-block), a sum of non-positive terms."""
    s = (tl.arange(0, BT) // BC)[:, None]                                   # [BT, 1]
    b_btw = tl.where((S < 1) & (s > 1), b_t1[None, :], 0.0) + tl.where((S < 2) & (s > 2), b_t2[None, :], 0.0)
    m_r = s > S
    return tl.where(m_r, tl.exp(tl.where(m_r, b_P + b_btw, 0.0)), 0.0)


@triton.jit
def level_factor(gP, b_P, bos, r0, T_n, i_hv, HV: tl.constexpr, K: tl.constexpr, o_k, S: tl.constexpr,
                 BR: tl.constexpr):
    """One level of the hierarchical factorisation of a diagonal 16x16 block (chunk_wy.diagonal_levels,
    chunk_bwd.diagonal_grads), for the rows r0 .. r0 + BR (r0 at a sub-block start, BR a multiple of 16) at
    channels o_k: with the rows cut into blocks of S (S = 16, 8, 4 or 2, so never across a sub-block) and ``r``
    the last row of the lower half of row i's block, ``exp(gP_i - gP_r)`` on the rows of upper halves and
    ``exp(gP_r - gP_i)`` on the rows of lower halves, [BR, len(o_k)] float32. gP is non-increasing inside a
    sub-block, so both exponents are <= 0 and every factor is <= 1; for a row i of an upper half and a row j of
    the lower half of the same block (j <= r < i), ``exp(gP_i - gP_j)`` is the product of their two factors.

    ``b_P``: gP of the same rows and channels (zero past T_n); ``gP_r`` is a second load of the gP rows with row
    index r (L1 hits). Rows past T_n get the factor 1 (their q and k are zero), and r is clamped to the last valid
    row (the addresses stay inside the sequence; a valid row j <= r keeps a clamped r >= j in its sub-block, so its
    exponent stays <= 0)."""
    o_r = tl.arange(0, BR)
    r = (o_r // S) * S + (S // 2 - 1)                                       # [BR] the reference row of each row
    r = tl.minimum(r, (T_n - 1 - r0).to(tl.int32))
    p_x = gP + ((bos + r0) * HV + i_hv) * K
    if K // o_k.shape[0] * o_k.shape[0] == K:                               # the width divides K: no column mask
        b_Pr = tl.load(p_x + (r * (HV * K))[:, None] + o_k[None, :])
    else:
        b_Pr = tl.load(p_x + (r * (HV * K))[:, None] + o_k[None, :], mask=(o_k < K)[None, :], other=0.0)
    b_x = tl.where(((o_r % S) >= S // 2)[:, None], b_P - b_Pr, b_Pr - b_P)
    return fast_exp(tl.where(((r0 + o_r) < T_n)[:, None], b_x, 0.0))


# Strong channel steps of 16-bit inputs: each step of the gate steeper than -DIAG_CLAMP counts as -DIAG_CLAMP in the
# diagonal blocks' factors (clamped_diagonal_factors), so a 16-row block falls by at most 15 * DIAG_CLAMP = 150 and
# its factors through the block's midpoint stay within exp(+-75). A pair across a clamped step has its factor
# below exp(-DIAG_CLAMP) = 4.5e-5 both before and after the clamp, and that difference is under a tenth of the
# tf32 rounding (2^-11 of each operand) that every 16-bit score product already carries.
DIAG_CLAMP: tl.constexpr = tl.constexpr(10.0)


@triton.jit
def clamped_diagonal_factors(gP, b_P, bos, t0, T_n, i_hv, HV: tl.constexpr, K: tl.constexpr, o_k,
                             BT: tl.constexpr, BC: tl.constexpr, STEPS_PREC: tl.constexpr):
    """Row and column factors ``exp(c_i - m)``, ``exp(m - c_j)`` ([BT, BKS] float32 each, zero on rows past T_n)
    whose product is the diagonal blocks' ``exp(gP_i - gP_j)`` at any gate, to 16-bit precision: ``c`` sums the
    gate's steps clamped at -DIAG_CLAMP, ``m`` is the midpoint of ``c`` over each 16-row sub-block.

    Where no step between j and i is clamped, ``c_i - c_j = gP_i - gP_j``; where one is, both the exact factor and
    the clamped one are below exp(-DIAG_CLAMP). Each sub-block's ``c`` falls by at most 15 DIAG_CLAMP, so both
    factors stay within exp(+-7.5 DIAG_CLAMP): one tensor-core product per channel step, as for mild gates, where
    the exact reference-row levels (chunk_wy.diagonal_levels, kept for float32 inputs) take several. ``b_P``: gP
    of the chunk's rows at channels o_k (zero past T_n); the previous row's gP is a second load (L1 hits)."""
    o_t = tl.arange(0, BT)
    m_t = (t0 + o_t) < T_n                                                  # [BT] rows of the sequence
    m_s = m_t & ((o_t % BC) != 0)                                           # [BT] rows with a step inside the block
    o_p = tl.where(m_s, o_t - 1, o_t)
    p_x = gP + ((bos + t0) * HV + i_hv) * K
    b_Pp = tl.load(p_x + (o_p * (HV * K))[:, None] + o_k[None, :], mask=m_s[:, None] & (o_k < K)[None, :],
                   other=0.0)                                               # [BT, BKS] gP of the row before
    b_s = tl.where(m_s[:, None], tl.maximum(b_P - b_Pp, -DIAG_CLAMP), 0.0)  # [BT, BKS] clamped steps
    # c - m = M s with M[i, t] = [t <= i] - 1/2 inside each sub-block: the running sum of the clamped steps minus
    # half its total (c is 0 at a block's first row, its total at the last). A tensor-core product instead of a
    # scan and eight row reductions; M's entries are exact in tf32. ``STEPS_PREC`` "tf32x3" keeps the steps'
    # float32 bits; "tf32" (one product) is as good here: every row sums the same rounded steps, so a pair's
    # exponent x_i - x_j is the sum of its own steps rounded to tf32, off by at most 2^-11 |x_i - x_j| (the steps
    # are <= 0), and its factor by at most 2^-11 |d| exp(-|d|) <= 1.8e-4 (d its exponent), below the tf32 rounding
    # of the products' own operands. The forward takes "tf32" (H100, 16 x 2048: strong decay's scores 2.178 ->
    # 2.112 ms, K3's saturated gates 0.893 -> 0.868), the score gradients "tf32x3" (their sub-block launch under
    # strong decay 5.153 -> 5.242 ms with "tf32").
    o_s = o_t // BC
    b_M = tl.where(o_s[:, None] == o_s[None, :], tl.where(o_t[None, :] <= o_t[:, None], 0.5, -0.5), 0.0)
    b_x = mm(b_M, b_s, STEPS_PREC)                                          # [BT, BKS], |b_x| <= 75
    return tl.where(m_t[:, None], fast_exp(b_x), 0.0), tl.where(m_t[:, None], fast_exp(-b_x), 0.0)


@triton.jit
def level_pairs(o_i, o_j, S: tl.constexpr):
    """The pairs (i, j) that :func:`level_factor`'s level S covers, [len(o_i), len(o_j)]: the same S-row block,
    i in its upper half and j in its lower half (local row indices, blocks aligned to multiples of S). The levels
    S = 16, 8, 4, 2 cover every pair j < i of a 16x16 diagonal block exactly once."""
    return (((o_i // S)[:, None] == (o_j // S)[None, :]) & ((o_i % S) >= S // 2)[:, None]
            & ((o_j % S) < S // 2)[None, :])


@triton.jit
def chunk_gate_terms(gP, bos, t0, T_n, i_hv, HV: tl.constexpr, K: tl.constexpr, o_k, BT: tl.constexpr,
                     BC: tl.constexpr):
    """For the whole chunk at channels o_k: (G [BT, BKS] chunk prefix, Gs [BT, BKS] chunk suffix after the row
    (G_C - G), G_C [BKS]), each a sum of non-positive terms (see the module docstring). Rows past T_n hold
    don't-care finite values."""
    b_P, b_t0, b_t1, b_t2, b_t3 = gate_tiles(gP, bos, t0, T_n, i_hv, HV, K, o_k, BT, BC)   # [BT, BKS], [BKS] x4
    return gate_terms(b_P, b_t0, b_t1, b_t2, b_t3, BT, BC)


@triton.jit
def own_totals(b_t0, b_t1, b_t2, b_t3, s):
    """``tot`` of each row's own sub-block: [BT, BKS] from the four totals ([BKS] each) and ``s`` ([BT, 1], each
    row's sub-block)."""
    return tl.where(s == 0, b_t0[None, :], tl.where(s == 1, b_t1[None, :],
                    tl.where(s == 2, b_t2[None, :], b_t3[None, :])))


@triton.jit
def gate_terms(b_P, b_t0, b_t1, b_t2, b_t3, BT: tl.constexpr, BC: tl.constexpr):
    """:func:`chunk_gate_terms` from a loaded gP tile ([BT, BKS]) and the four sub-block totals ([BKS] each)."""
    tl.static_assert(BT == 4 * BC)
    o_t = tl.arange(0, BT)
    s = (o_t // BC)[:, None]                                                # [BT, 1] sub-block of each row
    b_before = (tl.where(s >= 1, b_t0[None, :], 0.0) + tl.where(s >= 2, b_t1[None, :], 0.0)
                + tl.where(s >= 3, b_t2[None, :], 0.0))                      # [BT, BKS]
    b_own = own_totals(b_t0, b_t1, b_t2, b_t3, s)                           # [BT, BKS]
    b_after = (tl.where(s <= 0, b_t1[None, :], 0.0) + tl.where(s <= 1, b_t2[None, :], 0.0)
               + tl.where(s <= 2, b_t3[None, :], 0.0))                       # [BT, BKS]
    b_G = b_P + b_before
    b_Gs = (b_own - b_P) + b_after
    return b_G, b_Gs, b_t0 + b_t1 + b_t2 + b_t3


# Rows of the diagonal blocks that the inverse's substitution works on (diagonal_block_inverses), then
# doubled to BC. H200, 16 x 2048, WY kernel in every gate regime (2026-12-03, two rounds each): 1.292 ms with 4,
# 1.297 with 2, 1.434 with 8, 1.560 with one substitution over the 16-row blocks.
INV_BLOCK: tl.constexpr = tl.constexpr(4)


@triton.jit
def pair_inverses(b_T, b_beta, Akk, bos, t0, T_n, i_hv, HV: tl.constexpr, BT: tl.constexpr, HB: tl.constexpr):
    """The inverses of the chunk's diagonal [2 HB, 2 HB] blocks ([BT // (2 HB), 2 HB, 2 HB]) from those of its
    [HB, HB] blocks (``b_T``, [BT // HB, HB, HB]): with L, U the inverses of a block's two halves (upper left,
    lower right), ``[[L, 0], [-U (beta A_21) L, U]]``, two batched float32 products on the CUDA cores. ``b_beta``:
    the chunk's beta, [BT]."""
    NP: tl.constexpr = BT // (2 * HB)
    b_L, b_U = tl.split(tl.permute(tl.reshape(b_T, [NP, 2, HB, HB]), (0, 2, 3, 1)))              # [NP, HB, HB] x2
    _, b_bU = tl.split(tl.permute(tl.reshape(b_beta, [NP, 2, HB]), (0, 2, 1)))                   # [NP, HB]
    o_p = tl.arange(0, NP)
    o_i = tl.arange(0, HB)
    r = t0 + o_p[:, None] * (2 * HB) + HB + o_i[None, :]                                          # [NP, HB]
    b_A = tl.load(Akk + ((bos + r) * HV + i_hv)[:, :, None] * BT + (o_p * (2 * HB))[:, None, None]
                  + o_i[None, None, :], mask=(r < T_n)[:, :, None], other=0.0) * b_bU[:, :, None]   # beta A_21
    b_X = tl.sum(b_A[:, :, :, None] * b_L[:, None, :, :], 2)                                     # beta A_21 L
    b_C = -tl.sum(b_U[:, :, :, None] * b_X[:, None, :, :], 2)                                    # -U beta A_21 L
    # rows of the upper half [L, 0], of the lower [C, U]
    b_top = tl.reshape(tl.permute(tl.join(b_L, tl.zeros_like(b_L)), (0, 1, 3, 2)), [NP, HB, 2 * HB])
    b_bot = tl.reshape(tl.permute(tl.join(b_C, b_U), (0, 1, 3, 2)), [NP, HB, 2 * HB])
    return tl.reshape(tl.permute(tl.join(b_top, b_bot), (0, 3, 1, 2)), [NP, 2 * HB, 2 * HB])


@triton.jit
def diagonal_block_inverses(Akk, beta, bos, t0, T_n, i_hv, HV: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                            USE_BETA_SIGMOID: tl.constexpr, NEG_EIGVAL: tl.constexpr):
    """``(I + diag(beta) A_bb)^-1`` of the chunk's BT // BC diagonal [BC, BC] blocks of Akk (strictly lower) at
    once: [BT // BC, BC, BC] float32. Two steps:

    1. the diagonal [HB, HB] blocks (HB = INV_BLOCK) in one forward substitution, row i of every inverse
       ``e_i - sum_{m < i} beta_i A[i, m] (row m)``, with row i of the blocks loaded from memory (no reduction to
       pick it out of a tile): HB - 1 serial steps on [BT // HB, HB, HB] tiles;
    2. blocks twice as large from pairs of those (:func:`pair_inverses`), twice, to [BC, BC].

    (A substitution over the [BC, BC] blocks themselves takes BC - 1 serial steps on four times larger tiles; the
    substitution is the WY kernel's serial part.) Not the nilpotent product ``(I - L)(I + L^2)(I + L^4)(I + L^8)``
    (six tensor-core products, no serial steps): its powers grow like binomial coefficients before they cancel, so
    with near-identical keys it loses digits (float32 products: 2.5e-5 relative error at beta ~ U(0, 1), 6e-2 at
    beta = 2 with identical keys; tf32: up to 1e0), where substitution stays at 1e-7 - 3e-6."""
    HB: tl.constexpr = INV_BLOCK
    tl.static_assert(BC == 4 * HB)
    NH: tl.constexpr = BT // HB
    o_h = tl.arange(0, NH)                                                 # [NH]
    o_i = tl.arange(0, HB)                                                 # [HB]
    b_eye = tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0)               # [HB, HB]
    b_T = tl.zeros([NH, HB, HB], dtype=tl.float32) + b_eye[None, :, :]     # [NH, HB, HB]
    b_bt = load_beta(beta, bos, t0, T_n, i_hv, HV, BT, USE_BETA_SIGMOID, NEG_EIGVAL)                # [BT]
    b_beta = tl.reshape(b_bt, [NH, HB])
    for i in tl.static_range(1, HB):                                       # unrolled: every row's load issued early
        r = t0 + o_h * HB + i                                              # [NH] row i of each block
        m_a = (r < T_n)[:, None] & (o_i < i)[None, :]
        b_a = tl.load(Akk + ((bos + r) * HV + i_hv)[:, None] * BT + (o_h * HB)[:, None] + o_i[None, :],
                      mask=m_a, other=0.0)                                 # [NH, HB] A[i, m], m < i
        # beta picked out of its tile by a reduction in each serial step: loading it per step instead halves the
        # WY kernel's barriers and shuffles (offline sm_90) but was slower on the H200 (1.585 against 1.555 ms,
        # 16 x 2048, every gate regime, 2026-12-02)
        b_a = b_a * tl.sum(tl.where(o_i[None, :] == i, b_beta, 0.0), 1)[:, None]
        b_row = -tl.sum(b_a[:, :, None] * b_T, 1)                          # [NH, HB]
        b_e = tl.where(o_i == i, 1.0, 0.0)                                # [HB] e_i
        b_T = tl.where((o_i == i)[None, :, None], b_row[:, None, :] + b_e[None, None, :], b_T)
    b_T = pair_inverses(b_T, b_bt, Akk, bos, t0, T_n, i_hv, HV, BT, HB)                 # [BT // 2HB, 2HB, 2HB]
    return pair_inverses(b_T, b_bt, Akk, bos, t0, T_n, i_hv, HV, BT, 2 * HB)             # [BT // BC, BC, BC]


@triton.jit
def block_of(b_T, b: tl.constexpr):
    """Block b of a [NB, BC, BC] stack: [BC, BC]."""
    o_b = tl.arange(0, b_T.shape[0])
    return tl.sum(tl.where((o_b == b)[:, None, None], b_T, 0.0), 0)
