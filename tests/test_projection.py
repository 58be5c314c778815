"""ddtree_bench.projection: a sweep's measured DDTREE / DFLASH round costs combined with a published acceptance
profile (what a trained drafter would get)."""

import json
import math
from pathlib import Path

import pytest

from ddtree_bench import projection as pj

ROOT = Path(__file__).resolve().parents[1]
SWEEP_8B = ROOT / "benchmarks" / "results" / "sweep_8b-real_2026-12-04_b171d51.jsonl"

TOY = {"name": "toy", "chain_tau": 5.0, "tree_tau_by_budget": {"16": 6.0, "64": 8.0, "256": 9.0},
       "extrapolate_down_to": 15}


def _row(method, budget, bs, step_ms, runs=None, backend="triton", setup="s", tps=None, with_args=True):
    row = {"kind": "result", "status": "ok", "key": f"{setup}|{method}|{budget}|{bs}|{backend}", "setup": setup,
           "method": method, "budget": budget, "batch_size": bs, "step_ms": step_ms, "interleaved": True,
           "server": f"{setup}-{backend}-{method}-{budget}", "decode_tokens_per_s": tps or 1000.0 / step_ms,
           "run_id": "r1"}
    if runs is not None:
        row["step_ms_runs"] = runs
    if with_args:
        row["server_args"] = ["--model-path", "x", "--attention-backend", backend, "--enable-metrics"]
    return row


def test_tau_is_the_published_value_at_a_published_budget_and_log_linear_between():
    assert pj.tau_for_budget(TOY, 16) == 6.0 and pj.tau_for_budget(TOY, 256) == 9.0
    assert pj.tau_for_budget(TOY, 32) == pytest.approx(7.0)  # halfway from 16 to 64 in log2(B)
    assert pj.tau_for_budget(TOY, 128) == pytest.approx(8.5)
    assert pj.tau_for_budget(TOY, 48) == pytest.approx(6.0 + 2.0 * math.log2(3) / 2)


def test_budget_15_follows_the_first_slope_and_nothing_below_it_or_above_the_largest_has_a_tau():
    assert pj.tau_for_budget(TOY, 15) == pytest.approx(6.0 - 1.0 * math.log2(16 / 15))  # slope 1 per doubling
    for budget in (14, 8, 1, 257, 1024):
        assert pj.tau_for_budget(TOY, budget) is None
    paper = pj.load_profile()
    # the profile's own note: 8.61 - 0.66 * log2(16/15) = 8.55
    assert round(pj.tau_for_budget(paper, 15), 2) == 8.55
    assert pj.tau_for_budget(paper, 14) is None and pj.tau_for_budget(paper, 2048) is None
    assert pj.tau_for_budget(paper, 1024) == 10.98 and paper["chain_tau"] == 7.79


def test_an_unknown_profile_is_refused():
    with pytest.raises(ValueError, match="no acceptance profile 'nope'"):
        pj.load_profile("nope")


def test_dflash_and_ddtree_are_paired_within_one_backend_only():
    rows = [_row("dflash", None, 1, 10.0), _row("ddtree", 16, 1, 11.0),
            _row("dflash", None, 1, 20.0, backend="flashinfer"), _row("ddtree", 16, 1, 30.0, backend="flashinfer"),
            _row("ddtree", 64, 1, 40.0, backend="flashinfer")]  # no triton 64: never paired with triton's DFLASH
    groups = {g["backend"]: g for g in pj.project_rows(rows, TOY)}
    assert set(groups) == {"triton", "flashinfer"}
    tri = groups["triton"]["by_batch"]["1"]["budgets"]
    fi = groups["flashinfer"]["by_batch"]["1"]["budgets"]
    assert [(x["budget"], x["round_ratio"]) for x in tri] == [(16, 1.1)]
    assert [(x["budget"], x["round_ratio"]) for x in fi] == [(16, 1.5), (64, 2.0)]
    assert tri[0]["projected_ratio"] == pytest.approx(round((6.0 / 5.0) / 1.1, 4))


def test_a_row_without_server_args_takes_its_backend_from_its_server_line():
    rows = [_row("dflash", None, 4, 10.0, with_args=False), _row("ddtree", 16, 4, 12.0, with_args=False),
            _row("dflash", None, 4, 10.0, backend="flashinfer")]
    servers = {rows[0]["server"]: ["--attention-backend", "triton"], rows[1]["server"]: ["--attention-backend",
                                                                                          "triton"]}
    groups = pj.project_rows(rows, TOY, servers)
    assert [(g["backend"], list(g["by_batch"])) for g in groups] == [("triton", ["4"])]
    assert pj.project_rows(rows[:2], TOY)[0]["backend"] == "default"  # nothing names one


