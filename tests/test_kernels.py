"""Triton kernels == the torch reference implementations, bit for bit (CPU via TRITON_INTERPRET=1).

The interpreter must be switched on before triton is imported, so the comparisons run in a subprocess.
On the GPU machine tests/gpu/test_kernels_cuda.py runs the same comparisons compiled.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

def run_in_interpreter(code: str, marker: str, timeout: int) -> None:
    """Run `code` in a fresh Python with TRITON_INTERPRET=1 (set before triton is imported) and expect `marker`."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert marker in result.stdout, result.stdout[-3000:] + result.stderr[-6000:]


CHECK = textwrap.dedent(
    """
    import torch
    from sglang_ddtree import kernels
    from sglang_ddtree.layout import ancestor_mask
    from sglang_ddtree.sglang.ops import tree_verify_mask, verify_mask_numel
    from sglang_ddtree.tree import build_tree_from_topk, topk_draft
    from sglang_ddtree.walk import walk_choices
    from sglang_ddtree.layout import retrieve_arrays

    FIELDS = ("tokens", "parents", "depth", "scores", "ranks", "valid")
    gen = torch.Generator().manual_seed(0)
    cases = [(1, 3, 5, 1, None), (2, 4, 6, 7, None), (3, 5, 40, 16, None), (2, 6, 9, 33, 0.01), (2, 15, 70, 64, None),
             (1, 1, 10, 4, None)]
    for bs, depth, vocab, budget, prune in cases:
        for ties in (False, True):
            lp = (torch.randn(bs, depth, vocab, generator=gen) * 2).log_softmax(-1)
            if ties:
                lp = (lp * 2).round() / 2
            values, tokens = topk_draft(lp, min(budget, vocab))
            roots = torch.randint(0, vocab, (bs,), generator=gen)
            budgets = torch.randint(1, budget + 1, (bs,), generator=gen)
            ref = build_tree_from_topk(values, tokens, budgets, roots, prune=prune, max_budget=budget)
            for kernel in ("sort", "select"):
                got = kernels.build_tree_triton(values, tokens, budgets, roots, prune=prune, max_budget=budget,
                                                kernel=kernel)
                for f in FIELDS:
                    assert torch.equal(getattr(ref, f), getattr(got, f)), (bs, depth, vocab, budget, ties, kernel,
                                                                           f, getattr(ref, f), getattr(got, f))
            seq_lens = torch.randint(0, 20, (bs,), generator=gen)
            numel = verify_mask_numel(ref.max_nodes, int(seq_lens.sum()) + 16 * bs, bs)
            assert torch.equal(tree_verify_mask(ancestor_mask(ref), seq_lens, numel),
                               kernels.tree_verify_mask_triton(ref, seq_lens, numel))
            # walk: random choices, and choices that follow the best-ranked children (deep paths)
            first = retrieve_arrays(ref)[1]
            deep = torch.where(first >= 0, ref.tokens.gather(1, first.clamp(min=0)), 0)
            for choice in (torch.randint(0, vocab, ref.tokens.shape, generator=gen), deep):
                a, b = walk_choices(ref, choice), kernels.walk_triton(ref, choice)
                for f in ("path", "accept_len", "bonus", "out_tokens"):
                    assert torch.equal(getattr(a, f), getattr(b, f)), (f, getattr(a, f), getattr(b, f))
    print("KERNELS-OK")
    """
)


def test_triton_kernels_match_torch_reference():
    run_in_interpreter(CHECK, "KERNELS-OK", timeout=900)


