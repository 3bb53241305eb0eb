"""The C decode kernels' loader (kimi_linear.ops.native): the cache, the fallbacks, and the build without OpenMP."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

import kimi_linear.ops.native as native
from kimi_linear.ops.native import norm as native_norm

HAS_CC = any(shutil.which(c) for c in ("cc", "gcc", "clang"))
needs_cc = pytest.mark.skipif(not HAS_CC, reason="no C compiler on this machine: the PyTorch path runs instead")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A loader that has not loaded yet, compiling into an empty cache; the process's library is restored after."""
    monkeypatch.delitem(native._state, "lib", raising=False)
    monkeypatch.setenv("KIMI_LINEAR_CACHE", str(tmp_path))
    return tmp_path


def rms_norm_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w.double()


@needs_cc
def test_builds_once_into_the_cache_and_reuses_it(fresh, monkeypatch):
    lib = native.library()
    assert lib is not None
    built = list((fresh / "native").glob("decode-*.so"))
    assert len(built) == 1 and not list((fresh / "native").glob("*.tmp*"))
    # a second process (a fresh loader) loads the cached file without compiling
    monkeypatch.delitem(native._state, "lib")

    def no_compiler(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    assert native.library() is not None


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("KIMI_LINEAR_NATIVE", "0")
    assert native.library() is None
    x, w = torch.randn(2, 16), torch.rand(16) + 0.5
    assert native_norm.rms_norm(x, w, 1e-6) is None


def test_a_failing_compiler_warns_once_and_falls_back(fresh, monkeypatch):
    monkeypatch.setenv("CC", shutil.which("false") or "false")
    with pytest.warns(RuntimeWarning, match="could not be built"):
        assert native.library() is None
    assert native.library() is None              # remembered: no second attempt, no second warning
    from kimi_linear.ops.rms_norm import rms_norm

    x, w = torch.randn(3, 32), torch.rand(32) + 0.5
    assert (rms_norm(x, w, 1e-6).double() - rms_norm_reference(x, w, 1e-6)).abs().max() < 1e-6


@needs_cc
def test_build_without_openmp_gives_the_same_results(fresh, monkeypatch):
    """A compiler that rejects -fopenmp: the loader builds without it, and the expert products run on one core."""
    cc = next(shutil.which(c) for c in ("cc", "gcc", "clang") if shutil.which(c))
    script = fresh / "cc-no-openmp"
    script.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && exit 1; done\nexec {cc} "$@"\n')
    script.chmod(0o755)
    monkeypatch.setenv("CC", str(script))
    from kimi_linear.ops.native.moe import glu_mlp

    gen = torch.Generator().manual_seed(0)
    x, w13 = torch.randn(1, 24, generator=gen), torch.randn(40, 24, generator=gen)
    w2 = torch.randn(24, 20, generator=gen)
    got = glu_mlp(x, w13, w2)
    assert got is not None
    assert native.library() is not None and list((fresh / "native").glob("decode-*.so"))
    xd = x.double()
    gate, up = (xd @ w13.double().T).chunk(2, -1)
    want = (torch.nn.functional.silu(gate) * up) @ w2.double().T
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-5


@needs_cc
@pytest.mark.parametrize("shape", [(1, 1, 512), (3, 64), (2, 5, 7)])
def test_rms_norm_and_add_rms_norm(shape):
    gen = torch.Generator().manual_seed(1)
    x, delta = torch.randn(shape, generator=gen) * 3, torch.randn(shape, generator=gen)
    w = torch.rand(shape[-1], generator=gen) + 0.5
    got = native_norm.rms_norm(x, w, 1e-5)
    assert got is not None and got.shape == x.shape
    assert ((got.double() - rms_norm_reference(x, w, 1e-5)).abs().max()).item() < 1e-5
    s, y = native_norm.add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(s, x + delta)
    assert ((y.double() - rms_norm_reference(x + delta, w, 1e-5)).abs().max()).item() < 1e-5


def test_norm_kernels_leave_large_16_bit_and_autograd_inputs_to_pytorch():
    w = torch.rand(64) + 0.5
    assert native_norm.rms_norm(torch.randn(native_norm.MAX_ELEMENTS // 64 + 1, 64), w, 1e-6) is None
    assert native_norm.rms_norm(torch.randn(2, 64, dtype=torch.bfloat16), w.bfloat16(), 1e-6) is None
    assert native_norm.rms_norm(torch.randn(2, 64, requires_grad=True), w, 1e-6) is None
    assert native_norm.rms_norm(torch.randn(64, 2).t(), torch.rand(2), 1e-6) is None     # not contiguous


@needs_cc
def test_loading_keeps_subnormal_numbers(fresh):
    """-ffast-math would link crtfastmath, which turns on flush-to-zero in the process as the library loads
    (hypothesis then refuses to run, and every PyTorch op loses its subnormals). A new process, built afresh."""
    code = (
        "import sys, torch\n"
        "import kimi_linear.ops.native as n\n"
        "assert n.library() is not None\n"
        "tiny = torch.tensor([1e-40], dtype=torch.float32)\n"
        "print(float(tiny * 1.5) > 0, 5e-324 * 1.0 > 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"]


@needs_cc
def test_an_unwritable_cache_falls_back_to_a_temporary_folder(fresh, monkeypatch, tmp_path):
    """A cache path that cannot be made (its parent is a file; root ignores permissions): the library is built in
    the per-user temporary folder instead, without a warning."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("KIMI_LINEAR_CACHE", str(tmp_path / "file" / "cache"))
    monkeypatch.setattr(native.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lib = native.library()
    assert lib is not None
    assert list((tmp_path / "tmp").glob("kimi_linear-*/native/decode-*.so"))
