"""`--speculative-ddtree-budget auto` in the SGLang worker: one candidate budget per round, chosen on the host
without a host sync.

The GPU gives (DDTreeWorker, through pinned buffers and events: AutoFeedback, a round or two late): every round's
time (its chained CUDA events; none for rounds that did one-time work: captures, compiles, host stalls); on a
sampled round, every candidate's expected committed tokens from the tree at the largest budget
(adaptive.expected_acceptance, raw drafter scores) and the committed tokens of the chosen candidate and of every
smaller tree (adaptive.subtree_accept_lengths: exact, their trees are its first slots).

The host decides (AutoBudgetPolicy.choose), per batch-size bucket (the CUDA-graph size the round pads to):
    rate(c) = est_tokens(c) / round_ms(bucket, c),   est_tokens(c) = expected(c) x observed/expected ratio(c)
round_ms is the median of c's recent times, a tree's drawn toward the trees' pooled time. Unmeasured candidates are
explored first (narrowest first, never wider than what has a time); the stalest is probed every probe_every rounds;
both skip a candidate that cannot win (its tokens over a lower bound of its round time, _cost_floor). The chain
(DFLASH's top-1 path, verified causally) is always a candidate. A decision holds a few rounds, longer as it repeats.

Tunables: AutoConfig (fixed when the server starts: auto_config); what a user may set: USER_KNOBS (docs/adaptive-
budget.md, "Knobs"). The evidence behind the defaults, and the experiments tried and switched off, are in that doc,
docs/gpu-suite.md and this file's git history. Measuring modes: auto_ab.py.
"""

from __future__ import annotations

import collections
import math
import os
from dataclasses import dataclass

import torch

from sglang_ddtree.adaptive import CHAIN, PLAIN, candidate_label
from sglang_ddtree.config import at_least, env_value, switch
from sglang_ddtree.sglang.auto_ab import MEASURING_MODES
from sglang_ddtree.sglang.stats import TableGauges


@dataclass(frozen=True)
class AutoConfig:
    """The chooser's tunables, one line of why each (the evidence: the docs and git history named above)."""

    # -- how often a round computes every candidate's expectation (the top-K and the tree at the largest budget)
    sample_every: int = 4  # a sampled round costs ~0.2-2 ms more at 8B shapes: one round in 4 pays it
    sample_every_idle: int = 16  # ... one in 16 while the chain leads or runs, or the bucket is settled
    close: float = 0.25  # the chain "leads" beyond this over every tree's best case: a few samples cannot erase it
    chain_run: int = 32  # the chain "runs" when the bucket's last chain_run choices were the chain but for
    chain_run_others: int = 2  # ... this many: a never-right drafter keeps `close` from ever idling
    # -- exploration and probes
    explore_rounds: int = 4  # rounds a candidate is explored per bucket: 3 timed after its untimed cold first one
    max_unmeasured: int = 8  # rounds exploration waits for a candidate's first time (feedback lags 1-2 rounds)
    probe_every: int = 64  # rounds between probes of the stalest candidate that could still win
    stale_rounds: int = 256  # a candidate untimed this long is probed even if it cannot win (its times bound others)
    stale_hope: float = 0.5  # ... unless explored only as another bucket's best and below this share of the best
    # -- round times
    recent: int = 8  # times kept per candidate: floors take the least, rates the median (one outlier moves neither)
    floor_min_times: int = 2  # a candidate's times bound floors from its 2nd one: one slow first round cannot
    times_expire: int = 256  # a new time drops the candidate's times older than this many bucket rounds (0: never)
    shrink_z: float = 1.0  # trees' times drawn to their pooled time by this many standard errors (flat, host-bound)
    noise: float = 0.1  # the relative timing noise a cost floor allows for (an allowance, not a measurement)
    half_life_rounds: float = 200.0  # half-life of the expectations, ratios and mean times, in rounds
    # -- holds: the chooser's Python costs ~0.15 ms a round in a host-bound server
    hold_rounds: int = 4  # a decision of the best holds this many rounds of its bucket
    hold_max: int = 64  # ... doubling while it repeats, up to this (and never past the bucket's next probe)
    settled_hold: int = 32  # a hold this long settles the bucket: it samples at sample_every_idle
    # -- the calibration table (adaptive.ScoreCalibrator): reported next to the raw scores, it feeds no decision
    # --speculative-ddtree-auto-calibration; off (the default): no scored walk is built or run. At real size (the
    # widened 8B pair) the calibrated estimate was worse than the raw scores at 3 of 4 batch sizes (MAE 1.28 vs 0.96,
    # 1.45 vs 1.32, 1.09 vs 1.04, 1.19 vs 1.27 at batch 1 / 4 / 16 / 64) and its scoring walk cost 0.39 ms a round
    # at batch 1 against the fixed tree's 0.12; the table feeds no decision.
    calibration: bool = False
    calibration_every: int = 4  # a grown table scores one sampled tree round in 4 (~185 small kernels each)
    calibration_young: int = 2000  # ... every one until it scored this many request-rounds (its half-life)
    calibration_learn_all: int = 500  # ... and every tree round, sampled or not, until it learnt this many
    calibration_gate: int = 100  # the gated predictor is the raw one until the table learnt this many
    # -- operation and testing
    log_every: int = 2000  # SGLANG_DDTREE_AUTO_LOG_EVERY: rounds between chooser-table log lines (~0.3 ms each)
    force: str | None = None  # SGLANG_DDTREE_AUTO_FORCE: every round verifies this candidate (testing, measuring);
    # a comma-separated list: the decisions take them in turn (each held hold_rounds: switches between them, tested)
    explore_all: bool = False  # SGLANG_DDTREE_AUTO_EXPLORE_ALL: explore every candidate, even hopeless (testing)

    def __post_init__(self):
        zero_ok = ("chain_run_others", "times_expire", "calibration_young", "calibration_learn_all", "calibration_gate")
        for name, value in vars(self).items():
            low = 1e-9 if name == "half_life_rounds" else 0 if name in zero_ok or isinstance(value, float) else 1
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not value >= low:
                raise ValueError(f"AutoConfig.{name} must be >= {low:g}, got {value}.")
        if self.sample_every_idle % self.sample_every:  # a round counter modulo either stays in step
            raise ValueError("AutoConfig.sample_every_idle must be a multiple of sample_every.")


