"""What `auto`'s chooser block costs the host per round, piece by piece, outside a server: the policy's Python
(choose, sample_interval, observe through AutoFeedback.drain) and the CUDA calls it makes on real events (a round
timer's event queries and elapsed times). Lease 23's host stages showed `choose` at 0.15-0.17 ms a round in the
server against ~20 us of policy Python on the CPU machine; this splits it on the device's own CPU.

    python3 scripts/device/auto_host_costs.py [--cpu N] [--rounds 20000] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv=None) -> int:
    import torch

    from sglang_ddtree.sglang.auto import AutoBudgetPolicy, AutoFeedback
    from sglang_ddtree.sglang.stats import RoundTimer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", type=int, default=None, help="pin this process to one vCPU")
    ap.add_argument("--rounds", type=int, default=20000)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    cands = [0, 16, 32, 64, 128]
    policy = AutoBudgetPolicy(cands, widths=[16, 17, 33, 65, 129])
    feedback = AutoFeedback(policy, device)
    vector = torch.tensor([5.0, 6, 7, 8, 9, 4, 5, 5.5, 6, 6.5, 0, 0, 0], device=device)
    parts = {"drain": 0.0, "choose": 0.0, "sample_interval": 0.0, "timer": 0.0, "push": 0.0}
    x = torch.zeros(1, device=device)

    def one(r: int, measure: bool) -> None:
        t0 = time.perf_counter()
        if not hasattr(policy, "deciding") or policy.deciding(1):  # as the worker: drain before a decision only
            feedback.drain()
        t1 = time.perf_counter()
        c = policy.choose(1)
        t2 = time.perf_counter()
        sampled = policy.sampled(r, 1)
        t3 = time.perf_counter()
        timer = RoundTimer(cuda)
        for stage in ("draft", "tree", "verify", "walk", "commit"):
            x.add_(1.0)  # a little GPU work between the marks
            timer.mark(stage)
        t4 = time.perf_counter()
        feedback.push(vector.clone() if sampled else None, timer, 1, c, 1, sampled=sampled)
        t5 = time.perf_counter()
        if measure:
            for k, a, b in (("drain", t0, t1), ("choose", t1, t2), ("sample_interval", t2, t3), ("timer", t3, t4),
                            ("push", t4, t5)):
                parts[k] += b - a

    for r in range(3000):
        one(r, False)
    for r in range(args.rounds):
        one(r, True)
    us = {k: round(v / args.rounds * 1e6, 2) for k, v in parts.items()}
    # the CUDA calls alone
    calls = {}
    if cuda:
        e1, e2 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e1.record()
        x.add_(1.0)
        e2.record()
        torch.cuda.synchronize()
        for name, fn in (("event_query", e2.query), ("elapsed_time", lambda: e1.elapsed_time(e2)),
                         ("event_record", e2.record), ("new_event", lambda: torch.cuda.Event(enable_timing=True))):
            t = time.perf_counter()
            for _ in range(20000):
                fn()
            calls[name] = round((time.perf_counter() - t) / 20000 * 1e6, 3)
    result = {"device": device, "cpu": args.cpu, "rounds": args.rounds, "us_per_round": us,
              "us_per_cuda_call": calls, "chosen": policy.export()["rounds_chosen"]}
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
