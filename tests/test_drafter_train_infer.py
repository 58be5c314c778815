"""The drafter sees the same inputs at training time (scripts/train_tiny_pair.py) as in the offline decoder.

Training runs many anchors per sequence in one call (full-sequence target features, block-sparse mask); the
offline DFLASH decoder builds the drafter context incrementally from prefill and verify forwards
(`DFlashDraftSource` + `DrafterCache` + `draft_block_logits`). For every anchor p (block [x_p, mask...] at
positions p.., context = positions < p) both must give the same draft, and the training-time acceptance
estimate must equal what the decoder accepts. A random small target/drafter pair, float32 CPU.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from fixtures.offline_models import one_thread, random_dflash, random_target
from sglang_ddtree.drafter import DrafterCache, draft_block_logits
from sglang_ddtree.offline.decoders import plain_decode, speculative_decode
from sglang_ddtree.offline.drafts import DFlashDraftSource
from sglang_ddtree.offline.target import TargetState

REPO = Path(__file__).resolve().parent.parent
VOCAB = 12  # small: a random drafter then guesses right often enough for multi-token commits


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def trainer():
    spec = importlib.util.spec_from_file_location("train_tiny_pair_under_test", REPO / "scripts" / "train_tiny_pair.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def pair():
    target = random_target(seed=11, vocab=VOCAB, layers=4)
    drafter = random_dflash(target, seed=12, block_size=8, mask_token_id=1)
    return target, drafter


def greedy_sequence(target, prompt, n_new):
    return prompt + plain_decode(target, prompt, max_new_tokens=n_new).output_ids


def train_path_drafts(trainer, target, drafter, seq, anchors):
    """Drafter argmax [A, block-1] and labels through the training script's own functions."""
    cfg = drafter.config
    seqs = torch.tensor([seq])
    feats = trainer.target_features(target, seqs, cfg.target_layer_ids)
    logits, labels = trainer.drafter_block_logits_train(drafter, target, feats, seqs, torch.tensor([anchors]),
                                                        cfg.block_size, cfg.mask_token_id)
    return logits[0], labels[0]


@pytest.mark.parametrize("seed", [0, 1])
def test_training_path_equals_cache_path(trainer, pair, seed):
    target, drafter = pair
    B = drafter.config.block_size
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(2, VOCAB, (7,), generator=g).tolist()
    seq = greedy_sequence(target, prompt, 30)
    anchors = list(range(len(prompt) - 1, len(seq) - B + 1))
    logits, labels = train_path_drafts(trainer, target, drafter, seq, anchors)
    # Labels are the tokens after the anchor: x_{p+1} .. x_{p+B-1}.
    for a, p in enumerate(anchors):
        assert labels[a].tolist() == seq[p + 1:p + B]

    # Inference path: context features from ONE prefill of the prefix, cache holds exactly positions < p.
    with torch.no_grad():
        hs = target(input_ids=torch.tensor([seq]), output_hidden_states=True, use_cache=False).hidden_states
    source = DFlashDraftSource(drafter, target)
    feats = source.features(hs)
    for a, p in enumerate(anchors):
        cache = DrafterCache(drafter, 1, "cpu", torch.float32)
        cache.append(drafter.project_context(feats[:, :p]), torch.arange(p)[None])
        got = draft_block_logits(drafter, cache, torch.tensor([seq[p]]), torch.tensor([p]),
                                 target.get_input_embeddings(), target.get_output_embeddings())
        torch.testing.assert_close(got[0], logits[a].float(), rtol=1e-4, atol=1e-4)


def test_training_path_matches_incremental_decoder_context(trainer, pair):
    """Context built as the decoder builds it: prefill, then verify forwards of a whole block committing a few
    tokens at a time (features of the committed tokens only, taken from the verify forward)."""
    target, drafter = pair
    B = drafter.config.block_size
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(2, VOCAB, (5,), generator=g).tolist()
    seq = greedy_sequence(target, prompt, 40)
    anchors = list(range(len(prompt), len(seq) - B + 1))
    logits, _ = train_path_drafts(trainer, target, drafter, seq, anchors)
    want = {p: logits[a].argmax(-1) for a, p in enumerate(anchors)}

    source = DFlashDraftSource(drafter, target)
    source.start()
    state = TargetState(target, want_hidden=True)
    _, hidden = state.causal(torch.tensor(prompt), 0)
    source.append(torch.tensor([prompt]), torch.arange(len(prompt))[None], source.features(hidden))
    pos, checked = len(prompt), 0
    while pos + B <= len(seq):
        proposal = source.propose(seq[pos], pos)[0].argmax(-1)
        assert torch.equal(proposal, want[pos]), pos
        checked += 1
        k = int(torch.randint(1, 4, (1,), generator=g))  # accepted drafts + 1
        _, hidden = state.causal(torch.tensor(seq[pos:pos + B]), pos)
        state.crop(pos + k)
        source.append(torch.tensor([seq[pos:pos + k]]), torch.arange(pos, pos + k)[None],
                      source.features(hidden)[:, :k])
        pos += k
    assert checked >= 8


