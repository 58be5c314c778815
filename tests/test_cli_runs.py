"""The `sglang-ddtree` CLI around a run: the CPU thread count it picks, Ctrl-C (one line saying what was kept, exit
status 130, no traceback), a failed or interrupted `offline` run leaving no header-only file in the way of the
rerun, and `summary --check` saying that the summary is current."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sglang_ddtree import cli
from sglang_ddtree.baseline import MethodRecord, read_baseline
from sglang_ddtree.cli_args import set_cpu_threads
from tests.test_cli_errors import run

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def keep_threads():
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


def last_line(err: str) -> str:
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


# ---------------------------------------------------------------------------------------------------------------
# threads


def test_the_tiny_pair_runs_on_one_cpu_thread_unless_asked(keep_threads):
    torch.set_num_threads(2)
    line = set_cpu_threads(None, "cpu", tiny=True, environ={})
    assert line == "1 CPU thread (the tiny pair's default; --threads N for more)"
    assert torch.get_num_threads() == 1
    assert set_cpu_threads(3, "cpu", tiny=True, environ={"OMP_NUM_THREADS": "1"}) == "3 CPU threads (--threads)"
    assert torch.get_num_threads() == 3  # --threads wins over OMP_NUM_THREADS


def test_an_omp_num_threads_the_user_set_is_kept(keep_threads):
    torch.set_num_threads(2)  # what torch took from OMP_NUM_THREADS=2 when it started
    assert set_cpu_threads(None, "cpu", tiny=True, environ={"OMP_NUM_THREADS": "2"}) == \
        "2 CPU threads (OMP_NUM_THREADS=2)"
    assert torch.get_num_threads() == 2


def test_other_models_and_gpus_keep_torchs_threads(keep_threads):
    torch.set_num_threads(2)
    line = set_cpu_threads(None, "cpu", tiny=False, environ={})
    assert line == "2 CPU threads (torch's default; --threads N to change)"
    assert set_cpu_threads(None, "cuda", tiny=True, environ={}) is None  # nothing to say on a GPU
    assert torch.get_num_threads() == 2


def test_offline_prints_its_thread_count_in_one_line(capsys, tmp_path, keep_threads, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    rc, out, _ = run(capsys, "offline", "--tiny", "--limit", "1", "--max-new-tokens", "4", "--methods", "plain",
                     "--device", "cpu", "--no-progress", "--out", tmp_path / "b.jsonl")
    assert rc == 0
    assert [ln for ln in out.splitlines() if "CPU thread" in ln] == [
        "offline: cpu, 1 CPU thread (the tiny pair's default; --threads N for more)"]
    assert torch.get_num_threads() == 1


# ---------------------------------------------------------------------------------------------------------------
# offline: Ctrl-C and failures


def fake_decoder(monkeypatch, complete: int, then: BaseException):
    """offline's decoder replaced: `complete` records, then `then` is raised."""
    import sglang_ddtree.offline.runner as runner

    calls = []

    def decode_one(target, draft, prompt, method, settings, **kw):
        calls.append((prompt.id, method))
        if len(calls) > complete:
            raise then
        return MethodRecord(prompt_id=prompt.id, method=method, output_ids=[3, 4, 5], prompt_index=prompt.index,
                            accept_lengths=[1, 1])

    monkeypatch.setattr(runner, "decode_one", decode_one)
    return calls


OFFLINE = ["offline", "--tiny", "--limit", "3", "--methods", "plain", "--device", "cpu", "--no-progress"]


def test_ctrl_c_in_offline_says_what_the_file_keeps(capsys, tmp_path, monkeypatch, keep_threads):
    out = tmp_path / "b.jsonl"
    fake_decoder(monkeypatch, 2, KeyboardInterrupt())
    rc, _, err = run(capsys, *OFFLINE, "--out", out)
    assert rc == 130
    assert last_line(err) == (f"interrupted: {out} keeps 2 complete record(s), 2 of them from this run; the same "
                              "command resumes it.")
    assert err.count("interrupted") == 1
    assert len(read_baseline(out).records) == 2

    calls = fake_decoder(monkeypatch, 10, KeyboardInterrupt())
    rc, _, _ = run(capsys, *OFFLINE, "--out", out)
    assert rc == 0 and len(calls) == 1 and len(read_baseline(out).records) == 3  # resumed: the third prompt only


