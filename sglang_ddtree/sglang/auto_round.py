"""`--speculative-ddtree-budget auto` inside the DDTREE worker: the per-candidate stages, the choice before the
draft, the bookkeeping after the commit, and the captures of a batch-size bucket's stage graphs.

The policy itself (what to choose, from which feedback) is sglang_ddtree.sglang.auto; this module is the worker's
side of it. Each round first picks a candidate budget on the host; its tree and walk stages are the candidate's
own, and the verify swaps in the target attention backend and verify graphs captured for that width (the chain's
without the tree mask); every candidate's stage graphs are captured together after a batch-size bucket's first
round (capture_bucket), not one by one as the chooser reaches them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from functools import partial

import torch

from sglang_ddtree import kernels
from sglang_ddtree.adaptive import CHAIN, PLAIN, CalibratorConfig, ScoreCalibrator, candidate_label, drafted
from sglang_ddtree.graphs import GraphedStage
from sglang_ddtree.sglang import ops
from sglang_ddtree.sglang.auto import (AutoBudgetPolicy, AutoFeedback, CalibrationMonitor, WalkSchedule,
                                      auto_config)
from sglang_ddtree.sglang.round_state import Round

logger = logging.getLogger(__name__)


@dataclass
class AutoRounds:
    """Per candidate index its verify width and graphed stages; the extra verify states by width; the host policy
    and its GPU -> host feedback; the calibration table's host side (the table lives on the GPU: the scored walk
    stages score its predictions and compute what it learns)."""

    candidates: tuple[int, ...]
    widths: list[int]
    tree_stages: list[dict[bool, GraphedStage]]  # [candidate][sampled]; PLAIN (no draft): none
    walk_stages: list[dict[str, GraphedStage]]  # [candidate][WalkSchedule.VARIANTS entry]; the chain: no scored ones
    verify_states: dict | None  # (width, causal) -> (attention backend, verify graphs), built at the first round
    policy: AutoBudgetPolicy
    feedback: AutoFeedback
    calibration: CalibrationMonitor
    no_calibration: torch.Tensor  # the feedback vector's calibration entries of a round that scored nothing
    log_every: int = 2000
    rounds: int = 0
    seen: set = field(default_factory=set)  # (bucket, candidate index) pairs that ran once
    captured_buckets: set = field(default_factory=set)  # buckets whose stages were all captured (capture_bucket)
    late_captures: int = 0  # stage captures in rounds after their bucket's capture_bucket (expected: none)
    lean_chain_rounds: int = 0  # chain rounds that ran DDTreeWorker._chain_round
    walks: WalkSchedule = field(default_factory=WalkSchedule)  # which walk stage variant a round runs

    @classmethod
    def build(cls, w) -> "AutoRounds":
        """Per candidate, a tree stage (tree at the largest budget, the chosen candidate's tree, every candidate's
        expected tokens), a walk stage, and for every verify width other than the largest (which SGLang captured:
        speculative_num_draft_tokens = largest + 1) its own target attention backend and verify CUDA graphs
        (ensure_verify_states), swapped in around the verify (DDTreeWorker._verify)."""
        candidates = tuple(w.options.candidates)
        widths = [1 if c == PLAIN else w.block_size if c == CHAIN else c + 1 for c in candidates]
        # the candidates whose rounds draft: a sampled tree stage computes their expectations, a sampled walk their
        # observed tokens, in this order (auto.AutoFeedback maps them back to the policy's candidates)
        staged = tuple(drafted(candidates))
        if max(widths) != w.num_nodes:
            raise ValueError(f"DDTREE auto: the largest verify width {max(widths)} must be the server's "
                             f"{w.num_nodes} (the drafter block is {w.block_size}).")
        tree_stages, walk_stages = [], []
        pad = w._pad
        # The calibration table learns from the scored sampled tree rounds' walks (auto.WalkSchedule: one in
        # calibration_every, every one while the table is young) and predicts its committed tokens next to the raw
        # scores (both scored and exported: CalibrationMonitor). Not from chain rounds: a chain teaches only the
        # top-1 cells, which every tree's first path teaches too, and the scoring is ~140 small kernels. The choice
        # stays on raw expectations times each candidate's observed / expected ratio (auto.py): feeding the table's
        # expectations to the chooser cost every sampled tree stage the table's work and measured slower on the
        # tiny pair, with no gain projected offline for calibrated choices (docs/adaptive-budget.md).
        config = auto_config(w.options.auto_calibration)
        walks = WalkSchedule(config)
        calibrator = ScoreCalibrator(CalibratorConfig(depth_limit=w.depth_limit), device=w.device)
        for c in candidates:
            if c == PLAIN:  # a round without a draft builds no tree and walks none (DDTreeWorker._plain_round)
                tree_stages.append({})
                walk_stages.append({})
                continue
            tree_stages.append({sampled: GraphedStage(
                partial(ops.auto_tree_stage, w.budget, c, staged, w.options.prune, w.use_kernels, sampled),
                name=f"auto tree {candidate_label(c)}{' sampled' if sampled else ''}", enabled=w.round_graphs,
                borrow=(0, 1), unpad=ops.unpad_tree_stage, rows_arg=w.round_graphs, **pad)
                for sampled in (True, False)})
            # walk stages after a tree stage: a stage borrows its inputs from exactly one producer (graphs.py). Only
            # a sampled walk computes the candidates' observed tokens (ops.observed_tokens, 36 kernels at the
            # 128-tree): the policy reads them next to the same round's expectations only (AutoFeedback.push); only
            # a scored one the calibration's (WalkSchedule, calibration_every), and the learn variant (an unsampled
            # round's scoring while the table learns all) follows the unsampled tree stage, whose outputs it borrows.
            # The chain is not scored.
            walk_stages.append({variant: GraphedStage(
                partial(ops.walk_commit_plan, w.block_size, w.use_kernels, w.stats.prometheus is not None,
                        auto=(staged, c) if variant in WalkSchedule.SAMPLED_TREE else None, top1_chain=c == CHAIN,
                        calibrator=calibrator if variant in WalkSchedule.SCORED else None),
                name=f"auto walk {candidate_label(c)}{'' if variant == 'plain' else ' ' + variant}",
                enabled=w.round_graphs, borrow=(0, 1, 2, 3, 4, 5), unpad=ops.unpad_commit_plan,
                rows_arg=w.round_graphs, **pad)
                for variant in walks.variants(c == CHAIN)})
        policy = AutoBudgetPolicy(list(candidates), widths=widths, config=config)
        # verify_states are built at the first decode round: SGLang creates the target's attention backend and
        # verify graphs after the speculative worker (no `attn_backend` on the target runner yet here).
        calibration = CalibrationMonitor(calibrator, w.stats.prometheus, config)
        return cls(candidates, widths, tree_stages, walk_stages, None, policy,
                   AutoFeedback(policy, w.device, calibration), calibration,
                   torch.zeros(AutoFeedback.CALIBRATION, dtype=torch.float32, device=w.device),
                   log_every=config.log_every, walks=walks)

    def first_use(self, bucket: int, chosen) -> bool:
        """The first round of a candidate (index) at a batch-size bucket (eager paths compile kernels there)."""
        if (bucket, chosen) in self.seen:
            return False
        self.seen.add((bucket, chosen))
        return True

    def maybe_log(self, tp_rank: int) -> None:
        self.rounds += 1
        if tp_rank == 0 and self.rounds % self.log_every == 0:
            logger.info("DDTREE auto after %d rounds: %s", self.rounds,
                        {**self.policy.export(), "lean_chain_rounds": self.lean_chain_rounds,
                         "calibration": self.calibration.export()})

    # ------------------------------------------------------------------------------------------------------------
    # The round's parts

    def choose(self, w, r: Round) -> None:
        """Before the draft (a chain round that samples nothing needs only the top-1): the verify states at the first
        round, the round's bucket, candidate and whether it samples the expectations."""
        timer, detail = r.timer, w.modes.detail
        timer.host_mark("draft")  # the round's preparation so far is the draft's host time, as in a fixed round
        r.built = self.ensure_verify_states(w)
        r.bucket = bucket = w._auto_bucket(r.bs)
        detail(timer, "choose_prep")
        held = self.policy.held_round(bucket, self.rounds)  # a held choice reads nothing (AutoConfig.hold_rounds)
        detail(timer, "choose_held")
        if held is None:
            self.feedback.drain()
            detail(timer, "choose_drain")
            r.chosen = self.policy.choose(bucket)
            r.sampled = self.policy.sampled(self.rounds, bucket)
        else:
            r.chosen, r.sampled = held
        if self.candidates[r.chosen] == PLAIN:  # nothing drafted: no expectations to compute
            r.sampled = False
        timer.host_mark("choose")

    def tree(self, w, r: Round) -> None:
        """The chosen candidate's tree stage, and the walk stage variant that follows it."""
        if w.stats.prometheus is not None:
            w.stats.prometheus.auto_round(candidate_label(self.candidates[r.chosen]), r.bucket)
        r.width = self.widths[r.chosen]
        r.walk_variant = variant = self.walks.variant(self.candidates[r.chosen] == CHAIN, r.sampled, self.calibration)
        r.walk_stage = self.walk_stages[r.chosen][variant]
        w.modes.detail(r.timer, "tree_auto")
        r.tree, r.verify_ids, r.verify_positions, r.expected = self.tree_stages[r.chosen][r.sampled](
            r.topk_values, r.topk_tokens, r.roots, r.prefix_lens, rows=r.bs)
        r.causal = self.candidates[r.chosen] == CHAIN  # a chain needs no tree mask

    def after_tree_round(self, w, r: Round, stalled: bool) -> None:
        """A tree round's feedback: a sampled round sends its expectations, observed tokens and calibration scores
        (an unsampled round's walk computes no observed tokens: the policy reads them only next to the same round's
        expectations) and what the table learns; every round its time."""
        plan = r.plan
        scored = plan.calibration is not None
        vector = torch.cat([r.expected, plan.observed, plan.calibration if scored else self.no_calibration]) \
            if r.sampled else None
        w.modes.detail(r.timer, "after_cat")
        self.after_round(w, r, vector, plan.calibration_delta if scored else None, stalled)

    def after_round(self, w, r: Round, vector, calibration_delta, stalled: bool) -> None:
        """`auto`'s bookkeeping at a round's end: the feedback (vector: a sampled round's, else None), what the
        calibration table learns (calibration_delta: a scored round's, else None), the log; sets r.cold. A round
        that built verify states or captured stage graphs (first use of a candidate at a batch size) took one-time
        work: its tokens count, its time does not (such rounds made the first candidates explored look seconds
        slow); so did a round that stalled on the host (stalled: the round's StallDetector answer, asked once a
        round by the caller)."""
        timer, bucket, detail = r.timer, r.bucket, w.modes.detail
        captured = GraphedStage.total_captures != r.captures
        if captured and bucket in self.captured_buckets:
            self.late_captures += 1
            if w.ps.tp_rank == 0:
                logger.warning("DDTREE auto: a stage graph was captured in a round at batch-size bucket %d after "
                               "the bucket's stages were all captured (%d such rounds)", bucket, self.late_captures)
        r.cold = r.built or captured or self.first_use(bucket, r.chosen) or stalled
        self.feedback.push(vector, timer, bucket, r.chosen, r.bs, cold=r.cold, sampled=r.sampled,
                           young=self.calibration.young())
        detail(timer, "after_push")
        if calibration_delta is not None:  # the table learns now, in stream order before the next scored walk stage
            self.calibration.learn(calibration_delta, r.bs)
            detail(timer, "after_learn")
        self.calibration.after_round()
        self.maybe_log(w.ps.tp_rank)
        detail(timer, "after_auto")

    # ------------------------------------------------------------------------------------------------------------
    # One-time work

    def ensure_verify_states(self, w) -> bool:
        """Keyed (width, causal): the chain verifies causally (no custom mask, as DFLASH does), and so does a round
        without a draft (its one token), trees with the tree mask; the widest tree uses SGLang's own state. True
        when they were built now."""
        if self.verify_states is not None:
            return False
        keys = sorted({(width, c <= CHAIN) for c, width in zip(self.candidates, self.widths)}
                      - {(w.num_nodes, False)})
        self.verify_states = {key: w._build_verify_state(*key) for key in keys}
        if w.ps.tp_rank == 0:
            logger.info("DDTREE auto: verify states built for (width, causal) %s", keys)
        return True

    def capture_bucket(self, w, r: Round, choice_dtype) -> None:
        """After a batch-size bucket's first round: every candidate's tree and walk stages (sampled and not) and
        both draft heads are captured now, together, from this round's inputs, instead of at each one's first use.
        Why: exploration, probes and sampled rounds reach the candidates one by one over thousands of rounds, and
        each first use was a capture stalling that round (tiny pair at batch 4: 22 captures inside measured runs,
        the tree stage 1.75 ms a round on average against the fixed 128-tree's 0.15); one stall per bucket now, at
        its first round. Runs after everything the round returns was copied out of the stages' memory (their
        replays here overwrite it). The walks get the target choices of an all-zero verify (any token id will do:
        only the shapes are captured); the other inputs are the round's, padded as a real first use pads them
        (graphs.GraphedStage)."""
        batch, bucket, bs, prefix_lens = r.batch, r.bucket, r.bs, r.prefix_lens
        started = time.perf_counter()
        before = GraphedStage.total_captures
        heads = {k: w._draft_topk(r.draft_hidden, k) for k in {1, w.topk}}
        for i, candidate in enumerate(self.candidates):
            if candidate == PLAIN:  # no stages: its verify graphs are SGLang's (ensure_verify_states)
                continue
            width = self.widths[i]
            slots = w._verify_slots(batch, prefix_lens, bs, width)
            choices = torch.zeros((bs, width), dtype=choice_dtype, device=slots.device)
            for variant, walk_stage in self.walk_stages[i].items():
                sampled = variant in WalkSchedule.SAMPLED_TREE  # the tree stage this walk variant follows
                top1 = candidate == CHAIN and not sampled and w.modes.scripted is None  # as the round picks its head
                tree, _, _, _ = self.tree_stages[i][sampled](*heads[1 if top1 else w.topk], r.roots, prefix_lens,
                                                             rows=bs)
                walk_stage(tree.tokens, tree.parents, tree.depth, tree.scores, tree.ranks, tree.valid, choices, slots,
                           prefix_lens, rows=bs)
        if w.lean_chain and w.use_kernels:
            self._warm_chain_accept(w, bucket, prefix_lens)
        self.captured_buckets.add(bucket)
        w.stats.other_batch()  # the next round's `between` would hold these captures
        if w.ps.tp_rank == 0:
            logger.info("DDTREE auto: batch-size bucket %d: %d stage graphs captured together in %.0f ms", bucket,
                        GraphedStage.total_captures - before, 1e3 * (time.perf_counter() - started))

    @staticmethod
    def _warm_chain_accept(w, bucket: int, prefix_lens: torch.Tensor) -> None:
        """The lean chain round's accept kernel (eager: ops.chain_accept) launched once per compiled variant that the
        bucket's batch sizes reach (kernels.chain_accept_batch_sizes), on zeros into scratch buffers, so that no
        measured round compiles it (auto.STALL_HOST_MS)."""
        sizes = sorted(set(w._bucket_cache[1] if w._bucket_cache is not None else []) | {bucket})
        low = max([size for size in sizes if size < bucket], default=0) + 1
        block, device = w.block_size, prefix_lens.device
        for rows in kernels.chain_accept_batch_sizes(low, bucket):
            ids = torch.zeros((rows, block), dtype=torch.int64, device=device)
            logprobs = torch.zeros((rows, block - 1), dtype=torch.float32, device=device)
            lens = torch.zeros(rows, dtype=prefix_lens.dtype, device=device)
            ops.chain_accept(True, ids, ids, logprobs, lens,
                             ops.chain_outputs(rows, w.depth_limit, prefix_lens.dtype, device))

