"""Adaptive tree budget per round (`--speculative-ddtree-budget auto`) and self-calibrating node scores.

Each round the drafter's block gives a best-first tree. Instead of a fixed budget B, the round picks B from a small
candidate set (the drafter's top-1 chain, "no tree", always among them) to maximise

    expected accepted tokens per second = sum over requests of E_i(B) / T(batch, B)

where E_i(B) is the expected committed length (accepted draft nodes + bonus) of request i's best-B tree and T the
predicted round time at this batch size (`RoundCost`, from the cost model). Verify shapes are uniform across a
batch, so there is one choice per round for the whole batch.

Expected acceptance (`expected_acceptance`). A node is accepted iff its whole prefix matches the target, so
E(B) = 1 + sum over the B draft nodes of P(node accepted). With raw scores P = exp(score) (the drafter's own belief,
score = prefix log-prob). One tree built at the largest candidate budget serves every candidate: the builder's
canonical order (tree.py) makes the first b draft slots exactly the best-b tree, ties included, so E(b) is a
cumulative sum read at b. The chain: E = 1 + sum over depths d of prod_{d' <= d} p_top1(d').

Calibration (`ScoreCalibrator`). The drafter's marginals are over-confident off its first-ranked path: a branch
the target accepted is followed by a wrong next token more often than the marginals say. The calibrator learns,
from the walk's own results, a correction of each node's conditional probability q = P(node token | parent accepted),
whose raw value is the drafter marginal exp(score - parent score). Cells (fixed table, bounded memory):
    depth d (1..L) x path class (non-top-1 choices among the node's strict ancestors, capped: 0 = the parent lies on
    the drafter's top-1 chain) x own rank (0 / not 0) x raw-q bucket.
Calibrated q = min(1, q * r[cell]) and a node's calibrated probability is the product of calibrated q along its
path, computed depth by depth (parent first), so it never exceeds its parent's: the best-b set by calibrated
probability (ties: lower slot first, and a parent's slot is lower than its child's) is prefix-closed
(`select_by_probs`).
The factor r[cell] = (A + m) / (P + m) makes the cell's predicted node acceptances match the observed ones: over
every draft node of every verified tree, A sums acceptance (0/1: the node is on the accepted path) and P sums the
prediction P_cal(parent) * q made with the table as it stood (decayed sums, half-life in request-rounds; m a prior
mass, so an empty table gives the raw scores). Matching node acceptances, whose sum is the committed length, rather
than conditionals given an accepted parent matters: acceptance is correlated along a path (a context the drafter
gets right stays right), so a product of conditionals each calibrated given an accepted parent under-predicts deep
nodes; on the tiny pair that version predicted tau worse than the raw scores (docs/adaptive-budget.md).

Everything per round is vectorized torch with static shapes and no host synchronisation (CPU and CUDA); only
`RoundCost` (built once per batch size) and `ScoreCalibrator.export` touch the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from sglang_ddtree.tree import DraftTree, _key_with_tiebreak, blank_invalid

CHAIN = 0  # candidate "budget" meaning the drafter's top-1 chain of L nodes (the DFLASH chain), verified as is
# candidate "budget" of a round without a draft (the server's `auto` only): the target's decode step verifies the last
# committed token alone and commits its own next token, as plain decoding does; the drafter's context still takes
# that token's hidden state, so the next drafted round drafts from where the text is
PLAIN = -1
DEFAULT_CANDIDATES = (CHAIN, 16, 32, 64, 128, 256)


def parse_candidates(spec: str | Sequence, allow_plain: bool = False) -> list[int]:
    """'chain,16,32,64' (or a sequence of ints / 'chain'; with allow_plain also 'plain') -> sorted unique list,
    PLAIN (-1) first when named, then CHAIN (0).

    The chain is always included: without it the choice could be slower than DFLASH.
    """
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out = {CHAIN}
    for x in items:
        if isinstance(x, str):
            x = x.strip().lower()
            if not x:
                continue
            if x in ("chain", "dflash", "0"):
                continue
            if x in ("plain", "none"):
                x = PLAIN
            else:
                try:
                    x = int(x)
                except ValueError:
                    raise ValueError(f"candidate budgets must be integers, 'chain' or 'plain', got {x!r}.") from None
        if isinstance(x, int) and x == PLAIN:
            if not allow_plain:
                raise ValueError("'plain' (a round without a draft) is a candidate of the server's auto only.")
            out.add(PLAIN)
            continue
        if isinstance(x, bool) or not isinstance(x, int) or x < 0 or x > 1024:
            raise ValueError(f"candidate budgets must be in 1..1024 (or 'chain', 'plain'), got {x!r}.")
        out.add(int(x))
    return sorted(out)


def candidate_label(budget: int) -> str:
    return "chain" if budget == CHAIN else "plain" if budget == PLAIN else str(budget)


def drafted(candidates: Sequence[int]) -> list[int]:
    """The candidates whose rounds draft (all but PLAIN): the ones a tree stage computes expectations for."""
    return [c for c in candidates if c != PLAIN]


# ------------------------------------------------------------------------------------------ node quantities


def node_conditionals(tree: DraftTree) -> torch.Tensor:
    """[bs, N] float32: raw conditional probability of each node given its parent, exp(score - parent score)
    (the drafter's marginal of the node's token at its depth). Root 1, invalid slots 0."""
    parent_scores = tree.scores.gather(1, tree.parents.clamp(min=0))
    q = torch.exp(tree.scores - parent_scores)
    q = torch.where(tree.valid, q, 0.0)
    q[:, 0] = 1.0
    return q.clamp(max=1.0)


def offchain_ancestors(tree: DraftTree) -> torch.Tensor:
    """[bs, N] int64: number of the node's strict non-root ancestors whose drafter rank is not 0.

    By pointer jumping: after step k, count[i] sums the 2^k nearest strict ancestors and anc[i] is the 2^k-th
    (-1 past the root), so depth L takes ceil(log2 L) steps (4 at L = 15, ~25 kernels) where walking up one level
    at a time took L - 1 (~85 kernels: the SGLang worker runs this in every sampled tree round's walk stage). Integer
    sums: the same result in any order."""
    off = (tree.valid & (tree.ranks > 0)).to(torch.int64)
    off[:, 0] = 0
    anc = tree.parents
    count = torch.where(anc >= 0, off.gather(1, anc.clamp(min=0)), 0)
    covered = 1
    while covered < tree.depth_limit:
        a = anc.clamp(min=0)
        count = count + torch.where(anc >= 0, count.gather(1, a), 0)
        anc = torch.where(anc >= 0, anc.gather(1, a), -1)
        covered *= 2
    return count


def propagate_along_paths(tree: DraftTree, q: torch.Tensor) -> torch.Tensor:
    """[bs, N]: product of q over each node's path (root excluded), computed depth by depth so a child's value is
    parent * q exactly (<= parent whenever q <= 1). Invalid slots 0."""
    probs = torch.ones_like(q)
    parents = tree.parents.clamp(min=0)
    for d in range(1, tree.depth_limit + 1):
        probs = torch.where(tree.depth == d, probs.gather(1, parents) * q, probs)
    probs = torch.where(tree.valid, probs, 0.0)
    probs[:, 0] = 1.0
    return probs


def raw_node_probs(tree: DraftTree) -> torch.Tensor:
    """[bs, N]: exp(score) (the drafter's probability that the whole prefix matches), root 1, invalid 0."""
    return torch.where(tree.valid, tree.scores.exp(), 0.0)


# ------------------------------------------------------------------------------------------ expected acceptance


def _check_candidates(tree: DraftTree, budgets: Sequence[int]) -> None:
    top = max((b for b in budgets if b != CHAIN), default=0)
    if top > tree.max_nodes - 1:
        raise ValueError(f"candidate budget {top} needs a tree with at least {top + 1} slots, got {tree.max_nodes}.")


_INDEX_CACHE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _budget_index(budgets: Sequence[int], n_slots: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot index of each candidate, is-chain mask), cached per (budgets, slots, device): no host-to-device copy
    after the first round, so the per-round functions can run inside a CUDA graph."""
    key = (tuple(int(b) for b in budgets), int(n_slots), torch.device(device))
    if key not in _INDEX_CACHE:
        idx = torch.tensor([min(max(b, 0), n_slots - 1) for b in budgets], dtype=torch.int64, device=device)
        chain = torch.tensor([b == CHAIN for b in budgets], dtype=torch.bool, device=device)
        _INDEX_CACHE[key] = (idx, chain)
    return _INDEX_CACHE[key]


def expected_from_ordered(probs: torch.Tensor, budgets: Sequence[int]) -> torch.Tensor:
    """probs [bs, N] with slot 0 the root and draft slots in selection order -> [bs, C]: 1 + sum of the first b
    draft slots per budget b (CHAIN entries are left 0 here; fill them with `chain_expected`)."""
    draft = probs.clone()
    draft[:, 0] = 0.0
    cum = draft.cumsum(dim=1)  # cum[:, b] = sum of slots 1..b
    idx, is_chain = _budget_index(budgets, probs.shape[1], probs.device)
    return torch.where(is_chain, 0.0, 1.0 + cum[:, idx])


def chain_expected(top1_logprobs: torch.Tensor, calibrator: "ScoreCalibrator | None" = None) -> torch.Tensor:
    """[bs, L] top-1 log-prob per depth -> [bs]: 1 + sum_d prod_{d'<=d} p(d') (calibrated when given)."""
    if calibrator is not None:
        probs = calibrator.chain_probs(top1_logprobs)
    else:
        probs = top1_logprobs.float().cumsum(dim=1).exp()
    return 1.0 + probs.sum(dim=1)


def expected_acceptance(tree: DraftTree, budgets: Sequence[int], top1_logprobs: torch.Tensor | None = None,
                        calibrator: "ScoreCalibrator | None" = None) -> torch.Tensor:
    """[bs, C] expected committed tokens per round (bonus included) for every candidate budget.

    tree: built at the largest candidate budget (canonical order: the first b draft slots are the best-b tree).
    top1_logprobs [bs, L]: the drafter's top-1 log-prob per depth, needed when CHAIN is a candidate.
    calibrator: None = raw scores (node prob = exp(score), best-b = first b slots); otherwise the calibrated node
    probabilities, best-b = the b most probable nodes by calibrated probability (a prefix-closed set).
    """
    _check_candidates(tree, budgets)
    if calibrator is None:
        out = expected_from_ordered(raw_node_probs(tree), budgets)
    else:
        probs = calibrator.node_probs(tree)
        order = calibrated_order(tree, probs)
        out = expected_from_ordered(probs.gather(1, order), budgets)
    if any(b == CHAIN for b in budgets):
        if top1_logprobs is None:
            raise ValueError("the chain candidate needs the drafter's top-1 log-probs per depth (top1_logprobs).")
        chain = chain_expected(top1_logprobs.to(out.device), calibrator)
        _, is_chain = _budget_index(budgets, tree.max_nodes, out.device)
        out = torch.where(is_chain, chain.unsqueeze(1), out)
    return out


def calibrated_order(tree: DraftTree, probs: torch.Tensor) -> torch.Tensor:
    """[bs, N] slot permutation: root first, then valid draft nodes by (probs descending, slot ascending), then
    invalid slots. With probs monotone along paths every prefix of this order is prefix-closed."""
    bs, n = probs.shape
    device = probs.device
    slots = torch.arange(n, device=device)
    key_vals = torch.where(tree.valid, probs.float(), -1.0)
    key_vals = torch.where(slots == 0, 2.0, key_vals)  # root first
    reverse = (n - 1) - slots
    keys = _key_with_tiebreak(key_vals.contiguous(), reverse.expand(bs, n))
    return torch.topk(keys, n, dim=1, sorted=True).indices


def select_by_probs(tree: DraftTree, probs: torch.Tensor, budget: int) -> DraftTree:
    """The best-`budget` draft nodes by `probs` (e.g. calibrated) as a tree of budget + 1 slots, nodes in selection
    order (every parent before its children). Needs probs monotone along paths (child <= parent), which
    `ScoreCalibrator.node_probs` and exp(score) guarantee; scores/ranks stay the drafter's."""
    bs, n = tree.tokens.shape
    if not 1 <= budget <= n - 1:
        raise ValueError(f"budget must be in 1..{n - 1} for a tree of {n} slots, got {budget}.")
    device = tree.tokens.device
    order = calibrated_order(tree, probs)[:, : budget + 1]  # [bs, b+1], root first
    new_of_old = torch.full((bs, n), -1, dtype=torch.int64, device=device)
    new_of_old.scatter_(1, order, torch.arange(budget + 1, device=device).expand(bs, budget + 1))
    take = lambda t: t.gather(1, order)  # noqa: E731
    valid = take(tree.valid)
    old_parents = take(tree.parents)
    parents = torch.where(old_parents >= 0, new_of_old.gather(1, old_parents.clamp(min=0)), -1)
    valid = valid & ((parents >= 0) | (torch.arange(budget + 1, device=device) == 0))
    return blank_invalid(take(tree.tokens), parents, take(tree.depth), take(tree.scores), take(tree.ranks), valid,
                         tree.depth_limit)


def first_slots(tree: DraftTree, budget: int) -> DraftTree:
    """The best-`budget` tree of a tree built at a larger budget: its first budget + 1 slots (tree.py's canonical
    order makes this exactly the tree built at `budget`)."""
    n = budget + 1
    if n > tree.max_nodes:
        raise ValueError(f"budget {budget} exceeds the tree's {tree.max_nodes - 1} draft slots.")
    return DraftTree(tree.tokens[:, :n], tree.parents[:, :n], tree.depth[:, :n], tree.scores[:, :n],
                     tree.ranks[:, :n], tree.valid[:, :n], tree.depth_limit)


def subtree_accept_lengths(tree: DraftTree, path: torch.Tensor, budgets: Sequence[int]) -> torch.Tensor:
    """[bs, C] committed length (accepted + bonus) that the best-b subtree (the first b slots; CHAIN: the top-1
    chain) of a verified tree would have had this round, read off that tree's walk `path` [bs, L+1].

    Exact for b within the verified tree when the target's choices are deterministic (T=0): the target's choice at
    a node depends only on the node's prefix, not on which other nodes were verified, and path indices increase
    from the root. For CHAIN it counts the leading rank-0 nodes of the path: a lower bound when the chain leaves the
    verified tree (its deeper nodes were not verified)."""
    steps = path[:, 1:]
    out = []
    for b in budgets:
        if b == CHAIN:
            ok = (steps >= 1) & (tree.ranks.gather(1, steps.clamp(min=0)) == 0)
        else:
            if b > tree.max_nodes - 1:
                raise ValueError(f"budget {b} exceeds the verified tree's {tree.max_nodes - 1} draft slots.")
            ok = (steps >= 1) & (steps <= b)
        out.append(1 + ok.to(torch.int64).cumprod(dim=1).sum(dim=1))
    return torch.stack(out, dim=1)


# ------------------------------------------------------------------------------------------ the chooser


def choose_budget(expected: torch.Tensor, round_ms: torch.Tensor, active: torch.Tensor | None = None) -> torch.Tensor:
    """Index (0-dim int64 tensor, no host sync) of the candidate maximising sum_i expected[i, c] / round_ms[c].

    expected [bs, C], round_ms [C] (predicted round time at this batch size, candidates in ascending verify size),
    active [bs] bool (padding rows excluded). Ties go to the lowest index (the smaller budget); the rule is
    memoryless (no hysteresis), so the same inputs always give the same choice.
    """
    if expected.dim() != 2 or round_ms.shape != (expected.shape[1],):
        raise ValueError(f"expected must be [batch, C] and round_ms [C]; got {tuple(expected.shape)} and "
                         f"{tuple(round_ms.shape)}.")
    e = expected.float()
    if active is not None:
        e = torch.where(active.to(e.device).view(-1, 1), e, 0.0)
    rate = e.sum(dim=0) / round_ms.to(e.device, torch.float32)
    idx = torch.arange(rate.numel(), device=e.device)
    return torch.where(rate >= rate.max(), idx, rate.numel()).min()


# ------------------------------------------------------------------------------------------ calibration


@dataclass
class CalibratorConfig:
    depth_limit: int = 15
    path_classes: int = 3  # non-top-1 choices among strict ancestors: 0, 1, 2+
    q_edges: tuple[float, ...] = (0.02, 0.1, 0.3, 0.6, 0.9)  # raw-q bucket boundaries (buckets = len + 1)
    rank_classes: int = 2  # own rank 0 / not 0
    prior_mass: float = 3.0  # pseudo-mass (probability units) pulling every cell's factor to 1
    half_life: float = 2000.0  # request-rounds after which an observation weighs half

    @property
    def q_buckets(self) -> int:
        return len(self.q_edges) + 1

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.depth_limit, self.path_classes, self.rank_classes, self.q_buckets)

    @property
    def decay(self) -> float:
        return 0.5 ** (1.0 / self.half_life) if math.isfinite(self.half_life) and self.half_life > 0 else 1.0


class ScoreCalibrator:
    """Online correction table of the drafter's conditional node probabilities (see the module docstring).

    Memory: 3 float tensors of depth_limit x path_classes x rank_classes x q_buckets cells (15 x 3 x 2 x 6 = 540
    cells by default), whatever the number of rounds.
    """

    def __init__(self, config: CalibratorConfig | None = None, device: torch.device | str = "cpu", **kw):
        self.config = config or CalibratorConfig(**kw)
        if config is not None and kw:
            raise ValueError("pass either a CalibratorConfig or keyword settings, not both.")
        c = self.config
        if c.depth_limit < 1 or c.path_classes < 1 or c.rank_classes not in (1, 2) or c.prior_mass <= 0:
            raise ValueError(f"invalid calibrator config {c}.")
        if list(c.q_edges) != sorted(c.q_edges) or any(not 0 < e < 1 for e in c.q_edges):
            raise ValueError(f"q_edges must be increasing values in (0, 1), got {c.q_edges}.")
        self.device = torch.device(device)
        self._edges = torch.tensor(c.q_edges, dtype=torch.float32, device=self.device)
        self.reset()

    def reset(self) -> None:
        """An empty table (raw scores). In place once allocated: CUDA graphs captured with the table (the SGLang
        worker's stages) keep reading the same tensors."""
        self._pending_rounds = 0
        if getattr(self, "_sums", None) is not None:
            self._sums.zero_()
            self._rounds.zero_()
            return
        # one tensor, so that `learn` is one kernel (a host count of requests); count / pred / obs are views of it
        self._sums = torch.zeros((3, *self.config.shape), dtype=torch.float64, device=self.device)
        self.count = self._sums[0]  # decayed observation count
        self.pred = self._sums[1]  # decayed sum of P_cal(parent) * q
        self.obs = self._sums[2]  # decayed sum of accepted (0/1)
        self._flat = self._sums.view(3, -1)  # [3, cells], as observation's delta: kept, learn runs every scored round
        self._rounds = torch.zeros((), dtype=torch.int64, device=self.device)

    @property
    def rounds(self) -> torch.Tensor:
        """Request-rounds learnt since the last reset, a 0-dim int64 tensor on the table's device (the same tensor
        throughout). `learn` with a host number of requests counts them on the host and adds them here when read:
        one kernel launch fewer per learnt round (the SGLang worker learns every tree round of a fresh server's first
        AutoConfig.calibration_learn_all request-rounds; an A/B of the tiny pair in one server put that phase's host
        cost at ~0.065 ms a batch-1 round)."""
        if self._pending_rounds:
            self._rounds.add_(self._pending_rounds)
            self._pending_rounds = 0
        return self._rounds

    # -- cells

    def _cells(self, depth: torch.Tensor, path_class: torch.Tensor, rank: torch.Tensor, q: torch.Tensor):
        c = self.config
        d = (depth - 1).clamp(0, c.depth_limit - 1)
        p = path_class.clamp(0, c.path_classes - 1)
        r = (rank > 0).to(torch.int64) if c.rank_classes == 2 else torch.zeros_like(rank)
        b = torch.bucketize(q.float().contiguous(), self._edges.to(q.device))
        return ((d * c.path_classes + p) * c.rank_classes + r) * c.q_buckets + b

    def ratio(self) -> torch.Tensor:
        """Per-cell factor on the raw conditional, (accepted + m) / (predicted + m), float32, table-shaped."""
        m = self.config.prior_mass
        return ((self.obs + m) / (self.pred + m)).float()

    # -- calibrated probabilities

    def _calibrated(self, tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (calibrated conditionals [bs, N], every node's cell index [bs, N], raw conditionals [bs, N])."""
        q = node_conditionals(tree)
        cells = self._cells(tree.depth, offchain_ancestors(tree), tree.ranks, q).clamp(min=0)
        cal = (q * self.ratio().to(q.device).flatten()[cells]).clamp(0.0, 1.0)
        cal = torch.where(tree.valid, cal, 0.0)
        cal[:, 0] = 1.0
        return cal, cells, q

    def conditionals(self, tree: DraftTree) -> torch.Tensor:
        """[bs, N] calibrated conditional probabilities (root 1, invalid 0), in [0, 1]."""
        return self._calibrated(tree)[0]

    def node_probs(self, tree: DraftTree) -> torch.Tensor:
        """[bs, N] calibrated probability that each node is accepted: product of calibrated conditionals along
        its path; monotone (child <= parent)."""
        return propagate_along_paths(tree, self.conditionals(tree))

    def chain_probs(self, top1_logprobs: torch.Tensor) -> torch.Tensor:
        """[bs, L] calibrated acceptance probability of each node of the top-1 chain."""
        lp = top1_logprobs.float()
        bs, depth_limit = lp.shape
        q = lp.exp().clamp(max=1.0)
        depth = torch.arange(1, depth_limit + 1, device=lp.device).expand(bs, depth_limit)
        zeros = torch.zeros((bs, depth_limit), dtype=torch.int64, device=lp.device)
        cells = self._cells(depth, zeros, zeros, q)
        cal = (q * self.ratio().to(lp.device).flatten()[cells]).clamp(0.0, 1.0)
        return cal.cumprod(dim=1)

    def expected(self, tree: DraftTree) -> torch.Tensor:
        """[bs] calibrated expected committed length of the whole (valid part of the) tree."""
        probs = self.node_probs(tree)
        probs = torch.where(tree.valid, probs, 0.0)
        return 1.0 + probs[:, 1:].sum(dim=1)

    # -- learning

    def observation(self, tree: DraftTree, path: torch.Tensor, active: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What one verified round teaches, without changing the table (a pure function: the SGLang worker runs it
        inside CUDA graphs, whose warm-up and capture calls must not learn). tree [bs, N]: the verified tree;
        path [bs, L+1]: the walk's accepted node indices, -1 padded (`WalkResult.path`); active [bs] bool: only
        these requests count (padding rows). Every valid draft node is one observation: accepted (on the path) or
        not, against the prediction P_cal(parent) * q of the current table.
        -> (delta [3, cells] float64: per cell the observations, predicted and accepted sums, for `learn`;
            [bs] the calibrated expected committed length of the tree as the table stands, `expected`)."""
        bs, n = tree.tokens.shape
        device = tree.tokens.device
        on_path = torch.zeros((bs, n + 1), dtype=torch.bool, device=device)
        on_path.scatter_(1, torch.where(path >= 0, path, n), True)
        on_path = on_path[:, :n]
        observed = tree.valid & (tree.parents >= 0)
        if active is not None:
            observed &= active.to(device).view(-1, 1)
        cal, cells, q = self._calibrated(tree)
        probs = propagate_along_paths(tree, cal)  # = node_probs(tree)
        expected = 1.0 + torch.where(tree.valid, probs, 0.0)[:, 1:].sum(dim=1)
        parent_probs = probs.gather(1, tree.parents.clamp(min=0))
        w = observed.to(torch.float64)
        values = torch.stack([w, (parent_probs * q).double() * w, on_path.double() * w]).view(3, -1)
        delta = torch.zeros(self._flat.shape, dtype=torch.float64, device=device)
        delta.scatter_add_(1, cells.reshape(1, -1).expand(3, -1), values)
        return delta, expected

    def learn(self, delta: torch.Tensor, requests: "int | torch.Tensor") -> None:
        """Decay the table by one step per request, then add an `observation`'s delta. requests: a number or a
        0-dim tensor (no host sync either way).

        A number (the SGLang worker's: it knows its batch's requests) costs one kernel, the decay a Python float
        folded into one add and the count kept on the host until `rounds` is read; a tensor costs seven. Why it
        matters: a batch-1 host profile of the tiny pair (benchmarks/results/host_profile_2026-12-01_b48413f/) put the
        tensor path at 100-106 us a decode batch under cProfile (half the batches scored there), the largest piece
        of `auto`'s own host cost."""
        sums = self._flat
        delta = delta.to(self.device)
        if isinstance(requests, torch.Tensor):
            requests = requests.to(self.device)
            self.rounds.add_(requests.round().to(torch.int64))
            sums.mul_(torch.pow(self.config.decay, requests.double()))
            sums.add_(delta)
        else:
            self._pending_rounds += int(requests)  # added to the device count when read (rounds)
            torch.add(delta, sums, alpha=self.config.decay ** requests, out=sums)  # delta + decay * sums

    def update(self, tree: DraftTree, path: torch.Tensor, active: torch.Tensor | None = None) -> torch.Tensor:
        """Learn from one verified round (`observation` then `learn`). -> [bs] the calibrated expected committed
        length of the tree as the table stood before this round."""
        delta, expected = self.observation(tree, path, active)
        self.learn(delta, active.sum() if active is not None else tree.tokens.shape[0])
        return expected

    # -- persistence and metrics

    def state_dict(self) -> dict:
        return {"config": {**self.config.__dict__, "q_edges": list(self.config.q_edges)},
                "pred": self.pred.clone(), "obs": self.obs.clone(), "count": self.count.clone(),
                "rounds": self.rounds.clone()}

    def load_state_dict(self, state: dict) -> None:
        cfg = {**state["config"], "q_edges": tuple(state["config"]["q_edges"])}
        if CalibratorConfig(**cfg) != self.config:
            raise ValueError(f"calibrator state was saved with config {cfg}, this one has {self.config}.")
        for name in ("pred", "obs", "count"):
            t = torch.as_tensor(state[name], dtype=torch.float64)
            if tuple(t.shape) != self.config.shape:
                raise ValueError(f"calibrator state {name!r} has shape {tuple(t.shape)}, expected {self.config.shape}.")
            getattr(self, name).copy_(t)  # in place (views of one tensor), as reset
        self.rounds.copy_(torch.as_tensor(state["rounds"], dtype=torch.int64))

    def summary(self) -> torch.Tensor:
        """[3, depth_limit, path_classes, rank_classes] float64 on the table's device: decayed observations,
        predicted and accepted sums over the q buckets (`summary_rows` reads it; no host sync here)."""
        return self._sums.sum(dim=-1)

    def export(self) -> dict:
        """Plain-JSON summary for metrics: per (depth, path class, rank class) the decayed node count, predicted and
        accepted sums and their ratio over all q buckets, plus the full per-cell factor table."""
        c = self.config
        summary = self.summary().cpu()
        return {"config": {**c.__dict__, "q_edges": list(c.q_edges)}, "request_rounds": int(self.rounds),
                "observations": round(float(summary[0].sum()), 3), "cells": summary_rows(summary, c.prior_mass),
                "ratio_table": [[[[round(x, 4) for x in row] for row in pr] for pr in dp]
                                for dp in self.ratio().cpu().tolist()]}


def summary_rows(summary: torch.Tensor, prior_mass: float) -> list[dict]:
    """`ScoreCalibrator.summary()` (on the host) -> one row per (depth, path class, rank class) with observations:
    decayed node count, predicted and accepted sums, and their ratio (accepted + m) / (predicted + m)."""
    count, pred, obs = summary.double().tolist()
    rows = []
    for d, by_path in enumerate(count):
        for p, by_rank in enumerate(by_path):
            for r, n in enumerate(by_rank):
                if n <= 0:
                    continue
                a, e = obs[d][p][r], pred[d][p][r]
                rows.append({"depth": d + 1, "path_class": p, "rank_class": r, "observations": round(n, 3),
                             "predicted": round(e, 4), "accepted": round(a, 4),
                             "ratio": round((a + prior_mass) / (e + prior_mass), 4)})
    return rows
