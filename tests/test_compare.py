"""The comparator: identical files pass; planted bugs (a corrupted tree, a changed token, a walk that accepts a
different length on the same tree, a lossless walk that accepts one token fewer) fail with the right round/position
or on tau; near-ties and sampled runs' token differences don't fail; bad input files are named in one sentence.
Sampled runs' distributions: tests/test_compare_sampled.py."""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import pytest

from fixtures.offline_models import OracleDraft, one_thread, random_target
from sglang_ddtree.baseline import Baseline, BaselineHeader, MethodRecord, read_baseline, write_baseline
from sglang_ddtree.compare import Thresholds, compare, compare_trees, paired_bootstrap_tau
from sglang_ddtree.compare_report import format_report
from sglang_ddtree.offline.cli_commands import add_compare_parser
from sglang_ddtree.offline.runner import PromptInput, RunSettings, decode_one

FIXTURES = Path(__file__).parent / "fixtures"
METHODS = ["plain", "dflash", "ddtree_tb16"]


@pytest.fixture(scope="module")
def reference_file(tmp_path_factory):
    """A real offline run (tiny random target, oracle drafts, trees recorded)."""
    with one_thread():
        target = random_target(seed=2)
        settings = RunSettings(methods=METHODS, max_new_tokens=30, record_trees=True)
        prompts = [PromptInput(f"p{i}", i, [3 + i, 9, 27 + i, 4, 17]) for i in range(3)]
        records = [decode_one(target, OracleDraft(target, noise=0.5, seed=1), p, m, settings)
                   for p in prompts for m in METHODS]
    header = BaselineHeader(source="offline", target={"path": None, "fingerprint": "t"}, dtype="float32",
                            device="cpu", max_new_tokens=30, block_size=16, dataset="synthetic")
    path = tmp_path_factory.mktemp("cmp") / "reference.jsonl"
    write_baseline(path, header, records)
    return path


def _run_cli(*argv) -> int:
    parser = argparse.ArgumentParser()
    add_compare_parser(parser.add_subparsers())
    args = parser.parse_args(["compare", *map(str, argv)])
    return args.func(args)


def _edit(src: Path, dst: Path, fn) -> Path:
    """Rewrite a baseline file line by line as JSON (what a foreign, possibly buggy writer could produce)."""
    lines = src.read_text().splitlines()
    out = [lines[0]]
    for line in lines[1:]:
        d = json.loads(line)
        fn(d)
        out.append(json.dumps(d))
    dst.write_text("\n".join(out) + "\n")
    return dst


def test_identical_files_pass(reference_file, tmp_path, capsys):
    assert _run_cli(reference_file, reference_file, "--min-match-rate", "1", "--max-tau-drop", "0",
                    "--json", tmp_path / "r.json") == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["passed"] and report["overall"]["match_rate"] == 1.0
    m = report["methods"]["ddtree_tb16"]
    assert m["tree_rounds_compared"] > 0 and m["tree_difference_counts"] == {}
    assert m["tau"]["diff"] == 0 and m["tau"]["diff_ci95"] == [0.0, 0.0]
    assert m["tau"]["baseline"] > 1.5  # the oracle drafts get accepted: a meaningful tau
    assert "PASS" in capsys.readouterr().out


def _swap_parents(tree) -> tuple[int, int]:
    """Swap the parents of two same-depth nodes with different parents, keeping parents before children."""
    parents = tree["parents"]
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    for b in range(1, len(parents)):
        for a in range(1, b):
            if depth[a] == depth[b] and parents[a] != parents[b] and parents[b] < a:
                parents[a], parents[b] = parents[b], parents[a]
                return a, b
    raise AssertionError("no swappable pair")


def test_corrupted_tree_is_reported_at_its_round(reference_file, tmp_path, capsys):
    base = read_baseline(reference_file)
    rec = base.get("p1", "ddtree_tb16")
    bad_round = next(r for r, t in enumerate(rec.trees) if r >= 2 and len(t["tokens"]) > 8)
    swapped = {}

    def corrupt(d):
        if d["prompt_id"] == "p1" and d["method"] == "ddtree_tb16":
            swapped["nodes"] = _swap_parents(d["trees"][bad_round])

    cand = _edit(reference_file, tmp_path / "cand.jsonl", corrupt)
    assert _run_cli(reference_file, cand, "--json", tmp_path / "r.json") == 1
    report = json.loads((tmp_path / "r.json").read_text())
    first = report["methods"]["ddtree_tb16"]["first_tree_difference"]
    assert first["prompt_id"] == "p1" and first["round"] == bad_round and first["class"] == "bug"
    assert first["node"] == swapped["nodes"][0] and first["fields"] == ["parents"]
    assert report["methods"]["dflash"]["passed"] and report["methods"]["plain"]["passed"]
    assert f"round {bad_round}" in capsys.readouterr().out


