"""Offline DDTree through a hybrid target (Qwen3-Next: 3 gated-delta-net layers + 1 full-attention layer), CPU,
float32: the depth-by-depth fast path ('tree') and the node-by-node oracle ('oracle') emit plain decoding's tokens,
agree node by node, and leave the committed state plain decoding would have; the attention-mask path refuses."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from fixtures.hybrid_models import (
    BRANCH, MISS, TOP, ScriptedBranchDraft, quiet_single_thread, random_hybrid_dflash, random_hybrid_target,
    seeded_script,
)
from fixtures.offline_models import OracleDraft, random_target
from sglang_ddtree.offline.decoders import _trim, plain_decode, speculative_decode
from sglang_ddtree.offline.drafts import DFlashDraftSource
from sglang_ddtree.offline.hybrid import HybridTargetState, cache_layer_kinds
from sglang_ddtree.offline.target import TargetState, is_hybrid
from sglang_ddtree.tree import build_tree
from sglang_ddtree.walk import greedy_walk

MAX_NEW = 32


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    with quiet_single_thread():
        yield


@pytest.fixture(scope="module")
def target():
    return random_hybrid_target(seed=0)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, 64, (int(torch.randint(3, 14, (1,), generator=g)),), generator=g).tolist()
            for _ in range(2)]


@pytest.fixture(scope="module")
def plain_outputs(target, prompts):
    return [plain_decode(target, p, max_new_tokens=MAX_NEW) for p in prompts]


def test_target_is_a_cpu_hybrid_far_from_ties(target, plain_outputs):
    """Guard on the fixture: a real hybrid cache layout, and greedy picks well above float32 noise."""
    assert is_hybrid(target)
    assert cache_layer_kinds(TargetState(target, want_hidden=False).cache) == ["recurrent"] * 3 + ["attention"]
    for plain in plain_outputs:
        assert len(plain.output_ids) == MAX_NEW
        assert min(plain.margins) > 0.02


def _scripted(target, budget):
    # budget 1 only ever uses depth 1: a short block keeps the scripted truth (one forward per depth) cheap
    return ScriptedBranchDraft(target, seeded_script(1), block_size=4 if budget == 1 else 16)


def _accepted_depths_and_branches(rec):
    depths = [a - 1 for a in rec.accept_lengths]
    branch_at = [d for ranks in rec.accepted_ranks for d, r in enumerate(ranks, start=1) if r != 0]
    return depths, branch_at


@pytest.mark.parametrize("budget", [1, 16, 64, 256])
def test_fast_and_oracle_paths_equal_plain_greedy(target, prompts, plain_outputs, budget):
    for i, (prompt, plain) in enumerate(zip(prompts, plain_outputs)):
        modes = ("tree", "oracle") if i == 0 else ("tree",)  # the oracle is O(B) forwards a round: one prompt
        recs = {}
        for mode in modes:
            rec = speculative_decode(target, _scripted(target, budget), prompt, method="ddtree", budget=budget,
                                     max_new_tokens=MAX_NEW, hybrid_verify=mode)
            rec.validate()
            assert rec.output_ids == plain.output_ids, (mode, budget)
            assert rec.finish_reason == "length"
            assert rec.margins == pytest.approx(plain.margins, abs=2e-3)
            assert rec.extra["hybrid_verify"] == mode
            recs[mode] = rec
        if "oracle" in recs:
            assert recs["tree"].accept_lengths == recs["oracle"].accept_lengths
            assert recs["tree"].accepted_ranks == recs["oracle"].accepted_ranks
        depths, branch_at = _accepted_depths_and_branches(recs["tree"])
        if budget == 1:
            assert max(depths) == 1 and min(depths) == 0 and not branch_at
        else:
            # the scripted drafter really makes the walk take deep paths through non-first siblings
            assert max(depths) >= 3 and branch_at and max(branch_at) >= 2, (depths, branch_at)
            if budget >= 64:
                assert max(depths) >= 7


def test_dflash_drafter_on_hybrid_target(target, prompts, plain_outputs):
    """The DFlash drafter (hidden-feature context from the hybrid target's per-node states) through both paths."""
    drafter = random_hybrid_dflash(target, seed=5)
    for mode, budget, n in (("tree", 16, MAX_NEW), ("tree", 64, MAX_NEW), ("oracle", 16, 16)):
        rec = speculative_decode(target, DFlashDraftSource(drafter, target), prompts[0], method="ddtree",
                                 budget=budget, max_new_tokens=n, hybrid_verify=mode)
        assert rec.output_ids == plain_outputs[0].output_ids[:n], (mode, budget)
    chain = speculative_decode(target, DFlashDraftSource(drafter, target), prompts[1], method="dflash",
                               max_new_tokens=MAX_NEW, hybrid_verify="tree")
    assert chain.output_ids == plain_outputs[1].output_ids


def _path_of(parents: list[int], i: int) -> list[int]:
    nodes = []
    while i >= 0:
        nodes.append(i)
        i = parents[i]
    return nodes[::-1]


def test_fast_path_node_logits_equal_oracle(target, prompts):
    """Every node's logits and hidden states: fast path == oracle (float32 allclose), and the oracle == an
    independent causal forward over prompt + the node's root-to-node path (no cache at all)."""
    prompt = prompts[0]
    lp = torch.log_softmax(torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(0)) * 3, dim=-1)
    tree = build_tree(lp, 64, torch.tensor([21]))
    tree = _trim(tree, int(tree.num_nodes[0]))
    out = {}
    for mode in ("oracle", "tree"):
        state = HybridTargetState(target, want_hidden=True, mode=mode)
        state.causal(torch.tensor(prompt), 0)
        before = [{k: v.clone() for k, v in layer.items()} for layer in state.layer_states()]
        out[mode] = state.verify(tree, len(prompt))
        after = state.layer_states()  # verify must leave the committed cache alone
        assert all(torch.equal(before[i][k], after[i][k]) for i in range(len(before)) for k in before[i])
    parents, depth = tree.parents[0].tolist(), tree.depth[0]
    assert int(depth.max()) == 6 and len(set(parents[1:])) > 10  # deep and bushy
    (lo, ho), (lt, ht) = out["oracle"], out["tree"]
    torch.testing.assert_close(lt, lo, atol=2e-3, rtol=1e-4)
    for a, b in zip(ht, ho):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-4)
    assert not torch.allclose(lo[1:], lo[:-1], atol=1e-1)  # nodes really differ
    tokens = tree.tokens[0].tolist()
    with torch.no_grad():
        for i in range(len(tokens)):
            seq = prompt + [tokens[j] for j in _path_of(parents, i)]
            ref = target(input_ids=torch.tensor([seq])).logits[0, -1]
            # chunked gated-delta kernel (full forward) vs the recurrent one (cached steps): float32 rounding only
            torch.testing.assert_close(lo[i], ref, atol=1e-2, rtol=1e-4)


