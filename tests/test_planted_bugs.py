"""Planted decoder bugs (sglang_ddtree/offline/planted_bugs.py) through the CI correctness check: each is reported as
a bug, never as noise, against the committed baselines in our format and in the reference's file shape, and the
report names the first bad prompt and round, which this test finds on its own from the records. The clean decoder
passes the same comparisons in tests/test_correctness_ci.py."""

from __future__ import annotations

import math

import pytest

from sglang_ddtree import tiny
from sglang_ddtree.offline import correctness as cc
from sglang_ddtree.offline.planted_bugs import BUGS, planted

pytestmark = pytest.mark.skipif(
    not (tiny.tiny_dir() / "target" / "model.safetensors").is_file()
    or not (tiny.tiny_dir() / "drafter" / "model.safetensors").is_file(),
    reason=f"the tiny pair is not built under {tiny.tiny_dir()}",
)

METHODS = ("ddtree_tb16", "ddtree_tb64")


@pytest.fixture(scope="module")
def pair():
    return cc.TinyPair()


@pytest.fixture(scope="module")
def baselines():
    from sglang_ddtree.baseline import read_baseline

    return {"ours": read_baseline(cc.OURS_PATH), "reference": cc.load_reference_baseline()}


def _round(rec, pos):
    r = rec.round_of_position(pos)
    return -1 if r is None else r


def first_difference(base, cand, tol):
    """Earliest candidate round at which `cand` differs from `base` in anything both record, or None."""
    rounds = []
    n = min(len(base.output_ids), len(cand.output_ids))
    pos = next((i for i in range(n) if base.output_ids[i] != cand.output_ids[i]), None)
    if pos is None and len(base.output_ids) != len(cand.output_ids):
        pos = n
    if pos is not None:
        rounds.append(_round(cand, pos))
    rounds += [r for r, (a, b) in enumerate(zip(base.accept_lengths, cand.accept_lengths)) if a != b][:1]
    from sglang_ddtree.baseline import round_tree_hashes

    hb, hc = round_tree_hashes(base), round_tree_hashes(cand)
    if hb is not None and hc is not None:
        rounds += [r for r, (a, b) in enumerate(zip(hb, hc)) if a is not None and b is not None and a != b][:1]
    if base.margins is not None and cand.margins is not None:
        rounds += [_round(cand, i) for i, (a, b) in enumerate(zip(base.margins, cand.margins))
                   if math.isfinite(a) and math.isfinite(b) and abs(a - b) > tol][:1]
    return min(rounds) if rounds else None


def test_planted_bug_name_is_checked():
    with pytest.raises(ValueError, match="unknown planted bug"):
        with planted("nope"):
            pass


@pytest.mark.parametrize("bug", BUGS)
def test_planted_bug_is_a_bug_not_noise(pair, baselines, bug):
    run = pair.decode(METHODS, bug=bug)
    reports = cc.check(run, baselines, methods=list(METHODS))
    for name, rep in reports.items():
        assert rep["rule"]["name"] == "exact"
        assert not rep["passed"], (bug, name)
        assert cc.called_noise(rep) == 0, (bug, name)
        base = baselines[name]
        for m in METHODS:
            r = rep["methods"][m]
            # the first bad prompt and round, found independently
            expected = None
            for b in (x for x in base.records if x.method == m):
                c = next(x for x in run.records if x.method == m and x.prompt_sha256 == b.prompt_sha256)
                first = first_difference(b, c, rep["thresholds"]["exact_tol"])
                if first is not None:
                    expected = (c.prompt_id, first)
                    break
            if expected is None:
                assert r["passed"], (bug, name, m)
                continue
            fb = r["first_bug"]
            names = (expected[0], f"(candidate: {expected[0]})")  # the reference names prompts by index
            assert fb is not None and (fb["prompt_id"] == names[0] or fb["prompt_id"].endswith(names[1])) and fb["round"] == expected[1], \
                (bug, name, m, fb, expected)
            assert f"prompt {fb['prompt_id']} round {fb['round']}" in r["failures"][0]
        assert any(rep["methods"][m]["first_bug"] for m in METHODS)
