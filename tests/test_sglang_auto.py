"""`--speculative-ddtree-budget auto` in the SGLang worker, CPU side: flags, the host policy, the GPU->host
feedback channel and the round's auto stages (the worker wiring itself runs in tests/gpu/test_ddtree_server.py)."""

import argparse
import re

import pytest
import torch

from sglang_ddtree import adaptive
from sglang_ddtree.adaptive import CHAIN, PLAIN
from sglang_ddtree.sglang import args as ddtree_args
from sglang_ddtree.sglang import auto, ops
from sglang_ddtree.sglang.auto import (AutoBudgetPolicy, AutoConfig, AutoFeedback, CalibrationMonitor,
                                      observed_candidates)
from sglang_ddtree.sglang.stats import TableGauges
from sglang_ddtree.tree import build_tree_from_topk, chain_tree, topk_draft
from sglang_ddtree.walk import walk_choices

# ------------------------------------------------------------------------------------------------------ flags


def parse(*argv):
    parser = argparse.ArgumentParser()
    ddtree_args.add_cli_args(parser)
    return ddtree_args.options_from(parser.parse_args(list(argv)))


def test_auto_flags():
    opts = parse("--speculative-ddtree-budget", "auto")
    assert opts.auto and opts.candidates == (0, 16, 32, 64, 128) and opts.budget == 128
    opts = parse("--speculative-ddtree-budget", "AUTO", "--speculative-ddtree-auto-candidates", "64,16")
    assert opts.candidates == (0, 16, 64) and opts.budget == 64  # the chain is always a candidate
    assert not parse("--speculative-ddtree-budget", "32").auto
    with pytest.raises(ValueError, match="needs --speculative-ddtree-budget auto"):
        parse("--speculative-ddtree-budget", "32", "--speculative-ddtree-auto-candidates", "16,32")
    with pytest.raises(ValueError, match="at least 15"):
        parse("--speculative-ddtree-budget", "auto", "--speculative-ddtree-auto-candidates", "chain,8")
    with pytest.raises(ValueError, match="auto-candidates: candidate budgets must be"):
        parse("--speculative-ddtree-budget", "auto", "--speculative-ddtree-auto-candidates", "16,2000")
    with pytest.raises(ValueError, match="or auto"):
        parse("--speculative-ddtree-budget", "automatic")
    # --speculative-ddtree-auto-calibration on|off (default off), `auto` only
    assert not parse("--speculative-ddtree-budget", "auto").auto_calibration
    for word, on in (("off", False), ("OFF", False), ("0", False), ("on", True), ("true", True)):
        assert parse("--speculative-ddtree-budget", "auto", "--speculative-ddtree-auto-calibration", word) \
            .auto_calibration is on
    with pytest.raises(ValueError, match="must be on or off"):
        parse("--speculative-ddtree-budget", "auto", "--speculative-ddtree-auto-calibration", "sometimes")
    with pytest.raises(ValueError, match="auto-calibration needs --speculative-ddtree-budget auto"):
        parse("--speculative-ddtree-budget", "32", "--speculative-ddtree-auto-calibration", "off")


# ------------------------------------------------------------------------------------------------------ policy

DEFAULTS = AutoConfig()
ON = AutoConfig(calibration=True)  # the calibration table's own tests (off by default)


def Policy(candidates, widths=None, **config):
    """An AutoBudgetPolicy whose AutoConfig differs from the default in these fields."""
    return AutoBudgetPolicy(candidates, widths=widths, config=AutoConfig(**config))


def run_policy(policy, bucket, tokens, ms, rounds, lag=0):
    """Drive the policy: a round of candidate i commits tokens[i] per request (the drafter expects 1.5x that)
    and takes ms[i]; observations arrive `lag` rounds late, as the GPU feedback does."""
    queue, picks = [], []
    for _ in range(rounds):
        i = policy.choose(bucket)
        picks.append(i)
        seen = observed_candidates(policy.candidates, i)
        queue.append((i, [1.5 * t for t in tokens], [t if s else None for t, s in zip(tokens, seen)]))
        if len(queue) > lag:
            j, exp, obs = queue.pop(0)
            policy.observe(bucket, j, 1, ms[j], exp, obs)
    return picks


def test_policy_explores_then_picks_the_best_rate():
    policy = Policy([CHAIN, 16, 64], explore_rounds=2, probe_every=1000)
    tokens, ms = [3.0, 4.0, 5.0], [1.0, 1.1, 2.0]  # rates 3.0, 3.64, 2.5: the 16-tree wins
    picks = run_policy(policy, 1, tokens, ms, 40)
    # smallest first, each twice unless its timed rounds say it cannot win. A candidate's own times bound its floor
    # from its FLOOR_MIN_TIMES-th (2): after the 64-tree's first 2.0 ms its floor is the 16-tree's 1.1 ms, where it
    # could win (5 / 1.1 > 4 / 1.1), so it runs its second round; its least 2.0 ms then needs 1.8 ms (10% timing
    # allowance) to beat the 16-tree, so it is not verified again
    assert picks[:6] == [0, 0, 1, 1, 2, 2]
    assert picks[6:] == [1] * 34
    # with floor_min_times=1 its one timed round already ends its exploration
    assert run_policy(Policy([CHAIN, 16, 64], explore_rounds=2, probe_every=1000, floor_min_times=1), 1, tokens,
                      ms, 40)[:6] == [0, 0, 1, 1, 2, 1]
    assert policy.ratio(2) == pytest.approx(1 / 1.5) and policy.est_tokens(1) == pytest.approx(4.0)
    # a bucket of its own: costs are per batch size (here the 64-tree is cheap at batch 8)
    picks8 = run_policy(policy, 8, tokens, [1.0, 1.1, 1.15], 20)
    assert picks8[-1] == 2 and picks[-1] == 1
    exported = policy.export()
    assert exported["rounds_chosen"] == {"chain": 4, "16": 38, "64": 18}
    # per bucket: the rounds each candidate ran there, and the medians the rates compare
    by_bucket = exported["rounds_by_bucket"]
    assert by_bucket["1"] == {"chain": picks.count(0), "16": picks.count(1), "64": picks.count(2)}
    assert by_bucket["8"] == {"chain": picks8.count(0), "16": picks8.count(1), "64": picks8.count(2)}
    assert exported["median_ms"]["1"] == {"chain": 1.0, "16": 1.1, "64": 2.0}


def test_policy_picks_the_chain_when_trees_do_not_pay():
    policy = Policy([CHAIN, 16, 32], explore_rounds=1, probe_every=1000)
    picks = run_policy(policy, 1, [3.0, 3.1, 3.2], [1.0, 1.5, 2.0], 30, lag=2)
    assert picks[-20:] == [0] * 20


def test_policy_never_tries_wide_trees_that_cannot_pay():
    """A drafter that is never right (dummy weights): every candidate commits 1 token a round, so a tree wider
    than the measured narrower trees cannot win (it costs at least as much for the same tokens) and is never
    verified, not even by exploration or probes: `auto` runs DFLASH's chain. The 16-tree, the narrowest tree, has
    no floor before its own times (the chain's round is another cost curve: _cost_floor): it is explored, then
    probed (its least time less NOISE could still win), and its times keep the wider trees out."""
    policy = Policy([CHAIN, 16, 32, 128], explore_rounds=3, probe_every=8)
    picks = run_policy(policy, 4, [1.0, 1.0, 1.0, 1.0], [7.0, 7.1, 9.0, 12.0], 60, lag=1)
    assert set(picks) == {0, 1} and picks[3:6] == [1, 1, 1]
    assert picks[6:].count(1) <= len(picks[6:]) // policy.config.probe_every + 1  # probes only
    # a drafter that is right sometimes makes the 16-tree worth a try, and here worth keeping
    policy = Policy([CHAIN, 16, 32, 128], explore_rounds=3, probe_every=8)
    picks = run_policy(policy, 4, [2.0, 2.4, 2.5, 2.6], [7.0, 7.1, 9.0, 12.0], 60, lag=1)
    assert 1 in picks and 3 not in picks and picks[-1] == 1


def test_policy_probes_the_stalest_candidate_that_could_win():
    # rates 3.5, 3.64, 3.45: within the 10% timing allowance of the best, so both others are re-measured
    policy = Policy([CHAIN, 16, 64], explore_rounds=1, probe_every=10)
    picks = run_policy(policy, 1, [3.5, 4.0, 5.0], [1.0, 1.1, 1.45], 40)
    probes = [(n, i) for n, i in enumerate(picks) if n >= 3 and i != 1]  # after exploration, not the best
    assert {i for _, i in probes} >= {0, 2} and picks.count(1) >= 30
    assert all(b - a >= 10 for (a, _), (b, _) in zip(probes, probes[1:]))  # at most one in probe_every rounds
    # the 64-tree at 2.0 ms (rate 2.5) would need 1.37 ms to win. Its own times bound its floor from the second
    # (FLOOR_MIN_TIMES): after exploration's one round its floor is the 16-tree's 1.1 ms and it is probed once; then
    # measured twice, it is never probed again
    policy = Policy([CHAIN, 16, 64], explore_rounds=1, probe_every=10)
    picks = run_policy(policy, 1, [3.5, 4.0, 5.0], [1.0, 1.1, 2.0], 60)
    assert picks.count(2) == 2 and policy.buckets[1].measured[2] == 2 and picks.count(0) >= 2
    # with floor_min_times=1: measured once, never probed again
    policy = Policy([CHAIN, 16, 64], explore_rounds=1, probe_every=10, floor_min_times=1)
    picks = run_policy(policy, 1, [3.5, 4.0, 5.0], [1.0, 1.1, 2.0], 60)
    assert picks.count(2) == 1 and picks.count(0) >= 2


def run_with_cold_rounds(policy, bucket, tokens, expected, ms, rounds, lag=2, batch=16):
    """As the worker feeds it: the first round of each candidate is cold (graph captures: its tokens count, its
    time does not) and observations arrive `lag` rounds late."""
    queue, picks, used = [], [], set()
    for _ in range(rounds):
        i = policy.choose(bucket)
        picks.append(i)
        cold = i not in used
        used.add(i)
        seen = observed_candidates(policy.candidates, i)
        queue.append((i, cold, [batch * t if s else None for t, s in zip(tokens, seen)]))
        if len(queue) > lag:
            j, was_cold, obs = queue.pop(0)
            policy.observe(bucket, j, batch, None if was_cold else ms[j], [batch * e for e in expected], obs)
    return picks


