"""The profiler-trace reader (ddtree_bench.trace) and the worker's per-stage profiler ranges."""

import pytest
import torch

from ddtree_bench import trace


def x(cat, name, ts, dur, tid=1, corr=None):
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def synthetic_trace():
    """Two steps of 1000 us each. Host thread 1: SGLang's `scheduler.run_batch` range over a `ddtree:draft` range (an aten::copy_ op in it) launching kernel A (corr 1) and a graph
    (corr 2, two kernels), a stream sync, a `ddtree:verify` range launching kernel C (corr 3). GPU (tid 7): A 0..100,
    graph kernels 150..350 and 350..550, C 700..900; a pageable DtoH copy 950..960; the same again 1000 us later."""
    ev = []
    for step in range(2):
        t = 1000.0 * step
        ev += [
            x("user_annotation", "scheduler.run_batch", t + 0, 700),
            x("user_annotation", "ddtree:draft", t + 0, 120),
            x("cpu_op", "aten::copy_", t + 2, 3),
            x("cuda_runtime", "cudaLaunchKernel", t + 5, 10, corr=10 * step + 1),
            x("cuda_runtime", "cudaGraphLaunch", t + 20, 30, corr=10 * step + 2),
            x("cuda_runtime", "cudaStreamSynchronize", t + 130, 420),
            x("user_annotation", "ddtree:verify", t + 600, 50),
            x("cuda_runtime", "cudaLaunchKernel", t + 610, 10, corr=10 * step + 3),
            x("cuda_runtime", "cudaMemcpyAsync", t + 660, 5, corr=10 * step + 4),
            x("kernel", "A", t + 0, 100, tid=7, corr=10 * step + 1),
            x("kernel", "B1", t + 150, 200, tid=7, corr=10 * step + 2),
            x("kernel", "B2", t + 350, 200, tid=7, corr=10 * step + 2),
            x("kernel", "C", t + 700, 200, tid=7, corr=10 * step + 3),
            x("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", t + 950, 10, tid=7, corr=10 * step + 4),
        ]
    ev.append({"ph": "i", "name": "marker", "ts": 0})  # not a complete event: ignored
    return {"traceEvents": ev}


def test_analyze_splits_a_step_into_busy_idle_kernels_syncs_and_ranges():
    got = trace.analyze(synthetic_trace(), steps=2)
    assert got["wall_ms"] == pytest.approx(1.96 / 2)  # GPU activity spans 0 .. 1960 us
    assert got["gpu_busy_ms"] == pytest.approx((100 + 400 + 200 + 10) / 1e3)
    assert got["gpu_idle_ms"] == pytest.approx(got["wall_ms"] - got["gpu_busy_ms"])
    assert {k["name"]: k["ms"] for k in got["kernels"]} == pytest.approx({"B1": 0.2, "B2": 0.2, "C": 0.2, "A": 0.1,
                                                                         "Memcpy DtoH (Device -> Pageable)": 0.01})
    assert got["kernels"][-1]["name"].startswith("Memcpy")  # largest first
    assert {k["name"]: k["calls"] for k in got["kernels"]}["A"] == 1
    assert got["kernel_launches"] == 5
    assert got["syncs"] == [{"name": "cudaStreamSynchronize", "ms": pytest.approx(0.42), "calls": 1}]
    assert got["pageable_dtoh_copies"] == 1
    draft, verify = got["ranges"]["draft"], got["ranges"]["verify"]
    assert draft["host_ms"] == pytest.approx(0.12) and draft["gpu_ms"] == pytest.approx(0.5)
    assert draft["launches"] == 2 and draft["count"] == 1
    assert verify["gpu_ms"] == pytest.approx(0.2) and verify["launches"] == 1
    # Python: the range's time in no op and no runtime call of its thread (draft 120 us less the copy 3, the launch
    # 10 and the graph launch 30; verify 50 less its launch 10; the memcpy call at 660 is past its end)
    assert draft["python_ms"] == pytest.approx(0.077) and verify["python_ms"] == pytest.approx(0.040)
    # SGLang's own ranges apart from the worker's stages; torch ops per step (run_batch: 700 us less 3 + 10 + 30 +
    # 420 (the sync) + 10 + 5)
    assert got["annotations"] == {"scheduler.run_batch": {"host_ms": pytest.approx(0.7),
                                                          "python_ms": pytest.approx(0.222), "count": 1}}
    assert got["cpu_ops"] == [{"name": "aten::copy_", "ms": pytest.approx(0.003), "calls": 1}]


def test_analyze_refuses_a_trace_without_gpu_activity():
    with pytest.raises(ValueError, match="no GPU activity"):
        trace.analyze({"traceEvents": [x("cpu_op", "aten::add", 0, 5)]}, steps=1)
    with pytest.raises(ValueError, match="steps"):
        trace.analyze(synthetic_trace(), steps=0)


def test_round_timer_opens_one_profiler_range_per_stage(tmp_path):
    """The worker's RoundTimer with ranges on: the stages appear as `ddtree:<stage>` ranges, in order, each
    closed before the next opens (no CUDA needed: the ranges are host-side)."""
    pytest.importorskip("prometheus_client")
    from sglang_ddtree.sglang.stats import RoundTimer
    from sglang_ddtree.stages import STAGES

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        timer = RoundTimer(enabled=False, ranges=True)
        for stage in STAGES:
            torch.ones(4).sum()
            timer.mark(stage)
    path = tmp_path / "t.json"
    prof.export_chrome_trace(str(path))
    got = [e for e in trace.load(path)["traceEvents"] if str(e.get("name", "")).startswith("ddtree:")]
    got.sort(key=lambda e: e["ts"])
    assert [e["name"] for e in got] == [f"ddtree:{s}" for s in STAGES]
    for a, b in zip(got, got[1:]):
        assert a["ts"] + a["dur"] <= b["ts"] + 1e-3