def test_ctrl_c_before_the_first_record_leaves_no_file(capsys, tmp_path, monkeypatch, keep_threads):
    out = tmp_path / "b.jsonl"
    fake_decoder(monkeypatch, 0, KeyboardInterrupt())
    rc, _, err = run(capsys, *OFFLINE, "--out", out)
    assert rc == 130
    assert last_line(err) == "interrupted: no record was complete, so no output file was kept."
    assert not out.exists()


def test_a_failed_run_leaves_no_header_only_file(capsys, tmp_path, monkeypatch, keep_threads):
    out = tmp_path / "b.jsonl"
    fake_decoder(monkeypatch, 0, RuntimeError("decoding failed"))
    with pytest.raises(RuntimeError):
        cli.main([*OFFLINE, "--out", str(out)])
    assert not out.exists()
    fake_decoder(monkeypatch, 1, RuntimeError("decoding failed"))
    with pytest.raises(RuntimeError):
        cli.main([*OFFLINE, "--out", str(out)])
    assert len(read_baseline(out).records) == 1  # a record was written: the file is kept, for the rerun to resume


def test_a_header_only_file_with_other_settings_does_not_block_the_rerun(capsys, tmp_path, monkeypatch, keep_threads):
    """Such a file (left by a run that stopped before its first record) holds nothing to resume: it is started
    afresh instead of refused with 'cannot resume ... temperature'. A file with records still is refused."""
    out = tmp_path / "b.jsonl"
    fake_decoder(monkeypatch, 10, KeyboardInterrupt())
    assert run(capsys, *OFFLINE, "--temperature", "0.5", "--out", out)[0] == 0
    lines = out.read_text().splitlines()
    out.write_text(lines[0] + "\n")  # the header alone, temperature 0.5
    rc, _, err = run(capsys, *OFFLINE, "--out", out)
    assert rc == 0, err
    b = read_baseline(out)
    assert b.header.temperature == 0.0 and len(b.records) == 3
    rc, _, err = run(capsys, *OFFLINE, "--temperature", "0.5", "--out", out)
    assert rc == 2 and "cannot resume" in err and len(read_baseline(out).records) == 3


def test_ctrl_c_in_a_real_offline_process(tmp_path):
    """SIGINT to a real `sglang-ddtree offline` on the tiny pair once its file holds a record: exit 130, no
    traceback, one line naming the records kept, which are the file's."""
    out = tmp_path / "b.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "sglang_ddtree.cli", "offline", "--tiny", "--limit", "50",
                             "--max-new-tokens", "64", "--methods", "plain,dflash", "--device", "cpu", "--out",
                             str(out)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and len(out.read_text().splitlines()) >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    kept = len(read_baseline(out).records)
    assert kept >= 1
    line = last_line(err)
    assert line.startswith(f"interrupted: {out} keeps {kept} complete record(s), {kept} of them from this run")
    assert err.count("interrupted") == 1


# ---------------------------------------------------------------------------------------------------------------
# Ctrl-C elsewhere


def test_ctrl_c_in_the_demo_says_nothing_was_written(capsys, tmp_path, monkeypatch):
    import sglang_ddtree.demo as demo

    def interrupted(args):
        assert Path(args.out).is_dir()
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "_run", interrupted)
    rc, _, err = run(capsys, "demo", "--out", tmp_path / "demo")
    assert rc == 130
    assert err == "interrupted: nothing was written (the demo writes its outputs once every repeat is done).\n"
    assert not (tmp_path / "demo").exists()  # the folder it made is removed again


def test_ctrl_c_in_any_other_command_is_one_line(capsys, monkeypatch):
    import sglang_ddtree.offline.cli_commands as cc

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cc, "cmd_compare", interrupted)
    rc, out, err = run(capsys, "compare", "a.jsonl", "b.jsonl")
    assert rc == 130 and not out
    assert err == "interrupted: sglang-ddtree compare stopped before it finished.\n"


