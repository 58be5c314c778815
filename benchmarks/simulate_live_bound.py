"""How often the tree kernels' live bound lets a depth skip its radix passes (CPU, torch; no kernel runs here).

For drafts like bench_tree.py's (randn x --draft-scale over V ids, L = 15 depths, the top-W log-probs per depth),
follow the tree build depth by depth as kernels.tree_build._tree_build_kernel does (candidates = the extension pairs of
tree.py, each depth's W best kept, stop once no deeper node can beat the bound) and count, per depth selected, the
candidates scoring above three bounds: `lb` (the running max of each depth's W-th best), `pair` (lb, or the best a of
the previous depth with the best W - a of this one: what the kernel uses) and `exact` (the W-th best of every node
selected so far, which a kernel would need a merge for). A depth whose count is <= W skips the radix passes.

    python benchmarks/simulate_live_bound.py --out benchmarks/results/live_bound_simulation_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def pair_bound(older: torch.Tensor, newer: torch.Tensor, w: int) -> float:
    """max over a of min(older[a-1], newer[w-a-1]), both sorted descending (a = 1..w-1)."""
    i = torch.arange(w - 1)
    return torch.minimum(older[i], newer[w - 2 - i]).max().item()


def simulate(scale: float, w: int, trials: int, vocab: int, depth: int, seed: int) -> dict:
    from sglang_ddtree.tree import _extension_pairs_cpu

    gen = torch.Generator().manual_seed(seed)
    pp, pr = _extension_pairs_cpu(w, w)
    counts = {"lb": 0, "pair": 0, "exact": 0}
    selected = 0
    for _ in range(trials):
        lp = (torch.randn(depth, vocab, generator=gen) * scale).log_softmax(-1)
        vals = lp.topk(w, dim=-1).values
        prev, lists = vals[0], [vals[0]]
        lb = pb = prev[w - 1].item()
        for d in range(1, depth):
            if prev.max().item() + vals[d][0].item() <= pb:  # the kernel's early stop (with its bound)
                break
            cand = prev[pp] + vals[d][pr]
            exact = torch.cat(lists).topk(w).values[-1].item()
            selected += 1
            counts["lb"] += int((cand > lb).sum().item() <= w)
            counts["pair"] += int((cand > pb).sum().item() <= w)
            counts["exact"] += int((cand > exact).sum().item() <= w)
            top = cand.topk(w).values
            lb = max(lb, top[-1].item())
            pb = max(pb, lb, pair_bound(prev, top, w))
            prev = top
            lists.append(top)
    return {"draft_scale": scale, "budget": w, "trials": trials, "depths_selected": selected,
            "share_of_selections_without_radix": {k: round(v / selected, 3) for k, v in counts.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scales", default="4,12")
    ap.add_argument("--budgets", default="256,1024")
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = [simulate(float(s), int(b), args.trials, args.vocab, 15, seed=0)
            for s in args.scales.split(",") for b in args.budgets.split(",")]
    for row in rows:
        print(json.dumps(row))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": "CPU (simulation)",
                                        "command": "python benchmarks/simulate_live_bound.py " + " ".join(argv or sys.argv[1:]),
                                        "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
