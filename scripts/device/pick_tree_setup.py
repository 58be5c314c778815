"""Pick the tree-build kernel and the top-K chunking for the servers of this lease from bench_tree results.

    python3 scripts/device/pick_tree_setup.py CHUNKED.json ONE_STAGE.json > /tmp/picked.env

CHUNKED.json: benchmarks/bench_tree.py with --impls triton,triton_rank (default top-K: chunked on CUDA);
ONE_STAGE.json: the same with SGLANG_DDTREE_TOPK_CHUNKS=0 (at least --impls triton). Prints `export` lines.

Rule (written before the numbers were seen): at the serving-critical point, batch 1 and B=256, take the rank
kernel when its CUDA-graph tree time is below 0.8x the sort kernel's, and the chunked top-K when its graph time is
below the one-stage top-K's. Graph times (GPU time alone) decide because at real size the GPU is busy with the
draft pass while these launches are queued; the eager numbers are printed next to them.
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
    chunked, one_stage = row(argv[0], 1, 256), row(argv[1], 1, 256)
    sort_ms, rank_ms = chunked["triton_graph_tree_ms"], chunked["triton_rank_graph_tree_ms"]
    kernel = "rank" if rank_ms < 0.8 * sort_ms else "sort"
    topk_chunked, topk_one = chunked["triton_graph_topk_ms"], one_stage["triton_graph_topk_ms"]
    chunks = "-1" if topk_chunked < topk_one else "0"
    print(f"# tree build B=256 bs1 graph: sort {sort_ms:.4f} ms, rank {rank_ms:.4f} ms "
          f"(eager all: sort {chunked['triton_eager_all_ms']:.4f}, rank {chunked['triton_rank_eager_all_ms']:.4f})")
    print(f"# top-K B=256 bs1 graph: chunked {topk_chunked:.4f} ms, one stage {topk_one:.4f} ms")
    print(f"export SGLANG_DDTREE_TREE_KERNEL={kernel}")
    print(f"export SGLANG_DDTREE_TOPK_CHUNKS={chunks}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
