"""Triton chunk_kda forward under the interpreter (CPU) against the float64 reference.

The forward is the kernel pipeline (chunk_pipeline.py). Outputs and every intermediate buffer are poisoned with NaN
before each run: an element the kernels forget to write (or read before writing) fails the comparison. Under the
interpreter the kernels round bf16 stores to nearest even and drop tf32's low mantissa bits as the GPU does
(chunk_common.py), so the bf16 errors here are the GPU's, give or take accumulation order.
"""

import pytest
import torch

pytest.importorskip("triton")

from kimi_linear.ops.gate import KernelOptions  # noqa: E402
from kimi_linear.ops.triton import chunk_kda  # noqa: E402
from kimi_linear.ops.triton.chunk import chunk_kda_fwd  # noqa: E402
from kimi_linear.ops.triton.chunk_pipeline import LaunchConfig  # noqa: E402

from .kda_cases import make_inputs, rel_err  # noqa: E402
from .triton_cases import (  # noqa: E402, F401  (poison_empty: autouse fixture)
    force_levels,
    mixed_gates,
    poison_empty,
    reference,
    spy_calls,
    spy_tiles,
    stepped_gates,
    strong_gate,
)

NO_OPTIONS = KernelOptions()


def run(x, opts=NO_OPTIONS, **kw):
    return chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                     output_final_state=True, **opts.kwargs(), **kw)


def tol(dtype):
    return 1e-5 if dtype == torch.float32 else 5e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_reference_gva_initial_state(dtype):
    """float16 inputs keep float32 intermediates (their range is too small for the states)."""
    x = make_inputs(B=2, T=70, H=1, HV=2, K=32, V=16, dtype=dtype, seed=31)
    o, S = run(x)
    o_ref, S_ref = reference(x, KernelOptions())
    assert o.dtype == dtype and S.dtype == torch.float32
    assert rel_err(o, o_ref) < tol(dtype) and rel_err(S, S_ref) < tol(dtype)


@pytest.mark.parametrize("gate", ["softplus", "lower_bound"])
@pytest.mark.parametrize("store", ["input", "float32"])
def test_in_kernel_options(gate, store):
    """l2norm, the gate formula and the beta sigmoid (2 sigmoid with negative eigenvalues) inside the kernels;
    intermediates in bf16 (the default for bf16 inputs) or float32; the lower_bound gate without dt_bias."""
    x = make_inputs(B=1, T=70, H=1, HV=2, K=32, V=32, raw=True, dtype=torch.bfloat16, seed=32)
    A_log, dt_bias = torch.randn(2), (torch.randn(2 * 32) if gate == "softplus" else None)
    opts = KernelOptions(True, True, True, gate == "softplus", A_log, dt_bias, -5.0 if gate == "lower_bound" else None)
    o, S = chunk_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], 32 ** -0.5, x["initial_state"], True, opts,
                         None, cfg=LaunchConfig(store=store))
    o_ref, S_ref = reference(x, opts)
    assert rel_err(o, o_ref) < 5e-3 and rel_err(S, S_ref) < 5e-3


@pytest.mark.parametrize("T", [1, 64, 130])
def test_extreme_gates_and_lengths(T):
    """Per-step gates of -1000 (every 7th step, and the first) and exactly 0 (every 5th from the 3rd): finite, and
    float32-accurate. Bar 1e-4: inside a 16-row diagonal block the factors exp(gP_i - gP_r), exp(gP_r - gP_j) (r
    a reference row, chunk_wy.diagonal_levels) are differences of two sums that can hold -1000s (about 1e-4
    absolute rounding in the exponent); elsewhere exponents are plain sums."""
    x = make_inputs(B=1, T=T, H=1, K=32, V=16, strong_decay=True, seed=33)
    x["g"][:, 0] = -1000.0
    o, S = run(x)
    o_ref, S_ref = reference(x, KernelOptions())
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert rel_err(o, o_ref) < 1e-4 and rel_err(S, S_ref) < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_separable_and_blocked_score_paths_side_by_side(dtype):
    """Head 0 decays by about 3 a step (96 over 32 rows: not separable, so the scores go by halves for bf16 and by
    the blocked scheme with the diagonal in its product for float32); head 1 by about 0.5 (separable: one product
    per channel step)."""
    x = make_inputs(B=1, T=130, H=1, HV=2, K=32, V=16, dtype=dtype, seed=39)
    g = x["g"].double()
    g[:, :, 0] = -3.0 + 0.1 * torch.randn(1, 130, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x["g"] = g.to(dtype)
    o, S = chunk_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], 32 ** -0.5, x["initial_state"], True,
                         NO_OPTIONS, None)
    o_ref, S_ref = reference(x, KernelOptions())
    assert rel_err(o, o_ref) < tol(dtype) and rel_err(S, S_ref) < tol(dtype)


