"""DDTreeWorker: DFlash's spec-v2 worker with a budgeted draft tree instead of a 16-token chain.

One round, per batch (all on the GPU, no host sync on the default path), DDTreeWorker._round:
  0. choose  - `--speculative-ddtree-budget auto` only: a candidate budget for this round, on the host
               (sglang_ddtree.sglang.auto_round; the policy is sglang_ddtree.sglang.auto).
  1. draft   - the DFlash drafter runs one block [bonus, mask x 15] (SGLang's draft runner, graph-captured);
               we keep the top-K log-probs of each of the 15 positions (K = min(B, V), TP shards merged).
  2. tree    - the B most probable prefixes (sglang_ddtree.tree), their ancestor mask and depth positions.
  3. verify  - one target forward over the B+1 nodes of every request (TARGET_VERIFY with a custom mask,
               graph-captured at B+1 tokens per request); node i's KV lands in slot req_to_token[prefix + i].
  4. walk    - the longest path on which the target's own choice (argmax, or a per-node sample) matches a child.
  5. commit  - the accepted nodes' KV is copied to slots prefix+1..prefix+k (the rest of the reserved slots are
               simply overwritten next round), the drafter's context KV is written from the accepted nodes' target
               hidden states.
  6. finish  - `auto`'s feedback, the stats, and the result in DFLASH's format ([bs, 16] tokens: accepted then
               bonus; accept_lens = k + 1; cap_lens = the path's branch tokens).
The round's state is a round_state.Round; the measuring and testing modes (A/B arms, host detail, scripted drafts,
the oracle, the debug dump) reach it through one seam, self.modes (sglang_ddtree.sglang.modes), whose hooks do
nothing when no mode is on.
Prefill, idle batches, KV reservation and the overlap relay are DFLASH's, inherited unchanged.
What is checked or built outside the round (the target / drafter checks, the lm_head shard, the modes, `auto`'s and
the oracle's verify states, the commit's KV move) is the mixin WorkerSetup's (sglang_ddtree.sglang.worker_setup).
Between SGLang's graph replays (drafter, target verify) the fixed-shape work is replayed as three graphs per
CUDA-graph batch size, padded like the verify (sglang_ddtree.graphs): the draft top-K, the tree with its verify ids
and positions, and the walk with the commit's slot arithmetic. Left eager: the verify mask (its size follows the
context length), the target's choices (argmax or sampling), SGLang's KV move and the drafter-KV append.
An `auto` chain round that samples nothing (most chain rounds) runs _chain_round instead: DFLASH's round on our
top-1 head, the walk, commit arithmetic and stats summary in one kernel (ops.chain_accept). An `auto` round without
a draft (candidate `plain`) runs _plain_round: no draft pass, the target verifies the last committed token alone.
Every round's outputs (tokens, lengths, branch counts) go to two buffer sets used in turn (_outputs).
Hybrid targets (gated-delta-net layers, e.g. Qwen3-Next): the plugin sets speculative_eagle_topk = 2 so SGLang's
hybrid backend runs its tree verify (each node's conv window and SSM state from its parent's, stored per node); the
verify input carries the tree's links (retrieve_next_token / retrieve_next_sibling), and after the walk the live
recurrent state becomes the stored state of the last accepted node (and radix-cache tracking takes the node at
the tracking point), instead of DFLASH's "step accept_len" which is only right for a chain.
"""

from __future__ import annotations

import contextlib
import logging
from functools import partial

import torch

from sglang_ddtree import config, kernels
from sglang_ddtree.adaptive import CHAIN, PLAIN, candidate_label
from sglang_ddtree.graphs import GraphedStage
from sglang_ddtree.layout import ancestor_mask
from sglang_ddtree.sglang import args as ddtree_args
from sglang_ddtree.sglang import engine, ops
from sglang_ddtree.sglang.auto_round import AutoRounds
from sglang_ddtree.sglang.hooks import causal_verify, mark_active
from sglang_ddtree.sglang.round_state import Round
from sglang_ddtree.sglang.stats import DDTreeStats, StallDetector
from sglang_ddtree.sglang.worker_setup import WorkerSetup
from sglang_ddtree.walk import sample_choices

logger = logging.getLogger(__name__)


