"""The tree-verify conv of gated-delta-net layers (sglang_ddtree/tree_conv.py): parents from the EAGLE links, the
plain-torch statement against an ordinary causal conv on a chain, and the Triton kernel against that statement
(TRITON_INTERPRET=1 in a subprocess; tests/gpu/test_tree_conv_cuda.py compares it with SGLang's kernel compiled)."""

import textwrap

import pytest
import torch
import torch.nn.functional as F

from sglang_ddtree import tree_conv
from sglang_ddtree.layout import retrieve_arrays
from sglang_ddtree.tree import build_tree_from_topk, topk_draft


def random_tree(bs, budget, seed):
    gen = torch.Generator().manual_seed(seed)
    lp = (torch.randn(bs, 6, 40, generator=gen) * 2).log_softmax(-1)
    values, tokens = topk_draft(lp, min(budget, 40))
    budgets = torch.randint(1, budget + 1, (bs,), generator=gen)
    return build_tree_from_topk(values, tokens, budgets, torch.zeros(bs, dtype=torch.long), max_budget=budget)


@pytest.mark.parametrize("budget", [1, 7, 33, 200])
def test_parents_from_retrieve_links_are_the_tree_parents(budget):
    tree = random_tree(3, budget, budget)
    _, next_token, next_sibling = retrieve_arrays(tree)
    parents = tree_conv.parents_from_retrieve(next_token, next_sibling)
    # SGLang's kernel leaves 0 where a slot is nobody's child (the root, padding)
    assert torch.equal(parents, torch.where(tree.valid & (tree.parents >= 0), tree.parents, 0))


def test_reference_on_a_chain_is_an_ordinary_causal_conv():
    """A chain (each token's parent the one before) is what a plain causal conv1d sees: [state, x] convolved."""
    torch.manual_seed(0)
    bs, dim, n, k = 2, 6, 9, 4
    parents = torch.arange(-1, n - 1).clamp(min=0).expand(bs, n)
    x, state, w, bias = torch.randn(bs, dim, n), torch.randn(3, dim, k - 1), torch.randn(dim, k), torch.randn(dim)
    idx = torch.tensor([2, 0])
    expect = torch.stack([F.conv1d(torch.cat([state[int(i)], x[b]], dim=1)[None], w[:, None, :], bias,
                                   groups=dim)[0] for b, i in enumerate(idx)])
    windows = torch.zeros(3, n, dim, k - 1)
    s = state.clone()
    got = tree_conv.tree_conv_reference(x, s, w, bias, False, idx, parents, windows, torch.tensor([1, 2]))
    assert torch.allclose(got, expect, atol=1e-5)
    # the rolled state is the last k-1 inputs, and the window kept for token t is the k-1 inputs ending at t
    for b, i in enumerate(idx):
        full = torch.cat([state[int(i)], x[b]], dim=1)
        assert torch.equal(s[int(i)], full[:, -(k - 1):])
        for t in range(n):
            assert torch.equal(windows[[1, 2][b], t], full[:, t + 1: t + k])


def test_drop_in_refuses_what_a_tree_verify_never_passes():
    x, state, w = torch.zeros(1, 4, 5), torch.zeros(1, 4, 3), torch.zeros(4, 4)
    links = torch.full((1, 5), -1)
    with pytest.raises(ValueError, match="retrieve_next_token"):
        tree_conv.causal_conv1d_tree_update(x, state, w)
    with pytest.raises(ValueError, match="num_accept_tokens"):
        tree_conv.causal_conv1d_tree_update(x, state, w, num_accept_tokens=torch.ones(1), retrieve_next_token=links,
                                            retrieve_next_sibling=links)
    with pytest.raises(ValueError, match="activation"):
        tree_conv.causal_conv1d_tree_update(x, state, w, activation="gelu", retrieve_next_token=links,
                                            retrieve_next_sibling=links)


KERNEL_CHECK = textwrap.dedent(
    """
    import torch
    from sglang_ddtree import tree_conv
    from sglang_ddtree.layout import retrieve_arrays
    from tests.test_tree_conv import random_tree

    for seed, (bs, budget, dim, k, bias, silu, save, pad_row, dtype) in enumerate([
            (2, 16, 40, 4, True, True, True, None, torch.float32), (3, 33, 70, 4, False, True, True, 1, torch.float32),
            (1, 7, 16, 2, True, False, False, None, torch.float32), (2, 64, 24, 3, True, True, True, 0, torch.float32),
            (1, 1, 8, 4, True, True, True, None, torch.float32), (2, 40, 32, 4, False, False, True, None, torch.float16)]):
        # bf16 is left to tests/gpu/test_tree_conv_cuda.py: the interpreter's bf16 arithmetic gives NaNs (SGLang's
        # kernel the same ones at the same places)
        gen = torch.Generator().manual_seed(seed)
        tree = random_tree(bs, budget, seed)
        _, nxt, sib = retrieve_arrays(tree)
        n = tree.tokens.shape[1]
        parents = tree_conv.parents_from_retrieve(nxt, sib)
        x = torch.randn(bs, dim, n, generator=gen).to(dtype)
        state = torch.randn(5, dim, k - 1, generator=gen).to(dtype)
        w = torch.randn(dim, k, generator=gen).to(dtype)
        b = torch.randn(dim, generator=gen).to(dtype) if bias else None
        idx = torch.randperm(5, generator=gen)[:bs].to(torch.int32)
        if pad_row is not None:
            idx[pad_row] = -1
        widx = torch.randperm(5, generator=gen)[:bs].to(torch.int32)
        win_ref, win = torch.zeros(5, n, dim, k - 1, dtype=dtype), torch.zeros(5, n, dim, k - 1, dtype=dtype)
        s_ref, s = state.clone(), state.clone()
        ref = tree_conv.tree_conv_reference(x, s_ref, w, b, silu, idx, parents, win_ref if save else None, widx)
        # link buffers with more rows than the batch (CUDA-graph padding): only the first bs rows are read / written
        pad = torch.full((2, n), -1, dtype=nxt.dtype)
        out_parents = torch.full((bs + 2, n), 99, dtype=torch.int64)
        got = tree_conv.causal_conv1d_tree_update(
            x, s, w, b, "silu" if silu else None, conv_state_indices=idx,
            intermediate_conv_window=win if save else None, intermediate_state_indices=widx if save else None,
            retrieve_next_token=torch.cat([nxt, pad]), retrieve_next_sibling=torch.cat([sib, pad]),
            retrieve_parent_token=out_parents, block_n=16)
        assert (out_parents[bs:] == 99).all()
        out_parents = out_parents[:bs]
        rows = [r for r in range(bs) if int(idx[r]) != -1]
        tol = 1e-5 if dtype == torch.float32 else 1e-2  # half outputs: the last bit may round differently
        assert torch.allclose(got[rows].float(), ref[rows].float(), atol=tol, rtol=tol), (seed, (got - ref).abs().max())
        assert torch.equal(s, s_ref) and torch.equal(win, win_ref) and torch.equal(out_parents, parents), seed
    print("TREE-CONV-OK")
    """
)


def test_tree_conv_kernel_matches_the_reference():
    pytest.importorskip("triton")
    from tests.test_kernels import run_in_interpreter

    run_in_interpreter(KERNEL_CHECK, "TREE-CONV-OK", timeout=600)