@pytest.mark.parametrize("case", ["extreme gates", "varlen bf16 options", "repeated keys, no decay"])
def test_inverse_hard_cases(case):
    """The chunk inverse (four diagonal 16x16 blocks in one batched substitution, then the off-diagonal blocks) on
    the inputs that stress it."""
    cu, opts = None, NO_OPTIONS
    if case == "extreme gates":
        x = make_inputs(B=1, T=130, H=1, K=32, V=16, strong_decay=True, seed=40)
        bar = 1e-4
    elif case == "repeated keys, no decay":
        # every key of a chunk the same, beta near 1 and no decay: A is near the all-ones strictly lower matrix,
        # whose inverse (near the bidiagonal [1, -1]) sums long alternating paths (the worst case for cancellation)
        x = make_inputs(B=1, T=130, H=1, K=32, V=16, seed=43)
        x["k"] = x["k"][:, :1].expand_as(x["k"]).clone()
        x["g"] = torch.zeros_like(x["g"])
        x["beta"] = torch.full_like(x["beta"], 0.99)
        bar = 1e-4
    else:
        cu = torch.tensor([0, 1, 1, 70, 71, 90])
        x = make_inputs(B=1, T=90, H=1, HV=2, K=32, V=16, N=5, raw=True, dtype=torch.bfloat16, seed=41)
        opts = KernelOptions(True, True, True, False, torch.randn(2), torch.randn(2 * 32), None)
        bar = 5e-3
    o, S = chunk_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["q"].shape[-1] ** -0.5, x["initial_state"],
                         True, opts, cu)
    o_ref, S_ref = reference(x, opts, cu_seqlens=cu)
    assert rel_err(o, o_ref) < bar and rel_err(S, S_ref) < bar


def lopsided_gates(x, T):
    """Value head 0 falls by 2.8 a step in the first half of each chunk and 0.5 in the second (about 90 then 16:
    not separable around row 31); head 1 as drawn."""
    g = x["g"].double()
    steep = (torch.arange(T) % 64) < 32
    g[:, :, 0] = torch.where(steep[:, None], -2.8, -0.5).to(g.dtype)
    x["g"] = g.to(x["g"].dtype)
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lopsided_chunks(dtype):
    """Chunks whose gate falls steeply in one half and gently in the other, beside ordinary ones."""
    x = lopsided_gates(make_inputs(B=1, T=130, H=1, HV=2, K=32, V=16, dtype=dtype, seed=42), 130)
    o, S = chunk_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], 32 ** -0.5, x["initial_state"], True,
                         NO_OPTIONS, None)
    o_ref, S_ref = reference(x, NO_OPTIONS)
    assert rel_err(o, o_ref) < tol(dtype) and rel_err(S, S_ref) < tol(dtype)


def test_varlen_with_empty_and_length_one_sequences():
    cu = torch.tensor([0, 1, 1, 70, 71, 90])
    x = make_inputs(B=1, T=90, H=1, HV=2, K=32, V=16, N=5, dtype=torch.bfloat16, seed=34)
    o, S = run(x, cu_seqlens=cu)
    o_ref, S_ref = reference(x, KernelOptions(), cu_seqlens=cu)
    assert rel_err(o, o_ref) < 5e-3 and rel_err(S, S_ref) < 5e-3
    assert torch.equal(S[1], x["initial_state"][1])                 # the empty sequence keeps its state


def test_no_initial_state_no_final_state_odd_widths():
    """K and V that are not powers of two (masked channels), no initial state, no final state asked for."""
    x = make_inputs(B=2, T=20, K=24, V=20, seed=35, initial_state=False)
    o, S = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"])
    assert S is None
    assert rel_err(o, reference(x, KernelOptions())[0]) < 1e-5


@pytest.mark.parametrize("field, value", [("scores_warps", 2), ("wy_warps", 1), ("store", "half"),
                                          ("bwd_intra_prec", "bf16"), ("bwd_halves_per_sm", 0),
                                          ("bwd_sub_per_sm", 0), ("wy_bv", 48), ("bwd_wy_bv", 8),
                                          ("scores_bks", 0), ("h_bv", 24)])
def test_launch_config_refuses_bad_fields(field, value):
    with pytest.raises(ValueError, match=f"LaunchConfig.{field}"):
        LaunchConfig(**{field: value})


def test_public_op_reads_the_module_default_config_at_call_time(monkeypatch):
    """`bench/kda_kernels.py --config` swaps ``chunk.DEFAULT_CONFIG``: the forward without gradients must use it
    too (float32 intermediates change bf16 results), not the default bound when the pipeline was defined."""
    import kimi_linear.ops.triton.chunk as tri_chunk

    x = make_inputs(B=1, T=40, H=1, K=32, V=16, dtype=torch.bfloat16, seed=39)
    default = run(x)[0]
    monkeypatch.setattr(tri_chunk, "DEFAULT_CONFIG", LaunchConfig(store="float32"))
    assert not torch.equal(run(x)[0], default)
    assert torch.equal(run(x)[0], chunk_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], 32 ** -0.5,
                                                x["initial_state"], True, NO_OPTIONS, None,
                                                cfg=LaunchConfig(store="float32"))[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["three paths", "extreme gates"])
