"""Adaptive budget (sglang_ddtree/adaptive.py): best-b subtrees, expected acceptance, the chooser, the calibrator,
calibrated selection and the round-cost model. Brute force on tiny V / L / B where feasible."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from sglang_ddtree import adaptive
from sglang_ddtree.adaptive import (CHAIN, CalibratorConfig, ScoreCalibrator, calibrated_order,
                                    chain_expected, choose_budget, expected_acceptance, first_slots,
                                    node_conditionals, offchain_ancestors, parse_candidates, propagate_along_paths,
                                    raw_node_probs, select_by_probs)
from sglang_ddtree import round_cost
from sglang_ddtree.round_cost import RoundCost
from sglang_ddtree.tree import build_tree, build_tree_reference, chain_tree, topk_draft
from sglang_ddtree.walk import walk_choices


def _lp(bs, depth, vocab, seed, scale=3.0, quantize=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(bs, depth, vocab, generator=g) * scale
    if quantize:  # few distinct values: many exact score ties
        x = (x * quantize).round() / quantize
    return torch.log_softmax(x, dim=-1)


def _fields(t):
    return (t.tokens, t.parents, t.depth, t.scores, t.ranks, t.valid)


def _assert_same_tree(a, b):
    for x, y in zip(_fields(a), _fields(b)):
        assert torch.equal(x, y)


# ------------------------------------------------------------------------------------- best-b = first b slots


@pytest.mark.parametrize("quantize", [None, 1.0, 0.25])
@pytest.mark.parametrize("vocab,depth", [(5, 4), (32, 6), (200, 15)])
def test_first_b_slots_equal_the_tree_built_at_b(vocab, depth, quantize):
    lp = _lp(3, depth, vocab, seed=vocab + depth, quantize=quantize)
    roots = torch.tensor([1, 2, 3])
    big = build_tree(lp, 128, roots)
    for b in (1, 2, 3, 7, 16, 31, 64, 100, 128):
        _assert_same_tree(first_slots(big, b), build_tree(lp, b, roots))


def test_first_b_slots_match_the_heap_reference_with_ties():
    lp = _lp(1, 4, 4, seed=3, quantize=0.5)  # heavy ties
    big = build_tree(lp, 64, torch.tensor([0]))
    for b in (1, 5, 17, 40, 64):
        ref = build_tree_reference(lp[0], b, 0)
        _assert_same_tree(first_slots(big, b), ref)


# ------------------------------------------------------------------------------------- expected acceptance


def _all_prefix_probs(lp):
    """Brute force: probability of every draft prefix of a [L, V] factorized drafter."""
    depth, vocab = lp.shape
    out = []
    for d in range(1, depth + 1):
        for seq in itertools.product(range(vocab), repeat=d):
            out.append(math.exp(sum(float(lp[i, t]) for i, t in enumerate(seq))))
    return out


def test_expected_acceptance_is_the_sum_of_the_best_b_prefix_probabilities():
    lp = _lp(2, 3, 4, seed=11)
    budgets = [CHAIN, 1, 2, 5, 10, 30, 60]
    big = build_tree(lp, 60, torch.tensor([0, 0]))
    top1 = topk_draft(lp, 1)[0][:, :, 0]
    e = expected_acceptance(big, budgets, top1)
    for i in range(2):
        probs = sorted(_all_prefix_probs(lp[i]), reverse=True)
        for j, b in enumerate(budgets):
            if b == CHAIN:
                p = lp[i].max(dim=-1).values.cumsum(0).exp().sum()
                assert float(e[i, j]) == pytest.approx(1 + float(p), rel=1e-5)
            else:
                assert float(e[i, j]) == pytest.approx(1 + sum(probs[:b]), rel=1e-5)


def test_expected_acceptance_is_exact_when_the_target_samples_like_the_drafter():
    """If the target's choice at each depth is drawn from the drafter's marginal there, E[accept_len + 1] of a tree
    is 1 + sum exp(score): checked by enumerating every target choice sequence through the real walk."""
    depth, vocab = 3, 3
    lp = _lp(1, depth, vocab, seed=5, scale=1.5)
    for b in (1, 4, 9, 20):
        tree = build_tree(lp, b, torch.tensor([0]))
        n = tree.max_nodes
        exp_len = 0.0
        for seq in itertools.product(range(vocab), repeat=depth):
            prob = math.exp(sum(float(lp[0, d, t]) for d, t in enumerate(seq)))
            # the target's choice at a node of depth d is seq[d] (depth-only target: same for every prefix)
            choice = torch.tensor([[seq[min(int(d), depth - 1)] for d in tree.depth[0].tolist()]])
            choice = torch.where(tree.depth[0] < depth, choice, 0).view(1, n)
            exp_len += prob * float(walk_choices(tree, choice).commit_len[0])
        pred = float(expected_acceptance(tree, [b])[0, 0])
        assert pred == pytest.approx(exp_len, rel=1e-5)


def test_chain_expected_matches_the_chain_tree():
    lp = _lp(4, 15, 50, seed=2)
    tree = chain_tree(lp, torch.zeros(4, dtype=torch.long))
    top1 = topk_draft(lp, 1)[0][:, :, 0]
    assert torch.allclose(chain_expected(top1), 1 + raw_node_probs(tree)[:, 1:].sum(1), rtol=1e-5)
    cal = ScoreCalibrator(depth_limit=15)
    _train(cal, lp, rounds=3)
    assert torch.allclose(chain_expected(top1, cal), 1 + cal.node_probs(tree)[:, 1:].sum(1), rtol=1e-5)


def test_expected_acceptance_needs_a_big_enough_tree_and_the_chain_inputs():
    lp = _lp(1, 4, 10, seed=0)
    tree = build_tree(lp, 8, torch.tensor([0]))
    with pytest.raises(ValueError, match="at least 17 slots"):
        expected_acceptance(tree, [16])
    with pytest.raises(ValueError, match="top1_logprobs"):
        expected_acceptance(tree, [CHAIN, 4])


# ------------------------------------------------------------------------------------- the chooser


def test_chooser_maximises_tokens_per_second_with_smaller_budget_on_ties():
    expected = torch.tensor([[2.0, 3.0, 4.0], [2.0, 3.0, 4.0]])
    assert int(choose_budget(expected, torch.tensor([1.0, 1.0, 1.0]))) == 2  # free verify: the biggest tree
    assert int(choose_budget(expected, torch.tensor([1.0, 10.0, 100.0]))) == 0  # expensive verify: the chain
    assert int(choose_budget(expected, torch.tensor([1.0, 1.5, 2.0]))) == 0  # exact tie 4/1 = 6/1.5 = 8/2
    out = choose_budget(expected, torch.tensor([2.0, 1.5, 2.0]))
    assert isinstance(out, torch.Tensor) and out.dim() == 0 and int(out) == 1  # tie between 1 and 2 -> 1
    # one choice for the batch: the sum over requests decides, padding rows excluded
    e = torch.tensor([[1.0, 5.0], [3.0, 3.1], [100.0, 0.0]])
    assert int(choose_budget(e, torch.tensor([1.0, 1.5]), torch.tensor([True, True, False]))) == 1
    assert int(choose_budget(e, torch.tensor([1.0, 1.5]))) == 0


def test_chooser_brute_force():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        c = int(torch.randint(1, 6, (1,), generator=g))
        e = torch.rand(int(torch.randint(1, 5, (1,), generator=g)), c, generator=g).round(decimals=1) * 4 + 1
        t = torch.rand(c, generator=g).round(decimals=1) + 0.5
        rates = [float(e[:, j].sum()) / float(t[j]) for j in range(c)]
        best = max(rates)
        assert int(choose_budget(e, t)) == min(j for j, r in enumerate(rates) if r >= best * (1 - 1e-6) and
                                              abs(r - best) <= 1e-5 * best)


def test_chooser_on_real_trees_picks_chain_when_verify_is_expensive_and_the_largest_tree_when_free():
    lp = _lp(3, 15, 100, seed=4)
    cands = [CHAIN, 16, 64, 256]
    tree = build_tree(lp, 256, torch.zeros(3, dtype=torch.long))
    e = expected_acceptance(tree, cands, topk_draft(lp, 1)[0][:, :, 0])
    assert int(choose_budget(e, torch.tensor([1.0, 1e3, 1e4, 1e5]))) == 0
    assert int(choose_budget(e, torch.ones(4))) == 3
    assert (e[:, 1:].diff(dim=1) > 0).all()  # more nodes, more expected tokens


def test_parse_candidates():
    assert parse_candidates("16, 64,chain,16") == [CHAIN, 16, 64]
    assert parse_candidates([256, 32]) == [CHAIN, 32, 256]  # the chain is always a candidate
    for bad in ("16,x", "2048", [-1]):
        with pytest.raises(ValueError):
            parse_candidates(bad)


# ------------------------------------------------------------------------------------- calibrator


@pytest.mark.parametrize("depth", [1, 2, 3, 5, 8, 15])
def test_offchain_ancestors_count_the_non_top1_ancestors(depth):
    """Pointer jumping (log2 L steps) against walking up each node's parents one by one."""
    for seed, budget in itertools.product(range(3), (4, 30, 200)):
        lp = _lp(3, depth, 12, seed=seed, scale=1.0)
        tree = build_tree(lp, budget, torch.zeros(3, dtype=torch.long))
        got = offchain_ancestors(tree)
        for b in range(tree.batch_size):
            for i in range(tree.max_nodes):
                want, a = 0, int(tree.parents[b, i])
                while a > 0:
                    want += int(tree.valid[b, a] and tree.ranks[b, a] > 0)
                    a = int(tree.parents[b, a])
                assert int(got[b, i]) == want, (seed, budget, b, i)


