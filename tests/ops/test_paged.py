"""The decode step's paged-pool rows (ops.paged): the Triton kernel (under the interpreter) against the PyTorch
path, which is checked against the formula written out row by row."""

import pytest
import torch

from kimi_linear.ops.paged import paged_decode_rows, paged_decode_rows_torch


def case(dtype, S=6, MB=37, B=5, bs=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    table = torch.randperm(S * MB, generator=gen).view(S, MB).to(dtype)
    slots = torch.tensor([4, 0, 5, 5, 2])[:B]                      # a repeated slot (padding rows share one)
    lens = torch.tensor([0, bs - 1, bs, MB * bs - 1, 300])[:B]      # first, last of a block, next block, last key
    return table, slots, lens, bs


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_torch_path_is_the_formula(dtype):
    table, slots, lens, bs = case(dtype)
    rows, dst, seq = paged_decode_rows_torch(table, slots, lens, bs)
    for r in range(len(slots)):
        s, n = int(slots[r]), int(lens[r])
        assert torch.equal(rows[r], table[s])
        assert int(dst[r]) == int(table[s, n // bs]) * bs + n % bs and int(seq[r]) == n + 1
    assert dst.dtype == torch.int64 and seq.dtype == torch.int32 and rows.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("MB", [37, 5000])                          # one column block; two (BM = 4096)
def test_triton_matches_torch(dtype, MB):
    pytest.importorskip("triton")
    from kimi_linear.ops.triton.paged import paged_decode_rows as tri

    table, slots, lens, bs = case(dtype, MB=MB)
    wide = torch.zeros(table.shape[0], MB + 3, dtype=dtype)
    wide[:, :MB] = table
    for t in (table, wide[:, :MB]):                                   # contiguous, and a view with a row stride
        got, want = tri(t, slots, lens, bs), paged_decode_rows_torch(t, slots, lens, bs)
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want))


def test_public_op_dispatches_and_names_bad_arguments(monkeypatch):
    import kimi_linear.ops.paged as op
    from kimi_linear.ops.triton.paged import paged_decode_rows as tri

    calls = []
    monkeypatch.setattr(op, "triton_op", lambda name, x: (lambda *a: calls.append(name) or tri(*a)))
    table, slots, lens, bs = case(torch.int32)
    paged_decode_rows(table, slots, lens, bs)
    assert calls == ["paged_decode_rows"]
    with pytest.raises(ValueError, match="block_table"):
        paged_decode_rows(table.float(), slots, lens, bs)
    with pytest.raises(ValueError, match="lens"):
        paged_decode_rows(table, slots, lens.int(), bs)
    with pytest.raises(ValueError, match="block_size"):
        paged_decode_rows(table, slots, lens, 0)
