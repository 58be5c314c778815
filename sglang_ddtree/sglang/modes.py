"""The seam through which the measuring and testing modes reach the DDTREE round (sglang/worker.py).

The round calls the same hooks whatever is on; with every mode off the worker holds a `RoundModes`, whose hooks do
nothing (a call each, no tensor work, no sync). `MeasuringModes` runs the ones that are on:
  - A/B arms (SGLANG_DDTREE_AUTO_AB=N, a measuring mode of an `auto` server): decode rounds alternate in blocks of
    N between `auto` and the fixed widest tree, each arm's tokens and time tallied apart (stats.ABTallies);
  - host detail (SGLANG_DDTREE_AUTO_HOST_DETAIL=1): `auto`'s own host work marked apart (stages.AUTO_HOST_DETAIL);
  - scripted drafts (SGLANG_DDTREE_TEST_SCRIPT, a test-only mode): the drafter's top-K replaced by a script;
  - the sequential oracle (--speculative-ddtree-oracle): the accepted path verified once more as a chain, and the
    round commits what that chain verify accepts;
  - the debug dump (--speculative-ddtree-debug): `auto`'s pick in every dump row, its tables every 100 rounds.
Profiling ranges (SGLANG_DDTREE_PROFILE_RANGES) live in the round's timer (stats.RoundTimer).
"""

from __future__ import annotations

import logging

from sglang_ddtree.adaptive import candidate_label
from sglang_ddtree.sglang import engine, ops
from sglang_ddtree.sglang.round_state import Round

logger = logging.getLogger(__name__)
# --speculative-ddtree-oracle: a log line (with a sync) every this many greedy request-rounds.
ORACLE_LOG = 200


class RoundModes:
    """No measuring or testing mode on: every hook does nothing."""

    scripted = None  # sglang.scripted.ScriptedDrafts with scripted drafts on
    oracle = None  # Oracle with the oracle on
    ab_block = 0  # the A/B's block length in rounds (0: off)
    host_detail = False

    def start(self, worker, r: Round) -> None:
        """The round starts (before `auto` chooses): its A/B arm; the oracle's verify state at the first round."""

    def detail(self, timer, stage: str) -> None:
        """A host-detail boundary inside `auto`'s own host work (timer.host_mark with host detail on)."""

    def drafts(self, r: Round) -> None:
        """The draft's top-K is known (scripted drafts replace it here)."""

    def before_verify(self, worker, r: Round) -> None:
        """The tree verify is next (the oracle keeps a hybrid target's conv state here)."""

    def after_walk(self, worker, r: Round) -> None:
        """The tree was walked (the oracle re-verifies the accepted path here and replaces what the round commits)."""

    def arm(self, worker, r: Round) -> None:
        """The round's A/B arm and kind, for the A/B tallies (stats.ABTallies, fed by record_round and finish_round)."""

    def dump_extra(self, worker, r: Round) -> dict | None:
        """Fields added to the round's debug-dump rows."""
        return None

    def dumped(self, worker, r: Round) -> None:
        """The round's dump rows were written (`auto`'s tables follow every 100 rounds)."""


class MeasuringModes(RoundModes):
    """The modes that are on (at least one): see the module docstring."""

    def __init__(self, *, ab=None, ab_block: int = 0, host_detail: bool = False, scripted=None, oracle=None,
                 debug: bool = False):
        self.ab, self.ab_block = ab, ab_block
        self.host_detail, self.scripted, self.oracle, self.debug = host_detail, scripted, oracle, debug

    def start(self, worker, r: Round) -> None:
        if self.ab_block:
            r.fixed_arm = self.ab.next_is_fixed()
        if self.oracle is not None:
            self.oracle.ensure_state(worker)

    def detail(self, timer, stage: str) -> None:
        if self.host_detail:
            timer.host_mark(stage)

    def drafts(self, r: Round) -> None:
        if self.scripted is not None:
            self.scripted.apply(getattr(r.batch, "reqs", None), r.batch.seq_lens, r.topk_values, r.topk_tokens)

    def before_verify(self, worker, r: Round) -> None:
        if self.oracle is not None:
            self.oracle.before_verify(worker, r)

    def after_walk(self, worker, r: Round) -> None:
        if self.oracle is not None:
            self.oracle.after_walk(worker, r)

    def arm(self, worker, r: Round) -> None:
        """The arm; whether the round did one-time work, sampled `auto`'s expectations and verified the widest
        tree (the fixed arm's; not the lean chain round)."""
        if self.ab_block:
            timer = r.timer
            timer.arm, timer.cold = ("fixed" if r.fixed_arm else "auto"), r.cold
            timer.sampled = r.use_auto and r.sampled
            timer.widest = not r.use_auto or (not r.lean and r.chosen == len(worker.auto.candidates) - 1)

    def dump_extra(self, worker, r: Round) -> dict | None:
        if not (self.debug and r.use_auto):
            return None
        return {"auto_candidate": candidate_label(worker.auto.candidates[r.chosen]), "auto_sampled": r.sampled,
                "auto_cold": r.cold, "auto_walk": r.walk_variant}

    def dumped(self, worker, r: Round) -> None:
        if self.debug and r.use_auto:
            worker.stats.dump_state("auto", worker.auto.policy.export(), every=100)
            worker.stats.dump_state("calibration", {**worker.auto.calibration.export(),
                                                    **worker.auto.calibration.calibrator.export()}, every=100)