@pytest.mark.parametrize("budget", [1, 16, 64, 256])
def test_retrieve_arrays_give_back_the_parents_in_one_pass(budget):
    """SGLang's tree conv kernel (causal_conv1d_triton.py:807-831) rebuilds parents in ONE pass over the nodes in
    slot order: node i's first child gets parent i, node i's next sibling gets i's parent. That only works if a
    node's parent is known before its first child / next sibling is visited; our retrieve arrays (what the worker
    would hand to the hybrid backend) must satisfy it for every tree."""
    from sglang_ddtree.layout import retrieve_arrays

    g = torch.Generator().manual_seed(budget)
    for trial in range(4):
        lp = torch.log_softmax(torch.randn(2, 15, 64, generator=g) * (1 + trial), dim=-1)
        tree = build_tree(lp, budget, torch.tensor([3, 4]))
        _, next_token, next_sibling = retrieve_arrays(tree)
        for b in range(2):
            n = int(tree.num_nodes[b])
            parent = [-1] * n
            for i in range(n):
                child, sibling = int(next_token[b, i]), int(next_sibling[b, i])
                if child != -1:
                    parent[child] = i
                if sibling != -1:
                    parent[sibling] = parent[i]
            assert parent == tree.parents[b, :n].tolist()


def _layer_tensors(cache) -> list[torch.Tensor]:
    """All committed state of a transformers hybrid cache, layer by layer."""
    out = []
    for layer, kind in zip(cache.layers, cache_layer_kinds(cache)):
        out += [layer.keys, layer.values] if kind == "attention" else [layer.conv_states, layer.recurrent_states]
    return out


def _fixed_script(round_index: int, depth: int) -> int:
    return {2: BRANCH, 4: BRANCH, 7: MISS}.get(depth, TOP)


