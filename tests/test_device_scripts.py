"""CPU tests of scripts/device/ (the GPU machine's install, env and runner) and of the GPU suite's skipping."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DEVICE = REPO / "scripts" / "device"
sys.path.insert(0, str(DEVICE))

import _common  # noqa: E402
import pack_site  # noqa: E402


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, DEVICE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


run_gpu_suite = load_script("run_gpu_suite")
write_dist_info = load_script("write_dist_info")


# ---------------------------------------------------------------------------------------------- lock/manifest


def test_lock_matches_wheels_in():
    lock = {e.key: e for e in _common.read_lock()}
    wanted = _common.read_wanted()
    assert set(lock) == set(wanted.carried)
    for name, pin in wanted.carried.items():
        if pin:
            assert lock[name].version == pin, name
    # The versions the notes measured, and sglang's own pins, must be what we carry.
    for name, version in {"sglang": "0.5.17", "sglang-kernel": "0.4.5", "transformers": "5.12.1",
                          "tokenizers": "0.22.2", "flashinfer-python": "0.6.15.post1", "xgrammar": "0.2.1",
                          "openai": "2.6.1", "apache-tvm-ffi": "0.1.11"}.items():
        assert lock[name].version == version
    for e in lock.values():  # each file is a cp312-compatible manylinux/any wheel of that version
        assert e.filename.endswith(".whl") and f"-{e.version}-" in e.filename
        assert any(t in e.filename for t in ("-none-any", "manylinux", "abi3")), e.filename


def test_read_lock_rejects_duplicates_and_garbage(tmp_path):
    line = "foo==1.0 --hash=sha256:" + "a" * 64 + "  # foo-1.0-py3-none-any.whl\n"
    (tmp_path / "dup.lock").write_text(line + line.replace("foo==1.0", "Foo==2.0"))
    with pytest.raises(ValueError, match="more than once"):
        _common.read_lock(tmp_path / "dup.lock")
    (tmp_path / "bad.lock").write_text("foo>=1.0\n")
    with pytest.raises(ValueError, match="expected"):
        _common.read_lock(tmp_path / "bad.lock")


@pytest.mark.skipif(not (REPO / ".device-cache" / "manifest.json").exists(),
                    reason="no .device-cache/manifest.json here (run scripts/device/pack_site.py)")
def test_packed_manifest_matches_lock():
    manifest = json.loads((REPO / ".device-cache" / "manifest.json").read_text())
    lock = {e.key: e for e in _common.read_lock()}
    assert manifest["lock_sha256"] == _common.sha256_file(_common.LOCK_PATH), "packed from another lock: repack"
    packed = [p for c in manifest["chunks"] for p in c["packages"]]
    assert sorted(p["name"] for p in packed) == sorted(lock)  # each package exactly once
    for p in packed:
        e = lock[p["name"]]
        assert (p["version"], p["wheel"], p["wheel_sha256"]) == (e.version, e.filename, e.sha256)
    for c in manifest["chunks"]:
        assert c["bytes"] <= manifest["max_chunk_bytes"]
        path = REPO / c["path"]
        if path.exists():
            assert path.stat().st_size == c["bytes"]
            assert _common.sha256_file(path) == c["sha256"]


# ------------------------------------------------------------------------------------------- pack + install


def make_wheel(dest: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal valid py3-none-any wheel."""
    dist = f"{name}-{version}.dist-info"
    files = dict(files)
    files[f"{dist}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    files[f"{dist}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    wheel = dest / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return wheel


@pytest.fixture
def fake_set(tmp_path):
    """Three fake wheels (incompressible payloads), a lock for them, packed into 0.5 MiB chunks."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    rnd = lambda n, seed: hashlib.shake_256(seed.encode()).digest(n)  # noqa: E731
    specs = {
        "alpha": {"alpha/__init__.py": b"X = 1\n", "alpha/blob.bin": rnd(300_000, "a")},
        "beta": {"beta/__init__.py": b"Y = 2\n", "beta/blob.bin": rnd(200_000, "b"),
                 "beta/huge_ops.so": rnd(100_000, "trim")},
        "gamma": {"gamma.py": b"Z = 3\n", "gamma_data/blob.bin": rnd(250_000, "c")},
    }
    lines = []
    for name, files in specs.items():
        w = make_wheel(wheels, name, "1.0", files)
        lines.append(f"{name}==1.0 --hash=sha256:{_common.sha256_file(w)}  # {w.name}")
    lock = tmp_path / "wheels.lock"
    lock.write_text("# test lock\n" + "\n".join(lines) + "\n")
    out = tmp_path / "cache"
    out.mkdir()
    manifest = pack_site.pack(_common.read_lock(lock), wheels, out, 0.5, lock, {"beta": ["beta/*_ops.so"]})
    return {"manifest": manifest, "lock": lock, "out": out, "specs": specs, "tmp": tmp_path}


def test_pack_manifest_matches_lock_and_limits(fake_set):
    manifest, lock = fake_set["manifest"], _common.read_lock(fake_set["lock"])
    packed = {p["name"]: p for c in manifest["chunks"] for p in c["packages"]}
    assert sorted(packed) == sorted(e.key for e in lock)
    assert sum(len(c["packages"]) for c in manifest["chunks"]) == len(lock)
    assert len(manifest["chunks"]) >= 2, "0.5 MiB chunks cannot hold ~0.85 MB of random bytes"
    for c in manifest["chunks"]:
        path = Path(c["path"])
        assert path.stat().st_size == c["bytes"] <= manifest["max_chunk_bytes"]
        assert _common.sha256_file(path) == c["sha256"]
        assert (path.parent / "manifest.json").exists()
    assert packed["beta"]["trimmed_files"] == ["beta/huge_ops.so"]


def test_pack_is_reproducible(fake_set):
    first = [c["sha256"] for c in fake_set["manifest"]["chunks"]]
    out2 = fake_set["tmp"] / "cache2"
    out2.mkdir()
    again = pack_site.pack(_common.read_lock(fake_set["lock"]), fake_set["tmp"] / "wheels", out2, 0.5,
                           fake_set["lock"], {"beta": ["beta/*_ops.so"]})
    assert [c["sha256"] for c in again["chunks"]] == first


def run_install(chunks: list[Path], site: Path, unpack: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, DDTREE_SITE=str(site), DDTREE_UNPACK=unpack)
    return subprocess.run(["bash", str(DEVICE / "install_chunk.sh"), *map(str, chunks)], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("unpack", ["auto", "python"])
def test_install_chunk_unpacks_and_is_idempotent(fake_set, tmp_path, unpack):
    site = tmp_path / f"site-{unpack}"
    folders = [Path(c["path"]).parent for c in fake_set["manifest"]["chunks"]]
    first = run_install(folders, site, unpack)
    assert first.returncode == 0, first.stderr
    # Every file of every wheel is there, byte for byte, except the trimmed one.
    for files in fake_set["specs"].values():
        for rel, data in files.items():
            if rel == "beta/huge_ops.so":
                assert not (site / rel).exists()
            else:
                assert (site / rel).read_bytes() == data
    record = (site / "beta-1.0.dist-info" / "RECORD").read_text()
    assert "huge_ops.so" not in record and "beta/blob.bin" in record
    installs = (site / ".ddtree-chunks" / "installs.jsonl").read_text().splitlines()
    assert len(installs) == len(folders)
    assert (site / ".ddtree-chunks" / "manifest.json").exists()

    (site / "alpha" / "__init__.py").write_text("touched\n")  # a second run must not unpack again
    second = run_install(folders, site, unpack)
    assert second.returncode == 0, second.stderr
    assert second.stdout.count("already in") == len(folders)
    assert (site / "alpha" / "__init__.py").read_text() == "touched\n"
    assert len((site / ".ddtree-chunks" / "installs.jsonl").read_text().splitlines()) == len(folders)
    status = run_gpu_suite.site_status(site)
    assert sorted(status["installed"]) == sorted(c["name"] for c in fake_set["manifest"]["chunks"])
    assert status["missing"] == []


def test_install_chunk_replaces_a_changed_chunk_and_rejects_missing(tmp_path):
    site = tmp_path / "site"
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    chunk = tmp_path / "c" / "site-1.tar.xz"
    chunk.parent.mkdir()
    for version in ("one", "two"):
        (src / "pkg" / "v.txt").write_text(version)
        with tarfile.open(chunk, "w:xz") as tf:
            tf.add(src / "pkg" / "v.txt", arcname="pkg/v.txt")
        res = run_install([chunk], site, "auto")
        assert res.returncode == 0, res.stderr
        assert (site / "pkg" / "v.txt").read_text() == version
    assert "changed since it was installed" in res.stdout
    missing = run_install([tmp_path / "nope.tar.xz"], site, "auto")
    assert missing.returncode == 2 and "no such chunk" in missing.stderr


# -------------------------------------------------------------------------------------------------- env.sh


def test_dist_info_exposes_the_plugin_entry_point(tmp_path):
    write_dist_info.write(tmp_path)
    code = ("from importlib.metadata import entry_points, version; "
            "print(version('sglang-ddtree')); "
            "print([e.value for e in entry_points(group='sglang.srt.plugins') if e.name == 'ddtree'])")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    version, eps = out.stdout.splitlines()[:2]
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert version == project["version"]
    assert eps == repr([project["entry-points"]["sglang.srt.plugins"]["ddtree"]])
    # Rewriting for another version removes the old dist-info (two would both be found).
    (tmp_path / "sglang_ddtree-0.0.1.dist-info").mkdir()
    write_dist_info.write(tmp_path)
    assert [p.name for p in tmp_path.glob("sglang_ddtree-*.dist-info")] == [f"sglang_ddtree-{version}.dist-info"]


def test_env_sh_sets_paths_and_caches(tmp_path):
    script = (f"export DDTREE_SITE={tmp_path}/site DDTREE_JIT_ROOT={tmp_path}/jit; "
              f"source {DEVICE}/env.sh; source {DEVICE}/env.sh; "
              'echo "$PYTHONPATH"; echo "$TRITON_CACHE_DIR $TVM_FFI_CACHE_DIR $FLASHINFER_WORKSPACE_BASE"')
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    pythonpath, caches = out.stdout.splitlines()[:2]
    assert pythonpath == f"{tmp_path}/site:{REPO}"  # sourcing twice does not stack entries
    assert all(c.startswith(f"{tmp_path}/jit/") for c in caches.split())
    assert list((tmp_path / "site").glob("sglang_ddtree-*.dist-info"))


def test_queue_runs_a_plan_detached_and_collects_what_it_wrote(tmp_path):
    """queue.sh start returns at once; collect waits for the plan, reports every step's exit status (a failed step
    does not stop the next) and packs the results folder into $OUT without server-log tarballs."""
    import tarfile

    plan = tmp_path / "plan.sh"
    plan.write_text('step first bash -c "sleep 1; echo $C > $R/first.txt"\n'
                    "step broken false\n"
                    'step last bash -c "mkdir -p $R/sweep && echo x > $R/sweep/logs_x.tar.xz && echo y > $R/sweep/y.jsonl"\n')
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(QUEUE_DIR=str(tmp_path / "q"), OUT=str(out), DDTREE_SITE=str(tmp_path / "site"),
               DDTREE_JIT_ROOT=str(tmp_path / "jit"))
    started = subprocess.run(["bash", str(DEVICE / "queue.sh"), "start", str(plan), "abc1234"], env=env,
                             capture_output=True, text=True, timeout=60)
    assert started.returncode == 0 and "queue started" in started.stdout
    collected = subprocess.run(["bash", str(DEVICE / "queue.sh"), "collect", "60"], env=env, capture_output=True,
                               text=True, timeout=120)
    assert collected.returncode == 0, collected.stderr
    assert "still running" not in collected.stdout
    for line in ("== first exit 0", "== broken exit 1", "== last exit 0", "queue: done"):
        assert line in collected.stdout, collected.stdout
    with tarfile.open(out / "results.tar.xz") as tar:
        names = set(tar.getnames())
        assert tar.extractfile("results/first.txt").read().decode().strip() == "abc1234"
    assert "results/sweep/y.jsonl" in names and "results/sweep/logs_x.tar.xz" not in names
    with tarfile.open(out / "logs.tar") as tar:
        assert tar.getnames() == ["results/sweep/logs_x.tar.xz"]


# -------------------------------------------------------------------------------------------------- runner


def run_runner(tmp_path: Path, body: str, *extra: str) -> tuple[subprocess.CompletedProcess, dict, Path]:
    mod = tmp_path / "fake_tests" / "test_fake_suite.py"
    mod.parent.mkdir(parents=True, exist_ok=True)
    mod.write_text(body)
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env.update(DDTREE_SITE=str(tmp_path / "nosite"), DDTREE_JIT_ROOT=str(tmp_path / "jit"))
    proc = subprocess.run([sys.executable, str(DEVICE / "run_gpu_suite.py"), str(mod), "--out", str(out),
                           "--log-dir", str(tmp_path / "logs"), *extra], env=env, capture_output=True,
                          text=True, timeout=300)
    return proc, json.loads((out / "gpu_suite.json").read_text()), out


FAKE_MIXED = '''
import pytest
def test_good():
    assert 2 + 2 == 4
def test_broken():
    assert 2 + 2 == 5, "two plus two"
@pytest.mark.skip(reason="not today")
def test_skipped():
    pass
'''


def test_runner_turns_a_failure_into_nonzero_exit(tmp_path):
    proc, report, out = run_runner(tmp_path, FAKE_MIXED, "--bench", "hello=echo hi > $GPU_SUITE_RESULTS_DIR/hi.txt")
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert report["counts"] == {"passed": 1, "failed": 1, "skipped": 1, "errors": 0}
    assert report["ok"] is False
    broken = [t for t in report["tests"] if t["id"].endswith("test_broken")]
    assert broken[0]["outcome"] == "failed" and "two plus two" in broken[0]["message"]
    assert "assert (2 + 2) == 5" in broken[0]["details"]
    assert report["bench"][0]["exit_code"] == 0 and (out / "results" / "hi.txt").read_text() == "hi\n"
    assert set(report["phases_s"]) >= {"install", "jit_restore", "first_server_start", "suite", "bench"}
    junit = ET.parse(out / "junit.xml").getroot()
    assert len(list(junit.iter("testcase"))) == 3
    with tarfile.open(out / "logs.tar.xz") as tf:
        names = tf.getnames()
    assert "pytest.log" in names and "bench-hello.log" in names
    assert len([p for p in out.rglob("*") if p.is_file()]) <= 8
    assert "RESULT: FAIL" in proc.stdout


def test_runner_passes_a_clean_module_and_fails_a_failed_bench(tmp_path):
    proc, report, _ = run_runner(tmp_path, "def test_fine():\n    assert True\n")
    assert proc.returncode == 0 and report["ok"] is True and report["counts"]["passed"] == 1
    proc, report, _ = run_runner(tmp_path, "def test_fine():\n    assert True\n", "--bench", "bad=exit 3")
    assert proc.returncode == 1 and report["bench"][0]["exit_code"] == 3


def test_runner_keeps_out_within_eight_files(tmp_path):
    out, logs = tmp_path / "out", tmp_path / "logs"
    (out / "results").mkdir(parents=True)
    for i in range(10):
        (out / "results" / f"r{i}.json").write_text("{}")
    moved = run_gpu_suite.enforce_out_limits(out, logs, run_gpu_suite.OWN_OUTPUTS)
    left = [p for p in out.rglob("*") if p.is_file()]
    assert len(left) + len(run_gpu_suite.OWN_OUTPUTS) <= 8
    assert len(moved) == 10 - len(left) and all((logs / "out-overflow" / m).exists() for m in moved)


def test_jit_cache_round_trip_and_stale_check(tmp_path):
    jit = tmp_path / "jit"
    (jit / "triton" / "abc").mkdir(parents=True)
    (jit / "triton" / "abc" / "kernel.cubin").write_bytes(b"\x7fELF fake")
    stamp = {"torch": "2.11.0", "gpu": "NVIDIA H200", "sglang": "0.5.17"}
    archive = tmp_path / "jit-cache.tar.xz"
    res = run_gpu_suite.pack_jit_cache(jit, stamp, archive, tmp_path)
    assert res["returned"] and res["files"] == 1
    fresh = tmp_path / "fresh"
    assert run_gpu_suite.restore_jit_cache(archive, fresh, stamp)["restored"]
    assert (fresh / "triton" / "abc" / "kernel.cubin").read_bytes() == b"\x7fELF fake"
    other = tmp_path / "other"
    stale = run_gpu_suite.restore_jit_cache(archive, other, {**stamp, "gpu": "NVIDIA H100"})
    assert not stale["restored"] and "stale" in stale["reason"] and "gpu" in stale["diff"]
    assert not other.exists()


# ------------------------------------------------------------------------------------------- the GPU suite


def test_dummy_configs_are_a_consistent_pair():
    cfg = REPO / "tests" / "gpu" / "configs"
    target = json.loads((cfg / "dummy-target" / "config.json").read_text())
    drafter = json.loads((cfg / "dummy-drafter" / "config.json").read_text())
    assert drafter["architectures"] == ["DFlashDraftModel"]
    for key in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert drafter[key] == target[key], key
    assert drafter["num_target_layers"] == target["num_hidden_layers"]
    assert all(0 <= i < target["num_hidden_layers"] for i in drafter["dflash_config"]["target_layer_ids"])
    assert drafter["dflash_config"]["mask_token_id"] < target["vocab_size"]
    assert drafter["block_size"] == 16


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None and __import__("torch").cuda.is_available(),
                    reason="this machine has CUDA: the GPU suite would run, not skip")
def test_gpu_suite_is_collected_and_skipped_here(tmp_path):
    junit = tmp_path / "junit.xml"
    env = {k: v for k, v in os.environ.items() if k != "DDTREE_GPU_REQUIRED"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider",
                           f"--junitxml={junit}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    cases = list(ET.parse(junit).getroot().iter("testcase"))
    names = {c.get("name") for c in cases}
    assert {"test_plain_decoding_returns_tokens", "test_dflash_greedy_equals_plain"} <= names
    for case in cases:
        assert case.find("skipped") is not None, f"{case.get('name')} was not skipped"
        assert case.find("error") is None and case.find("failure") is None


def _sized(path, size: int) -> None:
    """A file of `size` bytes that takes no disk (sparse): the plan only counts sizes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.truncate(size)


