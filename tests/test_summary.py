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