def _synthetic_walk(tree, g, wrong_after_branch=False):
    """A target that takes the rank-0 child with probability 0.8 and the rank-1 child with 0.1 (never anything below a
    non-top-1 choice when wrong_after_branch): the walk's accepted path [bs, L+1]."""
    choice = torch.full(tree.tokens.shape, -1, dtype=torch.long)
    off = offchain_ancestors(tree) + (tree.ranks > 0).long()
    for b in range(tree.batch_size):
        for i in range(tree.max_nodes):
            if not tree.valid[b, i]:
                continue
            kids = {int(tree.ranks[b, j]): j for j in range(tree.max_nodes)
                    if tree.valid[b, j] and int(tree.parents[b, j]) == i}
            r = float(torch.rand(1, generator=g))
            if wrong_after_branch and i > 0 and int(off[b, i]) > 0:
                continue
            if r < 0.8 and 0 in kids:
                choice[b, i] = tree.tokens[b, kids[0]]
            elif 0.8 <= r < 0.9 and 1 in kids:
                choice[b, i] = tree.tokens[b, kids[1]]
    return walk_choices(tree, choice).path


def _train(cal, lp, rounds=5, seed=0, wrong_after_branch=False, budget=64):
    g = torch.Generator().manual_seed(seed)
    for _ in range(rounds):
        tree = build_tree(lp, budget, torch.zeros(lp.shape[0], dtype=torch.long))
        cal.update(tree, _synthetic_walk(tree, g, wrong_after_branch))
    return cal