EARLY_EXIT_CHECK = textwrap.dedent(
    """
    import torch
    from sglang_ddtree import kernels
    from sglang_ddtree.tree import build_tree_from_topk, topk_draft

    FIELDS = ("tokens", "parents", "depth", "scores", "ranks", "valid")
    gen = torch.Generator().manual_seed(1)
    depths = set()
    # the one-program kernels stop selecting once no deeper node can enter the top W: trees from shallow (flat
    # drafts) to deep (peaked), ties, pruning, and a draft whose bound equals the threshold exactly
    for bs, depth, vocab, budget, scale, prune in [(2, 15, 300, 64, 1.0, None), (2, 15, 300, 64, 3.0, None),
                                                   (2, 15, 300, 64, 8.0, None), (2, 15, 200, 33, 5.0, 0.001)]:
        for ties in (False, True):
            lp = (torch.randn(bs, depth, vocab, generator=gen) * scale).log_softmax(-1)
            if ties:
                lp = (lp * 2).round() / 2
            values, tokens = topk_draft(lp, min(budget, vocab))
            roots = torch.randint(0, vocab, (bs,), generator=gen)
            ref = build_tree_from_topk(values, tokens, budget, roots, prune=prune, max_budget=budget)
            depths.add(int(ref.depth.max()))
            for kernel in ("sort", "select"):
                got = kernels.build_tree_triton(values, tokens, budget, roots, prune=prune, max_budget=budget,
                                                kernel=kernel)
                for f in FIELDS:
                    assert torch.equal(getattr(ref, f), getattr(got, f)), (depth, scale, ties, kernel, f)
    assert min(depths) <= 4 and max(depths) >= 10, depths  # both shallow and deep trees were built
    # depth 1: four ties at -1 (lb = -1); depth 2: a certain token (log-prob 0), so the bound is -1 = lb: a depth-2
    # node scoring -1 comes after the four depth-1 nodes, and the tree of 4 is depth 1 only
    values = torch.tensor([[[-1.0, -1.0, -1.0, -1.0], [0.0, -30.0, -30.0, -30.0], [0.0, -30.0, -30.0, -30.0]]])
    tokens = torch.arange(12).view(1, 3, 4)
    ref = build_tree_from_topk(values, tokens, 4, torch.tensor([0]), max_budget=4)
    assert ref.depth.tolist() == [[0, 1, 1, 1, 1]]
    for kernel in ("sort", "select"):
        got = kernels.build_tree_triton(values, tokens, 4, torch.tensor([0]), max_budget=4, kernel=kernel)
        for f in FIELDS:
            assert torch.equal(getattr(ref, f), getattr(got, f)), ("boundary", kernel, f)
    # the same with budget 5: the depth-2 node is the fifth
    ref = build_tree_from_topk(values, tokens, 5, torch.tensor([0]), max_budget=5)
    assert sorted(ref.depth[0].tolist()) == [0, 1, 1, 1, 1, 2]
    for kernel in ("sort", "select"):
        got = kernels.build_tree_triton(values, tokens, 5, torch.tensor([0]), max_budget=5, kernel=kernel)
        for f in FIELDS:
            assert torch.equal(getattr(ref, f), getattr(got, f)), ("boundary5", kernel, f)
    # the two-list bound at its boundary (W = 4): depth 1 [-1, -1.25, -9, -9], depths 2 and 3 [-0.125, -9, -9.5, -10].
    # Depth 2 keeps 2 candidates above depth 1's 4th best (-9): the radix passes are skipped. The best 2 of depth 1
    # with the best 2 of depth 2 give the bound -1.375, below the depth-3 node -1.25 that is the tree's 4th node
    # (after the depth-1 node of the same score). A bound from 3 nodes (-1.25) would drop it.
    per_depth = torch.tensor([[-1.0, -1.25, -9.0, -9.0], [-0.125, -9.0, -9.5, -10.0], [-0.125, -9.0, -9.5, -10.0]])
    values, tokens = per_depth.view(1, 3, 4), torch.arange(12).view(1, 3, 4)
    ref = build_tree_from_topk(values, tokens, 4, torch.tensor([0]), max_budget=4)
    assert ref.scores.tolist() == [[0.0, -1.0, -1.125, -1.25, -1.25]] and ref.depth.tolist() == [[0, 1, 2, 1, 3]]
    for kernel in ("sort", "select"):
        got = kernels.build_tree_triton(values, tokens, 4, torch.tensor([0]), max_budget=4, kernel=kernel)
        for f in FIELDS:
            assert torch.equal(getattr(ref, f), getattr(got, f)), ("two-list bound", kernel, f)
    print("EARLY-EXIT-OK")
    """
)


def test_tree_kernels_stop_at_the_last_depth_that_can_matter():
    """... and drop the candidates that cannot enter the tree (a bound that W shallower nodes reach), skipping the
    radix passes where no more than W are left; the same trees as the torch reference."""
    run_in_interpreter(EARLY_EXIT_CHECK, "EARLY-EXIT-OK", timeout=900)