def test_per_repeat_ratios_pair_repeat_r_with_repeat_r():
    rows = [_row("dflash", None, 1, 10.0, runs=[10.0, 10.0, 10.0]),
            _row("ddtree", 16, 1, 12.0, runs=[11.0, 12.0, 13.0])]
    rec = pj.project_rows(rows, TOY)[0]["by_batch"]["1"]["budgets"][0]
    assert rec["round_ratio_runs"] == [1.1, 1.2, 1.3] and rec["round_ratio_run_range"] == [1.1, 1.3]
    lo, hi = rec["round_ratio_ci95"]
    assert lo < rec["round_ratio_paired"] < hi and lo < 1.1 and hi > 1.3  # t(0.975, 2) = 4.303 is wide
    assert rec["round_ratio_paired"] == pytest.approx(round((1.1 * 1.2 * 1.3) ** (1 / 3), 4))
    gain = 6.0 / 5.0
    assert rec["projected_run_range"] == [round(gain / 1.3, 4), round(gain / 1.1, 4)]
    assert rec["run_pairing"] == "repeat r with repeat r"


def test_unpaired_repeats_give_no_interval_and_say_why():
    rows = [_row("dflash", None, 1, 10.0, runs=[10.0, 10.0]), _row("ddtree", 16, 1, 12.0, runs=[11.0, 12.0, 13.0])]
    rec = pj.project_rows(rows, TOY)[0]["by_batch"]["1"]["budgets"][0]
    assert rec["round_ratio"] == 1.2 and rec["round_ratio_run_range"] is None and rec["round_ratio_ci95"] is None
    assert rec["run_pairing"] == "unpaired: 3 repeats against 2" and rec["projected_run_range"] is None
    rows[0].pop("step_ms_runs")
    rec = pj.project_rows(rows, TOY)[0]["by_batch"]["1"]["budgets"][0]
    assert rec["run_pairing"] == "no per-repeat step_ms in the DFLASH row"


def test_the_best_budget_is_the_highest_projection_and_an_unsupported_budget_is_never_best():
    # budget 8: the cheapest round, but no published tau -> no projection
    rows = [_row("dflash", None, 1, 10.0), _row("ddtree", 8, 1, 9.0), _row("ddtree", 16, 1, 11.0),
            _row("ddtree", 64, 1, 12.0), _row("ddtree", 512, 1, 12.5)]
    batch = pj.project_rows(rows, TOY)[0]["by_batch"]["1"]
    by_b = {x["budget"]: x for x in batch["budgets"]}
    assert by_b[8]["projected_ratio"] is None and by_b[8]["tau_gain"] is None
    assert by_b[512]["projected_ratio"] is None  # above the largest published budget
    # 16: 1.2 / 1.1 = 1.091; 64: 1.6 / 1.2 = 1.333
    assert batch["best"] == {"budget": 64, "projected_ratio": round(1.6 / 1.2, 4)}
    assert by_b[64]["measured_tokens_per_s_ratio"] == round(10.0 / 12.0, 4)


def _step_ms(path: Path, setup: str) -> dict[tuple[str, int | None, str], float]:
    """{(method, budget, batch size): step_ms} of a sweep file's ok triton result rows of one setup, read here
    without the projection module (the last row of a key wins, as a resumed sweep's do)."""
    from sglang_ddtree.results_file import read_text

    out = {}
    for line in read_text(path).splitlines():
        row = json.loads(line)
        if row.get("kind") == "result" and row.get("status") == "ok" and row.get("setup") == setup:
            out[(row["method"], row["budget"], str(row["batch_size"]))] = row["step_ms"]
    return out


