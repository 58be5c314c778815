"""The sweep's orchestration with a fake launcher (no processes, no network, a fake clock): waves, serial
measurement, skip rows, failures, the deadline, interruption and resume from the results file."""

from __future__ import annotations

import dataclasses
import json
import math
import threading
from pathlib import Path

import pytest

from ddtree_bench import plan as P
from ddtree_bench.measure import RequestResult
from ddtree_bench.results import ResultsWriter, latest_results, read_rows
from ddtree_bench.server import ServerStartError
from ddtree_bench.sweep import Sweep, SweepOptions, id_prompts

STAGE_MS = {"draft": 1.0, "tree": 0.5, "verify": 4.0, "walk": 0.25, "commit": 0.5}
FAKE_TAU = 2  # every speculative round accepts exactly one draft token


class Clock:
    def __init__(self):
        self.t = 0.0
        self.lock = threading.Lock()

    def __call__(self):
        with self.lock:
            return self.t

    def sleep(self, s):
        with self.lock:
            self.t += s


class FakeClient:
    def __init__(self, server):
        self.server = server

    def generate_stream(self, payload, timeout_s):
        srv = self.server
        srv.launcher.events.append(("generate", srv.name))
        srv.max_new_tokens_seen.append(payload["sampling_params"]["max_new_tokens"])
        with srv.lock:
            srv.generates += 1
            srv.prompts_seen.append(payload.get("text"))
            if srv.name in srv.launcher.die_after and srv.generates > srv.launcher.die_after[srv.name]:
                srv.dead = True
        if srv.dead:
            return RequestResult(index=0, t_send=0.0, error="ConnectionRefusedError: server gone")
        n = payload["sampling_params"]["max_new_tokens"]
        spec = srv.plan.method != "plain"
        rounds = math.ceil((n - 1) / FAKE_TAU) if spec else n - 1
        decode_s = rounds * srv.step_s
        meta = {"completion_tokens": n, "prompt_tokens": 7, "decode_throughput": (n - 1) / decode_s,
                "e2e_latency": 0.01 + decode_s, "queue_time": 0.0}
        if spec:
            meta["spec_verify_ct"] = rounds
            meta["spec_correct_drafts_histogram"] = [0] * (FAKE_TAU - 1) + [rounds]
        with srv.lock:
            srv.request_rounds += rounds
        t = srv.launcher.clock()
        return RequestResult(index=0, t_send=t, t_first=t + 0.01, t_last=t + 0.01 + decode_s, meta=meta, chunks=n)

    def metrics_text(self):
        srv = self.server
        if srv.plan.method != "ddtree":
            return "sglang:num_running_reqs 0\n"
        b, n = srv.plan.budget, srv.request_rounds
        lines = [f'sglang:ddtree_rounds_total{{budget="{b}"}} {n}',
                 f'sglang:ddtree_accepted_tokens_total{{budget="{b}"}} {n * FAKE_TAU}']
        for stage, ms in STAGE_MS.items():
            lines.append(f'sglang:ddtree_stage_seconds_sum{{budget="{b}",stage="{stage}"}} {n * ms / 1e3}')
            lines.append(f'sglang:ddtree_stage_seconds_count{{budget="{b}",stage="{stage}"}} {n}')
        return "\n".join(lines) + "\n"

    def server_info(self):
        return {"max_total_num_tokens": self.server.plan.memory.kv_pool_tokens, "version": "fake",
                "internal_states": [{"last_gen_throughput": 1.0, "nested": {"x": 1}}]}

    def flush_cache(self):
        srv = self.server
        srv.launcher.clock.sleep(srv.launcher.row_seconds)  # a row's time passes here
        if srv.name in srv.launcher.interrupt_on:
            raise KeyboardInterrupt
        return True


class FakeServer:
    def __init__(self, plan, launcher):
        self.plan, self.launcher, self.name = plan, launcher, plan.name
        self.log_path = None
        self.lock = threading.Lock()
        self.polls = 0
        self.generates = 0
        self.prompts_seen: list = []
        self.max_new_tokens_seen: list = []
        self.request_rounds = 0
        self.dead = False
        self.stopped = False
        self.step_s = 0.002 if plan.setup.name == "tiny" else 0.02

    def start(self):
        self.launcher.events.append(("start", self.name))

    def poll(self):
        if self.name in self.launcher.fail:
            raise ServerStartError(f"server {self.name} exited with status 1 while starting; boom")
        self.polls += 1
        return self.polls >= 3

    def client(self):
        return FakeClient(self)

    def alive(self):
        return not self.dead

    def stop(self):
        self.stopped = True
        self.launcher.events.append(("stop", self.name))


class FakeLauncher:
    def __init__(self, clock, *, fail=(), die_after=None, interrupt_on=(), row_seconds=1.0):
        self.clock = clock
        self.fail, self.interrupt_on = set(fail), set(interrupt_on)
        self.die_after = dict(die_after or {})
        self.row_seconds = row_seconds
        self.created: dict[str, FakeServer] = {}
        self.events: list[tuple[str, str]] = []

    def create(self, plan):
        server = FakeServer(plan, self)
        self.created[plan.name] = server
        return server


SETUPS = P.default_setups()
TINY = dataclasses.replace(SETUPS["tiny"], budgets=(16, 64), batch_sizes=(1, 4))
BIG = dataclasses.replace(SETUPS["8b-dummy"], budgets=(16, 1024), batch_sizes=(1, 64))
PROMPTS = {"tiny": [{"text": f"def f{i}(x):\n"} for i in range(64)], "8b-dummy": id_prompts(64, 8, 151936)}


def make_plan(*setups):
    return P.expand(list(setups or (TINY, BIG)), mem_budget_gib=119.0)


def sweep(tmp_path, plan, launcher, clock, log=None, **opts):
    options = SweepOptions(results_path=tmp_path / "results.jsonl", mem_budget_gib=119.0,
                           first_start_estimate_s=5.0, **{"max_minutes": 60.0, **opts})
    return Sweep(plan, launcher, PROMPTS, options, run_info={"gpu": "fake"}, clock=clock, sleep=clock.sleep,
                 log=log or (lambda msg: None))


def results(tmp_path):
    return latest_results(read_rows(tmp_path / "results.jsonl"))