def test_round_timer_names_the_range_after_a_mark_by_the_stage_marked_next(tmp_path):
    """`auto`'s lean chain round marks draft, verify, walk, commit (no tree): told the stage that follows the draft,
    the timer names each range after the stage it ends in."""
    pytest.importorskip("prometheus_client")
    from sglang_ddtree.sglang.stats import RoundTimer

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        timer = RoundTimer(enabled=False, ranges=True)
        timer.mark("draft", following="verify")
        for stage in ("verify", "walk", "commit"):
            timer.mark(stage)
    path = tmp_path / "t.json"
    prof.export_chrome_trace(str(path))
    got = sorted((e for e in trace.load(path)["traceEvents"] if str(e.get("name", "")).startswith("ddtree:")),
                 key=lambda e: e["ts"])
    assert [e["name"] for e in got] == ["ddtree:draft", "ddtree:verify", "ddtree:walk", "ddtree:commit"]


def profile_rounds_module():
    """benchmarks/profile_rounds.py, a script, loaded as a module."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "profile_rounds.py"
    spec = importlib.util.spec_from_file_location("profile_rounds", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_profile_rounds_profiles_the_sweeps_servers_at_batch_1():
    """benchmarks/profile_rounds.py starts exactly the servers the budget sweep would (same plan code), batch 1."""
    mod = profile_rounds_module()
    args = mod.parse_args(["--out", "/tmp/x", "--setups", "8b-dummy,tiny", "--methods", "dflash,ddtree",
                           "--budgets", "32,256"])
    servers = mod.servers_to_profile(args)
    assert [s.name for s in servers] == ["8b-dummy-dflash", "8b-dummy-ddtree-b32", "8b-dummy-ddtree-b256",
                                         "tiny-dflash", "tiny-ddtree-b32", "tiny-ddtree-b256"]
    assert all(s.batch_sizes == (1,) for s in servers)
    b256 = servers[2].args
    assert b256[b256.index("--speculative-ddtree-budget") + 1] == "256"
    with pytest.raises(SystemExit):
        mod.parse_args(["--out", "/tmp/x", "--steps", "2"])
    with pytest.raises(SystemExit, match="unknown setup"):
        mod.servers_to_profile(mod.parse_args(["--out", "/tmp/x", "--setups", "70b"]))


def test_profile_rounds_at_a_batch_size_with_auto():
    """--batch-size sizes the servers as the sweep's row of that batch size does; `auto` is one server."""
    mod = profile_rounds_module()
    args = mod.parse_args(["--out", "/tmp/x", "--setups", "8b-dummy", "--methods", "dflash,auto",
                           "--budgets", "32", "--batch-size", "16"])
    servers = mod.servers_to_profile(args)
    assert [s.name for s in servers] == ["8b-dummy-dflash", "8b-dummy-auto"]
    assert all(s.batch_sizes == (16,) for s in servers)
    auto = servers[1].args
    assert auto[auto.index("--speculative-ddtree-budget") + 1] == "auto"
    assert int(auto[auto.index("--max-running-requests") + 1]) >= 16
    with pytest.raises(SystemExit):
        mod.parse_args(["--out", "/tmp/x", "--batch-size", "0"])


def test_profile_one_starts_recording_at_a_token_count(tmp_path, monkeypatch):
    """profile_one waits until the first request has --start-at-tokens output tokens before /start_profile (a
    fixed sleep left the context length, and so the attention cost, to chance), and reports the request's
    length then and when the trace appeared. A fake server streams one token every millisecond."""
    import json
    import threading
    import time

    from ddtree_bench.measure import RequestResult

    mod = profile_rounds_module()
    state = {"tokens_at_start_profile": None, "streamed": 0}
    lock = threading.Lock()

    class FakeClient:
        def generate_stream(self, payload, timeout_s, index=0, on_chunk=None):
            result = RequestResult(index=index, t_send=0.0)
            for n in range(1, payload["sampling_params"]["max_new_tokens"] + 1):
                time.sleep(0.001)
                result.meta = {"completion_tokens": n}  # a text prompt's stream: the count, no output_ids
                with lock:
                    state["streamed"] = max(state["streamed"], n)
                if on_chunk is not None:
                    on_chunk(result)
            result.meta = {**result.meta, "spec_accept_length": 1.0}
            result.output_ids = list(range(payload["sampling_params"]["max_new_tokens"]))
            return result

        def _open(self, path, body, timeout_s):
            import contextlib
            import io

            assert path == "/start_profile"
            with lock:
                state["tokens_at_start_profile"] = state["streamed"]
            out = tmp_path / "traces" / "raw-fake"
            (out / "x.trace.json.gz").write_bytes(b"")
            return contextlib.closing(io.BytesIO(b"ok"))

    class Handle:
        def client(self):
            return FakeClient()

    class Server:
        name = "fake"

    trace_dir = tmp_path / "traces"
    trace_dir.mkdir()
    monkeypatch.setattr(mod.trace, "load", lambda path: {"path": str(path)})
    monkeypatch.setattr(mod.trace, "analyze", lambda tr, steps: {"wall_ms": 1.0, "steps": steps})
    got = mod.profile_one(Server(), Handle(), [{"input_ids": [1, 2, 3]}], steps=2, trace_dir=trace_dir,
                          warmup_batches=1, start_at_tokens=40)
    assert state["tokens_at_start_profile"] >= 40
    assert 40 <= got["request_tokens_at_profile_start"] <= got["request_tokens_when_trace_written"]
    assert got["prompt_tokens"] == 3 and got["wall_ms"] == 1.0
    assert json.dumps(got)  # the report stays plain JSON
