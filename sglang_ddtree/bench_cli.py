"""`sglang-ddtree bench` (the SGLang budget sweep) and `sglang-ddtree summary` (regenerate summary.json).

Both run a checkout's scripts and its benchmark harness (ddtree_bench/, next to this package, not shipped in the
wheel); from an installed wheel they say so and exit 2.

The script runs in a child process named after the command (its --help and errors say `sglang-ddtree bench`, not
the script's file name), in a process group of its own: Ctrl-C reaches it once, through this process, which then
waits for it to stop (the sweep stops its servers and keeps the rows measured so far) and says in one line what was
kept, with exit status 130.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH_SCRIPT = "benchmarks/bench_budgets.py"
SUMMARY_SCRIPT = "scripts/make_summary.py"
HARNESS = "ddtree_bench"

# Runs a script as `python SCRIPT ARGS` would (as __main__, its own folder first on sys.path), with sys.argv[0] set
# to the command's name, which argparse takes for its prog; Ctrl-C ends it with status 130 and no traceback (the
# parent says what was kept).
_RUN_AS = """\
import importlib.util, os, sys
path, sys.argv = sys.argv[1], sys.argv[2:]
sys.path[0] = os.path.dirname(path)
try:
    spec = importlib.util.spec_from_file_location("__main__", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["__main__"] = module
    spec.loader.exec_module(module)
except KeyboardInterrupt:
    sys.exit(130)
"""


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


def _run_script(command: str, script: str, argv: list[str], kept) -> int:
    """Run `script` as `sglang-ddtree COMMAND`; on Ctrl-C, wait for it to stop and raise cli_args.Interrupted with
    `kept()`, a sentence saying what the interrupted run kept."""
    from sglang_ddtree.cli_args import Interrupted

    missing = _missing(script)
    if missing:
        print(f"error: {missing} is not in this installation; the {command} command runs from a clone of the "
              "repository.", file=sys.stderr)
        return 2
    proc = subprocess.Popen([sys.executable, "-c", _RUN_AS, str(ROOT / script), f"sglang-ddtree {command}", *argv],
                            process_group=0)
    interrupted = False
    ended_by = []  # SIGTERM / SIGHUP to this process: passed on to the script (its own group: it stops its servers)

    def pass_on(signum, _frame):
        ended_by.append(signum)
        proc.send_signal(signum)

    previous = {sig: signal.signal(sig, pass_on) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        while True:
            try:
                rc = proc.wait()
                break
            except KeyboardInterrupt:  # each Ctrl-C reaches the script once, as if it ran in the foreground
                interrupted = True
                proc.send_signal(signal.SIGINT)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if interrupted:
        raise Interrupted(kept())
    if ended_by:
        return 128 + ended_by[0]
    return rc


def run_bench(argv: list[str]) -> int:
    return _run_script("bench", BENCH_SCRIPT, argv, lambda: (
        "the rows measured before the stop stay in the sweep's results file (a rerun without --fresh resumes it)."))


def _run_summary(args) -> int:
    path = ROOT / "benchmarks" / "results" / "summary.json"
    before = path.read_bytes() if path.exists() else None

    def kept() -> str:
        now = path.read_bytes() if path.exists() else None
        return (f"{path.relative_to(ROOT)} is unchanged." if now == before or args.check else
                f"{path.relative_to(ROOT)} was being rewritten: run `sglang-ddtree summary` again.")

    return _run_script("summary", SUMMARY_SCRIPT, ["--check"] if args.check else [], kept)
