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

from .ints import cdiv

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


@triton.jit
def prefetch_part_l2(nxt, n_nxt, c_nxt, i_p):
    """Program ``i_p``'s part of the ``n_nxt`` bytes at ``nxt`` into L2 (:func:`prefetch_l2`): bytes
    ``[i_p c_nxt, min((i_p + 1) c_nxt, n_nxt))``, nothing past the end (:func:`prefetch_plan` makes the parts)."""
    o_nxt = i_p.to(tl.int64) * c_nxt                                         # bytes before this part
    if o_nxt < n_nxt:
        prefetch_l2(nxt + o_nxt, tl.minimum(n_nxt - o_nxt, c_nxt).to(tl.int32))


def prefetchable(t: torch.Tensor | None) -> bool:
    """Whether ``t`` can be asked into L2 in 16-byte multiples (:func:`prefetch_l2`): contiguous, its start
    16-byte aligned and its size a multiple of 16 bytes."""
    return (t is not None and t.is_contiguous() and t.data_ptr() % 16 == 0
            and (t.numel() * t.element_size()) % 16 == 0)


def prefetch_share(nbytes: int, programs: int) -> int:
    """Bytes each of ``programs`` programs asks into L2 of an ``nbytes`` tensor (a multiple of 16): program p takes
    ``[p share, min((p + 1) share, nbytes))``, so together they cover it once, each piece a multiple of 16 bytes
    (nbytes is one: :func:`prefetchable`)."""
    return cdiv(cdiv(nbytes, programs), 16) * 16


def prefetch_plan(t: torch.Tensor | None, programs: int, idle: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """The ``(nxt, n_nxt, c_nxt)`` arguments of :func:`prefetch_part_l2` for a launch of ``programs`` programs
    sharing out ``t`` (a tensor a later kernel of the step reads): a byte view of it, its size and one program's
    part; ``(idle, 0, 0)`` (any tensor of the launch in its place, nothing asked for) when ``t`` is None, on
    another device or not :func:`prefetchable`."""
    if t is None or t.device != idle.device or not prefetchable(t):
        return idle, 0, 0
    nbytes = t.numel() * t.element_size()
    return t.reshape(-1).view(torch.uint8), nbytes, prefetch_share(nbytes, programs)
