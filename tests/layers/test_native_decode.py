"""The layers' CPU decode tokens through the C kernels (kimi_linear.ops.native) against the same layers in float64
(their PyTorch path), including strong decay, saturated gates, K3's bounded gate, several sequences, a carried
state and a serving pool's rows; and that the kernels really ran."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import kimi_linear.layers.kda as kda_module
import kimi_linear.layers.mla as mla_module
import kimi_linear.layers.mlp as mlp_module
import kimi_linear.layers.moe as moe_module
from kimi_linear.layers import KimiDeltaAttention, NoPEMLA, PagedLatentView, RMSNorm, SparseMoE, SwiGLUMLP
from kimi_linear.layers.kda import PooledKDAState

from ..ops.test_native import needs_cc
from .test_layers import moe_reference, randomize, rel_err

pytestmark = needs_cc


@pytest.fixture
def ran(monkeypatch):
    """Counts the calls in which each kernel wrapper ran (returned a result) instead of declining."""
    counts = {"kda": 0, "block": 0, "mla": 0, "moe": 0, "mlp": 0}

    def spy(module, name, key):
        inner = getattr(module, name)

        def wrapped(*args, **kwargs):
            out = inner(*args, **kwargs)
            counts[key] += out is not None
            return out

        monkeypatch.setattr(module, name, wrapped)

    spy(kda_module, "kda_decode", "kda")
    spy(kda_module, "kda_block_decode", "block")
    spy(mla_module, "mla_block_decode", "mla")
    spy(moe_module, "moe_decode", "moe")
    spy(mlp_module, "glu_mlp", "mlp")
    return counts


@torch.no_grad()
def set_gates(m: KimiDeltaAttention, regime: str, gen: torch.Generator) -> None:
    H, d = m.num_heads, m.head_dim
    m.A_log.copy_(torch.empty(H).uniform_(1.0, 16.0, generator=gen).log().view_as(m.A_log))
    if regime == "init":             # the layer's initialisation: softplus^-1 of U(1e-3, 0.1)
        dt = torch.empty(H * d).uniform_(math.log(1e-3), math.log(0.1), generator=gen).exp()
        m.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
    elif regime == "strong":         # per-step log decay ~ -exp(A_log) * 4: the memory is nearly wiped each step
        m.dt_bias.copy_(4.0 + torch.randn(H * d, generator=gen))
    elif regime == "saturated":      # raw gates of +-40: softplus past its linear threshold, sigmoid saturated
        m.f_b_proj.weight.mul_(300.0)
    elif regime == "slow":           # softplus's curved part above 1 with slow rates: the memory keeps ~70-97%
        m.A_log.copy_(torch.empty(H).uniform_(0.01, 0.1, generator=gen).log().view_as(m.A_log))
        m.dt_bias.copy_(torch.empty(H * d).uniform_(1.0, 4.0, generator=gen))


def kda_layer(regime: str, lower_bound: float | None = None, full_rank_gate: bool = False,
              hidden: int = 48) -> KimiDeltaAttention:
    m = KimiDeltaAttention(hidden, num_heads=3, head_dim=16, conv_size=4, gate_lower_bound=lower_bound,
                           full_rank_gate=full_rank_gate)
    m = randomize(m, seed=1).eval()
    set_gates(m, regime, torch.Generator().manual_seed(2))
    m.pack()
    return m


@pytest.mark.parametrize("regime,lower_bound,full_rank", [
    ("init", None, False), ("strong", None, False), ("saturated", None, False), ("slow", None, False),
    ("init", -5.0, True),
    ("saturated", -5.0, False),
])
@pytest.mark.parametrize("B,prefix", [(1, 0), (1, 37), (3, 5)])
def test_kda_decode_tokens_match_float64(ran, regime, lower_bound, full_rank, B, prefix):
    """A prefill of ``prefix`` tokens (none: decoding starts from the zero state), then 6 decode tokens, float32
    through the kernel against float64 through the PyTorch ops: outputs, conv windows and memories."""
    m = kda_layer(regime, lower_bound, full_rank)
    ref = copy.deepcopy(m).double()
    x = torch.randn(B, prefix + 6, 48, generator=torch.Generator().manual_seed(3))
    state, state64 = m.empty_state(B, torch.float32, x.device), ref.empty_state(B, torch.float64, x.device)
    with torch.no_grad():
        if prefix:
            m(x[:, :prefix], state), ref(x[:, :prefix].double(), state64)
        for t in range(prefix, prefix + 6):
            before = state.recurrent.clone()
            held = state.recurrent
            got, want = m(x[:, t : t + 1], state), ref(x[:, t : t + 1].double(), state64)
            assert torch.equal(held, before)         # the state given is not modified: a new one replaces it
            assert rel_err(got, want) < 2e-5, t
    assert ran["kda"] == 6
    assert rel_err(state.recurrent, state64.recurrent) < 2e-5
    assert rel_err(state.conv, state64.conv) < 1e-6


@pytest.mark.parametrize("rows,threads", [([4, 1], 2), ([4], 2), ([4], 1)])
def test_kda_decode_in_pool_rows_leaves_other_rows(ran, rows, threads, monkeypatch):
    """A serving pool: its rows ``rows`` updated in place; the others untouched, bit for bit. One sequence on two
    threads splits its heads between them (each head's channels of the window moved on in place); two sequences
    or one thread go sequence by sequence."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    m = kda_layer("init")
    ref = copy.deepcopy(m).double()
    pooled, state64, x = pool_and_reference(rows, seed=4)
    start = copy.deepcopy(pooled)
    with torch.no_grad():
        for t in range(3):
            got, want = m(x[:, t : t + 1], pooled), ref(x[:, t : t + 1].double(), state64)
            assert rel_err(got, want) < 2e-5
    assert ran["kda"] == 3
    check_pool(pooled, start, state64)


def pool_and_reference(rows: list[int], seed: int) -> tuple[PooledKDAState, kda_module.KDAState, torch.Tensor]:
    """A 6-row serving pool of random states for the 3-head layers here, the same rows ``rows`` as a float64
    state (memories float32), and 3 tokens of input per row."""
    gen = torch.Generator().manual_seed(seed)
    conv_pool, rec_pool = torch.randn(6, 3, 144, generator=gen), torch.randn(6, 3, 16, 16, generator=gen) * 0.3
    index = torch.tensor(rows)
    state64 = kda_module.KDAState(conv_pool[index].double(), rec_pool[index].clone())
    return PooledKDAState(conv_pool, rec_pool, index), state64, torch.randn(len(rows), 3, 48, generator=gen)


def check_pool(pooled: PooledKDAState, start: PooledKDAState, state64: kda_module.KDAState) -> None:
    """The pool's named rows hold the reference's states; the others are as they started, bit for bit."""
    others = [r for r in range(6) if r not in pooled.index.tolist()]
    assert torch.equal(pooled.rec_pool[others], start.rec_pool[others])
    assert torch.equal(pooled.conv_pool[others], start.conv_pool[others])
    assert rel_err(pooled.rec_pool[pooled.index], state64.recurrent) < 2e-5
    assert rel_err(pooled.conv_pool[pooled.index], state64.conv) < 1e-6


def test_kda_decode_declines_where_it_does_not_apply(ran):
    """16-bit and autograd keep the PyTorch ops (and still decode right)."""
    m = kda_layer("init")
    x = torch.randn(1, 1, 48)
    state = m.empty_state(1, torch.float32, x.device)
    m(x, state).sum().backward()                                      # gradients wanted
    b = copy.deepcopy(m).bfloat16()
    with torch.no_grad():
        b(x.bfloat16(), b.empty_state(1, torch.bfloat16, x.device))
    assert ran["kda"] == 0


def norms(hidden: int, seed: int) -> tuple[RMSNorm, RMSNorm]:
    """A decoder layer's input and post-attention norms with random weights (and eps far apart, so that the
    kernel's use of each shows)."""
    return randomize(RMSNorm(hidden, eps=1e-3), seed), randomize(RMSNorm(hidden, eps=0.05), seed + 1)


def block_tokens_against_float64(m, ref, state, state64, B: int, hidden: int, prefix: int, seed: int) -> None:
    """A ``prefix``-token prefill through layer m and its float64 copy ``ref`` (states ``state`` / ``state64``),
    then 6 tokens through ``m.decode_block`` with a decoder layer's two norms, against ``post(ref(in(x)),
    residual=x)`` in float64, and one token without the norms against ``ref(x)``."""
    in_norm, post_norm = norms(hidden, seed=seed)
    ref_in, ref_post = (copy.deepcopy(t).double() for t in (in_norm, post_norm))
    x = torch.randn(B, prefix + 7, hidden, generator=torch.Generator().manual_seed(seed + 2))
    with torch.no_grad():
        m(x[:, :prefix], state), ref(x[:, :prefix].double(), state64)
        for t in range(prefix, prefix + 6):
            xt = x[:, t : t + 1]
            out, normed = m.decode_block(xt, state, in_norm, post_norm)
            want_normed, want_out = ref_post(ref(ref_in(xt.double()), state64), residual=xt.double())
            assert rel_err(out, want_out) < 2e-5 and rel_err(normed, want_normed) < 2e-5, t
        out, normed = m.decode_block(x[:, -1:], state)
        assert normed is None and rel_err(out, ref(x[:, -1:].double(), state64)) < 2e-5


@pytest.mark.parametrize("regime,lower_bound,full_rank", [
    ("init", None, False), ("strong", None, False), ("saturated", None, False), ("slow", None, False),
    ("init", -5.0, True),
    ("saturated", -5.0, False),
])
@pytest.mark.parametrize("hidden,B,transposed", [(48, 1, False), (48, 3, True), (192, 2, False)])
def test_kda_block_decode_matches_float64(ran, regime, lower_bound, full_rank, hidden, B, transposed):
    """The whole attention half of a decoder layer in one call (input norm, projections, step, output projection,
    residual add and next norm) after a 5-token prefill, 6 tokens, float32 against the float64 PyTorch layer:
    both outputs, then one token without the norms, and the states. The packed projection is stored by columns
    at hidden 48 (179 rows > 48) and by rows at 192; ``transposed`` stores the gates' and output projections by
    columns too: every layout of the kernel's products."""
    m = kda_layer(regime, lower_bound, full_rank, hidden)
    if transposed:
        for lin in (m.f_b_proj, m.o_proj) + (() if full_rank else (m.g_b_proj,)):
            lin.weight.data = lin.weight.data.t().contiguous().t()
    ref = copy.deepcopy(m).double()
    state, state64 = m.empty_state(B, torch.float32, None), ref.empty_state(B, torch.float64, None)
    block_tokens_against_float64(m, ref, state, state64, B, hidden, prefix=5, seed=5)
    assert ran["block"] == 7 and ran["kda"] == 0
    assert rel_err(state.recurrent, state64.recurrent) < 2e-5
    assert rel_err(state.conv, state64.conv) < 1e-6


@pytest.mark.parametrize("rows,threads", [([4, 1], 2), ([4], 2), ([4], 1), ([4, 1, 0], 2)])
def test_kda_block_decode_in_pool_rows_leaves_other_rows(ran, rows, threads, monkeypatch):
    """A serving pool's rows updated in place by the whole-block call, the other rows untouched bit for bit; one
    sequence on two threads splits its heads, several go sequence by sequence."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    m = kda_layer("strong")
    in_norm, post_norm = norms(48, seed=7)
    ref, ref_in, ref_post = (copy.deepcopy(t).double() for t in (m, in_norm, post_norm))
    pooled, state64, x = pool_and_reference(rows, seed=8)
    start = copy.deepcopy(pooled)
    with torch.no_grad():
        for t in range(3):
            xt = x[:, t : t + 1]
            out, normed = m.decode_block(xt, pooled, in_norm, post_norm)
            want_normed, want_out = ref_post(ref(ref_in(xt.double()), state64), residual=xt.double())
            assert rel_err(out, want_out) < 2e-5 and rel_err(normed, want_normed) < 2e-5
    assert ran["block"] == 3
    check_pool(pooled, start, state64)
    bad = PooledKDAState(pooled.conv_pool, pooled.rec_pool, torch.tensor([1] * (len(rows) - 1) + [6]))
    before = pooled.rec_pool.clone()
    with torch.no_grad(), pytest.raises(IndexError, match="rows"):
        m.decode_block(x[:, :1], bad)
    assert torch.equal(pooled.rec_pool, before)


def test_kda_block_decode_declines_where_it_does_not_apply(ran):
    """More rows than MAX_BLOCK_ROWS, 16-bit, autograd, unpacked weights: None (the caller runs the layer), and
    the decoder layer's path then still decodes right."""
    from kimi_linear.ops.native.kda import MAX_BLOCK_ROWS

    m = kda_layer("init")
    B = MAX_BLOCK_ROWS + 1
    x = torch.randn(B, 1, 48)
    with torch.no_grad():
        assert m.decode_block(x, m.empty_state(B, torch.float32, x.device)) is None
        assert m.decode_block(x[:1].bfloat16(), copy.deepcopy(m).bfloat16().empty_state(1, torch.bfloat16,
                                                                                         x.device)) is None
        unpacked = kda_layer("init")
        unpacked._pack = None
        assert unpacked.decode_block(x[:1], unpacked.empty_state(1, torch.float32, x.device)) is None
    assert m.decode_block(x[:1], m.empty_state(1, torch.float32, x.device)) is None      # gradients wanted
    assert ran["block"] == 0


def mla_layer(hidden: int, transposed: bool = False, **options) -> NoPEMLA:
    """A small NoPE MLA layer (3 heads, latent 24, nope 8, rope 4, v 6), packed; its packed projection (64 rows)
    stored by columns when hidden < 64, else by rows; ``transposed``: kv_b_proj and o_proj stored by columns."""
    m = randomize(NoPEMLA(hidden, num_heads=3, kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4,
                          v_head_dim=6, **options), seed=21).eval()
    if transposed:
        for lin in (m.kv_b_proj, m.o_proj):
            lin.weight.data = lin.weight.data.t().contiguous().t()
    m.pack()
    return m


@pytest.mark.parametrize("hidden,B,transposed", [(48, 1, False), (48, 3, True), (96, 2, False), (96, 1, True)])
def test_mla_block_decode_matches_float64(ran, hidden, B, transposed):
    """An MLA layer's whole attention half in one call over a dense latent cache after a 10-token prefill, 6
    tokens with the decoder layer's norms and one without, float32 against the float64 PyTorch layer: outputs and
    the cached entries."""
    m = mla_layer(hidden, transposed)
    ref = copy.deepcopy(m).double()
    cache, cache64 = m.empty_cache(B, torch.float32, None), ref.empty_cache(B, torch.float64, None)
    block_tokens_against_float64(m, ref, cache, cache64, B, hidden, prefix=10, seed=22)
    assert ran["mla"] == 7 and cache.length == cache64.length == 17
    assert rel_err(cache.buf[:, :17], cache64.buf[:, :17]) < 2e-6


def test_mla_block_decode_over_a_paged_pool(ran):
    """A paged pool (shuffled blocks, unused slots NaN, int32 tables as the engine makes them): each new entry goes
    to its row's ``dst``, the attention reads through the block table, and the outputs match the float64 layer over
    a dense cache; rows of different lengths. A table naming a block outside the pool, a length past the table's
    reach or a destination outside the pool raise, naming the argument, before anything is written."""
    m = mla_layer(48)
    in_norm, post_norm = norms(48, seed=24)
    ref, ref_in, ref_post = (copy.deepcopy(t).double() for t in (m, in_norm, post_norm))
    x = torch.randn(2, 12, 48, generator=torch.Generator().manual_seed(25))
    bs, nb, P = 4, 4, 8
    pool = torch.full((P + 1, bs, m.cache_width), float("nan"))
    table = torch.randperm(P, generator=torch.Generator().manual_seed(26)).view(2, nb).int()
    starts = [7, 5]                                                     # row 1 is 2 tokens shorter
    with torch.no_grad():
        caches = []
        for b in range(2):
            c = ref.empty_cache(1, torch.float64, x.device)
            ref(x[b : b + 1, : starts[b]].double(), c)
            for j in range(starts[b]):
                pool[table[b, j // bs], j % bs] = c.buf[0, j].float()
            caches.append(c)
        for step in range(5):
            pos = torch.tensor([starts[0] + step, starts[1] + step])
            dst = table[torch.arange(2), pos // bs].long() * bs + pos % bs
            view = PagedLatentView(pool, table, (pos + 1).int(), dst)
            xt = x[torch.arange(2), pos][:, None]
            out, normed = m.decode_block(xt, view, in_norm, post_norm)
            for b in range(2):
                xb = xt[b : b + 1].double()
                want_normed, want_out = ref_post(ref(ref_in(xb), caches[b]), residual=xb)
                assert rel_err(out[b : b + 1], want_out) < 2e-5 and rel_err(normed[b : b + 1], want_normed) < 2e-5
                written = pool.view(-1, m.cache_width)[dst[b]]
                assert rel_err(written, caches[b].buf[0, pos[b]]) < 2e-6
    assert ran["mla"] == 5
    for bad_table, lens, where, what in ((table.clone().fill_(P + 1), pos + 1, dst, "block_table"),
                                         (table, torch.tensor([1, nb * bs + 1]), dst, "lengths"),
                                         (table, pos + 1, dst + pool.shape[0] * bs, "dst")):
        before = pool.clone()
        with torch.no_grad(), pytest.raises((IndexError, ValueError), match=what):
            m.decode_block(xt, PagedLatentView(pool, bad_table, lens.int(), where))
        assert torch.equal(pool.nan_to_num(), before.nan_to_num())                 # nothing written


def test_mla_block_decode_declines_where_it_does_not_apply(ran):
    """K3's output gate, a low-rank query, more rows than MAX_BLOCK_ROWS, 16-bit, autograd, a padding mask's
    dense cache in another dtype: None (the caller runs the layer), nothing appended to the cache."""
    from kimi_linear.ops.native.mla import MAX_BLOCK_ROWS

    B = MAX_BLOCK_ROWS + 1
    x = torch.randn(B, 1, 48)
    cases = [(mla_layer(48, output_gate=True), x[:1]), (mla_layer(48, q_lora_rank=16), x[:1]), (mla_layer(48), x)]
    with torch.no_grad():
        for m, xs in cases:
            cache = m.empty_cache(xs.shape[0], torch.float32, x.device)
            assert m.decode_block(xs, cache) is None and cache.length == 0
        half = copy.deepcopy(mla_layer(48)).bfloat16()
        assert half.decode_block(x[:1].bfloat16(), half.empty_cache(1, torch.bfloat16, x.device)) is None
    m = mla_layer(48)
    cache = m.empty_cache(1, torch.float32, x.device)
    assert m.decode_block(x[:1], cache) is None and cache.length == 0                   # gradients wanted
    assert ran["mla"] == 0


def moe_layer(hidden: int, inter: int, shared: int, renormalize: bool, seed: int) -> SparseMoE:
    m = randomize(SparseMoE(hidden, inter, num_experts=6, top_k=2, num_shared_experts=shared,
                            routed_scaling_factor=2.5, renormalize=renormalize), seed)
    with torch.no_grad():
        m.gate.e_score_correction_bias.copy_(torch.randn(6, generator=torch.Generator().manual_seed(seed)) * 0.3)
    return m.eval()


@pytest.mark.parametrize("hidden,inter", [(32, 16), (24, 16), (16, 24)])   # every layout pack() makes on a CPU
@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_decode_rows_match_float64(ran, hidden, inter, renormalize):
    """One token at a time and all 7 in one call (a decode batch: the kernel groups the 14 choices by expert, so
    experts run over several rows), with and without the residual."""
    m = moe_layer(hidden, inter, 1, renormalize, seed=9)
    m.pack()
    x = torch.randn(7, 1, hidden, generator=torch.Generator().manual_seed(10))
    residual = torch.randn(7, 1, hidden, generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        single = torch.cat([m(x[i]) for i in range(7)])
        batch = m(x)
        with_residual = m(x, residual=residual)
    assert ran["moe"] == 9
    want = moe_reference(m, x[:, 0])
    assert rel_err(single, want) < 2e-6 and rel_err(batch[:, 0], want) < 2e-6
    assert rel_err(with_residual[:, 0], want + residual[:, 0].double()) < 2e-6


def test_moe_decode_without_shared_expert_and_with_an_unstacked_one(ran):
    """No shared expert: the kernel runs the routed ones only. Two shared experts (a wider MLP, not stackable):
    the PyTorch path runs. Not packed: the PyTorch path runs. All three decode right."""
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(12))
    for shared, pack, runs in ((0, True, 5), (2, True, 0), (1, False, 0)):
        ran["moe"] = 0
        m = moe_layer(32, 16, shared, True, seed=13)
        if pack:
            m.pack()
        with torch.no_grad():
            got = torch.cat([m(x[i : i + 1]) for i in range(5)])
        assert ran["moe"] == runs, (shared, pack)
        assert rel_err(got, moe_reference(m, x)) < 2e-6, (shared, pack)


@pytest.mark.parametrize("hidden,inter", [(16, 24), (32, 8)])
@pytest.mark.parametrize("rows", [1, 3])
def test_dense_mlp_rows_match_float64(ran, hidden, inter, rows):
    m = randomize(SwiGLUMLP(hidden, inter), seed=14)
    m.pack()
    x = torch.randn(rows, 1, hidden, generator=torch.Generator().manual_seed(15))
    with torch.no_grad():
        got = m(x)
    assert ran["mlp"] == 1
    p = {n: t.double() for n, t in m.named_parameters()}
    xd = x.double()
    want = (F.silu(xd @ p["gate_proj.weight"].T) * (xd @ p["up_proj.weight"].T)) @ p["down_proj.weight"].T
    assert rel_err(got, want) < 2e-6


def test_large_row_counts_keep_the_pytorch_paths(ran, monkeypatch):
    """More rows than MAX_ROWS (a prompt), or than MAX_WORK allows for the experts' size, go through the
    per-expert products, and give the same result."""
    import kimi_linear.ops.native.moe as native_moe

    m = moe_layer(16, 8, 1, True, seed=17)
    m.pack()
    N = native_moe.MAX_ROWS
    x = torch.randn(N + 1, 16, generator=torch.Generator().manual_seed(18))
    with torch.no_grad():
        got = m(x)
        part = m(x[:N])
        assert ran["moe"] == 1
        monkeypatch.setattr(native_moe, "MAX_WORK", 4 * 8 * 16)
        assert rel_err(m(x[:5]), got[:5]) < 2e-6 and ran["moe"] == 1
        assert rel_err(m(x[:4]), got[:4]) < 2e-6 and ran["moe"] == 2
    assert rel_err(got, moe_reference(m, x)) < 2e-6 and rel_err(part, got[:N]) < 2e-6


def test_kda_decode_rejects_bad_rows_and_shapes():
    """Rows outside the pool raise before anything is written; a mis-shaped argument is named."""
    from kimi_linear.ops.native.kda import kda_decode

    gen = torch.Generator().manual_seed(16)
    H, D, W = 2, 8, 4
    C = 3 * H * D
    args = dict(qkv=torch.randn(2, 1, C, generator=gen), g=torch.randn(2, 1, H, D, generator=gen),
                gate=torch.randn(2, 1, H, D, generator=gen), beta=torch.randn(2, 1, H, generator=gen),
                conv_weight=torch.randn(W, C, generator=gen), window=torch.randn(3, W - 1, C, generator=gen),
                memory=torch.randn(3, H, D, D, generator=gen), A_log=torch.zeros(H), dt_bias=torch.zeros(H * D),
                lower_bound=None, norm_weight=torch.ones(D), norm_eps=1e-5, scale=D**-0.5)
    window, memory = args["window"].clone(), args["memory"].clone()
    for bad in ([0, 3], [-1, 1]):
        with pytest.raises(IndexError, match="rows"):
            kda_decode(**args, rows=torch.tensor(bad))
        assert torch.equal(args["window"], window) and torch.equal(args["memory"], memory)
    assert kda_decode(**args, rows=torch.tensor([2, 0])) is not None
    with pytest.raises(ValueError, match="`beta` must be"):
        kda_decode(**{**args, "beta": torch.randn(2, 1, H + 1)}, rows=torch.tensor([2, 0]))
    with pytest.raises(ValueError, match="one row per sequence"):
        kda_decode(**args)


def test_model_decode_steps_run_the_block_calls(ran, monkeypatch):
    """The tiny model's greedy `generate` on a CPU: every decode step's KDA and MLA layers go through their block
    calls (one sequence and three), and the tokens equal those of the PyTorch ops (C kernels off)."""
    from kimi_linear.model import KimiLinearForCausalLM
    from kimi_linear.model.config import preset_config

    model = KimiLinearForCausalLM(preset_config("tiny"))
    model.init_weights(0)
    model.eval().optimize_layout()
    kinds = [layer.is_kda for layer in model.model.layers]
    assert 0 < sum(kinds) < len(kinds)                                    # both kinds of layer
    ids = torch.randint(0, model.config.vocab_size, (3, 6), generator=torch.Generator().manual_seed(27))
    for rows in (1, 3):
        ran.update(block=0, mla=0)
        got = model.generate(ids[:rows], max_new_tokens=5, min_new_tokens=5)
        steps = 4                                                         # the decode steps after the prefill
        assert ran["block"] == steps * sum(kinds) and ran["mla"] == steps * (len(kinds) - sum(kinds))
        monkeypatch.setenv("KIMI_LINEAR_NATIVE", "0")
        assert torch.equal(got, model.generate(ids[:rows], max_new_tokens=5, min_new_tokens=5))
        monkeypatch.delenv("KIMI_LINEAR_NATIVE")
