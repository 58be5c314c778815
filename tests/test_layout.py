import torch

from sglang_ddtree.layout import (
    ancestor_mask,
    pack_mask_bits,
    parents_from_retrieve,
    retrieve_arrays,
    tree_positions,
    unpack_mask_bits,
)
from sglang_ddtree.tree import build_tree


def make_tree(seed, bs=3, depth=6, vocab=9, budget=70, prune=None):
    gen = torch.Generator().manual_seed(seed)
    lp = (torch.randn(bs, depth, vocab, generator=gen) * 2).log_softmax(-1)
    budgets = torch.randint(1, budget + 1, (bs,), generator=gen)
    return build_tree(lp, budgets, torch.arange(bs), max_budget=budget, prune=prune)


def ancestors(parents, i):
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


def test_mask_rows_are_exactly_ancestors_plus_self():
    for seed in range(5):
        tree = make_tree(seed, prune=0.001 if seed % 2 else None)
        mask = ancestor_mask(tree)
        bs, n = tree.tokens.shape
        assert mask.shape == (bs, n, n) and mask.dtype == torch.bool
        for b in range(bs):
            parents = tree.parents[b].tolist()
            for i in range(n):
                expect = ancestors(parents, i) if tree.valid[b, i] else {i}
                assert set(torch.nonzero(mask[b, i]).flatten().tolist()) == expect


def test_packed_mask_round_trips_and_uses_bit_j_mod_32():
    tree = make_tree(11, budget=100)  # N = 101 -> 4 words, the last one partial
    mask = ancestor_mask(tree)
    packed = pack_mask_bits(mask)
    assert packed.shape == (*mask.shape[:2], 4) and packed.dtype == torch.int32
    assert torch.equal(unpack_mask_bits(packed, mask.shape[-1]), mask)
    # column 0 (the root) is bit 0 of word 0 for every valid row; column 31 sets the sign bit
    single = torch.zeros(1, 1, 40, dtype=torch.bool)
    single[0, 0, 31] = True
    single[0, 0, 33] = True
    words = pack_mask_bits(single)[0, 0].tolist()
    assert words == [-(2**31), 2]


def test_positions_are_start_plus_depth():
    tree = make_tree(12)
    start = torch.tensor([0, 17, 1000])
    pos = tree_positions(tree, start)
    assert torch.equal(pos, start[:, None] + tree.depth)
    assert torch.equal(pos[:, 0], start)


def test_retrieve_arrays_round_trip_to_parents():
    for seed in range(6):
        tree = make_tree(seed + 20, prune=0.01 if seed % 3 == 0 else None)
        index, next_token, next_sibling = retrieve_arrays(tree)
        bs, n = tree.tokens.shape
        assert torch.equal(parents_from_retrieve(next_token, next_sibling), tree.parents)
        for b in range(bs):
            for i in range(n):
                assert index[b, i] == (b * n + i if tree.valid[b, i] else -1)
                children = [j for j in range(n) if tree.parents[b, j] == i and tree.valid[b, j]]
                assert next_token[b, i] == (children[0] if children else -1)
                # the first child is the drafter's best-ranked child
                if children:
                    assert tree.ranks[b, children[0]] == min(tree.ranks[b, j] for j in children)
                p = int(tree.parents[b, i])
                if p >= 0:
                    sibs = [j for j in range(n) if tree.parents[b, j] == p and tree.valid[b, j]]
                    k = sibs.index(i)
                    assert next_sibling[b, i] == (sibs[k + 1] if k + 1 < len(sibs) else -1)
                else:
                    assert next_sibling[b, i] == -1
