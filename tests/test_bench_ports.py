"""free_port: unique within a process and across processes that allocate at the same moment (the GPU suite and a
budget sweep once got the same port: EADDRINUSE)."""

import multiprocessing as mp
import os


def _take(registry: str, n: int, out) -> None:
    os.environ["SGLANG_DDTREE_PORT_REGISTRY"] = registry
    from ddtree_bench import server

    out.put([server.free_port() for _ in range(n)])


def test_ports_are_unique_across_processes(tmp_path):
    registry = str(tmp_path / "ports")
    ctx = mp.get_context("spawn")  # fresh interpreters: no shared in-process state
    out = ctx.Queue()
    procs = [ctx.Process(target=_take, args=(registry, 40, out)) for _ in range(3)]
    for p in procs:
        p.start()
    got = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    ports = [port for chunk in got for port in chunk]
    assert len(ports) == 120 and len(set(ports)) == 120
    assert len((tmp_path / "ports").read_text().splitlines()) == 120


def test_registry_forgets_old_ports(tmp_path, monkeypatch):
    from ddtree_bench import server

    monkeypatch.setenv("SGLANG_DDTREE_PORT_REGISTRY", str(tmp_path / "ports"))
    (tmp_path / "ports").write_text("1234 0\nnot a line\n")  # handed out in 1970: expired
    port = server.free_port()
    lines = (tmp_path / "ports").read_text().splitlines()
    assert lines == [f"{port} {lines[0].split()[1]}"]
