"""CPU kernels in C for a decode step's rows (``decode.c``), compiled on first use and called through ctypes.

Why: on a CPU a decode step of a small model is bound by per-op overhead. Every PyTorch op costs 3-20 us there
(2-3x more right after a projection streamed a cold weight through the caches), a call through ctypes 1-3 us; the
KDA layer's step between its input and output projections is ~65 ops, a MoE layer's ~57 (BENCHMARKS.md, "The
model on a CPU"). For up to a few rows a KDA or MLA decoder layer's whole attention half (input norm,
projections, the step, output projection, residual add and next norm) is one call (:mod:`.kda`, :mod:`.mla`), its
products plain loops that stream the weights as fast as BLAS; past those rows the projections stay BLAS products
(:func:`kimi_linear.layers.linear.linear`) and the KDA call replaces the ops between them. The MoE layer and the
dense MLP are one call each (:mod:`.moe`), the residual stream's norms too (:mod:`.norm`).

The source is compiled once per machine with the system C compiler (``$CC``, else ``cc``; ``-O3 -march=native``,
reassociated sums, no ``-ffast-math``; OpenMP when the compiler has it) into ``$KIMI_LINEAR_CACHE`` (default
``~/.cache/kimi_linear``; a per-user temporary folder when that cannot be written), keyed by the source, the
compiler, the flags and the CPU, written under a temporary name and renamed, so concurrent processes never load a
partial file. Without a compiler, or when compiling fails (one warning says why), :func:`library` returns None and
every caller keeps its PyTorch path, which is also the reference the kernels are tested against.
``KIMI_LINEAR_NATIVE=0`` turns the kernels off (read at every call: to compare the two paths).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("decode.c")
# Reassociation (vectorised sums) without -ffast-math: that flag (and -funsafe-math-optimizations) also links
# crtfastmath, whose constructor turns on flush-to-zero for the whole process when the library loads, and every
# PyTorch op after it would lose its subnormal numbers. Unrolling with several partial sums per dot product (the
# variable expansion) keeps the FMA units busy instead of waiting on one sum's latency: a MoE layer of the small
# preset on 8 rows 0.81 -> 0.62 ms (A/B in one process, Intel box, 2 threads), one row unchanged.
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros", "-fassociative-math",
         "-funroll-loops", "-fvariable-expansion-in-unroller", "-std=c11", "-shared", "-fPIC")

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
SIGNATURES = {
    "rms_norm_f32": [_P, _I64, _P, _F32, _I64, _I64, _P],
    "add_rms_norm_f32": [_P, _P, _P, _F32, _I64, _I64, _P, _P],
    "kda_decode_f32": [_I64, _I64, _I64, _I64, _I64, _P, _I64, _P, _I64, _P, _I64, _P, _I64, _P, _P, _P, _P, _P, _P,
                       _P, _P, _I32, _F32, _P, _F32, _F32, _P, _I32],
    "kda_block_decode_f32": [_I64] * 7 + [_P, _P, _F32] + [_P, _I64, _I64] * 3 + [_P] * 6 + [_P, _P, _I32, _F32]
                            + [_P, _F32, _F32] + [_P, _I64, _I64, _P, _F32] + [_P, _P, _I32],
    "mla_block_decode_f32": [_I64] * 7 + [_P, _P, _F32] + [_P, _I64, _I64, _P, _F32] + [_P, _I64, _I64, _F32]
                            + [_P, _I64, _P, _I64, _I64, _P, _P] + [_P, _I64, _I64, _P, _F32] + [_P, _P, _I32],
    "glu_rows_f32": [_P, _I64, _I64, _I64, _P, _I64, _I64, _P, _I64, _I64, _P, _P, _P, _I32],
    "moe_rows_f32": [_P, _I64, _I64, _I64, _P, _P, _I64, _I64, _I32, _F32, _I64, _P, _I64, _I64, _I64, _P, _I64,
                     _I64, _I64, _P, _P, _P, _P, _P, _I32],
}

RETURNS_STATUS = {"kda_decode_f32", "kda_block_decode_f32", "mla_block_decode_f32", "moe_rows_f32"}

_lock = threading.Lock()
_state: dict[str, object] = {}


def enabled() -> bool:
    return os.environ.get("KIMI_LINEAR_NATIVE", "1") != "0"


def cpu_float32_inference(*tensors: torch.Tensor | None) -> bool:
    """What every kernel here needs of its tensors (None entries skipped): on the CPU, float32, and no gradient
    wanted through any of them (the kernels have no backward)."""
    ts = [t for t in tensors if t is not None]
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in ts):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in ts))


def matrix_strides(w: torch.Tensor) -> tuple[int, int] | None:
    """(row, column) strides of a 2-D weight with a contiguous row or column (the layouts the C products read),
    else None."""
    so, si = w.stride()
    return (so, si) if so == 1 or si == 1 else None


def norm_args(norm: tuple[torch.Tensor, float] | None) -> tuple[int | None, float]:
    """An optional RMSNorm ``(weight, eps)`` as a C call's (pointer or NULL, eps) pair."""
    return (None, 0.0) if norm is None else (norm[0].data_ptr(), norm[1])


def cache_dir() -> Path:
    root = os.environ.get("KIMI_LINEAR_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "kimi_linear")
    return Path(root) / "native"


def _cpu_identity() -> str:
    """What -march=native depends on: the machine and, on Linux, the CPU's model and feature flags."""
    ident = [platform.machine(), platform.processor()]
    try:
        with open("/proc/cpuinfo") as f:
            ident += sorted({ln for ln in f if ln.startswith(("model name", "flags", "Features"))})
    except OSError:
        pass
    return "\n".join(ident)


def _compile(compiler: str, target: Path) -> None:
    """Build with OpenMP (the threads of the expert products; the process's OpenMP runtime, loaded by torch, is
    shared), else without it (a compiler without OpenMP support: those products then run on one core)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        for extra in (("-fopenmp",), ()):
            done = subprocess.run([compiler, *FLAGS, *extra, "-o", tmp, str(SOURCE), "-lm"], capture_output=True,
                                  text=True, timeout=300)
            if done.returncode == 0:
                break
        else:
            raise RuntimeError(f"{compiler} exited with {done.returncode}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _folders() -> list[Path]:
    """Where the library may be built: the cache, else (a read-only home, say) a per-user temporary folder."""
    user = os.getuid() if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")
    return [cache_dir(), Path(tempfile.gettempdir()) / f"kimi_linear-{user}" / "native"]


def _load() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        return None
    lib, error = None, None
    try:
        key = hashlib.sha256("\n".join([SOURCE.read_text(), compiler, *FLAGS, _cpu_identity()]).encode())
        for folder in _folders():
            target = folder / f"decode-{key.hexdigest()[:16]}.so"
            try:
                if not target.exists():
                    logging.getLogger(__name__).info("compiling the CPU decode kernels into %s", target)
                    _compile(compiler, target)
                lib = ctypes.CDLL(str(target))
                break
            except OSError as err:          # an unusable folder, or a file that does not load: the next folder
                error = err
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        error = err
    if lib is None:
        warnings.warn(f"kimi_linear: the CPU decode kernels could not be built ({error}); using PyTorch ops "
                      "instead (slower decoding on a CPU)", RuntimeWarning, stacklevel=3)
        return None
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, (_I32 if name in RETURNS_STATUS else None)
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (disabled, no compiler, or the build failed: then the PyTorch path runs)."""
    if not enabled():
        return None
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"] = _load()
    return _state["lib"]  # type: ignore[return-value]
