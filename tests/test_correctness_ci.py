"""CI correctness check: the offline decoders on the committed tiny pair (CPU, float32, T=0; plain, the DFLASH chain
and DDTree at budgets 16, 64 and 256) against committed baselines, in our format and in the DDTree reference's file
shape, with `compare` under the exact rule: every difference in outputs, per-round accept lengths, per-round tree
hashes or the target's recorded top-2 gaps is a bug. See sglang_ddtree/offline/correctness.py for the set and why.

`pytest tests/test_correctness_ci.py --planted-bug deep_position` runs the same check with a planted decoder bug
switched on (any of sglang_ddtree.offline.planted_bugs.BUGS): it must fail.
"""

from __future__ import annotations

import pytest

from sglang_ddtree import tiny
from sglang_ddtree.offline import correctness as cc

pytestmark = pytest.mark.skipif(
    not (tiny.tiny_dir() / "target" / "model.safetensors").is_file()
    or not (tiny.tiny_dir() / "drafter" / "model.safetensors").is_file(),
    reason=f"the tiny pair is not built under {tiny.tiny_dir()}",
)


@pytest.fixture(scope="module")
def pair():
    return cc.TinyPair()


@pytest.fixture(scope="module")
def run(pair, request):
    return pair.decode(bug=request.config.getoption("--planted-bug"))


def _assert_passes(report):
    from sglang_ddtree.compare_report import format_report

    assert report["rule"]["name"] == "exact", report["rule"]
    assert report["passed"], format_report(report)
    assert cc.called_noise(report) == 0


def test_run_covers_deep_trees(run):
    """The check reaches the depth a deepest-node bug needs: full-depth rounds in every tree method."""
    for m in ("dflash", "ddtree_tb16", "ddtree_tb64", "ddtree_tb256"):
        recs = [r for r in run.records if r.method == m]
        assert sum(r.accept_lengths.count(run.header.block_size) for r in recs) >= len(recs), m
        assert all(r.tree_hashes and len(r.tree_hashes) == len(r.accept_lengths) for r in recs)


def test_matches_our_format_baseline(run):
    from sglang_ddtree.baseline import read_baseline

    base = read_baseline(cc.OURS_PATH)
    report = cc.check(run, {"ours": base})["ours"]
    _assert_passes(report)
    m = report["methods"]["ddtree_tb64"]
    assert m["prompts"] == len(cc.CHECK.prompt_indices) and m["tree_rounds_compared"] == len(
        [h for r in run.records if r.method == "ddtree_tb64" for h in r.tree_hashes])
    assert set(report["methods"]) == set(cc.CHECK.methods)


def test_matches_reference_format_baseline(run):
    ref = cc.load_reference_baseline()
    assert ref.header.dtype == "float32" and ref.header.device == "cpu"
    report = cc.check(run, {"reference": ref})["reference"]
    _assert_passes(report)
    assert set(report["methods"]) == set(cc.CHECK.reference_methods)
    assert all(m["matched_by"] == "prompt token hash" for m in report["methods"].values())
    # the reference names its prompts "0", "1", ...: paired by tokens, not names
    assert ref.prompt_ids("plain") == [str(i) for i in range(len(cc.CHECK.prompt_indices))]
    # plain runs to the length limit, so every reference record of it ends with the extra final round
    assert report["methods"]["plain"]["reference_extra_final_rounds"]["baseline"] == len(cc.CHECK.prompt_indices)
    assert report["methods"]["ddtree_tb16"]["tree_rounds_compared"] > 0


def test_matches_the_wide_offline_baseline(run):
    """The 40-prompt, all-budget offline baseline (the roadmap's offline tau figures): the prompts and methods it shares
    with the check."""
    from sglang_ddtree.baseline import read_baseline

    wide = read_baseline(cc.WIDE_PATH)
    report = cc.check(run, {"wide": wide})["wide"]
    _assert_passes(report)
    assert all(m["prompts"] == len(cc.CHECK.prompt_indices) for m in report["methods"].values())


def test_ten_prompt_reference_style_file_compares_without_flags(tmp_path):
    """A reference-style .pt (no dtype or device recorded, prompts named 0..9, tree traces, extra final rounds)
    against our baseline file on the same prompts: `sglang-ddtree compare REF.pt OURS.jsonl` with no option."""
    import argparse

    import torch

    from sglang_ddtree.baseline import write_baseline
    from sglang_ddtree.offline.cli_commands import add_compare_parser

    s = cc.CheckSettings(prompt_indices=tuple(range(10)), methods=("plain", "ddtree_tb16"),
                         reference_methods=("plain", "ddtree_tb16"), max_new_tokens=32)
    pair = cc.TinyPair(s)
    ours = pair.decode()
    write_baseline(tmp_path / "ours.jsonl", ours.header, ours.records)
    block = int(pair.drafter.config.block_size)
    long_run = pair.decode(max_new_tokens=s.max_new_tokens + block, record_trees=True)
    ref = cc.export_reference_style(long_run, pair.prompts, s.max_new_tokens, block, s.methods,
                                    stop_token_ids=pair.eos,
                                    args={"dataset": "humaneval", "max_new_tokens": s.max_new_tokens,
                                          "temperature": 0.0, "tree_budget": "16"})
    torch.save(ref, tmp_path / "ref.pt")
    parser = argparse.ArgumentParser()
    add_compare_parser(parser.add_subparsers())
    args = parser.parse_args(["compare", str(tmp_path / "ref.pt"), str(tmp_path / "ours.jsonl"),
                              "--json", str(tmp_path / "r.json")])
    assert args.func(args) == 0
    import json

    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["passed"] and rep["overall"]["exact_match"] == 20
    # honest metadata: the file does not say its dtype, so the float32 side's own top-2 gaps judge any difference
    assert rep["baseline"]["dtype"] is None and rep["rule"]["name"] == "float32-tie"
    assert rep["rule"]["float32_side"] == "candidate"
    assert all(m["prompts"] == 10 and m["matched_by"] == "prompt token hash" for m in rep["methods"].values())
    assert rep["methods"]["plain"]["reference_extra_final_rounds"]["baseline"] == 10
