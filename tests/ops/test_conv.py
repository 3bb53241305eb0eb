"""The KDA block's short convolution (ops.conv): the PyTorch path and the Triton kernels (under the interpreter)
against a float64 loop over the formula, forward and gradients (x, weight, past), with packed documents (pos),
length 1, lengths shorter than the window and not multiples of the kernels' row block, and more channels than one
channel block. Bars: float64 1e-12, float32 1e-5, bf16 5e-3 forward / 2e-2 gradients (relative, norm-wise)."""

import pytest
import torch

from kimi_linear.ops.conv import short_conv, short_conv_torch

from .kda_cases import rel_err
from .triton_cases import poison_empty  # noqa: F401  (autouse fixture)


def naive_short_conv(x, weight, past=None, pos=None):
    """y_t = silu(sum_j w_j x_{t - (W-1-j)}), token by token in float64."""
    B, T, C = x.shape
    W = weight.shape[0]
    full = torch.cat([past.double() if past is not None else x.new_zeros(B, W - 1, C).double(), x.double()], 1)
    y = torch.zeros(B, T, C, dtype=torch.float64)
    for t in range(T):
        for j in range(W):
            if pos is None or pos[t] >= W - 1 - j:
                y[:, t] += weight[j].double() * full[:, t + j]
    return torch.nn.functional.silu(y)


def make(B, T, C, W=4, dtype=torch.float32, past=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=gen).to(dtype)
    w = (torch.randn(W, C, generator=gen) * 0.5).to(dtype)
    p = torch.randn(B, W - 1, C, generator=gen).to(dtype) if past else None
    return x, w, p


def doc_positions(cu):
    """pos of each token inside its document for offsets cu."""
    cu = torch.tensor(cu)
    starts = torch.repeat_interleave(cu[:-1], cu.diff())
    return torch.arange(int(cu[-1])) - starts


CASES = [  # (B, T, C, past, documents)
    (2, 37, 24, True, None),
    (1, 1, 16, True, None),
    (3, 2, 8, True, None),
    (1, 70, 160, False, [0, 1, 3, 40, 41, 70]),
    (1, 33, 8, True, [0, 2, 33]),
]


@pytest.mark.parametrize("B, T, C, past, docs", CASES)
def test_torch_path_exact(B, T, C, past, docs):
    x, w, p = make(B, T, C, dtype=torch.float64, past=past)
    pos = doc_positions(docs) if docs else None
    y, window = short_conv(x, w, p, pos)
    assert rel_err(y, naive_short_conv(x, w, p, pos)) < 1e-12
    full = torch.cat([p if p is not None else torch.zeros(B, 3, C, dtype=x.dtype), x], 1)
    assert torch.equal(window, full[:, -3:])


def triton_short_conv(x, w, p, pos):
    from kimi_linear.ops.triton.conv import short_conv as tri

    return tri(x, w, p, pos)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B, T, C, past, docs", CASES)
def test_triton_forward_and_gradients(B, T, C, past, docs, dtype):
    x, w, p = make(B, T, C, dtype=dtype, past=past, seed=1)
    pos = doc_positions(docs) if docs else None
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, w, p)]
    y = triton_short_conv(*leaves, pos)
    ref_leaves = [t.detach().double().requires_grad_() if t is not None else None for t in (x, w, p)]
    y_ref = naive_short_conv(*ref_leaves, pos)
    assert y.dtype == dtype and y.shape == x.shape
    fwd_bar, grad_bar = (1e-5, 1e-5) if dtype == torch.float32 else (5e-3, 2e-2)
    assert rel_err(y, y_ref) < fwd_bar
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    (y.double() * dy).sum().backward()
    (y_ref * dy).sum().backward()
    for name, got, ref in zip(("x", "weight", "past"), leaves, ref_leaves):
        if got is None:
            continue
        assert got.grad.dtype == dtype and got.grad.shape == got.shape, name
        assert rel_err(got.grad, ref.grad) < grad_bar, (name, rel_err(got.grad, ref.grad))


