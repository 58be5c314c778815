"""The Grafana dashboard (dashboards/sglang-ddtree.json) against a real Prometheus.

Recorded rounds (tests/fixtures/recorded_rounds_tiny.jsonl: the offline decoders on the tiny pair, DDTree at budget
64 and `ddtree_auto`, 4 HumanEval prompts) are fed into the server's Prometheus series (sglang/prometheus.py, through
sglang_ddtree.dashboard.ReplayServer) of two servers, each served over HTTP on 127.0.0.1; a `prometheus` process
started here scrapes both every second; then every panel's query is evaluated through Prometheus's HTTP API and
must return data, and the main ones the values the recorded rounds give. Everything runs on loopback and is stopped
at the end (Prometheus: terminate, then kill after 10 s).

Needs Debian's `prometheus` binary: scripts/setup.sh installs it (scripts/install_prometheus.sh) when run as root
with apt-get, and where both are available a missing binary fails the test instead of skipping it; elsewhere it
skips.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

import pytest

from sglang_ddtree.dashboard import (DASHBOARD_PATH, BUDGET_VARIABLE_QUERY, PrometheusServer, ReplayServer,
                                     dashboard_json, finite_values, panel_targets, prometheus_binary, replay_rounds,
                                     round_vector, substitute)
from sglang_ddtree.metrics import aggregate

prometheus_client = pytest.importorskip("prometheus_client")

FIXTURE = Path(__file__).parent / "fixtures" / "recorded_rounds_tiny.jsonl"


def test_the_committed_dashboard_is_the_panel_list():
    assert DASHBOARD_PATH.read_text() == dashboard_json(), "run python scripts/make_dashboard.py"
    dash = json.loads(DASHBOARD_PATH.read_text())
    titles = [p["title"] for p in dash["panels"]]
    for wanted in ("tau", "Per-depth acceptance", "Branch acceptance", "auto: chosen budget", "Stage time"):
        assert any(t.startswith(wanted) for t in titles), wanted
    assert len({p["id"] for p in dash["panels"]}) == len(titles)


def test_round_vector_is_the_servers_round_summary_vector():
    """The replay folds a round's records into the vector the worker builds on the GPU (round_summary_vector)."""
    import torch

    from sglang_ddtree.metrics import records_from_round
    from sglang_ddtree.sglang.stats import round_summary_vector
    from sglang_ddtree.tree import build_tree_from_topk, topk_draft
    from sglang_ddtree.walk import walk_choices

    gen = torch.Generator().manual_seed(3)
    values, tokens = topk_draft((torch.randn(5, 6, 12, generator=gen) * 0.7).log_softmax(-1), 12)
    tree = build_tree_from_topk(values, tokens, 40, torch.zeros(5, dtype=torch.long), max_budget=40)
    choice = torch.randint(0, 12, tree.tokens.shape, generator=gen)
    for b in range(5):  # follow a random child at every node: walks that branch
        for i in range(tree.tokens.shape[1]):
            children = ((tree.parents[b] == i) & tree.valid[b]).nonzero().view(-1)
            if len(children):
                choice[b, i] = tree.tokens[b, children[torch.randint(0, len(children), (1,), generator=gen)]]
    walk = walk_choices(tree, choice)
    records = records_from_round(tree, walk)
    assert sum(sum(r.branch_taken) for r in records) > 0
    assert round_vector(records, tree.depth_limit) == pytest.approx(round_summary_vector(tree, walk).tolist())


def _by(result, *labels):
    return {tuple(s["metric"].get(k) for k in labels): float(s["value"][1]) for s in result}