def test_cold_calibrator_gives_raw_scores_and_probabilities_are_monotone_along_paths():
    lp = _lp(2, 6, 20, seed=1)
    tree = build_tree(lp, 100, torch.tensor([0, 1]))
    cal = ScoreCalibrator(depth_limit=6)
    assert torch.allclose(cal.node_probs(tree), torch.where(tree.valid, tree.scores.exp(), 0.0), rtol=1e-5)
    assert torch.allclose(cal.conditionals(tree), node_conditionals(tree))
    _train(cal, lp, rounds=4, wrong_after_branch=True)
    probs = cal.node_probs(tree)
    parent = probs.gather(1, tree.parents.clamp(min=0))
    assert (probs[tree.valid] <= parent[tree.valid]).all()
    assert ((probs >= 0) & (probs <= 1)).all()


def test_calibrator_learns_the_off_chain_overconfidence():
    """When the target never continues a path after a non-top-1 choice, the nodes below a branch lose their
    probability mass (cells learn in proportion to the predicted mass they hold, so the mass is what converges)
    while the chain keeps most of its own."""
    lp = _lp(2, 5, 12, seed=6, scale=1.0)
    tree = build_tree(lp, 64, torch.tensor([0, 0]))
    cal = _train(ScoreCalibrator(depth_limit=5, prior_mass=0.5, half_life=float("inf")), lp, rounds=30,
                 wrong_after_branch=True)
    probs = cal.node_probs(tree)
    raw = raw_node_probs(tree)
    below_branch = tree.valid & (offchain_ancestors(tree) > 0)
    assert below_branch.any()
    assert float(probs[below_branch].sum()) < 0.3 * float(raw[below_branch].sum())
    chain = tree.valid & (offchain_ancestors(tree) == 0) & (tree.ranks == 0) & (tree.depth > 0)
    assert float(probs[chain].sum()) > 0.5 * float(raw[chain].sum())
    exported = cal.export()
    json.dumps(exported)
    assert exported["request_rounds"] == 60 and exported["cells"]


