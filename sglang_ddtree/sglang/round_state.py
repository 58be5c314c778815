"""One DDTREE decode round's state, filled stage by stage (sglang/worker.py: choose -> draft -> tree -> verify ->
walk -> commit -> finish). Plain data: the stages and the measuring modes (sglang/modes.py) read and write it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass
class Round:
    # the batch, as the round starts
    batch: Any
    draft_input: Any
    bs: int
    prefix_lens: torch.Tensor
    seq_lens_cpu_bound: torch.Tensor  # a host-side upper bound of the committed lengths (DDTreeWorker._host_seq_len_bound)
    seq_lens_sum_bound: int
    timer: Any  # stats.RoundTimer
    on_publish: Callable | None
    captures: int  # stage graphs captured in the process before the round (a round that changes it did one-time work)
    fixed_arm: bool = False  # SGLANG_DDTREE_AUTO_AB: the round is the fixed widest tree's
    # choose: `auto`'s pick (use_auto False: the server's fixed tree)
    use_auto: bool = False
    built: bool = False  # verify states were built in this round
    bucket: int | None = None
    chosen: int | None = None  # the candidate's index
    sampled: bool = False  # the round computes every candidate's expected tokens
    top1_only: bool = False  # the round needs the drafter's top-1 only (an unsampled chain)
    lean: bool = False  # the round is the lean chain round (DDTreeWorker._chain_round)
    plain: bool = False  # the round drafts nothing (DDTreeWorker._plain_round)
    # draft
    draft_hidden: torch.Tensor | None = None
    block_positions: torch.Tensor | None = None
    block_slots: torch.Tensor | None = None
    topk_values: torch.Tensor | None = None
    topk_tokens: torch.Tensor | None = None
    roots: torch.Tensor | None = None
    # tree
    width: int = 0  # verify tokens per request
    causal: bool = False  # verified without a tree mask (a chain)
    tree: Any = None  # DraftTree
    verify_ids: torch.Tensor | None = None
    verify_positions: torch.Tensor | None = None
    expected: torch.Tensor | None = None  # `auto`, sampled: every candidate's expected committed tokens
    walk_stage: Any = None  # the GraphedStage that walks this tree
    walk_variant: str = "plain"  # `auto`: which walk stage (auto.WalkSchedule: plain, sampled, scored, learn)
    mask: torch.Tensor | None = None
    # verify
    node_cache_loc: torch.Tensor | None = None
    logits_output: Any = None
    can_run_cuda_graph: bool = False
    # walk
    choices: torch.Tensor | None = None
    plan: Any = None  # ops.CommitPlan (the oracle's, with the oracle on)
    walk: Any = None  # the tree walk's WalkResult: what the stats record
    summary: torch.Tensor | None = None
    # commit: what leaves the round, in the round's output buffers
    commit_lens: torch.Tensor | None = None
    new_seq_lens: torch.Tensor | None = None
    out_tokens: torch.Tensor | None = None
    bonus: torch.Tensor | None = None
    branch_lens: torch.Tensor | None = None
    # finish
    cold: bool = False  # the round did one-time work: its tokens count, its time does not