TOPK_CHECK = textwrap.dedent(
    """
    import torch
    from sglang_ddtree import kernels
    from sglang_ddtree.tree import exact_topk

    gen = torch.Generator().manual_seed(0)
    # k = 1, k = V, ties (values rounded to halves), -inf entries, widths below / above one block; k above the
    # number of 32-entry groups (every entry a candidate) and below it (the group-maximum threshold), incl. rows
    # where most entries tie at that threshold (constant, mostly -inf)
    for rows, vocab, k, ties in [(2, 50, 1, False), (3, 300, 16, False), (2, 300, 16, True), (2, 1000, 64, True),
                                 (1, 5000, 256, False), (2, 700, 700, True), (1, 4097, 100, False),
                                 (2, 20000, 64, True), (2, 20000, 300, False), (3, 9000, 40, "flat")]:
        x = torch.randn(rows, vocab, generator=gen) * 3
        if ties:
            x = (x * 2).round() / 2
        if ties == "flat":
            x[1] = 0.25
            x[2] = float("-inf")
            x[2, 7000:7003] = 1.0
        x[0, :5] = float("-inf")
        ref_values, ref_ids = exact_topk(x, k, id_offset=7)
        values, ids = kernels.topk_triton(x, k, id_offset=7, block=1024)
        assert torch.equal(ref_ids, ids), (rows, vocab, k, ties, ref_ids, ids)
        assert torch.equal(ref_values, values), (rows, vocab, k, ties)
        # read in bf16 as it is (the lm_head's output): the same as the top-K of its float32 copy
        xb = x.to(torch.bfloat16)
        ref_values, ref_ids = exact_topk(xb.float(), k, id_offset=7)
        values, ids = kernels.topk_triton(xb, k, id_offset=7, block=1024)
        assert torch.equal(ref_ids, ids) and torch.equal(ref_values, values), (rows, vocab, k, ties, "bf16")
        # float16: 3 of the 4 radix passes (its float32 bits below the top 24 are zero)
        xh = x.to(torch.float16)
        ref_values, ref_ids = exact_topk(xh.float(), k, id_offset=7)
        values, ids = kernels.topk_triton(xh, k, id_offset=7, block=1024)
        assert torch.equal(ref_ids, ids) and torch.equal(ref_values, values), (rows, vocab, k, ties, "fp16")
    try:
        kernels.topk_triton(torch.zeros(1, 5), 6)
    except ValueError as e:
        assert "1 <= k <= 5" in str(e)
    else:
        raise AssertionError("k > V accepted")
    print("TOPK-OK")
    """
)


def test_topk_kernel_matches_exact_topk():
    """kernels.topk_triton (radix selection) == tree.exact_topk: same ids and values in the same order."""
    run_in_interpreter(TOPK_CHECK, "TOPK-OK", timeout=900)


RADIX_CHECK = textwrap.dedent(
    """
    import torch, triton
    import triton.language as tl
    from sglang_ddtree.kernels.common import _radix_select

    @triton.jit
    def select(key_ptr, sel_ptr, res_ptr, count, N: tl.constexpr, KEY_BITS: tl.constexpr, EARLY: tl.constexpr):
        i = tl.arange(0, N)
        ukey = tl.load(key_ptr + i)
        live = ukey >= 0  # dead entries: -1
        thresh, k_left = _radix_select(ukey, live, count, KEY_BITS, EARLY)
        # the selection the callers make: every key above thresh, then the first k_left at it
        gt = live & (ukey > thresh)
        eq = live & (ukey == thresh)
        tl.store(sel_ptr + i, (gt | (eq & (tl.cumsum(eq.to(tl.int32), 0) <= k_left))).to(tl.int8))
        tl.store(res_ptr, thresh)
        tl.store(res_ptr + 1, k_left.to(tl.int64))

    def ukeys(x):  # unsigned order-preserving keys of float32 values, as the kernels build them
        bits = x.float().view(torch.int32)
        return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(torch.int64) + 2**31

    gen = torch.Generator().manual_seed(3)
    n = 256
    stops = {"early": 0, "full": 0}
    for trial in range(48):
        x = torch.randn(n, generator=gen) * (4 if trial % 2 else 0.01)
        if trial % 4 == 3:
            x = (x * 2).round() / 2  # many ties
        if trial % 8 == 5:
            x[: n // 2] = x[0]  # one big tie
        dead = torch.randperm(n, generator=gen)[: trial % 5 * 10]
        for bits, early, dtype in ((32, True, torch.float32), (32, False, torch.float32), (16, False, torch.bfloat16),
                                   (24, False, torch.float16), (16, True, torch.bfloat16)):
            key = ukeys(x.to(dtype))
            key[dead] = -1
            live_ids = [j for j in sorted(range(n), key=lambda j: (-int(key[j]), j)) if key[j] >= 0]
            count = int(torch.randint(1, len(live_ids) + 1, (1,), generator=gen))
            want = torch.zeros(n, dtype=torch.int8)
            want[live_ids[:count]] = 1  # the count largest live keys, ties lowest position first
            sel = torch.zeros(n, dtype=torch.int8)
            res = torch.zeros(2, dtype=torch.int64)
            select[(1,)](key, sel, res, count, N=n, KEY_BITS=bits, EARLY=early)
            assert torch.equal(sel, want), (trial, bits, early, count)
            kth = int(key[live_ids[count - 1]])
            thresh, k_left = res.tolist()
            if thresh == kth:  # all passes ran: the count-th largest key, k_left of the ties at it
                assert k_left == sum(int(key[j]) == kth for j in live_ids[:count]), (trial, bits, early)
                stops["full"] += early
            else:  # stopped early: one below the smallest key of a wholly selected bin, nothing taken at it
                assert early and k_left == 0 and thresh + 1 == min(int(key[j]) for j in live_ids[:count])
                stops["early"] += 1
    assert stops["early"] > 0 and stops["full"] > 0, stops  # both ends of the early stop ran
    print("RADIX-OK", stops)
    """
)


