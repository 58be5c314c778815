"""Pick the tree-build kernel and the top-K kernel for the servers of this machine from bench_tree results.

    python3 scripts/device/pick_tree_setup.py BENCH.json > /tmp/picked.env

BENCH.json: benchmarks/bench_tree.py with --impls including triton (sort) and triton_rank, optionally
triton_select and triton_select_topk. Prints `export` lines (and `#` lines with the numbers it used).

Rules (written before the numbers were seen):
- Tree kernel, from the batch-1 CUDA-graph tree times: every configuration the serving path can run (one kernel
  for all widths: sort, select, rank; or `auto`: a small-tree kernel (sort or select) below a width m and a large
  one (select or rank) from m on, for m in the measured budgets) gets the score sum over budgets of time / the best
  kernel's time at that budget; the lowest score wins, and on equal scores the earlier configuration in that list
  (a single kernel before `auto`). Lease 12's first run offered `auto` only with rank as the large kernel, which
  left select's lead at 256 and 1024 unused; the large kernel became a choice after it.
- Top-K: triton when triton_select_topk's graph top-K time is below the torch top-K's (the `triton` impl's) at
  B=256 (or the largest budget measured below it) at every batch size measured; torch otherwise.
- Draft logsumexp (only when the bench ran triton_fused): SGLANG_DDTREE_DRAFT_LSE=triton when triton_fused's graph
  top-K time (top-K and logsumexp from the bf16 logits) is below triton_select_topk's (log_softmax + the Triton
  top-K) at B=256 (as above) at every batch size measured, and the Triton top-K was picked; torch otherwise.
Graph times (GPU time alone) decide because at real size the GPU is busy with the draft pass while these launches
are queued.
"""

from __future__ import annotations

import json
import sys

KERNEL_COLUMNS = {"sort": "triton", "select": "triton_select", "rank": "triton_rank"}


def pick_tree_kernel(rows: list[dict]) -> tuple[dict, float]:
    """rows: batch-1 rows, sorted by budget. Returns (exports, score)."""
    budgets = [r["budget"] for r in rows]
    times = {k: [r[f"{col}_graph_tree_ms"] for r in rows] for k, col in KERNEL_COLUMNS.items()
             if all(f"{col}_graph_tree_ms" in r for r in rows)}
    best = [min(t[i] for t in times.values()) for i in range(len(rows))]

    def score(per_budget):
        return sum(t / b for t, b in zip(per_budget, best))

    configs = [({"SGLANG_DDTREE_TREE_KERNEL": k}, score(t)) for k, t in times.items()]
    for large in ("select", "rank"):
        for small in ("sort", "select"):
            if small == large or small not in times or large not in times:
                continue
            for i, m in enumerate(budgets[1:], start=1):
                mixed = times[small][:i] + times[large][i:]
                configs.append(({"SGLANG_DDTREE_TREE_KERNEL": "auto", "SGLANG_DDTREE_RANK_MIN_WIDTH": str(m),
                                 "SGLANG_DDTREE_SMALL_TREE_KERNEL": small, "SGLANG_DDTREE_LARGE_TREE_KERNEL": large},
                                score(mixed)))
    return min(configs, key=lambda c: c[1])  # min keeps the first of equal scores


def _faster_everywhere(rows: list[dict], new: str, old: str) -> bool:
    """Column `new` below column `old` (graph top-K ms) at B=256, or the largest budget measured below it, at every
    batch size measured (False when nothing was measured)."""
    rows = [r for r in rows if new in r and old in r]
    by_bs: dict[int, dict] = {}
    for r in sorted(rows, key=lambda r: r["budget"]):
        if r["budget"] <= 256 or r["batch_size"] not in by_bs:
            by_bs[r["batch_size"]] = r
    faster = [r[new] < r[old] for r in by_bs.values()]
    return bool(faster) and all(faster)


def pick_topk_kernel(rows: list[dict]) -> str:
    return "triton" if _faster_everywhere(rows, "triton_select_topk_graph_topk_ms", "triton_graph_topk_ms") else "torch"


def pick_draft_lse(rows: list[dict]) -> str | None:
    if not any("triton_fused_graph_topk_ms" in r for r in rows):
        return None
    faster = _faster_everywhere(rows, "triton_fused_graph_topk_ms", "triton_select_topk_graph_topk_ms")
    return "triton" if faster and pick_topk_kernel(rows) == "triton" else "torch"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    all_rows = json.load(open(argv[0]))["rows"]
    rows = sorted((r for r in all_rows if r["batch_size"] == 1), key=lambda r: r["budget"])
    if not rows:
        raise SystemExit(f"{argv[0]}: no batch-1 rows")
    for r in rows:
        cols = ", ".join(f"{k} {r[c + '_graph_tree_ms']:.4f}" for k, c in KERNEL_COLUMNS.items()
                         if f"{c}_graph_tree_ms" in r)
        print(f"# B={r['budget']:5d} bs1 tree graph ms: {cols}")
    exports, score = pick_tree_kernel(rows)
    print(f"# tree-kernel score {score:.3f} (sum over budgets of time / best time; {len(rows)} is the least)")
    exports["SGLANG_DDTREE_TOPK_KERNEL"] = pick_topk_kernel(all_rows)
    draft_lse = pick_draft_lse(all_rows)
    if draft_lse is not None:
        exports["SGLANG_DDTREE_DRAFT_LSE"] = draft_lse
    for name, value in exports.items():
        print(f"export {name}={value}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
