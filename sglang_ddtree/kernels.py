"""Triton kernels for the serving hot path: tree build, verify mask, walk. One program per request.

Why: the torch versions in tree.py / layout.py / walk.py are exact and readable, but they launch one small kernel
per depth and per step (~150 launches for a 15-deep tree); on an H200 that costs ~1 ms per round even inside a
CUDA graph, more than the verify of a small target. These kernels do the same computation in 3 launches and give
bit-identical results (tests compare them with the torch versions, on CPU through TRITON_INTERPRET=1).

Tree build (same result and canonical order as tree.build_tree_from_topk, by selection instead of sorting):
per depth, the candidates are W sorted lists {s_i + v_r : r < min(W // (i+1), K)} (parent slot i, token rank r).
The W-th largest candidate key is found by bisection over the 32-bit float keys, counting each list by binary
search (float addition is monotone), then every parent takes its candidates above the cut plus the ties in (i, r)
order; only the W chosen are sorted (by score, then (i, r)) to form the depth's list. The global top-W over the L
depth lists is selected the same way (ties: shallower depth, then position) and sorted. Parents become node
indices through an inverse map. Work per depth: ~32 x log2(W) dependent steps over W lanes plus one sort of W,
instead of a sort of the ~W ln W candidates.
"""

from __future__ import annotations

import torch

from sglang_ddtree.tree import DraftTree

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: callers fall back to the torch versions
    triton = None
    tl = None


