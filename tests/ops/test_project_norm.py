"""A decode step's output projection folded into the residual add + RMSNorm (ops.project_add_rms_norm): the
split-K partial sums against float64, the Triton kernels (under the interpreter) against the PyTorch path (the
projection, then add_rms_norm), the decoder layer's fold against its unfolded path, the dispatch and the sm_90
build of both kernels."""

import importlib

import pytest
import torch
import torch.nn.functional as F

import kimi_linear.ops.rms_norm as rms_op
from kimi_linear.ops.rms_norm import add_rms_norm, project_add_rms_norm

from .triton_cases import poison_empty  # noqa: F401  (autouse fixture)

EPS = 1e-6


def triton_rms_norm():
    """The Triton module (the package's ``rms_norm`` function shadows the submodule's name)."""
    pytest.importorskip("triton")
    return importlib.import_module("kimi_linear.ops.triton.rms_norm")


def case(M, D, K, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (3.0 * torch.randn(M, D, generator=gen)).to(dtype)
    o = torch.randn(M, K, generator=gen).to(dtype)
    w_o = (torch.randn(D, K, generator=gen) / K**0.5).to(dtype)
    w = (1.0 + 0.3 * torch.randn(D, generator=gen)).to(dtype)
    return x, o, w_o, w


@pytest.mark.parametrize("tma", [True, False], ids=["descriptor", "pointers"])
@pytest.mark.parametrize("M, N, K", [(1, 64, 300), (5, 100, 1000), (16, 70, 128)])
def test_split_k_partials_sum_to_the_product(M, N, K, tma, monkeypatch):
    """Weight tiles through the TMA descriptor (zero past N and K) and by pointers (masked)."""
    pytest.importorskip("triton")
    from kimi_linear.ops.triton import splitk

    made = []
    real = splitk.weight_descriptor
    monkeypatch.setattr(splitk, "weight_descriptor", lambda w: made.append(1) or (real(w) if tma else None))
    _, o, w_o, _ = case(M, N, K, torch.float32)
    p = splitk.split_k_partials(o, w_o)
    assert made and (not tma or real(w_o) is not None)            # the descriptor path really taken
    assert p.dtype == torch.float32 and p.shape[1:] == (M, N)
    assert p.shape[0] > 1 or K <= 128                       # the reduction really is split (4 "SMs" on a CPU)
    want = o.double() @ w_o.double().t()
    assert (p.double().sum(0) - want).abs().max() < 1e-5 * want.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M, D, K", [(1, 96, 300), (7, 64, 512), (16, 40, 129)])
def test_triton_matches_torch_path(dtype, M, D, K):
    pytest.importorskip("triton")
    tri = triton_rms_norm()

    x, o, w_o, w = case(M, D, K, dtype)
    s, y = tri.project_add_rms_norm(x, o, w_o, w, EPS)
    # the reference rounds the exact projection to the dtype, as the kernels round their float32 partial sums
    s_ref, y_ref = add_rms_norm(x, F.linear(o.double(), w_o.double()).to(dtype), w, EPS)
    # bars of the largest element: float32 a K-term sum's rounding; bf16 a rounding of the projection (its float32
    # sums in another order) or of the sum moved by one ulp
    tol = 1e-5 if dtype == torch.float32 else 2.0**-7
    for got, ref in ((s, s_ref), (y, y_ref)):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert (got.double() - ref.double()).abs().max() <= tol * ref.double().abs().max()


def test_dispatch_and_bad_arguments(monkeypatch):
    tri = triton_rms_norm()

    calls = []
    monkeypatch.setattr(rms_op, "triton_op", lambda name, x: (lambda *a: calls.append(name) or getattr(tri, name)(*a)))
    x, o, w_o, w = case(3, 64, 256, torch.float32)
    project_add_rms_norm(x, o, w_o, w, EPS)
    assert calls == ["project_add_rms_norm"] and rms_op.project_fused(x, w_o, w)
    big = case(17, 64, 256, torch.float32)                   # more rows than the kernel's block: the separate path
    project_add_rms_norm(*big, EPS)
    assert calls == ["project_add_rms_norm", "add_rms_norm"] and not rms_op.project_fused(big[0], big[2], big[3])
    with pytest.raises(ValueError, match="project_add_rms_norm"):
        project_add_rms_norm(x, o[:, :-1], w_o, w, EPS)
    with pytest.raises(ValueError, match="project_add_rms_norm"):
        project_add_rms_norm(x, o.double(), w_o, w, EPS)
    monkeypatch.setattr(rms_op, "triton_op", lambda name, x: None)     # a CPU without the kernels: no fold
    assert not rms_op.project_fused(x, w_o, w)


def test_decoder_layers_fold_the_projection_on_decode_steps(monkeypatch):
    """The tiny model with the kernels (interpreter): every layer of a decode step folds its output projection,
    and the logits equal the unfolded path's (float32, 1e-5 of the largest)."""
    import kimi_linear.model.modeling as modeling
    tri = triton_rms_norm()
    from kimi_linear.model import KimiLinearForCausalLM
    from kimi_linear.model.config import preset_config

    kernels = {"project_add_rms_norm": tri.project_add_rms_norm, "add_rms_norm": tri.add_rms_norm}
    monkeypatch.setattr(rms_op, "triton_op", lambda name, x: kernels.get(name))
    model = KimiLinearForCausalLM(preset_config("tiny"))
    model.init_weights(0)
    model.eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    folds = []
    fold = modeling.project_add_rms_norm
    monkeypatch.setattr(modeling, "project_add_rms_norm", lambda *a: folds.append(1) or fold(*a))

    def step_logits():
        with torch.inference_mode():
            cache = model.new_cache(2)
            model(ids[:, :4], cache=cache)
            return model(ids[:, 4:], cache=cache).logits

    folds.clear()
    folded = step_logits()
    assert len(folds) >= 2 * len(model.model.layers)                      # prompt (8 rows) and step (2 rows)
    monkeypatch.setattr(modeling, "project_fused", lambda *a: False)
    plain = step_logits()
    assert (folded - plain).abs().max() <= 1e-5 * plain.abs().max()


BUILD_SM90 = """
from kimi_linear.ops.triton.rms_norm import rms_norm_kernel
from kimi_linear.ops.triton.splitk import BK, BM, BN, split_k_kernel

for d_w, tma in ((f"tensordesc<bf16[{BN}, {BK}]>", True), ("*bf16", False)):
    sig = dict(x="*bf16", w="*bf16", d_w=d_w, p="*fp32", M="i32", N="i32", K="i32", KS="i32", s_xm="i64",
               s_wn="i64")
    const = dict(BM=BM, BN=BN, BK=BK, PREC="tf32", TMA=tma, PDL=True)
    assert len(compile(split_k_kernel, sig, const).asm["cubin"]) > 0
sig = dict(x="*bf16", delta="*fp32", w="*bf16", y="*bf16", s="*bf16", dst="*bf16", N="i32", sx="i64", sd="i64",
           sy="i64", eps="fp32", sp="i64")
const = dict(D=2304, BR=1, BD=4096, HAS_DELTA=True, SCATTER=False, TAIL=0, BT=1, PARTS=8, PDL=True)
assert len(compile(rms_norm_kernel, sig, const).asm["cubin"]) > 0
print("BUILT")
"""


def test_kernels_build_for_sm90(tmp_path):
    from .sm90 import build_sm90

    build_sm90(BUILD_SM90, tmp_path)
