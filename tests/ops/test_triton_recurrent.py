"""Triton fused_recurrent_kda under the interpreter (CPU) against the float64 reference.

Outputs are poisoned with NaN before each run: an element the kernel forgets to write fails the comparison.
"""

import pytest
import torch

pytest.importorskip("triton")

from kimi_linear.ops.gate import KernelOptions  # noqa: E402
from kimi_linear.ops.triton import fused_recurrent_kda  # noqa: E402

from .kda_cases import make_inputs, rel_err  # noqa: E402
from .triton_cases import poison_empty, reference  # noqa: E402, F401  (autouse fixture)


def tol(dtype):
    return 1e-5 if dtype == torch.float32 else 5e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate", ["softplus", "lower_bound"])
def test_options_gva_initial_state(dtype, gate):
    x = make_inputs(B=2, T=9, H=2, HV=4, K=32, V=16, raw=True, dtype=dtype, seed=21)
    A_log, dt_bias = torch.randn(4), torch.randn(4 * 32)
    opts = KernelOptions(True, True, True, False, A_log, dt_bias, -5.0 if gate == "lower_bound" else None)
    o, S = fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=32 ** -0.5,
                               initial_state=x["initial_state"], output_final_state=True, **opts.kwargs())
    o_ref, S_ref = reference(x, opts)
    assert o.dtype == dtype and S.dtype == torch.float32
    assert rel_err(o, o_ref) < tol(dtype) and rel_err(S, S_ref) < tol(dtype)


def test_neg_eigval_no_dt_bias_no_initial_state():
    x = make_inputs(B=1, T=5, H=2, K=16, V=32, raw=True, seed=22, initial_state=False)
    opts = KernelOptions(True, True, True, True, torch.randn(2), None, None)
    o, S = fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], output_final_state=True, **opts.kwargs())
    o_ref, S_ref = reference(x, opts)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(S, S_ref) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("T", [1, 67])
def test_extreme_gates_and_lengths(T):
    """Per-step gates of -1000 and exactly 0, one decode token and a multi-token prompt of odd length."""
    x = make_inputs(B=3, T=T, H=2, HV=4, K=32, V=64, strong_decay=True, seed=23)
    x["g"][:, 0] = -1000.0
    o, S = fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                               output_final_state=True)
    o_ref, S_ref = reference(x, KernelOptions())
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert rel_err(o, o_ref) < 1e-5 and rel_err(S, S_ref) < 1e-5


def test_varlen_with_length_one_sequences():
    cu = torch.tensor([0, 1, 2, 13, 14, 20])
    x = make_inputs(B=1, T=20, H=1, HV=2, K=32, V=32, N=5, dtype=torch.bfloat16, seed=24)
    o, S = fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                               output_final_state=True, cu_seqlens=cu)
    o_ref, S_ref = reference(x, KernelOptions(), cu_seqlens=cu)
    assert rel_err(o, o_ref) < 5e-3 and rel_err(S, S_ref) < 5e-3


def test_no_final_state_requested():
    x = make_inputs(B=2, T=3, K=16, V=16, seed=25)
    o, S = fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"])
    assert S is None
    assert rel_err(o, reference(x, KernelOptions(), initial_state=None)[0]) < 1e-5


@pytest.mark.parametrize("T", [1, 4])
def test_state_pool_in_place(T):
    """Sequences in slots 5, 0, 2 of an 8-slot pool: those rows advance, every other row keeps its bits."""
    x = make_inputs(B=3, T=T, H=2, HV=4, K=32, V=16, seed=26)
    pool = torch.randn(8, 4, 32, 16)
    before = pool.clone()
    slots = torch.tensor([5, 0, 2])
    o, ret = fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pool,
                                 output_final_state=True, state_indices=slots)
    assert ret is pool
    o_ref, S_ref = reference(x, KernelOptions(), initial_state=before[slots])
    assert rel_err(o, o_ref) < 1e-5 and rel_err(pool[slots], S_ref) < 1e-5
    others = torch.tensor([i for i in range(8) if i not in (5, 0, 2)])
    assert torch.equal(pool[others], before[others])
    o2, ret2 = fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=before.clone(),
                                   state_indices=slots)
    assert ret2 is None and torch.equal(o2, o)


def test_block_v_variants_agree():
    x = make_inputs(B=2, T=3, H=2, K=32, V=64, seed=27)
    outs = [fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                output_final_state=True, block_v=bv) for bv in (8, 64)]
    assert rel_err(outs[0][0], outs[1][0]) < 1e-6 and rel_err(outs[0][1], outs[1][1]) < 1e-6


@pytest.mark.parametrize("B,T", [(3, 1), (1, 1), (2, 5), (1, 7)])
def test_inputs_read_in_place_from_a_packed_projection(B, T):
    """q, k, v and beta as the KDA layer hands them over: views into one [B, T, width] projection output (q|k|v
    unbound from [.., 3, H, K], beta a column slice). The kernel reads them through their token strides: the same
    bits as with contiguous copies, and the token_stride rule says when a view can be read in place."""
    from kimi_linear.ops.triton.recurrent import token_stride

    H, K = 2, 32
    x = make_inputs(B=B, T=T, H=H, K=K, V=K, seed=28)
    packed = torch.randn(B, T, 3 * H * K + 5 + H)
    qkv = packed[..., : 3 * H * K].view(B, T, 3, H, K)
    for i, name in enumerate(("q", "k", "v")):
        qkv[:, :, i] = x[name]
    packed[..., 3 * H * K + 5 :] = x["beta"]
    q, k, v = qkv.unbind(2)
    beta = packed[..., 3 * H * K + 5 :]
    assert token_stride(q) == (packed.stride(0) if T == 1 and B > 1 else packed.stride(1) if T > 1 else H * K)
    views = fused_recurrent_kda(q, k, v, x["g"], beta, initial_state=x["initial_state"], output_final_state=True)
    copies = fused_recurrent_kda(q.contiguous(), k.contiguous(), v.contiguous(), x["g"], beta.contiguous(),
                                 initial_state=x["initial_state"], output_final_state=True)
    assert torch.equal(views[0], copies[0]) and torch.equal(views[1], copies[1])
    assert token_stride(packed.transpose(0, 1)) is None or B == 1 or T == 1
