"""Budgeted best-first draft trees (DDTree).

Given the drafter's per-depth log-probs for a block, the tree is the set of the B most probable draft prefixes,
where a prefix's score is the sum of its per-depth log-probs (the drafter is factorized over positions). The DDTree
paper (arXiv 2604.12989) shows this set maximises the expected number of accepted tokens under the drafter's own
distribution.

Canonical node order (what makes the output deterministic, ties included):
    1. higher score first;
    2. on equal score, the shallower node first (so a parent always precedes its children, even when a log-prob is
       exactly 0, which happens in low precision);
    3. on equal score and depth, the node whose parent comes first in this order;
    4. on the same parent, the child with the better drafter rank first; ranks order each depth's tokens by
       (log-prob descending, token id ascending).
Node 0 is the root (the bonus token already chosen by the target); nodes 1..B follow the canonical order, so every
node's parent has a smaller index and any prefix of the order is itself a valid (prefix-closed) tree.

Production builder (`build_tree_from_topk`): vectorized torch, static shapes for a given (batch, L, K, max_budget),
no host synchronisation, so it runs inside a CUDA graph. It works depth by depth:
  - Only the top-K = min(B, V) tokens of each depth can appear in a top-B tree.
  - At depth d the best B prefixes are extensions of the best B prefixes at depth d-1 (a parent scores at least as
    much as its child). Extension (i, r) = i-th best parent with the r-th best token. Parents and tokens are both
    sorted, so (i, r) is dominated by the (i+1)(r+1)-1 pairs (i'<=i, r'<=r), which all precede it in the canonical
    order: only pairs with (i+1)(r+1) <= B can make the cut, about B*ln(B) of them (7.6k for B=1024), a fixed
    index set computed once per (B, K).
  - The global top-B is the top-B of the L per-depth lists (at most B nodes of any depth can be in it).
Selections use int64 keys (order-preserving float bits in the high word, a tie-break index in the low word), so they
are exact and identical on CPU and CUDA whatever the top-k kernel does with equal values.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from functools import lru_cache

import torch

MAX_BUDGET = 1024


@dataclass
class DraftTree:
    """A batch of draft trees with a fixed number of slots N = max_budget + 1 per request.

    Valid nodes of request b are exactly slots 0..num_nodes[b]-1. Invalid slots hold token 0, parent -1, depth 0,
    score -inf and rank -1, so the tensors keep static shapes for CUDA graphs.
    """

    tokens: torch.Tensor  # [bs, N] int64
    parents: torch.Tensor  # [bs, N] int64, root -1
    depth: torch.Tensor  # [bs, N] int64, root 0
    scores: torch.Tensor  # [bs, N] float32 prefix log-prob, root 0
    ranks: torch.Tensor  # [bs, N] int64 drafter rank at the node's depth, root 0
    valid: torch.Tensor  # [bs, N] bool
    depth_limit: int  # L: the deepest depth the drafter proposed

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def max_nodes(self) -> int:
        return self.tokens.shape[1]

    @property
    def num_nodes(self) -> torch.Tensor:
        return self.valid.sum(dim=1)

    def expected_tokens(self) -> torch.Tensor:
        """[bs] float: the committed tokens the drafter expects of this tree (bonus included): 1 + the sum over its
        valid draft nodes of exp(score), each node's probability that its whole prefix matches."""
        return 1.0 + torch.where(self.valid, self.scores.exp(), 0.0)[:, 1:].sum(dim=1)

    def select(self, index) -> "DraftTree":
        """The trees of the requests in `index` (any tensor/int/slice indexing of dim 0)."""
        pick = lambda t: t[index] if not isinstance(index, int) else t[index : index + 1]  # noqa: E731
        return DraftTree(
            pick(self.tokens), pick(self.parents), pick(self.depth), pick(self.scores), pick(self.ranks),
            pick(self.valid), self.depth_limit,
        )


# ---------------------------------------------------------------------------------------------------------------
# Order-preserving integer keys


def _float_key(x: torch.Tensor) -> torch.Tensor:
    """int64 holding an int32 whose signed order equals the float32 order of `x` (-inf < ... < +inf)."""
    bits = x.contiguous().view(torch.int32)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(torch.int64)


def _key_with_tiebreak(x: torch.Tensor, tiebreak: torch.Tensor) -> torch.Tensor:
    """Unique int64 keys: float order first, then larger `tiebreak` (0 <= tiebreak < 2**32) first."""
    return (_float_key(x) << 32) | tiebreak


def _check_no_nan(x: torch.Tensor, what: str) -> None:
    if torch.isnan(x).any():
        raise ValueError(f"{what} contains NaN; the drafter produced invalid log-probs.")


