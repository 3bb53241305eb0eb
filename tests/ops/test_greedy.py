"""A decode step's float32 logits and greedy tokens (ops.greedy): the Triton kernels (under the interpreter, with
chunks small enough that every row spans several) against the PyTorch path, which is checked against the
definition: the first index of the maximum, -1 for a row with a NaN."""

import pytest
import torch

from kimi_linear.ops.greedy import logits_and_greedy, logits_and_greedy_torch


def rows(dtype, V, seed=0):
    """Six rows of V logits: random; a tie of the maximum across chunks (first wins); a NaN; all -inf; +inf twice;
    the maximum in the last column."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(6, V, generator=gen).to(dtype)
    top = x.float().max() + 1
    x[1, V // 3], x[1, V - 2] = top, top
    x[2, V // 2] = float("nan")
    x[3] = float("-inf")
    x[4, 1], x[4, V - 1] = float("inf"), float("inf")
    x[5, V - 1] = top
    return x


def first_argmax(row: torch.Tensor) -> int:
    if row.isnan().any():
        return -1
    m = row.max()
    return next(j for j in range(row.numel()) if row[j] == m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_torch_path_is_the_definition(dtype):
    x = rows(dtype, 300)
    logits, ids = logits_and_greedy_torch(x)
    assert logits.dtype == torch.float32
    assert ids.tolist() == [first_argmax(r) for r in x.float()]
    assert ids.tolist()[1:5] == [300 // 3, -1, 0, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("V", [1, 37, 64, 300])
def test_triton_matches_torch(dtype, V, monkeypatch):
    pytest.importorskip("triton")
    import kimi_linear.ops.triton.greedy as tri

    monkeypatch.setattr(tri, "BV", 64)           # 300 logits: 5 chunks, the last one partial
    x = rows(dtype, max(V, 6))[:, :V] if V >= 6 else torch.randn(3, V).to(dtype)
    wide = torch.zeros(x.shape[0], V + 5, dtype=dtype)
    wide[:, :V] = x
    for t in (x, wide[:, :V]):                    # contiguous, and a view with a row stride
        got, want = tri.logits_and_greedy(t), logits_and_greedy_torch(t)
        assert torch.equal(got[1], want[1]) and got[1].dtype == torch.int64
        assert got[0].dtype == torch.float32 and torch.equal(got[0].nan_to_num(), want[0].nan_to_num())


def test_public_op_dispatches_and_names_bad_arguments(monkeypatch):
    import kimi_linear.ops.greedy as op
    import kimi_linear.ops.triton.greedy as tri

    calls = []
    monkeypatch.setattr(op, "triton_op", lambda name, x: (lambda *a: calls.append(name) or tri.logits_and_greedy(*a)))
    x = rows(torch.bfloat16, 50)
    assert torch.equal(logits_and_greedy(x)[1], logits_and_greedy_torch(x)[1])
    assert calls == ["logits_and_greedy"]
    logits_and_greedy(x.double())                 # float64: the PyTorch path
    logits_and_greedy(x[:0])                      # no rows: nothing to launch
    assert calls == ["logits_and_greedy"]
    for bad in (x[0], x.int(), x[:, :0]):
        with pytest.raises(ValueError, match="logits"):
            logits_and_greedy(bad)