def test_the_committed_8b_sweep_gives_the_round_ratios_and_best_projections_of_its_rows():
    """The round ratios are the rows' DDTREE step_ms over DFLASH's, and the best budget the highest published tree
    tau over chain tau over that ratio (the paper's budgets 16-128 are published values: no interpolation); the
    team's hand-made table from this file gave 1.094 / 1.057 / 1.213 / 1.197 at B=16 and best B 64 / 32 / 16 / 16."""
    rows = _step_ms(SWEEP_8B, "8b-real")
    paper = pj.load_profile()
    result = pj.project_sweep(SWEEP_8B, setup="8b-real")
    (group,) = result["groups"]
    assert group["backend"] == "triton" and group["gpu"] == ["NVIDIA H200"]
    for bs, batch in group["by_batch"].items():
        chain = rows[("dflash", None, bs)]
        for rec in batch["budgets"]:
            assert rec["round_ratio"] == pytest.approx(rows[("ddtree", rec["budget"], bs)] / chain, abs=1e-4)
        projected = {rec["budget"]: paper["tree_tau_by_budget"][str(rec["budget"])] / paper["chain_tau"]
                     / (rows[("ddtree", rec["budget"], bs)] / chain) for rec in batch["budgets"]}
        assert batch["best"]["budget"] == max(projected, key=projected.get)
    assert {bs: round(b["budgets"][0]["round_ratio"], 3) for bs, b in group["by_batch"].items()} == {
        "1": 1.094, "4": 1.057, "16": 1.213, "64": 1.197}  # the team's table (B=16 is the first budget)
    # the flashinfer setup of the same file is its own group, never mixed into triton's
    groups = {(g["setup"], g["backend"]) for g in pj.project_sweep(SWEEP_8B)["groups"]}
    assert groups == {("8b-real", "triton"), ("8b-real-fi", "flashinfer")}


def test_the_summary_carries_the_projection_of_its_sweep_files():
    summary = json.loads((ROOT / "benchmarks" / "results" / "summary.json").read_text())
    results = ROOT / "benchmarks" / "results"
    for prefix, name, setup in [("real8b", "sweep_8b-real_2026-12-04_b171d51.jsonl", "8b-real"),
                                ("hybrid_real", "sweep_27b-hybrid_h100_2026-12-07_68af6c5.jsonl", "27b-hybrid")]:
        rows = _step_ms(results / name, setup)
        for bs, ratios in summary[f"{prefix}_round_over_dflash"].items():
            for budget, ratio in ratios.items():
                assert ratio == pytest.approx(rows[("ddtree", int(budget), bs)] / rows[("dflash", None, bs)],
                                              abs=1e-4), (prefix, bs, budget)
        assert set(summary[f"{prefix}_projected_trained_drafter"]) == set(summary[f"{prefix}_round_over_dflash"])
    assert "Qwen3-8B profile applied" in summary["hybrid_real_projected_trained_drafter_note"]


def test_cli_prints_a_table_or_json_and_refuses_bad_input_in_one_line(tmp_path, capsys):
    path = tmp_path / "sweep.jsonl"
    rows = [_row("dflash", None, 1, 10.0, runs=[10.0, 10.0]), _row("ddtree", 16, 1, 11.0, runs=[11.0, 11.5])]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert pj.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "s (triton" in out and f"best projected: B=16 x{(8.61 / 7.79) / 1.1:.3f}" in out  # the paper's profile
    assert pj.main([str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["projected"] is True and data["groups"][0]["by_batch"]["1"]["best"]["budget"] == 16
    for argv, msg in (([str(tmp_path / "absent.jsonl")], "no such file"),
                      ([str(path), "--profile", "nope"], "no acceptance profile"),
                      ([str(path), "--setup", "other"], "setup 'other' has no DFLASH and DDTREE rows")):
        assert pj.main(argv) == 2
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1


def test_an_arm_without_dflash_rows_is_paired_with_its_base_setup_only_when_asked():
    rows = [_row("dflash", None, 1, 10.0, setup="base"), _row("ddtree", 16, 1, 11.0, setup="base"),
            _row("ddtree", 16, 1, 10.5, setup="arm"), _row("ddtree", 16, 4, 12.0, setup="arm")]
    assert [g["setup"] for g in pj.project_rows(rows, TOY)] == ["base"]  # the arm has no DFLASH of its own
    groups = {g["setup"]: g for g in pj.project_rows(rows, TOY, chain_from={"arm": "base"})}
    arm = groups["arm"]["by_batch"]
    assert set(arm) == {"1"}  # batch 4: the base has no DFLASH row there either
    assert arm["1"]["budgets"][0]["round_ratio"] == pytest.approx(1.05)
    assert groups["base"]["by_batch"]["1"]["budgets"][0]["round_ratio"] == pytest.approx(1.1)
