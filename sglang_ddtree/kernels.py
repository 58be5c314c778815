"""Triton kernels for the serving hot path: draft top-K and logsumexp, tree build, verify mask, walk, KV move.

Why: the torch versions in tree.py / layout.py / walk.py are exact and readable, but they launch one small kernel
per depth and per step (~150 launches for a 15-deep tree); on an H200 that costs ~1 ms per round even inside a
CUDA graph, more than the verify of a small target. These kernels do the same computation in a few launches and
give bit-identical results (tests compare them with the torch versions, on CPU through TRITON_INTERPRET=1).

Tree build (same algorithm and canonical order as tree.build_tree_from_topk): per depth, the static extension
pairs (parent slot i, token rank r) with (i+1)(r+1) <= W are scored with a unique int64 key (float bits, then the
lower pair index) and the best W kept; at the end the global top-W of all depths' lists by the same kind of key
(float bits, then shallower depth, then position). Parents become node indices through an inverse map. Three
variants, chosen by width (TREE_KERNEL): "sort" (one program per request, full sorts), "select" (one program per
request, radix selection, then a sort of W keys) and "rank" (many programs per request, one launch per depth).
"""

from __future__ import annotations

import os

import torch

from sglang_ddtree.tree import DraftTree, _extension_pairs_cpu

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: callers fall back to the torch versions
    triton = None
    tl = None


