"""The core on CUDA: same results as on CPU, and capturable in a CUDA graph (no host sync)."""

import pytest
import torch

from sglang_ddtree.layout import ancestor_mask, retrieve_arrays, tree_positions
from sglang_ddtree.tree import build_tree
from sglang_ddtree.walk import greedy_walk, walk_choices

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

FIELDS = ("tokens", "parents", "depth", "scores", "ranks", "valid")


def inputs(bs, depth, vocab, seed, ties=False):
    gen = torch.Generator().manual_seed(seed)
    lp = (torch.randn(bs, depth, vocab, generator=gen) * 3).log_softmax(-1)
    if ties:
        lp = (lp * 2).round() / 2
    return lp, torch.randint(0, vocab, (bs,), generator=gen)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("budget", [1, 16, 256, 1024])
def test_cuda_equals_cpu(budget, ties):
    lp, roots = inputs(4, 15, 5000, seed=budget, ties=ties)
    cpu = build_tree(lp, budget, roots)
    gpu = build_tree(lp.cuda(), budget, roots.cuda())
    for f in FIELDS:
        assert torch.equal(getattr(cpu, f), getattr(gpu, f).cpu()), f
    assert torch.equal(ancestor_mask(cpu), ancestor_mask(gpu).cpu())
    for a, b in zip(retrieve_arrays(cpu), retrieve_arrays(gpu)):
        assert torch.equal(a, b.cpu())
    # make the target follow the tree's first children so the walk goes deep
    first = retrieve_arrays(cpu)[1]
    choice = torch.where(first >= 0, cpu.tokens.gather(1, first.clamp(min=0)), 0)
    w_cpu, w_gpu = walk_choices(cpu, choice), walk_choices(gpu, choice.cuda())
    assert torch.equal(w_cpu.out_tokens, w_gpu.out_tokens.cpu())
    assert torch.equal(w_cpu.path, w_gpu.path.cpu())


@pytest.mark.parametrize("budget", [16, 1024])
def test_stages_replay_in_a_cuda_graph(budget):
    bs, depth, vocab = 3, 15, 32000
    lp, roots = inputs(bs, depth, vocab, seed=7)
    static_lp = lp.cuda().to(torch.bfloat16)
    static_roots = roots.cuda()
    static_start = torch.tensor([5, 100, 7], device="cuda")
    static_logits = torch.randn(bs, budget + 1, 128, device="cuda")

    def run():
        tree = build_tree(static_lp.float().log_softmax(-1), budget, static_roots, check_values=False)
        walk = greedy_walk(tree, static_logits, check_values=False)
        return tree, ancestor_mask(tree), tree_positions(tree, static_start), walk

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_tree, g_mask, g_pos, g_walk = run()

    for seed in (11, 12):  # new inputs copied into the static buffers, then replay
        lp2, roots2 = inputs(bs, depth, vocab, seed=seed)
        static_lp.copy_(lp2.to(torch.bfloat16))
        static_roots.copy_(roots2)
        static_logits.normal_()
        graph.replay()
        torch.cuda.synchronize()
        e_tree, e_mask, e_pos, e_walk = run()
        for f in FIELDS:
            assert torch.equal(getattr(g_tree, f), getattr(e_tree, f)), f
        assert torch.equal(g_mask, e_mask) and torch.equal(g_pos, e_pos)
        assert torch.equal(g_walk.out_tokens, e_walk.out_tokens)


@pytest.mark.parametrize("rows,vocab,k", [(6, 151936, 16), (6, 151936, 1024), (6, 4096, 1024), (6, 300, 64),
                                          (256, 151936, 64)])
def test_exact_topk_cuda_fast_path_equals_cpu_keys(rows, vocab, k):
    """The CUDA path trusts torch.topk to take the lowest indices among values tied with the k-th; the CPU path
    selects on unique keys. Heavily tied inputs (a bf16-like grid) must give identical results."""
    from sglang_ddtree.tree import exact_topk

    gen = torch.Generator().manual_seed(vocab + k)
    x = ((torch.randn(rows, vocab, generator=gen) * 2).to(torch.bfloat16).float() * 4).round() / 4
    cpu_v, cpu_i = exact_topk(x, k)
    gpu_v, gpu_i = exact_topk(x.cuda(), k)
    assert torch.equal(cpu_i, gpu_i.cpu()) and torch.equal(cpu_v, gpu_v.cpu())


