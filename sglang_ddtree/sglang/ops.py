"""Tensor operations of the DDTREE serving step that do not depend on SGLang (CPU-testable, no host sync).

- draft top-K log-probs from the drafter's hidden states, with tensor-parallel vocab shards merged exactly;
- the FULL_MASK verify mask SGLang's triton and flashinfer backends read in TARGET_VERIFY;
- the KV moves that make the accepted path contiguous, and the path gathers for the drafter's context update;
- for hybrid (gated-delta-net) targets: the tree links SGLang's tree verify reads and the node whose recurrent
  state a round commits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from sglang_ddtree import adaptive, kernels
from sglang_ddtree.layout import retrieve_arrays
from sglang_ddtree.metric_names import SummaryLayout
from sglang_ddtree.sglang.auto import observed_candidates
from sglang_ddtree.sglang.stats import branch_counts, round_summary_vector
from sglang_ddtree.tree import (DraftTree, _key_with_tiebreak, blank_invalid, build_tree_from_topk,
                                chain_tree_from_topk, exact_topk)
from sglang_ddtree.walk import WalkResult, walk_choices


def local_topk_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    *,
    vocab_start: int = 0,
    logit_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k logits of one vocab shard and the shard's logsumexp.

    hidden [n, H], weight [V_shard, H] (padding rows already excluded), returns (values float32 [n, k],
    global ids int64 [n, k], logsumexp float32 [n]); ties resolved by the lower global id.
    """
    raw = hidden.to(weight.dtype) @ weight.T
    k = min(k, raw.shape[-1])
    if logit_scale is None and kernels.available(raw.device):
        return kernels.topk_logits_lse(raw, k, id_offset=vocab_start)  # no float32 copy, no second read
    logits = raw.float()
    if logit_scale is not None:
        logits = logits * logit_scale
    lse = torch.logsumexp(logits, dim=-1)
    if logits.is_cuda and kernels.available(logits.device):
        values, ids = kernels.topk_triton(logits, k, id_offset=vocab_start)
        return values, ids, lse
    values, ids = exact_topk(logits, k, id_offset=vocab_start)
    return values, ids, lse


def _fused_lse(raw: torch.Tensor):
    """kernels.row_max_lse of the lm_head's output on a Triton device, else None. The top-1 stage takes it, and the
    top-K stage the same logsumexp (topk_logits_lse), so the top-1's log-prob stays the top-K's first column bit for
    bit."""
    if kernels.available(raw.device):
        return kernels.row_max_lse(raw)
    return None


def merge_shard_topk(
    values: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge per-shard top-k into the global top-k log-probs.

    values/ids [shards, n, k_s], lse [shards, n]. The global top-k is among the shards' top-k (each shard holds
    at least k of its own best, or all of them). Returns (log-probs float32 [n, k], ids int64 [n, k]) ordered by
    (log-prob descending, id ascending), i.e. exactly what a full-vocabulary top-k returns.
    """
    shards, n, ks = values.shape
    total_lse = torch.logsumexp(lse, dim=0)  # [n]
    flat_values = values.permute(1, 0, 2).reshape(n, shards * ks)
    flat_ids = ids.permute(1, 0, 2).reshape(n, shards * ks)
    # Tie-break on the global id (lower id first): the key's low word is (2**32 - 1 - id).
    keys = _key_with_tiebreak(flat_values, (2**32 - 1) - flat_ids)
    top = torch.topk(keys, min(k, shards * ks), dim=-1, sorted=True).indices
    return flat_values.gather(-1, top) - total_lse.unsqueeze(-1), flat_ids.gather(-1, top)


def draft_topk_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    *,
    vocab_start: int = 0,
    logit_scale: float | None = None,
    all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
    world_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position top-k draft log-probs over the full vocabulary.

    With tensor parallelism each rank holds a vocab shard of the target's lm_head: pass `all_gather` (dim-0
    concatenation across ranks, e.g. SGLang's tp_group.all_gather_into_tensor wrapped) and `world_size`; only
    n*(2k+1) numbers per rank cross the interconnect instead of n*V logits. Every rank gets the same answer.
    """
    values, ids, lse = local_topk_logprobs(hidden, weight, k, vocab_start=vocab_start, logit_scale=logit_scale)
    if world_size == 1:
        return values - lse.unsqueeze(-1), ids
    n, ks = values.shape
    gathered_values = all_gather(values.contiguous()).view(world_size, n, ks)
    gathered_ids = all_gather(ids.contiguous()).view(world_size, n, ks)
    gathered_lse = all_gather(lse.contiguous()).view(world_size, n)
    return merge_shard_topk(gathered_values, gathered_ids, gathered_lse, k)