FAKE_SWEEP = """\
import argparse, pathlib, sys, time
ap = argparse.ArgumentParser()
ap.add_argument("--marker")
args = ap.parse_args()
print("usage name:", ap.prog, flush=True)
try:
    pathlib.Path(args.marker).write_text("running")
    time.sleep(120)
except KeyboardInterrupt:
    time.sleep(0.5)  # stopping its servers
    pathlib.Path(args.marker).write_text("stopped cleanly")
    print("end: 0 measured", flush=True)
    sys.exit(130)
"""


def bench_with_fake_sweep(tmp_path, script: str):
    """`sglang-ddtree bench --marker FILE` in a subprocess whose checkout holds `script` as the sweep; returns once
    the script has written its marker (it runs), with the process and the marker's path."""
    root = tmp_path / "checkout"
    (root / "benchmarks").mkdir(parents=True)
    (root / "ddtree_bench").mkdir()
    (root / "benchmarks" / "bench_budgets.py").write_text(script)
    marker = tmp_path / "marker"
    code = ("import sys; from pathlib import Path; import sglang_ddtree.bench_cli as b; from sglang_ddtree import cli; "
            f"b.ROOT = Path({str(root)!r}); sys.exit(cli.main(sys.argv[1:]))")
    proc = subprocess.Popen([sys.executable, "-c", code, "bench", "--marker", str(marker)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not marker.exists():
        time.sleep(0.05)
    return proc, marker


def test_ctrl_c_reaches_the_bench_sweep_once_and_is_waited_for(tmp_path):
    """`sglang-ddtree bench` runs the sweep in a process group of its own; SIGINT to the CLI is passed on to it, the
    CLI waits for it to finish stopping, then says in one line what was kept."""
    proc, marker = bench_with_fake_sweep(tmp_path, FAKE_SWEEP)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert marker.read_text() == "stopped cleanly"
    assert out.splitlines() == ["usage name: sglang-ddtree bench", "end: 0 measured"]
    assert err == ("interrupted: the rows measured before the stop stay in the sweep's results file (a rerun without "
                   "--fresh resumes it).\n")


# ---------------------------------------------------------------------------------------------------------------
# summary --check


def test_summary_check_says_it_is_current(capsys, tmp_path, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_summary", ROOT / "scripts" / "make_summary.py")
    ms = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ms)
    monkeypatch.setattr(ms, "RESULTS", tmp_path)
    monkeypatch.setattr(ms, "build", lambda: {"figure": 1.0})
    (tmp_path / "summary.json").write_text('{\n "figure": 1.0\n}\n')
    assert ms.main(["--check"]) == 0
    out, err = capsys.readouterr()
    assert out == "summary.json is current: it matches what the raw result files give.\n" and not err
    monkeypatch.setattr(ms, "build", lambda: {"figure": 2.0})
    assert ms.main(["--check"]) == 1
    out, err = capsys.readouterr()
    assert not out and "summary.json is stale" in err


FAKE_SWEEP_TERM = """\
import argparse, pathlib, signal, sys, time
ap = argparse.ArgumentParser()
ap.add_argument("--marker")
args = ap.parse_args()

def stop(signum, frame):
    pathlib.Path(args.marker).write_text(f"stopped by {signum}")
    sys.exit(128 + signum)

signal.signal(signal.SIGTERM, stop)
pathlib.Path(args.marker).write_text("running")
time.sleep(120)
"""


def test_sigterm_to_bench_reaches_the_sweep_and_is_waited_for(tmp_path):
    """A SIGTERM (or SIGHUP) to `sglang-ddtree bench` is passed on to the sweep's own process group, so its servers
    are stopped rather than left running; the CLI then exits 128 + the signal."""
    proc, marker = bench_with_fake_sweep(tmp_path, FAKE_SWEEP_TERM)
    time.sleep(0.3)  # the CLI's handlers are in place once the script runs
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert marker.read_text() == f"stopped by {int(signal.SIGTERM)}"
    assert proc.returncode == 128 + signal.SIGTERM
