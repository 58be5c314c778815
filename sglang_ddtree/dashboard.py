"""The Grafana dashboard of a DDTREE server (dashboards/sglang-ddtree.json, written by scripts/make_dashboard.py from
PANELS here), and the harness that checks its queries against a real Prometheus:

- `replay_rounds`: recorded rounds (a baseline file of the offline decoders: per round its accept length, the
  drafter ranks of the accepted nodes, tree size, expected tokens, stage times and, for `ddtree_auto`, the chosen
  candidate) grouped into batch rounds, and
- `ReplayServer`: those rounds fed into the server's own Prometheus series (sglang/prometheus.py,
  the same calls DDTreeStats makes per round) and exposed over HTTP with prometheus_client's exposition, as SGLang's
  /metrics does;
- `PrometheusServer`: a Prometheus process (Debian's `prometheus` binary) on 127.0.0.1 that scrapes them, with
  its HTTP query API.

tests/test_dashboard.py evaluates every panel's query through that Prometheus; scripts/render_dashboard.py plots
them for docs/dashboard.md. SGLang's own spec gauges (sglang:spec_accept_length, sglang:spec_accept_rate) come from
SGLang's scheduler, which does not run on a CPU: `ReplayServer` sets them as SGLang does (tokens / verify rounds and
accepted drafts / (rounds x (speculative_num_draft_tokens - 1)) over each logging interval) so that their panels can be
checked too.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from sglang_ddtree import metric_names as mn

REPO = Path(__file__).resolve().parents[1]
DASHBOARD_PATH = REPO / "dashboards" / "sglang-ddtree.json"

# ---------------------------------------------------------------------------------------------------------------
# the panels

_B = 'budget=~"$budget"'
_R = "$__rate_interval"


def _rate(sample: str, by: str = "budget") -> str:
    """The per-`by` rate of a sample (a metric_names name), narrowed to the budget variable."""
    return f"sum by ({by}) (rate({sample}{{{_B}}}[{_R}]))"


def _share(sample: str, by: str) -> str:
    """A sample's increase over the dashboard's time range per (budget, `by`), over the budget's request-rounds."""
    return (f"sum by (budget, {by}) (increase({sample}{{{_B}}}[$__range])) "
            f"/ on (budget) group_left sum by (budget) (increase({mn.ROUNDS.name}{{{_B}}}[$__range]))")


_TAU = f"{_rate(mn.ACCEPTED_TOKENS.name)} / {_rate(mn.ROUNDS.name)}"


