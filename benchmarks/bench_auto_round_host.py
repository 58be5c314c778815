"""Host cost of `auto`'s per-round block in the SGLang worker, on the CPU: what DDTreeWorker.forward_batch_generation
runs for `auto` around the GPU work (a held round's held_round, or drain, choose and sampled before a decision, the
Prometheus round counter, the walk variant, the feedback push with the sampled rounds' cat, the table's learn on
scored rounds, after_round with its snapshot publish at most once in stats.TableGauges.SECONDS, so once a
run here), with the real policy, feedback, monitor and Prometheus series on CPU tensors and a fake timer (times drawn
at random, every candidate alike). Then the same loop under cProfile: each piece's cumulative share. The server runs
this Python ~2-3x slower (lease 23: auto_host_costs_lease23).

    python benchmarks/bench_auto_round_host.py --out benchmarks/results/auto_round_host_cpu.json
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CANDIDATES = [0, 16, 32, 64, 128]
WIDTHS = [16, 17, 33, 65, 129]
PIECES = ("choose", "held_round", "drain", "observe", "sample_interval", "push", "auto_round", "after_round",
          "calibration_table", "learn", "variant")


class _Timer:
    enabled = True

    def __init__(self, ms: float):
        self.marks = [None]
        self._ms = ms

    def done(self) -> bool:
        return True

    def elapsed_ms(self) -> dict:
        return {"between": 1.0, "draft": 1.0, "tree": 0.2, "verify": 1.1, "walk": 0.1, "commit": self._ms}


def round_block(seed: int = 0):
    """-> one(): a round of the worker's `auto` host block at batch 1 (bucket 1)."""
    import torch
    from prometheus_client import CollectorRegistry

    from sglang_ddtree.adaptive import CHAIN, ScoreCalibrator, candidate_label
    from sglang_ddtree.sglang.auto import AutoBudgetPolicy, AutoFeedback, CalibrationMonitor, WalkSchedule
    from sglang_ddtree.sglang.stats import _Prometheus

    policy = AutoBudgetPolicy(list(CANDIDATES), widths=WIDTHS)
    prom = _Prometheus(15, "auto", registry=CollectorRegistry())
    monitor = CalibrationMonitor(ScoreCalibrator(), prom)
    feedback = AutoFeedback(policy, "cpu", monitor)
    walks = WalkSchedule()
    rng = random.Random(seed)
    n = len(CANDIDATES)
    expected, observed, errors, no_errors = torch.rand(n), torch.rand(n), torch.rand(3), torch.zeros(3)
    delta = torch.rand(3, 540, dtype=torch.float64)
    state = {"counter": 0}
    seen = set()

    def one():
        bucket = 1
        held = policy.held_round(bucket, state["counter"])
        if held is None:
            feedback.drain()
            chosen = policy.choose(bucket)
            sampled = policy.sampled(state["counter"], bucket)
        else:
            chosen, sampled = held
        prom.auto_round(candidate_label(CANDIDATES[chosen]))
        scored = walks.variant(CANDIDATES[chosen] == CHAIN, sampled, monitor) in WalkSchedule.SCORED  # as the worker
        seen.add((bucket, chosen))
        vector = torch.cat([expected, observed, errors if scored else no_errors]) if sampled else None
        feedback.push(vector, _Timer(rng.uniform(0.3, 0.6)), bucket, chosen, 1, sampled=sampled,
                      young=monitor.young())
        if scored:
            monitor.learn(delta, 1)
        monitor.after_round()
        state["counter"] += 1

    return one


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warm", type=int, default=3000, help="rounds before timing (past exploration)")
    ap.add_argument("--rounds", type=int, default=10000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    one = round_block()
    for _ in range(args.warm):
        one()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        for _ in range(args.rounds):
            one()
        times.append((time.perf_counter() - start) / args.rounds * 1e6)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.rounds):
        one()
    profiler.disable()
    stats = pstats.Stats(profiler)
    shares = {}
    for (_, _, name), (_, _, _, cumulative, _) in stats.stats.items():
        if name in PIECES:
            shares[name] = round(shares.get(name, 0.0) + cumulative / stats.total_tt, 3)
    from sglang_ddtree.bench.results import emit_result, head_commit

    result = {"what": "us per round of auto's per-round host block on the CPU (median of repeats), its Python calls a "
                      "round, and each piece's cumulative share of it under cProfile (drain includes observe; "
                      "after_round the table publish)",
              "commit": head_commit(), "rounds": args.rounds, "repeats": args.repeats,
              "median_us_per_round": round(statistics.median(times), 1), "runs_us": [round(t, 1) for t in times],
              # deterministic where the timings are not (this 2-core VM's timings moved 25-53 us between runs of
              # one commit): Python calls a round, builtins included, in the profiled pass
              "python_calls_per_round": round(stats.total_calls / args.rounds, 1),
              "cumulative_share_profiled": dict(sorted(shares.items(), key=lambda kv: -kv[1]))}
    emit_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
