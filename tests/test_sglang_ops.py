"""The SGLang-independent tensor operations of the DDTREE serving step, against plain references."""

import pytest
import torch

from sglang_ddtree.layout import ancestor_mask
from sglang_ddtree.sglang import ops
from sglang_ddtree.tree import build_tree, topk_draft
from sglang_ddtree.walk import walk_choices


@pytest.mark.parametrize("world_size,k", [(1, 20), (2, 20), (3, 20), (4, 25)])
def test_sharded_topk_equals_full_vocab_topk(world_size, k):
    """Equal vocab shards (as TP pads them); with k=25 > shard size 15 every shard contributes all its tokens."""
    gen = torch.Generator().manual_seed(world_size)
    n, hidden, vocab = 7, 16, 60
    h = torch.randn(n, hidden, generator=gen)
    weight = torch.randn(vocab, hidden, generator=gen)
    weight[40] = weight[3]  # two tokens with identical logits in different shards: the lower id must win
    ref_values, ref_ids = topk_draft((h @ weight.T).log_softmax(-1).unsqueeze(0), k)
    size = vocab // world_size
    local = [ops.local_topk_logprobs(h, weight[r * size:(r + 1) * size], k, vocab_start=r * size)
             for r in range(world_size)]
    values, ids = ops.merge_shard_topk(torch.stack([x[0] for x in local]), torch.stack([x[1] for x in local]),
                                       torch.stack([x[2] for x in local]), k)
    assert torch.equal(ids, ref_ids[0])
    assert torch.allclose(values, ref_values[0], atol=1e-5)
    if world_size == 1:
        v1, i1 = ops.draft_topk_logprobs(h, weight, k)
        assert torch.equal(i1, ids) and torch.allclose(v1, values)


def test_draft_topk_through_the_all_gather_interface():
    gen = torch.Generator().manual_seed(5)
    n, hidden, vocab, k, world = 4, 8, 40, 12, 2
    h = torch.randn(n, hidden, generator=gen)
    weight = torch.randn(vocab, hidden, generator=gen)
    shards = [(weight[:20], 0), (weight[20:], 20)]
    # Simulate the collective: each call gathers the corresponding tensor of every rank, in call order.
    per_rank = [ops.local_topk_logprobs(h, w, k, vocab_start=s) for w, s in shards]
    calls = iter(range(3))

    def all_gather(x):
        which = next(calls)
        return torch.cat([r[which] for r in per_rank], dim=0)

    values, ids = ops.draft_topk_logprobs(h, shards[0][0], k, vocab_start=0, all_gather=all_gather,
                                          world_size=world)
    ref_values, ref_ids = topk_draft((h @ weight.T).log_softmax(-1).unsqueeze(0), k)
    assert torch.equal(ids, ref_ids[0]) and torch.allclose(values, ref_values[0], atol=1e-5)


def dense_full_mask(tree_mask, seq_lens):
    blocks = []
    for b, prefix in enumerate(seq_lens.tolist()):
        n = tree_mask.shape[1]
        block = torch.ones(n, prefix + n, dtype=torch.bool)
        block[:, prefix:] = tree_mask[b]
        blocks.append(block.reshape(-1))
    return torch.cat(blocks)


def test_tree_verify_mask_matches_the_full_mask_layout():
    lp = torch.randn(3, 4, 6).log_softmax(-1)
    tree = build_tree(lp, 9, torch.tensor([1, 2, 3]))
    tm = ancestor_mask(tree)
    seq_lens = torch.tensor([5, 0, 12])
    exact = ops.verify_mask_numel(tree.max_nodes, int(seq_lens.sum()), 3)
    ref = dense_full_mask(tm, seq_lens)
    assert ref.numel() == exact
    assert torch.equal(ops.tree_verify_mask(tm, seq_lens, exact), ref)
    # a host-side upper bound (lagging lengths + 16) only adds a True tail
    bound = ops.verify_mask_numel(tree.max_nodes, int(seq_lens.sum()) + 3 * 16, 3)
    padded = ops.tree_verify_mask(tm, seq_lens, bound)
    assert torch.equal(padded[:exact], ref) and padded[exact:].all()


def apply_moves_chunked(kv, tgt, src, chunk):
    """SGLang's move_kv_cache: chunks in order; inside a chunk all sources are read before any write."""
    kv = kv.clone()
    for start in range(0, tgt.numel(), chunk):
        t, s = tgt[start:start + chunk], src[start:start + chunk]
        kv[t] = kv[s].clone()
    return kv


@pytest.mark.parametrize("chunk", [1, 3, 256])
def test_kv_moves_make_the_accepted_path_contiguous(chunk):
    gen = torch.Generator().manual_seed(chunk)
    bs, depth, vocab, budget = 4, 6, 5, 30
    lp = (torch.randn(bs, depth, vocab, generator=gen) * 0.3).log_softmax(-1)  # flat: deep branching trees
    tree = build_tree(lp, budget, torch.zeros(bs, dtype=torch.long))
    # a target that walks a random existing path: choose, at each node, the token of a random child
    choice = torch.randint(0, vocab, (bs, tree.max_nodes), generator=gen)
    walk = walk_choices(tree, choice)
    n = tree.max_nodes
    # request b's nodes live in a scattered set of KV slots
    perm = torch.randperm(bs * n + 50, generator=gen)[: bs * n].view(bs, n)
    kv = torch.randn(bs * n + 50, 3, generator=gen)
    tgt, src = ops.accepted_kv_moves(walk.path, perm)
    assert tgt.numel() == bs * depth
    moved = apply_moves_chunked(kv, tgt, src, chunk)
    for b in range(bs):
        k = int(walk.accept_len[b])
        for j in range(k + 1):
            # position prefix+j (node slot j) now holds the KV that node path[j] was verified into
            assert torch.equal(moved[perm[b, j]], kv[perm[b, walk.path[b, j]]])
    assert (walk.accept_len > 1).any()  # deep paths were exercised


