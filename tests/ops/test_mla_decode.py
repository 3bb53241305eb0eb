"""Paged MLA decode attention (ops.mla_decode): the PyTorch path and the Triton kernels (under the interpreter)
against a float64 dense softmax over each row's keys, gathered one by one through its block table.

Pools hold fresh random entries; every slot that no row may read (blocks no row owns, the tail of a row's last
block, the table columns past a row's blocks, which point at an all-NaN block) is NaN, so a key read or weighted
where it must not be shows up as NaN. Bars (largest error over the largest reference value): float64 1e-12,
float32 1e-5 (the kernels' products are exact float32 here); bf16 / fp16 5e-3 for ctx (the weights p go to the
tensor cores in 16 bits and ctx is rounded to 16 bits, each ~2^-9 relative; measured up to 2.0e-3 bf16, 2.2e-4
fp16) and 1e-4 absolute for lse (the reference takes the same 16-bit inputs; measured < 2e-6).
"""

from __future__ import annotations

import pytest
import torch

from kimi_linear.ops import mla_decode as md
from kimi_linear.ops import paged_mla_decode
from kimi_linear.ops.mla_decode import paged_mla_decode_torch

from .kda_cases import rel_err
from .triton_cases import poison_empty  # noqa: F401  (autouse fixture)

NAN = float("nan")


