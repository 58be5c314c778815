"""The tree verify's split-prefix attention (kernels/verify_attention.py) == exact attention (float32 torch), on
CPU through TRITON_INTERPRET=1; and which calls the worker's hook gives it (sglang/hooks.py). On the GPU,
tests/gpu/test_verify_attention_cuda.py compares it with SGLang's extend kernel compiled, in bf16, and times both."""

import textwrap

import pytest
import torch

from tests.test_kernels import run_in_interpreter

pytest.importorskip("triton")

CASES = textwrap.dedent(
    """
    import torch
    from sglang_ddtree.kernels.verify_attention import tree_verify_attention, tree_verify_attention_reference
    from tests.test_verify_attention import verify_inputs

    # (bs, width, heads, kv heads, head dim, splits, causal, heads a program): one query block and two (130 rows),
    # GQA groups 1-4, a non-power-of-two head dim, more splits than prefix blocks, empty prefixes, a one-token
    # verify; splits 1: the whole-prefix kernel (a tree, a chain, two query blocks); heads a program None: the
    # default (the whole kernel packs a group's heads, 2-4 of them here), 1 or 2 forced
    for case in [(1, 5, 4, 2, 16, 3, False, None), (2, 17, 4, 1, 32, 1, False, None),
                 (3, 65, 2, 2, 16, 4, False, None), (2, 130, 2, 1, 16, 2, False, None),
                 (2, 9, 4, 4, 24, 16, True, None), (1, 1, 2, 1, 16, 2, False, None),
                 (3, 16, 4, 2, 16, 1, True, None), (2, 40, 2, 1, 16, 1, False, None),
                 (2, 16, 8, 2, 16, 1, False, 1), (2, 16, 8, 2, 16, 1, False, 2), (2, 7, 4, 1, 16, 2, False, 2),
                 (2, 130, 4, 1, 16, 1, False, None),
                 # the tiny pair's heads (4 query, 2 KV, 64 wide) where its GPU suite's verifies take the split kernel
                 (8, 65, 4, 2, 64, 3, False, None), (1, 257, 4, 2, 64, 4, False, None)]:
        bs, width, heads, kv_heads, dim, splits, causal, hpb = case
        d = verify_inputs(bs, width, heads, kv_heads, dim, causal, seed=sum(case[:7]))
        out = torch.full_like(d["q"], float("nan"))
        tree_verify_attention(d["q"], d["k"], d["v"], out, d["k_pool"], d["v_pool"], d["kv_indptr"],
                              d["kv_indices"], d["mask"], d["mask_indptr"], width, 0.3, splits, heads_per_block=hpb)
        ref = tree_verify_attention_reference(d["q"], d["k"], d["v"], d["k_pool"], d["v_pool"], d["kv_indptr"],
                                              d["kv_indices"], d["mask"], d["mask_indptr"], width, 0.3)
        err = (out - ref).abs().max().item()
        assert err < 1e-5, (case, err)
    print("VERIFY-ATTENTION-OK")
    """
)