def test_plan_fits_the_device_tool_limits(tmp_path):
    """Chunks share an install call while they fit next to the tree; the last call runs the work and keeps only
    the units that still fit beside the work's carried paths."""
    plan_mod = load_script("plan")
    manifest = {"chunks": [{"name": f"site-{i}", "carry": f".device-cache/site-{i}"} for i in (1, 2, 3)]}
    for i, mib in ((1, 30), (2, 20), (3, 5)):
        _sized(tmp_path / ".device-cache" / f"site-{i}" / f"site-{i}.tar.xz", mib * 2**20)
    calls = plan_mod.plan(manifest, ["tests/gpu/test_server_smoke.py"], ["b1=python3 -c 'print(1)'"], 540, True,
                          repo=tmp_path, base_bytes=20 * 2**20)
    assert [c["carry"] for c in calls] == [[".device-cache/site-1"], [".device-cache/site-2", ".device-cache/site-3"]]
    assert calls[0]["command"] == "bash scripts/device/install_chunk.sh .device-cache/site-1"
    assert calls[-1]["command"].startswith("bash scripts/device/install_chunk.sh .device-cache/site-2 "
                                           ".device-cache/site-3 && source scripts/device/env.sh && ")
    assert "run_gpu_suite.py" in calls[-1]["command"]
    assert "--bench 'b1=python3 -c '\"'\"'print(1)'\"'\"''" in calls[-1]["command"]  # shell-quoted intact
    assert all(not c["problems"] and len(c["command"]) <= 2000 for c in calls)
    assert [c["mib"] for c in calls] == [50.0, 45.0]
    big = plan_mod.plan(manifest, ["tests/gpu"], [], 540, True, repo=tmp_path, base_bytes=65 * 2**20)
    assert len(big) == 3 and all("MiB travel" in c["problems"][0] for c in big)
    # The work's carried paths (25 MiB) do not fit beside site-2 + site-3: site-2 gets a call of its own.
    _sized(tmp_path / "runs" / "bench" / "prompts.jsonl", 25 * 2**20)
    calls = plan_mod.plan(manifest, [], [], 540, False, repo=tmp_path, base_bytes=20 * 2**20, work="true",
                          extra_carry=["runs/bench"])
    assert [c["carry"] for c in calls] == [[".device-cache/site-1"], [".device-cache/site-2"],
                                           [".device-cache/site-3", "runs/bench"]]
    assert all(not c["problems"] for c in calls)
    # With a JIT cache present, the last call carries it and restores it.
    (tmp_path / ".device-cache" / "jit").mkdir(parents=True)
    (tmp_path / ".device-cache" / "jit" / "jit-cache.tar.xz").write_bytes(b"x")
    last = plan_mod.plan(manifest, ["tests/gpu"], [], 540, True, repo=tmp_path, base_bytes=0)[-1]
    assert last["carry"][-1] == ".device-cache/jit"
    assert "--jit-cache .device-cache/jit/jit-cache.tar.xz" in last["command"]


