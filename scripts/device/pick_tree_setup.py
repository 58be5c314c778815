"""Pick the tree-build kernel and the top-K chunking for the servers of this lease from bench_tree results.

    python3 scripts/device/pick_tree_setup.py CHUNKED.json ONE_STAGE.json > /tmp/picked.env

CHUNKED.json: benchmarks/bench_tree.py with --impls triton,triton_rank (default top-K: chunked on CUDA);
ONE_STAGE.json: the same with SGLANG_DDTREE_TOPK_CHUNKS=0 (at least --impls triton). Prints `export` lines.

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


def row(path: str, bs: int, budget: int) -> dict:
    rows = json.load(open(path))["rows"]
    for r in rows:
        if r["batch_size"] == bs and r["budget"] == budget:
            return r
    raise SystemExit(f"{path}: no row for batch {bs}, budget {budget}")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    rows = sorted((r for r in json.load(open(argv[0]))["rows"] if r["batch_size"] == 1), key=lambda r: r["budget"])
    better = {r["budget"]: r["triton_rank_graph_tree_ms"] < 0.8 * r["triton_graph_tree_ms"] for r in rows}
    for r in rows:
        print(f"# B={r['budget']:5d} bs1 tree graph: sort {r['triton_graph_tree_ms']:.4f} ms, rank "
              f"{r['triton_rank_graph_tree_ms']:.4f} ms; eager all: sort {r['triton_eager_all_ms']:.4f}, rank "
              f"{r['triton_rank_eager_all_ms']:.4f}")
    budgets = sorted(better)
    from_on = [b for i, b in enumerate(budgets) if all(better[x] for x in budgets[i:])]
    kernel, min_width = ("rank", None) if all(better.values()) else ("sort", None) if not from_on else \
        ("auto", from_on[0])
    chunked, one_stage = row(argv[0], 1, 256), row(argv[1], 1, 256)
    sort_ms, rank_ms = chunked["triton_graph_tree_ms"], chunked["triton_rank_graph_tree_ms"]
    topk_chunked, topk_one = chunked["triton_graph_topk_ms"], one_stage["triton_graph_topk_ms"]
    chunks = "-1" if topk_chunked < topk_one else "0"
    print(f"# tree build B=256 bs1 graph: sort {sort_ms:.4f} ms, rank {rank_ms:.4f} ms "
          f"(eager all: sort {chunked['triton_eager_all_ms']:.4f}, rank {chunked['triton_rank_eager_all_ms']:.4f})")
    print(f"# top-K B=256 bs1 graph: chunked {topk_chunked:.4f} ms, one stage {topk_one:.4f} ms")
    print(f"export SGLANG_DDTREE_TREE_KERNEL={kernel}")
    if min_width is not None:
        print(f"export SGLANG_DDTREE_RANK_MIN_WIDTH={min_width}")
    print(f"export SGLANG_DDTREE_TOPK_CHUNKS={chunks}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
