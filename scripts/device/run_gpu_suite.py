#!/usr/bin/env python3
"""Run GPU test modules and benchmark commands on the GPU machine and leave the results under $OUT.

  source scripts/device/env.sh && python3 scripts/device/run_gpu_suite.py tests/gpu/test_server_smoke.py \\
      [--bench NAME='shell command' ...] [--jit-cache .device-cache/jit/jit-cache.tar.xz] [--return-jit-cache] \\
      [--deadline-s 540] [-- extra pytest args]

Writes into OUT ($OUT on the device, else --out, else runs/gpu-suite), never more than 8 files there:
  junit.xml        pytest's JUnit XML (-rA output goes to stdout and into the logs)
  gpu_suite.json   counts, one entry per test (outcome, seconds, message), seconds per phase (install, jit_restore,
                   first_server_start, suite, bench, jit_return), server starts, records written by the tests,
                   versions and GPU, the site check, the JIT cache's fate
  logs.tar.xz      pytest.log, every server log, benchmark logs, nvidia-smi, check_site output, gpu_suite.json
  jit-cache.tar.xz with --return-jit-cache, when it fits in 16 MiB: every JIT cache plus stamp.json
  results/...      whatever benchmark commands write to $GPU_SUITE_RESULTS_DIR (extra files go into logs.tar.xz)
Exit status 0 only when pytest passed (nothing failed or errored, something ran) and every benchmark exited 0.

The runner sets DDTREE_GPU_REQUIRED=1 for pytest (tests/gpu/conftest.py then fails, not skips, when CUDA or
SGLang is missing: on the device that is a broken install, not a reason to pass); --allow-missing-gpu lifts it.
Standard library only: it must run before anything else is known to work.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
MAX_OUT_FILES = 8
MAX_FILE_BYTES = 16 * 2**20
STAMP_PACKAGES = ["torch", "triton", "sglang", "sglang-kernel", "flashinfer-python", "apache-tvm-ffi"]
OWN_OUTPUTS = ["junit.xml", "gpu_suite.json", "logs.tar.xz"]  # jit-cache.tar.xz counted when made


def log(msg: str) -> None:
    print(f"[gpu-suite] {msg}", flush=True)


def pkg_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def gpu_facts(log_dir: Path) -> dict:
    """GPU name and driver from nvidia-smi (no CUDA context needed); full nvidia-smi output into the logs."""
    facts = {"gpu": None, "driver": None}
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        if q.returncode == 0 and q.stdout.strip():
            first = q.stdout.strip().splitlines()[0].split(",")
            facts = {"gpu": first[0].strip(), "driver": first[1].strip() if len(first) > 1 else None,
                     "gpu_count": len(q.stdout.strip().splitlines())}
        full = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
        (log_dir / "nvidia-smi.txt").write_text(full.stdout + full.stderr)
    except (OSError, subprocess.TimeoutExpired) as exc:
        (log_dir / "nvidia-smi.txt").write_text(f"nvidia-smi unavailable: {exc}\n")
    return facts


def jit_stamp(gpu: dict) -> dict:
    """What a JIT cache depends on: a mismatch in any of these means its kernels may not be reusable."""
    stamp = {name: pkg_version(name) for name in STAMP_PACKAGES}
    stamp["python"] = sys.version.split()[0]
    stamp["gpu"] = gpu.get("gpu")
    return stamp


# --------------------------------------------------------------------------------------------------- site


def site_status(site: Path) -> dict:
    marks = site / ".ddtree-chunks"
    status: dict = {"site": str(site), "installed": [], "missing": [], "install_seconds": 0.0, "installs": []}
    if (marks / "installs.jsonl").exists():
        for line in (marks / "installs.jsonl").read_text().splitlines():
            try:
                status["installs"].append(json.loads(line))
            except json.JSONDecodeError:
                pass
        status["install_seconds"] = round(sum(i.get("seconds", 0.0) for i in status["installs"]), 2)
    if (marks / "manifest.json").exists():
        manifest = json.loads((marks / "manifest.json").read_text())
        for chunk in manifest.get("chunks", []):
            mark = marks / f"{chunk['name']}.sha256"
            ok = mark.exists() and mark.read_text().strip() == chunk["sha256"]
            status["installed" if ok else "missing"].append(chunk["name"])
    else:
        status["note"] = "no manifest.json in the site dir: were the chunks installed with install_chunk.sh?"
    return status


def run_check_site(log_dir: Path) -> dict:
    out = log_dir / "check_site.json"
    try:
        proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts/device/check_site.py"), "--json", str(out)],
                              capture_output=True, text=True, timeout=120)
        (log_dir / "check_site.txt").write_text(proc.stdout + proc.stderr)
        if out.exists():
            res = json.loads(out.read_text())
            return {"unmet": res["unmet"], "shadowed": res["shadowed"], "distributions": res["distributions"]}
        return {"error": (proc.stdout + proc.stderr)[-2000:]}
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": str(exc)}


# ---------------------------------------------------------------------------------------------- JIT cache


def restore_jit_cache(archive: Path | None, jit_root: Path, stamp: dict) -> dict:
    if archive is None:
        return {"restored": False, "reason": "no --jit-cache given"}
    if not archive.exists():
        return {"restored": False, "reason": f"{archive} not here (carry its folder to use it)"}
    try:
        with tarfile.open(archive, "r:xz") as tf:
            member = tf.next()
            if member is None or member.name != "stamp.json":
                return {"restored": False, "reason": "archive does not start with stamp.json"}
            theirs = json.loads(tf.extractfile(member).read())
            if theirs != stamp:
                diff = {k: [theirs.get(k), stamp.get(k)] for k in sorted(set(theirs) | set(stamp))
                        if theirs.get(k) != stamp.get(k)}
                return {"restored": False, "reason": "stale: versions or GPU differ", "diff": diff}
            jit_root.mkdir(parents=True, exist_ok=True)
            rest = [m for m in tf.getmembers() if m.name != "stamp.json"]
            tf.extractall(jit_root, members=rest, filter="data")
        return {"restored": True, "files": len(rest), "bytes": archive.stat().st_size}
    except (OSError, tarfile.TarError, json.JSONDecodeError, lzma.LZMAError) as exc:
        return {"restored": False, "reason": f"unreadable archive: {exc}"}


def _jit_skip(rel: Path) -> bool:
    """Object files of SGLang's tvm-ffi kernels: it reuses a built module when its .so exists
    (sglang/kernels/jit/utils/compile.py), so the .o files only take room. Flashinfer's build dirs stay whole:
    it always runs ninja, which wants its objects."""
    return rel.parts[0] == "tvm-ffi" and rel.suffix == ".o"


def pack_jit_cache(jit_root: Path, stamp: dict, dest: Path, work: Path) -> dict:
    files = sorted(p for p in jit_root.rglob("*") if p.is_file() and not _jit_skip(p.relative_to(jit_root))) \
        if jit_root.exists() else []
    if not files:
        return {"returned": False, "reason": f"nothing under {jit_root}"}
    stamp_file = work / "stamp.json"
    stamp_file.write_text(json.dumps(stamp, indent=1) + "\n")
    with tarfile.open(dest, "w:xz", preset=6) as tf:
        tf.add(stamp_file, arcname="stamp.json")  # first, so a restore can judge it before unpacking anything
        for p in files:
            tf.add(p, arcname=p.relative_to(jit_root).as_posix(), recursive=False)
    size = dest.stat().st_size
    raw = sum(p.stat().st_size for p in files)
    if size > MAX_FILE_BYTES:
        dest.unlink()
        return {"returned": False, "reason": f"{size} bytes compressed, over the 16 MiB per-file limit",
                "raw_bytes": raw}
    return {"returned": True, "bytes": size, "raw_bytes": raw, "files": len(files)}


# ------------------------------------------------------------------------------------------------- pytest


def run_logged(cmd: list[str], log_path: Path, env: dict, timeout_s: float, cwd: Path) -> tuple[int, bool]:
    """Run cmd in its own process group, teeing output to stdout and log_path. On timeout: SIGINT first (pytest
    then runs its teardowns, which stop the servers), SIGKILL 30 s later. Returns (exit code, timed_out)."""
    with open(log_path, "w") as logf:
        # SIGINT restored to its default in the child: a runner started in the background by a non-interactive
        # shell inherits SIGINT ignored, and Python then never raises KeyboardInterrupt on the deadline's SIGINT.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                text=True, errors="replace", start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

        def pump() -> None:
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                logf.write(line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            timed_out = True
            log(f"deadline reached, interrupting {' '.join(cmd[:4])}")
            _signal_group(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()
        reader.join(timeout=10)
        return proc.returncode, timed_out


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def parse_junit(path: Path) -> tuple[list[dict], dict]:
    tests = []
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    if not path.exists():
        return tests, counts
    root = ET.parse(path).getroot()
    for case in root.iter("testcase"):
        cls, name = case.get("classname", ""), case.get("name", "")
        if not cls and not name:
            # a run cut by its deadline left `<testcase time="0.000" />` (the test under way when pytest
            # was stopped), which counted as a pass
            continue
        test_id = f"{cls}::{name}" if cls else name
        outcome, message, details = "passed", "", ""
        # pytest may attach an <error> (teardown) next to a <failure>: the worst one decides.
        for tag, label in (("skipped", "skipped"), ("failure", "failed"), ("error", "errors")):
            el = case.find(tag)
            if el is not None:
                outcome, message, details = label, el.get("message") or "", el.text or ""
        counts[outcome] += 1
        tests.append({"id": test_id, "outcome": {"errors": "error"}.get(outcome, outcome),
                      "seconds": round(float(case.get("time") or 0.0), 3), "message": message.strip()[:1000],
                      "details": details.strip()[-4000:]})
    return tests, counts


def read_records(log_dir: Path) -> list[dict]:
    path = log_dir / "records.jsonl"
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def kill_leftover_servers(log_dir: Path) -> list[int]:
    """conftest writes each server's process group id to servers.pgids; stop any still alive."""
    killed = []
    path = log_dir / "servers.pgids"
    if path.exists():
        for line in path.read_text().split():
            pgid = int(line)
            try:
                os.killpg(pgid, signal.SIGKILL)
                killed.append(pgid)
            except (ProcessLookupError, PermissionError):
                pass
    return killed