# Each panel: title, Grafana type, unit, description, targets [(PromQL, legend)], grid width, options.
PANELS: list[dict] = [
    {"title": "tau: tokens per verify round", "type": "timeseries", "unit": "none",
     "description": "Committed tokens (accepted draft tokens + the bonus) per request-round, as verified. `expected` "
                    "is what the drafter's own scores predicted (1 + the sum of node probabilities): above tau, the "
                    "drafter is over-confident. SGLang's spec_accept_length is completion tokens / verify rounds over "
                    "its logging interval (one series per server).",
     "targets": [(_TAU, "tau budget={{budget}}"),
                 (f"{_rate(mn.EXPECTED_TOKENS.name)} / {_rate(mn.ROUNDS.name)}", "expected budget={{budget}}"),
                 (f"avg by (instance) ({mn.SGLANG_SPEC_ACCEPT_LENGTH})", "SGLang spec_accept_length {{instance}}")]},
    {"title": "Per-depth acceptance: P(a round accepts >= d draft tokens)", "type": "bargauge", "unit": "percentunit",
     "description": "depth_reached_total{depth=d} / rounds_total over the dashboard's time range. The curve's sum "
                    "over d is tau - 1.",
     "targets": [(_share(mn.DEPTH_REACHED.name, "depth"), "B={{budget}} d={{depth}}")],
     "instant": True, "max": 1},
    {"title": "Branch acceptance: accepted draft tokens off the drafter's top-1", "type": "timeseries",
     "unit": "percentunit",
     "description": "branch_accepted_total / accepted draft tokens (accepted tokens minus one bonus per round): the "
                    "share of accepted tokens that a chain (DFLASH) would not have proposed.",
     "targets": [(f"{_rate(mn.BRANCH_ACCEPTED.name)} / ({_rate(mn.ACCEPTED_TOKENS.name)} - "
                  f"{_rate(mn.ROUNDS.name)})", "budget={{budget}}")]},
    {"title": "Accept length: share of rounds committing n tokens", "type": "bargauge", "unit": "percentunit",
     "description": "accept_length_total{tokens=n} / rounds_total over the time range.",
     "targets": [(_share(mn.ACCEPT_LENGTH.name, "tokens"), "B={{budget}} n={{tokens}}")],
     "instant": True, "max": 1},
    {"title": "auto: chosen budget (share of batch rounds)", "type": "timeseries", "unit": "percentunit",
     "description": "--speculative-ddtree-budget auto: which candidate each batch round verified ('chain' = the "
                    "drafter's top-1 chain). Empty on fixed-budget servers.",
     "targets": [(f"sum by (candidate) (rate({mn.AUTO_ROUNDS.name}[{_R}])) / ignoring (candidate) group_left "
                  f"sum (rate({mn.AUTO_ROUNDS.name}[{_R}]))", "{{candidate}}")],
     "stack": True, "max": 1},
    {"title": "auto: chosen budget per batch size (share of the bucket's rounds)", "type": "bargauge",
     "unit": "percentunit",
     "description": "auto_rounds_total over the time range per batch-size bucket (the verify's CUDA-graph batch "
                    "size) and candidate, over the bucket's rounds: what `auto` runs at each load ('plain' = rounds "
                    "without a draft).",
     "targets": [(f"sum by (batch, candidate) (increase({mn.AUTO_ROUNDS.name}[$__range])) / ignoring (candidate) "
                  f"group_left sum by (batch) (increase({mn.AUTO_ROUNDS.name}[$__range]))",
                  "batch {{batch}}: {{candidate}}")],
     "instant": True, "max": 1},
    {"title": "Draft nodes verified per round", "type": "timeseries", "unit": "none",
     "description": "tree_nodes_total / rounds_total: the tree size actually verified (below the budget when the "
                    "drafter's vocabulary or pruning cuts the tree; `auto`'s mix of candidates).",
     "targets": [(f"{_rate(mn.TREE_NODES.name)} / {_rate(mn.ROUNDS.name)}", "budget={{budget}}")]},
    {"title": "Stage time per batch round (GPU, mean)", "type": "timeseries", "unit": "s",
     "description": "stage_seconds_sum / stage_seconds_count per stage (CUDA events): between (the GPU time from the "
                    "previous decode round), draft, tree, verify, walk, commit. Stacked: the GPU time per round.",
     "targets": [(f"{_rate(mn.STAGE_SECONDS.sum, 'stage')} / {_rate(mn.STAGE_SECONDS.count, 'stage')}",
                  "{{stage}}")],
     "stack": True},
    {"title": "Stage time per batch round, p90", "type": "timeseries", "unit": "s",
     "description": "The 90th percentile of each stage's time per round from the stage_seconds histogram buckets.",
     "targets": [(f"histogram_quantile(0.9, {_rate(mn.STAGE_SECONDS.bucket, 'le, stage')})", "{{stage}} p90")]},
    {"title": "Host time of the worker's round call", "type": "timeseries", "unit": "s",
     "description": "round_host_seconds (mean per batch round) against the host's time per stage "
                    "(stage_host_seconds_total / stage_host_rounds_total; choose = `auto`'s chooser). Above the GPU "
                    "time per round, the server is host-bound.",
     "targets": [(f"{_rate(mn.ROUND_HOST_SECONDS.sum)} / {_rate(mn.ROUND_HOST_SECONDS.count)}",
                  "round call budget={{budget}}"),
                 (f"{_rate(mn.STAGE_HOST_SECONDS.name, 'stage')} / ignoring (stage) group_left "
                  f"sum (rate({mn.STAGE_HOST_ROUNDS.name}{{{_B}}}[{_R}]))", "host {{stage}}")],
     "stack": False},
    {"title": "Committed tokens per second", "type": "timeseries", "unit": "short",
     "description": "rate(accepted_tokens_total): decode tokens committed by DDTREE rounds, per budget label.",
     "targets": [(_rate(mn.ACCEPTED_TOKENS.name), "budget={{budget}}")]},
]

BUDGET_VARIABLE_QUERY = f"label_values({mn.ROUNDS.name}, budget)"


