"""The vectorized tree builder against brute force and against the heap reference."""

import itertools
import math

import pytest
import torch

from sglang_ddtree.tree import (
    MAX_BUDGET,
    build_tree,
    build_tree_from_topk,
    build_tree_reference,
    chain_tree,
    topk_draft,
)

FIELDS = ("tokens", "parents", "depth", "scores", "ranks", "valid")


def random_logprobs(gen, bs, depth, vocab, ties=False):
    lp = torch.randn(bs, depth, vocab, generator=gen).log_softmax(-1)
    if ties:  # coarse grid -> many exactly equal log-probs and equal prefix scores
        lp = (lp * 2).round() / 2
    return lp


def all_prefixes(lp):
    """Every draft prefix (as a token tuple) with its float32 score, accumulated root to leaf."""
    depth_limit, vocab = lp.shape
    out = {}
    frontier = {(): torch.tensor(0.0)}
    for d in range(depth_limit):
        nxt = {}
        for prefix, score in frontier.items():
            for tok in range(vocab):
                nxt[prefix + (tok,)] = score + lp[d, tok]
        out.update(nxt)
        frontier = nxt
    return out


def tree_paths(tree, b=0):
    """Token path of every valid draft node of request b."""
    tokens, parents, valid = tree.tokens[b].tolist(), tree.parents[b].tolist(), tree.valid[b].tolist()
    paths = {0: ()}
    for i in range(1, len(tokens)):
        if valid[i]:
            paths[i] = paths[parents[i]] + (tokens[i],)
    del paths[0]
    return paths


@pytest.mark.parametrize("ties", [False, True])
def test_tree_is_the_top_b_prefix_set(ties):
    gen = torch.Generator().manual_seed(1 if ties else 2)
    for _ in range(60):
        depth = int(torch.randint(1, 5, (1,), generator=gen))
        vocab = int(torch.randint(1, 6, (1,), generator=gen))
        lp = random_logprobs(gen, 1, depth, vocab, ties)
        prefixes = all_prefixes(lp[0])
        budget = int(torch.randint(1, len(prefixes) + 3, (1,), generator=gen))
        tree = build_tree(lp, budget, torch.tensor([7]))
        paths = tree_paths(tree)
        chosen_scores = sorted((prefixes[p].item() for p in paths.values()), reverse=True)
        best_scores = sorted((s.item() for s in prefixes.values()), reverse=True)[:budget]
        assert chosen_scores == best_scores  # same multiset of scores as the true top-B
        if not ties:  # continuous scores: the set itself is unique
            best = sorted(prefixes, key=lambda p: -prefixes[p].item())[:budget]
            assert set(paths.values()) == set(best)
        assert len(set(paths.values())) == len(paths)  # no duplicate prefix


def check_structure(tree, lp, root_tokens):
    bs, n = tree.tokens.shape
    for b in range(bs):
        valid = tree.valid[b].tolist()
        count = sum(valid)
        assert valid == [True] * count + [False] * (n - count)  # valid nodes are a prefix of the slots
        assert tree.tokens[b, 0] == root_tokens[b] and tree.parents[b, 0] == -1 and tree.depth[b, 0] == 0
        sorted_tokens = [topk_draft(lp[b:b + 1], lp.shape[-1])[1][0, d].tolist() for d in range(lp.shape[1])]
        for i in range(1, count):
            p = int(tree.parents[b, i])
            assert 0 <= p < i  # topological
            d = int(tree.depth[b, i])
            assert d == int(tree.depth[b, p]) + 1
            tok = int(tree.tokens[b, i])
            assert tree.scores[b, i] == tree.scores[b, p] + lp[b, d - 1, tok].float()
            assert sorted_tokens[d - 1][int(tree.ranks[b, i])] == tok
        # siblings carry distinct tokens
        pairs = [(int(tree.parents[b, i]), int(tree.tokens[b, i])) for i in range(1, count)]
        assert len(set(pairs)) == len(pairs)
        # canonical order: scores never increase along the slot order
        s = tree.scores[b, :count].tolist()
        assert all(x >= y for x, y in zip(s[1:], s[2:]))
        # invalid slots are blank
        assert (tree.tokens[b, count:] == 0).all() and (tree.parents[b, count:] == -1).all()
        assert torch.isinf(tree.scores[b, count:]).all() and (tree.ranks[b, count:] == -1).all()