def test_round_summary_vector_has_no_host_sync():
    """The per-round metrics vector runs every round with --enable-metrics: it must not make the host wait for
    the GPU (torch.bincount did: it reads the max back)."""
    pytest.importorskip("prometheus_client")
    from sglang_ddtree.sglang.stats import round_summary_vector
    from sglang_ddtree.tree import build_tree_from_topk, topk_draft

    gen = torch.Generator().manual_seed(3)
    values, tokens = topk_draft((torch.randn(4, 15, 512, generator=gen) * 3).log_softmax(-1).cuda(), 64)
    tree = build_tree_from_topk(values, tokens, 64, torch.zeros(4, dtype=torch.long, device="cuda"), max_budget=64)
    walk = walk_choices(tree, tree.tokens)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        vec = round_summary_vector(tree, walk)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cpu_tree = build_tree_from_topk(values.cpu(), tokens.cpu(), 64, torch.zeros(4, dtype=torch.long), max_budget=64)
    assert torch.allclose(vec.cpu(), round_summary_vector(cpu_tree, walk_choices(cpu_tree, cpu_tree.tokens)))


@pytest.mark.parametrize("budget", [32, 256])
def test_graphed_round_stages_equal_eager(budget):
    """The worker's three graphed stages (draft top-K, tree, walk + commit plan) give, replay after replay, for
    batch sizes met in any order, exactly what the eager functions give; the tree stage borrows the top-K stage's
    outputs (no copy) the way the worker chains them."""
    from functools import partial

    from sglang_ddtree.graphs import GraphedStage
    from sglang_ddtree.sglang import ops

    torch.manual_seed(budget)
    block, hidden_size, vocab = 16, 64, 5000
    weight = torch.randn(vocab, hidden_size, device="cuda", dtype=torch.bfloat16)
    k = min(budget, vocab)
    topk_fn = partial(ops.draft_topk_stage, block, k, 0, weight)
    tree_fn = partial(ops.tree_stage, budget, None, True)
    walk_fn = partial(ops.walk_commit_plan, block, True, True)
    stages = [GraphedStage(topk_fn, name="topk"), GraphedStage(tree_fn, name="tree", borrow=(0, 1)),
              GraphedStage(walk_fn, name="walk", borrow=tuple(range(6)))]

    def run(fns, bs, seed):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        hidden = torch.randn(bs * block, hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen) * 4
        roots = torch.randint(0, vocab, (bs,), device="cuda", generator=gen)
        prefix = torch.randint(5, 500, (bs,), device="cuda", generator=gen)
        values, tokens = fns[0](hidden)
        tree, ids, pos = fns[1](values, tokens, roots, prefix)
        # the target follows the first child at even depths, a random token elsewhere: deep and shallow walks
        choice = torch.where(torch.rand(tree.tokens.shape, device="cuda", generator=gen) < 0.7,
                             torch.roll(tree.tokens, -1, dims=1), tree.tokens)
        slots = torch.randperm(bs * (budget + 1), device="cuda", generator=gen).view(bs, budget + 1)
        plan = fns[2](tree.tokens, tree.parents, tree.depth, tree.scores, tree.ranks, tree.valid, choice, slots,
                      prefix)
        flat = [values, tokens, *(getattr(tree, f) for f in FIELDS), ids, pos, plan.walk.path, plan.walk.bonus,
                plan.walk.out_tokens, plan.commit_lens, plan.new_seq_lens, plan.kv_dest, plan.kv_src,
                plan.draft_cache_loc, plan.draft_positions, plan.out_tokens, plan.summary]
        return [x.clone() for x in flat]

    for bs, seed in ((1, 1), (4, 2), (1, 3), (4, 4), (1, 5)):
        graphed = run(stages, bs, seed)
        eager = run((topk_fn, tree_fn, walk_fn), bs, seed)
        for i, (g, e) in enumerate(zip(graphed, eager)):
            assert torch.equal(g, e), f"output {i} differs at bs={bs} seed={seed}"
    assert [s.captures for s in stages] == [2, 2, 2] and all(s.replays == 5 for s in stages)


