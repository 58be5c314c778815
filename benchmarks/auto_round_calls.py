"""Python calls a round of `auto`'s per-round host block (benchmarks/bench_auto_round_host.py's round_block) in a
given checkout, under cProfile: a deterministic-looking proxy where this 2-core VM's timings move 25-53 us a round
between runs of one commit. The count still moves from process to process (string-hash order; fix PYTHONHASHSEED
and it still moved by a few % between runs), so compare several runs of each tree.

    for s in 0 1 2; do for t in /tmp/base .; do
        PYTHONHASHSEED=$s python benchmarks/auto_round_calls.py $t
    done; done
"""

from __future__ import annotations

import cProfile
import json
import pstats
import sys
from pathlib import Path


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    tree = Path(args[0] if args else Path(__file__).resolve().parents[1]).resolve()
    rounds = int(args[1]) if len(args) > 1 else 20000
    sys.path.insert(0, str(tree / "benchmarks"))
    sys.path.insert(0, str(tree))
    import bench_auto_round_host

    one = bench_auto_round_host.round_block()
    for _ in range(3000):  # past exploration
        one()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(rounds):
        one()
    profiler.disable()
    calls = pstats.Stats(profiler).total_calls / rounds
    print(json.dumps({"tree": str(tree), "rounds": rounds, "python_calls_per_round": round(calls, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
