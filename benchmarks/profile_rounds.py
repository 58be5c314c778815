"""Profile decode rounds of DFLASH and DDTREE servers: where a round's time goes.

For each (setup, method, budget) it starts the same server the budget sweep starts (ddtree_bench/plan.py), warms it up,
starts --batch-size long greedy requests (batch 1 by default), records `--steps` scheduler steps with SGLang's
torch profiler (/start_profile: CPU + GPU activity, no stacks) and reads the trace (ddtree_bench/trace.py):
wall and GPU-busy ms per step, the GPU idle time, kernels, CUDA runtime calls, host syncs, and the DDTREE worker's
per-stage ranges (servers run with SGLANG_DDTREE_PROFILE_RANGES=1). The profiler adds host time per traced call, so the absolute
numbers are above an unprofiled run's; compare methods within one run.

  python3 benchmarks/profile_rounds.py --out $OUT/profile --setups 8b-dummy --budgets 32,256 --steps 40
  python3 benchmarks/profile_rounds.py --out $OUT/profile --setups 8b-dummy --methods dflash,auto --batch-size 16
  python3 benchmarks/profile_rounds.py --out $OUT/profile --setups 8b-real,8b-real-fi --copy-setup 8b-real-fi=8b-real \
      --set 8b-real-fi.backend=flashinfer --set 8b-real-fi.methods=dflash     # one server on another backend

Writes OUT/profile_rounds.json (one entry per server, plus run facts) and OUT/traces/<server>.trace.json.gz.
Exit status 0 when every server was profiled.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ddtree_bench import plan as plan_mod  # noqa: E402
from ddtree_bench import trace  # noqa: E402
from ddtree_bench.measure import HttpClient  # noqa: E402
from ddtree_bench.server import SubprocessLauncher, log_tail, wait_all_ready  # noqa: E402
from ddtree_bench.sweep import id_prompts, run_facts, text_prompts  # noqa: E402


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--setups", default="8b-dummy")
    p.add_argument("--methods", default="dflash,ddtree")
    p.add_argument("--budgets", default="32,256")
    p.add_argument("--steps", type=int, default=40, help="scheduler steps to record per server")
    p.add_argument("--batch-size", type=int, default=1, help="concurrent requests decoding while recorded")
    p.add_argument("--warmup-batches", type=int, default=2,
                   help="batches of 64-token requests before recording (`auto` explores per batch-size bucket and "
                        "captures graphs on first use: one warm-up batch left captures inside the recorded steps)")
    p.add_argument("--start-at-tokens", type=int, default=64,
                   help="start recording once the first request has this many output tokens (same context length "
                        "for every server)")
    p.add_argument("--prompts-file", default=None, help="text prompts for text setups (bench_budgets.py format)")
    p.add_argument("--copy-setup", action="append", default=[], metavar="NEW=BASE",
                   help="a copy of a setup under a new name, changed with --set (as bench_budgets.py's)")
    p.add_argument("--set", action="append", default=[], metavar="SETUP.FIELD=VALUE",
                   help="change a setup before profiling, e.g. 8b-real.backend=flashinfer or "
                        "8b-real-sg.server_env=SGLANG_DDTREE_VERIFY_ATTENTION=sglang (as bench_budgets.py's)")
    p.add_argument("--start-timeout-s", type=float, default=420.0)
    p.add_argument("--commit", default=None)
    args = p.parse_args(argv)
    if args.steps < 5:
        p.error("--steps must be >= 5")
    if args.batch_size < 1:
        p.error("--batch-size must be >= 1")
    if args.warmup_batches < 1:
        p.error("--warmup-batches must be >= 1")
    return args


def servers_to_profile(args) -> list[plan_mod.ServerPlan]:
    """The servers of --setups with --methods, --budgets and --batch-size, then --copy-setup / --set on top (so a
    copy may profile other methods or budgets, another backend or a worker switch in the same run)."""
    try:
        setups = plan_mod.copy_setups(plan_mod.default_setups(), args.copy_setup)
        # Long enough that decoding outlasts the recorded steps whatever the acceptance (16 tokens per round at most)
        setups = {name: plan_mod.with_overrides(
            setup, methods=tuple(m for m in args.methods.split(",") if m),
            budgets=tuple(int(b) for b in args.budgets.split(",") if b), batch_sizes=(args.batch_size,))
            for name, setup in setups.items()}
        setups = plan_mod.apply_sets(setups, args.set)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    chosen = []
    for name in [s for s in args.setups.split(",") if s]:
        if name not in setups:
            raise SystemExit(f"unknown setup {name!r}; known: {', '.join(setups)}")
        chosen.append(setups[name])
    return plan_mod.expand(chosen).servers


def post(client: HttpClient, path: str, body: dict, timeout_s: float) -> str:
    with client._open(path, body, timeout_s) as resp:
        return resp.read().decode(errors="replace")


def profile_one(server, handle, prompts: list[dict], steps: int, trace_dir: Path, warmup_batches: int = 2,
                start_at_tokens: int = 64) -> dict:
    """prompts: one per concurrent request (the batch size). Recording starts once the first request has
    `start_at_tokens` output tokens, so servers are compared at about the same context length (attention cost grows
    with it: a one-second sleep instead left it to chance, and the attention kernels of two servers
    differed by 10%); the request's length at the start and the end of the recording is reported."""
    client = handle.client()
    sampling = {"temperature": 0.0, "ignore_eos": True}
    long_tokens = min(16 * (steps + 30) + start_at_tokens, 2048)
    results: dict = {}
    reached = threading.Event()
    lengths: dict[str, int] = {}

    def progress(result):
        # meta_info's count: text prompts stream text, not always output_ids
        n = max(int((result.meta or {}).get("completion_tokens") or 0), len(result.output_ids or []))
        if n >= start_at_tokens:
            reached.set()
        lengths["last"] = n

    def generate(i: int, tokens: int, timeout_s: float, on_chunk=None):
        results[i] = client.generate_stream({**prompts[i], "sampling_params": {**sampling,
                                                                               "max_new_tokens": tokens}},
                                            timeout_s, on_chunk=on_chunk)

    def start_all(tokens: int, timeout_s: float, watch: bool = False) -> list[threading.Thread]:
        threads = [threading.Thread(target=generate, args=(i, tokens, timeout_s, progress if watch and i == 0
                                                           else None), daemon=True)
                   for i in range(len(prompts))]
        for t in threads:
            t.start()
        return threads

    for _ in range(warmup_batches):  # at the same batch size: JIT compiles, graph captures, `auto`'s exploration
        for t in start_all(64, 300):
            t.join(timeout=300)
        errors = [r.error for r in results.values() if r.error]
        if errors:
            raise RuntimeError(f"warm-up request failed: {errors[0]}")
    results.clear()
    workers = start_all(long_tokens, 600, watch=True)
    if not reached.wait(120):
        raise RuntimeError(f"the profiled request did not reach {start_at_tokens} tokens in 120 s")
    at_start = lengths.get("last", 0)
    out_dir = trace_dir / f"raw-{server.name}"
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    reply = post(client, "/start_profile", {"output_dir": str(out_dir), "num_steps": steps,
                                            "activities": ["CPU", "GPU"], "with_stack": False,
                                            "record_shapes": False, "profile_id": server.name}, 600)
    files = []
    while time.monotonic() - t0 < 300:
        files = sorted(out_dir.glob("*.trace.json.gz"))
        if files:
            break
        time.sleep(1.0)
    at_end = lengths.get("last", 0)
    if not files:
        raise RuntimeError(f"no trace written under {out_dir} (start_profile said: {reply.strip()[:200]})")
    time.sleep(2.0)  # export finishing
    for t in workers:
        t.join(timeout=600)
    failed = [results.get(i) for i in range(len(prompts)) if results.get(i) is None or results[i].error]
    if failed:
        raise RuntimeError(f"{len(failed)} profiled requests failed: {getattr(failed[0], 'error', 'no result')}")
    gen = results[0]
    dest = trace_dir / f"{server.name}.trace.json.gz"
    shutil.move(str(files[0]), dest)
    shutil.rmtree(out_dir, ignore_errors=True)
    analysis = trace.analyze(trace.load(dest), steps)
    return {"trace": dest.name, "batch_size": len(prompts), "profiled_request_tokens": len(gen.output_ids or []),
            "request_tokens_at_profile_start": at_start, "request_tokens_when_trace_written": at_end,
            "prompt_tokens": len(prompts[0].get("input_ids") or []) or None,
            "tokens_per_round_in_request": (gen.meta or {}).get("spec_accept_length"), **analysis}


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    trace_dir = args.out / "traces"
    trace_dir.mkdir(exist_ok=True)
    servers = servers_to_profile(args)
    launcher = SubprocessLauncher(args.out / "logs", env={**os.environ, "SGLANG_DDTREE_PROFILE_RANGES": "1"})
    handles = {s.name: launcher.create(s) for s in servers}
    report = {"facts": run_facts(sys.argv[1:] if argv is None else list(argv), args.commit), "steps": args.steps,
              "servers": {}}
    path = args.out / "profile_rounds.json"
    failed = 0
    try:
        for h in handles.values():
            h.start()
        ready = wait_all_ready(list(handles.values()), time.monotonic() + args.start_timeout_s,
                               on_ready=lambda n, o: print(f"[profile] {n}: {'ready' if isinstance(o, float) else o}",
                                                           flush=True))
        for server in servers:
            entry = {"setup": server.setup.name, "method": server.method, "budget": server.budget,
                     "args": server.args}
            if not isinstance(ready.get(server.name), float):
                entry["error"] = f"did not start: {ready.get(server.name)}"
                failed += 1
            else:
                setup = server.setup
                prompts = (id_prompts(args.batch_size, setup.prompt_tokens, setup.shapes()[0].vocab)
                           if setup.prompt_kind == "ids" else text_prompts(args.batch_size, args.prompts_file))
                try:
                    entry.update(profile_one(server, handles[server.name], prompts, args.steps, trace_dir,
                                             args.warmup_batches, args.start_at_tokens))
                    print(f"[profile] {server.name}: wall {entry['wall_ms']:.3f} ms/step, GPU busy "
                          f"{entry['gpu_busy_ms']:.3f}, idle {entry['gpu_idle_ms']:.3f}; ranges "
                          + ", ".join(f"{k} host {v['host_ms']:.3f}/gpu {v['gpu_ms']:.3f}"
                                      for k, v in entry["ranges"].items()), flush=True)
                except Exception as exc:  # one server's failure must not lose the others' numbers
                    entry["error"] = f"{type(exc).__name__}: {exc}"[:2000] + "\n" + log_tail(
                        getattr(handles[server.name], "log_path", None), 20)
                    failed += 1
                    print(f"[profile] {server.name}: FAILED {entry['error'][:300]}", flush=True)
                handles[server.name].stop()
            report["servers"][server.name] = entry
            path.write_text(json.dumps(report, indent=1) + "\n")
    finally:
        for h in handles.values():
            h.stop()
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"[profile] wrote {path}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
