"""Programmatic dependent launch (ops/triton/pdl.py): never applies off a CUDA sm_90+ device, so the interpreter
and CPU paths launch every kernel exactly as before."""

import torch

from kimi_linear.ops.triton import pdl

from .sm90 import build_sm90


def test_pdl_off_on_cpu_even_when_enabled(monkeypatch):
    assert pdl.pdl_args(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.pdl_args(torch.device("cpu")) == {"PDL": False}


def test_pdl_never_enabled_under_the_interpreter(monkeypatch):
    import importlib

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    try:
        assert importlib.reload(pdl).ENABLED is False
    finally:
        monkeypatch.undo()
        importlib.reload(pdl)


def test_prefetch_only_with_pdl_and_a_layout_that_allows_it(monkeypatch):
    assert pdl.prefetch_args(torch.device("cpu")) == {"PREFETCH": False}
    monkeypatch.setattr(pdl, "pdl_args", lambda device: {"PDL": True, "launch_pdl": True})
    assert pdl.prefetch_args(torch.device("cpu")) == {"PREFETCH": True}
    assert pdl.prefetch_args(torch.device("cpu"), on=False) == {"PREFETCH": False}


BUILD_SM90 = """
from kimi_linear.ops.triton.moe import router_logits_kernel

sig = dict(x="*bf16", w="*fp32", logits="*fp32", N="i32", E="i32", D="i32", s_xn="i64", s_we="i64", nxt="*u8",
           n_nxt="i64", c_nxt="i64")
ck = compile(router_logits_kernel, sig, dict(BN=4, BE=2, BK=1024, PDL=True, PREFETCH=True))
# two prefetches: the program's router rows, then its share of the tensor the step reads next
assert ck.asm["ptx"].count("cp.async.bulk.prefetch.L2.global") == 2 and len(ck.asm["cubin"]) > 0
print("BUILT")
"""


def test_router_prefetch_builds_for_sm90(tmp_path):
    """The L2 prefetch is inline PTX that the interpreter never runs: build the router kernel with it for sm_90
    (tests/ops/sm90.py), so a syntax or operand error fails here rather than on the first GPU."""
    build_sm90(BUILD_SM90, tmp_path)


def test_prefetch_shares_cover_the_tensor_once():
    """Each program's share of a tensor asked into L2: 16-byte pieces that cover [0, nbytes) exactly."""
    for nbytes, programs in [(9_437_184, 16), (16, 16), (48, 5), (4_718_592, 7), (0, 3)]:
        share = pdl.prefetch_share(nbytes, programs)
        pieces = [(p * share, min((p + 1) * share, nbytes)) for p in range(programs) if p * share < nbytes]
        assert share % 16 == 0 and all((b - a) % 16 == 0 and b > a for a, b in pieces)
        assert sum(b - a for a, b in pieces) == nbytes and all(x[1] == y[0] for x, y in zip(pieces, pieces[1:]))


def test_prefetch_plan_views_the_tensor_or_asks_nothing():
    """A launch's (nxt, n_nxt, c_nxt): a byte view of the whole tensor and one program's share; the launch's own
    tensor and zero bytes for None, a strided view or a start off 16 bytes (nothing is asked for then)."""
    idle = torch.empty(4)
    w = torch.randn(48, 40, dtype=torch.bfloat16)
    nxt, n, c = pdl.prefetch_plan(w, 7, idle)
    assert nxt.dtype == torch.uint8 and nxt.data_ptr() == w.data_ptr() and nxt.numel() == n == 48 * 40 * 2
    assert c == pdl.prefetch_share(n, 7)
    for t in (None, w.t(), w.reshape(-1)[4:-4]):          # strided; 8 bytes off (its size a multiple of 16)
        got = pdl.prefetch_plan(t, 7, idle)
        assert got[0] is idle and got[1:] == (0, 0)


BUILD_CONV_SM90 = """
from kimi_linear.ops.triton.conv import short_conv_decode_kernel

sig = dict(x="*bf16", w="*bf16", pool="*bf16", index="*i64", y="*bf16", C="i32", sx="i64", sp="i64", nxt="*u8",
           n_nxt="i64", c_nxt="i64")
for pre in (False, True):          # the KDA layer's decode conv, with and without o_proj's L2 prefetch
    ck = compile(short_conv_decode_kernel, sig, dict(W=4, WP=4, BC=512, PDL=True, PREFETCH=pre))
    assert ck.asm["ptx"].count("cp.async.bulk.prefetch.L2.global") == int(pre) and len(ck.asm["cubin"]) > 0
print("BUILT")
"""


def test_conv_decode_prefetch_builds_for_sm90(tmp_path):
    build_sm90(BUILD_CONV_SM90, tmp_path)
