"""Router load-balancing stress test: max/mean expert load under the sign rule and the quantile rule.

    python bench/balancing.py            # 64 experts, top-8, skewed preferences, drifting tokens, 200 updates
"""

from __future__ import annotations

import argparse

from kimi_linear.train.balancing import router_stress_test


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--k", type=int, default=8)
    a = p.parse_args()
    marks = [m for m in (1, 10, 50, 100, 200, 500) if m <= a.steps]
    print("| rule | " + " | ".join(f"after {m}" for m in marks) + " |")
    print("|---|" + "---|" * len(marks))
    for rule, kw, label in (("sign", {"rate": 1e-3}, "sign, rate 1e-3"), ("sign", {"rate": 1e-2}, "sign, rate 1e-2"),
                            ("quantile", {"damping": 0.5}, "quantile, damping 0.5")):
        h = router_stress_test(rule, steps=a.steps, experts=a.experts, k=a.k, **kw)
        print(f"| {label} | " + " | ".join(f"{h[m - 1]:.2f}" for m in marks) + " |")


if __name__ == "__main__":
    main()