def make_case(lens, bs=16, C=32, R=16, H=5, dtype=torch.float32, spare=3, extra_cols=2, seed=0):
    """Rows of lengths ``lens`` over a shuffled pool. Returns (q [B, H, C+R], cache, table int32, seq_lens int32)."""
    gen = torch.Generator().manual_seed(seed)
    B, W = len(lens), C + R
    need = [-(-L // bs) for L in lens]
    num_blocks = sum(need) + spare + 1                       # the last block: all NaN, the table's filler
    cache = torch.randn(num_blocks, bs, W, generator=gen).to(dtype)
    nan_block = num_blocks - 1
    perm = torch.randperm(num_blocks - 1, generator=gen).tolist()
    owned = set(perm[: sum(need)])
    for b in range(num_blocks):
        if b not in owned:
            cache[b] = NAN
    cols = max(need) + extra_cols
    table = torch.full((B, cols), nan_block, dtype=torch.int32)
    at = 0
    for i, (L, n) in enumerate(zip(lens, need)):
        table[i, :n] = torch.tensor(perm[at : at + n], dtype=torch.int32)
        at += n
        if L % bs:
            cache[table[i, n - 1], L % bs :] = NAN               # the unwritten tail of the row's last block
    # scaled up so the softmax is far from uniform (scores of a few units, not fractions)
    q = (2.0 * torch.randn(B, H, W, generator=gen)).to(dtype)
    return q, cache, table, torch.tensor(lens, dtype=torch.int32)


def reference(q, cache, table, seq_lens, scale, C):
    """float64, row by row: keys gathered one at a time through the table; (ctx [B, H, C], lse [B, H])."""
    B, H, _ = q.shape
    bs = cache.shape[1]
    ctx = torch.zeros(B, H, C, dtype=torch.float64)
    lse = torch.full((B, H), float("-inf"), dtype=torch.float64)
    for b in range(B):
        L = int(seq_lens[b])
        if L == 0:
            continue
        K = torch.stack([cache[int(table[b, j // bs]), j % bs] for j in range(L)]).double()   # [L, W]
        s = q[b].double() @ K.T * scale                                                        # [H, L]
        ctx[b] = s.softmax(-1) @ K[:, :C]
        lse[b] = s.logsumexp(-1)
    return ctx, lse


LAUNCH_KEYS = ("block_h", "block_n", "num_warps", "num_stages")   # a launch's overrides


def triton_decode(*args, **kw):
    pytest.importorskip("triton")
    from kimi_linear.ops.triton.mla_decode import paged_mla_decode as tri

    return tri(*args, **kw)


def bars(dtype):
    return (1e-5, 1e-5) if dtype == torch.float32 else (5e-3, 1e-4)


# ------------------------------------------------------------------------------------------------- PyTorch path
@pytest.mark.parametrize("bs", [4, 16])
def test_torch_path_exact_and_nan_free(bs):
    q, cache, table, lens = make_case([1, 17, 70], bs=bs, dtype=torch.float64, seed=1)
    ctx, lse = paged_mla_decode(q, cache, table, lens, 0.3, 32, return_lse=True)
    ctx_ref, lse_ref = reference(q, cache, table, lens, 0.3, 32)
    assert ctx.dtype == torch.float64 and ctx.shape == (3, 5, 32)
    assert rel_err(ctx, ctx_ref) < 1e-12 and (lse - lse_ref).abs().max() < 1e-12


def test_torch_path_empty_row_and_bf16():
    """A row of length 0 (a padding row) gets ctx 0 and lse -inf; bf16 in, bf16 out, float32 math."""
    q, cache, table, lens = make_case([0, 33], dtype=torch.bfloat16, seed=2)
    ctx, lse = paged_mla_decode(q, cache, table, lens, 0.2, 32, return_lse=True)
    assert ctx.dtype == torch.bfloat16 and torch.equal(ctx[0].float(), torch.zeros(5, 32))
    assert torch.isinf(lse[0]).all() and (lse[0] < 0).all()
    ctx_ref, lse_ref = reference(q, cache, table, lens, 0.2, 32)
    assert rel_err(ctx[1:], ctx_ref[1:]) < 5e-3 and (lse[1] - lse_ref[1]).abs().max() < 1e-4


# ------------------------------------------------------------------------------------------------ Triton kernels
CASES = [  # (lens, block size, splits, heads)
    ([1], 16, 1, 5),
    ([17], 16, 3, 5),
    ([300, 1, 17, 64], 16, 1, 5),        # one split: the split kernel writes the output itself
    ([300, 1, 17, 64], 16, 5, 20),       # 5 splits (all past the length-1 row's one key); 2 head blocks
    ([130, 64, 3], 64, 4, 5),            # 64-key blocks: a key tile inside one block
    ([257, 9], 64, 16, 3),               # more splits than tiles
    ([3000, 70], 16, 100, 3),            # 94 used splits of one tile each
]


@pytest.mark.parametrize("launch", [None, (32, 128, 16, 2), (32, 64, 8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens, bs, splits, H", CASES)
def test_triton_matches_reference(lens, bs, splits, H, dtype, launch):
    """The launch table's tiles, tiles of more heads than the case has (padded rows masked), and the long tiles with
    2 stages (one key buffer, as float32 pools run)."""
    q, cache, table, seq = make_case(lens, bs=bs, H=H, dtype=dtype, seed=len(lens) + bs + splits)
    ctx, lse = triton_decode(q, cache, table, seq, 0.25, 32, num_splits=splits,
                            **dict(zip(LAUNCH_KEYS, launch or ())))
    ctx_ref, lse_ref = reference(q, cache, table, seq, 0.25, 32)
    bar, lse_bar = bars(dtype)
    assert ctx.dtype == dtype and ctx.shape == (len(lens), H, 32) and lse.dtype == torch.float32
    assert torch.isfinite(ctx).all() and torch.isfinite(lse).all()
    assert rel_err(ctx, ctx_ref) < bar
    assert (lse.double() - lse_ref).abs().max() < lse_bar


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_kimi_width(dtype):
    """The Kimi-Linear-48B entry (C = 512, R = 64) with 32 heads (two head blocks), default split count; and the
    long splits' tiles (LAUNCH_LONG)."""
    q, cache, table, seq = make_case([40, 3], bs=16, C=512, R=64, H=32, dtype=dtype, seed=5)
    ctx_ref, lse_ref = reference(q, cache, table, seq, 192 ** -0.5, 512)
    pytest.importorskip("triton")
    from kimi_linear.ops.triton.mla_decode import LAUNCH_LONG

    for kw in ({}, dict(zip(LAUNCH_KEYS, LAUNCH_LONG))):
        ctx, lse = triton_decode(q, cache, table, seq, 192 ** -0.5, 512, **kw)
        assert rel_err(ctx, ctx_ref) < 5e-3 and (lse.double() - lse_ref).abs().max() < 1e-4


@pytest.mark.parametrize("merge_bs", [4, 16])
def test_triton_merge_in_several_steps(monkeypatch, merge_bs):
    """A row's splits merged a few at a time (the default takes up to MERGE_BS = 128 a step, so CASES merge in one):
    the online rescaling between merge steps, with a partial last step."""
    pytest.importorskip("triton")
    from kimi_linear.ops.triton import mla_decode as tri

    monkeypatch.setattr(tri, "MERGE_BS", merge_bs)
    q, cache, table, seq = make_case([3000, 70], bs=16, H=3, dtype=torch.float32, seed=7)
    ctx, lse = triton_decode(q, cache, table, seq, 0.25, 32, num_splits=50)
    ctx_ref, lse_ref = reference(q, cache, table, seq, 0.25, 32)
    bar, lse_bar = bars(torch.float32)
    assert rel_err(ctx, ctx_ref) < bar and (lse.double() - lse_ref).abs().max() < lse_bar


def test_triton_empty_row_wide_int64_table_and_mixed_dtypes():
    """seq_len 0 (ctx 0, lse -inf) beside real rows; int64 table and lengths read through a column slice of a
    wider table (row stride != columns); a float32 query against a bf16 pool (cast to bf16 for the products)."""
    q, cache, table, seq = make_case([0, 50, 5], dtype=torch.bfloat16, seed=6)
    wide = torch.cat([table, torch.full_like(table, 10**6)], 1).long()     # columns past the slice: out of range
    q32 = q.float() * 1.01
    for splits in (1, 4):
        ctx, lse = triton_decode(q32, cache, wide[:, : table.shape[1]], seq.long(), 0.25, 32, num_splits=splits)
        assert ctx.dtype == torch.float32 and torch.equal(ctx[0], torch.zeros(5, 32))
        assert torch.isinf(lse[0]).all() and (lse[0] < 0).all()
        ctx_ref, lse_ref = reference(q32.bfloat16(), cache, table, seq, 0.25, 32)
        assert rel_err(ctx[1:], ctx_ref[1:]) < 5e-3 and (lse[1:].double() - lse_ref[1:]).abs().max() < 1e-4


def test_triton_lengths_past_the_table_are_cut():
    """A length beyond max_blocks * block_size reads the table's keys only (memory safety), like the PyTorch path."""
    q, cache, table, seq = make_case([32], bs=16, extra_cols=0, seed=7)
    ctx = triton_decode(q, cache, table, torch.tensor([1000], dtype=torch.int32), 0.25, 32, num_splits=2)[0]
    ctx_t = paged_mla_decode_torch(q, cache, table, torch.tensor([1000], dtype=torch.int32), 0.25, 32)[0]
    assert rel_err(ctx, reference(q, cache, table, seq, 0.25, 32)[0]) < 1e-5 and rel_err(ctx_t, ctx) < 1e-5


def test_public_op_dispatches_to_the_kernel(monkeypatch):
    """paged_mla_decode sends CUDA-like inputs to the Triton function (here forced on CPU) and keeps its lse."""
    from kimi_linear.ops.triton import paged_mla_decode as tri

    calls = []
    monkeypatch.setattr(md, "triton_op", lambda name, x: (calls.append(name), tri)[1])
    q, cache, table, seq = make_case([20, 7], dtype=torch.float32, seed=8)
    ctx, lse = paged_mla_decode(q, cache, table, seq, 0.25, 32, num_splits=2, return_lse=True)
    ctx_ref, lse_ref = reference(q, cache, table, seq, 0.25, 32)
    assert calls == ["paged_mla_decode"] and rel_err(ctx, ctx_ref) < 1e-5 and (lse - lse_ref).abs().max() < 1e-5


def test_default_num_splits_static_heuristic():
    from kimi_linear.ops.triton.mla_decode import default_num_splits

    # one 1M-token row (65536 blocks of 16), 32 heads in 2 head blocks: every one of 132 SMs gets programs
    ns = default_num_splits(1, 32, 65536, 16, 132)
    assert 2 * ns >= 132 and (1 << 20) // ns >= 64
    # 128 / 256 rows at 4k: no splitting (256+ programs already)
    assert default_num_splits(128, 32, 256, 16, 132) == 1 and default_num_splits(256, 32, 256, 16, 132) == 1
    # short tables are not cut below 64 keys a split; the count never depends on anything but these shapes
    assert default_num_splits(1, 32, 4, 16, 132) == 1 and default_num_splits(1, 32, 64, 16, 132) == 16
    assert default_num_splits(1, 32, 256, 16, 132) == 64
    assert default_num_splits(32, 32, 256, 16, 132) == 4
    # a long table is cut into pieces of at most 8k keys (one long row among short ones) while the launch stays
    # under 16 programs per SM: a large batch fills the card anyway, and its partials grow with the splits
    assert default_num_splits(32, 32, 16384, 16, 132) == 32 and default_num_splits(256, 32, 16384, 16, 132) == 4
    assert default_num_splits(256, 32, 65536, 16, 132) == 4 and default_num_splits(128, 32, 65536, 16, 132) == 8


# --------------------------------------------------------------------------------------------------- arguments
def good():
    q, cache, table, seq = make_case([5, 9], seed=9)
    return dict(q=q, cache=cache, block_table=table, seq_lens=seq, scale=0.25, kv_lora_rank=32)


BAD = [
    ("q", lambda a: a["q"][0]),
    ("q", lambda a: a["q"].int()),
    ("cache", lambda a: a["cache"][..., :40]),
    ("cache", lambda a: a["cache"].transpose(0, 1)),
    ("cache", lambda a: a["cache"].long()),
    ("kv_lora_rank", 0),
    ("kv_lora_rank", 49),
    ("kv_lora_rank", 32.0),
    ("block_table", lambda a: a["block_table"][:1]),
    ("block_table", lambda a: a["block_table"].float()),
    ("block_table", lambda a: a["block_table"][:, :0]),
    ("seq_lens", lambda a: a["seq_lens"][:, None]),
    ("seq_lens", lambda a: a["seq_lens"].float()),
    ("seq_lens", lambda a: [5, 9]),
    ("scale", 0.0),
    ("scale", float("nan")),
    ("num_splits", 0),
]


@pytest.mark.parametrize("name, bad", BAD)
def test_argument_errors_name_the_argument(name, bad):
    a = good()
    a[name] = bad(a) if callable(bad) else bad
    with pytest.raises(ValueError, match=f"`{name}`"):
        paged_mla_decode(**a)
