"""Triton chunk_kda gradients under the interpreter (CPU) against the float64 reference.

The pipeline forward's backward is Triton (chunk_bwd.py, after recomputing the forward's pieces); the PyTorch
recompute stays as the fallback (``KIMI_LINEAR_CHUNK_BWD=torch``). Every buffer the kernels allocate is NaN-poisoned.
The loss weighs the output and the final state with fixed random cotangents, so the final state's gradient (dht)
flows in too. Bars: float32 1e-4 (A_log's gradient is a sum over every token and channel), bf16 2e-2.
"""

import pytest
import torch

pytest.importorskip("triton")

from kimi_linear.ops.gate import KernelOptions  # noqa: E402
from kimi_linear.ops.triton import chunk as triton_chunk  # noqa: E402
from kimi_linear.ops.triton import chunk_kda  # noqa: E402

from .kda_cases import loss_weights, make_inputs, rel_err  # noqa: E402
from .triton_cases import (  # noqa: E402, F401  (poison_empty: autouse fixture)
    force_levels,
    mixed_gates,
    poison_empty,
    reference_grads,
    spy_calls,
    stepped_gates,
    strong_gate,
)

NO_OPTIONS = KernelOptions()


def gate_opts(HV, K, lower_bound=None, neg_eigval=False, seed=0, dt_bias=True):
    gen = torch.Generator().manual_seed(seed)
    params = dict(A_log=torch.randn(HV, generator=gen), dt_bias=torch.randn(HV * K, generator=gen) if dt_bias else None)
    return KernelOptions(True, True, True, neg_eigval, params["A_log"], params["dt_bias"], lower_bound), params


def check(x, opts=NO_OPTIONS, params=None, bar=1e-4, cu_seqlens=None, final_state=True, only=None, bars=None):
    """Triton gradients vs the float64 reference for every tensor (or only those named in ``only``); ``bars``:
    tighter bars for some of them, by name."""
    names = [n for n, t in dict(x, **(params or {})).items() if t is not None and (only is None or n in only)]
    leaves = {n: (None if t is None else t.detach().clone().requires_grad_(n in names))
              for n, t in dict(x, **(params or {})).items()}
    kw = opts.kwargs()
    if params:
        kw.update(A_log=leaves["A_log"], dt_bias=leaves.get("dt_bias"))
    o, S = chunk_kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                     initial_state=leaves["initial_state"], output_final_state=final_state, cu_seqlens=cu_seqlens,
                     **kw)
    B, T, HV, V = o.shape
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    w = (loss_weights(o.shape), loss_weights((N, HV, x["q"].shape[-1], V), 2) * (1.0 if final_state else 0.0))
    loss = (o.double() * w[0]).sum()
    if final_state:
        loss = loss + (S.double() * w[1]).sum()
    loss.backward()
    ref = reference_grads(x, opts, w, cu_seqlens, params)
    for n in leaves:
        if n not in names:
            assert leaves[n] is None or leaves[n].grad is None, n
            continue
        got = leaves[n].grad
        assert got.dtype == leaves[n].dtype and got.shape == leaves[n].shape, n
        if ref[n].norm() == 0:
            # Exactly zero in exact arithmetic (a gate of -1000 erases the dependence): what is left is float32
            # residue of terms that cancel (a row's and a column's share of the same exponent).
            assert got.norm() < 1e-6, (n, got.norm())
            continue
        assert rel_err(got, ref[n]) < (bars or {}).get(n, bar), (n, rel_err(got, ref[n]))


def test_float32_gva_initial_state():
    check(make_inputs(B=2, T=40, H=1, HV=2, K=32, V=16, seed=41))