# -------------------------------------------------------------------------------------------------- output


def enforce_out_limits(out: Path, log_dir: Path, reserved: list[str]) -> list[str]:
    """Keep at most MAX_OUT_FILES files, 2 folders deep, under OUT: move the excess into the log bundle."""
    moved = []
    reserved_set = set(reserved)
    others = sorted(p for p in out.rglob("*") if p.is_file() and p.relative_to(out).as_posix() not in reserved_set)
    allowed = MAX_OUT_FILES - len(reserved_set)
    for i, p in enumerate(others):
        rel = p.relative_to(out)
        too_deep = len(rel.parts) > 3
        too_big = p.stat().st_size > MAX_FILE_BYTES
        if i >= allowed or too_deep or too_big:
            dest = log_dir / "out-overflow" / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(p), dest)
            moved.append(rel.as_posix())
    return moved


def bundle_logs(log_dir: Path, dest: Path) -> dict:
    def build(truncate_over: int | None) -> None:
        with tarfile.open(dest, "w:xz", preset=6) as tf:
            for p in sorted(log_dir.rglob("*")):
                if not p.is_file():
                    continue
                arc = p.relative_to(log_dir).as_posix()
                if truncate_over is not None and p.stat().st_size > truncate_over:
                    data = p.read_bytes()[-truncate_over:]
                    tmp = Path(tempfile.mkstemp()[1])
                    tmp.write_bytes(b"[... truncated to the last %d bytes ...]\n" % truncate_over + data)
                    tf.add(tmp, arcname=arc)
                    tmp.unlink()
                else:
                    tf.add(p, arcname=arc)

    build(None)
    truncated = False
    for limit in (4 * 2**20, 2**20, 2**18):
        if dest.stat().st_size <= MAX_FILE_BYTES:
            break
        build(limit)
        truncated = True
    return {"bytes": dest.stat().st_size, "truncated": truncated}


