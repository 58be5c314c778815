"""scripts/adaptive_eval.py end to end on the committed tiny pair, at toy size (the committed result file is made
by the full run; see docs/adaptive-budget.md)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from sglang_ddtree import tiny

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not (tiny.tiny_dir() / "target" / "model.safetensors").exists(),
                                reason="the tiny pair is not in models/tiny")


def test_adaptive_eval_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("adaptive_eval", ROOT / "scripts" / "adaptive_eval.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "a.json"
    threads = torch.get_num_threads()
    try:
        rc = mod.main(["--prompts", "2", "--offset", "1", "--warmup-prompts", "1", "--max-new-tokens", "12",
                       "--budgets", "16,32", "--candidates", "chain,16,32", "--batch-sizes", "1,64",
                       "--threads", "1", "--out", str(out), "--no-progress"])
    finally:
        torch.set_num_threads(threads)  # the script sets it for the whole process
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["lossless"] is True
    assert set(r["summary_fields"]["auto_vs_best_fixed_tokens_per_s"]) == {"1", "64"}
    assert r["summary_fields"]["raw_tau_mae"] > 0 and r["summary_fields"]["calibrated_tau_mae"] > 0
    assert r["projection"]["64"]["projected"] is True
    assert r["projection"]["64"]["auto"]["calibrated"]["candidates"] == ["chain"]  # no tree pays at batch 64
    for name in ("dflash", "ddtree_tb16", "ddtree_tb32", "auto_bs1_calibrated"):
        run = r["runs"][name]
        assert run["matches_plain"] == run["prompts"] == 2
        assert len(run["per_round"]["observed"]) == run["rounds"] == sum(run["rounds_per_prompt"])
    assert r["runs"]["warmup"]["tau_prior"]["chain"] >= 1
    assert r["command"].startswith("PYTHONPATH=$PWD python scripts/adaptive_eval.py")