def test_a_full_run_measures_every_row_once_in_waves(tmp_path):
    plan = make_plan()
    clock = Clock()
    launcher = FakeLauncher(clock)
    report = sweep(tmp_path, plan, launcher, clock, max_parallel=4).run()
    assert report.exit_code == 0 and not report.pending and not report.failed
    assert sorted(report.done) == sorted(r.key for r in plan.rows)
    got = results(tmp_path)
    assert {k for k, r in got.items() if r["status"] == "ok"} == {r.key for r in plan.rows}
    skipped = {k: r for k, r in got.items() if r["status"] == "skipped"}
    assert list(skipped) == [P.row_key("8b-dummy", "ddtree", 1024, 64)] and "logits" in skipped[
        P.row_key("8b-dummy", "ddtree", 1024, 64)]["reason"]
    # every server started once and was stopped
    assert sorted(launcher.created) == sorted(s.name for s in plan.servers)
    assert all(s.stopped for s in launcher.created.values())
    rows = read_rows(tmp_path / "results.jsonl")
    assert [r["kind"] for r in rows].count("run") == 1
    assert sum(1 for r in rows if r["kind"] == "server" and r["ok"]) == len(plan.servers)
    # waves: a wave's servers all start before any of them is measured; measurements never interleave
    waves = P.plan_waves(plan.servers, mem_budget_gib=119.0, max_parallel=4)
    assert len(waves) > 1
    ev = launcher.events
    for wave in waves:
        names = {s.name for s in wave}
        last_start = max(i for i, e in enumerate(ev) if e == ("start", e[1]) and e[1] in names)
        first_gen = min(i for i, e in enumerate(ev) if e[0] == "generate" and e[1] in names)
        assert last_start < first_gen
    blocks = [e[1] for i, e in enumerate(ev) if e[0] == "generate" and (i == 0 or ev[i - 1] != e)]
    assert len(blocks) == len(set(blocks)) == len(plan.servers)
    assert not any("cpus" in r for r in rows if r["kind"] == "server")  # no pinning asked for, none recorded


def test_server_rows_record_the_cpus_their_servers_were_pinned_to(tmp_path):
    clock = Clock()
    launcher = FakeLauncher(clock)
    create = launcher.create

    def pinned(plan):
        server = create(plan)
        server.cpus, server.pinned_threads = frozenset({5, 4}), 7
        return server

    launcher.create = pinned
    assert sweep(tmp_path, make_plan(TINY), launcher, clock).run().exit_code == 0
    servers = [r for r in read_rows(tmp_path / "results.jsonl") if r["kind"] == "server"]
    assert servers and all(r["cpus"] == [4, 5] and r["pinned_threads"] == 7 for r in servers)


def test_rows_carry_the_numbers_and_the_stage_split(tmp_path):
    plan = make_plan(TINY)
    clock = Clock()
    sweep(tmp_path, plan, FakeLauncher(clock), clock).run()
    got = results(tmp_path)
    dd = got[P.row_key("tiny", "ddtree", 64, 4)]
    assert dd["tau"] == pytest.approx(FAKE_TAU) and dd["acceptance_meaningful"] is True
    assert dd["stage_ms"] == pytest.approx(STAGE_MS)
    # the metrics diff covers the measured batch only, not its warmup
    per_request = math.ceil((TINY.max_new_tokens - 1) / FAKE_TAU)
    assert dd["ddtree_metrics"]["request_rounds"] == 4 * per_request
    assert dd["step_ms"] == pytest.approx(2.0) and dd["verify_tokens"] == 4 * 65
    assert dd["decode_tokens_per_s"] == pytest.approx(4 * (TINY.max_new_tokens - 1) / (per_request * 0.002))
    assert dd["server_args"] == next(s.args for s in plan.servers if s.name == "tiny-ddtree-b64")
    plain = got[P.row_key("tiny", "plain", None, 1)]
    assert plain["step_ms"] == pytest.approx(2.0) and "tau" not in plain and plain["stage_ms"] is None
    server_rows = [r for r in read_rows(tmp_path / "results.jsonl") if r["kind"] == "server"]
    assert server_rows[0]["server_info"]["internal_state"] == {"last_gen_throughput": 1.0}


def test_a_second_run_resumes_and_does_nothing_more(tmp_path):
    plan = make_plan()
    clock = Clock()
    sweep(tmp_path, plan, FakeLauncher(clock), clock).run()
    before = [r for r in read_rows(tmp_path / "results.jsonl") if r["kind"] == "result"]
    again = FakeLauncher(clock)
    report = sweep(tmp_path, make_plan(), again, clock).run()
    assert not again.created and sorted(report.already_done) == sorted(r.key for r in plan.rows)
    after = [r for r in read_rows(tmp_path / "results.jsonl") if r["kind"] == "result"]
    assert after == before  # the skipped row is not written twice either


def test_a_changed_workload_is_measured_again(tmp_path):
    clock = Clock()
    sweep(tmp_path, make_plan(), FakeLauncher(clock), clock).run()
    changed = dataclasses.replace(TINY, max_new_tokens=64)
    again = FakeLauncher(clock)
    sweep(tmp_path, make_plan(changed, BIG), again, clock).run()
    assert sorted(again.created) == sorted(s.name for s in make_plan(changed).servers)
    assert all(r["max_new_tokens"] == 64 for r in results(tmp_path).values()
               if r["setup"] == "tiny" and r["status"] == "ok")


def test_a_row_records_its_warm_up(tmp_path):
    """Each result row says its warm-up (new tokens per request), `auto` rows at least AUTO_WARMUP_NEW_TOKENS: A/B
    servers (`tiny-w`) ran a longer warm-up that their rows could not show."""
    clock = Clock()
    longer = dataclasses.replace(TINY, warmup_new_tokens=640)
    sweep(tmp_path, make_plan(longer), FakeLauncher(clock), clock).run()
    rows = [r for r in results(tmp_path).values() if r["status"] == "ok"]
    assert rows and all(r["warmup_new_tokens"] == 640 for r in rows)
    short = dataclasses.replace(TINY, warmup_new_tokens=0)
    assert short.warmup_tokens("auto") == P.AUTO_WARMUP_NEW_TOKENS > short.warmup_tokens("ddtree") == 0


