"""Cost model: the step-time fit recovers known parameters, tau sources, best-budget selection, the CLI."""

from __future__ import annotations

import json
import math
import random

import pytest

from sglang_ddtree import baseline as bl
from ddtree_bench import cost_model as cm
from ddtree_bench.results import ResultsWriter

TRUE = {"a": {1: 9.0, 4: 10.5, 16: 13.0, 64: 21.0}, "s1": 0.003, "s2": 0.022, "knee": 700.0}
BUDGETS = (16, 32, 64, 128, 256, 512, 1024)


def true_step(b, budget, p=TRUE):
    v = b * (budget + 1)
    return p["a"][b] + p["s1"] * v + p["s2"] * max(0.0, v - p["knee"])


def synthetic(budgets=BUDGETS, skip=((64, 1024),), noise=0.0, seed=0):
    rng = random.Random(seed)
    return [(b, B, true_step(b, B) * (1 + rng.uniform(-noise, noise)))
            for b in TRUE["a"] for B in budgets if (b, B) not in skip]


def test_fit_recovers_the_parameters_exactly_without_noise():
    fit = cm.fit_step_time(synthetic())
    assert fit.knee == pytest.approx(TRUE["knee"], rel=1e-6)
    assert fit.slope_ms == pytest.approx(TRUE["s1"], rel=1e-6)
    assert fit.slope2_ms == pytest.approx(TRUE["s2"], rel=1e-6)
    for b, a in TRUE["a"].items():
        assert fit.intercept_ms[b] == pytest.approx(a, rel=1e-6)
    assert fit.to_json()["max_abs_rel_err"] < 1e-9


def test_fit_from_the_reduced_budget_set_still_recovers_them():
    fit = cm.fit_step_time(synthetic(budgets=(16, 64, 256, 1024)))
    assert fit.knee == pytest.approx(TRUE["knee"], rel=1e-4)
    assert fit.slope2_ms == pytest.approx(TRUE["s2"], rel=1e-4)
    # and it predicts the budgets it never saw
    for b in (1, 4, 16):
        for budget in (32, 128, 512):
            assert fit.predict(b, b * (budget + 1)) == pytest.approx(true_step(b, budget), rel=1e-4)


def test_fit_with_noise_stays_close():
    fit = cm.fit_step_time(synthetic(noise=0.02, seed=3))
    assert fit.slope2_ms == pytest.approx(TRUE["s2"], rel=0.1)
    for b, a in TRUE["a"].items():
        assert fit.intercept_ms[b] == pytest.approx(a, rel=0.1)
    assert fit.to_json()["rms_rel_err"] < 0.03


def test_linear_data_needs_no_knee():
    pts = [(b, B, 5.0 + b + 0.01 * b * (B + 1)) for b in (1, 4, 16) for B in BUDGETS]
    fit = cm.fit_step_time(pts)
    for b, B, t in pts:
        assert fit.predict(b, b * (B + 1)) == pytest.approx(t, rel=1e-6)
    assert (not math.isfinite(fit.knee)) or fit.slope2_ms == pytest.approx(0.0, abs=1e-6)


def test_too_few_points_are_refused():
    with pytest.raises(ValueError, match="no DDTREE"):
        cm.fit_step_time([])
    with pytest.raises(ValueError, match="two budgets"):
        cm.fit_step_time([(1, 16, 10.0), (4, 16, 11.0)])
    with pytest.raises(ValueError, match="positive"):
        cm.fit_step_time([(1, 16, 10.0), (1, 64, -1.0), (4, 16, 11.0), (4, 64, 12.0)])


def test_intercepts_interpolate_between_measured_batches():
    fit = cm.fit_step_time(synthetic())
    assert fit.intercept(8) == pytest.approx(TRUE["a"][4] + (TRUE["a"][16] - TRUE["a"][4]) * 4 / 12)
    assert fit.intercept(128) == pytest.approx(TRUE["a"][64])


def test_best_budget_is_the_argmax_of_batch_tau_over_step():
    fit = cm.fit_step_time(synthetic())
    tau = {"ddtree": {B: 1.0 + 0.55 * math.log2(B) for B in BUDGETS}, "dflash": 3.0}
    dflash_ms = {b: TRUE["a"][b] + 0.5 for b in TRUE["a"]}
    plain_tps = {b: 1e3 * b / (TRUE["a"][b] - 2.0) for b in TRUE["a"]}
    out = cm.project(fit, tau, batch_sizes=sorted(TRUE["a"]), dflash_step_ms=dflash_ms, plain_tokens_per_s=plain_tps,
                     allow_extrapolation=True)
    for b in TRUE["a"]:
        expected = max(BUDGETS, key=lambda B: b * tau["ddtree"][B] / true_step(b, B))
        got = out[str(b)]
        assert got["best_budget"] == expected
        best_tps = 1e3 * b * tau["ddtree"][expected] / true_step(b, expected)
        assert got["projected_tokens_per_s"] == pytest.approx(best_tps, rel=1e-6)
        assert got["projected_speedup_vs_plain"] == pytest.approx(best_tps / plain_tps[b], rel=1e-6)
        assert got["projected_speedup_vs_dflash"] == pytest.approx(best_tps / (1e3 * b * 3.0 / dflash_ms[b]), rel=1e-6)
    # the tradeoff shows: a big batch prefers a smaller tree than batch 1
    assert out["64"]["best_budget"] < out["1"]["best_budget"]


