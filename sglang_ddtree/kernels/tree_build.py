"""The draft tree's build in one Triton launch per batch: the same tree as tree.build_tree_from_topk, bit for bit.

Why: the torch version launches one small kernel per depth (~150 launches for a 15-deep tree); on an H200 that cost
~1 ms per round even inside a CUDA graph, more than the verify of a small target.

Algorithm (the canonical order of tree.build_tree_from_topk): per depth, the static extension pairs (parent slot i,
token rank r) with (i+1)(r+1) <= W are scored with a unique int64 key (float bits, then the lower pair index) and
the best W kept; at the end the global top-W of all depths' lists by the same kind of key (float bits, then
shallower depth, then position). Parents become node indices through an inverse map. One program per request, in
two variants chosen by width (tree_kernel_for): "sort" (full sorts) below SELECT_MIN_WIDTH nodes, "select" (radix
selection, then a sort of W keys) from there. Measured on an H200 at batch 1 in one graph replay
(benchmarks/bench_tree.py): sort 0.024 / 0.068 / 0.143 ms at
B = 16 / 64 / 128, select 0.115 / 0.165 / 0.549 ms at B = 128 / 256 / 1024 (sort 0.48 / 3.24 there).
"""

from __future__ import annotations

import math

import torch

from sglang_ddtree.kernels.common import (_float_key, _key_float, _pow2, _radix_select, _warps, tl,  # noqa: F401
                                          triton)
from sglang_ddtree.tree import DraftTree, _extension_pairs_cpu

# Tree nodes from which build_tree_triton selects by radix ("select") instead of sorting whole lists ("sort").
SELECT_MIN_WIDTH = 128
TREE_KERNELS = ("sort", "select")