def test_radix_select_stops_early_and_reads_bf16_keys_in_two_passes():
    """kernels.common._radix_select == sorting: float32 keys with and without the early stop (a wholly selected bin ends
    the passes; both outcomes occur here), bfloat16 / float16 keys in 2 / 3 passes (their low bits follow from the
    sign), with ties, one big tie and dead entries."""
    run_in_interpreter(RADIX_CHECK, "RADIX-OK", timeout=600)


KV_MOVE_CHECK = textwrap.dedent(
    """
    import torch
    from sglang_ddtree import kernels
    from sglang_ddtree.sglang.ops import accepted_kv_moves
    from sglang_ddtree.tree import build_tree
    from sglang_ddtree.walk import walk_choices
    from sglang_ddtree.layout import retrieve_arrays

    gen = torch.Generator().manual_seed(0)
    # real accepted paths: trees of budget 24 over 4 requests, the target following first children / siblings
    bs, budget, vocab, depth = 4, 24, 40, 15
    lp = (torch.randn(bs, depth, vocab, generator=gen) * 2).log_softmax(-1)
    tree = build_tree(lp, budget, torch.randint(0, vocab, (bs,), generator=gen))
    _, first, sibling = retrieve_arrays(tree)
    child = torch.where(sibling.gather(1, first.clamp(min=0)) >= 0, sibling.gather(1, first.clamp(min=0)), first)
    choice = torch.where(child >= 0, tree.tokens.gather(1, child.clamp(min=0)), 0)
    walk = walk_choices(tree, choice)
    assert int(walk.accept_len.max()) >= 2 and bool((walk.path[:, 1:] > torch.arange(1, depth + 1)).any())
    slots = torch.randperm(400, generator=gen)[: bs * (budget + 1)].view(bs, budget + 1) + 7
    tgt, src = accepted_kv_moves(walk.path, slots)
    # buffers as SGLang's MHA pool holds them: one per layer and K/V, [slots, heads, dim], any dtype
    bufs = [torch.randn(420, 2, 8, generator=gen) for _ in range(3)] + [torch.randn(420, 4, 4).to(torch.bfloat16)]
    ref = [b.clone() for b in bufs]
    for r in ref:  # in-order copying, the semantics accepted_kv_moves is built for
        for t, s in zip(tgt.tolist(), src.tolist()):
            r[t] = r[s].clone()
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b[0].numel() * b.element_size() for b in bufs], dtype=torch.int64)
    kernels.move_path_kv(ptrs, strides, int(strides.max()), tgt, src, depth, tile=32)
    for i, (a, b) in enumerate(zip(bufs, ref)):
        assert torch.equal(a, b), i
    assert bool((tgt != src).any())  # something really moved
    try:
        kernels.move_path_kv(ptrs, strides, int(strides.max()), tgt[:-1], src[:-1], depth)
    except ValueError as e:
        assert "whole requests" in str(e)
    else:
        raise AssertionError("a partial request was accepted")
    print("KVMOVE-OK")
    """
)


def test_path_kv_move_kernel_equals_in_order_copies():
    """kernels.move_path_kv (moved rows only, one program per buffer x request x tile) == copying the accepted
    path's rows in order, on real accepted paths with branches."""
    run_in_interpreter(KV_MOVE_CHECK, "KVMOVE-OK", timeout=600)


