"""Result files stored xz-compressed: every reader finds `X.jsonl.xz` when asked for `X.jsonl`, and the committed
results keep to the rule that a file over 100 KB is stored as `.xz` (the tree travels with every GPU call)."""

import importlib.util
import json
import lzma
import subprocess
from pathlib import Path

import pytest

from sglang_ddtree.baseline import read_baseline, write_baseline
from sglang_ddtree.results_file import open_text, read_rows, read_text, stored_path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
LARGE = 100_000
# Plain on purpose: summary.json is generated and read by users; images and profiles do not shrink or are binary
# (pstats reads a file); the CI baselines are rewritten as they are by scripts/make_ci_baselines.py.
PLAIN_ANY_SIZE = {"summary.json", "ci_tiny_t0.jsonl"}
PLAIN_SUFFIXES = {".png", ".pstats", ".pt"}


def _xz(path: Path, text: str) -> Path:
    packed = path.with_name(path.name + ".xz")
    packed.write_bytes(lzma.compress(text.encode()))
    return packed


def test_a_plain_name_finds_its_xz_copy(tmp_path):
    rows = [{"kind": "run", "run_id": "r"}, {"kind": "result", "key": "a|b|1|1", "status": "ok"}]
    packed = _xz(tmp_path / "sweep.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n")
    assert stored_path(tmp_path / "sweep.jsonl") == packed
    assert read_rows(tmp_path / "sweep.jsonl") == rows == read_rows(packed)
    with open_text(packed) as fh:
        assert json.loads(fh.readline()) == rows[0]
    # the plain file wins when both are there; a name with neither comes back unchanged
    (tmp_path / "sweep.jsonl").write_text(json.dumps(rows[0]) + "\n")
    assert stored_path(tmp_path / "sweep.jsonl") == tmp_path / "sweep.jsonl"
    assert read_rows(tmp_path / "sweep.jsonl") == rows[:1]
    assert stored_path(tmp_path / "none.jsonl") == tmp_path / "none.jsonl"
    assert read_rows(tmp_path / "none.jsonl") == []


def test_a_cut_xz_file_is_a_value_error(tmp_path):
    packed = _xz(tmp_path / "x.json", json.dumps({"a": list(range(2000))}))
    packed.write_bytes(packed.read_bytes()[:-40])
    with pytest.raises(ValueError, match="not a complete xz file"):
        read_text(packed)


def test_a_baseline_reads_the_same_compressed(tmp_path):
    base = read_baseline(ROOT / "benchmarks" / "results" / "baselines" / "ci_tiny_t0.jsonl")
    plain = tmp_path / "b.jsonl"
    write_baseline(plain, base.header, base.records)
    packed = _xz(tmp_path / "c.jsonl", plain.read_text())
    again = read_baseline(packed)
    assert again.header == base.header and again.records == base.records
    assert read_baseline(tmp_path / "c.jsonl").records == base.records  # found through its .xz copy


def test_compare_cli_takes_a_compressed_baseline(tmp_path, capsys):
    from sglang_ddtree.cli import main

    ours = RESULTS / "baselines" / "ci_tiny_t0.jsonl"
    packed = _xz(tmp_path / "ci.jsonl", ours.read_text())
    assert main(["compare", str(packed), str(ours), "--bootstrap", "50"]) == 0
    packed.write_bytes(packed.read_bytes()[:100])
    assert main(["compare", str(packed), str(ours)]) == 2
    assert "not a complete xz file" in capsys.readouterr().err


def test_summary_sources_keep_their_names_and_read_the_xz_copy(tmp_path):
    spec = importlib.util.spec_from_file_location("make_summary", ROOT / "scripts" / "make_summary.py")
    ms = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ms)
    packed = _xz(tmp_path / "s.json", json.dumps({"x": 1}))
    src = ms.source("s.json", tmp_path)
    assert (src.name, src.path, src.json()) == ("s.json", packed, {"x": 1})


def test_committed_results_over_100_kb_are_stored_as_xz():
    tracked = subprocess.run(["git", "ls-files", "-z", "benchmarks/results"], cwd=ROOT, capture_output=True,
                             check=True).stdout.decode().split("\0")
    if not any(tracked):
        pytest.skip("not a git checkout")
    large = [p for p in tracked if p and (ROOT / p).is_file() and (ROOT / p).stat().st_size > LARGE]
    plain = [p for p in large if not p.endswith(".xz") and Path(p).name not in PLAIN_ANY_SIZE
             and Path(p).suffix not in PLAIN_SUFFIXES]
    assert plain == [], "compress them: xz -9e FILE (docs/gpu-suite.md, section 5)"
    assert any(p.endswith(".jsonl.xz") for p in large)
