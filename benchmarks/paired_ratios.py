"""Every row of an interleaved sweep over one base row, run by run, with 95% intervals (sglang_ddtree.bench.paired).

    python benchmarks/paired_ratios.py benchmarks/results/sweep_paired_tiny_lease22.jsonl --base "tiny|ddtree-128"

prints, per batch size, each row's tokens/s over the base row's (the geometric mean of the per-round ratios), its
95% interval and the number of rounds, then the same with the rounds of every batch size together; `--json PATH`
writes the same tables. Rows are named setup|method or setup|method-budget.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglang_ddtree.bench.paired import paired_table, pooled_ratios, row_label  # noqa: E402
from sglang_ddtree.bench.results import latest_results, read_rows  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="a bench_budgets.py results file (JSONL) of an --interleave sweep")
    ap.add_argument("--base", required=True, help="the row every other row is divided by, e.g. 'tiny|ddtree-128'")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the table as JSON")
    args = ap.parse_args(argv)
    try:
        rows = list(latest_results(read_rows(args.results)).values())
        table = paired_table(rows, args.base)
        pooled = pooled_ratios(rows, args.base)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not table:
        labels = sorted({row_label(r) for r in rows if r.get("status") == "ok"})
        print(f"error: no batch size has a measured row {args.base!r}; rows: {', '.join(labels) or 'none'}",
              file=sys.stderr)
        return 2
    for bs, ratios in table.items():
        print(f"batch {bs}: over {args.base}")
        for label, r in ratios.items():
            lo, hi = r["ci95"]
            print(f"  {label:28s} x{r['ratio']:.3f}  [{lo:.3f}, {hi:.3f}]  {r['rounds']} rounds")
    if len(table) > 1:
        print(f"all batch sizes together: over {args.base}")
        for label, r in pooled.items():
            lo, hi = r["ci95"]
            print(f"  {label:28s} x{r['ratio']:.3f}  [{lo:.3f}, {hi:.3f}]  {r['rounds']} rounds")
    if args.json:
        Path(args.json).write_text(json.dumps({"base": args.base, "results": str(args.results),
                                               "by_batch_size": {str(k): v for k, v in table.items()},
                                               "all_batch_sizes": pooled}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