def test_a_server_that_does_not_start_fails_its_rows_only(tmp_path):
    plan = make_plan(TINY)
    clock = Clock()
    launcher = FakeLauncher(clock, fail={"tiny-ddtree-b16"})
    report = sweep(tmp_path, plan, launcher, clock).run()
    assert report.exit_code == 1
    got = results(tmp_path)
    bad = {k for k, r in got.items() if r["status"] == "failed"}
    assert bad == {P.row_key("tiny", "ddtree", 16, b) for b in (1, 4)}
    assert "did not start" in got[P.row_key("tiny", "ddtree", 16, 1)]["reason"]
    assert sum(r["status"] == "ok" for r in got.values()) == len(plan.rows) - 2
    # failures are final unless asked again
    again = FakeLauncher(clock)
    sweep(tmp_path, make_plan(TINY), again, clock).run()
    assert not again.created
    retry = FakeLauncher(clock)
    report = sweep(tmp_path, make_plan(TINY), retry, clock, retry_failed=True).run()
    assert list(retry.created) == ["tiny-ddtree-b16"] and report.exit_code == 0
    assert all(r["status"] == "ok" for r in results(tmp_path).values())


def test_the_deadline_leaves_rows_pending_and_a_resume_finishes_them(tmp_path):
    plan = make_plan(TINY)
    clock = Clock()
    launcher = FakeLauncher(clock, row_seconds=20.0)
    report = sweep(tmp_path, plan, launcher, clock, max_minutes=2.0).run()
    assert 0 < len(report.done) < len(plan.rows)
    assert report.exit_code == 0 and not report.failed
    assert sorted(report.pending) == sorted(set(r.key for r in plan.rows) - set(report.done))
    assert clock() <= 120.0 + 1e-9
    assert all(s.stopped for s in launcher.created.values())
    assert {r["status"] for r in results(tmp_path).values()} == {"ok"}  # nothing recorded as failed
    # the next call on the same file measures exactly what is left, starting only the servers that have some
    later = FakeLauncher(clock, row_seconds=20.0)
    report2 = sweep(tmp_path, make_plan(TINY), later, clock, max_minutes=60.0).run()
    assert sorted(report2.done) == sorted(report.pending)
    left_servers = {s.name for s in plan.servers if any(r.key in report.pending for r in s.rows)}
    assert set(later.created) == left_servers
    assert {k for k, r in results(tmp_path).items() if r["status"] == "ok"} == {r.key for r in plan.rows}


def test_no_wave_starts_without_time_for_it(tmp_path):
    clock = Clock()
    launcher = FakeLauncher(clock)
    opts = SweepOptions(results_path=tmp_path / "r.jsonl", max_minutes=0.2, mem_budget_gib=119.0,
                        first_start_estimate_s=150.0)
    report = Sweep(make_plan(TINY), launcher, PROMPTS, opts, clock=clock, sleep=clock.sleep, log=lambda m: None).run()
    assert not launcher.created and report.pending and report.exit_code == 0


def test_a_server_dying_fails_the_rest_of_its_rows(tmp_path):
    three = dataclasses.replace(TINY, methods=("plain", "dflash"), batch_sizes=(1, 4, 16))
    plan = make_plan(three)
    clock = Clock()
    # tiny-plain: batch 1 = 1 warmup + 1 measured request; it dies during batch 4's warmup
    launcher = FakeLauncher(clock, die_after={"tiny-plain": 3})
    report = sweep(tmp_path, plan, launcher, clock).run()
    got = results(tmp_path)
    assert got[P.row_key("tiny", "plain", None, 1)]["status"] == "ok"
    assert got[P.row_key("tiny", "plain", None, 4)]["status"] == "failed"
    assert "warmup" in got[P.row_key("tiny", "plain", None, 4)]["reason"]
    # the row after it is not attempted on a dead server
    assert got[P.row_key("tiny", "plain", None, 16)]["status"] == "failed"
    assert got[P.row_key("tiny", "plain", None, 16)]["reason"].startswith("server died")
    assert launcher.created["tiny-plain"].generates == 2 + 4  # batch 1 (warmup + run), then batch 4's warmup only
    assert report.exit_code == 1 and len(report.failed) == 2
    assert all(got[P.row_key("tiny", "dflash", None, b)]["status"] == "ok" for b in (1, 4, 16))


def test_an_interrupt_stops_every_server(tmp_path):
    clock = Clock()
    launcher = FakeLauncher(clock, interrupt_on={"tiny-ddtree-b16"})
    report = sweep(tmp_path, make_plan(TINY), launcher, clock).run()
    assert report.interrupted and report.exit_code == 130
    assert launcher.created and all(s.stopped for s in launcher.created.values())
    assert P.row_key("tiny", "ddtree", 16, 1) in report.pending


def test_prompt_groups_time_consecutive_batches_of_different_prompts(tmp_path):
    """--prompt-groups 3: each measured run sends three batches of batch-size new prompts, one after the other;
    tokens/s is the mean batch's (the fake's rate does not depend on the prompt, so it equals the 1-group row)."""
    setup = dataclasses.replace(TINY, budgets=(64,), batch_sizes=(4,), methods=("ddtree",))
    one, three = tmp_path / "one", tmp_path / "three"
    one.mkdir(), three.mkdir()
    clock = Clock()
    assert sweep(one, make_plan(setup), FakeLauncher(clock), clock).run().exit_code == 0
    launcher = FakeLauncher(clock)
    assert sweep(three, make_plan(setup), launcher, clock, prompt_groups=3).run().exit_code == 0
    key = P.row_key("tiny", "ddtree", 64, 4)
    row1, row3 = results(one)[key], results(three)[key]
    assert row3["requests"] == 12 and row3["prompt_groups"] == 3 and row1["requests"] == 4
    assert row3["decode_tokens_per_s"] == pytest.approx(row1["decode_tokens_per_s"])
    measured = launcher.created["tiny-ddtree-b64"].prompts_seen[4:]  # after the warm-up batch (the first 4)
    assert sorted(measured) == sorted(p["text"] for p in PROMPTS["tiny"][:12])
    from ddtree_bench.sweep import prompt_group
    assert prompt_group([1, 2, 3], 2, 1) == [3, 1]  # wraps around when the prompts run out
    with pytest.raises(ValueError, match="prompt_groups"):
        sweep(tmp_path, make_plan(setup), FakeLauncher(clock), clock, prompt_groups=0)


