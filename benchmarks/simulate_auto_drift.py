"""`auto`'s host policy fed expectations whose basis moves, on the CPU (sglang_ddtree.bench.auto_sim): what lease 20
did when sampled rounds reported the calibration table's expectations instead of the raw scores' (52a645d). While the
table learns, every tree's expectation falls from the raw value toward what the tree commits (the raw scores
over-predict wide trees most), and each harness /flush_cache reset it to raw again (2-12 resets per sweep row).

The chooser estimates a candidate's tokens as its decayed mean expectation times its observed / expected ratio, and
the ratio of a candidate is refreshed only in rounds that observe it (the chosen tree and the narrower ones). The
question: does a moving basis alone, with everything else as in the flat tiny-pair case (lease 19's batch-1 tokens,
every round ~4.4 ms), pull `auto` off the widest tree? Cases: fixed basis (the raw scores, as the worker runs now),
a basis learning with a time constant of TAU rounds and never reset, and the same reset every PERIOD rounds.

    python benchmarks/simulate_auto_drift.py --out benchmarks/results/auto_drift_sim.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# Lease 19's chooser table at tiny batch 1: committed tokens per request and the raw expectation, chain, 16, 32, 64,
# 128 (the flat case's, one definition)
from simulate_auto_flat import EXPECTED, TOKENS  # noqa: E402


def learning_scale(tau: float, period: float | None):
    """round -> per-candidate factor on the raw expectation: 1 at a reset, tending to tokens / expected (a table
    that learnt the truth) with time constant tau rounds; reset every `period` rounds (None: never)."""
    target = [t / e for t, e in zip(TOKENS, EXPECTED)]

    def scale(r: int) -> list[float]:
        age = r % period if period else r
        w = 1.0 - math.exp(-age / tau)
        return [1.0 + (f - 1.0) * w for f in target]

    return scale


def main(argv=None) -> int:
    from sglang_ddtree.bench import auto_sim
    from sglang_ddtree.sglang import auto

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3000)
    ap.add_argument("--skip", type=int, default=300, help="rounds left out of the score (exploration)")
    ap.add_argument("--tau", type=float, default=400.0, help="rounds for the table to learn ~63%% of its way")
    ap.add_argument("--out", help="write the results here (JSON)")
    args = ap.parse_args(argv)
    base = [4.4] * 5
    cases = {
        "fixed basis (raw scores)": None,
        f"learning basis, tau {args.tau:g}, never reset": learning_scale(args.tau, None),
        f"learning basis, tau {args.tau:g}, reset every 600 rounds": learning_scale(args.tau, 600),
        f"learning basis, tau {args.tau:g}, reset every 200 rounds": learning_scale(args.tau, 200),
    }
    rows = []
    started = time.perf_counter()
    for k, (name, scale) in enumerate(cases.items(), 1):
        ratios, shares = [], []
        for seed in range(args.seeds):
            picks = auto_sim.simulate(seed, base, TOKENS, EXPECTED, args.rounds, 4, noise=0.10, outlier=0.05,
                                      expected_scale=scale)[args.skip:]
            ratios.append(auto_sim.rate_over_best(picks, base, TOKENS))
            shares.append(picks.count(4) / len(picks))
        row = {"case": name, "seeds": args.seeds, "rate_over_best_min": round(min(ratios), 4),
               "rate_over_best_mean": round(statistics.fmean(ratios), 4),
               "widest_tree_share_mean": round(statistics.fmean(shares), 3)}
        rows.append(row)
        print(f"[{k}/{len(cases)}] {name}: rate/best min {row['rate_over_best_min']} mean "
              f"{row['rate_over_best_mean']}, 128-tree {row['widest_tree_share_mean']:.0%} of the rounds "
              f"({time.perf_counter() - started:.0f} s)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "what": "auto's chooser (auto_sim) on the flat tiny-pair case, expectations on a fixed or a moving "
                    "basis (benchmarks/simulate_auto_drift.py); simulated, not measured",
            "command": "python benchmarks/simulate_auto_drift.py " + " ".join(argv if argv is not None
                                                                              else sys.argv[1:]),
            "shrink_z": auto.AutoConfig().shrink_z, "rounds": args.rounds, "skip": args.skip, "tau": args.tau,
            "tokens": TOKENS, "expected": EXPECTED, "cases": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
