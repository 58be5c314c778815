"""The Triton kernels compiled on CUDA == the torch reference (bit for bit), at serving sizes, and graph-capturable."""

import pytest
import torch

from sglang_ddtree import kernels
from sglang_ddtree.layout import ancestor_mask, retrieve_arrays
from sglang_ddtree.sglang.ops import tree_verify_mask, verify_mask_numel
from sglang_ddtree.tree import build_tree_from_topk, topk_draft
from sglang_ddtree.walk import walk_choices

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
FIELDS = ("tokens", "parents", "depth", "scores", "ranks", "valid")


# scale: the drafter's logits are randn x scale: 3 gives shallow trees (the one-program kernels stop selecting after
# a few depths), 12 trees 15 deep (they select at every depth)
@pytest.mark.parametrize("budget,bs,vocab,ties,scale", [(16, 4, 151936, False, 3), (256, 3, 151936, False, 3),
                                                        (1024, 2, 151936, False, 3), (64, 8, 4096, True, 3),
                                                        (1024, 2, 4096, True, 3), (7, 5, 5, True, 3),
                                                        (256, 3, 151936, False, 12), (1024, 2, 151936, False, 12)])
@pytest.mark.parametrize("kernel", ["sort", "select"])
def test_kernels_equal_torch_on_cuda(budget, bs, vocab, ties, scale, kernel):
    gen = torch.Generator().manual_seed(budget + bs)
    lp = (torch.randn(bs, 15, vocab, generator=gen) * scale).log_softmax(-1)
    if ties:
        lp = (lp * 2).round() / 2
    lp = lp.cuda()
    values, tokens = topk_draft(lp, min(budget, vocab))
    roots = torch.randint(0, vocab, (bs,), generator=gen).cuda()
    budgets = torch.randint(1, budget + 1, (bs,), generator=gen).cuda()
    for b in (budget, budgets):
        ref = build_tree_from_topk(values, tokens, b, roots, max_budget=budget)
        got = kernels.build_tree_triton(values, tokens, b, roots, max_budget=budget, kernel=kernel)
        for f in FIELDS:
            assert torch.equal(getattr(ref, f), getattr(got, f)), f
    seq_lens = torch.randint(0, 3000, (bs,), generator=gen).cuda()
    numel = verify_mask_numel(ref.max_nodes, int(seq_lens.sum()) + 16 * bs, bs)
    assert torch.equal(tree_verify_mask(ancestor_mask(ref), seq_lens, numel),
                       kernels.tree_verify_mask_triton(ref, seq_lens, numel))
    first = retrieve_arrays(ref)[1]
    deep = torch.where(first >= 0, ref.tokens.gather(1, first.clamp(min=0)), 0)
    for choice in (torch.randint(0, vocab, ref.tokens.shape, generator=gen).cuda(), deep):
        a, w = walk_choices(ref, choice), kernels.walk_triton(ref, choice)
        for f in ("path", "accept_len", "bonus", "out_tokens"):
            assert torch.equal(getattr(a, f), getattr(w, f)), f