def test_rotate_prompts_gives_each_run_the_next_groups_and_the_same_ones_across_servers(tmp_path):
    """SweepOptions.rotate_prompts: run r measures prompt groups r .. r + G - 1; with interleave the servers' r-th
    runs send the same prompts (what benchmarks/paired_ratios.py pairs)."""
    setup = dataclasses.replace(TINY, budgets=(64,), batch_sizes=(1,), methods=("dflash", "ddtree"))
    clock = Clock()
    launcher = FakeLauncher(clock)
    report = sweep(tmp_path, make_plan(setup), launcher, clock, repeats=4, prompt_groups=2, interleave=True,
                   rotate_prompts=True).run()
    assert report.exit_code == 0
    texts = [p["text"] for p in PROMPTS["tiny"]]
    warm = 1 if setup.warmup_new_tokens > 0 else 0
    for name in ("tiny-dflash", "tiny-ddtree-b64"):
        seen = launcher.created[name].prompts_seen[warm:]
        assert seen == [texts[r + g] for r in range(4) for g in range(2)]  # runs 0..3, each two groups of one
    row = results(tmp_path)[P.row_key("tiny", "ddtree", 64, 1)]
    assert row["rotate_prompts"] is True and row["requests"] == 2 and len(row["decode_tokens_per_s_runs"]) == 4
    header = next(r for r in read_rows(tmp_path / "results.jsonl") if r["kind"] == "run")
    assert header["options"]["rotate_prompts"] is True


def test_too_few_prompts_are_refused(tmp_path):
    opts = SweepOptions(results_path=tmp_path / "r.jsonl", max_minutes=1, mem_budget_gib=100)
    with pytest.raises(ValueError, match="prompts"):
        Sweep(make_plan(TINY), FakeLauncher(Clock()), {"tiny": PROMPTS["tiny"][:3]}, opts)
    with pytest.raises(ValueError, match="max_minutes"):
        SweepOptions(results_path=tmp_path / "r.jsonl", max_minutes=0, mem_budget_gib=100)


def test_results_file_survives_a_torn_line(tmp_path):
    path = tmp_path / "r.jsonl"
    w = ResultsWriter(path)
    w.write({"kind": "result", "key": "a", "status": "failed"})
    w.close()
    with open(path, "a") as fh:
        fh.write('{"kind": "result", "key": "a", "sta')  # killed mid-line
    w = ResultsWriter(path)
    w.write({"kind": "result", "key": "a", "status": "ok"})
    w.close()
    rows = read_rows(path)
    assert [r["status"] for r in rows] == ["failed", "ok"] and latest_results(rows)["a"]["status"] == "ok"
    with pytest.raises(ValueError, match=":2:"):
        read_rows(path, strict=True)
    with pytest.raises(ValueError, match="status"):
        ResultsWriter(tmp_path / "x.jsonl").write({"kind": "result", "key": "a", "status": "great"})
    path.write_text(json.dumps([1, 2]) + "\n")
    with pytest.raises(ValueError, match="kind"):
        read_rows(path)


def test_id_prompts_are_seeded_distinct_and_in_range():
    a, b = id_prompts(8, 16, 151936, seed=0), id_prompts(8, 16, 151936, seed=0)
    assert a == b and len({tuple(p["input_ids"]) for p in a}) == 8
    assert all(len(p["input_ids"]) == 16 and all(0 < t < 151936 for t in p["input_ids"]) for p in a)
    assert id_prompts(2, 4, 151936, seed=1) != id_prompts(2, 4, 151936, seed=0)


def test_launch_command_gives_each_server_its_own_nccl_port():
    from ddtree_bench.server import launch_command

    a = launch_command("py", ["--model-path", "m"], 1234)
    b = launch_command("py", ["--model-path", "m"], 1235)
    assert a[:3] == ["py", "-m", "sglang.launch_server"] and a[-4:] == ["--host", "127.0.0.1", "--port", "1234"]
    port_a, port_b = a[a.index("--nccl-port") + 1], b[b.index("--nccl-port") + 1]
    assert port_a != port_b
    explicit = launch_command("py", ["--nccl-port", "999"], 1)
    assert explicit.count("--nccl-port") == 1 and explicit[explicit.index("--nccl-port") + 1] == "999"


def test_repeats_report_the_median_run_and_every_run(tmp_path):
    """--repeats 3: the row's numbers are the median run's, each run's tokens/s and step time are kept, the stage
    split covers all three runs, and the deadline planning counts three runs per row."""

    class VaryingServer(FakeServer):
        @property
        def step_s(self):
            # request 1 is the warm-up; then 3 ms, 1 ms, 2 ms (median 2 ms)
            return {1: 0.002, 2: 0.003, 3: 0.001, 4: 0.002}.get(self.generates, 0.002)

        @step_s.setter
        def step_s(self, value):
            pass

    class VaryingLauncher(FakeLauncher):
        def create(self, plan):
            server = VaryingServer(plan, self)
            self.created[plan.name] = server
            return server

    setup = dataclasses.replace(TINY, budgets=(64,), batch_sizes=(1,), methods=("ddtree",))
    plan = make_plan(setup)
    clock = Clock()
    report = sweep(tmp_path, plan, VaryingLauncher(clock), clock, repeats=3).run()
    assert report.exit_code == 0
    row = results(tmp_path)[P.row_key("tiny", "ddtree", 64, 1)]
    assert row["repeats"] == 3
    assert row["step_ms_runs"] == pytest.approx([3.0, 1.0, 2.0])
    assert row["step_ms"] == pytest.approx(2.0)  # the median run's
    assert sorted(row["decode_tokens_per_s_runs"])[1] == pytest.approx(row["decode_tokens_per_s"])
    # every run's window rate and outlier count are kept (a fake server's requests decode alike: none)
    assert len(row["decode_tokens_per_s_window_runs"]) == 3 and all(row["decode_tokens_per_s_window_runs"])
    assert row["decode_rate_outliers_runs"] == [0, 0, 0]
    # acceptance over every run next to the median run's (with rotating prompts the median runs of two servers can
    # be different prompts)
    assert len(row["tau_runs"]) == 3 and row["tau"] in row["tau_runs"]
    assert row["tau_pooled"] == pytest.approx(FAKE_TAU, rel=0.05)
    per_request = math.ceil((setup.max_new_tokens - 1) / FAKE_TAU)
    assert row["ddtree_metrics"]["request_rounds"] == 3 * per_request
    with pytest.raises(ValueError, match="repeats"):
        sweep(tmp_path, plan, FakeLauncher(clock), clock, repeats=0)