# ---------------------------------------------------------------------------------------------------------------
# Top-K per depth


def topk_draft(draft_logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k tokens per depth, ordered by (log-prob descending, token id ascending).

    draft_logprobs: [bs, L, V] (any float dtype). Returns (values float32 [bs, L, k], tokens int64 [bs, L, k]).
    """
    if draft_logprobs.dim() != 3:
        raise ValueError(f"draft_logprobs must be [batch, L, V], got shape {tuple(draft_logprobs.shape)}.")
    vocab = draft_logprobs.shape[-1]
    if not 1 <= k <= vocab:
        raise ValueError(f"k must be in 1..V={vocab}, got {k}.")
    return exact_topk(draft_logprobs.float(), k)


def exact_topk(x: torch.Tensor, k: int, *, id_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the last dim with ties resolved by the lower index, ordered (value descending, index ascending).

    x: float32. On CUDA torch.topk already picks, among values equal to the k-th largest, the lowest indices (its
    gather pass fills the remaining slots in index order; tests/gpu checks it against the CPU path), so only the
    order inside the k needs canonicalizing: a sort of k keys. On CPU torch.topk makes no such promise, so the
    selection itself runs on unique int64 keys (float bits, then the reversed index).
    A two-stage selection over chunks of the row (more SMs busy at batch 1) was measured slower on the H200
    (B=256, batch 1: 0.36 vs 0.20 ms; batch 8: 1.35 vs 0.60 ms; benchmarks/results/tree_kernels_*_h200.json) and
    removed.
    """
    width = x.shape[-1]
    if x.is_cuda:
        values, index = torch.topk(x, k, dim=-1, sorted=True)
        order = torch.topk(_key_with_tiebreak(values, (2**32 - 1) - index), k, dim=-1, sorted=True).indices
        index = index.gather(-1, order)
        return x.gather(-1, index), index + id_offset
    reverse = (width - 1) - torch.arange(width, device=x.device, dtype=torch.int64)
    index = torch.topk(_key_with_tiebreak(x, reverse), k, dim=-1, sorted=True).indices
    return x.gather(-1, index), index + id_offset


# ---------------------------------------------------------------------------------------------------------------
# Vectorized builder


@lru_cache(maxsize=64)
def _extension_pairs_cpu(max_budget: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(parent slot i, token rank r) pairs with (i+1)(r+1) <= max_budget, r < k, in (i, r) lexicographic order."""
    parent_slots, ranks = [], []
    for i in range(max_budget):
        width = min(max_budget // (i + 1), k)
        parent_slots.extend([i] * width)
        ranks.extend(range(width))
    return torch.tensor(parent_slots, dtype=torch.int64), torch.tensor(ranks, dtype=torch.int64)


_PAIR_CACHE: dict[tuple[int, int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _extension_pairs(max_budget: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (max_budget, k, device)
    if key not in _PAIR_CACHE:
        parent_slots, ranks = _extension_pairs_cpu(max_budget, k)
        _PAIR_CACHE[key] = (parent_slots.to(device), ranks.to(device))
    return _PAIR_CACHE[key]


def _top_by_key(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the `count` best entries of each row, best first; ties go to the lower index."""
    width = scores.shape[-1]
    reverse_pos = (width - 1) - torch.arange(width, device=scores.device, dtype=torch.int64)
    keys = _key_with_tiebreak(scores, reverse_pos)
    return torch.topk(keys, count, dim=-1, sorted=True).indices


def _check_budget(budget, max_budget: int | None) -> int:
    if isinstance(budget, torch.Tensor):
        if budget.dim() != 1:
            raise ValueError(f"a per-request budget must be a 1-D tensor [batch], got shape {tuple(budget.shape)}.")
        if budget.dtype.is_floating_point:
            raise ValueError("a per-request budget must be an integer tensor.")
        if max_budget is None:
            # Host sync: only when the caller didn't give the static size (never in the serving path).
            max_budget = int(budget.max())
            if int(budget.min()) < 1:
                raise ValueError(f"budget must be in 1..{MAX_BUDGET}, got a minimum of {int(budget.min())}.")
    else:
        if isinstance(budget, bool) or not isinstance(budget, int):
            raise ValueError(f"budget must be an int or an integer tensor, got {type(budget).__name__}.")
        if not 1 <= budget <= MAX_BUDGET:
            raise ValueError(f"budget must be in 1..{MAX_BUDGET}, got {budget}.")
        if max_budget is None:
            max_budget = budget
        elif budget > max_budget:
            raise ValueError(f"budget {budget} exceeds max_budget {max_budget}.")
    if not 1 <= max_budget <= MAX_BUDGET:
        raise ValueError(f"budget must be in 1..{MAX_BUDGET}, got a maximum of {max_budget}.")
    return max_budget


def _check_prune(prune) -> None:
    if prune is not None and not (isinstance(prune, (int, float)) and 0.0 <= prune <= 1.0):
        raise ValueError(f"prune must be a prefix-probability threshold in [0, 1] or None, got {prune!r}.")


def build_tree_from_topk(
    topk_values: torch.Tensor,
    topk_tokens: torch.Tensor,
    budget: int | torch.Tensor,
    root_tokens: torch.Tensor,
    *,
    prune: float | None = None,
    max_budget: int | None = None,
) -> DraftTree:
    """Best-first tree from per-depth top-K log-probs (sorted as `topk_draft` returns them).

    topk_values: [bs, L, K] float log-probs, topk_tokens: [bs, L, K] int64, root_tokens: [bs].
    budget: draft nodes per request (root excluded), an int or a [bs] integer tensor; with a tensor, pass
    `max_budget` (the static slot count) to keep the call free of host synchronisation.
    prune: optional prefix-probability threshold; nodes with exp(score) < prune are dropped.
    The result is exact when K >= min(max_budget, V).
    """
    if topk_values.dim() != 3 or topk_values.shape != topk_tokens.shape:
        raise ValueError(
            "topk_values and topk_tokens must both be [batch, L, K]; got "
            f"{tuple(topk_values.shape)} and {tuple(topk_tokens.shape)}."
        )
    bs, depth_limit, k = topk_values.shape
    if depth_limit < 1:
        raise ValueError("the drafter must propose at least one position (L >= 1).")
    if root_tokens.shape != (bs,):
        raise ValueError(f"root_tokens must be [batch={bs}], got shape {tuple(root_tokens.shape)}.")
    if isinstance(budget, torch.Tensor) and budget.shape != (bs,):
        raise ValueError(f"a per-request budget must have shape [batch={bs}], got {tuple(budget.shape)}.")
    max_budget = _check_budget(budget, max_budget)
    _check_prune(prune)

    device = topk_values.device
    values = topk_values.float()
    tokens = topk_tokens.to(torch.int64)
    width = max_budget  # entries kept per depth

    # Depth 1: the root's children, already sorted; pad to `width` with impossible entries.
    take = min(k, width)
    level_scores = [torch.full((bs, width), float("-inf"), device=device)]
    level_scores[0][:, :take] = values[:, 0, :take]
    level_ranks = [torch.zeros((bs, width), dtype=torch.int64, device=device)]
    level_ranks[0][:, :take] = torch.arange(take, device=device)
    level_parent_slot = [torch.zeros((bs, width), dtype=torch.int64, device=device)]

    parent_slots, ext_ranks = _extension_pairs(width, k, device)
    for d in range(1, depth_limit):
        # Every parent slot has at least its top-1 extension, so there are always >= width candidates.
        cand = level_scores[-1][:, parent_slots] + values[:, d, ext_ranks]  # [bs, C], (i, r) lexicographic
        best = _top_by_key(cand, width)
        level_scores.append(cand.gather(1, best))
        level_parent_slot.append(parent_slots[best])
        level_ranks.append(ext_ranks[best])

    all_scores = torch.cat(level_scores, dim=1)  # [bs, L*width], depth-major: ties prefer shallower nodes
    chosen = _top_by_key(all_scores, max_budget)  # [bs, B] flat entry ids in canonical order
    chosen_depth0 = chosen // width  # 0-based depth index (node depth - 1)

    node_scores = all_scores.gather(1, chosen)
    node_ranks = torch.cat(level_ranks, dim=1).gather(1, chosen)
    node_parent_slot = torch.cat(level_parent_slot, dim=1).gather(1, chosen)
    node_tokens = tokens.reshape(bs, depth_limit * k).gather(1, chosen_depth0 * k + node_ranks)

    # Node index of every per-depth entry (0 = not chosen), to turn parent slots into parent node indices.
    node_of_entry = torch.zeros((bs, depth_limit * width), dtype=torch.int64, device=device)
    node_of_entry.scatter_(1, chosen, torch.arange(1, max_budget + 1, device=device).expand(bs, max_budget))
    parent_entry = (chosen_depth0 - 1).clamp(min=0) * width + node_parent_slot
    node_parents = torch.where(chosen_depth0 == 0, 0, node_of_entry.gather(1, parent_entry))

    valid = node_scores > float("-inf")
    slot = torch.arange(1, max_budget + 1, device=device)
    if isinstance(budget, torch.Tensor):
        valid &= slot.unsqueeze(0) <= budget.to(device).unsqueeze(1)
    elif budget < max_budget:  # an int budget below the static slot count: the extra slots stay invalid
        valid &= slot.unsqueeze(0) <= budget
    if prune is not None and prune > 0:
        valid &= node_scores >= math.log(prune)

    return _assemble(root_tokens, node_tokens, node_parents, chosen_depth0 + 1, node_scores, node_ranks, valid,
                     depth_limit)


def blank_invalid(tokens, parents, depth, scores, ranks, valid, depth_limit) -> DraftTree:
    """A DraftTree whose invalid slots hold the placeholders DraftTree documents (token 0, parent -1, depth 0,
    score -inf, rank -1), whatever the inputs held there."""
    return DraftTree(
        tokens=torch.where(valid, tokens, 0),
        parents=torch.where(valid, parents, -1),
        depth=torch.where(valid, depth, 0),
        scores=torch.where(valid, scores, float("-inf")),
        ranks=torch.where(valid, ranks, -1),
        valid=valid,
        depth_limit=depth_limit,
    )


def _assemble(root_tokens, tokens, parents, depth, scores, ranks, valid, depth_limit) -> DraftTree:
    """Prepend the root and blank out invalid slots."""
    bs = tokens.shape[0]
    device = tokens.device
    ones = torch.ones((bs, 1), dtype=torch.bool, device=device)
    valid = torch.cat([ones, valid], dim=1)
    tokens = torch.cat([root_tokens.to(device=device, dtype=torch.int64).view(bs, 1), tokens], dim=1)
    parents = torch.cat([torch.full((bs, 1), -1, dtype=torch.int64, device=device), parents], dim=1)
    depth = torch.cat([torch.zeros((bs, 1), dtype=torch.int64, device=device), depth], dim=1)
    scores = torch.cat([torch.zeros((bs, 1), device=device), scores.float()], dim=1)
    ranks = torch.cat([torch.zeros((bs, 1), dtype=torch.int64, device=device), ranks], dim=1)
    return blank_invalid(tokens, parents, depth, scores, ranks, valid, depth_limit)


def build_tree(
    draft_logprobs: torch.Tensor,
    budget: int | torch.Tensor,
    root_tokens: torch.Tensor,
    *,
    prune: float | None = None,
    max_budget: int | None = None,
    check_values: bool = True,
) -> DraftTree:
    """The B most probable draft prefixes as a batched tree.

    draft_logprobs: [bs, L, V] log-probs (any float dtype, CPU or CUDA); position d is the distribution of the token
    at depth d+1. `check_values=False` skips the NaN check, which needs a host sync (the serving path).
    """
    if draft_logprobs.dim() != 3:
        raise ValueError(f"draft_logprobs must be [batch, L, V], got shape {tuple(draft_logprobs.shape)}.")
    if not draft_logprobs.dtype.is_floating_point:
        raise ValueError(f"draft_logprobs must be floating point, got {draft_logprobs.dtype}.")
    bs, depth_limit, vocab = draft_logprobs.shape
    if depth_limit < 1:
        raise ValueError("the drafter must propose at least one position (L >= 1).")
    if vocab < 1:
        raise ValueError("the vocabulary is empty (V = 0).")
    max_budget = _check_budget(budget, max_budget)
    if check_values:
        _check_no_nan(draft_logprobs, "draft_logprobs")
    values, tokens = topk_draft(draft_logprobs, min(max_budget, vocab))
    return build_tree_from_topk(values, tokens, budget, root_tokens, prune=prune, max_budget=max_budget)


# ---------------------------------------------------------------------------------------------------------------
# Reference builder (tests): the paper's best-first heap search, one request, plain Python.


def build_tree_reference(
    draft_logprobs: torch.Tensor, budget: int, root_token: int, *, prune: float | None = None
) -> DraftTree:
    """Pop the best frontier prefix, add it, push its best child and its next sibling; stop after `budget` pops.

    Keys follow the canonical order of this module: (-score, depth, parent's order, rank). Scores are float32
    sums accumulated root-to-leaf, exactly as the vectorized builder computes them.
    """
    if draft_logprobs.dim() != 2:
        raise ValueError(f"draft_logprobs must be [L, V] for the reference builder, got {tuple(draft_logprobs.shape)}.")
    _check_budget(budget, None)
    _check_prune(prune)
    lp = draft_logprobs.float().cpu()
    depth_limit, vocab = lp.shape
    order = [sorted(range(vocab), key=lambda t, row=lp[d]: (-row[t].item(), t)) for d in range(depth_limit)]

    def child_score(parent_score: torch.Tensor, depth: int, rank: int) -> torch.Tensor:
        return parent_score + lp[depth - 1, order[depth - 1][rank]]  # float32 add, like the vectorized path

    root_score = torch.tensor(0.0)
    nodes = []  # (token, parent, depth, score, rank)
    # heap entry: (-score, depth, parent_order, rank, parent_score_tensor_id)
    parent_scores = {0: root_score}
    heap = [(-child_score(root_score, 1, 0).item(), 1, 0, 0)]
    while heap and len(nodes) < budget:
        neg_score, depth, parent, rank = heapq.heappop(heap)
        score = child_score(parent_scores[parent], depth, rank)
        if score.item() == float("-inf"):
            break
        node_id = len(nodes) + 1
        nodes.append((order[depth - 1][rank], parent, depth, score, rank))
        parent_scores[node_id] = score
        if depth < depth_limit:
            heapq.heappush(heap, (-child_score(score, depth + 1, 0).item(), depth + 1, node_id, 0))
        if rank + 1 < vocab:
            heapq.heappush(heap, (-child_score(parent_scores[parent], depth, rank + 1).item(), depth, parent, rank + 1))
    if prune is not None and prune > 0:
        nodes = [n for n in nodes if n[3].item() >= math.log(prune)]

    n = len(nodes)
    pad = budget - n
    tokens = torch.tensor([[t for t, *_ in nodes] + [0] * pad], dtype=torch.int64)
    parents = torch.tensor([[p for _, p, *_ in nodes] + [-1] * pad], dtype=torch.int64)
    depth = torch.tensor([[d for _, _, d, *_ in nodes] + [0] * pad], dtype=torch.int64)
    scores = torch.tensor([[s.item() for *_, s, _ in nodes] + [float("-inf")] * pad], dtype=torch.float32)
    ranks = torch.tensor([[r for *_, r in nodes] + [-1] * pad], dtype=torch.int64)
    valid = torch.tensor([[True] * n + [False] * pad])
    return _assemble(torch.tensor([root_token]), tokens, parents, depth, scores, ranks, valid, depth_limit)


def chain_tree(draft_logprobs: torch.Tensor, root_tokens: torch.Tensor) -> DraftTree:
    """The DFLASH chain as a tree: the drafter's top-1 token at every depth, one path of L nodes."""
    return chain_tree_from_topk(*topk_draft(draft_logprobs, 1), root_tokens)


# (bs, L, device) -> the chain's parents, depth, ranks and valid [bs, L+1]: the same for every chain of that shape.
# Made once (outside any CUDA-graph capture: a graphed stage's eager warm-up call makes them), so a chain round's
# graph replays no kernels for them. Read-only: no DraftTree consumer writes a tree's tensors.
_CHAIN_SLOTS: dict[tuple, tuple[torch.Tensor, ...]] = {}


def _chain_slots(bs: int, depth_limit: int, device) -> tuple[torch.Tensor, ...]:
    key = (bs, depth_limit, str(device))
    slots = _CHAIN_SLOTS.get(key)
    if slots is None:
        depth = torch.arange(depth_limit + 1, device=device).expand(bs, depth_limit + 1).contiguous()
        slots = (depth - 1, depth, torch.zeros_like(depth), torch.ones_like(depth, dtype=torch.bool),
                 torch.zeros((bs, 1), dtype=torch.float32, device=device))
        if len(_CHAIN_SLOTS) > 256:  # bounded: batch sizes x devices of one process
            _CHAIN_SLOTS.clear()
        _CHAIN_SLOTS[key] = slots
    return slots


def chain_tree_from_topk(values: torch.Tensor, tokens: torch.Tensor, root_tokens: torch.Tensor) -> DraftTree:
    """chain_tree from top-K draft log-probs and ids [bs, L, K] (column 0 = the top-1, as topk_draft returns).
    Every slot is valid: node d (depth d) is the top-1 at depth d, child of node d-1. Only the tokens and scores are
    computed (the other fields are shared constants): the chain is `auto`'s most frequent round at large batch
    sizes, where each small kernel costs."""
    bs, depth_limit, _ = values.shape
    device = values.device
    parents, depth, ranks, valid, zero = _chain_slots(bs, depth_limit, device)
    scores = torch.cat([zero, values[:, :, 0].cumsum(dim=1).float()], dim=1)
    ids = torch.cat([root_tokens.to(device=device, dtype=torch.int64).view(bs, 1), tokens[:, :, 0].long()], dim=1)
    return DraftTree(ids, parents, depth, scores, ranks, valid, depth_limit)
