"""Per-round DDTREE statistics in the scheduler process: Prometheus metrics and JSONL debug dumps.

Without --enable-metrics and without --speculative-ddtree-debug nothing here touches the GPU.
With metrics, each round copies a few numbers per request to pinned host memory asynchronously (no host sync);
they are folded into the Prometheus series a round or more later, once their CUDA event has completed.
With the debug dump, every round synchronises and writes the whole tree: a debugging tool, not for serving.
Its lines: a header {type, budget, depth_limit}, then one line per (round, batch row) with the request's `rid`,
`prompt_len`, `seq_len` and `output_tokens_before` (so rounds can be attributed to requests and output positions;
sglang_ddtree/sglang_baseline.py turns them into a baseline file), the round record (metrics.RoundRecord) and the
tree (tokens, parents, scores, ranks), the target's choices, the accepted path and the emitted tokens.

The Prometheus series: prometheus.py; their names and the round summary vector's layout: metric_names.py.
"""

from __future__ import annotations

import collections
import logging
import time

import torch

from sglang_ddtree import config
from sglang_ddtree.metric_names import AB_FIELDS, SUMMARY_FIELDS, SummaryLayout
from sglang_ddtree.metrics import JsonlWriter, records_from_round
from sglang_ddtree.sglang.prometheus import PrometheusSeries, committed_tokens
from sglang_ddtree.stages import STAGES

logger = logging.getLogger(__name__)


_HAS_CUDA: bool | None = None


def _current_stream():
    """The current CUDA stream; None without CUDA (the CPU tests fake the events). Whether CUDA exists is asked
    once per process."""
    global _HAS_CUDA
    if _HAS_CUDA is None:
        _HAS_CUDA = torch.cuda.is_available()
    return torch.cuda.current_stream() if _HAS_CUDA else None