def test_scores_by_halves(case, dtype):
    """The three score paths side by side: value head 0 decays by about 3 a step (48 per sub-block: not separable
    as a chunk, bounded per sub-block, so the three-product path for bf16), head 1 by about 0.5 (separable), head
    2 by about 6 (96 per sub-block: the blocked scheme); "extreme gates": -1000 and 0 steps (blocked scheme)
    beside ordinary chunks. Same numbers as the reference, every chunk written once (NaN poison)."""
    if case == "three paths":
        x = make_inputs(B=1, T=130, H=1, HV=3, K=32, V=16, dtype=dtype, seed=44)
        g = x["g"].double()
        noise = 0.1 * torch.randn(1, 130, 32, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        g[:, :, 0] = -3.0 + noise
        g[:, :, 2] = -6.0 + noise
        x["g"] = g.to(dtype)
        bar = tol(dtype)
    else:
        x = make_inputs(B=1, T=130, H=1, HV=2, K=32, V=16, strong_decay=True, dtype=dtype, seed=45)
        bar = 1e-4 if dtype == torch.float32 else 5e-3
    o, S = chunk_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], 32 ** -0.5, x["initial_state"], True,
                         NO_OPTIONS, None)
    o_ref, S_ref = reference(x, NO_OPTIONS)
    assert rel_err(o, o_ref) < bar and rel_err(S, S_ref) < bar



def reference_scores(rows, keys, g, diagonal):
    """Float64 scores of one block of rows: ``sum_c rows_ic keys_jc exp(G_ic - G_jc)`` with ``G`` the cumulative
    sum of the log decays ``g`` ([L, K] each), on the pairs ``torch.tril(diagonal)`` keeps (0: j <= i, -1: j < i),
    zero elsewhere: [L, L]."""
    G = g.cumsum(0)
    keep = torch.ones(len(G), len(G), dtype=torch.bool).tril(diagonal)[:, :, None]
    return torch.einsum("ic,jc,ijc->ij", rows, keys, torch.exp(torch.where(keep, G[:, None] - G[None, :], -1e9)))

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2norm_factors_from_scores(dtype):
    """l2norm's row factors from the scores kernel (its paths on raw q, k, the [BT, BT] results scaled): with GVA
    (one writer per q/k head), q and k far from unit norm, value heads on the separable, by-halves and blocked
    score paths (gate steps of about -0.5, -3 and -6)."""
    x = make_inputs(B=1, T=130, H=1, HV=3, K=40, V=16, dtype=dtype, seed=46)
    x["q"], x["k"] = (7 * x["q"]).to(dtype), (3 * x["k"]).to(dtype)
    stepped_gates(x, (-0.5, -3.0, -6.0), seed=4)
    opts = KernelOptions(use_qk_l2norm_in_kernel=True)
    o, S = chunk_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], 40 ** -0.5, x["initial_state"], True, opts,
                         None)
    o_ref, S_ref = reference(x, opts)
    assert rel_err(o, o_ref) < tol(dtype) and rel_err(S, S_ref) < tol(dtype)


@pytest.mark.parametrize("cfg", [dict(), dict(wy_stages=1)], ids=str)
def test_wy_products_odd_widths(cfg):
    """The WY products (pipelined, and not) against the reference at the bf16 bar, with a length that is not a
    multiple of the chunk and K not a multiple of the channel step."""
    x = make_inputs(B=2, T=70, H=1, HV=2, K=80, V=48, dtype=torch.bfloat16, seed=47)
    o, S = chunk_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], 80 ** -0.5, x["initial_state"], True,
                         NO_OPTIONS, None, cfg=LaunchConfig(**cfg))
    o_ref, S_ref = reference(x, NO_OPTIONS)
    assert rel_err(o, o_ref) < 5e-3 and rel_err(S, S_ref) < 5e-3


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [dict(wy_tma=True), dict(wy_tma=True, scores_tma=True, scores_stages=3),
                                 dict(wy_tma=False)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tensor_descriptor_tiles(cfg, dtype):
    """q, k, v and gP tiles through TMA descriptors over the [rows, heads x width] views (chunk_wy.chunk_tile):
    two sequences of 130 tokens, so the last chunk of the first reads the second's rows (they must count as
    zero), GVA, l2norm, against the reference; and the same numbers as pointer loads."""
    x = make_inputs(B=2, T=130, H=1, HV=2, K=64, V=32, dtype=dtype, seed=48)
    opts = KernelOptions(use_qk_l2norm_in_kernel=True)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 64 ** -0.5, x["initial_state"], True, opts, None)
    o, S = chunk_kda_fwd(*args, cfg=LaunchConfig(**cfg))
    o_ref, S_ref = reference(x, opts)
    assert rel_err(o, o_ref) < tol(dtype) and rel_err(S, S_ref) < tol(dtype)
    o_ptr, _ = chunk_kda_fwd(*args, cfg=LaunchConfig(wy_tma=False))
    assert torch.equal(o, o_ptr)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wide_keys_scan_within_the_h200_shared_memory(dtype):
    """K = V = 256 (fla's largest head): the state scans take 32 value columns and one pipeline stage (the
    offline sm_90 build: 2-3 stages asked 242-352 KiB of shared memory, the H200 has 227); K = 128 keeps its
    measured rule."""
    from kimi_linear.ops.triton.chunk_pipeline import Problem

    def scan_launch(K, B):
        q = torch.zeros(B, 64, 32, K, dtype=dtype)
        p = Problem(q, torch.zeros(B, 64, 32, K, dtype=dtype), None, NO_OPTIONS, LaunchConfig())
        return p.h_bv, p.h_stages, p.h_out_stages

    deep = 2 if dtype == torch.float32 else 3
    assert scan_launch(256, 1) == (32, 1, 1) and scan_launch(256, 16) == (32, 1, 1)
    # the forward's scan (it forms the output) pipelines 3 deep for 16-bit tiles at any shape; the backward's
    # scans keep 2 where 64 columns fill the card
    assert scan_launch(128, 16) == (64, 2, deep) and scan_launch(128, 1)[1:] == (deep, deep)