def test_last_auto_table_reads_the_newest_chooser_line(tmp_path):
    from ddtree_bench.sweep import last_auto_table

    log = tmp_path / "server.log"
    table = {"candidates": ["chain", "16"], "rounds_chosen": {"chain": 90, "16": 10},
             "expected_tokens": {"chain": 2.5, "16": None}, "observed_over_expected": {"chain": 0.7, "16": 0.6},
             "round_ms": {"4": {"chain": 4.6, "16": None}}}
    log.write_text("[2026-11-30 03:44:09] DDTREE auto after 100 rounds: {'candidates': ['chain']}\n"
                   "noise\n"
                   f"[2026-11-30 03:44:19] DDTREE auto after 200 rounds: {table!r}\n"
                   "[2026-11-30 03:44:20] Decode batch, #running-req: 4\n")
    assert last_auto_table(log) == {"rounds": 200, **table}
    assert last_auto_table(tmp_path / "missing.log") is None
    (tmp_path / "plain.log").write_text("nothing here\n")
    assert last_auto_table(tmp_path / "plain.log") is None


def test_interleave_measures_a_batch_size_one_run_at_a_time_across_servers(tmp_path):
    """SweepOptions.interleave: within a wave, every server's row of one batch size warms up, then run 1 of each
    server in turn, then run 2, ...; each row still reports its median run and every run. A server that dies fails
    its rows from there on while the others finish theirs."""
    setup = dataclasses.replace(TINY, budgets=(16, 64), batch_sizes=(1, 4), methods=("dflash", "ddtree"))
    plan = make_plan(setup)
    clock = Clock()
    launcher = FakeLauncher(clock)
    report = sweep(tmp_path, plan, launcher, clock, repeats=3, interleave=True).run()
    assert report.exit_code == 0 and sorted(report.done) == sorted(r.key for r in plan.rows)
    names = [s.name for s in plan.servers]
    order = [name for kind, name in launcher.events if kind == "generate"]
    warm = setup.warmup_new_tokens > 0
    # batch 1: (warm-ups,) then runs 1, 2, 3 of every server in turn, one request each, each round starting one
    # server later than the round before
    first = order[: len(names) * (3 + warm)]
    runs = first[len(names) * warm:]
    assert [runs[i * len(names):(i + 1) * len(names)] for i in range(3)] == [names[i:] + names[:i] for i in range(3)]
    got = results(tmp_path)
    for row in plan.rows:
        r = got[row.key]
        assert r["status"] == "ok" and r["repeats"] == 3 and r["interleaved"] is True
        assert len(r["decode_tokens_per_s_runs"]) == 3
        # each run's start (from the sweep's start) and duration: rising starts, one round apart at least
        starts, took = r["started_s_runs"], r["run_s_runs"]
        assert all(b >= a + t for a, b, t in zip(starts, starts[1:], took)) and all(t > 0 for t in took)
        assert "started_s" not in r and "run_s" not in r

    # one server dies in batch 4's runs: its batch-4 row fails, the others' rows are measured
    clock2 = Clock()
    dying = FakeLauncher(clock2, die_after={"tiny-dflash": (1 + warm) * 3 + 4 * warm + 4})
    report2 = sweep(tmp_path / "b", make_plan(setup), dying, clock2, repeats=3, interleave=True).run()
    got2 = latest_results(read_rows(tmp_path / "b" / "results.jsonl"))
    assert got2[P.row_key("tiny", "dflash", None, 1)]["status"] == "ok"
    assert got2[P.row_key("tiny", "dflash", None, 4)]["status"] == "failed"
    assert all(got2[P.row_key("tiny", "ddtree", b, bs)]["status"] == "ok" for b in (16, 64) for bs in (1, 4))
    assert report2.exit_code == 1 and all(s.stopped for s in dying.created.values())


@pytest.mark.parametrize("interleave", [True, False])
def test_measured_times_replace_a_pessimistic_plan_estimate(tmp_path, interleave):
    """The plan's step-time floors are crude (a tiny sweep whose estimate was ~8x its real time measured
    nothing). Once rows have been measured, the deadline checks scale the measured time by the plan's ratios, so
    a call that fits the real rows measures all of them; with the plan's estimates alone it would stop after the
    first batch size (the call below leaves 1 s more than the first batch size's estimate)."""
    setup = dataclasses.replace(TINY, budgets=(16,), batch_sizes=(1, 4, 16), methods=("dflash", "ddtree"),
                                est_step_floor_ms=(("plain", 3.0), ("dflash", 300.0), ("ddtree", 300.0)))
    repeats = 2
    first = sum(s.est_row_seconds(r) for s in make_plan(setup).servers for r in s.rows if r.batch_size == 1)
    first = first * repeats if interleave else max(  # serial: the first row's own estimate
        s.est_row_seconds(r) for s in make_plan(setup).servers for r in s.rows if r.batch_size == 1) * repeats
    probe = sweep(tmp_path / "probe", make_plan(setup), FakeLauncher(Clock()), Clock(), repeats=repeats,
                  interleave=interleave)
    probe.run()
    start_s = max(r["start_s"] for r in read_rows(tmp_path / "probe" / "results.jsonl") if r["kind"] == "server")
    start_s = max(start_s, 5.0)  # sweep()'s first_start_estimate_s: the wave's own check
    plan = make_plan(setup)
    clock = Clock()
    report = sweep(tmp_path, plan, FakeLauncher(clock), clock, repeats=repeats, interleave=interleave,
                   max_minutes=(start_s + first + SweepOptions.stop_reserve_s + 1.0) / 60).run()
    assert report.exit_code == 0 and not report.pending
    assert sorted(report.done) == sorted(r.key for r in plan.rows)


