"""Giving memory back to the OS once the server is idle.

What was measured (the shipped model, CPU, `kimi-linear serve --max-num-seqs 8`, one 1,500-token generation):

- bf16 weights on a CPU: RSS 0.56 -> 2.8 GB, never freed. oneDNN (PyTorch's CPU matmul library for 16-bit types)
  compiles and caches a kernel per matrix shape, and attention over a growing context has a new shape every step.
  With ``torch.backends.mkldnn`` off RSS stays at idle (bf16 then decodes ~25% slower); capping
  ONEDNN_PRIMITIVE_CACHE_CAPACITY still leaves ~0.5 GB.
  ``dtype="auto"`` now computes 16-bit checkpoints in float32 on a CPU (faster too), where none of this happens:
  the server turns oneDNN off only when 16-bit weights are asked for on a CPU (:func:`cpu_16bit_without_onednn`).
- What remains is the C allocator's: glibc keeps freed heap pages (per-thread arenas, and a mmap threshold that
  grows after large frees) for reuse. :func:`malloc_trim` hands them back; the server calls it when it falls idle.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from typing import Any

_libc: Any = None


def malloc_trim() -> bool:
    """glibc's ``malloc_trim(0)``: return free heap memory of every arena to the OS. False where unavailable."""
    global _libc
    if _libc is None:
        _libc = False
        if sys.platform.startswith("linux"):
            try:
                lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                lib.malloc_trim.argtypes = [ctypes.c_size_t]
                _libc = lib
            except (OSError, AttributeError):
                pass
    if not _libc:
        return False
    _libc.malloc_trim(0)
    return True


def rss_bytes(pid: int | None = None) -> int | None:
    """Resident set size of a process (Linux /proc), None elsewhere."""
    try:
        with open(f"/proc/{pid or os.getpid()}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cpu_16bit_without_onednn(model: Any) -> bool:
    """Serving 16-bit weights on a CPU: turn oneDNN off (its per-shape kernel cache grows by gigabytes over a long
    generation, see the module docstring). Returns whether it did."""
    import torch

    if model.device.type == "cpu" and model.dtype in (torch.bfloat16, torch.float16):
        torch.backends.mkldnn.enabled = False
        return True
    return False
