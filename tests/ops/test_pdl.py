"""Programmatic dependent launch (ops/triton/pdl.py): never applies off a CUDA sm_90+ device, so the interpreter
and CPU paths launch every kernel exactly as before."""

import torch

from kimi_linear.ops.triton import pdl


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
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kimi_linear.ops.triton.moe import router_logits_kernel

sig = dict(x="*bf16", w="*fp32", logits="*fp32", N="i32", E="i32", D="i32", s_xn="i64", s_we="i64")
const = dict(BN=4, BE=2, BK=1024, PDL=True, PREFETCH=True)
try:
    ck = triton.compile(ASTSource(router_logits_kernel, {**sig, **{k: "constexpr" for k in const}}, const, {}),
                        target=GPUTarget("cuda", 90, 128), options=dict(num_warps=4))
except FileNotFoundError as e:          # a Triton without its CUDA tool chain
    print("NO-TOOLCHAIN", e)
    raise SystemExit(0)
assert "cp.async.bulk.prefetch.L2.global" in ck.asm["ptx"] and len(ck.asm["cubin"]) > 0
print("BUILT")
"""


def test_router_prefetch_builds_for_sm90():
    """The L2 prefetch is inline PTX that the interpreter never runs: build the router kernel with it for sm_90
    (compiled, not interpreted: a fresh process without TRITON_INTERPRET; Triton's own ptxas, no GPU needed), so a
    syntax or operand error fails here rather than on the first GPU."""
    import os
    import subprocess
    import sys

    import pytest

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", BUILD_SM90], env=env, capture_output=True, text=True, timeout=300)
    if "NO-TOOLCHAIN" in run.stdout:
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0 and "BUILT" in run.stdout, run.stderr[-2000:]
