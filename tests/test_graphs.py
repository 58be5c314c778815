"""sglang_ddtree.graphs on CPU (eager fallback) and the round's stage functions' plumbing (sglang/ops.py)."""

import torch

from sglang_ddtree.graphs import GraphedStage
from sglang_ddtree.sglang import ops
from sglang_ddtree.sglang.stats import branch_counts
from sglang_ddtree.tree import build_tree_from_topk
from sglang_ddtree.walk import walk_choices


def test_graphed_stage_runs_eagerly_on_cpu_and_when_disabled():
    calls = []

    def fn(x):
        calls.append(1)
        return x * 2

    for stage in (GraphedStage(fn, name="t"), GraphedStage(fn, name="t", enabled=False)):
        assert torch.equal(stage(torch.ones(3)), torch.full((3,), 2.0))
        assert stage.captures == 0 and stage.replays == 0
    assert len(calls) == 2


def test_stage_functions_compose_to_the_round():
    """draft_topk_stage -> tree_stage -> walk_commit_plan (torch path) equal the core functions called directly."""
    torch.manual_seed(0)
    bs, block, hidden_size, vocab, budget = 3, 16, 32, 200, 24
    weight = torch.randn(vocab, hidden_size)
    hidden = torch.randn(bs * block, hidden_size) * 3
    roots = torch.randint(0, vocab, (bs,))
    prefix = torch.tensor([7, 30, 2])
    values, tokens = ops.draft_topk_stage(block, budget, 0, weight, hidden)
    direct_v, direct_t = ops.draft_topk_logprobs(hidden.view(bs, block, -1)[:, 1:].reshape(-1, hidden_size),
                                                 weight, budget)
    assert torch.equal(values, direct_v.view(bs, block - 1, -1)) and torch.equal(tokens, direct_t.view(bs, 15, -1))

    tree, ids, pos = ops.tree_stage(budget, None, False, values, tokens, roots, prefix)
    ref = build_tree_from_topk(values, tokens, budget, roots, max_budget=budget)
    assert torch.equal(tree.tokens, ref.tokens) and torch.equal(ids, ref.tokens.reshape(-1))
    assert torch.equal(pos, (prefix.unsqueeze(1) + ref.depth).reshape(-1))

    choice = torch.roll(tree.tokens, -1, dims=1)  # follows first children for a while
    slots = torch.arange(bs * (budget + 1)).view(bs, budget + 1) + 1000
    plan = ops.walk_commit_plan(block, False, False, tree.tokens, tree.parents, tree.depth, tree.scores,
                                tree.ranks, tree.valid, choice, slots, prefix)
    walk = walk_choices(tree, choice)
    assert int(walk.accept_len.max()) >= 1  # some KV really moves
    assert torch.equal(plan.walk.path, walk.path) and plan.summary is None
    assert torch.equal(plan.commit_lens, (walk.accept_len + 1).to(torch.int32))
    assert torch.equal(plan.new_seq_lens, prefix + walk.accept_len + 1)
    dest, src = ops.accepted_kv_moves(walk.path, slots)
    assert torch.equal(plan.kv_dest, dest) and torch.equal(plan.kv_src, src)
    assert torch.equal(plan.draft_cache_loc, slots[:, :16])
    assert torch.equal(plan.draft_positions, (prefix.unsqueeze(1) + torch.arange(16)).reshape(-1))
    assert torch.equal(plan.out_tokens, walk.out_tokens.clamp(min=0))
    assert torch.equal(plan.branch_lens, branch_counts(tree, walk))


def test_draft_top1_stage_is_the_first_column_of_the_top_k():
    """An `auto` chain round that samples nothing takes the top-1 alone (ops.draft_top1_stage); its tokens and
    log-probs must be the top-K stage's first column, ties included (lower id first), so the chain and its walk are
    unchanged."""
    torch.manual_seed(1)
    bs, block, hidden_size, vocab = 4, 16, 24, 300
    weight = torch.randn(vocab, hidden_size)
    weight[17] = weight[5]  # duplicate rows: tied logits wherever 5 is the best
    weight[5] *= 4.0
    weight[17] = weight[5]
    hidden = torch.randn(bs * block, hidden_size)
    values, tokens = ops.draft_topk_stage(block, 32, 1000, weight, hidden)
    top1_values, top1_tokens = ops.draft_top1_stage(block, 1000, weight, hidden)
    assert top1_values.shape == (bs, block - 1, 1) and top1_tokens.shape == (bs, block - 1, 1)
    assert torch.equal(top1_tokens, tokens[:, :, :1])
    assert torch.equal(top1_values, values[:, :, :1])
    assert (top1_tokens == 1005).sum() > 0 and (top1_tokens == 1017).sum() == 0  # the tie really occurs


def test_top1_chain_plan_equals_the_general_plan_of_a_chain():
    """walk_commit_plan(top1_chain=True) (auto's chain candidate) leaves out the KV moves and the branch counts; on
    a top-1 chain the general plan's moves are all self-copies and its branch counts zeros, and every other output
    is the same. Choices that follow the chain to different depths (none, some, all)."""
    from sglang_ddtree.tree import chain_tree_from_topk

    torch.manual_seed(2)
    bs, block = 3, 16
    values, tokens = torch.randn(bs, block - 1, 4).log_softmax(-1).sort(-1, descending=True)[0], \
        torch.randint(0, 50, (bs, block - 1, 4))
    roots = torch.randint(0, 50, (bs,))
    prefix = torch.tensor([5, 40, 11])
    chain = chain_tree_from_topk(values, tokens, roots)
    choice = torch.roll(chain.tokens, -1, dims=1)  # the chain's own next token everywhere: all accepted
    choice[1, 4] = (choice[1, 4] + 1) % 50  # request 1 stops after 4 drafts
    choice[2, 0] = (choice[2, 0] + 1) % 50  # request 2 accepts none
    slots = torch.arange(bs * block).view(bs, block) * 3 + 100
    summary = torch.tensor([True, False])
    for with_summary in summary.tolist():
        args = (block, False, with_summary, chain.tokens, chain.parents, chain.depth, chain.scores, chain.ranks,
                chain.valid, choice, slots, prefix)
        fast = ops.walk_commit_plan(*args, auto=((0, 16), 0), top1_chain=True)
        full = ops.walk_commit_plan(*args, auto=((0, 16), 0))
        assert fast.walk.accept_len.tolist() == [15, 4, 0]
        assert fast.kv_dest is None and fast.kv_src is None
        assert torch.equal(full.kv_dest, full.kv_src)  # a chain's accepted KV is already in place
        assert torch.equal(fast.branch_lens, full.branch_lens) and int(full.branch_lens.sum()) == 0
        for name in ("commit_lens", "new_seq_lens", "draft_cache_loc", "draft_positions", "out_tokens", "observed"):
            assert torch.equal(getattr(fast, name), getattr(full, name)), name
        assert (fast.summary is None) == (not with_summary)
        if with_summary:
            assert torch.equal(fast.summary, full.summary)
