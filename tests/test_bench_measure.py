"""What one measurement computes (decode rate, step time, acceptance), the streaming client against a local
SSE server, and the Prometheus diff that yields the DDTREE stage split."""

from __future__ import annotations

import json
import math
import statistics
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ddtree_bench import prom
from ddtree_bench.measure import (HttpClient, RequestResult, acceptance_from_histogram, run_batch,
                                  summarize)
from sglang_ddtree import metric_names as mn


def req(i, c, decode_s, *, verify=None, hist=None, server=True, t0=0.0, ttft=0.05):
    meta = {"completion_tokens": c, "prompt_tokens": 10, "e2e_latency": ttft + decode_s}
    if server:
        meta["decode_throughput"] = (c - 1) / decode_s
    if verify is not None:
        meta["spec_verify_ct"] = verify
    if hist is not None:
        meta["spec_correct_drafts_histogram"] = hist
    return RequestResult(index=i, t_send=t0, t_first=t0 + ttft, t_last=t0 + ttft + decode_s, meta=meta, chunks=5)


def test_plain_rates_and_step_times():
    rs = [req(0, 101, 1.0), req(1, 101, 2.0)]
    out = summarize(rs, method="plain", max_new_tokens=101)
    assert out["decode_tokens_per_s"] == pytest.approx(100 / 1.0 + 100 / 2.0)
    assert out["decode_tokens_per_s_per_request"] == pytest.approx(75.0)
    assert out["step_ms"] == pytest.approx((10.0 + 20.0) / 2)  # median of d / (c - 1) per request
    assert out["all_full_length"] and out["decode_timing"] == "server"
    # the window rate: 200 decode tokens from the first first-token to the last end (2.0 s)
    assert out["decode_tokens_per_s_window"] == pytest.approx(200 / 2.0)
    assert "tau" not in out
    # the same four requests as two batches one after the other: the mean batch's rate
    two = summarize(rs + [req(2, 101, 1.0), req(3, 101, 2.0)], method="plain", max_new_tokens=101, groups=2)
    assert two["decode_tokens_per_s"] == pytest.approx(out["decode_tokens_per_s"]) and two["prompt_groups"] == 2
    with pytest.raises(ValueError, match="equal batches"):
        summarize(rs + [req(2, 101, 1.0)], method="plain", max_new_tokens=101, groups=2)


def test_requests_timed_short_are_counted_as_rate_outliers():
    """An 8B batch-64 run read 2.2x: the summed per-request rate is inflated by a request whose decode time
    reads short; the run's window rate is not. Such requests are counted (decode_rate_outliers), the rate keeps its
    definition."""
    from ddtree_bench.measure import RATE_OUTLIER

    steady = [req(i, 33, 1.0) for i in range(8)]
    out = summarize(steady, method="plain", max_new_tokens=33)
    assert out["decode_rate_outliers"] == 0 and out["decode_tokens_per_s"] == pytest.approx(8 * 32.0)
    # the same batch with one request's decode timed at 1/20 of the others': its rate alone is 20x a request's
    short = steady[:7] + [req(7, 33, 1.0 / 20, ttft=0.05 + 0.95)]
    out = summarize(short, method="plain", max_new_tokens=33)
    assert out["decode_rate_outliers"] == 1
    assert out["decode_tokens_per_s"] == pytest.approx(7 * 32.0 + 20 * 32.0)  # ~3.4x the steady batch
    assert out["decode_tokens_per_s_window"] == pytest.approx(8 * 32 / 1.0)  # same window, same rate
    # prompts of one run decoding at different rates within RATE_OUTLIER of the median are not outliers
    mixed = [req(i, 33, d) for i, d in enumerate([1.0, 0.6, 1.5, 0.9])]
    assert max(1.5 / 0.6, 1.0 / 0.6) < RATE_OUTLIER
    assert summarize(mixed, method="plain", max_new_tokens=33)["decode_rate_outliers"] == 0


def test_speculative_acceptance_from_the_histogram():
    # request A: rounds accepting 0, 0, 1, 2 drafts; request B: 3, 0
    a = req(0, 9, 0.4, verify=4, hist=[2, 1, 1])
    b = req(1, 5, 0.2, verify=2, hist=[1, 0, 0, 1])
    out = summarize([a, b], method="ddtree", max_new_tokens=9)
    committed = (1 + 1 + 2 + 3) + (4 + 1)  # accepted drafts + one bonus per round
    assert out["tau"] == pytest.approx(committed / 6)
    assert out["accept_histogram"] == [3, 1, 1, 1]
    assert out["accept_rate_by_depth"][:3] == pytest.approx([3 / 6, 2 / 6, 1 / 6])
    assert len(out["accept_rate_by_depth"]) == 15 and out["accept_rate_by_depth"][3] == 0
    assert out["tau_meta"] == pytest.approx((9 + 5) / 6)
    assert out["step_ms"] == pytest.approx(100.0)  # 0.4 s / 4 rounds and 0.2 s / 2 rounds
    assert out["verify_rounds"] == 6 and not out["all_full_length"]