def test_calibrator_matches_observed_node_acceptance_in_a_stationary_stream():
    """The table's fixed point: on a stationary stream the calibrated expected length matches the observed mean,
    although the raw scores (a drafter unrelated to this target) are far off."""
    lp = _lp(1, 4, 8, seed=9, scale=0.5)  # a flat drafter: under-confident for a target that follows rank 0 80%
    cal = _train(ScoreCalibrator(depth_limit=4, prior_mass=1e-3, half_life=float("inf"), q_edges=()), lp, rounds=60,
                 seed=1, budget=24)
    g = torch.Generator().manual_seed(2)
    tree = build_tree(lp, 24, torch.tensor([0]))
    obs = sum(float(_synthetic_walk(tree, g)[0].ge(0).sum()) for _ in range(200)) / 200  # root + accepted
    raw = 1 + float(raw_node_probs(tree)[0, 1:].sum())
    assert float(cal.expected(tree)[0]) == pytest.approx(obs, rel=0.06)
    assert abs(raw - obs) > 3 * abs(float(cal.expected(tree)[0]) - obs)


def test_calibrator_state_reset_export_and_bounded_memory():
    lp = _lp(2, 5, 10, seed=3)
    cal = ScoreCalibrator(depth_limit=5)
    shapes = [t.shape for t in (cal.pred, cal.obs, cal.count)]
    _train(cal, lp, rounds=5)
    assert [t.shape for t in (cal.pred, cal.obs, cal.count)] == shapes == [CalibratorConfig(depth_limit=5).shape] * 3
    state = cal.state_dict()
    other = ScoreCalibrator(depth_limit=5)
    other.load_state_dict(state)
    tree = build_tree(lp, 30, torch.tensor([0, 0]))
    assert torch.equal(other.node_probs(tree), cal.node_probs(tree))
    assert int(other.rounds) == 10
    with pytest.raises(ValueError, match="config"):
        ScoreCalibrator(depth_limit=4).load_state_dict(state)
    cal.reset()
    assert float(cal.count.sum()) == 0 and int(cal.rounds) == 0
    assert torch.allclose(cal.node_probs(tree), raw_node_probs(tree), rtol=1e-5)
    json.dumps(other.export())


def test_calibrator_counts_host_requests_without_a_launch_until_read():
    """learn() with a host number of requests adds it to a host counter (one kernel launch fewer a learnt round);
    `rounds` folds it into the same device tensor when read, and reset() and load_state_dict() drop what is
    pending."""
    cal = ScoreCalibrator(depth_limit=4)
    delta = torch.zeros(cal._flat.shape, dtype=torch.float64)
    tensor = cal.rounds
    cal.learn(delta, 3)
    cal.learn(delta, torch.tensor(2.0))  # the tensor path adds on the device, after what is pending
    cal.learn(delta, 4)
    assert int(cal._rounds) == 5 and cal._pending_rounds == 4
    assert cal.rounds is tensor and int(cal.rounds) == 9 and cal._pending_rounds == 0
    cal.learn(delta, 7)
    cal.reset()
    assert int(cal.rounds) == 0
    cal.learn(delta, 6)
    state = {**cal.state_dict()}
    assert int(state["rounds"]) == 6
    cal.learn(delta, 1)
    cal.load_state_dict(state)
    assert int(cal.rounds) == 6


def test_calibrator_decay_and_active_mask():
    lp = _lp(2, 4, 10, seed=3)
    tree = build_tree(lp, 20, torch.tensor([0, 0]))
    path = torch.full((2, 5), -1)
    path[:, 0] = 0
    cal = ScoreCalibrator(depth_limit=4, half_life=1.0)
    cal.update(tree, path, active=torch.tensor([True, False]))
    n1 = float(cal.count.sum())
    assert n1 == pytest.approx(float(tree.valid[0, 1:].sum()))
    cal.update(tree, path, active=torch.tensor([True, False]))
    assert float(cal.count.sum()) == pytest.approx(n1 * 1.5)  # old mass halved, new mass added


