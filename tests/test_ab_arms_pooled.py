"""benchmarks/ab_arms_pooled.py: the per-arm reading of `tiny-ab` sweeps that docs/gpu-suite.md's tables quote."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "scripts"))

import ab_arms_pooled  # noqa: E402


def _row(label, narrower, rounds):
    setup, method = label.split("|")
    return {"kind": "result", "ab_runs": [{}], "setup": setup, "method": method, "budget": None, "batch_size": 4,
            "ddtree_metrics": {"ab": {"ratio": 0.9, "auto": {"rounds": rounds, "narrower_rounds": narrower}}}}


def test_locked_rows_are_those_above_the_share_of_the_arms_servers():
    rows = [_row("tiny-e1|auto", 31, 100), _row("tiny-e2|auto", 30, 100), _row("tiny-s1|auto", 90, 100),
            {"kind": "run"}]
    locked = ab_arms_pooled.locked_rows(rows, {"tiny-e1|auto", "tiny-e2|auto"}, 0.3)
    assert [(r["server"], r["narrower_rounds"]) for r in locked] == [("tiny-e1|auto", 31)]


def test_arms_of_three_runs_match_the_committed_file(tmp_path):
    results = ROOT / "benchmarks" / "results"
    sweeps = [str(results / f"sweep_ab_tiny_run{i}_2026-12-02_468f487.jsonl") for i in (1, 2, 3)]
    out = tmp_path / "arms.json"
    assert ab_arms_pooled.main(sweeps + ["--arm", "e=tiny-e", "--arm", "s=tiny-s", "--arm", "d=tiny-d",
                                         "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["arms"] == json.loads((results / "ab_arms_pooled_2026-12-02_63ca041.json").read_text())["arms"]
    assert [len(got["arms"][a]["servers"]) for a in "esd"] == [8, 8, 4]
    # the as-it-is arm's servers are the headline's (the three run files'), each pooled ratio within its servers' runs
    summary = json.loads((results / "summary.json").read_text())["sglang_auto_ab"]
    headline = sorted(label for name in ("sweep_ab_tiny_run1_2026-12-02_468f487.jsonl", "sweep_ab_tiny_run2_2026-12-02_468f487.jsonl",
                                         "sweep_ab_tiny_run3_2026-12-02_468f487.jsonl")
                      for label, entry in summary[name].items() if entry["arm"] == "as it is")
    assert got["arms"]["e"]["servers"] == headline
    for bs, pooled in got["arms"]["e"]["pooled"].items():
        own = [summary[name][label]["by_batch_size"][bs]["runs"]["ratio"] for name in summary
               if name.endswith("_2026-12-02_468f487.jsonl") for label in summary[name] if label in headline]
        assert min(own) - 1e-3 <= pooled["ratio"] <= max(own) + 1e-3


def test_headline_file_is_the_summary_headline_with_its_intervals():
    """ab_arms_pooled_headline.json (the intervals README and the docs quote) pools the same servers as the summary's
    headline (sglang_auto_ab_over_fixed_128_tiny) and reads the same ratios."""
    import make_summary

    results = ROOT / "benchmarks" / "results"
    summary = json.loads((results / "summary.json").read_text())
    arm = json.loads((results / "ab_arms_pooled_headline.json").read_text())
    assert arm["sweeps"] == make_summary.figure_sources("sglang_auto_ab", headline=True)
    e = arm["arms"]["e"]
    assert f"`auto` as it is: {e['server_count']} servers" in summary["sglang_auto_ab_over_fixed_128_tiny_source"]
    for bs, ratio in summary["sglang_auto_ab_over_fixed_128_tiny"].items():
        pooled = e["pooled"][bs]
        assert round(pooled["ratio"], 4) == ratio and pooled["ci95"][0] < ratio < pooled["ci95"][1]
