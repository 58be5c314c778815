"""sglang_ddtree.graphs on CPU (eager fallback) and the round's stage functions' plumbing (sglang/ops.py)."""

import pytest
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


def test_pad_rows_repeats_the_last_request():
    from sglang_ddtree.graphs import pad_rows

    x = torch.arange(12).view(6, 2)  # 3 requests of 2 rows each
    got = pad_rows(x, 3, 5)
    assert got.shape == (10, 2)
    assert torch.equal(got[:6], x) and torch.equal(got[6:8], x[4:6]) and torch.equal(got[8:10], x[4:6])
    assert torch.equal(pad_rows(x, 3, 3), x)


def test_padded_stage_returns_the_unpadded_result():
    """A stage run padded to a bucket (here eagerly on the CPU, the same arithmetic its graph replays) returns,
    after unpad, what the unpadded call returns; its batch sums (rows_arg) leave the padding out."""
    def fn(x, rows):
        live = (torch.arange(x.shape[0]) < rows).float()
        return x * 2, (x.sum(dim=1) * live).sum()

    stage = GraphedStage(fn, name="t", bucket_of=lambda bs: 8, unpad=lambda out, bs: (out[0][:bs], out[1]),
                         rows_arg=True)
    stage.pad_eagerly = True
    x = torch.randn(3, 4)
    doubled, total = stage(x, rows=3)
    assert doubled.shape == (3, 4) and torch.equal(doubled, x * 2)
    assert torch.allclose(total, x.sum())
    with pytest.raises(ValueError, match="rows="):
        stage(x)
    with pytest.raises(ValueError, match="unpad"):
        GraphedStage(fn, name="t", bucket_of=lambda bs: 8)


def test_a_batch_past_the_largest_bucket_runs_eagerly_unpadded():
    """bucket_of answering None (a batch larger than every captured verify size) runs fn once on the real requests:
    no padding, no capture, the batch sums over the real rows."""
    seen = []

    def fn(x, rows):
        seen.append(x.shape[0])
        return x * 2, x.sum() + 0 * rows

    stage = GraphedStage(fn, name="t", bucket_of=lambda bs: 8 if bs <= 8 else None,
                         unpad=lambda out, bs: (out[0][:bs], out[1]), rows_arg=True)
    stage.pad_eagerly = True
    x = torch.randn(11, 4)
    doubled, total = stage(x, rows=11)
    assert seen == [11] and torch.equal(doubled, x * 2) and torch.allclose(total, x.sum())
    stage(x[:3], rows=3)
    assert seen == [11, 8]  # within the buckets it still pads
    assert stage.captures == 0


@pytest.mark.parametrize("chosen", [0, 16, 32])
@pytest.mark.parametrize("sampled", [True, False])
def test_padded_round_stages_equal_the_unpadded_ones(chosen, sampled):
    """The round's stages (draft top-K, `auto`'s tree stage, walk + commit plan with summary and observed tokens;
    sampled: the calibration table's prediction errors and delta) run padded from 3 requests to
    8, as the worker runs them, then unpadded: every output equals the unpadded
    run's, the batch sums included, and no KV move of a padding request survives."""
    from functools import partial

    torch.manual_seed(3)
    candidates = (0, 16, 32)
    bs, block, hidden_size, vocab, width = 3, 16, 32, 200, 32
    weight = torch.randn(vocab, hidden_size)
    hidden = torch.randn(bs * block, hidden_size) * 3
    roots = torch.randint(0, vocab, (bs,))
    prefix = torch.tensor([7, 30, 2])
    from sglang_ddtree.adaptive import ScoreCalibrator

    calibrator = ScoreCalibrator(depth_limit=block - 1) if sampled else None
    if sampled:  # a table whose factors differ from 1: the stages read it, neither run may change it
        calibrator.obs.uniform_(0, 5, generator=torch.Generator().manual_seed(1))
        calibrator.pred.uniform_(0, 5, generator=torch.Generator().manual_seed(2))
        table = calibrator.state_dict()

    def stages(pad: bool):
        opts = dict(bucket_of=lambda b: 8) if pad else {}
        topk = GraphedStage(partial(ops.draft_topk_stage, block, width, 0, weight), name="topk",
                            unpad=ops.unpad_requests, **opts)
        tree = GraphedStage(partial(ops.auto_tree_stage, width, chosen, candidates, None, False, sampled),
                            name="tree", borrow=(0, 1), unpad=ops.unpad_tree_stage, rows_arg=pad, **opts)
        walk = GraphedStage(partial(ops.walk_commit_plan, block, False, True, auto=(candidates, chosen),
                                    top1_chain=chosen == 0, calibrator=calibrator),
                            name="walk", borrow=tuple(range(6)), unpad=ops.unpad_commit_plan, rows_arg=pad, **opts)
        for s in (topk, tree, walk):
            s.pad_eagerly = pad
        return topk, tree, walk

    def run(pad: bool):
        topk, tree_stage, walk_stage = stages(pad)
        values, tokens = topk(hidden, rows=bs)
        tree, ids, pos, expected = tree_stage(values, tokens, roots, prefix, rows=bs)
        choice = torch.roll(tree.tokens, -1, dims=1)  # follows first children for a while
        slots = torch.arange(bs * tree.max_nodes).view(bs, -1) * 2 + 1000
        plan = walk_stage(tree.tokens, tree.parents, tree.depth, tree.scores, tree.ranks, tree.valid, choice, slots,
                          prefix, rows=bs)
        return values, tokens, tree, ids, pos, expected, plan

    ref, got = run(False), run(True)
    for a, b in zip(ref[:2], got[:2]):
        assert torch.equal(a, b)
    for f in ("tokens", "parents", "depth", "scores", "ranks", "valid"):
        assert torch.equal(getattr(ref[2], f), getattr(got[2], f)), f
    for a, b in zip(ref[3:6], got[3:6]):
        assert torch.equal(a, b)
    p, q = ref[6], got[6]
    assert int(p.walk.accept_len.max()) >= 1  # something is accepted
    for f in ("path", "accept_len", "bonus", "out_tokens", "target_choice"):
        assert torch.equal(getattr(p.walk, f), getattr(q.walk, f)), f
    for f in ("commit_lens", "new_seq_lens", "kv_dest", "kv_src", "draft_cache_loc", "draft_positions", "out_tokens",
              "branch_lens", "summary", "observed", "calibration", "calibration_delta"):
        a, b = getattr(p, f), getattr(q, f)
        assert (a is None and b is None) or torch.equal(a, b), f
    if sampled:
        assert float(ref[5].sum()) > 0  # the expectations were computed (and summed over 3 requests, not 8)
        assert float(q.calibration[2]) == bs and float(q.calibration[:2].sum()) > 0
        assert all(torch.equal(table[k], calibrator.state_dict()[k]) for k in ("obs", "pred", "count"))
    else:
        assert q.calibration is None and q.calibration_delta is None
