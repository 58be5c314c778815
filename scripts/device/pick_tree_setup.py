"""Pick the tree-build kernel and the top-K chunking for the servers of this lease from bench_tree results.

    python3 scripts/device/pick_tree_setup.py BENCH.json > /tmp/picked.env

BENCH.json: benchmarks/bench_tree.py with --impls triton,triton_rank. Prints `export` lines.

Rule (written before the numbers were seen), at batch 1: the rank kernel is "better" at a budget when its
CUDA-graph tree time is below 0.8x the sort kernel's. If it is better at every measured budget: rank; at none:
sort; else auto with SGLANG_DDTREE_RANK_MIN_WIDTH = the smallest measured budget from which on it is better at
every larger one. The chunked top-K is kept when its graph time at B=256 is below the one-stage top-K's. Graph
times (GPU time alone) decide because at real size the GPU is busy with the draft pass while these launches are
queued; the eager numbers are printed next to them.
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    rows = sorted((r for r in json.load(open(argv[0]))["rows"] if r["batch_size"] == 1), key=lambda r: r["budget"])
    if not rows:
        raise SystemExit(f"{argv[0]}: no batch-1 rows")
    better = {r["budget"]: r["triton_rank_graph_tree_ms"] < 0.8 * r["triton_graph_tree_ms"] for r in rows}
    for r in rows:
        print(f"# B={r['budget']:5d} bs1 tree graph: sort {r['triton_graph_tree_ms']:.4f} ms, rank "
              f"{r['triton_rank_graph_tree_ms']:.4f} ms; eager all: sort {r['triton_eager_all_ms']:.4f}, rank "
              f"{r['triton_rank_eager_all_ms']:.4f}")
    budgets = sorted(better)
    from_on = [b for i, b in enumerate(budgets) if all(better[x] for x in budgets[i:])]
    if all(better.values()):
        kernel, min_width = "rank", None
    elif not from_on:
        kernel, min_width = "sort", None
    else:
        kernel, min_width = "auto", from_on[0]
    print(f"export SGLANG_DDTREE_TREE_KERNEL={kernel}")
    if min_width is not None:
        print(f"export SGLANG_DDTREE_RANK_MIN_WIDTH={min_width}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