@pytest.mark.parametrize("gate", ["softplus", "lower_bound"])
def test_in_kernel_options_bf16(gate):
    """Gradients through l2norm, the gate formula (into A_log and dt_bias; the lower_bound gate without dt_bias)
    and the beta sigmoid (2 sigmoid with the softplus gate); GVA."""
    x = make_inputs(B=1, T=70, H=1, HV=2, K=32, V=32, raw=True, dtype=torch.bfloat16, seed=42)
    lb = gate == "lower_bound"
    opts, params = gate_opts(2, 32, -5.0 if lb else None, neg_eigval=not lb, dt_bias=not lb)
    check(x, opts, params, bar=2e-2)


def test_in_kernel_options_float32_storage():
    """bf16 inputs with float32 intermediates (``LaunchConfig(store="float32")``) through the autograd Function."""
    from kimi_linear.ops.triton.chunk import ChunkKDAFunction
    from kimi_linear.ops.triton.chunk_pipeline import LaunchConfig

    x = make_inputs(B=1, T=40, H=1, HV=2, K=32, V=16, raw=True, dtype=torch.bfloat16, seed=43)
    opts, params = gate_opts(2, 32)
    leaves = {n: t.detach().clone().requires_grad_() for n, t in dict(x, **params).items()}
    opts_l = KernelOptions(True, True, True, False, leaves["A_log"], leaves["dt_bias"], None)
    o, S = ChunkKDAFunction.apply(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                                  leaves["initial_state"], leaves["A_log"], leaves["dt_bias"], 32 ** -0.5, True,
                                  opts_l, None, LaunchConfig(store="float32"))
    w = (loss_weights(o.shape), loss_weights(S.shape, 2))
    ((o.double() * w[0]).sum() + (S.double() * w[1]).sum()).backward()
    ref = reference_grads(x, opts, w, None, params)
    for n, t in leaves.items():
        assert rel_err(t.grad, ref[n]) < 2e-2, n


@pytest.mark.parametrize("T", [1, 130])
def test_extreme_gates(T):
    """Gates of -1000 (the first step and every 7th) and exactly 0: finite, float32-accurate gradients (the
    initial state's is exactly zero at the first -1000 step)."""
    x = make_inputs(B=1, T=T, H=1, K=32, V=16, strong_decay=True, seed=44)
    x["g"][:, 0] = -1000.0
    check(x)


def test_varlen_empty_and_length_one_sequences_bf16():
    cu = torch.tensor([0, 1, 1, 70, 71, 90])
    check(make_inputs(B=1, T=90, H=1, K=32, V=16, N=5, dtype=torch.bfloat16, seed=45), bar=2e-2,
          cu_seqlens=cu)


def test_no_initial_state_no_final_state_odd_widths_some_inputs():
    """K, V not powers of two; no initial state; output only (no dht); gradients asked for q and g only."""
    x = make_inputs(B=2, T=20, K=24, V=20, seed=46, initial_state=False)
    check(x, final_state=False, only=("q", "g"))


def test_pytorch_recompute_fallback(monkeypatch):
    monkeypatch.setenv("KIMI_LINEAR_CHUNK_BWD", "torch")
    x = make_inputs(B=1, T=40, H=1, HV=2, K=32, V=16, raw=True, seed=47)
    opts, params = gate_opts(2, 32)
    check(x, opts, params)


@pytest.mark.parametrize("case", ["float32 GVA", "mixed paths float32", "bf16 options", "extreme gates",
                                  "varlen bf16", "lopsided float32"])