def test_wide_keys_forward_and_final_state():
    """K = V = 256 end to end on a short sequence (interpreter)."""
    x = make_inputs(B=1, T=70, H=1, K=256, V=256, seed=50)
    o, S = run(x)
    o_ref, S_ref = reference(x, KernelOptions())
    assert rel_err(o, o_ref) < 1e-5 and rel_err(S, S_ref) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["softplus A_log~log U(1,16)", "mixed channels", "mixed by 16 channels",
                                  "varlen mixed", "-1000 padding"])
def test_strong_decay(case, dtype, monkeypatch):
    """The strong-decay regime of issue 20 against the float64 reference: every 16-row sub-block's gate sum far
    below -SAFE_EXP, so ``exp(-gP_j)`` overflows float32 and the diagonal blocks must take the reference-row levels
    (chunk_wy.diagonal_levels) for float32 inputs and the clamped steps (chunk_wy.clamped_diagonal_factors) for
    bf16 (counted: the test fails if they are not taken). The in-kernel softplus gate with
    A_log = log U(1, 16) (about -6.7 a step) and l2norm over GVA; mild and strong channels (and -1000 steps) in the
    same chunks (test cases: triton_cases.mixed_gates), also packed with lengths that are not multiples of 64
    and an empty sequence; -1000 on every 7th step and 0 on every 5th. Lengths 130 and 200, initial states."""
    from kimi_linear.ops.triton import chunk_wy

    strong_path = "diagonal_levels" if dtype == torch.float32 else "clamped_diagonal_factors"
    calls = spy_calls(monkeypatch, chunk_wy, strong_path)
    cu, opts, bar = None, NO_OPTIONS, tol(dtype)
    if case.startswith("softplus"):
        x = make_inputs(B=1, T=200, H=1, HV=2, K=32, V=16, raw=True, dtype=dtype, seed=60)
        opts, _ = strong_gate(2, 32, seed=61)
    elif case.startswith("mixed"):
        x = mixed_gates(make_inputs(B=1, T=130, H=1, K=64, V=16, dtype=dtype, seed=62), seed=63,
                        group=16 if "16" in case else None)
    elif case == "varlen mixed":
        cu = torch.tensor([0, 70, 70, 200])
        x = mixed_gates(make_inputs(B=1, T=200, H=1, K=64, V=16, N=3, dtype=dtype, seed=64), seed=65)
    else:
        x = make_inputs(B=1, T=130, H=1, HV=2, K=32, V=16, strong_decay=True, dtype=dtype, seed=66)
        bar = 1e-4 if dtype == torch.float32 else bar            # see test_extreme_gates_and_lengths
    o, S = chunk_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["q"].shape[-1] ** -0.5, x["initial_state"],
                         True, opts, cu)
    o_ref, S_ref = reference(x, opts, cu_seqlens=cu)
    assert calls, "the strong path was not taken"
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert rel_err(o, o_ref) < bar and rel_err(S, S_ref) < bar


def test_clamped_diagonal_at_the_clamp():
    """bf16 strong decay's diagonal blocks through clamped gate steps (chunk_wy.clamped_diagonal), checked on Akk
    itself (float32, before any inverse) against float64: channels stepping -9.9 (just above the clamp, so a
    sub-block falls by ~149 and the factors reach exp(+-74)), channels alternating -10.5 (clamped) and -0.5, and
    -1000 steps. Every kept entry within 2e-3 of the largest (tf32 operands); a clamp of 6 or less, or factors
    that skip the midpoint, fail it."""
    from kimi_linear.ops.triton.chunk_pipeline import Problem, forward_pieces

    T, K = 100, 32
    x = make_inputs(B=1, T=T, H=1, K=K, V=16, dtype=torch.bfloat16, seed=72)
    steps = torch.where(torch.arange(K) % 2 == 0, -9.9, torch.where(torch.arange(T)[:, None] % 2 == 0, -10.5, -0.5))
    steps[::13, 8:16] = -1000.0
    x["g"] = steps[None, :, None, :].to(torch.bfloat16)
    p = Problem(x["q"], x["v"], None, NO_OPTIONS, LaunchConfig())
    pc = forward_pieces(p, x["q"], x["k"], x["v"], x["g"], x["beta"], None, False)
    k, g = x["k"][0, :, 0].double(), x["g"][0, :, 0].double()
    err, top = 0.0, 0.0
    for b0 in range(0, T, 16):                                       # each 16-row sub-block
        r = slice(b0, min(b0 + 16, T))
        ref = reference_scores(k[r], k[r], g[r], -1)                 # pairs j < i of the sub-block
        got = pc.Akk[0, r, 0, b0 % 64: b0 % 64 + r.stop - r.start].double().tril(-1)
        err, top = max(err, (got - ref).abs().max().item()), max(top, ref.abs().max().item())
    assert torch.isfinite(pc.Akk).all()
    assert err < 2e-3 * top, (err, top)