def test_malformed_tree_is_reported_not_refused(reference_file, tmp_path):
    def corrupt(d):
        if d["prompt_id"] == "p0" and d["method"] == "ddtree_tb16":
            d["trees"][1]["parents"][1] = 5  # parent after its child
    cand = _edit(reference_file, tmp_path / "cand.jsonl", corrupt)
    report = compare(read_baseline(reference_file), read_baseline(cand))
    first = report["methods"]["ddtree_tb16"]["first_tree_difference"]
    assert not report["passed"] and first["round"] == 1 and "malformed" in first["reason"]


def test_corrupted_token_is_reported_at_its_position(reference_file, tmp_path):
    base = read_baseline(reference_file)
    rec = base.get("p2", "ddtree_tb16")
    pos = next(i for i in range(5, len(rec.output_ids)) if rec.margins[i] > 0.5)

    def corrupt(d):
        if d["prompt_id"] == "p2" and d["method"] == "ddtree_tb16":
            d["output_ids"][pos] = (d["output_ids"][pos] + 1) % 64

    cand = read_baseline(_edit(reference_file, tmp_path / "cand.jsonl", corrupt))
    report = compare(base, cand)
    m = report["methods"]["ddtree_tb16"]
    assert not report["passed"] and m["exact_match"] == 2 and m["divergence_counts"] == {"bug": 1}
    d = m["divergences"][0]
    assert d["prompt_id"] == "p2" and d["position"] == pos
    assert d["candidate_round"] == rec.round_of_position(pos)
    assert f"position {pos}" in " ".join(report["failures"])
    # the same change at a near-tie: both files are float32 runs of exact decoders, so it is still a bug ...
    base.get("p2", "ddtree_tb16").margins[pos] = 1e-5
    cand.get("p2", "ddtree_tb16").margins[pos] = 1e-5
    report = compare(base, cand, thresholds=Thresholds(noise_margin=1e-3))
    assert report["rule"]["name"] == "exact" and report["methods"]["ddtree_tb16"]["divergence_counts"] == {"bug": 1}
    # ... while a bf16 candidate against the float32 baseline may tie there (the float32 side's own gap is tiny)
    cand.header.dtype = "bfloat16"
    report = compare(base, cand, thresholds=Thresholds(noise_margin=1e-3))
    assert report["rule"] == {**report["rule"], "name": "float32-tie", "float32_side": "baseline"}
    assert report["methods"]["ddtree_tb16"]["divergence_counts"] == {"noise": 1}
    assert report["methods"]["ddtree_tb16"]["passed"]
    assert not compare(base, cand, thresholds=Thresholds(noise_margin=1e-3, min_match_rate=1.0))["passed"]
    base.get("p2", "ddtree_tb16").margins[pos] = 2e-3  # the float32 model's own gap is above the threshold: a bug
    assert compare(base, cand, thresholds=Thresholds(noise_margin=1e-3))["methods"]["ddtree_tb16"][
        "divergence_counts"] == {"bug": 1}


def test_walk_bug_on_identical_tree_fails(reference_file, tmp_path):
    base = read_baseline(reference_file)
    rec = base.get("p0", "ddtree_tb16")
    r = next(i for i, a in enumerate(rec.accept_lengths[:-1]) if a >= 2)

    def corrupt(d):  # same tokens and trees; the walk "accepted" one token less in round r
        if d["prompt_id"] == "p0" and d["method"] == "ddtree_tb16":
            d["accept_lengths"][r] -= 1
            d["accept_lengths"][r + 1] += 1
            d["accepted_ranks"][r] = d["accepted_ranks"][r][:-1]
            d["accepted_ranks"][r + 1] = [0] + d["accepted_ranks"][r + 1]

    report = compare(base, read_baseline(_edit(reference_file, tmp_path / "cand.jsonl", corrupt)))
    m = report["methods"]["ddtree_tb16"]
    assert not m["passed"] and m["accept_len_differences"][0]["round"] == r
    assert m["accept_len_differences"][0]["trees_identical"]