# What a user may set, and where it lands (an AutoConfig field; None: args.DDTreeOptions). The docs' "Knobs" section
# lists the same names (tests/test_sglang_auto.py checks it).
USER_KNOBS = {
    "--speculative-ddtree-auto-candidates": None,
    "--speculative-ddtree-auto-calibration": "calibration",
    "SGLANG_DDTREE_AUTO_LOG_EVERY": "log_every",
    "SGLANG_DDTREE_AUTO_FORCE": "force",
    "SGLANG_DDTREE_AUTO_EXPLORE_ALL": "explore_all",
}


def auto_config(calibration: bool = False, environ=None) -> AutoConfig:
    """The server's AutoConfig, read when the worker starts: calibration from the flag (args.DDTreeOptions), the
    variables of USER_KNOBS from the environment."""
    env = os.environ if environ is None else environ
    # a deleted knob set (an old A/B arm) would otherwise run the defaults unnoticed
    unknown = [k for k in env if k.startswith("SGLANG_DDTREE_AUTO_") and k not in (*USER_KNOBS, *MEASURING_MODES)]
    if unknown:
        raise ValueError(f"{', '.join(sorted(unknown))}: no such `auto` setting (the deleted ones: "
                         f"docs/adaptive-budget.md, Knobs).")
    log_every = env_value(env, "SGLANG_DDTREE_AUTO_LOG_EVERY", at_least(1), "a positive integer (rounds)")
    return AutoConfig(calibration=bool(calibration), log_every=log_every or AutoConfig.log_every,
                      force=env_value(env, "SGLANG_DDTREE_AUTO_FORCE", str.lower,
                                      "chain, plain or a candidate budget, or a comma-separated list of them"),
                      explore_all=bool(env_value(env, "SGLANG_DDTREE_AUTO_EXPLORE_ALL", switch, "0 or 1")))


class _Decayed:
    """Exponentially decayed sum pair (value, weight): mean = value / weight."""

    __slots__ = ("value", "weight")

    def __init__(self):
        self.value = self.weight = 0.0

    def add(self, x: float, w: float, keep: float) -> None:
        self.value = self.value * keep + x * w
        self.weight = self.weight * keep + w

    def mean(self) -> float | None:
        return self.value / self.weight if self.weight > 0 else None


