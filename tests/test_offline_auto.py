"""Offline ddtree_auto (sglang_ddtree/offline/auto.py): lossless at T=0 whatever the choice, equal to the fixed
decoders when there is one candidate, the chooser's extremes, calibration bookkeeping and the runner / CLI path."""

from __future__ import annotations

import pytest
import torch

from fixtures.offline_models import OracleDraft, one_thread, random_dflash, random_target
from sglang_ddtree.adaptive import CHAIN, ScoreCalibrator
from sglang_ddtree.baseline import BaselineHeader, BaselineWriter, read_baseline
from sglang_ddtree.offline.auto import AutoPolicy, auto_decode, build_policy
from sglang_ddtree.offline.decoders import plain_decode, speculative_decode
from sglang_ddtree.offline.drafts import DFlashDraftSource
from sglang_ddtree.offline.runner import AutoSettings, PromptInput, RunSettings, decode_one, run_offline

MAX_NEW = 40
CANDS = [CHAIN, 4, 16, 64]


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def target():
    return random_target(seed=0)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, 64, (int(torch.randint(3, 14, (1,), generator=g)),), generator=g).tolist()
            for _ in range(3)]


@pytest.fixture(scope="module")
def plain_outputs(target, prompts):
    return [plain_decode(target, p, max_new_tokens=MAX_NEW).output_ids for p in prompts]


def _drafts(kind, target, n):
    if kind == "oracle":
        return [OracleDraft(target, noise=0.3, seed=3) for _ in range(n)]
    drafter = random_dflash(target, seed=5)
    return [DFlashDraftSource(drafter, target) for _ in range(n)]


# Round times under which the choice moves between candidates from round to round (checked below).
MIXED_MS = [1.0, 1.25, 1.45, 2.2]


@pytest.mark.parametrize("draft_kind", ["oracle", "dflash-random"])
@pytest.mark.parametrize("select", ["raw", "calibrated"])
def test_auto_is_lossless_in_lockstep_groups(target, prompts, plain_outputs, draft_kind, select):
    cal = ScoreCalibrator(depth_limit=15, prior_mass=0.5) if select == "calibrated" else None
    policy = AutoPolicy(candidates=CANDS, round_ms=MIXED_MS, calibrator=cal, select=select)
    recs = auto_decode(target, _drafts(draft_kind, target, len(prompts)), prompts, policy=policy,
                       max_new_tokens=MAX_NEW)
    chosen = set()
    for rec, plain in zip(recs, plain_outputs):
        rec.validate()
        assert rec.method == "ddtree_auto"
        assert rec.output_ids == plain and rec.finish_reason == "length"
        a = rec.extra["auto"]
        assert len(a["budget"]) == len(a["pred_raw"]) == len(rec.accept_lengths) == len(rec.tree_sizes)
        assert ("pred_cal" in a) == (cal is not None)
        assert rec.tree_sizes == [15 if b == CHAIN else b for b in a["budget"]]
        chosen.update(a["budget"])
    # lockstep: every request of the group made the same choice in the rounds they shared
    n = min(len(r.accept_lengths) for r in recs)
    assert all(r.extra["auto"]["budget"][:n] == recs[0].extra["auto"]["budget"][:n] for r in recs)
    if draft_kind == "oracle":
        assert len(chosen) >= 2  # the chooser really switched budgets


def test_single_candidate_equals_the_fixed_decoders(target, prompts):
    for prompt in prompts[:2]:
        for budget, method in ((16, "ddtree"), (CHAIN, "dflash")):
            ref = speculative_decode(target, OracleDraft(target, noise=0.3, seed=3), prompt, method=method,
                                     budget=None if budget == CHAIN else budget, max_new_tokens=MAX_NEW)
            cal = ScoreCalibrator(depth_limit=15)
            rec = auto_decode(target, [OracleDraft(target, noise=0.3, seed=3)], [prompt],
                              policy=AutoPolicy(candidates=[budget], calibrator=cal), max_new_tokens=MAX_NEW)[0]
            assert rec.method == ref.method
            assert rec.output_ids == ref.output_ids
            assert rec.accept_lengths == ref.accept_lengths
            assert rec.expected_accepts == pytest.approx(ref.expected_accepts, rel=1e-5)
            assert int(cal.rounds) == len(rec.accept_lengths)  # observing only: the tree is the fixed one


