"""Fixtures for the GPU suite (tests/gpu).

Everything here skips cleanly, with a reason, where CUDA (all tests here) or SGLang (tests that serve) is
missing (CI, laptops). On the GPU machine scripts/device/run_gpu_suite.py sets DDTREE_GPU_REQUIRED=1, which turns
those skips into errors: there a missing GPU or SGLang means a broken install, not a pass.

`sglang_server(name, args)` (module scope) starts `python -m sglang.launch_server` on a free port, waits for
/health, and returns a small HTTP client; `sglang_servers({name: args, ...})` starts several in parallel.
Servers live until the module's tests are done (a start costs 1-3 minutes), then their process groups are
killed. Logs go to $GPU_SUITE_LOG_DIR (the runner bundles them) or runs/gpu-logs/.

`model_pair` picks the tiny trained pair in models/tiny/{target,drafter} when its weights are there, else the
dummy configs in tests/gpu/configs (random weights via --load-format dummy, no tokenizer, token-id prompts).
DDTREE_GPU_MODELS=tiny|dummy forces one; 8b-real (runs/8b-real), tiny-hybrid (the hybrid pair trained on the
device into models/tiny-hybrid) and 27b-hybrid (it widened to Qwen3.5-27B into runs/27b-hybrid) pick the pairs of
the real-size module (test_real8b.py), the widened ones built when missing. `gpu_record(kind, **fields)` appends to
the suite's records.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
# The benchmark harness (ddtree_bench/) lives next to the package, not in it: importable from the checkout's root,
# also where this file is loaded outside pytest's rootdir handling (a child process, the device runner).
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

# One port allocator and log reader for the suite and the budget sweep (both start servers in parallel).
from ddtree_bench.server import free_port, launch_command, log_tail, stop_process_group  # noqa: E402

TINY_DIR = REPO_ROOT / "models" / "tiny"
TINY_HYBRID_DIR = REPO_ROOT / "models" / "tiny-hybrid"  # scripts/device/hybrid.sh train
CONFIG_DIR = Path(__file__).resolve().parent / "configs"
GPU_DIR = Path(__file__).resolve().parent


# ------------------------------------------------------------------------------------------ environment gate


def cuda_unavailable_reason() -> str | None:
    """None when torch sees a CUDA device here, else why not (one sentence)."""
    if importlib.util.find_spec("torch") is None:
        return "gpu-env: torch is not installed"
    import torch

    if not torch.cuda.is_available():
        return "gpu-env: CUDA is not available on this machine"
    return None


def sglang_unavailable_reason() -> str | None:
    """None when the SGLang stack can be imported here, else why not (one sentence)."""
    for module in ("sglang", "sgl_kernel"):
        if importlib.util.find_spec(module) is None:
            return (f"gpu-env: {module} is not importable (install the site chunks and "
                    "`source scripts/device/env.sh`, see docs/gpu-suite.md)")
    return None


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("DDTREE_GPU_REQUIRED") == "1":
        pytest.fail(f"{reason} (DDTREE_GPU_REQUIRED=1: the GPU suite must not skip here)", pytrace=False)
    pytest.skip(reason)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if GPU_DIR in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(scope="session", autouse=True)
def gpu_env() -> None:
    """Every test here needs CUDA. Session-scoped, so it runs before any module-scoped fixture."""
    reason = cuda_unavailable_reason()
    if reason:
        _skip_or_fail(reason)


@pytest.fixture(scope="session")
def sglang_env(gpu_env) -> None:
    """Tests that serve need SGLang too (tests of our CUDA core do not)."""
    reason = sglang_unavailable_reason()
    if reason:
        _skip_or_fail(reason)


# ---------------------------------------------------------------------------------------------- logs/records


def suite_log_dir() -> Path:
    path = Path(os.environ.get("GPU_SUITE_LOG_DIR") or REPO_ROOT / "runs" / "gpu-logs")
    path.mkdir(parents=True, exist_ok=True)
    return path


def record(kind: str, **fields) -> None:
    """Append one JSON line to records.jsonl; run_gpu_suite.py copies them into gpu_suite.json."""
    with open(suite_log_dir() / "records.jsonl", "a") as fh:
        fh.write(json.dumps({"kind": kind, "time": round(time.time(), 3), **fields}, default=str) + "\n")


@pytest.fixture(scope="session")
def gpu_record():
    return record


# ----------------------------------------------------------------------------------------------- model pair


@dataclass(frozen=True)
class ModelPair:
    target: Path
    drafter: Path
    dummy: bool  # random weights, no tokenizer: prompts must be token ids
    name: str = ""  # "8b-real", "tiny-hybrid", "27b-hybrid"; else the mode follows `dummy`

    @property
    def mode(self) -> str:
        return self.name or ("dummy" if self.dummy else "tiny")

    @property
    def hybrid(self) -> bool:
        """A gated-delta-net hybrid target (SGLang's mamba state pool: --max-mamba-cache-size)."""
        return self.name in HYBRID_MODES

    def base_args(self) -> list[str]:
        args = ["--model-path", str(self.target)]
        if self.dummy:
            args += ["--load-format", "dummy", "--skip-tokenizer-init"]
        return args

    def dflash_args(self, block: int) -> list[str]:
        return ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(self.drafter),
                "--speculative-num-draft-tokens", str(block)]


