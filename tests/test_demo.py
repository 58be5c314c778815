"""`sglang-ddtree demo`: tau over emitted tokens only, the median and spread over repeats, and one small real run on
the tiny pair."""

from __future__ import annotations

import json

import pytest

from sglang_ddtree.baseline import MethodRecord
from sglang_ddtree.demo import emitted_round_tokens, summarize


def test_the_last_round_is_cut_at_the_emitted_tokens():
    # 96 output tokens: 1 from the prefill, 95 from rounds; the last round verified 16 but only 2 were emitted
    lens = [7] * 12 + [9, 16]
    assert sum(lens) == 109
    emitted = emitted_round_tokens(lens, 96)
    assert emitted == [7] * 12 + [9, 2] and sum(emitted) == 95
    # nothing to cut: every verified token was emitted (plain decoding, or a run that stopped exactly at the cap)
    assert emitted_round_tokens([1] * 95, 96) == [1] * 95
    assert emitted_round_tokens([4, 4], 9) == [4, 4]
    # an EOS from the prefill: no round emits anything
    assert emitted_round_tokens([], 1) == []


def _rec(method, pid, out_len, lens, ms):
    return MethodRecord(prompt_id=pid, method=method, output_ids=list(range(out_len)), prompt_index=int(pid),
                        accept_lengths=lens, total_ms=ms)


def test_summary_counts_tau_over_emitted_tokens_and_reports_the_median_and_spread():
    plain = [[_rec("plain", "0", 96, [1] * 95, ms)] for ms in (1000.0, 500.0, 2000.0)]
    tree = [[_rec("ddtree_tb16", "0", 96, [7] * 12 + [9, 16], ms)] for ms in (400.0, 200.0, 4000.0)]
    s = summarize({"plain": plain, "ddtree_tb16": tree})
    t = s["ddtree_tb16"]
    assert t["tau"] == pytest.approx(95 / 14)  # not 109 / 14 (7.79, ~15% high)
    assert t["tau_as_verified"] == pytest.approx(109 / 14)
    assert t["tokens_per_s_per_repeat"] == pytest.approx([240.0, 480.0, 24.0])
    assert t["tokens_per_s"] == pytest.approx(240.0)  # the median, not the mean (248) nor a single run
    assert (t["tokens_per_s_min"], t["tokens_per_s_max"]) == pytest.approx((24.0, 480.0))
    assert s["plain"]["tokens_per_s"] == pytest.approx(96.0) and s["plain"]["tau"] == 1.0
    assert t["speedup_vs_plain"] == pytest.approx(2.5)
    assert t["lossless"] and s["plain"]["lossless"]


def test_a_different_output_is_not_lossless():
    plain = [[_rec("plain", "0", 10, [1] * 9, 10.0)]]
    other = [[_rec("dflash", "0", 10, [3, 3, 3], 10.0)]]
    other[0][0].output_ids[-1] = 999
    assert not summarize({"plain": plain, "dflash": other})["dflash"]["lossless"]


@pytest.mark.slow
def test_demo_runs_on_the_tiny_pair(tmp_path, capsys):
    from sglang_ddtree.cli import main

    out = tmp_path / "demo"
    rc = main(["demo", "--prompts", "1", "--max-new-tokens", "24", "--repeats", "2", "--budgets", "16",
               "--device", "cpu", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "min-max of 2" in text and "CPU speeds do not predict GPU speeds" in text
    import torch

    n = torch.get_num_threads()
    assert f"demo: tiny pair on cpu, {n} CPU thread" in text  # how many, and why, in the first line
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["cpu_threads"] == n
    assert list(summary["methods"]) == ["plain", "dflash", "ddtree_tb16"]
    from sglang_ddtree.baseline import read_baseline

    records = read_baseline(out / "baseline.jsonl").records
    for rec in records:
        m = summary["methods"][rec.method]
        assert m["lossless"] and len(m["tokens_per_s_per_repeat"]) == 2
        assert m["tokens_per_s_min"] <= m["tokens_per_s"] <= m["tokens_per_s_max"]
        # tau x rounds = the tokens the rounds emitted (the prefill's first token belongs to no round)
        assert m["tau"] * m["rounds"] == pytest.approx(len(rec.output_ids) - 1)
