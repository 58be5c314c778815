"""Paired ratios of interleaved runs (ddtree_bench.paired, benchmarks/paired_ratios.py)."""

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from ddtree_bench.paired import (arm_table, group_ratio, paired_ratio, paired_table, pooled_ratios,
                                 rate_outlier_runs, row_label, t975)

REPO = Path(__file__).resolve().parents[1]


def _t_cdf(x: float, df: int, steps: int = 20000) -> float:
    """P(T <= x) for Student's t by Simpson's rule on the density from 0 to x (x > 0)."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    f = lambda t: c * (1 + t * t / df) ** (-(df + 1) / 2)  # noqa: E731
    h = x / steps
    s = f(0) + f(x) + sum((4 if i % 2 else 2) * f(i * h) for i in range(1, steps))
    return 0.5 + s * h / 3


@pytest.mark.parametrize("df", [1, 5, 29, 35, 50, 90, 200, 1000])
def test_t975_is_the_quantile_of_the_t_density(df):
    assert _t_cdf(t975(df), df) == pytest.approx(0.975, abs=4e-4)


def test_t975_falls_with_the_degrees_of_freedom_and_refuses_zero():
    values = [t975(df) for df in range(1, 400)]
    assert all(a > b for a, b in zip(values, values[1:]))
    assert 1.96 < values[-1] < 1.97
    with pytest.raises(ValueError, match=">= 1"):
        t975(0)


def test_paired_ratio_is_the_geometric_mean_with_a_t_interval():
    a, b = [110.0, 99.0, 120.0], [100.0, 100.0, 100.0]
    d = [math.log(1.1), math.log(0.99), math.log(1.2)]
    mean = sum(d) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 2)
    r = paired_ratio(a, b)
    assert r["ratio"] == pytest.approx(math.exp(mean), abs=1e-4) and r["rounds"] == 3
    assert r["ci95"][0] == pytest.approx(math.exp(mean - 4.303 * sd / math.sqrt(3)), abs=1e-4)
    assert r["ci95"][1] == pytest.approx(math.exp(mean + 4.303 * sd / math.sqrt(3)), abs=1e-4)
    same = paired_ratio([50.0, 80.0, 65.0], [100.0, 160.0, 130.0])  # a steady ratio under any drift: no spread
    assert same["ratio"] == pytest.approx(0.5) and same["ci95"] == [pytest.approx(0.5)] * 2
    for bad_a, bad_b, match in (([1.0, 2.0], [1.0], "same rounds"), ([1.0], [1.0], "at least 2"),
                                ([1.0, 0.0], [1.0, 1.0], "positive")):
        with pytest.raises(ValueError, match=match):
            paired_ratio(bad_a, bad_b)


def test_the_interval_covers_the_true_ratio_about_95_percent_of_the_time():
    """Runs drifting together by up to +-40% (the host), the two rows 3% apart, per-run noise 5%: the pairing
    cancels the drift, and the 95% interval of 8 rounds holds the true 1.03 in 93-97% of 3000 seeded trials."""
    rng = random.Random(7)
    hits = 0
    trials = 3000
    for _ in range(trials):
        host = [rng.uniform(0.6, 1.4) for _ in range(8)]
        a = [1030 * h * math.exp(rng.gauss(0, 0.05)) for h in host]
        b = [1000 * h * math.exp(rng.gauss(0, 0.05)) for h in host]
        lo, hi = paired_ratio(a, b)["ci95"]
        hits += lo <= 1.03 <= hi
    assert 0.93 <= hits / trials <= 0.97


def _row(setup, method, budget, bs, runs, interleaved=True):
    return {"kind": "result", "key": f"{setup}|{method}|{budget or '-'}|{bs}", "setup": setup, "method": method,
            "budget": budget, "batch_size": bs, "status": "ok", "decode_tokens_per_s": sorted(runs)[len(runs) // 2],
            "decode_tokens_per_s_runs": runs, **({"interleaved": True} if interleaved else {})}


def test_paired_table_divides_every_row_by_the_base_per_batch_size():
    rows = [_row("tiny", "ddtree", 128, 1, [100.0, 200.0, 150.0]), _row("tiny", "auto", None, 1, [99.0, 198.0, 148.5]),
            _row("tiny-b", "ddtree", 128, 1, [100.0, 200.0, 150.0]), _row("tiny", "auto", None, 4, [1.0, 2.0]),
            {**_row("tiny", "dflash", None, 1, [1.0, 1.0]), "status": "failed"}]
    assert row_label(rows[0]) == "tiny|ddtree-128" and row_label(rows[1]) == "tiny|auto"
    table = paired_table(rows, "tiny|ddtree-128")
    assert list(table) == [1]  # batch 4 has no base row; the failed row is not a row to pair
    assert table[1]["tiny|auto"]["ratio"] == pytest.approx(0.99) and table[1]["tiny-b|ddtree-128"]["ratio"] == 1.0
    with pytest.raises(ValueError, match="without --interleave"):
        paired_table([_row("tiny", "auto", None, 1, [1.0, 2.0], interleaved=False)], "tiny|auto")


def test_pooled_ratios_pair_within_each_batch_size_and_put_the_rounds_together():
    rows = [_row("tiny", "ddtree", 128, 1, [100.0, 200.0]), _row("tiny", "auto", None, 1, [90.0, 190.0]),
            _row("tiny", "ddtree", 128, 4, [400.0, 300.0, 500.0]), _row("tiny", "auto", None, 4, [390.0, 310.0, 480.0])]
    pooled = pooled_ratios(rows, "tiny|ddtree-128")
    assert list(pooled) == ["tiny|auto"]
    assert pooled["tiny|auto"] == paired_ratio([90.0, 190.0, 390.0, 310.0, 480.0], [100.0, 200.0, 400.0, 300.0, 500.0])
    assert pooled["tiny|auto"]["rounds"] == 5
    with pytest.raises(ValueError, match="1 runs against 2"):
        pooled_ratios([rows[0], _row("tiny", "auto", None, 1, [90.0])], "tiny|ddtree-128")


def test_paired_ratios_script_prints_and_writes_the_table(tmp_path):
    results = tmp_path / "r.jsonl"
    rows = [_row("tiny", "ddtree", 128, 1, [100.0, 200.0, 150.0]), _row("tiny", "auto", None, 1, [97.0, 194.0, 145.5]),
            _row("tiny", "ddtree", 128, 4, [400.0, 500.0]), _row("tiny", "auto", None, 4, [388.0, 485.0])]
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "t.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "paired_ratios.py"), str(results)]
    done = subprocess.run(cmd + ["--base", "tiny|ddtree-128", "--json", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "tiny|auto" in done.stdout and "x0.970" in done.stdout and "3 rounds" in done.stdout
    written = json.loads(out.read_text())
    assert written["by_batch_size"]["1"]["tiny|auto"]["ratio"] == pytest.approx(0.97)
    assert "all batch sizes together" in done.stdout and "5 rounds" in done.stdout
    assert written["all_batch_sizes"]["tiny|auto"]["ratio"] == pytest.approx(0.97) and \
        written["all_batch_sizes"]["tiny|auto"]["rounds"] == 5
    assert "note:" not in done.stdout and "rate_outlier_runs" not in written  # no run had outliers
    bad = subprocess.run(cmd + ["--base", "tiny|dflash"], capture_output=True, text=True)
    assert bad.returncode == 2 and "tiny|auto, tiny|ddtree-128" in bad.stderr
    # a run with requests timed short (an 8B batch-64 run: 4003 tok/s among ~1800) is named and its round left
    # out, unless --keep-outlier-runs
    rows[1]["decode_rate_outliers_runs"] = [0, 2, 0]
    rows[1]["decode_tokens_per_s_runs"] = [97.0, 388.0, 145.5]  # run 1 inflated 2x
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = subprocess.run(cmd + ["--base", "tiny|ddtree-128", "--json", str(out)], capture_output=True, text=True)
    assert done.returncode == 0 and "note: tiny|auto at batch 1: run(s) 1 (from 0)" in done.stdout
    assert "2 rounds (1 dropped)" in done.stdout and "leave these rounds out" in done.stdout
    written = json.loads(out.read_text())
    assert written["rate_outlier_runs"] == {"tiny|auto": {"1": [1]}} and written["outlier_runs_dropped"] is True
    assert written["by_batch_size"]["1"]["tiny|auto"]["ratio"] == pytest.approx(0.97)
    assert written["by_batch_size"]["1"]["tiny|auto"]["dropped_runs"] == 1
    assert written["all_batch_sizes"]["tiny|auto"]["rounds"] == 4
    kept = subprocess.run(cmd + ["--base", "tiny|ddtree-128", "--json", str(out), "--keep-outlier-runs"],
                          capture_output=True, text=True)
    assert kept.returncode == 0 and "ratios using them are suspect" in kept.stdout
    written = json.loads(out.read_text())
    assert written["by_batch_size"]["1"]["tiny|auto"]["ratio"] == pytest.approx((0.97 * 1.94 * 0.97) ** (1 / 3),
                                                                                abs=1e-4)
    assert "dropped_runs" not in written["by_batch_size"]["1"]["tiny|auto"]


def test_rate_outlier_runs_lists_the_runs_per_row_and_batch_size():
    rows = [{**_row("tiny", "auto", None, 1, [1.0, 2.0, 3.0]), "decode_rate_outliers_runs": [0, 1, 4]},
            {**_row("tiny", "auto", None, 4, [1.0, 2.0]), "decode_rate_outliers_runs": [0, 0]},
            {**_row("tiny", "dflash", None, 1, [1.0, 2.0]), "decode_rate_outliers_runs": [1, 0], "status": "failed"},
            _row("tiny", "ddtree", 128, 1, [1.0, 2.0, 3.0])]  # older sweep files: no such field
    assert rate_outlier_runs(rows) == {"tiny|auto": {1: [1, 2]}}


def test_group_ratio_averages_each_sides_logs_per_round():
    """Copies of one configuration pool per round (the mean of their logs), so one copy each is paired_ratio, and
    copies whose per-round noise cancels give a tighter interval than either copy alone."""
    a1, a2, b = [90.0, 210.0, 150.0, 120.0], [110.0, 190.0, 150.0, 120.0], [100.0, 200.0, 150.0, 125.0]
    assert group_ratio([a1], [b]) == paired_ratio(a1, b)
    both = group_ratio([a1, a2], [b])
    d = [(math.log(x) + math.log(y)) / 2 - math.log(z) for x, y, z in zip(a1, a2, b)]
    assert both["ratio"] == pytest.approx(math.exp(sum(d) / len(d)), abs=1e-4)
    assert both["ci95"][1] - both["ci95"][0] < paired_ratio(a1, b)["ci95"][1] - paired_ratio(a1, b)["ci95"][0]
    with pytest.raises(ValueError, match="same rounds"):
        group_ratio([a1, a2[:3]], [b])
    with pytest.raises(ValueError, match="one server on each side"):
        group_ratio([], [b])


def test_arm_table_and_the_scripts_arms(tmp_path):
    rows = [_row("tiny", "ddtree", 128, 1, [100.0, 200.0, 150.0]), _row("a1", "auto", None, 1, [98.0, 196.0, 147.0]),
            _row("a2", "auto", None, 1, [96.0, 192.0, 144.0]), _row("b1", "auto", None, 1, [90.0, 180.0, 135.0]),
            _row("b2", "auto", None, 1, [88.0, 176.0, 132.0])]
    arms = {"a": ["a1|auto", "a2|auto"], "b": ["b1|auto", "b2|auto"]}
    table = arm_table(rows, "tiny|ddtree-128", arms)[1]
    assert table["a over tiny|ddtree-128"]["ratio"] == pytest.approx(math.sqrt(0.98 * 0.96), abs=1e-4)
    assert table["b over a"]["ratio"] == pytest.approx(math.sqrt(0.90 * 0.88 / (0.98 * 0.96)), abs=1e-4)
    with pytest.raises(ValueError, match="no measured row c1"):
        arm_table(rows, "tiny|ddtree-128", {"c": ["c1|auto"]})
    results = tmp_path / "r.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "t.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "paired_ratios.py"), str(results), "--base", "tiny|ddtree-128"]
    done = subprocess.run(cmd + ["--arm", "a=a1|auto,a2|auto", "--arm", "b=b1|auto,b2|auto", "--json", str(out)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "b over a" in done.stdout
    assert json.loads(out.read_text())["arms_by_batch_size"]["1"]["b over a"]["rounds"] == 3
    bad = subprocess.run(cmd + ["--arm", "a"], capture_output=True, text=True)
    assert bad.returncode == 2 and "NAME=LABEL" in bad.stderr


def test_tables_leave_out_the_rounds_any_compared_row_had_a_rate_outlier_in():
    """A round is paired only where no row compared was flagged (decode_rate_outliers_runs): the base's flag drops
    the round for every row, a row's own flag only for that row; with two or fewer rounds left there is no ratio."""
    flagged = lambda row, flags: {**row, "decode_rate_outliers_runs": flags}  # noqa: E731
    base = flagged(_row("tiny", "ddtree", 128, 1, [100.0, 200.0, 150.0, 120.0]), [0, 0, 0, 3])
    auto = flagged(_row("tiny", "auto", None, 1, [90.0, 400.0, 135.0, 108.0]), [0, 1, 0, 0])
    dflash = _row("tiny", "dflash", None, 1, [80.0, 160.0, 120.0, 500.0])  # no flags (older sweep files)
    rows = [base, auto, dflash]
    table = paired_table(rows, "tiny|ddtree-128")[1]
    assert table["tiny|auto"] == {**paired_ratio([90.0, 135.0], [100.0, 150.0]), "dropped_runs": 2}
    assert table["tiny|dflash"] == {**paired_ratio([80.0, 160.0, 120.0], [100.0, 200.0, 150.0]), "dropped_runs": 1}
    assert paired_table(rows, "tiny|ddtree-128", drop_outliers=False)[1]["tiny|auto"] == paired_ratio(
        auto["decode_tokens_per_s_runs"], base["decode_tokens_per_s_runs"])
    pooled = pooled_ratios(rows, "tiny|ddtree-128")
    assert pooled["tiny|auto"]["rounds"] == 2 and pooled["tiny|auto"]["dropped_runs"] == 2
    arms = arm_table(rows, "tiny|ddtree-128", {"a": ["tiny|auto"], "d": ["tiny|dflash"]})[1]
    assert arms["a over tiny|ddtree-128"] == table["tiny|auto"]
    # the base is not compared here: only auto's own flag drops a round
    assert arms["d over a"] == {**paired_ratio([80.0, 120.0, 500.0], [90.0, 135.0, 108.0]), "dropped_runs": 1}
    one_left = flagged(auto, [0, 1, 1, 0])
    assert paired_table([base, one_left], "tiny|ddtree-128")[1]["tiny|auto"] == {
        "ratio": None, "ci95": None, "rounds": 1, "dropped_runs": 3}
