"""The KDA layer's pooled decode tokens with the gates' up-projections folded into the recurrent kernel
(kimi_linear.ops.recurrent.kda_decode_step; Triton interpreter, dispatched as on a GPU) against the same layer in
float64 through its PyTorch ops: outputs, the pool rows' conv windows and memories, the rows no sequence names left
untouched, every gate regime (strong decay, saturated gates, K3's bounded gate), padding rows on a shared scratch
slot, gate rank 64 (two of the kernel's 32-column steps), bf16; and that the folded kernel really ran (or not,
above FOLD_GATE_ROWS rows and with the full-rank output gate). Bars (relative, norm-wise): float32 2e-5 (outputs
and memories), 1e-6 (windows); bf16 2e-2."""

from __future__ import annotations

import copy

import pytest
import torch

import kimi_linear.layers.kda as kda_module
from kimi_linear.layers.kda import KDAState, PooledKDAState

from .test_layers import rel_err
from .test_native_decode import kda_layer


@pytest.fixture
def folded_runs(monkeypatch):
    """``on()`` sends CPU tensors to the Triton kernels (interpreter) from then on; the list counts the rows of each
    folded decode step."""
    calls = []
    inner = kda_module.kda_decode_step

    def counted(q, *args, **kwargs):
        calls.append(q.shape[0])
        return inner(q, *args, **kwargs)

    monkeypatch.setattr(kda_module, "kda_decode_step", counted)
    return lambda: monkeypatch.setenv("KIMI_LINEAR_BACKEND", "triton"), calls


def pooled_run(m, x, conv_pool, rec_pool, index, pad=0):
    """Decode x [B, T, D] token by token on pool rows ``index`` (plus ``pad`` padding rows on the last slot):
    outputs [B, T, D] of the live rows; the pools are updated in place."""
    B = x.shape[0]
    slots = torch.cat([index, torch.full((pad,), conv_pool.shape[0] - 1)])
    state = PooledKDAState(conv_pool, rec_pool, slots)
    gen = torch.Generator().manual_seed(99)
    outs = []
    with torch.no_grad():
        for t in range(x.shape[1]):
            xt = torch.cat([x[:, t : t + 1], torch.randn(pad, 1, x.shape[-1], generator=gen).to(x.dtype)])
            outs.append(m(xt, state)[:B])
    return torch.cat(outs, 1)


def reference(m, x, conv_pool, rec_pool, index):
    """The float64 layer (PyTorch ops) from the same pool rows; memories stay float32 as the ops keep them."""
    ref = copy.deepcopy(m).double()
    state = KDAState(conv_pool[index].double(), rec_pool[index].clone())
    with torch.no_grad():
        out = torch.cat([ref(x[:, t : t + 1].double(), state) for t in range(x.shape[1])], 1)
    return out, state


@pytest.mark.parametrize("regime,lower_bound,full_rank", [
    ("init", None, False), ("strong", None, False), ("saturated", None, False), ("slow", None, False),
    ("saturated", -5.0, False), ("init", -5.0, True),
])
@pytest.mark.parametrize("B,pad", [(1, 0), (3, 2)])
def test_folded_decode_matches_float64(folded_runs, regime, lower_bound, full_rank, B, pad):
    on, calls = folded_runs
    m = kda_layer(regime, lower_bound, full_rank)
    gen = torch.Generator().manual_seed(5)
    slots = B + 3
    conv_pool, rec_pool = torch.randn(slots, 3, 144, generator=gen), torch.randn(slots, 3, 16, 16, generator=gen) * 0.3
    index = torch.randperm(slots - 1, generator=gen)[:B]
    x = torch.randn(B, 4, 48, generator=gen)
    want, state64 = reference(m, x, conv_pool, rec_pool, index)
    on()
    got_conv, got_rec = conv_pool.clone(), rec_pool.clone()
    got = pooled_run(m, x, got_conv, got_rec, index, pad)
    assert calls == ([] if full_rank else [B + pad] * 4)     # the full-rank output gate has nothing to fold
    assert rel_err(got, want) < 2e-5
    assert rel_err(got_rec[index], state64.recurrent) < 2e-5
    assert rel_err(got_conv[index], state64.conv) < 1e-6
    others = [s for s in range(slots - 1) if s not in index.tolist()]   # the last slot: the padding rows' scratch
    assert torch.equal(got_rec[others], rec_pool[others]) and torch.equal(got_conv[others], conv_pool[others])


