"""What DDTreeWorker (sglang/worker.py) builds and checks outside its round, from SGLang's runners and pools.

At start: the checks of the target / drafter pair (a gated-delta-net hybrid target turns on SGLang's tree verify and
our conv hook), the target lm_head shard the draft top-K reads, and the measuring and testing modes
(sglang_ddtree.sglang.modes). Later, once: the extra verify states (attention backend + verify graphs) of `auto`'s
candidate widths and the oracle's chain, and the commit's KV move (at the first round: the pool exists then).

WorkerSetup is a mixin of DDTreeWorker: its methods read the worker's members (runners, options, stats) as the
worker's own methods do, and keep their names, which other modules call (auto_round, modes). Kept apart from
worker.py so that the round reads as one piece there.
"""

from __future__ import annotations

import contextlib
import logging
from functools import partial

import torch

from sglang_ddtree import config, kernels, tree_conv
from sglang_ddtree.sglang import args as ddtree_args
from sglang_ddtree.sglang import engine
from sglang_ddtree.sglang.auto_ab import ABSchedule, auto_ab_block, auto_host_detail
from sglang_ddtree.sglang.hooks import causal_verify_capture, install_tree_conv_hook, install_verify_attention_hook
from sglang_ddtree.sglang.modes import MeasuringModes, Oracle, RoundModes
from sglang_ddtree.sglang.scripted import ENV as SCRIPT_ENV, ScriptedDrafts

logger = logging.getLogger(__name__)


class WorkerSetup:
    """DDTreeWorker's start-up checks and the states it builds once (see the module docstring)."""

    def _check_models(self) -> None:
        target_cfg = self.model_runner.model_config
        draft_cfg = self.draft_model_runner.model_config
        recurrence = engine.recurrence(target_cfg)
        if recurrence is not None:
            # SGLang's own detection, authoritative; the plugin's (from the config file) ran at startup
            if recurrence != "gdn":
                raise ValueError(ddtree_args.OTHER_RECURRENT_REFUSAL)
            # topk > 1 here means the plugin recognised the target and already applied check_hybrid_config
            if int(self.server_args.speculative_eagle_topk or 1) <= 1:
                raise ValueError(
                    "DDTREE on a hybrid target needs SGLang's tree verify (speculative_eagle_topk > 1), which the "
                    "plugin sets when it recognises the target's config at startup; it did not here (was the model "
                    "config readable from --model-path?)."
                )
            self.hybrid = True
            conv = install_tree_conv_hook()  # this process's tree verifies: ours above 65 tokens (tree_conv.use_ours)
            if self.ps.tp_rank == 0 and tree_conv.use_ours(self.num_nodes, conv):
                logger.warning("DDTREE: budget %d on a hybrid target: the %d-token tree verify's conv runs "
                               "sglang-ddtree's kernel (SGLANG_DDTREE_TREE_CONV=%s; SGLang's unrolls over the "
                               "tokens and compiled for minutes above 64).", self.budget, self.num_nodes, conv)
            elif self.budget > 64 and self.ps.tp_rank == 0:
                # measured on an H200: verify-graph capture took 108 s at B=64, more than 7 minutes at 128 and 256
                logger.warning("DDTREE: budget %d on a hybrid target with SGLang's tree conv kernel, which unrolls "
                               "over the %d verify tokens: its compile can take many minutes (108 s at 64, more "
                               "than 7 minutes at 128).", self.budget, self.num_nodes)
        else:
            # the target's attention backends are built after this worker, and import the hooked kernel then
            attention = install_verify_attention_hook()
            if self.ps.tp_rank == 0:
                logger.info("DDTREE: tree verify attention on the Triton backend: %s (SGLANG_DDTREE_VERIFY_ATTENTION)",
                            "sglang-ddtree's kernels where faster (split prefix at small batches, one program a "
                            "request and KV group for verifies of up to 64 tokens)" if attention == "ddtree"
                            else "SGLang's extend kernel")
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

    def _measuring_modes(self) -> RoundModes:
        """The measuring and testing modes this server runs (sglang_ddtree.sglang.modes), read at the start."""
        script = config.get(SCRIPT_ENV)
        scripted = ScriptedDrafts(script, self._lm_head_shard["vocab_size"]) if script else None
        if scripted is not None and self.ps.tp_rank == 0:
            logger.warning("DDTREE: scripted drafts from %s (%s): a test-only mode, the drafter is ignored", script,
                           SCRIPT_ENV)
        # SGLANG_DDTREE_AUTO_AB: decode rounds alternate in blocks of this many between `auto` and the fixed widest
        # tree (0: off); its tallies are Prometheus counters
        ab_block = auto_ab_block()
        if ab_block and not self.options.auto:
            raise ValueError("SGLANG_DDTREE_AUTO_AB compares `auto` with the fixed widest tree in one server: it needs "
                             "--speculative-ddtree-budget auto.")
        if ab_block and self.ps.tp_rank == 0 and self.stats.prometheus is None:
            raise ValueError("SGLANG_DDTREE_AUTO_AB tallies its arms in Prometheus counters: it needs "
                             "--enable-metrics.")
        if ab_block and self.ps.tp_rank == 0:
            logger.warning("DDTREE A/B (SGLANG_DDTREE_AUTO_AB=%d): decode rounds alternate in blocks of %d between "
                           "auto and the fixed %d-tree, a measuring mode (sglang:ddtree_ab_* per arm)",
                           ab_block, ab_block, self.budget)
        # SGLANG_DDTREE_AUTO_HOST_DETAIL: `auto`'s own host work marked apart (stages.AUTO_HOST_DETAIL)
        host_detail = self.options.auto and auto_host_detail()
        oracle = Oracle(min(self.block_size, self.num_nodes)) if self.options.oracle else None
        if oracle is not None and self.ps.tp_rank == 0:
            logger.warning("DDTREE oracle: every round verifies its accepted path once more as a chain (%d tokens, "
                           "causal) and commits what that verify accepts: two target passes a round, for checking "
                           "the tree verify, not for speed", oracle.width)
        debug = self.options.auto and self.stats.debug is not None
        if not (scripted or ab_block or host_detail or oracle or debug):
            return RoundModes()
        return MeasuringModes(ab=ABSchedule(ab_block), ab_block=ab_block, host_detail=host_detail, scripted=scripted,
                              oracle=oracle, debug=debug)

    def _build_verify_state(self, width: int, causal: bool):
        """A target attention backend (own workspace) and, with decode graphs on, verify CUDA graphs for `width`
        tokens per request (causal: without the custom mask), built the way SGLang's adaptive EAGLE builds its
        per-step states."""
        return engine.build_verify_state(self.target_worker.model_runner, width,
                                         causal_verify_capture() if causal else contextlib.nullcontext())

    def _kv_mover(self):
        """The KV move of the commit: our kernel, which copies only the rows that move (kernels.move_path_kv), on
        the plain MHA pool SGLang's own all-rows copy serves; that copy (move_kv_cache) on any other pool."""
        pool = engine.target_kv_pool(self.target_worker.model_runner)
        if not (self.use_kernels and engine.plain_mha_pool(pool)):
            return pool.move_kv_cache
        ptrs, strides = pool.data_ptrs, pool.data_strides
        max_stride = int(strides.max())  # once, at the first round
        return partial(kernels.move_path_kv, ptrs, strides, max_stride, rows_per_request=self.depth_limit)