class DDTreeWorker(WorkerSetup, engine.worker_base()):
    # SGLang constructs the worker by keyword; `ps` only where its DFLASH worker still takes it (sglang.engine)
    def __init__(self, server_args, gpu_id, nccl_port, target_worker, ps=None):
        super().__init__(server_args, gpu_id, nccl_port, target_worker, ps=ps)
        self.options = ddtree_args.options_from(server_args)
        self.budget = self.options.budget
        self.num_nodes = self.budget + 1
        width = engine.verify_width(server_args)
        if width != self.num_nodes:
            raise ValueError(
                f"DDTREE expected speculative_num_draft_tokens = budget + 1 = {self.num_nodes}, got {width}; do not "
                f"pass --speculative-num-draft-tokens with DDTREE."
            )
        # DFlashWorkerV2 sized itself from speculative_num_draft_tokens (the verify width B+1); the drafter's own
        # block is the DFlash block (16). Everything draft-side and the result stride use the block.
        self.block_size = engine.drafter_block(server_args)
        engine.fit_drafter(self, self.block_size)  # the drafter's block back to it; heads and pools DDTREE refuses
        self.depth_limit = self.block_size - 1
        self.speculative_num_draft_tokens = self.block_size  # SGLang's accept-rate gauge: per-depth rate
        self._block_pos_offsets = engine.block_pos_offsets(self.block_size, self.device)
        self._draft_block_spec_info = engine.block_spec_info(self.block_size, self.device)
        self.hybrid = False  # set by _check_models: a gated-delta-net hybrid target
        self._move_kv = None  # the commit's KV move (_kv_mover), chosen at the first round: the pool exists then
        self._bucket_cache = None  # (SGLang's decode graph runner, its sorted batch sizes, {bs: bucket}): _graph_bucket
        self._check_models()
        self._lm_head_shard = self._resolve_lm_head_shard()
        self.topk = min(self.budget, self._lm_head_shard["vocab_size"])
        # Triton kernels for tree/mask/walk (3 launches a round); SGLANG_DDTREE_TORCH_PATH=1 selects the torch
        # reference implementations instead (identical results, ~150 small launches a round).
        self.use_kernels = kernels.available(self.device) and not config.get("SGLANG_DDTREE_TORCH_PATH")
        # The fixed-shape stages between SGLang's own graph replays, captured as graphs (sglang_ddtree.graphs): at
        # batch 1 on a small target the round is host-bound, and these stages were several dozen eager launches of
        # it. They run at SGLang's CUDA-graph batch sizes (the verify's own), padded, instead of one capture per
        # batch size met (as requests finish one by one, each capture a stall of the round). Off with decode CUDA
        # graphs off or with the torch path.
        decode_graphs = engine.decode_graphs_on()
        self.round_graphs = self.use_kernels and decode_graphs
        self._pad = dict(bucket_of=self._graph_bucket) if self.round_graphs else {}  # every stage's padding options
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
            unpad=ops.unpad_commit_plan, rows_arg=self.round_graphs, **pad)
        self.modes = self._measuring_modes()  # before any capture below: scripted drafts change the auto heads
        mark_active()  # before any capture below: the verify-mask hook keys on it
        self.auto = AutoRounds.build(self) if self.options.auto else None
        # `auto`'s chain rounds that sample nothing run _chain_round; not with the oracle (it re-verifies the tree
        # round's path), a hybrid target (its recurrent-state commit reads the tree walk) or the debug dump (it
        # writes every round's tree).
        self.lean_chain = (self.auto is not None and not self.options.oracle and not self.hybrid
                           and self.stats.debug is None)
        if self.auto is not None and PLAIN in self.auto.candidates and not self.lean_chain:
            # the round without a draft commits as the lean chain round does (no tree walk to read)
            raise ValueError("--speculative-ddtree-auto-candidates: 'plain' needs an attention-only target and no "
                             "--speculative-ddtree-debug.")
        self._stalls = StallDetector()  # rounds that stalled on the host are cold (stats.StallDetector)
        self._output_sets = None  # _outputs: two sets of the round's output buffers, used in turn
        self._output_slot = 0
        self._output_views = {}  # _outputs: (set, batch size) -> the set's views for that batch size
        self._last_verify_backend = None  # the attention backend of the round's last verify (_verify)
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
    # The round

    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None):
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch or batch.forward_mode.is_idle():
            self.stats.other_batch()
            return self.dflash_forward(batch, on_publish=on_publish, grammar_barrier=grammar_barrier,
                                       pp_proxy_tensors=pp_proxy_tensors)
        if getattr(batch, "return_logprob", False):  # refused per request (plugin._after_validate_request)
            raise ValueError("DDTREE speculative decoding does not support return_logprob yet.")
        return self._round(batch, on_publish)

    def _round(self, batch, on_publish):
        """One decode round: choose -> draft -> tree -> verify -> walk -> commit -> finish."""
        r = self._start(batch, on_publish)
        if r.use_auto:
            self.auto.choose(self, r)
            if self.auto.candidates[r.chosen] == PLAIN:  # no draft: one target decode step
                self._plain_round(r)
                return self._finish(r)
        r.top1_only = (r.use_auto and self.auto.candidates[r.chosen] == CHAIN and not r.sampled
                       and self.modes.scripted is None)
        r.lean = r.top1_only and self.lean_chain
        self._draft_round(r)
        if r.lean:  # `auto`'s chain round that samples nothing: verify, walk and commit of the drafter's top-1
            self._chain_round(r)
        else:
            self._tree(r)
            self._verify_tree(r)
            self._walk(r)
            self._commit_tree(r)
        return self._finish(r)

    def _start(self, batch, on_publish) -> Round:
        if batch.spec_info is None:
            batch.spec_info = engine.idle_draft_input(self.device)
        draft_input = batch.spec_info
        batch.seq_lens.record_stream(torch.get_device_module(self.device).current_stream())
        timer = self.stats.round_timer()
        seq_lens_cpu_bound, seq_lens_sum_bound = self._host_seq_len_bound(batch, draft_input)
        r = Round(batch, draft_input, len(batch.seq_lens), batch.seq_lens, seq_lens_cpu_bound, seq_lens_sum_bound,
                  timer, on_publish, GraphedStage.total_captures)
        self.modes.start(self, r)  # the A/B's arm; the oracle's verify state at the first round
        r.use_auto = self.auto is not None and not r.fixed_arm
        return r

    def _draft_round(self, r: Round) -> None:
        """The drafter's block, its top-K (the top-1 only where the round needs no more) and the tree's root."""
        r.draft_hidden, r.block_positions, r.block_slots = self._draft(r.batch, r.draft_input, r.seq_lens_cpu_bound,
                                                                       r.seq_lens_sum_bound)
        r.topk_values, r.topk_tokens = self._draft_topk(r.draft_hidden, 1 if r.top1_only else self.topk)
        self.modes.drafts(r)
        r.timer.mark("draft", following="verify" if r.lean else None)
        r.roots = r.draft_input.bonus_tokens.view(-1)

    def _tree(self, r: Round) -> None:
        """The server's tree (or `auto`'s candidate's), its verify inputs and its mask (none for a chain)."""
        if r.use_auto:
            self.auto.tree(self, r)
        else:
            r.width, r.walk_stage = self.num_nodes, self._walk_stage
            r.tree, r.verify_ids, r.verify_positions = self._tree_stage(r.topk_values, r.topk_tokens, r.roots,
                                                                        r.prefix_lens, rows=r.bs)
        mask_numel = ops.verify_mask_numel(r.width, r.seq_lens_sum_bound, r.bs)
        if r.causal:
            r.mask = None
        elif self.use_kernels:
            r.mask = kernels.tree_verify_mask_triton(r.tree, r.prefix_lens, mask_numel)
        else:
            r.mask = ops.tree_verify_mask(ancestor_mask(r.tree), r.prefix_lens, mask_numel)
        r.timer.mark("tree")

    def _verify_tree(self, r: Round) -> None:
        """The target's verify of every node at its reserved KV slots (prefix + node index)."""
        r.node_cache_loc = self._verify_slots(r.batch, r.prefix_lens, r.bs, r.width)
        self.modes.before_verify(self, r)
        r.logits_output, r.can_run_cuda_graph = self._verify(
            r.batch, r.verify_ids, r.verify_positions, r.mask, r.node_cache_loc, r.seq_lens_cpu_bound,
            r.seq_lens_sum_bound, r.width, r.causal, links=ops.tree_links(r.tree) if self.hybrid else None)
        r.timer.mark("verify")

    def _walk(self, r: Round) -> None:
        """The target's choices, the accepted path and the commit's slot arithmetic (the walk stage)."""
        tree = r.tree
        r.choices = self._target_choices(r.batch, r.logits_output, r.bs, r.width)
        r.plan = r.walk_stage(tree.tokens, tree.parents, tree.depth, tree.scores, tree.ranks, tree.valid,
                              r.choices, r.node_cache_loc, r.prefix_lens, rows=r.bs)
        r.walk, r.summary = r.plan.walk, r.plan.summary  # the tree's: what the stats record
        self.modes.after_walk(self, r)  # the oracle: the round commits its chain re-verify's plan instead
        r.timer.mark("walk")  # with the oracle: its re-verify included

    def _commit_tree(self, r: Round) -> None:
        """What leaves the round is copied out of the stage's graph memory (the next round's replay rewrites it), in
        one call into the round's output buffers (_outputs); then the KV (and a hybrid's recurrent state) commit."""
        plan, bs = r.plan, r.bs
        leaving = (plan.commit_lens, plan.new_seq_lens, plan.out_tokens, plan.walk.bonus, plan.branch_lens)
        if self.round_graphs:
            kept = self._outputs(bs, r.prefix_lens.dtype)
            kept = tuple(kept[name] for name in ("commit_lens", "new_seq_lens", "out_tokens", "bonus", "branch_lens"))
            torch._foreach_copy_(kept, leaving)
            leaving = kept
        r.commit_lens, r.new_seq_lens, r.out_tokens, r.bonus, r.branch_lens = leaving
        if r.on_publish is not None:
            r.on_publish(r.new_seq_lens)
        if self.hybrid:
            self._commit_recurrent_state(r.batch, plan.walk, r.prefix_lens, bs)
        self._commit(plan, r.logits_output.hidden_states, r.commit_lens, bs, r.width, chain=r.causal)
        r.logits_output.hidden_states = None
        r.timer.mark("commit")

    def _chain_round(self, r: Round) -> None:
        """`auto`'s chain round when it samples nothing (most chain rounds): a DFLASH round on our draft head. The
        drafter's top-1 path is verified causally at the draft block's own positions and KV slots (nothing to move
        after), then one kernel (ops.chain_accept) does the walk, the commit arithmetic and the stats summary into
        the round's output buffers. Why: through the general round (a tree stage, a walk stage, their input and
        output copies, the verify slots) `auto`'s chain cost about as much as a tree round, ~1.4 ms more than a DFLASH
        step on the tiny pair at batch 4, so where the chain was the best choice `auto` could not reach DFLASH. Its
        results are the general round's for the chain tree (tests/test_kernels.py's chain check against
        walk_commit_plan's arithmetic; the GPU server module)."""
        batch, bs, block, prefix_lens = r.batch, r.bs, self.block_size, r.prefix_lens
        self.auto.lean_chain_rounds += 1
        if self.auto.lean_chain_rounds == 1 and self.ps.tp_rank == 0:
            logger.info("DDTREE auto: first lean chain round (batch size %d)", bs)
        if self.stats.prometheus is not None:
            self.stats.prometheus.auto_round(candidate_label(CHAIN), r.bucket)
        ids = torch.cat([r.roots.to(torch.int64).view(bs, 1), r.topk_tokens.reshape(bs, block - 1)], dim=1)
        r.logits_output, r.can_run_cuda_graph = self._verify(
            batch, ids.view(-1), r.block_positions.reshape(-1), None, r.block_slots, r.seq_lens_cpu_bound,
            r.seq_lens_sum_bound, block, causal=True)
        r.timer.mark("verify")

        r.choices = self._target_choices(batch, r.logits_output, bs, block)
        out = self._outputs(bs, prefix_lens.dtype)
        ops.chain_accept(self.use_kernels, ids, r.choices, r.topk_values.reshape(bs, block - 1), prefix_lens, out)
        r.timer.mark("walk")

        self._commit_in_place(r, out, r.block_slots, r.block_positions)

    def _plain_round(self, r: Round) -> None:
        """`auto`'s round without a draft: the target verifies each request's last committed token (the root)
        alone, causally, at its own position and KV slot, and commits its own next token, as a plain decode step
        does. The drafter's context still takes that token's target hidden state (the drafter KV append a commit
        does), so the next drafted round drafts from where the text is. The round records no draft (its stats
        summary is zeros: the drafter's acceptance counts drafted rounds only); SGLang counts its one token."""
        batch, bs, prefix_lens = r.batch, r.bs, r.prefix_lens
        r.plain = True
        if self.stats.prometheus is not None:
            self.stats.prometheus.auto_round(candidate_label(PLAIN), r.bucket)
        roots = r.draft_input.bonus_tokens.view(-1).to(torch.int64)
        slots = self._slots(batch, prefix_lens, 1, bs).view(bs, 1)
        positions = prefix_lens.to(torch.int64)
        r.logits_output, r.can_run_cuda_graph = self._verify(
            batch, roots, positions, None, slots, r.seq_lens_cpu_bound, r.seq_lens_sum_bound, 1, causal=True)
        r.timer.mark("verify", following="walk")
        r.choices = self._target_choices(batch, r.logits_output, bs, 1)
        out = self._outputs(bs, prefix_lens.dtype)
        ops.plain_step(r.choices, prefix_lens, out)
        r.timer.mark("walk")
        self._commit_in_place(r, out, slots, positions)

    def _commit_in_place(self, r: Round, out: dict[str, torch.Tensor], slots: torch.Tensor,
                         positions: torch.Tensor) -> None:
        """The end of a round whose verified tokens already sit at their own KV slots (a causal verify: the lean
        chain round's block, a plain round's one token; nothing to move): what leaves the round, from its output
        buffers (`out`, ops.CHAIN_OUTPUTS), published; then the drafter's context KV from the committed rows' target
        hidden states. slots [bs, width] and positions (bs * width of them) of the verified tokens."""
        r.commit_lens, r.new_seq_lens, r.out_tokens, r.bonus, r.branch_lens = (
            out["commit_lens"], out["new_seq_lens"], out["out_tokens"], out["bonus"], out["branch_lens"])
        r.summary = out["summary"]
        if r.on_publish is not None:
            r.on_publish(r.new_seq_lens)
        self._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=r.logits_output.hidden_states.view(slots.numel(), -1),
            cache_loc=slots.reshape(-1),
            positions=positions.reshape(-1),
            cache_loc_2d=slots,
            commit_lens=r.commit_lens,
        )
        r.logits_output.hidden_states = None
        r.timer.mark("commit")

    def _finish(self, r: Round):
        """`auto`'s feedback, the round's stats, the one-time captures of a new batch-size bucket, the result."""
        stalled = self._stalls.stalled(r.timer.host_ms)  # once a round: every round's host time feeds the limit
        if r.lean or r.plain:
            self.auto.after_round(self, r, None, None, stalled)
        elif r.use_auto:
            self.auto.after_tree_round(self, r, stalled)
        else:
            r.cold = stalled or GraphedStage.total_captures != r.captures
        self.modes.arm(self, r)
        # reqs/seq_lens are only read by the debug dump (after its sync): no host sync on the default path.
        self.stats.record_round(r.tree, r.walk, r.timer, batch_size=r.bs, reqs=getattr(r.batch, "reqs", None),
                                seq_lens=r.prefix_lens, summary=r.summary, extra=self.modes.dump_extra(self, r))
        self.modes.dumped(self, r)
        if (r.use_auto and self.round_graphs and r.bucket not in self.auto.captured_buckets
                and r.draft_hidden is not None and self._graph_bucket(r.bs) is not None):  # a drafted round's inputs
            self.auto.capture_bucket(self, r, r.choices.dtype)
        result = engine.batch_result(
            logits_output=r.logits_output,
            next_token_ids=r.out_tokens.reshape(-1),
            accept_lens=r.commit_lens,
            # SGLang's per-request "cap" channel (DSpark's) carries our branch counts to meta_info: copied to the
            # host with accept_lens, summed and histogrammed per request (plugin._after_spec_metrics renames it).
            cap_lens=r.branch_lens,
            can_run_cuda_graph=r.can_run_cuda_graph,
            next_draft_input=engine.next_draft_input(r.bonus, r.new_seq_lens),
            speculative_num_draft_tokens=self.block_size,
            new_seq_lens=r.new_seq_lens,
        )
        self.stats.finish_round(r.timer)
        return result

    # ------------------------------------------------------------------------------------------------------------
    # Output buffers, graph buckets, calls from outside the round

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
        # the views per (set, batch size), made once: seven slices a round were 16 us a profiled batch
        key = (self._output_slot, bs)
        views = self._output_views.get(key)
        if views is None:
            views = self._output_views[key] = {name: t if name == "summary" else t[:bs]
                                               for name, t in sets[self._output_slot].items()}
        return views

    def _graph_bucket(self, bs: int) -> int | None:
        """The batch size a verify of `bs` requests pads to (SGLang's captured sizes); None past the largest (the
        verify runs eagerly there, and so do our stages: graphs.GraphedStage). Asked by every padded stage, 3-4
        times a round: the answers are kept per runner (sorting the sizes each time cost 16-28 us a round under
        cProfile at batch 1)."""
        graphs = self.target_worker.model_runner.decode_cuda_graph_runner
        cache = self._bucket_cache
        if cache is None or cache[0] is not graphs:  # the first call, or SGLang built another runner
            cache = self._bucket_cache = (graphs, sorted(getattr(graphs, "capture_bs", None) or []), {})
        _, sizes, buckets = cache
        if bs not in buckets:
            buckets[bs] = next((size for size in sizes if size >= bs), None)
        return buckets[bs]

    def _auto_bucket(self, bs: int) -> int:
        """`auto`'s batch-size bucket (its times and decisions are per bucket): the verify's CUDA-graph size, past
        the largest one the next power of two, so that the sizes met as requests finish share their candidates'
        times instead of each exploring every candidate anew."""
        bucket = self._graph_bucket(bs)
        return bucket if bucket is not None else 1 << (bs - 1).bit_length()

    def reset_calibration(self) -> bool:
        """`auto`'s calibration table starts empty again (plugin: POST /set_internal_state with
        {"server_args": {"ddtree_calibration_reset": 1}}). Not on /flush_cache: benchmark harnesses flush between
        runs (2-12 flushes per sweep row), which would keep the table cold. False without `auto`."""
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
    # Stages

    def _host_seq_len_bound(self, batch, draft_input):
        """Host-side upper bound of the committed lengths (the host copy lags by one round of at most `block_size`
        tokens). Sizes kernel metadata and the mask without reading the device lengths."""
        bs = len(batch.seq_lens)
        reserved = engine.reserved_lens_cpu(draft_input)
        if batch.seq_lens_cpu is not None:
            bound = batch.seq_lens_cpu.to(torch.int64) + self.block_size
        elif reserved is not None:
            bound = reserved.to(torch.int64)
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
            engine.prepare_draft_block(
                draft_input.bonus_tokens.view(-1), prefix_lens.view(-1), batch.req_pool_indices.view(-1),
                self.model_runner.req_to_token_pool.req_to_token, block_ids, positions_2d, cache_loc_2d,
                int(self._mask_token_id))
        else:
            block_ids.fill_(int(self._mask_token_id))
            block_ids[:, 0].copy_(draft_input.bonus_tokens.view(-1))
            torch.add(prefix_lens.to(torch.int64).unsqueeze(1), self._block_pos_offsets, out=positions_2d)
            cache_loc_2d.copy_(self._slots(batch, prefix_lens, block, bs).view(bs, block))

        input_embeds = engine.draft_embeddings(self, block_ids).view(bs * block, -1)
        # SGLang's ForwardBatch, the iteration's KV plan and the drafter's parallel scope: sglang.engine.draft_forward
        draft_out = engine.draft_forward(self, batch, block_ids, prefix_lens, cache_loc_2d, positions_2d,
                                         seq_lens_cpu_bound.to(torch.int32), seq_lens_sum_bound, input_embeds)
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
        group = engine.tp_group()

        def all_gather(x):
            out = torch.empty((group.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
            group.all_gather_into_tensor(out, x)
            return out

        return ops.draft_topk_logprobs(hidden, weight, k, vocab_start=shard["start"],
                                       all_gather=all_gather, world_size=group.world_size)

    def _slots(self, batch, prefix_lens, count, bs):
        """KV slots of positions prefix .. prefix+count-1 of every request (reserved by DFLASH's prepare step)."""
        return engine.extend_slots(batch, self.model_runner.req_to_token_pool.req_to_token, prefix_lens, count, bs,
                                   self.device)

    def _verify_slots(self, batch, prefix_lens, bs, width):
        return self._slots(batch, prefix_lens, width, bs).view(bs, width)

    @contextlib.contextmanager
    def _verify_state(self, width: int, causal: bool):
        """The target runner with the attention backend and verify graphs of this verify's (width, causal) swapped
        in (`auto`'s candidates, the oracle's chain; SGLang's own for the server's widest tree), restored after."""
        runner = self.target_worker.model_runner
        saved = (runner.attn_backend, runner.decode_cuda_graph_runner)
        if (width, causal) != (self.num_nodes, False):
            states = self.auto.verify_states if self.auto is not None else self.modes.oracle.states
            runner.attn_backend, runner.decode_cuda_graph_runner = states[(width, causal)]
        try:
            yield runner
        finally:
            runner.attn_backend, runner.decode_cuda_graph_runner = saved

    def _verify(self, batch, verify_ids, verify_positions, mask, node_cache_loc, seq_lens_cpu_bound,
                seq_lens_sum_bound, width, causal=False, links=None):
        verify_input = engine.verify_input(
            self.target_worker.model_runner, batch, width, node_cache_loc, seq_lens_cpu_bound,
            draft_token=verify_ids,
            positions=verify_positions,
            custom_mask=mask,
            retrieve_next_token=None if links is None else links[0],
            retrieve_next_sibling=None if links is None else links[1],
        )
        batch.out_cache_loc = node_cache_loc.reshape(-1)
        saved = (batch.seq_lens_cpu, batch.seq_lens_sum)
        batch.seq_lens_cpu = seq_lens_cpu_bound.to(saved[0].dtype if saved[0] is not None else torch.int64)
        batch.seq_lens_sum = seq_lens_sum_bound
        try:
            with self._verify_state(width, causal) as runner, causal_verify() if causal else contextlib.nullcontext():
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
        # at TP >= 2 a release may leave the verify's logits vocabulary-sharded until asked (sglang.engine)
        logits_output.next_token_logits = engine.full_vocab_logits(self, logits_output.next_token_logits)
        if info is not None:
            engine.apply_logit_adjustments(logits_output.next_token_logits, info, width)
        logits = logits_output.next_token_logits.view(bs, width, -1)
        if info is None or info.is_all_greedy:
            return logits.argmax(dim=-1)
        choice = sample_choices(logits, info.temperatures.view(-1), info.top_ks.view(-1).to(torch.int64),
                                info.top_ps.view(-1))
        if self.ps.tp_size > 1:  # every rank must walk the same samples
            engine.tp_group().broadcast(choice, src=0)
        return choice

    def _commit_recurrent_state(self, batch, walk, prefix_lens, bs):
        """Hybrid targets: the verify stored every node's conv window and SSM state (its parent's, advanced by its
        token); the live state becomes the last accepted node's, and radix-cache tracking copies the node at the
        tracking point (ops.mamba_commit_steps). Reads the metadata of the verify that just ran."""
        if not self._need_mamba_verify_commit:
            raise RuntimeError("DDTREE: the hybrid target's attention backend cannot commit verify states.")
        track = batch.mamba_track_indices is not None
        last, steps_to_track = ops.mamba_commit_steps(
            walk.path, walk.accept_len, prefix_lens, engine.mamba_track_interval() if track else None)
        runner = self.target_worker.model_runner
        backend = self._last_verify_backend or runner.attn_backend  # its metadata is the verify's that just ran
        backend.update_mamba_state_after_mtp_verify(
            last_correct_step_indices=last,
            mamba_track_indices=batch.mamba_track_indices,
            mamba_steps_to_track=steps_to_track,
            model=runner.model,
            req_pool_indices=batch.req_pool_indices[:bs],
        )

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
