"""Accepting the longest draft path the target agrees with.

The target has scored every tree node in one forward: its logits at node i are its next-token distribution after
the prefix root..i. It makes its own choice at every node (argmax at T=0, a sample at T>0). Starting at the root, the
walk moves to the child whose token equals the target's choice, until no child matches; the target's choice at the
last accepted node is the bonus token.

Lossless at any temperature without rejection sampling: each emitted token is the target's own choice given the
actual emitted prefix, drawn independently per node, so the output has exactly the target's sampling distribution;
the draft only decides how many of those choices are usable in one round.

Everything is vectorized over the batch with a fixed number of steps (the tree's depth limit), no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_ddtree.tree import DraftTree


@dataclass
class WalkResult:
    path: torch.Tensor  # [bs, L+1] node indices of the accepted path, path[:, 0] = 0 (root); -1 padded
    accept_len: torch.Tensor  # [bs] accepted draft nodes (root excluded), 0..L
    bonus: torch.Tensor  # [bs] the target's token after the last accepted node
    out_tokens: torch.Tensor  # [bs, L+1] accepted draft tokens then the bonus, -1 padded
    target_choice: torch.Tensor  # [bs, N] the target's choice at every node

    @property
    def commit_len(self) -> torch.Tensor:
        """Tokens emitted this round (accepted draft tokens + bonus) = KV entries committed (root + accepted)."""
        return self.accept_len + 1


def _check_logits(tree: DraftTree, target_logits: torch.Tensor, check_values: bool) -> None:
    bs, n = tree.tokens.shape
    if target_logits.dim() != 3 or target_logits.shape[:2] != (bs, n):
        raise ValueError(
            f"target_logits must be [batch={bs}, nodes={n}, V], got shape {tuple(target_logits.shape)}."
        )
    if check_values and torch.isnan(target_logits).any():  # host sync: off in the serving path
        raise ValueError("target_logits contains NaN; the target forward produced invalid logits.")


def walk_choices(tree: DraftTree, target_choice: torch.Tensor) -> WalkResult:
    """Walk the tree following the target's choice at every node."""
    bs, n = tree.tokens.shape
    if target_choice.shape != (bs, n):
        raise ValueError(f"target_choice must be [batch={bs}, nodes={n}], got shape {tuple(target_choice.shape)}.")
    device = tree.tokens.device
    target_choice = target_choice.to(torch.int64)
    idx = torch.arange(n, device=device).expand(bs, n)

    # matching_child[b, p]: the child of p whose token is the target's choice at p (siblings have distinct tokens,
    # so there is at most one). Column n is a sink for non-matches and for "no node" (-1) lookups.
    is_child = tree.valid & (tree.parents >= 0)
    choice_at_parent = target_choice.gather(1, tree.parents.clamp(min=0))
    matches = is_child & (tree.tokens == choice_at_parent)
    matching_child = torch.full((bs, n + 1), -1, dtype=torch.int64, device=device)
    matching_child.scatter_(1, torch.where(matches, tree.parents, n), torch.where(matches, idx, -1))
    matching_child[:, n] = -1

    node = torch.zeros(bs, dtype=torch.int64, device=device)
    path = [node]
    for _ in range(tree.depth_limit):
        node = matching_child.gather(1, torch.where(node >= 0, node, n).unsqueeze(1)).squeeze(1)
        path.append(node)
    path = torch.stack(path, dim=1)  # [bs, L+1]
    accept_len = (path[:, 1:] >= 0).sum(dim=1)
    last = path.gather(1, accept_len.unsqueeze(1)).squeeze(1)
    bonus = target_choice.gather(1, last.unsqueeze(1)).squeeze(1)

    steps = torch.arange(tree.depth_limit + 1, device=device).unsqueeze(0)
    path_tokens = tree.tokens.gather(1, path[:, 1:].clamp(min=0))
    out_tokens = torch.cat([path_tokens, torch.full((bs, 1), -1, dtype=torch.int64, device=device)], dim=1)
    out_tokens = torch.where(steps < accept_len.unsqueeze(1), out_tokens, -1)
    out_tokens.scatter_(1, accept_len.unsqueeze(1), bonus.unsqueeze(1))
    return WalkResult(path=path, accept_len=accept_len, bonus=bonus, out_tokens=out_tokens,
                      target_choice=target_choice)


def greedy_walk(tree: DraftTree, target_logits: torch.Tensor, *, check_values: bool = True) -> WalkResult:
    """T=0: the target's choice is its argmax (first index on ties, as torch.argmax and SGLang do)."""
    _check_logits(tree, target_logits, check_values)
    return walk_choices(tree, target_logits.argmax(dim=-1))


def _per_request(x, bs: int, device, dtype, name: str) -> torch.Tensor:
    t = torch.as_tensor(x, device=device, dtype=dtype)
    if t.dim() == 0:
        t = t.expand(bs)
    if t.shape != (bs,):
        raise ValueError(f"{name} must be a scalar or [batch={bs}], got shape {tuple(t.shape)}.")
    return t


def sample_choices(
    target_logits: torch.Tensor,
    temperature,
    top_k=0,
    top_p=1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One independent sample of the target at every node: [bs, N].

    Per-request parameters (scalars or [bs] tensors): temperature (0 = greedy for that request), top_k (<= 0 or >= V
    = disabled), top_p in (0, 1]. Sampling uses the exponential race (argmax of p / E, E ~ Exp(1)), which draws
    exactly from p and needs no host sync.
    """
    if target_logits.dim() != 3:
        raise ValueError(f"target_logits must be [batch, nodes, V], got shape {tuple(target_logits.shape)}.")
    bs, _, vocab = target_logits.shape
    device = target_logits.device
    temperature = _per_request(temperature, bs, device, torch.float32, "temperature")
    top_k = _per_request(top_k, bs, device, torch.int64, "top_k")
    top_p = _per_request(top_p, bs, device, torch.float32, "top_p")

    logits = target_logits.float()
    greedy = logits.argmax(dim=-1)
    scaled = logits / temperature.clamp(min=1e-6).view(bs, 1, 1)
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=device).view(1, 1, vocab)
    k = torch.where((top_k <= 0) | (top_k > vocab), vocab, top_k).view(bs, 1, 1)
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Top-p: keep the smallest prefix whose mass reaches top_p (the first token is always kept).
    mass_before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(mass_before >= top_p.view(bs, 1, 1), 0.0)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    sampled = sorted_ids.gather(-1, (probs / noise).argmax(dim=-1, keepdim=True)).squeeze(-1)
    return torch.where((temperature > 0).view(bs, 1), sampled, greedy)


def sampled_walk(
    tree: DraftTree,
    target_logits: torch.Tensor,
    temperature,
    top_k=0,
    top_p=1.0,
    generator: torch.Generator | None = None,
    *,
    check_values: bool = True,
) -> WalkResult:
    """T>0: sample the target at every node, then walk along the samples."""
    _check_logits(tree, target_logits, check_values)
    return walk_choices(tree, sample_choices(target_logits, temperature, top_k, top_p, generator))
