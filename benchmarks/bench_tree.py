"""Micro-benchmark of the DDTree core stages: tree build, layout, walk; torch reference vs Triton kernels.

  topk   = log_softmax of the drafter's logits [bs, L, V] + exact per-depth top-K (K = min(B, V))
  build  = topk + best-first tree           (torch: tree.build_tree_from_topk; triton: kernels.build_tree_triton)
  layout = the verify's attention mask      (torch: ancestor mask + SGLang FULL_MASK scatter + positions + retrieve
                                             arrays; triton: kernels.tree_verify_mask_triton + positions)
  walk   = the walk from the target's per-node choices [bs, N] (the argmax over V that produces those choices is
           part of the target's sampling, which every verify pays; it is timed separately as `choice`)
The serving path (sglang_ddtree/sglang/worker.py) uses the Triton kernels on CUDA.

On CUDA each configuration is timed eagerly (CUDA events around launches from an idle GPU: host launch overhead
included) and as one captured CUDA graph replay (GPU time alone); the serving path replays these stages as CUDA
graphs per batch size (sglang_ddtree/graphs.py), so the graph numbers are the ones that matter there. Writes JSON rows (one per configuration) and
prints a table. impls: torch, triton (sort tree kernel, one launch), triton_select (radix-select tree kernel, one
launch), triton_topk (the tree kernel that kernels.tree_kernel_for picks for the budget, and kernels.topk_triton for the top-K), triton_select_topk (select + topk_triton), triton_fused (the picked
tree kernel, and kernels.topk_logits_lse: the top-K and the logsumexp from the bf16 logits, without log_softmax).
Every impl's top-K and tree are checked against the torch reference before timing (a difference stops the run;
triton_fused's log-probs within 2e-5, its ids exact, its tree against the torch tree of its own top-K).

  python benchmarks/bench_tree.py --device cpu --out benchmarks/results/tree_cpu.json
  python benchmarks/bench_tree.py --device cuda --out $OUT/tree_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sglang_ddtree.layout import ancestor_mask, retrieve_arrays, tree_positions  # noqa: E402
from sglang_ddtree.tree import build_tree_from_topk  # noqa: E402
from sglang_ddtree.walk import walk_choices  # noqa: E402


PREFIX = 512  # committed tokens per request: sizes the FULL_MASK the verify reads
# impl -> (tree kernel, None = what build_tree_triton picks for the budget; the top-K: "torch" = log_softmax +
# torch.topk, "triton" = log_softmax + kernels.topk_triton, "fused" = kernels.topk_logits_lse on the bf16 logits)
TRITON_IMPLS = {"triton": ("sort", "torch"), "triton_select": ("select", "torch"),
                "triton_topk": (None, "triton"), "triton_select_topk": ("select", "triton"),
                "triton_fused": (None, "fused")}


def make_stages(impl, draft_logits, budget, roots, start, choice):
    from sglang_ddtree.sglang.ops import tree_verify_mask, verify_mask_numel
    from sglang_ddtree.tree import build_tree_from_topk, topk_draft

    bs, _, vocab = draft_logits.shape
    k = min(budget, vocab)
    numel = verify_mask_numel(budget + 1, int(start.sum()) + 16 * bs, bs)

    def torch_topk():
        return topk_draft(draft_logits.float().log_softmax(-1), k)

    topk = torch_topk

    if impl in TRITON_IMPLS:
        from sglang_ddtree import kernels

        kernel, topk_kind = TRITON_IMPLS[impl]
        kernel = kernel or kernels.tree_kernel_for(budget)
        if topk_kind == "triton":
            def triton_topk():
                lp = draft_logits.float().log_softmax(-1)
                values, tokens = kernels.topk_triton(lp.view(-1, vocab), k)
                return values.view(bs, -1, k), tokens.view(bs, -1, k)

            topk = triton_topk
        elif topk_kind == "fused":
            def fused_topk():  # what the serving path runs
                values, tokens, lse = kernels.topk_logits_lse(draft_logits.view(-1, vocab), k)
                return (values - lse.unsqueeze(-1)).view(bs, -1, k), tokens.view(bs, -1, k)

            topk = fused_topk

        def tree(values, tokens):
            return kernels.build_tree_triton(values, tokens, budget, roots, max_budget=budget, kernel=kernel)

        def layout(t):
            return kernels.tree_verify_mask_triton(t, start, numel), tree_positions(t, start)

        def walk(t):
            return kernels.walk_triton(t, choice)
    else:
        def tree(values, tokens):
            return build_tree_from_topk(values, tokens, budget, roots, max_budget=budget)

        def layout(t):
            return tree_verify_mask(ancestor_mask(t), start, numel), tree_positions(t, start), retrieve_arrays(t)

        def walk(t):
            return walk_choices(t, choice)
    return topk, tree, layout, walk


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
    ap.add_argument("--draft-scale", type=float, default=4.0,
                    help="the drafter's logits are randn x this: 4 = an unsure drafter (top-1 p ~0.24, trees about "
                         "4 deep at B = 256), 12 = a confident one (top-1 p ~0.72, trees 15 deep at B = 256 and "
                         "1024). The tree kernels stop at the last depth that can enter the tree, so their time "
                         "depends on it; rows record the tree's depth")
    ap.add_argument("--repeats", type=int, default=0, help="timed repetitions (default 50 on CUDA, 5 on CPU)")
    ap.add_argument("--choice-mem-limit-gb", type=float, default=0.0,
                    help="time the target argmax (`choice`) only when its logits fit (default 8 on CUDA, 0 on CPU)")
    ap.add_argument("--impls", default=None,
                    help="comma list of torch, " + ", ".join(TRITON_IMPLS) + " (see above); default: "
                         "torch,triton,triton_select on CUDA, torch on CPU")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--commit", default=None, help="commit to record (default: git here; a device copy's HEAD can be "
                    "stale)")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    repeats = args.repeats or (50 if cuda else 5)
    mem_limit = args.choice_mem_limit_gb or (8.0 if cuda else 0.0)
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    budgets = [int(x) for x in args.budgets.split(",")]
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    impls = args.impls.split(",") if args.impls else (["torch", "triton", "triton_select"] if cuda else ["torch"])
    if any(i.startswith("triton") for i in impls) and not (cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        raise SystemExit("--impls triton needs --device cuda (or TRITON_INTERPRET=1, which checks but times nothing "
                         "worth reading)")
    total = len(budgets) * len(batch_sizes)
    meta = {
        "command": " ".join(["python", "benchmarks/bench_tree.py"] + (argv if argv is not None else sys.argv[1:])),
        "commit": args.commit or git_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device_name": torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "repeats": repeats,
        "draft_scale": args.draft_scale,
        "timing": "median of repeats; CUDA: events, eager and one CUDA-graph replay; CPU: perf_counter",
    }

    def write(complete: bool) -> None:
        """The rows so far (after every row: a run cut short by a time limit keeps what it measured)."""
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"meta": {**meta, "complete": complete}, "rows": rows}, indent=1))

    for bs in batch_sizes:
        draft_logits = (torch.randn(bs, args.depth, args.vocab, generator=gen) * args.draft_scale).to(
            device, torch.bfloat16)
        roots = torch.randint(0, args.vocab, (bs,), generator=gen).to(device)
        start = torch.full((bs,), PREFIX, dtype=torch.long, device=device)
        for budget in budgets:
            n = budget + 1
            topk, tree_fn, _, _ = make_stages("torch", draft_logits, budget, roots, start, None)
            ref_tree = tree_fn(*topk())
            # Make the target agree with the drafter's best path so the walk runs its full depth.
            first_child = retrieve_arrays(ref_tree)[1]
            choice = torch.where(first_child >= 0, ref_tree.tokens.gather(1, first_child.clamp(min=0)), 0)
            row = {"device": str(device), "batch_size": bs, "budget": budget, "vocab": args.vocab,
                   "depth": args.depth, "prefix": PREFIX, "draft_scale": args.draft_scale,
                   "tree_depth_max": int(ref_tree.depth.max())}
            values, tokens = topk()
            timers = {"eager": time_cuda if cuda else time_cpu}
            if cuda:
                timers["graph"] = time_cuda_graph
            for impl in impls:
                topk_fn, tree_fn, layout_fn, walk_fn = make_stages(impl, draft_logits, budget, roots, start, choice)
                t = tree_fn(values, tokens)
                got_values, got_tokens = topk_fn()
                # The fused top-K's logsumexp sums in another order than torch's log_softmax: its log-probs may
                # differ in the last bits (ids must not), and its tree is checked against the torch tree of its own.
                fused = TRITON_IMPLS.get(impl, (None, None))[1] == "fused"
                same_values = (torch.allclose(got_values, values, rtol=0, atol=2e-5) if fused
                               else torch.equal(got_values, values))
                own_ref = (build_tree_from_topk(got_values, got_tokens, budget, roots, max_budget=budget) if fused
                           else ref_tree)
                own = tree_fn(got_values, got_tokens) if fused else t
                if not (same_values and torch.equal(got_tokens, tokens)
                        and torch.equal(t.tokens, ref_tree.tokens) and torch.equal(t.parents, ref_tree.parents)
                        and torch.equal(own.tokens, own_ref.tokens) and torch.equal(own.parents, own_ref.parents)):
                    raise SystemExit(f"{impl} at bs={bs} B={budget}: top-K or tree differs from the torch reference")

                def all_stages(topk_fn=topk_fn, tree_fn=tree_fn, layout_fn=layout_fn, walk_fn=walk_fn):
                    new_tree = tree_fn(*topk_fn())
                    layout_fn(new_tree)
                    return walk_fn(new_tree)

                for mode, timer in timers.items():
                    p = f"{impl}_{mode}"
                    row[f"{p}_topk_ms"] = timer(topk_fn, repeats)
                    row[f"{p}_tree_ms"] = timer(lambda: tree_fn(values, tokens), repeats)
                    row[f"{p}_layout_ms"] = timer(lambda: layout_fn(t), repeats)
                    row[f"{p}_walk_ms"] = timer(lambda: walk_fn(t), repeats)
                    row[f"{p}_all_ms"] = timer(all_stages, repeats)
            logits_gb = bs * n * args.vocab * 2 / 1e9
            if logits_gb <= mem_limit:
                target_logits = torch.randn(bs * n, args.vocab, device=device, dtype=torch.bfloat16)
                row["choice_ms"] = (time_cuda if cuda else time_cpu)(lambda: target_logits.argmax(-1), repeats)
                del target_logits
            rows.append(row)
            write(complete=False)
            key = f"{impls[-1]}_graph" if cuda else "torch_eager"
            print(f"[{len(rows)}/{total}] bs={bs:3d} B={budget:5d}  {key}: all={row[key + '_all_ms']:.3f} ms "
                  f"(topk {row[key + '_topk_ms']:.3f}, tree {row[key + '_tree_ms']:.3f}, "
                  f"layout {row[key + '_layout_ms']:.3f}, walk {row[key + '_walk_ms']:.3f})"
                  + (f"  torch_graph all={row['torch_graph_all_ms']:.3f}" if "torch_graph_all_ms" in row else ""),
                  flush=True)
        del draft_logits
        if cuda:
            torch.cuda.empty_cache()

    write(complete=True)
    if args.out:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