def tree_mask(width: int, gen: torch.Generator) -> torch.Tensor:
    """A random tree's ancestor mask [width, width] (node 0 the root; every node sees itself and its ancestors)."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, width)]
    mask = torch.zeros(width, width, dtype=torch.bool)
    for node in range(width):
        at = node
        while at >= 0:
            mask[node, at] = True
            at = parents[at]
    return mask


def verify_inputs(bs, width, heads, kv_heads, dim, causal, seed, dtype=torch.float32, device="cpu",
                  max_prefix=150):
    """A target verify in SGLang's layout: a shuffled KV pool, each request's prefix slots through kv_indptr /
    kv_indices (the first request's prefix empty when bs > 1), and the custom mask per request as width rows of
    (prefix + width) booleans whose prefix columns hold junk (they are all visible and must not be read)."""
    gen = torch.Generator().manual_seed(seed)
    prefixes = torch.randint(1, max_prefix, (bs,), generator=gen)
    if bs > 1:
        prefixes[0] = 0
    slots = int(prefixes.sum()) + 64
    kv_indptr = torch.zeros(bs + 1, dtype=torch.int32)
    kv_indptr[1:] = prefixes.cumsum(0)
    rows, mask_indptr = [], torch.zeros(bs + 1, dtype=torch.int64)
    for b in range(bs):
        prefix = int(prefixes[b])
        full = torch.zeros(width, prefix + width, dtype=torch.bool)
        full[:, :prefix] = torch.rand(width, prefix, generator=gen) < 0.5
        full[:, prefix:] = tree_mask(width, gen)
        rows.append(full.flatten())
        mask_indptr[b + 1] = mask_indptr[b] + full.numel()

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    return {"q": rand(bs * width, heads, dim), "k": rand(bs * width, kv_heads, dim),
            "v": rand(bs * width, kv_heads, dim), "k_pool": rand(slots, kv_heads, dim),
            "v_pool": rand(slots, kv_heads, dim), "kv_indptr": kv_indptr.to(device),
            "kv_indices": torch.randperm(slots, generator=gen)[: int(prefixes.sum())].to(device),
            "mask": None if causal else torch.cat(rows).to(device), "mask_indptr": mask_indptr.to(device)}


def test_split_prefix_attention_equals_exact_attention():
    run_in_interpreter(CASES, "VERIFY-ATTENTION-OK", timeout=900)


def test_plan_splits_small_batches_packs_narrow_verifies_and_leaves_wide_full_batches_to_sglang():
    """The plan the H200 and H100 measurements chose (plan_splits' docstring), at Qwen3-8B's 32 query heads."""
    from sglang_ddtree.kernels.verify_attention import MAX_SPLITS, _heads_per_block, plan_splits

    assert plan_splits(1, 32, 17, 132) == MAX_SPLITS == 4  # 32 programs of 32 rows in 528 slots
    assert plan_splits(4, 32, 17, 132) == 3
    assert plan_splits(4, 32, 33, 132) == 1  # 128 programs of 64 rows in 264 slots: two fits, the whole kernel
    assert plan_splits(1, 32, 65, 132) == 3  # 32 programs of 128 rows, one an SM
    assert plan_splits(2, 32, 65, 132) == 2
    assert plan_splits(4, 32, 65, 132) == 0  # 128 programs: SGLang's kernel keeps the call
    assert plan_splits(1, 32, 129, 132) == 2  # three 64-row blocks a head
    assert plan_splits(2, 32, 129, 132) == 0
    # below three fits: the whole-prefix kernel for verifies of at most 64 tokens, SGLang's kernel for wider ones
    # (split in two at exactly two fits)
    assert plan_splits(16, 32, 17, 132) == 1 and plan_splits(64, 32, 16, 132) == 1
    assert plan_splits(16, 32, 32, 132) == 1 and plan_splits(16, 32, 64, 132) == 1
    assert plan_splits(4, 32, 64, 132) == 1  # two fits of 64-row programs: the whole kernel beat the split one
    assert plan_splits(4, 32, 16, 132) == 3  # four fits: split
    assert plan_splits(16, 32, 65, 132) == 0 and plan_splits(64, 32, 65, 132) == 0
    # the whole-prefix kernel packs a KV group's heads into programs of up to 128 rows; the split kernel does not
    assert _heads_per_block(4, 1, 16) == 4 and _heads_per_block(4, 1, 32) == 4  # 16 / 17-32 tokens
    assert _heads_per_block(4, 1, 64) == 2 and _heads_per_block(4, 1, 128) == 1  # 33-64 / 65-128 tokens
    assert _heads_per_block(6, 1, 16) == 2 and _heads_per_block(4, 2, 16) == 1  # a group of 6; the split kernel


def test_hook_takes_only_plain_tree_verifies(monkeypatch):
    """SGLang's arguments decide: a verify mask, a causal layer, default options, unscaled KV of q's dtype and a
    uniform width; anything else (and the `sglang` switch) keeps SGLang's kernel."""
    from sglang_ddtree.sglang import hooks

    d = verify_inputs(1, 17, 32, 8, 16, causal=False, seed=1, dtype=torch.bfloat16)
    qo_indptr = torch.tensor([0, 17])

    def splits(mask=d["mask"], causal=True, width=17, k_scale=1.0, pool=d["k_pool"], **kwargs):
        return hooks._verify_splits(d["q"], pool, d["v_pool"], d["q"], qo_indptr, mask, causal, width, k_scale, 1.0,
                                    (), kwargs, sms=132)

    monkeypatch.setattr(hooks, "_VERIFY_ATTENTION", "ddtree")
    assert splits() == 4 and splits(sliding_window_size=None, page_size=1, logit_cap=0.0) == 4
    assert splits(mask=None) == 0  # the drafter's and the prefills' calls
    with hooks.causal_verify():  # the worker's causal verify (a chain, a round without a draft): ours, causal
        assert splits(mask=None) == 4 and splits(mask=None, causal=False) == 0
    assert splits(mask=None) == 0
    assert splits(causal=False) == 0
    assert splits(width=16) == 0  # not bs * width query rows
    assert splits(k_scale=0.5) == 0 and splits(pool=d["k_pool"].float()) == 0
    assert splits(sliding_window_size=128) == 0 and splits(sinks=torch.zeros(1)) == 0
    assert splits(logit_cap=30.0) == 0 and splits(page_size=16) == 0 and splits(future_option=1) == 0
    wide = verify_inputs(1, 17, 4, 1, 256, causal=False, seed=2, dtype=torch.bfloat16)  # heads past MAX_HEAD_DIM
    assert hooks._verify_splits(wide["q"], wide["k_pool"], wide["v_pool"], wide["q"], qo_indptr, wide["mask"], True,
                                17, 1.0, 1.0, (), {}, sms=132) == 0
    monkeypatch.setattr(hooks, "_VERIFY_ATTENTION", "sglang")
    assert splits() == 0


def test_the_hook_is_installed_only_when_asked_for(monkeypatch):
    """SGLANG_DDTREE_VERIFY_ATTENTION unset (ddtree, the default): the wrapper is registered on SGLang's kernel;
    sglang: the worker registers nothing, so SGLang's extend kernel runs with no wrapper around it."""
    import sys
    import types

    from sglang_ddtree.sglang import hooks

    registered = []
    registry = types.SimpleNamespace(register=lambda target, fn, kind: registered.append((target, fn, kind)),
                                     apply_hooks=lambda: None)
    fake = types.ModuleType("sglang.srt.plugins.hook_registry")
    fake.HookRegistry, fake.HookType = registry, types.SimpleNamespace(AROUND="around")
    for name in ("sglang", "sglang.srt", "sglang.srt.plugins"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.plugins.hook_registry", fake)
    monkeypatch.setattr(hooks, "_VERIFY_ATTENTION", hooks._VERIFY_ATTENTION)
    monkeypatch.setenv("SGLANG_DDTREE_VERIFY_ATTENTION", "sglang")
    assert hooks.install_verify_attention_hook() == "sglang" and registered == []
    monkeypatch.delenv("SGLANG_DDTREE_VERIFY_ATTENTION", raising=False)
    assert hooks.install_verify_attention_hook() == "ddtree"
    assert registered == [(hooks.VERIFY_ATTENTION_TARGET, hooks.around_extend_attention, "around")]
