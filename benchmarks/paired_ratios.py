"""Every row of an interleaved sweep over one base row, run by run, with 95% intervals (ddtree_bench.paired).

    python benchmarks/paired_ratios.py benchmarks/results/sweep_paired_tiny_2026-11-30_7dd2358.jsonl --base "tiny|ddtree-128"

prints, per batch size, each row's tokens/s over the base row's (the geometric mean of the per-round ratios), its
95% interval and the number of rounds, then the same with the rounds of every batch size together; `--json PATH`
writes the same tables. Rows are named setup|method or setup|method-budget. Rows of an `auto` server with the
in-process A/B (SGLANG_DDTREE_AUTO_AB) also get a table of their own: the `auto` arm over the fixed arm, over the
whole row and run by run (ddtree_bench.paired.ab_table), and where `auto`'s own host time goes, all such servers' rows
together (ab_own_host_split: its arm's host ms a round less the fixed arm's, per host stage); a sweep of such
servers alone needs no base row.
`--arm NAME=LABEL,LABEL,...` (repeated) adds, per batch size, each arm's servers together over the base row and over
the first arm (group_ratio: per round the mean over an arm's copies), for several servers per arm started together:

    python benchmarks/paired_ratios.py sweep_starts.jsonl --base "tiny|ddtree-128" \
        --arm "default=a1|auto,a2|auto,a3|auto" --arm "settle=b1|auto,b2|auto,b3|auto"
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree_bench.paired import (ab_own_host_split, ab_table, arm_table, paired_table,  # noqa: E402
                                 pooled_ratios, rate_outlier_runs, row_label)
from ddtree_bench.results import latest_results, read_rows  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="a bench_budgets.py results file (JSONL) of an --interleave sweep")
    ap.add_argument("--base", required=True, help="the row every other row is divided by, e.g. 'tiny|ddtree-128'")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the table as JSON")
    ap.add_argument("--arm", action="append", default=[], metavar="NAME=LABEL,LABEL,...",
                    help="servers of one configuration, pooled per round (repeat for each arm; the first is the "
                         "reference of the others)")
    ap.add_argument("--keep-outlier-runs", action="store_true",
                    help="pair every round, also those where a row had requests decoding far above its run's median "
                         "rate (decode_rate_outliers_runs; left out by default: such a run's tokens/s is inflated)")
    args = ap.parse_args(argv)
    drop = not args.keep_outlier_runs
    arms = {}
    for spec in args.arm:
        name, sep, labels = spec.partition("=")
        if not sep or not name or not labels or name in arms:
            ap.error(f"--arm wants a new NAME=LABEL,LABEL,..., got {spec!r}")
        arms[name] = [x.strip() for x in labels.split(",") if x.strip()]
    try:
        rows = list(latest_results(read_rows(args.results)).values())
        table = paired_table(rows, args.base, drop_outliers=drop)
        pooled = pooled_ratios(rows, args.base, drop_outliers=drop)
        by_arm = arm_table(rows, args.base, arms, drop_outliers=drop) if arms else {}
        outliers = rate_outlier_runs(rows)
        ab = ab_table(rows)
        own_host = ab_own_host_split(rows, set(ab))
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not table and not ab:
        labels = sorted({row_label(r) for r in rows if r.get("status") == "ok"})
        print(f"error: no batch size has a measured row {args.base!r}; rows: {', '.join(labels) or 'none'}",
              file=sys.stderr)
        return 2
    for bs, ratios in table.items():
        print(f"batch {bs}: over {args.base}")
        for label, r in ratios.items():
            print(f"  {label:28s} {_line(r)}")
    if len(table) > 1:
        print(f"all batch sizes together: over {args.base}")
        for label, r in pooled.items():
            print(f"  {label:28s} {_line(r)}")
    for bs, ratios in by_arm.items():
        print(f"batch {bs}: arms (each server's runs pooled per round)")
        for label, r in ratios.items():
            print(f"  {label:40s} {_line(r)}")
    for label, table_ab in ab.items():
        print(f"{label}: in-process A/B, auto's arm over the fixed widest tree's (SGLANG_DDTREE_AUTO_AB)")
        for bs, entry in table_ab["by_batch_size"].items():
            pooled_text = "-" if entry["ratio"] is None else f"x{entry['ratio']:.3f}"
            runs_text = _line(entry["runs"]) if entry["runs"] else "too few runs with both arms"
            arms_text = "; ".join(f"{arm} tau {n.get('tau') or 0:.2f}, {n.get('round_ms') or 0:.2f} ms"
                                  + (f" (host {n['host_ms']:.2f})" if n.get("host_ms") else "")
                                  + (f", narrower {n['narrower_rounds']}/{n['rounds']} rounds"
                                     if n.get("narrower_rounds") is not None else "")
                                  for arm, n in entry["arms"].items())
            print(f"  batch {bs:<4} all rounds {pooled_text}   run by run {runs_text}   [{arms_text}]")
        if table_ab["all_batch_sizes"]:
            print(f"  all batch sizes, run by run {_line(table_ab['all_batch_sizes'])}")
    if own_host:
        print(f"auto's own host time, its arm's ms a round less the fixed arm's (all {len(ab)} A/B servers' rows)")
        for bs, d in own_host.items():
            stages = " ".join(f"{k} {v:+.3f}" for k, v in d["stages"].items())
            sampled = "" if d["sampled_extra"] is None else f", sampled rounds' extra {d['sampled_extra']:+.3f}"
            print(f"  batch {bs:<4} host {d['host']:+.3f}  round {d['round']:+.3f} "
                  f"(fixed {d['fixed_round_ms']:.2f} ms{sampled})  [{stages}]  {d['rows']} rows")
    for label, by_bs in outliers.items():
        for bs, runs in by_bs.items():
            print(f"note: {label} at batch {bs}: run(s) {', '.join(map(str, runs))} (from 0) had requests decoding "
                  "far above the run's median rate (decode_rate_outliers_runs): "
                  + ("the ratios leave these rounds out (--keep-outlier-runs keeps them)" if drop
                     else "kept (--keep-outlier-runs); ratios using them are suspect"))
    if args.json:
        out = {"base": args.base, "results": str(args.results), "outlier_runs_dropped": drop,
               "by_batch_size": {str(k): v for k, v in table.items()}, "all_batch_sizes": pooled}
        if outliers:
            out["rate_outlier_runs"] = {label: {str(bs): runs for bs, runs in by_bs.items()}
                                        for label, by_bs in outliers.items()}
        if ab:
            out["ab"] = {label: {"by_batch_size": {str(k): v for k, v in t["by_batch_size"].items()},
                                 "all_batch_sizes": t["all_batch_sizes"]} for label, t in ab.items()}
        if own_host:
            out["ab_own_host_split"] = {str(k): v for k, v in own_host.items()}
        if arms:
            out["arms"] = arms
            out["arms_by_batch_size"] = {str(k): v for k, v in by_arm.items()}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


def _line(r: dict) -> str:
    """One ratio as the tables print it: x0.987  [0.950, 1.025]  30 rounds (2 dropped)."""
    dropped = f" ({r['dropped_runs']} dropped)" if r.get("dropped_runs") else ""
    if r["ratio"] is None:
        return f"too few rounds without rate outliers: {r['rounds']} rounds{dropped}"
    lo, hi = r["ci95"]
    return f"x{r['ratio']:.3f}  [{lo:.3f}, {hi:.3f}]  {r['rounds']} rounds{dropped}"


if __name__ == "__main__":
    sys.exit(main())
