"""DDTreeWorker: DFlash's spec-v2 worker with a budgeted draft tree instead of a 16-token chain.

One round, per batch (all on the GPU, no host sync on the default path):
  1. draft   - the DFlash drafter runs one block [bonus, mask x 15] (SGLang's draft runner, graph-captured);
               we keep the top-K log-probs of each of the 15 positions (K = min(B, V), TP shards merged).
  2. tree    - the B most probable prefixes (sglang_ddtree.tree), their ancestor mask and depth positions.
  3. verify  - one target forward over the B+1 nodes of every request (TARGET_VERIFY with a custom mask,
               graph-captured at B+1 tokens per request); node i's KV lands in slot req_to_token[prefix + i].
  4. walk    - the longest path on which the target's own choice (argmax, or a per-node sample) matches a child.
  5. commit  - the accepted nodes' KV is copied to slots prefix+1..prefix+k (EAGLE's move_kv_cache; the rest of the
               reserved slots are simply overwritten next round), the drafter's context KV is written from the
               accepted nodes' target hidden states, and the result goes back in DFLASH's format
               ([bs, 16] tokens: accepted then bonus; accept_lens = k + 1; cap_lens = the path's branch tokens).
Prefill, idle batches, KV reservation and the overlap relay are DFLASH's, inherited unchanged.
Between SGLang's graph replays (drafter, target verify) the fixed-shape work is replayed as three graphs per
CUDA-graph batch size, padded like the verify (sglang_ddtree.graphs): the draft top-K, the tree with its verify ids
and positions, and the walk with the commit's slot arithmetic. Left eager: the verify mask (its size follows the context length), the target's
choices (argmax or sampling), SGLang's KV move and the drafter-KV append.
With `--speculative-ddtree-budget auto` (sglang_ddtree.sglang.auto) each round first picks a candidate budget on
the host; its tree and walk stages are the candidate's own, and the verify swaps in the target attention backend
and verify graphs captured for that width (the chain's without the tree mask); every candidate's stage graphs are
captured together after a batch-size bucket's first round (_capture_bucket), not one by one as the chooser reaches
them. A chain round that samples nothing (most chain rounds) runs _chain_round instead: DFLASH's round on our top-1
head, the walk, commit arithmetic and stats summary in one kernel (ops.chain_accept).
Every round's outputs (tokens, lengths, branch counts) go to two buffer sets used in turn (_outputs).
With SGLANG_DDTREE_AUTO_AB=N (a measuring mode, auto_ab.auto_ab_block) an `auto` server's decode rounds alternate in
blocks of N between `auto` and the fixed widest tree, the fixed-budget server's own round (auto_ab.ABSchedule); each
arm's tokens and time are tallied apart (stats.ABTallies).
With `--speculative-ddtree-oracle` (_oracle_round) the accepted path is verified once more as a chain and the round
commits what that chain verify accepts: the sequential oracle the tree verify is checked against.
Hybrid targets (gated-delta-net layers, e.g. Qwen3-Next): the plugin sets speculative_eagle_topk = 2 so SGLang's
hybrid backend runs its tree verify (each node's conv window and SSM state from its parent's, stored per node); the
verify input carries the tree's links (retrieve_next_token / retrieve_next_sibling), and after the walk the live
recurrent state becomes the stored state of the last accepted node (and radix-cache tracking takes the node at
the tracking point), instead of DFLASH's "step accept_len" which is only right for a chain.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from functools import partial

import torch

from sglang.kernels.ops.speculative.dflash import _prepare_dflash_draft_block_unchecked
from sglang.srt.configs.hybrid_arch import hybrid_gdn_config, mambaish_config
from sglang.srt.managers.scheduler import GenerationBatchResult
from sglang.srt.model_executor.cuda_graph_config import Backend
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.runtime_context import get_exec
from sglang.srt.speculative.dflash_info import DFlashVerifyInput
from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
from sglang.srt.speculative.dflash_utils import apply_dflash_verify_logits_adjustments
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
from sglang.srt.speculative.draft_worker_common import (
    build_block_pos_offsets,
    make_draft_block_spec_info,
    make_draft_input_v2,
)

from sglang_ddtree import kernels
from sglang_ddtree.adaptive import CHAIN, CalibratorConfig, ScoreCalibrator, candidate_label
from sglang_ddtree.graphs import GraphedStage
from sglang_ddtree.layout import ancestor_mask
from sglang_ddtree.sglang import args as ddtree_args
from sglang_ddtree.sglang import ops
from sglang_ddtree.sglang.auto import (AutoBudgetPolicy, AutoFeedback, CalibrationMonitor, StallDetector,
                                      WalkSchedule, auto_config)
from sglang_ddtree.sglang.auto_ab import ABSchedule, auto_ab_block, auto_host_detail
from sglang_ddtree.sglang.plugin import mark_active
from sglang_ddtree.sglang.scripted import ENV as SCRIPT_ENV, ScriptedDrafts
from sglang_ddtree.sglang.stats import DDTreeStats
from sglang_ddtree.walk import sample_choices

logger = logging.getLogger(__name__)
# --speculative-ddtree-oracle: a log line (with a sync) every this many greedy request-rounds.
ORACLE_LOG = 200


@dataclass
class _AutoState:
    """`auto` (sglang_ddtree.sglang.auto): per candidate index its verify width and graphed stages; the extra
    verify states by width; the host policy and its GPU -> host feedback; the calibration table's host side (the
    table lives on the GPU: the scored walk stages score its predictions and compute what it learns)."""

    candidates: tuple[int, ...]
    widths: list[int]
    tree_stages: list[dict[bool, GraphedStage]]  # [candidate][sampled]
    walk_stages: list[dict[str, GraphedStage]]  # [candidate][WalkSchedule.VARIANTS entry]; the chain: no scored ones
    verify_states: dict | None  # (width, causal) -> (attention backend, verify graphs), built at the first round
    policy: AutoBudgetPolicy
    feedback: AutoFeedback
    calibration: CalibrationMonitor
    no_calibration: torch.Tensor  # the feedback vector's calibration entries of a round that scored nothing
    log_every: int = 2000
    rounds: int = 0
    seen: set = field(default_factory=set)  # (bucket, candidate index) pairs that ran once
    captured_buckets: set = field(default_factory=set)  # buckets whose stages were all captured (_capture_bucket)
    late_captures: int = 0  # stage captures in rounds after their bucket's _capture_bucket (expected: none)
    lean_chain_rounds: int = 0  # chain rounds that ran DDTreeWorker._chain_round
    walks: WalkSchedule = field(default_factory=WalkSchedule)  # which walk stage variant a round runs

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


@dataclass
class DDTreeVerifyInput(DFlashVerifyInput):
    """DFLASH's verify input plus the tree links SGLang's hybrid backend reads when speculative_eagle_topk > 1."""

    retrieve_next_token: torch.Tensor | None = None
    retrieve_next_sibling: torch.Tensor | None = None


class DDTreeWorker(DFlashWorkerV2):
    def __init__(self, server_args, gpu_id, ps, nccl_port, target_worker):
        super().__init__(server_args, gpu_id, ps, nccl_port, target_worker)
        self.options = ddtree_args.options_from(server_args)
        self.budget = self.options.budget
        self.num_nodes = self.budget + 1
        if int(server_args.speculative_num_draft_tokens) != self.num_nodes:
            raise ValueError(
                f"DDTREE expected speculative_num_draft_tokens = budget + 1 = {self.num_nodes}, got "
                f"{server_args.speculative_num_draft_tokens}; do not pass --speculative-num-draft-tokens with DDTREE."
            )
        # DFlashWorkerV2 sized itself from speculative_num_draft_tokens (the verify width B+1); the drafter's own
        # block is the DFlash block (16). Everything draft-side and the result stride use the block.
        self.block_size = int(getattr(server_args, "speculative_ddtree_block_size", 16))
        self.depth_limit = self.block_size - 1
        self.speculative_num_draft_tokens = self.block_size  # SGLang's accept-rate gauge: per-depth rate
        self._block_pos_offsets = build_block_pos_offsets(length=self.block_size, device=self.device)
        self._draft_block_spec_info = make_draft_block_spec_info(draft_token_num=self.block_size, device=self.device)
        self.hybrid = False  # set by _check_models: a gated-delta-net hybrid target
        self._move_kv = None  # the commit's KV move (_kv_mover), chosen at the first round: the pool exists then
        self._bucket_cache = None  # (SGLang's decode graph runner, its sorted batch sizes, {bs: bucket}): _graph_bucket
        self._check_models()
        self._lm_head_shard = self._resolve_lm_head_shard()
        self.topk = min(self.budget, self._lm_head_shard["vocab_size"])
        # Triton kernels for tree/mask/walk (3 launches a round); SGLANG_DDTREE_TORCH_PATH=1 selects the torch
        # reference implementations instead (identical results, ~150 small launches a round).
        self.use_kernels = kernels.available(self.device) and os.environ.get("SGLANG_DDTREE_TORCH_PATH") != "1"
        # The fixed-shape stages between SGLang's own graph replays, captured as graphs (sglang_ddtree.graphs):
        # at batch 1 on a small target the round is host-bound (lease 5 profile: 113-131 eager launches a round),
        # and these stages were several dozen of them. Off with decode CUDA graphs off, with the torch path, or
        # with SGLANG_DDTREE_ROUND_GRAPHS=0.
        decode_graphs = get_exec().graph.cuda_graph_config.decode.backend != Backend.DISABLED
        self.round_graphs = (self.use_kernels and decode_graphs
                             and os.environ.get("SGLANG_DDTREE_ROUND_GRAPHS", "1") != "0")
        # The stage graphs run at SGLang's CUDA-graph batch sizes (the verify's own), padded, instead of one
        # capture per batch size met: lease 16's tiny sweep, 642-747 captures in an unpadded `auto` server and
        # 180-186 in a fixed-budget one (as requests finished one by one, each capture a stall of the round) against
        # 88 and 12 padded, throughput the same within the runs' spread; the server module passed padded.
        # SGLANG_DDTREE_PAD_STAGES=0 captures per batch size instead.
        self.pad_stages = self.round_graphs and os.environ.get("SGLANG_DDTREE_PAD_STAGES", "1") != "0"
        self._pad = dict(bucket_of=self._graph_bucket) if self.pad_stages else {}  # every stage's padding options
        pad = self._pad
        shard = self._lm_head_shard
        self._topk_stage = GraphedStage(
            partial(ops.draft_topk_stage, self.block_size, self.topk, shard["start"], shard["weight"][: shard["rows"]]),
            name="draft top-K", enabled=self.round_graphs, unpad=ops.unpad_requests, **pad)
        self._top1_stage = GraphedStage(
            partial(ops.draft_top1_stage, self.block_size, shard["start"], shard["weight"][: shard["rows"]]),
            name="draft top-1", enabled=self.round_graphs, unpad=ops.unpad_requests, **pad)
        self._tree_stage = GraphedStage(partial(ops.tree_stage, self.budget, self.options.prune, self.use_kernels),
                                        name="tree", enabled=self.round_graphs, borrow=(0, 1),
                                        unpad=ops.unpad_tree_stage, **pad)
        self.stats = DDTreeStats(
            enable_metrics=bool(getattr(server_args, "enable_metrics", False)) and self.ps.tp_rank == 0,
            debug_path=self.options.debug_path if self.ps.tp_rank == 0 else None,
            depth_limit=self.depth_limit,
            budget=self.budget,
            timing=self.options.auto,  # `auto` learns round times from the stage events
            budget_label="auto" if self.options.auto else None,
        )
        self._walk_stage = GraphedStage(
            partial(ops.walk_commit_plan, self.block_size, self.use_kernels, self.stats.prometheus is not None),
            name="walk + commit plan", enabled=self.round_graphs, borrow=(0, 1, 2, 3, 4, 5),
            unpad=ops.unpad_commit_plan, rows_arg=self.pad_stages, **pad)
        script = os.environ.get(SCRIPT_ENV)
        self.scripted = ScriptedDrafts(script, self._lm_head_shard["vocab_size"]) if script else None
        if self.scripted is not None and self.ps.tp_rank == 0:
            logger.warning("DDTREE: scripted drafts from %s (%s): a test-only mode, the drafter is ignored", script,
                           SCRIPT_ENV)
        mark_active()  # before any capture below: the verify-mask hook keys on it
        self.auto = self._setup_auto() if self.options.auto else None
        # `auto`'s chain rounds that sample nothing run _chain_round; not with the oracle (it re-verifies the tree
        # round's path), a hybrid target (its recurrent-state commit reads the tree walk) or the debug dump (it
        # writes every round's tree).
        self.lean_chain = (self.auto is not None and not self.options.oracle and not self.hybrid
                           and self.stats.debug is None)
        # SGLANG_DDTREE_AUTO_AB: decode rounds alternate in blocks of this many between `auto` and the fixed widest
        # tree (0: off); its tallies are Prometheus counters
        self.ab_block = auto_ab_block()
        self._stalls = StallDetector()  # rounds that stalled on the host are cold (stats.StallDetector)
        # SGLANG_DDTREE_AUTO_HOST_DETAIL: `auto`'s own host work marked apart (stages.AUTO_HOST_DETAIL)
        self._host_detail = self.auto is not None and auto_host_detail()
        self._ab = ABSchedule(self.ab_block)
        if self.ab_block and self.auto is None:
            raise ValueError("SGLANG_DDTREE_AUTO_AB compares `auto` with the fixed widest tree in one server: it needs "
                             "--speculative-ddtree-budget auto.")
        if self.ab_block and self.ps.tp_rank == 0 and self.stats.prometheus is None:
            raise ValueError("SGLANG_DDTREE_AUTO_AB tallies its arms in Prometheus counters: it needs "
                             "--enable-metrics.")
        if self.ab_block and self.ps.tp_rank == 0:
            logger.warning("DDTREE A/B (SGLANG_DDTREE_AUTO_AB=%d): decode rounds alternate in blocks of %d between "
                           "auto and the fixed %d-tree, a measuring mode (sglang:ddtree_ab_* per arm)",
                           self.ab_block, self.ab_block, self.budget)
        self._output_sets = None  # _outputs: two sets of the round's output buffers, used in turn
        self._output_slot = 0
        self._output_views = {}  # _outputs: (set, batch size) -> the set's views for that batch size
        # --speculative-ddtree-oracle: the chain re-verify's width (the path's slots: root + at most L drafts, and
        # no more than the slots the tree reserved), its attention backend and graphs (built at the first decode
        # round, as auto's), and the fast path's disagreements with it (a device counter, read every ORACLE_LOG
        # rounds: the oracle is a checking mode, its log line syncs).
        self.oracle_width = min(self.block_size, self.num_nodes)
        self._oracle_state = None
        self._oracle_differ = None
        self._oracle_checked = 0
        self._last_verify_backend = None  # the attention backend of the round's last verify (_verify)
        if self.options.oracle and self.ps.tp_rank == 0:
            logger.warning("DDTREE oracle: every round verifies its accepted path once more as a chain (%d tokens, "
                           "causal) and commits what that verify accepts: two target passes a round, for checking "
                           "the tree verify, not for speed", self.oracle_width)
        if self.ps.tp_rank == 0 and self.auto is not None:
            logger.info("DDTREE auto: candidates %s (verify widths %s)", self.auto.policy.export()["candidates"],
                        self.auto.widths)
        if self.ps.tp_rank == 0:
            logger.info("DDTREE worker ready: budget=%d, verify nodes=%d, drafter block=%d, top-K=%d, prune=%s, "
                        "tp=%d, kernels=%s, round graphs=%s", self.budget, self.num_nodes, self.block_size,
                        self.topk, self.options.prune, self.ps.tp_size,
                        f"triton (tree build: {kernels.tree_kernel_for(self.budget)})" if self.use_kernels
                        else "torch", self.round_graphs)

    # ------------------------------------------------------------------------------------------------------------
    # Setup checks

    def _check_models(self) -> None:
        target_cfg = self.model_runner.model_config
        draft_cfg = self.draft_model_runner.model_config
        if mambaish_config(target_cfg) is not None:
            # SGLang's own detection, authoritative; the plugin's (from the config file) ran at startup
            if hybrid_gdn_config(target_cfg) is None:
                raise ValueError(ddtree_args.OTHER_RECURRENT_REFUSAL)
            # topk > 1 here means the plugin recognised the target and already applied check_hybrid_config
            if int(self.server_args.speculative_eagle_topk or 1) <= 1:
                raise ValueError(
                    "DDTREE on a hybrid target needs SGLang's tree verify (speculative_eagle_topk > 1), which the "
                    "plugin sets when it recognises the target's config at startup; it did not here (was the model "
                    "config readable from --model-path?)."
                )
            self.hybrid = True
            from sglang_ddtree import tree_conv
            from sglang_ddtree.sglang.plugin import install_tree_conv_hook

            install_tree_conv_hook()  # this process's tree verifies: ours above 65 tokens (tree_conv.use_ours)
            if self.ps.tp_rank == 0 and tree_conv.use_ours(self.num_nodes):
                logger.warning("DDTREE: budget %d on a hybrid target: the %d-token tree verify's conv runs "
                               "sglang-ddtree's kernel (SGLANG_DDTREE_TREE_CONV=%s; SGLang's unrolls over the "
                               "tokens and compiled for minutes above 64).", self.budget,
                               self.num_nodes, tree_conv.TREE_CONV)
            elif self.budget > 64 and self.ps.tp_rank == 0:
                # lease 10: verify-graph capture took 108 s at B=64; lease 12: > 7 min at 128 and 256
                logger.warning("DDTREE: budget %d on a hybrid target with SGLang's tree conv kernel, which unrolls "
                               "over the %d verify tokens: its compile can take many minutes (108 s at 64, more "
                               "than 7 minutes at 128).", self.budget, self.num_nodes)
        if int(draft_cfg.hidden_size) != int(target_cfg.hidden_size):
            raise ValueError(
                f"DDTREE drafter hidden size {draft_cfg.hidden_size} does not match the target's "
                f"{target_cfg.hidden_size}: the DFlash drafter reads the target's embedding and lm_head."
            )
        draft_vocab = getattr(draft_cfg.hf_config, "vocab_size", None)
        if draft_vocab is not None and int(draft_vocab) != int(target_cfg.vocab_size):
            raise ValueError(
                f"DDTREE drafter vocab size {draft_vocab} does not match the target's {target_cfg.vocab_size}."
            )
        softcap = getattr(target_cfg.hf_config, "final_logit_softcapping", None)
        if softcap:
            raise ValueError("DDTREE does not support targets with final_logit_softcapping yet.")

    def _resolve_lm_head_shard(self) -> dict:
        lm_head = getattr(self.target_worker.model_runner.model, "lm_head", None)
        if lm_head is None or not hasattr(lm_head, "weight"):
            raise ValueError("DDTREE needs the target model to expose an lm_head with a weight.")
        if not torch.is_floating_point(lm_head.weight):
            raise ValueError("DDTREE does not support a quantized target lm_head yet.")
        vocab_size = int(self.model_runner.model_config.vocab_size)
        if hasattr(lm_head, "shard_indices"):
            shard = lm_head.shard_indices
            if int(shard.num_added_elements) != 0:
                raise ValueError("DDTREE does not support added (LoRA) vocabulary in the target lm_head.")
            return {"weight": lm_head.weight, "rows": int(shard.num_org_elements),
                    "start": int(shard.org_vocab_start_index), "vocab_size": vocab_size}
        if self.ps.tp_size != 1:
            raise ValueError("DDTREE with tensor parallelism needs a vocab-parallel target lm_head.")
        return {"weight": lm_head.weight, "rows": vocab_size, "start": 0, "vocab_size": vocab_size}

    def _setup_auto(self) -> "_AutoState":
        """`--speculative-ddtree-budget auto`: per candidate, a tree stage (tree at the largest budget, the chosen
        candidate's tree, every candidate's expected tokens), a walk stage, and for every verify width other than
        the largest (which SGLang captured: speculative_num_draft_tokens = largest + 1) its own target attention
        backend and verify CUDA graphs (_ensure_auto_verify_states), swapped in around the verify (_verify)."""
        candidates = tuple(self.options.candidates)
        widths = [self.block_size if c == CHAIN else c + 1 for c in candidates]
        if max(widths) != self.num_nodes:
            raise ValueError(f"DDTREE auto: the largest verify width {max(widths)} must be the server's "
                             f"{self.num_nodes} (the drafter block is {self.block_size}).")
        tree_stages, walk_stages = [], []
        pad = self._pad
        # The calibration table learns from the scored sampled tree rounds' walks (auto.WalkSchedule: one in
        # calibration_every, every one while the table is young) and predicts
        # its committed tokens next to the raw scores (both scored and exported: CalibrationMonitor). Not from chain
        # rounds: a chain teaches only the top-1 cells, which every tree's first path teaches too, and the scoring is
        # ~140 small kernels (lease 20c, 8B shapes, batch 1, the chain in 375 of 384 rounds: walk stage 0.13 ms a round
        # against lease 19's 0.09; expected back to ~0.09 there, not measured yet). With
        # --speculative-ddtree-auto-calibration off no scored walk stage is built. The choice stays on raw expectations
        # times each candidate's observed / expected ratio (auto.py). Lease 20 fed the table's expectations to the
        # chooser: it cost every sampled tree stage the table's work and `auto` measured x0.83 / 0.79 / 0.92 / 0.92 of
        # DDTREE 128 at batch 1 / 4 / 16 / 64 on the tiny pair (a noisy, slow host; cause not separated, and a simulated
        # moving basis alone costs nothing: auto_drift_sim.json), with no gain projected offline for calibrated choices;
        # the trees stay the raw scores' best-b (offline, selecting them by calibrated scores projected no faster:
        # docs/adaptive-budget.md).
        config = auto_config(self.options.auto_calibration)
        walks = WalkSchedule(config)
        calibrator = ScoreCalibrator(CalibratorConfig(depth_limit=self.depth_limit), device=self.device)
        for c in candidates:
            tree_stages.append({sampled: GraphedStage(
                partial(ops.auto_tree_stage, self.budget, c, candidates, self.options.prune, self.use_kernels,
                        sampled),
                name=f"auto tree {candidate_label(c)}{' sampled' if sampled else ''}", enabled=self.round_graphs,
                borrow=(0, 1), unpad=ops.unpad_tree_stage, rows_arg=self.pad_stages, **pad)
                for sampled in (True, False)})
            # walk stages after a tree stage: a stage borrows its inputs from exactly one producer (graphs.py). Only
            # a sampled walk computes the candidates' observed tokens (ops.observed_tokens, 36 kernels at the
            # 128-tree): the policy reads them next to the same round's expectations only (AutoFeedback.push); only
            # a scored one the calibration's (WalkSchedule, calibration_every), and the learn variant (an unsampled
            # round's scoring while the table learns all) follows the unsampled tree stage, whose outputs it borrows.
            # The chain is not scored.
            walk_stages.append({variant: GraphedStage(
                partial(ops.walk_commit_plan, self.block_size, self.use_kernels, self.stats.prometheus is not None,
                        auto=(candidates, c) if variant in WalkSchedule.SAMPLED_TREE else None, top1_chain=c == CHAIN,
                        calibrator=calibrator if variant in WalkSchedule.SCORED else None),
                name=f"auto walk {candidate_label(c)}{'' if variant == 'plain' else ' ' + variant}",
                enabled=self.round_graphs, borrow=(0, 1, 2, 3, 4, 5), unpad=ops.unpad_commit_plan,
                rows_arg=self.pad_stages, **pad)
                for variant in walks.variants(c == CHAIN)})
        policy = AutoBudgetPolicy(list(candidates), widths=widths, config=config)
        # verify_states are built at the first decode round: SGLang creates the target's attention backend and
        # verify graphs after the speculative worker (lease 9: no `attn_backend` on the target runner yet here).
        calibration = CalibrationMonitor(calibrator, self.stats.prometheus, config)
        return _AutoState(candidates, widths, tree_stages, walk_stages, None, policy,
                          AutoFeedback(policy, self.device, calibration), calibration,
                          torch.zeros(AutoFeedback.CALIBRATION, dtype=torch.float32, device=self.device),
                          log_every=config.log_every, walks=walks)

    def _capture_bucket(self, batch, bucket, bs, draft_hidden, roots, prefix_lens, choice_dtype) -> None:
        """`auto`, after a batch-size bucket's first round: every candidate's tree and walk stages (sampled and
        not) and both draft heads are captured now, together, from this round's inputs, instead of at each one's
        first use. Why: exploration, probes and sampled rounds reach the candidates one by one over thousands of
        rounds, and each first use was a capture stalling that round (lease 18b, tiny pair at batch 4: 22 captures
        inside measured runs, the tree stage 1.75 ms a round on average against the fixed 128-tree's 0.15); one
        stall per bucket now, at its first round. Runs after everything the round returns was copied out of the
        stages' memory (their replays here overwrite it). The walks get the target choices of an all-zero verify
        (any token id will do: only the shapes are captured); the other inputs are the round's, padded as a real
        first use pads them (graphs.GraphedStage)."""
        started = time.perf_counter()
        before = self._stage_captures()
        heads = {k: self._draft_topk(draft_hidden, k) for k in {1, self.topk}}
        for i, candidate in enumerate(self.auto.candidates):
            width = self.auto.widths[i]
            slots = self._verify_slots(batch, prefix_lens, bs, width)
            choices = torch.zeros((bs, width), dtype=choice_dtype, device=slots.device)
            for variant, walk_stage in self.auto.walk_stages[i].items():
                sampled = variant in WalkSchedule.SAMPLED_TREE  # the tree stage this walk variant follows
                top1 = candidate == CHAIN and not sampled and self.scripted is None  # as the round picks its head
                tree, _, _, _ = self.auto.tree_stages[i][sampled](*heads[1 if top1 else self.topk], roots,
                                                                  prefix_lens, rows=bs)
                walk_stage(tree.tokens, tree.parents, tree.depth, tree.scores, tree.ranks, tree.valid, choices, slots,
                           prefix_lens, rows=bs)
        if self.lean_chain and self.use_kernels:
            self._warm_chain_accept(bucket, prefix_lens)
        self.auto.captured_buckets.add(bucket)
        self.stats.other_batch()  # the next round's `between` would hold these captures
        if self.ps.tp_rank == 0:
            logger.info("DDTREE auto: batch-size bucket %d: %d stage graphs captured together in %.0f ms", bucket,
                        self._stage_captures() - before, 1e3 * (time.perf_counter() - started))

    def _warm_chain_accept(self, bucket: int, prefix_lens: torch.Tensor) -> None:
        """The lean chain round's accept kernel (eager: ops.chain_accept) launched once per compiled variant that the
        bucket's batch sizes reach (kernels.chain_accept_batch_sizes), on zeros into scratch buffers, so that no
        measured round compiles it (stats.StallDetector)."""
        from sglang_ddtree import kernels

        sizes = sorted(set(self._bucket_cache[1] if self._bucket_cache is not None else []) | {bucket})
        low = max([size for size in sizes if size < bucket], default=0) + 1
        block, device = self.block_size, prefix_lens.device
        for rows in kernels.chain_accept_batch_sizes(low, bucket):
            ids = torch.zeros((rows, block), dtype=torch.int64, device=device)
            logprobs = torch.zeros((rows, block - 1), dtype=torch.float32, device=device)
            lens = torch.zeros(rows, dtype=prefix_lens.dtype, device=device)
            ops.chain_accept(True, ids, ids, logprobs, lens,
                             ops.chain_outputs(rows, self.depth_limit, prefix_lens.dtype, device))

    @staticmethod
    def _stage_captures() -> int:
        """Stage graphs captured so far, all stages of the process together: a round that changed it did one-time
        work."""
        return GraphedStage.total_captures

    def _ensure_auto_verify_states(self) -> bool:
        """Keyed (width, causal): the chain verifies causally (no custom mask, as DFLASH does), trees with the
        tree mask; the widest tree uses SGLang's own state. True when they were built now."""
        if self.auto.verify_states is not None:
            return False
        keys = sorted({(w, c == CHAIN) for c, w in zip(self.auto.candidates, self.auto.widths)}
                      - {(self.num_nodes, False)})
        self.auto.verify_states = {key: self._build_verify_state(*key) for key in keys}
        if self.ps.tp_rank == 0:
            logger.info("DDTREE auto: verify states built for (width, causal) %s", keys)
        return True

    def _build_verify_state(self, width: int, causal: bool):
        """A target attention backend (own workspace) and, with decode graphs on, verify CUDA graphs for `width`
        tokens per request (causal: without the custom mask), built the way SGLang's adaptive EAGLE builds its
        per-step states."""
        from sglang.srt.runtime_context import get_context, get_spec

        from sglang_ddtree.sglang.plugin import causal_verify_capture

        runner = self.target_worker.model_runner
        original = get_spec().speculative_num_draft_tokens
        get_context().override("ddtree_auto.capture", speculative_num_draft_tokens=width)
        saved_backend, saved_workspace = runner.attn_backend, runner.init_new_workspace
        try:
            backend = runner._get_attention_backend(init_new_workspace=True)
            graphs = None
            if get_exec().graph.cuda_graph_config.decode.backend != Backend.DISABLED:
                runner.attn_backend = backend  # the capture reads the mask policy from runner.attn_backend
                with causal_verify_capture() if causal else contextlib.nullcontext():
                    graphs = runner._decode_cuda_graph_runner_cls()(
                        runner, attn_backend=backend, speculative_num_draft_tokens=width)
        finally:
            runner.attn_backend, runner.init_new_workspace = saved_backend, saved_workspace
            get_context().override("ddtree_auto.restore", speculative_num_draft_tokens=original)
        return backend, graphs

    def _outputs(self, bs: int, seq_len_dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The round's output buffers (ops.CHAIN_OUTPUTS) for bs requests. What leaves a round (tokens, lengths,
        branch counts, the next round's roots) is read by SGLang's result processing and by the next round while
        the round after is launched, so two sets are used in turn, as DFLASH's own accept buffers are
        (dflash_worker_v2._next_accept_bonus_buffers), each grown to the largest batch met. Views of a replaced set
        keep its memory alive for as long as a result holds them."""
        sets = self._output_sets
        if sets is None or sets[0]["commit_lens"].shape[0] < bs or sets[0]["new_seq_lens"].dtype != seq_len_dtype:
            capacity = max(bs, 2 * sets[0]["commit_lens"].shape[0] if sets is not None else bs)
            sets = self._output_sets = [ops.chain_outputs(capacity, self.depth_limit, seq_len_dtype, self.device)
                                        for _ in range(2)]
            self._output_views = {}
        self._output_slot ^= 1
        # the views per (set, batch size), made once: seven slices a round were 16 us a profiled batch (lease 30c)
        key = (self._output_slot, bs)
        views = self._output_views.get(key)
        if views is None:
            views = self._output_views[key] = {name: t if name == "summary" else t[:bs]
                                               for name, t in sets[self._output_slot].items()}
        return views

    def _graph_bucket(self, bs: int) -> int:
        """The batch size a verify of `bs` requests pads to (SGLang's captured sizes), else bs. Asked by every
        padded stage, 3-4 times a round: the answers are kept per runner (lease 28's batch-1 host profile,
        sorting the sizes each time: 16-28 us a round under cProfile)."""
        graphs = self.target_worker.model_runner.decode_cuda_graph_runner
        cache = self._bucket_cache
        if cache is None or cache[0] is not graphs:  # the first call, or SGLang built another runner
            cache = self._bucket_cache = (graphs, sorted(getattr(graphs, "capture_bs", None) or []), {})
        _, sizes, buckets = cache
        bucket = buckets.get(bs)
        if bucket is None:
            bucket = buckets[bs] = next((size for size in sizes if size >= bs), bs)
        return bucket

    def _ab_mark(self, timer, fixed_arm: bool, cold: bool, sampled: bool = False, widest: bool = True) -> None:
        """SGLANG_DDTREE_AUTO_AB: the round's arm, whether it did one-time work, sampled `auto`'s expectations and
        verified the widest tree, for the tallies (stats.ABTallies, fed by record_round and finish_round)."""
        if self.ab_block:
            timer.arm, timer.cold = ("fixed" if fixed_arm else "auto"), cold
            timer.sampled, timer.widest = sampled, widest

    def reset_calibration(self) -> bool:
        """`auto`'s calibration table starts empty again (plugin: POST /set_internal_state with
        {"server_args": {"ddtree_calibration_reset": 1}}). Not on /flush_cache: benchmark harnesses flush between
        runs (lease 20's sweep: 2-12 flushes per row), which would keep the table cold. False without `auto`."""
        if self.auto is None:
            return False
        self.auto.calibration.reset()
        if self.ps.tp_rank == 0:
            logger.info("DDTREE auto: calibration table reset")
        return True

    def _maybe_build_draft_sampler(self):
        # DFLASH folds a greedy argmax head into the draft graph; DDTREE needs top-K log-probs instead.
        return None

    # ------------------------------------------------------------------------------------------------------------
    # The round

    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None):
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch or batch.forward_mode.is_idle():
            self.stats.other_batch()
            return super().forward_batch_generation(batch, on_publish=on_publish, grammar_barrier=grammar_barrier)
        if getattr(batch, "return_logprob", False):
            raise ValueError("DDTREE speculative decoding does not support return_logprob yet.")
        if batch.spec_info is None:
            batch.spec_info = DFlashDraftInputV2.create_idle_input(device=self.device)
        draft_input = batch.spec_info
        batch.seq_lens.record_stream(torch.get_device_module(self.device).current_stream())

        timer = self.stats.round_timer()
        bs = len(batch.seq_lens)
        prefix_lens = batch.seq_lens
        seq_lens_cpu_bound, seq_lens_sum_bound = self._host_seq_len_bound(batch, draft_input)
        fixed_arm = self._ab.next_is_fixed()  # SGLANG_DDTREE_AUTO_AB: this round is the fixed widest tree's
        use_auto = self.auto is not None and not fixed_arm
        captures = self._stage_captures()

        if self.options.oracle and self._oracle_state is None:
            # the oracle's chain verify state, at the first decode round (SGLang builds the target's attention
            # backend after this worker) and before the round's first verify, as `auto` builds its own
            self._oracle_state = {(self.oracle_width, True): self._build_verify_state(self.oracle_width, True)}
        if use_auto:  # chosen before the draft: a chain round that samples nothing needs only top-1
            timer.host_mark("draft")  # the round's preparation so far is the draft's host time, as in a fixed round
            built = self._ensure_auto_verify_states()
            bucket = self._graph_bucket(bs)
            if self._host_detail:
                timer.host_mark("choose_prep")
            held = self.auto.policy.held_round(bucket, self.auto.rounds)  # a held choice reads nothing
            if self._host_detail:
                timer.host_mark("choose_held")
            if held is None:
                self.auto.feedback.drain()
                if self._host_detail:
                    timer.host_mark("choose_drain")
                chosen = self.auto.policy.choose(bucket)
                sampled = self.auto.policy.sampled(self.auto.rounds, bucket)
            else:
                chosen, sampled = held
            timer.host_mark("choose")
        top1_only = (use_auto and self.auto.candidates[chosen] == CHAIN and not sampled
                     and self.scripted is None)
        lean = top1_only and self.lean_chain  # the round is _chain_round's

        draft_hidden, block_positions, block_slots = self._draft(batch, draft_input, seq_lens_cpu_bound,
                                                                 seq_lens_sum_bound)
        topk_values, topk_tokens = self._draft_topk(draft_hidden, 1 if top1_only else self.topk)
        if self.scripted is not None:
            self.scripted.apply(getattr(batch, "reqs", None), batch.seq_lens, topk_values, topk_tokens)
        timer.mark("draft", following="verify" if lean else None)

        roots = draft_input.bonus_tokens.view(-1)
        if lean:
            return self._chain_round(batch, timer, bs, bucket, chosen, built, captures, draft_hidden, roots,
                                     topk_values, topk_tokens, block_positions, block_slots, seq_lens_cpu_bound,
                                     seq_lens_sum_bound, on_publish)
        if not use_auto:
            width, walk_stage = self.num_nodes, self._walk_stage
            tree, verify_ids, verify_positions = self._tree_stage(topk_values, topk_tokens, roots, prefix_lens,
                                                                 rows=bs)
        else:
            if self.stats.prometheus is not None:
                self.stats.prometheus.auto_round(candidate_label(self.auto.candidates[chosen]))
            width = self.auto.widths[chosen]
            variant = self.auto.walks.variant(self.auto.candidates[chosen] == CHAIN, sampled, self.auto.calibration)
            walk_stage = self.auto.walk_stages[chosen][variant]
            if self._host_detail:
                timer.host_mark("tree_auto")
            tree, verify_ids, verify_positions, expected = self.auto.tree_stages[chosen][sampled](
                topk_values, topk_tokens, roots, prefix_lens, rows=bs)
        causal = use_auto and self.auto.candidates[chosen] == CHAIN  # a chain needs no tree mask
        mask_numel = ops.verify_mask_numel(width, seq_lens_sum_bound, bs)
        if causal:
            mask = None
        elif self.use_kernels:
            mask = kernels.tree_verify_mask_triton(tree, prefix_lens, mask_numel)
        else:
            mask = ops.tree_verify_mask(ancestor_mask(tree), prefix_lens, mask_numel)
        timer.mark("tree")

        node_cache_loc = self._verify_slots(batch, prefix_lens, bs, width)
        saved_conv = self._snapshot_conv(batch, bs) if self.options.oracle and self.hybrid else None
        logits_output, can_run_cuda_graph = self._verify(
            batch, verify_ids, verify_positions, mask, node_cache_loc, seq_lens_cpu_bound, seq_lens_sum_bound, width,
            causal, links=ops.tree_links(tree) if self.hybrid else None)
        timer.mark("verify")

        choices = self._target_choices(batch, logits_output, bs, width)
        plan = walk_stage(tree.tokens, tree.parents, tree.depth, tree.scores, tree.ranks, tree.valid,
                          choices, node_cache_loc, prefix_lens, rows=bs)
        walk, summary = plan.walk, plan.summary  # the tree's: what the stats record
        if self.options.oracle:  # the round commits what the chain re-verify of the accepted path accepts
            plan, logits_output, oracle_graph = self._oracle_round(
                batch, tree, walk, node_cache_loc, prefix_lens, seq_lens_cpu_bound, seq_lens_sum_bound, bs,
                saved_conv)
            can_run_cuda_graph = can_run_cuda_graph and oracle_graph
            width, causal = self.oracle_width, True
        timer.mark("walk")  # with the oracle: its re-verify included

        # What leaves the round is copied out of the stage's graph memory (the next round's replay rewrites it), in
        # one call into the round's output buffers (_outputs).
        leaving = (plan.commit_lens, plan.new_seq_lens, plan.out_tokens, plan.walk.bonus, plan.branch_lens)
        if self.round_graphs:
            kept = self._outputs(bs, prefix_lens.dtype)
            kept = tuple(kept[name] for name in ("commit_lens", "new_seq_lens", "out_tokens", "bonus", "branch_lens"))
            torch._foreach_copy_(kept, leaving)
            leaving = kept
        commit_lens, new_seq_lens, out_tokens, bonus, branch_lens = leaving
        if on_publish is not None:
            on_publish(new_seq_lens)
        if self.hybrid:
            self._commit_recurrent_state(batch, plan.walk, prefix_lens, bs)
        self._commit(plan, logits_output.hidden_states, commit_lens, bs, width, chain=causal)
        logits_output.hidden_states = None
        timer.mark("commit")
        stalled = self._stalls.stalled(timer.host_ms)  # once a round: every round's host time feeds the limit
        cold = stalled or self._stage_captures() != captures  # a fixed round's (an `auto` round's: _auto_after_round)
        if use_auto:
            scored = plan.calibration is not None
            # an unsampled round's walk computes no observed tokens (the policy reads them only next to the same
            # round's expectations) and sends nothing but its time
            vector = torch.cat([expected, plan.observed, plan.calibration if scored else self.auto.no_calibration]) \
                if sampled else None
            if self._host_detail:
                timer.host_mark("after_cat")
            cold = self._auto_after_round(timer, bs, bucket, chosen, built, captures, vector, sampled,
                                          plan.calibration_delta if scored else None, stalled)
        if use_auto:
            self._ab_mark(timer, False, cold, sampled, chosen == len(self.auto.candidates) - 1)
        else:
            self._ab_mark(timer, fixed_arm, cold)
        # reqs/seq_lens are only read by the debug dump (after its sync): no host sync on the default path.
        self.stats.record_round(tree, walk, timer, batch_size=bs, reqs=getattr(batch, "reqs", None),
                                seq_lens=prefix_lens, summary=summary,
                                extra=None if not use_auto or self.stats.debug is None else  # dump rows only
                                {"auto_candidate": candidate_label(self.auto.candidates[chosen]),
                                 "auto_sampled": sampled, "auto_cold": cold, "auto_walk": variant})
        if use_auto and self.stats.debug is not None:
            self.stats.dump_state("auto", self.auto.policy.export(), every=100)
            self.stats.dump_state("calibration", {**self.auto.calibration.export(),
                                                  **self.auto.calibration.calibrator.export()}, every=100)
        if use_auto and self.pad_stages and bucket not in self.auto.captured_buckets:
            self._capture_bucket(batch, bucket, bs, draft_hidden, roots, prefix_lens, choices.dtype)

        result = GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=out_tokens.reshape(-1),
            accept_lens=commit_lens,
            # SGLang's per-request "cap" channel (DSpark's) carries our branch counts to meta_info: copied to the
            # host with accept_lens, summed and histogrammed per request (plugin._after_spec_metrics renames it).
            cap_lens=branch_lens,
            can_run_cuda_graph=can_run_cuda_graph,
            next_draft_input=make_draft_input_v2(bonus_tokens=bonus, new_seq_lens=new_seq_lens),
            speculative_num_draft_tokens=self.block_size,
            new_seq_lens=new_seq_lens,
        )
        self.stats.finish_round(timer)
        return result

    def _chain_round(self, batch, timer, bs, bucket, chosen, built, captures, draft_hidden, roots, top1_values,
                     top1_tokens, block_positions, block_slots, seq_lens_cpu_bound, seq_lens_sum_bound, on_publish):
        """`auto`'s chain round when it samples nothing (most chain rounds): a DFLASH round on our draft head. The
        drafter's top-1 path is verified causally at the draft block's own positions and KV slots (nothing to move
        after), then one kernel (ops.chain_accept) does the walk, the commit arithmetic and the stats summary into
        the round's output buffers. Why: through the general round (a tree stage, a walk stage, their input and
        output copies, the verify slots) `auto`'s chain cost about as much as a tree round, ~1.4 ms more than a DFLASH
        step on the tiny pair at batch 4 (lease 29c: DDTREE 64 / 128 steps 4.72 / 4.97 ms, DFLASH 3.37), so where
        the chain was the best choice `auto` could not reach DFLASH. Its results are the general round's for the
        chain tree (tests/test_kernels.py's chain check against walk_commit_plan's arithmetic; the server module).
        Lease 30: at 8B shapes `auto` (the chain) steps within 0.8% of DFLASH's; on the host-bound tiny pair the chain
        held alone is still x0.81 / 0.87 of DFLASH at batch 4 / 16, the rest Python around the round
        (docs/gpu-suite.md, "Lease 30")."""
        block = self.block_size
        prefix_lens = batch.seq_lens
        self.auto.lean_chain_rounds += 1
        if self.auto.lean_chain_rounds == 1 and self.ps.tp_rank == 0:
            logger.info("DDTREE auto: first lean chain round (batch size %d)", bs)
        if self.stats.prometheus is not None:
            self.stats.prometheus.auto_round(candidate_label(CHAIN))
        ids = torch.cat([roots.to(torch.int64).view(bs, 1), top1_tokens.reshape(bs, block - 1)], dim=1)
        logits_output, can_run_cuda_graph = self._verify(
            batch, ids.view(-1), block_positions.reshape(-1), None, block_slots, seq_lens_cpu_bound,
            seq_lens_sum_bound, block, causal=True)
        timer.mark("verify")

        choices = self._target_choices(batch, logits_output, bs, block)
        out = self._outputs(bs, prefix_lens.dtype)
        ops.chain_accept(self.use_kernels, ids, choices, top1_values.reshape(bs, block - 1), prefix_lens, out)
        timer.mark("walk")

        if on_publish is not None:
            on_publish(out["new_seq_lens"])
        self._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=logits_output.hidden_states.view(bs * block, -1),
            cache_loc=block_slots.reshape(-1),
            positions=block_positions.reshape(-1),
            cache_loc_2d=block_slots,
            commit_lens=out["commit_lens"],
        )
        logits_output.hidden_states = None
        timer.mark("commit")
        cold = self._auto_after_round(timer, bs, bucket, chosen, built, captures, None, False, None,
                                      self._stalls.stalled(timer.host_ms))
        self._ab_mark(timer, False, cold, widest=False)  # the lean chain: `auto`'s, unsampled
        self.stats.record_round(None, None, timer, batch_size=bs, summary=out["summary"])
        if self.pad_stages and bucket not in self.auto.captured_buckets:
            self._capture_bucket(batch, bucket, bs, draft_hidden, roots, prefix_lens, choices.dtype)
        result = GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=out["out_tokens"].reshape(-1),
            accept_lens=out["commit_lens"],
            cap_lens=out["branch_lens"],
            can_run_cuda_graph=can_run_cuda_graph,
            next_draft_input=make_draft_input_v2(bonus_tokens=out["bonus"], new_seq_lens=out["new_seq_lens"]),
            speculative_num_draft_tokens=block,
            new_seq_lens=out["new_seq_lens"],
        )
        self.stats.finish_round(timer)
        return result

    def _auto_after_round(self, timer, bs, bucket, chosen, built, captures, vector, sampled,
                          calibration_delta, stalled: bool) -> bool:
        """`auto`'s bookkeeping at a round's end: the feedback (vector: a sampled round's, else None), what the
        calibration table learns (calibration_delta: a scored round's, else None), the log. -> whether the round
        was cold. A round that built verify states or captured stage graphs (first use of a candidate at a batch
        size) took one-time work: its tokens count, its time does not (lease 9: such rounds made the chain, the first
        candidate explored, look seconds slow); so did a round that stalled on the host (stalled: the round's
        StallDetector answer, asked once a round by the caller)."""
        captured = self._stage_captures() != captures
        if captured and bucket in self.auto.captured_buckets:
            self.auto.late_captures += 1
            if self.ps.tp_rank == 0:
                logger.warning("DDTREE auto: a stage graph was captured in a round at batch-size bucket %d after "
                               "the bucket's stages were all captured (%d such rounds)", bucket,
                               self.auto.late_captures)
        cold = built or captured or self.auto.first_use(bucket, chosen) or stalled
        self.auto.feedback.push(vector, timer, bucket, chosen, bs, cold=cold, sampled=sampled,
                                young=self.auto.calibration.young())
        if self._host_detail:
            timer.host_mark("after_push")
        if calibration_delta is not None:  # the table learns now, in stream order before the next scored walk stage
            self.auto.calibration.learn(calibration_delta, bs)
            if self._host_detail:
                timer.host_mark("after_learn")
        self.auto.calibration.after_round()
        self.auto.maybe_log(self.ps.tp_rank)
        if self._host_detail:
            timer.host_mark("after_auto")
        return cold

    # ------------------------------------------------------------------------------------------------------------
    # Stages

    def _host_seq_len_bound(self, batch, draft_input):
        """Host-side upper bound of the committed lengths (the host copy lags by one round of at most `block_size`
        tokens). Sizes kernel metadata and the mask without reading the device lengths."""
        bs = len(batch.seq_lens)
        if batch.seq_lens_cpu is not None:
            bound = batch.seq_lens_cpu.to(torch.int64) + self.block_size
        elif draft_input.reserved_seq_lens_cpu is not None:
            bound = draft_input.reserved_seq_lens_cpu.to(torch.int64)
        else:  # last resort, a blocking copy (DFLASH does the same)
            bound = batch.seq_lens.to("cpu", dtype=torch.int64)
        bound = bound[:bs]
        return bound, int(bound.sum())

    def _draft(self, batch, draft_input, seq_lens_cpu_bound, seq_lens_sum_bound):
        """The DFlash drafter block [bonus, mask x 15] -> (its hidden states [bs * block, H], the block's positions
        and KV slots [bs, block]: prefix .. prefix + block - 1, which a chain verify reuses as DFLASH's does)."""
        bs = len(batch.seq_lens)
        block = self.block_size
        prefix_lens = batch.seq_lens
        self._ensure_draft_block_buffers(bs)  # DFLASH's reusable block buffers (sized by self.block_size)
        block_ids = self._draft_block_ids_buf[:bs]
        positions_2d = self._draft_block_positions_buf[:bs]
        cache_loc_2d = self._draft_verify_out_cache_loc_buf[:bs]
        if self._use_triton_prepare_block:  # DFLASH's one-launch block preparation
            _prepare_dflash_draft_block_unchecked(
                bonus_tokens=draft_input.bonus_tokens.view(-1), prefix_lens=prefix_lens.view(-1),
                req_pool_indices=batch.req_pool_indices.view(-1),
                req_to_token=self.model_runner.req_to_token_pool.req_to_token,
                block_ids_out=block_ids, positions_out=positions_2d, cache_loc_out=cache_loc_2d,
                mask_token_id=int(self._mask_token_id))
        else:
            block_ids.fill_(int(self._mask_token_id))
            block_ids[:, 0].copy_(draft_input.bonus_tokens.view(-1))
            torch.add(prefix_lens.to(torch.int64).unsqueeze(1), self._block_pos_offsets, out=positions_2d)
            cache_loc_2d.copy_(self._slots(batch, prefix_lens, block, bs).view(bs, block))

        target_model = self.target_worker.model_runner.model
        input_embeds = target_model.get_input_embeddings()(block_ids).view(bs * block, -1)
        forward_batch = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY,
            batch_size=bs,
            input_ids=block_ids.flatten(),
            req_pool_indices=batch.req_pool_indices,
            seq_lens=prefix_lens,
            out_cache_loc=cache_loc_2d.reshape(-1),
            seq_lens_sum=seq_lens_sum_bound,
            seq_lens_cpu=seq_lens_cpu_bound.to(torch.int32),
            positions=positions_2d.reshape(-1),
            input_embeds=input_embeds,
            spec_algorithm=self.model_runner.spec_algorithm,
            spec_info=self._draft_block_spec_info,
            capture_hidden_mode=CaptureHiddenMode.NULL,
        )
        with torch.inference_mode():
            draft_out = self.draft_model_runner.forward(forward_batch)
        hidden = draft_out.logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("DDTREE: the DFlash draft forward returned no hidden states.")
        return hidden, positions_2d, cache_loc_2d

    def _draft_topk(self, draft_hidden, k):
        """Per-position top-k draft log-probs [bs, block - 1, k] and ids, TP shards merged (k: self.topk, or 1
        for an `auto` chain round)."""
        if self.ps.tp_size == 1:
            return (self._topk_stage if k == self.topk else self._top1_stage)(
                draft_hidden, rows=draft_hidden.shape[0] // self.block_size)
        bs = draft_hidden.shape[0] // self.block_size
        hidden = draft_hidden.view(bs, self.block_size, -1)[:, 1:, :].reshape(bs * (self.block_size - 1), -1)
        values, tokens = self._topk_logprobs(hidden, k)
        return values.view(bs, self.block_size - 1, -1), tokens.view(bs, self.block_size - 1, -1)

    def _topk_logprobs(self, hidden, k):
        shard = self._lm_head_shard
        weight = shard["weight"][: shard["rows"]]
        if self.ps.tp_size == 1:
            return ops.draft_topk_logprobs(hidden, weight, k, vocab_start=shard["start"])
        from sglang.srt.distributed import get_tp_group

        group = get_tp_group()

        def all_gather(x):
            out = torch.empty((group.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
            group.all_gather_into_tensor(out, x)
            return out

        return ops.draft_topk_logprobs(hidden, weight, k, vocab_start=shard["start"],
                                       all_gather=all_gather, world_size=group.world_size)

    def _slots(self, batch, prefix_lens, count, bs):
        """KV slots of positions prefix .. prefix+count-1 of every request (reserved by DFLASH's prepare step)."""
        from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func

        return assign_extend_cache_locs_func(
            req_pool_indices=batch.req_pool_indices,
            req_to_token=self.model_runner.req_to_token_pool.req_to_token,
            start_offset=prefix_lens,
            end_offset=prefix_lens + count,
            batch_size=bs,
            draft_token_num=count,
            device=self.device,
        )

    def _verify_slots(self, batch, prefix_lens, bs, width):
        return self._slots(batch, prefix_lens, width, bs).view(bs, width)

    @contextlib.contextmanager
    def _verify_state(self, width: int, causal: bool):
        """The target runner with the attention backend and verify graphs of this verify's (width, causal) swapped
        in (`auto`'s candidates, the oracle's chain; SGLang's own for the server's widest tree), restored after."""
        runner = self.target_worker.model_runner
        saved = (runner.attn_backend, runner.decode_cuda_graph_runner)
        if (width, causal) != (self.num_nodes, False):
            states = self.auto.verify_states if self.auto is not None else self._oracle_state
            runner.attn_backend, runner.decode_cuda_graph_runner = states[(width, causal)]
        try:
            yield runner
        finally:
            runner.attn_backend, runner.decode_cuda_graph_runner = saved

    def _verify(self, batch, verify_ids, verify_positions, mask, node_cache_loc, seq_lens_cpu_bound,
                seq_lens_sum_bound, width, causal=False, links=None):
        verify_input = DDTreeVerifyInput(
            draft_token=verify_ids,
            positions=verify_positions,
            draft_token_num=width,
            custom_mask=mask,
            capture_hidden_mode=CaptureHiddenMode.FULL,
            retrieve_next_token=None if links is None else links[0],
            retrieve_next_sibling=None if links is None else links[1],
        )
        batch.out_cache_loc = node_cache_loc.reshape(-1)
        saved = (batch.seq_lens_cpu, batch.seq_lens_sum)
        batch.seq_lens_cpu = seq_lens_cpu_bound.to(saved[0].dtype if saved[0] is not None else torch.int64)
        batch.seq_lens_sum = seq_lens_sum_bound
        try:
            with self._verify_state(width, causal) as runner:
                self._last_verify_backend = runner.attn_backend
                forward_batch, _ = verify_input.prepare_for_verify(batch, self.target_worker)
                out = self.target_worker.forward_batch_generation(
                    batch=None, forward_batch=forward_batch, is_verify=True, skip_attn_backend_init=True)
        finally:
            batch.seq_lens_cpu, batch.seq_lens_sum = saved
        if out.logits_output.hidden_states is None:
            raise RuntimeError("DDTREE verify needs the target's hidden states (aux capture is off).")
        return out.logits_output, out.can_run_cuda_graph

    def _target_choices(self, batch, logits_output, bs, width):
        """The target's own token at every node [bs, width] from a verify's logits (SGLang's per-request logit
        adjustments applied first, in place, as DFLASH applies them): argmax, or one sample per node with the
        request's parameters."""
        info = batch.sampling_info
        if info is not None:
            apply_dflash_verify_logits_adjustments(next_token_logits=logits_output.next_token_logits,
                                                   sampling_info=info, draft_token_num=width)
        logits = logits_output.next_token_logits.view(bs, width, -1)
        if info is None or info.is_all_greedy:
            return logits.argmax(dim=-1)
        choice = sample_choices(logits, info.temperatures.view(-1), info.top_ks.view(-1).to(torch.int64),
                                info.top_ps.view(-1))
        if self.ps.tp_size > 1:  # every rank must walk the same samples
            from sglang.srt.distributed import get_tp_group

            get_tp_group().broadcast(choice, src=0)
        return choice

    def _oracle_round(self, batch, tree, walk, node_cache_loc, prefix_lens, seq_lens_cpu_bound, seq_lens_sum_bound,
                      bs, saved_conv):
        """`--speculative-ddtree-oracle`: verify the tree walk's accepted nodes once more as a chain (causal, width
        oracle_width, from the same pre-round state: the target's KV of those positions is rewritten, a hybrid's conv
        state restored from saved_conv, and its SSM state is not written by a verify) and walk that chain with the
        target's own choices there. The round then commits what the chain verify accepts (tokens, KV, drafter
        context, recurrent state), whatever the tree verify computed: the tree only proposes the path, so the output
        is what a chain verify of the drafts would give, and the tree path is checked against it. At T = 0 the
        request-rounds whose accepted drafts or bonus differ from the tree walk's are counted (a device counter,
        logged with a sync every ORACLE_LOG rounds); at T > 0 both walks sample, so nothing is compared.
        -> (the chain's commit plan, its logits output, whether its verify ran in a CUDA graph)."""
        width = self.oracle_width
        verify_chain, walk_chain = ops.accepted_path_chain(tree, walk.path, width)
        ids, positions = ops.flat_tree_inputs(verify_chain, prefix_lens)
        slots = node_cache_loc[:, :width].contiguous()
        if saved_conv is not None:
            self._restore_conv(saved_conv)
        logits_output, can_run_cuda_graph = self._verify(
            batch, ids, positions, None, slots, seq_lens_cpu_bound, seq_lens_sum_bound, width, causal=True,
            links=ops.tree_links(verify_chain) if self.hybrid else None)
        choices = self._target_choices(batch, logits_output, bs, width)
        plan = ops.walk_commit_plan(self.block_size, self.use_kernels, False, walk_chain.tokens, walk_chain.parents,
                                    walk_chain.depth, walk_chain.scores, walk_chain.ranks, walk_chain.valid, choices,
                                    slots, prefix_lens)
        info = batch.sampling_info
        if info is None or info.is_all_greedy:
            differ = ((walk.accept_len != plan.walk.accept_len) | (walk.bonus != plan.walk.bonus)).sum()
            self._oracle_differ = differ if self._oracle_differ is None else self._oracle_differ + differ
            self._oracle_checked += bs
            crossed = self._oracle_checked // ORACLE_LOG != (self._oracle_checked - bs) // ORACLE_LOG
            if crossed and self.ps.tp_rank == 0:
                logger.info("DDTREE oracle: %d of %d greedy request-rounds differ from the tree verify's (accepted "
                            "drafts or bonus)", int(self._oracle_differ), self._oracle_checked)
        return plan, logits_output, can_run_cuda_graph

    def _snapshot_conv(self, batch, bs):
        """The oracle on a hybrid target: a verify rolls each request's live conv state in place (SGLang's conv
        update writes it; the commit then overwrites it from the accepted node's stored window), so the chain
        re-verify starts from a copy taken before the tree verify (a few KB per request and layer). The slots are
        resolved as the hybrid backend resolves them (virtual -> physical)."""
        pool = self.target_worker.model_runner.req_to_token_pool
        slots = pool.translate_mamba_indices(pool.get_mamba_indices(batch.req_pool_indices[:bs]))
        conv = pool.mamba_pool.mamba_cache.conv
        return conv, slots, [c[:, slots].clone() for c in conv]

    @staticmethod
    def _restore_conv(saved):
        conv, slots, copies = saved
        for c, copy in zip(conv, copies):
            c[:, slots] = copy

    def _commit_recurrent_state(self, batch, walk, prefix_lens, bs):
        """Hybrid targets: the verify stored every node's conv window and SSM state (its parent's, advanced by its
        token); the live state becomes the last accepted node's, and radix-cache tracking copies the node at the
        tracking point (ops.mamba_commit_steps). Reads the metadata of the verify that just ran."""
        if not self._need_mamba_verify_commit:
            raise RuntimeError("DDTREE: the hybrid target's attention backend cannot commit verify states.")
        track = batch.mamba_track_indices is not None
        last, steps_to_track = ops.mamba_commit_steps(
            walk.path, walk.accept_len, prefix_lens, get_exec().mamba.mamba_track_interval if track else None)
        runner = self.target_worker.model_runner
        backend = self._last_verify_backend or runner.attn_backend  # its metadata is the verify's that just ran
        backend.update_mamba_state_after_mtp_verify(
            last_correct_step_indices=last,
            mamba_track_indices=batch.mamba_track_indices,
            mamba_steps_to_track=steps_to_track,
            model=runner.model,
            req_pool_indices=batch.req_pool_indices[:bs],
        )

    def _kv_mover(self):
        """The KV move of the commit: our kernel, which copies only the rows that move (kernels.move_path_kv), on
        the plain MHA pool SGLang's own all-rows copy serves; that copy (move_kv_cache) on any other pool."""
        pool = self.target_worker.model_runner.token_to_kv_pool_allocator.get_kvcache()
        try:
            from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        except ImportError:
            MHATokenToKVPool = None
        plain_mha = (MHATokenToKVPool is not None
                     and type(pool).move_kv_cache is MHATokenToKVPool.move_kv_cache
                     and type(pool)._move_kv_cache_impl is MHATokenToKVPool._move_kv_cache_impl
                     and not getattr(pool, "use_hnd", False) and not getattr(pool, "use_native_move_kv_cache", False)
                     and getattr(pool, "k_scale_buffer", None) is None and getattr(pool, "layer_num", 0) > 0
                     and getattr(pool, "data_ptrs", None) is not None)
        if not (self.use_kernels and plain_mha and os.environ.get("SGLANG_DDTREE_KV_MOVE") != "sglang"):
            return pool.move_kv_cache
        ptrs, strides = pool.data_ptrs, pool.data_strides
        max_stride = int(strides.max())  # once, at the first round
        return partial(kernels.move_path_kv, ptrs, strides, max_stride, rows_per_request=self.depth_limit)

    def _commit(self, plan, target_hidden, commit_lens, bs, width, chain=False):
        """Accepted KV to consecutive slots (target pool), drafter context KV from the accepted hidden states.
        chain: the verified tree was a chain, whose accepted nodes are already at consecutive slots."""
        if not chain:
            if self._move_kv is None:
                self._move_kv = self._kv_mover()
            self._move_kv(plan.kv_dest, plan.kv_src)
        # Rows 0..P-1, P = min(16, B+1): at most that many KV entries can be committed in a round.
        path_len = plan.draft_cache_loc.shape[1]
        hidden = target_hidden.view(bs, width, -1)
        # A chain's accepted rows are its first ones, as DFLASH reads them (rows past commit_lens are not written)
        path_hidden = hidden[:, :path_len] if chain else ops.gather_path_rows(hidden, plan.walk.path)[:, :path_len]
        self._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=path_hidden.reshape(bs * path_len, -1),
            cache_loc=plan.draft_cache_loc.reshape(-1),
            positions=plan.draft_positions,
            cache_loc_2d=plan.draft_cache_loc,
            commit_lens=commit_lens,
        )