def test_folded_decode_rank_64_and_above_the_row_limit(folded_runs, monkeypatch):
    """Gate rank 64 folded; then the same steps with FOLD_GATE_ROWS below the batch take the batched product (the
    folded kernel does not run) and agree as well."""
    on, calls = folded_runs
    m = kda_layer("init", head_dim=64)
    gen = torch.Generator().manual_seed(8)
    conv_pool, rec_pool = torch.randn(4, 3, 384, generator=gen), torch.randn(4, 2, 64, 64, generator=gen) * 0.1
    index = torch.tensor([2, 0])
    x = torch.randn(2, 3, 48, generator=gen)
    want, state64 = reference(m, x, conv_pool, rec_pool, index)
    on()
    got_rec = rec_pool.clone()
    got = pooled_run(m, x, conv_pool.clone(), got_rec, index)
    assert calls == [2] * 3
    assert rel_err(got, want) < 2e-5 and rel_err(got_rec[index], state64.recurrent) < 2e-5
    monkeypatch.setattr(kda_module, "FOLD_GATE_ROWS", 1)
    got_rec = rec_pool.clone()
    got = pooled_run(m, x, conv_pool.clone(), got_rec, index)
    assert calls == [2] * 3
    assert rel_err(got, want) < 2e-5 and rel_err(got_rec[index], state64.recurrent) < 2e-5


def test_folded_decode_bf16(folded_runs):
    """bf16 activations and conv pool, float32 memory: within bf16's bar of the float64 layer."""
    on, calls = folded_runs
    m = kda_layer("init")
    b = copy.deepcopy(m).bfloat16()
    gen = torch.Generator().manual_seed(6)
    conv_pool, rec_pool = torch.randn(4, 3, 144, generator=gen), torch.randn(4, 3, 16, 16, generator=gen) * 0.3
    index = torch.tensor([2, 0])
    x = torch.randn(2, 3, 48, generator=gen)
    want, state64 = reference(m, x, conv_pool, rec_pool, index)
    on()
    got_rec = rec_pool.clone()
    got = pooled_run(b, x.bfloat16(), conv_pool.bfloat16(), got_rec, index)
    assert calls == [2] * 3
    assert got.dtype == torch.bfloat16 and rel_err(got.float(), want) < 2e-2
    assert rel_err(got_rec[index], state64.recurrent) < 2e-2


def test_kda_decode_step_names_a_misshaped_argument(folded_runs):
    from kimi_linear.ops.recurrent import kda_decode_step

    on, _ = folded_runs
    on()
    B, H, K, R = 2, 2, 8, 4
    args = dict(q=torch.randn(B, 1, H, K), k=torch.randn(B, 1, H, K), v=torch.randn(B, 1, H, K),
                f_a=torch.randn(B, 1, R), g_a=torch.randn(B, 1, R), beta=torch.randn(B, 1, H),
                w_f=torch.randn(H * K, R), w_g=torch.randn(H * K, R), pool=torch.zeros(3, H, K, K),
                rows=torch.tensor([0, 1]), scale=K**-0.5, A_log=torch.zeros(H), dt_bias=torch.zeros(H * K),
                lower_bound=None)
    with pytest.raises(ValueError, match="`w_g` must be"):
        kda_decode_step(**{**args, "w_g": torch.randn(H * K, R + 1)})
    with pytest.raises(ValueError, match="`rows` must be"):
        kda_decode_step(**{**args, "rows": torch.tensor([0])})
