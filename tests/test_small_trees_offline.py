"""benchmarks/small_trees_offline.py on the committed tiny pair: 2 HumanEval prompts x 8 new tokens, CPU."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from fixtures.offline_models import needs_tiny_pair, one_thread, tiny_pair

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import small_trees_offline as st  # noqa: E402

pytestmark = needs_tiny_pair

MAX_NEW = 8
BUDGETS = (1, 3, 15)
CHAINS = (1, 3, 15)


@pytest.fixture(scope="module")
def run():
    from sglang_ddtree.datasets import encode_prompt, load_prompts
    from sglang_ddtree.offline.drafts import DFlashDraftSource
    from sglang_ddtree.offline.runner import PromptInput

    with tiny_pair() as (tok, target, drafter):
        draft = DFlashDraftSource(drafter, target)
        prompts = [PromptInput(p.id, p.index, encode_prompt(tok, p)) for p in load_prompts("humaneval", limit=2)]
        eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
        log = io.StringIO()
        result = st.measure(target, draft, prompts, max_new_tokens=MAX_NEW, eos_token_ids=eos, budgets=BUDGETS,
                            chain_lengths=CHAINS, resamples=200, log=log)
        yield result, (target, draft, prompts, eos), log.getvalue()


def test_rows_are_lossless_and_within_their_depth(run):
    result, _, log = run
    rows = result["rows"]
    assert log.count("\n") == 2  # one progress line a prompt
    assert rows["plain"]["tau"] == 1.0 and rows["plain"]["width"] == 1
    for name, r in rows.items():
        assert r["tau"] >= 1.0
        assert r["tau_ci95"][0] - 1e-9 <= r["tau"] <= r["tau_ci95"][1] + 1e-9, name
        assert r["max_commit"] <= r["depth_limit"] + 1, name  # a round commits at most its deepest draft + bonus
        assert r["tau_per_width"] == pytest.approx(r["tau"] / r["width"])
        if r["kind"] != "chain_estimate":
            assert r["matches_plain"] == 2, name  # greedy speculative decoding reproduces plain decoding
            assert r["mean_width"] == r["width"], name
    for b in BUDGETS:
        assert rows[f"ddtree_B{b}"]["width"] == b + 1
    for n in CHAINS:
        assert rows[f"chain_L{n}"]["width"] == n + 1


def test_cut_chains_match_their_limits(run):
    rows = run[0]["rows"]
    # the chain cut to the whole block is the DFLASH chain; a budget-1 tree is the top-1 chain of one draft
    assert rows["chain_L15"]["tokens"] == rows["dflash"]["tokens"]
    assert rows["chain_L15"]["rounds"] == rows["dflash"]["rounds"]
    assert (rows["ddtree_B1"]["tokens"], rows["ddtree_B1"]["rounds"]) == (rows["chain_L1"]["tokens"],
                                                                       rows["chain_L1"]["rounds"])
    assert rows["chain_L15_est"]["tau"] == pytest.approx(rows["dflash"]["tau"])  # nothing to cut


def test_ratios_come_from_the_rows(run):
    result = run[0]
    rows = result["rows"]
    got = {(q["num"], q["den"], q["comparison"]): q for q in result["ratios"]}
    assert set(got) == {
        ("ddtree_B1", "chain_L1", "equal width"),
        ("ddtree_B1", "chain_L1_est", "equal width (chain estimated from the full chain's rounds)"),
        ("ddtree_B3", "chain_L3", "equal width"),
        ("ddtree_B3", "chain_L3_est", "equal width (chain estimated from the full chain's rounds)"),
        ("ddtree_B15", "dflash", "equal width"),
        ("ddtree_B15", "chain_L15", "equal width"),
        ("ddtree_B15", "chain_L15_est", "equal width (chain estimated from the full chain's rounds)"),
    }
    for (num, den, _), q in got.items():
        assert q["ratio"] == pytest.approx(rows[num]["tau"] / rows[den]["tau"])
        assert q["width"] == [rows[num]["width"], rows[den]["width"]]
        assert q["ratio_ci95"][0] <= q["ratio_ci95"][1]
    pp = result["per_prompt"]
    for name, r in rows.items():
        assert sum(pp[name]["tokens"]) == r["tokens"] and sum(pp[name]["rounds"]) == r["rounds"]


def test_tree_tau_is_the_offline_runners(run, tmp_path):
    from sglang_ddtree.baseline import BaselineHeader, BaselineWriter
    from sglang_ddtree.offline.runner import RunSettings, run_offline

    result, (target, draft, prompts, eos), _ = run
    settings = RunSettings(methods=["dflash", "ddtree_tb15"], max_new_tokens=MAX_NEW, eos_token_ids=eos)
    header = BaselineHeader(source="offline", target={"path": None, "fingerprint": "tiny"}, max_new_tokens=MAX_NEW)
    with one_thread(), BaselineWriter(tmp_path / "run.jsonl", header) as w:
        taus = run_offline(target, draft, prompts, settings, w, progress=False)
    assert result["rows"]["ddtree_B15"]["tau"] == taus["ddtree_tb15"]["tau"]
    assert result["rows"]["ddtree_B15"]["rounds"] == taus["ddtree_tb15"]["rounds"]
    assert result["rows"]["dflash"]["tau"] == taus["dflash"]["tau"]


def test_help_runs():
    with pytest.raises(SystemExit) as e:
        st.main(["--help"])
    assert e.value.code == 0