def test_score_gradient_paths(case):
    """The score gradients of separable chunks by one program per chunk, the others by sub-block. "mixed paths":
    one value head decays by about 3 a step (not separable), the other by about 0.5; "lopsided": steep in one half
    of each chunk, gentle in the other (test_triton_chunk.lopsided_gates)."""
    from .test_triton_chunk import lopsided_gates

    if case == "float32 GVA":
        check(make_inputs(B=2, T=40, H=1, HV=2, K=32, V=16, seed=48))
    elif case == "mixed paths float32":
        x = make_inputs(B=1, T=130, H=1, HV=2, K=32, V=16, seed=49)
        g = torch.randn(1, 130, 32, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        x["g"][:, :, 0] = (-3.0 + 0.1 * g).float()
        check(x)
    elif case == "bf16 options":
        x = make_inputs(B=1, T=70, H=1, HV=2, K=32, V=32, raw=True, dtype=torch.bfloat16, seed=42)
        opts, params = gate_opts(2, 32)
        check(x, opts, params, bar=2e-2)
    elif case == "extreme gates":
        x = make_inputs(B=1, T=130, H=1, K=32, V=16, strong_decay=True, seed=51)
        check(x)
    elif case == "lopsided float32":
        check(lopsided_gates(make_inputs(B=1, T=130, H=1, HV=2, K=32, V=16, seed=53), 130))
    else:
        check(make_inputs(B=1, T=90, H=1, K=32, V=16, N=5, dtype=torch.bfloat16, seed=52), bar=2e-2,
              cu_seqlens=torch.tensor([0, 1, 1, 70, 71, 90]))


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("case", ["bf16 options", "varlen float32"])
def test_kept_and_recomputed_scores(case, keep, monkeypatch):
    """``LaunchConfig(keep_scores=...)``: the backward from the forward's kept Aqk, Akk, inverse, l2norm factors and
    gate sums (the default), or recomputing them; both against the reference, and the kept tensors are really
    saved."""
    import kimi_linear.ops.triton.chunk as tri_chunk
    from kimi_linear.ops.triton.chunk_pipeline import LaunchConfig

    monkeypatch.setattr(tri_chunk, "DEFAULT_CONFIG", LaunchConfig(keep_scores=keep))
    if case == "bf16 options":
        x = make_inputs(B=1, T=70, H=1, HV=2, K=32, V=32, raw=True, dtype=torch.bfloat16, seed=54)
        opts, params = gate_opts(2, 32)
        check(x, opts, params, bar=2e-2)
        leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items() if t is not None}
        o, _ = chunk_kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                         initial_state=leaves["initial_state"], **opts.kwargs())
        saved = [t for t in o.grad_fn.saved_tensors if t is not None]
        # q k v g beta h0 A_log dt_bias (+ Aqk Akk Tm rq rk gP when kept)
        assert len(saved) == (14 if keep else 8)
    else:
        check(make_inputs(B=1, T=90, H=1, K=32, V=16, N=5, seed=55), cu_seqlens=torch.tensor([0, 1, 1, 70, 71, 90]))


@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 3])
def test_wide_state_scans(stages, monkeypatch):
    """The state scans 64 value columns wide (the H200 default for many sequences, ``h_bv=0`` picks it there; the
    small shapes of these tests would pick 32) with either pipelining depth, forward and backward."""
    import kimi_linear.ops.triton.chunk as tri_chunk
    from kimi_linear.ops.triton.chunk_pipeline import LaunchConfig

    monkeypatch.setattr(tri_chunk, "DEFAULT_CONFIG", LaunchConfig(h_bv=64, h_stages=stages, h_out_stages=stages))
    check(make_inputs(B=2, T=70, H=1, HV=2, K=32, V=64, seed=56))


@pytest.mark.slow
def test_two_column_blocks(monkeypatch):
    """Every blocked kernel with two column blocks (K = V = 64, 32 wide), whose programs chunk_common.grid_coords
    interleaves with the heads' (GVA) in one grid; varlen; forward and backward."""
    import kimi_linear.ops.triton.chunk as tri_chunk
    from kimi_linear.ops.triton.chunk_pipeline import LaunchConfig

    cfg = LaunchConfig(bwd_bk=32, bwd_intra_bk=32, h_bv=32)
    monkeypatch.setattr(tri_chunk, "DEFAULT_CONFIG", cfg)
    check(make_inputs(B=1, T=90, H=1, HV=2, K=64, V=64, N=3, seed=57), cu_seqlens=torch.tensor([0, 20, 70, 90]))