class RoundTimer:
    """CUDA events at stage boundaries; read only once the last one has completed (no sync).

    `previous_end` is the last event of the previous decode round, when that round was the batch just before
    this one: the time from it to this round's start is reported as `between` (see sglang_ddtree.stages).
    `host_ms` is the host's own time in the round (first to last mark): above the GPU time per round, the
    round is host-bound. With `ranges`, each stage is also a torch.profiler range `ddtree:<stage>`, so a
    profiler trace (SGLang's /start_profile) attributes host time and launched kernels to stages."""

    def __init__(self, enabled: bool, previous_end: torch.cuda.Event | None = None, ranges: bool = False):
        self.enabled = enabled
        self.marks: list[tuple[str, torch.cuda.Event]] = []
        self._previous_end = previous_end
        self._host_start = time.perf_counter()
        self.host_ms: float | None = None
        self._host_marks: list[tuple[str, float]] = []  # (stage, perf_counter) at every mark, host-only ones too
        self._elapsed: dict[str, float] | None = None
        self._range = None
        # SGLANG_DDTREE_AUTO_AB: the round's arm ("auto" / "fixed"; None without the A/B) and whether it did
        # one-time work (graph captures, verify-state builds), both set by the worker before record_round
        self.arm: str | None = None
        self.cold = False
        # ... and, for the tallies' split of an arm's rounds, whether the round sampled (computed `auto`'s
        # expectations) and whether it verified the widest tree (the fixed arm's; False for `auto`'s narrower picks)
        self.sampled = False
        self.widest = True
        # The round's stream, looked up once: Event.record() without one looks it up per call through several
        # Python layers (a batch-4 host profile: ~8 such lookups a round more than DFLASH's, ~120 us a
        # batch under cProfile); the worker stays on one stream for the whole round.
        self.stream = _current_stream() if enabled else None
        if enabled:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record(self.stream)
        if ranges:
            self._open_range(STAGES[0])

    def _open_range(self, stage: str) -> None:
        self._range = torch.autograd.profiler.record_function(f"ddtree:{stage}")
        self._range.__enter__()

    def mark(self, stage: str, following: str | None = None) -> None:
        """The end of `stage`. following: the stage the round marks next when it is not the next in STAGES (`auto`'s
        lean chain round has no tree stage): only the profiler range's name reads it."""
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
            if following is None:
                after = STAGES.index(stage) + 1 if stage in STAGES else len(STAGES)
                following = STAGES[after] if after < len(STAGES) else None
            if following is not None:
                self._open_range(following)
        if self.enabled:
            event = torch.cuda.Event(enable_timing=True)
            event.record(self.stream)
            self.marks.append((stage, event))
            now = time.perf_counter()
            self._host_marks.append((stage, now))
            self.host_ms = 1e3 * (now - self._host_start)

    def host_mark(self, stage: str) -> None:
        """A host-only boundary (no CUDA event): the host's time from the previous mark is added to `stage`
        (host_stage_ms; a stage may be marked more than once), the next GPU stage's time is unchanged. `auto` marks
        `draft` (the round's preparation) and then `choose` (its chooser block, before the draft forward), so that
        its draft host time means what a fixed-budget round's does."""
        if self.enabled:
            self._host_marks.append((stage, time.perf_counter()))

    def host_stage_ms(self, end: float | None = None) -> dict[str, float]:
        """The host's ms per stage of the worker's round call: from the timer's creation (or the previous mark) to
        each mark, and `after` from the last mark to `end` (perf_counter; the end of the round call). Pure host
        times: readable at once, no CUDA event involved."""
        out, prev = {}, self._host_start
        for stage, t in self._host_marks:
            out[stage] = out.get(stage, 0.0) + 1e3 * (t - prev)
            prev = t
        if end is not None and self._host_marks:
            out["after"] = 1e3 * (end - prev)
        return out

    def ab_counted(self) -> bool:
        """Whether the round counts in the A/B tallies (ABTallies): it has an arm, did no one-time work, and
        directly followed another decode round (its time then runs from that round's end: `between` included)."""
        return self.arm is not None and self.enabled and not self.cold and self._previous_end is not None

    @property
    def end_event(self) -> torch.cuda.Event | None:
        return self.marks[-1][1] if self.marks else None

    def done(self) -> bool:
        # elapsed_ms() runs only once done: when the metrics' drain (or `auto`'s) already read the times, the cache
        # answers without a CUDA call
        return not self.enabled or not self.marks or self._elapsed is not None or self.marks[-1][1].query()

    def elapsed_ms(self) -> dict[str, float]:
        """Each stage's ms (and `between`), once done(). Computed once: the metrics and `auto`'s feedback both read
        every round's, and each elapsed_time is a CUDA call (~6 a round). Callers must not change the dict."""
        if self._elapsed is not None:
            return self._elapsed
        out, prev = {}, getattr(self, "_start", None)
        if self._previous_end is not None and prev is not None:
            out["between"] = self._previous_end.elapsed_time(prev)
        for stage, event in self.marks:
            out[stage] = prev.elapsed_time(event)
            prev = event
        self._elapsed = out
        return out


