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