def test_auto_rows_warm_up_long_enough_to_explore(tmp_path):
    """An `auto` row warms up with at least AUTO_WARMUP_NEW_TOKENS per request (its exploration and first-use
    captures before the measured runs); other rows with the setup's own warm-up."""
    setup = dataclasses.replace(BIG, methods=("dflash", "auto"), batch_sizes=(1,), warmup_new_tokens=4)
    clock = Clock()
    launcher = FakeLauncher(clock)
    assert sweep(tmp_path, make_plan(setup), launcher, clock).run().exit_code == 0
    seen = {name: server.max_new_tokens_seen for name, server in launcher.created.items()}
    assert seen["8b-dummy-dflash"][0] == 4 and seen["8b-dummy-auto"][0] == P.AUTO_WARMUP_NEW_TOKENS > 4
    assert set(seen["8b-dummy-auto"][1:]) == set(seen["8b-dummy-dflash"][1:]) == {setup.max_new_tokens}


def test_interleave_keeps_to_the_deadline(tmp_path):
    """Interleaved rows of one batch size start only with time for all their runs; what does not fit is left
    pending, every server stopped."""
    clock = Clock()
    launcher = FakeLauncher(clock, row_seconds=20.0)
    report = sweep(tmp_path, make_plan(TINY), launcher, clock, max_minutes=2.0, interleave=True).run()
    assert report.exit_code == 0 and not report.failed and report.pending
    assert clock() <= 120.0 + 1e-9
    assert all(s.stopped for s in launcher.created.values())


def test_warm_up_repeats_while_it_captures_graphs_and_runs_count_their_captures(tmp_path):
    """A DDTREE server logs a line for each first-use stage graph. The warm-up is repeated while its batch still
    captured graphs (at most WARMUP_MAX_BATCHES batches), and each measured run records the captures logged during
    it, so a row that paid one-time work inside its runs says so (a tiny sweep: 22 captures in auto's runs)."""
    from ddtree_bench.sweep import WARMUP_MAX_BATCHES

    captures = {"tiny-ddtree-b16": 3, "tiny-ddtree-b64": WARMUP_MAX_BATCHES + 3}

    class CapturingServer(FakeServer):
        def __init__(self, plan, launcher):
            super().__init__(plan, launcher)
            self.log_path = tmp_path / f"{plan.name}.log"
            self.log_path.write_text("server started\n")
            self.left = captures[plan.name]

    class CapturingClient(FakeClient):
        def generate_stream(self, payload, timeout_s):
            srv = self.server
            if srv.left > 0:  # this request meets a batch shape not captured yet
                srv.left -= 1
                with open(srv.log_path, "a") as fh:
                    fh.write("[t] DDTREE: captured the tree stage for inputs [(1, 15, 64)]\n")
            return super().generate_stream(payload, timeout_s)

    class CapturingLauncher(FakeLauncher):
        def create(self, plan):
            server = CapturingServer(plan, self)
            server.client = lambda: CapturingClient(server)
            self.created[plan.name] = server
            return server

    setup = dataclasses.replace(TINY, budgets=(16, 64), batch_sizes=(1,), methods=("ddtree",),
                                warmup_new_tokens=4)
    clock = Clock()
    launcher = CapturingLauncher(clock)
    logs = []
    report = sweep(tmp_path, make_plan(setup), launcher, clock, repeats=3, log=logs.append).run()
    assert report.exit_code == 0
    rows = results(tmp_path)
    warmups = {name: s.max_new_tokens_seen.count(4) for name, s in launcher.created.items()}
    # 3 captures: three warm-up batches captured, the fourth did not; the runs capture nothing
    assert warmups["tiny-ddtree-b16"] == 4
    assert rows[P.row_key("tiny", "ddtree", 16, 1)]["captures_runs"] == [0, 0, 0]
    # more captures than warm-ups may take: the rest lands in the measured runs, and the row's log line says so
    assert warmups["tiny-ddtree-b64"] == WARMUP_MAX_BATCHES
    assert rows[P.row_key("tiny", "ddtree", 64, 1)]["captures_runs"] == [1, 1, 1]
    assert any("3 graph captures in the measured runs" in line for line in logs)


def test_row_log_names_runs_with_rate_outliers():
    """A row whose runs had requests decoding over RATE_OUTLIER x the median says so in the sweep's log."""
    from types import SimpleNamespace

    from ddtree_bench.sweep import Sweep

    lines = []
    host = SimpleNamespace(log=lines.append)
    row = {"status": "ok", "key": "8b|auto|-|64", "decode_tokens_per_s": 4003.0, "step_ms": 35.0, "row_s": 30.0,
           "decode_rate_outliers_runs": [0, 0, 3, 0]}
    Sweep._log_row(host, row)
    assert "1 run(s) with requests decoding over 3x the median rate" in lines[-1]
    Sweep._log_row(host, {**row, "decode_rate_outliers_runs": [0, 0, 0, 0]})
    assert "median rate" not in lines[-1] and "4003 tok/s" in lines[-1]


def test_median_run_pools_acceptance_over_every_run():
    """The row's `tau` is its median-rate run's; `tau_pooled` counts every run's rounds (two chain servers'
    median runs at batch 4 were different prompts, tau 4.57 against 6.07, while their runs agreed run by run)."""
    from ddtree_bench.results import row_tau
    from ddtree_bench.sweep import median_run

    runs = [{"decode_tokens_per_s": 10.0, "step_ms": 1.0, "tau": 1.0, "accept_histogram": [4]},
            {"decode_tokens_per_s": 30.0, "step_ms": 1.0, "tau": 3.0, "accept_histogram": [0, 0, 4]},
            {"decode_tokens_per_s": 20.0, "step_ms": 1.0, "tau": 2.0, "accept_histogram": [0, 8]}]
    row = median_run(runs)
    assert row["tau"] == 2.0 and row["tau_runs"] == [1.0, 3.0, 2.0]
    assert row["tau_pooled"] == pytest.approx((4 * 1 + 4 * 3 + 8 * 2) / 16)
    assert row_tau(row) == row["tau_pooled"] and row_tau({"tau": 2.5}) == 2.5