def test_observation_is_pure_and_learning_it_equals_update():
    """The SGLang worker computes a round's observation inside CUDA graphs (whose warm-up and capture calls must
    not learn) and applies it afterwards: observation leaves the table alone, learn(observation) == update, padding
    rows included, and reset / load_state_dict keep the tensors a captured graph reads."""
    lp = _lp(3, 5, 12, seed=4)
    trained = _train(ScoreCalibrator(depth_limit=5), lp, rounds=4, wrong_after_branch=True, budget=24)
    twin = ScoreCalibrator(depth_limit=5)
    twin.load_state_dict(trained.state_dict())
    tree = build_tree(lp, 24, torch.zeros(3, dtype=torch.long))
    path = _synthetic_walk(tree, torch.Generator().manual_seed(9))
    active = torch.tensor([True, False, True])
    before = trained.state_dict()
    delta, expected = trained.observation(tree, path, active)
    assert all(torch.equal(before[k], trained.state_dict()[k]) for k in ("pred", "obs", "count", "rounds"))
    assert torch.allclose(expected, trained.expected(tree))
    ptrs = [t.data_ptr() for t in (trained.pred, trained.obs, trained.count, trained.rounds)]
    trained.learn(delta, active.sum())
    got = twin.update(tree, path, active)
    assert torch.allclose(got, expected)
    for k in ("pred", "obs", "count"):
        assert torch.allclose(getattr(trained, k), getattr(twin, k), rtol=1e-12, atol=1e-12), k
        assert not torch.equal(getattr(trained, k), before[k]), k  # it did learn
    assert int(trained.rounds) == int(twin.rounds) == int(before["rounds"]) + 2
    # the padding row taught nothing: its nodes are not among the observations
    assert float(delta[0].sum()) == pytest.approx(float((tree.valid & (tree.parents >= 0))[active].sum()))
    trained.load_state_dict(before)
    trained.reset()
    assert [t.data_ptr() for t in (trained.pred, trained.obs, trained.count, trained.rounds)] == ptrs
    assert float(trained.count.sum()) == 0 and int(trained.rounds) == 0


def test_summary_rows_are_the_exported_cells():
    cal = _train(ScoreCalibrator(depth_limit=4), _lp(2, 4, 10, seed=5), rounds=3, budget=20)
    rows = adaptive.summary_rows(cal.summary(), cal.config.prior_mass)
    assert rows == cal.export()["cells"] and rows
    assert sum(r["observations"] for r in rows) == pytest.approx(float(cal.count.sum()), abs=1e-2)


# ------------------------------------------------------------------------------------- calibrated selection


def _is_prefix_closed(t):
    for b in range(t.batch_size):
        for i in range(1, t.max_nodes):
            if t.valid[b, i]:
                p = int(t.parents[b, i])
                if not (0 <= p < i and t.valid[b, p]):
                    return False
    return True


@pytest.mark.parametrize("seed", range(4))
def test_calibrated_selection_is_prefix_closed_and_the_top_b_by_probability(seed):
    lp = _lp(2, 5, 9, seed=seed, quantize=0.5 if seed % 2 else None)
    tree = build_tree(lp, 80, torch.tensor([3, 4]))
    cal = _train(ScoreCalibrator(depth_limit=5, prior_mass=0.3), lp, rounds=6, seed=seed, wrong_after_branch=True)
    probs = cal.node_probs(tree)
    for b in (1, 5, 20, 50, 80):
        sub = select_by_probs(tree, probs, b)
        assert _is_prefix_closed(sub)
        for r in range(2):
            chosen = sorted(float(x) for x in cal.node_probs(sub)[r, 1:][sub.valid[r, 1:]])
            best = sorted(float(x) for x in probs[r, 1:][tree.valid[r, 1:]])[-b:]
            assert chosen == pytest.approx(best, rel=1e-6)
        # expected acceptance of candidate b with calibration = that tree's calibrated expectation
        e = expected_acceptance(tree, [b], calibrator=cal)
        assert torch.allclose(e[:, 0], cal.expected(sub), rtol=1e-5)
        # tokens/paths are preserved: each selected node's path is a path of the big tree
        assert set(zip(sub.tokens[0][sub.valid[0]].tolist(), sub.depth[0][sub.valid[0]].tolist())) <= \
            set(zip(tree.tokens[0][tree.valid[0]].tolist(), tree.depth[0][tree.valid[0]].tolist()))


