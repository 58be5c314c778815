"""Bad inputs to the `sglang-ddtree` CLI: one line on stderr, exit status 2, no traceback, found before any model
loads (the loaders are replaced by ones that fail the test), and no output folder left behind; `--help` works on
every subcommand."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from sglang_ddtree import cli

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def no_model_loads(monkeypatch):
    """Any model load (offline, demo) fails the test: every case here must be refused before it."""

    def boom(*a, **k):
        raise AssertionError("a model was loaded for an input that should have been refused first")

    import sglang_ddtree.demo as demo
    import sglang_ddtree.offline.cli_commands as cc

    monkeypatch.setattr(cc, "_load_models", boom)
    monkeypatch.setattr(demo, "_run", boom)


def run(capsys, *argv) -> tuple[int, str, str]:
    try:
        rc = cli.main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def assert_refused(capsys, *argv, says: str) -> str:
    rc, out, err = run(capsys, *argv)
    assert rc == 2, (rc, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and "Traceback" not in out
    assert says in lines[0], lines[0]
    return lines[0]


def unwritable(tmp_path: Path) -> Path:
    """A folder nobody can create files in: sysfs for root (root ignores permission bits), a read-only folder
    otherwise."""
    if os.geteuid() == 0:
        return Path("/sys")
    d = tmp_path / "read-only"
    d.mkdir()
    d.chmod(0o500)
    return d


# ---------------------------------------------------------------------------------------------------------------
# demo


@pytest.mark.parametrize("budgets, says", [
    ("5000", "1..1024"),
    ("16,,32", "no empty entries"),
    ("16,x", "comma-separated whole numbers"),
    ("0", "1..1024"),
    ("16,16", "twice"),
])
def test_demo_bad_budgets(capsys, tmp_path, budgets, says):
    out = tmp_path / "demo-out"
    line = assert_refused(capsys, "demo", "--budgets", budgets, "--out", out, says=says)
    assert "--budgets" in line
    assert not out.exists()


@pytest.mark.parametrize("flag", ["--prompts", "--max-new-tokens", "--repeats"])
@pytest.mark.parametrize("value", ["0", "-3", "two"])
def test_demo_counts_must_be_positive(capsys, tmp_path, flag, value):
    line = assert_refused(capsys, "demo", flag, value, "--out", tmp_path / "o", says=">= 1")
    assert flag in line and "limit" not in line  # the user's flag, not the offline runner's internal name


def test_demo_device_tpu(capsys, tmp_path):
    assert_refused(capsys, "demo", "--device", "tpu", "--out", tmp_path / "o", says="expected cpu, cuda or cuda:N")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: --device cuda is valid here")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_demo_device_cuda_without_a_gpu(capsys, tmp_path, device):
    assert_refused(capsys, "demo", "--device", device, "--out", tmp_path / "o", says="no CUDA GPU")


def test_demo_out_is_an_existing_file(capsys, tmp_path):
    f = tmp_path / "taken"
    f.write_text("keep me")
    assert_refused(capsys, "demo", "--out", f, says="is an existing file")
    assert f.read_text() == "keep me"
    assert_refused(capsys, "demo", "--out", f / "below", says="is a file, not a folder")


def test_demo_out_unwritable(capsys, tmp_path):
    target = unwritable(tmp_path) / "demo" / "out"
    assert_refused(capsys, "demo", "--out", target, says="is not writable")
    assert not target.parent.exists()


def test_a_failed_demo_leaves_no_empty_folders(capsys, tmp_path, monkeypatch):
    """A run that fails after the arguments passed (here: the decoding raises) removes the folders it made, and
    only those."""
    import sglang_ddtree.demo as demo

    def crash(args):
        assert Path(args.out).is_dir()  # made for the run
        raise RuntimeError("decoding failed")

    monkeypatch.setattr(demo, "_run", crash)
    kept = tmp_path / "existing"
    kept.mkdir()
    with pytest.raises(RuntimeError):
        cli.main(["demo", "--out", str(kept / "new" / "deeper")])
    assert kept.is_dir() and list(kept.iterdir()) == []

    monkeypatch.setattr(demo, "_run", lambda args: 2)  # a failure reported by exit status
    assert cli.main(["demo", "--out", str(kept / "other")]) == 2
    assert list(kept.iterdir()) == []

    monkeypatch.setattr(demo, "_run", lambda args: (Path(args.out) / "summary.json").write_text("{}") and 1)
    assert cli.main(["demo", "--out", str(kept / "lossy")]) == 1  # not lossless: its outputs are kept to inspect
    assert (kept / "lossy" / "summary.json").exists()


# ---------------------------------------------------------------------------------------------------------------
# offline, compare, import-reference, from-server


def test_offline_bad_inputs(capsys, tmp_path):
    out = tmp_path / "b.jsonl"
    assert_refused(capsys, "offline", "--tiny", "--limit", "0", "--out", out, says="--limit")
    assert_refused(capsys, "offline", "--tiny", "--budgets", "16,,32", "--out", out, says="no empty entries")
    assert_refused(capsys, "offline", "--tiny", "--budgets", "2048", "--out", out, says="1..1024")
    assert_refused(capsys, "offline", "--tiny", "--device", "tpu", "--out", out, says="--device")
    assert_refused(capsys, "offline", "--tiny", "--out", tmp_path, says="is a folder")
    assert_refused(capsys, "offline", "--tiny", "--out", unwritable(tmp_path) / "b.jsonl", says="is not writable")
    assert not out.exists()


@pytest.mark.parametrize("flag, value, says", [
    ("--temperature", "-1", "expected a number >= 0, got -1"),
    ("--temperature", "nan", "expected a number >= 0, got 'nan'"),
    ("--temperature", "warm", "expected a number >= 0, got 'warm'"),
    ("--top-p", "2", "expected a number in (0, 1], got 2"),
    ("--top-p", "0", "expected a number in (0, 1], got 0"),
    ("--top-k", "-5", "expected a whole number >= 0, got -5"),
    ("--top-k", "0.5", "expected a whole number >= 0, got '0.5'"),
])
def test_offline_sampling_out_of_range_is_refused_while_parsing(capsys, tmp_path, flag, value, says):
    """Refused by the argument parser: no model loads and no output file is created, so nothing blocks the
    corrected rerun."""
    out = tmp_path / "b.jsonl"
    line = assert_refused(capsys, "offline", "--tiny", flag, value, "--out", out, says=says)
    assert f"argument {flag}" in line
    assert not out.exists()


@pytest.mark.parametrize("flag", ["--target", "--drafter", "--tokenizer"])
def test_offline_model_folder_that_is_a_file(capsys, tmp_path, flag):
    readme = ROOT / "README.md"
    line = assert_refused(capsys, "offline", "--tiny", flag, readme, "--out", tmp_path / "b.jsonl",
                          says="is a file, not a folder")
    assert "does not exist" not in line


def test_offline_tiny_pair_missing_says_where_it_is_looked_for(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_DDTREE_TINY_DIR", str(tmp_path / "nowhere"))
    for argv in (["offline", "--tiny", "--out", tmp_path / "b.jsonl"], ["demo", "--out", tmp_path / "d"]):
        assert_refused(capsys, *argv, says="run from the repository's root (it holds models/tiny)")
    assert not (tmp_path / "b.jsonl").exists() and not (tmp_path / "d").exists()


def test_offline_methods_needing_a_drafter_are_refused_before_loading(capsys, tmp_path):
    assert_refused(capsys, "offline", "--target", ROOT / "models" / "tiny" / "target", "--methods", "plain,dflash",
                   "--out", tmp_path / "b.jsonl", says="need a drafter")


@pytest.fixture
def garbage_pt(tmp_path) -> Path:
    p = tmp_path / "garbage.pt"
    p.write_bytes(b"I am not a checkpoint\n" + bytes(range(256)))
    return p


@pytest.mark.parametrize("trust", [False, True])
def test_garbage_reference_file(capsys, tmp_path, garbage_pt, trust):
    """Neither a zip archive (torch.save's format) nor a pickle: said so, without suggesting --trust-pickle."""
    flag = ["--trust-pickle"] if trust else []
    says = "is not a torch.save file (neither a zip archive nor a pickle)"
    for argv in (["compare", garbage_pt, garbage_pt, *flag],
                 ["import-reference", garbage_pt, "--out", tmp_path / "x.jsonl", *flag]):
        assert "--trust-pickle" not in assert_refused(capsys, *argv, says=says)
    assert not (tmp_path / "x.jsonl").exists()


def test_a_pickle_that_weights_only_refuses_suggests_trust_pickle(capsys, tmp_path):
    """A real pickle with a class weights_only loading does not allow: --trust-pickle is the fix for a file you
    made yourself."""
    import pickle

    p = tmp_path / "ref.pt"
    p.write_bytes(pickle.dumps({"responses": [], "when": Path("x")}, protocol=2))
    line = assert_refused(capsys, "import-reference", p, "--out", tmp_path / "x.jsonl",
                          says="could not load with weights_only=True")
    assert "retry with trust_pickle=True (--trust-pickle)" in line


@pytest.mark.parametrize("kind, says", [
    ("folder", "is a folder; expected the .pt file"),
    ("jsonl", "is JSON text, not a torch.save file; expected the .pt file"),
    ("text", "is a text file, not a torch.save file"),
    ("empty", "is empty; expected the .pt file"),
])
def test_import_reference_of_something_else_says_what_it_expected(capsys, tmp_path, kind, says):
    ref = tmp_path / "ref"
    if kind == "folder":
        ref.mkdir()
    else:
        ref.write_text({"jsonl": '{"format": "sglang-ddtree-baseline"}\n', "text": "hello\n", "empty": ""}[kind])
    for trust in ([], ["--trust-pickle"]):
        line = assert_refused(capsys, "import-reference", ref, "--out", tmp_path / "x.jsonl", *trust, says=says)
        assert "--trust-pickle" not in line
    if kind == "jsonl":
        assert "a baseline JSONL needs no import" in line
    assert not (tmp_path / "x.jsonl").exists()


@pytest.mark.parametrize("dump_text, says", [
    ("", "is empty"),
    ('{"rid": "r1", "output_tokens_before": 1}\n', "has no header line"),
])
def test_from_server_dump_without_a_header_names_the_real_fix(capsys, tmp_path, dump_text, says):
    dump, results, out = tmp_path / "dump.jsonl", tmp_path / "results.jsonl", tmp_path / "server.jsonl"
    dump.write_text(dump_text)
    results.write_text('{"output_ids": [1, 2], "meta_info": {"id": "r1", "spec_verify_ct": 0}}\n')
    line = assert_refused(capsys, "from-server", "--debug", dump, "--results", results, "--out", out, says=says)
    assert "--speculative-ddtree-debug" in line and "method=" not in line
    assert not out.exists()


def test_reference_file_with_garbage_values_names_the_field(capsys, tmp_path):
    p = tmp_path / "bad_values.pt"
    torch.save({"responses": [{"baseline": {"output_ids": [1, 2, 3], "num_input_tokens": "abc",
                                            "num_output_tokens": 3, "acceptance_lengths": [1, 1]}}],
                "block_size": 16, "args": {}}, p)
    assert_refused(capsys, "import-reference", p, "--out", tmp_path / "x.jsonl", "--trust-pickle",
                   says="num_input_tokens: expected a whole number")


def test_compare_json_unwritable_is_refused_before_reading_the_inputs(capsys, tmp_path):
    missing = tmp_path / "missing.jsonl"  # never read: the --json check comes first
    assert_refused(capsys, "compare", missing, missing, "--json", unwritable(tmp_path) / "r.json",
                   says="--json")
    assert_refused(capsys, "compare", missing, missing, "--json", tmp_path, says="is a folder")


def test_import_reference_and_from_server_out_unwritable(capsys, tmp_path):
    bad = unwritable(tmp_path) / "x.jsonl"
    ref = ROOT / "tests" / "fixtures" / "reference_small.pt"
    assert_refused(capsys, "import-reference", ref, "--out", bad, says="is not writable")
    assert_refused(capsys, "from-server", "--debug", tmp_path / "d.jsonl", "--results", tmp_path / "r.jsonl",
                   "--out", bad, says="is not writable")


# ---------------------------------------------------------------------------------------------------------------
# --help everywhere


SUBCOMMANDS = ["demo", "offline", "compare", "import-reference", "compare-zlab", "from-server", "bench", "summary"]


def test_the_subcommand_list_is_the_parsers():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert list(sub.choices) == SUBCOMMANDS


@pytest.mark.parametrize("command", [c for c in SUBCOMMANDS if c != "bench"])
def test_help_on_every_subcommand(capsys, command):
    rc, out, err = run(capsys, command, "--help")
    assert rc == 0 and out.startswith(f"usage: sglang-ddtree {command}") and not err


def test_bench_help_is_the_bench_scripts(capfd):
    """`bench` hands its arguments to benchmarks/bench_budgets.py (a subprocess), --help included, under the
    command's name."""
    rc = cli.main(["bench", "--help"])
    out, err = capfd.readouterr()
    assert rc == 0, err
    assert out.startswith("usage: sglang-ddtree bench ") and "--setups" in out and "unrecognized" not in err
    assert "bench_budgets.py [" not in out
    rc = cli.main(["bench", "--frobnicate"])
    out, err = capfd.readouterr()
    assert rc == 2 and "sglang-ddtree bench: error: unrecognized arguments: --frobnicate" in err


def test_top_level_errors_are_one_line(capsys):
    assert_refused(capsys, says="required: COMMAND")
    assert_refused(capsys, "frobnicate", says="invalid choice")
    assert_refused(capsys, "compare", "only-one-file", says="required")


def test_the_installed_entry_point_exits_2_without_a_traceback(tmp_path):
    """The same through a real process (the console script runs cli.main and exits with its status)."""
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "sglang_ddtree.cli", "demo", "--budgets", "5000", "--out",
                           str(tmp_path / "o")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv", [["bench", "--dry-run"], ["summary", "--check"]])
def test_bench_and_summary_say_in_one_sentence_that_an_installed_wheel_has_no_harness(capsys, monkeypatch, tmp_path,
                                                                                     argv):
    """An installed wheel holds the package only: next to it there are no benchmarks/, scripts/ or ddtree_bench/.
    With the scripts there but the harness not (a partial copy), the harness is named."""
    import sglang_ddtree.bench_cli as bench_cli

    monkeypatch.setattr(bench_cli, "ROOT", tmp_path)
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and not out and err.count("\n") == 1 and "runs from a clone of the repository" in err
    for script in (bench_cli.BENCH_SCRIPT, bench_cli.SUMMARY_SCRIPT):
        (tmp_path / script).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / script).write_text("raise SystemExit(0)\n")
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and err.startswith(f"error: {bench_cli.HARNESS} is not in this installation")
    (tmp_path / bench_cli.HARNESS).mkdir()
    assert run(capsys, *argv)[0] == 0