def test_chain_when_verify_is_expensive_and_the_largest_tree_when_free(target, prompts):
    def run(ms):
        return auto_decode(target, [OracleDraft(target, noise=0.3, seed=3)], [prompts[0]],
                           policy=AutoPolicy(candidates=CANDS, round_ms=ms), max_new_tokens=MAX_NEW)[0]

    assert set(run([1.0, 1e4, 1e5, 1e6]).extra["auto"]["budget"]) == {CHAIN}
    assert set(run([1.0, 1.0, 1.0, 1.0]).extra["auto"]["budget"]) == {64}


def test_calibrated_predictions_are_made_before_the_round_updates_the_table(target, prompts):
    events = []

    class Logged(ScoreCalibrator):
        def expected(self, tree):
            events.append(("predict", int(self.rounds)))
            return super().expected(tree)

        def update(self, tree, path, active=None):
            events.append(("update", int(self.rounds)))
            super().update(tree, path, active)

    cal = Logged(depth_limit=15)
    recs = auto_decode(target, _drafts("oracle", target, 2), prompts[:2],
                       policy=AutoPolicy(candidates=CANDS, round_ms=MIXED_MS, calibrator=cal, select="calibrated"),
                       max_new_tokens=MAX_NEW)
    # rounds are runs of predictions followed by as many updates; every prediction of a run sees only the
    # updates of the earlier runs (the table as it was before its own round)
    runs = []
    for kind, rounds in events:
        if not runs or runs[-1][0] != kind:
            runs.append([kind, []])
        runs[-1][1].append(rounds)
    assert [k for k, _ in runs] == ["predict", "update"] * (len(runs) // 2)
    done = 0
    for (_, preds), (_, ups) in zip(runs[0::2], runs[1::2]):
        assert len(preds) == len(ups) and set(preds) == {done}
        done += len(ups)
    total_rounds = sum(len(r.accept_lengths) for r in recs)
    assert int(cal.rounds) == total_rounds
    frozen = ScoreCalibrator(depth_limit=15)
    auto_decode(target, [OracleDraft(target, noise=0.3, seed=3)], prompts[:1],
                policy=AutoPolicy(candidates=CANDS, round_ms=MIXED_MS, calibrator=frozen, learn=False),
                max_new_tokens=10)
    assert int(frozen.rounds) == 0 and float(frozen.count.sum()) == 0


def test_sampled_auto_is_reproducible_and_shares_the_prefill_token(target, prompts):
    from sglang_ddtree.offline.runner import prompt_generator

    def gen(s):
        return prompt_generator(torch.device("cpu"), s, 0)

    kw = dict(max_new_tokens=20, temperature=1.0, top_p=0.95)
    pol = dict(candidates=CANDS, round_ms=MIXED_MS)
    a = auto_decode(target, [OracleDraft(target, noise=0.5)], [prompts[0]], policy=AutoPolicy(**pol),
                    generators=[gen(1)], **kw)[0]
    b = auto_decode(target, [OracleDraft(target, noise=0.5)], [prompts[0]], policy=AutoPolicy(**pol),
                    generators=[gen(1)], **kw)[0]
    assert a.output_ids == b.output_ids and a.accept_lengths == b.accept_lengths
    p = plain_decode(target, prompts[0], generator=gen(1), **kw)
    assert p.output_ids[0] == a.output_ids[0]


def test_bad_inputs(target, prompts):
    with pytest.raises(ValueError, match="round time"):
        AutoPolicy(candidates=[CHAIN, 16])
    with pytest.raises(ValueError, match="needs a calibrator"):
        AutoPolicy(candidates=[16], select="calibrated")
    with pytest.raises(ValueError, match="one draft source per prompt"):
        auto_decode(target, [OracleDraft(target)], prompts[:2], policy=AutoPolicy(candidates=[16]), max_new_tokens=4)
    d = OracleDraft(target)
    with pytest.raises(ValueError, match="its own draft source"):
        auto_decode(target, [d, d], prompts[:2], policy=AutoPolicy(candidates=[16]), max_new_tokens=4)


def test_build_policy_uses_the_committed_cost_model():
    p1 = build_policy("chain,16,64,256", batch_size=1)
    p64 = build_policy("chain,16,64,256", batch_size=64, calibrate=True)
    assert p1.candidates == [CHAIN, 16, 64, 256] and p64.candidates == [CHAIN, 16]
    assert p64.select == "calibrated" and p64.calibrator is not None
    assert p1.round_ms[0] < p1.round_ms[-1]
    assert p1.method() == p64.method() == "ddtree_auto"
    assert build_policy("chain,1024", batch_size=64).candidates == [CHAIN]  # nothing left to decide
    assert build_policy("chain,1024", batch_size=64).round_ms is None


def test_runner_and_baseline_file(target, prompts, plain_outputs, tmp_path):
    drafter = random_dflash(target, seed=5)
    draft = DFlashDraftSource(drafter, target)
    inputs = [PromptInput(f"p{i}", i, p) for i, p in enumerate(prompts[:2])]
    settings = RunSettings(methods=["ddtree_tb16", "ddtree_auto"], max_new_tokens=MAX_NEW,
                           auto=AutoSettings(candidates="chain,16,64", batch_size=4, calibrate=True))
    header = BaselineHeader(source="offline", target={"path": None, "fingerprint": None})
    out = tmp_path / "auto.jsonl"
    with BaselineWriter(out, header) as w:
        taus = run_offline(target, draft, inputs, settings, w, progress=False)
    assert taus["ddtree_auto"]["rounds"] > 0 and taus["ddtree_auto"]["calibration"]["request_rounds"] > 0
    base = read_baseline(out)
    assert base.methods == ["ddtree_tb16", "ddtree_auto"]
    for p, plain in zip(inputs, plain_outputs):
        rec = base.get(p.id, "ddtree_auto")
        assert rec.output_ids == plain
        assert rec.extra["auto"]["policy"]["batch_size"] == 4
    single = decode_one(target, draft, inputs[0], "ddtree_auto", settings)
    assert single.output_ids == plain_outputs[0]


def test_method_name_ddtree_auto():
    from sglang_ddtree.baseline import method_name, method_sort_key, parse_method

    assert method_name("ddtree_auto") == "ddtree_auto" and parse_method("ddtree_auto") == ("ddtree_auto", None)
    assert sorted(["ddtree_auto", "ddtree_tb64", "dflash", "plain"], key=method_sort_key) == \
        ["plain", "dflash", "ddtree_tb64", "ddtree_auto"]
    with pytest.raises(ValueError, match="no fixed budget"):
        method_name("ddtree_auto", 64)


def test_runner_windowed_candidates_from_a_tau_prior(target, prompts, plain_outputs, tmp_path):
    import json

    prior = tmp_path / "prior.json"
    prior.write_text(json.dumps({"chain": 2.0, "16": 3.0, "64": 3.1}))
    draft = OracleDraft(target, noise=0.3, seed=3)
    s1 = RunSettings(methods=["ddtree_auto"], max_new_tokens=MAX_NEW,
                     auto=AutoSettings(candidates="chain,16,64", batch_size=1, tau_prior=str(prior)))
    rec = decode_one(target, draft, PromptInput("p0", 0, prompts[0]), "ddtree_auto", s1)
    assert rec.output_ids == plain_outputs[0]
    pol = rec.extra["auto"]["policy"]
    assert pol["candidate_rule"]["rule"] == "window" and pol["candidates"][0] == "chain"
    s64 = RunSettings(methods=["ddtree_auto"], max_new_tokens=MAX_NEW,
                      auto=AutoSettings(candidates="chain,16,64", batch_size=64, tau_prior=str(prior)))
    rec = decode_one(target, draft, PromptInput("p0", 0, prompts[0]), "ddtree_auto", s64)
    assert rec.extra["auto"]["policy"]["candidates"] == ["chain"] and set(rec.extra["auto"]["budget"]) == {CHAIN}
    assert rec.output_ids == plain_outputs[0]
