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