def available(device: torch.device) -> bool:
    return triton is not None and (torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


if triton is not None:

    @triton.jit
    def _path_kv_move_kernel(data_ptrs, strides, tgt_ptr, src_ptr, ROWS: tl.constexpr, RP: tl.constexpr,
                             TILE: tl.constexpr):
        """One program per (KV buffer, request, byte tile): the request's moved rows (src != tgt) of that tile,
        all loaded before any is stored."""
        buf = tl.program_id(0)
        req = tl.program_id(1).to(tl.int64)
        tile = tl.program_id(2)
        stride = tl.load(strides + buf).to(tl.int64)
        base = tl.load(data_ptrs + buf).to(tl.pointer_type(tl.uint8))
        r = tl.arange(0, RP)
        in_rows = r < ROWS
        src = tl.load(src_ptr + req * ROWS + r, mask=in_rows, other=0)
        tgt = tl.load(tgt_ptr + req * ROWS + r, mask=in_rows, other=0)
        moved = in_rows & (src != tgt)
        off = tile * TILE + tl.arange(0, TILE)
        m = moved[:, None] & (off < stride)[None, :]
        vals = tl.load(base + src[:, None] * stride + off[None, :], mask=m)
        tl.store(base + tgt[:, None] * stride + off[None, :], vals, mask=m)


    @triton.jit
    def _float_key(x):
        bits = x.to(tl.int32, bitcast=True)
        return bits ^ ((bits >> 31) & 0x7FFFFFFF)

    @triton.jit
    def _key_float(k):
        bits = k ^ ((k >> 31) & 0x7FFFFFFF)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _radix_digit(hist, k_left):
        """One step of a radix selection: the digit (bin of the 256) that holds the k_left-th largest counted key,
        and how many of the k_left are still to be found among the keys with that digit."""
        bins = tl.arange(0, 256)
        at_or_above = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # keys with this digit or a larger one
        digit = tl.max(tl.where(at_or_above >= k_left, bins, -1), 0)
        return digit, k_left - tl.sum(tl.where(bins > digit, hist, 0), 0)

    @triton.jit
    def _key_from_prefix(prefix, KEY_BITS: tl.constexpr):
        """The whole unsigned 32-bit key of a value whose float32 bits below the top KEY_BITS are zero (a bfloat16
        value as float32: KEY_BITS = 16; float16: 24 covers its 10 mantissa bits) from those top bits: _float_key
        keeps a non-negative value's low bits (zero) and flips a negative one's (all ones)."""
        LOW: tl.constexpr = 32 - KEY_BITS
        fill = tl.where(prefix >= (1 << (KEY_BITS - 1)), 0, (1 << LOW) - 1).to(tl.int64)
        return (prefix << LOW) | fill

    @triton.jit
    def _radix_select(ukey, live, count, KEY_BITS: tl.constexpr, EARLY: tl.constexpr):
        """The count-th largest of the live keys (int64 holding unsigned 32-bit values) and how many keys equal to
        it belong to the top `count` (histogram passes over 8-bit digits, in registers).
        KEY_BITS: the keys' bits that can differ (32 for float32 values; 16 / 24 for bfloat16 / float16 ones, whose
        low bits follow from the sign: _key_from_prefix): one pass per 8 of them.
        EARLY: stop once the bin holding the count-th largest key lies wholly inside the top `count`; the result is
        then (that bin's smallest key - 1, 0): every key above it is taken, none at it, the same selection. Why:
        after 24 bits a bin of a few thousand float32 scores rarely holds more than the one key, so the 4th pass
        mostly confirmed what the 3rd had found. Measured (lease 18, same run as the kernels without it): the tree
        kernel's time did not move (B = 256 / 1024 with confident drafts 0.117 -> 0.120 / 0.410 -> 0.409 ms): the
        checks cost what the skipped pass saved. The 2-pass bf16 selections of the top-K (KEY_BITS) gave that run's
        gain (0.080 -> 0.061 ms)."""
        prefix = tl.zeros([], dtype=tl.int64)
        k_left = tl.zeros([], dtype=tl.int32) + count
        whole = tl.zeros([], dtype=tl.int32)  # 1 once a bin was found wholly selected
        early_thresh = tl.zeros([], dtype=tl.int64)
        bins = tl.arange(0, 256)
        for p in tl.static_range(KEY_BITS // 8):
            shift = 24 - 8 * p
            if whole == 0:
                match = live & ((ukey >> (shift + 8)) == prefix)
                hist = tl.histogram(((ukey >> shift) & 255).to(tl.int32), 256, mask=match)
                digit, k_left = _radix_digit(hist, k_left)
                prefix = prefix * 256 + digit.to(tl.int64)
                if EARLY:
                    if p < KEY_BITS // 8 - 1:  # (after the last pass the prefix is the key anyway)
                        if tl.sum(tl.where(bins == digit, hist, 0), 0) == k_left:
                            in_bin = live & ((ukey >> shift) == prefix)
                            early_thresh = tl.min(tl.where(in_bin, ukey, 4294967296), 0) - 1
                            whole = tl.full([], 1, dtype=tl.int32)
        thresh = tl.where(whole != 0, early_thresh, _key_from_prefix(prefix, KEY_BITS))
        k_left = tl.where(whole != 0, 0, k_left)
        return thresh, k_left

    @triton.jit
    def _top_w_sorted(key, live, n_live, scratch, offs_w, W: tl.constexpr, ABLATE: tl.constexpr):
        """The W largest live int64 keys (all n_live of them when there are no more than W), sorted descending, as
        a [WP] block (int64 min past them). The high word is an order-preserving float key; among equal high words
        the lower position has the larger low word, so the ties at the threshold are taken lowest position first (a
        cumsum in position order), as a full sort would.
        Why: a full sort of ~W ln W keys per depth dominated the tree build (B=1024: 3.2 ms on an H200); then the
        radix passes did (lease 16, confident drafts: ~69% of the kernel at B=256), so they run only when more
        than W keys are live."""
        ukey = (key >> 32) + 2147483648
        if ABLATE % 2 == 1:  # profiling only (ABLATE_*): no selection, the first W live keys pass
            thresh = tl.zeros([], dtype=tl.int64)
            k_left = tl.zeros([], dtype=tl.int32) + W
        elif n_live <= W:  # every live key is selected: a threshold below all of them
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
        if ABLATE % 2 == 1:  # every live key passed the zero threshold: keep the first W slots
            sel = sel & (slot < W)
        tl.debug_barrier()
        tl.store(scratch + slot, key, mask=sel)
        tl.debug_barrier()
        # (slots past the selected keys hold an earlier call's keys: not read)
        top = tl.load(scratch + offs_w, mask=offs_w < tl.minimum(n_live, W), other=-9223372036854775807 - 1)
        if ABLATE < 2:  # (profiling only: ABLATE_SORT / ABLATE_BOTH leave the W keys unsorted)
            top = tl.sort(top, 0, descending=True)
        return top

    @triton.jit
    def _best_w(key, live, n_live, scratch, offs, offs_w, W: tl.constexpr, RADIX: tl.constexpr,
                ABLATE: tl.constexpr):
        """The W largest live keys (n_live of them live), descending, as a [WP] block: radix selection and a sort
        of W keys (RADIX), or a sort of all of them (dead entries must then hold the int64 minimum)."""
        if RADIX:
            top = _top_w_sorted(key, live, n_live, scratch, offs_w, W, ABLATE)
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
        SP: tl.constexpr, GP: tl.constexpr, RADIX: tl.constexpr, ABLATE: tl.constexpr, LP: tl.constexpr,
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
        #   skipped (they were ~69% of the kernel at B = 256 with confident drafts, lease 16; with the two-list
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
        while (d < L) & ((bound > lb) | (ABLATE > 0)):  # the profiling variants select at every depth
            cand = tl.gather(prev, pp, 0) + tl.load(vals + d * K + pr, mask=pr < K, other=NEG_INF)
            live = (cand > lb) | (ABLATE > 0)  # (the profiling variants keep every candidate)
            n_live = tl.sum(live.to(tl.int32), 0)
            key = (_float_key(cand).to(tl.int64) << 32) | (CP - 1 - offs_c).to(tl.int64)
            key = tl.where(live, key, -(2**63))  # the full-sort variant orders dead entries last
            top = _best_w(key, live, n_live, scratch, offs_c, offs_w, W, RADIX, ABLATE)
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
        glob = _best_w(everything, built, d * WP, scratch, offs_g, offs_w, W, RADIX, ABLATE)
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

    @triton.jit
    def _chain_accept_kernel(
        cand_ptr, choice_ptr, logp_ptr, prefix_ptr, accept_ptr, commit_ptr, bonus_ptr, out_ptr, new_len_ptr,
        branch_ptr, summary_ptr, bs, L: tl.constexpr, W: tl.constexpr, ROWS: tl.constexpr, BLOCKS: tl.constexpr,
    ):
        """One program for the whole batch (the batch sums need no atomics): see chain_accept_triton."""
        cols = tl.arange(0, W)
        node_cols = cols < L + 1
        draft_cols = cols < L
        counts = tl.zeros([W], dtype=tl.float32)
        expected = tl.zeros([ROWS], dtype=tl.float32)
        requests = tl.zeros([ROWS], dtype=tl.float32)
        for block in range(BLOCKS):
            rows = block * ROWS + tl.arange(0, ROWS)
            live = rows < bs
            r = rows.to(tl.int64)
            drafts = live[:, None] & draft_cols[None, :]
            choice = tl.load(choice_ptr + r[:, None] * (L + 1) + cols[None, :],
                             mask=live[:, None] & node_cols[None, :], other=0)
            # the draft at node j + 1 is accepted when the target's choice at node j is that token
            following = tl.load(cand_ptr + r[:, None] * (L + 1) + cols[None, :] + 1, mask=drafts, other=0)
            miss = (choice != following) | ~draft_cols[None, :]
            accept = tl.min(tl.where(miss, cols[None, :], W), axis=1)  # the first miss: accepted drafts, <= L
            at_accept = cols[None, :] == accept[:, None]
            bonus = tl.sum(tl.where(at_accept, choice, 0), axis=1)
            out = tl.where(cols[None, :] < accept[:, None], following, tl.where(at_accept, bonus[:, None], 0))
            tl.store(out_ptr + r[:, None] * (L + 1) + cols[None, :], out, mask=live[:, None] & node_cols[None, :])
            tl.store(accept_ptr + r, accept, mask=live)
            tl.store(commit_ptr + r, accept + 1, mask=live)
            tl.store(bonus_ptr + r, bonus, mask=live)
            tl.store(branch_ptr + r, tl.zeros([ROWS], dtype=tl.int32), mask=live)  # no draft off the top-1
            prefix = tl.load(prefix_ptr + r, mask=live, other=0)
            tl.store(new_len_ptr + r, prefix + accept + 1, mask=live)
            # the drafter's expected committed tokens: 1 + the sum over the chain's nodes of their prefix probability
            logp = tl.load(logp_ptr + r[:, None] * L + cols[None, :], mask=drafts, other=0.0)
            prob = tl.where(drafts, tl.exp(tl.cumsum(logp, axis=1)), 0.0)
            expected += tl.where(live, 1.0 + tl.sum(prob, axis=1), 0.0)
            requests += live.to(tl.float32)
            counts += tl.sum((live[:, None] & at_accept).to(tl.float32), axis=0)
        n = tl.sum(requests, axis=0)
        tl.store(summary_ptr + cols, counts, mask=node_cols)
        tl.store(summary_ptr + L + 1, 0.0)  # branches: a chain has none
        tl.store(summary_ptr + L + 2, n * L)  # draft nodes verified
        tl.store(summary_ptr + L + 3, tl.sum(expected, axis=0))
        tl.store(summary_ptr + L + 4, n)

    # ---- tree build, "rank" variant: many programs per request, one launch per depth (see build_tree_triton_rank)

    @triton.jit
    def _rank_init_kernel(
        values_ptr, root_ptr, lvl_score_ptr, lvl_parent_ptr, lvl_rank_ptr,
        out_tokens_ptr, out_parents_ptr, out_depth_ptr, out_scores_ptr, out_ranks_ptr, out_valid_ptr,
        L: tl.constexpr, K: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, NP: tl.constexpr,
    ):
        """Depth-1 list (the root's children = the top-K of depth 1), empty lists below, every output node invalid
        (the final kernel overwrites the chosen ones), the root."""
        b = tl.program_id(0).to(tl.int64)
        NEG_INF: tl.constexpr = float("-inf")
        offs = tl.arange(0, WP)
        base = b * L * WP
        tl.store(lvl_score_ptr + base + offs,
                 tl.load(values_ptr + b * L * K + offs, mask=(offs < K) & (offs < W), other=NEG_INF))
        tl.store(lvl_parent_ptr + base + offs, tl.zeros([WP], dtype=tl.int32))
        tl.store(lvl_rank_ptr + base + offs, offs.to(tl.int32))
        for d in range(1, L):
            tl.store(lvl_score_ptr + base + d * WP + offs, tl.full([WP], NEG_INF, tl.float32))
        n = tl.arange(0, NP)
        m = n < W + 1
        out = b * (W + 1) + n
        is_root = n == 0
        tl.store(out_tokens_ptr + out, tl.where(is_root, tl.load(root_ptr + b), 0), mask=m)
        tl.store(out_parents_ptr + out, tl.full([NP], -1, tl.int64), mask=m)
        tl.store(out_depth_ptr + out, tl.zeros([NP], dtype=tl.int64), mask=m)
        tl.store(out_scores_ptr + out, tl.where(is_root, 0.0, NEG_INF), mask=m)
        tl.store(out_ranks_ptr + out, tl.where(is_root, 0, -1).to(tl.int64), mask=m)
        tl.store(out_valid_ptr + out, is_root.to(tl.int8), mask=m)

    @triton.jit
    def _rank_depth_kernel(
        values_ptr, pair_parent_ptr, pair_rank_ptr, run_len_ptr, lvl_score_ptr, lvl_parent_ptr, lvl_rank_ptr,
        d, n_pairs,
        L: tl.constexpr, K: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, BLOCK: tl.constexpr,
        STEPS: tl.constexpr,
    ):
        """Depth d's list from depth d-1's: every extension pair (parent slot i, token rank r) of this program's
        block gets its exact rank among all pairs (score descending, then pair index ascending) by counting, in
        each parent's run of pairs, the ones that beat it (a binary search: a run's scores fall with r); the
        pairs ranked below W are written to their slot. Same lists as _tree_build_kernel's sort."""
        b = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        cm = c < n_pairs
        i = tl.load(pair_parent_ptr + c, mask=cm, other=0)
        r = tl.load(pair_rank_ptr + c, mask=cm, other=K)
        prev = lvl_score_ptr + b * L * WP + (d - 1) * WP
        vals = values_ptr + b * L * K + d * K
        score = tl.load(prev + i, mask=cm, other=float("-inf")) + tl.load(vals + r, mask=cm & (r < K),
                                                                            other=float("-inf"))
        skey = _float_key(score)
        live = cm & (score > float("-inf"))
        ip = tl.arange(0, WP)
        pscore = tl.load(prev + ip, mask=ip < W, other=float("-inf"))
        run = tl.load(run_len_ptr + ip, mask=ip < W, other=0)
        later = ip[None, :] > i[:, None]  # a later parent's pair wins only with a strictly higher score
        lo = tl.zeros([BLOCK, WP], dtype=tl.int32)
        hi = tl.zeros([BLOCK, WP], dtype=tl.int32) + run[None, :]
        for _ in tl.static_range(STEPS):
            active = lo < hi
            mid = (lo + hi) // 2
            v = tl.load(vals + mid, mask=active, other=float("-inf"))
            k2 = _float_key(pscore[None, :] + v)
            beats = tl.where(later, k2 > skey[:, None], k2 >= skey[:, None])
            lo = tl.where(active & beats, mid + 1, lo)
            hi = tl.where(active & (beats == 0), mid, hi)
        own = ip[None, :] == i[:, None]  # the own run: exactly the r pairs before it
        rank = tl.sum(tl.where(own, r[:, None], lo), axis=1)
        keep = live & (rank < W)
        slot = b * L * WP + d * WP + rank
        tl.store(lvl_score_ptr + slot, score, mask=keep)
        tl.store(lvl_parent_ptr + slot, i, mask=keep)
        tl.store(lvl_rank_ptr + slot, r, mask=keep)

    @triton.jit
    def _global_rank(lvl, skey, d, w, L: tl.constexpr, WP: tl.constexpr, LP: tl.constexpr, BLOCK: tl.constexpr,
                     STEPS: tl.constexpr, W: tl.constexpr):
        """Rank of entries (depth d, slot w, key skey) among all depth lists: score descending, then shallower
        depth, then lower slot. Each list is sorted, so a binary search per list counts what beats the entry."""
        dp = tl.arange(0, LP)
        lo = tl.zeros([BLOCK, LP], dtype=tl.int32)
        hi = tl.zeros([BLOCK, LP], dtype=tl.int32) + tl.where(dp < L, W, 0)[None, :]
        deeper = dp[None, :] > d[:, None]
        for _ in tl.static_range(STEPS):
            active = lo < hi
            mid = (lo + hi) // 2
            k2 = _float_key(tl.load(lvl + dp[None, :] * WP + mid, mask=active, other=float("-inf")))
            beats = tl.where(deeper, k2 > skey[:, None], k2 >= skey[:, None])
            lo = tl.where(active & beats, mid + 1, lo)
            hi = tl.where(active & (beats == 0), mid, hi)
        return tl.sum(tl.where(dp[None, :] == d[:, None], w[:, None], lo), axis=1)

    @triton.jit
    def _rank_final_kernel(
        tokens_ptr, lvl_score_ptr, lvl_parent_ptr, lvl_rank_ptr, budget_ptr, log_prune,
        out_tokens_ptr, out_parents_ptr, out_depth_ptr, out_scores_ptr, out_ranks_ptr, out_valid_ptr,
        L: tl.constexpr, K: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, LP: tl.constexpr,
        BLOCK: tl.constexpr, STEPS: tl.constexpr,
    ):
        """The global top-W over all depth lists: each entry's rank is its node slot; its parent's node is the
        parent entry's rank (computed the same way), so no inverse map and no second pass."""
        b = tl.program_id(0).to(tl.int64)
        e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        d = e // WP
        w = e % WP
        em = (d < L) & (w < W)
        lvl = lvl_score_ptr + b * L * WP
        score = tl.load(lvl + e, mask=em, other=float("-inf"))
        live = em & (score > float("-inf"))
        g = _global_rank(lvl, _float_key(score), d, w, L, WP, LP, BLOCK, STEPS, W)
        chosen = live & (g < W)
        pslot = tl.load(lvl_parent_ptr + b * L * WP + e, mask=chosen, other=0)
        rank = tl.load(lvl_rank_ptr + b * L * WP + e, mask=chosen, other=0)
        pd = tl.maximum(d - 1, 0)
        pscore = tl.load(lvl + pd * WP + pslot, mask=chosen & (d > 0), other=0.0)
        pg = _global_rank(lvl, _float_key(pscore), pd, pslot, L, WP, LP, BLOCK, STEPS, W)
        parent = tl.where(d > 0, pg + 1, 0).to(tl.int64)
        token = tl.load(tokens_ptr + b * L * K + d * K + rank, mask=chosen, other=0)
        budget = tl.load(budget_ptr + b)
        valid = chosen & (g < budget) & (score >= log_prune)
        out = b * (W + 1) + 1 + g
        tl.store(out_tokens_ptr + out, tl.where(valid, token, 0), mask=chosen)
        tl.store(out_parents_ptr + out, tl.where(valid, parent, -1), mask=chosen)
        tl.store(out_depth_ptr + out, tl.where(valid, d + 1, 0).to(tl.int64), mask=chosen)
        tl.store(out_scores_ptr + out, tl.where(valid, score, float("-inf")), mask=chosen)
        tl.store(out_ranks_ptr + out, tl.where(valid, rank, -1).to(tl.int64), mask=chosen)
        tl.store(out_valid_ptr + out, valid.to(tl.int8), mask=chosen)


_PAIRS: dict = {}


if triton is not None:

    # ---- per-row statistics of the lm_head's output in its own dtype: max, first index of the max, logsumexp,
    # computed by the top-K's first two launches (below): per (row, chunk of GB x S entries) a max and a sum of
    # exp(x - max), then per row their combination. row_max_lse runs the same two kernels with the same launch
    # shapes, so both give the same logsumexp bit for bit (an `auto` chain round's top-1 must stay the top-K's first
    # column): two separate kernels with the same source gave different bits on the H200 (lease 13; a sum's order
    # follows the launch's warps).

    @triton.jit
    def _load_group_block(x_ptr, row, prog, stride_x, V: tl.constexpr, GB: tl.constexpr, S: tl.constexpr):
        """Entries prog*GB*S .. (prog+1)*GB*S - 1 of a row as a [GB, S] float32 block (-inf past V) and their
        indices."""
        g = prog * GB + tl.arange(0, GB)
        offs = g[:, None] * S + tl.arange(0, S)[None, :]
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        return offs, x

    # ---- exact top-K over the vocabulary (topk_triton): a threshold from group maxima, then a radix selection
    # among the few keys above it

    @triton.jit
    def _vocab_keys(x_ptr, row, chunk, stride_x, V: tl.constexpr, CHUNK: tl.constexpr):
        offs = chunk * CHUNK + tl.arange(0, CHUNK)
        inside = offs < V
        x = tl.load(x_ptr + row * stride_x + offs, mask=inside, other=0.0).to(tl.float32)
        return offs, inside, _float_key(x).to(tl.int64) + 2147483648  # unsigned order in [0, 2^32)

    @triton.jit
    def _group_max_kernel(x_ptr, gmax_ptr, pm_ptr, ps_ptr, parg_ptr, stride_x, groups, parts, V: tl.constexpr,
                          GB: tl.constexpr, S: tl.constexpr, LSE: tl.constexpr):
        """The largest key of each group of S consecutive entries (GB groups a program); LSE: also the program's
        max, the first index holding it, and the sum of exp(x - max) (0 for a block of -inf only)."""
        row = tl.program_id(0).to(tl.int64)
        prog = tl.program_id(1)
        offs, x = _load_group_block(x_ptr, row, prog, stride_x, V, GB, S)
        g = prog * GB + tl.arange(0, GB)
        tl.store(gmax_ptr + row * groups + g, tl.max(_float_key(x), axis=1), mask=g < groups)
        if LSE:
            m = tl.max(tl.max(x, 1), 0)
            total = tl.sum(tl.sum(tl.exp(x - m), 1), 0)
            tl.store(pm_ptr + row * parts + prog, m)
            tl.store(ps_ptr + row * parts + prog, tl.where(m > float("-inf"), total, 0.0))
            tl.store(parg_ptr + row * parts + prog, tl.min(tl.min(tl.where(x == m, offs, V), 1), 0))

    @triton.jit
    def _group_threshold_kernel(gmax_ptr, thresh_ptr, pm_ptr, ps_ptr, parg_ptr, lse_ptr, max_ptr, arg_ptr, groups,
                                parts, K: tl.constexpr, GP: tl.constexpr, LSE: tl.constexpr, PP: tl.constexpr,
                                KEY_BITS: tl.constexpr):
        """t = the K-th largest group maximum (K <= groups; 0 otherwise, which keeps every key). K groups hold a
        key >= t, so the K-th largest key T >= t: the top K lie among the keys >= t. LSE: the row's logsumexp from
        the chunks' parts, its max and the first index holding it (ties keep the earlier chunk)."""
        row = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, GP)
        live = i < groups
        ukey = tl.load(gmax_ptr + row * groups + i, mask=live, other=0).to(tl.int64) + 2147483648
        if K > 0:
            thresh, k_left = _radix_select(ukey, live, K, KEY_BITS, False)
        else:
            thresh = tl.zeros([], dtype=tl.int64)
        tl.store(thresh_ptr + row, thresh)
        if LSE:
            c = tl.arange(0, PP)
            counted = c < parts
            pm = tl.load(pm_ptr + row * parts + c, mask=counted, other=float("-inf"))
            ps = tl.load(ps_ptr + row * parts + c, mask=counted, other=0.0)
            top = tl.max(pm, 0)
            tl.store(lse_ptr + row, top + tl.log(tl.sum(ps * tl.exp(pm - top), 0)))
            first_chunk = tl.min(tl.where(counted & (pm == top), c, PP), 0)
            parg = tl.load(parg_ptr + row * parts + c, mask=counted, other=0)
            tl.store(max_ptr + row, top)
            tl.store(arg_ptr + row, tl.sum(tl.where(c == first_chunk, parg, 0), 0).to(tl.int64))

    @triton.jit
    def _threshold_count_kernel(x_ptr, thresh_ptr, counts_ptr, stride_x, chunks, V: tl.constexpr,
                                CHUNK: tl.constexpr):
        """Per chunk: how many keys lie above t, and how many equal it."""
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        offs, inside, key = _vocab_keys(x_ptr, row, chunk, stride_x, V, CHUNK)
        thresh = tl.load(thresh_ptr + row)
        slot = counts_ptr + (row * chunks + chunk) * 2
        tl.store(slot, tl.sum((inside & (key > thresh)).to(tl.int32), 0))
        tl.store(slot + 1, tl.sum((inside & (key == thresh)).to(tl.int32), 0))

    @triton.jit
    def _threshold_collect_kernel(x_ptr, thresh_ptr, counts_ptr, cand_ptr, stride_x, chunks, cap,
                                  V: tl.constexpr, K: tl.constexpr, CHUNK: tl.constexpr, CHP: tl.constexpr):
        """The candidates in two index-ordered runs: every key above t (fewer than K groups hold one, so at most
        S(K-1) of them), then the first K keys equal to t (the lowest-index ties are the ones the top K can
        take). Inside each run, position order is index order: ties at the final threshold are then taken
        lowest position first."""
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        offs, inside, key = _vocab_keys(x_ptr, row, chunk, stride_x, V, CHUNK)
        thresh = tl.load(thresh_ptr + row)
        c = tl.arange(0, CHP)
        counted = c < chunks
        gt_counts = tl.load(counts_ptr + (row * chunks + c) * 2, mask=counted, other=0)
        eq_counts = tl.load(counts_ptr + (row * chunks + c) * 2 + 1, mask=counted, other=0)
        earlier = c < chunk
        gt_before = tl.sum(tl.where(earlier, gt_counts, 0), 0)
        eq_before = tl.sum(tl.where(earlier, eq_counts, 0), 0)
        n_gt = tl.sum(gt_counts, 0)
        gt = inside & (key > thresh)
        eq = inside & (key == thresh)
        out = cand_ptr + row * cap
        tl.store(out + gt_before + tl.cumsum(gt.to(tl.int32), 0) - 1, offs.to(tl.int32), mask=gt)
        eq_rank = eq_before + tl.cumsum(eq.to(tl.int32), 0) - 1
        tl.store(out + n_gt + eq_rank, offs.to(tl.int32), mask=eq & (eq_rank < K))

    @triton.jit
    def _candidate_topk_kernel(x_ptr, counts_ptr, cand_ptr, scratch_ptr, out_values_ptr, out_ids_ptr, stride_x,
                               chunks, cap, id_offset, K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr,
                               CHP: tl.constexpr, KEY_BITS: tl.constexpr):
        """Exact top K of a row's candidates (typically ~K of them, at most S(K-1) + K): KEY_BITS / 8 histogram
        passes over 8-bit digits find the K-th largest key T (see _radix_select), a pass collects the keys above T
        and the lowest-position (= lowest-index) ties at T, a sort of K gives the canonical order (value descending,
        then index ascending)."""
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride_x
        cand = cand_ptr + row * cap
        c = tl.arange(0, CHP)
        counted = c < chunks
        n_gt = tl.sum(tl.load(counts_ptr + (row * chunks + c) * 2, mask=counted, other=0), 0)
        n_eq = tl.sum(tl.load(counts_ptr + (row * chunks + c) * 2 + 1, mask=counted, other=0), 0)
        n = n_gt + tl.minimum(n_eq, K)
        prefix = tl.zeros([], dtype=tl.int64)  # the digits of T fixed so far
        k_left = tl.zeros([], dtype=tl.int32) + K  # how many of the K still lie at or below the prefix
        for p in tl.static_range(KEY_BITS // 8):
            shift = 24 - 8 * p
            hist = tl.zeros([256], dtype=tl.int32)
            start = tl.zeros([], dtype=tl.int32)
            while start < n:  # a while: the interpreter cannot take a tensor bound in range()
                pos = start + tl.arange(0, BLOCK)
                live = pos < n
                idx = tl.load(cand + pos, mask=live, other=0)
                x = tl.load(base + idx, mask=live, other=0.0).to(tl.float32)
                key = _float_key(x).to(tl.int64) + 2147483648
                match = live & ((key >> (shift + 8)) == prefix)
                hist += tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=match)
                start += BLOCK
            digit, k_left = _radix_digit(hist, k_left)
            prefix = prefix * 256 + digit.to(tl.int64)
        prefix = _key_from_prefix(prefix, KEY_BITS)
        above = K - k_left
        n_above = tl.zeros([], dtype=tl.int32)
        n_tied = tl.zeros([], dtype=tl.int32)
        out_scratch = scratch_ptr + row * KP
        start = tl.zeros([], dtype=tl.int32)
        while start < n:
            pos = start + tl.arange(0, BLOCK)
            live = pos < n
            idx = tl.load(cand + pos, mask=live, other=0)
            x = tl.load(base + idx, mask=live, other=0.0).to(tl.float32)
            key = _float_key(x).to(tl.int64) + 2147483648
            gt = live & (key > prefix)
            eq = live & (key == prefix)
            tl.store(out_scratch + n_above + tl.cumsum(gt.to(tl.int32), 0) - 1, idx.to(tl.int64), mask=gt)
            eq_rank = n_tied + tl.cumsum(eq.to(tl.int32), 0) - 1
            tl.store(out_scratch + above + eq_rank, idx.to(tl.int64), mask=eq & (eq_rank < k_left))
            n_above += tl.sum(gt.to(tl.int32), 0)
            n_tied += tl.sum(eq.to(tl.int32), 0)
            start += BLOCK
        tl.debug_barrier()
        slots = tl.arange(0, KP)
        ok = slots < K
        chosen = tl.load(out_scratch + slots, mask=ok, other=0)
        values = tl.load(base + chosen, mask=ok, other=0.0).to(tl.float32)
        packed = (_float_key(values).to(tl.int64) << 32) | (4294967295 - chosen)
        packed = tl.sort(tl.where(ok, packed, -9223372036854775807 - 1), 0, descending=True)
        ids = 4294967295 - (packed & 4294967295)
        tl.store(out_ids_ptr + row * K + slots, ids + id_offset, mask=ok)
        tl.store(out_values_ptr + row * K + slots, tl.load(base + ids, mask=ok, other=0.0).to(tl.float32),
                 mask=ok)


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


# Which tree-build kernel build_tree_triton runs: "sort" (one program per request: a full sort per depth),
# "select" (one program per request: radix selection per depth, then a sort of W keys), "rank" (many programs per
# request, one launch per depth), or "auto" (SGLANG_DDTREE_LARGE_TREE_KERNEL from SGLANG_DDTREE_RANK_MIN_WIDTH tree
# nodes up, SGLANG_DDTREE_SMALL_TREE_KERNEL below). Same output bit for bit. Environment, read once;
# scripts/device/pick_tree_setup.py derives them from a GPU benchmark. Defaults = what it picked in lease 12 (H200,
# batch 1, one graph replay, benchmarks/results/tree_kernels_h200_lease12.json): sort 0.024 / 0.031 / 0.068 / 0.143 /
# 0.48 / 1.31 / 3.24 ms at B = 16 / 32 / 64 / 128 / 256 / 512 / 1024, select 0.059 / 0.062 / 0.084 / 0.115 / 0.165 /
# 0.288 / 0.549, rank 0.122 / 0.158 / 0.210 / 0.218 / 0.246 / 0.533 / 1.87 (rank also grows with the batch: 14.4 ms
# at B=1024, batch 8).
TREE_KERNELS = ("sort", "select", "rank", "auto")
TREE_KERNEL = os.environ.get("SGLANG_DDTREE_TREE_KERNEL", "auto")
RANK_MIN_WIDTH = int(os.environ.get("SGLANG_DDTREE_RANK_MIN_WIDTH", "128"))
SMALL_TREE_KERNEL = os.environ.get("SGLANG_DDTREE_SMALL_TREE_KERNEL", "sort")
LARGE_TREE_KERNEL = os.environ.get("SGLANG_DDTREE_LARGE_TREE_KERNEL", "select")
if TREE_KERNEL not in TREE_KERNELS:
    raise ValueError(f"SGLANG_DDTREE_TREE_KERNEL must be one of {', '.join(TREE_KERNELS)}, got {TREE_KERNEL!r}.")
if SMALL_TREE_KERNEL not in ("sort", "select"):
    raise ValueError(f"SGLANG_DDTREE_SMALL_TREE_KERNEL must be sort or select, got {SMALL_TREE_KERNEL!r}.")
if LARGE_TREE_KERNEL not in ("select", "rank"):
    raise ValueError(f"SGLANG_DDTREE_LARGE_TREE_KERNEL must be select or rank, got {LARGE_TREE_KERNEL!r}.")


# Which exact top-K the serving path runs over the vocabulary (sglang/ops.py): "torch" (torch.topk, then a sort of
# the K into canonical order) or "triton" (topk_triton). Same result bit for bit. Default = what pick_tree_setup.py
# picked in lease 12 (tree_kernels_h200_lease12.json, one graph replay, log_softmax included, K = 16..1024): triton
# 0.11-0.12 / 0.36-0.39 / 1.31-1.39 ms at batch 1 / 8 / 32 against torch's 0.16-0.21 / 0.56-0.63 / 1.48-1.64.
TOPK_KERNEL = os.environ.get("SGLANG_DDTREE_TOPK_KERNEL", "triton")
if TOPK_KERNEL not in ("torch", "triton"):
    raise ValueError(f"SGLANG_DDTREE_TOPK_KERNEL must be torch or triton, got {TOPK_KERNEL!r}.")


def tree_kernel_for(width: int, kernel: str | None = None) -> str:
    choice = kernel or TREE_KERNEL
    if choice == "auto":
        return LARGE_TREE_KERNEL if width >= RANK_MIN_WIDTH else SMALL_TREE_KERNEL
    return choice


def build_tree_triton(topk_values: torch.Tensor, topk_tokens: torch.Tensor, budget, root_tokens: torch.Tensor, *,
                      prune: float | None = None, max_budget: int | None = None, kernel: str | None = None
                      ) -> DraftTree:
    """Same result as tree.build_tree_from_topk (bit for bit). kernel: sort, select, rank or auto (default
    TREE_KERNEL)."""
    width = max_budget if max_budget is not None else int(budget)
    choice = tree_kernel_for(width, kernel)
    if choice not in TREE_KERNELS[:3]:
        raise ValueError(f"tree kernel must be one of {', '.join(TREE_KERNELS)}, got {kernel!r}.")
    if choice == "rank":
        return build_tree_triton_rank(topk_values, topk_tokens, budget, root_tokens, prune=prune,
                                      max_budget=max_budget)
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


_RUNS: dict = {}


def _run_lengths(width: int, k: int, device) -> torch.Tensor:
    """Pairs per parent slot i: min(width // (i+1), k), the run lengths of _extension_pairs_cpu."""
    key = (width, k, device)
    if key not in _RUNS:
        i = torch.arange(width, dtype=torch.int64)
        _RUNS[key] = torch.clamp(width // (i + 1), max=k).to(torch.int32).to(device)
    return _RUNS[key]


def build_tree_triton_rank(topk_values: torch.Tensor, topk_tokens: torch.Tensor, budget, root_tokens: torch.Tensor,
                           *, prune: float | None = None, max_budget: int | None = None) -> DraftTree:
    """Same result as tree.build_tree_from_topk (bit for bit): L + 1 launches, each spread over many programs.

    Why: the sort kernel gives each request ONE program, which sorts ~W ln W keys per depth; at batch 1 that leaves
    all but one SM idle (B=256: ~0.45 ms on an H200). Here depth d's list comes from ranking every extension pair
    by counting (binary searches in the sorted runs), one program per block of pairs, and the global top-W by
    ranking every depth-list entry against the sorted lists the same way.
    """
    import math

    bs, depth_limit, k = topk_values.shape
    width = max_budget if max_budget is not None else int(budget)
    device = topk_values.device
    wp = _pow2(width)
    pair_parent, pair_rank, _ = _pairs(width, k, device)
    n_pairs = int(_extension_pairs_cpu(width, k)[0].numel())
    runs = _run_lengths(width, k, device)
    values = topk_values.float().contiguous()
    tokens = topk_tokens.to(torch.int64).contiguous()
    out = _tree_outputs(bs, width + 1, device)
    lvl_score = torch.empty((bs, depth_limit, wp), dtype=torch.float32, device=device)
    lvl_parent = torch.empty((bs, depth_limit, wp), dtype=torch.int32, device=device)
    lvl_rank = torch.empty((bs, depth_limit, wp), dtype=torch.int32, device=device)
    roots = root_tokens.to(device=device, dtype=torch.int64).contiguous()
    _rank_init_kernel[(bs,)](
        values, roots, lvl_score, lvl_parent, lvl_rank,
        out["tokens"], out["parents"], out["depth"], out["scores"], out["ranks"], out["valid"],
        L=depth_limit, K=k, W=width, WP=wp, NP=_pow2(width + 1), num_warps=4,
    )
    block = max(1, 4096 // wp)
    steps = max(1, k.bit_length())
    for d in range(1, depth_limit):
        _rank_depth_kernel[(bs, triton.cdiv(n_pairs, block))](
            values, pair_parent, pair_rank, runs, lvl_score, lvl_parent, lvl_rank, d, n_pairs,
            L=depth_limit, K=k, W=width, WP=wp, BLOCK=block, STEPS=steps, num_warps=4,
        )
    lp = _pow2(depth_limit)
    fblock = max(1, min(256, 4096 // lp))
    _rank_final_kernel[(bs, triton.cdiv(depth_limit * wp, fblock))](
        tokens, lvl_score, lvl_parent, lvl_rank, _budget_tensor(budget, bs, device),
        math.log(prune) if prune else float("-inf"),
        out["tokens"], out["parents"], out["depth"], out["scores"], out["ranks"], out["valid"],
        L=depth_limit, K=k, W=width, WP=wp, LP=lp, BLOCK=fblock, STEPS=max(1, width.bit_length()), num_warps=4,
    )
    return DraftTree(out["tokens"], out["parents"], out["depth"], out["scores"], out["ranks"],
                     out["valid"].bool(), depth_limit)


def build_tree_triton_sort(topk_values: torch.Tensor, topk_tokens: torch.Tensor, budget, root_tokens: torch.Tensor,
                           *, prune: float | None = None, max_budget: int | None = None, radix: bool = False,
                           ablate: int = 0) -> DraftTree:
    """Same result as tree.build_tree_from_topk (bit for bit), one kernel launch, one program per request.
    radix=False ("sort"): full sorts of each depth's pairs; radix=True ("select"): radix selection of the best W,
    then a sort of W keys. ablate (profiling only, WRONG trees): with radix, ABLATE_RADIX skips the radix passes,
    ABLATE_SORT the sort of the W selected keys, ABLATE_BOTH both (benchmarks/profile_kernels.py times the
    differences)."""
    if ablate not in (0, ABLATE_RADIX, ABLATE_SORT, ABLATE_BOTH) or (ablate and not radix):
        raise ValueError(f"ablate must be 0 or one of ABLATE_* with radix=True, got {ablate} (radix={radix}).")
    import math

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
        L=depth_limit, K=k, W=width, WP=wp, CP=cp, SP=sp, GP=gp, RADIX=radix, ABLATE=ablate,
        LP=_pow2(depth_limit), num_warps=_warps(max(cp, gp)),
    )
    return DraftTree(out["tokens"], out["parents"], out["depth"], out["scores"], out["ranks"],
                     out["valid"].bool(), depth_limit)


# Profiling variants of the select kernel (build_tree_triton_sort(..., ablate=...)): they build WRONG trees and
# exist only so that the time of a part can be read as a difference (no profiler sees inside one program).
ABLATE_RADIX, ABLATE_SORT, ABLATE_BOTH = 1, 2, 3

# Warps of the tree-build program (one program per request sorts up to a few thousand keys): 0 = by size (below).
# SGLANG_DDTREE_TREE_WARPS exists to measure other choices on a GPU (benchmarks/bench_tree.py), read once.
_TREE_WARPS = int(os.environ.get("SGLANG_DDTREE_TREE_WARPS", "0"))


def _warps(elements: int) -> int:
    if _TREE_WARPS:
        return _TREE_WARPS
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


def _chain_accept_blocks(bs: int) -> tuple[int, int]:
    """chain_accept_triton's ROWS (row blocks a loop of its one program walks: few compiled variants) and BLOCKS
    (the loop's trips) for bs requests: both constexprs, so each pair is a compiled variant."""
    rows = 16 if bs <= 16 else 64
    return rows, -(-bs // rows)


def chain_accept_batch_sizes(low: int, high: int) -> list[int]:
    """One batch size in low..high (inclusive) per variant of chain_accept_triton that batch sizes compile: its
    ROWS and BLOCKS constexprs and Triton's specialization of the integer `bs` (equal to 1, divisible by 16). Each
    variant's first launch compiles it (~0.3-0.5 s), so `auto` launches these once when it captures a batch-size
    bucket's stages (DDTreeWorker._capture_bucket): lease 32's in-process A/B timed a lean chain round's first launch
    at a new variant inside a measured run (an `auto` arm at 16.5 ms a round over a run against its fixed arm's 5.0)."""
    out, seen = [], set()
    for bs in range(max(1, low), high + 1):
        key = (*_chain_accept_blocks(bs), bs == 1, bs % 16 == 0)
        if key not in seen:
            seen.add(key)
            out.append(bs)
    return out


def chain_accept_triton(candidates: torch.Tensor, choices: torch.Tensor, logprobs: torch.Tensor,
                        prefix_lens: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
    """A chain round's walk, commit arithmetic and stats in one launch (sglang.ops.chain_accept: the same results
    as its torch reference, the expected tokens up to float32 summation order). candidates [bs, L+1] int64 (the
    root, then the drafts), choices [bs, L+1] int64 (the target's token at each), logprobs [bs, L] float32 (the
    drafts' log-probs), prefix_lens [bs]. Writes out's accept_len / commit_lens (int32 [bs]), bonus (int64 [bs]),
    out_tokens (int64 [bs, L+1]: the accepted drafts, the bonus, zeros), new_seq_lens ([bs], prefix_lens' dtype),
    branch_lens (int32 [bs], zeros) and summary (float32 [L+5], stats.round_summary_vector's layout)."""
    bs, width = candidates.shape
    rows, blocks = _chain_accept_blocks(bs)
    _chain_accept_kernel[(1,)](
        candidates.contiguous(), choices.to(torch.int64).contiguous(), logprobs.float().contiguous(),
        prefix_lens.contiguous(), out["accept_len"], out["commit_lens"], out["bonus"], out["out_tokens"],
        out["new_seq_lens"], out["branch_lens"], out["summary"], bs, L=width - 1, W=_pow2(width), ROWS=rows,
        BLOCKS=blocks, num_warps=4,
    )


# How the draft's per-position logsumexp (and the top-1 of an `auto` chain round) is computed (sglang/ops.py):
# "triton" (one read of the lm_head's output in its dtype: topk_logits_lse takes the logsumexp in the Triton top-K's
# first pass, row_max_lse runs the same two launches for the top-1) or "torch" (a float32 copy of the logits,
# torch.logsumexp, torch.max / the top-K). Default triton since lease 13 (H200, benchmarks/results/
# tree_kernels_h200_lease13.json): the top-K stage at B=256 in one graph replay 0.084 / 0.237 / 0.819 ms at batch
# 1 / 8 / 32 against 0.123 / 0.399 / 1.361 for log_softmax + the Triton top-K; at 8B shapes `auto` reached 0.970 /
# 0.961 / 0.964 of DFLASH at batch 1 / 4 / 16 against 0.82 / 0.89 / 0.94 with torch in the same call
# (sweep_auto_8b_lease13_draft_lse_*.jsonl). Log-probs differ from torch's in the last bits (the walk and the output
# do not depend on them; the tree's node order can, at exact near-ties of node scores).
DRAFT_LSE = os.environ.get("SGLANG_DDTREE_DRAFT_LSE", "triton")
if DRAFT_LSE not in ("torch", "triton"):
    raise ValueError(f"SGLANG_DDTREE_DRAFT_LSE must be torch or triton, got {DRAFT_LSE!r}.")


def row_max_lse(x: torch.Tensor, block: int = 4096) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of x [rows, V] (float32, bfloat16 or float16, read in its dtype; -inf-free rows): (max float32, first
    index of the max int64, logsumexp float32), in one read of x spread over (row, chunk) programs: the top-K's
    first two launches (topk_launches) with the same shapes. The max and its index equal torch.max over x.float();
    the logsumexp equals torch.logsumexp up to float32 rounding (a different summation order) and topk_logits_lse's
    bit for bit."""
    x = _readable(x)
    out_max = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    out_arg = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    out_lse = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    launches, _ = topk_launches(x, 1, None, None, block=block, lse=out_lse, row_max=(out_max, out_arg))
    for _, launch in launches[:2]:
        launch()
    return out_max, out_arg, out_lse


# Largest k topk_triton orders in one program (a register sort of k keys); the serving path needs k <= 1024.
TOPK_TRITON_MAX_K = 4096
# Entries per group whose maxima give topk_triton's threshold: the candidates are at most S(K-1) + K.
TOPK_GROUP = 32


# The float32 bits that can differ between values read in each dtype (the rest follow from the sign, see
# _key_from_prefix): the radix selections of the top-K run one 8-bit pass per 8 of them, so a bfloat16 lm_head
# output takes 2 passes instead of 4 in both of its selections.
_KEY_BITS = {torch.float32: 32, torch.float16: 24, torch.bfloat16: 16}


def _readable(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels read it: its own float dtype where Triton loads it (no float32 copy of a bf16 lm_head
    output), rows contiguous."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        x = x.float()
    return x.contiguous()


def _chunking(width: int, block: int) -> tuple[int, int, int]:
    """(entries per group S, groups per program GB, programs per row) of a row of `width` entries: programs read
    GB * S = min(block, next power of two of width) consecutive entries."""
    chunk = min(block, _pow2(width))
    group = min(TOPK_GROUP, chunk)
    return group, chunk // group, triton.cdiv(width, chunk)


def topk_triton(x: torch.Tensor, k: int, *, id_offset: int = 0, block: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Same result as tree.exact_topk(x.float(), k, id_offset=id_offset) for a [rows, V] tensor without NaN (bit
    for bit: values as float32, then ids, in the canonical order); bfloat16 / float16 rows are read as they are.

    How: the maxima of groups of TOPK_GROUP entries give t = their K-th largest, a lower bound of the K-th largest
    entry (K groups hold an entry >= t); two passes over (row, chunk of `block`) programs count and collect the
    entries above t and the first K equal to it, in index order; one program per row finds the exact top K among
    those candidates (radix selection) and sorts them. Three reads of the row, all of them cheap compares and
    maxima. Why: torch.topk took 0.20 / 0.60 ms at batch 1 / 8 for K=256 on the H200 (lease 8), and a radix
    selection over the whole row (four histogram passes, lease 12) 0.15 / 0.67 ms: histograms of every entry cost
    more than the reads. Selected by SGLANG_DDTREE_TOPK_KERNEL=triton."""
    values, ids, _ = _topk(x, k, id_offset, block, with_lse=False)
    return values, ids


def topk_logits_lse(x: torch.Tensor, k: int, *, id_offset: int = 0, block: int = 4096
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_triton of raw logits plus each row's logsumexp (float32, = row_max_lse's bit for bit), computed in the
    top-K's first pass: the draft's top-K log-probs are values - lse, without a float32 copy of the logits or a
    separate logsumexp (lease 12's profile at 8B shapes, batch 16: those took ~0.27 ms a round)."""
    return _topk(x, k, id_offset, block, with_lse=True)


def _topk(x, k, id_offset, block, with_lse):
    x = _readable(x)
    rows, width = x.shape
    if not 1 <= k <= width:
        raise ValueError(f"top-k needs 1 <= k <= {width}, got k={k}.")
    if k > TOPK_TRITON_MAX_K:
        raise ValueError(f"topk_triton orders at most {TOPK_TRITON_MAX_K} keys a row, got k={k}; use tree.exact_topk.")
    values = torch.empty((rows, k), dtype=torch.float32, device=x.device)
    ids = torch.empty((rows, k), dtype=torch.int64, device=x.device)
    lse = torch.empty(rows, dtype=torch.float32, device=x.device) if with_lse else None
    launches, _ = topk_launches(x, k, values, ids, id_offset=id_offset, block=block, lse=lse)
    for _, launch in launches:
        launch()
    return values, ids, lse


def topk_launches(x: torch.Tensor, k: int, values: torch.Tensor | None, ids: torch.Tensor | None, *,
                  id_offset: int = 0, block: int = 4096, lse: torch.Tensor | None = None,
                  row_max: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[list[tuple[str, object]], torch.Tensor]:
    """topk_triton's five launches in order, as (name, callable) over their scratch buffers (x: as _readable gives
    it; results into values / ids, the rows' logsumexp into `lse` when given, and their max and its first index into
    `row_max` when given: row_max_lse runs the first two launches only), and the per-chunk counts of keys above / at
    the threshold they fill (the candidates per row: above + min(at, k)). topk_triton runs them back to back;
    benchmarks/profile_kernels.py times each."""
    rows, width = x.shape
    device = x.device
    group, gb, chunks = _chunking(width, block)
    chunk = gb * group
    groups = triton.cdiv(width, group)
    cap = min(width, group * (k - 1) + k)
    gmax = torch.empty((rows, groups), dtype=torch.int32, device=device)
    thresh = torch.empty(rows, dtype=torch.int64, device=device)
    counts = torch.empty((rows, chunks, 2), dtype=torch.int32, device=device)
    cand = torch.empty((rows, cap), dtype=torch.int32, device=device)
    kp = _pow2(max(k, 2))
    scratch = torch.empty((rows, kp), dtype=torch.int64, device=device)
    # With the logsumexp, both launches also give each row's max and its index, for row_max_lse and topk_logits_lse
    # alike: the two then run the same code with the same shapes (only K differs).
    with_lse = lse is not None
    parts_shape = (rows, chunks) if with_lse else 1
    pm = torch.empty(parts_shape, dtype=torch.float32, device=device)
    ps = torch.empty(parts_shape, dtype=torch.float32, device=device)
    parg = torch.empty(parts_shape, dtype=torch.int32, device=device)
    lse_out = lse if with_lse else pm
    if row_max is not None:
        max_out, arg_out = row_max
    elif with_lse:
        max_out = torch.empty(rows, dtype=torch.float32, device=device)
        arg_out = torch.empty(rows, dtype=torch.int64, device=device)
    else:
        max_out, arg_out = pm, parg
    gp = _pow2(groups)
    chp = _pow2(chunks)
    grid = (rows, chunks)
    key_bits = _KEY_BITS[x.dtype]
    launches = [
        ("group_max", lambda: _group_max_kernel[grid](
            x, gmax, pm, ps, parg, x.stride(0), groups, chunks, V=width, GB=gb, S=group, LSE=with_lse, num_warps=4)),
        ("threshold", lambda: _group_threshold_kernel[(rows,)](
            gmax, thresh, pm, ps, parg, lse_out, max_out, arg_out, groups, chunks, K=k if k <= groups else 0, GP=gp,
            LSE=with_lse, PP=chp, KEY_BITS=key_bits, num_warps=_warps(gp))),
        ("count", lambda: _threshold_count_kernel[grid](
            x, thresh, counts, x.stride(0), chunks, V=width, CHUNK=chunk, num_warps=4)),
        ("collect", lambda: _threshold_collect_kernel[grid](
            x, thresh, counts, cand, x.stride(0), chunks, cap, V=width, K=k, CHUNK=chunk, CHP=chp, num_warps=4)),
        ("candidates_topk", lambda: _candidate_topk_kernel[(rows,)](
            x, counts, cand, scratch, values, ids, x.stride(0), chunks, cap, id_offset, K=k, KP=kp,
            BLOCK=min(2048, _pow2(cap)), CHP=chp, KEY_BITS=key_bits, num_warps=4 if kp <= 256 else 8)),
    ]
    return launches, counts


def move_path_kv(data_ptrs: torch.Tensor, strides: torch.Tensor, max_stride: int, tgt: torch.Tensor,
                 src: torch.Tensor, rows_per_request: int, tile: int = 512) -> None:
    """KV rows of every buffer (data_ptrs: uint64 [buffers], strides: bytes per slot [buffers], max_stride: their
    maximum, known on the host; SGLang's MHA pool layout) copied from slot src to slot tgt, rows grouped by request
    (ops.accepted_kv_moves' order, bs * L rows). Same result as SGLang's move_kv_cache for these moves (a
    simultaneous copy; ops.accepted_kv_moves shows in-order copying gives the same), but rows with src == tgt move
    nothing: after a round most accepted nodes are already in place, and lease 11's profile (8B shapes, batch 16)
    spent 0.94 ms a round in SGLang's all-rows copy (one program per buffer holding up to 128 rows x 512 bytes)."""
    total = tgt.numel()
    if total == 0:
        return
    if total % rows_per_request:
        raise ValueError(f"{total} moves are not whole requests of {rows_per_request} rows.")
    _path_kv_move_kernel[(data_ptrs.numel(), total // rows_per_request, triton.cdiv(max_stride, tile))](
        data_ptrs, strides, tgt.contiguous(), src.contiguous(), ROWS=rows_per_request, RP=_pow2(rows_per_request),
        TILE=tile, num_warps=4)
