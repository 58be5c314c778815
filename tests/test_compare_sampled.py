"""compare on sampled (T > 0) runs: an honest run with another seed passes, a walk that shares one noise draw across
the tree's nodes (planted bug `shared_noise`) fails on acceptance per depth although every token-level difference
is 'sampled'; the permutation tests keep their false-alarm rate on synthetic runs drawn from one distribution;
different sampling settings and too few prompts are said, not judged silently."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from fixtures.offline_models import OracleDraft, one_thread, random_target
from sglang_ddtree.baseline import Baseline, BaselineHeader, MethodRecord, prompt_sha256
from sglang_ddtree.compare import Thresholds, compare
from sglang_ddtree.compare_report import format_report
from sglang_ddtree.compare_sampled import sampled_tests
from sglang_ddtree.offline.planted_bugs import planted
from sglang_ddtree.offline.runner import PromptInput, RunSettings, decode_one

VOCAB, BLOCK, MAX_NEW, TEMPERATURE = 8, 6, 24, 1.0
METHODS = ["plain", "ddtree_tb8"]
# 4 prompts sampled 15 times each (other prompt indices, so other seeds): per-prompt token counts for the token test
DISTINCT, REPEATS = 4, 15


@pytest.fixture(scope="module")
def target():
    return random_target(seed=3, vocab=VOCAB, layers=2, init_range=0.3)


def _run(target, seed: int, bug: str | None = None, temperature: float = TEMPERATURE) -> Baseline:
    g = torch.Generator().manual_seed(5)
    texts = [torch.randint(2, VOCAB, (6,), generator=g).tolist() for _ in range(DISTINCT)]
    prompts = [PromptInput(f"p{i % DISTINCT}/{i // DISTINCT}", i, texts[i % DISTINCT])
               for i in range(DISTINCT * REPEATS)]
    s = RunSettings(methods=METHODS, max_new_tokens=MAX_NEW, temperature=temperature, seed=seed)
    with one_thread(), (planted(bug) if bug else contextlib.nullcontext()):
        records = [decode_one(target, OracleDraft(target, block_size=BLOCK, noise=0.3, seed=1), p, m, s)
                   for p in prompts for m in METHODS]
    header = BaselineHeader(source="offline", target={"path": None, "fingerprint": "t"}, dtype="float32",
                            device="cpu", temperature=temperature, top_k=0, top_p=1.0, seed=seed,
                            max_new_tokens=MAX_NEW, block_size=BLOCK, dataset="synthetic")
    return Baseline(header, records)


@pytest.fixture(scope="module")
def baseline(target):
    return _run(target, seed=0)


def test_an_honest_sampled_run_passes(target, baseline):
    report = compare(baseline, _run(target, seed=1), n_boot=200)
    assert report["passed"], report["failures"]
    assert report["sampled_judgement"]["tests"] == 3  # plain: tokens; ddtree_tb8: acceptance and tokens
    m = report["methods"]["ddtree_tb8"]
    assert m["match_rate"] < 0.5 and set(m["divergence_counts"]) <= {"sampled", "truncation"}  # outputs differ
    s = m["sampled"]
    assert s["not_judged"] is None and set(s["tests"]) == {"acceptance_by_depth", "token_frequencies"}
    assert s["tests"]["acceptance_by_depth"]["tau"]["baseline"] > 2  # the tree is used: several tokens a round
    assert all(t["p"] >= s["alpha"] for t in s["tests"].values())
    assert "sampled acceptance by depth: p =" in format_report(report)


def test_a_shared_noise_draw_across_tree_nodes_fails(target, baseline):
    candidate = _run(target, seed=1, bug="shared_noise")
    report = compare(baseline, candidate, n_boot=200)
    assert not report["passed"]
    m = report["methods"]["ddtree_tb8"]
    # token by token nothing is wrong that a sampled run could not do: only the distribution test sees the bug
    assert set(m["divergence_counts"]) <= {"sampled", "truncation"} and m["first_bug"] is None
    assert any(f.startswith("sampled acceptance by depth differs") for f in m["failures"]), m["failures"]
    acc = m["sampled"]["tests"]["acceptance_by_depth"]
    assert acc["p"] < m["sampled"]["alpha"]
    assert acc["tau"]["candidate"] > acc["tau"]["baseline"]  # coupled draws along a path agree with the chain more
    assert report["methods"]["plain"]["passed"]  # plain decoding draws no tree noise
    # without the distribution tests the comparison passes: what the comparator did before it judged T > 0
    assert compare(baseline, candidate, thresholds=Thresholds(sampled_alpha=0), n_boot=200)["passed"]


def _synthetic_pair(rng, i: int, quality: float, vocab: int, length: int) -> tuple[MethodRecord, MethodRecord]:
    """Two independent draws of prompt i from one distribution: accept lengths of a per-prompt quality, tokens from
    a per-prompt, per-position distribution."""
    prompt_rng = np.random.default_rng(1000 + i)
    probs = prompt_rng.dirichlet(np.full(vocab, 0.5), size=length)
    sha = prompt_sha256([i, 7, 7])

    def draw():
        out = [int(rng.choice(vocab, p=probs[k])) for k in range(length)]
        accepts, n = [], 1
        while n < length:
            a = min(1 + int(rng.geometric(1 - quality)) - 1, 6, length - n)
            accepts.append(max(1, a))
            n += accepts[-1]
        return MethodRecord(prompt_id=f"s{i}", method="ddtree_tb8", output_ids=out, accept_lengths=accepts,
                            num_input_tokens=3, prompt_sha256=sha)

    return draw(), draw()


def test_sampled_tests_keep_their_false_alarm_rate():
    """200 comparisons of two files drawn from one distribution (30 prompts of different quality, a few repeated):
    each test rejects at level 0.05 in about 5% of them, and its p-values spread over [0, 1]."""
    rng = np.random.default_rng(0)
    ps: dict[str, list[float]] = {"acceptance_by_depth": [], "token_frequencies": []}
    for rep in range(200):
        pairs = [_synthetic_pair(rng, i % 24, quality=0.3 + 0.02 * (i % 24), vocab=5, length=12) for i in range(30)]
        out = sampled_tests(pairs, speculative=True, alpha=0.05, seed=rep)
        for name in ps:
            ps[name].append(out["tests"][name]["p"])
    for name, p in ps.items():
        p = np.array(p)
        # Binomial(200, 0.05): mean 10; P(>= 21) < 0.001
        assert np.count_nonzero(p < 0.05) <= 20, (name, np.count_nonzero(p < 0.05))
        assert 0.4 < p.mean() < 0.6 and np.count_nonzero(p < 0.5) > 70, (name, p.mean())


def test_different_sampling_settings_and_too_few_prompts_are_said():
    def rec(pid, out):
        return MethodRecord(prompt_id=pid, method="ddtree_tb8", output_ids=out, accept_lengths=[2, 2],
                            num_input_tokens=4)

    def file(temperature, records):
        return Baseline(BaselineHeader(source="test", target={"path": None}, temperature=temperature, top_p=1.0),
                        records)

    a = file(1.0, [rec("p0", [1, 2, 3, 4, 5])])
    report = compare(a, file(0.7, [rec("p0", [1, 2, 9, 4, 5])]))
    assert not report["passed"] and "sample with different settings (temperature 1.0 vs 0.7)" in report["failures"][0]
    assert "FAIL: the files sample with different settings" in format_report(report)
    report = compare(a, file(1.0, [rec("p0", [1, 2, 9, 4, 5])]))
    s = report["methods"]["ddtree_tb8"]["sampled"]
    assert report["passed"] and "cannot show a difference" in s["not_judged"]
    assert "sampled distributions not judged" in format_report(report)
