"""The KDA layer's decode tokens on a serving pool through the fused Triton kernel (kimi_linear.ops.kda_decode,
under the interpreter, dispatched as on a GPU) against the same layer in float64 through its PyTorch ops: outputs,
the pool rows' conv windows and memories, the rows no sequence names left untouched, strong decay, saturated
gates, K3's bounded gate, the full-rank output gate, padding rows on a shared scratch slot, bf16; and that the
kernel really ran. Bars (relative, norm-wise): float32 2e-5 (outputs and memories), 1e-6 (windows); bf16 2e-2."""

from __future__ import annotations

import copy

import pytest
import torch

import kimi_linear.layers.kda as kda_module
import kimi_linear.ops.decode as decode_module
from kimi_linear.layers.kda import KDAState, PooledKDAState

from .test_layers import rel_err
from .test_native_decode import kda_layer


@pytest.fixture
def triton_runs(monkeypatch):
    """Sends CPU tensors to the Triton kernels (interpreter) for the calls made after ``on()``; counts the fused
    kernel's calls."""
    calls = []
    inner = decode_module.triton_op

    def spy(name, x):
        fast = inner(name, x)
        if name != "kda_decode" or fast is None:
            return fast

        def counted(*args, **kwargs):
            calls.append(args[0].shape[0])
            return fast(*args, **kwargs)
        return counted

    monkeypatch.setattr(decode_module, "triton_op", spy)
    return lambda: monkeypatch.setenv("KIMI_LINEAR_BACKEND", "triton"), calls


def pooled_run(m, x, conv_pool, rec_pool, index, pad=0):
    """Decode x [B, T, D] token by token on pool rows ``index`` (plus ``pad`` padding rows on the last slot):
    outputs [B, T, D] of the live rows, and the pools after."""
    B = x.shape[0]
    slots = torch.cat([index, torch.full((pad,), conv_pool.shape[0] - 1)])
    state = PooledKDAState(conv_pool, rec_pool, slots)
    outs = []
    with torch.no_grad():
        for t in range(x.shape[1]):
            xt = torch.cat([x[:, t : t + 1], torch.randn(pad, 1, x.shape[-1], dtype=x.dtype)])
            outs.append(m(xt, state)[:B])
    return torch.cat(outs, 1)


@pytest.mark.parametrize("regime,lower_bound,full_rank", [
    ("init", None, False), ("strong", None, False), ("saturated", None, False), ("slow", None, False),
    ("init", -5.0, True), ("saturated", -5.0, False),
])
@pytest.mark.parametrize("B,pad,fold", [(1, 0, True), (3, 2, True), (3, 2, False)])
def test_fused_decode_matches_float64(triton_runs, monkeypatch, regime, lower_bound, full_rank, B, pad, fold):
    """fold: the kernel up-projects the low-rank gates itself (small batches); else it is given them."""
    on, calls = triton_runs
    if not fold:
        monkeypatch.setattr(kda_module, "FOLD_GATE_ROWS", 0)
    m = kda_layer(regime, lower_bound, full_rank)
    ref = copy.deepcopy(m).double()
    gen = torch.Generator().manual_seed(5)
    slots = B + 3
    conv_pool, rec_pool = torch.randn(slots, 3, 144, generator=gen), torch.randn(slots, 3, 16, 16, generator=gen) * 0.3
    index = torch.randperm(slots - 1, generator=gen)[:B]
    x = torch.randn(B, 4, 48, generator=gen)
    state64 = KDAState(conv_pool[index].double(), rec_pool[index].clone())        # (the op keeps memories float32)
    with torch.no_grad():
        want = torch.cat([ref(x[:, t : t + 1].double(), state64) for t in range(4)], 1)
    on()
    got_conv, got_rec = conv_pool.clone(), rec_pool.clone()
    got = pooled_run(m, x, got_conv, got_rec, index, pad)
    assert calls == [B + pad] * 4                     # the fused kernel ran every step
    assert rel_err(got, want) < 2e-5
    assert rel_err(got_rec[index], state64.recurrent) < 2e-5
    assert rel_err(got_conv[index], state64.conv) < 1e-6
    others = [s for s in range(slots - 1) if s not in index.tolist()]   # the last slot: the padding rows' scratch
    assert torch.equal(got_rec[others], rec_pool[others]) and torch.equal(got_conv[others], conv_pool[others])