LSE_CHECK = textwrap.dedent(
    """
    import torch
    from sglang_ddtree import kernels
    from sglang_ddtree.sglang import ops
    from sglang_ddtree.tree import exact_topk

    gen = torch.Generator().manual_seed(0)
    for rows, vocab, dtype in [(3, 300, torch.float32), (2, 5000, torch.bfloat16), (1, 4097, torch.float32)]:
        x = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
        x[0, 7] = x[0, 4000 % vocab] = x[0].max() + 1  # a tie at the max: the first index wins
        if rows > 1:  # chunks of -inf only
            x[1] = float("-inf")
            x[1, vocab - 3:] = 2.0
        m, arg, lse = kernels.row_max_lse(x, block=1024)
        ref_m, ref_arg = x.float().max(dim=-1)
        assert torch.equal(m, ref_m) and torch.equal(arg, ref_arg), (m, ref_m, arg, ref_arg)
        assert torch.allclose(lse, torch.logsumexp(x.float(), -1), rtol=1e-6, atol=1e-5)
        # the top-K's own logsumexp (its first pass) is row_max_lse's bit for bit, and its top-K exact
        values, ids, lse_topk = kernels.topk_logits_lse(x, 20, id_offset=3, block=1024)
        ref_values, ref_ids = exact_topk(x.float(), 20, id_offset=3)
        assert torch.equal(lse_topk, lse) and torch.equal(ids, ref_ids) and torch.equal(values, ref_values)
    # the top-K stage takes topk_logits_lse and the top-1 stage row_max_lse: the top-1 stage is still the top-K
    # stage's first column, bit for bit
    torch.manual_seed(1)
    bs, block, hidden_size, vocab = 3, 16, 24, 300
    weight = torch.randn(vocab, hidden_size)
    weight[5] *= 4.0
    weight[17] = weight[5]
    hidden = torch.randn(bs * block, hidden_size)
    values, tokens = ops.draft_topk_stage(block, 32, 1000, weight, hidden)
    v1, t1 = ops.draft_top1_stage(block, 1000, weight, hidden)
    assert torch.equal(t1, tokens[:, :, :1]) and torch.equal(v1, values[:, :, :1])
    assert (t1 == 1005).sum() > 0 and (t1 == 1017).sum() == 0
    print("LSE-OK")
    """
)


def test_fused_logsumexp_keeps_the_top1_equal_to_the_top_k_first_column():
    """kernels.row_max_lse: max and its first index exact, logsumexp within float32
    rounding of torch's (also with chunks of -inf only) and equal bit for bit to the one topk_logits_lse takes in its
    first pass; with it on, ops.draft_top1_stage still equals draft_topk_stage's first column bit for bit."""
    run_in_interpreter(LSE_CHECK, "LSE-OK", timeout=600)


PROFILE_CHECK = textwrap.dedent(
    """
    import json, subprocess, sys, tempfile, os
    out = os.path.join(tempfile.mkdtemp(), "p.json")
    subprocess.run([sys.executable, "benchmarks/profile_kernels.py", "--budgets", "16", "--repeats",
                    "1", "--vocab", "2000", "--out", out], check=True)
    row = json.load(open(out))["rows"][0]
    assert set(row["topk"]) >= {"group_max", "threshold", "count", "collect", "candidates_topk", "triton_topk_total"}
    assert row["topk"]["candidates_per_row_max"] >= 16
    assert {"tree_sort_ms", "tree_select_ms"} <= set(row)
    print("PROFILE-OK")
    """
)


def test_profile_kernels_script_runs_and_checks_its_kernels():
    """benchmarks/profile_kernels.py on a small vocabulary in the interpreter: it runs every piece of the Triton top-K
    one launch at a time (checking the result against topk_triton) and each tree kernel (checked against the torch
    tree) and writes its rows."""
    run_in_interpreter(PROFILE_CHECK, "PROFILE-OK", timeout=600)


BENCH_CHECK = textwrap.dedent(
    """
    import json, subprocess, sys, tempfile, os
    out = os.path.join(tempfile.mkdtemp(), "b.json")
    subprocess.run([sys.executable, "benchmarks/bench_tree.py", "--device", "cpu", "--impls",
                    "torch,triton_select_topk,triton_fused", "--budgets", "16", "--batch-sizes", "2", "--vocab",
                    "1500", "--depth", "3", "--repeats", "1", "--out", out], check=True)
    row = json.load(open(out))["rows"][0]
    assert {"triton_fused_eager_topk_ms", "triton_select_topk_eager_all_ms"} <= set(row)
    print("BENCH-OK")
    """
)