@pytest.mark.parametrize("mode,rerun", [("tree", False), ("oracle", False), ("tree", True)])
def test_committed_state_after_a_round_equals_plain_decoding(target, prompts, mode, rerun):
    prompt = prompts[1]
    draft = ScriptedBranchDraft(target, _fixed_script)
    draft.start()
    state = HybridTargetState(target, want_hidden=False, mode=mode)
    logits, _ = state.causal(torch.tensor(prompt), 0)
    root = int(logits[-1].argmax())
    draft.append(torch.tensor([prompt]), torch.arange(len(prompt)).view(1, -1), None)
    tree = build_tree(draft.propose(root, len(prompt)), 64, torch.tensor([root]))
    tree = _trim(tree, int(tree.num_nodes[0]))
    node_logits, _ = state.verify(tree, len(prompt))
    walk = greedy_walk(tree, node_logits.unsqueeze(0))
    acc = int(walk.accept_len[0])
    path = walk.path[0, : acc + 1]
    assert acc == 6 and tree.ranks[0, path].tolist() == [0, 0, 1, 0, 1, 0, 0]  # branches at depths 2 and 4
    state.commit(len(prompt), path, rerun=rerun, path_tokens=tree.tokens[0, path])
    assert state.committed == len(prompt) + acc + 1

    plain = TargetState(target, want_hidden=False)  # plain decoding of the same tokens, one at a time
    plain.causal(torch.tensor(prompt), 0)
    for tok in tree.tokens[0, path].tolist():
        plain.causal(torch.tensor([tok]), plain.committed)
    got, want = _layer_tensors(state.cache), _layer_tensors(plain.cache)
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        if mode == "oracle":
            assert torch.equal(g, w)  # the oracle IS plain decoding, branch by branch on cache copies
        else:
            torch.testing.assert_close(g, w, atol=1e-4 if not rerun else 2e-3, rtol=1e-4)
    # and the next step from the committed state is plain's next step
    nxt = int(walk.bonus[0])
    a, _ = state.causal(torch.tensor([nxt]), state.committed)
    b, _ = plain.causal(torch.tensor([nxt]), plain.committed)
    torch.testing.assert_close(a, b, atol=2e-3, rtol=1e-4)


def test_commit_rerun_equals_gather(target, prompts, plain_outputs):
    for mode in ("tree", "oracle"):
        a = speculative_decode(target, _scripted(target, 16), prompts[1], method="ddtree", budget=16,
                               max_new_tokens=MAX_NEW, hybrid_verify=mode, commit="rerun")
        assert a.output_ids == plain_outputs[1].output_ids
        assert a.extra["variant"]["verify"] == f"hybrid_{mode}"


def test_sampled_fast_path_equals_oracle(target, prompts):
    """T > 0: same per-node logits up to float noise, same generator -> the same samples and walk."""
    recs = []
    for mode in ("tree", "oracle"):
        gen = torch.Generator().manual_seed(11)
        recs.append(speculative_decode(target, _scripted(target, 16), prompts[0], method="ddtree", budget=16,
                                       max_new_tokens=20, temperature=0.8, top_k=20, top_p=0.95, generator=gen,
                                       hybrid_verify=mode))
    assert recs[0].output_ids == recs[1].output_ids
    assert recs[0].accept_lengths == recs[1].accept_lengths


def test_hybrid_paths_on_an_attention_only_target():
    """The hybrid paths are generic: on a plain Qwen3 target they equal plain decoding too."""
    qwen3 = random_target(seed=0)
    prompt = [7, 3, 9, 12, 40]
    plain = plain_decode(qwen3, prompt, max_new_tokens=24)
    for mode in ("tree", "oracle"):
        rec = speculative_decode(qwen3, OracleDraft(qwen3, noise=0.3, seed=3), prompt, method="ddtree", budget=16,
                                 max_new_tokens=24, hybrid_verify=mode)
        assert rec.output_ids == plain.output_ids
        assert max(rec.accept_lengths) >= 4


