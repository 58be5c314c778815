"""Sampled (T > 0) offline decoding: seeded reproducibility, and a chi-square check that DDTree's first sampled
tokens follow the target's own sampling distribution (computed exactly from the tiny target)."""

from __future__ import annotations

import pytest
import torch

from fixtures.offline_models import OracleDraft, one_thread, random_target
from sglang_ddtree.offline.decoders import plain_decode, speculative_decode
from sglang_ddtree.offline.runner import prompt_generator

VOCAB = 8
PROMPT = [3, 1, 4, 1, 5]
RUNS = 600


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def target():
    return random_target(seed=11, vocab=VOCAB, layers=2, init_range=0.15)


def _gen(seed):
    return prompt_generator(torch.device("cpu"), seed, 0)


def test_seeded_runs_are_reproducible(target):
    prompt = [5, 2, 7, 1, 3, 3]
    kw = dict(max_new_tokens=20, temperature=1.0, top_k=0, top_p=0.95)
    a = speculative_decode(target, OracleDraft(target, noise=0.5), prompt, method="ddtree", budget=16,
                           generator=_gen(1), **kw)
    b = speculative_decode(target, OracleDraft(target, noise=0.5), prompt, method="ddtree", budget=16,
                           generator=_gen(1), **kw)
    assert a.output_ids == b.output_ids and a.accept_lengths == b.accept_lengths
    outs = {tuple(speculative_decode(target, OracleDraft(target, noise=0.5), prompt, method="ddtree", budget=16,
                                     generator=_gen(s), **kw).output_ids) for s in range(2, 8)}
    assert len(outs) > 1  # different seeds sample different texts
    # plain and DDTree draw the prefill token from the same generator state: same first token per seed
    for s in range(4):
        p = plain_decode(target, prompt, generator=_gen(s), **kw)
        d = speculative_decode(target, OracleDraft(target, noise=0.5), prompt, method="dflash", generator=_gen(s), **kw)
        assert p.output_ids[0] == d.output_ids[0]


def _exact_marginals(target, prompt, temperature):
    """P(t0), P(t1), P(t2) of the target's own sampler, by enumerating all prefixes (V^2 forwards in a batch)."""
    with torch.no_grad():
        def probs(seqs):
            logits = target(input_ids=torch.tensor(seqs)).logits[:, -1].double()
            return torch.softmax(logits / temperature, dim=-1)

        p0 = probs([prompt])[0]
        p1_given = probs([prompt + [i] for i in range(VOCAB)])  # [i, j]
        p2_given = probs([prompt + [i, j] for i in range(VOCAB) for j in range(VOCAB)]).view(VOCAB, VOCAB, VOCAB)
    p1 = (p0[:, None] * p1_given).sum(0)
    p2 = (p0[:, None, None] * p1_given[:, :, None] * p2_given).sum((0, 1))
    return p0, p1, p2


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells with expected count < 5 are pooled into one."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().view(1)]) if small.any() else counts
    exp = torch.cat([expected[~small], expected[small].sum().view(1)]) if small.any() else expected
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat.double() / 2))


def _sample_counts(target, runs, temperature):
    counts = torch.zeros(3, VOCAB, dtype=torch.float64)
    accepted_rounds = branch_rounds = 0
    for seed in range(runs):
        rec = speculative_decode(target, OracleDraft(target, block_size=4, noise=1.0, seed=seed), PROMPT,
                                 method="ddtree", budget=6, max_new_tokens=3, temperature=temperature,
                                 generator=_gen(seed))
        for pos in range(3):
            counts[pos, rec.output_ids[pos]] += 1
        accepted_rounds += rec.accept_lengths[0] > 1
        branch_rounds += any(r != 0 for r in rec.accepted_ranks[0])
    return counts, accepted_rounds, branch_rounds


def test_ddtree_sampled_tokens_follow_the_target_distribution(target):
    temperature = 1.0
    exact = _exact_marginals(target, PROMPT, temperature)
    counts, accepted_rounds, branch_rounds = _sample_counts(target, RUNS, temperature)
    # the tree is actually used: first rounds accept drafts, sometimes off the drafter's top-1
    assert accepted_rounds > RUNS // 4 and branch_rounds > RUNS // 20
    for pos in range(3):
        assert _chi2_pvalue(counts[pos], exact[pos]) > 1e-3, (pos, counts[pos].tolist(), (exact[pos] * RUNS).tolist())


def test_chi_square_catches_a_planted_sampling_bug(target, monkeypatch):
    """Power check of the test above: a walk that takes the target's argmax at the root instead of a sample."""
    import sglang_ddtree.offline.decoders as decoders
    from sglang_ddtree.walk import sample_choices, walk_choices

    def root_greedy_walk(tree, logits, temperature, top_k, top_p, generator=None):
        choice = sample_choices(logits, temperature, top_k, top_p, generator)
        choice[:, 0] = logits[:, 0].argmax(dim=-1)
        return walk_choices(tree, choice)

    monkeypatch.setattr(decoders, "sampled_walk", root_greedy_walk)
    exact = _exact_marginals(target, PROMPT, 1.0)
    counts, _, _ = _sample_counts(target, 150, 1.0)
    assert _chi2_pvalue(counts[0], exact[0]) > 1e-3  # the prefill token is untouched by the bug
    assert _chi2_pvalue(counts[1], exact[1]) < 1e-6