def build_dashboard() -> dict:
    """The Grafana dashboard JSON (schema 39; a `datasource` variable picks the Prometheus data source)."""
    ds = {"type": "prometheus", "uid": "${datasource}"}
    panels = []
    for i, p in enumerate(PANELS):
        w = 12
        defaults: dict = {"unit": p["unit"]}
        if "max" in p:
            defaults.update({"min": 0, "max": p["max"]})
        if p["type"] == "timeseries":
            defaults["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 20 if p.get("stack") else 0,
                                  "showPoints": "never", "stacking": {"mode": "normal" if p.get("stack") else "none"}}
            options = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                       "tooltip": {"mode": "multi", "sort": "desc"}}
        else:
            options = {"orientation": "horizontal", "displayMode": "gradient", "showUnfilled": True,
                       "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}
        panels.append({
            "id": i + 1, "type": p["type"], "title": p["title"], "description": p["description"], "datasource": ds,
            "gridPos": {"h": 8, "w": w, "x": (i % 2) * 12, "y": (i // 2) * 8},
            "fieldConfig": {"defaults": defaults, "overrides": []}, "options": options,
            "targets": [{"datasource": ds, "expr": expr, "legendFormat": legend, "refId": chr(ord("A") + j),
                         "range": not p.get("instant", False), "instant": bool(p.get("instant", False))}
                        for j, (expr, legend) in enumerate(p["targets"])],
        })
    return {
        "title": "SGLang DDTree speculative decoding",
        "uid": "sglang-ddtree",
        "description": f"{mn.PREFIX}* series of a DDTREE server (--enable-metrics) and SGLang's spec gauges. "
                       "Metric reference: docs/metrics.md.",
        "tags": ["sglang", "ddtree", "speculative-decoding"],
        "editable": True, "graphTooltip": 1, "schemaVersion": 39, "version": 1,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "30s",
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0, "refresh": 1},
            {"name": "budget", "label": "budget", "type": "query", "datasource": ds,
             "definition": BUDGET_VARIABLE_QUERY, "query": {"query": BUDGET_VARIABLE_QUERY, "refId": "budget"},
             "includeAll": True, "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"},
             "refresh": 2, "sort": 3},
        ]},
        "panels": panels,
    }


def dashboard_json() -> str:
    return json.dumps(build_dashboard(), indent=1) + "\n"


def panel_targets(dashboard: dict) -> list[tuple[str, str, str, bool]]:
    """(panel title, refId, PromQL, instant) of every query of every panel."""
    return [(p["title"], t["refId"], t["expr"], bool(t.get("instant"))) for p in dashboard["panels"]
            for t in p["targets"]]


def substitute(expr: str, *, rate_interval: str = "1m", range_: str = "5m", budget: str = ".*") -> str:
    """Grafana's variables in a panel query, as Grafana fills them: the rate interval, the time range and the
    budget variable's value (`All` = its allValue `.*`)."""
    return (expr.replace("$__rate_interval", rate_interval).replace("$__range", range_)
            .replace("${budget}", budget).replace("$budget", budget))


# ---------------------------------------------------------------------------------------------------------------
# recorded rounds -> the server's series


@dataclass
class BatchRound:
    """One decode round of a batch: the requests' round records, the stage times (ms) and `auto`'s candidate."""

    records: list  # metrics.RoundRecord per request
    stage_ms: dict[str, float]
    candidate: str | None = None


def replay_rounds(baseline_path: str | os.PathLike, method: str) -> tuple[list[BatchRound], int]:
    """The rounds of `method` in a baseline file (offline decoders: one request at a time), in the order a server
    decoding all its prompts at once, each in a batch of its own, would run them: round j of every prompt that still
    decodes, then round j + 1. Returns (batch rounds of one request each, the drafter's depth limit)."""
    from sglang_ddtree.adaptive import candidate_label
    from sglang_ddtree.baseline import read_baseline
    from sglang_ddtree.compare import round_records

    base = read_baseline(baseline_path)
    recs = [r for r in base.records if r.method == method]
    if not recs:
        raise ValueError(f"{baseline_path}: no records of method {method!r}.")
    depth_limit = int(base.header.block_size) - 1
    per_prompt = []
    for rec in recs:
        auto = rec.extra.get("auto", {}).get("budget")
        per_prompt.append([
            BatchRound(records=[rr], stage_ms={s: v[j] for s, v in (rec.stage_ms or {}).items() if j < len(v)},
                       candidate=candidate_label(auto[j]) if auto is not None else None)
            for j, rr in enumerate(round_records(rec))])
    rounds = [p[j] for j in range(max(len(p) for p in per_prompt)) for p in per_prompt if j < len(p)]
    return rounds, depth_limit