def test_kv_moves_with_fewer_nodes_than_depths():
    path = torch.tensor([[0, 1, 2, -1, -1]])
    slots = torch.tensor([[10, 11, 12]])  # budget 2: only 3 node slots
    tgt, src = ops.accepted_kv_moves(path, slots)
    assert tgt.tolist()[:2] == [11, 12] and src.tolist()[:2] == [11, 12]
    assert torch.equal(tgt[2:], src[2:])  # depths without slots are self-copies


def test_gather_path_rows_and_flat_inputs():
    rows = torch.arange(2 * 4 * 3).view(2, 4, 3)
    path = torch.tensor([[0, 2, -1], [0, 1, 3]])
    out = ops.gather_path_rows(rows, path)
    assert torch.equal(out[0], rows[0, [0, 2, 0]]) and torch.equal(out[1], rows[1, [0, 1, 3]])
    tree = build_tree(torch.randn(2, 3, 4).log_softmax(-1), 5, torch.tensor([7, 8]))
    ids, pos = ops.flat_tree_inputs(tree, torch.tensor([100, 3]))
    assert torch.equal(ids.view(2, -1), tree.tokens)
    assert torch.equal(pos.view(2, -1), torch.tensor([[100], [3]]) + tree.depth)


@pytest.mark.parametrize("budget,width", [(30, 7), (5, 6), (40, 7)])
def test_oracle_chain_reverify_commits_what_the_tree_walk_accepted(budget, width):
    """`--speculative-ddtree-oracle`: the accepted path re-verified as a chain. When the chain verify's choices
    equal the tree verify's at the path's nodes (same numbers), the chain walk commits exactly what the tree walk
    did (tokens, bonus, branch counts, commit lengths); where the chain's choice differs at slot j, it commits the
    first j drafts and its own choice as the bonus. The verify chain is a plain chain (links, positions)."""
    from sglang_ddtree.sglang.stats import branch_counts

    gen = torch.Generator().manual_seed(budget)
    bs, depth, vocab = 6, width - 1, 5
    lp = (torch.randn(bs, depth, vocab, generator=gen) * 0.3).log_softmax(-1)  # flat: deep branching trees
    tree = build_tree(lp, budget, torch.arange(bs))
    # the target picks a random child's token at each node (a non-first sibling often), rarely a token off the tree
    n = tree.max_nodes
    child_token = torch.full((bs, n), vocab + 1, dtype=torch.long)
    for b in range(bs):
        for i in range(n):
            kids = [c for c in range(n) if bool(tree.valid[b, c]) and int(tree.parents[b, c]) == i]
            if kids and torch.rand(1, generator=gen).item() < 0.9:
                child_token[b, i] = tree.tokens[b, kids[int(torch.randint(len(kids), (1,), generator=gen))]]
    walk = walk_choices(tree, child_token)
    if budget >= 30:  # deep paths and branches really exercised (a 5-node flat tree is one level deep)
        assert (walk.accept_len >= 2).any() and (branch_counts(tree, walk) > 0).any()

    verify, chain = ops.accepted_path_chain(tree, walk.path, width)
    nodes = torch.where(walk.path[:, :width] >= 0, walk.path[:, :width],
                        walk.path.gather(1, walk.accept_len.unsqueeze(1)))
    same = child_token.gather(1, nodes)  # the chain verify reproduces the tree verify's choices
    chain_walk = walk_choices(chain, same)
    assert torch.equal(chain_walk.accept_len, walk.accept_len)
    assert torch.equal(chain_walk.bonus, walk.bonus)
    assert torch.equal(chain_walk.out_tokens, walk.out_tokens[:, : chain_walk.out_tokens.shape[1]])
    assert torch.equal(branch_counts(chain, chain_walk), branch_counts(tree, walk))

    # a differing choice at slot 1 where two drafts were accepted: one draft, then the chain's own choice
    deep = walk.accept_len >= 2
    other = same.clone()
    other[:, 1] = vocab + 2
    diff = walk_choices(chain, other)
    assert torch.equal(diff.accept_len[deep], torch.ones_like(diff.accept_len[deep]))
    assert (diff.bonus[deep] == vocab + 2).all()

    # the verify chain: slot j's parent is j - 1, positions follow the slot, links make one chain
    assert verify.valid.all() and torch.equal(verify.parents[:, 1:], torch.arange(width - 1).expand(bs, -1))
    next_token, next_sibling = ops.tree_links(verify)
    assert torch.equal(next_token[:, :-1], torch.arange(1, width, dtype=torch.int32).expand(bs, -1))
    assert (next_token[:, -1] == -1).all() and (next_sibling == -1).all()
    ids, pos = ops.flat_tree_inputs(verify, torch.full((bs,), 50))
    assert torch.equal(pos.view(bs, -1), 50 + torch.arange(width).expand(bs, -1))
    assert torch.equal(ids.view(bs, -1)[chain.valid], chain.tokens[chain.valid])
