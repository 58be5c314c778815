"""The walk against step-by-step decoding of a toy target, and the sampled walk's distribution."""

import math

import pytest
import torch

from sglang_ddtree.tree import build_tree, chain_tree
from sglang_ddtree.walk import greedy_walk, sample_choices, sampled_walk, walk_choices


class ToyTarget:
    """A deterministic next-token model over a small vocab: logits are a pseudo-random function of the prefix."""

    def __init__(self, vocab, seed):
        self.vocab = vocab
        self.seed = seed

    def logits(self, prefix):
        gen = torch.Generator().manual_seed(hash((self.seed, tuple(prefix))) % (2**31))
        return torch.randn(self.vocab, generator=gen) * 3

    def tree_logits(self, context, tree, b):
        """Target logits at every node of request b's tree (what one masked verify forward computes)."""
        n = tree.max_nodes
        out = torch.zeros(n, self.vocab)
        for i in range(n):
            path, node = [], i
            while node > 0:
                path.append(int(tree.tokens[b, node]))
                node = int(tree.parents[b, node])
            out[i] = self.logits(context + [int(tree.tokens[b, 0])] + path[::-1])
        return out

    def greedy(self, context, steps):
        out = []
        for _ in range(steps):
            out.append(int(self.logits(context + out).argmax()))
        return out


def drafter_logprobs(target, context, depth, noise, gen):
    """A drafter that knows the target's greedy path, blurred by noise (so branches matter)."""
    path = target.greedy(context, depth)
    lp = torch.randn(depth, target.vocab, generator=gen) * noise
    for d, tok in enumerate(path):
        lp[d, tok] += 2.0
    return lp.log_softmax(-1)


@pytest.mark.parametrize("budget", [1, 4, 16, 64])
def test_greedy_walk_reproduces_plain_decoding(budget):
    gen = torch.Generator().manual_seed(budget)
    vocab, depth, bs = 6, 5, 4
    target = ToyTarget(vocab, seed=budget)
    accepted_total = 0
    for trial in range(8):
        contexts = [torch.randint(0, vocab, (3,), generator=gen).tolist() for _ in range(bs)]
        roots = torch.randint(0, vocab, (bs,), generator=gen)
        lp = torch.stack([drafter_logprobs(target, c + [int(r)], depth, noise=2.0, gen=gen)
                          for c, r in zip(contexts, roots)])
        tree = build_tree(lp, budget, roots)
        logits = torch.stack([target.tree_logits(c, tree, b) for b, c in enumerate(contexts)])
        walk = greedy_walk(tree, logits)
        for b in range(bs):
            k = int(walk.accept_len[b])
            accepted_total += k
            plain = target.greedy(contexts[b] + [int(roots[b])], k + 1)
            assert walk.out_tokens[b, :k + 1].tolist() == plain
            assert (walk.out_tokens[b, k + 1:] == -1).all()
            assert int(walk.bonus[b]) == plain[-1]
            # the path is a chain of parent links starting at the root
            path = walk.path[b, :k + 1].tolist()
            assert path[0] == 0 and all(tree.parents[b, path[j]] == path[j - 1] for j in range(1, k + 1))
            assert (walk.path[b, k + 1:] == -1).all()
            # maximality: the target's choice after the last accepted node is not a child in the tree
            children = {int(tree.tokens[b, j]) for j in range(tree.max_nodes)
                        if tree.valid[b, j] and tree.parents[b, j] == path[-1]}
            assert plain[-1] not in children
    if budget >= 16:
        assert accepted_total > 0  # the walk was really exercised beyond the root


def test_walk_never_accepts_invalid_slots():
    lp = torch.full((1, 3, 4), -math.log(4.0))
    tree = build_tree(lp, torch.tensor([2]), torch.tensor([0]), max_budget=10)
    choice = torch.zeros(1, tree.max_nodes, dtype=torch.long)  # invalid slots hold token 0 with parent -1
    choice[0, 0] = 3  # not among the two valid children (tokens 0 and 1)
    walk = walk_choices(tree, choice)
    assert walk.accept_len.item() == 0 and walk.bonus.item() == 3