@pytest.mark.parametrize("fall", [20.5, 19.5])
def test_banded_scores_at_their_bound(fall, monkeypatch):
    """bf16 chunks whose every channel falls by ``fall`` over each 16-row sub-block (20.5: just past BAND_LIMIT,
    so chunk_wy.banded_scores leaves the pairs two sub-blocks apart, whose factors reach exp(-20.5), at zero;
    19.5: just short of it, so the blocked scheme takes them), with channels falling by about 200 a sub-block
    (not bounded per sub-block, so no by-halves path) and -1000 steps beside them. Aqk (stored in bf16: 5e-3)
    and Akk (float32 here: 2e-3) against float64 on every pair j <= i (j < i), within that share of the largest
    entry; the sub-diagonal blocks (which the banded path forms in a product of their own) checked apart, and the
    chunks counted on the path their fall gives them (the last chunk's sub-block 2 lies past the end: never
    banded)."""
    from kimi_linear.ops.triton import chunk_wy
    from kimi_linear.ops.triton.chunk_pipeline import Problem, forward_pieces

    banded = spy_calls(monkeypatch, chunk_wy, "banded_scores")
    blocked = spy_calls(monkeypatch, chunk_wy, "blocked_scores")
    T, K = 150, 32
    x = make_inputs(B=1, T=T, H=1, K=K, V=16, dtype=torch.bfloat16, seed=97)
    u = torch.rand(T, K, generator=torch.Generator().manual_seed(98), dtype=torch.float64)
    # even channels: uneven steps summing to -fall over each sub-block; odd ones about -200 a sub-block
    blocks = torch.nn.functional.pad(u, (0, 0, 0, (-T) % 16)).reshape(-1, 16, K)
    mild = (-fall * blocks / blocks.sum(1, keepdim=True)).reshape(-1, K)[:T]
    steps = torch.where(torch.arange(K) % 2 == 0, mild, -12.5 * (0.5 + u))
    steps[::11, 1::4] = -1000.0
    x["g"] = steps[None, :, None, :].to(torch.bfloat16)
    p = Problem(x["q"], x["v"], None, NO_OPTIONS, LaunchConfig())
    pc = forward_pieces(p, x["q"], x["k"], x["v"], x["g"], x["beta"], None, False)
    chunks = -(-T // 64)
    full = T // 64
    assert (len(banded), len(blocked)) == ((full, chunks - full) if fall > 20 else (0, chunks)), (banded, blocked)
    qd, kd, G = (x[n][0, :, 0].double() for n in ("q", "k", "g"))
    for name, rows, got_all, strict, bar in (("Aqk", qd, pc.Aqk, 0, 5e-3), ("Akk", kd, pc.Akk, -1, 2e-3)):
        err, err_sub, top = 0.0, 0.0, 0.0
        for t0 in range(0, T, 64):
            r = slice(t0, min(t0 + 64, T))
            n = r.stop - r.start
            ref = reference_scores(rows[r], kd[r], G[r], strict)
            got = got_all[0, r, 0, :n].double().tril(strict)
            sub = torch.zeros(n, n, dtype=torch.bool)
            for b in range(16, n, 16):
                sub[b:b + 16, b - 16:b] = True
            err, top = max(err, (got - ref).abs().max().item()), max(top, ref.abs().max().item())
            err_sub = max(err_sub, (got - ref)[sub].abs().max().item())
        assert torch.isfinite(got_all).all()
        assert err < bar * top and err_sub < bar * top, (name, err, err_sub, top)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_row_levels_on_every_diagonal_block(dtype, monkeypatch):
    """The diagonal pass of the blocked scheme (chunk_wy.diagonal_levels for float32, clamped_diagonal for bf16)
    takes every channel step, mild channels included (head 0 mixes mild and strong channels; head 1 falls by about
    48 a sub-block, blocked in float32, by halves in bf16): there every pair of a diagonal block has a factor that
    matters, so each level's pairs and masks are checked, not only the pairs next to the diagonal that strong decay
    leaves. Must match the reference as closely as the fast product does. (force_levels sends the score
    gradients' diagonal blocks the same way.)"""
    force_levels(monkeypatch)
    x = mixed_gates(make_inputs(B=1, T=130, H=1, HV=2, K=64, V=16, dtype=dtype, seed=67), seed=68)
    g = x["g"].double()
    g[:, :, 1] = -3.0 + 0.1 * torch.randn(1, 130, 64, generator=torch.Generator().manual_seed(69),
                                          dtype=torch.float64)    # head 1: every sub-block falls by about 48
    x["g"] = g.to(dtype)
    o, S = chunk_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], 64 ** -0.5, x["initial_state"], True,
                         NO_OPTIONS, None)
    o_ref, S_ref = reference(x, NO_OPTIONS)
    assert rel_err(o, o_ref) < tol(dtype) and rel_err(S, S_ref) < tol(dtype)