def verify_mask_numel(num_nodes: int, seq_lens_sum: int, batch_size: int) -> int:
    """Cells of SGLang's FULL_MASK custom mask: per request an [N, prefix + N] block, concatenated."""
    return num_nodes * seq_lens_sum + num_nodes * num_nodes * batch_size


def tree_verify_mask(tree_mask: torch.Tensor, seq_lens: torch.Tensor, numel: int) -> torch.Tensor:
    """Flat bool mask in SGLang's FULL_MASK layout for a tree verify.

    tree_mask [bs, N, N] (ancestor-or-self), seq_lens [bs] committed prefix lengths (device), `numel` >= the
    exact size (a host-side upper bound keeps this free of host syncs; the tail is left True). Row r of request
    b: prefix columns all True (every node sees the whole committed context), then the tree block.
    """
    bs, n, _ = tree_mask.shape
    device = tree_mask.device
    seq_lens = seq_lens.to(device=device, dtype=torch.int64)
    row_len = seq_lens + n  # [bs]
    block = n * row_len
    start = torch.cumsum(block, dim=0) - block  # exclusive prefix sum: where request b's block begins
    rows = torch.arange(n, device=device).view(1, n, 1)
    cols = torch.arange(n, device=device).view(1, 1, n)
    cell = start.view(bs, 1, 1) + rows * row_len.view(bs, 1, 1) + seq_lens.view(bs, 1, 1) + cols
    mask = torch.ones(numel, dtype=torch.bool, device=device)
    mask.scatter_(0, cell.reshape(-1), tree_mask.reshape(-1))
    return mask