class Oracle:
    """`--speculative-ddtree-oracle`: every round's accepted path is verified once more as a chain (causal, width
    `width`: the path's slots, root + at most L drafts and no more than the tree reserved), from the same pre-round
    state, and the round commits what that chain verify accepts. Its attention backend and graphs are built at the
    first decode round (SGLang builds the target's after the worker); the fast path's disagreements with it are a
    device counter, read every ORACLE_LOG request-rounds (a checking mode: its log line syncs)."""

    def __init__(self, width: int):
        self.width = width
        self.states = None  # {(width, causal): (attention backend, verify graphs)}
        self.differ = None
        self.checked = 0
        self._saved_conv = None

    def ensure_state(self, worker) -> None:
        if self.states is None:
            self.states = {(self.width, True): worker._build_verify_state(self.width, True)}

    def before_verify(self, worker, r: Round) -> None:
        self._saved_conv = self._snapshot_conv(worker, r.batch, r.bs) if worker.hybrid else None

    def after_walk(self, worker, r: Round) -> None:
        """Verify the tree walk's accepted nodes once more as a chain (causal, from the same pre-round state: the
        target's KV of those positions is rewritten, a hybrid's conv state restored from the copy taken before the
        tree verify, and its SSM state is not written by a verify) and walk that chain with the target's own
        choices there. The round then commits what the chain verify accepts (tokens, KV, drafter context,
        recurrent state), whatever the tree verify computed: the tree only proposes the path, so the output is what
        a chain verify of the drafts would give, and the tree path is checked against it. At T = 0 the
        request-rounds whose accepted drafts or bonus differ from the tree walk's are counted; at T > 0 both walks
        sample, so nothing is compared."""
        width, bs, walk = self.width, r.bs, r.walk
        verify_chain, walk_chain = ops.accepted_path_chain(r.tree, walk.path, width)
        ids, positions = ops.flat_tree_inputs(verify_chain, r.prefix_lens)
        slots = r.node_cache_loc[:, :width].contiguous()
        if self._saved_conv is not None:
            self._restore_conv(self._saved_conv)
            self._saved_conv = None
        logits_output, can_run_cuda_graph = worker._verify(
            r.batch, ids, positions, None, slots, r.seq_lens_cpu_bound, r.seq_lens_sum_bound, width, causal=True,
            links=ops.tree_links(verify_chain) if worker.hybrid else None)
        choices = worker._target_choices(r.batch, logits_output, bs, width)
        plan = ops.walk_commit_plan(worker.block_size, worker.use_kernels, False, walk_chain.tokens,
                                    walk_chain.parents, walk_chain.depth, walk_chain.scores, walk_chain.ranks,
                                    walk_chain.valid, choices, slots, r.prefix_lens)
        info = r.batch.sampling_info
        if info is None or info.is_all_greedy:
            differ = ((walk.accept_len != plan.walk.accept_len) | (walk.bonus != plan.walk.bonus)).sum()
            self.differ = differ if self.differ is None else self.differ + differ
            self.checked += bs
            crossed = self.checked // ORACLE_LOG != (self.checked - bs) // ORACLE_LOG
            if crossed and worker.ps.tp_rank == 0:
                logger.info("DDTREE oracle: %d of %d greedy request-rounds differ from the tree verify's (accepted "
                            "drafts or bonus)", int(self.differ), self.checked)
        r.plan, r.logits_output = plan, logits_output
        r.can_run_cuda_graph = r.can_run_cuda_graph and can_run_cuda_graph
        r.width, r.causal = width, True

    @staticmethod
    def _snapshot_conv(worker, batch, bs):
        """A hybrid target: a verify rolls each request's live conv state in place (SGLang's conv update writes it;
        the commit then overwrites it from the accepted node's stored window), so the chain re-verify starts from a
        copy taken before the tree verify (a few KB per request and layer). The slots are resolved as the hybrid
        backend resolves them (virtual -> physical)."""
        conv, slots = engine.conv_states(worker.target_worker.model_runner, batch.req_pool_indices[:bs])
        return conv, slots, [c[:, slots].clone() for c in conv]

    @staticmethod
    def _restore_conv(saved):
        conv, slots, copies = saved
        for c, copy in zip(conv, copies):
            c[:, slots] = copy