def test_fused_decode_folds_wide_gates(triton_runs):
    """Heads of 64 channels (gate rank 64: two of the kernel's 32-column steps per up-projection) and a carried
    pool state, folded gates, against the float64 layer."""
    on, calls = triton_runs
    m = kda_layer("init", head_dim=64)
    ref = copy.deepcopy(m).double()
    gen = torch.Generator().manual_seed(8)
    conv_pool, rec_pool = torch.randn(3, 3, 384, generator=gen), torch.randn(3, 2, 64, 64, generator=gen) * 0.1
    index = torch.tensor([1])
    x = torch.randn(1, 3, 48, generator=gen)
    state64 = KDAState(conv_pool[index].double(), rec_pool[index].clone())
    with torch.no_grad():
        want = torch.cat([ref(x[:, t : t + 1].double(), state64) for t in range(3)], 1)
    on()
    got_rec = rec_pool.clone()
    got = pooled_run(m, x, conv_pool.clone(), got_rec, index)
    assert calls == [1] * 3
    assert rel_err(got, want) < 2e-5 and rel_err(got_rec[index], state64.recurrent) < 2e-5


def test_fused_decode_bf16(triton_runs):
    """bf16 activations and conv pool, float32 memory: within bf16's bar of the float64 layer."""
    on, calls = triton_runs
    m = kda_layer("init")
    ref = copy.deepcopy(m).double()
    b = copy.deepcopy(m).bfloat16()
    gen = torch.Generator().manual_seed(6)
    conv_pool, rec_pool = torch.randn(4, 3, 144, generator=gen), torch.randn(4, 3, 16, 16, generator=gen) * 0.3
    index = torch.tensor([2, 0])
    x = torch.randn(2, 3, 48, generator=gen)
    state64 = KDAState(conv_pool[index].double(), rec_pool[index].clone())
    with torch.no_grad():
        want = torch.cat([ref(x[:, t : t + 1].double(), state64) for t in range(3)], 1)
    on()
    got_rec = rec_pool.clone()
    got = pooled_run(b, x.bfloat16(), conv_pool.bfloat16(), got_rec, index)
    assert calls == [2] * 3
    assert got.dtype == torch.bfloat16 and rel_err(got.float(), want) < 2e-2
    assert rel_err(got_rec[index], state64.recurrent) < 2e-2


def test_fused_decode_declines_without_a_pool(triton_runs):
    """A per-sequence state (rows None) keeps the PyTorch ops on the Triton backend: the kernel updates pools in
    place only."""
    on, calls = triton_runs
    m = kda_layer("init")
    x = torch.randn(2, 1, 48)
    on()
    with torch.no_grad():
        m(x, m.empty_state(2, torch.float32, x.device))
    assert calls == []


def test_kda_decode_names_a_misshaped_argument():
    from kimi_linear.ops import kda_decode

    H, D, W = 2, 8, 4
    C = 3 * H * D
    args = dict(qkv=torch.randn(2, 1, C), g=torch.randn(2, 1, H, D), gate=torch.randn(2, 1, H, D),
                beta=torch.randn(2, 1, H), conv_weight=torch.randn(W, C), window=torch.randn(3, W - 1, C),
                memory=torch.randn(3, H, D, D), A_log=torch.zeros(H), dt_bias=torch.zeros(H * D), lower_bound=None,
                norm_weight=torch.ones(D), norm_eps=1e-5, scale=D**-0.5)
    with pytest.raises(ValueError, match="`memory` must be"):
        kda_decode(**{**args, "memory": torch.randn(3, H, D, D + 1)}, rows=torch.tensor([2, 0]))
    with pytest.raises(ValueError, match="`window` must be"):
        kda_decode(**{**args, "window": torch.randn(3, W, C)}, rows=torch.tensor([2, 0]))


BUILD_SM90 = """
import os, re, subprocess, tempfile

from kimi_linear.ops.triton.decode import kda_decode_kernel

sig = dict(qkv="*bf16", g="*bf16", gate="*bf16", beta="*bf16", conv_w="*bf16", window="*bf16", memory="*fp32",
           rows="*i64", A_log="*fp32", dt_bias="*fp32", norm_w="*fp32", w_f="*bf16", w_g="*bf16", o="*bf16",
           s_x="i64", s_g="i64", s_o="i64", s_b="i64", scale="fp32", lower_bound="fp32", eps="fp32")
tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
for lb, fold in ((False, False), (True, False), (False, True)):
    ck = compile(kda_decode_kernel, sig, dict(H=32, D=128, W=4, WP=4, BD=128, R=128, BR=32, FOLD_F=fold,
                                              FOLD_G=fold, USE_LOWER_BOUND=lb, PDL=True), num_warps=8)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        use = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", f.name],
                             capture_output=True, text=True).stdout
    found = re.search(r"REG:(\\d+) STACK:(\\d+)", use)
    print(found.group(0))
    assert int(found.group(2)) == 0, use
print("BUILT")
"""


def test_kernel_builds_for_sm90_without_spills(tmp_path):
    """The kernel as the 48B shape launches it (32 heads of 128, a [128, 128] float32 memory in registers over 8
    warps; gates given or up-projected from rank 128), built for sm_90: it compiles, and nothing spills."""
    from ..ops.sm90 import build_sm90

    build_sm90(BUILD_SM90, tmp_path)