@pytest.mark.parametrize("padded", [False, True])
def test_graphed_auto_stages_equal_eager(padded):
    """`auto`: per candidate, the graphed tree stage (tree at the largest budget, the chosen tree, every candidate's
    expected tokens) and walk stage (with the observed tokens) equal the eager functions, candidates met in any
    order, batch sizes 1, 3 and 4. padded: the stages run at batch 4 for 1..4 requests (as the worker runs them:
    the walk borrows the tree stage's padded buffers, the batch sums leave the padding out). Sampled walks score
    the calibration table (one table for the graphed stages, a twin for the eager calls, each learning
    after its round as the worker does): their errors and deltas agree, and so do the tables at the
    end (the graphs' warm-up and capture calls taught nothing)."""
    from functools import partial

    from sglang_ddtree.adaptive import CHAIN, ScoreCalibrator
    from sglang_ddtree.graphs import GraphedStage
    from sglang_ddtree.sglang import ops
    from sglang_ddtree.tree import topk_draft

    candidates = (CHAIN, 16, 32, 64)
    block, vocab = 16, 3000
    tables = {}
    for kind in ("graphed", "eager"):
        tables[kind] = ScoreCalibrator(depth_limit=block - 1, device="cuda")
        tables[kind].obs.uniform_(0, 5, generator=torch.Generator(device="cuda").manual_seed(1))
        tables[kind].pred.uniform_(0, 5, generator=torch.Generator(device="cuda").manual_seed(2))

    def fns(kind):
        cal = tables[kind]
        tree = {(c, sampled): partial(ops.auto_tree_stage, 64, c, candidates, None, True, sampled)
                for c in candidates for sampled in (True, False)}
        walk = {(c, sampled): partial(ops.walk_commit_plan, block, True, False, auto=(candidates, c),
                                      top1_chain=c == CHAIN, calibrator=cal if sampled else None)
                for c in candidates for sampled in (True, False)}
        return tree, walk

    tree_fns, walk_fns = fns("eager")
    graph_tree_fns, graph_walk_fns = fns("graphed")
    pad = dict(bucket_of=lambda b: 4 if b <= 4 else b, rows_arg=True) if padded else {}
    tree_stages = {k: GraphedStage(f, name=f"tree {k}", borrow=(0, 1), unpad=ops.unpad_tree_stage, **pad)
                   for k, f in graph_tree_fns.items()}
    walk_stages = {k: GraphedStage(f, name=f"walk {k}", borrow=tuple(range(6)), unpad=ops.unpad_commit_plan, **pad)
                   for k, f in graph_walk_fns.items()}

    def run(tree_fn, walk_fn, bs, seed, table=None, **rows):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        lp = (torch.randn(bs, block - 1, vocab, device="cuda", generator=gen) * 3).log_softmax(-1)
        values, tokens = topk_draft(lp, 64)
        roots = torch.randint(0, vocab, (bs,), device="cuda", generator=gen)
        prefix = torch.randint(5, 500, (bs,), device="cuda", generator=gen)
        tree, ids, pos, expected = tree_fn(values, tokens, roots, prefix, **rows)
        choice = torch.where(torch.rand(tree.tokens.shape, device="cuda", generator=gen) < 0.7,
                             torch.roll(tree.tokens, -1, dims=1), tree.tokens)
        width = tree.tokens.shape[1]
        slots = torch.randperm(bs * width, device="cuda", generator=gen).view(bs, width)
        plan = walk_fn(tree.tokens, tree.parents, tree.depth, tree.scores, tree.ranks, tree.valid, choice, slots,
                       prefix, **rows)
        flat = [*(getattr(tree, f) for f in FIELDS), ids, pos, expected, plan.walk.path, plan.commit_lens,
                plan.kv_dest, plan.kv_src, plan.out_tokens, plan.observed]
        scored = [] if plan.calibration is None else [plan.calibration.clone(), plan.calibration_delta.clone()]
        if scored:  # the worker's order: the table learns after the round's stages. The graphed arm learns as the
            # worker does (its host count of requests: two kernels), the eager arm from the stage's own count
            # (errors[2], a device tensor): later rounds' scores read both tables, so the two paths must agree
            table.learn(plan.calibration_delta, rows["rows"] if rows else plan.calibration[2])
        return [x.clone() for x in flat if x is not None] + scored  # a chain's plan has no KV moves

    order = [(64, 1), (CHAIN, 1), (16, 4), (64, 4), (32, 1), (CHAIN, 4), (64, 1), (16, 1), (64, 3), (CHAIN, 3)]
    for n, (c, bs) in enumerate(order):
        outs = {}
        for sampled in (True, False):
            graphed = run(tree_stages[(c, sampled)], walk_stages[(c, sampled)], bs, n, tables["graphed"], rows=bs)
            eager = run(tree_fns[(c, sampled)], walk_fns[(c, sampled)], bs, n, tables["eager"])
            assert len(graphed) == len(eager)
            for i, (g, e) in enumerate(zip(graphed, eager)):
                if sampled and i >= len(graphed) - 2:
                    # the calibration errors and table delta: float sums by atomics (scatter_add) in any order
                    torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6,
                                               msg=f"candidate {c}: calibration output {i} at bs={bs}")
                elif padded and g.is_floating_point():
                    # a padded stage runs torch's reductions over 4 rows where the eager call has bs: a cumsum (the
                    # chain's scores) over 1 row and over 4 may add in another order (the chain's scores were
                    # seen to differ in the last bits at bs=1); ids, links, paths and commits must stay exact
                    torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-5,
                                               msg=f"candidate {c}, sampled {sampled}: output {i} at bs={bs}")
                else:
                    assert torch.equal(g, e), f"candidate {c}, sampled {sampled}: output {i} differs at bs={bs}"
            observed = graphed[-3] if sampled else graphed[-1]
            assert observed.sum() > 0  # the chosen candidate's committed tokens are observed
            if sampled:
                assert float(graphed[-2][2]) == bs  # the calibration errors cover the real requests
            outs[sampled] = graphed
        # an unsampled round builds the chosen tree directly: the same tree as the sampled round's first slots
        expected_at = len(FIELDS) + 2
        for i, (a, b) in enumerate(zip(outs[True], outs[False])):
            if i != expected_at:
                assert torch.equal(a, b), f"candidate {c}: output {i} differs between sampled and unsampled rounds"
        assert outs[False][expected_at].abs().sum() == 0 and outs[True][expected_at].sum() > 0
    for k in ("obs", "pred", "count"):  # both tables learnt the same rounds, once each
        torch.testing.assert_close(getattr(tables["graphed"], k), getattr(tables["eager"], k), rtol=1e-9, atol=1e-9)
    assert int(tables["graphed"].rounds) == int(tables["eager"].rounds) == sum(bs for _, bs in order)


