"""Kernels built for sm_90 without a GPU (Triton's own ptxas), in a fresh process without TRITON_INTERPRET: inline
PTX that the interpreter never runs is checked here rather than on the first GPU."""

import os
import subprocess
import sys

import pytest

# The start of every build script: compile(fn, signature, constexprs) -> the compiled kernel, or exit printing
# NO-TOOLCHAIN when this Triton has no CUDA tool chain.
PREAMBLE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile(fn, sig, const, num_warps=4):
    try:
        return triton.compile(ASTSource(fn, {**sig, **{k: "constexpr" for k in const}}, const, {}),
                              target=GPUTarget("cuda", 90, 128), options=dict(num_warps=num_warps))
    except FileNotFoundError as e:          # a Triton without its CUDA tool chain
        print("NO-TOOLCHAIN", e)
        raise SystemExit(0)
"""


def build_sm90(script: str, tmp_path) -> None:
    """Run PREAMBLE + ``script`` from a file (Triton reads a kernel's source from its file); the script prints
    BUILT when its assertions on the build pass. Skips where Triton has no CUDA tool chain."""
    pytest.importorskip("triton")
    path = tmp_path / "build_sm90.py"
    path.write_text(PREAMBLE + script)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=300)
    if "NO-TOOLCHAIN" in run.stdout:
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0 and "BUILT" in run.stdout, run.stderr[-2000:]
