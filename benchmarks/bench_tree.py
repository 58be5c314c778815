"""Micro-benchmark of the DDTree core stages: tree build, layout, walk.

  build  = log_softmax of the drafter's logits [bs, L, V] + per-depth top-K + best-first tree
  layout = ancestor mask [bs, N, N] + positions + EAGLE retrieve arrays
  walk   = the walk from the target's per-node choices [bs, N] (the argmax over V that produces those choices is
           part of the target's sampling, which every verify pays; it is timed separately as `choice`)

On CUDA each configuration is timed eagerly (CUDA events) and as one captured CUDA graph replay, which is how the
serving path runs it. Writes JSON rows (one per configuration) and prints a table.

  python benchmarks/bench_tree.py --device cpu --out benchmarks/results/tree_cpu.json
  python benchmarks/bench_tree.py --device cuda --out $OUT/tree_h200.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sglang_ddtree.layout import ancestor_mask, retrieve_arrays, tree_positions  # noqa: E402
from sglang_ddtree.tree import build_tree  # noqa: E402
from sglang_ddtree.walk import walk_choices  # noqa: E402


def stages(draft_logits, budget, roots, start, target_choice):
    tree = build_tree(draft_logits.log_softmax(-1), budget, roots, check_values=False)
    mask = ancestor_mask(tree)
    pos = tree_positions(tree, start)
    retrieve = retrieve_arrays(tree)
    walk = walk_choices(tree, target_choice)
    return tree, mask, pos, retrieve, walk


def time_cpu(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_cuda(fn, repeats):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def time_cuda_graph(fn, repeats):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_cuda(graph.replay, repeats)


def git_commit():
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--budgets", default="16,32,64,128,256,512,1024")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--depth", type=int, default=15)
    ap.add_argument("--repeats", type=int, default=0, help="timed repetitions (default 50 on CUDA, 5 on CPU)")
    ap.add_argument("--choice-mem-limit-gb", type=float, default=0.0,
                    help="time the target argmax (`choice`) only when its logits fit (default 8 on CUDA, 0 on CPU)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    repeats = args.repeats or (50 if cuda else 5)
    mem_limit = args.choice_mem_limit_gb or (8.0 if cuda else 0.0)
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    budgets = [int(x) for x in args.budgets.split(",")]
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    total = len(budgets) * len(batch_sizes)
    for bs in batch_sizes:
        draft_logits = (torch.randn(bs, args.depth, args.vocab, generator=gen) * 4).to(device, torch.bfloat16)
        roots = torch.randint(0, args.vocab, (bs,), generator=gen).to(device)
        start = torch.full((bs,), 500, dtype=torch.long, device=device)
        for budget in budgets:
            n = budget + 1
            tree, *_ = stages(draft_logits, budget, roots, start, torch.zeros(bs, n, dtype=torch.long, device=device))
            # Make the target agree with the drafter's best path so the walk runs its full depth.
            choice = torch.zeros(bs, n, dtype=torch.long, device=device)
            first_child = retrieve_arrays(tree)[1]
            choice = torch.where(first_child >= 0, tree.tokens.gather(1, first_child.clamp(min=0)), choice)

            timers = {"eager": time_cuda if cuda else time_cpu}
            if cuda:
                timers["graph"] = time_cuda_graph
            row = {"device": str(device), "batch_size": bs, "budget": budget, "vocab": args.vocab,
                   "depth": args.depth}
            for mode, timer in timers.items():
                build = lambda: build_tree(draft_logits.log_softmax(-1), budget, roots, check_values=False)  # noqa
                row[f"{mode}_build_ms"] = timer(build, repeats)
                row[f"{mode}_layout_ms"] = timer(
                    lambda: (ancestor_mask(tree), tree_positions(tree, start), retrieve_arrays(tree)), repeats)
                row[f"{mode}_walk_ms"] = timer(lambda: walk_choices(tree, choice), repeats)
                row[f"{mode}_all_ms"] = timer(lambda: stages(draft_logits, budget, roots, start, choice), repeats)
            logits_gb = bs * n * args.vocab * 2 / 1e9
            if logits_gb <= mem_limit:
                target_logits = torch.randn(bs * n, args.vocab, device=device, dtype=torch.bfloat16)
                row["choice_ms"] = (time_cuda if cuda else time_cpu)(lambda: target_logits.argmax(-1), repeats)
                del target_logits
            rows.append(row)
            key = "graph_all_ms" if cuda else "eager_all_ms"
            print(f"[{len(rows)}/{total}] bs={bs:3d} B={budget:5d}  all={row[key]:.3f} ms "
                  f"(build {row[key.replace('all', 'build')]:.3f}, layout {row[key.replace('all', 'layout')]:.3f}, "
                  f"walk {row[key.replace('all', 'walk')]:.3f})", flush=True)
        del draft_logits
        if cuda:
            torch.cuda.empty_cache()

    meta = {
        "command": " ".join(["python", "benchmarks/bench_tree.py"] + (argv if argv is not None else sys.argv[1:])),
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device_name": torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "repeats": repeats,
        "timing": "median of repeats; CUDA: events, eager and one CUDA-graph replay; CPU: perf_counter",
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
