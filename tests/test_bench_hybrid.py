"""benchmarks/bench_hybrid.py end to end on CPU with a tiny hybrid target: the JSON has every field, the oracle
and tree verify paths equal plain decoding, the scripted drafter really gets deep / branching acceptance, and the
timings are positive."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers.models.qwen3_next", reason="transformers without Qwen3-Next")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_hybrid.py"
TINY = ["--device", "cpu", "--budgets", "16", "--prompts", "1", "--max-new-tokens", "8", "--warmup-tokens", "2",
        "--prompt-len", "6", "--hidden", "32", "--layers", "4", "--vocab", "64", "--experts", "4", "--block-size", "8"]
PATH_FIELDS = {"verify_ms_median", "verify_ms_mean", "round_ms_median", "rounds", "tau"}


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_hybrid", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    out = tmp_path_factory.mktemp("bench_hybrid") / "hybrid.json"
    try:
        rc = _load_bench().main(TINY + ["--out", str(out)])
    finally:
        logging.set_verbosity(verbosity)  # main() silences transformers' "fast path not available" notice
    assert rc == 0
    return json.loads(out.read_text())


def test_header_fields(result):
    for key in ("date_utc", "git_commit", "command", "device", "torch", "transformers", "model_config", "settings"):
        assert result[key], key
    assert "--max-new-tokens 8" in result["command"]
    assert result["model_config"]["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert result["model_config"]["hidden_size"] == 32


def test_lossless_and_real_acceptance(result):
    assert result["hybrid_lossless_t0"] is True
    entry = result["budgets"]["16"]
    assert entry["lossless"] is True and entry["mismatches"] == []
    assert entry["oracle_tree_same_acceptance"] is True
    assert entry["tree"]["tau"] > 1  # the scripted drafter's continuation really gets accepted
    assert entry["tree"]["tau"] == entry["oracle"]["tau"]
    depths = {int(d): n for d, n in entry["accepted_depth_histogram"].items()}
    assert sum(depths.values()) == entry["tree"]["rounds"] and max(depths) >= 2
    assert set(entry["branch_accepts"]) == {"total", "rounds_with_branch", "by_depth"}


def test_timings_positive(result):
    entry = result["budgets"]["16"]
    for path in ("oracle", "tree"):
        assert PATH_FIELDS <= set(entry[path]), path
        assert entry[path]["rounds"] >= 1
        for key in ("verify_ms_median", "verify_ms_mean", "round_ms_median"):
            assert entry[path][key] > 0, (path, key)
        assert entry[path]["round_ms_median"] >= entry[path]["stage_ms_median"]["verify"]  # a round includes it
    assert entry["plain_ms_per_token"] > 0
    # budget 64 was not run: the headline step times are present but null
    assert result["hybrid_step_ms"] == {"oracle_b64": None, "fast_b64": None}


def test_a_differing_output_is_reported_with_its_position():
    """The lossless verdict itself: a path whose tokens differ from plain decoding is named, with where."""
    from types import SimpleNamespace as Rec

    bench = _load_bench()
    plain = [Rec(output_ids=[5, 6, 7], margins=[1.0, 0.5, 2.0])]
    runs = {"tree": {"recs": [Rec(output_ids=[5, 6, 7])]}, "oracle": {"recs": [Rec(output_ids=[5, 9, 7])]}}
    assert bench.mismatches(plain, runs) == [{"prompt": 0, "path": "oracle", "first_diff_at": 1,
                                              "plain_margin_there": 0.5}]
    runs["oracle"]["recs"][0].output_ids = [5, 6]  # a shorter output differs where it ends
    assert bench.mismatches(plain, runs)[0]["first_diff_at"] == 2
    hist, branches = bench.acceptance([Rec(accept_lengths=[1, 4, 3], accepted_ranks=[[], [0, 1, 0], [1, 1]])])
    assert hist == {"0": 1, "2": 1, "3": 1}
    assert branches == {"total": 3, "rounds_with_branch": 2, "by_depth": {"1": 1, "2": 2}}