def test_plan_counts_travel_as_the_device_tool_does(tmp_path):
    """A file travels as a 512-byte header and its content padded to 512-byte blocks, so many small files count
    more than their sizes (a call at 63.7 MiB of plain sizes was refused as over 64 MiB)."""
    plan_mod = load_script("plan")
    (tmp_path / "d").mkdir()
    for name, size in (("one", 1), ("block", 512), ("more", 513), ("empty", 0)):
        (tmp_path / "d" / name).write_bytes(b"x" * size)
    assert plan_mod.path_bytes(tmp_path / "d" / "one") == 1024
    assert plan_mod.path_bytes(tmp_path / "d") == 1024 + 1024 + 1536 + 512
    assert plan_mod.path_bytes(tmp_path / "none") == 0


def test_plan_installs_split_parts_and_runs_other_work(tmp_path):
    """A chunk too large for a call next to the tree is installed from the parts split_chunk.py made, but only parts
    of this pack (parts.json's chunk name and sha256), as many a call as fit; a chunk that fits goes whole even when
    parts of it exist; --work runs another command (a steps.sh step) in the last call, with extra carried paths; a
    carried path this checkout lacks and an oversized call are problems, the latter with the split that would fit."""
    plan_mod = load_script("plan")
    split_chunk = load_script("split_chunk")
    cache = tmp_path / ".device-cache"
    for name, size in (("site-1", 3000), ("site-2", 300)):
        (cache / name).mkdir(parents=True)
        (cache / name / f"{name}.tar.xz").write_bytes(bytes(range(256)) * (size // 256) + b"x" * (size % 256))
    manifest = {"chunks": [{"name": n, "carry": f".device-cache/{n}",
                            "sha256": hashlib.sha256((cache / n / f"{n}.tar.xz").read_bytes()).hexdigest()}
                           for n in ("site-1", "site-2")]}
    # three parts: 3072, 3072 and 2560 bytes of travel (with parts.json); the whole chunk 3584, site-2 1024
    split_chunk.split(cache / "site-1", 1200)
    (cache / "site-2-part1").mkdir()  # a part of another pack: not this chunk's sha256, left alone
    (cache / "site-2-part1" / "parts.json").write_text(json.dumps({"chunk": "site-2", "parts": 1, "sha256": "0"}))
    (tmp_path / "runs" / "bench").mkdir(parents=True)
    work = "bash scripts/device/steps.sh tiny-ab $OUT abc1234"
    room_for_a_part = 64 * 2**20 - 3500  # a part fits beside this tree, two parts or the whole chunk do not
    calls = plan_mod.plan(manifest, [], [], 540, False, repo=tmp_path, base_bytes=room_for_a_part, work=work,
                          extra_carry=["runs/bench"])
    assert [c["carry"][0] for c in calls] == [".device-cache/site-1-part1", ".device-cache/site-1-part2",
                                              ".device-cache/site-1-part3", ".device-cache/site-2"]
    assert calls[-1]["carry"] == [".device-cache/site-2", "runs/bench"]
    assert calls[-1]["command"] == ("bash scripts/device/install_chunk.sh .device-cache/site-2 && "
                                    f"source scripts/device/env.sh && {work}")
    assert all(not c["problems"] for c in calls)
    # split so that the last part is small (2048 bytes of travel): it shares its call with site-2
    split_chunk.split(cache / "site-1", 1400)
    shared = plan_mod.plan(manifest, [], [], 540, False, repo=tmp_path, base_bytes=room_for_a_part, work="true")
    assert [c["carry"] for c in shared] == [[".device-cache/site-1-part1"], [".device-cache/site-1-part2"],
                                            [".device-cache/site-1-part3", ".device-cache/site-2"]]
    assert shared[-1]["command"] == ("bash scripts/device/install_chunk.sh .device-cache/site-1-part3 "
                                     ".device-cache/site-2 && source scripts/device/env.sh && true")
    lacking = plan_mod.plan(manifest, [], [], 540, False, repo=tmp_path, base_bytes=room_for_a_part, work=work,
                            extra_carry=["runs/elsewhere"])
    assert lacking[-1]["problems"] == ["not in this checkout: runs/elsewhere"]
    whole = plan_mod.plan(manifest, [], [], 540, False, repo=tmp_path, base_bytes=50 * 2**20, work="true")
    assert [c["carry"] for c in whole] == [[".device-cache/site-1", ".device-cache/site-2"]]
    assert not whole[0]["problems"]
    tight = plan_mod.plan({"chunks": manifest["chunks"][1:]}, [], [], 540, False, repo=tmp_path,
                          base_bytes=64 * 2**20 - 500, work="true")
    assert "the working tree alone is too large" in tight[0]["problems"][0]


# ------------------------------------------------------------------- the server fixture, against a fake SGLang

FAKE_LAUNCH_SERVER = '''
import argparse, json, os, subprocess, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer

p = argparse.ArgumentParser()
p.add_argument("--host"); p.add_argument("--port", type=int); p.add_argument("--mode", default="ok")
args, rest = p.parse_known_args()
print("fake sglang starting with", rest, flush=True)
if args.mode == "crash":
    print("RuntimeError: pretend CUDA out of memory", flush=True)
    sys.exit(3)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])  # like the scheduler process
open(os.environ["FAKE_CHILD_PID_FILE"], "w").write(str(child.pid))
if os.environ.get("FAKE_SERVER_PID_FILE"):
    open(os.environ["FAKE_SERVER_PID_FILE"], "a").write(f"{os.getpid()}\\n")
t0 = time.time()

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def _send(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code); self.send_header("Content-Length", str(len(data))); self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self._send(200 if args.mode == "ok" and time.time() - t0 > 1.0 else 503, {})  # "hang": never healthy
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = body["sampling_params"].get("max_new_tokens", 4)
        self._send(200, {"output_ids": list(range(n)), "meta_info": {"completion_tokens": n}, "echo": body})

HTTPServer((args.host, args.port), Handler).serve_forever()
'''


@pytest.fixture
def fake_sglang(tmp_path, monkeypatch):
    pkg = tmp_path / "fake" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(FAKE_LAUNCH_SERVER)
    monkeypatch.setenv("GPU_SUITE_LOG_DIR", str(tmp_path / "logs"))
    spec = importlib.util.spec_from_file_location("gpu_conftest", REPO / "tests" / "gpu" / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_conftest", conftest)  # dataclasses look their module up there
    spec.loader.exec_module(conftest)
    env = {"PYTHONPATH": str(tmp_path / "fake"), "FAKE_CHILD_PID_FILE": str(tmp_path / "child.pid")}
    return conftest, env, tmp_path


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child of a dead parent may linger as a zombie until reaped by init.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def test_server_fixture_starts_serves_and_kills_the_group(fake_sglang):
    conftest, env, tmp = fake_sglang
    log_dir = conftest.suite_log_dir()
    server = conftest.SGLangServer("fake", ["--model-path", "x", "--mode", "ok"], log_dir, env, start_timeout_s=60)
    server.start()
    try:
        out = server.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 5}, return_logprob=True)
        assert out["output_ids"] == [0, 1, 2, 3, 4]
        assert out["echo"] == {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 5},
                               "return_logprob": True}
        assert server.generate(text="hi")["echo"]["text"] == "hi"
        with pytest.raises(ValueError, match="exactly one"):
            server.generate(text="a", input_ids=[1])
        assert "--port" in server.log_text() and server.start_seconds >= 1.0  # /health said 503 for 1 s
    finally:
        server.stop()
    child = int((tmp / "child.pid").read_text())
    deadline = time.time() + 10
    while pid_alive(child) and time.time() < deadline:
        time.sleep(0.1)
    assert not pid_alive(child), "the server's child outlived stop()"
    starts = [json.loads(line) for line in (log_dir / "records.jsonl").read_text().splitlines()]
    assert starts[-1]["kind"] == "server_start" and starts[-1]["ok"] is True
    assert str(server.proc.pid) in (log_dir / "servers.pgids").read_text().split()
    with pytest.raises(ValueError, match="--port"):
        conftest.SGLangServer("bad", ["--port", "1"], log_dir)


