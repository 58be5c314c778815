"""The DDTREE server's Prometheus series (the scheduler process's; stats.DDTreeStats feeds them round by round).

The series' names, types, labels and help texts are defined in sglang_ddtree/metric_names.py (one table that the
dashboard and the benchmark harness read too); what they count (counters are request-rounds unless said otherwise,
label `budget` everywhere):
  rounds_total, accepted_tokens_total (incl. the bonus: tau = accepted_tokens_total / rounds_total),
  accept_length_total{tokens} (rounds that committed `tokens` tokens: the accept-length histogram),
  depth_reached_total{depth} (rounds that accepted >= depth draft tokens: per-depth acceptance =
  depth_reached_total / rounds_total), branch_accepted_total (accepted draft tokens that were not the drafter's
  top-1), tree_nodes_total (draft nodes verified: tree fill = tree_nodes_total / rounds_total / budget),
  expected_tokens_total (the drafter's own expectation: 1 + sum of node probabilities, for calibration),
  stage_seconds{stage} (histogram per batch round: between, draft, tree, verify, walk, commit; `between` only
  for a round that directly follows another decode round, see sglang_ddtree.stages),
  round_host_seconds (histogram per batch round: the host's time in the worker's round call, to the commit),
  stage_host_seconds_total{stage} and stage_host_rounds_total (the host's time per stage of the round call:
  choose (`auto`), draft, tree, verify, walk, commit, after; mean = the sum / stage_host_rounds_total).
`auto` adds auto_rounds_total{candidate, batch} (batch rounds per verified candidate) and, from its calibration table
(sglang_ddtree.sglang.auto.CalibrationMonitor): auto_tau_abs_error_total{scores=raw|calibrated|gated} and
auto_tau_scored_total (mean absolute error of the predicted committed tokens per request-round, scored tree
rounds: one sampled tree round in AutoConfig.calibration_every, every one while the table is young),
calibration_ratio{depth,path_class,rank_class} and calibration_observations{...} (gauges: the table's factors and
decayed node counts, refreshed every 256 rounds and at a reset).
With SGLANG_DDTREE_AUTO_AB (an `auto` server alternating blocks of rounds between `auto` and the fixed widest tree,
a measuring mode: sglang_ddtree.sglang.auto.auto_ab_block), per arm (label `arm` = auto | fixed), over the rounds
that count (ABTallies): ab_rounds_total (batch rounds), ab_request_rounds_total, ab_tokens_total (committed),
ab_seconds_total (GPU-timeline seconds, `between` included: the stages' sum), ab_host_seconds_total (the worker's
round call) and ab_host_stage_seconds_total{stage}, and ab_skipped_rounds_total (rounds that do not count); the
arm's rounds that sampled (ab_sampled_rounds_total, ab_sampled_seconds_total) and those that verified a candidate
other than the widest tree (ab_narrower_{rounds,seconds,tokens,request_rounds}_total).
"""

from __future__ import annotations

from sglang_ddtree import metric_names as mn
from sglang_ddtree.stages import HOST_STAGES, SERVER_STAGES


def committed_tokens(by_accepted) -> float:
    """Tokens committed by request-rounds counted by accepted draft tokens 0..L (a round vector's first entries):
    each commits its accepted drafts and the bonus."""
    return sum((a + 1) * c for a, c in enumerate(by_accepted))


def register(metric: mn.Metric, registry, **kwargs):
    """The prometheus_client family of a metric_names definition, in `registry` (kwargs: e.g. a gauge's
    multiprocess_mode)."""
    import prometheus_client

    if metric.kind == mn.HISTOGRAM:
        kwargs["buckets"] = list(metric.buckets)
    cls = {mn.COUNTER: prometheus_client.Counter, mn.HISTOGRAM: prometheus_client.Histogram,
           mn.GAUGE: prometheus_client.Gauge}[metric.kind]
    return cls(metric.name, metric.doc, metric.label_names, registry=registry, **kwargs)