@pytest.mark.parametrize("ties", [False, True])
def test_vectorized_equals_heap_reference(ties):
    gen = torch.Generator().manual_seed(3 if ties else 4)
    for _ in range(80):
        depth = int(torch.randint(1, 7, (1,), generator=gen))
        vocab = int(torch.randint(1, 12, (1,), generator=gen))
        budget = int(torch.randint(1, 70, (1,), generator=gen))
        lp = random_logprobs(gen, 1, depth, vocab, ties)
        tree = build_tree(lp, budget, torch.tensor([3]))
        ref = build_tree_reference(lp[0], budget, 3)
        for f in FIELDS:
            assert torch.equal(getattr(tree, f), getattr(ref, f)), f
        check_structure(tree, lp, [3])


def test_batched_per_request_budgets_match_single_requests():
    gen = torch.Generator().manual_seed(5)
    bs, depth, vocab = 6, 5, 9
    lp = random_logprobs(gen, bs, depth, vocab, ties=True)
    budgets = torch.tensor([1, 7, 30, 2, 64, 64])
    roots = torch.arange(bs) + 10
    tree = build_tree(lp, budgets, roots, max_budget=64)
    assert tree.max_nodes == 65
    check_structure(tree, lp, roots.tolist())
    for b in range(bs):
        ref = build_tree_reference(lp[b], int(budgets[b]), int(roots[b]))
        n = ref.max_nodes
        for f in FIELDS:
            assert torch.equal(getattr(tree, f)[b, :n], getattr(ref, f)[0]), (b, f)
        assert not tree.valid[b, n:].any()


def test_int_budget_below_max_budget_keeps_only_budget_nodes():
    gen = torch.Generator().manual_seed(11)
    lp = random_logprobs(gen, 2, 4, 6)
    small = build_tree(lp, 4, torch.tensor([0, 1]), max_budget=16)
    exact = build_tree(lp, 4, torch.tensor([0, 1]))
    assert small.max_nodes == 17 and (small.num_nodes == 5).all()
    for f in FIELDS:
        assert torch.equal(getattr(small, f)[:, :5], getattr(exact, f))
    per_request = build_tree(lp, torch.tensor([4, 4]), torch.tensor([0, 1]), max_budget=16)
    for f in FIELDS:
        assert torch.equal(getattr(small, f), getattr(per_request, f))


def test_expected_acceptance_equals_brute_force():
    """Sum of exp(score) over draft nodes = expected accepted draft tokens when the target samples like the drafter."""
    gen = torch.Generator().manual_seed(6)
    depth, vocab = 3, 3
    for budget in (1, 4, 9, 20, 39):
        lp = random_logprobs(gen, 1, depth, vocab)
        tree = build_tree(lp, budget, torch.tensor([0]))
        paths = set(tree_paths(tree).values())
        expected = 0.0
        for seq in itertools.product(range(vocab), repeat=depth):
            prob = math.exp(sum(lp[0, d, t].item() for d, t in enumerate(seq)))
            accepted = 0
            while accepted < depth and seq[:accepted + 1] in paths:
                accepted += 1
            expected += prob * accepted
        node_sum = tree.scores[0, 1:][tree.valid[0, 1:]].double().exp().sum().item()
        assert node_sum == pytest.approx(expected, rel=1e-5)


def test_prune_drops_improbable_nodes_and_keeps_a_prefix_of_the_order():
    gen = torch.Generator().manual_seed(7)
    lp = random_logprobs(gen, 3, 6, 20)
    full = build_tree(lp, 128, torch.zeros(3, dtype=torch.long))
    pruned = build_tree(lp, 128, torch.zeros(3, dtype=torch.long), prune=0.01)
    for b in range(3):
        keep = full.valid[b] & (full.scores[b] >= math.log(0.01))
        assert torch.equal(pruned.valid[b], keep)
        n = int(keep.sum())
        assert torch.equal(pruned.tokens[b, :n], full.tokens[b, :n])
        assert torch.equal(pruned.parents[b, :n], full.parents[b, :n])
    assert (pruned.num_nodes < full.num_nodes).all()
    ref = build_tree_reference(lp[1], 128, 0, prune=0.01)
    assert torch.equal(ref.valid[0], pruned.valid[1])


def test_exact_ties_are_deterministic_and_ordered_by_token_id():
    lp = torch.full((2, 3, 8), -math.log(8.0))  # uniform: every prefix of a depth ties
    tree = build_tree(lp, 20, torch.tensor([1, 2]))
    again = build_tree(lp.clone(), 20, torch.tensor([1, 2]))
    for f in FIELDS:
        assert torch.equal(getattr(tree, f), getattr(again, f))
    # depth-1 nodes first (shallower wins ties of... higher scores anyway), tokens in id order
    assert tree.tokens[0, 1:9].tolist() == list(range(8))
    assert tree.depth[0, 1:9].tolist() == [1] * 8
    # then depth 2 under the first parent, children in token order
    assert tree.parents[0, 9:17].tolist() == [1] * 8
    assert tree.tokens[0, 9:17].tolist() == list(range(8))


