"""The rows the committed plots and projection are drawn from: the 8b-dummy setup of lease 2's sweep (clean stage
splits) and the tiny setup of lease 3's sweep (the shipped pair), with lease 3's tiny stage splits dropped (the
worker published metrics late then: a server's warm-up rounds, Triton compiles included, landed in its first
workloads; see benchmarks/results/README.md). Tokens/s, step times and tau are kept.

  python scripts/merge_sweeps_for_plots.py > /tmp/merged_sweep.jsonl
  python -m sglang_ddtree.bench.plots --sweep /tmp/merged_sweep.jsonl \
      --projection benchmarks/results/best_budget.json --out-dir benchmarks/results
"""

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def main() -> int:
    for name, setup, drop_stages in (("sweep_h200.jsonl", "8b-dummy", False),
                                     ("sweep_tiny_h200_lease3.jsonl", "tiny", True)):
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