if triton is not None:

    @triton.jit
    def _top_w_sorted(key, live, n_live, scratch, offs_w, W: tl.constexpr):
        """The W largest live int64 keys (all n_live of them when there are no more than W), sorted descending, as
        a [WP] block (int64 min past them). The high word is an order-preserving float key; among equal high words
        the lower position has the larger low word, so the ties at the threshold are taken lowest position first (a
        cumsum in position order), as a full sort would.
        Why: a full sort of ~W ln W keys per depth dominated the tree build (B=1024: 3.2 ms on an H200); then the
        radix passes did (confident drafts: ~69% of the kernel at B=256), so they run only when more
        than W keys are live."""
        ukey = (key >> 32) + 2147483648
        if n_live <= W:  # every live key is selected: a threshold below all of them
            thresh = tl.full([], -1, dtype=tl.int64)
            k_left = tl.zeros([], dtype=tl.int32)
        else:
            thresh, k_left = _radix_select(ukey, live, W, 32, True)
        gt = live & (ukey > thresh)
        eq = live & (ukey == thresh)
        # one scan for both running counts (each < 2^16: at most 16384 keys)
        both = tl.cumsum(gt.to(tl.int32) + (eq.to(tl.int32) << 16), 0)
        gt_upto = both & 0xFFFF
        eq_upto = both >> 16
        sel = gt | (eq & (eq_upto <= k_left))
        slot = gt_upto + tl.minimum(eq_upto, k_left) - 1
        tl.debug_barrier()
        tl.store(scratch + slot, key, mask=sel)
        tl.debug_barrier()
        # (slots past the selected keys hold an earlier call's keys: not read)
        top = tl.load(scratch + offs_w, mask=offs_w < tl.minimum(n_live, W), other=-9223372036854775807 - 1)
        top = tl.sort(top, 0, descending=True)
        return top

    @triton.jit
    def _best_w(key, live, n_live, scratch, offs, offs_w, W: tl.constexpr, RADIX: tl.constexpr):
        """The W largest live keys (n_live of them live), descending, as a [WP] block: radix selection and a sort
        of W keys (RADIX), or a sort of all of them (dead entries must then hold the int64 minimum)."""
        if RADIX:
            top = _top_w_sorted(key, live, n_live, scratch, offs_w, W)
        else:
            ordered = tl.sort(key, descending=True)
            tl.debug_barrier()
            tl.store(scratch + offs, ordered)
            tl.debug_barrier()
            top = tl.load(scratch + offs_w)
        return top

    @triton.jit
    def _tree_build_kernel(
        values_ptr, tokens_ptr, pair_parent_ptr, pair_rank_ptr, budget_ptr, root_ptr, log_prune,
        scratch_ptr, lvl_key_ptr, lvl_parent_ptr, lvl_rank_ptr, inv_ptr,
        out_tokens_ptr, out_parents_ptr, out_depth_ptr, out_scores_ptr, out_ranks_ptr, out_valid_ptr,
        L: tl.constexpr, K: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, CP: tl.constexpr,
        SP: tl.constexpr, GP: tl.constexpr, RADIX: tl.constexpr, LP: tl.constexpr,
    ):
        """RADIX = False: each depth's W best pairs and the global top-W by full sorts (CP and GP keys);
        RADIX = True: by radix selection (_top_w_sorted), so only W keys are sorted each time."""
        b = tl.program_id(0).to(tl.int64)
        NEG_INF: tl.constexpr = float("-inf")
        offs_w = tl.arange(0, WP)
        offs_c = tl.arange(0, CP)
        vals = values_ptr + b * L * K
        scratch = scratch_ptr + b * SP
        lvl_key = lvl_key_ptr + b * L * WP
        lvl_parent = lvl_parent_ptr + b * L * WP
        lvl_rank = lvl_rank_ptr + b * L * WP

        # depth 1: the root's children, already sorted by the top-K
        prev = tl.load(vals + offs_w, mask=(offs_w < K) & (offs_w < W), other=NEG_INF)
        tl.store(lvl_parent + offs_w, tl.zeros([WP], dtype=tl.int32))
        tl.store(lvl_rank + offs_w, offs_w.to(tl.int32))
        tl.store(lvl_key + offs_w, (_float_key(prev).to(tl.int64) << 32) | (L * WP - 1 - offs_w).to(tl.int64))

        pp = tl.load(pair_parent_ptr + offs_c)
        pr = tl.load(pair_rank_ptr + offs_c)
        # lb: a score that W nodes of the depths selected so far reach (the W-th best of one depth's list, or of
        # the best a of one list and the best W - a of the next). A node deeper than all of them scoring <= lb
        # cannot enter the tree (it comes after those W; equal scores: shallower first), nor can its descendants
        # (they score no more). So (exact, the same tree):
        # - a depth's candidates scoring <= lb are dropped, and when no more than W are left the radix passes are
        #   skipped (they were ~69% of the kernel at B = 256 with confident drafts; with the two-list
        #   bound 68% / 66% of such drafts' selections keep no more than W at B = 256 / 1024, against 46% / 35%
        #   with the one-list bound: benchmarks/simulate_live_bound.py);
        # - depths stop once no deeper node can score above lb: every node below depth d scores at most
        #   bound = (depth d's best) + (depth d+1's top-1) (+ any positive log-prob, none for log-probs: `slack`).
        #   An unsure drafter's wide, shallow trees then skip most of the 15 selections (random logits x4 over
        #   151936 ids: trees 4 deep at B = 256).
        offs_l = tl.arange(0, LP)
        slack = tl.sum(tl.maximum(tl.load(vals + offs_l * K, mask=offs_l < L, other=0.0), 0.0), 0)
        lb = tl.min(tl.where(offs_w < W, prev, float("inf")), 0)
        d = tl.full([], 1, dtype=tl.int32)  # the depth being selected: an int32 scalar carried by the loop
        bound = tl.max(prev, 0) + tl.load(vals + K, mask=L > 1, other=NEG_INF) + slack
        while (d < L) & (bound > lb):
            cand = tl.gather(prev, pp, 0) + tl.load(vals + d * K + pr, mask=pr < K, other=NEG_INF)
            live = cand > lb
            n_live = tl.sum(live.to(tl.int32), 0)
            key = (_float_key(cand).to(tl.int64) << 32) | (CP - 1 - offs_c).to(tl.int64)
            key = tl.where(live, key, -(2**63))  # the full-sort variant orders dead entries last
            top = _best_w(key, live, n_live, scratch, offs_c, offs_w, W, RADIX)
            pick = (CP - 1 - (top & 0xFFFFFFFF)).to(tl.int32)
            older = prev
            prev = tl.where(offs_w < tl.minimum(n_live, W), _key_float((top >> 32).to(tl.int32)), NEG_INF)
            tl.store(lvl_parent + d * WP + offs_w, tl.gather(pp, pick, 0))
            tl.store(lvl_rank + d * WP + offs_w, tl.gather(pr, pick, 0))
            # global key of this depth's entries: float bits, then shallower depth / lower position first
            tl.store(lvl_key + d * WP + offs_w,
                     (_float_key(prev).to(tl.int64) << 32) | (L * WP - 1 - (d * WP + offs_w)).to(tl.int64))
            lb = tl.maximum(lb, tl.min(tl.where(offs_w < W, prev, float("inf")), 0))
            # the best i + 1 of the older list and the best W - 1 - i of this one (both sorted, descending)
            newer = tl.gather(prev, tl.maximum(W - 2 - offs_w, 0), 0)
            lb = tl.maximum(lb, tl.max(tl.where(offs_w <= W - 2, tl.minimum(older, newer), NEG_INF), 0))
            d += 1
            bound = tl.max(prev, 0) + tl.load(vals + d * K, mask=d < L, other=NEG_INF) + slack

        # the global top-W over the depths built (d of them): one selection over their lists
        tl.debug_barrier()
        offs_g = tl.arange(0, GP)
        built = offs_g < d * WP
        everything = tl.load(lvl_key + offs_g, mask=built, other=-(2**63))
        glob = _best_w(everything, built, d * WP, scratch, offs_g, offs_w, W, RADIX)
        entry = (L * WP - 1 - (glob & 0xFFFFFFFF)).to(tl.int32)
        depth0 = entry // WP
        score = _key_float((glob >> 32).to(tl.int32))
        chosen = offs_w < W
        tl.store(inv_ptr + b * L * WP + entry, (offs_w + 1).to(tl.int32), mask=chosen)
        tl.debug_barrier()
        parent_slot = tl.load(lvl_parent + entry, mask=chosen, other=0)
        rank = tl.load(lvl_rank + entry, mask=chosen, other=0)
        parent_entry = (depth0 - 1) * WP + parent_slot
        parent = tl.load(inv_ptr + b * L * WP + parent_entry, mask=chosen & (depth0 > 0), other=0)
        token = tl.load(tokens_ptr + b * L * K + depth0 * K + rank, mask=chosen, other=0)
        budget = tl.load(budget_ptr + b)
        valid = chosen & (score > NEG_INF) & (offs_w < budget) & (score >= log_prune)

        out = b * (W + 1) + 1 + offs_w
        tl.store(out_tokens_ptr + out, tl.where(valid, token, 0), mask=chosen)
        tl.store(out_parents_ptr + out, tl.where(valid, parent, -1).to(tl.int64), mask=chosen)
        tl.store(out_depth_ptr + out, tl.where(valid, depth0 + 1, 0).to(tl.int64), mask=chosen)
        tl.store(out_scores_ptr + out, tl.where(valid, score, NEG_INF), mask=chosen)
        tl.store(out_ranks_ptr + out, tl.where(valid, rank, -1).to(tl.int64), mask=chosen)
        tl.store(out_valid_ptr + out, valid.to(tl.int8), mask=chosen)
        root = b * (W + 1)
        tl.store(out_tokens_ptr + root, tl.load(root_ptr + b))
        tl.store(out_parents_ptr + root, -1)
        tl.store(out_depth_ptr + root, 0)
        tl.store(out_scores_ptr + root, 0.0)
        tl.store(out_ranks_ptr + root, 0)
        tl.store(out_valid_ptr + root, 1)