def test_client_clock_is_the_fallback():
    out = summarize([req(0, 11, 0.5, server=False)], method="plain", max_new_tokens=11)
    assert out["decode_timing"] == "client"
    assert out["decode_tokens_per_s"] == pytest.approx(10 / 0.5)


def test_unusable_batches_raise():
    bad = RequestResult(index=0, t_send=0.0, error="HTTPError 400")
    with pytest.raises(ValueError, match="failed"):
        summarize([bad, req(1, 11, 0.5)], method="plain", max_new_tokens=11)
    empty = RequestResult(index=0, t_send=0.0, meta={"completion_tokens": 1})
    with pytest.raises(ValueError, match="decode time"):
        summarize([empty], method="plain", max_new_tokens=1)


def test_acceptance_from_histogram_edges():
    assert acceptance_from_histogram([])["tau"] is None
    acc = acceptance_from_histogram([0, 0, 4])
    assert acc["tau"] == 3 and acc["accept_rate_by_depth"] == [1.0, 1.0]


# ------------------------------------------------------------------------------------------------- prometheus

BEFORE = """# HELP sglang:ddtree_stage_seconds Seconds per round by stage.
# TYPE sglang:ddtree_stage_seconds histogram
sglang:ddtree_stage_seconds_sum{budget="64",stage="draft"} 0.5
sglang:ddtree_stage_seconds_count{budget="64",stage="draft"} 100.0
sglang:ddtree_stage_seconds_sum{budget="64",stage="verify"} 2.0
sglang:ddtree_stage_seconds_count{budget="64",stage="verify"} 100.0
sglang:ddtree_stage_seconds_bucket{budget="64",le="+Inf",stage="verify"} 100.0
sglang:ddtree_rounds_total{budget="64"} 400.0
sglang:ddtree_accepted_tokens_total{budget="64"} 800.0
sglang:ddtree_depth_reached_total{budget="64",depth="1"} 300.0
sglang:num_running_reqs{engine_type="unified",model_name="m \\"x\\""} 0.0
"""
AFTER = """sglang:ddtree_stage_seconds_sum{budget="64",stage="draft"} 0.8
sglang:ddtree_stage_seconds_count{budget="64",stage="draft"} 150.0
sglang:ddtree_stage_seconds_sum{budget="64",stage="verify"} 3.0
sglang:ddtree_stage_seconds_count{budget="64",stage="verify"} 150.0
sglang:ddtree_stage_seconds_bucket{budget="64",le="+Inf",stage="verify"} 150.0
sglang:ddtree_rounds_total{budget="64"} 600.0
sglang:ddtree_round_host_seconds_sum{budget="64"} 0.2
sglang:ddtree_round_host_seconds_count{budget="64"} 50.0
sglang:ddtree_stage_seconds_sum{budget="64",stage="between"} 0.01
sglang:ddtree_stage_seconds_count{budget="64",stage="between"} 40.0
sglang:ddtree_accepted_tokens_total{budget="64"} 1300.0
sglang:ddtree_depth_reached_total{budget="64",depth="1"} 450.0
sglang:ddtree_depth_reached_total{budget="64",depth="2"} 100.0
sglang:ddtree_branch_accepted_total{budget="64"} 60.0
sglang:ddtree_expected_tokens_total{budget="64"} 550.0
sglang:ddtree_tree_nodes_total{budget="64"} 12800.0
sglang:num_running_reqs{engine_type="unified",model_name="m \\"x\\""} 3.0
"""


def test_parse_labels_values_and_escapes():
    got = prom.parse(BEFORE)
    assert got[("sglang:ddtree_stage_seconds_bucket", (("budget", "64"), ("le", "+Inf"), ("stage", "verify")))] == 100
    assert got[("sglang:num_running_reqs", (("engine_type", "unified"), ("model_name", 'm "x"')))] == 0.0
    assert prom.parse("x_total 3 1700000000000\ny +Inf\n")[("y", ())] == math.inf
    with pytest.raises(ValueError, match="line 1"):
        prom.parse("this is not a metric line at all {")


def test_ddtree_summary_of_a_workload():
    delta = prom.diff(prom.parse(AFTER), prom.parse(BEFORE))
    s = prom.ddtree_summary(delta, budget=64)
    # `between` is observed only for rounds that follow another decode round: its mean is over those
    assert s["stage_ms"] == pytest.approx({"between": 1e3 * 0.01 / 40, "draft": 1e3 * 0.3 / 50,
                                           "verify": 1e3 * 1.0 / 50})
    assert s["stage_ms_sum"] == pytest.approx(0.25 + 6.0 + 20.0)
    assert s["host_ms"] == pytest.approx(1e3 * 0.2 / 50)
    assert s["batch_rounds"] == 50 and s["request_rounds"] == 200
    assert s["tau"] == pytest.approx(500 / 200)
    assert s["accept_rate_by_depth"] == pytest.approx([150 / 200, 100 / 200])
    assert s["branch_accept_rate"] == pytest.approx(60 / (500 - 200))
    assert s["expected_accept_length"] == pytest.approx(550 / 200)
    assert s["tree_nodes_mean"] == pytest.approx(64.0)
    assert prom.ddtree_summary(delta, budget=16) is None  # another budget's series: none here
    assert prom.ddtree_summary(prom.diff(prom.parse(BEFORE), prom.parse(BEFORE))) is None
    # a scrape without the drafter's expectation or the node counts: None, not a 0 that reads as measured
    bare = {k: v for k, v in delta.items() if k[0] not in (mn.EXPECTED_TOKENS.name, mn.TREE_NODES.name)}
    s = prom.ddtree_summary(bare, budget=64)
    assert s["tau"] == pytest.approx(500 / 200)
    assert s["expected_accept_length"] is None and s["tree_nodes_mean"] is None