def test_extrapolated_budgets_are_not_chosen_unless_allowed():
    fit = cm.fit_step_time(synthetic(budgets=(16, 64)))  # measured verify tokens: up to 64 * 65
    tau = {"ddtree": {16: 1.5, 64: 1.6, 1024: 50.0}, "dflash": None}  # 1024 would win if trusted
    out = cm.project(fit, tau, batch_sizes=[1, 64])
    assert out["1"]["best_budget"] == 64
    big = next(c for c in out["1"]["candidates"] if c["budget"] == 1024)
    assert big["extrapolated"] and not next(c for c in out["1"]["candidates"] if c["budget"] == 64)["extrapolated"]
    assert cm.project(fit, tau, batch_sizes=[1], allow_extrapolation=True)["1"]["best_budget"] == 1024


def _row(setup, method, budget, b, **kw):
    return {"kind": "result", "key": f"{setup}|{method}|{budget or '-'}|{b}", "status": "ok", "setup": setup,
            "method": method, "budget": budget, "batch_size": b, **kw}


def write_sweep(path, tau_of=lambda B: 1.0 + 0.3 * math.log2(B)):
    w = ResultsWriter(path)
    for b in TRUE["a"]:
        for B in (16, 64, 256, 1024):
            if (b, B) != (64, 1024):
                w.write(_row("8b-dummy", "ddtree", B, b, step_ms=true_step(b, B), tau=1.0, verify_rounds=31))
        w.write(_row("8b-dummy", "plain", None, b, step_ms=5.0, decode_tokens_per_s=1e3 * b / 5.0))
        w.write(_row("8b-dummy", "dflash", None, b, step_ms=8.0, tau=1.0, decode_tokens_per_s=1e3 * b / 8.0))
        for B in BUDGETS:
            # rounds differ by batch: the pooled tau must weight by them
            w.write(_row("tiny", "ddtree", B, b, tau=tau_of(B) + (0.2 if b == 1 else 0.0), verify_rounds=100 * b,
                         step_ms=3.0))
        w.write(_row("tiny", "dflash", None, b, tau=1.3, verify_rounds=100 * b))
    w.write({"kind": "result", "key": "8b-dummy|ddtree|1024|64", "status": "skipped", "setup": "8b-dummy",
             "method": "ddtree", "budget": 1024, "batch_size": 64, "reason": "memory"})
    w.close()


def test_tau_from_the_sweep_pools_rounds_over_batches(tmp_path):
    path = tmp_path / "s.jsonl"
    write_sweep(path)
    tau = cm.tau_from_sweep(cm.load_ok_results(path, "tiny"))
    weights = {b: 100 * b for b in TRUE["a"]}
    for B in BUDGETS:
        base = 1.0 + 0.3 * math.log2(B)
        expected = sum(w * (base + (0.2 if b == 1 else 0.0)) for b, w in weights.items()) / sum(weights.values())
        assert tau["ddtree"][B] == pytest.approx(expected)
    assert tau["dflash"] == pytest.approx(1.3)


def test_tau_from_a_baseline_file(tmp_path):
    path = tmp_path / "offline.jsonl"
    header = bl.BaselineHeader(source="offline", target={"path": None, "fingerprint": None})
    recs = [bl.MethodRecord(prompt_id="p0", method="ddtree_tb16", output_ids=[1] * 6, accept_lengths=[2, 3]),
            bl.MethodRecord(prompt_id="p1", method="ddtree_tb16", output_ids=[1] * 5, accept_lengths=[4]),
            bl.MethodRecord(prompt_id="p0", method="dflash", output_ids=[1] * 4, accept_lengths=[1, 2]),
            bl.MethodRecord(prompt_id="p0", method="plain", output_ids=[1] * 3, accept_lengths=[1, 1])]
    bl.write_baseline(path, header, recs)
    tau = cm.tau_from_baseline(path)
    assert tau == {"ddtree": {16: pytest.approx(9 / 3)}, "dflash": pytest.approx(3 / 2)}


def test_cli_writes_a_projection_labelled_projected(tmp_path, capsys):
    sweep = tmp_path / "s.jsonl"
    write_sweep(sweep)
    out = tmp_path / "best_budget_projected.json"
    assert cm.main(["--sweep", str(sweep), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["projected"] is True and "PROJECTED" in result["note"]
    assert result["fit"]["points"] == 15 and result["fit"]["max_abs_rel_err"] < 1e-6
    assert result["tau_source"] == {"kind": "sweep", "setup": "tiny"}
    for b, entry in result["by_batch"].items():
        assert entry["best_budget"] in BUDGETS
        numeric = [k for k, v in entry.items() if isinstance(v, float) and k != "plain_tokens_per_s_measured"]
        assert numeric and all("projected" in k for k in numeric)
        assert all(all("projected" in k for k in c if k.endswith("_per_s") or k.startswith("speedup"))
                   for c in entry["candidates"])
        assert entry["plain_tokens_per_s_measured"] == pytest.approx(1e3 * int(b) / 5.0)
    assert "PROJECTED" in capsys.readouterr().out
    # a file without cost rows is a clear error, not a crash
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert cm.main(["--sweep", str(empty), "--out", str(tmp_path / "x.json")]) == 2
