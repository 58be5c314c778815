"""Host cost of three pieces of `auto`'s periodic and per-round bookkeeping, on the CPU, for the cuts that lease 38's
detail split (SGLANG_DDTREE_AUTO_HOST_DETAIL) pointed at:

- a Prometheus Counter inc, in-process and under prometheus_client's multiprocess mode (SGLang sets
  PROMETHEUS_MULTIPROC_DIR with --enable-metrics), against a dict add (`_Prometheus.auto_round` sums its rounds);
- the chooser's log line (`AutoRounds.maybe_log`: the policy's and the table's export, formatted by logging), with
  the policy of bench_auto_round_host.py after its warm rounds (one bucket);
- the calibration table's publish with its summary rows (`CalibrationMonitor._publish`).

    python benchmarks/bench_auto_bookkeeping.py --out benchmarks/results/auto_bookkeeping_cpu.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def _per_call_us(fn, loops: int, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(loops):
            fn()
        runs.append((time.perf_counter() - start) / loops * 1e6)
    return round(statistics.median(runs), 2)


def counter_us(loops: int, repeats: int) -> dict:
    """In this process: us per Counter inc and per dict add (run with PROMETHEUS_MULTIPROC_DIR set for the mode)."""
    from prometheus_client import CollectorRegistry, Counter

    child = Counter("x_total", "x", ["budget", "candidate"], registry=CollectorRegistry()).labels(
        budget="auto", candidate="128")
    pending: dict = {}

    def add():
        pending["128"] = pending.get("128", 0) + 1

    return {"inc_us": _per_call_us(child.inc, loops, repeats), "dict_add_us": _per_call_us(add, loops, repeats)}


def log_and_publish_us(loops: int, repeats: int) -> dict:
    import bench_auto_round_host

    one = bench_auto_round_host.round_block()
    for _ in range(3000):  # past exploration, as bench_auto_round_host's --warm
        one()
    cells = {type(c.cell_contents).__name__: c.cell_contents for c in one.__closure__}
    policy, monitor = cells["AutoBudgetPolicy"], cells["CalibrationMonitor"]
    log = logging.getLogger("bench_auto_bookkeeping")
    log.propagate = False
    log.addHandler(logging.StreamHandler(open(os.devnull, "w")))
    log.setLevel(logging.INFO)

    def log_line():  # what AutoRounds.maybe_log formats
        log.info("DDTREE auto after %d rounds: %s", 1,
                 {**policy.export(), "lean_chain_rounds": 0, "calibration": monitor.export()})

    def publish():
        monitor._publish(monitor.calibrator.summary())

    return {"buckets": len(policy.buckets), "log_line_us": _per_call_us(log_line, loops, repeats),
            "publish_us": _per_call_us(publish, loops, repeats)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loops", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--counter-only", choices=("plain", "multiprocess"), help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.counter_only:  # a child process: the multiprocess mode is chosen at import
        print(json.dumps(counter_us(100 * args.loops, args.repeats)))
        return 0
    counters = {}
    with tempfile.TemporaryDirectory() as multiproc_dir:
        for mode in ("plain", "multiprocess"):
            env = dict(os.environ)
            env.pop("PROMETHEUS_MULTIPROC_DIR", None)
            if mode == "multiprocess":
                env["PROMETHEUS_MULTIPROC_DIR"] = multiproc_dir
            out = subprocess.run([sys.executable, __file__, "--counter-only", mode, "--loops", str(args.loops),
                                  "--repeats", str(args.repeats)], env=env, capture_output=True, text=True,
                                 check=True).stdout
            counters[mode] = json.loads(out)
    from sglang_ddtree.bench.results import emit_result, head_commit

    result = {"what": "us per call on the CPU (median of repeats): Prometheus Counter inc in-process and under "
                      "multiprocess mode against a dict add; the chooser's log line; the calibration table's "
                      "publish with its summary rows",
              "commit": head_commit(), "loops": args.loops, "repeats": args.repeats, "counter": counters,
              **log_and_publish_us(args.loops, args.repeats)}
    emit_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
