"""Where a kernel's time goes, from Nsight Compute's per-instruction stall samples (SASS):

    ncu --section SourceCounters --kernel-name regex:fwd_wy --launch-count 1 -o R python3 bench/ncu_chunk.py ...
    ncu -i R.ncu-rep --page source --csv --print-source sass > R.csv
    python3 bench/ncu_hotspots.py R.csv

Prints the samples summed by opcode, the program split into equal stretches of instructions (so a phase of the
kernel, e.g. the inverse before the WY products, shows as a run of stretches), and the hottest instructions.
"""

from __future__ import annotations

import argparse
import csv
from collections import Counter


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--stretches", type=int, default=24, help="equal stretches of the instruction stream")
    ap.add_argument("--top", type=int, default=30, help="hottest instructions to list")
    a = ap.parse_args()
    with open(a.csv, newline="") as f:
        lines = [row for row in csv.reader(f)]
    head_at = next(i for i, r in enumerate(lines) if any("Source" in c for c in r))
    head, rows = lines[head_at], [r for r in lines[head_at + 1:] if len(r) == len(lines[head_at])]
    print("columns:", " | ".join(head))
    src = next(i for i, c in enumerate(head) if c.strip() == "Source")
    samp = next(i for i, c in enumerate(head) if "Sampling" in c and "All" in c)
    execd = next((i for i, c in enumerate(head) if c.startswith("Instructions Executed")), None)
    total = sum(number(r[samp]) for r in rows) or 1.0
    print(f"{len(rows)} instructions, {total:.0f} samples")

    by_op = Counter()
    for r in rows:
        by_op[r[src].split()[0].split(".")[0] if r[src].split() else "?"] += number(r[samp])
    print("by opcode: " + ", ".join(f"{op} {100 * s / total:.1f}%" for op, s in by_op.most_common(16)))

    n = max(1, len(rows) // a.stretches)
    for i in range(0, len(rows), n):
        part = rows[i:i + n]
        ops = Counter()
        for r in part:
            ops[r[src].split()[0].split(".")[0] if r[src].split() else "?"] += number(r[samp])
        s = sum(ops.values())
        print(f"  instr {i:5d}-{i + len(part) - 1:5d}: {100 * s / total:5.1f}%  " +
              ", ".join(f"{op} {100 * v / total:.1f}" for op, v in ops.most_common(4) if v))

    print("hottest:")
    for j, r in sorted(enumerate(rows), key=lambda t: -number(t[1][samp]))[:a.top]:
        ex = f" exec {r[execd]}" if execd is not None else ""
        print(f"  #{j:5d} {100 * number(r[samp]) / total:5.2f}%{ex}  {r[src][:90]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
