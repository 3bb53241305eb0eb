"""One chunk forward of ours and of fla-core, warmed up outside the profiled range, for Nsight Compute:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats python3 bench/ncu_chunk.py [--B 16 --T 2048] [--no-fla]

``--backward`` profiles our backward pipeline instead of the forward. Per-instruction stall samples of one
kernel (SASS, where its time goes): ``--section SourceCounters --kernel-name regex:fwd_wy --launch-count 1 -o R``,
then ``ncu -i R.ncu-rep --page source --csv --print-source sass`` (bench/ncu_hotspots.py sums them by region).

Every kernel launched between ``cudaProfilerStart`` and ``cudaProfilerStop`` is profiled: ours (prepare, scores,
WY, state scan, output) then fla's (with its autotuning already done in the warm-up). Shapes as in
bench/kda_kernels.py (bf16, H=32, K=V=128, l2norm, softplus gate and beta sigmoid in kernel).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

from kimi_linear.ops.gate import KernelOptions
from kimi_linear.ops.triton.chunk import chunk_kda_fwd
from kimi_linear.ops.triton.chunk_pipeline import DEFAULT_CONFIG, chunk_kda_bwd_pipeline


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--B", type=int, default=16, help="batch")
    ap.add_argument("--T", type=int, default=2048, help="tokens per sequence")
    ap.add_argument("--no-fla", action="store_true", help="profile ours only")
    ap.add_argument("--lower-bound", action="store_true", help="the lower_bound=-5 gate (fla: safe_gate) for both")
    ap.add_argument("--saturated", action="store_true",
                    help="with --lower-bound: dt_bias ~ 0.1 N, so that the gates saturate at ~-2.5 a step (K3's "
                         "saturated regime of bench/kda_kernels.py, whose chunks go by halves); else dt_bias ~ "
                         "0.5 N - 4 (active gates)")
    ap.add_argument("--backward", action="store_true",
                    help="ours: the pipeline backward (recomputing every forward piece)")
    ap.add_argument("--config", default="{}",
                    help="LaunchConfig fields as JSON, e.g. '{\"wy_tma\": false}'")
    a = ap.parse_args()
    cfg = replace(DEFAULT_CONFIG, **json.loads(a.config))
    H, D = 32, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=gen, device="cuda")
    q, k, v, g = (rnd(a.B, a.T, H, D).bfloat16() for _ in range(4))
    beta = rnd(a.B, a.T, H).bfloat16()
    if a.saturated and not a.lower_bound:
        ap.error("--saturated needs --lower-bound")
    shift = 0.0 if a.saturated or not a.lower_bound else 4.0
    A_log, dt_bias = (rnd(H) * 0.5).float(), (rnd(H * D) * (0.1 if a.saturated else 0.5) - shift).float()
    lb = -5.0 if a.lower_bound else None
    kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
              A_log=A_log, dt_bias=dt_bias)
    ours = lambda: chunk_kda_fwd(q, k, v, g, beta, D ** -0.5, None, True, KernelOptions(lower_bound=lb, **kw),
                                 None, cfg)
    if a.backward:
        do = rnd(a.B, a.T, H, D).bfloat16()
        ours = lambda: chunk_kda_bwd_pipeline(q, k, v, g, beta, D ** -0.5, None, KernelOptions(lower_bound=lb, **kw),
                                              None, do, None, cfg)
    fla = None
    if not a.no_fla:
        from fla.ops.kda import chunk_kda
        extra = dict(safe_gate=True, lower_bound=lb) if a.lower_bound else {}
        fla = lambda: chunk_kda(q, k, v, g, beta, scale=D ** -0.5, output_final_state=True, **kw, **extra)
    for fn in (ours, fla):
        if fn is not None:
            fn()
            fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for fn in (ours, fla):
        if fn is not None:
            fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