# ---------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    t_begin = time.monotonic()
    argv = sys.argv[1:] if argv is None else argv
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tests", nargs="*", default=["tests/gpu"], help="pytest targets (default tests/gpu)")
    ap.add_argument("--bench", action="append", default=[], metavar="NAME=CMD",
                    help="a shell command run after pytest (repeatable); writes results to $GPU_SUITE_RESULTS_DIR")
    ap.add_argument("--out", type=Path, default=None, help="output dir (default $OUT, else runs/gpu-suite)")
    ap.add_argument("--log-dir", type=Path, default=None,
                    help="where logs gather before bundling (default: a temp dir)")
    ap.add_argument("--jit-cache", type=Path, default=None, help="a jit-cache.tar.xz from an earlier machine to restore")
    ap.add_argument("--return-jit-cache", action="store_true", help="pack the JIT caches into OUT/jit-cache.tar.xz")
    ap.add_argument("--deadline-s", type=float, default=540.0,
                    help="stop pytest/benchmarks this many seconds after start, leaving time to write results "
                         "(a device call is killed at 600 s)")
    ap.add_argument("--allow-missing-gpu", action="store_true",
                    help="let tests/gpu skip when CUDA or SGLang is missing instead of failing")
    args = ap.parse_args(argv)
    if args.deadline_s <= 0:
        raise SystemExit(f"--deadline-s must be positive (seconds), got {args.deadline_s}.")
    benches = []
    for spec in args.bench:
        name, sep, cmd = spec.partition("=")
        if not sep or not name or not cmd or not name.replace("-", "").replace("_", "").isalnum():
            raise SystemExit(f"--bench expects NAME=COMMAND with NAME in letters, digits, '-' and '_', got {spec!r}.")
        benches.append((name, cmd))

    out = args.out or Path(os.environ.get("OUT") or REPO_ROOT / "runs" / "gpu-suite")
    out.mkdir(parents=True, exist_ok=True)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="gpu-suite-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    results_dir = out / "results"
    site = Path(os.environ.get("DDTREE_SITE", "/tmp/site"))
    jit_root = Path(os.environ.get("DDTREE_JIT_ROOT", "/tmp/jit"))
    phases: dict[str, float | None] = {}
    report: dict = {"tests_requested": args.tests, "out": str(out)}

    # -- preflight: what is installed, on which GPU
    gpu = gpu_facts(log_dir)
    report["env"] = {**gpu, "python": sys.version.split()[0],
                     **{name: pkg_version(name) for name in STAMP_PACKAGES + ["transformers", "tokenizers"]}}
    report["site"] = site_status(site)
    phases["install"] = report["site"]["install_seconds"] or None
    if report["site"]["missing"]:
        log(f"WARNING: chunks not installed: {report['site']['missing']}")
    report["site_check"] = run_check_site(log_dir)
    log(f"GPU {gpu.get('gpu')}, torch {report['env']['torch']}, sglang {report['env']['sglang']}, "
        f"site chunks in: {report['site']['installed']}, unmet requirements: "
        f"{len(report['site_check'].get('unmet', []))}")

    # -- JIT cache from an earlier machine
    stamp = jit_stamp(gpu)
    t = time.monotonic()
    report["jit_cache"] = {"restore": restore_jit_cache(args.jit_cache, jit_root, stamp)}
    phases["jit_restore"] = round(time.monotonic() - t, 2)
    log(f"JIT cache restore: {report['jit_cache']['restore']}")

    # -- pytest
    env = dict(os.environ, GPU_SUITE_LOG_DIR=str(log_dir), GPU_SUITE_RESULTS_DIR=str(results_dir),
               PYTHONUNBUFFERED="1")
    if not args.allow_missing_gpu:
        env["DDTREE_GPU_REQUIRED"] = "1"
    junit = out / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", *args.tests, "-rA", f"--junitxml={junit}", "-p", "no:cacheprovider",
           *extra]
    log("$ " + " ".join(cmd))
    reserve = 45.0 + (30.0 if args.return_jit_cache else 0.0)  # left for results, logs and the JIT archive
    t = time.monotonic()
    rc, timed_out = run_logged(cmd, log_dir / "pytest.log", env,
                               args.deadline_s - (time.monotonic() - t_begin) - reserve, REPO_ROOT)
    phases["suite"] = round(time.monotonic() - t, 2)
    report["pytest_exit_code"], report["pytest_timed_out"] = rc, timed_out
    report["leftover_servers_killed"] = kill_leftover_servers(log_dir)

    # -- benchmarks
    report["bench"] = []
    t = time.monotonic()
    for name, bcmd in benches:
        left = args.deadline_s - (time.monotonic() - t_begin) - reserve
        if left <= 5:
            report["bench"].append({"name": name, "cmd": bcmd, "exit_code": None, "seconds": 0,
                                    "note": "not run: deadline"})
            continue
        results_dir.mkdir(parents=True, exist_ok=True)
        log(f"bench {name}: $ {bcmd}")
        tb = time.monotonic()
        brc, bto = run_logged(["bash", "-c", bcmd], log_dir / f"bench-{name}.log", env, left, REPO_ROOT)
        report["bench"].append({"name": name, "cmd": bcmd, "exit_code": brc, "timed_out": bto,
                                "seconds": round(time.monotonic() - tb, 2)})
    phases["bench"] = round(time.monotonic() - t, 2) if benches else None

    # -- results
    tests, counts = parse_junit(junit)
    if not junit.exists():
        counts["errors"] += 1
        tests.append({"id": "<pytest>", "outcome": "error", "seconds": phases["suite"], "details": "",
                      "message": f"no junit.xml: pytest exited {rc}{' after the deadline' if timed_out else ''}"})
    records = read_records(log_dir)
    starts = [r for r in records if r.get("kind") == "server_start"]
    phases["first_server_start"] = starts[0]["seconds"] if starts else None
    report.update(counts=counts, tests=tests, server_starts=starts,
                  records=[r for r in records if r.get("kind") != "server_start"])

    if args.return_jit_cache:
        t = time.monotonic()
        report["jit_cache"]["return"] = pack_jit_cache(jit_root, stamp, out / "jit-cache.tar.xz", log_dir)
        phases["jit_return"] = round(time.monotonic() - t, 2)
        log(f"JIT cache return: {report['jit_cache']['return']}")

    reserved = OWN_OUTPUTS + (["jit-cache.tar.xz"] if (out / "jit-cache.tar.xz").exists() else [])
    report["moved_to_logs"] = enforce_out_limits(out, log_dir, reserved)
    ran = counts["passed"] + counts["failed"] + counts["errors"]
    bench_ok = all(b["exit_code"] == 0 for b in report["bench"])
    ok = rc == 0 and counts["failed"] == 0 and counts["errors"] == 0 and ran > 0 and bench_ok and not timed_out
    phases["total"] = round(time.monotonic() - t_begin, 2)
    report.update(ok=ok, phases_s=phases)
    text = json.dumps(report, indent=1, default=str) + "\n"
    (out / "gpu_suite.json").write_text(text)
    (log_dir / "gpu_suite.json").write_text(text)
    report["logs"] = bundle_logs(log_dir, out / "logs.tar.xz")

    # -- summary (the end of stdout is what the device tool hands back)
    log("=" * 70)
    for tcase in tests:
        if tcase["outcome"] in ("failed", "error"):
            log(f"{tcase['outcome'].upper()} {tcase['id']}: {tcase['message'][:300]}")
            for line in tcase.get("details", "").splitlines()[-6:]:
                log(f"    {line[:200]}")
    for b in report["bench"]:
        log(f"bench {b['name']}: exit {b['exit_code']} in {b['seconds']}s")
    log(f"counts {counts}  pytest exit {rc}{' (DEADLINE)' if timed_out else ''}")
    if timed_out:  # a module that records as it goes (test_real8b.py) keeps what finished before the deadline
        log(f"the deadline stopped pytest; gpu_suite.json holds the {len(report['records'])} records made before")
    log("phases (s): " + ", ".join(f"{k}={v}" for k, v in phases.items()))
    for r in report["records"][-10:]:
        log(f"record: {json.dumps(r)[:300]}")
    log(f"outputs: {sorted(p.relative_to(out).as_posix() for p in out.rglob('*') if p.is_file())}")
    log("RESULT: " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