def test_bench_tree_checks_every_impl_against_the_torch_reference():
    """benchmarks/bench_tree.py in the interpreter: each Triton impl, incl. triton_fused (top-K and logsumexp from
    the bf16 logits), passes its check against the torch reference before it is timed (a failed check exits
    non-zero)."""
    run_in_interpreter(BENCH_CHECK, "BENCH-OK", timeout=600)


CHAIN_CHECK = textwrap.dedent(
    """
    import torch
    from sglang_ddtree.metric_names import SummaryLayout
    from sglang_ddtree.sglang import ops

    gen = torch.Generator().manual_seed(3)
    L, vocab = 15, 6  # a small vocabulary: random choices often match, so every accept length occurs
    for bs in (1, 3, 16, 17, 70):
        for dtype in (torch.int64, torch.int32):
            cand = torch.randint(0, vocab, (bs, L + 1), generator=gen)
            choices = torch.randint(0, vocab, (bs, L + 1), generator=gen)
            # some requests accept everything, some follow the drafts for a random number of steps
            follow = torch.randint(0, L + 1, (bs,), generator=gen)
            follow[: max(1, bs // 4)] = L
            take = torch.arange(L + 1).unsqueeze(0) < follow.unsqueeze(1)
            choices = torch.where(take, torch.cat([cand[:, 1:], cand[:, :1]], dim=1), choices)
            logprobs = -torch.rand(bs, L, generator=gen) * 3
            prefix = torch.randint(0, 500, (bs,), generator=gen).to(dtype)
            ref = ops.chain_accept_reference(cand, choices, logprobs, prefix)
            out = ops.chain_outputs(bs, L, dtype, "cpu")
            ops.chain_accept(True, cand, choices, logprobs, prefix, out)
            for name, want in zip(ops.CHAIN_OUTPUTS, ref):
                got = out[name]
                assert got.dtype == want.dtype, (name, got.dtype, want.dtype)
                if name == "summary":  # the expected tokens up to float32 summation order, the rest exact
                    exact = torch.arange(len(want)) != SummaryLayout(L).index("expected")
                    assert torch.equal(got[exact], want[exact]), (got, want)
                    assert torch.allclose(got[~exact], want[~exact], rtol=1e-5), (got, want)
                else:
                    assert torch.equal(got, want), (bs, name, got, want)
            if bs >= 16:  # the cases cover full and partial acceptance
                assert ref[0].max() == L and ref[0].min() < L, ref[0]
    print("CHAIN-OK")
    """
)


def test_chain_accept_kernel_matches_the_chain_trees_walk():
    """`auto`'s lean chain round (ops.chain_accept): one kernel == the chain tree's walk, commit arithmetic and
    stats summary (walk_commit_plan on tree.chain_tree_from_topk), for batches below, at and above a row block."""
    run_in_interpreter(CHAIN_CHECK, "CHAIN-OK", timeout=600)


def test_chain_accept_batch_sizes_cover_every_compiled_variant_once():
    """kernels.chain_accept_batch_sizes: one batch size per variant of chain_accept_triton that a range of batch
    sizes compiles (its ROWS / BLOCKS constexprs, Triton's bs == 1 and bs % 16 == 0 specializations), so that
    `auto`'s bucket capture compiles them all (AutoRounds._warm_chain_accept)."""
    from sglang_ddtree import kernels

    def variant(bs):
        rows = 16 if bs <= 16 else 64
        return rows, -(-bs // rows), bs == 1, bs % 16 == 0

    assert kernels.chain_accept_batch_sizes(1, 64) == [1, 2, 16, 17, 32]
    assert kernels.chain_accept_batch_sizes(2, 4) == [2]
    assert kernels.chain_accept_batch_sizes(65, 128) == [65, 80]
    for low, high in ((1, 1), (1, 16), (5, 16), (17, 64), (33, 256)):
        sizes = kernels.chain_accept_batch_sizes(low, high)
        assert all(low <= bs <= high for bs in sizes)
        assert len({variant(bs) for bs in sizes}) == len(sizes)  # one each
        assert {variant(bs) for bs in range(low, high + 1)} == {variant(bs) for bs in sizes}  # all of them
