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
