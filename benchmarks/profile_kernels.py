"""Where the core stages' GPU time goes, kernel by kernel: the Triton top-K (`kernels.topk_triton`) and the tree
build kernels at batch 1, timed one launch at a time with CUDA events (the top-K's launches eagerly, so their sum can
exceed bench_tree.py's graph number; the tree kernels, sort and select, as one graph replay each).

    python benchmarks/profile_kernels.py --out $OUT/profile_kernels.json

Inputs as in benchmarks/bench_tree.py (bf16 logits, randn x --draft-scale, V = 151936, L = 15), but by default
the confident drafter (scale 12: trees 15 deep), where the tree kernels select at every depth (with an unsure one
they stop after a few depths).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timed(fn, repeats: int) -> float:
    """bench_tree.py's timers: CUDA events around one launch on a GPU, wall time in the interpreter (CPU)."""
    from benchmarks.bench_tree import time_cpu, time_cuda

    return (time_cuda if torch.cuda.is_available() else time_cpu)(fn, repeats)


def timed_replay(fn, repeats: int) -> float:
    """The tree kernels: one CUDA-graph replay (as the server runs them), so a launch's host latency is not in
    the time (eager launches carried ~0.15 ms of launch latency in every number). Wall time in the interpreter."""
    from benchmarks.bench_tree import time_cpu, time_cuda_graph

    return (time_cuda_graph if torch.cuda.is_available() else time_cpu)(fn, repeats)


def topk_pieces(lp: torch.Tensor, k: int, repeats: int) -> dict:
    """Median ms of each launch of kernels.topk_triton, run one at a time on the same buffers."""
    from sglang_ddtree import kernels
    from sglang_ddtree.tree import exact_topk

    x = lp.contiguous()
    rows = x.shape[0]
    values = torch.empty((rows, k), dtype=torch.float32, device=x.device)
    ids = torch.empty((rows, k), dtype=torch.int64, device=x.device)
    out = {}
    launches, counts = kernels.topk_launches(x, k, values, ids)
    for name, launch in launches:  # in order: each reads the previous ones' output
        out[name] = timed(launch, repeats)
    ref_values, ref_ids = kernels.topk_triton(x, k)
    assert torch.equal(ids, ref_ids) and torch.equal(values, ref_values)
    n = counts.sum(dim=1)
    out["candidates_per_row_max"] = int((n[:, 0] + n[:, 1].clamp(max=k)).max())
    out["log_softmax"] = timed(lambda: lp.float().log_softmax(-1), repeats)
    out["torch_topk_exact"] = timed(lambda: exact_topk(x, k), repeats)
    out["triton_topk_total"] = timed(lambda: kernels.topk_triton(x, k), repeats)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", default="256,1024")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--draft-scale", type=float, default=12.0, help="the drafter's logits are randn x this")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    from sglang_ddtree import kernels
    from sglang_ddtree.tree import build_tree_from_topk, topk_draft

    gen = torch.Generator().manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits = (torch.randn(1, 15, args.vocab, generator=gen) * args.draft_scale).to(device, torch.bfloat16)
    lp = logits.float().log_softmax(-1)
    roots = torch.zeros(1, dtype=torch.long, device=device)
    rows = []
    for budget in (int(b) for b in args.budgets.split(",")):
        row = {"budget": budget, "batch_size": 1, "topk": topk_pieces(lp.view(15, -1), budget, args.repeats)}
        values, tokens = topk_draft(lp, budget)
        ref = build_tree_from_topk(values, tokens, budget, roots, max_budget=budget)
        row["tree_depth_max"] = int(ref.depth.max())
        for kernel in ("sort", "select"):
            fn = lambda: kernels.build_tree_triton(values, tokens, budget, roots, max_budget=budget,  # noqa
                                                   kernel=kernel)
            got = fn()
            assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.parents, ref.parents)
            row[f"tree_{kernel}_ms"] = timed_replay(fn, args.repeats)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:  # after every budget: a timeout keeps what was measured
            write(args.out, meta(args, device, complete=False), rows)
    if args.out:
        write(args.out, meta(args, device, complete=True), rows)
    return 0


def meta(args, device: str, complete: bool) -> dict:
    return {"commit": args.commit, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
            "torch": torch.__version__, "vocab": args.vocab, "draft_scale": args.draft_scale, "complete": complete,
            "timing": "median of repeats, CUDA events: the top-K launches one eager launch each (launch latency "
                      "included), the tree kernels one CUDA-graph replay each"}


def write(path: Path, meta_: dict, rows: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta_, "rows": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