def test_triton_matches_torch_path_without_past():
    """No past (a fresh sequence): both paths read zeros before the first input."""
    x, w, _ = make(2, 45, 40, past=False, seed=3)
    assert rel_err(triton_short_conv(x, w, None, None), short_conv_torch(x, w)[0]) < 1e-6


@pytest.mark.parametrize("bad, match", [
    (dict(x=torch.zeros(2, 3)), "x must be"),
    (dict(weight=torch.zeros(4, 5)), "weight must be"),
    (dict(past=torch.zeros(1, 2, 8)), "past must be"),
    (dict(pos=torch.zeros(5)), "pos must be"),
])
def test_bad_inputs(bad, match):
    args = dict(x=torch.zeros(1, 6, 8), weight=torch.zeros(4, 8), past=None, pos=None)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        short_conv(**args)


@pytest.mark.parametrize("lens", [[1, 5, 2, 9], [1], [3, 1, 1]])
@pytest.mark.parametrize("use_triton", [False, True])
def test_varlen_sequences_each_continue_from_their_past(lens, use_triton, monkeypatch):
    """short_conv_varlen (a mixed engine step's packed sequences): each sequence's outputs and next window equal
    running it alone from its own past, length-1 sequences and the Triton kernel (interpreter) included."""
    import kimi_linear.ops.conv as conv_mod
    from kimi_linear.ops.conv import short_conv_varlen

    if use_triton:
        monkeypatch.setattr(conv_mod, "triton_op", lambda name, x: triton_short_conv)
    N, C = len(lens), 40
    x, w, _ = make(1, sum(lens), C, seed=4)
    past = torch.randn(N, 3, C, generator=torch.Generator().manual_seed(5))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    y, win = short_conv_varlen(x, w, past, cu)
    for n in range(N):
        a, b = int(cu[n]), int(cu[n + 1])
        y_ref = naive_short_conv(x[:, a:b], w, past[n : n + 1])
        assert rel_err(y[:, a:b], y_ref) < 1e-5, n
        full = torch.cat([past[n], x[0, a:b]])
        assert torch.equal(win[n], full[-3:]), n


