"""`sglang-ddtree bench` (the SGLang budget sweep) and `sglang-ddtree summary` (regenerate summary.json).

Both run a checkout's scripts and its benchmark harness (ddtree_bench/, next to this package, not shipped in the
wheel); from an installed wheel they say so and exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH_SCRIPT = "benchmarks/bench_budgets.py"
SUMMARY_SCRIPT = "scripts/make_summary.py"
HARNESS = "ddtree_bench"


def _missing(script: str) -> str | None:
    """What of a checkout's script and harness is absent next to this package (None: both there)."""
    for name in (script, HARNESS):
        if not (ROOT / name).exists():
            return name
    return None


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


def _run_script(command: str, script: str, argv: list[str]) -> int:
    missing = _missing(script)
    if missing:
        print(f"error: {missing} is not in this installation; the {command} command runs from a clone of the "
              "repository.", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, str(ROOT / script), *argv])


def run_bench(argv: list[str]) -> int:
    return _run_script("bench", BENCH_SCRIPT, argv)


def _run_summary(args) -> int:
    return _run_script("summary", SUMMARY_SCRIPT, ["--check"] if args.check else [])
