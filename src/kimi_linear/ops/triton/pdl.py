"""Programmatic dependent launch (PDL, Hopper and later) for the kernels of a decode step.

A batch-1 decode step is ~120 kernels of a few microseconds each, and ~0.1 ms of it is the gaps between them (one
launch ends, its successor is set up and ramps up). With PDL a kernel launched with the ``launch_pdl`` attribute
may start while its predecessor in the stream still runs, once every program of the predecessor has executed
``griddepcontrol.launch_dependents``; it must execute ``griddepcontrol.wait`` (which returns when the predecessor
has completed and its writes are visible) before touching anything the predecessor reads or writes.

Every kernel that takes part calls :func:`pdl_entry` first thing: it waits for its predecessor, then lets its own
successor launch. Waiting before any load or store keeps each kernel exactly as ordered as without PDL (the only
overlap is the successor's launch and set-up with this kernel's run), so it is correct whatever the predecessor is
(a cuBLAS kernel never signals: its successor then launches when it completes, as without PDL). The one thing a
kernel may do before waiting is :func:`prefetch_l2` of weights that nothing in the step writes (a hint to the
memory system: it reads nothing into the program and cannot change a result). H200, 2026-12-02,
the 8-layer 48B-shaped model at batch 1 and 131,072 tokens of context, CUDA-graph replay of a step (two runs each):
1.162 / 1.138 ms without, 1.102 / 1.076 ms with. On for every sm_90+ device where Triton has it; never under
Triton's interpreter.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

# A Triton without gdc_wait (older releases) launches every kernel as before.
ENABLED = os.environ.get("TRITON_INTERPRET", "0") != "1" and hasattr(tl.extra.cuda, "gdc_wait")


def pdl_args(device: torch.device) -> dict[str, Any]:
    """The launch arguments of a participating kernel on ``device``: its ``PDL`` constexpr and, when on, Triton's
    ``launch_pdl`` option (sm_90 and later only)."""
    on = ENABLED and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def pdl_entry(PDL: tl.constexpr):
    """Wait for the previous kernel in the stream to complete, then let the next one launch (module docstring)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def prefetch_args(device: torch.device, on: bool = True) -> dict[str, Any]:
    """``PREFETCH`` of a kernel that brings its weights into L2 before waiting for its predecessor
    (:func:`prefetch_l2`): only with PDL (without it there is no predecessor still running to overlap) and where
    the caller's layout allows (``on``: contiguous rows, 16-byte aligned)."""
    return {"PREFETCH": on and pdl_args(device)["PDL"]}


@triton.jit
def prefetch_l2(p, nbytes):
    """Ask the copy engine to bring ``nbytes`` (a multiple of 16; p 16-byte aligned) from ``p`` into L2, from one
    thread of the program (``cp.async.bulk.prefetch``, sm_90). Issued before :func:`pdl_entry` by a kernel whose
    weights do not depend on its predecessor, so the bytes arrive while the predecessor still runs.

    It pays only behind a predecessor that leaves HBM idle (the router GEMV behind a norm: 3.9 -> 3.2 us a call on
    the H200); behind a bandwidth-bound one (the MoE down kernel behind gate/up) it competes for the same bandwidth
    and was slower (BENCHMARKS.md, fused MoE)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [p, nbytes], dtype=tl.int32, is_pure=False, pack=1)
