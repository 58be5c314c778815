"""`sglang-ddtree bench` (the SGLang budget sweep) and `sglang-ddtree summary` (regenerate summary.json)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH_SCRIPT = "benchmarks/bench_budgets.py"


def add_bench_parser(sub) -> None:
    # Listed for `sglang-ddtree --help` only: cli.main hands every argument after `bench` (--help included) to the
    # script, whose own parser documents them.
    p = sub.add_parser("bench", help="SGLang sweep: budgets x batch sizes x {plain, DFLASH, DDTREE} (needs a GPU; "
                                     "`bench --help` lists its options)", add_help=False)
    p.add_argument("bench_args", nargs="*", help=f"arguments for {BENCH_SCRIPT}")
    p.set_defaults(func=lambda a: run_bench(a.bench_args))


def add_summary_parser(sub) -> None:
    p = sub.add_parser("summary", help="regenerate benchmarks/results/summary.json from the raw result files")
    p.add_argument("--check", action="store_true", help="fail if summary.json is stale")
    p.set_defaults(func=_run_summary)


def run_bench(argv: list[str]) -> int:
    path = ROOT / BENCH_SCRIPT
    if not path.exists():
        print(f"error: {BENCH_SCRIPT} is not in this installation; the bench command runs from a clone of the "
              "repository.", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, str(path), *argv])


def _run_summary(args) -> int:
    path = ROOT / "scripts" / "make_summary.py"
    if not path.exists():
        print("error: scripts/make_summary.py is not in this installation; the summary command runs from a clone of "
              "the repository.", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, str(path)] + (["--check"] if args.check else []))