def test_the_scrape_fixtures_use_the_names_the_server_exports():
    """BEFORE / AFTER stand for a server's /metrics: their DDTREE samples are ones the server registers
    (metric_names), so that a renamed series fails here rather than reading as zeros in the sweep's rows."""
    exported = {sample for metric in mn.ALL for sample in metric.samples}
    for text in (BEFORE, AFTER):
        names = {name for name, _ in prom.parse(text) if name.startswith(mn.PREFIX)}
        assert names and names <= exported, names - exported


def test_auto_calibration_of_a_workload():
    """The calibration table's errors of one workload: the counters' differences over the request-rounds scored;
    None where nothing was scored (fixed-budget servers export no such series)."""
    before = ('sglang:ddtree_auto_tau_abs_error_total{budget="auto",scores="raw"} 10.0\n'
              'sglang:ddtree_auto_tau_abs_error_total{budget="auto",scores="calibrated"} 9.0\n'
              'sglang:ddtree_auto_tau_scored_total{budget="auto"} 8.0\n')
    after = ('sglang:ddtree_auto_tau_abs_error_total{budget="auto",scores="raw"} 40.0\n'
             'sglang:ddtree_auto_tau_abs_error_total{budget="auto",scores="calibrated"} 33.0\n'
             'sglang:ddtree_auto_tau_scored_total{budget="auto"} 28.0\n')
    got = prom.auto_calibration(prom.diff(prom.parse(after), prom.parse(before)))
    assert got == {"scored_request_rounds": 20, "tau_mae_raw": pytest.approx(1.5),
                   "tau_mae_calibrated": pytest.approx(1.2)}
    assert prom.auto_calibration(prom.diff(prom.parse(after), prom.parse(after))) is None
    assert prom.auto_calibration(prom.diff(prom.parse(AFTER), prom.parse(BEFORE))) is None
    # a server exporting the gated predictor (newer servers): its MAE too, from its own series
    gated_before = before + 'sglang:ddtree_auto_tau_abs_error_total{budget="auto",scores="gated"} 10.0\n'
    gated_after = after + 'sglang:ddtree_auto_tau_abs_error_total{budget="auto",scores="gated"} 36.0\n'
    got = prom.auto_calibration(prom.diff(prom.parse(gated_after), prom.parse(gated_before)))
    assert got["tau_mae_gated"] == pytest.approx(1.3) and got["tau_mae_calibrated"] == pytest.approx(1.2)


# -------------------------------------------------------------------------------------------- streaming client


class _SSE(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = body["sampling_params"]["max_new_tokens"]
        assert body["stream"] is True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for c in range(1, n + 1):
            meta = {"completion_tokens": c}
            if c == n:
                meta.update(decode_throughput=(n - 1) / 0.01, spec_verify_ct=n - 1)
            self.wfile.write(b"data: " + json.dumps({"output_ids": list(range(c)), "meta_info": meta}).encode()
                             + b"\n\n")
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")

    def do_GET(self):
        text = b"sglang:ddtree_rounds_total{budget=\"4\"} 7\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(text)))
        self.end_headers()
        self.wfile.write(text)


@pytest.fixture()
def sse_server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _SSE)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_streaming_client_and_concurrent_batch(sse_server):
    client = HttpClient(sse_server)
    payloads = [{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 5 + i}} for i in range(4)]
    results = run_batch(client, payloads, timeout_s=10)
    assert [r.index for r in results] == [0, 1, 2, 3]
    for i, r in enumerate(results):
        assert r.error is None and r.chunks == 5 + i
        assert r.meta["completion_tokens"] == 5 + i and r.meta["spec_verify_ct"] == 4 + i
        assert r.t_send <= r.t_first <= r.t_last
    out = summarize(results, method="dflash", max_new_tokens=5)
    assert out["decode_timing"] == "server"
    # the server said 0.01 s of decode for every request, over spec_verify_ct = n - 1 rounds
    assert out["step_ms"] == pytest.approx(statistics.median(10.0 / (4 + i) for i in range(4)))
    assert prom.parse(client.metrics_text())[("sglang:ddtree_rounds_total", (("budget", "4"),))] == 7


def test_streaming_client_reports_connection_errors():
    r = HttpClient("http://127.0.0.1:9").generate_stream({"input_ids": [1]}, timeout_s=2)
    assert r.error and r.t_first is None
