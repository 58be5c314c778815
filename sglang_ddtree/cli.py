"""`sglang-ddtree` command line: demo | offline | compare | import-reference | from-server | bench | summary."""

from __future__ import annotations

import argparse
import sys


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="the main job: plain vs DFLASH chain vs DDTree on the tiny pair (CPU or GPU)")
    p.add_argument("--budgets", default="16,64,256", help="DDTree budgets, comma separated")
    p.add_argument("--prompts", type=int, default=4, help="HumanEval prompts to run")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--out", default="runs/demo", help="output folder (baseline JSONL + summary JSON)")
    p.set_defaults(func=_run_demo)


def _run_demo(args) -> int:
    from sglang_ddtree.demo import run_demo

    return run_demo(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sglang-ddtree", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_demo(sub)
    from sglang_ddtree.offline.cli_commands import (add_compare_parser, add_import_parser, add_offline_parser,
                                                    add_zlab_parser)

    add_offline_parser(sub)
    add_compare_parser(sub)
    add_import_parser(sub)
    add_zlab_parser(sub)
    from sglang_ddtree.sglang_baseline import add_from_server_parser

    add_from_server_parser(sub)
    from sglang_ddtree.bench_cli import add_bench_parser, add_summary_parser

    add_bench_parser(sub)
    add_summary_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