def test_selection_by_raw_probabilities_is_the_first_slots():
    lp = _lp(2, 6, 7, seed=8, quantize=1.0)
    tree = build_tree(lp, 100, torch.tensor([0, 0]))
    for b in (1, 10, 64, 100):
        _assert_same_tree(select_by_probs(tree, raw_node_probs(tree), b), first_slots(tree, b))
    order = calibrated_order(tree, raw_node_probs(tree))
    assert torch.equal(order, torch.arange(tree.max_nodes).expand_as(order))


def test_propagation_is_exactly_monotone():
    lp = _lp(1, 8, 30, seed=12)
    tree = build_tree(lp, 200, torch.tensor([0]))
    q = torch.rand(tree.tokens.shape, generator=torch.Generator().manual_seed(0))
    q = torch.where(torch.rand(q.shape) < 0.3, 1.0, q)  # many exact 1s: children tie their parent
    p = propagate_along_paths(tree, q)
    parent = p.gather(1, tree.parents.clamp(min=0))
    assert (p[tree.valid] <= parent[tree.valid]).all()
    assert _is_prefix_closed(select_by_probs(tree, p, 120))


# ------------------------------------------------------------------------------------- round cost


def test_round_cost_from_the_committed_sweep():
    cost = RoundCost.from_sweep()
    cands = [CHAIN, 16, 64, 256]
    for b in (1, 4, 16, 64):
        fixed = [cost.fixed_ms(b, c) for c in cands]
        assert fixed[0] == pytest.approx(cost.dflash_step_ms[b])
        assert fixed[1:] == pytest.approx([cost.fit.predict(b, b * (c + 1)) for c in cands[1:]])
        with_overhead = cost.round_ms(b, cands)
        assert all(w >= f for w, f in zip(with_overhead, fixed))
        assert cost.round_ms(b, [64]) == pytest.approx([fixed[2]])  # one candidate: no decision, no overhead
        assert RoundCost(cost.fit, cost.dflash_step_ms, cost.kernels, overhead=False).round_ms(b, cands) == \
            pytest.approx(fixed)
        json.dumps(cost.describe(b, cands))
    # the decision's cost grows with B_max (tree build) and with the batch (top-K)
    assert cost.overhead_ms(1, CHAIN, [CHAIN, 256]) > cost.overhead_ms(1, CHAIN, [CHAIN, 16])
    assert cost.overhead_ms(64, CHAIN, [CHAIN, 16]) > cost.overhead_ms(1, CHAIN, [CHAIN, 16])
    # pruning: at batch 64 a 256-node tree costs far more than twice the chain
    assert round_cost.prune_candidates(cost, 64, cands) == [CHAIN, 16]
    assert round_cost.prune_candidates(cost, 1, cands) == cands


def test_kernel_cost_interpolation():
    k = round_cost.KernelCosts(topk_ms={1: {16: 1.0, 64: 2.0}, 8: {16: 8.0, 64: 16.0}},
                             tree_ms={1: {16: 0.5}, 8: {16: 1.5}})
    assert k.topk(1, 32) == pytest.approx(1 + 16 / 48)
    assert k.topk(4, 16) == pytest.approx(1 + 7 * 3 / 7)
    assert k.topk(15, 16) == pytest.approx(15.0)  # linear extrapolation in the batch
    assert k.topk(1, 8) == 1.0 and k.tree(1, 0) == 0.0
    assert k.extrapolated(15) and not k.extrapolated(4)


# ------------------------------------------------------------------------------------- counterfactuals, window