class StallDetector:
    """Which decode rounds stalled on the host (a Triton compile outside a capture, a first allocation, a long GC
    pause: ~300-500 ms against a round's few ms): like a capture round, its tokens count and its time does not. The
    limit is the larger of floor_ms and factor x the median host time of the last `window` rounds (re-read every
    window / 4 rounds), so a server whose every round is long on the host does not call them all stalled."""

    def __init__(self, floor_ms: float = 50.0, factor: float = 10.0, window: int = 32):
        if floor_ms <= 0 or factor <= 1 or window < 4:
            raise ValueError("a stall limit needs floor_ms > 0, factor > 1 and window >= 4.")
        self.floor_ms, self.factor = floor_ms, factor
        self.recent: collections.deque = collections.deque(maxlen=window)
        self.limit_ms = floor_ms
        self._every = window // 4
        self._since = 0
        self.stalls = 0

    def stalled(self, host_ms: float | None) -> bool:
        if host_ms is None:
            return False
        out = host_ms > self.limit_ms
        self.stalls += out
        self.recent.append(host_ms)
        self._since += 1
        if self._since >= self._every:
            self._since = 0
            xs = sorted(self.recent)
            self.limit_ms = max(self.floor_ms, self.factor * xs[len(xs) // 2])
        return out


class TableGauges:
    """`auto`'s calibration table (adaptive.ScoreCalibrator) as Prometheus gauges without a host sync: every EVERY
    rounds, if SECONDS passed since the last one started, its summary is copied to pinned memory, and published the
    round after the copy completed. A publish sets every cell's two gauges (~180 sets, ~0.4 ms on the dev CPU); a
    dashboard reads them on a scale of seconds. restart() (a reset of the table) publishes at once, and the check
    EVERY rounds later publishes whatever the clock says: whoever reset the table wants to see it learn again."""

    EVERY = 64
    SECONDS = 10.0

    def __init__(self, calibrator, prometheus):
        self.calibrator, self.prometheus = calibrator, prometheus
        pin = calibrator.device.type == "cuda"
        self._snapshot = torch.zeros((3, *calibrator.config.shape[:3]), dtype=torch.float64, pin_memory=pin)
        self._pending = None  # the snapshot copy's event (True on CPU) while one is in flight
        self._rounds = 0
        self._last = None  # time.monotonic() when the last snapshot started (None: none yet)

    def after_round(self) -> None:
        self._rounds += 1
        if self._pending is not None and (self._pending is True or self._pending.query()):
            self.publish(self._snapshot)
            self._pending = None
        if self._pending is None and self._rounds % self.EVERY == 0:
            now = time.monotonic()
            if self._last is not None and now - self._last < self.SECONDS:
                return
            self._last = now
            self._snapshot.copy_(self.calibrator.summary(), non_blocking=True)
            if self._snapshot.is_pinned():
                self._pending = torch.cuda.Event()
                self._pending.record()
            else:
                self._pending = True

    def restart(self) -> None:
        self._pending = self._last = None
        self._rounds = 0
        self.publish(self.calibrator.summary().cpu())

    def publish(self, summary: torch.Tensor) -> None:
        from sglang_ddtree.adaptive import summary_rows

        try:
            self.prometheus.calibration_table(summary_rows(summary, self.calibrator.config.prior_mass))
        except Exception:  # metrics must never take the server down
            logger.exception("DDTREE calibration metrics update failed")


def request_identity(reqs, seq_lens, batch_size: int) -> list[dict]:
    """Per batch row: the request id, its prompt length, the committed tokens before the round (prompt + output
    tokens but the last one: the round's root is the request's last output token, not yet in the KV cache) and
    the output tokens it had before the round (root's output position + 1). Debug dump only: reads seq_lens."""
    seq = seq_lens.tolist() if seq_lens is not None else [None] * batch_size
    out = []
    for b in range(batch_size):
        req = reqs[b] if reqs is not None and b < len(reqs) else None
        rid = getattr(req, "rid", None)
        prompt = getattr(req, "origin_input_ids", None)
        prompt_len = len(prompt) if prompt is not None else None
        seq_len = int(seq[b]) if b < len(seq) and seq[b] is not None else None
        before = seq_len - prompt_len + 1 if seq_len is not None and prompt_len is not None else None
        out.append({"rid": rid, "prompt_len": prompt_len, "seq_len": seq_len, "output_tokens_before": before})
    return out


def branch_counts(tree, walk) -> torch.Tensor:
    """[bs] int32: accepted draft tokens of each request's path this round that were not the drafter's top-1 at
    their depth (rank > 0). The worker hands it to SGLang as the round's per-request `cap_lens` (see plugin)."""
    ranks_on_path = tree.ranks.gather(1, walk.path.clamp(min=0))[:, 1:]
    return ((ranks_on_path > 0) & (walk.path[:, 1:] >= 0)).sum(dim=1).to(torch.int32)


def round_summary_vector(tree, walk, branch_lens: torch.Tensor | None = None,
                         rows: torch.Tensor | None = None) -> torch.Tensor:
    """A round's numbers summed over the batch, on the tree's device, with no host sync (tests/gpu checks it), in
    metric_names.SummaryLayout: request-rounds by accepted draft tokens 0..L, then SUMMARY_FIELDS (branches, draft
    nodes, expected tokens, requests).
    branch_lens: branch_counts(tree, walk) when the caller has it already. rows: the real requests (0-dim tensor)
    of a batch padded past them (graphs.GraphedStage); None: every request is real."""
    n = tree.depth_limit
    branch_lens = branch_counts(tree, walk) if branch_lens is None else branch_lens
    expected = tree.expected_tokens()
    nodes = tree.num_nodes - 1
    if rows is None:
        counted = torch.ones_like(walk.accept_len, dtype=torch.float32)
        branches, nodes, expected = branch_lens.sum(), nodes.sum(), expected.sum()
        requests = expected.new_full((), float(tree.batch_size))
    else:  # a padded batch: the first `rows` requests only (selected, so no padding value can leak in)
        live = torch.arange(tree.batch_size, device=tree.valid.device) < rows
        counted = live.to(torch.float32)
        branches = torch.where(live, branch_lens, 0).sum()
        nodes = torch.where(live, nodes, 0).sum()
        expected = torch.where(live, expected, 0.0).sum()
        requests = counted.sum()
    # not torch.bincount: on CUDA it reads the input's max back to size its output, a host sync every round
    by_accepted = torch.zeros(n + 1, dtype=torch.float32, device=walk.accept_len.device).scatter_add_(
        0, walk.accept_len.clamp(0, n), counted)
    extra = {"branches": branches.float(), "nodes": nodes.float(), "expected": expected, "requests": requests}
    return torch.cat([by_accepted, torch.stack([extra[field] for field in SUMMARY_FIELDS])])


class ABTallies:
    """SGLANG_DDTREE_AUTO_AB: per arm, sums over the rounds that count (RoundTimer.ab_counted), published as
    Prometheus counters every FLUSH_ROUNDS rounds (sums kept in Python floats between: a counter update is a few
    microseconds, and both arms pay the same). A round's tokens and GPU time arrive with its feedback (DDTreeStats'
    drain, a round or two late), its host time at the end of its call (finish_round): two round counts, so each
    mean divides by its own.
    Why the GPU timeline: chained round to round, a round's stages add up to the time from the previous round's end
    to its own (sglang_ddtree.stages), so over the rounds that count the sum is the decode time they took, host-bound
    or not; a round after a prefill or idle batch has no `between` and does not count, nor one that captured graphs."""

    FIELDS = AB_FIELDS
    FLUSH_ROUNDS = 8

    def __init__(self, prometheus, depth_limit: int):
        self.prometheus = prometheus
        self.depth_limit = depth_limit
        layout = SummaryLayout(depth_limit)
        self._requests_at, self._by_accepted = layout.index("requests"), layout.by_accepted
        self.sums: dict[str, dict[str, float]] = {}
        self.host_stage: dict[str, dict[str, float]] = {}
        self._unflushed = 0

    def _arm(self, arm: str) -> dict[str, float]:
        sums = self.sums.get(arm)
        if sums is None:
            sums = self.sums[arm] = dict.fromkeys(self.FIELDS, 0.0)
            self.host_stage[arm] = {}
        return sums

    def round_done(self, timer: RoundTimer, values: list[float]) -> None:
        """A completed round's summary vector (round_summary_vector) and timer."""
        sums = self._arm(timer.arm)
        if timer.ab_counted():
            request_rounds, tokens = values[self._requests_at], committed_tokens(values[self._by_accepted])
            seconds = sum(timer.elapsed_ms().values()) / 1e3
            sums["rounds"] += 1
            sums["request_rounds"] += request_rounds
            sums["tokens"] += tokens
            sums["seconds"] += seconds
            if timer.sampled:
                sums["sampled_rounds"] += 1
                sums["sampled_seconds"] += seconds
            if not timer.widest:
                sums["narrower_rounds"] += 1
                sums["narrower_seconds"] += seconds
                sums["narrower_tokens"] += tokens
                sums["narrower_request_rounds"] += request_rounds
        else:
            sums["skipped_rounds"] += 1
        self._unflushed += 1
        if self._unflushed >= self.FLUSH_ROUNDS:
            self.flush()

    def host_done(self, timer: RoundTimer, stage_ms: dict[str, float]) -> None:
        """A round call's host time per stage (RoundTimer.host_stage_ms), at its end."""
        if not timer.ab_counted():
            return
        sums = self._arm(timer.arm)
        sums["host_rounds"] += 1
        sums["host_seconds"] += sum(stage_ms.values()) / 1e3
        stages = self.host_stage[timer.arm]
        for name, ms in stage_ms.items():
            stages[name] = stages.get(name, 0.0) + ms / 1e3

    def flush(self) -> None:
        if self.prometheus is not None:
            try:
                for arm, sums in self.sums.items():
                    self.prometheus.ab(arm, sums, self.host_stage[arm])
            except Exception:  # metrics must never take the server down
                logger.exception("DDTREE A/B metrics update failed")
        self.sums, self.host_stage, self._unflushed = {}, {}, 0


class DDTreeStats:
    RING = 256  # rounds whose numbers may be in flight to the host
    # Publish every completed round. Batching 16 rounds saved host time but let a workload's Prometheus diff
    # receive rounds of the one before (a server's warm-up rounds, JIT compiles included, landed in the
    # first measured workload's stage means); now at most the one or two rounds still in flight spill over.
    FLUSH_ROUNDS = 1
    # Host stage times are published in sums of this many rounds (eight counters a flush): a workload's scrape can
    # miss its last few rounds' host times, never mix a round's stages (sums and their round count go together).
    HOST_FLUSH_ROUNDS = 8

    def __init__(self, *, enable_metrics: bool, debug_path: str | None, depth_limit: int, budget: int,
                 timing: bool = False, budget_label: str | None = None):
        """timing: time the stages even without metrics or dump (`auto` learns round times from them).
        budget_label: the Prometheus `budget` label and dump header value instead of the number (`auto`)."""
        self.enabled = enable_metrics or debug_path is not None or timing
        self.budget = budget
        label = budget_label or budget
        self.prometheus = PrometheusSeries(depth_limit, label) if enable_metrics else None
        self.debug = JsonlWriter(debug_path, header={"budget": label, "depth_limit": depth_limit}) \
            if debug_path else None
        self.pending: collections.deque = collections.deque()
        self.round_index = 0
        self.ring_index = 0
        self.dropped_rounds = 0
        self.totals: list[float] | None = None
        self.rounds_seen = 0
        self.stage_ms: list[dict[str, float]] = []
        self._last_round_end: torch.cuda.Event | None = None
        self._host_totals: dict[str, float] = {}
        self._host_rounds = 0
        self.ab = ABTallies(self.prometheus, depth_limit)  # SGLANG_DDTREE_AUTO_AB: fed by rounds with an arm only
        # Profiler ranges per stage (a few microseconds of host time per round): for profiling runs only.
        self.profile_ranges = config.get("SGLANG_DDTREE_PROFILE_RANGES")
        width = SummaryLayout(depth_limit).width
        self.ring = [torch.empty(width, dtype=torch.float32, pin_memory=True) for _ in range(self.RING)] \
            if enable_metrics else []

    def round_timer(self) -> RoundTimer:
        timer = RoundTimer(self.enabled, previous_end=self._last_round_end, ranges=self.profile_ranges)
        self._last_round_end = None
        return timer

    def finish_round(self, timer: RoundTimer) -> None:
        """The end of the worker's decode round call: its host time per stage (HOST_STAGES) is added to running
        sums, published every HOST_FLUSH_ROUNDS rounds (host times need no CUDA event, so this round's are final)."""
        if self.prometheus is None or not timer.enabled:
            return
        stage_ms = timer.host_stage_ms(time.perf_counter())
        for name, ms in stage_ms.items():
            self._host_totals[name] = self._host_totals.get(name, 0.0) + ms
        if timer.arm is not None:
            self.ab.host_done(timer, stage_ms)
        self._host_rounds += 1
        if self._host_rounds >= self.HOST_FLUSH_ROUNDS:
            try:
                self.prometheus.host_stages(self._host_totals, self._host_rounds)
            except Exception:  # metrics must never take the server down
                logger.exception("DDTREE metrics update failed")
            self._host_totals, self._host_rounds = {}, 0

    def other_batch(self) -> None:
        """A prefill or idle batch ran: the next decode round's `between` would count it, so it has none."""
        self._last_round_end = None

    def _count_round(self, timer: RoundTimer, tree=None, walk=None, summary: torch.Tensor | None = None) -> bool:
        """What every decode round records: its index, the timer chain (`between`), the counters. False when the
        stats are off."""
        self.round_index += 1
        if not self.enabled:
            return False
        self._last_round_end = timer.end_event
        if self.prometheus is not None:
            self._queue_summary(tree, walk, timer, summary)
            self._drain()
        return True

    def record_round(self, tree, walk, timer: RoundTimer, batch_size: int, reqs=None, seq_lens=None,
                     summary: torch.Tensor | None = None, extra: dict | None = None) -> None:
        """reqs (the batch's SGLang requests, row order) and seq_lens (committed tokens per row before the round,
        a device tensor) are read only by the debug dump, after its sync: the default path never touches them.
        summary: round_summary_vector(tree, walk) when the caller computed it already (inside a graph).
        extra: fields added to every dump row of the round (`auto`: the verified candidate)."""
        if not self._count_round(timer, tree, walk, summary):
            return
        if self.debug is not None:
            if tree.tokens.is_cuda:
                torch.cuda.synchronize()
            stage_ms = timer.elapsed_ms()
            identity = request_identity(reqs, seq_lens, tree.batch_size)
            budget = tree.tokens.shape[1] - 1  # the verified tree's (`auto`: the round's candidate)
            for b, record in enumerate(records_from_round(tree, walk, budget=budget, stage_ms=stage_ms)):
                n = int(tree.num_nodes[b])
                self.debug.write({
                    "round": self.round_index, "request": b, "batch_size": batch_size, **identity[b], **(extra or {}),
                    **record.to_json(),
                    "tree_tokens": tree.tokens[b, :n], "tree_parents": tree.parents[b, :n],
                    "tree_scores": tree.scores[b, :n], "tree_ranks": tree.ranks[b, :n],
                    "target_choice": walk.target_choice[b, :n],
                    "path": walk.path[b, : record.accept_len], "out_tokens": walk.out_tokens[b, : record.accept_len],
                })

    def dump_state(self, kind: str, state: dict, every: int) -> None:
        """A `{"type": kind, "round": n, ...state}` line in the debug dump every `every` decode rounds (`auto`: the
        chooser's table). Readers skip lines without a request id."""
        if self.debug is not None and self.round_index % every == 0:
            self.debug.write({"type": kind, "round": self.round_index, **state})

    def _queue_summary(self, tree, walk, timer: RoundTimer, summary: torch.Tensor | None = None) -> None:
        """One small vector per round, summed over the batch on the GPU, copied without a sync."""
        if len(self.pending) >= self.RING:  # the host fell behind: skip this round's numbers rather than block
            self.dropped_rounds += 1
            if timer.arm is not None:
                timer.cold = True  # nor its host time: the arm's two round counts stay one set of rounds
                self.ab._arm(timer.arm)["skipped_rounds"] += 1
            return
        slot = self.ring[self.ring_index % self.RING]
        self.ring_index += 1
        slot.copy_(summary if summary is not None else round_summary_vector(tree, walk), non_blocking=True)
        event = torch.cuda.Event()
        event.record(getattr(timer, "stream", None))
        self.pending.append((event, slot, timer))

    def _drain(self) -> None:
        """Fold completed rounds into running sums; publish them every FLUSH_ROUNDS rounds."""
        while self.pending and self.pending[0][0].query() and self.pending[0][2].done():
            _, slot, timer = self.pending.popleft()
            values = slot.tolist()
            self.totals = values if self.totals is None else [a + b for a, b in zip(self.totals, values)]
            self.rounds_seen += 1
            if timer.enabled and timer.marks:
                self.stage_ms.append({**timer.elapsed_ms(), "host": timer.host_ms})
            if timer.arm is not None:
                self.ab.round_done(timer, values)
        if self.totals is not None and self.rounds_seen >= self.FLUSH_ROUNDS:
            try:
                self.prometheus.observe(self.totals, self.rounds_seen, self.stage_ms)
            except Exception:  # metrics must never take the server down
                logger.exception("DDTREE metrics update failed")
            self.totals, self.rounds_seen, self.stage_ms = None, 0, []
