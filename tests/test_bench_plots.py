"""Plots of a fake results file (and projection): every figure is written and is a real PNG."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("matplotlib")

from ddtree_bench import cost_model as cm  # noqa: E402
from ddtree_bench import plots  # noqa: E402
from test_bench_cost_model import write_sweep  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def add_stage_split(path):
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows:
        if r.get("method") == "ddtree" and r.get("status") == "ok":
            r["stage_ms"] = {"draft": 1.0, "tree": 0.4, "verify": r["step_ms"] - 2.0, "walk": 0.2, "commit": 0.4}
            r["acceptance_meaningful"] = r["setup"] == "tiny"
            r.setdefault("decode_tokens_per_s", 1e3 * r["batch_size"] * r.get("tau", 1.0) / r["step_ms"])
        elif r.get("status") == "ok":
            r["acceptance_meaningful"] = r["setup"] == "tiny"
            r.setdefault("decode_tokens_per_s", 1e3 * r["batch_size"] / 4.0)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_all_plots_from_a_fake_sweep_and_projection(tmp_path):
    sweep = tmp_path / "s.jsonl"
    write_sweep(sweep)
    add_stage_split(sweep)
    proj = tmp_path / "best.json"
    assert cm.main(["--sweep", str(sweep), "--out", str(proj)]) == 0
    out = tmp_path / "png"
    assert plots.main(["--sweep", str(sweep), "--projection", str(proj), "--out-dir", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["speedup.png", "stage_breakdown.png", "tau_vs_budget.png", "tokens_per_s_vs_budget.png"]
    for p in out.iterdir():
        data = p.read_bytes()
        assert data.startswith(PNG) and len(data) > 5000


def test_plots_without_acceptance_or_projection_skip_what_they_cannot_draw(tmp_path):
    sweep = tmp_path / "s.jsonl"
    write_sweep(sweep)
    add_stage_split(sweep)
    only_costs = [json.loads(line) for line in sweep.read_text().splitlines()]
    sweep.write_text("".join(json.dumps(r) + "\n" for r in only_costs if r.get("setup") == "8b-dummy"))
    made = plots.make_plots(sweep, tmp_path / "png")
    assert sorted(p.name for p in made) == ["stage_breakdown.png", "tokens_per_s_vs_budget.png"]


def test_an_empty_results_file_is_a_clear_error(tmp_path):
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no ok result rows"):
        plots.make_plots(empty, tmp_path / "png")
    assert plots.main(["--sweep", str(empty), "--out-dir", str(tmp_path / "png")]) == 2


def test_a_real_size_sweep_with_auto_and_a_setup_without_plain(tmp_path, monkeypatch):
    """Rows of a sweep with real acceptance at real size: `auto` drawn as levels, a speedup panel only for the
    references a setup has, run spreads without the flagged runs, and the measured best budgets refused as a
    projection (they carry no fit)."""
    from ddtree_bench import best_budget as bb
    from test_bench_best_budget import SETUP, write_sweep as write_real

    sweep = tmp_path / "real.jsonl"
    write_real(sweep)
    plt = plots._plt()
    panels = {}
    real_subplots = plt.subplots

    def subplots(nrows, ncols, **kw):
        fig, axes = real_subplots(nrows, ncols, **kw)
        panels[len(panels)] = axes
        return fig, axes

    monkeypatch.setattr(plt, "subplots", subplots)
    made = plots.make_plots(sweep, tmp_path / "png", dpi=60)
    assert sorted(p.name for p in made) == ["speedup.png", "tau_vs_budget.png", "tokens_per_s_vs_budget.png"]
    speedup = [a.get_title() for a in panels[2][0]]
    assert speedup == ["other: speedup over DFLASH chain (measured)",  # `other` has no plain rows
                       f"{SETUP}: speedup over plain (measured)", f"{SETUP}: speedup over DFLASH chain (measured)"]
    tokens = panels[1][0][1]  # setups in name order: other, then SETUP (the one with auto)
    assert tokens.get_title().startswith(f"{SETUP}:")
    assert "auto" in tokens.get_legend_handles_labels()[1]
    assert "best fixed budget" in tokens.get_legend_handles_labels()[1]
    only = plots.make_plots(sweep, tmp_path / "png1", setups=[SETUP], dpi=60)
    assert len(only) == 3
    # run spreads: a flagged run is left out, and so is its round when two rows are paired
    row = {"decode_tokens_per_s_runs": [10.0, 30.0, 12.0], "decode_rate_outliers_runs": [0, 3, 0]}
    assert plots._runs(row) == [10.0, 12.0]
    assert plots._run_ratios(row, {"decode_tokens_per_s_runs": [5.0, 5.0, 4.0]}) == [2.0, 3.0]
    assert plots._run_ratios(row, {"decode_tokens_per_s_runs": [5.0, 5.0]}) == []
    measured = tmp_path / "best_budget.json"
    assert bb.main(["--sweep", str(sweep), "--setup", SETUP, "--out", str(measured)]) == 0
    with pytest.raises(ValueError, match="not a cost-model projection"):
        plots.make_plots(sweep, tmp_path / "png2", projection=measured)
