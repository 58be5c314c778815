import math

import pytest
import torch

from sglang_ddtree.metrics import (
    JsonlWriter,
    RoundRecord,
    aggregate,
    prometheus_text,
    read_jsonl,
    records_from_round,
)
from sglang_ddtree.tree import build_tree
from sglang_ddtree.walk import walk_choices


def hand_tree():
    """Root 9 with children a (rank 0) and b (rank 1); a has child c (rank 0); b has child d (rank 0)."""
    lp = torch.full((1, 2, 4), float("-inf"))
    lp[0, 0, 1], lp[0, 0, 2] = math.log(0.6), math.log(0.4)  # depth 1: token 1 (rank 0), token 2 (rank 1)
    lp[0, 1, 3] = 0.0  # depth 2: token 3 is certain
    tree = build_tree(lp, 4, torch.tensor([9]))
    # canonical order: [root, 1 (0.6), 3 under 1 (0.6), 2 (0.4), 3 under 2 (0.4)]
    assert tree.tokens[0].tolist() == [9, 1, 3, 2, 3] and tree.parents[0].tolist() == [-1, 0, 1, 0, 3]
    return tree


def test_records_from_a_branching_round():
    tree = hand_tree()
    choice = torch.tensor([[2, 0, 0, 3, 0]])  # target picks the rank-1 branch, then its child, then bonus 0
    walk = walk_choices(tree, choice)
    (rec,) = records_from_round(tree, walk, budget=4, stage_ms={"tree": 0.5})
    assert rec.accept_len == 3 and rec.depth_reached == 2
    assert rec.branch_taken == [True, False]
    assert rec.tree_size == 4 and rec.max_depth == 2
    assert rec.expected_accept == pytest.approx(1 + 0.6 + 0.6 + 0.4 + 0.4, rel=1e-6)
    assert rec.stage_ms == {"tree": 0.5}


def test_aggregate_on_known_records():
    recs = [
        RoundRecord(accept_len=1, branch_taken=[], tree_size=4, max_depth=2, expected_accept=2.0, budget=8,
                    stage_ms={"verify": 2.0}),
        RoundRecord(accept_len=3, branch_taken=[True, False], tree_size=8, max_depth=3, expected_accept=3.0,
                    budget=8, stage_ms={"verify": 4.0}),
        RoundRecord(accept_len=2, branch_taken=[False], tree_size=6, max_depth=2, expected_accept=2.5, budget=8,
                    stage_ms={"verify": 3.0, "tree": 1.0}),
    ]
    s = aggregate(recs, depth_limit=3)
    assert s["rounds"] == 3 and s["tokens"] == 6 and s["tau"] == 2.0
    assert s["accept_len_hist"] == {"1": 1, "2": 1, "3": 1, "4": 0}
    assert s["accept_rate_by_depth"] == [2 / 3, 1 / 3, 0.0]
    assert s["conditional_accept_by_depth"] == [2 / 3, 0.5, 0.0]
    assert s["branch_accept_rate"] == 1 / 3  # 1 branch among 3 accepted nodes
    assert s["branch_rate_by_depth"][:2] == [0.5, 0.0] and math.isnan(s["branch_rate_by_depth"][2])
    assert s["mean_tree_size"] == 6.0 and s["tree_fill"] == pytest.approx(0.75)
    assert s["mean_expected_accept"] == 2.5
    assert s["stage_ms_mean"] == {"tree": 1 / 3, "verify": 3.0}
    assert aggregate([])["rounds"] == 0


def test_jsonl_round_trip_and_header_once(tmp_path):
    path = tmp_path / "d" / "dump.jsonl"
    rec = RoundRecord(accept_len=2, branch_taken=[True], tree_size=3, max_depth=1, expected_accept=1.5)
    with JsonlWriter(path, header={"budget": 3}) as w:
        w.write(rec.to_json())
        w.write({"tensor": torch.tensor([1, 2])})
    with JsonlWriter(path, header={"budget": 3}) as w:  # reopening appends, no second header
        w.write(rec.to_json())
    rows = read_jsonl(path)
    assert [r.get("type") for r in rows] == ["header", None, None, None]
    assert RoundRecord.from_json(rows[1]) == rec and rows[2]["tensor"] == [1, 2]


def test_prometheus_text_is_well_formed():
    recs = [RoundRecord(accept_len=2, branch_taken=[False], tree_size=3, max_depth=1, expected_accept=1.5,
                        stage_ms={"draft": 1.0, "verify": 2.0})]
    text = prometheus_text(aggregate(recs, depth_limit=2), labels={"budget": "64"})
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    names = [ln.split("{")[0] for ln in lines]
    assert 'ddtree_tau{budget="64"} 2.0' in lines
    assert 'ddtree_accept_rate_by_depth{budget="64",depth="1"} 1.0' in lines
    assert 'ddtree_stage_ms{budget="64",stage="verify"} 2.0' in lines
    helps = [ln.split()[2] for ln in text.splitlines() if ln.startswith("# HELP")]
    assert len(helps) == len(set(helps))  # one HELP per metric family
    assert set(names) <= {f"ddtree_{h}" for h in [h.removeprefix("ddtree_") for h in helps]}