def test_training_acceptance_equals_decoder_acceptance(trainer, pair):
    """The trainer's chain acceptance at anchor p is exactly what DFLASH accepts in a round rooted at p."""
    target, drafter = pair
    B = drafter.config.block_size
    n_new = 40
    seen_multi = False
    for seed in range(3):
        g = torch.Generator().manual_seed(100 + seed)
        prompt = torch.randint(2, VOCAB, (6,), generator=g).tolist()
        seq = greedy_sequence(target, prompt, n_new + B)  # long enough to label every round's block
        rec = speculative_decode(target, DFlashDraftSource(drafter, target), prompt, method="dflash",
                                 max_new_tokens=n_new, record_trees=True)
        assert rec.output_ids == seq[len(prompt):len(prompt) + n_new]
        roots = [len(prompt) + sum(rec.accept_lengths[:i]) for i in range(len(rec.accept_lengths))]
        logits, labels = train_path_drafts(trainer, target, drafter, seq, roots)
        drafts = logits.argmax(-1)
        accepted = (drafts == labels).int().cumprod(-1).sum(-1)
        for i, p in enumerate(roots):
            assert rec.trees[i]["tokens"][0] == seq[p]
            assert rec.trees[i]["tokens"][1:] == drafts[i].tolist(), (seed, i, p)
            if i < len(roots) - 1:  # the last round may be cut by max_new_tokens
                assert rec.accept_lengths[i] == int(accepted[i]) + 1, (seed, i, p)
        seen_multi |= max(rec.accept_lengths[:-1]) > 1
    assert seen_multi, "no round accepted a draft: the multi-token commit path was not exercised"


def test_training_drafts_do_not_see_the_future(trainer, pair):
    """Changing every token after x_p leaves the training-time draft at anchor p unchanged."""
    target, drafter = pair
    B = drafter.config.block_size
    g = torch.Generator().manual_seed(7)
    seq = torch.randint(2, VOCAB, (40,), generator=g).tolist()
    p = 20
    other = seq[:p + 1] + torch.randint(2, VOCAB, (len(seq) - p - 1,), generator=g).tolist()
    a, _ = train_path_drafts(trainer, target, drafter, seq, [p, p + 5])
    b, _ = train_path_drafts(trainer, target, drafter, other, [p, p + 5])
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(a[1], b[1])  # ... while an anchor after the change does see it
    assert B <= len(seq) - p - 5


def test_chain_metrics_walk(trainer, pair):
    """chain_metrics reports the per-anchor mean and the walk p -> p + accepted + 1 of the same acceptance."""
    target, drafter = pair
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(2, VOCAB, (6,), generator=g).tolist()
    seq = torch.tensor([greedy_sequence(target, prompt, 30)])
    feats = trainer.target_features(target, seq, drafter.config.target_layer_ids)
    res = trainer.chain_metrics(drafter, target, feats, seq, len(prompt), torch.device("cpu"), chunk=5)
    logits, labels = train_path_drafts(trainer, target, drafter, seq[0].tolist(),
                                       list(range(len(prompt), seq.shape[1] - drafter.config.block_size + 1)))
    acc = (logits.argmax(-1) == labels).int().cumprod(-1).sum(-1)
    assert res["anchors"] == acc.numel()
    assert res["mean_accept_len_per_anchor"] == pytest.approx(acc.float().mean().item() + 1, abs=1e-4)
    walk, p = [], 0
    while p < acc.numel():
        walk.append(int(acc[p]) + 1)
        p += walk[-1]
    assert res["chain_walk_rounds"] == len(walk)
    assert res["mean_accept_len_chain_walk"] == pytest.approx(sum(walk) / len(walk), abs=1e-4)