@pytest.mark.parametrize("kernel", ["sort", "select"])
def test_kernels_replay_in_a_cuda_graph(kernel):
    bs, vocab, budget = 3, 32000, 256
    values = torch.empty(bs, 15, budget, device="cuda")
    tokens = torch.empty(bs, 15, budget, dtype=torch.long, device="cuda")
    roots = torch.zeros(bs, dtype=torch.long, device="cuda")

    def fill(seed):
        gen = torch.Generator().manual_seed(seed)
        v, t = topk_draft((torch.randn(bs, 15, vocab, generator=gen) * 3).log_softmax(-1), budget)
        values.copy_(v)
        tokens.copy_(t)

    def run():
        tree = kernels.build_tree_triton(values, tokens, budget, roots, max_budget=budget, kernel=kernel)
        return tree, kernels.walk_triton(tree, tree.tokens)

    fill(0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_tree, g_walk = run()
    for seed in (1, 2):
        fill(seed)
        graph.replay()
        torch.cuda.synchronize()
        ref = build_tree_from_topk(values, tokens, budget, roots, max_budget=budget)
        for f in FIELDS:
            assert torch.equal(getattr(ref, f), getattr(g_tree, f)), f


@pytest.mark.parametrize("rows,k,ties", [(15, 16, False), (15, 256, False), (15, 1024, True), (120, 64, True),
                                         (120, 256, False), (15, 1024, "flat")])
def test_topk_kernel_equals_exact_topk_on_cuda(rows, k, ties):
    """The radix-select top-K (kernels.topk_triton) compiled, at the real vocabulary: the same ids and
    values in the same order as tree.exact_topk on the CPU, and the same again replayed in a CUDA graph."""
    from sglang_ddtree.tree import exact_topk

    gen = torch.Generator().manual_seed(rows + k)
    x = torch.randn(rows, 151936, generator=gen) * 4
    if ties:
        x = (x.to(torch.bfloat16).float() * 4).round() / 4
    if ties == "flat":  # rows where most entries tie at the group-maximum threshold
        x[1] = 0.5
        x[2] = float("-inf")
        x[2, 150000:150010] = 2.0
    ref_values, ref_ids = exact_topk(x, k, id_offset=3)
    static = x.cuda()
    values, ids = kernels.topk_triton(static, k, id_offset=3)
    assert torch.equal(ids.cpu(), ref_ids) and torch.equal(values.cpu(), ref_values)
    # bfloat16 / float16 read as they are: 2 / 3 radix passes a selection instead of 4 (kernels.topk._KEY_BITS)
    for dtype in (torch.bfloat16, torch.float16):
        low = x.to(dtype)
        want_values, want_ids = exact_topk(low.float(), k, id_offset=3)
        values, ids = kernels.topk_triton(low.cuda(), k, id_offset=3)
        assert torch.equal(ids.cpu(), want_ids) and torch.equal(values.cpu(), want_values), dtype
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_values, g_ids = kernels.topk_triton(static, k, id_offset=3)
    x2 = torch.randn(rows, 151936, generator=gen)
    static.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    ref_values, ref_ids = exact_topk(x2, k, id_offset=3)
    assert torch.equal(g_ids.cpu(), ref_ids) and torch.equal(g_values.cpu(), ref_values)


@pytest.mark.parametrize("rows,k", [(15, 256), (240, 64), (15, 1024)])
def test_topk_logits_lse_on_bf16_equals_the_float32_path_on_cuda(rows, k):
    """kernels.topk_logits_lse (what the serving path runs on a GPU) reads the bf16 lm_head output
    as it is: the same ids and values as tree.exact_topk of its float32 copy, a logsumexp equal to row_max_lse's bit
    for bit and to torch.logsumexp's up to float32 rounding, also replayed in a CUDA graph."""
    from sglang_ddtree.tree import exact_topk

    gen = torch.Generator(device="cuda").manual_seed(rows + k)
    static = (torch.randn(rows, 151936, device="cuda", generator=gen) * 4).to(torch.bfloat16)
    static[0, 100:120] = static[0].max()  # a tie at the max
    static[1] = float("-inf")
    static[1, 150000:150005] = 3.0  # chunks of -inf only
    for attempt in range(2):
        if attempt == 0:
            values, ids, lse = kernels.topk_logits_lse(static, k, id_offset=3)
        else:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                g_out = kernels.topk_logits_lse(static, k, id_offset=3)
            static.copy_((torch.randn(rows, 151936, device="cuda", generator=gen) * 4).to(torch.bfloat16))
            graph.replay()
            torch.cuda.synchronize()
            values, ids, lse = g_out
        ref_values, ref_ids = exact_topk(static.float(), k, id_offset=3)
        assert torch.equal(ids, ref_ids) and torch.equal(values, ref_values)
        m, arg, lse_rows = kernels.row_max_lse(static)
        assert torch.equal(lse, lse_rows)
        ref_m, ref_arg = static.float().max(dim=-1)
        assert torch.equal(m, ref_m) and torch.equal(arg, ref_arg)
        assert torch.allclose(lse, torch.logsumexp(static.float(), -1), rtol=1e-6, atol=1e-5)


def test_path_kv_move_on_cuda_equals_in_order_copies():
    """kernels.move_path_kv on CUDA buffers laid out as SGLang's MHA pool (one per layer and K/V, [slots, heads,
    dim] bf16): equal to copying the accepted path's rows in order, for paths with branches and rows in place."""
    from sglang_ddtree import kernels
    from sglang_ddtree.sglang.ops import accepted_kv_moves

    gen = torch.Generator(device="cuda").manual_seed(0)
    bs, nodes, depth = 16, 33, 15
    # accepted paths: increasing node indices, some rows in place (node j at depth j), some far off
    path = torch.full((bs, depth + 1), -1, dtype=torch.int64, device="cuda")
    path[:, 0] = 0
    for b in range(bs):
        accepted = b % (depth + 1)
        picks = torch.randperm(nodes - 1, device="cuda", generator=gen)[:accepted].sort().values + 1
        if b % 3 == 0:
            picks = torch.arange(1, accepted + 1, device="cuda")  # a chain: nothing moves
        path[b, 1: accepted + 1] = picks
    slots = torch.randperm(4096, device="cuda", generator=gen)[: bs * nodes].view(bs, nodes) + 1
    tgt, src = accepted_kv_moves(path, slots)
    bufs = [torch.randn(4200, 8, 128, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(6)]
    ref = [b.clone() for b in bufs]
    for r in ref:
        for t, s in zip(tgt.tolist(), src.tolist()):
            r[t] = r[s].clone()
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64, device="cuda")
    strides = torch.tensor([b[0].numel() * b.element_size() for b in bufs], dtype=torch.int64, device="cuda")
    kernels.move_path_kv(ptrs, strides, int(strides.max()), tgt, src, depth)
    torch.cuda.synchronize()
    assert bool((tgt != src).any()) and all(torch.equal(a, b) for a, b in zip(bufs, ref))


@pytest.mark.parametrize("bs", [1, 4, 16, 17, 64, 200])
def test_chain_accept_on_cuda_equals_the_chain_trees_walk(bs):
    """`auto`'s lean chain round (ops.chain_accept, one launch) == the chain tree's walk, commit arithmetic and stats
    summary computed the tree way (ops.chain_accept_reference) on CUDA, at serving vocabulary sizes; no host sync."""
    from sglang_ddtree.sglang import ops

    gen = torch.Generator().manual_seed(bs)
    L, vocab = 15, 151936
    cand = torch.randint(0, vocab, (bs, L + 1), generator=gen)
    follow = torch.randint(0, L + 1, (bs,), generator=gen)
    follow[0] = L
    take = torch.arange(L + 1).unsqueeze(0) < follow.unsqueeze(1)
    choices = torch.where(take, torch.cat([cand[:, 1:], cand[:, :1]], dim=1),
                          torch.randint(0, vocab, (bs, L + 1), generator=gen))
    logprobs = -torch.rand(bs, L, generator=gen) * 3
    prefix = torch.randint(0, 4000, (bs,), generator=gen)
    cand, choices, logprobs, prefix = (t.cuda() for t in (cand, choices, logprobs, prefix))
    ref = ops.chain_accept_reference(cand, choices, logprobs, prefix)
    out = ops.chain_outputs(bs, L, prefix.dtype, "cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.Stream()):
        torch.cuda.set_sync_debug_mode("error")
        try:
            ops.chain_accept(True, cand, choices, logprobs, prefix, out)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for name, want in zip(ops.CHAIN_OUTPUTS, ref):
        got = out[name]
        if name == "summary":
            assert torch.equal(got[:L + 3], want[:L + 3]) and torch.equal(got[L + 4:], want[L + 4:]), (got, want)
            assert torch.allclose(got[L + 3], want[L + 3], rtol=1e-5), (got, want)
        else:
            assert torch.equal(got, want), (name, got, want)
    assert int(out["accept_len"][0]) == L