def output_from_stored_pieces(x, cu, scale):
    """``o = scale (qg h[n] + Aqk vn)`` per chunk in float64 from what the backward's recompute stores (h per chunk,
    vn, qg, Aqk: chunk_pipeline.forward_pieces without a scale), [B, T, HV, V]."""
    from kimi_linear.ops.triton.chunk_pipeline import Problem, forward_pieces

    p = Problem(x["q"], x["v"], cu, NO_OPTIONS, LaunchConfig())
    pc = forward_pieces(p, x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"], False)
    B, T = x["q"].shape[:2]
    bounds = cu.tolist() if cu is not None else None
    o = torch.zeros(*x["v"].shape, dtype=torch.float64)
    c = 0
    for n in range(len(bounds) - 1 if cu is not None else B):
        b, bos, eos = (0, bounds[n], bounds[n + 1]) if cu is not None else (n, 0, T)
        for t0 in range(bos, eos, 64):
            r = slice(t0, min(t0 + 64, eos))
            A = pc.Aqk[b, r].double()[..., : r.stop - r.start]                 # [L, HV, L]
            qh = torch.einsum("thk,hkv->thv", pc.qg[b, r].double(), pc.h[c].double())
            o[b, r] = scale * (qh + torch.einsum("tha,ahv->thv", A, pc.vn[b, r].double()))
            c += 1
    return o


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["gva initial state", "varlen", "strong decay", "length 1"])
def test_output_formed_in_the_scan(case, dtype):
    """The forward's scan forms each chunk's output from the state and vn in registers (chunk_state.py, OUTPUT):
    against the float64 reference at the usual bars, and against ``scale (qg h[n] + Aqk vn)`` from the pieces the
    backward's recompute stores (same rounding of h and vn; bar: a few bf16 roundings of o), with GVA and an
    initial state, varlen with an empty sequence and lengths that are not multiples of 64, strong decay and a
    single token."""
    cu = None
    if case == "varlen":
        cu = torch.tensor([0, 70, 70, 200])
        x = make_inputs(B=1, T=200, H=1, HV=2, K=32, V=48, N=3, dtype=dtype, seed=70)
    elif case == "strong decay":
        x = make_inputs(B=1, T=130, H=1, HV=2, K=32, V=16, strong_decay=True, dtype=dtype, seed=71)
    else:
        x = make_inputs(B=2, T=1 if case == "length 1" else 100, H=1, HV=2, K=32, V=32, dtype=dtype, seed=72)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 32 ** -0.5, x["initial_state"], True, NO_OPTIONS, cu)
    o, S = chunk_kda_fwd(*args)
    o_ref, S_ref = reference(x, NO_OPTIONS, cu_seqlens=cu)
    bar = 1e-4 if case == "strong decay" and dtype == torch.float32 else tol(dtype)
    assert o.dtype == dtype and torch.isfinite(o).all()
    assert rel_err(o, o_ref) < bar and rel_err(S, S_ref) < bar
    o_pieces = output_from_stored_pieces(x, cu, 32 ** -0.5)
    assert rel_err(o, o_pieces) < (1e-6 if dtype == torch.float32 else 3e-3)


@pytest.mark.parametrize("bks", [16, 32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocked_scores_at_every_channel_step(dtype, bks):
    """chunk_wy.blocked_scores with the launch stepping 16, 32 (taken as two halves) or 64 channels
    (``LaunchConfig.scores_bks``), mild and strong channels alternating in groups of 16 so that one step holds
    both: each channel's diagonal pairs must come from exactly one of the product and the strong pass, which decide
    per the same step (with the strong pass deciding per 16 channels, a 64-channel launch was 0.59 off the
    reference). Against the float64 reference at the usual bars."""
    x = mixed_gates(make_inputs(B=1, T=130, H=1, HV=1, K=64, V=16, dtype=dtype, seed=7), seed=8, group=16)
    o, S = chunk_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], 64 ** -0.5, x["initial_state"], True,
                         NO_OPTIONS, None, cfg=LaunchConfig(scores_bks=bks))
    o_ref, S_ref = reference(x, NO_OPTIONS)
    assert rel_err(o, o_ref) < tol(dtype) and rel_err(S, S_ref) < tol(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_descriptor_tiles_in_every_score_path(dtype, monkeypatch):
    """``LaunchConfig(scores_tma=True)`` (the default): q, k and gP through the descriptors in every score path,
    the by-halves and blocked ones included (every tile counted), two sequences of 130 tokens (the first's last
    chunk reads the second's rows through the descriptor: they must count as zero); value head 0 on the halves
    path (about -3 a step), head 1 mixed mild / strong channels (the blocked scheme with its diagonal levels).
    Bit for bit the pointer loads' outputs, and the reference's at the usual bars."""
    from kimi_linear.ops.triton import chunk_wy

    halves = spy_calls(monkeypatch, chunk_wy, "halves_scores")
    blocked = spy_calls(monkeypatch, chunk_wy, "blocked_scores")
    x = mixed_gates(make_inputs(B=2, T=130, H=1, HV=2, K=64, V=32, dtype=dtype, seed=73), seed=74)
    g = x["g"].double()
    g[:, :, 0] = -3.0 + 0.1 * torch.randn(2, 130, 64, generator=torch.Generator().manual_seed(75),
                                          dtype=torch.float64)
    x["g"] = g.to(dtype)
    tiles = spy_tiles(monkeypatch)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 64 ** -0.5, x["initial_state"], True, NO_OPTIONS, None)
    o_ptr, S_ptr = chunk_kda_fwd(*args, cfg=LaunchConfig(scores_tma=False, wy_tma=False))
    assert tiles and not any(tma for _, tma in tiles)
    tiles.clear()
    o, S = chunk_kda_fwd(*args, cfg=LaunchConfig())
    o_ref, S_ref = reference(x, NO_OPTIONS)
    assert blocked and (halves or dtype == torch.float32)        # float32 takes no halves path
    assert tiles and all(tma for _, tma in tiles)                # every path's tiles came by descriptor
    assert torch.equal(o, o_ptr) and torch.equal(S, S_ptr)
    assert rel_err(o, o_ref) < tol(dtype) and rel_err(S, S_ref) < tol(dtype)