def accepted_kv_moves(path: torch.Tensor, node_cache_loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KV copies that put the accepted path at consecutive positions: (target slots, source slots), flat.

    path [bs, L+1] accepted node indices (root first, -1 padded), node_cache_loc [bs, N] the KV slot each tree
    node was verified into (slot of position prefix+i for node i). The node at depth j moves to the slot of
    position prefix+j. Entries that need no move copy a slot onto itself, so the shape is static
    (bs * L entries) and no host sync is needed. Order per request is by ascending depth: a depth-j source has
    node index >= j, so it is never overwritten by an earlier (shallower) move in the same request.
    """
    bs, width = path.shape
    depth_limit = width - 1
    dest_nodes = torch.arange(1, depth_limit + 1, device=path.device).expand(bs, depth_limit)
    src_nodes = torch.where(path[:, 1:] >= 0, path[:, 1:], dest_nodes)
    tgt = node_cache_loc.gather(1, dest_nodes.clamp(max=node_cache_loc.shape[1] - 1))
    src = node_cache_loc.gather(1, src_nodes.clamp(max=node_cache_loc.shape[1] - 1))
    # Depths beyond the tree's slots (tiny budgets) never hold an accepted node: make them self-copies.
    beyond = dest_nodes >= node_cache_loc.shape[1]
    src = torch.where(beyond, tgt, src)
    return tgt.reshape(-1).to(torch.int64), src.reshape(-1).to(torch.int64)


def gather_path_rows(rows: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """rows [bs, N, F], path [bs, L+1] (-1 padded) -> [bs, L+1, F], padding filled from the root row."""
    index = path.clamp(min=0).unsqueeze(-1).expand(-1, -1, rows.shape[-1])
    return rows.gather(1, index)


def flat_tree_inputs(tree: DraftTree, prefix_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify input ids and positions, flat [bs * N]: node tokens at prefix + depth (invalid slots: token 0 at
    the root's position; they are masked to themselves and never accepted)."""
    positions = prefix_lens.to(torch.int64).unsqueeze(1) + tree.depth
    return tree.tokens.reshape(-1), positions.reshape(-1)


# ------------------------------------------------------------------------------------------------------------------
# The round's fixed-shape stages, as functions of tensors only (sglang_ddtree.graphs captures them per batch size).


def draft_topk_stage(block_size: int, topk: int, vocab_start: int, weight: torch.Tensor, draft_hidden: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafter hidden states [bs * block, H] (row 0 of each block is the root's) -> top-K draft log-probs and ids
    [bs, block - 1, K]. Single-rank vocabulary (tensor parallelism merges shards: draft_topk_logprobs)."""
    hidden = draft_hidden.view(-1, block_size, draft_hidden.shape[-1])
    bs = hidden.shape[0]
    values, ids = draft_topk_logprobs(hidden[:, 1:, :].reshape(bs * (block_size - 1), -1), weight, topk,
                                      vocab_start=vocab_start)
    return values.view(bs, block_size - 1, -1), ids.view(bs, block_size - 1, -1)


def draft_top1_stage(block_size: int, vocab_start: int, weight: torch.Tensor, draft_hidden: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """What draft_topk_stage's first column holds (the top-1 log-prob and id per position, [bs, block - 1, 1]),
    without the top-K: an `auto` chain round that does not sample the expectations needs no more, and an exact
    top-K over the vocabulary costs far more than a max (0.20 ms at batch 1, 0.95 ms at batch 8 for
    K=256). Ties go to the lower id, as in exact_topk (torch.max returns the first maximal index)."""
    hidden = draft_hidden.view(-1, block_size, draft_hidden.shape[-1])
    bs = hidden.shape[0]
    raw = hidden[:, 1:, :].reshape(bs * (block_size - 1), -1).to(weight.dtype) @ weight.T
    fused = _fused_lse(raw)
    if fused is not None:
        values, ids, lse = fused
    else:
        logits = raw.float()
        lse = torch.logsumexp(logits, dim=-1)
        values, ids = logits.max(dim=-1)
    return (values - lse).view(bs, block_size - 1, 1), (ids + vocab_start).view(bs, block_size - 1, 1)


def tree_stage(budget: int, prune: float | None, use_kernels: bool, topk_values: torch.Tensor,
               topk_tokens: torch.Tensor, roots: torch.Tensor, prefix_lens: torch.Tensor):
    """-> (tree, verify ids [bs * N], verify positions [bs * N]): the budgeted tree and its flat verify inputs."""
    build = kernels.build_tree_triton if use_kernels else build_tree_from_topk
    tree = build(topk_values, topk_tokens, budget, roots, prune=prune, max_budget=budget)
    ids, positions = flat_tree_inputs(tree, prefix_lens)
    return tree, ids, positions


def auto_tree_stage(max_budget: int, chosen: int, candidates: tuple[int, ...], prune: float | None,
                    use_kernels: bool, sampled: bool, topk_values: torch.Tensor, topk_tokens: torch.Tensor,
                    roots: torch.Tensor, prefix_lens: torch.Tensor, rows: torch.Tensor | None = None):
    """`auto` (sglang_ddtree.sglang.auto): the round verifies the chosen candidate's tree (CHAIN: the drafter's
    top-1 path). On a sampled round the tree is built at the largest candidate budget, whose first b draft slots
    are the best-b tree (tree.py's canonical order), and gives every candidate's expected committed tokens, summed
    over the batch [C] (raw scores); other rounds build only the chosen tree (expected: zeros). rows: the real
    requests (0-dim tensor) when the batch is padded (graphs.GraphedStage): the sum leaves the others out.
    -> (chosen tree, verify ids, verify positions, expected)."""
    build = kernels.build_tree_triton if use_kernels else build_tree_from_topk
    if sampled:
        big = build(topk_values, topk_tokens, max_budget, roots, prune=prune, max_budget=max_budget)
        per_request = adaptive.expected_acceptance(big, candidates, topk_values[:, :, 0])
        expected = live_sum(per_request, rows)
    else:
        big = None
        expected = torch.zeros(len(candidates), dtype=torch.float32, device=topk_values.device)
    if chosen == adaptive.CHAIN:
        tree = chain_tree_from_topk(topk_values, topk_tokens, roots)
    elif big is not None:
        n = chosen + 1
        tree = DraftTree(*(t[:, :n].contiguous() for t in (big.tokens, big.parents, big.depth, big.scores,
                                                            big.ranks, big.valid)), big.depth_limit)
    else:  # the same tree as a fixed budget builds it, from the top-K it needs
        k = min(chosen, topk_values.shape[-1])
        return (*tree_stage(chosen, prune, use_kernels, topk_values[:, :, :k].contiguous(),
                            topk_tokens[:, :, :k].contiguous(), roots, prefix_lens), expected)
    ids, positions = flat_tree_inputs(tree, prefix_lens)
    return tree, ids, positions, expected


def live_sum(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """x [bs, ...] summed over its requests: the first `rows` (a 0-dim tensor) of a batch padded to bs, selected
    with torch.where so that whatever a padding request computed cannot leak in; all of them when rows is None (an
    unpadded batch: no extra kernel)."""
    if rows is None:
        return x.sum(dim=0)
    live = (torch.arange(x.shape[0], device=x.device) < rows).view(-1, *([1] * (x.dim() - 1)))
    return torch.where(live, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum(dim=0)


def observed_tokens(candidates: tuple[int, ...], chosen: int, tree: DraftTree, walk,
                    rows: torch.Tensor | None = None) -> torch.Tensor:
    """[C] committed tokens summed over the batch that each candidate would have had this round, for the candidates
    this round observes exactly (auto.observed_candidates), 0 elsewhere. rows: see live_sum."""
    seen = observed_candidates(list(candidates), candidates.index(chosen))
    out = torch.zeros(len(candidates), dtype=torch.float32, device=walk.path.device)
    if chosen == adaptive.CHAIN:  # the chain observes itself only
        out[candidates.index(chosen)] = live_sum(walk.accept_len + 1, rows).float()
        return out
    budgets = [b for b, ok in zip(candidates, seen) if ok]  # the chosen tree and the smaller ones
    lens = live_sum(adaptive.subtree_accept_lengths(tree, walk.path, budgets), rows).float()
    for j, b in enumerate(budgets):  # device copies only (no host tensor): this runs inside a CUDA graph
        out[candidates.index(b)] = lens[j]
    return out


@dataclass
class CommitPlan:
    """The walk and everything the commit needs, computed from tensors only (one graph replay)."""

    walk: object  # walk.WalkResult
    commit_lens: torch.Tensor  # [bs] int32: accepted draft tokens + the bonus
    new_seq_lens: torch.Tensor  # [bs] committed lengths after the round (prefix_lens' dtype)
    kv_dest: torch.Tensor | None  # flat slots the accepted path's KV moves to (accepted_kv_moves); None: a chain
    kv_src: torch.Tensor | None
    draft_cache_loc: torch.Tensor  # [bs, P] slots of positions prefix .. prefix+P-1, P = min(block, N)
    draft_positions: torch.Tensor  # [bs * P] those positions
    out_tokens: torch.Tensor  # [bs, block] accepted tokens then the bonus, -1 padding clamped to 0
    branch_lens: torch.Tensor  # [bs] int32: accepted draft tokens off the drafter's top-1 (stats.branch_counts)
    summary: torch.Tensor | None  # stats.round_summary_vector, when metrics are on
    observed: torch.Tensor | None = None  # `auto`: observed_tokens
    calibration: torch.Tensor | None = None  # `auto`, scored tree rounds: calibration_round's errors
    calibration_delta: torch.Tensor | None = None  # ... and the table's delta (batch sums, as summary)


def calibration_round(calibrator, tree: DraftTree, walk, rows: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """What `auto`'s calibration table learns from a verified tree and its walk, without learning it (the stage
    runs in CUDA graphs, whose warm-up and capture calls must not count: the worker calls
    `calibrator.learn(delta, requests)` after the round). -> (errors [3] float32 summed over the real requests:
    |raw prediction - committed|, |calibrated prediction - committed| (raw = 1 + sum of exp(score) over the
    verified draft nodes, calibrated = the table's as it stands), and the number of requests;
    delta: adaptive.ScoreCalibrator.observation's). rows: see live_sum."""
    active = None if rows is None else torch.arange(tree.batch_size, device=tree.tokens.device) < rows
    delta, calibrated = calibrator.observation(tree, walk.path, active)
    raw = tree.expected_tokens()
    committed = (walk.accept_len + 1).float()
    errors = torch.stack([(raw - committed).abs(), (calibrated.float() - committed).abs(),
                          torch.ones_like(committed)], dim=1)
    return live_sum(errors, rows), delta


def walk_commit_plan(block_size: int, use_kernels: bool, with_summary: bool, tokens, parents, depth, scores, ranks,
                     valid, choices, node_cache_loc, prefix_lens, rows: torch.Tensor | None = None,
                     auto: tuple | None = None, top1_chain: bool = False, calibrator=None) -> CommitPlan:
    """The walk (target choices -> accepted path) and the commit's slot and position arithmetic.
    auto: (candidates, chosen budget) of an `auto` round, for the observed tokens of the candidates.
    calibrator: `auto`'s table on a sampled round: what it learns from this walk (calibration_round).
    top1_chain: the tree is the drafter's top-1 chain (`auto`'s chain candidate, tree.chain_tree_from_topk): its
    accepted nodes already sit at consecutive slots (no KV moves: kv_dest / kv_src None) and none is off the top-1
    (branch_lens zeros), so the ~17 small kernels computing those are left out of the round (at 8B shapes,
    batch 16, auto's chain round ran ~100 kernels more than DFLASH's).
    rows: the real requests when the batch is padded (graphs.GraphedStage): the batch sums leave the others out."""
    tree = DraftTree(tokens, parents, depth, scores, ranks, valid, block_size - 1)
    walk = kernels.walk_triton(tree, choices) if use_kernels else walk_choices(tree, choices)
    commit_lens = (walk.accept_len + 1).to(torch.int32)
    new_seq_lens = prefix_lens + commit_lens.to(prefix_lens.dtype)
    dest, src = (None, None) if top1_chain else accepted_kv_moves(walk.path, node_cache_loc)
    path_len = min(block_size, node_cache_loc.shape[1])
    positions = prefix_lens.to(torch.int64).unsqueeze(1) + torch.arange(path_len, device=prefix_lens.device)

    branch_lens = (torch.zeros_like(commit_lens) if top1_chain else branch_counts(tree, walk))
    summary = round_summary_vector(tree, walk, branch_lens, rows) if with_summary else None
    observed = observed_tokens(auto[0], auto[1], tree, walk, rows) if auto is not None else None
    calibration, delta = calibration_round(calibrator, tree, walk, rows) if calibrator is not None else (None, None)
    return CommitPlan(walk, commit_lens, new_seq_lens, dest, src, node_cache_loc[:, :path_len].contiguous(),
                      positions.reshape(-1), walk.out_tokens[:, :block_size].clamp(min=0), branch_lens, summary,
                      observed, calibration, delta)



CHAIN_OUTPUTS = ("accept_len", "commit_lens", "bonus", "out_tokens", "new_seq_lens", "branch_lens", "summary")


def chain_outputs(bs: int, depth_limit: int, seq_len_dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """Empty buffers for chain_accept (CHAIN_OUTPUTS) of a batch of bs requests."""
    return {"accept_len": torch.empty(bs, dtype=torch.int32, device=device),
            "commit_lens": torch.empty(bs, dtype=torch.int32, device=device),
            "bonus": torch.empty(bs, dtype=torch.int64, device=device),
            "out_tokens": torch.empty((bs, depth_limit + 1), dtype=torch.int64, device=device),
            "new_seq_lens": torch.empty(bs, dtype=seq_len_dtype, device=device),
            "branch_lens": torch.empty(bs, dtype=torch.int32, device=device),
            "summary": torch.empty(SummaryLayout(depth_limit).width, dtype=torch.float32, device=device)}


def chain_accept(use_kernels: bool, candidates: torch.Tensor, choices: torch.Tensor, logprobs: torch.Tensor,
                 prefix_lens: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
    """`auto`'s chain round (the drafter's top-1 path, verified causally): what walk_commit_plan computes for
    tree.chain_tree_from_topk's chain (the walk, commit lengths, new lengths, out tokens, branch counts (zeros), the
    stats summary) into
    `out` (chain_outputs), with one Triton launch instead of two stage graphs (a host profile, tiny pair
    at batch 4: a stage replay with its input copies ~40-60 us of host time under cProfile, the walk stage's five
    output clones ~75). candidates [bs, L+1] (root, then the top-1 drafts), choices [bs, L+1] (the target's token at
    each), logprobs [bs, L] (the drafts' log-probs), prefix_lens [bs]. The torch path computes it the tree way."""
    if use_kernels:
        kernels.chain_accept_triton(candidates, choices, logprobs, prefix_lens, out)
        return
    for name, value in zip(CHAIN_OUTPUTS, chain_accept_reference(candidates, choices, logprobs, prefix_lens)):
        out[name].copy_(value)


def plain_step(choices: torch.Tensor, prefix_lens: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
    """`auto`'s round without a draft (the candidate `plain`): a plain decode step's results in the round's output
    buffers (chain_outputs' names). choices [bs, 1]: the target's token after each request's last committed one.
    Nothing was drafted: accept_len 0, one committed token (the bonus), no branches, and a zero stats summary (the
    drafter's acceptance counts drafted rounds only)."""
    token = choices[:, 0].to(torch.int64)
    out["accept_len"].zero_()
    out["commit_lens"].fill_(1)
    out["bonus"].copy_(token)
    out["out_tokens"].zero_()
    out["out_tokens"][:, 0].copy_(token)
    torch.add(prefix_lens, 1, out=out["new_seq_lens"])
    out["branch_lens"].zero_()
    out["summary"].zero_()


def chain_accept_reference(candidates: torch.Tensor, choices: torch.Tensor, logprobs: torch.Tensor,
                           prefix_lens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """chain_accept's results (CHAIN_OUTPUTS order) from the chain tree, its walk and walk_commit_plan's
    arithmetic: the reference the kernel is tested against."""
    tree = chain_tree_from_topk(logprobs.unsqueeze(-1), candidates[:, 1:].unsqueeze(-1), candidates[:, 0])
    walk = walk_choices(tree, choices)
    commit_lens = (walk.accept_len + 1).to(torch.int32)
    branch_lens = torch.zeros_like(commit_lens)  # every draft is the top-1
    summary = round_summary_vector(tree, walk, branch_lens)
    return (walk.accept_len.to(torch.int32), commit_lens, walk.bonus, walk.out_tokens.clamp(min=0),
            prefix_lens + commit_lens.to(prefix_lens.dtype), branch_lens, summary)

# What a stage padded to a graph bucket returns for its first `bs` requests (graphs.GraphedStage's unpad): views
# of the padded outputs, no copies. Flat per-request tensors hold their requests one after the other.

def unpad_requests(outputs: tuple, bs: int) -> tuple:
    """(values [B, ...], tokens [B, ...]) or any tuple of per-request tensors -> their first bs requests."""
    return tuple(x[:bs] for x in outputs)


def _first_requests_flat(x: torch.Tensor | None, bs: int, total: int) -> torch.Tensor | None:
    return None if x is None else x[: x.shape[0] // total * bs]


def unpad_tree_stage(outputs: tuple, bs: int) -> tuple:
    """(tree, verify ids, verify positions[, expected]) of a padded batch -> of its first bs requests (expected is
    a batch sum, already over the real requests)."""
    tree, ids, positions, *rest = outputs
    total = tree.batch_size
    return (tree.select(slice(0, bs)), _first_requests_flat(ids, bs, total),
            _first_requests_flat(positions, bs, total), *rest)


def unpad_commit_plan(plan: CommitPlan, bs: int) -> CommitPlan:
    """A padded batch's CommitPlan -> its first bs requests' (the KV moves of padding requests are dropped: their
    slots are stale values of earlier rounds). summary, observed, calibration and calibration_delta are batch sums
    over the real requests."""
    total = plan.commit_lens.shape[0]
    w = plan.walk
    walk = WalkResult(w.path[:bs], w.accept_len[:bs], w.bonus[:bs], w.out_tokens[:bs], w.target_choice[:bs])
    return CommitPlan(walk, plan.commit_lens[:bs], plan.new_seq_lens[:bs],
                      _first_requests_flat(plan.kv_dest, bs, total), _first_requests_flat(plan.kv_src, bs, total),
                      plan.draft_cache_loc[:bs], _first_requests_flat(plan.draft_positions, bs, total),
                      plan.out_tokens[:bs], plan.branch_lens[:bs], plan.summary, plan.observed, plan.calibration,
                      plan.calibration_delta)


def accepted_path_chain(tree: DraftTree, path: torch.Tensor, width: int) -> tuple[DraftTree, DraftTree]:
    """The sequential oracle's chain (`--speculative-ddtree-oracle`): the nodes the tree walk accepted (path
    [bs, L+1] node indices, path[:, 0] = 0, -1 past the accepted ones) as `width` chain slots, root first.

    Returns (verify chain, walk chain). The verify chain links every slot to the one before (past the accepted
    nodes it repeats the last accepted token: verified, never accepted), so the target sees a plain chain; the walk
    chain is the same with those slots invalid, so the re-verify accepts at most what the tree walk accepted. Slot
    j carries the tree's score and drafter rank of the accepted node at depth j (branch counts stay the tree's)."""
    bs = path.shape[0]
    device = path.device
    nodes = path[:, :width]
    accepted = nodes >= 0
    last = nodes.gather(1, accepted.sum(dim=1, keepdim=True) - 1)
    nodes = torch.where(accepted, nodes, last)
    slot = torch.arange(width, device=device).expand(bs, width)
    tokens = tree.tokens.gather(1, nodes)
    scores = tree.scores.gather(1, nodes)
    ranks = tree.ranks.gather(1, nodes)
    verify = DraftTree(tokens, slot - 1, slot, scores, ranks, torch.ones_like(accepted), tree.depth_limit)
    return verify, blank_invalid(tokens, slot - 1, slot, scores, ranks, accepted, tree.depth_limit)


def tree_links(tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
    """retrieve_next_token / retrieve_next_sibling as int32 [bs, N]: what SGLang's hybrid backend reads in a tree
    verify (speculative_eagle_topk > 1). Its conv kernel derives each node's parent in one pass over the slots
    (a node's first child gets the node, its next sibling gets the node's parent), which our slot order allows:
    parents come before children and siblings are linked in increasing slot order."""
    _, next_token, next_sibling = retrieve_arrays(tree)
    return next_token.to(torch.int32), next_sibling.to(torch.int32)


def mamba_commit_steps(path: torch.Tensor, accept_len: torch.Tensor, prefix_lens: torch.Tensor,
                       track_interval: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Which verify node's recurrent state each request commits, and which one radix-cache tracking copies.

    path [bs, L+1] accepted node indices (path[:, 0] = 0, the root; -1 after the accepted ones), accept_len [bs]
    drafts accepted, prefix_lens [bs] committed length before the round. The round commits root + accepted drafts
    (accept_len + 1 tokens at positions prefix .. prefix + accept_len): the live state must become the state after
    the last of them, node path[accept_len]. With tracking every `track_interval` tokens, a round whose committed
    length crosses a multiple m of the interval also stores the state after position m - 1, i.e. after committed
    token m - 1 - prefix: node path[m - 1 - prefix] (-1 when no crossing). For a chain (path = 0, 1, 2, ...) both
    are DFLASH's (commit_lens - 1 and its to_track_ith)."""
    accept_len = accept_len.to(torch.int64)
    last = path.gather(1, accept_len.unsqueeze(1)).squeeze(1).to(torch.int64)
    if track_interval is None:
        return last, None
    prefix = prefix_lens.to(torch.int64)
    commit = accept_len + 1
    new_len = prefix + commit
    crossing = prefix // track_interval != new_len // track_interval
    ith = (new_len // track_interval * track_interval - prefix - 1).clamp(min=0)
    can = crossing & (ith < commit)
    node = path.gather(1, ith.clamp(max=path.shape[1] - 1).unsqueeze(1)).squeeze(1).to(torch.int64)
    return last, torch.where(can, node, torch.full_like(node, -1))