def test_graphed_draft_top1_equals_the_top_k_first_column():
    """`auto` chain rounds that sample nothing draft with ops.draft_top1_stage (a max instead of the top-K): on the
    GPU, graphed and eager, it must give the top-K stage's first column exactly (bf16 lm_head of 151936 rows, two
    rows equal so that their logits can tie), or the chain and the walk would change; the fused logsumexp
    (kernels.row_max_lse)'s max and index must equal torch's and its logsumexp torch's up to float32 rounding."""
    from functools import partial

    from sglang_ddtree import kernels
    from sglang_ddtree.graphs import GraphedStage
    from sglang_ddtree.sglang import ops

    gen = torch.Generator(device="cuda").manual_seed(3)
    block, hidden_size, vocab = 16, 128, 151936
    weight = torch.randn(vocab, hidden_size, device="cuda", generator=gen).to(torch.bfloat16)
    weight[90001] = weight[7] * 3
    weight[7] = weight[90001]  # both must pick the same one where the logits tie (the CPU test pins the rule)
    top1 = GraphedStage(partial(ops.draft_top1_stage, block, 0, weight), name="top1")
    topk = GraphedStage(partial(ops.draft_topk_stage, block, 128, 0, weight), name="topk")
    for bs in (1, 4, 16, 4):
        hidden = torch.randn(bs * block, hidden_size, device="cuda", generator=gen).to(torch.bfloat16)
        v1, t1 = (x.clone() for x in top1(hidden))
        vk, tk = (x.clone() for x in topk(hidden))
        e1, et = ops.draft_top1_stage(block, 0, weight, hidden)
        assert torch.equal(v1, e1) and torch.equal(t1, et)
        assert torch.equal(t1, tk[:, :, :1]) and torch.equal(v1, vk[:, :, :1])
        raw = hidden.view(bs, block, -1)[:, 1:].reshape(-1, hidden_size) @ weight.T
        m, arg, lse_fused = kernels.row_max_lse(raw)
        ref_m, ref_arg = raw.float().max(dim=-1)
        assert torch.equal(m, ref_m) and torch.equal(arg, ref_arg)
        assert torch.allclose(lse_fused, torch.logsumexp(raw.float(), -1), rtol=1e-6, atol=1e-5)
    assert top1.captures == 3 and top1.replays == 4