def test_server_fixture_fails_early_with_the_log_tail(fake_sglang):
    conftest, env, _ = fake_sglang
    server = conftest.SGLangServer("crash", ["--mode", "crash"], conftest.suite_log_dir(), env, start_timeout_s=60)
    t0 = time.time()
    with pytest.raises(conftest.ServerStartError) as err:
        server.start()
    assert time.time() - t0 < 30, "a dead server must not wait for the timeout"
    assert "exited with status 3" in str(err.value) and "pretend CUDA out of memory" in str(err.value)


def test_model_pair_falls_back_to_dummy_configs(fake_sglang, monkeypatch, tmp_path):
    conftest, _, _ = fake_sglang
    monkeypatch.setattr(conftest, "TINY_DIR", tmp_path / "no-such-tiny")
    monkeypatch.setattr(conftest, "REPO_ROOT", tmp_path)
    pair = conftest.choose_model_pair("auto")
    assert pair.dummy and pair.target.name == "dummy-target" and (pair.target / "config.json").exists()
    assert pair.base_args()[-3:] == ["--load-format", "dummy", "--skip-tokenizer-init"]
    assert pair.dflash_args(16)[:2] == ["--speculative-algorithm", "DFLASH"]
    with pytest.raises(ValueError, match="tiny pair lacks"):
        conftest.choose_model_pair("tiny")
    with pytest.raises(ValueError, match="one of auto, tiny, dummy, 8b-real, tiny-hybrid, 27b-hybrid"):
        conftest.choose_model_pair("big")


def fake_pair(folder: Path) -> None:
    for sub in ("target", "drafter"):
        (folder / sub).mkdir(parents=True)
        (folder / sub / "config.json").write_text("{}")
        (folder / sub / "model.safetensors").write_bytes(b"w")
    (folder / "target" / "tokenizer.json").write_text("{}")


def test_model_pair_picks_the_hybrid_pairs(fake_sglang, monkeypatch, tmp_path):
    """DDTREE_GPU_MODELS=tiny-hybrid: the pair trained on the device, refused with the step that trains it while it
    is incomplete; 27b-hybrid: its widening, built from that pair when missing (and not again once built)."""
    conftest, _, _ = fake_sglang
    from sglang_ddtree import widen_hybrid

    monkeypatch.setattr(conftest, "TINY_HYBRID_DIR", tmp_path / "tiny-hybrid")
    monkeypatch.setattr(conftest, "HYBRID27B_DIR", tmp_path / "27b-hybrid")
    monkeypatch.setattr(conftest, "REPO_ROOT", tmp_path)
    for mode in ("tiny-hybrid", "27b-hybrid"):
        with pytest.raises(ValueError, match="hybrid.sh train"):
            conftest.choose_model_pair(mode)
    fake_pair(tmp_path / "tiny-hybrid")
    (tmp_path / "tiny-hybrid" / "drafter" / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="weights"):
        conftest.choose_model_pair("tiny-hybrid")
    (tmp_path / "tiny-hybrid" / "drafter" / "model.safetensors").write_bytes(b"w")
    pair = conftest.choose_model_pair("tiny-hybrid")
    assert (pair.mode, pair.hybrid, pair.dummy) == ("tiny-hybrid", True, False)
    assert pair.target == tmp_path / "tiny-hybrid" / "target" and "--load-format" not in pair.base_args()
    built = []

    def build(small, big, out):
        built.append((small, big.name, out))
        fake_pair(out)
        cfg = {"widened_from": {"shape": big.name}}
        (out / "target" / "config.json").write_text(json.dumps(cfg))

    monkeypatch.setattr(widen_hybrid, "widen_hybrid_pair", build)
    for _ in range(2):
        pair = conftest.choose_model_pair("27b-hybrid")
        assert (pair.mode, pair.hybrid) == ("27b-hybrid", True) and pair.drafter == tmp_path / "27b-hybrid" / "drafter"
    assert built == [(tmp_path / "tiny-hybrid", "qwen3.5-27b", tmp_path / "27b-hybrid")]
    assert not conftest.ModelPair(tmp_path, tmp_path, dummy=False, name="8b-real").hybrid


def test_real_size_plans_pick_each_pairs_servers(monkeypatch):
    """tests/gpu/serving_common.py's plans for the real-size module: the DDTREE configurations per pair (no `auto` on
    a hybrid target, the in-server oracle there), DDTREE_GPU_CONFIGS narrowing them, and the 27B pair's servers run
    one at a time, plain first."""
    monkeypatch.syspath_prepend(str(REPO / "tests" / "gpu"))
    import serving_common as sc

    assert sc.real_size_config_args("ddtree-64-oracle") == sc.ddtree("64", "--speculative-ddtree-oracle")
    assert sc.real_size_config_args("ddtree-auto") == sc.ddtree("auto")
    assert sc.real_size_config_args("ddtree-auto-plain") == sc.ddtree(
        "auto", "--speculative-ddtree-auto-candidates", sc.AUTO_SMALL_CANDIDATES)
    assert sc.REAL_SIZE_ENV["ddtree-auto-plain"]["SGLANG_DDTREE_AUTO_FORCE"] == "plain,15"
    assert set(sc.REAL_SIZE_ENV) <= set(sc.REAL_SIZE_CONFIGS)
    for bad in ("ddtree-", "ddtree-x", "ddtree-64-fast", "tree-64", "ddtree-64-plain"):
        with pytest.raises(ValueError, match="ddtree-<budget>"):
            sc.real_size_config_args(bad)
    plans = sc.REAL_SIZE_PLANS
    assert set(plans) == {"8b-real", "tiny-hybrid", "27b-hybrid"}
    assert all(c in sc.REAL_SIZE_CONFIGS for p in plans.values() for c in p.configs + (p.leak_config,))
    for name in ("tiny-hybrid", "27b-hybrid"):
        assert "ddtree-auto" not in plans[name].configs and any(c.endswith("-oracle") for c in plans[name].configs)
    monkeypatch.delenv("DDTREE_GPU_CONFIGS", raising=False)
    base, draft = ["--model-path", "t"], ["--speculative-draft-model-path", "d"]
    tiny = sc.real_size_configs(plans["tiny-hybrid"], base, draft)
    assert list(tiny) == ["plain", "ddtree-16", "ddtree-64", "ddtree-64-oracle"] and tiny["plain"] == base
    assert tiny["ddtree-64-oracle"] == base + sc.ddtree("64", "--speculative-ddtree-oracle") + draft
    assert plans["27b-hybrid"].one_at_a_time and not plans["tiny-hybrid"].one_at_a_time
    assert list(sc.real_size_configs(plans["27b-hybrid"], base, draft)) == ["plain", "ddtree-16", "ddtree-16-oracle"]
    monkeypatch.setenv("DDTREE_GPU_CONFIGS", "ddtree-16-oracle")
    assert list(sc.real_size_configs(plans["27b-hybrid"], base, draft)) == ["plain", "ddtree-16-oracle"]
    monkeypatch.setenv("DDTREE_GPU_CONFIGS", "ddtree-256")  # an 8b-real configuration, not a hybrid one
    with pytest.raises(ValueError, match="unknown configurations"):
        sc.real_size_configs(plans["tiny-hybrid"], base, draft)


