"""Launching servers: the interface the sweep uses, and the real implementation (one launch_server process group).

The sweep only calls `Launcher.create(plan)` and the `ServerHandle` methods below, so CPU tests drive it with a
fake launcher (no processes, no network).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Protocol

from ddtree_bench.measure import Client, HttpClient
from ddtree_bench.plan import REPO_ROOT, ServerPlan


class ServerStartError(RuntimeError):
    pass


class ServerHandle(Protocol):
    name: str
    log_path: Path | None

    def start(self) -> None:
        """Spawn and return at once."""

    def poll(self) -> bool:
        """True once the server answers /health; raises ServerStartError if it died."""

    def client(self) -> Client: ...

    def alive(self) -> bool: ...

    def stop(self) -> None: ...


class Launcher(Protocol):
    def create(self, plan: ServerPlan) -> ServerHandle: ...


_ports_given: set[int] = set()
_ports_lock = threading.Lock()
PORT_REGISTRY_TTL_S = 3600.0


def _port_registry() -> Path:
    return Path(os.environ.get("SGLANG_DDTREE_PORT_REGISTRY")
                or Path(tempfile.gettempdir()) / "sglang-ddtree-ports")


def free_port() -> int:
    """A port nothing listens on, never handed out twice, in this process or in another one on this machine.

    A probe (bind to port 0, close) can give two processes that start servers at the same moment the same port
    (seen: the GPU suite and a budget sweep, one server died with EADDRINUSE on its torch.distributed port).
    So ports handed out in the last hour are kept in a registry file shared by every process of this package,
    read and extended under an exclusive lock."""
    import fcntl

    registry = _port_registry()
    with _ports_lock, open(registry.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            now = time.time()
            recent: dict[int, float] = {}
            if registry.exists():
                for line in registry.read_text().splitlines():
                    parts = line.split()
                    if len(parts) == 2 and parts[0].isdigit() and now - float(parts[1]) < PORT_REGISTRY_TTL_S:
                        recent[int(parts[0])] = float(parts[1])
            while True:
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                if port not in _ports_given and port not in recent:
                    break
            _ports_given.add(port)
            recent[port] = now
            tmp = registry.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text("".join(f"{p} {t}\n" for p, t in recent.items()))
            tmp.replace(registry)
            return port
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def launch_command(python: str, args: list[str], port: int) -> list[str]:
    """`python -m sglang.launch_server ARGS` on 127.0.0.1:port. SGLang picks its torch.distributed port
    (--nccl-port) with a free-port probe of its own, which servers starting at the same moment can race for
    (EADDRINUSE, seen): unless ARGS name one, it gets one from our allocator."""
    nccl = [] if "--nccl-port" in args else ["--nccl-port", str(free_port())]
    return [python, "-m", "sglang.launch_server", *args, *nccl, "--host", "127.0.0.1", "--port", str(port)]


def parse_cpu_list(text: str) -> frozenset[int]:
    """A CPU list as taskset writes it ("4-7,9") -> {4, 5, 6, 7, 9}. Every CPU must be one this process may run
    on: a server pinned to a CPU it cannot use would fail inside SGLang's start with a less helpful message."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        lo, dash, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi if dash else lo)
        except ValueError:
            raise ValueError(f"CPU list {text!r}: {part!r} is not a CPU number or a range like 4-7.") from None
        if first < 0 or last < first:
            raise ValueError(f"CPU list {text!r}: {part!r} is not a range of CPU numbers (first <= last, >= 0).")
        cpus.update(range(first, last + 1))
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed:
        raise ValueError(f"CPU list {text!r}: CPUs {format_cpu_list(cpus - allowed)} are not available here "
                         f"(this process may run on {format_cpu_list(allowed)}).")
    return frozenset(cpus)


def format_cpu_list(cpus) -> str:
    """The inverse of parse_cpu_list: {0, 1, 2, 5} -> "0-2,5"."""
    parts, run = [], []
    for c in sorted(cpus):
        if run and c != run[-1] + 1:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(c)
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)


def log_tail(path: Path | None, lines: int = 40) -> str:
    if path is None:
        return "(no log)"
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(no log: {exc})"


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    # SGLang makes a private Prometheus multiprocess dir per server only when this is unset; inherited, every
    # server of a wave would write its metrics into the same directory and /metrics would mix them.
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


# Rounds between the chooser tables an `auto` server logs in a sweep (the server's default, 2000, is more rounds than
# a batch-16 row runs, so its rows carried no table): a row then says why `auto` chose what it chose
# (sweep.last_auto_table). A table line costs ~0.3 ms of host time: ~1 us a round at this interval.
AUTO_TABLE_EVERY = 256


def auto_table_env(env: dict[str, str]) -> dict[str, str]:
    """env with SGLANG_DDTREE_AUTO_LOG_EVERY at AUTO_TABLE_EVERY, unless the launcher or the setup set it."""
    key = "SGLANG_DDTREE_AUTO_LOG_EVERY"
    return env if key in env else {**env, key: str(AUTO_TABLE_EVERY)}


def pin_process(pid: int, cpus: frozenset[int]) -> int:
    """Every thread of process `pid` may run only on `cpus` from now on (threads started later inherit it from
    their parent thread). Returns how many threads were pinned. Linux only (/proc)."""
    pinned = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, PermissionError):
        return 0  # gone meanwhile, or not ours
    for tid in tids:
        try:
            os.sched_setaffinity(int(tid), cpus)
            pinned += 1
        except (ProcessLookupError, FileNotFoundError):
            pass
    return pinned