def round_vector(records, depth_limit: int) -> list[float]:
    """The host-side twin of stats.round_summary_vector for one batch round's records (metric_names.SummaryLayout):
    request-rounds by accepted draft tokens 0..L, then branches, draft nodes, expected tokens, requests."""
    layout = mn.SummaryLayout(depth_limit)
    vec = [0.0] * layout.width
    for r in records:
        vec[layout.by_accepted.start + min(r.accept_len - 1, depth_limit)] += 1
    extra = {"branches": sum(sum(r.branch_taken) for r in records), "nodes": sum(r.tree_size for r in records),
             "expected": sum(r.expected_accept for r in records), "requests": len(records)}
    for field, value in extra.items():
        vec[layout.index(field)] = float(value)
    return vec


class ReplayServer:
    """One DDTREE server's /metrics: its PrometheusSeries (a private registry) fed round by round, as
    DDTreeStats feeds them, plus SGLang's spec gauges set every `log_interval` batch rounds."""

    def __init__(self, budget_label: str, depth_limit: int, num_draft_tokens: int, log_interval: int = 8):
        import prometheus_client

        from sglang_ddtree.sglang.prometheus import PrometheusSeries
        from sglang_ddtree.sglang.stats import DDTreeStats

        self.registry = prometheus_client.CollectorRegistry()
        self.prom = PrometheusSeries(depth_limit, budget_label, registry=self.registry)
        self.depth_limit = depth_limit
        labels = ["model_name", "engine_type", "tp_rank", "pp_rank"]
        self._spec_labels = {"model_name": "tiny-pair", "engine_type": "unified", "tp_rank": "0", "pp_rank": "0"}
        self.spec_accept_length = prometheus_client.Gauge(
            mn.SGLANG_SPEC_ACCEPT_LENGTH, "The average acceptance length of speculative decoding.", labels,
            registry=self.registry).labels(**self._spec_labels)
        self.spec_accept_rate = prometheus_client.Gauge(
            mn.SGLANG_SPEC_ACCEPT_RATE, "The average acceptance rate of speculative decoding.", labels,
            registry=self.registry).labels(**self._spec_labels)
        self.num_draft_tokens = num_draft_tokens
        self.log_interval = log_interval
        self.host_flush = DDTreeStats.HOST_FLUSH_ROUNDS
        self._host_totals: dict[str, float] = {}
        self._host_rounds = 0
        self._window = [0, 0, 0]  # rounds, tokens, accepted drafts since the last log
        self._batches = 0
        self._lock = threading.Lock()
        self._http: WSGIServer | None = None

    def feed(self, batch: BatchRound) -> None:
        vec = round_vector(batch.records, self.depth_limit)
        round_ms = sum(batch.stage_ms.values())
        with self._lock:
            self.prom.observe(vec, 1, [{**batch.stage_ms, "host": round_ms}])
            if batch.candidate is not None:
                self.prom.auto_round(batch.candidate, len(batch.records))
            # the offline decoders run on the host: a stage's host time is its time
            for s, ms in batch.stage_ms.items():
                self._host_totals[s] = self._host_totals.get(s, 0.0) + ms
            self._host_rounds += 1
            if self._host_rounds >= self.host_flush:
                self.prom.host_stages(self._host_totals, self._host_rounds)
                self._host_totals, self._host_rounds = {}, 0
            tokens = sum(r.accept_len for r in batch.records)
            self._window[0] += len(batch.records)
            self._window[1] += tokens
            self._window[2] += tokens - len(batch.records)
            self._batches += 1
            if self._batches % self.log_interval == 0:
                self.log_stats()

    def log_stats(self) -> None:
        """SGLang's scheduler logging step: the spec gauges over the rounds since the last one."""
        rounds, tokens, drafts = self._window
        if rounds:
            self.spec_accept_length.set(tokens / rounds)
            self.spec_accept_rate.set(drafts / (rounds * max(self.num_draft_tokens - 1, 1)))
        self._window = [0, 0, 0]

    def flush(self) -> None:
        """What the periodic flushes still hold (`auto`'s candidates, host stage sums, the spec window)."""
        with self._lock:
            self.prom.flush_auto_rounds()
            if self._host_rounds:
                self.prom.host_stages(self._host_totals, self._host_rounds)
                self._host_totals, self._host_rounds = {}, 0
            self.log_stats()

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        with self._lock:
            return generate_latest(self.registry)

    def serve(self) -> str:
        """Serve /metrics on 127.0.0.1 (a free port) in a thread; returns host:port."""
        from prometheus_client import CONTENT_TYPE_LATEST

        def app(environ, start_response):
            body = self.exposition()
            start_response("200 OK", [("Content-Type", CONTENT_TYPE_LATEST), ("Content-Length", str(len(body)))])
            return [body]

        class Quiet(WSGIRequestHandler):
            def log_message(self, *args):
                pass

        self._http = make_server("127.0.0.1", 0, app, handler_class=Quiet)
        threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
        return f"127.0.0.1:{self._http.server_port}"

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


