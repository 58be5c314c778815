"""The rows the committed plots and projection are drawn from: the 8b-dummy setup of lease 2's sweep (clean stage
splits) and the tiny setup of lease 3's sweep (the shipped pair), with lease 3's tiny stage splits dropped (the
worker published metrics late then: a server's warm-up rounds, Triton compiles included, landed in its first
workloads; see benchmarks/results/README.md). Tokens/s, step times and tau are kept.

  python scripts/merge_sweeps_for_plots.py > /tmp/merged_sweep.jsonl
  python -m sglang_ddtree.bench.plots --sweep /tmp/merged_sweep.jsonl \
      --projection benchmarks/results/best_budget.json --out-dir benchmarks/results

--round-graphs: instead, the batch-1 rows of leases 6-7 with the round's stage graphs on and off, the setup name
suffixed with the mode, for the stage-breakdown plot stage_breakdown_round_graphs.png:
  python scripts/merge_sweeps_for_plots.py --round-graphs > /tmp/rg.jsonl
  python -m sglang_ddtree.bench.plots --sweep /tmp/rg.jsonl --out-dir /tmp/rg
  cp /tmp/rg/stage_breakdown.png benchmarks/results/stage_breakdown_round_graphs.png
"""

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


ROUND_GRAPHS = (("sweep_tiny_bs1_graphs_on_2026-11-29_e205a8d.jsonl", "graphs on"),
                ("sweep_tiny_bs1_graphs_off_2026-11-29_e205a8d.jsonl", "graphs off"),
                ("sweep_8b_bs1_graphs_on_2026-11-29_e205a8d.jsonl", "graphs on"),
                ("sweep_8b_lease6_graphs_off.jsonl", "graphs off"))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--round-graphs"]:
        for name, mode in ROUND_GRAPHS:
            for line in (RESULTS / name).read_text().splitlines():
                row = json.loads(line)
                if row.get("setup") and row.get("batch_size") == 1:
                    row["setup"] = f"{row['setup']}, {mode}"
                    row["key"] = "|".join([row["setup"], *row["key"].split("|")[1:]])  # rows are keyed by setup
                    sys.stdout.write(json.dumps(row) + "\n")
        return 0
    if argv:
        print("usage: merge_sweeps_for_plots.py [--round-graphs]", file=sys.stderr)
        return 2
    for name, setup, drop_stages in (("sweep_h200.jsonl", "8b-dummy", False),
                                     ("sweep_tiny_h200_2026-11-29_d7e5344.jsonl", "tiny", True)):
        for line in (RESULTS / name).read_text().splitlines():
            row = json.loads(line)
            if row.get("setup") != setup:
                continue
            if drop_stages:
                row.pop("stage_ms", None)
            sys.stdout.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