def decode_case(B, C, W, slots, dtype=torch.float32, seed=6):
    """x [B, 1, C] as a slice of a packed projection, weight [W, C], a pool of random windows, and each row's slot:
    distinct slots in random order, the last two rows padding on one shared scratch slot (slots - 1)."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randn(B, 1, C + 9, generator=gen).to(dtype)
    w = (torch.randn(W, C, generator=gen) * 0.5).to(dtype)
    pool = torch.randn(slots, W - 1, C, generator=gen).to(dtype)
    live = torch.randperm(slots - 1, generator=gen)[: B - 2]
    index = torch.cat([live, torch.full((2,), slots - 1)])
    return packed[..., 4:4 + C], w, pool, index


@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("B, C", [(5, 40), (4, 700), (3, 1030)])   # C not a multiple of any block; > one block
def test_decode_step_on_the_pool_torch_path(B, C, W):
    """short_conv_decode (PyTorch path) = a one-token short_conv from each row's window, and the pool's rows then
    hold the last W - 1 inputs; slots no row names are untouched."""
    from kimi_linear.ops.conv import short_conv_decode

    x, w, pool, index = decode_case(B, C, W, slots=B + 3)
    before = pool.clone()
    y = short_conv_decode(x, w, pool, index)
    assert y.shape == x.shape
    for b in range(B - 2):
        s = int(index[b])
        assert rel_err(y[b:b + 1], naive_short_conv(x[b:b + 1], w, before[s:s + 1])) < 1e-6, b
        assert torch.equal(pool[s], torch.cat([before[s], x[b]])[1:]), b
    untouched = [s for s in range(B + 3) if s not in index.tolist()]
    assert torch.equal(pool[untouched], before[untouched])


def triton_decode(x, w, pool, index):
    from kimi_linear.ops.triton.conv import short_conv_decode as tri

    return tri(x, w, pool, index)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("B, C", [(5, 40), (4, 700), (3, 1030)])
def test_triton_decode_matches_torch_path(B, C, W, dtype):
    """The decode kernel (interpreter) against the PyTorch path: outputs of the live rows, the whole pool except
    the scratch slot the padding rows share (raced, never read), as [B, 1, C] and as [B, C] input."""
    from kimi_linear.ops.conv import short_conv_decode

    x, w, pool, index = decode_case(B, C, W, slots=B + 3, dtype=dtype, seed=7)
    ref_pool, got_pool = pool.clone(), pool.clone()
    y_ref = short_conv_decode(x, w, ref_pool, index)
    y = triton_decode(x, w, got_pool, index)
    assert y.dtype == dtype and y.shape == x.shape
    bar = 1e-6 if dtype == torch.float32 else 1e-2   # bf16: the PyTorch path rounds each tap's product to bf16
    assert rel_err(y[:-2], y_ref[:-2]) < bar
    keep = [s for s in range(B + 3) if s != B + 2]
    assert torch.equal(got_pool[keep], ref_pool[keep])
    y2 = triton_decode(x.reshape(B, C), w, pool, index)      # [B, C] input: same outputs, same pool update
    assert y2.shape == (B, C) and torch.equal(y2, y.reshape(B, C)) and torch.equal(pool[keep], got_pool[keep])


def test_decode_steps_continue_a_prefill(monkeypatch):
    """Prefill through short_conv, its window put in a pool, then 5 decode steps through the kernel (dispatched as
    on a GPU): the outputs equal one short_conv over the whole sequence."""
    import kimi_linear.ops.conv as conv_mod
    from kimi_linear.ops.conv import short_conv_decode

    monkeypatch.setattr(conv_mod, "triton_op", lambda name, x: triton_decode if name == "short_conv_decode" else None)
    x, w, _ = make(2, 12, 24, seed=8)
    full, _ = short_conv(x, w)
    y, window = short_conv(x[:, :7], w)
    pool = torch.zeros(4, 3, 24)
    index = torch.tensor([2, 0])
    pool[index] = window
    steps = [short_conv_decode(x[:, t:t + 1], w, pool, index) for t in range(7, 12)]
    assert rel_err(torch.cat([y, *steps], 1), full) < 1e-6
    assert torch.equal(pool[1], torch.zeros(3, 24)) and torch.equal(pool[index], x[:, 9:])


@pytest.mark.parametrize("bad, match", [
    (dict(x=torch.zeros(3, 2, 8)), "x must be"),
    (dict(weight=torch.zeros(4, 5)), "weight must be"),
    (dict(conv_pool=torch.zeros(6, 2, 8)), "conv_pool must be"),
    (dict(index=torch.zeros(3)), "index must be"),
    (dict(index=torch.zeros(2, dtype=torch.long)), "index must be"),
])
def test_decode_bad_inputs(bad, match):
    from kimi_linear.ops.conv import short_conv_decode

    args = dict(x=torch.zeros(3, 1, 8), weight=torch.zeros(4, 8), conv_pool=torch.zeros(6, 3, 8),
                index=torch.zeros(3, dtype=torch.long))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        short_conv_decode(**args)


@pytest.mark.parametrize("rows, want_bt", [(1, 1), (3, 4), (17, 32), (500, 32)])
def test_launch_shape_fits_short_calls(rows, want_bt):
    """The prefill kernel's row block follows T (next power of two, at most 32) and widens its channel block in
    proportion (same tile size) so a short call launches few programs; every row and channel is covered."""
    from kimi_linear.ops.triton.conv import BC_CHANNELS, BT_ROWS, launch_shape

    BT, BC, grid = launch_shape(torch.zeros(2, rows, 3000), rows)
    assert BT == want_bt and BT * BC <= BT_ROWS * BC_CHANNELS
    assert grid[0] * BT >= rows and grid[1] * BC >= 3000 and grid[2] == 2
