"""The DDTREE Prometheus series from one folded round vector (CPU: no CUDA needed for the arithmetic)."""

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from sglang_ddtree.sglang.stats import _Prometheus  # noqa: E402


def value(registry, name, **labels):
    return registry.get_sample_value(name, {"budget": "8", **labels})


def test_round_vector_becomes_counters():
    registry = prometheus_client.CollectorRegistry()
    prom = _Prometheus(depth_limit=3, budget=8, registry=registry)
    # 4 request-rounds: accepted draft tokens 0, 2, 2, 3 -> by_accepted = [1, 0, 2, 1]
    totals = [1, 0, 2, 1] + [2.0, 30.0, 9.5, 4.0]  # branches, tree nodes, expected sum, requests
    prom.observe(totals, rounds_seen=1, stage_ms=[{"draft": 1.0, "verify": 3.0}])
    assert value(registry, "sglang:ddtree_rounds_total") == 4
    assert value(registry, "sglang:ddtree_accepted_tokens_total") == 1 + 3 + 3 + 4
    assert [value(registry, "sglang:ddtree_accept_length_total", tokens=str(t)) for t in (1, 3, 4)] == [1, 2, 1]
    assert value(registry, "sglang:ddtree_accept_length_total", tokens="2") == 0  # exported, never incremented
    # at least d accepted: d=1 -> 3 rounds, d=2 -> 3, d=3 -> 1
    assert [value(registry, "sglang:ddtree_depth_reached_total", depth=str(d)) for d in (1, 2, 3)] == [3, 3, 1]
    assert value(registry, "sglang:ddtree_branch_accepted_total") == 2
    assert value(registry, "sglang:ddtree_tree_nodes_total") == 30
    assert value(registry, "sglang:ddtree_expected_tokens_total") == 9.5
    assert value(registry, "sglang:ddtree_stage_seconds_count", stage="verify") == 1
    assert value(registry, "sglang:ddtree_stage_seconds_sum", stage="verify") == pytest.approx(0.003)


def test_round_summary_vector_counts_rounds_by_accepted_length():
    import torch

    from sglang_ddtree.sglang.stats import round_summary_vector
    from sglang_ddtree.tree import build_tree_from_topk, topk_draft
    from sglang_ddtree.walk import walk_choices

    gen = torch.Generator().manual_seed(5)
    values, tokens = topk_draft((torch.randn(6, 4, 30, generator=gen) * 3).log_softmax(-1), 8)
    tree = build_tree_from_topk(values, tokens, 8, torch.zeros(6, dtype=torch.long), max_budget=8)
    choice = torch.where(torch.rand(tree.tokens.shape, generator=gen) < 0.5, tree.tokens,
                         torch.randint(0, 30, tree.tokens.shape, generator=gen))
    walk = walk_choices(tree, choice)
    vec = round_summary_vector(tree, walk)
    by_accepted = vec[: tree.depth_limit + 1]
    expect = torch.bincount(walk.accept_len, minlength=tree.depth_limit + 1).float()
    assert torch.equal(by_accepted, expect) and by_accepted.sum() == 6
    assert vec[-1] == 6 and vec[-3] == tree.num_nodes.sum() - 6
