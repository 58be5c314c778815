"""SGLANG_DDTREE_AUTO_AB sweeps read per arm: the `auto` servers whose label starts with each given prefix (e.g.
`tiny-e` for the servers as they are, `tiny-s` for a knob's arm), their runs pooled (paired.ab_pooled: `auto`
over its fixed arm per batch size and over all, 95% intervals), their own host time split by stage
(ab_own_host_split), and the rows on a narrower candidate than the fixed arm's for more than a share of their rounds
(lock-ins). The intervals of the summary's `auto` A/B headline come from the `auto` as it is servers (`tiny-e*`) of
the sweeps marked `headline = true` in scripts/summary_sources.toml.

    python benchmarks/ab_arms_pooled.py benchmarks/results/sweep_ab_tiny_run{1,2,3}_2026-12-02_468f487.jsonl \\
        --arm e=tiny-e --arm s=tiny-s --arm d=tiny-d --json benchmarks/results/ab_arms_pooled_2026-12-02_63ca041.json
    python benchmarks/ab_arms_pooled.py <the headline sweeps> --arm e=tiny-e \\
        --json benchmarks/results/ab_arms_pooled_headline.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree_bench.paired import ab_own_host_split, ab_pooled, row_label  # noqa: E402
from ddtree_bench.results import latest_results, read_rows  # noqa: E402


def locked_rows(rows: list[dict], labels: set, share: float) -> list[dict]:
    """The A/B rows of `labels` whose `auto` arm ran a narrower candidate in more than `share` of its rounds."""
    out = []
    for r in rows:
        if r.get("kind") != "result" or not r.get("ab_runs") or row_label(r) not in labels:
            continue
        ab = (r.get("ddtree_metrics") or {}).get("ab") or {}
        auto = ab.get("auto") or {}
        if auto.get("rounds") and (auto.get("narrower_rounds") or 0) > share * auto["rounds"]:
            out.append({"server": row_label(r), "batch_size": r["batch_size"], "narrower_rounds":
                        auto["narrower_rounds"], "rounds": auto["rounds"], "ratio": ab.get("ratio")})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweeps", nargs="+", type=Path, help="bench_budgets.py results files of `tiny-ab` calls")
    ap.add_argument("--arm", action="append", required=True, metavar="NAME=PREFIX",
                    help="an arm: the A/B servers whose label starts with PREFIX (repeat)")
    ap.add_argument("--locked-share", type=float, default=0.3, help="a row is locked above this narrower share")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    rows: list = []
    per_sweep: list = []  # each file's A/B server labels: a label may repeat across files (another run's server)
    for path in args.sweeps:
        sweep_rows = list(latest_results(read_rows(path)).values())
        rows += sweep_rows
        per_sweep.append({row_label(r) for r in sweep_rows if r.get("kind") == "result" and r.get("ab_runs")})
    servers = set().union(*per_sweep)
    out: dict = {"sweeps": [p.name for p in args.sweeps], "locked_share": args.locked_share, "arms": {}}
    for spec in args.arm:
        name, _, prefix = spec.partition("=")
        labels = {s for s in servers if s.startswith(prefix)}
        count = sum(len(labels & sweep) for sweep in per_sweep)
        if not labels:
            ap.error(f"arm {name}: no A/B server's label starts with {prefix!r}")
        pooled = ab_pooled(rows, labels)
        locked = locked_rows(rows, labels, args.locked_share)
        rows_counted = sum(1 for r in rows if r.get("kind") == "result" and r.get("ab_runs")
                           and row_label(r) in labels)
        out["arms"][name] = {"servers": sorted(labels), "server_count": count,
                             "pooled": {str(k): v for k, v in pooled["by_batch_size"].items()},
                             "all_batch_sizes": pooled["all_batch_sizes"],
                             "own_host": {str(k): v for k, v in ab_own_host_split(rows, labels).items()},
                             "locked_rows": locked, "rows": rows_counted}
        cells = []
        for bs, v in pooled["by_batch_size"].items():
            if v:
                cells.append(f"batch {bs} x{v['ratio']:.3f} [{v['ci95'][0]:.3f}, {v['ci95'][1]:.3f}]")
        a = pooled["all_batch_sizes"]
        print(f"{name} ({count} servers): " + ", ".join(cells)
              + f"; all x{a['ratio']:.3f} [{a['ci95'][0]:.3f}, {a['ci95'][1]:.3f}]; locked rows {len(locked)} of "
              f"{rows_counted}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
