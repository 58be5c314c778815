"""Host cost of one publish of `auto`'s calibration table to Prometheus (`_Prometheus.calibration_table`, at most one in
stats.TableGauges.SECONDS): every cell of the default table (15 depths x 3 path classes x 2 rank
classes = 90) set on its two gauges, in a private registry. CPU only; compare two commits on one machine.

    python benchmarks/bench_calibration_publish.py --out benchmarks/results/calibration_publish_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def publish_us(loops: int, repeats: int) -> list[float]:
    from prometheus_client import CollectorRegistry

    from sglang_ddtree.sglang.stats import _Prometheus

    prom = _Prometheus(15, "auto", registry=CollectorRegistry())
    rows = [{"depth": d, "path_class": p, "rank_class": r, "ratio": 0.9, "observations": 10.0}
            for d in range(1, 16) for p in range(3) for r in range(2)]
    prom.calibration_table(rows)  # the first publish creates the series
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(loops):
            prom.calibration_table(rows)
        out.append((time.perf_counter() - start) / loops * 1e6)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loops", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    times = publish_us(args.loops, args.repeats)
    from sglang_ddtree.bench.results import head_commit

    result = {"what": "us per publish of the 90-cell calibration table (median of repeats of loops)",
              "cells": 90, "loops": args.loops, "repeats": args.repeats, "commit": head_commit(),
              "median_us": round(statistics.median(times), 1), "runs_us": [round(t, 1) for t in times]}
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
