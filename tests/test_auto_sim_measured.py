"""benchmarks/auto_sim_measured.py: the host policy fed measured costs, per scenario of server effects."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def load():
    spec = importlib.util.spec_from_file_location("auto_sim_measured", REPO / "benchmarks" / "auto_sim_measured.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_writes_each_scenario_and_follows_the_costs(tmp_path):
    """A 16-tree far cheaper per token than every other candidate is run in most rounds; every scenario is written
    with shares that add up to one and one entry per seed."""
    mod = load()
    out = tmp_path / "sim.json"
    assert mod.main(["--ms", "chain=12,16=9,32=20,64=30,128=55", "--taus", "chain=3.5,16=4.4,32=4.7,64=5,128=5.1",
                     "--seeds", "2", "--rounds", "500", "--skip", "150", "--out", str(out), "--source", "test"]) == 0
    data = json.loads(out.read_text())
    assert set(data["scenarios"]) == set(mod.SCENARIOS) and data["source"] == "test"
    base = data["scenarios"]["measured costs only"]
    assert base["share"]["16"] > 0.8 and base["rate_over_best_mean"] > 0.9
    for r in data["scenarios"].values():
        assert sum(r["share"].values()) == pytest.approx(1.0, abs=0.01) and len(r["seeds"]) == 2
        assert r["rate_over_best_min"] <= r["rate_over_best_mean"] <= r["rate_over_best_max"] <= 1.0


@pytest.mark.parametrize("argv, match", [
    (["--ms", "chain=12,16=9", "--taus", "chain=3,16=4,32=4,64=5,128=5"], "--ms: give exactly"),
    (["--ms", "chain=12,16=9,32=20,64=30,128", "--taus", "chain=3,16=4,32=4,64=5,128=5"], "label=value"),
    (["--ms", "chain=12,16=9,32=20,64=30,128=55", "--taus", "chain=3,16=4,32=4,64=5,128=5", "--skip", "2000"],
     "--skip"),
])
def test_bad_input_is_refused(argv, match):
    with pytest.raises(SystemExit, match=match):
        load().main(argv)
