"""`auto`'s host policy on a flat cost curve, on the CPU (sglang_ddtree.bench.auto_sim): how often it verifies the
widest tree, and how close its picks stay to the best candidate's rate, when every candidate's round costs about the
same and wider trees commit more - lease 19's tiny pair (sweep_auto_tiny_lease19.jsonl: at batch 1 the chooser timed
the 32-, 64- and 128-trees at 4.31 / 4.41 / 4.32 ms and gave the narrower ones 32% of its rounds). Next to it, two
8B-like cases where the chain should win. `--recent N` evaluates the chooser with medians over N recent rounds
instead of auto.RECENT.

    python benchmarks/simulate_auto_flat.py --out benchmarks/results/auto_flat_sim.json
    python benchmarks/simulate_auto_flat.py --recent 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Lease 19's chooser table at tiny batch 1: committed tokens per request (expected x observed / expected) and the
# drafter's expectation, chain, 16, 32, 64, 128.
TOKENS = [2.55, 3.86, 4.13, 4.37, 4.54]
EXPECTED = [3.85, 4.62, 5.01, 5.36, 5.70]
CASES = {
    "flat, noise 0.10": dict(base=[4.4] * 5, noise=0.10, outlier=0.05),
    "flat, noise 0.20": dict(base=[4.4] * 5, noise=0.20, outlier=0.05),
    "flat, noise 0.15, slow phases x1.5": dict(base=[4.4] * 5, noise=0.15, outlier=0.05, phase_mult=1.5,
                                               phase_len=150),
    "128-tree 8% dearer, noise 0.15": dict(base=[5.0, 5.0, 5.1, 5.2, 5.4], noise=0.15, outlier=0.05),
    "8B-like batch 16 (convex, drafter never right)": dict(base=[11.0, 11.5, 20.0, 38.0, 73.0], noise=0.03,
                                                           outlier=0.01, tokens=[1.0] * 5,
                                                           expected=[1.5, 2.0, 3.0, 4.0, 6.0]),
    "8B-like batch 1 (drafter never right)": dict(base=[8.0, 8.2, 8.5, 9.0, 10.0], noise=0.03, outlier=0.01,
                                                  tokens=[1.0] * 5, expected=[1.5, 2.0, 3.0, 4.0, 6.0]),
}


def main(argv=None) -> int:
    from sglang_ddtree.bench import auto_sim
    from sglang_ddtree.sglang import auto

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4000)
    ap.add_argument("--skip", type=int, default=300, help="first rounds left out (exploration)")
    ap.add_argument("--recent", type=int, default=None, help="auto.RECENT for this run (default: the code's)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.rounds <= args.skip:
        ap.error("--rounds must exceed --skip")
    if args.recent is not None:
        if args.recent < 1:
            ap.error("--recent must be >= 1")
        auto.RECENT = args.recent  # read when a bucket's deques are made
    rows = []
    for name, case in CASES.items():
        tokens, expected = case.get("tokens", TOKENS), case.get("expected", EXPECTED)
        ratios, shares = [], [0] * len(tokens)
        for seed in range(args.seeds):
            picks = auto_sim.simulate(seed, case["base"], tokens, expected, args.rounds, 4, case["noise"],
                                      case["outlier"], 2, phase_mult=case.get("phase_mult", 1.0),
                                      phase_len=case.get("phase_len"))[args.skip:]
            ratios.append(auto_sim.rate_over_best(picks, case["base"], tokens))
            for i in picks:
                shares[i] += 1
        total = sum(shares)
        rows.append({"case": name, "seeds": args.seeds, "rate_over_best_mean": round(statistics.mean(ratios), 3),
                     "rate_over_best_min": round(min(ratios), 3),
                     "share_by_candidate": {auto_sim.CANDIDATES[i] or "chain": round(n / total, 3)
                                            for i, n in enumerate(shares)}})
        print(json.dumps(rows[-1]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "machine": "CPU (this repo's dev machine, 2 cores)",
            "command": "python benchmarks/simulate_auto_flat.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "recent": auto.RECENT, "cases": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
