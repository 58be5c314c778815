"""Per-round DDTREE statistics in the scheduler process: Prometheus metrics and JSONL debug dumps.

Without --enable-metrics and without --speculative-ddtree-debug nothing here touches the GPU.
With metrics, each round copies a few numbers per request to pinned host memory asynchronously (no host sync);
they are folded into the Prometheus series a round or more later, once their CUDA event has completed.
With the debug dump, every round synchronises and writes the whole tree: a debugging tool, not for serving.

Metric names (all `sglang:ddtree_*`, label `budget`):
  accept_length (histogram, tokens committed per request per round, incl. the bonus),
  rounds_total, accepted_tokens_total, depth_reached_total{depth} (rounds that accepted >= depth draft tokens,
  so per-depth acceptance = depth_reached_total / rounds_total), branch_accepted_total (accepted nodes that were
  not the drafter's top-1), tree_nodes (histogram of draft nodes per tree), expected_accept_length_sum (the
  drafter's own expectation: 1 + sum of node probabilities), stage_seconds{stage} (histogram per round).
"""

from __future__ import annotations

import collections
import logging

import torch

from sglang_ddtree.metrics import JsonlWriter, records_from_round

logger = logging.getLogger(__name__)


class RoundTimer:
    """CUDA events at stage boundaries; read only once the last one has completed (no sync)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.marks: list[tuple[str, torch.cuda.Event]] = []
        if enabled:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()

    def mark(self, stage: str) -> None:
        if self.enabled:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((stage, event))

    def done(self) -> bool:
        return not self.enabled or not self.marks or self.marks[-1][1].query()

    def elapsed_ms(self) -> dict[str, float]:
        out, prev = {}, getattr(self, "_start", None)
        for stage, event in self.marks:
            out[stage] = prev.elapsed_time(event)
            prev = event
        return out


class _Prometheus:
    def __init__(self, depth_limit: int, budget: int):
        from prometheus_client import Counter, Histogram  # imported here: SGLang sets the multiprocess dir first

        labels = {"budget": str(budget)}
        self.labels = labels
        names = list(labels)
        self.accept_length = Histogram("sglang:ddtree_accept_length", "Tokens committed per request per round "
                                       "(accepted draft tokens + bonus).", names,
                                       buckets=[float(x) for x in range(1, depth_limit + 2)]).labels(**labels)
        self.rounds = Counter("sglang:ddtree_rounds_total", "Request-rounds verified.", names).labels(**labels)
        self.accepted = Counter("sglang:ddtree_accepted_tokens_total", "Tokens committed (incl. bonus).",
                                names).labels(**labels)
        self.depth_reached = Counter("sglang:ddtree_depth_reached_total", "Request-rounds that accepted at least "
                                     "`depth` draft tokens.", names + ["depth"])
        self.branch = Counter("sglang:ddtree_branch_accepted_total", "Accepted draft tokens that were not the "
                              "drafter's top-1 at their depth.", names).labels(**labels)
        self.expected = Counter("sglang:ddtree_expected_accept_length_sum", "Sum over request-rounds of the "
                                "drafter's expected tokens per round (1 + sum of node probabilities).",
                                names).labels(**labels)
        self.tree_nodes = Histogram("sglang:ddtree_tree_nodes", "Draft nodes per tree (root excluded).", names,
                                    buckets=[1, 4, 16, 32, 64, 128, 256, 512, 1024]).labels(**labels)
        self.stage = Histogram("sglang:ddtree_stage_seconds", "Seconds per round by stage.", names + ["stage"],
                               buckets=[1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1])
        self.depth_limit = depth_limit

    def observe(self, summary: torch.Tensor, stage_ms: dict[str, float]) -> None:
        # summary rows per request: [accept_len, branches, tree_nodes, expected_accept]
        for accept_len, branches, nodes, expected in summary.tolist():
            self.accept_length.observe(accept_len + 1)
            self.rounds.inc()
            self.accepted.inc(accept_len + 1)
            for depth in range(1, int(accept_len) + 1):
                self.depth_reached.labels(**self.labels, depth=str(depth)).inc()
            if branches:
                self.branch.inc(branches)
            self.expected.inc(expected)
            self.tree_nodes.observe(nodes)
        for stage, ms in stage_ms.items():
            self.stage.labels(**self.labels, stage=stage).observe(ms / 1e3)


class DDTreeStats:
    def __init__(self, *, enable_metrics: bool, debug_path: str | None, depth_limit: int, budget: int):
        self.enabled = enable_metrics or debug_path is not None
        self.budget = budget
        self.prometheus = _Prometheus(depth_limit, budget) if enable_metrics else None
        self.debug = JsonlWriter(debug_path, header={"budget": budget, "depth_limit": depth_limit}) \
            if debug_path else None
        self.pending: collections.deque = collections.deque()
        self.round_index = 0

    def round_timer(self) -> RoundTimer:
        return RoundTimer(self.enabled)

    def record_round(self, tree, walk, timer: RoundTimer, batch_size: int) -> None:
        self.round_index += 1
        if not self.enabled:
            return
        if self.prometheus is not None:
            self._queue_summary(tree, walk, timer)
            self._drain()
        if self.debug is not None:
            torch.cuda.synchronize()
            stage_ms = timer.elapsed_ms()
            for b, record in enumerate(records_from_round(tree, walk, budget=self.budget, stage_ms=stage_ms)):
                n = int(tree.num_nodes[b])
                self.debug.write({
                    "round": self.round_index, "request": b, "batch_size": batch_size, **record.to_json(),
                    "tree_tokens": tree.tokens[b, :n], "tree_parents": tree.parents[b, :n],
                    "tree_scores": tree.scores[b, :n], "target_choice": walk.target_choice[b, :n],
                    "path": walk.path[b, : record.accept_len], "out_tokens": walk.out_tokens[b, : record.accept_len],
                })

    def _queue_summary(self, tree, walk, timer: RoundTimer) -> None:
        ranks_on_path = tree.ranks.gather(1, walk.path.clamp(min=0))[:, 1:]
        on_path = walk.path[:, 1:] >= 0
        branches = ((ranks_on_path > 0) & on_path).sum(dim=1)
        draft_valid = tree.valid.clone()
        draft_valid[:, 0] = False
        expected = 1.0 + torch.where(draft_valid, tree.scores.exp(), 0.0).sum(dim=1)
        summary = torch.stack([walk.accept_len.float(), branches.float(), (tree.num_nodes - 1).float(), expected],
                              dim=1)
        host = torch.empty(summary.shape, dtype=summary.dtype, pin_memory=True)
        host.copy_(summary, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.pending.append((event, host, timer))

    def _drain(self) -> None:
        while self.pending and self.pending[0][0].query() and self.pending[0][2].done():
            _, host, timer = self.pending.popleft()
            try:
                self.prometheus.observe(host, timer.elapsed_ms())
            except Exception:  # metrics must never take the server down
                logger.exception("DDTREE metrics update failed")