@pytest.mark.parametrize("neg_eigval", [False, True])
def test_beta_logits_reach_the_kernels_as_torch_sigmoid(neg_eigval, monkeypatch):
    """use_beta_sigmoid_in_kernel: the kernels get ``torch.sigmoid(beta.float())`` (times 2 with negative
    eigenvalues), computed once, so the outputs and every gradient are bit for bit those of a caller that applies
    the sigmoid itself, as fla's test_chunk_use_beta_sigmoid_in_kernel requires at 1e-4. (Recomputed inside the
    kernels, Triton's sigmoid differs from torch's in the last bits: here numpy's, on the GPU approximate exp and
    division; on the H200 that moved the bf16 results past 1e-4 at T=8192.)"""
    x = make_inputs(B=1, T=70, H=1, HV=2, K=32, V=16, dtype=torch.bfloat16, seed=41)
    logits = torch.randn(1, 70, 2, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    do = torch.randn(1, 70, 2, 16, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    dht = torch.randn(1, 2, 32, 16, generator=torch.Generator().manual_seed(4))

    def run(in_kernel: bool):
        leaves = [t.detach().clone().requires_grad_(True) for t in (x["q"], x["k"], x["v"], x["g"], logits,
                                                                     x["initial_state"])]
        q, k, v, g, b, h0 = leaves
        if in_kernel:
            o, S = chunk_kda(q, k, v, g, b, initial_state=h0, output_final_state=True,
                             use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg_eigval)
        else:
            beta = torch.sigmoid(b.float()) * (2 if neg_eigval else 1)
            o, S = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        ((o * do).sum() + (S * dht).sum()).backward()
        return [o, S] + [t.grad for t in leaves]

    seen = []
    apply = triton_chunk.ChunkKDAFunction.apply
    monkeypatch.setattr(triton_chunk.ChunkKDAFunction, "apply", lambda *a: seen.append(a) or apply(*a))
    for got, want in zip(run(True), run(False)):
        assert got.dtype == want.dtype and torch.equal(got, want)
    beta, opts = seen[0][4], seen[0][10]      # what the kernels were given on the in-kernel call
    assert not opts.use_beta_sigmoid_in_kernel and not opts.allow_neg_eigval
    assert beta.dtype == torch.float32 and torch.equal(beta, torch.sigmoid(logits.float()) * (2 if neg_eigval else 1))


def test_float16_gate_parameter_gradients_masked_gates():
    """float16 inputs, 90% of raw gates at -1000 (no decay there), two packed sequences: the gate parameters'
    gradients are sums over every token of dG's reverse cumulative sums, so the score-gradient products must not be
    rounded to the inputs' own 10 bits (tf32): with tf32 they were 7.4e-3 (dt_bias) and 8.1e-3 (A_log) off the
    float64 reference, with tf32x3 4.8e-4 and 1.6e-4 (fla's test_chunk_varlen: 6.3e-3 against a 5e-3 bar on the
    H200 with tf32)."""
    x = make_inputs(B=1, T=256, H=2, K=64, V=32, N=2, dtype=torch.float16, raw=True, seed=60)
    gen = torch.Generator().manual_seed(61)
    x["g"] = torch.where(torch.rand(x["g"].shape, generator=gen) > 0.9, x["g"], torch.full_like(x["g"], -1000.0))
    params = dict(A_log=torch.empty(2).uniform_(1, 16, generator=gen).log(), dt_bias=torch.randn(128, generator=gen))
    opts = KernelOptions(True, True, False, False, params["A_log"], params["dt_bias"], None)
    check(x, opts, params, bar=2e-3, cu_seqlens=torch.tensor([0, 85, 256]), only=("A_log", "dt_bias", "g"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["softplus A_log~log U(1,16)", "mixed channels varlen", "-1000 padding"])
def test_strong_decay_gradients(case, dtype, monkeypatch):
    """Gradients of every input (dq, dk, dv, dbeta, dg, the initial state; dA_log and ddt_bias through the
    in-kernel softplus gate with A_log = log U(1, 16), about -6.7 a step) in the strong-decay regime of issue 20,
    where the diagonal blocks' score gradients must take the reference-row levels (chunk_bwd.diagonal_level_grads)
    for float32 inputs and the clamped gate steps (chunk_bwd.clamped_diagonal_grads) for bf16 (counted). Mild and
    strong channels and -1000 steps in the same chunks, packed sequences of 70 and 130 tokens
    and an empty one; -1000 on every 7th step and 0 on every 5th. Float32 bar 1e-4, bf16 2e-2 (the file's), and
    6e-3 for bf16 dA_log and ddt_bias: they sum dG over every token, weighted by gates of about -6.7, so the
    diagonal blocks' row and column shares of dG must cancel pair by pair (chunk_bwd.diagonal_level_grads forms
    them from the same rounded operands). Taken as q dq + k (dk_rows - dk_cols) from the tf32 products, they were
    1.3e-2 and 6.8e-3 off here; 2.1e-3 and 3.4e-3 as they are."""
    from kimi_linear.ops.triton import chunk_bwd

    calls = spy_calls(monkeypatch, chunk_bwd,
                      "diagonal_level_grads" if dtype == torch.float32 else "clamped_diagonal_grads")
    bar = 1e-4 if dtype == torch.float32 else 2e-2
    if case.startswith("softplus"):
        opts, params = strong_gate(2, 32, seed=71)
        check(make_inputs(B=1, T=130, H=1, HV=2, K=32, V=16, raw=True, dtype=dtype, seed=70), opts, params, bar=bar,
              bars=dict(A_log=6e-3, dt_bias=6e-3) if dtype == torch.bfloat16 else None)
    elif case == "mixed channels varlen":
        x = mixed_gates(make_inputs(B=1, T=200, H=1, K=64, V=16, N=3, dtype=dtype, seed=72), seed=73)
        check(x, bar=bar, cu_seqlens=torch.tensor([0, 70, 70, 200]))
    else:
        check(make_inputs(B=1, T=130, H=1, HV=2, K=32, V=16, strong_decay=True, dtype=dtype, seed=74), bar=bar)
    assert calls, "the strong path was not taken"


@pytest.mark.parametrize("fall", [20.5, 19.5])
def test_banded_score_gradients(fall, monkeypatch):
    """bf16 chunks whose every channel falls by ``fall`` over each 16-row sub-block (20.5: past BAND_LIMIT, so the
    score gradients of their sub-blocks go against the neighbouring sub-blocks only, chunk_bwd.band_grads, counted;
    19.5: short of it, against every earlier column and later row) beside channels falling by about 200 a
    sub-block (so no chunk is bounded per sub-block) and -1000 steps, GVA, an initial state, packed sequences of 144
    and 112 tokens (the second's last chunk of 48 rows banded too). Every gradient against the float64 reference
    at the file's bf16 bar."""
    from kimi_linear.ops.triton import chunk_bwd

    band = spy_calls(monkeypatch, chunk_bwd, "band_grads")
    sub_blocks = spy_calls(monkeypatch, chunk_bwd, "sub_block_grads")
    T, K = 256, 32
    x = make_inputs(B=1, T=T, H=1, HV=2, K=K, V=16, N=2, dtype=torch.bfloat16, seed=84)
    u = torch.rand(T, 2, K, generator=torch.Generator().manual_seed(85), dtype=torch.float64)
    blocks = u.reshape(-1, 16, 2, K)                     # 16-row sub-blocks of the packed rows
    mild = (-fall * blocks / blocks.sum(1, keepdim=True)).reshape(T, 2, K)
    steps = torch.where(torch.arange(K) % 2 == 0, mild, -12.5 * (0.5 + u))
    steps[::11, :, 1::4] = -1000.0
    x["g"] = steps[None].to(torch.bfloat16)
    check(x, bar=2e-2, cu_seqlens=torch.tensor([0, 144, 256]))
    # chunks: 144 tokens -> 3 (the last of 16 rows), 112 -> 2 (the last of 48); 2 value heads, 4 sub-blocks each.
    # Banded: all but the one of 16 rows, whose sub-blocks 1 and 2 lie past its end
    assert len(sub_blocks) == 2 * 4 * (3 + 2), len(sub_blocks)
    banded = 2 * 4 * (2 + 2) if fall > 20 else 0
    assert len(band) == banded, (len(band), banded)


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_score_gradients_by_halves(dtype, varlen, monkeypatch):
    """K3's bounded gate near saturation (in-kernel ``lower_bound = -5`` with dt_bias ~ 1.5: about -3.9 a step): no
    full chunk is separable (a 32-row half falls by ~125), every 16-row sub-block falls by less than 80 (the
    bound), so in bf16 the score gradients of the full chunks take chunk_bwd.halves_grads (counted) and never the
    sub-block scheme (float32 inputs keep the sub-block scheme, as their forward does); length 200 (the partial
    last chunk is separable), GVA, initial state; or the same 200 tokens as sequences of 70 and 130 (again three
    full chunks, listed through the varlen chunk indices). Every gradient, dA_log and ddt_bias included, against the
    float64 reference at the file's bars. (This input's A_log gradient is small beside its terms, so its relative
    error is the largest of the file's bf16 cases: 1.9e-2 here, 2.3e-2 by the sub-block scheme; with float32
    intermediates, LaunchConfig(store="float32"), 9.9e-3.)"""
    from kimi_linear.ops.triton import chunk_bwd

    halves = spy_calls(monkeypatch, chunk_bwd, "halves_grads")
    sub_blocks = spy_calls(monkeypatch, chunk_bwd, "sub_block_grads")
    x = make_inputs(B=1, T=200, H=1, HV=2, K=32, V=16, N=2 if varlen else None, raw=True, dtype=dtype, seed=80)
    gen = torch.Generator().manual_seed(81)
    params = dict(A_log=0.1 * torch.randn(2, generator=gen), dt_bias=1.5 + 0.3 * torch.randn(64, generator=gen))
    opts = KernelOptions(True, True, True, False, params["A_log"], params["dt_bias"], -5.0)
    check(x, opts, params, bar=1e-4 if dtype == torch.float32 else 2e-2,
          cu_seqlens=torch.tensor([0, 70, 200]) if varlen else None)
    if dtype == torch.bfloat16:
        assert len(halves) == 3 * 2, halves        # three full chunks, two value heads, one key block
        assert not sub_blocks
    else:
        assert sub_blocks and not halves


def test_score_gradients_of_every_chunk_kind_in_one_call(monkeypatch):
    """bf16, three value heads whose gates fall by about 0.5, 3 and 6 a step (separable; bounded per sub-block, so
    by halves; neither, so by sub-blocks) over sequences of 70 and 130 tokens: the list kernel files the bounded
    chunks at the front of one list and the others at its back, and each persistent launch must take exactly its
    own end (three full chunks each: one halves call per chunk, four sub-block calls per chunk). Every gradient
    against the float64 reference at the file's bf16 bar."""
    from kimi_linear.ops.triton import chunk_bwd

    halves = spy_calls(monkeypatch, chunk_bwd, "halves_grads")
    sub_blocks = spy_calls(monkeypatch, chunk_bwd, "sub_block_grads")
    x = stepped_gates(make_inputs(B=1, T=200, H=1, HV=3, K=32, V=16, N=2, dtype=torch.bfloat16, seed=82),
                      (-0.5, -3.0, -6.0), seed=83)
    check(x, bar=2e-2, cu_seqlens=torch.tensor([0, 70, 200]))
    assert len(halves) == 3, halves
    assert len(sub_blocks) == 3 * 4, sub_blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_row_level_gradients_on_every_diagonal_block(dtype, monkeypatch):
    """The score gradients' reference-row levels on every diagonal block of the sub-block scheme, mild channels
    included (chunk_common.SAFE_EXP forced to -1, forward too), so that every pair of a block carries weight: the
    in-kernel softplus gate with exp(A_log) in [3, 5] decays by about 3 a step (not separable over 32 rows, about
    50 per sub-block: the fast product's regime). dA_log and ddt_bias collect dG over every token, so the diagonal
    blocks' row and column shares of dG must cancel pair by pair. bf16 inputs take the clamped gate steps there
    (chunk_bwd.clamped_diagonal_grads), float32 the levels (chunk_bwd.diagonal_level_grads)."""
    from kimi_linear.ops.triton import chunk_bwd

    force_levels(monkeypatch)
    calls = spy_calls(monkeypatch, chunk_bwd,
                      "diagonal_level_grads" if dtype == torch.float32 else "clamped_diagonal_grads")
    x = make_inputs(B=1, T=130, H=1, HV=2, K=32, V=16, raw=True, dtype=dtype, seed=75)
    gen = torch.Generator().manual_seed(76)
    params = dict(A_log=torch.empty(2).uniform_(3, 5, generator=gen).log(),
                  dt_bias=0.1 * torch.randn(64, generator=gen))
    opts = KernelOptions(True, True, True, False, params["A_log"], params["dt_bias"], None)
    check(x, opts, params, bar=1e-4 if dtype == torch.float32 else 2e-2)
    assert calls


class LaunchCounter:
    """Stands in for a Triton kernel in a module's globals and counts its launches (``kernel[grid](...)``)."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize("case", ["bf16 options", "varlen float32"])
def test_disable_recompute_keeps_the_factors(case, monkeypatch):
    """fla's ``disable_recompute=True`` (``LaunchConfig.keep_factors``): the forward keeps its WY factors (five
    more saved tensors), the backward launches no WY kernel (and, the gate sums kept either way, no prepare
    kernel), and every
    gradient has the same bits as with the recomputation (under the interpreter; on the GPU the WY kernel's forward
    and recompute variants are compiled apart and may round differently in the last bit)."""
    from kimi_linear.ops.triton import chunk_pipeline

    counters = {n: LaunchCounter(getattr(chunk_pipeline, n))
                for n in ("chunk_kda_prepare_kernel", "chunk_kda_fwd_wy_kernel")}
    for n, c in counters.items():
        monkeypatch.setattr(chunk_pipeline, n, c)
    if case == "bf16 options":
        x = make_inputs(B=1, T=70, H=1, HV=2, K=32, V=32, raw=True, dtype=torch.bfloat16, seed=97)
        opts, params = gate_opts(2, 32)
        cu = None
    else:
        x, opts, params = make_inputs(B=1, T=90, H=1, K=32, V=16, N=5, seed=98), NO_OPTIONS, {}
        cu = torch.tensor([0, 1, 1, 70, 71, 90])

    def grads(disable_recompute: bool):
        leaves = {n: t.detach().clone().requires_grad_() for n, t in dict(x, **params).items() if t is not None}
        kw = dict(opts.kwargs(), **{n: leaves[n] for n in params})
        o, S = chunk_kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                         initial_state=leaves["initial_state"], output_final_state=True, cu_seqlens=cu,
                         disable_recompute=disable_recompute, **kw)
        saved = [t for t in o.grad_fn.saved_tensors if t is not None]
        for c in counters.values():
            c.launches = 0
        w = (loss_weights(o.shape), loss_weights(S.shape, 2))
        ((o.float() * w[0]).sum() + (S * w[1]).sum()).backward()
        launches = {n: c.launches for n, c in counters.items()}
        return [o, S] + [leaves[n].grad for n in sorted(leaves)], len(saved), launches

    got, n_got, launches_got = grads(True)
    want, n_want, launches_want = grads(False)
    assert n_got == n_want + 5
    assert launches_got == {"chunk_kda_prepare_kernel": 0, "chunk_kda_fwd_wy_kernel": 0}
    assert launches_want == {"chunk_kda_prepare_kernel": 0, "chunk_kda_fwd_wy_kernel": 1}
    for a, b in zip(got, want):
        assert torch.equal(a, b)
