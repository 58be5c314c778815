"""`sglang-ddtree` command line: demo | offline | compare | import-reference | from-server | bench | summary.

Every input error is one line on stderr and exit status 2, found before any model loads (sglang_ddtree.cli_args).
Ctrl-C stops any command with one line saying what was kept, and exit status 130.
"""

from __future__ import annotations

import sys

from sglang_ddtree.cli_args import (CliParser, Interrupted, budget_list, check_output_dir, device_name, fail,
                                   positive_int)


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="the main job: plain vs DFLASH chain vs DDTree on the tiny pair (CPU or GPU)",
                       description="Plain decoding, the DFLASH chain and DDTree at a few budgets on the committed tiny "
                                   "pair: a warm-up, then timed repeats; prints tau, the median tokens/s with its "
                                   "min-max and the losslessness check.")
    p.add_argument("--budgets", type=budget_list, default="16,64,256",
                   help="DDTree budgets, comma separated, each in 1..1024 (default 16,64,256)")
    p.add_argument("--prompts", type=positive_int, default=4, help="HumanEval prompts per repeat (default 4)")
    p.add_argument("--max-new-tokens", type=positive_int, default=96, help="tokens per prompt (default 96)")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="timed repeats after the warm-up; the median and min-max are reported (default 3)")
    p.add_argument("--device", type=device_name, default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch CPU threads (default: OMP_NUM_THREADS when set, else 1: the tiny pair's matrices are "
                        "too small to gain from more, and extra threads stall on shared cores)")
    p.add_argument("--out", default="runs/demo", help="output folder (baseline JSONL + summary JSON)")
    p.set_defaults(func=_run_demo)


def _run_demo(args) -> int:
    from sglang_ddtree.demo import model_args, run_demo
    from sglang_ddtree.offline.cli_commands import model_paths

    try:
        check_output_dir(args.out)
        model_paths(model_args(args))
    except ValueError as e:
        return fail(str(e))
    return run_demo(args)


def build_parser() -> CliParser:
    parser = CliParser(prog="sglang-ddtree", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(argv)
    except Interrupted as e:
        print(f"interrupted: {e}", file=sys.stderr)
    except KeyboardInterrupt:
        command = f" {argv[0]}" if argv and not argv[0].startswith("-") else ""
        print(f"interrupted: sglang-ddtree{command} stopped before it finished.", file=sys.stderr)
    return 130


def _main(argv: list[str]) -> int:
    if argv[:1] == ["bench"]:  # every argument (--help included) belongs to benchmarks/bench_budgets.py
        from sglang_ddtree.bench_cli import run_bench

        return run_bench(argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
