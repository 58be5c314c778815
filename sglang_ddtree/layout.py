"""What the target's verify forward needs from a draft tree: visibility mask, positions, EAGLE-style arrays.

All functions are vectorized over the batch with static shapes and no host synchronisation.
"""

from __future__ import annotations

import torch

from sglang_ddtree.tree import DraftTree


def ancestor_chain(tree: DraftTree) -> torch.Tensor:
    """[bs, N, L+1] int64: for node i, itself, its parent, grandparent, ... up to the root; -1 padded.

    Invalid nodes have only themselves.
    """
    bs, n = tree.tokens.shape
    device = tree.tokens.device
    # Extra column n is a sink whose parent is -1, so following -1 stays at -1 without branching.
    parents_ext = torch.cat([tree.parents, torch.full((bs, 1), -1, dtype=torch.int64, device=device)], dim=1)
    node = torch.arange(n, device=device).expand(bs, n)
    chain = [node]
    for _ in range(tree.depth_limit):
        node = parents_ext.gather(1, torch.where(node >= 0, node, n))
        chain.append(node)
    return torch.stack(chain, dim=2)


def ancestor_mask(tree: DraftTree) -> torch.Tensor:
    """[bs, N, N] bool: mask[b, i, j] is True iff node j is node i or one of its ancestors."""
    bs, n = tree.tokens.shape
    chain = ancestor_chain(tree)  # [bs, N, L+1]
    rows = torch.arange(n, device=chain.device).view(1, n, 1)
    cols = torch.where(chain >= 0, chain, rows)  # padding re-marks the diagonal, which is True anyway
    mask = torch.zeros((bs, n * n), dtype=torch.bool, device=chain.device)
    mask.scatter_(1, (rows * n + cols).reshape(bs, -1), True)
    return mask.view(bs, n, n)


def pack_mask_bits(mask: torch.Tensor) -> torch.Tensor:
    """Bit-pack the last dim: [..., N] bool -> [..., ceil(N/32)] int32, column j at bit (j % 32) of word j // 32."""
    n = mask.shape[-1]
    words = (n + 31) // 32
    padded = torch.nn.functional.pad(mask.to(torch.int64), (0, words * 32 - n))
    weights = torch.bitwise_left_shift(torch.ones(32, dtype=torch.int64, device=mask.device),
                                       torch.arange(32, device=mask.device))
    packed = (padded.view(*mask.shape[:-1], words, 32) * weights).sum(dim=-1)
    # Reinterpret the low 32 bits as a signed int32 (bit 31 set -> negative).
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_mask_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `pack_mask_bits`."""
    bits = torch.arange(32, device=packed.device)
    unpacked = (packed.to(torch.int64).unsqueeze(-1) >> bits) & 1
    return unpacked.flatten(-2)[..., :n].bool()


def tree_positions(tree: DraftTree, start: torch.Tensor) -> torch.Tensor:
    """[bs, N] int64 position ids: the root sits at `start` (the first uncommitted position), a node at start+depth."""
    if start.shape != (tree.batch_size,):
        raise ValueError(f"start must be [batch={tree.batch_size}], got shape {tuple(start.shape)}.")
    return start.to(torch.int64).unsqueeze(1) + tree.depth


def retrieve_arrays(tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SGLang/EAGLE tree arrays, left-child right-sibling, each [bs, N] int64 with -1 for none.

    retrieve_index[b, i]: flat index b*N + i of node i in the batch's verify tokens (-1 for invalid slots);
    retrieve_next_token[b, i]: node i's first child (its best-ranked child, the smallest index);
    retrieve_next_sibling[b, i]: the next child of node i's parent after i.
    """
    bs, n = tree.tokens.shape
    device = tree.tokens.device
    idx = torch.arange(n, device=device).expand(bs, n)
    is_child = tree.valid & (tree.parents >= 0)

    retrieve_index = torch.where(tree.valid, idx + torch.arange(bs, device=device).unsqueeze(1) * n, -1)

    # First child: smallest child index per parent. Non-children write into a sink column n.
    first_child = torch.full((bs, n + 1), n, dtype=torch.int64, device=device)
    first_child.scatter_reduce_(1, torch.where(is_child, tree.parents, n), torch.where(is_child, idx, n),
                                reduce="amin")
    retrieve_next_token = first_child[:, :n]
    retrieve_next_token = torch.where(retrieve_next_token < n, retrieve_next_token, -1)

    # Next sibling: sort children by (parent, index); consecutive entries with the same parent are siblings.
    sort_key = torch.where(is_child, tree.parents * n + idx, n * n + idx)
    order = torch.argsort(sort_key, dim=1)
    sorted_parent = torch.where(is_child, tree.parents, -1).gather(1, order)
    same_parent = (sorted_parent[:, :-1] == sorted_parent[:, 1:]) & (sorted_parent[:, :-1] >= 0)
    next_in_order = torch.where(same_parent, order[:, 1:], -1)
    retrieve_next_sibling = torch.full((bs, n), -1, dtype=torch.int64, device=device)
    retrieve_next_sibling.scatter_(1, order[:, :-1], next_in_order)
    return retrieve_index, retrieve_next_token, retrieve_next_sibling


def parents_from_retrieve(retrieve_next_token: torch.Tensor, retrieve_next_sibling: torch.Tensor) -> torch.Tensor:
    """Rebuild the parent array by walking the left-child right-sibling links (host loop: tests and debugging)."""
    bs, n = retrieve_next_token.shape
    parents = torch.full((bs, n), -1, dtype=torch.int64)
    next_token = retrieve_next_token.cpu().tolist()
    next_sibling = retrieve_next_sibling.cpu().tolist()
    for b in range(bs):
        stack = [0]
        while stack:
            node = stack.pop()
            child = next_token[b][node]
            while child != -1:
                parents[b, child] = node
                stack.append(child)
                child = next_sibling[b][child]
    return parents