def test_inverse_kept_only_for_a_backward():
    """The WY kernel assembles the inverse's 16x16 blocks into one [64, 64] tile in registers and stores it as Tm
    only when a backward will read it: the stored Tm is (I + diag(beta) Akk)^-1 of every chunk (float64 inverse of
    the stored Akk; a block put in the wrong place fails it), and the forward without it (no Tm buffer at all)
    gives the same bits."""
    from kimi_linear.ops.triton.chunk_pipeline import chunk_kda_fwd_keeping

    T = 150                                                          # 3 chunks, the last one partial
    x = make_inputs(B=1, T=T, H=1, HV=2, K=32, V=16, dtype=torch.float32, seed=91)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 0.2, x["initial_state"], True, NO_OPTIONS, None)
    o, ht, kept = chunk_kda_fwd_keeping(*args)
    o2, ht2, none = chunk_kda_fwd_keeping(*args, keep=False)
    assert none is None
    assert torch.equal(o, o2) and torch.equal(ht, ht2)
    for h in range(2):
        for t0 in range(0, T, 64):
            n = min(64, T - t0)
            A = kept.Akk[0, t0:t0 + n, h, :n].double().tril(-1) * x["beta"][0, t0:t0 + n, h].double()[:, None]
            ref = torch.linalg.inv(torch.eye(n, dtype=torch.float64) + A)
            got = kept.Tm[0, t0:t0 + n, h, :n].double()
            assert (got - ref).abs().max() < 1e-5 * ref.abs().max(), (h, t0)


@pytest.mark.parametrize("gate", ["in kernel", "caller's"])
def test_akk_storage(gate):
    """Akk is float16 for 16-bit inputs with l2norm and the gate formula in the kernels (|Akk| <= 1: float16's
    11-bit significand matches the tf32 products that form it) and float32 for a caller's gate (which may rise);
    either way every kept entry is within 2e-3 of the largest against float64."""
    from kimi_linear.ops.gate import fused_kda_gate
    from kimi_linear.ops.triton.chunk_pipeline import Problem, forward_pieces

    T, K = 100, 32
    x = make_inputs(B=1, T=T, H=1, K=K, V=16, raw=True, dtype=torch.bfloat16, seed=93)
    A_log, dt_bias = torch.randn(1), torch.randn(K)
    in_kernel = gate == "in kernel"
    opts = KernelOptions(True, in_kernel, False, False, A_log if in_kernel else None, dt_bias if in_kernel else None)
    g = x["g"] if in_kernel else fused_kda_gate(x["g"].float(), A_log, dt_bias).to(torch.bfloat16)
    p = Problem(x["q"], x["v"], None, opts, LaunchConfig())
    pc = forward_pieces(p, x["q"], x["k"], x["v"], g, x["beta"], None, False)
    assert pc.Akk.dtype == (torch.float16 if in_kernel else torch.float32)
    k = torch.nn.functional.normalize(x["k"][0, :, 0].double(), dim=-1)
    G = (fused_kda_gate(x["g"].float(), A_log, dt_bias) if in_kernel else g).double()[0, :, 0]
    err, top = 0.0, 0.0
    for t0 in range(0, T, 64):
        r = slice(t0, min(t0 + 64, T))
        ref = reference_scores(k[r], k[r], G[r], -1)
        got = pc.Akk[0, r, 0, :len(ref)].double().tril(-1)
        err, top = max(err, (got - ref).abs().max().item()), max(top, ref.abs().max().item())
    assert err < 2e-3 * top, (err, top)


