"""`sglang-ddtree bench` (the SGLang budget sweep) and `sglang-ddtree summary` (regenerate summary.json)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="SGLang sweep: budgets x batch sizes x {plain, DFLASH, DDTREE} (needs a GPU)",
                       add_help=False)
    p.add_argument("bench_args", nargs="*", help="arguments for benchmarks/bench_budgets.py (see its --help)")
    p.set_defaults(func=_run_script("benchmarks/bench_budgets.py", "bench_args"))


def add_summary_parser(sub) -> None:
    p = sub.add_parser("summary", help="regenerate benchmarks/results/summary.json from the raw result files")
    p.add_argument("--check", action="store_true", help="fail if summary.json is stale")
    p.set_defaults(func=lambda a: subprocess.call([sys.executable, str(ROOT / "scripts" / "make_summary.py")]
                                                  + (["--check"] if a.check else [])))


def _run_script(script: str, attr: str):
    def run(args) -> int:
        path = ROOT / script
        if not path.exists():
            print(f"error: {script} is not in this checkout (the bench command needs the repository).",
                  file=sys.stderr)
            return 2
        return subprocess.call([sys.executable, str(path), *getattr(args, attr)])

    return run