def test_an_ab_server_records_its_arms_run_by_run_and_paired_reads_them(tmp_path):
    """An `auto` server with SGLANG_DDTREE_AUTO_AB in its setup's server_env: the sweep scrapes its A/B tallies
    around every run (ab_runs: each arm's tokens/s and the ratio), keeps the row's own (ddtree_metrics.ab) and its
    block; ddtree_bench.paired.ab_table turns them into the arms' ratio over the row and run by run with an interval.
    Here the fake's auto arm commits 3 tokens a round in 4 ms and the fixed arm 2 in 4 ms, the same rounds each."""
    from ddtree_bench.paired import ab_table

    class ABClient(FakeClient):
        def metrics_text(self):
            n = self.server.request_rounds  # this fake's rounds split evenly between the arms
            lines = []
            for arm, tokens in (("auto", 3), ("fixed", 2)):
                for field, value in (("rounds", n / 2), ("request_rounds", n / 2), ("tokens", tokens * n / 2),
                                     ("seconds", 4e-3 * n / 2), ("skipped_rounds", 1), ("host_rounds", n / 2),
                                     ("host_seconds", 1e-3 * n / 2)):
                    lines.append(f'sglang:ddtree_ab_{field}_total{{budget="auto",arm="{arm}"}} {value}')
            return "\n".join(lines) + "\n"

    class ABServer(FakeServer):
        def client(self):
            return ABClient(self)

    class ABLauncher(FakeLauncher):
        def create(self, plan):
            server = ABServer(plan, self)
            self.created[plan.name] = server
            return server

    setup = dataclasses.replace(TINY, methods=("auto",), batch_sizes=(1, 4),
                                server_env=("SGLANG_DDTREE_AUTO_AB=8",))
    clock = Clock()
    assert sweep(tmp_path, make_plan(setup), ABLauncher(clock), clock, repeats=3, interleave=True).run().exit_code == 0
    rows = results(tmp_path)
    row = rows[P.row_key("tiny", "auto", None, 4)]
    assert row["ab_block"] == 8 and len(row["ab_runs"]) == 3
    assert all(run["ratio"] == pytest.approx(1.5) for run in row["ab_runs"])
    assert row["ab_runs"][0]["auto"]["tokens_per_s"] == pytest.approx(3 / 4e-3)
    assert row["ddtree_metrics"]["ab"]["ratio"] == pytest.approx(1.5)
    assert row["ddtree_metrics"]["ab"]["fixed"]["tau"] == pytest.approx(2.0)
    assert row["ddtree_metrics"]["ab"]["auto"]["host_ms"] == pytest.approx(1.0)
    table = ab_table(list(rows.values()))
    entry = table["tiny|auto"]["by_batch_size"][4]
    assert entry["block"] == 8 and entry["ratio"] == pytest.approx(1.5) and entry["runs_with_both_arms"] == 3
    assert entry["runs"]["ratio"] == pytest.approx(1.5) and entry["runs"]["ci95"] == pytest.approx([1.5, 1.5])
    assert table["tiny|auto"]["all_batch_sizes"]["rounds"] == 6

    # the same setup without the knob records no A/B
    plain = dataclasses.replace(setup, server_env=())
    clock2 = Clock()
    assert sweep(tmp_path / "b", make_plan(plain), ABLauncher(clock2), clock2, repeats=2).run().exit_code == 0
    row2 = latest_results(read_rows(tmp_path / "b" / "results.jsonl"))[P.row_key("tiny", "auto", None, 4)]
    assert "ab_runs" not in row2 and "ab" not in (row2.get("ddtree_metrics") or {})
    assert ab_table([row2]) == {}


def test_ab_pooled_pools_the_runs_of_one_configurations_servers():
    """paired.ab_pooled: the run-by-run ratio over every run of the named A/B servers' rows (two recorded
    `auto` servers as they are): per batch size the paired ratio of the concatenated runs, which lies between the
    two servers' own; a label not named adds nothing."""
    from ddtree_bench.paired import _ab_pairs, ab_pooled, ab_table, paired_ratio
    from ddtree_bench.results import latest_results, read_rows

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "sweep_ab_tiny_run2_2026-12-02_3ed1a84.jsonl"
    rows = list(latest_results(read_rows(path)).values())
    pooled = ab_pooled(rows, {"tiny-a|auto", "tiny-a2|auto"})
    alone = ab_table(rows)
    for bs in (1, 4, 16, 64):
        a, f = [], []
        for r in rows:
            if r.get("kind") == "result" and r.get("batch_size") == bs and r.get("setup") in ("tiny-a", "tiny-a2"):
                x, y = _ab_pairs(r)
                a += x
                f += y
        assert len(a) == 20
        assert pooled["by_batch_size"][bs] == paired_ratio(a, f)
        ours = sorted(alone[label]["by_batch_size"][bs]["runs"]["ratio"] for label in ("tiny-a|auto", "tiny-a2|auto"))
        assert ours[0] - 1e-9 <= pooled["by_batch_size"][bs]["ratio"] <= ours[1] + 1e-9
    assert pooled["all_batch_sizes"]["rounds"] == 80
    assert ab_pooled(rows, {"tiny-a|auto"})["all_batch_sizes"] == alone["tiny-a|auto"]["all_batch_sizes"]
    assert ab_pooled(rows, {"nothing|auto"}) == {"by_batch_size": {}, "all_batch_sizes": None}


def test_ab_table_shows_autos_narrower_rounds():
    """ddtree_bench.paired.ab_table carries the A/B split tallies of servers that record them (ab_arms' narrower_rounds,
    sampled_rounds): a recorded tiny-e4 server ran a candidate other than the 128-tree in 448 of its 465 batch-4 rounds (the
    chain lock-in its tau and ratio show), while its fixed arm has no such series; rows before the split have none."""
    from ddtree_bench.paired import ab_table
    from ddtree_bench.results import latest_results, read_rows

    results_dir = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    rows = list(latest_results(read_rows(results_dir / "sweep_ab_tiny_run2_2026-12-02_c8f6ae0.jsonl")).values())
    arms = ab_table(rows)["tiny-e4|auto"]["by_batch_size"][4]["arms"]
    assert (arms["auto"]["narrower_rounds"], arms["auto"]["rounds"]) == (448, 465)
    assert arms["auto"]["sampled_rounds"] > 0 and arms["auto"]["narrower_round_ms"] > 0
    assert "narrower_rounds" not in arms["fixed"]
    old = list(latest_results(read_rows(results_dir / "sweep_ab_tiny_run2_2026-12-02_3ed1a84.jsonl")).values())
    assert all("narrower_rounds" not in n for t in ab_table(old).values() for e in t["by_batch_size"].values()
               for n in e["arms"].values())


