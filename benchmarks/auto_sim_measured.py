"""`auto`'s host policy fed measured round costs and taus (ddtree_bench.auto_sim), no GPU: what it would choose at
one batch size if its times and tokens were what the fixed-budget servers measured, with and without the warm-up,
start and switch costs a server adds. A real `auto` row far below the simulated rate points at what the simulation
leaves out; a bimodal spread of seeds points at a lock-in.

    python benchmarks/auto_sim_measured.py --ms chain=12.6,16=14.24,32=18.5,64=30,128=55 \\
        --taus chain=3.55,16=4.41,32=4.73,64=4.96,128=5.10 --batch-size 16 --out benchmarks/results/FILE.json \\
        --source "where the numbers come from"

Writes per scenario the mean, least and greatest rate over the best candidate's, the share of rounds per candidate,
and per seed the chain's and each tree's share and the final medians.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree_bench.auto_sim import CANDIDATES, WIDTHS, rate_over_best, simulate  # noqa: E402
from sglang_ddtree.adaptive import candidate_label  # noqa: E402
from sglang_ddtree.sglang.auto import AutoBudgetPolicy, AutoConfig  # noqa: E402

LABELS = [candidate_label(c) for c in CANDIDATES]
# Server effects measured before (auto_sim.simulate's docstring): a candidate's first timed rounds after its cold one,
# a slow first stretch of a server's requests, rounds right after a switch of candidate, and what a sampled round
# adds (the chain's sampled round runs the general path; a tree's builds the largest tree).
SCENARIOS = {
    "measured costs only": {},
    "warm-up": {"warm_mult": (1.4, 1.15)},
    "slow start": {"start_rounds": 100, "start_mult": 1.5},
    "switch costs": {"switch_mult": 1.05, "switch_outlier": 0.09},
    "all of them": {"warm_mult": (1.4, 1.15), "start_rounds": 100, "start_mult": 1.5, "switch_mult": 1.05,
                    "switch_outlier": 0.09},
}


def per_candidate(text: str, what: str) -> list[float]:
    """'chain=12.6,16=14.2,...' -> one value per auto_sim.CANDIDATES, every one given."""
    values = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--{what}: expected label=value items, got {item!r}")
        values[key.strip()] = float(value)
    if sorted(values) != sorted(LABELS):
        raise SystemExit(f"--{what}: give exactly {', '.join(LABELS)}, got {', '.join(values)}")
    return [values[k] for k in LABELS]


def run(ms: list[float], taus: list[float], batch_size: int, seeds: int, rounds: int, skip: int,
        sampled_ms: list[float], scenarios=SCENARIOS) -> dict:
    out = {}
    for name, extra in scenarios.items():
        ratios, shares, per_seed = [], collections.Counter(), []
        for seed in range(seeds):
            policy = AutoBudgetPolicy(list(CANDIDATES), widths=WIDTHS, config=AutoConfig())
            picks = simulate(seed, ms, taus, taus, rounds, batch_size, noise=0.04, outlier=0.02, poisson_tokens=True,
                             content_sigma=0.15, content_rounds=100, policy=policy, sampled_ms=sampled_ms, **extra)
            kept = picks[skip:]
            counts = collections.Counter(kept)
            shares.update(counts)
            ratio = rate_over_best(kept, ms, taus)
            ratios.append(ratio)
            bucket = policy.buckets[batch_size]
            per_seed.append({"seed": seed, "rate_over_best": round(ratio, 4),
                             "share": {LABELS[i]: round(counts[i] / len(kept), 3) for i in sorted(counts)},
                             "median_ms": {LABELS[i]: round(m, 2) for i, m in enumerate(bucket.median) if m}})
        total = sum(shares.values())
        out[name] = {"server_effects": {k: list(v) if isinstance(v, tuple) else v for k, v in extra.items()},
                     "rate_over_best_mean": round(statistics.mean(ratios), 4),
                     "rate_over_best_min": round(min(ratios), 4), "rate_over_best_max": round(max(ratios), 4),
                     "share": {LABELS[i]: round(n / total, 3) for i, n in sorted(shares.items())},
                     "seeds": per_seed}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", required=True, help="round ms per candidate, e.g. chain=12.6,16=14.24,...")
    ap.add_argument("--taus", required=True, help="committed tokens a request a round per candidate")
    ap.add_argument("--sampled-ms", default="chain=0.3,16=1.5,32=1.5,64=1.5,128=1.5",
                    help="what a sampled round adds per candidate")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seeds", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=1500)
    ap.add_argument("--skip", type=int, default=300, help="first rounds left out (exploration)")
    ap.add_argument("--source", default="", help="where --ms and --taus come from (kept in the output)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if not 0 <= args.skip < args.rounds or args.seeds < 1 or args.batch_size < 1:
        raise SystemExit("need 0 <= --skip < --rounds, --seeds >= 1 and --batch-size >= 1")
    ms, taus = per_candidate(args.ms, "ms"), per_candidate(args.taus, "taus")
    sampled = per_candidate(args.sampled_ms, "sampled-ms")
    result = {"command": "python benchmarks/auto_sim_measured.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "source": args.source, "candidates": LABELS, "round_ms": ms, "taus": taus, "sampled_ms": sampled,
              "batch_size": args.batch_size, "seeds": args.seeds, "rounds": args.rounds, "skipped_rounds": args.skip,
              "scenarios": run(ms, taus, args.batch_size, args.seeds, args.rounds, args.skip, sampled)}
    for name, r in result["scenarios"].items():
        print(f"{name:22s} rate/best {r['rate_over_best_mean']:.3f} [{r['rate_over_best_min']:.3f}-"
              f"{r['rate_over_best_max']:.3f}] share {r['share']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
