"""Lossless contract of the offline decoders at T=0 (float32, CPU): DFLASH chain and DDTree at every budget emit
exactly the plain-decoding tokens, plus cross-checks between independent code paths."""

from __future__ import annotations

import pytest
import torch

from fixtures.offline_models import OracleDraft, one_thread, random_dflash, random_target
from sglang_ddtree.offline.decoders import plain_decode, speculative_decode
from sglang_ddtree.offline.drafts import DFlashDraftSource
from sglang_ddtree.tree import chain_tree

MAX_NEW = 40


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    with one_thread():
        yield


def _prompts(n=3, vocab=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (int(torch.randint(3, 14, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module")
def target():
    return random_target(seed=0)


@pytest.fixture(scope="module")
def prompts():
    return _prompts()


@pytest.fixture(scope="module")
def plain_outputs(target, prompts):
    return [plain_decode(target, p, max_new_tokens=MAX_NEW) for p in prompts]


def _drafts(target):
    return {
        "oracle": OracleDraft(target, noise=0.3, seed=3),  # deep acceptance, branches used
        "dflash-random": DFlashDraftSource(random_dflash(target, seed=5), target),  # feature path
    }


@pytest.mark.parametrize("draft_name", ["oracle", "dflash-random"])
@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", 1), ("ddtree", 16), ("ddtree", 64)])
def test_greedy_speculative_equals_plain(target, prompts, plain_outputs, draft_name, method, budget):
    draft = _drafts(target)[draft_name]
    for prompt, plain in zip(prompts, plain_outputs):
        rec = speculative_decode(target, draft, prompt, method=method, budget=budget, max_new_tokens=MAX_NEW)
        rec.validate()
        assert rec.output_ids == plain.output_ids
        assert rec.finish_reason == plain.finish_reason == "length"
        assert sum(rec.accept_lengths) + 1 >= MAX_NEW
        # margins are taken where each token was chosen: same context, so they match plain's up to float noise
        assert rec.margins == pytest.approx(plain.margins, abs=1e-4)


def test_oracle_exercises_deep_and_branch_acceptance(target, prompts):
    """Guard on the tests above: the oracle makes DDTree accept deep paths and non-top-1 branches."""
    rec = speculative_decode(target, OracleDraft(target, noise=0.3, seed=3), prompts[0], method="ddtree", budget=64,
                             max_new_tokens=MAX_NEW)
    assert max(rec.accept_lengths) >= 4
    assert any(r != 0 for ranks in rec.accepted_ranks for r in ranks)
    chain = speculative_decode(target, OracleDraft(target, noise=0.3, seed=3), prompts[0], method="dflash",
                               max_new_tokens=MAX_NEW)
    assert max(chain.accept_lengths) >= 6


def test_commit_rerun_equals_gather(target, prompts, plain_outputs):
    for prompt, plain in zip(prompts[:2], plain_outputs):
        for draft in _drafts(target).values():
            a = speculative_decode(target, draft, prompt, method="ddtree", budget=16, max_new_tokens=MAX_NEW)
            b = speculative_decode(target, draft, prompt, method="ddtree", budget=16, max_new_tokens=MAX_NEW,
                                   commit="rerun")
            assert a.output_ids == b.output_ids == plain.output_ids
            assert a.accept_lengths == b.accept_lengths


def test_chain_cross_checks(target, prompts):
    """DDTree machinery over chain trees (tree mask verify, gather commit) == DFLASH chain (causal verify, crop)."""
    for prompt in prompts[:2]:
        draft = OracleDraft(target, noise=0.5, seed=7)
        chain = speculative_decode(target, draft, prompt, method="dflash", max_new_tokens=MAX_NEW, record_trees=True)
        as_tree = speculative_decode(target, draft, prompt, method="ddtree", budget=15, max_new_tokens=MAX_NEW,
                                     tree_builder=chain_tree, record_trees=True)
        tree_verify = speculative_decode(target, draft, prompt, method="dflash", max_new_tokens=MAX_NEW,
                                         verify="tree")
        assert chain.output_ids == as_tree.output_ids == tree_verify.output_ids
        assert chain.accept_lengths == as_tree.accept_lengths == tree_verify.accept_lengths
        assert chain.trees == as_tree.trees
        assert all(len(t["tokens"]) == 16 for t in chain.trees)


def test_budget_one_tree_is_a_block_two_chain(target, prompts):
    """DDTree at budget 1 is the drafter's top-1 at depth 1: the DFLASH chain with block size 2, round by round."""
    for prompt in prompts:
        tree = speculative_decode(target, OracleDraft(target, block_size=16, noise=0.5, seed=9), prompt,
                                  method="ddtree", budget=1, max_new_tokens=MAX_NEW, record_trees=True)
        chain = speculative_decode(target, OracleDraft(target, block_size=2, noise=0.5, seed=9), prompt,
                                   method="dflash", max_new_tokens=MAX_NEW, record_trees=True)
        assert tree.output_ids == chain.output_ids
        assert tree.accept_lengths == chain.accept_lengths
        assert [t["tokens"] for t in tree.trees] == [t["tokens"] for t in chain.trees]


def test_eager_attention_matches_sdpa(prompts, plain_outputs):
    eager = random_target(seed=0, attn="eager")
    for prompt, plain in zip(prompts[:2], plain_outputs):
        assert plain_decode(eager, prompt, max_new_tokens=MAX_NEW).output_ids == plain.output_ids
        rec = speculative_decode(eager, OracleDraft(eager, noise=0.3, seed=3), prompt, method="ddtree", budget=32,
                                 max_new_tokens=MAX_NEW)
        assert rec.output_ids == plain.output_ids


def test_stops_at_eos_and_max_new_tokens_like_plain(target, prompts, plain_outputs):
    prompt, plain = prompts[0], plain_outputs[0]
    eos = plain.output_ids[17]  # a token plain emits mid-output: its first occurrence ends the output
    first = plain.output_ids.index(eos)
    p = plain_decode(target, prompt, max_new_tokens=MAX_NEW, eos_token_ids=[eos])
    assert p.output_ids == plain.output_ids[: first + 1] and p.finish_reason == "eos"
    for method, budget in [("dflash", None), ("ddtree", 64)]:
        rec = speculative_decode(target, OracleDraft(target, noise=0.3, seed=3), prompt, method=method, budget=budget,
                                 max_new_tokens=MAX_NEW, eos_token_ids=[eos])
        assert rec.output_ids == p.output_ids and rec.finish_reason == "eos"
        assert len(rec.margins) == len(rec.output_ids)
    for n in (1, 2, 7):
        rec = speculative_decode(target, OracleDraft(target, noise=0.3, seed=3), prompt, method="ddtree", budget=16,
                                 max_new_tokens=n)
        assert rec.output_ids == plain.output_ids[:n] and rec.finish_reason == "length"


def test_bad_arguments_raise_value_errors(target, prompts):
    draft = OracleDraft(target)
    with pytest.raises(ValueError, match="budget"):
        speculative_decode(target, draft, prompts[0], method="ddtree", budget=0, max_new_tokens=4)
    with pytest.raises(ValueError, match="dflash takes no budget"):
        speculative_decode(target, draft, prompts[0], method="dflash", budget=4, max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        plain_decode(target, prompts[0], max_new_tokens=0)
    with pytest.raises(ValueError, match="empty"):
        plain_decode(target, [], max_new_tokens=3)
    with pytest.raises(ValueError, match="causal verification needs a chain"):
        speculative_decode(target, OracleDraft(target, noise=2.0), prompts[0], method="ddtree", budget=8,
                           max_new_tokens=4, verify="causal")
    flash = random_target(seed=0)
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="custom 4D attention mask"):
        speculative_decode(flash, draft, prompts[0], method="ddtree", budget=4, max_new_tokens=4)


def test_tree_verify_logits_and_gathered_kv_match_causal_forwards(target):
    """Each node's logits from the one masked forward equal a causal forward over prompt + its path, and the
    gathered KV of a path equals the KV a causal forward over that path writes."""
    from sglang_ddtree.layout import ancestor_mask
    from sglang_ddtree.offline.target import TargetState
    from sglang_ddtree.tree import build_tree

    prompt = [7, 3, 9, 12, 40]
    lp = torch.log_softmax(torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(0)) * 3, dim=-1)
    tree = build_tree(lp, 24, torch.tensor([21]))
    state = TargetState(target, want_hidden=False)
    state.causal(torch.tensor(prompt), 0)
    logits, _ = state.tree(tree.tokens[0], tree.depth[0], ancestor_mask(tree)[0], len(prompt))
    tokens, parents = tree.tokens[0].tolist(), tree.parents[0].tolist()

    def path_of(i):
        nodes = []
        while i >= 0:
            nodes.append(i)
            i = parents[i]
        return nodes[::-1]

    with torch.no_grad():
        for i in range(len(tokens)):
            seq = prompt + [tokens[j] for j in path_of(i)]
            ref = target(input_ids=torch.tensor([seq])).logits[0, -1]
            assert torch.allclose(logits[i], ref, atol=1e-4), i
        deepest = max(range(len(tokens)), key=lambda i: len(path_of(i)))
        path = torch.tensor(path_of(deepest))
        state.keep_nodes(len(prompt), path)
        fresh = TargetState(target, want_hidden=False)
        fresh.causal(torch.tensor(prompt + [tokens[j] for j in path.tolist()]), 0)
        assert state.committed == fresh.committed == len(prompt) + len(path)
        for a, b in zip(state.cache.layers, fresh.cache.layers):
            assert torch.allclose(a.keys, b.keys, atol=1e-5) and torch.allclose(a.values, b.values, atol=1e-5)