def pin_process_group(pgid: int, cpus: frozenset[int]) -> int:
    """pin_process for every live process of process group `pgid`; the number of threads pinned."""
    pinned = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) != pgid:
                continue
        except ProcessLookupError:
            continue
        pinned += pin_process(int(entry), cpus)
    return pinned


class SubprocessServer:
    """One launch_server process group on a free port.

    cpus: once the server answers /health, every thread of its processes (the HTTP server, SGLang's scheduler and
    detokenizer) is pinned to these CPUs; None leaves the placement to the OS. Pinned only when ready: a dozen
    servers compiling kernels and capturing graphs at once start much faster on the whole machine. start_cpus:
    the CPUs the process starts on (the parent's own, when it has narrowed itself since: bench_budgets.py moves
    its client off the servers' CPUs)."""

    def __init__(self, name: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None,
                 python: str = sys.executable, cpus: frozenset[int] | None = None,
                 start_cpus: frozenset[int] | None = None):
        for flag in ("--host", "--port"):
            if flag in args:
                raise ValueError(f"the launcher picks {flag} itself; remove it from the server args.")
        self.name = name
        self.args = list(args)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"server-{name}-{self.port}.log"
        self.log_dir = log_dir
        self.env = server_env(env)
        self.python = python
        self.cpus = cpus
        self.start_cpus = start_cpus
        self.pinned_threads: int | None = None  # set when pinned (cpus)
        self.proc: subprocess.Popen | None = None
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def command(self) -> list[str]:
        return launch_command(self.python, self.args, self.port)

    def start(self) -> None:
        cmd = self.command()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as logf:
            logf.write("$ " + " ".join(cmd) + "\n")
            logf.flush()
            start = self.start_cpus
            self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=self.env, cwd=REPO_ROOT,
                                         start_new_session=True,
                                         preexec_fn=None if start is None else lambda: os.sched_setaffinity(0, start))
        with open(self.log_dir / "servers.pgids", "a") as fh:  # run_gpu_suite.py kills leftovers by these
            fh.write(f"{self.proc.pid}\n")

    def poll(self) -> bool:
        if self.proc is None:
            raise ServerStartError(f"server {self.name} was never started.")
        rc = self.proc.poll()
        if rc is not None:
            raise ServerStartError(f"server {self.name} exited with status {rc} while starting; last lines of "
                                   f"{self.log_path}:\n{log_tail(self.log_path)}")
        try:
            with self._opener.open(self.base_url + "/health", timeout=2) as resp:
                ready = resp.status == 200
        except (urllib.error.URLError, OSError):
            return False
        if ready and self.cpus is not None and self.pinned_threads is None:
            self.pinned_threads = pin_process_group(self.proc.pid, self.cpus)
        return ready

    def client(self) -> Client:
        return HttpClient(self.base_url)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 8.0) -> None:
        if self.proc is not None:
            stop_process_group(self.proc, grace_s, 5.0)


def stop_process_group(proc: subprocess.Popen, grace_s: float, kill_wait_s: float) -> None:
    """SIGTERM a server's process group, SIGKILL it if the leader is still there after grace_s, then SIGKILL the
    group once more: the scheduler and detokenizer children share it and can outlive the leader."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, kill_wait_s)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class SubprocessLauncher:
    """cpus: every server's CPUs once it is ready (SubprocessServer). One set for all: servers of an interleaved
    sweep, measured one at a time, then run on the same vCPUs, whose speeds differ on the lent machines
    (measured: 0.32-0.68 s for one loop pinned to each vCPU in turn), instead of wherever the OS placed each process.
    Servers start on the CPUs this process had when the launcher was made."""

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None, python: str = sys.executable,
                 cpus: frozenset[int] | None = None):
        self.log_dir = Path(log_dir)
        self.env = env
        self.python = python
        self.cpus = cpus
        self.start_cpus = frozenset(os.sched_getaffinity(0)) if cpus is not None else None

    def create(self, plan: ServerPlan) -> SubprocessServer:
        env = self.env
        if plan.setup.server_env:  # the setup's own entries over the launcher's environment
            env = {**(os.environ if env is None else env), **plan.setup.env()}
        if plan.method == "auto":
            env = auto_table_env(os.environ if env is None else env)
        return SubprocessServer(plan.name, plan.args, self.log_dir, env, self.python, self.cpus, self.start_cpus)


def wait_all_ready(handles: list[ServerHandle], deadline: float, clock=time.monotonic, sleep=time.sleep,
                   on_ready=None) -> dict[str, float | ServerStartError]:
    """Poll every handle until it is ready, failed, or `deadline` (clock time) passes. Returns name -> seconds to
    ready (from the call) or the ServerStartError. on_ready(name, seconds_or_error) is called as each settles."""
    t0 = clock()
    pending = {h.name: h for h in handles}
    settled: dict[str, float | ServerStartError] = {}
    while pending:
        for name, handle in list(pending.items()):
            try:
                ready = handle.poll()
            except ServerStartError as exc:
                settled[name] = exc
            else:
                if not ready:
                    continue
                settled[name] = clock() - t0
            del pending[name]
            if on_ready is not None:
                on_ready(name, settled[name])
        if not pending:
            break
        if clock() >= deadline:
            for name, handle in pending.items():
                settled[name] = ServerStartError(f"server {name} not ready after {clock() - t0:.0f} s (deadline); "
                                                 f"last lines of {handle.log_path}:\n{log_tail(handle.log_path, 15)}")
                if on_ready is not None:
                    on_ready(name, settled[name])
            break
        sleep(1.0)
    return settled
