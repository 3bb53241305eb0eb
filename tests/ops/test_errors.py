"""Bad input gets a ValueError or TypeError that names the argument; nothing is silently broadcast."""

import pytest
import torch

from kimi_linear.ops import chunk_gated_delta_rule, chunk_kda, fused_kda_gate, fused_recurrent_kda

from .kda_cases import make_inputs

OPS = [chunk_kda, fused_recurrent_kda]


def args(**overrides):
    x = make_inputs(B=2, T=9, H=2, HV=4, K=8, V=4)
    x.update(overrides)
    return x


def call(op, x, **kw):
    return op(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"], **kw)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    "name, bad, exc",
    [
        ("k", torch.randn(2, 9, 2, 7), ValueError),                 # mismatched with q
        ("q", torch.randn(2, 9, 8), ValueError),                    # missing head dim
        ("v", torch.randn(2, 8, 4, 4), ValueError),                 # wrong T
        ("v", torch.randn(2, 9, 3, 4), ValueError),                 # HV not a multiple of H
        ("g", torch.randn(2, 9, 2, 8), ValueError),                 # g per q/k head, not per value head
        ("g", torch.randn(2, 9, 4), ValueError),                    # scalar gate given to KDA
        ("beta", torch.randn(2, 9, 4, 1), ValueError),              # extra dimension
        ("beta", torch.randn(2, 9, 2), ValueError),                 # per q/k head
        ("initial_state", torch.randn(2, 4, 8, 4, dtype=torch.float64), TypeError),
        ("initial_state", torch.randn(1, 4, 8, 4), ValueError),     # wrong N
        ("q", torch.randint(0, 3, (2, 9, 2, 8)), TypeError),        # integer input
        ("v", [[1.0]], TypeError),
    ],
)
def test_bad_tensor_is_named(op, name, bad, exc):
    with pytest.raises(exc, match=f"`{name}`"):
        call(op, args(**{name: bad}))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    "cu, B, message",
    [
        (torch.tensor([0, 4, 9]), 2, "B == 1"),
        (torch.tensor([1, 4, 9]), 1, "start at 0"),
        (torch.tensor([0, 5, 4, 9]), 1, "non-decreasing"),
        (torch.tensor([0, 4, 8]), 1, "end at"),
        (torch.tensor([0.0, 9.0]), 1, "int32 or int64"),
        (torch.tensor([[0, 9]]), 1, "1-D"),
    ],
)
def test_bad_cu_seqlens(op, cu, B, message):
    x = make_inputs(B=B, T=9, H=2, K=8, V=4, initial_state=False)
    with pytest.raises((ValueError, TypeError), match=message) as info:
        call(op, x, cu_seqlens=cu)
    assert "cu_seqlens" in str(info.value)


def test_gate_parameters_are_checked():
    x = args()
    with pytest.raises(ValueError, match="`A_log`"):
        call(chunk_kda, x, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="`A_log`"):
        call(chunk_kda, x, use_gate_in_kernel=True, A_log=torch.randn(3))
    with pytest.raises(ValueError, match="`dt_bias`"):
        call(chunk_kda, x, use_gate_in_kernel=True, A_log=torch.randn(4), dt_bias=torch.randn(4))
    with pytest.raises(ValueError, match="`lower_bound`"):
        call(chunk_kda, x, use_gate_in_kernel=True, A_log=torch.randn(4), lower_bound=2.0)
    with pytest.raises(ValueError, match="use_gate_in_kernel"):
        call(chunk_kda, x, A_log=torch.randn(4))
    with pytest.raises(ValueError, match="`g`"):
        fused_kda_gate(torch.randn(8), torch.randn(1))


def test_state_indices_are_checked():
    pool = torch.zeros(5, 4, 8, 4)
    with pytest.raises(ValueError, match="`state_indices`"):
        call(fused_recurrent_kda, args(initial_state=pool), state_indices=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="`state_indices`"):
        call(fused_recurrent_kda, args(initial_state=pool), state_indices=torch.tensor([0, 1, 2]))
    with pytest.raises(TypeError, match="`state_indices`"):
        call(fused_recurrent_kda, args(initial_state=pool), state_indices=torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="`initial_state`"):
        call(fused_recurrent_kda, args(initial_state=None), state_indices=torch.tensor([0, 1]))


def test_scalar_gate_for_gated_delta_rule_is_checked():
    x = args()
    with pytest.raises(ValueError, match="`g`"):
        chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"])