def tiny_pair_missing(folder: Path | None = None) -> str | None:
    """None when `folder` (default models/tiny) holds a servable pair, else what is missing."""
    folder = folder or TINY_DIR
    target, drafter = folder / "target", folder / "drafter"
    for d in (target, drafter):
        if not (d / "config.json").is_file():
            return f"{d.relative_to(REPO_ROOT)}/config.json"
        if not any(d.glob("*.safetensors")):
            return f"weights (*.safetensors) in {d.relative_to(REPO_ROOT)}"
    if not any((target / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return f"a tokenizer in {target.relative_to(REPO_ROOT)}"
    return None


REAL8B_DIR = REPO_ROOT / "runs" / "8b-real"


def real8b_pair() -> ModelPair:
    """The tiny pair widened to Qwen3-8B shapes (sglang_ddtree/widen.py), built into runs/8b-real when missing."""
    from sglang_ddtree import widen

    big = widen.SHAPES["qwen3-8b"]
    if not widen.is_built(REAL8B_DIR, big):
        widen.widen_pair(TINY_DIR, big, REAL8B_DIR)
    return ModelPair(REAL8B_DIR / "target", REAL8B_DIR / "drafter", dummy=False, name="8b-real")


HYBRID27B_DIR = REPO_ROOT / "runs" / "27b-hybrid"
HYBRID_MODES = ("tiny-hybrid", "27b-hybrid")
MODES = ("auto", "tiny", "dummy", "8b-real") + HYBRID_MODES


def tiny_hybrid_pair() -> ModelPair:
    """The tiny gated-delta-net hybrid pair, trained on the device (scripts/device/hybrid.sh train)."""
    missing = tiny_pair_missing(TINY_HYBRID_DIR)
    if missing:
        raise ValueError(f"DDTREE_GPU_MODELS=tiny-hybrid but the hybrid pair lacks {missing} (train it on the device: "
                         "bash scripts/device/hybrid.sh train OUT COMMIT).")
    return ModelPair(TINY_HYBRID_DIR / "target", TINY_HYBRID_DIR / "drafter", dummy=False, name="tiny-hybrid")


def hybrid27b_pair() -> ModelPair:
    """The tiny hybrid pair widened to Qwen3.5-27B shapes (sglang_ddtree/widen_hybrid.py, 57.3 GB), built into
    runs/27b-hybrid when missing (refused before writing when the disk has no room)."""
    from sglang_ddtree import widen_hybrid

    big = widen_hybrid.HYBRID_SHAPES["qwen3.5-27b"]
    if not widen_hybrid.is_built(HYBRID27B_DIR, big):
        widen_hybrid.widen_hybrid_pair(tiny_hybrid_pair().target.parent, big, HYBRID27B_DIR)
    return ModelPair(HYBRID27B_DIR / "target", HYBRID27B_DIR / "drafter", dummy=False, name="27b-hybrid")


def choose_model_pair(mode: str) -> ModelPair:
    if mode == "8b-real":
        return real8b_pair()
    if mode == "tiny-hybrid":
        return tiny_hybrid_pair()
    if mode == "27b-hybrid":
        return hybrid27b_pair()
    if mode not in MODES:
        raise ValueError(f"DDTREE_GPU_MODELS must be one of {', '.join(MODES)}, got {mode!r}.")
    missing = tiny_pair_missing()
    if mode == "tiny" and missing:
        raise ValueError(f"DDTREE_GPU_MODELS=tiny but the tiny pair lacks {missing}.")
    if mode == "dummy" or (mode == "auto" and missing):
        return ModelPair(CONFIG_DIR / "dummy-target", CONFIG_DIR / "dummy-drafter", dummy=True)
    return ModelPair(TINY_DIR / "target", TINY_DIR / "drafter", dummy=False)


@pytest.fixture(scope="session")
def model_pair(sglang_env) -> ModelPair:
    pair = choose_model_pair(os.environ.get("DDTREE_GPU_MODELS", "auto"))
    record("model_pair", mode=pair.mode, target=str(pair.target), drafter=str(pair.drafter),
           tiny_missing=tiny_pair_missing())
    return pair


# ----------------------------------------------------------------------------------------------- the server


class ServerStartError(RuntimeError):
    pass


class SGLangServer:
    """One `python -m sglang.launch_server` process group and a tiny HTTP client for it."""

    def __init__(self, name: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None,
                 start_timeout_s: float | None = None):
        for flag in ("--host", "--port"):
            if flag in args:
                raise ValueError(f"sglang_server picks {flag} itself; remove it from the args ({args}).")
        self.name = name
        self.args = list(args)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"server-{name}-{self.port}.log"
        self.env = {**os.environ, **(env or {})}
        self.start_timeout_s = start_timeout_s or float(os.environ.get("DDTREE_SERVER_START_TIMEOUT", "600"))
        self.proc: subprocess.Popen | None = None
        self.start_seconds: float | None = None
        self.cancelled = threading.Event()  # set by kill(): a start still in progress gives up at once

    # -- lifecycle
    def start(self) -> "SGLangServer":
        cmd = launch_command(sys.executable, self.args, self.port)
        t0 = time.monotonic()
        if self.cancelled.is_set():
            raise ServerStartError(f"server {self.name!r} was cancelled before it started")
        with open(self.log_path, "w") as logf:
            logf.write("$ " + " ".join(cmd) + "\n")
            logf.flush()
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=self.env,
                                         cwd=REPO_ROOT, start_new_session=True)
        with open(self.log_path.parent / "servers.pgids", "a") as fh:  # the runner kills leftovers
            fh.write(f"{self.proc.pid}\n")
        try:
            self._wait_healthy(t0)
        except BaseException as exc:  # KeyboardInterrupt too (the runner's deadline): leave nothing running
            if not isinstance(exc, ServerStartError):
                self.kill()
                raise
            self.start_seconds = round(time.monotonic() - t0, 2)
            record("server_start", name=self.name, ok=False, seconds=self.start_seconds, error=str(exc)[:500],
                   log=self.log_path.name)
            self.stop()
            raise
        self.start_seconds = round(time.monotonic() - t0, 2)
        record("server_start", name=self.name, ok=True, seconds=self.start_seconds, args=self.args,
               log=self.log_path.name)
        return self

    def _wait_healthy(self, t0: float) -> None:
        while True:
            if self.cancelled.is_set():
                self.kill()
                raise ServerStartError(f"server {self.name!r} was cancelled while starting")
            rc = self.proc.poll()
            if rc is not None:
                raise ServerStartError(f"server {self.name!r} exited with status {rc} before it was healthy; "
                                       f"last lines of {self.log_path}:\n{log_tail(self.log_path, 60)}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() - t0 > self.start_timeout_s:
                raise ServerStartError(f"server {self.name!r} not healthy after {self.start_timeout_s:.0f} s; "
                                       f"last lines of {self.log_path}:\n{log_tail(self.log_path, 60)}")
            time.sleep(1.0)

    def kill(self) -> None:
        """SIGKILL the whole process group at once (no graceful shutdown); a start in progress gives up."""
        self.cancelled.set()
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        stop_process_group(self.proc, 20, 10)

    # -- client
    def generate(self, text: str | list[str] | None = None, input_ids: list[int] | list[list[int]] | None = None,
                 sampling_params: dict | None = None, timeout_s: float = 300, **extra) -> dict | list[dict]:
        """POST /generate; returns SGLang's JSON: for one prompt a dict (output_ids, meta_info, and text when the
        server has a tokenizer), for a list of prompts (a batch) a list of such dicts."""
        if (text is None) == (input_ids is None):
            raise ValueError("generate takes exactly one of text= or input_ids=.")
        body = {"sampling_params": sampling_params or {}, **extra}
        body["text" if text is not None else "input_ids"] = text if text is not None else list(input_ids)
        return self._post("/generate", body, timeout_s)

    def get(self, path: str, timeout_s: float = 30) -> dict:
        with urllib.request.urlopen(self.base_url + path, timeout=timeout_s) as resp:
            return json.loads(resp.read())

    def _post(self, path: str, body: dict, timeout_s: float) -> dict:
        req = urllib.request.Request(self.base_url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:2000]
            raise AssertionError(f"{path} on server {self.name!r} answered {exc.code}: {detail}\n"
                                 f"server log tail:\n{log_tail(self.log_path, 30)}") from exc

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


class ServerPool:
    """The servers of one test module, by name."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.servers: dict[str, SGLangServer] = {}

    def _reuse(self, name: str, args: list[str]) -> SGLangServer | None:
        if name in self.servers:
            if self.servers[name].args != list(args):
                raise ValueError(f"server {name!r} already runs with other args; use another name.")
            return self.servers[name]
        return None

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> SGLangServer:
        return self.start_many({name: args}, env)[name]

    def start_many(self, configs: dict[str, list[str] | tuple[list[str], dict[str, str]]],
                   env: dict[str, str] | None = None, *,
                   all_or_nothing: bool = True) -> dict[str, SGLangServer | ServerStartError]:
        """Start every configuration not yet running, all at once (JIT and graph capture overlap on the CPUs).
        If any does not come up: fail with every failed server's log tail, or, with all_or_nothing=False,
        return the ServerStartError in its place so that only the tests using that server fail."""
        if not configs:
            raise ValueError("sglang_servers needs at least one {name: args} entry.")
        # a configuration is its args, or (args, extra environment) for a server that needs its own switches
        specs = {n: (c if isinstance(c, tuple) else (c, {})) for n, c in configs.items()}
        todo = {n: SGLangServer(n, a, self.log_dir, {**(env or {}), **extra} or None)
                for n, (a, extra) in specs.items() if self._reuse(n, a) is None}
        errors: dict[str, ServerStartError] = {}
        pool = concurrent.futures.ThreadPoolExecutor(max(1, len(todo)))
        try:
            pending = {pool.submit(server.start): name for name, server in todo.items()}
            while pending:
                # Short waits, not a blocking result(): a SIGINT the OS hands to a worker thread only reaches
                # Python's handler when the main thread wakes up.
                done, _ = concurrent.futures.wait(list(pending), timeout=0.5,
                                                  return_when=concurrent.futures.FIRST_COMPLETED)
                for fut in done:
                    name = pending.pop(fut)
                    try:
                        fut.result()
                        self.servers[name] = todo[name]
                    except ServerStartError as exc:
                        errors[name] = exc
        except BaseException:
            # Interrupted (the runner's deadline sends SIGINT), wherever it lands: kill every server still
            # starting (their threads then end within a poll) and do not wait for the threads here.
            for server in todo.values():
                server.kill()
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown(wait=True)
        if errors and all_or_nothing:
            pytest.fail("\n\n".join(map(str, errors.values())), pytrace=False)
        return {name: self.servers.get(name) or errors[name] for name in configs}

    def stop_all(self) -> None:
        for server in self.servers.values():  # signal all first, so their shutdowns overlap
            if server.proc is not None and server.proc.poll() is None:
                try:
                    os.killpg(server.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for server in self.servers.values():
            server.stop()


@pytest.fixture(scope="module")
def _server_pool(sglang_env):
    pool = ServerPool(suite_log_dir())
    yield pool
    pool.stop_all()


@pytest.fixture(scope="module")
def sglang_server(_server_pool):
    """Factory: sglang_server(name, args, env=None) -> a running SGLangServer, reused within the module under the
    same name (asking again with other args is an error). All are stopped when the module ends."""
    return _server_pool.start


@pytest.fixture(scope="module")
def sglang_servers(_server_pool):
    """Factory: sglang_servers({name: args, ...}, env=None) -> {name: SGLangServer}, started in parallel. Each
    start costs 1-3 minutes, mostly JIT and graph capture, which overlap well; give each server a small
    --mem-fraction-static. Shares the module's servers with sglang_server."""
    return _server_pool.start_many
