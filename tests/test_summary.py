"""benchmarks/results/summary.json is generated from the committed raw result files and must not be stale."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_summary_is_regenerated_from_raw_files():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_summary.py"), "--check"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr + "\n(run: python scripts/make_summary.py)"
    summary = json.loads((ROOT / "benchmarks" / "results" / "summary.json").read_text())
    assert summary["missing"] == [], summary["missing"]


def test_auto_ratios_flag_a_server_without_decode_graphs():
    """An auto ratio against a graphed rival while auto ran eager (the planner's graph-token cap, lease 13's 8B
    batch-64 row) is not like for like: the summary lists such rows."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_summary", ROOT / "scripts" / "make_summary.py")
    ms = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ms)
    graphed = {"batch_size": 64, "server_args": ["--cuda-graph-bs-decode", "16", "64", "--x"]}
    assert ms._decode_graphs(graphed) and not ms._decode_graphs({**graphed, "batch_size": 32})
    assert not ms._decode_graphs({"batch_size": 64, "server_args": ["--disable-decode-cuda-graph"]})
    assert ms._decode_graphs({"batch_size": 64, "decode_graphs": True, "server_args": []})
    rows = ms._sweep_rows("sweep_auto_8b_lease13_bs64.jsonl")  # committed: auto eager, DFLASH graphed
    assert not ms._decode_graphs(rows[("8b-dummy", "auto", None, 64)])
    assert ms._decode_graphs(rows[("8b-dummy", "dflash", None, 64)])
    summary = json.loads((ROOT / "benchmarks" / "results" / "summary.json").read_text())
    assert summary["sglang_auto_rows_without_decode_graphs"] == {}  # today's sources compare like with like
