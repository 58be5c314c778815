"""`auto`'s host policy on the CPU: its own cost per round (choose + sample_interval + observe, the Python the
worker runs every round) and how close its picks stay to the best candidate when the host slows down in phases
(sglang_ddtree.bench.auto_sim; candidates costing about the same and committing more with width, the tiny pair's
batch-4 shape of lease 12).

    python benchmarks/simulate_auto_phases.py --out benchmarks/results/auto_chooser_cpu.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BASE = [4.6, 4.7, 4.6, 4.8, 4.7]
TOKENS = [5.47, 5.62, 6.05, 6.59, 6.69]
EXPECTED = [8.0, 9.0, 10.5, 12.0, 13.0]


def host_us_per_round(rounds: int) -> float:
    from sglang_ddtree.bench.auto_sim import CANDIDATES, WIDTHS
    from sglang_ddtree.sglang.auto import AutoBudgetPolicy

    rng = random.Random(0)
    policy = AutoBudgetPolicy(list(CANDIDATES), widths=WIDTHS)

    def one(r):
        c = policy.choose(64)
        policy.sample_interval(64)
        policy.observe(64, c, 64, rng.uniform(5, 8), [rng.uniform(1, 8) for _ in CANDIDATES] if r % 4 == 0 else None,
                       [rng.uniform(1, 6)] * len(CANDIDATES))

    for r in range(2000):  # past exploration
        one(r)
    t = time.perf_counter()
    for r in range(rounds):
        one(r)
    return (time.perf_counter() - t) / rounds * 1e6


def main(argv=None) -> int:
    from sglang_ddtree.bench.auto_sim import rate_over_best, simulate

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3000)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = []
    for mult, length in [(1.0, None), (1.3, 100), (1.6, 100), (1.6, 300), (1.6, 1000)]:
        ratios = [rate_over_best(simulate(seed, BASE, TOKENS, EXPECTED, args.rounds, 4, noise=0.10, phase_mult=mult,
                                          phase_len=length), BASE, TOKENS) for seed in range(args.seeds)]
        rows.append({"phase_mult": mult, "phase_len_rounds": length, "seeds": args.seeds,
                     "rate_over_best_min": round(min(ratios), 3),
                     "rate_over_best_mean": round(sum(ratios) / len(ratios), 3)})
        print(json.dumps(rows[-1]))
    cost = round(host_us_per_round(5000), 1)
    print(f"host us per round: {cost}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "machine": "CPU (this repo's dev machine, 2 cores)",
            "command": "python benchmarks/simulate_auto_phases.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "policy_host_us_per_round": cost, "phases": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