class PrometheusSeries:
    """Series are Counters (and per-round stage Histograms): a round's numbers are summed on the GPU and added
    with one call per series, so the host cost per round does not grow with the batch."""

    def __init__(self, depth_limit: int, budget: int | str, registry=None):
        from prometheus_client import REGISTRY  # here: SGLang sets the multiprocess dir first

        registry = registry or REGISTRY
        labels = {mn.BUDGET: str(budget)}

        def family(metric):
            return register(metric, registry)

        self.rounds = family(mn.ROUNDS).labels(**labels)
        self.accepted = family(mn.ACCEPTED_TOKENS).labels(**labels)
        per_length = family(mn.ACCEPT_LENGTH)
        self.accept_length = [per_length.labels(**labels, tokens=str(n)) for n in range(1, depth_limit + 2)]
        per_depth = family(mn.DEPTH_REACHED)
        self.depth_reached = [per_depth.labels(**labels, depth=str(d)) for d in range(1, depth_limit + 1)]
        self.branch = family(mn.BRANCH_ACCEPTED).labels(**labels)
        self.expected = family(mn.EXPECTED_TOKENS).labels(**labels)
        self.tree_nodes = family(mn.TREE_NODES).labels(**labels)
        stage = family(mn.STAGE_SECONDS)
        self.stage = {name: stage.labels(**labels, stage=name) for name in SERVER_STAGES}
        self.host = family(mn.ROUND_HOST_SECONDS).labels(**labels)
        # Counters, not histograms: only the means are read, and the host stages are seven series a round
        host_stage = family(mn.STAGE_HOST_SECONDS)
        self.host_stage = {name: host_stage.labels(**labels, stage=name) for name in HOST_STAGES}
        self._host_stage = host_stage
        self.host_stage_rounds = family(mn.STAGE_HOST_ROUNDS).labels(**labels)
        layout = mn.SummaryLayout(depth_limit)  # where observe finds its numbers, resolved once
        self._by_accepted = layout.by_accepted
        self._at = tuple(layout.index(field) for field in ("branches", "nodes", "expected", "requests"))
        self.depth_limit = depth_limit
        self._auto = family(mn.AUTO_ROUNDS)
        self._auto_labels = labels
        self._auto_children: dict = {}
        self._auto_pending: dict = {}  # candidate -> rounds not yet in the counter (AUTO_ROUND_FLUSH)
        self._auto_unflushed = 0
        # `auto`'s calibration table (sglang_ddtree.sglang.auto.CalibrationMonitor): created at first use, so that
        # fixed-budget servers export no empty series
        self._registry = registry
        self._tau_error = self._tau_scored = self._cal_ratio = self._cal_obs = None
        self._tau_children: dict = {}  # calibration_errors' series (_tau_child)
        self._cal_published: set[tuple[str, str, str]] = set()
        self._cal_children: dict = {}  # (depth, path class, rank class) -> (ratio, observations) gauges (_cal_child)
        self._ab = None  # SGLANG_DDTREE_AUTO_AB's counters (ab), created at first use
        self._ab_children: dict = {}

    def ab(self, arm: str, sums: dict[str, float], host_stage_s: dict[str, float]) -> None:
        """SGLANG_DDTREE_AUTO_AB: one arm's sums since the last flush (metric_names.AB_FIELDS; seconds in
        seconds)."""
        if self._ab is None:  # created at first use: servers without the A/B export no such series
            self._ab = {field: register(metric, self._registry) for field, metric in mn.AB.items()}
            self._ab["host_stage"] = register(mn.AB_HOST_STAGE_SECONDS, self._registry)
        for field, value in sums.items():
            if value:
                self._ab_child(field, arm).inc(value)
        for stage, value in host_stage_s.items():
            if value:
                self._ab_child("host_stage", arm, stage).inc(value)

    def _ab_child(self, field: str, arm: str, stage: str | None = None):
        key = (field, arm, stage)
        child = self._ab_children.get(key)
        if child is None:  # resolved once, as auto_round's
            extra = {"arm": arm} if stage is None else {"arm": arm, "stage": stage}
            child = self._ab_children[key] = self._ab[field].labels(**self._auto_labels, **extra)
        return child

    # `auto`'s rounds per candidate reach the counter in sums of this many rounds: an inc() per round was a lock and,
    # under SGLang's multiprocess metrics, an mmap write (1.3 us on the dev CPU against 0.13 for a dict add,
    # benchmarks/results/auto_bookkeeping_cpu.json), in the span that the host-detail split timed at ~28 us a
    # tiny-pair round (tree_auto). A scrape misses at most the last AUTO_ROUND_FLUSH - 1 rounds (ABTallies and the
    # host stages lag the same way).
    AUTO_ROUND_FLUSH = 16

    def auto_round(self, candidate: str, batch: int) -> None:
        key = (candidate, batch)
        self._auto_pending[key] = self._auto_pending.get(key, 0) + 1
        self._auto_unflushed += 1
        if self._auto_unflushed >= self.AUTO_ROUND_FLUSH:
            self.flush_auto_rounds()

    def flush_auto_rounds(self) -> None:
        for key, n in self._auto_pending.items():
            child = self._auto_children.get(key)
            if child is None:  # resolved once per (candidate, batch): labels() builds and locks a lookup (~8 us)
                candidate, batch = key
                child = self._auto_children[key] = self._auto.labels(**self._auto_labels, candidate=candidate,
                                                                     batch=str(batch))
            child.inc(n)
        self._auto_pending.clear()
        self._auto_unflushed = 0

    def host_stages(self, totals: dict[str, float], rounds: int) -> None:
        for name, ms in totals.items():
            child = self.host_stage.get(name)
            if child is None:  # stages.AUTO_HOST_DETAIL's, made at first use: no zero series on other servers
                child = self.host_stage[name] = self._host_stage.labels(**self._auto_labels, stage=name)
            child.inc(ms / 1e3)
        self.host_stage_rounds.inc(rounds)

    def _calibration_series(self) -> None:
        if self._tau_error is not None:
            return
        self._tau_error = register(mn.AUTO_TAU_ABS_ERROR, self._registry)
        self._tau_scored = register(mn.AUTO_TAU_SCORED, self._registry)
        self._cal_ratio = register(mn.CALIBRATION_RATIO, self._registry, multiprocess_mode="mostrecent")
        self._cal_obs = register(mn.CALIBRATION_OBSERVATIONS, self._registry, multiprocess_mode="mostrecent")

    def calibration_errors(self, raw_abs: float, calibrated_abs: float, requests: float,
                           gated_abs: float | None = None) -> None:
        self._calibration_series()
        self._tau_child("raw").inc(raw_abs)
        self._tau_child("calibrated").inc(calibrated_abs)
        if gated_abs is not None:
            self._tau_child("gated").inc(gated_abs)
        self._tau_child(None).inc(requests)

    def _tau_child(self, scores: str | None):
        """The error series of `scores` (None: the scored request-rounds), resolved once, as auto_round's."""
        child = self._tau_children.get(scores)
        if child is None:
            child = self._tau_children[scores] = (
                self._tau_scored.labels(**self._auto_labels) if scores is None
                else self._tau_error.labels(**self._auto_labels, scores=scores))
        return child

    def calibration_table(self, rows: list[dict]) -> None:
        """rows: adaptive.summary_rows (cells with observations); cells published before and absent now (a reset)
        go back to ratio 1, 0 observations."""
        self._calibration_series()
        seen = set()
        for row in rows:
            key = (str(row["depth"]), str(row["path_class"]), str(row["rank_class"]))
            seen.add(key)
            ratio, observations = self._cal_child(key)
            ratio.set(row["ratio"])
            observations.set(row["observations"])
        for key in self._cal_published - seen:
            ratio, observations = self._cal_child(key)
            ratio.set(1.0)
            observations.set(0.0)
        self._cal_published |= seen

    def _cal_child(self, key: tuple[str, str, str]):
        """A table cell's two gauges, resolved once, as auto_round's and calibration_errors' series. Why: a publish
        (at most one in TableGauges.SECONDS) sets ~90 cells, and labels() builds and locks a lookup per
        call: 1.17 ms a publish of 90 cells on the dev CPU with it, 0.30 without (benchmarks/
        bench_calibration_publish.py, results/calibration_publish_cpu*.json); under cProfile 8% of `auto`'s whole
        per-round host block before, 3% after (results/auto_round_host_cpu*.json)."""
        children = self._cal_children.get(key)
        if children is None:
            cell = dict(zip(mn.CALIBRATION_CELL, key))
            children = self._cal_children[key] = (self._cal_ratio.labels(**self._auto_labels, **cell),
                                                  self._cal_obs.labels(**self._auto_labels, **cell))
        return children

    def observe(self, totals: list[float], rounds_seen: int, stage_ms: list[dict[str, float]]) -> None:
        """totals: summed round vectors (see DDTreeStats._queue_summary)."""
        n = self.depth_limit
        by_accepted = totals[self._by_accepted]  # request-rounds by accepted draft tokens 0..n
        branches, nodes, expected, requests = (totals[i] for i in self._at)
        if requests:
            self.rounds.inc(requests)
            self.accepted.inc(committed_tokens(by_accepted))
            for a, c in enumerate(by_accepted):
                if c:
                    self.accept_length[a].inc(c)
            reached = 0.0
            for d in range(n, 0, -1):
                reached += by_accepted[d]
                if reached:
                    self.depth_reached[d - 1].inc(reached)
            if branches:
                self.branch.inc(branches)
            self.expected.inc(expected)
            self.tree_nodes.inc(nodes)
        for round_ms in stage_ms:
            for name, ms in round_ms.items():
                (self.host if name == "host" else self.stage[name]).observe(ms / 1e3)