def _real_size_module(monkeypatch):
    """tests/gpu/test_real8b.py loaded on the CPU (its `conftest` import answered by a stand-in)."""
    import types

    monkeypatch.syspath_prepend(str(REPO / "tests" / "gpu"))
    monkeypatch.syspath_prepend(str(REPO))
    monkeypatch.setitem(sys.modules, "conftest", types.SimpleNamespace(REPO_ROOT=REPO))
    spec = importlib.util.spec_from_file_location("real_size_module", REPO / "tests" / "gpu" / "test_real8b.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "real_size_module", mod)  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


class _FakeServers:
    """The sglang_servers factory's stand-in: servers that answer greedy requests with fixed ids (three tokens in one
    verify round; an oracle server logs 1 of 400 request-rounds differing) and record which servers were up whenever
    one answered. `stop_at`: the start of that server raises KeyboardInterrupt, as the runner's deadline does."""

    def __init__(self, stop_at: str | None = None):
        self.started: list[list[str]] = []  # names per start call
        self.envs: dict = {}  # name -> the environment it started with
        self.all: dict = {}
        self.up_while_answering: list[tuple[str, ...]] = []
        self.stop_at = stop_at

    def __call__(self, configs, env=None):
        import types

        if self.stop_at in configs:
            raise KeyboardInterrupt
        self.started.append(list(configs))
        self.envs.update({name: dict(env or {}) for name in configs})
        out = {}
        for name, args in configs.items():
            server = types.SimpleNamespace(name=name, args=list(args), alive=True)
            server.proc = types.SimpleNamespace(poll=lambda s=server: None if s.alive else 0)
            server.stop = lambda s=server: setattr(s, "alive", False)
            server.generate = lambda s=server, **kw: self._answer(s, **kw)
            server.log_text = lambda: "DDTREE oracle: 1 of 400 greedy request-rounds differ from the tree verify's\n"
            self.all[name] = out[name] = server
        return out

    def up(self) -> tuple[str, ...]:
        return tuple(n for n, s in self.all.items() if s.alive)

    def _answer(self, server, text, sampling_params, **extra):
        assert server.alive, f"{server.name} answered after it stopped"
        self.up_while_answering.append(self.up())
        one = {"output_ids": [3, 4, 5], "meta_info": {"completion_tokens": 3, "spec_verify_ct": 1}}
        return [dict(one) for _ in text] if isinstance(text, list) else one


def _no_leak(mod, monkeypatch, fake):
    """The KV-leak load's stand-ins (an idle pool before and after, 40 of 200 requests aborted); returns the list of
    (server, servers up) each load ran on."""
    leak_on = []

    def load(server, prompt_of):
        leak_on.append((server.name, fake.up()))
        return 0, 0, {"ok": 160, "aborted": 40}

    monkeypatch.setattr(mod, "used_tokens", lambda server: (0, 0))
    monkeypatch.setattr(mod, "mixed_and_aborted_load", load)
    return leak_on


@pytest.mark.parametrize("pair_name", ["27b-hybrid", "tiny-hybrid"])
def test_real_size_module_runs_the_27b_servers_one_at_a_time(monkeypatch, pair_name):
    """The real-size lossless module on the 27B pair: plain first, then each DDTREE server alone, each stopped once
    it has answered, the KV-leak load taken while its own server is up, and every server sized to have the GPU to
    itself; the tiny hybrid's servers start together."""
    import types

    mod = _real_size_module(monkeypatch)
    monkeypatch.delenv("DDTREE_GPU_CONFIGS", raising=False)
    fake = _FakeServers()
    leak_on = _no_leak(mod, monkeypatch, fake)
    plan = mod.REAL_SIZE_PLANS[pair_name]
    pair = types.SimpleNamespace(base_args=lambda: ["--model-path", "t"], drafter=Path("d"), hybrid=True,
                                 mode=pair_name)
    texts = [f"def f{i}():" for i in range(6)]
    records = []
    served = mod.serve(fake, pair, plan, texts, "triton", lambda kind, **f: records.append({"kind": kind, **f}))
    configs = ["plain", *plan.configs]
    names = {f"{c}/bs{b}" for c in plan.configs for b in (1, plan.batch)} | {"plain"}
    assert set(served.outputs) == names and all(len(v) == len(texts) for v in served.outputs.values())
    # every judgement recorded once, as its server answered, and passing on these stand-ins
    oracles = [c for c in plan.configs if c.endswith("-oracle")]
    assert [(r["kind"], r["config"]) for r in records if r["kind"] != "real8b_greedy"] == \
        [("real8b_kv_leak", plan.leak_config)] + [("real8b_oracle", c) for c in oracles]
    assert sorted(r["config"] for r in records if r["kind"] == "real8b_greedy") == sorted(names - {"plain"})
    assert all(r["ok"] and r["pair"] == pair_name and "error" not in r for r in records), records
    assert all(served.greedy[n]["exact"] == len(texts) and served.greedy[n]["tau"] == 3.0 for n in names - {"plain"})
    assert served.leak["ok"] and all(served.oracle[c]["checked"] == 400 for c in oracles)
    if pair_name == "tiny-hybrid":
        assert fake.started == [configs] and leak_on == [(plan.leak_config, tuple(configs))]
        assert all(s.alive for s in fake.all.values())  # the module's pool stops them at its end
        return
    assert fake.started == [[c] for c in configs]
    assert set(fake.up_while_answering) == {(c,) for c in configs}  # never two servers up at once
    assert leak_on == [(plan.leak_config, (plan.leak_config,))] and served.leak["alive"]
    assert not any(s.alive for s in fake.all.values())
    for server in fake.all.values():
        args = server.args
        assert args[args.index("--mem-fraction-static") + 1] == "0.92"
        assert args[args.index("--max-total-tokens") + 1] == "8192"
        assert args[args.index("--max-running-requests") + 1] == str(plan.batch)


def test_real_size_module_starts_a_configuration_with_its_own_environment_apart(monkeypatch):
    """8b-real: the servers start together, but ddtree-auto-plain (auto held in turn on rounds without a draft and
    the 15-tree) starts on its own with SGLANG_DDTREE_AUTO_FORCE, which no other server gets; it is judged as the
    others are; one server at a time (long prompts) it keeps its environment."""
    import types

    mod = _real_size_module(monkeypatch)
    monkeypatch.delenv("DDTREE_GPU_CONFIGS", raising=False)
    pair = types.SimpleNamespace(base_args=lambda: ["--model-path", "t"], drafter=Path("d"), hybrid=False,
                                 mode="8b-real")
    plan = mod.REAL_SIZE_PLANS["8b-real"]
    force = "SGLANG_DDTREE_AUTO_FORCE"
    for one_at_a_time in (False, True):
        fake = _FakeServers()
        _no_leak(mod, monkeypatch, fake)
        records = []
        run = dataclasses.replace(plan, one_at_a_time=one_at_a_time)
        mod.serve(fake, pair, run, ["a", "b"], "triton", lambda kind, **f: records.append({"kind": kind, **f}))
        others = ["plain"] + [c for c in plan.configs if c != "ddtree-auto-plain"]
        expected = [[c] for c in others + ["ddtree-auto-plain"]] if one_at_a_time else [others, ["ddtree-auto-plain"]]
        assert fake.started == expected
        assert fake.envs["ddtree-auto-plain"][force] == "plain,15"
        assert all(force not in fake.envs[c] for c in others)
        args = fake.all["ddtree-auto-plain"].args
        assert args[args.index("--speculative-ddtree-auto-candidates") + 1] == "plain,chain,7,15,63"
        assert {"ddtree-auto-plain/bs1", "ddtree-auto-plain/bs16"} <= {r["config"] for r in records
                                                                        if r["kind"] == "real8b_greedy"}


def test_real_size_module_sizes_its_servers_for_long_prompts(monkeypatch):
    """DDTREE_GPU_PROMPTS=long:8192: batch 4, the context and KV pool those prompts need (prompt + new tokens + twice
    the widest verify + 32, the pool for the batch with 20% to spare), every record naming the prompt set; 32K
    prompts run one server at a time; a malformed choice is refused."""
    import types

    mod = _real_size_module(monkeypatch)
    monkeypatch.delenv("DDTREE_GPU_CONFIGS", raising=False)
    monkeypatch.setenv("DDTREE_GPU_PROMPTS", "long:8192")
    choice = mod.prompt_choice()
    assert choice == ("long", 8192)
    base = mod.REAL_SIZE_PLANS["8b-real"]
    plan = mod.prompt_plan(base, choice)
    assert (plan.batch, plan.one_at_a_time, plan.configs) == (4, False, base.configs)
    assert mod.prompt_plan(base, ("long", 32768)).one_at_a_time and mod.prompt_plan(base, None) is base
    assert mod.widest_verify(plan) == 257  # ddtree-256
    need = 8192 + mod.NEW_TOKENS + 2 * 257 + 32
    assert mod.long_context(8192, plan) == (-(-need // 1024) * 1024, -(-int(4 * need * 1.2) // 1024) * 1024)
    fake = _FakeServers()
    _no_leak(mod, monkeypatch, fake)
    pair = types.SimpleNamespace(base_args=lambda: ["--model-path", "t"], drafter=Path("d"), hybrid=False,
                                 mode="8b-real")
    records = []
    mod.serve(fake, pair, plan, ["a", "b"], "triton", lambda kind, **f: records.append({"kind": kind, **f}), choice)
    context, pool = mod.long_context(8192, plan)
    for server in fake.all.values():
        args = server.args
        assert args[args.index("--context-length") + 1] == str(context) == "9216"
        assert args[args.index("--max-total-tokens") + 1] == str(pool)
        assert args[args.index("--max-running-requests") + 1] == "4"
    assert records and all(r["prompt_set"] == "long:8192" for r in records)
    for bad in ("long", "long:8k", "short:2048"):
        monkeypatch.setenv("DDTREE_GPU_PROMPTS", bad)
        with pytest.raises(ValueError, match="DDTREE_GPU_PROMPTS"):
            mod.prompt_choice()
    monkeypatch.setenv("DDTREE_GPU_PROMPTS", "humaneval")
    assert mod.prompt_choice() is None and mod.prompt_set_name(None) == "humaneval"


def test_real_size_module_stops_a_server_whose_answers_fail(monkeypatch):
    """One at a time, a server that fails mid-way is stopped all the same, so a later module or rerun gets the GPU."""
    import types

    mod = _real_size_module(monkeypatch)
    monkeypatch.delenv("DDTREE_GPU_CONFIGS", raising=False)
    fake = _FakeServers()

    def broken(server, **kw):
        raise AssertionError("/generate answered 500")

    real_call = fake.__call__

    def start(configs, env=None):
        out = real_call(configs, env)
        for s in out.values():
            s.generate = lambda s=s, **kw: broken(s, **kw)
        return out

    pair = types.SimpleNamespace(base_args=lambda: ["--model-path", "t"], drafter=Path("d"), hybrid=True,
                                 mode="27b-hybrid")
    with pytest.raises(AssertionError, match="500"):
        mod.serve(start, pair, mod.REAL_SIZE_PLANS["27b-hybrid"], ["x"], "triton", lambda kind, **f: None)
    assert list(fake.all) == ["plain"] and not fake.all["plain"].alive


def test_real_size_module_records_each_server_as_it_answers(monkeypatch):
    """The 27B pair one server at a time, the runner's deadline (KeyboardInterrupt) landing as the oracle server
    starts: plain against DDTREE 16, at batch 1 and at its batch, and the KV-leak load are recorded already; a
    difference judged a failure is recorded as one, and a judgement that raises is recorded with its error."""
    import types

    mod = _real_size_module(monkeypatch)
    monkeypatch.delenv("DDTREE_GPU_CONFIGS", raising=False)
    fake = _FakeServers(stop_at="ddtree-16-oracle")
    _no_leak(mod, monkeypatch, fake)
    real_answer = fake._answer

    def answer(server, text, sampling_params, **extra):  # DDTREE 16 at its batch differs from plain at a token
        out = real_answer(server, text, sampling_params, **extra)
        if server.name == "ddtree-16" and isinstance(text, list):
            out[0] = {**out[0], "output_ids": [3, 9, 5]}
        if server.name == "plain":
            out["meta_info"] = {**out["meta_info"], "output_top_logprobs": [None, [[-0.1, 4, ""], [-2.0, 9, ""]]]}
        return out

    fake._answer = answer
    plan = mod.REAL_SIZE_PLANS["27b-hybrid"]
    pair = types.SimpleNamespace(base_args=lambda: ["--model-path", "t"], drafter=Path("d"), hybrid=True,
                                 mode="27b-hybrid")
    records = []
    with pytest.raises(KeyboardInterrupt):
        mod.serve(fake, pair, plan, ["a", "b"], "triton", lambda kind, **f: records.append({"kind": kind, **f}))
    got = {(r["kind"], r["config"]): r for r in records}
    assert list(got) == [("real8b_greedy", "ddtree-16/bs1"), ("real8b_greedy", "ddtree-16/bs4"),
                         ("real8b_kv_leak", "ddtree-16")]
    assert got["real8b_greedy", "ddtree-16/bs1"]["ok"] and got["real8b_greedy", "ddtree-16/bs1"]["exact"] == 2
    batch = got["real8b_greedy", "ddtree-16/bs4"]
    assert not batch["ok"] and batch["exact"] == 1 and batch["max_gap"] == pytest.approx(1.9)
    # tau per prompt and over the prompts decoded as plain decodes them (prompt 1 only here)
    assert batch["exact_prompts"] == [1] and len(batch["tau_by_prompt"]) == 2
    assert batch["tau_exact_prompts"] == pytest.approx(batch["tau_by_prompt"][1], abs=1e-4)
    assert batch["failures"] == [{"prompt": 0, "position": 1, "plain": 4, "candidate": 9,
                                  "logprob_gap": pytest.approx(1.9)}]
    assert got["real8b_kv_leak", "ddtree-16"]["ok"] and not any(s.alive for s in fake.all.values())

    monkeypatch.setattr(mod, "tau_of", lambda outputs: 1 / 0)  # a judgement that raises: recorded, serving goes on
    records.clear()
    served = mod.serve(_FakeServers(), pair, plan, ["a"], "triton", lambda kind, **f: records.append({"kind": kind,
                                                                                                      **f}))
    greedy = [r for r in records if r["kind"] == "real8b_greedy"]
    assert len(greedy) == 4 and all(not r["ok"] and r["error"].startswith("ZeroDivisionError") for r in greedy)
    assert served.leak["ok"] and served.oracle["ddtree-16-oracle"]["ok"]


REAL_SIZE_UNDER_THE_RUNNER = '''
import importlib.util, sys, time, types
from pathlib import Path
import pytest

REPO = Path({repo!r})
sys.path[:0] = [str(REPO / "tests" / "gpu"), str(REPO)]
sys.modules["conftest"] = types.SimpleNamespace(REPO_ROOT=REPO)


def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gpu_conftest = load("gpu_conftest", REPO / "tests" / "gpu" / "conftest.py")  # its record(): the gpu_record fixture
real = load("real_size_module", REPO / "tests" / "gpu" / "test_real8b.py")
real.used_tokens = lambda server: (0, 0)
real.mixed_and_aborted_load = lambda server, prompt_of: (0, 0, {{"ok": 160, "aborted": 40}})


def start(configs, env=None):
    (name,) = configs
    if name == "ddtree-16-oracle":
        time.sleep(600)  # the oracle server takes longer to start than the call has left
    server = types.SimpleNamespace(name=name, args=configs[name], log_text=lambda: "")
    server.proc = types.SimpleNamespace(poll=lambda: None)
    server.stop = lambda: None
    one = {{"output_ids": [3, 4], "meta_info": {{"completion_tokens": 2, "spec_verify_ct": 1}}}}
    server.generate = lambda text, sampling_params, **kw: [dict(one) for _ in text] if isinstance(text, list) else one
    return {{name: server}}


def test_lossless_27b():
    pair = types.SimpleNamespace(base_args=lambda: ["--model-path", "t"], drafter=Path("d"), hybrid=True,
                                 mode="27b-hybrid")
    real.serve(start, pair, real.REAL_SIZE_PLANS["27b-hybrid"], ["a", "b"], "triton", gpu_conftest.record)
'''


def test_runner_keeps_the_records_written_before_its_deadline(tmp_path):
    """The real-size module under the runner, its deadline landing while the third server starts: gpu_suite.json
    holds the records of the servers that had answered (DDTREE 16 against plain, the KV-leak load), and the call
    fails."""
    proc, report, _ = run_runner(tmp_path, REAL_SIZE_UNDER_THE_RUNNER.format(repo=str(REPO)), "--deadline-s", "58",
                                 "--allow-missing-gpu")
    assert proc.returncode == 1 and report["ok"] is False and report["pytest_timed_out"] is True
    kept = [(r["kind"], r.get("config"), r.get("ok")) for r in report["records"]]
    assert kept == [("real8b_greedy", "ddtree-16/bs1", True), ("real8b_greedy", "ddtree-16/bs4", True),
                    ("real8b_kv_leak", "ddtree-16", True)], proc.stdout[-3000:]
    assert "RESULT: FAIL" in proc.stdout


def test_jit_cache_leaves_out_tvm_ffi_objects(tmp_path):
    jit = tmp_path / "jit"
    (jit / "tvm-ffi" / "mod").mkdir(parents=True)
    (jit / "tvm-ffi" / "mod" / "mod.so").write_bytes(b"so")
    (jit / "tvm-ffi" / "mod" / "a.o").write_bytes(b"obj")
    (jit / "flashinfer" / "op").mkdir(parents=True)
    (jit / "flashinfer" / "op" / "b.o").write_bytes(b"obj")  # ninja needs these: kept
    archive = tmp_path / "c.tar.xz"
    assert run_gpu_suite.pack_jit_cache(jit, {}, archive, tmp_path)["files"] == 2
    with tarfile.open(archive) as tf:
        assert tf.getnames() == ["stamp.json", "flashinfer/op/b.o", "tvm-ffi/mod/mod.so"]


def test_server_pool_starts_in_parallel_and_reports_every_failure(fake_sglang):
    conftest, env, _ = fake_sglang
    pool = conftest.ServerPool(conftest.suite_log_dir())
    try:
        both = pool.start_many({"a": ["--mode", "ok", "--x", "1"], "b": ["--mode", "ok", "--x", "2"]}, env)
        assert both["a"].port != both["b"].port
        assert all(s.generate(input_ids=[1])["output_ids"] == [0, 1, 2, 3] for s in both.values())
        assert pool.start("a", ["--mode", "ok", "--x", "1"], env) is both["a"]  # reused, not restarted
        with pytest.raises(ValueError, match="other args"):
            pool.start("a", ["--mode", "ok"], env)
        with pytest.raises(pytest.fail.Exception, match="pretend CUDA out of memory"):
            pool.start_many({"c": ["--mode", "ok", "--x", "3"], "bad": ["--mode", "crash"]}, env)
        assert sorted(pool.servers) == ["a", "b", "c"]  # the good one is kept, so teardown stops it
    finally:
        pool.stop_all()
    assert all(s.proc.poll() is not None for s in pool.servers.values())


def test_server_pool_can_hand_back_failures_instead_of_failing(fake_sglang):
    conftest, env, _ = fake_sglang
    pool = conftest.ServerPool(conftest.suite_log_dir())
    try:
        got = pool.start_many({"ok": ["--mode", "ok"], "bad": ["--mode", "crash"]}, env, all_or_nothing=False)
        assert isinstance(got["ok"], conftest.SGLangServer) and got["ok"].generate(input_ids=[1])["output_ids"]
        assert isinstance(got["bad"], conftest.ServerStartError) and "status 3" in str(got["bad"])
    finally:
        pool.stop_all()


INTERRUPTED_START = """
import signal
signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with SIGINT ignored (background job)
import importlib.util, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("gpu_conftest", sys.argv[1])
conftest = importlib.util.module_from_spec(spec)
sys.modules["gpu_conftest"] = conftest
spec.loader.exec_module(conftest)
pool = conftest.ServerPool(conftest.suite_log_dir())
import os
import shutil
env = {"PYTHONPATH": os.environ["FAKE_PATH"], "FAKE_CHILD_PID_FILE": os.environ["FAKE_CHILD_PID_FILE"],
       "FAKE_SERVER_PID_FILE": os.environ["FAKE_SERVER_PID_FILE"]}
try:
    pool.start_many({"h1": ["--mode", "hang"], "h2": ["--mode", "hang", "--x", "2"]}, env)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(130)
"""


def test_interrupted_parallel_start_kills_the_servers_promptly(fake_sglang):
    """The runner's deadline sends SIGINT to pytest: servers still starting must die, and fast."""
    import signal

    _, env, tmp = fake_sglang
    script = tmp / "interrupted.py"
    script.write_text(INTERRUPTED_START)
    server_pid_file = tmp / "server.pid"
    child_env = dict(os.environ, FAKE_PATH=env["PYTHONPATH"], FAKE_CHILD_PID_FILE=env["FAKE_CHILD_PID_FILE"],
                     FAKE_SERVER_PID_FILE=str(server_pid_file), DDTREE_SERVER_START_TIMEOUT="300")
    proc = subprocess.Popen([sys.executable, str(script), str(REPO / "tests" / "gpu" / "conftest.py")],
                            env=child_env, stdout=subprocess.PIPE, text=True)
    servers = lambda: [int(x) for x in server_pid_file.read_text().split()] if server_pid_file.exists() else []  # noqa: E731
    try:
        deadline = time.time() + 30
        while len(servers()) < 2 and time.time() < deadline:
            time.sleep(0.1)
        assert len(servers()) == 2, "the fake servers never started"
        time.sleep(0.5)
        t0 = time.time()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 130 and "interrupted" in out
        assert time.time() - t0 < 15, "the interrupted start waited for its servers"
        deadline = time.time() + 10
        while any(map(pid_alive, servers())) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(map(pid_alive, servers())), "a server that was still starting survived the interrupt"
    finally:  # whatever happened, leave nothing of ours running
        if proc.poll() is None:
            proc.kill()
        for pid in servers():
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def test_tree_kernel_switches_to_select_at_the_min_width():
    """The tree build sorts below SELECT_MIN_WIDTH nodes and selects by radix from there (what the kernel bench
    picked on an H200; the rank variant and the environment switches between variants are gone)."""
    from sglang_ddtree import kernels

    assert kernels.SELECT_MIN_WIDTH == 128
    assert [kernels.tree_kernel_for(w) for w in (16, 127, 128, 1024)] == ["sort", "sort", "select", "select"]


def test_split_chunk_parts_install_one_call_at_a_time(tmp_path):
    """A chunk split by split_chunk.py installs from its part folders given one per call: nothing before the last
    part, the whole chunk after it; a corrupted part is refused."""
    src = tmp_path / "src" / "pkg"
    src.mkdir(parents=True)
    (src / "blob.bin").write_bytes(os.urandom(300_000))
    chunk_dir = tmp_path / "cache" / "site-1"
    chunk_dir.mkdir(parents=True)
    with tarfile.open(chunk_dir / "site-1.tar.xz", "w:xz") as tf:
        tf.add(src / "blob.bin", arcname="pkg/blob.bin")
    (chunk_dir / "manifest.json").write_text("{}")
    out = subprocess.run([sys.executable, str(DEVICE / "split_chunk.py"), str(chunk_dir), "--part-mb", "0.12"],
                         capture_output=True, text=True, check=True).stdout.split()
    parts = [Path(p) for p in out]
    assert len(parts) == 3 and all((p / "parts.json").exists() and (p / "manifest.json").exists() for p in parts)
    site = tmp_path / "site"
    for part in parts[:-1]:
        res = run_install([part], site, "auto")
        assert res.returncode == 0, res.stderr
        assert "install the others" in res.stderr and not (site / "pkg").exists()
    res = run_install([parts[-1]], site, "auto")
    assert res.returncode == 0, res.stderr
    assert (site / "pkg" / "blob.bin").read_bytes() == (src / "blob.bin").read_bytes()
    assert (site / ".ddtree-chunks" / "site-1.sha256").exists()
    # a corrupted part: the joined chunk's sha256 does not match, nothing is installed
    bad_site = tmp_path / "bad"
    victim = next(parts[1].glob("*.part-*"))
    data = victim.read_bytes()
    victim.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])  # always a different byte (b"x" could equal the first)
    for part in parts[:-1]:
        run_install([part], bad_site, "auto")
    res = run_install([parts[-1]], bad_site, "auto")
    assert res.returncode == 2 and "sha256" in res.stderr and not (bad_site / "pkg").exists()


def test_vcpu_speed_samples_every_vcpu_and_restores_the_affinity(tmp_path):
    """scripts/device/vcpu_speed.py (per-vCPU speed, over time): every allowed vCPU sampled each pass,
    the process's own affinity restored, and the lag-1 correlation right on known series."""
    mod = load_script("vcpu_speed")
    before = os.sched_getaffinity(0)
    out = tmp_path / "v.json"
    assert mod.main(["--seconds", "0.3", "--iterations", "2000", "--out", str(out)]) == 0
    assert os.sched_getaffinity(0) == before
    result = json.loads(out.read_text())
    cpus = sorted(before)
    assert result["cpus"] == cpus and result["passes"] >= 1
    assert len(result["samples"]) == result["passes"] * len(cpus)
    assert all(s["s"] > 0 for s in result["samples"])
    assert set(result["per_cpu"]) == {str(c) for c in cpus}
    assert result["max_over_min"] >= 1.0
    assert mod.lag1_correlation([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(1.0)
    assert mod.lag1_correlation([1.0, -1.0, 1.0, -1.0, 1.0]) == pytest.approx(-1.0)
    assert mod.lag1_correlation([2.0, 2.0, 2.0]) is None and mod.lag1_correlation([1.0, 2.0]) is None
    with pytest.raises(SystemExit):
        mod.main(["--seconds", "0", "--out", str(out)])


def test_parse_junit_ignores_the_nameless_case_of_a_cut_run(tmp_path):
    """A run stopped by its deadline left `<testcase time="0.000" />` in the JUnit XML, which counted as a
    pass; it is no test and is left out (a real pass, skip and failure next to it still count)."""
    path = tmp_path / "junit.xml"
    path.write_text('<testsuites><testsuite>'
                    '<testcase classname="m" name="a" time="1.0"><skipped message="not selected">x</skipped></testcase>'
                    '<testcase classname="m" name="b" time="2.0" />'
                    '<testcase classname="m" name="c" time="3.0"><failure message="boom">y</failure></testcase>'
                    '<testcase time="0.000" /></testsuite></testsuites>')
    tests, counts = run_gpu_suite.parse_junit(path)
    assert counts == {"passed": 1, "failed": 1, "skipped": 1, "errors": 0}
    assert [t["id"] for t in tests] == ["m::a", "m::b", "m::c"]


def test_pack_base_writes_the_package_a_server_started_in_the_repo_root_imports(tmp_path):
    """steps.sh tiny-paired TP_TWIN_BASE: pack_base.sh writes a commit's package, and with PYTHONSAFEPATH=1
    and PYTHONPATH on it a Python started in the repository root (where ddtree_bench/server.py starts servers)
    imports that package; PYTHONPATH alone still imports the checkout's (so a twin set up that way runs the checkout
    in both setups).
    -S: no site-packages, as on the device (this venv's editable install would map the package by itself)."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()
    dest = tmp_path / "base"
    done = subprocess.run(["bash", str(DEVICE / "pack_base.sh"), "HEAD", str(dest)], cwd=REPO, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(dest)
    assert (dest / "COMMIT").read_text().strip() == head
    assert sorted(p.name for p in dest.iterdir()) == ["COMMIT", "sglang_ddtree"]
    assert (dest / "sglang_ddtree" / "sglang" / "plugin.py").is_file()
    code = "import sglang_ddtree; print(sglang_ddtree.__file__)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    env["PYTHONPATH"] = str(dest)
    plain = subprocess.run([sys.executable, "-S", "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    safe = subprocess.run([sys.executable, "-S", "-c", code], cwd=REPO, env={**env, "PYTHONSAFEPATH": "1"},
                          capture_output=True, text=True)
    assert plain.returncode == 0 and safe.returncode == 0, plain.stderr + safe.stderr
    assert Path(plain.stdout.strip()) == REPO / "sglang_ddtree" / "__init__.py"
    assert Path(safe.stdout.strip()) == dest / "sglang_ddtree" / "__init__.py"
    bad = subprocess.run(["bash", str(DEVICE / "pack_base.sh"), "not-a-commit", str(tmp_path / "x")], cwd=REPO,
                         capture_output=True, text=True)
    assert bad.returncode != 0 and not (tmp_path / "x").exists()


def test_tiny_ab_lets_an_arm_change_the_shared_warm_up(tmp_path):
    """steps.sh tiny-ab with TA_SETS: bench_budgets.py gets the step's shared 128-token warm-up before the
    arms' --set items, so `tiny-w1.warmup_new_tokens=640` wins (--set applies in order: an arm with a longer
    warm-up). A fake python3 on PATH records the sweep's argv instead of starting servers."""
    fake = tmp_path / "bin"
    fake.mkdir()
    argv_file = tmp_path / "argv.json"
    (fake / "python3").write_text(
        "#!" + sys.executable + "\n"
        "import json, os, sys\n"
        "if sys.argv[1].endswith('bench_budgets.py'):\n"
        "    args = sys.argv[1:]\n"
        "    os.makedirs(args[args.index('--log-dir') + 1], exist_ok=True)\n"
        f"    json.dump(args, open({str(argv_file)!r}, 'w'))\n")
    (fake / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "TA_RIVALS": "0", "TA_ARMS": "e1: w1:",
           "TA_SETS": "tiny-w1.warmup_new_tokens=640", "TA_TIMEOUT_S": "60"}
    env.pop("DDTREE_JIT_ROOT", None)
    done = subprocess.run(["bash", str(DEVICE / "steps.sh"), "tiny-ab", str(tmp_path / "out"), "abc1234"],
                          cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    args = json.loads(argv_file.read_text())
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    assert sets.index("all.warmup_new_tokens=128") < sets.index("tiny-w1.warmup_new_tokens=640")
    assert args[args.index("--setups") + 1] == "tiny-e1,tiny-w1"
    # the arms' copies exist before the item that names one of them
    assert args.index("tiny-w1=tiny") < args.index("tiny-w1.warmup_new_tokens=640")


FAKE_PYTHON = '''#!{python}
import json, os, sys
log = {log!r}
script = next((a for a in sys.argv[1:] if not a.startswith("-")), "")
widen = bool({{"sglang_ddtree.widen_hybrid", "sglang_ddtree.widen"}} & set(sys.argv))  # never a real widening
names = ("DDTREE_GPU_MODELS", "DDTREE_GPU_BACKEND", "DDTREE_GPU_CONFIGS", "DDTREE_COMMIT")
if script.endswith(("train_tiny_pair.py", "bench_budgets.py", "run_gpu_suite.py")) or widen:
    with open(log, "a") as fh:
        fh.write(json.dumps({{"argv": sys.argv[1:], "env": {{k: os.environ.get(k) for k in names}}}}) + "\\n")
    if script.endswith("train_tiny_pair.py"):  # a stand-in pair: incompressible weights, two parts' worth
        out = sys.argv[sys.argv.index("--out") + 1]
        for sub, size in (("target", 20_000_000), ("drafter", 4_000_000)):
            os.makedirs(os.path.join(out, sub), exist_ok=True)
            open(os.path.join(out, sub, "config.json"), "w").write("{{}}")
            open(os.path.join(out, sub, "model.safetensors"), "wb").write(os.urandom(size))
        open(os.path.join(out, "training_log.json"), "w").write('{{"status": "done"}}')
        print("trained")
    sys.exit(int(os.environ.get("FAKE_RC", "0")) if widen else 0)
os.execv({python!r}, [{python!r}] + sys.argv[1:])
'''


def fake_python(tmp_path: Path) -> tuple[dict, Path]:
    """A python3 first on PATH that records (and stands in for) the trainer, the sweep, the suite runner and the
    widening, and runs anything else (env.sh's dist-info writer, split_chunk.py) with this interpreter."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.jsonl"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(FAKE_PYTHON.format(python=sys.executable, log=str(log)))
    (bin_dir / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "DDTREE_SITE": str(tmp_path / "site"),
           "DDTREE_JIT_ROOT": str(tmp_path / "jit"), "HYBRID_TMP": str(tmp_path / "hy")}
    for k in ("DDTREE_GPU_CONFIGS", "PYTHONPATH"):
        env.pop(k, None)
    return env, log


def calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_hybrid_train_returns_the_pair_in_parts_that_restore_rebuilds(tmp_path):
    """hybrid.sh train: the trainer's command, the pair returned as split_chunk.py parts within the tool's limits
    (files of at most 16 MiB, at most 8 files), and `restore` rebuilding models/tiny-hybrid byte for byte from the
    parts, here all at once and on the device one part a call. Runs in a copy of the scripts (the step writes
    models/tiny-hybrid)."""
    repo = tmp_path / "repo"
    (repo / "scripts" / "device").mkdir(parents=True)
    for name in ("hybrid.sh", "env.sh", "install_chunk.sh", "split_chunk.py", "write_dist_info.py", "_common.py"):
        (repo / "scripts" / "device" / name).write_bytes((DEVICE / name).read_bytes())
    (repo / "pyproject.toml").write_bytes((REPO / "pyproject.toml").read_bytes())
    env, log = fake_python(tmp_path)
    out = tmp_path / "out"
    script = ["bash", str(repo / "scripts" / "device" / "hybrid.sh")]
    done = subprocess.run(script + ["train", str(out), "abc1234"], cwd=repo, env=env, capture_output=True, text=True)
    assert done.returncode == 2 and ".cache/corpus" in done.stderr  # the corpus must be carried
    (repo / ".cache" / "corpus").mkdir(parents=True)
    (repo / ".cache" / "corpus" / "manifest.json").write_text("{}")
    done = subprocess.run(script + ["train", str(out), "abc1234"], cwd=repo, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    (train,) = calls(log)
    argv = train["argv"]
    assert argv[0] == "scripts/train_tiny_pair.py" and argv[argv.index("--target-arch") + 1] == "qwen3_5_text"
    assert argv[argv.index("--out") + 1] == "models/tiny-hybrid" and argv[argv.index("--data") + 1] == ".cache/corpus"
    assert "--target-seconds" not in argv and train["env"]["DDTREE_COMMIT"] == "abc1234"  # the default budgets
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8 and all(p.stat().st_size <= 16 * 2**20 for p in files)
    assert all(len(p.relative_to(out).parts) <= 3 for p in files)
    parts = sorted(out.glob("tiny-hybrid-part*"))
    assert len(parts) == 2 and {"train.log", "training_log.json"} <= {p.name for p in files}
    original = {p.relative_to(repo / "models").as_posix(): p.read_bytes()
                for p in (repo / "models" / "tiny-hybrid").rglob("*") if p.is_file()}
    # here: every part at once
    shutil.rmtree(repo / "models" / "tiny-hybrid")
    done = subprocess.run(script + ["restore", *map(str, parts)], cwd=repo, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    restored = {p.relative_to(repo / "models").as_posix(): p.read_bytes()
                for p in (repo / "models" / "tiny-hybrid").rglob("*") if p.is_file()}
    assert restored == original
    # on the device: one part a call; the pair appears with the last
    shutil.rmtree(repo / "models" / "tiny-hybrid")
    env = {**env, "HYBRID_TMP": str(tmp_path / "device")}
    first = subprocess.run(script + ["restore", str(parts[0])], cwd=repo, env=env, capture_output=True, text=True)
    assert first.returncode == 0 and not (repo / "models" / "tiny-hybrid").exists()
    last = subprocess.run(script + ["restore", str(parts[1])], cwd=repo, env=env, capture_output=True, text=True)
    assert last.returncode == 0, last.stdout + last.stderr
    assert (repo / "models" / "tiny-hybrid" / "target" / "model.safetensors").read_bytes() == \
        original["tiny-hybrid/target/model.safetensors"]


def test_hybrid_sweep_and_lossless_steps_pass_the_right_arguments(tmp_path):
    """hybrid.sh sweep: bench_budgets.py on tiny-hybrid unless the args name other setups (27b-hybrid: widened first,
    --if-missing, and a refused widening stops the step before the sweep); lossless: the real-size module on the
    pair, 27b-hybrid with every configuration of its plan (the module runs them one at a time); unknown pairs and
    steps are refused."""
    env, log = fake_python(tmp_path)
    script = ["bash", str(DEVICE / "hybrid.sh")]
    out = str(tmp_path / "out")

    def run(*args, **extra):
        return subprocess.run(script + list(args), cwd=REPO, env={**env, **extra}, capture_output=True, text=True)

    assert run("sweep", out, "abc1234", "tiny", "6", "--repeats", "2").returncode == 0
    (sweep,) = calls(log)
    argv = sweep["argv"]
    assert argv[0] == "benchmarks/bench_budgets.py" and argv[argv.index("--setups") + 1] == "tiny-hybrid"
    assert argv[-2:] == ["--repeats", "2"] and argv[argv.index("--max-minutes") + 1] == "6"
    assert argv[argv.index("--out") + 1] == str(tmp_path / "hy" / "tiny" / "sweep")
    log.unlink()
    assert run("sweep", out, "abc1234", "big", "8", "--setups", "27b-hybrid").returncode == 0
    widen, sweep = calls(log)
    assert widen["argv"][:2] == ["-m", "sglang_ddtree.widen_hybrid"] and "--if-missing" in widen["argv"]
    assert widen["argv"][widen["argv"].index("--out") + 1] == "runs/27b-hybrid"
    setups = [sweep["argv"][i + 1] for i, a in enumerate(sweep["argv"]) if a == "--setups"]
    assert setups == ["tiny-hybrid", "27b-hybrid"]  # the last one wins (argparse)
    log.unlink()
    assert run("sweep", out, "abc1234", "big", "8", "--setups", "27b-hybrid", FAKE_RC="3").returncode == 3
    assert [c["argv"][1] for c in calls(log)] == ["sglang_ddtree.widen_hybrid"]  # no sweep after a refusal
    log.unlink()
    assert run("lossless", out, "abc1234", "triton").returncode == 0
    assert run("lossless", out, "abc1234", "flashinfer", "27b-hybrid").returncode == 0
    tiny, widen, big = calls(log)
    assert tiny["argv"][:2] == ["scripts/device/run_gpu_suite.py", "tests/gpu/test_real8b.py"]
    assert tiny["env"]["DDTREE_GPU_MODELS"] == "tiny-hybrid" and tiny["env"]["DDTREE_GPU_CONFIGS"] is None
    assert tiny["argv"][tiny["argv"].index("--out") + 1] == f"{out}/lossless_tiny-hybrid_triton"
    assert "sglang_ddtree.widen_hybrid" in widen["argv"]
    assert (big["env"]["DDTREE_GPU_MODELS"], big["env"]["DDTREE_GPU_BACKEND"], big["env"]["DDTREE_GPU_CONFIGS"]) == \
        ("27b-hybrid", "flashinfer", None)  # every configuration of its plan, one server at a time
    assert run("lossless", out, "abc1234", "triton", "8b-real").returncode == 2
    assert run("fly", out).returncode == 2 and run("restore").returncode == 2


def test_real_size_sweep_step_sweeps_the_real_size_setup_unless_told_otherwise(tmp_path):
    """real8b.sh sweep: bench_budgets.py on 8b-real (bench_budgets' own default is tiny,8b-dummy), after the widening;
    setups named in the args replace it (argparse keeps the last --setups)."""
    env, log = fake_python(tmp_path)
    out = str(tmp_path / "out")

    def run(*args):
        return subprocess.run(["bash", str(DEVICE / "real8b.sh"), *args], cwd=REPO, env=env, capture_output=True,
                              text=True)

    assert run("sweep", out, "abc1234", "tri", "5", "--repeats", "2").returncode == 0
    widen, sweep = calls(log)
    assert widen["argv"][:2] == ["-m", "sglang_ddtree.widen"]
    argv = sweep["argv"]
    assert argv[0] == "benchmarks/bench_budgets.py" and argv[-2:] == ["--repeats", "2"]
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--setups"] == ["8b-real"]
    log.unlink()
    assert run("sweep", out, "abc1234", "tri", "5", "--setups", "8b-real,8b-real-fi").returncode == 0
    argv = calls(log)[-1]["argv"]
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--setups"][-1] == "8b-real,8b-real-fi"