@pytest.mark.slow
def test_every_panel_query_returns_data_from_a_real_prometheus(tmp_path):
    if prometheus_binary() is None:
        if shutil.which("apt-get") and os.geteuid() == 0:  # it can be had here: CI must run this test, not skip it
            pytest.fail("no `prometheus` binary on PATH although apt-get and root are available: run "
                        "scripts/setup.sh (or scripts/install_prometheus.sh) first")
        pytest.skip("no `prometheus` binary on PATH and no way to install it here (needs root and apt-get: "
                    "scripts/install_prometheus.sh)")
    started = time.monotonic()
    fixed, depth_limit = replay_rounds(FIXTURE, "ddtree_tb64")
    auto, _ = replay_rounds(FIXTURE, "ddtree_auto")
    servers = {"64": (ReplayServer("64", depth_limit, num_draft_tokens=65), fixed),
               "auto": (ReplayServer("auto", depth_limit, num_draft_tokens=257), auto)}
    try:
        targets = [srv.serve() for srv, _ in servers.values()]
        with PrometheusServer(targets, tmp_path / "prometheus", scrape_interval="1s") as prom:
            # the counters exist at 0 before the first round, as on a server that has just started
            prom.wait_for("sglang:ddtree_rounds_total", lambda r: len(r) == 2 and not any(finite_values(r)))
            slices = 8
            for k in range(slices):  # rounds arrive over ~4 s: several scrapes see the counters grow
                for srv, rounds in servers.values():
                    n = len(rounds)
                    for batch in rounds[k * n // slices:(k + 1) * n // slices]:
                        srv.feed(batch)
                time.sleep(0.5)
            for srv, _ in servers.values():
                srv.flush()
            want_rounds = {(label,): float(len(rounds)) for label, (_, rounds) in servers.items()}
            prom.wait_for("sglang:ddtree_stage_host_rounds_total",
                          lambda r: _by(r, "budget") == want_rounds)
            prom.wait_for("sum(sglang:ddtree_auto_rounds_total)", lambda r: finite_values(r) == [float(len(auto))])
            assert all(t["health"] == "up" for t in prom.scrape_targets_up())

            # every query of every panel returns finite data
            dash = json.loads(DASHBOARD_PATH.read_text())
            queries = panel_targets(dash)
            assert len(queries) >= 10
            empty = [f"{title} [{ref}]: {expr}" for title, ref, expr, _ in queries
                     if not finite_values(prom.query(substitute(expr)))]
            assert not empty, "panel queries that returned nothing:\n" + "\n".join(empty)
            assert prom.api("label/budget/values", **{"match[]": "sglang:ddtree_rounds_total"})["data"] == \
                ["64", "auto"], BUDGET_VARIABLE_QUERY
            # the budget variable narrows every ddtree panel to one server
            one = [(t, r, e) for t, r, e, _ in queries if "$budget" in e]
            for title, ref, expr in one:
                budgets = {s["metric"].get("budget") for s in prom.query(substitute(expr, budget="64"))}
                assert budgets <= {"64", None}, (title, ref, budgets)

            # ... and the values the recorded rounds give
            q = {(t, r): e for t, r, e, _ in queries}
            for label, (_, rounds) in servers.items():
                summary = aggregate([rec for b in rounds for rec in b.records], depth_limit=depth_limit)
                tau = _by(prom.query(substitute(q["tau: tokens per verify round", "A"])), "budget")
                assert tau[(label,)] == pytest.approx(summary["tau"], rel=1e-6)
                depth = _by(prom.query(substitute(q["Per-depth acceptance: P(a round accepts >= d draft tokens)",
                                                    "A"])), "budget", "depth")
                assert [depth[(label, str(d))] for d in range(1, depth_limit + 1)] == \
                    pytest.approx(summary["accept_rate_by_depth"], rel=1e-6)
                branch = _by(prom.query(substitute(q["Branch acceptance: accepted draft tokens off the drafter's "
                                                     "top-1", "A"])), "budget")
                assert branch[(label,)] == pytest.approx(summary["branch_accept_rate"], rel=1e-6)
            chosen = _by(prom.query(substitute(q["auto: chosen budget (share of batch rounds)", "A"])), "candidate")
            assert {c for (c,) in chosen} == {b.candidate for b in auto}
            assert sum(chosen.values()) == pytest.approx(1.0)
            stages = _by(prom.query(substitute(q["Stage time per batch round (GPU, mean)", "A"])), "stage")
            # the offline decoders have no `between` (its series exists, at 0 rounds: NaN, a gap in Grafana)
            assert {s for (s,), v in stages.items() if math.isfinite(v)} == {"draft", "tree", "verify", "walk",
                                                                               "commit"}
    finally:
        for srv, _ in servers.values():
            srv.close()
    assert time.monotonic() - started < 60
