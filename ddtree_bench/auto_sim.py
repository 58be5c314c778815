"""`auto`'s host policy (sglang_ddtree.sglang.auto) fed the way the worker feeds it, with simulated round times:
for tests and benchmarks/simulate_auto_phases.py, no GPU."""

from __future__ import annotations

import math
import random

from sglang_ddtree.adaptive import CHAIN
from sglang_ddtree.sglang.auto import AutoBudgetPolicy, observed_candidates

CANDIDATES = (CHAIN, 16, 32, 64, 128)
WIDTHS = [16] + [c + 1 for c in CANDIDATES[1:]]  # verify tokens per request: the chain's block, a tree's nodes + 1


def simulate(seed: int, base: list[float], tokens: list[float], expected: list[float], rounds: int, batch: int,
             noise: float, outlier: float = 0.0, lag: int = 2, phase_mult: float = 1.0,
             phase_len: float | None = None, start_rounds: int = 0, start_mult: float = 1.0,
             start_tokens: list[float] | None = None, policy: AutoBudgetPolicy | None = None,
             expected_scale=None, sampled_ms: float | list[float] = 0.0, drift_sigma: float = 0.0,
             drift_rounds: float | None = None, content_sigma: float = 0.0, content_rounds: float | None = None,
             token_noise: float = 0.0, expected_follows: float = 0.5, prompt_sigma: float = 0.0,
             prompt_rounds: int | None = None, poisson_tokens: bool = False, warm_mult: tuple = (),
             chain_warm_mult: tuple = (), switch_mult: float = 1.0, switch_outlier: float = 0.0) -> list[int]:
    """Candidate i's round costs base[i] ms x lognormal(noise), doubled with probability `outlier`, and x phase_mult
    while the host is in a slow phase (phases flip with probability 1 / phase_len a round; none without phase_len);
    a round commits tokens[i] per request; the drafter expects expected[i]. First rounds of a candidate are cold
    (untimed), sampled rounds (policy.sample_interval) carry the expectations, observations arrive `lag` rounds
    late. The first start_rounds rounds (a server's first requests) cost start_mult times more and commit
    start_tokens (default tokens). policy: a fresh AutoBudgetPolicy over CANDIDATES unless given (to read its state
    afterwards). expected_scale: round -> a factor per candidate on the expectations a sampled round reports (a
    basis that moves, as calibrated expectations do while their table learns; None: fixed). sampled_ms: what a sampled
    round costs on top (the top-K and the tree at the largest budget, the walk's per-candidate counts): one value for
    every candidate, or one per candidate (the chain's plain round drafts a top-1 and builds no tree, so its extra
    is larger). drift_sigma / drift_rounds: the host's speed drifts (every round's ms x exp(x), x an AR(1)
    process with standard deviation drift_sigma and correlation time drift_rounds rounds: the lent vCPUs ran one
    Python loop in 0.32-0.68 s, their order changing from one pass to the next). content_sigma / content_rounds /
    token_noise: what a round commits moves with the text (every candidate's tokens x exp(y) x lognormal(token_noise),
    y an AR(1) process like the drift; one factor for all candidates of a round, so a wider tree still commits at
    least a narrower one's tokens) and the drafter's expectations follow exp(expected_follows x y). prompt_sigma /
    prompt_rounds: the text changes at once every prompt_rounds rounds (a new prompt: y ~ N(0, prompt_sigma), held;
    a measured sweep's batch-1 rows ran 4 prompts of ~350 rounds each). poisson_tokens: a round's committed tokens are
    drawn, not scaled: the chain and the narrowest tree 1 + Poisson((tokens[i] - 1) x exp(y)) each, every wider tree
    the next narrower one's plus Poisson((tokens[j] - tokens[j - 1]) x exp(y)) (per round a wider tree commits at
    least as much, by a count that is often 0). warm_mult: a candidate's rounds after its cold first one cost
    warm_mult[0], warm_mult[1], ... times more (a server's debug dump at batch 1: the first timed round of each
    candidate 1.13-1.47x its median, the second 1.04-1.17x). chain_warm_mult: the same for the chain alone, on top
    (batch-1 servers of the tiny pair timed the lean chain round's exploration at 6.4-7.8 ms against 3.7-5.4 for the
    trees; other runs at 26-40 ms). switch_mult / switch_outlier: a round whose candidate
    is not the previous round's costs switch_mult times more, and 1.5x more again with probability switch_outlier
    (the same dump, batch 1, rounds after a candidate's first three: such rounds' quartiles 0.995 / 1.035 / 1.088 of
    the candidate's median against 0.967 / 0.999 / 1.036 for the others, 9% of them >= 1.4x against 4%). Returns the
    candidate index chosen each round."""
    rng = random.Random(seed)
    policy = policy if policy is not None else AutoBudgetPolicy(list(CANDIDATES), widths=WIDTHS)
    queue, picks, used, uses = [], [], set(), [0] * len(base)
    slow = False
    keep = math.exp(-1.0 / drift_rounds) if drift_rounds else 0.0
    drift = rng.gauss(0.0, drift_sigma) if drift_sigma > 0 else 0.0
    content_keep = math.exp(-1.0 / content_rounds) if content_rounds else 0.0
    content = rng.gauss(0.0, content_sigma) if content_sigma > 0 else 0.0
    prompt = 0.0
    for r in range(rounds):
        if prompt_sigma > 0 and prompt_rounds and r % prompt_rounds == 0:
            prompt = rng.gauss(0.0, prompt_sigma)
        if drift_sigma > 0:
            drift = drift * keep + rng.gauss(0.0, drift_sigma * math.sqrt(1.0 - keep * keep))
        if content_sigma > 0:
            content = content * content_keep + rng.gauss(0.0, content_sigma * math.sqrt(1.0 - content_keep ** 2))
        if phase_len is not None and rng.random() < 1.0 / phase_len:
            slow = not slow
        i = policy.choose(batch)
        switched = bool(picks) and picks[-1] != i
        sampled = policy.sampled(r, batch)  # as the worker decides
        picks.append(i)
        cold = i not in used
        used.add(i)
        uses[i] += 1
        seen = observed_candidates(policy.candidates, i)
        ms = base[i] * rng.lognormvariate(0, noise) * (2.0 if rng.random() < outlier else 1.0)
        ms *= phase_mult if slow else 1.0
        if sampled:
            ms += sampled_ms[i] if isinstance(sampled_ms, (list, tuple)) else sampled_ms
        ms *= math.exp(drift)
        starting = r < start_rounds
        ms *= start_mult if starting else 1.0
        if 2 <= uses[i] < 2 + len(warm_mult):
            ms *= warm_mult[uses[i] - 2]
        if i == 0 and 2 <= uses[i] < 2 + len(chain_warm_mult):
            ms *= chain_warm_mult[uses[i] - 2]
        if switched:
            ms *= switch_mult * (1.5 if switch_outlier and rng.random() < switch_outlier else 1.0)
        committed = start_tokens if starting and start_tokens is not None else tokens
        scale = expected_scale(r) if expected_scale is not None else [1.0] * len(expected)
        text = content + prompt
        if content_sigma > 0 or token_noise > 0 or prompt_sigma > 0 or poisson_tokens:
            factor = math.exp(text) * (rng.lognormvariate(0, token_noise) if token_noise > 0 else 1.0)
            scale = [f * math.exp(expected_follows * text) for f in scale]
            if poisson_tokens:
                t = committed
                drawn = [1 + _poisson(rng, (t[0] - 1) * factor), 1 + _poisson(rng, (t[1] - 1) * factor)]
                for j in range(2, len(t)):
                    drawn.append(drawn[-1] + _poisson(rng, max(0.0, t[j] - t[j - 1]) * factor))
                committed = drawn
            else:
                committed = [t * factor for t in committed]
        reported = [batch * e * f for e, f in zip(expected, scale)]
        queue.append((i, cold, ms, sampled, [batch * t if s else None for t, s in zip(committed, seen)], reported))
        if len(queue) > lag:
            j, was_cold, mj, smp, obs, exp = queue.pop(0)
            policy.observe(batch, j, batch, None if was_cold else mj, exp if smp else None, obs)
    return picks


def _poisson(rng: random.Random, lam: float) -> int:
    """A Poisson draw (Knuth's product of uniforms; lam here is a few tokens at most)."""
    if lam <= 0:
        return 0
    limit, k, p = math.exp(-lam), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


def rate_over_best(picks: list[int], base: list[float], tokens: list[float]) -> float:
    """The picks' mean tokens per ms at the phase-free costs, over the best candidate's."""
    best = max(t / b for t, b in zip(tokens, base))
    return sum(tokens[i] / base[i] for i in picks) / len(picks) / best