class _Bucket:
    """A batch-size bucket's times and decision state; lists are per candidate index."""

    def __init__(self, n: int, config: AutoConfig, chain: int = 0):
        self.chain = chain  # the chain's candidate index
        self.round_ms = [_Decayed() for _ in range(n)]  # decayed mean time: the rate's until `recent` holds 3
        self.recent = [collections.deque(maxlen=config.recent) for _ in range(n)]  # the last timed rounds' ms
        self.recent_at = [collections.deque(maxlen=config.recent) for _ in range(n)]  # ... their bucket rounds
        # of `recent`, kept (the chooser reads them every round, only the timed candidate's change): its median,
        # interquartile range as a normal sigma, and least
        self.median, self.spread, self.least = [None] * n, [None] * n, [None] * n
        self.expired_least = [None] * n  # the least of its last expired times: still a floor (_bound_ms)
        self.measured, self.tried, self.seen = [0] * n, [0] * n, [0] * n  # timed / chosen / observed rounds
        self.waited = [0] * n  # rounds exploration waited for its first time
        self.last_measured = [-1] * n  # the bucket round of its last time
        self.elsewhere: set = set()  # explored as another bucket's best (its stale probes need stale_hope)
        self.last_choices = collections.deque(maxlen=config.chain_run)
        self.others_in_run = 0  # of last_choices, those not the chain
        self.rounds = self.decisions = 0  # rounds chosen, and those that decided (not held)
        self.held = self.hold = 0  # the last decision, and the rounds it still holds
        self.best: int | None = None  # the last decision of the best (probes, exploration and waits aside)
        self.streak = 0  # decisions of the best in a row that repeated the one before (hold growth)
        self.settled = False  # the hold grew to settled_hold
        self.next_probe = config.probe_every

    def chose(self, i: int) -> None:
        if len(self.last_choices) == self.last_choices.maxlen and self.last_choices[0] != self.chain:
            self.others_in_run -= 1  # leaves the window
        self.last_choices.append(i)
        self.others_in_run += i != self.chain

    def expire(self, i: int, before: int) -> bool:
        """Drop candidate i's times taken before bucket round `before`; True if any went."""
        at = self.recent_at[i]
        if not at or at[0] >= before:
            return False
        dropped = []
        while at and at[0] < before:
            at.popleft()
            dropped.append(self.recent[i].popleft())
        self.expired_least[i] = min(dropped)
        return True

    def timed(self, i: int, ms: float) -> None:
        self.recent[i].append(ms)
        self.recent_at[i].append(self.rounds)
        xs = sorted(self.recent[i])
        n = len(xs)
        self.median[i], self.least[i] = xs[n // 2], xs[0]
        self.spread[i] = 0.7413 * (xs[(3 * n) // 4] - xs[n // 4])


class AutoBudgetPolicy:
    """The host side of `auto`: observe() completed rounds, choose() the next one's candidate (an index)."""

    def __init__(self, candidates, widths=None, config: AutoConfig | None = None):
        self.config = config = config or AutoConfig()
        self.candidates = [int(c) for c in candidates]
        if (self.candidates != sorted(set(self.candidates)) or CHAIN not in self.candidates
                or self.candidates[0] < PLAIN):
            raise ValueError(f"auto candidates must be sorted, distinct and hold the chain (0), besides trees and "
                             f"optionally plain (-1), got {self.candidates}.")
        if not any(c > 0 for c in self.candidates):
            raise ValueError("auto needs at least one tree budget besides the chain.")
        n = len(self.candidates)
        self.chain = self.candidates.index(CHAIN)
        # the candidates whose rounds draft, in order: the feedback vector's entries (AutoFeedback)
        self.drafted = [i for i, c in enumerate(self.candidates) if c != PLAIN]
        self.widths = list(widths) if widths is not None else [
            1 if c == PLAIN else 16 if c == CHAIN else c + 1 for c in self.candidates]
        if len(self.widths) != n:
            raise ValueError(f"one verify width per candidate, got {self.widths} for {self.candidates}.")
        labels = [candidate_label(c) for c in self.candidates]
        forced = None if config.force is None else [x.strip() for x in config.force.split(",")]
        if forced is not None and not all(x in labels for x in forced):
            raise ValueError(f"SGLANG_DDTREE_AUTO_FORCE must name auto candidates among {labels}, got "
                             f"{config.force!r}.")
        self.force = None if forced is None else [labels.index(x) for x in forced]
        self.keep = 0.5 ** (1.0 / config.half_life_rounds)
        self.expected = [_Decayed() for _ in range(n)]  # expected tokens per request
        self.observed = [_Decayed() for _ in range(n)]  # observed tokens per request, and next to them
        self.observed_expected = [_Decayed() for _ in range(n)]  # the same rounds' expectation: ratio()
        self.buckets: dict[int, _Bucket] = {}
        self.chosen_total = [0] * n
        self.rounds_observed = 0
        self._last_sampled = 0  # rounds_observed at the last round that carried expectations
        self._last_observed = [0] * n  # rounds_observed at each ratio's last sample
        self.sampling = None  # the last choice's sampling: True (it explores or probes), None (the schedule's)
        # Estimates change only in observe() (tokens only on a sampled round): choose() and sample_interval() reuse
        # them between (_cached), which halved the policy's CPU time a round with the same picks.
        self._version = self._tokens_version = 0
        self._memo: dict = {}  # (what, bucket) -> (version, values)
        self._explore_order = sorted(range(n), key=lambda i: (self.widths[i], i))  # narrowest verify first

    def _bucket(self, bucket: int) -> _Bucket:
        b = self.buckets.get(bucket)
        if b is None:
            b = self.buckets[bucket] = _Bucket(len(self.candidates), self.config, self.chain)
        return b

    # ---------------------------------------------------------------------------------------------- estimates

    def ratio(self, i: int) -> float:
        """Observed / expected committed tokens for candidate i (nearest smaller observed candidate, else 1)."""
        for j in range(i, -1, -1):
            obs, exp = self.observed[j].mean(), self.observed_expected[j].mean()
            if obs is not None and exp:
                return obs / exp
        return 1.0

    def _cached(self, key, compute, version: int):
        hit = self._memo.get(key)
        if hit is not None and hit[0] == version:
            return hit[1]
        values = compute()
        self._memo[key] = (version, values)
        return values

    def _all_tokens(self) -> list[float | None]:
        """est_tokens of every candidate: a tree's is at least every narrower tree's (those are its first slots: per
        round it commits at least as much); a round without a draft commits exactly one token a request."""
        out, best = [], None
        for i, c in enumerate(self.candidates):
            if c == PLAIN:
                out.append(1.0)
                continue
            exp = self.expected[i].mean()
            own = None if exp is None else exp * self.ratio(i)
            if c == CHAIN or own is None:
                out.append(own)
            else:
                best = own if best is None else max(best, own)
                out.append(best)
        return out

    def est_tokens(self, i: int) -> float | None:
        """Candidate i's estimated committed tokens per request."""
        return self._cached(("tokens", None), self._all_tokens, self._tokens_version)[i]

    def rates(self, bucket: int) -> list[float | None]:
        return list(self._cached(("rates", bucket), lambda: self._rates(bucket), self._version))

    def _rates(self, bucket: int) -> list[float | None]:
        ms = self._shrunk_tree_ms(self._bucket(bucket))
        tokens = self._cached(("tokens", None), self._all_tokens, self._tokens_version)
        return [t / m if t is not None and m else None for t, m in zip(tokens, ms)]

    def _shrunk_tree_ms(self, b: _Bucket) -> list[float | None]:
        """Every candidate's round ms for its rate: the median of its recent times once there are 3, the decayed mean
        before. A tree's is drawn toward the trees' pooled time by shrink_z standard errors of its median: on a flat
        cost curve whichever tree's median came out lowest won otherwise. The chain keeps its own (it verifies
        causally: another cost curve)."""
        ms = [b.median[i] if len(b.recent[i]) >= 3 else b.round_ms[i].mean() for i in range(len(self.candidates))]
        trees = [i for i, c in enumerate(self.candidates) if c > 0 and ms[i] and len(b.recent[i]) >= 3]
        if len(trees) < 2:
            return ms
        weights = [len(b.recent[i]) for i in trees]
        pooled = sum(ms[i] * w for i, w in zip(trees, weights)) / sum(weights)
        for i in trees:
            error = self.config.shrink_z * 1.25 * b.spread[i] / math.sqrt(len(b.recent[i]))
            gap = ms[i] - pooled
            ms[i] = pooled + math.copysign(max(0.0, abs(gap) - error), gap)
        return ms

    # ---------------------------------------------------------------------------------------------- decisions

    def _cost_floor(self, b: _Bucket, i: int) -> float | None:
        """A lower bound of candidate i's round ms in this bucket (None: nothing measured bounds it), from least
        recent times (_bound_ms):
        - measured itself: its least time, less noise (a probe re-measures what would win at that price);
        - otherwise: the dearest measured candidate of its kind (tree or chain) that verifies no more tokens, and,
          from two measured narrower trees, their secant extended to i's width (round time is convex in the verify
          width: flat while launch- or memory-bound, then linear), its slope taken less noise. The chain's round is
          another code path (a causal verify, worker._chain_round), and so is a round without a draft
          (worker._plain_round): their times bound no tree's floor."""
        least = [self._bound_ms(b, j) for j in range(len(self.candidates))]
        noise = self.config.noise
        if least[i] is not None:
            return least[i] * (1.0 - noise)
        kind = _kind(self.candidates[i])
        narrower = [least[j] for j in range(len(self.candidates)) if j != i and least[j] is not None
                    and self.widths[j] <= self.widths[i] and _kind(self.candidates[j]) == kind]
        if not narrower:
            return None
        floor = max(narrower)
        trees = [(self.widths[j], least[j]) for j in range(len(self.candidates))
                 if j != i and self.candidates[j] > 0 and self.widths[j] < self.widths[i] and least[j] is not None]
        if len(trees) >= 2:
            (w1, t1), (w2, t2) = min(trees), max(trees)
            if w2 > w1:
                slope = (t2 - t1 * (1.0 + noise)) / (w2 - w1)
                if slope > 0:
                    floor = max(floor, t2 + slope * (self.widths[i] - w2))
        return floor

    def _bound_ms(self, b: _Bucket, j: int) -> float | None:
        """The time candidate j's floors use: its least recent time once it has floor_min_times; before that, after
        its older times expired, the least of the expired and the new ones (an expiry must not let hopeless wide
        trees be probed more: at 8B shapes a 128-tree probe costs ~6 chain rounds); else None."""
        if len(b.recent[j]) >= self.config.floor_min_times:
            return b.least[j]
        old = b.expired_least[j]
        if old is None:
            return None
        return old if b.least[j] is None else min(old, b.least[j])

    def _best_case_rate(self, b: _Bucket, i: int) -> float | None:
        """Candidate i's estimated tokens over the floor of its round time (None: either is unknown)."""
        tokens, floor = self.est_tokens(i), self._cost_floor(b, i)
        return tokens / floor if tokens is not None and floor else None

    def _could_win(self, b: _Bucket, i: int, best_rate: float | None, hope: float | None = None) -> bool:
        """Whether i's best case beats the best rate (hope: reaches that share of it); True when either is unknown."""
        best_case = self._best_case_rate(b, i)
        if best_rate is None or best_case is None:
            return True
        return best_case >= hope * best_rate if hope else best_case > best_rate * (1.0 + 1e-6)  # a tie is no win

    def choose(self, bucket: int) -> int:
        """Index into candidates for the next round of a batch in this bucket. Exploration goes narrowest first and
        waits for a candidate's first time (it arrives a round or two late; a cold first round is not timed) before
        it explores a wider one, so a wider tree is judged by the narrower ones' times, never blind; it skips a
        candidate that cannot win unless another bucket's best is that candidate (a new bucket's slow first times
        must not lock out what won elsewhere). With a drafter that is rarely right the wide trees are never tried."""
        cfg = self.config
        b = self._bucket(bucket)
        b.rounds += 1
        self.sampling = None
        if b.hold > 0:
            b.hold -= 1
            return self._chosen(b, b.held)
        b.decisions += 1
        if self.force is not None:  # held as a decision is, so the feedback is drained as often as `auto` drains it
            if b.rounds >= b.next_probe:  # the probe slot passes with nothing probed: holds grow as a settled one's
                b.next_probe = b.rounds + cfg.probe_every
            forced = self.force[(b.decisions - 1) % len(self.force)]
            b.held, b.hold = forced, self._hold_after(b, forced)
            return self._chosen(b, forced)
        rates = self.rates(bucket)
        # Ties go to the wider candidate: a wider tree estimated at a narrower one's tokens commits at least as much
        known = [(r, i) for i, r in enumerate(rates) if r is not None and math.isfinite(r)]
        best = max(known)[1] if known else None
        best_rate = rates[best] if best is not None else None
        choice, waiting = None, False
        for i in self._explore_order:
            if b.measured[i] >= cfg.explore_rounds:
                continue
            if b.tried[i] < cfg.explore_rounds:
                if cfg.explore_all or self._could_win(b, i, best_rate):
                    choice = i
                    break
                if i in self._best_elsewhere(bucket):
                    b.elsewhere.add(i)
                    choice = i
                    break
            if b.tried[i] > 0 and b.measured[i] == 0 and b.waited[i] < cfg.max_unmeasured:
                b.waited[i] += 1  # its time is in flight: run the best known meanwhile, explore nothing wider yet
                waiting = True
                break
        if choice is not None or waiting:  # exploring: the next decision of the best starts its holds over
            b.best, b.streak, b.settled = None, 0, False
        if choice is None and b.rounds >= b.next_probe:
            b.next_probe = b.rounds + cfg.probe_every
            # the stalest that could still win, or whose times are stale (stale_rounds)
            probes = [i for i in range(len(self.candidates)) if i != best and (
                self._could_win(b, i, best_rate)
                or (b.recent[i] and b.rounds - b.last_measured[i] > cfg.stale_rounds
                    and (i not in b.elsewhere or self._could_win(b, i, best_rate, cfg.stale_hope))))]
            if probes:
                choice = min(probes, key=lambda i: (b.last_measured[i], i))
        if choice is not None:  # exploration and probes: one round each, sampled (it refreshes the ratio)
            self.sampling, hold = True, 0
        else:
            choice = best if best is not None else self.chain
            hold = 0 if waiting else self._hold_after(b, choice)
        b.held, b.hold = choice, hold
        return self._chosen(b, choice)

    def _hold_after(self, b: _Bucket, choice: int) -> int:
        """The rounds a decision of the best holds after its own: hold_rounds x 2^k for the k-th repeat in a row
        (counted once every wider candidate was explored: until then a wider tree keeps its chance every
        hold_rounds), up to hold_max and never past the next probe (but at least hold_rounds)."""
        cfg = self.config
        explored = all(m >= cfg.explore_rounds for m, w in zip(b.measured, self.widths) if w > self.widths[choice])
        if choice == b.best and explored:
            b.streak += 1
        else:
            b.best, b.streak = choice, 0
        grown = min(cfg.hold_max, cfg.hold_rounds << min(b.streak, 16))
        b.settled = grown >= cfg.settled_hold
        return max(cfg.hold_rounds, min(grown, b.next_probe - b.rounds)) - 1

    def _best_elsewhere(self, bucket: int) -> set[int]:
        """The candidates with the best measured rate in another bucket."""
        out = set()
        for other, b in self.buckets.items():
            if other != bucket:
                rates = self.rates(other)
                known = [(r, i) for i, r in enumerate(rates) if r is not None and math.isfinite(r) and b.measured[i]]
                if known:
                    out.add(max(known)[1])
        return out

    def _chosen(self, b: _Bucket, choice: int) -> int:
        b.tried[choice] += 1
        b.chose(choice)
        self.chosen_total[choice] += 1
        return choice

    def sampled(self, counter: int, bucket: int) -> bool:
        """Whether the round just chosen computes the expectations: an exploration or probe round always, any other
        one in sample_interval of the worker's round counter."""
        if self.sampling is not None:
            return self.sampling
        return counter % self.sample_interval(bucket) == 0

    def held_round(self, bucket: int, counter: int) -> tuple[int, bool] | None:
        """The worker's one call for a round whose bucket's decision holds: (candidate index, sampled), what choose()
        and sampled() would return; None when the bucket decides this round (the worker then drains the feedback
        and calls choose() and sampled())."""
        b = self.buckets.get(bucket)
        if b is None or b.hold <= 0:
            return None
        b.rounds += 1
        b.hold -= 1
        self.sampling = None
        return self._chosen(b, b.held), counter % self._sample_interval(b, bucket) == 0

    def deciding(self, bucket: int) -> bool:
        """Whether the bucket's next choose() decides (else it repeats the held choice)."""
        b = self.buckets.get(bucket)
        return b is None or b.hold == 0

    def sample_interval(self, bucket: int) -> int:
        """sample_every_idle while the bucket is settled, while the chain runs (chain_run) or leads every tree's best
        case by more than `close`; else sample_every."""
        return self._sample_interval(self._bucket(bucket), bucket)

    def _sample_interval(self, b: _Bucket, bucket: int) -> int:
        cfg = self.config
        if b.settled or (len(b.last_choices) == cfg.chain_run and b.others_in_run <= cfg.chain_run_others):
            return cfg.sample_every_idle
        return self._cached(("interval", bucket), lambda: self._chain_lead_interval(b, bucket), self._version)

    def _chain_lead_interval(self, b: _Bucket, bucket: int) -> int:
        chain_rate = self.rates(bucket)[self.chain]
        if chain_rate is None:
            return self.config.sample_every
        for i in (i for i, c in enumerate(self.candidates) if c > 0):
            best_case = self._best_case_rate(b, i)
            if best_case is None or best_case >= (1.0 - self.config.close) * chain_rate:
                return self.config.sample_every
        return self.config.sample_every_idle

    def observe(self, bucket: int, chosen: int, batch_size: int, round_ms: float | None,
                expected_sum: list[float] | None, observed_sum: list[float | None]) -> None:
        """One completed round: its GPU ms (None when unknown), the batch's expected tokens per candidate (None on
        a round that did not sample them; a None entry for a candidate without expectations, PLAIN) and the
        committed tokens of the candidates it observed (None = not observed; used only next to the same round's
        expectation)."""
        if batch_size < 1:
            return
        self._version += 1
        if expected_sum:
            self._tokens_version += 1
        keep, every = self.keep, self.config.sample_every
        b = self._bucket(bucket)
        b.seen[chosen] += 1
        if round_ms is not None and math.isfinite(round_ms) and round_ms > 0:
            if self.config.times_expire and b.expire(chosen, b.rounds - self.config.times_expire):
                b.round_ms[chosen] = _Decayed()  # restarts from the times kept
                for x in b.recent[chosen]:
                    b.round_ms[chosen].add(x, 1.0, keep)
            b.round_ms[chosen].add(round_ms, 1.0, keep)
            b.timed(chosen, round_ms)
            b.measured[chosen] += 1
            b.last_measured[chosen] = b.rounds
        self.rounds_observed += 1
        if expected_sum:
            # one sampled round stands for the sample_every-round stretches since the last one (weight k, keep^k), so
            # the means follow the drafter at the same pace whatever the sampling interval
            k = max(1.0, (self.rounds_observed - self._last_sampled) / every)
            self._last_sampled = self.rounds_observed
            keep_k = keep ** k
            for i, e in enumerate(expected_sum):
                if e is None:
                    continue
                self.expected[i].add(e / batch_size, k, keep_k)
                o = observed_sum[i]
                if o is not None:  # decayed over the rounds since this candidate's last sample: fresh beats old
                    since = max(1.0, (self.rounds_observed - self._last_observed[i]) / every)
                    self._last_observed[i] = self.rounds_observed
                    self.observed[i].add(o / batch_size, k, keep ** since)
                    self.observed_expected[i].add(e / batch_size, k, keep ** since)

    def export(self) -> dict:
        """The chooser's state, for logs and the debug dump."""
        labels = [candidate_label(c) for c in self.candidates]
        per_bucket = sorted(self.buckets.items())
        return {
            "candidates": labels,
            "rounds_chosen": dict(zip(labels, self.chosen_total)),
            "expected_tokens": {k: _r(self.expected[i].mean()) for i, k in enumerate(labels)},
            "observed_over_expected": {k: _r(self.ratio(i)) for i, k in enumerate(labels)},
            "round_ms": {str(n): {k: _r(b.round_ms[i].mean()) for i, k in enumerate(labels)} for n, b in per_bucket},
            "decisions": {str(n): {"rounds": b.rounds, "decisions": b.decisions, "settled": b.settled}
                          for n, b in per_bucket},
            # the rounds each candidate ran (observed so far) and its median time: a locked bucket shows here
            "rounds_by_bucket": {str(n): dict(zip(labels, b.seen)) for n, b in per_bucket},
            "median_ms": {str(n): {k: _r(b.median[i]) for i, k in enumerate(labels)} for n, b in per_bucket},
        }


class WalkSchedule:
    """Which of a candidate's walk stages a round runs: "plain" (an unsampled round: only its time), "sampled" (the
    observed candidates' committed tokens, for the chooser), "scored" (those and the calibration table's scoring and
    delta: the first sampled tree round, then one in calibration_every; every one while the table is young; every
    tree round, sampled or not, while it learns all), "learn" (the scored walk of an unsampled tree round, captured
    on the unsampled tree stage's outputs so that nothing is copied in). The chain is never scored (it teaches only
    top-1 cells, which every tree's first path teaches too). With calibration off only plain and sampled exist."""

    VARIANTS = ("plain", "sampled", "scored", "learn")
    SCORED = frozenset({"scored", "learn"})  # the variants whose walk computes the calibration's delta
    SAMPLED_TREE = frozenset({"sampled", "scored"})  # the variants that follow the sampled tree stage

    def __init__(self, config: AutoConfig | None = None):
        config = config or AutoConfig()
        self.enabled = config.calibration
        self.every, self.young, self.learn_all = (config.calibration_every, config.calibration_young,
                                                  config.calibration_learn_all)
        self.sampled_tree_rounds = 0

    def variants(self, chain: bool) -> tuple[str, ...]:
        """The walk stages a candidate needs built."""
        return self.VARIANTS if self.enabled and not chain else ("plain", "sampled")

    def variant(self, chain: bool, sampled: bool, monitor: CalibrationMonitor) -> str:
        """monitor: the table's host side (how much it scored and learnt since its last reset)."""
        if chain or not self.enabled:
            return "sampled" if sampled else "plain"
        learn_all = monitor.learnt < self.learn_all
        if not sampled:
            return "learn" if learn_all else "plain"
        scored = learn_all or monitor.request_rounds < self.young or self.sampled_tree_rounds % self.every == 0
        self.sampled_tree_rounds += 1
        return "scored" if scored else "sampled"


def _r(x):
    return None if x is None else round(float(x), 4)


def _kind(candidate: int) -> str:
    """Which code path a candidate's round runs: their times bound only their own kind's (_cost_floor)."""
    return "plain" if candidate == PLAIN else "chain" if candidate == CHAIN else "tree"


def observed_candidates(candidates: list[int], chosen: int) -> list[bool]:
    """Which candidates' committed tokens a round verifying candidates[chosen] observes exactly: the chain only
    itself; a tree every tree candidate up to its own budget (their trees are its first slots)."""
    c = candidates[chosen]
    if c <= CHAIN:  # the chain observes itself only; a round without a draft observes nothing else
        return [b == c for b in candidates]
    return [0 < b <= c for b in candidates]


class CalibrationMonitor:
    """The host side of the calibration table (adaptive.ScoreCalibrator, on the GPU; the scored walks compute what
    it learns, `learn` applies it): each scored round's |raw - committed| and |calibrated - committed| (both predicted
    before it learns the round) as totals and Prometheus counters; the table as Prometheus gauges (stats.TableGauges);
    reset (POST /set_internal_state {"server_args":
    {"ddtree_calibration_reset": 1}}). With calibration off nothing is scored, learnt or published."""

    def __init__(self, calibrator, prometheus=None, config: AutoConfig | None = None):
        config = config or AutoConfig()
        self.calibrator = calibrator
        self.prometheus = prometheus
        self.enabled, self.gate = config.calibration, config.calibration_gate
        self.gauges = TableGauges(calibrator, prometheus) if prometheus is not None and self.enabled else None
        self.raw_abs = self.calibrated_abs = self.gated_abs = self.request_rounds = 0.0
        self.learnt = 0  # request-rounds the table learnt since its last reset
        self.resets = 0

    def young(self) -> bool:
        """Whether the gated predictor is still the raw one, asked before the table learns the round."""
        return self.learnt < self.gate

    def errors(self, raw_abs: float, calibrated_abs: float, requests: float, young: bool = False) -> None:
        """A scored round's summed errors; young: young() when it predicted (the gated error is then the raw one)."""
        if requests <= 0:
            return
        gated_abs = raw_abs if young else calibrated_abs
        self.raw_abs += raw_abs
        self.calibrated_abs += calibrated_abs
        self.gated_abs += gated_abs
        self.request_rounds += requests
        if self.prometheus is not None:
            self.prometheus.calibration_errors(raw_abs, calibrated_abs, requests, gated_abs)

    def learn(self, delta: torch.Tensor, requests: int) -> None:
        """A scored round's delta, after the round (so graph warm-ups and captures teach nothing)."""
        self.calibrator.learn(delta, int(requests))
        self.learnt += requests

    def after_round(self) -> None:
        if self.gauges is not None:
            self.gauges.after_round()

    def reset(self) -> None:
        """Between rounds (a queued round may still add its delta); the gauges published at once and soon again."""
        self.calibrator.reset()
        self.raw_abs = self.calibrated_abs = self.gated_abs = self.request_rounds = 0.0
        self.learnt = 0
        self.resets += 1
        if self.gauges is not None:
            self.gauges.restart()

    def export(self) -> dict:
        """For logs and the debug dump (host values only: no sync)."""
        n = self.request_rounds
        return {"enabled": self.enabled, "scored_request_rounds": int(n), "resets": self.resets,
                "tau_mae_raw": _r(self.raw_abs / n) if n else None,
                "tau_mae_calibrated": _r(self.calibrated_abs / n) if n else None,
                "tau_mae_gated": _r(self.gated_abs / n) if n else None}


class AutoFeedback:
    """The GPU -> host channel of `auto`: one small vector per sampled round copied into pinned memory, read once
    its event and the round's timer events have completed (never waits)."""

    CALIBRATION = 3  # the vector's last entries: ops.calibration_round's errors (zeros when the round scored none)

    def __init__(self, policy: AutoBudgetPolicy, device, calibration: CalibrationMonitor | None = None):
        self.policy = policy
        self.calibration = calibration
        self.ring_size = 4 * policy.config.hold_max  # rounds queued between two decisions, the lag, and room
        self.width = 2 * len(policy.drafted) + self.CALIBRATION
        pin = torch.device(device).type == "cuda"
        # one pinned block, a row per slot (its rows are views: copied into without a sync, read with tolist)
        self.ring = torch.zeros((self.ring_size, self.width), dtype=torch.float32, pin_memory=pin)
        self.pending: collections.deque = collections.deque()
        self.index = 0
        self.dropped = 0

    def push(self, vector: torch.Tensor | None, timer, bucket: int, chosen: int, batch_size: int,
             cold: bool = False, sampled: bool = True, young: bool = False) -> None:
        """vector: [expected per candidate, observed per candidate, calibration errors] (batch sums); None on an
        unsampled round (only its time counts). cold: one-time work, its time does not count. young: see errors()."""
        if sampled and vector is None:
            raise ValueError("a sampled round must bring its feedback vector.")
        if len(self.pending) >= self.ring_size:
            self.dropped += 1
            return
        slot = event = None
        if sampled:
            slot = self.ring[self.index % self.ring_size]
            self.index += 1
            slot.copy_(vector, non_blocking=True)
            if vector.is_cuda:
                event = torch.cuda.Event()
                event.record(getattr(timer, "stream", None))  # the round's stream, when the timer has it
        self.pending.append((event, slot, None if cold else timer, bucket, chosen, batch_size, young))

    def drain(self) -> int:
        policy = self.policy
        done, n, m = 0, len(policy.candidates), len(policy.drafted)
        while self.pending:
            event, slot, timer, bucket, chosen, batch_size, young = self.pending[0]
            if (event is not None and not event.query()) or (timer is not None and not timer.done()):
                break
            self.pending.popleft()
            stages = timer.elapsed_ms() if timer is not None and timer.enabled and timer.marks else {}
            round_ms = sum(stages.values()) if stages else None
            done += 1
            if slot is None:  # an unsampled round: its time only
                policy.observe(bucket, chosen, batch_size, round_ms, None, [None] * n)
                continue
            values = slot.tolist()  # [expected, observed] per drafted candidate, then the calibration's errors
            seen = observed_candidates(policy.candidates, chosen)
            expected, observed = [None] * n, [None] * n
            for k, i in enumerate(policy.drafted):
                expected[i] = values[k]
                observed[i] = values[m + k] if seen[i] else None
            policy.observe(bucket, chosen, batch_size, round_ms, expected, observed)
            if self.calibration is not None:
                self.calibration.errors(*values[2 * m: 2 * m + self.CALIBRATION], young=young)
        return done

