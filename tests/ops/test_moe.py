"""Fused mixture of experts (ops.moe): the PyTorch path against a per-token float64 loop over the formula, and the
Triton kernels (under the interpreter) against the PyTorch path in float64 on fresh random inputs.

Routings: random (duplicate-free top-k, as a router gives), one expert no token chooses, every token on the same
k experts (one segment over many blocks), k = 1 and k = E; N = 1 (decode), 3, 37 (segments longer than a block);
SiLU and SiTU (pre-activations from -10 to 10: both tanh branches); launch shapes whose tiles do not divide W or I.
Outputs and intermediates are poisoned with NaN before each run: an element the kernels forget to write, or a
padding row they read, fails the comparison.

Bars (relative, norm-wise, against float64): float32 1e-6; bfloat16 2^-8 = 3.9e-3 and float16 2^-11 = 4.9e-4 (the
dtype's unit roundoff: the hidden is rounded to the dtype once and the output once, each at most half of that;
measured 2.2-2.5e-3 and 2.9e-4; the PyTorch path in bf16 is at 4.2e-3, rounding gate, up and the GLU too).
"""

import pytest
import torch
import torch.nn.functional as F

from kimi_linear.ops import fused_moe
from kimi_linear.ops.moe import fused_moe_torch

from .kda_cases import rel_err
from .triton_cases import poison_empty  # noqa: F401  (autouse fixture)

pytest.importorskip("triton")