def _synthetic(pid, accepts, temperature=0.0, out=None):
    n = sum(accepts) + 1
    return MethodRecord(prompt_id=pid, method="ddtree_tb8", output_ids=out or list(range(2, 2 + n)),
                        accept_lengths=accepts, num_input_tokens=4)


def _bl(records, temperature=0.0):
    return Baseline(BaselineHeader(source="test", target={"path": None}, temperature=temperature), records)


def test_tau_difference_and_interval():
    base = _bl([_synthetic(f"p{i}", [3] * (5 + i)) for i in range(8)])
    same = compare(base, base)["methods"]["ddtree_tb8"]["tau"]
    assert same["diff"] == 0 and same["diff_ci95"] == [0.0, 0.0]
    sums = [3 * (5 + i) for i in range(8)]  # same outputs, cut into shorter rounds
    worse = _bl([_synthetic(f"p{i}", [2] * (s // 2) + [1] * (s % 2)) for i, s in enumerate(sums)])
    tau = compare(base, worse, thresholds=Thresholds(min_match_rate=None))["methods"]["ddtree_tb8"]["tau"]
    assert tau["baseline"] == 3.0 and tau["candidate"] < 2.2
    lo, hi = tau["diff_ci95"]
    assert lo <= tau["diff"] <= hi < 0
    assert not compare(base, worse, thresholds=Thresholds(max_tau_drop=0.5))["passed"]
    rep = compare(base, worse, thresholds=Thresholds(max_tau_drop=2.0))
    assert rep["passed"], rep["failures"]  # same tokens, different rounds: only tau differs
    # paired bootstrap: a constant shift per prompt has a tight interval even with very different prompts
    b = [_synthetic(f"q{i}", [1 + i % 5] * 10) for i in range(10)]
    c = [_synthetic(f"q{i}", [1 + i % 5] * 9 + [2 + i % 5]) for i in range(10)]
    t = paired_bootstrap_tau(b, c, n_boot=500, seed=1)
    assert t["diff_ci95"][1] - t["diff_ci95"][0] < 0.05 and t["diff"] == pytest.approx(0.1)


def test_sampled_runs_report_divergences_without_failing():
    base = _bl([_synthetic("p0", [2, 2], out=[1, 2, 3, 4, 5])], temperature=1.0)
    cand = _bl([_synthetic("p0", [2, 2], out=[1, 2, 9, 4, 5])], temperature=1.0)
    rep = compare(base, cand)
    assert rep["passed"] and rep["methods"]["ddtree_tb8"]["divergence_counts"] == {"sampled": 1}
    greedy = compare(_bl(base.records), _bl(cand.records))
    assert greedy["methods"]["ddtree_tb8"]["divergence_counts"] == {"unknown": 1}


def test_prompt_mismatch_and_missing_method_fail():
    a = _bl([_synthetic("p0", [2, 2])])
    other = _synthetic("p0", [2, 2])
    other.num_input_tokens = 9
    rep = compare(a, _bl([other]))
    assert not rep["passed"] and "not the same prompt" in rep["failures"][0]
    rep = compare(a, a, methods=["dflash"])
    assert not rep["passed"] and "not in the baseline" in rep["failures"][0]


def test_tree_classification():
    base = {"tokens": [7, 1, 2, 3, 4], "parents": [-1, 0, 0, 1, 1], "scores": [0.0, -0.1, -0.5, -0.9, -1.2]}
    assert compare_trees(base, copy.deepcopy(base), 1e-3) is None
    cut = copy.deepcopy(base)
    cut["tokens"][4], cut["scores"][4] = 5, -1.2001  # another node exactly at the budget cut
    assert compare_trees(base, cut, 1e-3)["class"] == "noise"
    high = copy.deepcopy(base)
    high["tokens"][2] = 6  # a high-scoring depth-1 node replaced
    assert compare_trees(base, high, 1e-3)["class"] == "bug"
    drift = copy.deepcopy(base)
    drift["scores"][3] = -0.7
    d = compare_trees(base, drift, 1e-3)
    assert d["class"] == "bug" and d["fields"] == ["scores"] and d["node"] == 3
    tie = {"tokens": [7, 1, 2, 3, 4], "parents": [-1, 0, 0, 1, 1], "scores": [0.0, -0.1, -0.5, -1.0, -1.0]}
    swapped = {"tokens": [7, 1, 2, 4, 3], "parents": [-1, 0, 0, 1, 1], "scores": [0.0, -0.1, -0.5, -1.0, -1.0]}
    assert compare_trees(tie, swapped, 1e-3)["class"] == "noise"
    dup = {"tokens": [7, 1, 1], "parents": [-1, 0, 0], "scores": [0.0, -0.1, -0.2]}
    assert "repeats" in compare_trees({"tokens": [7, 1, 2], "parents": [-1, 0, 0], "scores": [0, -0.1, -0.2]},
                                      dup, 1e-3)["reason"]


def test_reference_import_compares_with_itself(tmp_path):
    ref = FIXTURES / "reference_small.pt"
    assert _run_cli(ref, ref) == 0
    assert _run_cli(ref, tmp_path / "missing.jsonl") == 2


def test_report_text_has_a_table_and_histograms(reference_file):
    text = format_report(compare(read_baseline(reference_file), read_baseline(reference_file)))
    assert "ddtree_tb16" in text and "P(reach)" in text and "overall: 9/9 exact matches; PASS" in text


def test_a_walk_that_stops_one_node_short_fails_on_tau_alone(reference_file, tmp_path):
    """Planted bug walk_one_short: the output is the target's (lossless) but every round accepts one token fewer.
    With the margin rule and no trees nothing token- or round-level is judged a bug; the tau interval is."""
    from sglang_ddtree.offline.planted_bugs import planted

    base = read_baseline(reference_file)
    with one_thread(), planted("walk_one_short"):
        target = random_target(seed=2)
        settings = RunSettings(methods=METHODS, max_new_tokens=30, record_trees=True)
        records = [decode_one(target, OracleDraft(target, noise=0.5, seed=1), PromptInput(f"p{i}", i, p.token_ids), m,
                              settings)
                   for i, p in enumerate(PromptInput(f"p{i}", i, [3 + i, 9, 27 + i, 4, 17]) for i in range(3))
                   for m in METHODS]
    cand = tmp_path / "short.jsonl"
    write_baseline(cand, base.header, records)
    args = (reference_file, cand, "--rule", "margin", "--no-trees", "--json", tmp_path / "r.json")
    assert _run_cli(*args) == 1
    m = json.loads((tmp_path / "r.json").read_text())["methods"]["ddtree_tb16"]
    assert m["match_rate"] == 1.0 and m["tau"]["diff_ci95"][1] < 0
    assert m["failures"] == [next(f for f in m["failures"] if f.startswith("tau drop") and "below zero" in f)]
    # the documented way to tolerate it: a tau drop up to the given size (inf: any) passes
    assert _run_cli(*args, "--max-tau-drop", "inf") == 0
    assert _run_cli(*args, "--max-tau-drop", f"{-m['tau']['diff_ci95'][0] + 0.01:.3f}") == 0
    assert _run_cli(*args, "--max-tau-drop", "-1") == 2


def _main(capsys, *argv) -> tuple[int, str, str]:
    from sglang_ddtree import cli

    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("command", ["compare", "compare-zlab"])
def test_a_folder_for_an_input_file_is_one_sentence(reference_file, tmp_path, capsys, command):
    first = FIXTURES / "reference_small.pt"
    if command == "compare-zlab":  # its first input is a z-lab summary
        first = tmp_path / "summary.json"
        first.write_text(json.dumps({"tau": 3.0, "histogram": [0.0, 0.5, 0.5], "samples": 3}))
    for argv in ((tmp_path, reference_file), (first, tmp_path)):
        rc, out, err = _main(capsys, command, *argv)
        assert rc == 2 and out == "" and "Traceback" not in err, err
        assert err.strip().splitlines() == [err.strip()] and f"{str(tmp_path)!r} is a folder; pass a file" in err
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(bytes(range(256)))
    rc, _, err = _main(capsys, command, binary, reference_file)
    assert rc == 2 and "is not a text file" in err and len(err.strip().splitlines()) == 1


def test_a_header_only_file_names_its_problem(reference_file, tmp_path, capsys):
    header_only = tmp_path / "header_only.jsonl"
    header_only.write_text(reference_file.read_text().splitlines()[0] + "\n")
    rc, out, _ = _main(capsys, "compare", reference_file, header_only)
    assert rc == 1
    assert f"FAIL: the candidate file {header_only} has no records (a header line only)" in out
    assert out.strip().endswith("FAIL (1 problem(s))")
    rc, _, err = _main(capsys, "compare-zlab", FIXTURES / "reference_small.pt", header_only)
    assert rc == 2
