"""How fast each vCPU runs a fixed pure-Python loop, and how that changes over time (one machine: 0.32-0.68 s per
vCPU for one loop, the order changing between passes seconds apart).

Round-robin over the vCPUs this process may use, one short timed loop per vCPU per pass, for --seconds. Writes per
sample (pass, vCPU, start time, seconds) and per vCPU the spread and the correlation of consecutive samples: a
correlation near 1 at the pass interval means a process's speed holds from one pass to the next, so alternating
two configurations faster than that would cancel it; near 0 means it does not.

    python3 scripts/device/vcpu_speed.py --seconds 60 --out $OUT/vcpu_speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def spin(iterations: int) -> float:
    """Seconds of one pure-Python loop (the kind of work SGLang's scheduler does between kernel launches)."""
    start = time.perf_counter()
    s = 0
    for i in range(iterations):
        s += i * i
    return time.perf_counter() - start


def lag1_correlation(xs: list[float]) -> float | None:
    if len(xs) < 3:
        return None
    a, b = xs[:-1], xs[1:]
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    va = sum((x - ma) ** 2 for x in a)
    vb = sum((y - mb) ** 2 for y in b)
    if va == 0 or vb == 0:
        return None
    return sum((x - ma) * (y - mb) for x, y in zip(a, b)) / (va * vb) ** 0.5


def measure(seconds: float, iterations: int, cpus: list[int]) -> dict:
    samples, t0, passes = [], time.perf_counter(), 0
    original = os.sched_getaffinity(0)
    try:
        while time.perf_counter() - t0 < seconds:
            for cpu in cpus:
                os.sched_setaffinity(0, {cpu})
                started = time.perf_counter() - t0
                samples.append({"pass": passes, "cpu": cpu, "t": round(started, 4), "s": round(spin(iterations), 5)})
            passes += 1
    finally:
        os.sched_setaffinity(0, original)
    per_cpu = {}
    for cpu in cpus:
        xs = [x["s"] for x in samples if x["cpu"] == cpu]
        per_cpu[str(cpu)] = {"n": len(xs), "min": min(xs), "median": statistics.median(xs), "max": max(xs),
                             "lag1_correlation": lag1_correlation(xs)}
    every = [x["s"] for x in samples]
    return {"iterations": iterations, "seconds": seconds, "passes": passes, "cpus": cpus,
            "pass_interval_s": round((time.perf_counter() - t0) / max(passes, 1), 4),
            "min_s": min(every), "max_s": max(every), "max_over_min": round(max(every) / min(every), 3),
            "per_cpu": per_cpu, "samples": samples}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--iterations", type=int, default=200_000, help="loop length per sample (~20-40 ms there)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.seconds <= 0 or args.iterations < 1:
        ap.error("--seconds must be > 0 and --iterations >= 1")
    cpus = sorted(os.sched_getaffinity(0))
    result = measure(args.seconds, args.iterations, cpus)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"vcpu_speed: {len(cpus)} vCPUs x {result['passes']} passes, {result['min_s']:.4f}-{result['max_s']:.4f} s "
          f"(x{result['max_over_min']}), pass every {result['pass_interval_s']} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
