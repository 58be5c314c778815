"""The DDTREE server's Prometheus series, named once, and the layout of the round summary vector they are summed from.

Every series is `sglang:ddtree_*` and carries the label `budget` (the number, or `auto`). Writers and readers take
the names from here: the server registers its series from these definitions (sglang/prometheus.py), the Grafana
dashboard builds its queries from them (dashboard.py) and the benchmark harness reads scrapes by them
(ddtree_bench/prom.py). tests/test_metric_names.py checks that every name a reader reads is one the server exports,
and that no other module spells a series name out. The reference for users is docs/metrics.md.

A core module: it imports nothing (the harness reads the names without torch or SGLang).
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "sglang:ddtree_"
BUDGET = "budget"  # the label of every series

COUNTER, HISTOGRAM, GAUGE = "counter", "histogram", "gauge"


@dataclass(frozen=True)
class Metric:
    """One series family: its full name as registered with prometheus_client (a counter's ends in `_total`, which
    is also its sample's name), its type, its labels besides `budget`, its help text and a histogram's buckets."""

    name: str
    kind: str
    labels: tuple[str, ...]
    doc: str
    buckets: tuple[float, ...] = ()

    @property
    def label_names(self) -> list[str]:
        return [BUDGET, *self.labels]

    @property
    def samples(self) -> tuple[str, ...]:
        """The sample names of this family in the text exposition (a counter's `_created` left out)."""
        return (self.bucket, self.sum, self.count) if self.kind == HISTOGRAM else (self.name,)

    @property
    def sum(self) -> str:
        return self._part("_sum")

    @property
    def count(self) -> str:
        return self._part("_count")

    @property
    def bucket(self) -> str:
        return self._part("_bucket")

    def _part(self, suffix: str) -> str:
        if self.kind != HISTOGRAM:
            raise ValueError(f"{self.name} is a {self.kind}, not a histogram: it has no {suffix} sample.")
        return self.name + suffix


def _metric(name: str, kind: str, labels: tuple[str, ...], doc: str, buckets: tuple[float, ...] = ()) -> Metric:
    return Metric(PREFIX + name, kind, labels, doc, buckets)


# Counters of request-rounds unless said otherwise (a request-round = one request in one verify round)
ROUNDS = _metric("rounds_total", COUNTER, (), "Request-rounds verified.")
ACCEPTED_TOKENS = _metric("accepted_tokens_total", COUNTER, (), "Tokens committed (accepted draft tokens + bonus).")
ACCEPT_LENGTH = _metric("accept_length_total", COUNTER, ("tokens",), "Request-rounds that committed `tokens` tokens.")
DEPTH_REACHED = _metric("depth_reached_total", COUNTER, ("depth",),
                        "Request-rounds that accepted at least `depth` draft tokens (per-depth acceptance = "
                        "depth_reached_total / rounds_total).")
BRANCH_ACCEPTED = _metric("branch_accepted_total", COUNTER, (),
                          "Accepted draft tokens that were not the drafter's top-1 at their depth.")
EXPECTED_TOKENS = _metric("expected_tokens_total", COUNTER, (),
                          "Sum over request-rounds of the drafter's expected tokens per round (1 + sum of node "
                          "probabilities).")
TREE_NODES = _metric("tree_nodes_total", COUNTER, (), "Draft nodes verified (root excluded).")
# Per batch round
STAGE_SECONDS = _metric("stage_seconds", HISTOGRAM, ("stage",), "Seconds per round by stage.",
                        (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1))
ROUND_HOST_SECONDS = _metric("round_host_seconds", HISTOGRAM, (),
                             "Host (CPU) seconds of the worker's round call: above the GPU seconds per round, the "
                             "round is host-bound.", (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1))
STAGE_HOST_SECONDS = _metric("stage_host_seconds_total", COUNTER, ("stage",),
                             "Host (CPU) seconds of the worker's round call by stage (choose = `auto`'s chooser; "
                             "after = from the commit to the end of the call).")
STAGE_HOST_ROUNDS = _metric("stage_host_rounds_total", COUNTER, (), f"Batch rounds in {STAGE_HOST_SECONDS.name}.")
# `auto` only (created at first use: fixed-budget servers export none of these but AUTO_ROUNDS)
AUTO_ROUNDS = _metric("auto_rounds_total", COUNTER, ("candidate", "batch"),
                      "`auto`: rounds (batches) that verified this candidate budget ('chain' = the drafter's top-1 "
                      "path, 'plain' = a round without a draft), by the batch-size bucket the round was chosen in "
                      "(its verify's CUDA-graph batch size; past the largest, the next power of two).")
AUTO_TAU_SCORED = _metric("auto_tau_scored_total", COUNTER, (),
                          "`auto`: request-rounds whose prediction error was scored (scored tree rounds).")
AUTO_TAU_ABS_ERROR = _metric("auto_tau_abs_error_total", COUNTER, ("scores",),
                             "`auto`, scored tree rounds: sum over request-rounds of |predicted - committed tokens|, "
                             "by the scores that predicted (raw drafter scores, the calibration table's, or gated: "
                             "raw until the table has learnt calibration_gate request-rounds, the table's after), all "
                             f"before the table learnt the round. MAE = this / {AUTO_TAU_SCORED.name}.")
CALIBRATION_CELL = ("depth", "path_class", "rank_class")
CALIBRATION_RATIO = _metric("calibration_ratio", GAUGE, CALIBRATION_CELL,
                            "`auto`'s calibration table: (accepted + m) / (predicted + m) of the draft nodes of a "
                            "(depth, path class = off-top-1 ancestors, rank class = own rank > 0) cell, over its "
                            "raw-probability buckets (1 = raw scores).")
CALIBRATION_OBSERVATIONS = _metric("calibration_observations", GAUGE, CALIBRATION_CELL,
                                   "`auto`'s calibration table: decayed count of the cell's observed draft nodes (0 "
                                   "after a reset: ddtree_calibration_reset).")

# SGLANG_DDTREE_AUTO_AB (a measuring mode of `auto` servers): what stats.ABTallies sums per arm (label `arm` =
# auto | fixed), each published as the counter ab_<field>_total
AB_FIELDS = {
    "rounds": "SGLANG_DDTREE_AUTO_AB: batch rounds that count (tokens and GPU seconds).",
    "request_rounds": "SGLANG_DDTREE_AUTO_AB: request-rounds of the rounds that count.",
    "tokens": "SGLANG_DDTREE_AUTO_AB: tokens committed (accepted drafts + bonus) in the rounds that count.",
    "seconds": "SGLANG_DDTREE_AUTO_AB: GPU-timeline seconds of the rounds that count, `between` included.",
    "skipped_rounds": "SGLANG_DDTREE_AUTO_AB: batch rounds that do not count (after a prefill or idle batch, "
                      "or with graph captures).",
    "host_rounds": "SGLANG_DDTREE_AUTO_AB: batch rounds in ab_host_seconds_total.",
    "host_seconds": "SGLANG_DDTREE_AUTO_AB: host seconds of the worker's round call, rounds that count.",
    # The arm's rounds split (`auto`'s own cost against its choices): those that sampled, those of a candidate
    # narrower than the widest tree (their tokens and request-rounds too: the rest are the widest tree's)
    "sampled_rounds": "SGLANG_DDTREE_AUTO_AB: rounds that count and sampled `auto`'s expectations.",
    "sampled_seconds": "SGLANG_DDTREE_AUTO_AB: GPU-timeline seconds of those sampled rounds.",
    "narrower_rounds": "SGLANG_DDTREE_AUTO_AB: rounds that count and verified a candidate other than the widest "
                       "tree.",
    "narrower_seconds": "SGLANG_DDTREE_AUTO_AB: GPU-timeline seconds of those narrower rounds.",
    "narrower_tokens": "SGLANG_DDTREE_AUTO_AB: tokens committed in those narrower rounds.",
    "narrower_request_rounds": "SGLANG_DDTREE_AUTO_AB: request-rounds of those narrower rounds.",
}
AB = {field: _metric(f"ab_{field}_total", COUNTER, ("arm",), doc) for field, doc in AB_FIELDS.items()}
AB_HOST_STAGE_SECONDS = _metric("ab_host_stage_seconds_total", COUNTER, ("arm", "stage"),
                                "SGLANG_DDTREE_AUTO_AB: the worker's host seconds by stage of the rounds that count.")

ALL: tuple[Metric, ...] = (
    ROUNDS, ACCEPTED_TOKENS, ACCEPT_LENGTH, DEPTH_REACHED, BRANCH_ACCEPTED, EXPECTED_TOKENS, TREE_NODES,
    STAGE_SECONDS, ROUND_HOST_SECONDS, STAGE_HOST_SECONDS, STAGE_HOST_ROUNDS, AUTO_ROUNDS, AUTO_TAU_SCORED,
    AUTO_TAU_ABS_ERROR, CALIBRATION_RATIO, CALIBRATION_OBSERVATIONS, *AB.values(), AB_HOST_STAGE_SECONDS)

# SGLang's own speculative-decoding gauges (its scheduler sets them), which the dashboard reads next to ours
SGLANG_SPEC_ACCEPT_LENGTH = "sglang:spec_accept_length"
SGLANG_SPEC_ACCEPT_RATE = "sglang:spec_accept_rate"


# ---------------------------------------------------------------------------------------------------------------
# The round summary vector: one verify round's numbers summed over its batch (float32), built on the GPU without a
# host sync (stats.round_summary_vector, the lean chain kernel kernels.chain_accept_triton, the dashboard's replay
# dashboard.round_vector) and folded into the counters above (prometheus.PrometheusSeries.observe, the A/B tallies
# stats.ABTallies). For depth limit L: entries 0..L are request-rounds by accepted draft tokens 0..L, then
# SUMMARY_FIELDS in this order.

SUMMARY_FIELDS = (
    "branches",  # accepted draft tokens off the drafter's top-1 -> BRANCH_ACCEPTED
    "nodes",  # draft nodes verified, root excluded -> TREE_NODES
    "expected",  # the drafter's expected committed tokens (1 + sum of node probabilities) -> EXPECTED_TOKENS
    "requests",  # request-rounds -> ROUNDS
)


@dataclass(frozen=True)
class SummaryLayout:
    """Where each number sits in the round summary vector of depth limit `depth_limit`."""

    depth_limit: int

    @property
    def by_accepted(self) -> slice:
        """Request-rounds by accepted draft tokens 0..depth_limit."""
        return slice(0, self.depth_limit + 1)

    @property
    def width(self) -> int:
        return self.depth_limit + 1 + len(SUMMARY_FIELDS)

    def index(self, field: str) -> int:
        return self.depth_limit + 1 + SUMMARY_FIELDS.index(field)

    def fields(self, values) -> dict:
        """{field: value} of SUMMARY_FIELDS from a summary vector (a list or a tensor)."""
        return {field: values[self.index(field)] for field in SUMMARY_FIELDS}