@pytest.mark.parametrize("fall", [45.0, 58.0])
def test_scores_by_halves_at_their_bound(fall, monkeypatch):
    """chunk_wy.halves_scores with every 16-row sub-block falling by ``fall`` (not separable, bounded per
    sub-block; 58 just under the tightest bound that path has been given, 60), so that the factors of its half-1
    rows reach exp(fall). Every kept entry of Aqk (stored in bf16: 5e-3) and Akk (float32 here: 2e-3) within that
    share of the largest against float64, the quarter across the halves included, and the chunks went by halves."""
    from kimi_linear.ops.triton import chunk_wy
    from kimi_linear.ops.triton.chunk_pipeline import Problem, forward_pieces

    halves = spy_calls(monkeypatch, chunk_wy, "halves_scores")
    T, K = 128, 32
    x = make_inputs(B=1, T=T, H=1, K=K, V=16, dtype=torch.bfloat16, seed=95)
    gen = torch.Generator().manual_seed(96)
    step = fall / 16 * (1.0 + 0.05 * torch.randn(1, T, 1, K, generator=gen, dtype=torch.float64)).clamp(0.9, 1.0)
    x["g"] = (-step).to(torch.bfloat16)
    p = Problem(x["q"], x["v"], None, NO_OPTIONS, LaunchConfig())
    pc = forward_pieces(p, x["q"], x["k"], x["v"], x["g"], x["beta"], None, False)
    assert len(halves) == T // 64, halves
    q, k, G = (x[n][0, :, 0].double() for n in ("q", "k", "g"))
    for name, rows, got_all, strict, bar in (("Aqk", q, pc.Aqk, 0, 5e-3), ("Akk", k, pc.Akk, -1, 2e-3)):
        err, top = 0.0, 0.0
        for t0 in range(0, T, 64):
            r = slice(t0, t0 + 64)
            ref = reference_scores(rows[r], k[r], G[r], strict)
            got = got_all[0, r, 0].double().tril(strict)
            err, top = max(err, (got - ref).abs().max().item()), max(top, ref.abs().max().item())
        assert err < bar * top, (name, err, top)


def test_value_side_by_split_products():
    """bf16 values: the WY kernel forms u = Tm diag(beta) v by two bf16 products of v against the tf32 operand
    split exactly in two (chunk_common.bf16_split, mm_split), so u (stored in float32 here) equals the tf32 product
    of round_tf32(Tm diag(beta)) by v to float32 accumulation: within 1e-5 of the largest entry against float64,
    where the high half alone (a bf16 operand) is 2.4e-4 of it off. Two value heads, a chunk cut at T = 130."""
    from kimi_linear.ops.triton.chunk_pipeline import Problem, forward_pieces

    x = make_inputs(B=1, T=130, H=1, HV=2, K=32, V=64, dtype=torch.bfloat16, seed=91)
    p = Problem(x["q"], x["v"], None, NO_OPTIONS, LaunchConfig(store="float32"))
    pc = forward_pieces(p, x["q"], x["k"], x["v"], x["g"], x["beta"], None, False)
    assert pc.u.dtype == torch.float32 and pc.Tm is not None
    err, top = 0.0, 0.0
    for h in range(2):
        for t0 in range(0, 130, 64):
            r = slice(t0, min(t0 + 64, 130))
            n = r.stop - r.start
            Tb = pc.Tm[0, r, h, :n] * x["beta"][0, r, h].float()[None, :]           # Tm diag(beta), float32
            Tb = ((Tb.view(torch.int32) + 0x1000) & ~0x1FFF).view(torch.float32)     # tf32 (ties away)
            ref = Tb.double() @ x["v"][0, r, h].double()
            err = max(err, (pc.u[0, r, h].double() - ref).abs().max().item())
            top = max(top, ref.abs().max().item())
    assert err < 1e-5 * top, (err, top)


def test_wy_value_step_keeps_descriptors(monkeypatch):
    """The WY kernel's u loop steps by ``LaunchConfig.wy_bv`` (64) where that divides V, else by the key step, so
    that V = 96 keeps every tile on TMA descriptors (a step of 64 would leave V's last block partial and turn them
    all into pointer loads): every chunk_tile call there by descriptor, and the reference's numbers."""

    x = make_inputs(B=1, T=70, H=1, HV=1, K=32, V=96, dtype=torch.bfloat16, seed=93)
    tiles = spy_tiles(monkeypatch)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 32 ** -0.5, x["initial_state"], True, NO_OPTIONS, None)
    o, S = chunk_kda_fwd(*args, cfg=LaunchConfig(wy_bv=64))
    o_ref, S_ref = reference(x, NO_OPTIONS)
    assert tiles and all(tma for _, tma in tiles)
    assert {step for step, _ in tiles} == {32}                  # every tile by the key step, v included
    assert rel_err(o, o_ref) < tol(torch.bfloat16) and rel_err(S, S_ref) < tol(torch.bfloat16)


def test_scores_descriptors_whatever_the_value_width(monkeypatch):
    """The scores kernel reads no v, so its q, k and gP tiles come through descriptors whatever V is (V = 16 here,
    below its 32-channel step; chunk_pipeline.tile_descriptors checks V only where v is among the tensors)."""
    from kimi_linear.ops.triton import chunk_wy

    x = make_inputs(B=1, T=130, H=1, HV=1, K=32, V=16, dtype=torch.bfloat16, seed=96)
    tiles = spy_tiles(monkeypatch)
    scores = spy_calls(monkeypatch, chunk_wy, "separable_scores")
    o, S = chunk_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], 32 ** -0.5, x["initial_state"], True,
                         NO_OPTIONS, None, cfg=LaunchConfig())
    assert scores and tiles and all(tma for _, tma in tiles)      # the WY kernel's too (its steps divide V)
    o_ref, S_ref = reference(x, NO_OPTIONS)
    assert rel_err(o, o_ref) < tol(torch.bfloat16) and rel_err(S, S_ref) < tol(torch.bfloat16)