def test_attention_mask_path_refuses_hybrid_targets(target, prompts):
    draft = ScriptedBranchDraft(target, seeded_script(1))
    with pytest.raises(ValueError, match="attention-mask tree verify only works for attention-only targets.*"
                                         "hybrid_verify='oracle' or 'tree'"):
        speculative_decode(target, draft, prompts[0], method="ddtree", budget=16, max_new_tokens=4)
    with pytest.raises(ValueError, match="causal chain verify"):
        speculative_decode(target, draft, prompts[0], method="dflash", max_new_tokens=4)
    with pytest.raises(ValueError, match="attention-mask tree verify"):
        speculative_decode(target, draft, prompts[0], method="dflash", verify="tree", max_new_tokens=4)
    with pytest.raises(ValueError, match="hybrid_verify must be one of oracle, tree"):
        speculative_decode(target, draft, prompts[0], method="ddtree", budget=4, max_new_tokens=4,
                           hybrid_verify="mask")
    with pytest.raises(ValueError, match="leave it unset"):
        speculative_decode(target, draft, prompts[0], method="ddtree", budget=4, max_new_tokens=4,
                           hybrid_verify="tree", verify="tree")
    # the low-level attention-only operations refuse too, before touching the cache
    state = TargetState(target, want_hidden=False)
    state.causal(torch.tensor(prompts[0]), 0)
    one = torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match="ancestor attention mask only works for attention-only targets"):
        state.tree(one, one, torch.ones(1, 1, dtype=torch.bool), len(prompts[0]))
    with pytest.raises(ValueError, match="cropping the cache"):
        state.crop(2)
    with pytest.raises(ValueError, match="gather-commit"):
        state.keep_nodes(len(prompts[0]), one)
    assert state.committed == len(prompts[0])
    with pytest.raises(ValueError, match="hybrid_verify must be one of"):
        HybridTargetState(target, want_hidden=False, mode="mask")
    hs = HybridTargetState(target, want_hidden=False, mode="tree")
    hs.causal(torch.tensor(prompts[0]), 0)
    with pytest.raises(ValueError, match="needs a verify"):
        hs.commit(len(prompts[0]), one)
    untrimmed = build_tree(torch.zeros(1, 3, 64), torch.tensor([4]), torch.tensor([5]), max_budget=16)
    with pytest.raises(ValueError, match="trimmed to its valid nodes"):
        hs.verify(untrimmed, len(prompts[0]))


def _word_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<mask>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


def _offline_cli_on_saved_pair(tmp_path, target):
    """The hybrid target (with a word tokenizer), a drafter for it and a one-prompt dataset written under tmp_path;
    returns the `offline` parser and the arguments that point at them."""
    from sglang_ddtree.offline.cli_commands import add_offline_parser

    target.save_pretrained(tmp_path / "target")
    _word_tokenizer(target.config.vocab_size).save_pretrained(tmp_path / "target")
    random_hybrid_dflash(target, seed=5, block_size=8).save_pretrained(tmp_path / "drafter")
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"id": "q0", "prompt": "w5 w9 w12"}) + "\n")
    parser = argparse.ArgumentParser()
    add_offline_parser(parser.add_subparsers())
    args = ["offline", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
            "--dataset", "jsonl", "--dataset-path", str(data), "--chat", "no", "--device", "cpu",
            "--methods", "plain,ddtree", "--budgets", "8", "--no-progress", "--out", str(tmp_path / "out.jsonl")]
    return parser, args


def test_cli_requires_hybrid_verify_for_a_hybrid_target(tmp_path, target, capsys):
    parser, common = _offline_cli_on_saved_pair(tmp_path, target)
    common += ["--max-new-tokens", "6"]
    args = parser.parse_args(common)
    assert args.hybrid_verify is None
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert "recurrent layers" in err and "--hybrid-verify tree" in err
    assert parser.parse_args(common + ["--hybrid-verify", "tree"]).hybrid_verify == "tree"
    with pytest.raises(SystemExit):
        parser.parse_args(common + ["--hybrid-verify", "mask"])


def test_cli_offline_run_on_a_hybrid_target(tmp_path, target):
    from sglang_ddtree.baseline import read_baseline

    parser, common = _offline_cli_on_saved_pair(tmp_path, target)
    args = parser.parse_args(common + ["--max-new-tokens", "12", "--ignore-eos", "--hybrid-verify", "tree"])
    assert args.func(args) == 0
    b = read_baseline(tmp_path / "out.jsonl")
    assert b.header.extra["hybrid_verify"] == "tree"
    assert b.get("q0", "ddtree_tb8").output_ids == b.get("q0", "plain").output_ids
    assert b.get("q0", "ddtree_tb8").extra["hybrid_verify"] == "tree"