_PAIRS: dict = {}


def _pairs(width: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    key = (width, k, device)
    if key not in _PAIRS:
        parent, rank = _extension_pairs_cpu(width, k)
        cp = _pow2(max(parent.numel(), 2))
        pad = cp - parent.numel()
        parent = torch.cat([parent, torch.zeros(pad, dtype=torch.int64)]).to(torch.int32)
        rank = torch.cat([rank, torch.full((pad,), k, dtype=torch.int64)]).to(torch.int32)  # rank k = nothing
        _PAIRS[key] = (parent.to(device), rank.to(device), cp)
    return _PAIRS[key]


def tree_kernel_for(width: int) -> str:
    """The tree-build variant for a tree of `width` nodes below the root."""
    return "select" if width >= SELECT_MIN_WIDTH else "sort"


def build_tree_triton(topk_values: torch.Tensor, topk_tokens: torch.Tensor, budget, root_tokens: torch.Tensor, *,
                      prune: float | None = None, max_budget: int | None = None, kernel: str | None = None
                      ) -> DraftTree:
    """Same result as tree.build_tree_from_topk (bit for bit). kernel: sort or select (default: by width,
    tree_kernel_for)."""
    width = max_budget if max_budget is not None else int(budget)
    choice = kernel or tree_kernel_for(width)
    if choice not in TREE_KERNELS:
        raise ValueError(f"tree kernel must be one of {', '.join(TREE_KERNELS)}, got {kernel!r}.")
    return build_tree_triton_sort(topk_values, topk_tokens, budget, root_tokens, prune=prune, max_budget=max_budget,
                                  radix=choice == "select")


def _budget_tensor(budget, bs: int, device) -> torch.Tensor:
    if isinstance(budget, torch.Tensor):
        return budget.to(device=device, dtype=torch.int64)
    return torch.full((bs,), int(budget), dtype=torch.int64, device=device)


def _tree_outputs(bs: int, n: int, device) -> dict[str, torch.Tensor]:
    return {
        "tokens": torch.empty((bs, n), dtype=torch.int64, device=device),
        "parents": torch.empty((bs, n), dtype=torch.int64, device=device),
        "depth": torch.empty((bs, n), dtype=torch.int64, device=device),
        "scores": torch.empty((bs, n), dtype=torch.float32, device=device),
        "ranks": torch.empty((bs, n), dtype=torch.int64, device=device),
        "valid": torch.empty((bs, n), dtype=torch.int8, device=device),
    }


def build_tree_triton_sort(topk_values: torch.Tensor, topk_tokens: torch.Tensor, budget, root_tokens: torch.Tensor,
                           *, prune: float | None = None, max_budget: int | None = None, radix: bool = False
                           ) -> DraftTree:
    """Same result as tree.build_tree_from_topk (bit for bit), one kernel launch, one program per request.
    radix=False ("sort"): full sorts of each depth's pairs; radix=True ("select"): radix selection of the best W,
    then a sort of W keys."""
    bs, depth_limit, k = topk_values.shape
    width = max_budget if max_budget is not None else int(budget)
    device = topk_values.device
    wp = _pow2(width)
    pair_parent, pair_rank, cp = _pairs(width, k, device)
    gp = _pow2(depth_limit * wp)
    sp = wp if radix else max(cp, gp)
    budget_t = _budget_tensor(budget, bs, device)
    out = _tree_outputs(bs, width + 1, device)
    scratch = torch.empty((bs, sp), dtype=torch.int64, device=device)
    lvl_key = torch.empty((bs, depth_limit, wp), dtype=torch.int64, device=device)
    lvl_parent = torch.empty((bs, depth_limit, wp), dtype=torch.int32, device=device)
    lvl_rank = torch.empty((bs, depth_limit, wp), dtype=torch.int32, device=device)
    inv = torch.zeros((bs, depth_limit * wp), dtype=torch.int32, device=device)
    log_prune = math.log(prune) if prune else float("-inf")
    _tree_build_kernel[(bs,)](
        topk_values.float().contiguous(), topk_tokens.to(torch.int64).contiguous(), pair_parent, pair_rank,
        budget_t, root_tokens.to(device=device, dtype=torch.int64).contiguous(), log_prune,
        scratch, lvl_key, lvl_parent, lvl_rank, inv,
        out["tokens"], out["parents"], out["depth"], out["scores"], out["ranks"], out["valid"],
        L=depth_limit, K=k, W=width, WP=wp, CP=cp, SP=sp, GP=gp, RADIX=radix,
        LP=_pow2(depth_limit), num_warps=_warps(max(cp, gp)),
    )
    return DraftTree(out["tokens"], out["parents"], out["depth"], out["scores"], out["ranks"],
                     out["valid"].bool(), depth_limit)
