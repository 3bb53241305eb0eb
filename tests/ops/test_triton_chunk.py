"""Triton chunk_kda under the interpreter (CPU) against the float64 reference and the PyTorch chunkwise path.

Outputs and every intermediate buffer are poisoned with NaN before each run: an element the kernels forget to write
(or read before writing) fails the comparison.
"""

import pytest
import torch

pytest.importorskip("triton")

from kimi_linear.ops import chunk_kda as torch_chunk_kda  # noqa: E402
from kimi_linear.ops.gate import KernelOptions  # noqa: E402
from kimi_linear.ops.triton import chunk_kda  # noqa: E402

from .kda_cases import loss_weights, make_inputs, rel_err  # noqa: E402
from .triton_cases import poison_empty, reference  # noqa: E402, F401  (autouse fixture)

NO_OPTIONS = KernelOptions()


def run(x, opts=NO_OPTIONS, **kw):
    return chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                     output_final_state=True, **opts.kwargs(), **kw)


def tol(dtype):
    return 1e-5 if dtype == torch.float32 else 5e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference_gva_initial_state(dtype):
    x = make_inputs(B=2, T=100, H=2, HV=4, K=32, V=16, dtype=dtype, seed=31)
    o, S = run(x)
    o_ref, S_ref = reference(x, KernelOptions())
    assert o.dtype == dtype and S.dtype == torch.float32
    assert rel_err(o, o_ref) < tol(dtype) and rel_err(S, S_ref) < tol(dtype)


@pytest.mark.parametrize("gate", ["softplus", "lower_bound"])
def test_in_kernel_options(gate):
    x = make_inputs(B=1, T=70, H=1, HV=2, K=32, V=32, raw=True, dtype=torch.bfloat16, seed=32)
    A_log, dt_bias = torch.randn(2), torch.randn(2 * 32)
    opts = KernelOptions(True, True, True, gate == "softplus", A_log, dt_bias, -5.0 if gate == "lower_bound" else None)
    o, S = run(x, opts)
    o_ref, S_ref = reference(x, opts)
    assert rel_err(o, o_ref) < 5e-3 and rel_err(S, S_ref) < 5e-3


@pytest.mark.parametrize("T", [1, 64, 130])
def test_extreme_gates_and_lengths(T):
    """Per-step gates of -1000 (every 7th step, and the first) and exactly 0 (every 5th from the 3rd).

    float32 bar 1e-4 here: inside a 16-row diagonal block the kernel forms exp(P_i - P_j) from two prefix sums
    that can hold -1000s (about 1e-4 absolute rounding in the exponent); elsewhere the exponents are plain sums."""
    x = make_inputs(B=1, T=T, H=1, K=32, V=16, strong_decay=True, seed=33)
    x["g"][:, 0] = -1000.0
    o, S = run(x)
    o_ref, S_ref = reference(x, KernelOptions())
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert rel_err(o, o_ref) < 1e-4 and rel_err(S, S_ref) < 1e-4


def test_varlen_with_length_one_sequences():
    cu = torch.tensor([0, 1, 2, 70, 71, 90])
    x = make_inputs(B=1, T=90, H=1, HV=2, K=32, V=16, N=5, dtype=torch.bfloat16, seed=34)
    o, S = run(x, cu_seqlens=cu)
    o_ref, S_ref = reference(x, KernelOptions(), cu_seqlens=cu)
    assert rel_err(o, o_ref) < 5e-3 and rel_err(S, S_ref) < 5e-3


def test_no_initial_state_no_final_state():
    x = make_inputs(B=2, T=20, K=32, V=16, seed=35, initial_state=False)
    o, S = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"])
    assert S is None
    assert rel_err(o, reference(x, KernelOptions())[0]) < 1e-5


def test_gradients_through_recompute_match_pytorch():
    """Differentiable calls run the Triton forward and a recomputed PyTorch backward: every input's gradient."""
    x = make_inputs(B=1, T=40, H=1, HV=2, K=32, V=16, raw=True, seed=36)
    A_log, dt_bias = torch.randn(2), torch.randn(2 * 32)
    leaves = lambda: {n: t.detach().clone().requires_grad_() for n, t in
                      dict(x, A_log=A_log, dt_bias=dt_bias).items()}
    grads = []
    for fn in (chunk_kda, torch_chunk_kda):
        p = leaves()
        o, S = fn(p["q"], p["k"], p["v"], p["g"], p["beta"], initial_state=p["initial_state"],
                  output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                  use_beta_sigmoid_in_kernel=True, A_log=p["A_log"], dt_bias=p["dt_bias"])
        loss = (o.double() * loss_weights(o.shape)).sum() + (S.double() * loss_weights(S.shape, 2)).sum()
        loss.backward()
        grads.append({n: t.grad for n, t in p.items()})
    for n in grads[1]:
        assert rel_err(grads[0][n], grads[1][n]) < 1e-4, n


@pytest.mark.parametrize("raw", [False, True])
def test_column_loop_diagonal_variant(raw):
    """The intra kernel's other diagonal-block form (column by column) agrees too; the default is sliced."""
    from kimi_linear.ops.triton.chunk import chunk_kda_fwd

    x = make_inputs(B=1, T=80, H=1, HV=2, K=32, V=16, raw=raw, strong_decay=not raw, seed=37)
    opts = KernelOptions(True, True, True, False, torch.randn(2), torch.randn(64), None) if raw else NO_OPTIONS
    o, S = chunk_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], 32 ** -0.5, x["initial_state"], True, opts,
                         None, diag_slice=0)
    o_ref, S_ref = reference(x, opts)
    assert rel_err(o, o_ref) < 1e-4 and rel_err(S, S_ref) < 1e-4


@pytest.mark.parametrize("case", ["options_bf16", "varlen_extreme_fp32"])
def test_split_intra_variant(case):
    """Part 1 as two kernels (chunk_split.py): the same results as the fused kernel's bars."""
    from kimi_linear.ops.triton.chunk import chunk_kda_fwd

    if case == "options_bf16":
        x = make_inputs(B=2, T=70, H=1, HV=2, K=32, V=16, raw=True, dtype=torch.bfloat16, seed=38)
        opts, cu, bar = KernelOptions(True, True, True, False, torch.randn(2), torch.randn(64), -5.0), None, 5e-3
    else:
        cu = torch.tensor([0, 1, 2, 70, 71, 90])
        x = make_inputs(B=1, T=90, H=1, HV=2, K=32, V=16, N=5, strong_decay=True, seed=39)
        opts, bar = NO_OPTIONS, 1e-4
    o, S = chunk_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], 32 ** -0.5, x["initial_state"], True, opts,
                         cu, intra="split", intra_warps=8)
    o_ref, S_ref = reference(x, opts, cu_seqlens=cu)
    assert rel_err(o, o_ref) < bar and rel_err(S, S_ref) < bar