def test_ab_own_host_split_is_autos_arm_less_the_fixed_arm_per_stage():
    """paired.ab_own_host_split: per batch size, the mean over the named servers' rows of `auto`'s arm's host
    ms (in all and per host stage; a stage one arm lacks counts 0 there) less the fixed arm's, and the same for the
    GPU round; rows of servers not named, or without both arms' times, add nothing. Checked by hand on two rows,
    then on a committed A/B file: its stage differences sum to its host difference, and `choose` is `auto`'s alone."""
    from ddtree_bench.paired import ab_own_host_split
    from ddtree_bench.results import latest_results, read_rows

    def row(setup, bs, auto_stages, fixed_stages, auto_round, fixed_round):
        arm = lambda stages, round_ms: {"host_ms": sum(stages.values()), "host_stage_ms": stages,  # noqa: E731
                                        "round_ms": round_ms, "rounds": 10}
        return {"kind": "result", "status": "ok", "setup": setup, "method": "auto", "budget": None,
                "batch_size": bs, "ab_runs": [{}], "ddtree_metrics": {"ab": {"auto": arm(auto_stages, auto_round),
                                                                            "fixed": arm(fixed_stages, fixed_round)}}}

    rows = [row("tiny-a", 4, {"choose": 0.05, "draft": 1.0, "after": 0.30}, {"draft": 0.98, "after": 0.28}, 5.2, 5.0),
            row("tiny-b", 4, {"choose": 0.03, "draft": 1.0, "after": 0.20}, {"draft": 1.0, "after": 0.24}, 5.1, 5.1),
            row("tiny-c", 4, {"choose": 9.0}, {}, 9.0, 1.0), row("tiny-d", 4, {"choose": 9.0}, {}, 9.0, 1.0)]
    del rows[3]["ddtree_metrics"]["ab"]["fixed"]["host_ms"]  # named below, but its fixed arm has no host time
    # tiny-a's auto arm: 2 of its 10 rounds sampled at 6.0 ms, so the other 8 took (52 - 12) / 8 = 5.0 ms and sampling
    # adds 0.2 x 1.0 ms a round; tiny-b tallied no sampled rounds and is left out of that mean
    rows[0]["ddtree_metrics"]["ab"]["auto"].update(sampled_rounds=2, sampled_round_ms=6.0)
    split = ab_own_host_split(rows, {"tiny-a|auto", "tiny-b|auto", "tiny-d|auto"})
    assert list(split) == [4] and abs(split[4]["sampled_extra"] - 0.2) < 1e-9
    d = split[4]
    assert d["rows"] == 2 and abs(d["fixed_round_ms"] - 5.05) < 1e-9 and abs(d["round"] - 0.1) < 1e-9
    assert d["stages"] == {"after": -0.01, "choose": 0.04, "draft": 0.01}
    assert abs(d["host"] - 0.04) < 1e-9
    assert ab_own_host_split(rows, {"nothing|auto"}) == {}

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "sweep_ab_tiny_run1_2026-12-02_80c380a.jsonl"
    rows = list(latest_results(read_rows(path)).values())
    split = ab_own_host_split(rows, {f"tiny-e{i}|auto" for i in (1, 2, 3, 4)})
    assert sorted(split) == [1, 4, 16, 64]
    for d in split.values():
        assert d["rows"] == 4
        assert abs(sum(d["stages"].values()) - d["host"]) < 0.002  # rounded to 1e-4 per stage
        assert d["stages"]["choose"] > 0 and d["host"] > 0 and 0 < d["sampled_extra"] < d["round"] + 0.05


def test_host_profile_diff_names_autos_own_functions(tmp_path):
    """benchmarks/host_profile_diff.py on committed profiles (an `auto` server and the fixed 128-tree,
    600 decode batches each): the batch count comes from the .txt beside each .pstats, `auto`'s chooser functions are
    only in its profile, a builtin named with its address in both (Event.record) is matched across the two
    processes, and per-batch times are the profile's totals over 600."""
    import importlib.util
    import pstats

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("host_profile_diff", root / "benchmarks" / "host_profile_diff.py")
    hpd = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hpd)
    d = root / "benchmarks" / "results" / "host_profile_2026-12-02_f70f218"
    a, b = d / "host_profile_ddtree_auto_13128.pstats", d / "host_profile_ddtree_128_13171.pstats"
    assert hpd.batches_of(a) == 600 and hpd.batches_of(b) == 600
    pa, pb = hpd.per_batch(a, 600), hpd.per_batch(b, 600)
    drain = [k for k in pa if k.endswith(":drain") and k.startswith("auto.py:")]
    assert len(drain) == 1 and drain[0] not in pb
    total = sum(v[2] for (f, _, n), v in pstats.Stats(str(a)).stats.items() if f.endswith("auto.py") and n == "drain")
    assert abs(pa[drain[0]][0] - 1e3 * total / 600) < 1e-9
    record = [k for k in pa if "Event.record" in k]
    assert len(record) == 1 and record[0] in pb and " at 0x" not in record[0]
    out = tmp_path / "diff.json"
    assert hpd.main([str(a), str(b), "--top", "5", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["batches"] == [600, 600] and len(result["largest_differences"]) == 5
    only_a = {r["function"] for r in result["only_in_a"]}
    assert drain[0] in only_a and not any("Event.record" in f for f in only_a)


def test_cpu_bench_result_helpers_name_the_commit_and_write_what_they_print(tmp_path, capsys):
    """results.head_commit / emit_result, shared by the one-file CPU benches (bench_auto_round_host.py,
    bench_auto_bookkeeping.py, bench_calibration_publish.py): the checkout's HEAD, and the printed JSON written as is."""
    import re
    import subprocess

    from ddtree_bench.results import emit_result, head_commit

    expected = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[1]).stdout.strip() or None
    assert head_commit() == expected and (expected is None or re.fullmatch(r"[0-9a-f]{40}", expected))
    result = {"what": "x", "runs_us": [1.5, 2.0], "commit": expected}
    out = tmp_path / "r.json"
    emit_result(result, out)
    printed = capsys.readouterr().out
    assert json.loads(printed) == result and out.read_text() == printed
    emit_result(result, None)  # print only
    assert json.loads(capsys.readouterr().out) == result