@pytest.mark.parametrize("seed", range(3))
def test_subtree_accept_lengths_equal_walking_each_subtree(seed):
    """T=0 counterfactual: the walk of the verified big tree tells what every best-b subtree (and the chain, when
    it lies inside the big tree) would have committed with the same target."""
    vocab, depth = 6, 5
    lp = _lp(3, depth, vocab, seed=seed, scale=1.5)
    roots = torch.tensor([0, 1, 2])
    big = build_tree(lp, 200, roots)
    # a target whose choice depends on the whole prefix: hash of the node's token path
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, vocab, (10007,), generator=g)

    def choices(tree):
        h = torch.zeros(tree.tokens.shape, dtype=torch.long)
        from sglang_ddtree.layout import ancestor_chain
        chain = ancestor_chain(tree)
        for k in range(chain.shape[2]):
            node = chain[:, :, k]
            tok = tree.tokens.gather(1, node.clamp(min=0))
            h = torch.where(node >= 0, (h * 31 + tok + 1) % 10007, h)
        # make the drafter's top-1 right most of the time so paths get deep
        top1 = topk_draft(lp, 1)[1][:, :, 0]
        d = tree.depth.clamp(max=depth - 1)
        agree = table[h] % 3 != 0
        return torch.where(agree, top1.gather(1, d), table[h] % vocab)

    budgets = [CHAIN, 1, 3, 10, 50, 200]
    got = adaptive.subtree_accept_lengths(big, walk_choices(big, choices(big)).path, budgets)
    assert int(got.max()) >= 3  # deep enough to mean something
    for j, b in enumerate(budgets):
        sub = chain_tree(lp, roots) if b == CHAIN else build_tree(lp, b, roots)
        want = walk_choices(sub, choices(sub)).commit_len
        if b == CHAIN:
            assert (got[:, j] <= want).all()  # lower bound; equal while the chain stays inside the big tree
            inside = [all(((big.tokens[r] == t) & (big.depth[r] == i + 1)).any() for i, t in
                          enumerate(sub.tokens[r, 1:].tolist())) for r in range(3)]
            assert all(int(got[r, j]) == int(want[r]) for r in range(3) if inside[r])
        else:
            assert torch.equal(got[:, j], want)


def test_candidate_window():
    cost = RoundCost.from_sweep()
    tau = {CHAIN: 2.9, 16: 3.6, 32: 3.95, 64: 4.2, 128: 4.45, 256: 4.7}
    cands = [CHAIN, 16, 32, 64, 128, 256]
    w1 = round_cost.candidate_window(cost, 1, cands, tau)
    rates = {b: tau[b] / cost.fixed_ms(1, b) for b in cands}
    best = max(rates.values())
    assert w1 == sorted({CHAIN} | {b for b in cands if rates[b] >= 0.95 * best})
    assert CHAIN in w1 and len(w1) >= 2
    # at batch 64 no tree budget is inside the measured verify range and within 5%: the chain alone, no decision
    assert round_cost.candidate_window(cost, 64, cands, tau) == [CHAIN]
    assert round_cost.candidate_window(cost, 1, cands, {}) == [CHAIN]
    assert round_cost.candidate_window(cost, 1, cands, tau, tolerance=1.0) == cands


def test_load_tau_prior(tmp_path):
    p = tmp_path / "prior.json"
    p.write_text(json.dumps({"chain": 2.5, "16": 3.5}))
    assert round_cost.load_tau_prior(p) == {CHAIN: 2.5, 16: 3.5}
    p.write_text(json.dumps({"runs": {"warmup": {"tau_prior": {"chain": 2.0, "64": 4.0}}}}))
    assert round_cost.load_tau_prior(p) == {CHAIN: 2.0, 64: 4.0}
    p.write_text("[]")
    with pytest.raises(ValueError):
        round_cost.load_tau_prior(p)


def test_calibration_prior_scripts_sparse_learner_learns_from_every_nth_update_only():
    """benchmarks/calibration_prior.py --learn-every N: its table learns from updates 1, N + 1, 2N + 1, ... (the
    server's sampled rounds) and predicts from what it learnt on the others, like a table that saw only those."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "calibration_prior", Path(__file__).resolve().parents[1] / "benchmarks" / "calibration_prior.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    lp = _lp(1, 5, 12, seed=3, scale=1.0)
    tree = build_tree(lp, 40, torch.tensor([0]))
    path = walk_choices(tree, torch.zeros_like(tree.tokens)).path
    sparse = script.sparse_learner(3, CalibratorConfig(depth_limit=5))
    dense = ScoreCalibrator(depth_limit=5)
    for k in range(7):
        before = sparse.expected(tree)
        assert torch.allclose(sparse.update(tree, path), before)  # what it predicted before this update
        if k % 3 == 0:
            dense.update(tree, path)
    assert int(sparse.rounds) == 3 and torch.equal(sparse.obs, dense.obs) and torch.equal(sparse.pred, dense.pred)
    young = script.sparse_learner(3, CalibratorConfig(depth_limit=5), young=2)  # learns at updates 1, 2, 3, 6
    for _ in range(7):
        young.update(tree, path)
    assert int(young.rounds) == 4