def test_policy_does_not_explore_wide_trees_blind_at_large_batch():
    """8B shapes at batch 16 with a dummy drafter that is confident and never right: verify time grows
    with the width (chain 11 ms, 128-tree ~5x), every candidate commits 1 token, the drafter expects more for wider
    trees. Exploration waits for each candidate's first timed round, and the convex cost floor (secant of the
    narrower trees' times) rules the wide trees out. With floor_min_times=1 the 16- and 32-trees' secant rules the
    64- and 128-trees out before they are ever verified. With FLOOR_MIN_TIMES = 2 the 32-tree's one timed round
    (its exploration ends there: its own rounds commit 1 token) gives no secant, so the 64-tree is explored against
    the 16-tree's 11.5 ms: three rounds (its observed tokens arrive two rounds late), two timed; the 128-tree once,
    its cold round, before the secant through the 64-tree's 38 ms floors it at ~72 ms."""
    widths = [16, 17, 33, 65, 129]
    ms = [11.0, 11.5, 20.0, 38.0, 73.0]
    one_time = Policy([CHAIN, 16, 32, 64, 128], widths=widths, floor_min_times=1)
    picks = run_with_cold_rounds(one_time, 16, [1.0] * 5, [1.5, 2.0, 3.0, 4.0, 6.0], ms, 384)
    assert 3 not in picks and 4 not in picks
    assert picks.count(0) >= 360  # all but the 16- and 32-trees' explorations
    policy = Policy([CHAIN, 16, 32, 64, 128], widths=widths)
    picks = run_with_cold_rounds(policy, 16, [1.0] * 5, [1.5, 2.0, 3.0, 4.0, 6.0], ms, 384)
    b = policy.buckets[16]
    # the wide trees run only in exploration, a bounded few rounds, the 128-tree never timed
    wide = [n for n, i in enumerate(picks) if i >= 3]
    assert picks.count(3) <= 3 and picks.count(4) <= 1 and b.measured[4] == 0 and all(n < 20 for n in wide), wide
    # after exploration the chain runs every round but probes (at most one in probe_every, never a wide tree)
    after = picks[20:]
    assert after.count(0) >= len(after) - (len(after) // policy.config.probe_every + 1)
    # the floor itself: below the true (convex) cost, above what the narrower trees alone would say
    floor_128 = policy._cost_floor(b, 4)
    assert 20.0 < floor_128 < 73.0
    assert 20.0 < one_time._cost_floor(one_time.buckets[16], 4) < 73.0


def test_the_chains_slow_start_floors_no_tree():
    """Tiny batch-1 servers: the lean chain round, explored first at the server's start, read 7.8 ms
    against ~4.6-4.9 for every tree, and as the narrowest candidate's least time it floored the 32- to 128-trees out
    of exploration (the 128-tree never ran in the batch-1 rows). The chain's round is another code path: its times
    bound only its own floor, so the wider trees are explored and the 128-tree (the best rate) runs."""
    widths = [16, 17, 33, 65, 129]
    ms = [7.8, 4.9, 4.8, 4.7, 4.6]
    tokens, expected = [4.1, 4.7, 5.0, 5.3, 5.5], [4.3, 5.0, 5.4, 5.8, 6.1]
    policy = Policy([CHAIN, 16, 32, 64, 128], widths=widths)
    picks = run_with_cold_rounds(policy, 1, tokens, expected, ms, 300, batch=1)
    assert policy.buckets[1].measured[4] >= 3 and 4 in picks[:40], picks[:40]
    assert picks[100:].count(4) >= 0.85 * 200, [picks[100:].count(i) for i in range(5)]
    # the floor itself: a tree's from the narrower trees' least times only, the chain's from its own
    b = Policy([CHAIN, 16, 32], widths=widths[:3])
    for i, t in ((0, 7.8), (0, 7.9), (1, 4.9), (1, 5.0)):
        b.observe(1, i, 1, t, None, [None] * 3)
    assert b._cost_floor(b.buckets[1], 2) == pytest.approx(4.9)
    assert b._cost_floor(b.buckets[1], 0) == pytest.approx(7.8 * 0.9)


def run_batch1(policy, rounds, ms, tokens, factor, lag=2):
    """Drive the policy at batch 1: a round of candidate i commits tokens[i] (the drafter expects 1.2x that) and
    takes ms[i] x factor(i, its uses so far counting this one, the previous round's candidate or None); a
    candidate's first round is cold (untimed); observations arrive `lag` rounds late."""
    queue, picks, uses = [], [], [0] * len(ms)
    for _ in range(rounds):
        i = policy.choose(1)
        uses[i] += 1
        t = ms[i] * factor(i, uses[i], picks[-1] if picks else None)
        picks.append(i)
        seen = observed_candidates(policy.candidates, i)
        queue.append((i, uses[i] == 1, t, [tok if s else None for tok, s in zip(tokens, seen)]))
        if len(queue) > lag:
            j, cold, tj, obs = queue.pop(0)
            policy.observe(1, j, 1, None if cold else tj, [1.2 * tok for tok in tokens], obs)
    return picks


def run_with_slow_first_uses(policy, rounds, slow_uses, lag=2):
    """Chain, 16- and 128-tree at batch 1 (4.0 / 4.4 / 4.4 ms, 3.0 / 4.0 / 4.6 tokens): a candidate's first
    round is cold (untimed), its next slow_uses[i] rounds cost 1.5x (as measured on servers' first uses
    and on their first explored trees)."""
    return run_batch1(policy, rounds, [4.0, 4.4, 4.4], [3.0, 4.0, 4.6],
                      lambda i, used, _: 1.5 if 2 <= used <= 1 + slow_uses[i] else 1.0, lag)


def test_a_new_time_expires_a_candidates_old_ones():
    """TIMES_EXPIRE (an A/B server, `tiny-o1`: its 128-tree's median stayed its slow exploration's while the 64-tree
    ran): the 128-tree's exploration rounds were its slow first uses (6.6 ms against the 16-tree's 4.4), so the
    16-tree won. Its stale probe (STALE_ROUNDS) brings one warm time; kept next to the three slow ones it cannot move
    the median, and the 16-tree keeps running until ~3 such probes; with the slow times expired the probe's time is
    the 128-tree's, and the 128-tree (the best rate) runs from then."""
    widths = [16, 17, 129]
    kept = Policy([CHAIN, 16, 128], widths=widths, times_expire=0)
    before = run_with_slow_first_uses(kept, 520, [0, 0, 3])
    assert before[400:520].count(2) <= 2, [before[400:520].count(i) for i in range(3)]
    policy = Policy([CHAIN, 16, 128], widths=widths, times_expire=256)
    picks = run_with_slow_first_uses(policy, 520, [0, 0, 3])
    assert picks[:380] == before[:380]  # nothing expires before the stale probe (round ~385)
    assert picks[400:520].count(2) >= 0.9 * 120, [picks[400:520].count(i) for i in range(3)]
    b = policy.buckets[1]
    assert b.expired_least[2] == pytest.approx(6.6) and max(b.recent[2]) == pytest.approx(4.4)
    with pytest.raises(ValueError, match="times_expire"):
        Policy([CHAIN, 16], times_expire=-1)


def test_expired_times_still_floor_the_wide_trees():
    """An expiry must not let the wide trees that cannot win be probed more: at 8B-like convex costs (chain 11 ms,
    128-tree 73) their expired times still bound their floors (_bound_ms) until they have enough new ones, so over
    3000 rounds the 64- and 128-trees run no more often with TIMES_EXPIRE than without."""
    widths = [16, 17, 33, 65, 129]
    ms = [11.0, 11.5, 20.0, 38.0, 73.0]
    runs = {}
    for expire in (0, 256):
        policy = Policy([CHAIN, 16, 32, 64, 128], widths=widths, times_expire=expire)
        picks = run_with_cold_rounds(policy, 16, [1.0] * 5, [1.5, 2.0, 3.0, 4.0, 6.0], ms, 3000)
        runs[expire] = [picks.count(i) for i in range(5)]
        if expire:
            assert any(x is not None for x in policy.buckets[16].expired_least)  # times did expire
    assert runs[256][3] <= runs[0][3] and runs[256][4] <= runs[0][4], runs
    assert runs[256][0] >= 0.9 * 3000, runs


def test_explore_all_verifies_every_candidate_even_one_that_cannot_win():
    """SGLANG_DDTREE_AUTO_EXPLORE_ALL (the GPU server tests' mode): the same costs as above, where the 64- and
    128-trees are ruled out unverified, now explored `explore` rounds each; then the chooser exploits as before."""
    widths = [16, 17, 33, 65, 129]
    ms = [11.0, 11.5, 20.0, 38.0, 73.0]
    policy = Policy([CHAIN, 16, 32, 64, 128], widths=widths, explore_all=True)
    picks = run_with_cold_rounds(policy, 16, [1.0] * 5, [1.5, 2.0, 3.0, 4.0, 6.0], ms, 384)
    assert all(picks.count(i) >= 3 for i in range(5)), [picks.count(i) for i in range(5)]
    assert picks[200:].count(0) >= 175  # exploration over: the chain but for probes


def test_policy_borrows_the_ratio_of_the_nearest_smaller_observed_candidate():
    policy = Policy([CHAIN, 16, 64])
    policy.observe(1, 1, 2, 1.0, [6.0, 8.0, 10.0], [None, 4.0, None])  # the 16-tree: observed 2, expected 4
    assert policy.ratio(1) == pytest.approx(0.5) and policy.ratio(2) == pytest.approx(0.5)
    assert policy.ratio(0) == 1.0  # nothing observed at or below the chain
    assert policy.est_tokens(2) == pytest.approx(2.5)


def test_a_wider_tree_is_estimated_to_commit_at_least_what_a_narrower_one_does():
    """Its first slots are the narrower tree, so per round it commits at least as much: an estimate below the
    narrower tree's (a ratio from a few unlucky rounds) is lifted to it."""
    policy = Policy([CHAIN, 16, 64])
    policy.observe(1, 2, 1, 1.0, [3.0, 4.0, 6.0], [None, 3.0, 1.0])  # the 64-tree: 1 of 6 expected, the 16: 3 of 4
    assert policy.ratio(2) == pytest.approx(1 / 6) and policy.est_tokens(1) == pytest.approx(3.0)
    assert policy.est_tokens(2) == pytest.approx(3.0)  # not 1.0
    policy.observe(1, 2, 1, 1.0, [3.0, 4.0, 6.0], [None, 3.0, 5.0])
    assert policy.est_tokens(2) > 3.0  # its own estimate again once it is the larger


def test_an_exact_tie_goes_to_the_wider_tree():
    """Tiny batch-1 servers: the 64-tree's own estimate fell below the 16-tree's (its ratio from rounds
    of harder text), so both were estimated at the 16-tree's tokens, and their times, alike, pooled to one value:
    an exact tie, which the narrowest candidate used to win. The wider tree commits at least as much per round."""
    policy = Policy([CHAIN, 16, 64], explore_rounds=1, probe_every=1000)
    for _ in range(3):  # 64-tree rounds on hard text (per round it commits at least the 16-tree's tokens)
        policy.observe(1, 2, 1, 4.0, [3.0, 4.0, 6.0], [None, 2.0, 2.2])
    for _ in range(3):  # then easier text, the 16-tree and the chain at the same round time
        policy.observe(1, 1, 1, 4.0, [3.0, 4.0, 6.0], [None, 3.5, None])
        policy.observe(1, 0, 1, 4.0, [3.0, 4.0, 6.0], [1.0, None, None])
    own = [policy.expected[i].mean() * policy.ratio(i) for i in range(3)]
    assert own[2] < own[1]  # its own ratio is from the hard text
    assert policy.est_tokens(1) == policy.est_tokens(2)  # lifted to the 16-tree's estimate: the tie is exact
    rates = policy.rates(1)
    assert rates[1] == rates[2] > rates[0]
    assert policy.choose(1) == 2


def test_a_ratio_decays_with_the_rounds_since_it_was_last_observed():
    """A candidate observed once long ago (a low ratio) and again now: the fresh sample outweighs the old one,
    which has decayed over the rounds between (not only over the samples between)."""
    policy = Policy([CHAIN, 16, 64], half_life_rounds=50.0)
    policy.observe(1, 2, 1, 1.0, [3.0, 4.0, 6.0], [None, 3.0, 1.0])  # ratio 1/6
    for _ in range(2000):  # sampled rounds of the 16-tree only (the decay's pace: SAMPLE_EVERY rounds a step)
        policy.observe(1, 1, 1, 1.0, [3.0, 4.0, 6.0], [None, 3.0, None])
    policy.observe(1, 2, 1, 1.0, [3.0, 4.0, 6.0], [None, 3.0, 4.8])  # ratio 0.8
    assert policy.ratio(2) > 0.79  # decayed only per sample, the old one would still weigh as much: 0.48


def test_probes_and_exploration_are_sampled_and_stale_times_are_probed():
    """`sampling` marks the rounds that explore or probe (the worker samples them, so a probe also refreshes the
    ratio); a candidate whose last timed round is more than STALE_ROUNDS back is probed even when its old times
    say it cannot win (then re-measured at its real cost, it wins)."""
    STALE_ROUNDS = DEFAULTS.stale_rounds
    policy = Policy([CHAIN, 16, 64], explore_rounds=1, probe_every=16)
    tokens, slow, fast = [3.0, 4.0, 5.0], [1.0, 1.1, 4.0], [1.0, 1.1, 1.15]
    flags, picks = [], []
    for r in range(3 * STALE_ROUNDS):
        i = policy.choose(1)
        picks.append(i)
        flags.append(policy.sampling)
        # the 64-tree's first rounds ran 3.5x slow: its exploration round and its first probe, the two timed rounds
        # its own floor needs (FLOOR_MIN_TIMES)
        ms = (slow if r < 40 else fast)[i]
        policy.observe(1, i, 1, ms, [1.5 * t for t in tokens],
                       [t if s else None for t, s in zip(tokens, observed_candidates(policy.candidates, i))])
    assert flags[:3] == [True, True, True] and picks[:3] == [0, 1, 2]  # exploration, narrowest first
    probe_rounds = [n for n, f in enumerate(flags) if f and n >= 3]  # then probes, at most one in probe_every
    assert probe_rounds and all(b - a >= 16 for a, b in zip(probe_rounds, probe_rounds[1:]))
    # one time bounds no floor: probed once more (slow again); then at 4.0 ms it cannot win: not probed while that
    # time is fresh
    again = [n for n in range(3, STALE_ROUNDS) if picks[n] == 2]
    assert len(again) == 1 and again[0] < 40 and flags[again[0]], again
    assert picks.index(2, again[0] + 1) > again[0] + STALE_ROUNDS  # next verified once its times are stale
    assert picks[-50:].count(2) >= 45  # probed once stale, re-measured at 1.15 ms: the 64-tree runs


def test_a_slow_start_that_commits_little_does_not_lock_a_candidate_out():
    """A tiny sweep at batch 4: the 128-tree's ratio stayed at 0.197 from a few early rounds, the 16- and
    32-trees' times at their exploration's, and `auto` ran the 64-tree (x0.855 of the fixed 128-tree). Simulated:
    the first 60 rounds 1.4x slow and committing ~1 token; with ratios that never aged and no probe of stale times
    10 seeds gave 0.923-0.989 of the best rate afterwards (mean 0.954)."""
    from ddtree_bench.auto_sim import CANDIDATES, rate_over_best, simulate

    base, tokens = [4.4, 4.5, 4.6, 4.68, 4.75], [3.6, 3.9, 4.1, 4.3, 4.55]
    ratios, refreshed = [], []
    for seed in range(10):
        policy = Policy(list(CANDIDATES), widths=[16, 17, 33, 65, 129])
        picks = simulate(seed, base, tokens, [4.0, 4.8, 5.2, 5.5, 5.9], 3000, 4, noise=0.08, start_rounds=60,
                         start_mult=1.4, start_tokens=[1.0, 1.1, 1.2, 1.3, 1.2], policy=policy)
        ratios.append(rate_over_best(picks[1000:], base, tokens))
        refreshed.append(policy.ratio(4))
    assert min(ratios) > 0.95 and sum(ratios) / len(ratios) > 0.97, ratios
    assert min(refreshed) > 0.6, refreshed  # the 128-tree's ratio left the start's 0.2


def test_policy_rejects_bad_candidates():
    for bad in ([16, 32], [CHAIN], [CHAIN, 32, 16]):
        with pytest.raises(ValueError):
            Policy(bad)


def test_observed_candidates():
    assert observed_candidates([0, 16, 32, 64], 0) == [True, False, False, False]
    assert observed_candidates([0, 16, 32, 64], 2) == [False, True, True, False]


class FakeTimer:
    enabled = True

    def __init__(self, stages, done=True):
        self.marks = list(stages)
        self.stages = stages
        self._done = done

    def done(self):
        return self._done

    def elapsed_ms(self):
        return dict(self.stages)


def test_unsampled_rounds_count_time_only():
    """An unsampled round sends no vector (its walk computes no observed tokens: the policy reads them only next to
    the same round's expectations); its time counts, and the policy's estimates are those of a round whose
    observed tokens were sent and ignored."""
    policy = Policy([CHAIN, 16])
    feedback = AutoFeedback(policy, "cpu")
    feedback.push(None, FakeTimer({"verify": 2.0}), 1, 0, 1, sampled=False)
    assert feedback.index == 0  # no ring slot used
    assert feedback.drain() == 1
    assert policy.buckets[1].round_ms[0].mean() == pytest.approx(2.0) and policy.rounds_observed == 1
    assert policy.expected[0].mean() is None and policy.observed[0].mean() is None
    with pytest.raises(ValueError, match="sampled round must bring"):
        feedback.push(None, FakeTimer({"verify": 2.0}), 1, 0, 1, sampled=True)
    # the same rounds observed with their observed tokens on unsampled rounds too (what the feedback passed before
    # unsampled walks stopped computing them) leave the same policy state
    twin = Policy([CHAIN, 16])
    twin_feedback = AutoFeedback(twin, "cpu")
    sent = Policy([CHAIN, 16])
    for r in range(12):
        sampled = r % 4 == 0
        vector = torch.tensor([4.0, 6.0, 3.0 + r % 3, 0.0, 0.0, 0.0, 0.0])
        twin_feedback.push(vector if sampled else None, FakeTimer({"verify": 2.0 + r}), 1, 0, 1, sampled=sampled)
        twin_feedback.drain()
        sent.observe(1, 0, 1, 2.0 + r, [4.0, 6.0] if sampled else None, [3.0 + r % 3, None])
        assert twin.export() == sent.export() and twin.choose(1) == sent.choose(1)


def test_feedback_reads_completed_rounds_only():
    policy = Policy([CHAIN, 16])
    feedback = AutoFeedback(policy, "cpu")
    feedback.push(torch.tensor([8.0, 12.0, 7.0, 0.0, 0.0, 0.0, 0.0]), FakeTimer({"draft": 1.0, "verify": 2.0}), 4, 0, 4)
    late = FakeTimer({"draft": 1.0}, done=False)
    feedback.push(torch.tensor([8.0, 12.0, 0.0, 9.0, 0.0, 0.0, 0.0]), late, 4, 1, 4)
    assert feedback.drain() == 1  # the second round's events have not completed
    assert policy.buckets[4].round_ms[0].mean() == pytest.approx(3.0)
    assert policy.expected[1].mean() == pytest.approx(3.0) and policy.observed[0].mean() == pytest.approx(1.75)
    assert policy.observed[1].mean() is None  # the chain round did not observe the tree
    late._done = True
    assert feedback.drain() == 1 and policy.observed[1].mean() == pytest.approx(2.25)
    # a cold round (graph captures): its tokens count, its seconds-long time does not
    feedback.push(torch.tensor([8.0, 12.0, 0.0, 9.0, 0.0, 0.0, 0.0]), FakeTimer({"verify": 3000.0}), 4, 1, 4, cold=True)
    assert feedback.drain() == 1
    assert policy.buckets[4].round_ms[1].mean() == pytest.approx(1.0) and policy.buckets[4].measured[1] == 1
    assert policy.rounds_observed == 3


# ------------------------------------------------------------------------------------------- rounds without a draft


def test_plain_is_a_candidate_of_the_servers_auto_only():
    opts = parse("--speculative-ddtree-budget", "auto", "--speculative-ddtree-auto-candidates", "plain,15")
    assert opts.candidates == (PLAIN, CHAIN, 15) and opts.budget == 15
    assert adaptive.candidate_label(PLAIN) == "plain" and adaptive.drafted(opts.candidates) == [CHAIN, 15]
    with pytest.raises(ValueError, match="server's auto only"):
        adaptive.parse_candidates("plain,16")  # the offline decoders' candidates
    with pytest.raises(ValueError, match="at least 15"):
        parse("--speculative-ddtree-budget", "auto", "--speculative-ddtree-auto-candidates", "plain,7")
    with pytest.raises(ValueError, match="at least one tree"):
        Policy([PLAIN, CHAIN])
    assert observed_candidates([PLAIN, CHAIN, 7, 15], 0) == [True, False, False, False]
    assert observed_candidates([PLAIN, CHAIN, 7, 15], 3) == [False, False, True, True]  # trees only


def test_policy_runs_plain_rounds_where_speculation_costs_more_than_it_gains():
    """A large batch: a plain round commits 1 token a request in 5 ms (0.2 a ms), the chain 2.0 in 14 ms (0.14),
    the 15-tree 2.5 in 13 ms (0.19). The plain round is explored first (the narrowest verify), then every drafted
    candidate, and the choice settles on it; its estimate is exactly one token, whatever a drafter expects."""
    policy = Policy([PLAIN, CHAIN, 15], widths=[1, 16, 16], explore_rounds=2, probe_every=1000)
    picks = run_policy(policy, 64, [1.0, 2.0, 2.5], [5.0, 14.0, 13.0], 40)
    assert picks[:2] == [0, 0] and {1, 2} <= set(picks[:8])
    assert picks[-20:] == [0] * 20
    assert policy.est_tokens(0) == 1.0 and policy.export()["rounds_chosen"]["plain"] == picks.count(0)
    # where a tree pays, the plain round is left after its exploration
    picks = run_policy(Policy([PLAIN, CHAIN, 15], widths=[1, 16, 16], explore_rounds=2, probe_every=1000), 1,
                       [1.0, 3.0, 4.0], [5.0, 6.0, 6.2], 40)
    assert picks[:2] == [0, 0] and picks[-20:] == [2] * 20


def test_plain_times_floor_no_drafted_candidate():
    """A round without a draft is another code path: its time bounds no chain's or tree's (_cost_floor), and the
    sampling back-off reads the chain's rate wherever the chain sits in the candidates."""
    policy = Policy([PLAIN, CHAIN, 15, 31], widths=[1, 16, 16, 32], explore_rounds=2, probe_every=1000)
    b = policy._bucket(4)
    for _ in range(3):
        b.timed(0, 2.0)
    assert policy._cost_floor(b, 1) is None and policy._cost_floor(b, 2) is None
    assert policy._cost_floor(b, 0) == pytest.approx(2.0 * (1 - policy.config.noise))
    assert policy.sample_interval(4) == policy.config.sample_every  # the chain's rate is unknown yet


def test_feedback_maps_the_drafted_candidates_entries_around_plain():
    """The feedback vector holds the drafted candidates only ([expected, observed] of chain, 15, 31, then the
    calibration's 3): a tree round's entries land on the policy's candidates past PLAIN; a plain round sends none."""
    policy = Policy([PLAIN, CHAIN, 15, 31], widths=[1, 16, 16, 32])
    feedback = AutoFeedback(policy, "cpu")
    assert feedback.width == 2 * 3 + AutoFeedback.CALIBRATION
    vector = torch.tensor([4.0, 6.0, 8.0, 0.0, 5.0, 7.0, 0.0, 0.0, 0.0])  # expected x3, observed x3, calibration
    feedback.push(vector, FakeTimer({"verify": 3.0}), 2, 3, 2)  # the 31-tree, batch 2
    feedback.push(None, FakeTimer({"verify": 1.0}), 2, 0, 2, sampled=False)  # a plain round: its time only
    assert feedback.drain() == 2
    assert policy.expected[0].mean() is None
    assert [policy.expected[i].mean() for i in (1, 2, 3)] == pytest.approx([2.0, 3.0, 4.0])
    assert policy.observed[1].mean() is None  # the chain is not observed by a tree round
    assert [policy.observed[i].mean() for i in (2, 3)] == pytest.approx([2.5, 3.5])
    assert policy.buckets[2].round_ms[0].mean() == pytest.approx(1.0)
    assert policy.buckets[2].round_ms[3].mean() == pytest.approx(3.0)


def test_a_forced_list_takes_its_candidates_in_turn():
    """SGLANG_DDTREE_AUTO_FORCE=plain,15 (the GPU module's switch test): the decisions alternate, each held
    hold_rounds rounds, so rounds without a draft and drafted ones follow each other all run long."""
    policy = AutoBudgetPolicy([PLAIN, CHAIN, 15], widths=[1, 16, 16], config=auto.auto_config(
        environ={"SGLANG_DDTREE_AUTO_FORCE": "plain,15"}))
    picks = run_policy(policy, 1, [1.0, 3.0, 4.0], [1.0, 1.0, 1.0], 40)
    hold = DEFAULTS.hold_rounds
    assert picks == [(0 if (r // hold) % 2 == 0 else 2) for r in range(40)]
    with pytest.raises(ValueError, match="must name auto candidates"):
        AutoBudgetPolicy([CHAIN, 15], config=auto.auto_config(environ={"SGLANG_DDTREE_AUTO_FORCE": "plain,15"}))


def test_plain_step_outputs_one_committed_token_and_no_draft():
    choices = torch.tensor([[7], [3], [11]])
    prefix = torch.tensor([10, 0, 5], dtype=torch.int64)
    out = ops.chain_outputs(3, 15, torch.int64, "cpu")
    for t in out.values():
        t.fill_(-3)  # stale values of an earlier round in the reused buffers
    ops.plain_step(choices, prefix, out)
    assert out["accept_len"].tolist() == [0, 0, 0] and out["commit_lens"].tolist() == [1, 1, 1]
    assert out["bonus"].tolist() == [7, 3, 11] and out["new_seq_lens"].tolist() == [11, 1, 6]
    assert out["out_tokens"][:, 0].tolist() == [7, 3, 11] and not out["out_tokens"][:, 1:].any()
    assert not out["branch_lens"].any() and not out["summary"].any()


# ------------------------------------------------------------------------------------------------------ stages


def draft(bs=3, depth=6, vocab=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(bs, depth, vocab, generator=gen) * 2).log_softmax(-1)


@pytest.mark.parametrize("chosen", [CHAIN, 8, 16, 48])
def test_auto_tree_stage_gives_the_chosen_tree_and_every_expectation(chosen):
    candidates = (CHAIN, 8, 16, 48)
    lp = draft()
    values, tokens = topk_draft(lp, 40)
    roots = torch.tensor([1, 2, 3])
    prefix = torch.tensor([5, 9, 2])
    tree, ids, positions, expected = ops.auto_tree_stage(48, chosen, candidates, None, False, True, values,
                                                         tokens, roots, prefix)
    # an unsampled round builds the chosen tree directly, without the expectations
    tree2, ids2, positions2, zeros = ops.auto_tree_stage(48, chosen, candidates, None, False, False, values,
                                                         tokens, roots, prefix)
    for name in ("tokens", "parents", "depth", "scores", "ranks", "valid"):
        assert torch.equal(getattr(tree, name), getattr(tree2, name)), name
    assert torch.equal(ids, ids2) and torch.equal(positions, positions2) and not zeros.any()
    ref = chain_tree(lp, roots) if chosen == CHAIN else build_tree_from_topk(values, tokens, chosen, roots,
                                                                             max_budget=chosen)
    for name in ("tokens", "parents", "depth", "ranks", "valid"):
        assert torch.equal(getattr(tree, name), getattr(ref, name)), name
    assert torch.allclose(tree.scores, ref.scores)
    assert torch.equal(ids, ref.tokens.reshape(-1))
    assert torch.equal(positions, (prefix.unsqueeze(1) + ref.depth).reshape(-1))
    big = build_tree_from_topk(values, tokens, 48, roots, max_budget=48)
    want = adaptive.expected_acceptance(big, candidates, values[:, :, 0]).sum(dim=0)
    assert torch.allclose(expected, want)
    # each candidate's expectation is its own tree's 1 + sum of node probabilities, summed over the batch
    for c, e in zip(candidates, expected.tolist()):
        own = chain_tree(lp, roots) if c == CHAIN else build_tree_from_topk(values, tokens, c, roots, max_budget=c)
        assert e == pytest.approx(float((1 + torch.where(own.valid, own.scores.exp(), 0.0)[:, 1:].sum(1)).sum()),
                                  rel=1e-5)


def _rejecting_table(values, tokens, roots, rounds=3):
    """A table taught by rounds in which the target took no draft token: its factors fall below 1."""
    cal = adaptive.ScoreCalibrator(depth_limit=values.shape[1])
    for _ in range(rounds):
        tree = build_tree_from_topk(values, tokens, 48, roots, max_budget=48)
        cal.update(tree, walk_choices(tree, torch.full(tree.tokens.shape, -1)).path)
    return cal


def test_calibration_round_scores_predictions_and_leaves_learning_to_the_caller():
    """ops.calibration_round (the sampled walk stage's): the batch's |raw - committed| and |calibrated - committed|
    (both before learning) and its request count, over the real requests only; the table is not touched until the
    worker's `learn`, which then equals ScoreCalibrator.update on the real requests."""
    lp = draft(bs=3, seed=6)
    values, tokens = topk_draft(lp, 40)
    roots = torch.tensor([4, 5, 6])
    cal = _rejecting_table(values, tokens, roots, rounds=2)
    twin = adaptive.ScoreCalibrator(depth_limit=6)
    twin.load_state_dict(cal.state_dict())
    tree = build_tree_from_topk(values, tokens, 16, roots, max_budget=16)
    choice = torch.roll(tree.tokens, -1, dims=1)  # follows first children for a while
    walk = walk_choices(tree, choice)
    assert int(walk.accept_len.max()) >= 1
    committed = walk.accept_len[:2].float() + 1
    raw = 1 + torch.where(tree.valid, tree.scores.exp(), 0.0)[:, 1:].sum(dim=1)[:2]
    before = cal.state_dict()
    errors, delta = ops.calibration_round(cal, tree, walk, rows=torch.tensor(2))
    assert torch.equal(before["obs"], cal.obs) and torch.equal(before["pred"], cal.pred)
    assert float(errors[0]) == pytest.approx(float((raw - committed).abs().sum()), rel=1e-5)
    assert float(errors[1]) == pytest.approx(float((cal.expected(tree)[:2] - committed).abs().sum()), rel=1e-5)
    assert float(errors[2]) == 2
    monitor = CalibrationMonitor(cal, config=ON)
    monitor.learn(delta, 2)
    assert monitor.learnt == 2
    twin.update(tree, walk.path, active=torch.tensor([True, True, False]))
    for k in ("pred", "obs", "count"):
        assert torch.allclose(getattr(cal, k), getattr(twin, k), rtol=1e-12, atol=1e-12), k
    assert int(cal.rounds) == int(twin.rounds)


def test_calibration_monitor_totals_metrics_snapshots_and_reset(monkeypatch):
    """The host side of the table: MAE totals from the feedback, Prometheus counters, the table's gauges from a
    snapshot every TableGauges.EVERY rounds (published the round after its copy), and a reset that empties the table in
    place (captured graphs keep reading it) and sets the published gauges back to ratio 1, 0 observations."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from sglang_ddtree.sglang.prometheus import PrometheusSeries

    registry = prometheus_client.CollectorRegistry()
    prom = PrometheusSeries(depth_limit=6, budget="auto", registry=registry)
    lp = draft(seed=7)
    values, tokens = topk_draft(lp, 40)
    cal = _rejecting_table(values, tokens, torch.tensor([1, 2, 3]))
    monitor = CalibrationMonitor(cal, prom, ON)
    monkeypatch.setattr(TableGauges, "EVERY", 4)
    policy = Policy([CHAIN, 16])
    feedback = AutoFeedback(policy, "cpu", monitor)
    CALIBRATION_GATE = DEFAULTS.calibration_gate
    assert monitor.young()  # the gated predictor is the raw one until the table has learnt calibration_gate
    # request-rounds: a round pushed while young counts its raw error as the gated one, a later one its calibrated
    feedback.push(torch.tensor([8.0, 12.0, 7.0, 0.0, 3.0, 2.0, 4.0]), FakeTimer({"verify": 2.0}), 4, 0, 4,
                  young=monitor.young())
    feedback.push(torch.tensor([0.0, 0.0, 0.0, 9.0, 0.0, 0.0, 0.0]), FakeTimer({"verify": 2.0}), 4, 1, 4,
                  sampled=False)
    monitor.learnt = CALIBRATION_GATE
    assert not monitor.young()
    feedback.push(torch.tensor([8.0, 12.0, 7.0, 0.0, 2.0, 1.0, 4.0]), FakeTimer({"verify": 2.0}), 4, 0, 4,
                  young=monitor.young())
    assert feedback.drain() == 3
    assert monitor.export() == {"enabled": True, "scored_request_rounds": 8, "resets": 0, "tau_mae_raw": 0.625,
                                "tau_mae_calibrated": 0.375, "tau_mae_gated": 0.5}

    def sample(name, **labels):
        return registry.get_sample_value(name, {"budget": "auto", **labels})

    assert sample("sglang:ddtree_auto_tau_abs_error_total", scores="raw") == 5.0
    assert sample("sglang:ddtree_auto_tau_abs_error_total", scores="calibrated") == 3.0
    assert sample("sglang:ddtree_auto_tau_abs_error_total", scores="gated") == 4.0
    assert sample("sglang:ddtree_auto_tau_scored_total") == 8.0
    cell = {"depth": "1", "path_class": "0", "rank_class": "0"}
    for _ in range(4):
        monitor.after_round()
    assert sample("sglang:ddtree_calibration_observations", **cell) is None  # the copy is in flight
    monitor.after_round()
    rows = adaptive.summary_rows(cal.summary(), cal.config.prior_mass)
    first = next(r for r in rows if (r["depth"], r["path_class"], r["rank_class"]) == (1, 0, 0))
    assert sample("sglang:ddtree_calibration_observations", **cell) == pytest.approx(first["observations"])
    assert sample("sglang:ddtree_calibration_ratio", **cell) == pytest.approx(first["ratio"]) and first["ratio"] < 1
    ptr = cal.obs.data_ptr()
    monitor.learnt = 12
    monitor.reset()
    assert cal.obs.data_ptr() == ptr and float(cal.count.sum()) == 0 and monitor.learnt == 0 and monitor.young()
    assert monitor.export()["scored_request_rounds"] == 0 and monitor.export()["resets"] == 1
    assert sample("sglang:ddtree_calibration_observations", **cell) == 0
    assert sample("sglang:ddtree_calibration_ratio", **cell) == 1.0


def test_calibration_snapshots_wait_export_seconds_between_publishes(monkeypatch):
    """CalibrationMonitor.after_round (stats.TableGauges) reads the clock every EVERY rounds and starts a snapshot
    (published the round after its copy) only when SECONDS passed since the last one started; the first check
    publishes, and so does the one EVERY rounds after a reset (without that, the GPU server module's
    learn-again-after-a-reset check waited 10 s for the gauges)."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from sglang_ddtree.sglang import stats as stats_mod
    from sglang_ddtree.sglang.prometheus import PrometheusSeries

    clock = [1000.0]
    monkeypatch.setattr(stats_mod.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(TableGauges, "EVERY", 4)
    monkeypatch.setattr(TableGauges, "SECONDS", 10.0)
    registry = prometheus_client.CollectorRegistry()
    monitor = CalibrationMonitor(adaptive.ScoreCalibrator(), PrometheusSeries(depth_limit=6, budget="auto",
                                                                         registry=registry), ON)
    published = []
    monkeypatch.setattr(monitor.gauges, "publish", lambda summary: published.append(clock[0]))

    def rounds(n, seconds_each=1.0):
        for _ in range(n):
            clock[0] += seconds_each
            monitor.after_round()

    rounds(5)  # round 4 starts the first snapshot, round 5 publishes it
    assert published == [1005.0]
    rounds(7)  # rounds 8 and 12 check the clock: 4 and 8 s since round 4's start, too soon
    assert len(published) == 1
    rounds(5)  # round 16 (12 s after round 4) starts one, round 17 publishes
    assert published == [1005.0, 1017.0]
    rounds(8, seconds_each=0.1)  # rounds 20 and 24: under a second later
    assert len(published) == 2
    rounds(2, seconds_each=0.1)
    monitor.reset()  # round 26: publishes the empty table at once; rounds now count from the reset
    assert len(published) == 3
    rounds(3, seconds_each=0.1)  # no check at round 28: only EVERY rounds after the reset
    assert len(published) == 3
    rounds(2, seconds_each=0.1)  # round 4 after the reset (~1.5 s after round 16's start) starts one, 5 publishes
    assert len(published) == 4
    rounds(8, seconds_each=0.1)  # rounds 8 and 12 after it: the wait holds again after that publish
    assert len(published) == 4


def test_calibration_table_publish_resolves_each_cells_gauges_once():
    """PrometheusSeries.calibration_table: the first publish resolves every cell's two gauges with labels(), later
    publishes reuse them (each lookup builds and locks a label key), with the same values as resolving anew; a cell
    gone from the rows (a reset) goes back to ratio 1, 0 observations through the same gauges."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from sglang_ddtree.sglang.prometheus import PrometheusSeries

    registry = prometheus_client.CollectorRegistry()
    prom = PrometheusSeries(depth_limit=6, budget="auto", registry=registry)
    rows = [{"depth": 1, "path_class": 0, "rank_class": 0, "ratio": 0.8, "observations": 12.0},
            {"depth": 2, "path_class": 1, "rank_class": 1, "ratio": 0.5, "observations": 3.0}]
    prom.calibration_table(rows)
    calls = []
    for gauge in (prom._cal_ratio, prom._cal_obs):
        original = gauge.labels
        gauge.labels = lambda *a, _original=original, **kw: calls.append(kw) or _original(*a, **kw)
    prom.calibration_table([{**rows[0], "ratio": 0.7, "observations": 20.0}])

    def sample(name, **cell):
        return registry.get_sample_value(name, {"budget": "auto", **cell})

    first = {"depth": "1", "path_class": "0", "rank_class": "0"}
    second = {"depth": "2", "path_class": "1", "rank_class": "1"}
    assert calls == []
    assert sample("sglang:ddtree_calibration_ratio", **first) == 0.7
    assert sample("sglang:ddtree_calibration_observations", **first) == 20.0
    assert sample("sglang:ddtree_calibration_ratio", **second) == 1.0  # gone from the rows: back to raw
    assert sample("sglang:ddtree_calibration_observations", **second) == 0.0
    prom.calibration_table([{**rows[0], "depth": 3}])  # a cell never published: resolved once, here
    assert [c["depth"] for c in calls] == ["3", "3"]
    assert sample("sglang:ddtree_calibration_ratio", depth="3", path_class="0", rank_class="0") == 0.8


def test_observed_tokens_equal_walking_each_smaller_tree():
    """At T=0 the target's choice at a node depends only on its prefix: walking the 48-tree tells what the 8- and
    16-trees would have committed (their trees are its first slots)."""
    candidates = (CHAIN, 8, 16, 48)
    lp = draft(bs=6, seed=3)
    values, tokens = topk_draft(lp, 40)
    roots = torch.zeros(6, dtype=torch.long)
    big = build_tree_from_topk(values, tokens, 48, roots, max_budget=48)
    gen = torch.Generator().manual_seed(1)
    # a scripted "target": at each prefix, a token of a random child (deterministic per prefix via a table)
    table = torch.randint(0, 40, (6, 7, 40), generator=gen)

    def target(tree):  # choice at node = table[b, depth, token]: depends on the node's own (depth, token) only
        return table[torch.arange(tree.batch_size).unsqueeze(1), tree.depth, tree.tokens]

    # make the table follow the drafter's best children often, so deep and branching paths are accepted
    for b in range(6):
        for i in range(1, 49):
            kids = ((big.parents[b] == i) & big.valid[b]).nonzero().view(-1)
            if len(kids) and torch.rand((), generator=gen) < 0.8:
                kid = kids[torch.randint(0, len(kids), (1,), generator=gen)]
                table[b, big.depth[b, i], big.tokens[b, i]] = big.tokens[b, kid]
        table[b, 0, roots[b]] = big.tokens[b, 1]
    walk = walk_choices(big, target(big))
    assert int(walk.accept_len.max()) >= 3
    observed = ops.observed_tokens(candidates, 48, big, walk)
    assert observed[0] == 0  # the chain is not observed by a tree round
    for c, o in zip(candidates[1:], observed[1:].tolist()):
        small = build_tree_from_topk(values, tokens, c, roots, max_budget=c)
        assert o == float((walk_choices(small, target(small)).accept_len + 1).sum()), c
    chain = chain_tree(lp, roots)
    chain_walk = walk_choices(chain, target(chain))
    assert ops.observed_tokens(candidates, CHAIN, chain, chain_walk).tolist() == [
        float((chain_walk.accept_len + 1).sum()), 0.0, 0.0, 0.0]


def test_sampling_backs_off_while_the_chain_leads_or_runs():
    """Sampled rounds (top-K and tree at the largest budget) every SAMPLE_EVERY rounds while nothing is known or a
    tree is being chosen; every SAMPLE_EVERY_IDLE rounds once the chain's rate beats every tree's best case by more
    than CLOSE, or once the chain has been chosen in all but CHAIN_RUN_OTHERS of the bucket's last CHAIN_RUN rounds
    (trees close in their best case but never winning: the dummy 8B drafter); back to SAMPLE_EVERY when a
    tree wins rounds again, and to SAMPLE_EVERY_IDLE once that tree's decisions have settled (settled_hold)."""
    CHAIN_RUN, CLOSE = DEFAULTS.chain_run, DEFAULTS.close
    SAMPLE_EVERY, SAMPLE_EVERY_IDLE = DEFAULTS.sample_every, DEFAULTS.sample_every_idle
    assert SAMPLE_EVERY_IDLE % SAMPLE_EVERY == 0 and SAMPLE_EVERY_IDLE > SAMPLE_EVERY
    if True:
        policy = Policy([CHAIN, 16, 32], explore_rounds=2, probe_every=1000)
        assert policy.sample_interval(1) == SAMPLE_EVERY  # nothing measured
        # chain 0.2 tokens/ms; the 16-tree at best 2.05 / (20 x 0.9) = 0.114 < (1 - CLOSE) x 0.2; the 32-tree
        # unexplored, bounded by the narrower ones' dearest time
        picks = run_policy(policy, 1, [2.0, 2.05, 2.1], [10.0, 20.0, 30.0], rounds=20)
        assert 2.05 / (20.0 * 0.9) < (1 - CLOSE) * 0.2
        assert len(picks) < CHAIN_RUN and policy.sample_interval(1) == SAMPLE_EVERY_IDLE  # by CLOSE, before any run
        assert policy.sample_interval(8) == SAMPLE_EVERY  # another batch-size bucket knows nothing yet
        # the trees win: the 16-tree's rate 5 / 20 = 0.25 beats the chain's, it is chosen, sampling resumes
        picks, intervals = [], []
        for _ in range(400):
            picks += run_policy(policy, 1, [2.0, 5.0, 5.5], [10.0, 20.0, 30.0], rounds=1)
            intervals.append(policy.sample_interval(1))
        first = picks.index(1)
        assert picks[-1] == 1 and intervals[first] == SAMPLE_EVERY
        settled = policy.buckets[1].settled
        assert settled and intervals[-1] == SAMPLE_EVERY_IDLE

    # Trees close in their best case, never chosen: 3.5 / (20 x 0.9) = 0.194 >= (1 - CLOSE) x 0.2, so CLOSE alone
    # keeps sampling often; the chain's run backs it off once CHAIN_RUN rounds were (nearly) all the chain.
    policy = Policy([CHAIN, 16, 32], explore_rounds=2, probe_every=1000)
    picks = run_policy(policy, 1, [2.0, 3.5, 4.0], [10.0, 20.0, 30.0], rounds=8)
    assert 3.5 / (20.0 * 0.9) >= (1 - CLOSE) * 0.2 and 1 in picks  # explored, lost
    assert policy.sample_interval(1) == SAMPLE_EVERY
    picks = run_policy(policy, 1, [2.0, 3.5, 4.0], [10.0, 20.0, 30.0], rounds=CHAIN_RUN)
    assert set(picks) == {0} and policy.sample_interval(1) == SAMPLE_EVERY_IDLE


def test_a_sparse_sample_weighs_as_the_samples_it_stands_for():
    """Expectations come from sampled rounds only; one sampled round after n rounds moves the decayed means as
    n / SAMPLE_EVERY samples would, so backing off to SAMPLE_EVERY_IDLE does not slow how fast they follow the
    drafter (in rounds)."""
    SAMPLE_EVERY, SAMPLE_EVERY_IDLE = DEFAULTS.sample_every, DEFAULTS.sample_every_idle

    def after(every, rounds):
        policy = Policy([CHAIN, 16], half_life_rounds=20.0)
        for r in range(rounds):
            sampled = r % every == 0
            value = 1.0 if r < rounds // 2 else 3.0  # the drafter changes half way
            policy.observe(1, 0, 1, 5.0, [value, value] if sampled else None, [value, None] if sampled else None)
        return policy.expected[1].mean()

    dense, sparse = after(SAMPLE_EVERY, 320), after(SAMPLE_EVERY_IDLE, 320)
    assert 2.0 < dense < 3.0 and 2.0 < sparse < 3.0
    assert sparse == pytest.approx(dense, abs=0.15)
    # unweighted, the sparse means would lag far behind: 10 samples of 1.0 then 10 of 3.0 at the same decay
    slow = Policy([CHAIN, 16], half_life_rounds=20.0)
    for value in [1.0] * 10 + [3.0] * 10:
        slow.expected[1].add(value, 1.0, slow.keep)
    assert slow.expected[1].mean() < sparse - 0.2


def run_noisy(seed, base, tokens, expected, rounds, batch, noise, outlier, lag=2):
    """The worker's feeding with noisy timings (ddtree_bench.auto_sim): each round's ms is base x
    lognormal(noise), doubled with probability `outlier`; first rounds cold; sampled rounds carry the expectations;
    observations `lag` rounds late. Returns the picks."""
    from ddtree_bench.auto_sim import simulate

    return simulate(seed, base, tokens, expected, rounds, batch, noise, outlier, lag)


def test_policy_is_not_stuck_on_the_chain_by_one_slow_sample():
    """The tiny pair at batch 4: host-bound rounds cost about the same at every width (timings +-10%, 5% of
    them doubled) while wider trees commit more (5.5 -> 6.7 tokens), and `auto` ran the chain in 722 of 746 rounds.
    With floors and rates from decayed means, one slow sample of a rarely verified tree raised every wider tree's
    floor and the chooser stopped exploring (6 of 20 seeds below 0.9 of the best candidate's rate); floors from the
    least recent time and rates from the median keep every seed near the best."""
    base = [4.6, 4.7, 4.6, 4.8, 4.7]
    tokens = [5.47, 5.62, 6.05, 6.59, 6.69]
    best = max(t / b for t, b in zip(tokens, base))
    ratios = []
    for seed in range(20):
        picks = run_noisy(seed, base, tokens, [8.0, 9.0, 10.5, 12.0, 13.0], 750, 4, noise=0.10, outlier=0.05)
        ratios.append(sum(tokens[i] / base[i] for i in picks) / len(picks) / best)
    assert min(ratios) > 0.93 and sum(ratios) / len(ratios) > 0.97, ratios


def test_noisy_dummy_drafter_at_batch_16_still_runs_the_chain():
    """The dummy-drafter case above (8B shapes, batch 16, a drafter never right: every candidate commits 1 token,
    wider verifies cost up to 6.6x) with noisy timings: the wide trees stay unverified and the rate stays within 2% of
    the chain's (with decayed means one seed ran the 16-tree for 380 of 400 rounds after one slow chain round:
    0.955)."""
    base = [11.0, 11.5, 20.0, 38.0, 73.0]
    for seed in range(10):
        picks = run_noisy(seed, base, [1.0] * 5, [1.5, 2.0, 3.0, 4.0, 6.0], 400, 16, noise=0.03, outlier=0.01)
        assert picks.count(3) + picks.count(4) <= 1, seed
        rate = sum(1.0 / base[i] for i in picks) / len(picks)
        assert rate > 0.98 / base[0], seed


def test_a_flat_cost_curve_runs_the_widest_tree():
    """The tiny pair at batch 1: every tree's round costs about the same (host-bound) and the 128-tree commits
    the most, yet `auto` gave a third of its rounds to narrower trees whose recent median happened to come out
    lower. With the trees' times drawn toward their pooled time by their medians' standard error (SHRINK_Z) the
    widest tree runs nearly throughout (benchmarks/simulate_auto_flat.py: 66% -> 97% of the rounds at noise 0.10)."""
    from ddtree_bench.auto_sim import rate_over_best, simulate

    base, tokens, expected = [4.4] * 5, [2.55, 3.86, 4.13, 4.37, 4.54], [3.85, 4.62, 5.01, 5.36, 5.70]
    shares, ratios = [], []
    for seed in range(4):
        picks = simulate(seed, base, tokens, expected, 2000, 4, noise=0.10, outlier=0.05)[300:]
        shares.append(picks.count(4) / len(picks))
        ratios.append(rate_over_best(picks, base, tokens))
    assert min(shares) > 0.85 and min(ratios) > 0.99, (shares, ratios)


def test_policy_holds_through_slow_host_phases():
    """Host-bound tiny rounds move in phases (whole runs of one row 20-40% apart in a sweep): every candidate's rounds
    1.6x slower for stretches of ~300 rounds. The medians of recent times then mix phases, but as the phases slow all
    candidates alike the picks stay near the best (benchmarks/simulate_auto_phases.py, 20 seeds x 3000 rounds: worst
    seed 0.96, mean 0.99 of the best rate)."""
    from ddtree_bench.auto_sim import rate_over_best, simulate

    base = [4.6, 4.7, 4.6, 4.8, 4.7]
    tokens = [5.47, 5.62, 6.05, 6.59, 6.69]
    ratios = [rate_over_best(simulate(seed, base, tokens, [8.0, 9.0, 10.5, 12.0, 13.0], 2000, 4, noise=0.10,
                                      phase_mult=1.6, phase_len=300), base, tokens) for seed in range(10)]
    assert min(ratios) > 0.95 and sum(ratios) / len(ratios) > 0.97, ratios


def test_policy_holds_under_host_and_text_noise():
    """What tiny batch-1 servers showed the simulation had left out, all at once on the flat tiny-like case: sampled
    rounds cost more, the host's speed drifts (AR(1), sd 0.2 over ~250 rounds), and what a round commits moves with
    the text (sd 0.4 over ~500 rounds) and per round (token noise 0.6), the drafter's expectations following half of
    it (simulate_auto_flat.py at batch 4, 8 seeds: 0.985 / 0.959 of the best rate, mean / min, before exact ties went
    to the wider tree; 0.984 / 0.969 after, the widest tree in 74% of the rounds). Here batch 1, 4 seeds."""
    from ddtree_bench.auto_sim import rate_over_best, simulate

    base, tokens, expected = [4.4] * 5, [2.55, 3.86, 4.13, 4.37, 4.54], [3.85, 4.62, 5.01, 5.36, 5.70]
    ratios, shares = [], []
    for seed in range(4):
        picks = simulate(seed, base, tokens, expected, 2000, 1, noise=0.10, outlier=0.05, sampled_ms=0.3,
                         drift_sigma=0.2, drift_rounds=250, content_sigma=0.4, content_rounds=500,
                         token_noise=0.6)[300:]
        ratios.append(rate_over_best(picks, base, tokens))
        shares.append(picks.count(4) / len(picks))
    assert min(ratios) > 0.96 and sum(ratios) / len(ratios) > 0.975, ratios
    assert sum(shares) / len(shares) > 0.6, shares  # the widest tree runs most rounds


def test_simulated_host_drift_and_text_noise_move_what_they_should():
    """auto_sim's host and text noise knobs: drift and sampled-round cost change only round times (the same picks when
    times are all alike and the widest commits the most by far), text noise changes what rounds commit; none of
    them touches the random stream of a simulation that does not use it (earlier results reproduce)."""
    from ddtree_bench.auto_sim import simulate

    base, tokens, expected = [4.4] * 5, [2.55, 3.86, 4.13, 4.37, 4.54], [3.85, 4.62, 5.01, 5.36, 5.70]
    plain = simulate(3, base, tokens, expected, 600, 4, noise=0.10, outlier=0.05)
    assert simulate(3, base, tokens, expected, 600, 4, noise=0.10, outlier=0.05, drift_sigma=0.0,
                    sampled_ms=0.0, content_sigma=0.0, token_noise=0.0) == plain
    assert simulate(3, base, tokens, expected, 600, 4, noise=0.10, outlier=0.05, drift_sigma=0.3,
                    drift_rounds=100) != plain


def test_simulated_poisson_tokens_keep_a_wider_tree_at_or_above_a_narrower_one():
    """poisson_tokens: each round's committed tokens are drawn (a wider tree adds a Poisson count to the narrower
    one's), so per round the observed tree candidates never decrease with width, their means follow `tokens`, and
    a new prompt every prompt_rounds rounds moves them together."""
    from ddtree_bench.auto_sim import CANDIDATES, simulate

    seen = []

    class Recording(AutoBudgetPolicy):
        def observe(self, bucket, chosen, batch_size, round_ms, expected_sum, observed_sum):
            seen.append(observed_sum)
            super().observe(bucket, chosen, batch_size, round_ms, expected_sum, observed_sum)

    widths = [16] + [c + 1 for c in CANDIDATES[1:]]
    tokens = [2.5, 3.0, 3.5, 4.5, 5.0]
    policy = Recording(list(CANDIDATES), widths=widths, config=AutoConfig(explore_all=True))
    simulate(0, [4.4] * 5, tokens, [3.0, 4.0, 5.0, 6.0, 7.0], 3000, 1, noise=0.1, policy=policy,
             poisson_tokens=True, prompt_sigma=0.3, prompt_rounds=350)
    trees = [[o for o in obs[1:] if o is not None] for obs in seen]
    assert all(a <= b for t in trees for a, b in zip(t, t[1:]))
    assert all(float(o).is_integer() for obs in seen for o in obs if o is not None)
    firsts = [obs[1] for obs in seen if obs[1] is not None]
    assert len(firsts) > 1000 and 2.4 < sum(firsts) / len(firsts) < 3.8  # 1 + 2.0 x exp(text), text ~ N(0, 0.3)


def test_auto_config_reads_its_variables_when_asked_and_checks_them():
    """auto_config (called when the worker starts, nothing read at import): the calibration flag's value and the
    variables of USER_KNOBS; unset or empty, each is the AutoConfig default; a bad value is refused by name."""
    assert auto.auto_config(environ={}) == AutoConfig()
    assert auto.auto_config(False, environ={}) == AutoConfig(calibration=False)
    got = auto.auto_config(environ={"SGLANG_DDTREE_AUTO_LOG_EVERY": "100", "SGLANG_DDTREE_AUTO_FORCE": " Chain ",
                                    "SGLANG_DDTREE_AUTO_EXPLORE_ALL": "1"})
    assert (got.log_every, got.force, got.explore_all) == (100, "chain", True)
    assert auto.auto_config(environ={"SGLANG_DDTREE_AUTO_LOG_EVERY": "", "SGLANG_DDTREE_AUTO_EXPLORE_ALL": "0"}) \
        == AutoConfig()
    for name, bad in (("SGLANG_DDTREE_AUTO_LOG_EVERY", "0"), ("SGLANG_DDTREE_AUTO_LOG_EVERY", "-5"),
                      ("SGLANG_DDTREE_AUTO_LOG_EVERY", "often"), ("SGLANG_DDTREE_AUTO_EXPLORE_ALL", "yes")):
        with pytest.raises(ValueError, match=name):
            auto.auto_config(environ={name: bad})
    with pytest.raises(ValueError, match="SGLANG_DDTREE_AUTO_HOLD_MAX: no such"):  # a deleted knob
        auto.auto_config(environ={"SGLANG_DDTREE_AUTO_HOLD_MAX": "4", "SGLANG_DDTREE_AUTO_AB": "8"})
    with pytest.raises(ValueError, match="times_expire"):
        AutoConfig(times_expire=-1)
    with pytest.raises(ValueError, match="sample_every"):
        AutoConfig(sample_every=0)
    with pytest.raises(ValueError, match="multiple of sample_every"):
        AutoConfig(sample_every=4, sample_every_idle=10)


def test_the_knobs_are_what_the_docs_say():
    """USER_KNOBS (at most five, the issue's limit) and the measuring modes are exactly the names in
    docs/adaptive-budget.md's "Knobs" table, each landing in an AutoConfig field (or the flags' options); no other
    SGLANG_DDTREE_AUTO_* variable is read anywhere in the package."""
    import dataclasses
    import pathlib

    from sglang_ddtree.sglang import auto_ab

    root = pathlib.Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "adaptive-budget.md").read_text()
    section = doc.split("## Knobs", 1)[1].split("\n## ", 1)[0]
    rows = [re.split(r"[ =]", line.split("|")[1].strip().strip("`"))[0] for line in section.splitlines()
            if line.startswith("| `")]
    assert rows == list(auto.USER_KNOBS) + list(auto_ab.MEASURING_MODES)
    assert len(auto.USER_KNOBS) <= 5
    fields = {f.name for f in dataclasses.fields(AutoConfig)}
    assert all(field is None or field in fields for field in auto.USER_KNOBS.values())
    assert all(knob.startswith("--") or knob.startswith("SGLANG_DDTREE_AUTO_") for knob in rows)
    flags = {knob for knob in auto.USER_KNOBS if knob.startswith("--")}
    assert flags <= set(ddtree_args.FLAG_DEST)
    variables = set()
    for path in (root / "sglang_ddtree").rglob("*.py"):
        variables |= set(re.findall(r"SGLANG_DDTREE_AUTO_[A-Z_]+", path.read_text()))
    assert variables == set(rows) - flags, variables ^ (set(rows) - flags)


def test_shrink_z_changes_the_picks_on_a_flat_cost_curve():
    """AutoConfig.shrink_z (test_a_flat_cost_curve_runs_the_widest_tree's case): without the time shrinkage the
    picks differ from the default's."""
    from ddtree_bench import auto_sim

    base, tokens, expected = [4.4] * 5, [2.55, 3.86, 4.13, 4.37, 4.54], [3.85, 4.62, 5.01, 5.36, 5.70]
    widths = [16] + [c + 1 for c in auto_sim.CANDIDATES[1:]]

    def run(**config):
        policy = Policy(list(auto_sim.CANDIDATES), widths=widths, **config)
        return auto_sim.simulate(1, base, tokens, expected, 1200, 4, noise=0.10, outlier=0.05, policy=policy)

    assert run() != run(shrink_z=0.0) and run() == run(shrink_z=DEFAULTS.shrink_z)


class Table:
    """What WalkSchedule reads of a CalibrationMonitor: request-rounds learnt and scored since the last reset."""

    def __init__(self, learnt=10 ** 6, request_rounds=10 ** 6):
        self.learnt, self.request_rounds = learnt, request_rounds


def test_walk_schedule_scores_the_first_sampled_tree_round_then_one_in_every():
    """Unsampled rounds walk plain, sampled chain rounds sampled (never scored), and of the sampled tree rounds the
    first and then every calibration_every-th run the calibration scoring, however chain rounds interleave."""
    from sglang_ddtree.sglang.auto import WalkSchedule

    assert DEFAULTS.calibration_every == WalkSchedule(ON).every > 1 and not WalkSchedule().enabled
    grown = Table()
    schedule = WalkSchedule(AutoConfig(calibration=True, calibration_every=3))
    rounds = [(False, False), (False, True), (True, True), (False, True), (False, False), (False, True),
              (True, True), (False, True), (False, True), (True, False), (False, True)]  # (chain, sampled)
    got = [schedule.variant(chain, sampled, grown) for chain, sampled in rounds]
    assert got == ["plain", "scored", "sampled", "sampled", "plain", "sampled", "sampled", "scored", "sampled",
                   "plain", "sampled"]
    every_one = WalkSchedule(AutoConfig(calibration=True, calibration_every=1))
    assert [every_one.variant(False, True, grown) for _ in range(3)] == ["scored"] * 3
    # while the table is young every sampled tree round scores, and the cadence goes on from there afterwards
    schedule = WalkSchedule(AutoConfig(calibration=True, calibration_every=3))
    young = Table(request_rounds=DEFAULTS.calibration_young - 1)
    got = [schedule.variant(False, True, young) for _ in range(4)] + [schedule.variant(True, True, young)]
    assert got == ["scored"] * 4 + ["sampled"]  # the chain never scores
    assert [schedule.variant(False, True, grown) for _ in range(4)] == ["sampled", "sampled", "scored", "sampled"]
    # while it learns all (calibration_learn_all) every tree round scores, sampled or not (an unsampled one through
    # the "learn" walk, which follows the unsampled tree stage); the chain never does, and only the sampled tree round
    # moves the cadence (one step: 9 % 3 scores next)
    learning = Table(learnt=DEFAULTS.calibration_learn_all - 1)
    got = [schedule.variant(chain, sampled, learning)
           for chain, sampled in [(False, False), (False, True), (True, False), (True, True), (False, False)]]
    assert got == ["learn", "scored", "plain", "sampled", "learn"]
    assert WalkSchedule.SCORED == {"scored", "learn"} and WalkSchedule.SAMPLED_TREE == {"sampled", "scored"}
    assert [schedule.variant(False, True, grown) for _ in range(3)] == ["scored", "sampled", "sampled"]
    assert schedule.variants(False) == WalkSchedule.VARIANTS and schedule.variants(True) == ("plain", "sampled")
    with pytest.raises(ValueError, match="calibration_every"):
        AutoConfig(calibration_every=0)


def test_calibration_off_builds_and_runs_no_scored_walk_and_publishes_nothing():
    """--speculative-ddtree-auto-calibration off (AutoConfig.calibration): no candidate needs a scored or learn walk
    stage, no round runs one (young table, learn-all phase or not), and the monitor publishes no table; its export
    says so. What is left of a tree round's walk is the fixed tree's plus, when sampled, the observed tokens."""
    from sglang_ddtree.sglang.auto import WalkSchedule

    off = AutoConfig(calibration=False)
    schedule = WalkSchedule(off)
    assert schedule.variants(False) == schedule.variants(True) == ("plain", "sampled")
    fresh = Table(learnt=0, request_rounds=0)
    got = {schedule.variant(chain, sampled, fresh) for chain in (False, True) for sampled in (False, True)
           for _ in range(8)}
    assert got == {"plain", "sampled"}
    published = []
    prometheus = type("P", (), {"calibration_table": lambda self, rows: published.append(rows)})()
    monitor = CalibrationMonitor(adaptive.ScoreCalibrator(), prometheus, config=off)
    assert CalibrationMonitor(adaptive.ScoreCalibrator(), prometheus, ON).gauges is not None  # on: it would publish
    assert CalibrationMonitor(adaptive.ScoreCalibrator(), prometheus).gauges is None  # off by default
    for _ in range(3 * TableGauges.EVERY):
        monitor.after_round()
    monitor.reset()
    assert published == [] and monitor.gauges is None and monitor.export()["enabled"] is False
    assert not ddtree_args.parse_options(budget="auto").auto_calibration  # off by default
    assert ddtree_args.parse_options(budget="auto", auto_calibration="on").auto_calibration


def test_bucket_statistics_kept_per_round_equal_recomputing_them():
    """_Bucket keeps each candidate's median / spread / least of its last `recent` times and the count of non-chain
    choices in its last `chain_run` choices as rounds arrive (the chooser reads them every round): equal to
    recomputing them from the windows, across the windows' roll-over."""
    import random

    policy = Policy([0, 16, 64])
    b = policy._bucket(1)
    rng = random.Random(3)
    for _ in range(300):
        i = rng.randrange(3)
        b.timed(i, rng.uniform(3.0, 6.0))
        b.chose(rng.choice([0, 0, 0, 1, 2]))
        for j in range(3):
            xs = sorted(b.recent[j])
            if not xs:
                assert b.median[j] is None and b.least[j] is None
                continue
            n = len(xs)
            assert (b.median[j], b.least[j]) == (xs[n // 2], xs[0])
            assert b.spread[j] == pytest.approx(0.7413 * (xs[(3 * n) // 4] - xs[n // 4]))
        assert len(b.last_choices) <= DEFAULTS.chain_run
        assert b.others_in_run == sum(c != 0 for c in b.last_choices)


def test_a_decision_holds_for_hold_rounds_and_the_feedback_is_read_only_before_one():
    """auto.HOLD_ROUNDS / HOLD_MAX: a choice of the best runs HOLD_ROUNDS rounds of its bucket without a decision
    (deciding() is false meanwhile, so the worker leaves the feedback queued), and each repeat of that choice holds
    twice as long, up to HOLD_MAX; exploration rounds decide one by one; a candidate that becomes the best is picked
    up at the next decision, at most HOLD_MAX rounds later, and its holds start over at HOLD_ROUNDS. Driven as the
    worker drives it: feedback read only when deciding, `lag` rounds late."""
    HOLD_ROUNDS, HOLD_MAX = DEFAULTS.hold_rounds, DEFAULTS.hold_max
    assert (HOLD_ROUNDS, HOLD_MAX) == (4, 64)  # the pattern below is written for them
    policy = Policy([CHAIN, 16, 64], explore_rounds=1, probe_every=10_000)
    tokens, ms = [3.0, 4.0, 5.0], [1.0, 1.1, 1.2]  # rates 3.0, 3.64, 4.17: the 64-tree wins
    queue, picks, decided = [], [], []
    for r in range(300):
        if r == 100:
            ms = [1.0, 1.1, 2.0]  # the 64-tree gets dear: the 16-tree wins from here
        deciding = policy.deciding(1)
        if deciding:
            while len(queue) > 1:  # what completed on the GPU (one round in flight)
                j = queue.pop(0)
                policy.observe(1, j, 1, ms[j], [1.5 * t for t in tokens],
                               [t if s else None for t, s in zip(tokens, observed_candidates(policy.candidates, j))])
        i = policy.choose(1)
        picks.append(i)
        decided.append(deciding)
        queue.append(i)
    # exploration, narrowest first, each waiting for the one before's time: every round decides
    assert [i for i in picks[:6] if i] == [1, 2, 1] and all(decided[:7])
    runs = [n for n in range(1, 300) if picks[n] != picks[n - 1]]
    assert all(decided[n] for n in runs)  # the choice changes only where a decision was made
    switch = picks.index(1, 10)
    assert 100 < switch <= 100 + HOLD_MAX  # the dearer 64-tree left at the first decision that saw its times
    for first, last in ((6, switch), (switch, 300)):  # the holds of each settled choice: 4, 8, 16, 32, 64, 64, ...
        settled = [n for n in range(first, last) if decided[n]]
        gaps = [b - a for a, b in zip(settled, settled[1:])]
        assert gaps == [min(HOLD_MAX, HOLD_ROUNDS << k) for k in range(len(gaps))] and len(gaps) >= 4, gaps
    assert picks[10:100] == [2] * 90 and picks[switch:] == [1] * (300 - switch)


def test_holds_grow_only_once_the_wider_candidates_were_explored_and_end_at_the_next_probe():
    """HOLD_MAX's limits: while a candidate wider than the choice is still unexplored (its cost floor keeps it out:
    it cannot win yet) a repeated decision holds HOLD_ROUNDS, so a chance to explore it is not missed for HOLD_MAX
    rounds (the simulator's tiny-like starts lost 1-2% of the best rate with holds growing from the start); a
    narrower one that never could win does not stop the growth (the tiny pair's 128-tree over a chain that is never
    explored); and no hold runs past the bucket's next scheduled probe, so probes keep their schedule (probe_every)."""
    HOLD_ROUNDS = DEFAULTS.hold_rounds

    # the 64-tree's floor (the 16-tree's least time) x its tokens stays below the chain's rate: never explored, and
    # the chain's repeated decisions keep holding HOLD_ROUNDS
    policy = Policy([CHAIN, 16, 64], explore_rounds=2, probe_every=10_000)
    picks = run_policy(policy, 1, [3.0, 3.05, 3.1], [1.0, 2.0, 2.1], rounds=200)
    b = policy.buckets[1]
    assert 2 not in picks and b.measured[2] == 0
    assert picks[-150:] == [0] * 150 and b.streak == 0 and not b.settled
    # (with explore_rounds=1 the 64-tree is tried once at the start, and the chain's holds grow)
    policy = Policy([CHAIN, 16, 64], explore_rounds=1, probe_every=10_000)
    picks = run_policy(policy, 1, [3.0, 3.05, 3.1], [1.0, 2.0, 2.1], rounds=200)
    assert policy.buckets[1].streak >= 4 and picks[-150:] == [0] * 150
    # a dear 16-tree, out after two of its three exploration rounds: the 64-tree's repeated decisions hold longer
    # and longer all the same
    policy = Policy([CHAIN, 16, 64], explore_rounds=3, probe_every=10_000)
    picks = run_policy(policy, 1, [1.0, 1.5, 5.0], [1.0, 3.0, 1.2], rounds=300)
    b = policy.buckets[1]
    assert b.measured[1] < policy.config.explore_rounds and picks[-150:] == [2] * 150 and b.streak >= 4 and b.settled
    # every candidate explored, probes every 50 rounds: holds grow, but each ends by the next probe round
    policy = Policy([CHAIN, 16, 64], explore_rounds=1, probe_every=50)
    tokens, ms = [3.0, 4.0, 5.0], [1.0, 1.1, 1.2]
    queue, checks, longest = [], [], 0
    for r in range(400):
        if policy.deciding(1):
            while len(queue) > 1:
                j = queue.pop(0)
                policy.observe(1, j, 1, ms[j], [1.5 * t for t in tokens],
                               [t if s else None for t, s in zip(tokens, observed_candidates(policy.candidates, j))])
        before = policy.buckets[1].next_probe if 1 in policy.buckets else None
        queue.append(policy.choose(1))
        b = policy.buckets[1]
        if before is not None and b.next_probe != before:
            checks.append(b.rounds)  # the scheduled probe check ran in this round
        assert b.rounds + b.hold <= max(b.next_probe - 1, b.rounds + HOLD_ROUNDS - 1)  # ends by the next probe
        longest = max(longest, b.hold + 1)
    assert b.settled and longest > 2 * HOLD_ROUNDS
    assert len(checks) >= 6 and all(q - p == 50 for p, q in zip(checks, checks[1:])), checks


def test_a_round_that_waits_for_exploration_samples_at_the_usual_interval():
    """A settled bucket samples one round in SAMPLE_EVERY_IDLE (SETTLED_HOLD); exploration starts that over: a round
    that waits for an explored candidate's first time (its round in flight) samples at SAMPLE_EVERY again."""
    SAMPLE_EVERY, SAMPLE_EVERY_IDLE = DEFAULTS.sample_every, DEFAULTS.sample_every_idle

    policy = Policy([CHAIN, 16], explore_rounds=1, probe_every=10_000)
    for _ in range(3):
        policy.observe(1, 0, 1, 1.0, [3.0, 4.0], [2.0, None])
    b = policy.buckets[1]
    b.settled = True
    assert policy.sample_interval(1) == SAMPLE_EVERY_IDLE
    b.tried[1] = 1  # the 16-tree explored, its time not back yet
    assert policy.choose(1) == 0 and b.waited[1] == 1  # the best known runs meanwhile
    assert not b.settled and policy.sample_interval(1) == SAMPLE_EVERY


def test_explore_best_elsewhere_tries_another_buckets_best_despite_its_cost_floor():
    """A new bucket whose narrower tree's first times read slow (10x) floors the 64-tree out of exploration (a
    bucket alone never explores it); the 64-tree, best in bucket 1, is explored anyway and wins there too. A
    candidate explored that way is not stale-probed while its best case stays below STALE_HOPE of the best rate; the
    others still are."""
    STALE_HOPE, STALE_ROUNDS = DEFAULTS.stale_hope, DEFAULTS.stale_rounds

    tokens = [3.0, 4.0, 5.0]

    def feed(policy, bucket, ms, rounds):
        picks = []
        for _ in range(rounds):
            i = policy.choose(bucket)
            cold = i not in picks
            picks.append(i)
            policy.observe(bucket, i, 1, None if cold else ms[i], [1.5 * t for t in tokens],
                           [t if s else None for t, s in zip(tokens, observed_candidates(policy.candidates, i))])
        return picks

    def run(elsewhere, ms4):
        # explore_rounds=3: a cold round, then the two timed ones a candidate's times need to bound floors
        # (floor_min_times; with explore_rounds=2 the 16-tree's one timed round would floor nothing)
        policy = Policy([CHAIN, 16, 64], explore_rounds=3, probe_every=16)
        if elsewhere:
            assert feed(policy, 1, [1.0, 1.0, 1.0], 40)[-1] == 2  # bucket 1: the 64-tree's rate is the best
        return feed(policy, 4, ms4, 2 * STALE_ROUNDS)

    assert 2 not in run(False, [1.0, 10.0, 1.1])  # floored out by the 16-tree's 10x: 5 / 10 < the chain's 3 / 1
    picks = run(True, [1.0, 10.0, 1.1])
    assert picks.index(2) < 10 and picks[-100:].count(2) >= 90
    picks = run(True, [1.0, 10.0, 5.0])  # the 64-tree explored, then far from winning: 5 / (5 x 0.9) < 0.5 x 3 / 1
    assert 5.0 / (5.0 * 0.9) < STALE_HOPE * 3.0 and picks[:10].count(2) == 3  # its explore rounds
    assert picks[10:].count(2) == 0 and picks[STALE_ROUNDS:].count(1) >= 1  # the 16-tree is still re-measured


def test_floor_min_times_keeps_one_slow_first_round_from_flooring_the_wider_trees():
    """Servers' batch-1 starts: the first tree explored after the leaders read ~2x slow in its one timed round
    (after its cold first one); through the secant that time floored every wider tree out of exploration until a stale
    probe. With floor_min_times=2 one time bounds no floor: the tree is explored again, reads its true cost, and the
    128-tree, the best rate on this flat cost curve, is explored and wins within the first rounds."""
    STALE_ROUNDS = DEFAULTS.stale_rounds
    tokens, ms = [3.0, 4.0, 4.5, 5.0, 6.0], [3.75, 4.0, 4.0, 4.0, 4.0]

    def run(floor_min_times):
        policy = Policy([CHAIN, 16, 32, 64, 128], floor_min_times=floor_min_times)
        picks, timed = [], [0] * 5
        for _ in range(STALE_ROUNDS - 50):
            i = policy.choose(1)
            cold = i not in picks
            picks.append(i)
            slow = 2.0 if i == 2 and timed[i] == 0 and not cold else 1.0  # the 32-tree's first timed round
            timed[i] += not cold
            policy.observe(1, i, 1, None if cold else ms[i] * slow, [1.5 * t for t in tokens],
                           [t if s else None for t, s in zip(tokens, observed_candidates(policy.candidates, i))])
        return picks

    assert 4 not in run(1)  # floored out: the secant of the 16-tree's 4 ms and the 32-tree's one 8 ms
    picks = run(2)
    assert picks.index(4) < 40 and picks[100:].count(4) >= 0.9 * len(picks[100:])


def test_a_forced_candidate_runs_every_round_on_the_usual_sampling_schedule():
    """SGLANG_DDTREE_AUTO_FORCE (the server module's lean-chain server, benchmarks): choose() returns that candidate
    whatever the rates say (here the 16-tree would win), with no exploration or probe rounds, so its rounds sample on
    the schedule only (mostly unsampled: the chain's lean round, worker._chain_round); a name that is not a
    candidate is refused."""
    SAMPLE_EVERY, SAMPLE_EVERY_IDLE = DEFAULTS.sample_every, DEFAULTS.sample_every_idle
    assert Policy([CHAIN, 16, 64]).force is None
    assert AutoBudgetPolicy([CHAIN, 16, 64], config=auto.auto_config(
        environ={"SGLANG_DDTREE_AUTO_FORCE": "Chain"})).force == [0]
    assert Policy([CHAIN, 16, 64], force="64").force == [2]
    with pytest.raises(ValueError, match="SGLANG_DDTREE_AUTO_FORCE"):
        Policy([CHAIN, 16, 64], force="32")

    free = Policy([CHAIN, 16, 64], explore_rounds=2, probe_every=1000)
    assert run_policy(free, 1, [3.0, 4.0, 5.0], [1.0, 1.1, 2.0], 40)[-1] == 1
    forced = Policy([CHAIN, 16, 64], explore_rounds=2, probe_every=1000, force="chain")
    sampled = []
    for r in range(200):
        assert forced.choose(1) == 0
        sampled.append(forced.sampled(r, 1))
        forced.observe(1, 0, 1, 1.0, [4.5, 6.0, 7.5] if sampled[-1] else None, [3.0, None, None])
    assert forced.chosen_total == [200, 0, 0]
    # no exploration (every round sampled) nor probes: the schedule's interval, backing off as the chain runs
    assert 0 < sum(sampled) <= 200 // SAMPLE_EVERY + 1
    assert sum(sampled[100:]) <= 100 // SAMPLE_EVERY_IDLE + 1
    # its holds grow past the probe slots as a settled bucket's do (A/B servers held on one tree decided every 4 rounds
    # once the first probe slot had passed: next_probe was never moved on)
    held = Policy([CHAIN, 16, 64], probe_every=64, force="64")
    for r in range(1000):
        assert held.choose(4) == 2
    b = held.buckets[4]
    assert b.settled and b.decisions <= 1000 // 64 + 8, b.decisions


def test_the_ab_block_knob_is_off_unless_set_to_a_positive_count(monkeypatch):
    """SGLANG_DDTREE_AUTO_AB (the in-process A/B of `auto` against the fixed widest tree): unset, empty or 0 is off;
    a positive count is the block length; anything else is refused with the variable's name."""
    from sglang_ddtree.sglang.auto_ab import auto_ab_block

    monkeypatch.delenv("SGLANG_DDTREE_AUTO_AB", raising=False)
    assert auto_ab_block() == 0
    for raw, expected in (("", 0), ("0", 0), ("8", 8), (" 16 ", 16)):
        monkeypatch.setenv("SGLANG_DDTREE_AUTO_AB", raw)
        assert auto_ab_block() == expected
    for bad in ("-1", "eight", "1.5"):
        monkeypatch.setenv("SGLANG_DDTREE_AUTO_AB", bad)
        with pytest.raises(ValueError, match="SGLANG_DDTREE_AUTO_AB"):
            auto_ab_block()


def test_the_ab_schedule_alternates_blocks_starting_with_auto():
    """ABSchedule: `block` rounds of `auto`, then `block` of the fixed tree, again and again; block 0 never runs the
    fixed arm; a negative block is refused."""
    from sglang_ddtree.sglang.auto_ab import ABSchedule

    three = ABSchedule(3)
    assert [three.next_is_fixed() for _ in range(13)] == [False] * 3 + [True] * 3 + [False] * 3 + [True] * 3 + [False]
    off = ABSchedule(0)
    assert not any(off.next_is_fixed() for _ in range(50))
    with pytest.raises(ValueError, match="block"):
        ABSchedule(-1)


def test_a_settled_bucket_decides_once_in_hold_max_and_samples_at_the_idle_interval():
    """The defaults decide ~1 round in hold_max and sample at the idle interval once settled; with hold_max =
    hold_rounds the bucket never settles: one decision in hold_rounds, sampling at sample_every while a tree wins."""
    HOLD_ROUNDS, HOLD_MAX = DEFAULTS.hold_rounds, DEFAULTS.hold_max

    def run(**config):
        policy = Policy([CHAIN, 16, 64], explore_rounds=1, probe_every=10_000, **config)
        deciding, sampled = [], []
        for r in range(600):
            deciding.append(policy.deciding(1))
            c = policy.choose(1)
            sampled.append(policy.sampled(r, 1))
            observed = [[3.0, None, None], [None, 5.0, None], [None, 5.0, 6.0]][c]
            policy.observe(1, c, 1, [3.0, 4.0, 4.1][c], [4.0, 6.0, 7.0], observed)
        return policy, sum(deciding[300:]), sum(sampled[300:])

    policy, decisions, samples = run()
    assert policy.buckets[1].settled
    every = lambda n: sum(r % n == 0 for r in range(300, 600))  # noqa: E731 (rounds 300..599 on a schedule of n)
    assert decisions <= 300 // HOLD_MAX + 1 and samples == every(DEFAULTS.sample_every_idle)
    policy, decisions, samples = run(hold_max=HOLD_ROUNDS)
    assert not policy.buckets[1].settled
    assert decisions == 300 // HOLD_ROUNDS and samples == every(DEFAULTS.sample_every)


def test_hold_rounds_and_sample_every_reach_the_policy():
    """AutoConfig.hold_rounds / sample_every: a decision holds that many rounds, and unsampled stretches last
    sample_every rounds (sample_every_idle a multiple of it)."""
    policy = Policy([CHAIN, 16, 64], explore_rounds=1, probe_every=10_000, hold_rounds=16, hold_max=16,
                    sample_every=8)
    assert policy.sample_interval(1) == 8
    # past exploration, decisions come every 16 rounds: deciding() is true once in 16
    picks, deciding = [], []
    for _ in range(200):
        deciding.append(policy.deciding(1))
        c = policy.choose(1)
        picks.append(c)
        observed = [[3.0, None, None], [None, 5.0, None], [None, 5.0, 6.0]][c]  # what a round of c observes
        policy.observe(1, c, 1, [3.0, 4.0, 9.0][c], [4.0, 6.0, 7.0], observed)
    assert sum(deciding[100:]) <= 100 // 16 + 1
    # the chain leads by far (a tree's best case below (1 - close) of it): the idle interval
    lead = Policy([CHAIN, 64], explore_rounds=1, probe_every=10_000, sample_every=8, sample_every_idle=32)
    for _ in range(50):
        c = lead.choose(1)
        lead.observe(1, c, 1, [1.0, 30.0][c], [4.0, 4.5], [4.0, None] if c == 0 else [None, 4.5])
    assert lead.sample_interval(1) == 32


@pytest.mark.parametrize("force", [None, "32"])
def test_held_round_returns_what_choose_and_sampled_would(force):
    """AutoBudgetPolicy.held_round (the worker's call on a round whose bucket holds its decision) against the
    deciding() / choose() / sampled() sequence it stands for: two identical policies fed the same noisy rounds (a
    round late, through exploration, probes, a cost change and two buckets) pick the same candidates and sample the
    same rounds, and end with the same bookkeeping. A forced candidate holds as a decision does (the feedback is then
    read once in HOLD_ROUNDS rounds, as `auto` reads it), still verifying that candidate every round."""
    import random

    HOLD_ROUNDS = DEFAULTS.hold_rounds
    a = Policy([CHAIN, 16, 32, 64], probe_every=32, force=force)
    b = Policy([CHAIN, 16, 32, 64], probe_every=32, force=force)
    rng = random.Random(3)
    queues = {id(a): [], id(b): []}
    trace = {id(a): [], id(b): []}
    held_rounds = 0
    for r in range(600):
        bucket = 1 if (r // 150) % 2 == 0 else 4
        ms = [1.0, 1.1, 1.2, 1.3] if r < 300 else [1.0, 1.1, 2.5, 3.0]
        noise = [rng.uniform(0.9, 1.1) for _ in ms]
        tokens = [3.0, 4.0, 4.6, 5.0]
        def drain(policy):  # what completed on the GPU (one round in flight)
            queue = queues[id(policy)]
            while len(queue) > 1:
                bk, j, s, k = queue.pop(0)
                seen = observed_candidates(policy.candidates, j)
                policy.observe(bk, j, 1, ms[j] * k, [1.5 * t for t in tokens] if s else None,
                               [t if x else None for t, x in zip(tokens, seen)])

        for policy in (a, b):
            if policy is a:  # as the worker drives it
                held = policy.held_round(bucket, r)
                if held is None:
                    drain(policy)
                    chosen, sampled = policy.choose(bucket), policy.sampled(r, bucket)
                else:
                    chosen, sampled = held
                    held_rounds += 1
            else:  # as the worker drove it before held_round
                if policy.deciding(bucket):
                    drain(policy)
                chosen, sampled = policy.choose(bucket), policy.sampled(r, bucket)
            queues[id(policy)].append((bucket, chosen, sampled, noise[chosen]))
            trace[id(policy)].append((chosen, sampled))
    assert trace[id(a)] == trace[id(b)]
    assert held_rounds >= 600 * (HOLD_ROUNDS - 1) / HOLD_ROUNDS * 0.5  # most rounds held
    assert a.chosen_total == b.chosen_total and a.export() == b.export()
    for bucket in (1, 4):
        x, y = a.buckets[bucket], b.buckets[bucket]
        assert (x.rounds, x.tried, list(x.last_choices), x.others_in_run) == \
            (y.rounds, y.tried, list(y.last_choices), y.others_in_run)
    if force is not None:
        assert set(c for c, _ in trace[id(a)]) == set(a.force) == {2}


def test_a_round_whose_host_time_stalled_is_cold():
    """StallDetector: a round whose host time exceeds STALL_HOST_MS did uncounted one-time work (a
    Triton compile inside a lean chain round, seen in a tiny-pair A/B on the H200: ~480 ms against ~4 ms rounds); an untimed round never stalls; where
    every round is long on the host (a GPU-bound deployment whose launches wait, 120 ms here) the limit rises to
    STALL_FACTOR times their median within a window, so those rounds keep their times, and a compile-sized outlier
    beyond that still stalls."""
    from sglang_ddtree.sglang.stats import StallDetector

    tiny = StallDetector()
    STALL_FACTOR, STALL_HOST_MS, STALL_WINDOW = tiny.factor, tiny.floor_ms, tiny.recent.maxlen
    assert not tiny.stalled(None)
    assert [tiny.stalled(4.0) for _ in range(100)] == [False] * 100
    assert tiny.limit_ms == STALL_HOST_MS  # 10 x 4 ms lies below the floor
    assert tiny.stalled(480.0) and not tiny.stalled(4.2) and tiny.stalls == 1

    big = StallDetector()
    flags = [big.stalled(120.0) for _ in range(3 * STALL_WINDOW)]
    assert sum(flags) <= STALL_WINDOW // 4  # only until the first re-read of the limit
    assert not any(flags[STALL_WINDOW // 4:])
    assert big.limit_ms == pytest.approx(STALL_FACTOR * 120.0)
    assert big.stalled(5000.0) and not big.stalled(130.0)
    with pytest.raises(ValueError):
        StallDetector(factor=1.0)