# ---------------------------------------------------------------------------------------------------------------
# a Prometheus server


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrometheusServer:
    """`prometheus` on 127.0.0.1 scraping `targets` (host:port) every `scrape_interval`, data in `workdir`. A
    context manager: started on entry (ready or an error within `start_timeout` s), stopped on exit."""

    def __init__(self, targets: list[str], workdir: str | os.PathLike, *, scrape_interval: str = "1s",
                 binary: str | None = None, start_timeout: float = 30.0):
        self.binary = binary or prometheus_binary()
        if self.binary is None:
            raise FileNotFoundError("no `prometheus` binary on PATH (Debian: apt-get install prometheus).")
        self.workdir = Path(workdir)
        self.targets = targets
        self.scrape_interval = scrape_interval
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def __enter__(self) -> "PrometheusServer":
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text(
            "global:\n"
            f"  scrape_interval: {self.scrape_interval}\n"
            f"  evaluation_interval: {self.scrape_interval}\n"
            "scrape_configs:\n"
            "  - job_name: sglang\n"
            f"    scrape_interval: {self.scrape_interval}\n"
            f"    scrape_timeout: {self.scrape_interval}\n"
            "    static_configs:\n"
            f"      - targets: {json.dumps(self.targets)}\n")
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(self.workdir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={config}", f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.workdir)
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self.proc.poll() is not None:
                self.__exit__(None, None, None)
                raise RuntimeError(f"prometheus exited with status {self.proc.returncode}: {self.log_tail()}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            if time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise TimeoutError(f"prometheus not ready within {self.start_timeout:.0f} s: {self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return (self.workdir / "prometheus.log").read_text(errors="replace")[-600:]
        return ""

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if getattr(self, "log", None) is not None:
            self.log.close()

    def api(self, path: str, **params) -> dict:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params, doseq=True)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:  # a bad query answers 400 with the error in the body
            return json.loads(e.read())

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """An instant query's result vector; raises on a query Prometheus rejects."""
        out = self.api("query", query=expr, **({"time": f"{at:.3f}"} if at is not None else {}))
        if out.get("status") != "success":
            raise ValueError(f"prometheus rejected {expr!r}: {out.get('error')}")
        return out["data"]["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        out = self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step}")
        if out.get("status") != "success":
            raise ValueError(f"prometheus rejected {expr!r}: {out.get('error')}")
        return out["data"]["result"]

    def wait_for(self, expr: str, predicate, timeout: float = 20.0) -> list[dict]:
        """Poll an instant query until predicate(result) holds (e.g. the last fed round has been scraped)."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if predicate(result):
                return result
            if time.monotonic() > deadline:
                raise TimeoutError(f"{expr!r} did not reach the expected value within {timeout:.0f} s: {result}")
            time.sleep(0.25)

    def scrape_targets_up(self) -> list[dict]:
        return self.api("targets")["data"]["activeTargets"]


def finite_values(result: list[dict]) -> list[float]:
    """The finite sample values of an instant query result."""
    vals = [float(s["value"][1]) for s in result]
    return [v for v in vals if math.isfinite(v)]
