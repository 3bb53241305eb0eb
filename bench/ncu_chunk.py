"""One chunk forward of ours and of fla-core, warmed up outside the profiled range, for Nsight Compute:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats python3 bench/ncu_chunk.py [--B 16 --T 2048] [--no-fla]

``--backward`` profiles our backward pipeline instead of the forward. Per-instruction stall samples of one
kernel (SASS, where its time goes): ``--section SourceCounters --kernel-name regex:fwd_wy --launch-count 1 -o R``,
then ``ncu -i R.ncu-rep --page source --csv --print-source sass`` (bench/ncu_hotspots.py sums them by region).

Every kernel launched between ``cudaProfilerStart`` and ``cudaProfilerStop`` is profiled: ours (prepare, scores,
WY, state scan, output) then fla's (with its autotuning already done in the warm-up). Inputs as in
bench/kda_kernels.py (bf16, H=32, K=V=128, l2norm, gate and beta sigmoid in kernel), with the gate parameters of
one of its gate regimes (``--regime``: a piece of exactly one name, e.g. ``strong``, ``-5, dt`` or ``active``; fla takes
``safe_gate`` with the lower_bound regimes).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

from kda_kernels import REGIMES, args5, fla_opts, make_regime, opts  # bench/ is the script's folder, first on sys.path
from kimi_linear.ops.gate import KernelOptions
from kimi_linear.ops.triton.chunk import chunk_kda_fwd
from kimi_linear.ops.triton.chunk_pipeline import DEFAULT_CONFIG, chunk_kda_bwd_pipeline


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--B", type=int, default=16, help="batch")
    ap.add_argument("--T", type=int, default=2048, help="tokens per sequence")
    ap.add_argument("--no-fla", action="store_true", help="profile ours only")
    ap.add_argument("--regime", default="bench",
                    help="the gate regime of bench/kda_kernels.py whose name holds this text (case-insensitive): "
                         + "; ".join(REGIMES))
    ap.add_argument("--backward", action="store_true",
                    help="ours: the pipeline backward (recomputing every forward piece)")
    ap.add_argument("--config", default="{}",
                    help="LaunchConfig fields as JSON, e.g. '{\"wy_tma\": false}'")
    a = ap.parse_args()
    cfg = replace(DEFAULT_CONFIG, **json.loads(a.config))
    names = [n for n in REGIMES if a.regime.lower() in n.lower()]
    if len(names) != 1:
        ap.error(f"--regime {a.regime!r} names {len(names)} of the gate regimes ({'; '.join(REGIMES)}): give a "
                 "piece of exactly one name")
    print(f"gate regime: {names[0]}", flush=True)
    x, lb = make_regime(a.B, a.T, names[0])
    q, k, v, g, beta = args5(x)
    D = q.shape[-1]
    ko = KernelOptions(**opts(x, lb))
    ours = lambda: chunk_kda_fwd(q, k, v, g, beta, D ** -0.5, None, True, ko, None, cfg)
    if a.backward:
        do = torch.randn_like(v)
        ours = lambda: chunk_kda_bwd_pipeline(q, k, v, g, beta, D ** -0.5, None, ko, None, do, None, cfg)
    fla = None
    if not a.no_fla:
        from fla.ops.kda import chunk_kda
        fla = lambda: chunk_kda(q, k, v, g, beta, scale=D ** -0.5, output_final_state=True, **fla_opts(x, lb))
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