def test_zero_logprob_child_never_precedes_its_parent():
    """A certain token (log-prob exactly 0) makes a child tie with its parent; the parent must come first."""
    lp = torch.full((1, 4, 5), float("-inf"))
    lp[0, :, 2] = 0.0  # the drafter is certain at every depth
    tree = build_tree(lp, 6, torch.tensor([0]))
    assert tree.num_nodes.item() == 5  # 4 certain nodes, the -inf prefixes are not valid nodes
    assert tree.parents[0, 1:5].tolist() == [0, 1, 2, 3]
    assert tree.depth[0, 1:5].tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_any_float_dtype(dtype):
    gen = torch.Generator().manual_seed(8)
    lp = random_logprobs(gen, 2, 4, 10).to(dtype)
    tree = build_tree(lp, 30, torch.tensor([0, 1]))
    ref = build_tree(lp.float(), 30, torch.tensor([0, 1]))
    for f in FIELDS:
        assert torch.equal(getattr(tree, f), getattr(ref, f))


def test_topk_path_equals_full_path_and_large_budget_is_capped_by_vocab():
    gen = torch.Generator().manual_seed(9)
    lp = random_logprobs(gen, 2, 5, 7)
    values, tokens = topk_draft(lp, 7)
    a = build_tree(lp, 100, torch.tensor([0, 0]))
    b = build_tree_from_topk(values, tokens, 100, torch.tensor([0, 0]))
    for f in FIELDS:
        assert torch.equal(getattr(a, f), getattr(b, f))
    assert a.max_nodes == 101


def test_chain_tree_is_the_top1_path():
    gen = torch.Generator().manual_seed(10)
    lp = random_logprobs(gen, 2, 15, 11)
    chain = chain_tree(lp, torch.tensor([4, 5]))
    assert chain.max_nodes == 16
    assert torch.equal(chain.tokens[:, 1:], lp.argmax(-1))
    assert chain.parents[0].tolist() == [-1] + list(range(15))
    one = build_tree(lp, 1, torch.tensor([4, 5]))  # budget 1 = the first chain node only
    assert torch.equal(one.tokens, chain.tokens[:, :2])
    assert torch.equal(chain.tokens[:, 0], torch.tensor([4, 5]))
    assert torch.equal(chain.depth, torch.arange(16).expand(2, 16))
    assert torch.equal(chain.ranks, torch.zeros(2, 16, dtype=torch.int64)) and bool(chain.valid.all())
    expected = torch.cat([torch.zeros(2, 1), lp.max(-1).values.cumsum(1)], dim=1)
    assert torch.allclose(chain.scores, expected) and chain.scores.dtype == torch.float32
    # the slot tensors are shared by chains of one shape (made once); tokens and scores are each chain's own
    other = chain_tree(random_logprobs(gen, 2, 15, 11), torch.tensor([7, 8]))
    assert other.parents is chain.parents and other.depth is chain.depth
    assert torch.equal(chain.tokens[:, 0], torch.tensor([4, 5])) and torch.equal(other.tokens[:, 0], torch.tensor([7, 8]))
    assert not torch.equal(other.scores, chain.scores)


def test_bad_input_is_refused_with_value_errors():
    lp = torch.randn(2, 3, 5).log_softmax(-1)
    roots = torch.tensor([0, 0])
    with pytest.raises(ValueError, match="budget"):
        build_tree(lp, 0, roots)
    with pytest.raises(ValueError, match="budget"):
        build_tree(lp, MAX_BUDGET + 1, roots)
    with pytest.raises(ValueError, match="budget"):
        build_tree(lp, torch.tensor([3, 0]), roots)
    with pytest.raises(ValueError, match="shape"):
        build_tree(lp, torch.tensor([3, 3, 3]), roots)
    with pytest.raises(ValueError, match="L >= 1"):
        build_tree(torch.randn(2, 0, 5), 3, roots)
    with pytest.raises(ValueError, match="root_tokens"):
        build_tree(lp, 3, torch.tensor([0]))
    with pytest.raises(ValueError, match=r"\[batch, L, V\]"):
        build_tree(lp[0], 3, roots)
    bad = lp.clone()
    bad[1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        build_tree(bad, 3, roots)
    with pytest.raises(ValueError, match="prune"):
        build_tree(lp, 3, roots, prune=1.5)
    with pytest.raises(ValueError, match="max_budget"):
        build_tree(lp, 10, roots, max_budget=5)