BARS = {torch.float32: 1e-6, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def naive_moe(x, w13, w2, topk_weights, topk_ids, activation="silu", b=4.0, b_lin=25.0):
    """Token by token in float64: sum_j w_j w2[e_j] glu(w1[e_j] x, w3[e_j] x)."""
    x, w13, w2, topk_weights = x.double(), w13.double(), w2.double(), topk_weights.double()
    I = w2.shape[2]
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j, e in enumerate(topk_ids[n].tolist()):
            g, u = w13[e, :I] @ x[n], w13[e, I:] @ x[n]
            if activation == "silu":
                a = F.silu(g) * u
            else:
                a = b * torch.tanh(g / b) * torch.sigmoid(g) * b_lin * torch.tanh(u / b_lin)
            out[n] += topk_weights[n, j] * (w2[e] @ a)
    return out


def routing(N, E, k, mode, gen):
    """topk_ids [N, k] int64, duplicate-free per token. mode: "random"; "idle" (expert E - 1 never chosen);
    "one" (every token chooses experts 0..k-1, in shuffled order)."""
    pool = k if mode == "one" else E - 1 if mode == "idle" else E
    rows = [torch.randperm(pool, generator=gen)[:k] for _ in range(N)]
    return torch.stack(rows) if rows else torch.zeros(0, k, dtype=torch.int64)


def make(N, E, k, W, I, dtype=torch.float32, mode="random", seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(N, W, generator=gen) * scale).to(dtype)
    w13 = (torch.randn(E, 2 * I, W, generator=gen) / W**0.5).to(dtype)
    w2 = (torch.randn(E, W, I, generator=gen) / I**0.5).to(dtype)
    topk_weights = torch.rand(N, k, generator=gen) + 0.1
    return x, w13, w2, topk_weights, routing(N, E, k, mode, gen)


def reference(x, w13, w2, topk_weights, topk_ids, activation="silu", b=4.0, b_lin=25.0):
    return fused_moe_torch(x.double(), w13.double(), w2.double(), topk_weights.double(), topk_ids, activation, b,
                           b_lin)


def triton_moe(*args, **kw):
    from kimi_linear.ops.triton.moe import fused_moe as tri

    return tri(*args, **kw)


@pytest.mark.parametrize("activation", ["silu", "situ"])
@pytest.mark.parametrize("mode", ["random", "idle", "one"])
def test_torch_path_matches_token_loop(mode, activation):
    x, w13, w2, tw, ids = make(9, 5, 2, 12, 10, torch.float64, mode, seed=1, scale=3.0)
    got = fused_moe(x, w13, w2, tw, ids, activation, 2.0, 3.0)
    assert got.dtype == torch.float64
    assert rel_err(got, naive_moe(x, w13, w2, tw, ids, activation, 2.0, 3.0)) < 1e-12


CASES = [  # (N, E, k, W, I, routing)
    (1, 4, 2, 32, 32, "random"),
    (1, 8, 3, 64, 48, "idle"),
    (3, 4, 1, 32, 64, "random"),
    (3, 8, 2, 64, 32, "one"),
    (37, 8, 3, 64, 48, "random"),
    (37, 4, 2, 32, 32, "idle"),
    (37, 4, 1, 48, 40, "one"),           # 37 pairs of one expert: a segment of three 16-slot blocks
    (5, 4, 4, 32, 32, "random"),         # k = E: every expert gets every token
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N, E, k, W, I, mode", CASES)
def test_triton_matches_reference(N, E, k, W, I, mode, dtype):
    x, w13, w2, tw, ids = make(N, E, k, W, I, dtype, mode, seed=N * 100 + E * 10 + k)
    got = triton_moe(x, w13, w2, tw, ids)
    assert got.dtype == dtype and got.shape == (N, W)
    assert rel_err(got, reference(x, w13, w2, tw, ids)) < BARS[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_situ(dtype):
    """Pre-activations of scale ~4 (up to ~15): tanh(g / 4) and tanh(u / 2) on both sides of the Taylor branch."""
    x, w13, w2, tw, ids = make(11, 6, 2, 32, 32, dtype, seed=5, scale=4.0)
    got = triton_moe(x, w13, w2, tw, ids, "situ", 4.0, 2.0)
    assert rel_err(got, reference(x, w13, w2, tw, ids, "situ", 4.0, 2.0)) < BARS[dtype]


@pytest.mark.parametrize("launch", [
    dict(BM=32, BN1=32, BK1=32, BN2=32, BK2=32),     # BK1 does not divide W = 48, BN1 not I = 40: masked tiles
    dict(BM=16, BN1=16, BK1=16, BN2=64, BK2=16),     # BN2 wider than W
    dict(BM=64, BN1=64, BK1=64, BN2=16, BK2=64),     # one block for every expert, BK2 wider than I
])
@pytest.mark.parametrize("tma", [True, False])
def test_triton_launch_shapes(launch, tma):
    """Masked and oversized tiles, with the weights through descriptors (the default) and through pointer loads
    (GPUs before Hopper, and layouts descriptors cannot describe)."""
    from kimi_linear.ops.triton.moe import MoELaunch

    x, w13, w2, tw, ids = make(20, 5, 3, 48, 40, torch.float32, seed=6)
    got = triton_moe(x, w13, w2, tw, ids, launch=MoELaunch(**launch, stages1=2, stages2=2, tma=tma))
    assert rel_err(got, reference(x, w13, w2, tw, ids)) < BARS[torch.float32]


def test_triton_strided_weights_and_int32_ids():
    """Weights stored transposed (the CPU layout of packed experts: longer dimension contiguous), int32 ids,
    float64 routing weights, rows of x apart in memory."""
    x, w13, w2, tw, ids = make(7, 4, 2, 32, 48, torch.float32, seed=7)
    w13_t = w13.transpose(1, 2).contiguous().transpose(1, 2)
    w2_t = w2.transpose(1, 2).contiguous().transpose(1, 2)
    x_nc = torch.cat([x, x], 1)[:, :32]
    assert torch.equal(x_nc, x) and x_nc.stride() == (64, 1)
    got = triton_moe(x_nc, w13_t, w2_t, tw.double(), ids.int())
    assert rel_err(got, reference(x, w13, w2, tw, ids)) < BARS[torch.float32]


def test_triton_strided_single_choice():
    """k = 1 ids and weights taken as columns of wider tensors (1-D views with a stride)."""
    x, w13, w2, tw, ids = make(9, 4, 1, 32, 32, torch.float32, seed=10)
    ids_col = torch.cat([ids, ids.flip(0)], 1)[:, :1]
    tw_col = torch.cat([tw, tw], 1)[:, :1]
    assert ids_col.stride() == (2, 1) and torch.equal(ids_col, ids)
    got = triton_moe(x, w13, w2, tw_col, ids_col)
    assert rel_err(got, reference(x, w13, w2, tw, ids)) < BARS[torch.float32]


def test_triton_ignores_out_of_range_ids():
    """A pair whose id is outside [0, E) is never computed and adds nothing (no out-of-bounds access)."""
    x, w13, w2, tw, ids = make(6, 4, 2, 32, 32, torch.float32, seed=8)
    bad = ids.clone()
    bad[1, 0], bad[4, 1] = -1, 4
    got = triton_moe(x, w13, w2, tw, bad)
    tw0 = tw.clone()
    tw0[1, 0], tw0[4, 1] = 0.0, 0.0
    assert rel_err(got, reference(x, w13, w2, tw0, ids)) < BARS[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_one_token_layout(dtype):
    """One token skips the sort (block j holds pair j): out-of-range ids (one equal to the shared expert's index)
    add nothing, a repeated id is computed twice, and the residual is added; on a second call the kept slot layout
    is reused."""
    from kimi_linear.ops.triton.moe import one_token_slots

    E, S = 6, 1
    x, w13, w2, tw, ids = make(1, E + S, 4, 32, 24, dtype, "random", seed=31)
    ids = torch.tensor([[2, E, -3, 2]])
    residual = torch.randn(1, 32, generator=torch.Generator().manual_seed(32)).to(dtype)
    tw0 = tw.clone()
    tw0[0, 1:3] = 0.0
    want = fused_moe(x.double(), w13.double(), w2.double(), tw0, ids.clamp(0, E - 1), num_shared=S,
                     residual=residual.double())
    for _ in range(2):
        got = triton_moe(x, w13, w2, tw, ids, num_shared=S, residual=residual)
        assert rel_err(got, want) < BARS[dtype]
    assert one_token_slots(5, 16, x.device) is one_token_slots(5, 16, x.device)


def test_triton_no_tokens():
    x, w13, w2, tw, ids = make(0, 4, 2, 32, 32)
    assert triton_moe(x, w13, w2, tw, ids).shape == (0, 32)


def test_public_op_dispatches_to_triton(monkeypatch):
    """On a CUDA tensor ``fused_moe`` runs the Triton function (here: forced on CPU tensors); float64 stays on the
    PyTorch path (the kernels compute in float32)."""
    import kimi_linear.ops.moe as moe_op

    calls = []

    def fake(*args, **kw):
        calls.append(args[-3])
        return triton_moe(*args, **kw)

    monkeypatch.setattr(moe_op, "triton_op", lambda name, x: fake if name == "fused_moe" else None)
    x, w13, w2, tw, ids = make(4, 4, 2, 32, 32, seed=9)
    got = fused_moe(x, w13, w2, tw, ids, activation="situ")
    assert calls == ["situ"] and rel_err(got, reference(x, w13, w2, tw, ids, "situ")) < BARS[torch.float32]
    fused_moe(x.double(), w13.double(), w2.double(), tw, ids)
    assert calls == ["situ"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N, E, k, S, mode", [(1, 8, 3, 1, "random"), (37, 4, 2, 1, "one"), (9, 6, 2, 2, "idle"),
                                              (5, 4, 4, 1, "random")])
def test_shared_experts(N, E, k, S, mode, dtype):
    """The last S stacked experts run on every token with weight 1: the PyTorch path equals the routed sum plus
    each shared expert (float64 loop), and the Triton kernels equal the PyTorch path; an out-of-range routed id
    equal to a shared expert's index must not alias it."""
    x, w13, w2, tw, ids = make(N, E + S, k, 32, 24, dtype, mode, seed=N + 7 * S)
    ids = ids % E
    want = naive_moe(x, w13, w2, tw, ids) + sum(
        naive_moe(x, w13, w2, torch.ones(N, 1), torch.full((N, 1), e)) for e in range(E, E + S))
    got_torch = fused_moe(x.double(), w13.double(), w2.double(), tw, ids, num_shared=S)
    assert rel_err(got_torch, want) < 1e-12
    got = triton_moe(x, w13, w2, tw, ids, num_shared=S)
    assert rel_err(got, want) < BARS[dtype]
    bad = ids.clone()
    bad[0, 0] = E                                               # the first shared expert's index: out of range here
    tw0 = tw.clone()
    tw0[0, 0] = 0.0
    assert rel_err(triton_moe(x, w13, w2, tw, bad, num_shared=S),
                   fused_moe(x.double(), w13.double(), w2.double(), tw0, ids, num_shared=S)) < BARS[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_folded_into_combine(dtype):
    """``residual`` is added to the float32 sum before the one rounding: the PyTorch path equals the routed sum
    plus the residual (float64 loop), the Triton kernels equal that within the dtype's bar, also for a residual
    whose rows are strided (a view into a wider tensor)."""
    x, w13, w2, tw, ids = make(7, 5, 2, 32, 24, dtype, "random", seed=21)
    wide = torch.randn(7, 48, generator=torch.Generator().manual_seed(22)).to(dtype)
    residual = wide[:, 8:40]                                              # [7, 32], row stride 48
    want = naive_moe(x, w13, w2, tw, ids) + residual.double()
    assert rel_err(fused_moe(x.double(), w13.double(), w2.double(), tw, ids, residual=residual.double()),
                   want) < 1e-12
    assert rel_err(triton_moe(x, w13, w2, tw, ids, residual=residual), want) < BARS[dtype]
    with pytest.raises(ValueError, match="residual must be"):
        fused_moe(x, w13, w2, tw, ids, residual=residual[:, :16])


def test_sigmoid_topk_triton_matches_torch():
    """The router's Triton kernel against the PyTorch path: same experts in the same order, weights to float32
    rounding; with and without renormalisation, k = 1 and k = E, E not a power of two, a strong bias."""
    from kimi_linear.ops.moe import sigmoid_topk_torch
    from kimi_linear.ops.triton.moe import sigmoid_topk as tri

    gen = torch.Generator().manual_seed(11)
    for N, E, k, renorm, scale in [(1, 32, 8, True, 2.5), (7, 12, 1, False, 1.0), (5, 6, 6, True, 1.0),
                                   (33, 256, 8, True, 2.446)]:
        logits = torch.randn(N, E, generator=gen) * 3
        bias = torch.randn(E, generator=gen) * 0.5
        w, i = tri(logits, bias, k, renorm, scale)
        w_ref, i_ref = sigmoid_topk_torch(logits, bias, k, renorm, scale)
        assert torch.equal(i, i_ref) and i.dtype == torch.int64
        assert torch.allclose(w, w_ref, rtol=1e-6, atol=0)


def test_sigmoid_topk_nan_ranks_first_as_torch():
    """A NaN logit is chosen first (torch.topk's order) and its row's weights come out NaN on both paths: never an
    out-of-range expert id that the fused MoE would drop without a trace."""
    from kimi_linear.ops.moe import sigmoid_topk_torch
    from kimi_linear.ops.triton.moe import sigmoid_topk as tri

    logits = torch.randn(2, 8, generator=torch.Generator().manual_seed(3))
    logits[0, 3] = float("nan")
    w, i = tri(logits, torch.zeros(8), 2, True, 1.0)
    w_ref, i_ref = sigmoid_topk_torch(logits, torch.zeros(8), 2, True, 1.0)
    assert torch.equal(i, i_ref) and i[0, 0] == 3 and bool(w[0].isnan().all()) and bool(w_ref[0].isnan().all())
    assert torch.allclose(w[1], w_ref[1], rtol=1e-6, atol=0)


def test_sigmoid_topk_dispatch_and_errors(monkeypatch):
    """The public op takes the Triton kernel only when no gradient is needed (here forced on CPU tensors), and
    names a bad argument."""
    import kimi_linear.ops.moe as moe_op
    from kimi_linear.ops import sigmoid_topk
    from kimi_linear.ops.triton.moe import sigmoid_topk as tri

    calls = []
    monkeypatch.setattr(moe_op, "triton_op", lambda name, x: (lambda *a: calls.append(1) or tri(*a))
                        if name == "sigmoid_topk" else None)
    logits, bias = torch.randn(3, 8), torch.zeros(8)
    sigmoid_topk(logits, bias, 2)
    assert calls == [1]
    w, _ = sigmoid_topk(logits.requires_grad_(), bias, 2)
    assert calls == [1] and w.requires_grad
    with pytest.raises(ValueError, match="bias"):
        sigmoid_topk(torch.randn(3, 8), torch.zeros(7), 2)
    with pytest.raises(ValueError, match="k must"):
        sigmoid_topk(torch.randn(3, 8), torch.zeros(8), 9)
    with pytest.raises(ValueError, match="logits"):
        sigmoid_topk(torch.randn(3, 8).half(), torch.zeros(8), 2)
    sigmoid_topk(torch.randn(3, 8).double(), torch.zeros(8), 2)           # float64: the PyTorch path
    assert calls == [1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_logits_triton(dtype, monkeypatch):
    """Router logits from a 16-bit or float32 x and float32 W: the Triton kernel against float64 (float32
    rounding of a 2304-term sum), every row the same bits alone as inside a batch (routing must not depend on the
    batch), D not a multiple of the kernel's step, E not a multiple of its expert block; the public op sends up
    to ROUTER_TRITON_MAX_TOKENS rows there, more rows and autograd to PyTorch, and names bad shapes."""
    import kimi_linear.ops.moe as moe_op
    from kimi_linear.ops import router_logits
    from kimi_linear.ops.triton.moe import router_logits as tri

    gen = torch.Generator().manual_seed(5)
    for N, E, D in [(1, 32, 2304), (13, 7, 300)]:
        x = torch.randn(N, D, generator=gen).to(dtype)
        w = torch.randn(E, D, generator=gen) / D**0.5
        got = tri(x, w)
        want = x.double() @ w.double().t()
        assert got.dtype == torch.float32 and (got.double() - want).abs().max() < 1e-5
        assert all(torch.equal(tri(x[n : n + 1], w)[0], got[n]) for n in range(N))
    calls = []
    monkeypatch.setattr(moe_op, "triton_op", lambda name, x: (lambda *a: calls.append(1) or tri(*a))
                        if name == "router_logits" else None)
    w = torch.randn(8, 64, generator=gen)
    router_logits(torch.randn(moe_op.ROUTER_TRITON_MAX_TOKENS, 64).to(dtype), w)
    router_logits(torch.randn(moe_op.ROUTER_TRITON_MAX_TOKENS + 1, 64).to(dtype), w)
    router_logits(torch.randn(2, 64).to(dtype), w.requires_grad_())
    assert calls == [1]
    with pytest.raises(ValueError, match="router_logits"):
        router_logits(torch.randn(2, 63), w)


def _args(**bad):
    x, w13, w2, tw, ids = make(3, 4, 2, 8, 6)
    args = dict(x=x, w13=w13, w2=w2, topk_weights=tw, topk_ids=ids)
    args.update(bad)
    return args


@pytest.mark.parametrize("bad, match", [
    (dict(x=torch.zeros(3, 8, 1)), "x must be"),
    (dict(x=torch.zeros(3, 8, dtype=torch.int64)), "x must be"),
    (dict(w13=torch.zeros(4, 12, 7)), "w13 must be"),
    (dict(w13=torch.zeros(4, 11, 8)), "w13 must be"),
    (dict(w2=torch.zeros(4, 8, 5)), "w2 must be"),
    (dict(w2=torch.zeros(4, 8, 6, dtype=torch.float64)), "w2 must have x's dtype"),
    (dict(topk_ids=torch.zeros(3, 2)), "topk_ids must be"),
    (dict(topk_ids=torch.zeros(2, 2, dtype=torch.int64)), "topk_ids must be"),
    (dict(topk_ids=torch.zeros(3, 5, dtype=torch.int64)), "1 <= k <= E"),
    (dict(topk_weights=torch.zeros(3, 3)), "topk_weights must be"),
    (dict(topk_weights=torch.zeros(3, 2, dtype=torch.int64)), "topk_weights must be"),
    (dict(activation="gelu"), "activation must be"),
    (dict(situ_beta=0.0), "situ_beta must be"),
    (dict(situ_linear_beta=-1.0), "situ_linear_beta must be"),
    (dict(num_shared=4), "num_shared must be"),
    (dict(num_shared=-1), "num_shared must be"),
    (dict(num_shared=3), "1 <= k <= E=1"),
])
def test_bad_inputs(bad, match):
    with pytest.raises(ValueError, match=match):
        fused_moe(**_args(**bad))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N, E, k, S, W, I, launch", [
    (1, 8, 3, 1, 64, 48, dict()),                                        # one-token layout, shared expert
    (37, 4, 2, 0, 48, 40, dict(BM=32, BN1=32, BK1=32, BN2=32, BK2=32)),  # tiles past W and I: rows of the next
    (20, 5, 3, 0, 48, 40, dict(BM=16, BN1=16, BK1=16, BN2=64, BK2=16)),  # expert / past the view, zero columns
])
def test_triton_weight_descriptors(N, E, k, S, W, I, launch, dtype, monkeypatch):
    """``MoELaunch(tma=True)`` (the default): the expert weights' tiles through TMA descriptors of their 2D views (the
    interpreter implements them), counted: the test fails if the kernels did not get descriptors. Tiles that
    reach past W read zeros, tiles past an expert's I rows read the next expert's rows (or zeros past the last),
    which only feed columns the stores leave out; same bars as the pointer loads, and a transposed weight layout
    falls back to them."""
    from kimi_linear.ops.triton import moe as tri_moe

    built = []
    real = tri_moe.weight_descriptors
    monkeypatch.setattr(tri_moe, "weight_descriptors", lambda *a: built.append(real(*a)) or built[-1])
    x, w13, w2, tw, ids = make(N, E + S, k, W, I, dtype, "random", seed=N + W)
    ids = ids % E
    cfg = tri_moe.MoELaunch(**launch, stages1=2, stages2=2, tma=True)
    shared = [torch.full((N, 1), e) for e in range(E, E + S)]
    want = naive_moe(x, w13, w2, tw, ids) + sum(naive_moe(x, w13, w2, torch.ones(N, 1), e) for e in shared)
    got = triton_moe(x, w13, w2, tw, ids, launch=cfg, num_shared=S)
    assert all(d is not None for d in built[-1])
    assert rel_err(got, want) < BARS[dtype]
    w13_t = w13.transpose(1, 2).contiguous().transpose(1, 2)
    got_t = triton_moe(x, w13_t, w2, tw, ids, launch=cfg, num_shared=S)
    assert built[-1][0] is None and rel_err(got_t, want) < BARS[dtype]


def test_prefetch_shares_cover_the_tensor_once():
    """Each router program's share of the tensor asked into L2: 16-byte pieces that cover [0, nbytes) exactly."""
    from kimi_linear.ops.triton.moe import prefetch_share

    for nbytes, programs in [(9_437_184, 16), (16, 16), (48, 5), (4_718_592, 7), (0, 3)]:
        share = prefetch_share(nbytes, programs)
        pieces = [(p * share, min((p + 1) * share, nbytes)) for p in range(programs) if p * share < nbytes]
        assert share % 16 == 0 and all((b - a) % 16 == 0 and b > a for a, b in pieces)
        assert sum(b - a for a, b in pieces) == nbytes and all(x[1] == y[0] for x, y in zip(pieces, pieces[1:]))


def test_moe_layer_prefetches_its_shared_expert(monkeypatch):
    """With the fused path (Triton under the interpreter) and the shared expert stacked last, the layer hands the
    router that expert's gate/up slab of the stack to ask into L2 (a hint: the output is the same without it);
    without a stacked shared expert, nothing."""
    import kimi_linear.ops.moe as moe_op
    import kimi_linear.ops.triton.moe as tri
    from kimi_linear.layers import SparseMoE

    seen = []

    def router(x, w, prefetch=None):
        seen.append(prefetch)
        return tri.router_logits(x, w, prefetch)

    fast = {"router_logits": router, "fused_moe": tri.fused_moe, "sigmoid_topk": tri.sigmoid_topk}
    monkeypatch.setattr(moe_op, "triton_op", lambda name, x: fast.get(name))
    torch.manual_seed(0)
    for shared in (1, 0):
        moe = SparseMoE(32, 16, 4, 2, num_shared_experts=shared).requires_grad_(False)
        for t in [*moe.parameters(), *moe.buffers()]:
            t.copy_(0.2 * torch.randn(t.shape))
        moe.pack()
        x = torch.randn(3, 32)
        seen.clear()
        out = moe(x)
        w13 = moe._packed_experts()[0]
        if shared:
            assert seen[-1] is not None and seen[-1].data_ptr() == w13[-1].data_ptr()
            assert seen[-1].shape == w13.shape[1:]
        else:
            assert seen[-1] is None
        monkeypatch.setattr(moe_op, "triton_op", lambda name, x: None)
        assert torch.allclose(out, moe(x), rtol=1e-4, atol=1e-5)
        monkeypatch.setattr(moe_op, "triton_op", lambda name, x: fast.get(name))