def test_chain_walk_accepts_the_matching_prefix():
    lp = torch.randn(1, 4, 7).log_softmax(-1)
    tree = chain_tree(lp, torch.tensor([2]))
    choice = torch.full((1, 5), 6)
    draft = tree.tokens[0, 1:].tolist()
    choice[0, 0], choice[0, 1] = draft[0], draft[1]  # the target agrees with the first two drafts
    choice[0, 2] = (draft[2] + 1) % 7
    walk = walk_choices(tree, choice)
    assert walk.accept_len.item() == 2
    assert walk.out_tokens[0].tolist() == [draft[0], draft[1], (draft[2] + 1) % 7, -1, -1]


def chi2_critical(dof, z=3.09):
    """Wilson-Hilferty approximation of the chi-square quantile (z=3.09: p = 0.001)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def chi2(counts, probs, total):
    keep = probs * total >= 5
    other = (counts[~keep].sum(), probs[~keep].sum() * total)
    stat = (((counts[keep] - probs[keep] * total) ** 2) / (probs[keep] * total)).sum()
    if other[1] > 0:
        stat += (other[0] - other[1]) ** 2 / other[1]
    dof = int(keep.sum()) - (0 if other[1] > 0 else 1)
    return float(stat), dof


@pytest.mark.parametrize("params", [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.3, 0, 0.8)])
def test_sampled_walk_first_two_tokens_follow_the_target(params):
    temperature, top_k, top_p = params
    vocab, depth, reps = 6, 3, 40000
    gen = torch.Generator().manual_seed(123)
    target = ToyTarget(vocab, seed=99)
    context, root = [1, 2], 3
    lp = drafter_logprobs(target, context + [root], depth, noise=1.0, gen=gen)
    tree = build_tree(lp.unsqueeze(0), 12, torch.tensor([root]))
    logits = target.tree_logits(context, tree, 0)
    walk = sampled_walk(tree.select(torch.zeros(reps, dtype=torch.long)), logits.expand(reps, -1, -1),
                        temperature, top_k, top_p, generator=torch.Generator().manual_seed(7))

    def filtered_probs(logit_row):
        scaled = logit_row / temperature
        if top_k > 0:
            kth = scaled.topk(top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        p = scaled.softmax(-1)
        sp, si = p.sort(descending=True)
        keep = (sp.cumsum(0) - sp) < top_p
        out = torch.zeros_like(p)
        out[si[keep]] = sp[keep]
        return (out / out.sum()).double()

    # first token: the target's filtered distribution at the root
    p1 = filtered_probs(target.logits(context + [root]))
    first = walk.out_tokens[:, 0]
    counts = torch.bincount(first, minlength=vocab).double()
    stat, dof = chi2(counts, p1, reps)
    assert stat < chi2_critical(dof), (stat, dof)
    assert counts[p1 == 0].sum() == 0  # filtered-out tokens never appear
    # joint of the first two tokens: p(a) * p(b | a). Rounds that stopped after one token get their second token
    # the way the next round would: a fresh target sample at the new root.
    cond = torch.stack([filtered_probs(target.logits(context + [root, a])) for a in range(vocab)])
    joint = (p1[:, None] * cond).flatten()
    second = walk.out_tokens[:, 1].clone()
    stopped = walk.accept_len == 0
    fresh = torch.multinomial(cond[first[stopped]].float(), 1, generator=torch.Generator().manual_seed(8)).squeeze(1)
    second[stopped] = fresh
    pair = first * vocab + second
    counts2 = torch.bincount(pair, minlength=vocab * vocab).double()
    stat2, dof2 = chi2(counts2, joint, reps)
    assert stat2 < chi2_critical(dof2), (stat2, dof2)
    assert (walk.accept_len > 0).float().mean() > 0.2  # draft tokens were really accepted on the way


def test_zero_temperature_rows_are_greedy_in_a_mixed_batch():
    logits = torch.randn(3, 5, 11)
    choice = sample_choices(logits, torch.tensor([0.0, 1.0, 0.0]), generator=torch.Generator().manual_seed(0))
    assert torch.equal(choice[0], logits[0].argmax(-1)) and torch.equal(choice[2], logits[2].argmax(-1))


def test_bad_input_is_refused():
    tree = build_tree(torch.randn(2, 3, 5).log_softmax(-1), 4, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="target_logits"):
        greedy_walk(tree, torch.randn(2, 4, 5))
    bad = torch.randn(2, 5, 5)
    bad[0, 1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        greedy_walk(tree, bad)
    with pytest.raises(ValueError, match="target_choice"):
        walk_choices(tree, torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        sample_choices(torch.randn(2, 5, 5), torch.tensor([1.0, 1.0, 1.0]))
