"""Deliberate bugs for the offline DDTree decoder, to prove that `compare` catches them.

Each bug is switched on by the context manager `planted(name)`, which patches one piece the decoder in
`sglang_ddtree/offline/decoders.py` uses and restores it on exit. Nothing here runs unless a test or
`scripts/planted_bugs.py` asks for it. The bugs are the kinds a real tree-verify implementation gets wrong:

  sibling_mask     the verify mask lets a node also see its previous sibling (same parent), not only its
                   ancestors: the target's logits at such nodes are computed on a wrong context;
  walk_plus_one    the walk accepts one node too many: when the target's choice does not match any child of
                   the last accepted node, the walk takes that node's first child anyway;
  deep_position    draft nodes at depth 15 or more (the deepest with block size 16) are verified one position
                   too far (start + depth + 1): only rounds whose walk reaches depth 15 see it;
  kv_commit_wrong  the KV commit keeps the K/V of the wrong node for the last accepted draft node (the node
                   verified right after it), while the output tokens are right;
  walk_one_short   the greedy walk stops one node before the end of the path the target agrees with: the last
                   agreed draft token is emitted as the bonus, so the output is right (lossless) but every round
                   that accepted a draft token accepts one fewer: only tau shows it (and, between exact decoders,
                   the rounds' accept lengths).

`BUGS` lists them in this order; all of them show at T = 0. `SAMPLED_BUGS` show only in sampled runs (T > 0):

  shared_noise     the sampled walk draws one exponential-race noise vector and uses it at every tree node
                   instead of an independent draw per node: each node's own sample still follows the target, but
                   the samples along a path are coupled, so which tokens follow which (and how deep the walk gets)
                   no longer follows the target.
"""

from __future__ import annotations

import contextlib

import torch

BUGS = ("sibling_mask", "walk_plus_one", "deep_position", "kv_commit_wrong", "walk_one_short")
SAMPLED_BUGS = ("shared_noise",)


def _sibling_mask(orig):
    def ancestor_mask(tree):
        mask = orig(tree).clone()
        parents = tree.parents
        bs, n = parents.shape
        for b in range(bs):
            last_child: dict[int, int] = {}
            for i in range(1, n):
                if not bool(tree.valid[b, i]):
                    continue
                p = int(parents[b, i])
                prev = last_child.get(p)
                if prev is not None:
                    mask[b, i, prev] = True
                last_child[p] = i
        return mask

    return ancestor_mask


def _walk_plus_one(orig):
    from sglang_ddtree.walk import WalkResult

    def greedy_walk(tree, target_logits, **kw):
        w = orig(tree, target_logits, **kw)
        path, acc = w.path.clone(), w.accept_len.clone()
        out = w.out_tokens.clone()
        bonus = w.bonus.clone()
        for b in range(path.shape[0]):
            a = int(acc[b])
            if a >= tree.depth_limit:
                continue
            last = int(path[b, a])
            children = [i for i in range(tree.tokens.shape[1])
                        if bool(tree.valid[b, i]) and int(tree.parents[b, i]) == last]
            if not children:
                continue
            child = children[0]
            path[b, a + 1] = child
            out[b, a] = tree.tokens[b, child]
            bonus[b] = w.target_choice[b, child]
            out[b, a + 1] = bonus[b]
            acc[b] = a + 1
        return WalkResult(path=path, accept_len=acc, bonus=bonus, out_tokens=out, target_choice=w.target_choice)

    return greedy_walk


def _walk_one_short(orig):
    from sglang_ddtree.walk import WalkResult

    def greedy_walk(tree, target_logits, **kw):
        w = orig(tree, target_logits, **kw)
        path, acc = w.path.clone(), w.accept_len.clone()
        out, bonus = w.out_tokens.clone(), w.bonus.clone()
        for b in range(path.shape[0]):
            a = int(acc[b])
            if a == 0:
                continue
            bonus[b] = out[b, a - 1]  # the target's choice at the new last node: the dropped node's token
            out[b, a] = -1
            path[b, a] = -1
            acc[b] = a - 1
        return WalkResult(path=path, accept_len=acc, bonus=bonus, out_tokens=out, target_choice=w.target_choice)

    return greedy_walk


def _shared_noise(orig):
    from sglang_ddtree.walk import sample_choices, walk_choices

    def sampled_walk(tree, target_logits, temperature, top_k=0, top_p=1.0, generator=None, **kw):
        gen = generator if generator is not None else torch.default_generator
        state = gen.get_state()
        choices = []
        for i in range(target_logits.shape[1]):
            gen.set_state(state)  # every node starts from the same generator state: the same noise vector
            choices.append(sample_choices(target_logits[:, i:i + 1], temperature, top_k, top_p, gen)[:, 0])
        return walk_choices(tree, torch.stack(choices, dim=1))

    return sampled_walk


DEEP_DEPTH = 15


def _deep_position(orig):
    def tree(self, ids, depth, ancestors, start):
        return orig(self, ids, torch.where(depth >= DEEP_DEPTH, depth + 1, depth), ancestors, start)

    return tree


def _kv_commit_wrong(orig):
    def keep_nodes(self, start, nodes):
        nodes = nodes.clone()
        if nodes.numel() > 1:  # a draft node was accepted: commit its neighbour in the verify instead
            last, n = int(nodes[-1]), self.committed - start
            wrong = last + 1 if last + 1 < n else last - 1
            if wrong > 0 and wrong != int(nodes[-2]):
                nodes[-1] = wrong
        return orig(self, start, nodes)

    return keep_nodes


@contextlib.contextmanager
def planted(name: str):
    """Switch bug `name` (one of BUGS or SAMPLED_BUGS) on for the duration of the block."""
    from sglang_ddtree.offline import decoders
    from sglang_ddtree.offline.target import TargetState

    if name not in BUGS + SAMPLED_BUGS:
        raise ValueError(f"unknown planted bug {name!r}; allowed: {', '.join(BUGS + SAMPLED_BUGS)}.")
    if name == "sibling_mask":
        owner, attr, make = decoders, "ancestor_mask", _sibling_mask
    elif name == "walk_plus_one":
        owner, attr, make = decoders, "greedy_walk", _walk_plus_one
    elif name == "walk_one_short":
        owner, attr, make = decoders, "greedy_walk", _walk_one_short
    elif name == "shared_noise":
        owner, attr, make = decoders, "sampled_walk", _shared_noise
    elif name == "deep_position":
        owner, attr, make = TargetState, "tree", _deep_position
    else:
        owner, attr, make = TargetState, "keep_nodes", _kv_commit_wrong
    orig = getattr(owner, attr)
    setattr(owner, attr, make(orig))
    try:
        yield
    finally:
        setattr(owner, attr, orig)
