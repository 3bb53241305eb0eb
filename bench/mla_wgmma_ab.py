"""EXPERIMENT (committed and reverted; numbers in BENCHMARKS.md, "Kernels on their own"): the paged MLA split kernel with the products transposed (keys / channels as M, so
Hopper's wgmma applies) against the current kernel: checks against dense float32 and graph-replay timings."""
import os, sys
smoke = "--smoke" in sys.argv
if smoke:
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch, triton  # noqa
import mla_decode_gpu as M  # noqa
from kimi_linear.ops.triton.mla_decode_wgmma import decode_t  # noqa
from kimi_linear.ops import paged_mla_decode  # noqa
M.S = S = M.Setup(smoke)
CFGS = [(32, 64, 4, 2, 1), (32, 64, 8, 2, 1), (32, 32, 4, 3, 1), (32, 32, 4, 3, 2), (32, 32, 8, 3, 2)]
if smoke:
    CFGS = [(16, 32, 4, 2, 1), (32, 16, 4, 2, 1)]
checks = [(1, 17), (1, 300), (3, 100)] if smoke else [(1, 1), (1, 17), (1, 4096), (32, 4096), (1, 262144), (128, 4096)]
bad = 0
for B, L in checks:
    c = M.Case(M.mixed_lengths(B, L, 1), S.bs, seed=B + L)
    for cfg in CFGS:
        BH, BN, nw, ns, ps = cfg
        try:
            ctx, lse = decode_t(c.q, c.cache, c.table, c.seq_lens, S.scale, S.C, BH, BN, nw, ns, ps)
            e, le = M.compare(c, ctx, lse, rows=[0, B - 1] if B > 1 else None)
        except Exception as ex:  # noqa
            e, le = float("nan"), repr(ex)[:200]
        ok = e < M.CTX_BAR and le < M.LSE_BAR if isinstance(le, float) else False
        bad += not ok
        print(f"check B={B} L={L} cfg={cfg}: ctx_err {e:.3g} lse_err {le}" + ("" if ok else "  FAIL"), flush=True)
if smoke:
    raise SystemExit(bad)
print("| case | current | " + " | ".join(str(c) for c in CFGS) + " |")
for rnd in range(2):
    for B, L in [(1, 4096), (1, 131072), (1, 1 << 20), (128, 4096), (32, 32768)]:
        c = M.Case([L] * B, S.bs, seed=B + L)
        a = c.args()
        row = [M.bench_ms(M.graph_of(lambda: paged_mla_decode(*a)))]
        for BH, BN, nw, ns, ps in CFGS:
            try:
                row.append(M.bench_ms(M.graph_of(lambda: decode_t(c.q, c.cache, c.table, c.seq_lens, S.scale, S.C,
                                                                  BH, BN, nw, ns, ps))))
            except Exception as ex:  # noqa
                print(repr(ex)[:300]); row.append(float("nan"))
        gbs = c.nbytes() / 1e9
        print(f"| r{rnd} B={B} L={L} ({gbs*1e3:.0f} MB) | " + " | ".join(f"{t*1e3:.1f} us ({gbs/t*1e3/1e3:.2f} TB/s)" for t in row) + " |", flush=True)
        c = a = None; torch.cuda.empty_cache()
raise SystemExit(bad)
