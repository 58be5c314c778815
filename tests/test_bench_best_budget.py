"""Measured best budgets from a small synthetic sweep: the choice, the ratios over DFLASH and `auto`'s, run pairing,
the run facts, and the CLI."""

from __future__ import annotations

import json

import pytest

from ddtree_bench import best_budget as bb
from ddtree_bench.results import ResultsWriter

SETUP = "real"


def _row(method, budget, b, runs, *, setup=SETUP, tau=None, outliers=None, run_id="r2", **kw):
    """An ok result row whose tokens/s is its median run (as the sweep writes it)."""
    median = sorted(runs)[(len(runs) - 1) // 2]
    row = {"kind": "result", "key": f"{setup}|{method}|{budget or '-'}|{b}", "status": "ok", "run_id": run_id,
           "setup": setup, "method": method, "budget": budget, "batch_size": b, "acceptance_meaningful": True,
           "decode_tokens_per_s": median, "tau": tau, "interleaved": True}
    if len(runs) > 1:
        row.update(repeats=len(runs), decode_tokens_per_s_runs=list(runs),
                   decode_rate_outliers_runs=outliers or [0] * len(runs))
    return {**row, **kw}


def write_sweep(path):
    w = ResultsWriter(path)
    w.write({"kind": "run", "run_id": "r1", "date": "2026-01-02T10:00:00+00:00", "commit": "abc1234",
             "gpu": "Some GPU"})
    w.write({"kind": "server", "run_id": "r1", "server": "real-dflash", "ok": True, "setup": SETUP,
             "method": "dflash", "budget": None, "args": ["--model-path", "m", "--attention-backend", "triton"]})
    w.write({"kind": "server", "run_id": "r1", "server": "other-dflash", "ok": True, "setup": "other",
             "method": "dflash", "budget": None, "args": ["--attention-backend", "flashinfer"]})
    # a first run's line for B=128 at batch 1, replaced by the resumed run's: only the latest line counts
    w.write(_row("ddtree", 128, 1, [900.0, 950.0, 990.0], tau=5.5, run_id="r1"))
    w.write({"kind": "run", "run_id": "r2", "date": "2026-01-02T11:00:00+00:00", "commit": "abc1234",
             "gpu": "Some GPU"})
    # batch 1: B=64 has the best median; B=32 has the best single run and B=128 the highest tau (neither is best)
    w.write(_row("plain", None, 1, [200.0, 210.0, 205.0]))
    w.write(_row("dflash", None, 1, [400.0, 500.0, 450.0], tau=2.5))
    w.write(_row("ddtree", 16, 1, [480.0, 500.0, 490.0], tau=3.0))
    w.write(_row("ddtree", 32, 1, [420.0, 700.0, 430.0], tau=3.5))
    w.write(_row("ddtree", 64, 1, [520.0, 540.0, 530.0], tau=4.0))
    w.write(_row("ddtree", 128, 1, [450.0, 470.0, 460.0], tau=4.5))
    w.write(_row("auto", None, 1, [510.0, 520.0, 500.0], tau=3.8))
    # batch 4: the DFLASH row has two runs, the best tree three: ratios of the rows only, and why
    w.write(_row("dflash", None, 4, [1500.0, 1600.0], tau=2.7))
    w.write(_row("ddtree", 16, 4, [1700.0, 1800.0, 1750.0], tau=3.2))
    w.write(_row("ddtree", 32, 4, [1600.0, 1650.0, 1700.0], tau=3.6))
    # batch 16: DFLASH beats every tree, so auto's rival is DFLASH; two budgets tie and the smaller wins;
    # run 1 of the tree had a rate-outlier request
    w.write(_row("dflash", None, 16, [5000.0, 5200.0, 5100.0], tau=3.0))
    w.write(_row("ddtree", 16, 16, [4800.0, 5000.0, 4900.0], tau=3.4, outliers=[0, 2, 0]))
    w.write(_row("ddtree", 32, 16, [4850.0, 4900.0, 4950.0], tau=3.8))
    w.write(_row("auto", None, 16, [5100.0, 5000.0, 5050.0], tau=3.2))
    # batch 64: no DFLASH row, no auto
    w.write(_row("ddtree", 16, 64, [7000.0], tau=3.9))
    # another setup of the same file, faster everywhere: never read
    w.write(_row("ddtree", 128, 1, [9000.0, 9100.0, 9200.0], setup="other", tau=4.0))
    w.write(_row("dflash", None, 1, [100.0, 100.0, 100.0], setup="other", tau=2.0))
    # a failed row of the setup: not a candidate
    w.write({"kind": "result", "key": f"{SETUP}|ddtree|256|1", "status": "failed", "setup": SETUP,
             "method": "ddtree", "budget": 256, "batch_size": 1, "decode_tokens_per_s": 99999.0})
    w.close()


def test_the_best_budget_is_the_highest_measured_median_and_ratios_pair_runs(tmp_path):
    path = tmp_path / "s.jsonl"
    write_sweep(path)
    out = bb.build(path, SETUP)
    assert out["projected"] is False and "MEASURED" in out["note"]
    assert (out["setup"], out["attention_backend"], out["commit"]) == (SETUP, "triton", "abc1234")
    assert out["dates"] == ["2026-01-02"] and out["gpu"] == ["Some GPU"] and out["run_ids"] == ["r2"]
    assert out["interleaved"] is True
    by = out["by_batch"]
    assert {b: r["best_budget"] for b, r in by.items()} == {"1": 64, "4": 16, "16": 16, "64": 16}

    one = by["1"]
    assert one["tokens_per_s"] == 530.0 and one["tau"] == 4.0
    assert one["dflash_tokens_per_s"] == 450.0 and one["dflash_tau"] == 2.5
    assert one["over_dflash"] == pytest.approx(530 / 450, abs=1e-4)
    runs = [520 / 400, 540 / 500, 530 / 450]
    assert one["over_dflash_runs"] == pytest.approx(runs, abs=1e-4)
    assert one["over_dflash_run_range"] == pytest.approx([min(runs), max(runs)], abs=1e-4)
    assert one["over_dflash_run_pairing"].startswith("run r with run r")
    assert one["plain_tokens_per_s"] == 205.0 and one["over_plain"] == pytest.approx(530 / 205, abs=1e-4)
    # auto over the better of DFLASH and the best budget (here the best budget), run r against run r
    assert one["auto_tokens_per_s"] == 510.0 and one["auto_tau"] == 3.8 and one["auto_rival"] == "ddtree-64"
    assert one["auto_over_best"] == pytest.approx(510 / 530, abs=1e-4)
    assert one["auto_over_best_run_range"] == pytest.approx([500 / 530, 510 / 520], abs=1e-4)
    assert [c["budget"] for c in one["candidates"]] == [16, 32, 64, 128]
    assert next(c for c in one["candidates"] if c["budget"] == 128)["tokens_per_s"] == 460.0  # the latest line
    assert one["rate_outlier_runs"] == []

    four = by["4"]
    assert four["over_dflash"] == pytest.approx(1750 / 1500, abs=1e-4)  # the lower middle of two runs
    assert four["over_dflash_runs"] is None and four["over_dflash_run_range"] is None
    assert four["over_dflash_run_pairing"] == "unpaired: 3 runs against 2"
    assert "auto_tokens_per_s" not in four and "plain_tokens_per_s" not in four

    sixteen = by["16"]
    assert sixteen["tokens_per_s"] == 4900.0  # 16 and 32 tie at 4900: the smaller tree
    assert sixteen["over_dflash"] == pytest.approx(4900 / 5100, abs=1e-4)
    assert sixteen["auto_rival"] == "dflash"
    assert sixteen["auto_over_best"] == pytest.approx(5050 / 5100, abs=1e-4)
    assert sixteen["auto_over_best_runs"] == pytest.approx([5100 / 5000, 5000 / 5200, 5050 / 5100], abs=1e-4)
    assert sixteen["rate_outlier_runs"] == [1]

    sixty_four = by["64"]
    assert sixty_four["tokens_per_s"] == 7000.0 and sixty_four["tokens_per_s_runs"] is None
    assert "over_dflash" not in sixty_four


def test_paired_runs_says_why_it_cannot_pair():
    a = {"decode_tokens_per_s_runs": [2.0, 4.0], "interleaved": True}
    assert bb.paired_runs(a, {"decode_tokens_per_s_runs": [1.0, 2.0], "interleaved": True}) == (
        [2.0, 2.0], "run r with run r (interleaved rounds)")
    runs, how = bb.paired_runs(a, {"decode_tokens_per_s_runs": [1.0, 2.0]})
    assert runs == [2.0, 2.0] and "not interleaved" in how
    assert bb.paired_runs(a, {}) == (None, "no per-run tokens/s in the denominator row")
    assert bb.paired_runs({"decode_tokens_per_s_runs": [3.0]}, {"decode_tokens_per_s_runs": [1.0]})[0] is None


def test_a_costs_only_or_absent_setup_is_refused(tmp_path):
    path = tmp_path / "s.jsonl"
    w = ResultsWriter(path)
    w.write(_row("ddtree", 16, 1, [100.0, 110.0], acceptance_meaningful=False, setup="dummy"))
    w.close()
    with pytest.raises(ValueError, match="no real acceptance"):
        bb.build(path, "dummy")
    with pytest.raises(ValueError, match="no ok result rows"):
        bb.build(path, "nope")


def test_cli_writes_the_measured_file(tmp_path, capsys):
    sweep = tmp_path / "s.jsonl"
    write_sweep(sweep)
    out = tmp_path / "best_budget.json"
    assert bb.main(["--sweep", str(sweep), "--setup", SETUP, "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(bb.build(sweep, SETUP)))
    assert data["by_batch"]["1"]["best_budget"] == 64
    text = capsys.readouterr().out
    assert "MEASURED" in text and "best budget   64" in text
    assert bb.main(["--sweep", str(sweep), "--setup", "nope", "--out", str(tmp_path / "x.json")]) == 2


def test_auto_is_judged_against_plain_decoding_too_and_its_choices_are_shared_out(tmp_path):
    """At a batch where plain decoding beats DFLASH and every tree, `auto`'s rival is plain; its row's Prometheus
    rounds per candidate become the share of rounds each ran."""
    rows = [_row("plain", None, 64, [10000.0, 10100.0, 10050.0]),
            _row("dflash", None, 64, [7400.0, 7500.0, 7450.0], tau=3.0),
            _row("ddtree", 15, 64, [9000.0, 9100.0, 9050.0], tau=3.5),
            _row("auto", None, 64, [9800.0, 9900.0, 9850.0], tau=2.0,
                 ddtree_metrics={"auto_rounds": {"plain": 300, "15": 100}})]
    rec = bb.best_by_batch(rows)["64"]
    assert rec["auto_rival"] == "plain"
    assert rec["auto_over_best"] == pytest.approx(9850 / 10050, abs=1e-4)
    assert rec["auto_over_best_runs"] == pytest.approx([9800 / 10000, 9900 / 10100, 9850 / 10050], abs=1e-4)
    assert rec["auto_choice"] == {"15": 0.25, "plain": 0.75}