def available(device: torch.device) -> bool:
    import os

    return triton is not None and (torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


if triton is not None:

    @triton.jit
    def _float_key(x):
        bits = x.to(tl.int32, bitcast=True)
        return bits ^ ((bits >> 31) & 0x7FFFFFFF)

    @triton.jit
    def _key_float(k):
        bits = k ^ ((k >> 31) & 0x7FFFFFFF)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _count_at_least(base, lens, src, src_base, thr, STEPS: tl.constexpr, SRC: tl.constexpr):
        """Per lane: how many ranks r < lens[lane] have key(base[lane] + src[src_base + r]) >= thr. Each lane's
        values are sorted descending and float addition is monotone, so it is a binary search per lane, probing a
        register tensor (no memory traffic)."""
        lo = tl.zeros_like(lens)
        hi = lens
        for _ in range(STEPS):
            active = lo < hi
            mid = (lo + hi) // 2
            v = tl.gather(src, tl.minimum(src_base + mid, SRC - 1), 0)
            ok = active & (_float_key(base + v) >= thr)
            lo = tl.where(ok, mid + 1, lo)
            hi = tl.where(active & (ok == 0), mid, hi)
        return lo

    @triton.jit
    def _select_slots(base, lens, src, src_base, need, offs, STEPS: tl.constexpr, SRC: tl.constexpr,
                      SEARCH: tl.constexpr, SEARCH_STEPS: tl.constexpr):
        """Top-`need` of the family of sorted lists {base[i] + src[src_base[i] + r] : r < lens[i]}, ties to the
        lower (i, r): for output slot j (lane j < need) returns its list i and rank r."""
        # Bisection for the largest key t with >= need candidates of key >= t. Bounds: the best candidate is
        # base[0] + src[src_base[0]] at most... every list's head is a candidate, so bound by the heads' keys.
        heads = tl.where(lens > 0, _float_key(base + tl.gather(src, tl.minimum(src_base, SRC - 1), 0)),
                         -2147483648)
        lo = tl.full([1], -2147483648, tl.int64)
        hi = tl.zeros([1], dtype=tl.int64) + tl.max(heads, axis=0).to(tl.int64)
        for _ in range(32):
            mid = lo + (hi - lo + 1) // 2
            count = tl.sum(_count_at_least(base, lens, src, src_base, mid.to(tl.int32), STEPS, SRC), axis=0)
            ok = count >= need
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid - 1)
        thr = lo.to(tl.int32)
        at_least = _count_at_least(base, lens, src, src_base, thr, STEPS, SRC)
        above = _count_at_least(base, lens, src, src_base, thr + 1, STEPS, SRC)
        ties = at_least - above
        missing = need - tl.sum(above, axis=0)
        ties_before = tl.cumsum(ties, 0) - ties
        take = above + tl.minimum(tl.maximum(missing - ties_before, 0), ties)
        ends = tl.cumsum(take, 0)
        starts = ends - take
        # list of slot j: the first list whose end is > j (ends are non-decreasing)
        lo_s = tl.zeros_like(offs)
        hi_s = tl.zeros_like(offs) + SEARCH
        for _ in range(SEARCH_STEPS):
            active = lo_s < hi_s
            mid = tl.minimum((lo_s + hi_s) // 2, SEARCH - 1)
            ok = active & (tl.gather(ends, mid, 0) <= offs)
            lo_s = tl.where(ok, mid + 1, lo_s)
            hi_s = tl.where(active & (ok == 0), mid, hi_s)
        which = tl.minimum(lo_s, SEARCH - 1)
        rank = offs - tl.gather(starts, which, 0)
        return which, rank

    @triton.jit
    def _tree_build_kernel(
        values_ptr, tokens_ptr, budget_ptr, root_ptr, log_prune,
        lvl_score_ptr, lvl_parent_ptr, lvl_rank_ptr, inv_ptr,
        out_tokens_ptr, out_parents_ptr, out_depth_ptr, out_scores_ptr, out_ranks_ptr, out_valid_ptr,
        L: tl.constexpr, LP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, W: tl.constexpr,
        WP: tl.constexpr, LWP: tl.constexpr, RANK_STEPS: tl.constexpr, POS_STEPS: tl.constexpr,
        LIST_STEPS: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        NEG_INF: tl.constexpr = float("-inf")
        offs_w = tl.arange(0, WP)
        vals = values_ptr + b * L * K
        lvl_score = lvl_score_ptr + b * L * WP
        lvl_parent = lvl_parent_ptr + b * L * WP
        lvl_rank = lvl_rank_ptr + b * L * WP
        # Candidate extensions of parent slot i: ranks r < min(W // (i + 1), K) (the others are dominated).
        lens = tl.where(offs_w < W, tl.minimum(W // (offs_w + 1), K), 0)

        # depth 1: the root's children, already sorted by the top-K
        prev = tl.load(vals + offs_w, mask=(offs_w < K) & (offs_w < W), other=NEG_INF)
        tl.store(lvl_score + offs_w, prev)
        tl.store(lvl_parent + offs_w, tl.zeros([WP], dtype=tl.int32))
        tl.store(lvl_rank + offs_w, offs_w.to(tl.int32))
        offs_k = tl.arange(0, KP)
        for d in range(1, L):
            vreg = tl.load(vals + d * K + offs_k, mask=offs_k < K, other=NEG_INF)
            parent, rank = _select_slots(prev, lens, vreg, tl.zeros_like(offs_w), W, offs_w, RANK_STEPS, KP, WP,
                                         POS_STEPS)
            live = offs_w < W
            score = tl.where(live, tl.gather(prev, parent, 0) + tl.gather(vreg, tl.minimum(rank, KP - 1), 0),
                             NEG_INF)
            # this depth's list in canonical order: score, then parent slot, then rank
            key = (_float_key(score).to(tl.int64) << 32) | (2147483647 - (parent * K + rank)).to(tl.int64)
            key = tl.where(live, key, -(2**63))  # unused slots (W < WP) sort last
            key = tl.sort(key, descending=True)
            pick = (2147483647 - (key & 0xFFFFFFFF)).to(tl.int32)
            prev = tl.where(live, _key_float((key >> 32).to(tl.int32)), NEG_INF)
            tl.store(lvl_score + d * WP + offs_w, prev)
            tl.store(lvl_parent + d * WP + offs_w, pick // K)
            tl.store(lvl_rank + d * WP + offs_w, pick % K)

        # global top-W over the L sorted depth lists, ties to the shallower depth, then the lower position
        tl.debug_barrier()
        offs_l = tl.arange(0, LP)
        list_len = tl.where(offs_l < L, W, 0)
        offs_all = tl.arange(0, LWP)
        all_scores = tl.load(lvl_score + offs_all, mask=offs_all < L * WP, other=NEG_INF)
        # lane d of the search reads list d at offset d * WP; adding -0.0 leaves every score intact
        depth0, pos = _select_slots(tl.full([LP], -0.0, tl.float32), list_len, all_scores, offs_l * WP, W, offs_w,
                                    POS_STEPS, LWP, LP, LIST_STEPS)
        entry = depth0 * WP + pos
        chosen = offs_w < W
        score = tl.where(chosen, tl.load(lvl_score + entry, mask=chosen, other=NEG_INF), NEG_INF)
        gkey = (_float_key(score).to(tl.int64) << 32) | (L * WP - 1 - entry).to(tl.int64)
        gkey = tl.where(chosen, gkey, -(2**63))  # unused slots (W < WP) sort last
        gkey = tl.sort(gkey, descending=True)
        entry = (L * WP - 1 - (gkey & 0xFFFFFFFF)).to(tl.int32)
        depth0 = entry // WP
        pos = entry % WP
        score = _key_float((gkey >> 32).to(tl.int32))
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

    @triton.jit
    def _verify_mask_kernel(
        parents_ptr, valid_ptr, start_ptr, seq_lens_ptr, mask_ptr,
        N: tl.constexpr, L: tl.constexpr, BLOCK_ROWS: tl.constexpr, NP: tl.constexpr,
    ):
        """Tree block of SGLang's FULL_MASK for rows [row0, row0+BLOCK_ROWS) of request b: row r, column c is
        True iff node c is node r or an ancestor of it (invalid rows: only themselves)."""
        b = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        cols = tl.arange(0, NP)
        row_ok = rows < N
        prefix = tl.load(seq_lens_ptr + b).to(tl.int64)
        row_base = tl.load(start_ptr + b) + rows.to(tl.int64) * (prefix + N) + prefix
        ptrs = mask_ptr + row_base[:, None] + cols[None, :]
        tl.store(ptrs, tl.zeros([BLOCK_ROWS, NP], dtype=tl.int8), mask=row_ok[:, None] & (cols[None, :] < N))
        tl.debug_barrier()
        node = rows.to(tl.int64)
        for _ in range(L + 1):
            alive = row_ok & (node >= 0)
            tl.store(mask_ptr + row_base + node, tl.full([BLOCK_ROWS], 1, tl.int8), mask=alive)
            node = tl.load(parents_ptr + b * N + node, mask=alive, other=-1)

    @triton.jit
    def _walk_kernel(
        tokens_ptr, parents_ptr, valid_ptr, choice_ptr, match_ptr,
        path_ptr, accept_ptr, bonus_ptr, out_tokens_ptr,
        N: tl.constexpr, NP: tl.constexpr, L: tl.constexpr, LP: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, NP)
        in_tree = offs < N
        tok = tl.load(tokens_ptr + b * N + offs, mask=in_tree, other=0)
        par = tl.load(parents_ptr + b * N + offs, mask=in_tree, other=-1)
        val = tl.load(valid_ptr + b * N + offs, mask=in_tree, other=0) != 0
        is_child = in_tree & val & (par >= 0)
        choice_at_parent = tl.load(choice_ptr + b * N + par, mask=is_child, other=-1)
        hit = is_child & (tok == choice_at_parent)
        tl.store(match_ptr + b * N + par, offs.to(tl.int64), mask=hit)  # siblings carry distinct tokens
        tl.debug_barrier()
        steps = tl.arange(0, LP)
        path = tl.where(steps == 0, 0, -1).to(tl.int64)
        node = tl.zeros([1], dtype=tl.int64)
        for s in range(1, L + 1):
            node = tl.load(match_ptr + b * N + node, mask=node >= 0, other=-1)
            path = tl.where(steps == s, node, path)
        accept = tl.sum(((path >= 0) & (steps > 0)).to(tl.int64))
        last = tl.max(tl.where(steps == accept, path, -1))
        bonus = tl.load(choice_ptr + b * N + last)
        tl.store(path_ptr + b * (L + 1) + steps, path, mask=steps < L + 1)
        tl.debug_barrier()
        following = tl.load(path_ptr + b * (L + 1) + steps + 1, mask=steps < L, other=-1)
        ftok = tl.load(tokens_ptr + b * N + following, mask=following >= 0, other=-1)
        out = tl.where(steps < accept, ftok, tl.where(steps == accept, bonus, -1))
        tl.store(out_tokens_ptr + b * (L + 1) + steps, out, mask=steps < L + 1)
        tl.store(accept_ptr + b, accept)
        tl.store(bonus_ptr + b, bonus)


def build_tree_triton(topk_values: torch.Tensor, topk_tokens: torch.Tensor, budget, root_tokens: torch.Tensor, *,
                      prune: float | None = None, max_budget: int | None = None) -> DraftTree:
    """Same result as tree.build_tree_from_topk (bit for bit), one kernel launch."""
    import math

    bs, depth_limit, k = topk_values.shape
    width = max_budget if max_budget is not None else int(budget)
    device = topk_values.device
    wp = _pow2(width)
    if isinstance(budget, torch.Tensor):
        budget_t = budget.to(device=device, dtype=torch.int64)
    else:
        budget_t = torch.full((bs,), int(budget), dtype=torch.int64, device=device)
    n = width + 1
    out = {
        "tokens": torch.empty((bs, n), dtype=torch.int64, device=device),
        "parents": torch.empty((bs, n), dtype=torch.int64, device=device),
        "depth": torch.empty((bs, n), dtype=torch.int64, device=device),
        "scores": torch.empty((bs, n), dtype=torch.float32, device=device),
        "ranks": torch.empty((bs, n), dtype=torch.int64, device=device),
        "valid": torch.empty((bs, n), dtype=torch.int8, device=device),
    }
    lvl_score = torch.empty((bs, depth_limit, wp), dtype=torch.float32, device=device)
    lvl_parent = torch.empty((bs, depth_limit, wp), dtype=torch.int32, device=device)
    lvl_rank = torch.empty((bs, depth_limit, wp), dtype=torch.int32, device=device)
    inv = torch.zeros((bs, depth_limit * wp), dtype=torch.int32, device=device)
    log_prune = math.log(prune) if prune else float("-inf")
    _tree_build_kernel[(bs,)](
        topk_values.float().contiguous(), topk_tokens.to(torch.int64).contiguous(), budget_t,
        root_tokens.to(device=device, dtype=torch.int64).contiguous(), log_prune,
        lvl_score, lvl_parent, lvl_rank, inv,
        out["tokens"], out["parents"], out["depth"], out["scores"], out["ranks"], out["valid"],
        L=depth_limit, LP=_pow2(depth_limit), K=k, KP=_pow2(min(width, k)), W=width, WP=wp,
        LWP=_pow2(depth_limit * wp),
        RANK_STEPS=(min(width, k) + 1).bit_length(), POS_STEPS=(wp + 1).bit_length(),
        LIST_STEPS=(_pow2(depth_limit) + 1).bit_length(), num_warps=_warps(wp),
    )
    return DraftTree(out["tokens"], out["parents"], out["depth"], out["scores"], out["ranks"],
                     out["valid"].bool(), depth_limit)


def _warps(elements: int) -> int:
    return 4 if elements <= 1024 else 8 if elements <= 4096 else 16


def tree_verify_mask_triton(tree: DraftTree, seq_lens: torch.Tensor, numel: int) -> torch.Tensor:
    """Same result as sglang.ops.tree_verify_mask(layout.ancestor_mask(tree), seq_lens, numel)."""
    bs, n = tree.tokens.shape
    device = tree.tokens.device
    seq_lens = seq_lens.to(device=device, dtype=torch.int64)
    block = n * (seq_lens + n)
    start = torch.cumsum(block, dim=0) - block
    mask = torch.ones(numel, dtype=torch.bool, device=device)
    rows = 16
    _verify_mask_kernel[(bs, triton.cdiv(n, rows))](
        tree.parents.contiguous(), tree.valid, start, seq_lens, mask.view(torch.int8),
        N=n, L=tree.depth_limit, BLOCK_ROWS=rows, NP=_pow2(n), num_warps=4,
    )
    return mask


def walk_triton(tree: DraftTree, target_choice: torch.Tensor):
    """Same result as walk.walk_choices(tree, target_choice)."""
    from sglang_ddtree.walk import WalkResult

    bs, n = tree.tokens.shape
    device = tree.tokens.device
    depth = tree.depth_limit
    choice = target_choice.to(torch.int64).contiguous()
    match = torch.full((bs, n), -1, dtype=torch.int64, device=device)
    path = torch.empty((bs, depth + 1), dtype=torch.int64, device=device)
    accept = torch.empty(bs, dtype=torch.int64, device=device)
    bonus = torch.empty(bs, dtype=torch.int64, device=device)
    out_tokens = torch.empty((bs, depth + 1), dtype=torch.int64, device=device)
    _walk_kernel[(bs,)](
        tree.tokens.contiguous(), tree.parents.contiguous(), tree.valid.to(torch.int8), choice, match,
        path, accept, bonus, out_tokens, N=n, NP=_pow2(n), L=depth, LP=_pow2(depth + 1), num_warps=4,
    )
    return WalkResult(path=path, accept_len=accept, bonus=bonus, out_tokens=out_tokens, target_choice=choice)
