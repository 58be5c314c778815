"""`--speculative-ddtree-budget auto` in the SGLang worker: one candidate budget per round, chosen on the host
without a host sync.

What the GPU gives (DDTreeWorker): on a sampled round (one in SAMPLE_EVERY; one in SAMPLE_EVERY_IDLE while the chain
leads or runs) the tree is built at the largest candidate budget and `adaptive.expected_acceptance` gives every
candidate's expected committed tokens (summed over the batch, the drafter's raw scores); after the walk, the
committed tokens of the chosen candidate and of every smaller tree candidate (`adaptive.subtree_accept_lengths`:
exact, the target's choice at a node does not depend on which other nodes were verified). Every round gives its
chained CUDA-event times (sum = GPU ms per round, host gaps included as `between`), except rounds that did one-time
work (graph captures), whose time is dropped. All of it reaches the host through pinned buffers and events
(`AutoFeedback`), a round or two late.

What the host decides (`AutoBudgetPolicy.choose`), per batch-size bucket (the CUDA-graph batch size the round
pads to, since verify cost follows it):
  rate(c) = est_tokens(c) / round_ms(bucket, c),   est_tokens(c) = expected(c) x ratio(c)
where expected(c) is a decayed mean of the drafter's expectation per request, ratio(c) the decayed observed /
expected of the sampled rounds in which c's tokens were observed (the drafter is over-confident off its top-1
path, more so for larger trees; a candidate never observed borrows the ratio of the nearest smaller observed one),
and round_ms(bucket, c) the median of its last RECENT measured round times (the decayed mean until there are 3),
a tree's drawn toward the trees' pooled time by the median's standard error (SHRINK_Z).
Unmeasured cells are explored first (each candidate `explore` rounds per bucket, WARM_ROUNDS - 1 more when its
first WARM_ROUNDS are left untimed; narrowest first) and the stalest candidate is re-measured every `probe_every`
rounds, so the estimates follow context growth; both skip a candidate that cannot win (its estimated tokens over a
floor of its round time, `_cost_floor`, do not beat the best rate).
The chain (DFLASH's top-1 path, verified causally like DFLASH) is always a candidate: the choice can only be slower
than the chain by estimation error, exploration and the per-round cost of the decision.
Lag: decisions use rounds that completed on the GPU, typically the ones one or two before the current round
(overlap scheduling keeps the host a round ahead). The choice is per round for the whole batch (verify shapes are
uniform across a batch).
"""

from __future__ import annotations

import collections
import logging
import math
import os
import time
from dataclasses import dataclass, field

import torch

from sglang_ddtree.adaptive import CHAIN, candidate_label

logger = logging.getLogger(__name__)


# Every candidate's expectation needs the top-K and the tree at the largest budget (0.20 ms a round at 8B shapes
# against the chain's 0.05 at batch 1, lease 9; the top-K alone 0.95 ms at batch 8 for K=256, lease 8). One round
# in SAMPLE_EVERY computes it; the others build only the chosen tree. While the chain leads every tree candidate by
# more than CLOSE (its rate against the tree's best case: estimated tokens over its cost floor), one round in
# SAMPLE_EVERY_IDLE: the expectations then only watch for the drafter becoming confident, and a lead that large
# takes a few samples to erase anyway. Expected saving at 8B shapes, batch 16, chain chosen: 3/16 of a sampled
# round's extra ~1.5-2 ms, ~0.3 ms of a ~11.6 ms step (not measured yet).
SAMPLE_EVERY = 4
SAMPLE_EVERY_IDLE = 16
CLOSE = 0.25
# ... and also while the chain has been chosen in all but CHAIN_RUN_OTHERS of the bucket's last CHAIN_RUN rounds
# (probes and exploration aside). A drafter that is never right (dummy weights) keeps the 16-tree's best case near
# the chain's rate at batch 1-16 (its verify costs barely more, its expectation is the chain's), so the CLOSE test
# alone kept sampling one round in 4 there: lease 14's 8B batch-16 profile, 8 sampled rounds of 30, each building
# the top-K and tree at B = 128. Expected saving at 8B shapes, batch 16: ~0.06 ms a round.
CHAIN_RUN = 32
CHAIN_RUN_OTHERS = 2

# The calibration table scores and learns on one sampled tree round in CALIBRATION_EVERY (the others run a walk
# without it). Since lease 20 it feeds only the prediction metrics and the exported table, not the choice, yet it was
# the sampled walk's largest part: ops.calibration_round is ~185 small kernels (lease 22b's batch-4 profile: `auto`
# 344 kernels a round against DDTREE 128's 268, ~46 of the difference the scoring), plus ~6 eager launches to learn.
# On a host-bound pair every graph node and launch is host time (lease 22b: cudaGraphLaunch 0.41 against 0.25 ms a
# round). Expected: ~35 kernels and ~1.5 launches fewer a round, ~1-2% of a tiny-pair round; the table sees a
# quarter of the observations (it still learns from thousands of nodes a minute). Measured with 217d929's other
# chooser changes (lease 23, sweep_paired_tiny_lease23.jsonl): x0.922 [0.890, 0.955] of DDTREE 128 against lease
# 22's x0.914 [0.873, 0.958], a difference the two runs cannot resolve.
CALIBRATION_EVERY = 4
# ... except while the table is young: until it has scored CALIBRATION_YOUNG request-rounds (its half-life; again
# after a reset) every sampled tree round is scored. Why: at batch 1, a sweep's first rows, the table had learnt from
# only ~200-480 scored request-rounds when measured (lease 22: 483, every sampled round scoring; 199-271 since), and
# its predictions came out worse than the raw scores there in every run since lease 22 (MAE raw / calibrated
# 1.30 / 1.39, lease 22; 1.235 / 1.243, 23b; 1.402 / 1.464, 24; 0.894 / 1.215, 24c) while better at batch 4-64.
# Offline, an empty table beats the raw scores only after a few hundred rounds (benchmarks/calibration_prior.py:
# rounds 300+ 1.211 against 1.250 at budget 128, the first 100 1.605 against 1.113). Expected: ~4x the data by the
# batch-1 rows, calibrated at or below raw there; the extra scoring runs only in those first rounds (~185 kernels on
# a sampled round). Measured (lease 24d, sweep_paired_tiny_lease24d.jsonl, one run): raw 1.024 / calibrated 1.008 at
# batch 1 on 948 scored request-rounds, 1.005 / 0.967 at batch 4.
CALIBRATION_YOUNG = 2000
# ... and with CALIBRATION_LEARN_ALL = N > 0, every tree round learns (sampled or not) until the table has learnt N
# request-rounds. Why: lease 25's 13 batch-1 tables all predicted worse than raw over ~370-700 scored request-rounds
# (calibrated 1.26-1.52 against raw 0.86-1.02), and offline (benchmarks/calibration_prior.py, tiny pair, errors on
# every 4th round either way) a table learning only from every 4th round, as the server's sampled rounds, was worse
# than raw after ~240-275 of them (1.317 / 1.143 against raw 1.192 / 1.114 in two runs,
# calibration_prior_b*_every4.json), one learning from every round better (1.170 / 1.079,
# calibration_prior_b*_score4.json), and one learning from every one of its first 500 rounds and one in four after
# better too (1.177 / 1.089, calibration_prior_b*_young500.json). The price: the scoring's kernels on every tree
# round of the first N request-rounds (an unsampled round runs the "learn" walk: the scored walk captured on the
# unsampled tree stage's outputs), and those rounds' times carry it (the chain's do not: it is never scored).
# Expected at N = 500: at batch 1 a few tenths of a second once per server, calibrated at or below raw there. Lease
# 26's A/B (tiny-starts, three servers per arm, sweep_starts_tiny_lease26.jsonl): batch-1 calibrated MAE 0.906 /
# 1.107 / 0.940 against raw 0.965 / 0.992 / 0.955 (the arm without: 1.098 / 1.051 / 1.131 against 0.986 / 0.965 /
# 1.010); tokens/s x0.996 [0.932, 1.065] of that arm at batch 1, x1.032 at 4. On by default;
# SGLANG_DDTREE_AUTO_CALIBRATION_LEARN_ALL=0 off.
CALIBRATION_LEARN_ALL = 500
# The gated predictor, reported next to the raw and the calibrated ones: the raw prediction until the table has learnt
# CALIBRATION_GATE request-rounds since its last reset, the table's after. Why: offline (calibration_prior.py, tiny
# pair, learning as the server does), the young table's loss is its first ~100 rounds (1.6-1.8 against 1.1-1.3 raw)
# and it ends about even with raw over ~1000 rounds (1.177 / 1.288 against 1.192 / 1.282 at budget 128 / 64), where
# the same table consulted only from its 100th learnt round reads 1.144 / 1.236 (200: 1.157 / 1.242; 25 or 50: no
# better than ungated; calibration_prior_b*_young500_gates.json). The table feeds no decision in the server, so the
# gate changes what is reported, not what runs: the calibrated series stays the table's own.
CALIBRATION_GATE = 100

# At its FORGET_START-th round a bucket re-measures its start, once: every candidate with times from the bucket's
# first FORGET_START // 2 rounds and a rate of at least STALE_HOPE of the best is explored again (whether or not it
# could win), and its start times are replaced once it has three new ones (0: never). Why: the rounds at a server's
# start and a candidate's first uses in a bucket run slow (lease 24's debug dump: a candidate's first timed rounds
# 1.13-1.47x its median; lease 26: the first explored trees 6.0-8.9 ms against ~4.0-4.4 later; lease 33c: the chain's
# exploration 6.4-7.8 ms against 3.7-5.4 for the trees), and only the incumbent's times refresh: the others keep
# their start times until a stale probe (STALE_ROUNDS) or a few probe_every probes replace them, so a start decided
# on such times can hold for hundreds of rounds (the tiny batch-1 rows of leases 21e-33c ran the 128-tree in 0-95%
# of their rounds). Re-measured after the incumbent has run a while, the others read their warm cost; their start
# times bound the wider candidates' floors until then, so nothing is explored blind. Simulated (simulate_auto_flat.py,
# 30 cases; mean of the cases' means / of their worst seeds / the worst seed; auto_flat_sim_forget_start*.json): with
# the chain no longer flooring the trees (_cost_floor) 0.9924 / 0.965 / 0.812, with this too 0.9929 / 0.980 / 0.893
# (before both, 0.9916 / 0.962 / 0.823); the tiny-like batch-1 starts' worst seeds 0.812-0.978 -> 0.954-0.977, the
# lock-out test 0.995 / 0.970 -> 0.998 / 0.992, the 8B-like cases unchanged (their wide trees, far behind the chain,
# are not re-measured), flat noise 0.10 0.997 -> 0.996. Measured (lease 34, tiny pair, in-process A/B against each
# server's fixed 128-tree arm; docs/gpu-suite.md "Lease 34"): not resolvable in the pooled ratios (x1.004 / 0.949 /
# 0.949 / 0.966 against x0.974 / 0.966 / 0.948 / 0.978 off, three servers per arm), but 4 of the 12 servers with it
# ran the chain for 95-310 rounds of a row (x0.88-0.96 there), none of the 6 without it more than 27: re-measured,
# the lean chain reads its warm 3.5-3.8 ms while the trees' observed / expected ratios stay those of their few
# start rounds (tiny-n8: the 128-tree's 0.74-0.86, an estimate of ~4.2 tokens a round where its fixed arm committed
# 5.87), which the simulation does not model (its ratios are exact).
# Off (0) until the trees' stale ratios are dealt with; SGLANG_DDTREE_AUTO_FORGET_START=128 turns it on, for an A/B.
FORGET_START = 0

# A decision of the best candidate holds for HOLD_ROUNDS rounds of its bucket (exploration and probes are single
# rounds), and the worker drains the feedback only before a decision (AutoBudgetPolicy.deciding). Why: lease 23's
# host stages timed the worker's chooser block (feedback drain, choose, sample_interval) at 0.15-0.17 ms a round on
# the tiny pair (host_stage_ms `choose`), ~4% of a host-bound round, where the same Python on the device's CPU, hot
# in a loop, takes ~45 us (auto_host_costs_lease23): inside the server every round's Python runs ~3x slower. The
# choice changes rarely (the 128-tree in 76-97% of the rounds at batch 4-64) and its feedback lags one or two rounds
# anyway. Expected: the block at ~1/HOLD_ROUNDS of its cost, ~0.1 ms a tiny round. Measured (lease 23b, another
# machine, sweep_paired_tiny_lease23b.jsonl): `choose` 0.12-0.14 ms (of which 0.04-0.10 the round's preparation,
# counted as the draft's since), `auto`'s host time a round 0.00-0.21 ms above DDTREE 128's (lease 23: 0.19-0.46),
# and x0.973 [0.932, 1.016] of DDTREE 128 over all batch sizes (lease 23: x0.922 [0.890, 0.955]).
HOLD_ROUNDS = 4
# ... and a decision of the best that repeats the bucket's previous decision holds twice as long as that one was
# meant to (HOLD_ROUNDS, 2x, 4x, ...), up to HOLD_MAX rounds and never past the bucket's next probe (probe_every),
# once every candidate wider than it was explored (_hold_after), so a settled bucket decides about once a probe
# interval; once its hold has grown to SETTLED_HOLD rounds the bucket
# samples one round in the idle interval (SAMPLE_EVERY_IDLE) instead of SAMPLE_EVERY, until a decision changes.
# Exploration (and its waits) and a changed decision start over at HOLD_ROUNDS and SAMPLE_EVERY; a probe (one round of
# another candidate) does not, unless its time changes the best. Why: lease 32b's
# in-process A/B on the tiny pair read `auto` x0.928 / 0.975 / 0.937 / 0.967 of its own fixed 128-tree arm with the
# same tau in both arms; what it spent was host time, 0.19-0.32 ms a round (the chooser block 0.05-0.09 ms, `after`
# 0.03-0.10, the sampled rounds' extra walk and tree work), and lease 28b's host profiles counted ~158 Python calls a
# round more in `auto` than in DDTREE 128, at ~1 us a call in the server. A decision (drain + choose) is ~100-300
# calls, a sampled round's extra ~50 host calls plus its larger graphs and copies; a settled bucket of the tiny pair
# (the 128-tree in 88-97% of its rounds) makes ~1 decision and ~4 sampled rounds in 64 instead of 16 and 16.
# Expected: ~0.1 ms a tiny round off `auto`'s host time (~2%), the same picks within the simulator's noise
# (simulate_auto_flat.py; a change of the best is seen at the next decision, at most HOLD_MAX rounds late instead of
# HOLD_ROUNDS). SGLANG_DDTREE_AUTO_HOLD_MAX=4 and SGLANG_DDTREE_AUTO_SETTLED_SAMPLING=0 give the previous behaviour.
# Simulated: mean 0.9923 against 0.9919 of the best rate (auto_flat_sim_settled*.json). Measured (lease 33c, A/B,
# two servers): decisions 1 in 11-17 rounds at batch 4-64, the chooser block 0.04-0.05 ms a round (0.06-0.08 before),
# `auto` x0.967-1.010 of its fixed arm there, x0.969 / 0.977 over all batch sizes; neither server ran the 128-tree in
# its batch-1 rows (its first), x0.90 / 0.99 there (docs/gpu-suite.md, "Lease 33").
HOLD_MAX = 64
SETTLED_HOLD = 32

# Relative timing noise the chooser allows for when it bounds a candidate's round time (_cost_floor). An allowance,
# not a measurement: whole runs of one tiny-pair configuration moved 10-20% in lease 10 (sweep_auto_lease10.jsonl);
# a decayed mean over many rounds of one server should move less.
NOISE = 0.1

# A round whose host time (RoundTimer.host_ms, the worker's round call from its start to the commit mark) exceeds
# STALL_HOST_MS did one-time work that no counter saw (a Triton kernel compiled outside a graph capture, a first
# allocation, a long GC pause): like a round that captured graphs, its tokens count and its time does not (the
# chooser's timing, the A/B tallies). Why: in 5 of ~800 runs of leases 31-32's in-process A/B an `auto` arm took
# 10.6-16.5 ms a round over a run against its fixed arm's 4.2-7.1, always the `auto` arm and mostly a batch size's
# first run (tiny-r at batch 1: the row's walk stage 1.19 ms of host time a round against 0.22): the server's first
# lean chain round at a new variant of its eager accept kernel (DDTreeWorker._chain_round) fell there and compiled it
# (now warmed at each bucket's capture: DDTreeWorker._warm_chain_accept). Lease 32b: no such run left. A round's
# host time is ~3-6 ms on the tiny pair and below the GPU's ~7-36 ms at 8B shapes; a Triton compile takes ~300-500 ms.
# The limit is STALL_FACTOR times the median host time of the server's last STALL_WINDOW rounds when that is larger
# (StallDetector): where a deployment's rounds all take long on the host (a large GPU-bound batch whose launches wait
# for the GPU), a fixed limit would make every round cold and leave the chooser without times.
STALL_HOST_MS = 50.0
STALL_FACTOR = 10.0
STALL_WINDOW = 32

# Exploration waits at most this many rounds for a candidate's first timed round before it explores wider ones
# (a round is timed unless it was cold; the feedback lags by one or two rounds).
MAX_UNMEASURED = 8

# Timing statistics over each candidate's last RECENT timed rounds: cost floors take the least (a floor must not
# exceed the cost; a mean of a few samples can), rates the median (one slow round cannot move it). Lease 12's tiny
# sweep (host-bound rounds, timings +-10% with outliers): with decayed means, one slow sample of a rarely verified
# tree raised its floor and, through the secant, every wider tree's, so `auto` ran the chain in 722 of 746 batch-4
# rounds while the 64- and 128-trees were 14-23% faster. Simulations of that case (tests/test_sglang_auto.py, 20
# seeds): below 0.9 of the best candidate's rate in 6 runs with means; worst 0.956, mean 0.981 with least / median.
RECENT = 8

# The tree candidates' round times are drawn toward their pooled time by SHRINK_Z standard errors of their medians
# before rates compare them (_shrunk_tree_ms). Why: on a host-bound pair every tree's round costs about the same
# (lease 19's tiny pair at batch 1: 32-, 64-, 128-tree 4.31 / 4.41 / 4.32 ms), so whichever tree's recent median
# came out lowest won, and the narrower trees took 32% of auto's rounds at batch 1 and 45% at batch 64 while the
# 128-tree commits the most (x0.865 / 0.894 of the fixed 128-tree, sweep_auto_tiny_lease19.jsonl). Simulated
# (benchmarks/simulate_auto_flat.py, min / mean of the best rate over seeds, before -> after): flat costs at noise
# 0.10 0.974 / 0.983 -> 0.995 / 0.997, at 0.20 0.961 / 0.969 -> 0.990 / 0.993; the 8B-like cases 0.998 both; the
# lock-out, slow-sample and slow-phase scenarios of tests/test_sglang_auto.py 0.970 / 0.990, 0.955 / 0.981,
# 0.967 / 0.986 -> 0.971 / 0.993, 0.962 / 0.989, 0.981 / 0.991 (20-40 seeds); a case where two trees' rates lie
# 0.5% apart with real cost gaps (11 / 12.5 ms at 5% noise) 0.996 -> 0.993: real differences shrink by the error
# too. SHRINK_Z = 2 took the flat cases to 0.997 but the lock-out mean to 0.982. Not yet measured on a GPU.
SHRINK_Z = 1.0
# The spread of a candidate's recent times that SHRINK_Z's standard error uses: "iqr" (the interquartile range as a
# normal sigma) or "mad" (the median absolute deviation as one). Why "mad" would: the IQR of RECENT = 8 times breaks
# at two outliers. Simulated (simulate_auto_flat.py, 8B-like batch 16 after batch 1, convex): two 2x rounds among the
# 16-tree's last eight put its spread at 8.4 ms (0.3 before), SHRINK_Z drew its 11.7 ms toward the trees' pooled ~19
# to 15.4, and the chain (never drawn: it verifies causally) won for hundreds of rounds at a rate ~20% below the
# 16-tree's, the 16-tree re-timed only by probes (three of sixteen seeds 0.943-0.965 of the best rate; with
# EXPLORE_ROUNDS = 4 one seed 0.823). The median absolute deviation breaks at half the window. Simulated
# (auto_flat_sim_lease26_mad*.json against auto_flat_sim_lease26_*.json, mean / min of the best rate): that case
# 0.987 / 0.943 -> 0.995 / 0.988, with FLOOR_MIN_TIMES = 2 and EXPLORE_ROUNDS = 4 0.970 / 0.823 -> 0.995 / 0.994;
# every case's mean with all three 0.982 or more (0.892 with none). GPU A/B, lease 27 (paired_arms_starts_tiny_
# lease27.json, "plus_mad"): with FLOOR_MIN_TIMES = 2 and EXPLORE_ROUNDS = 4, x0.977 [0.926, 1.030] / x0.963 [0.901,
# 1.029] of the arm with neither at batch 1 / 4, below the arm with the two alone (x1.013 / 1.021); two of its three
# batch-1 servers had run the 128-tree <= 4 rounds after 400 (auto_chooser_log_starts_lease27.txt). The convex
# 8B-like case it was written for has no GPU setup (no drafter right at 8B shapes). Off ("iqr"); kept for A/Bs
# (SGLANG_DDTREE_AUTO_SPREAD=mad).
SPREAD = "iqr"

# Evidence goes stale. Lease 18's tiny sweep at batch 4 (sweep_auto_tiny_lease18_dchain.jsonl, setup `tiny`): the
# 128-tree's observed / expected stayed at 0.197 from a few early rounds (every batch-size row reported the same
# value) and the 16- / 32-trees' times at 6.1 / 6.6 ms from their exploration, above the 64-tree's 4.7, so no
# estimate could let the 128-tree win again and `auto` ran the 64-tree in 4879 of 5713 rounds, x0.855 of the fixed
# 128-tree (tests/test_sglang_auto.py reproduces it: a slow start whose rounds commit few tokens). Now:
# - a candidate's observed / expected decays with the rounds since it was last observed (not only when a new
#   sample arrives), so one fresh sample outweighs old ones;
# - a wider tree is estimated to commit at least what a narrower tree commits (its first slots are that tree:
#   exact per round);
# - a candidate whose last timed round lies more than STALE_ROUNDS rounds of its bucket back is a probe (one round
#   in probe_every re-measures the stalest probe) even when its estimates say it cannot win: its times also
#   bound the wider candidates' cost floors; a candidate never timed stays unexplored while it cannot win;
# - probe and exploration rounds carry the expectations (`sampling`), so a probe also refreshes the ratio.
STALE_ROUNDS = 256
# A candidate's new timed round drops its times from more than TIMES_EXPIRE rounds of its bucket before it (0: times
# are kept until RECENT newer ones push them out), and its decayed mean restarts from the times it keeps. Why: only
# the running candidate's times refresh; another keeps the times it had when it last ran, and a stale probe adds one
# time in STALE_ROUNDS to its RECENT, so its median stays that of rounds hundreds of rounds old. Lease 34c's
# `tiny-o1` (auto_chooser_log_tiny_lease34c.txt): at batch 4 its 128-tree's median was 6.38 ms, its exploration's at
# the bucket's start, while the same server's fixed arm ran that tree at 4.17 ms a round and `auto` ran the 64-tree
# (4.33 ms) in 429 of the row's 441 rounds (x0.929 of the fixed arm, tau 6.44 against 6.64); at batch 1 the same
# (5.44 against 4.25 ms for the 64-tree, 233 of 363 rounds, x0.920). With the old times dropped at the stale probe,
# the probe's time is the candidate's (the decayed mean until it has three again: _typical_ms); a slow one keeps it
# out until the next stale probe, as before. Nothing is explored that was not: only the times a probe brings replace
# older ones, and the expired times still bound the candidate's floor until it has enough new ones (_bound_ms), so
# the wide trees that cannot win at 8B-like shapes are probed no more often than before. Simulated
# (simulate_auto_flat.py, 31 cases; mean of the cases' means / of their worst seeds / the worst seed;
# auto_flat_sim_times_expire*.json): 0.9919 / 0.964 / 0.733 against 0.9921 / 0.962 / 0.812 without - neutral on
# the whole: the slow-start lock-outs gain (the lock-out test's worst seed 0.970 -> 0.993, the convex 8B-like batch
# 16 after batch 1 0.823 -> 0.955, host drift 0.975 -> 0.989), cases where a single probe's time is noise lose
# (content and token noise 0.997 -> 0.993), and one seed of the tiny-like start with dear sampled rounds runs the
# chain more (0.812 -> 0.733: the trees' stale observed / expected ratios, which this leaves alone). Measured (lease
# 35, tiny pair, in-process A/B against each server's fixed 128-tree arm, six servers per arm, 8 runs a row, runs
# pooled; sweep_ab_tiny_lease35*.jsonl): with it x0.996 [0.959, 1.034] / 0.962 [0.932, 0.994] / 0.991 [0.969,
# 1.013] / 0.996 [0.981, 1.010] at batch 1 / 4 / 16 / 64, without x0.989 / 0.964 / 0.993 / 0.969 [0.955, 0.984];
# at batch 64 (a server's last bucket) all six servers with it read 0.992-1.000 and all six without 0.944-0.987;
# over all batch sizes x0.986 [0.973, 1.000] against x0.979 [0.966, 0.992]. On by default;
# SGLANG_DDTREE_AUTO_TIMES_EXPIRE=0 turns it off.
TIMES_EXPIRE = 256

# With EXPLORE_BEST_ELSEWHERE a new bucket's exploration also tries every candidate that has the best rate in another
# bucket, whatever its cost floor says. Why one would: lease 25's tiny sweep (sweep_paired_tiny_lease25.jsonl, the
# `auto` server's log) at batch 4, after batch 1 where the 128-tree led: the 64-tree's first timed rounds read 6.86
# ms against the 32-tree's 3.9, and the floors built on them kept the 128-tree unexplored for ~900 rounds, which
# then ran at 3.9-4.3 ms and won; `auto` x0.897 [0.836, 0.963] of DDTREE 128 there. Every new batch-size bucket of
# a server starts that way. The price: a candidate explored that way is then measured, so it is re-probed every
# STALE_ROUNDS even when it is far from winning (at 8B-like convex costs the 128-tree at batch 16, 6x the chain's
# round: ~1-3% of the bucket's time simulated), so stale probes skip a candidate explored that way while its best case
# is below STALE_HOPE of the best rate. (Applied to every stale candidate, that guard cost the lock-out test's
# scenario 0.995 / 0.987 -> 0.988 / 0.930 mean / min: stale probes are how a candidate misread at a slow start
# comes back.) Simulated (simulate_auto_flat.py, auto_flat_sim_best_elsewhere.json against auto_flat_sim.json, mean
# / min of the best rate): tiny-like batch 4 after batch 1 with slow first uses 0.962 / 0.925 -> 0.982 / 0.962,
# the 8B-like batch 16 after batch 1 cases within ~0.005, the one-bucket cases unchanged (no other bucket).
# Lease 26's A/B (tiny-starts, three servers per arm, batch 1 then 4, sweep_starts_tiny_lease26.jsonl): at batch 4
# x1.065 [0.992, 1.142] of the arm without it; the 8B shapes x0.982 of DFLASH pooled against 0.968 without
# (sweep_auto_8b_lease26.jsonl). On by default; SGLANG_DDTREE_AUTO_EXPLORE_BEST_ELSEWHERE=0 turns it off.
EXPLORE_BEST_ELSEWHERE = True
STALE_HOPE = 0.5

# A candidate's first WARM_ROUNDS rounds in a bucket can be left untimed (the first is cold anyway: the worker drops
# its time), exploration then trying it WARM_ROUNDS - 1 more rounds to time as many as before. Why one would: lease
# 24's debug dump (tiny pair, batch 1, every round's stage times, debug_rounds_tiny_lease24.json) timed the round
# after each candidate's cold first use at 1.13-1.47x the candidate's median and the next at 1.04-1.17x, and
# exploration times exactly those, so an explored candidate reads dearer than the incumbent's many rounds; lease
# 23b's batch-1 server ran the 64-tree ~650 rounds while the 128-tree, explored at 5.8 ms, ran at 3.9-4.3 later.
# Simulated (simulate_auto_flat.py, 48 seeds, mean / min best rate, auto_flat_sim_warm3.json against
# auto_flat_sim.json): the tiny-like batch-1 start with that warm-up 0.967 / 0.861 -> 0.983 / 0.897, without it
# 0.987 / 0.899 -> 0.983 / 0.897, the two starts whose first 20 rounds all run 1.5x slow 0.986 / 0.953 ->
# 0.975 / 0.840 and 0.960 / 0.827 -> 0.953 / 0.741, the rest within 0.004. Measured on the GPU (lease 24c,
# sweep_paired_tiny_lease24c.jsonl, both servers interleaved with DDTREE 128 from their start): x0.921 / 0.970 of
# DDTREE 128 at batch 1 / 4 with WARM_ROUNDS = 3, x0.951 / 1.004 with 0. The 3-server's first explored tree still
# read 5.4 ms against the chain's 3.0 after its two warm rounds were dropped, so it ran the chain ~850 rounds and
# left the 32- to 128-trees unexplored: a server's first rounds vary more than two dropped rounds absorb. Off.
WARM_ROUNDS = 0

# Cost floors use other candidates' times from the bucket's last FLOOR_FRESH rounds only (0: every recent time).
# Off by default; see AutoBudgetPolicy.floor_fresh.
FLOOR_FRESH = 0

# A candidate's times bound cost floors (its own and the wider candidates') only once it has FLOOR_MIN_TIMES timed
# rounds in the bucket; until then a floor comes from the others' times (None if there are none: exploration goes
# on). Why: lease 26's batch-1 `auto` servers (auto_chooser_log_starts_lease26.txt, auto_chooser_log_tiny_lease26.txt):
# in nine of ten a tree explored early read 6.0-8.9 ms in its one or two timed rounds against ~4.0-4.4 once it ran;
# that time floored the tree itself and, through the secant (a 32-tree at 6.7 ms after a 16-tree at 3.7 extends to
# ~23 ms at width 129), every wider one, and the 128-tree first ran after 200-600 rounds, mostly at the first stale
# probe (STALE_ROUNDS). A least of two times is robust to one slow first round.
# With a cold first round untimed, exploration's EXPLORE_ROUNDS tries give a candidate EXPLORE_ROUNDS - 1 timed
# rounds: the previous 3 gave two, the most FLOOR_MIN_TIMES = 2 could ask of exploration alone; 4 gives three.
# Simulated (simulate_auto_flat.py, mean / min of the best rate, auto_flat_sim_lease26_*.json; mean over all cases
# 0.985 with FLOOR_MIN_TIMES = 1 and EXPLORE_ROUNDS = 3): FLOOR_MIN_TIMES = 2 0.987, EXPLORE_ROUNDS = 4 0.990, both
# 0.992; the tiny-like batch-1 starts with slow first uses (x1.3 to x1.8) 0.892-0.967 -> 0.987-0.990 with both, the
# 8B-like batch 16 after batch 1 (convex; the 128-tree, best at batch 1, explored there 73 ms a round against the
# chain's 11) 0.987 / 0.943 -> 0.970 / 0.823 over its 1500 rounds (its worst seeds run the chain for the 16-tree, a
# confusion three of its sixteen seeds show with 1 and 3 too; SPREAD). The price where wide trees cannot win (lease
# 10's 8B shapes at batch 16, a drafter never right; tests/test_sglang_auto.py): the 32-tree's one timed round no
# longer gives the secant, so the 64-tree is explored (three rounds, two timed) and the 128-tree once (cold) before
# the 64-tree's own times floor them out; with 1 neither ran. Defaults (FLOOR_MIN_TIMES = 2, EXPLORE_ROUNDS = 4;
# SGLANG_DDTREE_AUTO_FLOOR_MIN_TIMES=1 and SGLANG_DDTREE_AUTO_EXPLORE_ROUNDS=3 give the previous chooser).
# GPU A/B, lease 27 (tiny pair, three `auto` servers per arm, batch 1 then 4, 24 runs; paired_arms_starts_tiny_
# lease27.json): x1.013 [0.969, 1.059] / x1.021 [0.967, 1.079] of the arm with 1 and 3 at batch 1 / 4, no
# interval clear of 1; its three batch-1 servers verified the 128-tree within 100-200 rounds (two of three with 1
# and 3 first ran it in rounds 300-400 / 100-200). 8B shapes (sweep_auto_8b_lease27.jsonl): x0.972 / 0.981 / 0.991
# of DFLASH at batch 1 / 4 / 16 against 0.964 / 0.975 / 0.981. Made defaults on that consistent small gain, not on
# significance.
FLOOR_MIN_TIMES = 2
# Exploration's rounds per candidate and bucket (the policy's `explore`): as many timed rounds, the cold first one
# left untimed by the worker making one fewer. 4 by default with FLOOR_MIN_TIMES = 2 (3 before; see there).
EXPLORE_ROUNDS = 4

# With RELATIVE_TIMES a candidate's round time for its rate is read against the bucket's reference candidate (the one
# timed most in its last REFERENCE_WINDOW timed rounds, the incumbent): the reference's own median times the median
# ratio of the candidate's timed rounds to the reference's timed rounds next to them (at most PAIR_GAP rounds of the
# bucket apart, both sampled or both not: a sampled round costs more), a tree's ratio drawn toward 1 by SHRINK_Z
# standard errors as the pooled shrinkage draws times (_Bucket._pair). Why: the host's speed drifts by a third over
# minutes on the tiny pair (lease 21b), and a probed tree's few times, taken when the host ran fast, read up to ~10%
# below the incumbent's many, taken over all of it: lease 31's free `auto` servers ran the 32- and 64-trees in 8-41%
# of their rounds (auto_chooser_log_tiny_lease31.txt), committing 4-9% fewer tokens a round at the same cost. Rounds
# a few milliseconds apart share the host's speed, as lease 31's in-process A/B's arms do. A candidate with fewer
# than PAIR_MIN such pairs keeps its own median, as does one whose newest pair is older than STALE_ROUNDS observed
# rounds of the bucket. The ratio assumes the two candidates' costs move together; one may step alone (a
# context-dependent cost, tests/test_sglang_auto.py's step test): a pair's newest entry off its median by more than
# LEVEL_MOVED (log) and two sigmas has the candidate probed at the next decision if it could win (a probe brought
# forward: at least REPROBE_GAP rounds, or probe_every if fewer, after the last probe), and two such
# entries in a row, the same way, restart the pair from them. (A development variant that fell back to the
# candidate's own median on one such entry, or whenever the reference's median had moved by LEVEL_MOVED since the
# newest pair, gave back most of the simulated gain: host drift and 2x outliers trip both; mean 0.9923, not kept.)
# Simulated (simulate_auto_flat.py, 29 cases, mean of the cases' mean / worst case's mean / mean of the cases' worst
# seed; auto_flat_sim_relative.json against auto_flat_sim_relative_off.json): 0.9942 / 0.989 / 0.977 against
# 0.9919 / 0.970 / 0.964; the `flat, host drift` cases 0.986 / 0.991 -> 0.996 (the 64-tree's share 27% / 14% ->
# 3% / 2%), the convex 8B-like batch 16 after batch 1 0.970 -> 0.994, the 8B-like batch 1 0.998 -> 0.996 (the chain's
# share 98% -> 90%: a chain and a tree are not drawn together), the `real cost gaps` case 0.993 -> 0.989. GPU A/B,
# lease 32 (tiny pair, two `auto` servers per arm, each against its own fixed 128-tree arm, 14 runs a batch size;
# sweep_ab_tiny_lease32.jsonl): the 128-tree ran 88 / 91% of the `auto` rounds against 82 / 84% without, but the
# arms' ratios did not move: pooled x0.926 / 0.956 against x0.948 / 0.960 (batch 4-64 x0.946-0.973 against
# 0.935-0.966; one batch-1 run of one server lost ~0.5 s in its `auto` arm to a compile: STALL_HOST_MS). The rest of
# the gap is `auto`'s host time a round (+0.2-0.3 ms), not its choices. Off; SGLANG_DDTREE_AUTO_RELATIVE_TIMES=1 on.
RELATIVE_TIMES = False
REFERENCE_WINDOW = 32
PAIR_GAP = 32
PAIR_MIN = 3
LEVEL_MOVED = 0.15
REPROBE_GAP = 16

# With SWITCH_UNTIMED a round whose candidate is not its bucket's previous round's is left untimed (its tokens and
# expectations still count), and a probe runs PROBE_ROUNDS rounds in a row, so that the probe's time is a round like
# the incumbent's many and not the switch's. Why: lease 36's A/B tallies split `auto`'s rounds (ab_arms' narrower_*):
# where a row verified a candidate other than the 128-tree only in a few probes and exploration rounds (3-25 of ~400-
# 600), those rounds took 1.12-1.55x, typically ~1.25x, the same server's fixed 128-tree round (tiny-e6..e9 at batch
# 4: 6.14-6.89 against 4.86-5.41 ms) - a switch of graphs and attention state, a sampled round and a decision in one.
# A candidate that is not the incumbent is timed almost only in such rounds, so it must beat the incumbent by ~25% to
# take over; on the tiny pair, where the candidates' rates lie within ~5-20% of each other, whichever won the bucket's
# first decisions kept it: tiny-e4's batch-4 rows ran the chain in 448 of 465 rounds (x0.913 of its fixed arm) with
# its 128-tree's bucket median at 6.74 ms while its fixed arm ran that tree at 5.27, tiny-e3's batch-1 rows the chain
# in all 384 (x0.834), tiny-w3's the 64-tree in 274 of 330 (auto_chooser_log_tiny_lease36*.txt). (SWITCH_SETTLE, a
# probe's second round timed, was tried in lease 25 with the simulator's switches at x1.04 and gained nothing.) The
# price: a probe verifies its candidate twice (one round in probe_every more of a candidate that is not the best).
# Simulated (simulate_auto_flat.py, 35 cases with lease 36's, switched rounds x1.2 plus 0.3 ms sampled;
# auto_flat_sim_switch_untimed*.json; mean of the cases' means / of their worst seeds / the worst seed): 0.9891 /
# 0.963 / 0.875 against 0.9916 / 0.960 / 0.733 without - the worst seeds gain (the lease-36-like batch-1 start 0.815
# -> 0.912, the tiny-like start with dear sampled rounds 0.733 -> 0.880, the milder convex 8B-like batch 16 0.906 ->
# 0.990), the settled flat cases lose 0.3-0.5% (the probes' second rounds), and one seed of the lease-36-like batch 4
# ran the chain (0.987 -> 0.897). The simulator does not reproduce the GPU's lock-ins (its batch-4 case reads 0.995
# without this, the GPU 0.958), so a GPU A/B decides. Measured (lease 37, tiny pair, in-process A/B against each
# server's fixed 128-tree arm, seven servers per arm, 8 runs a row, runs pooled; sweep_ab_tiny_lease37*.jsonl):
# x0.990 / 0.977 / 0.976 / 0.963 at batch 1 / 4 / 16 / 64 with it, x1.001 / 0.979 / 0.961 / 0.975 without, x0.977
# [0.965, 0.989] against x0.979 [0.966, 0.992] over all; rows on a narrower candidate for more than 30% of their
# rounds 8 of 28 with it, 3 of 28 without. No gain: off. SGLANG_DDTREE_AUTO_SWITCH_UNTIMED=1 turns it on.
SWITCH_UNTIMED = False
PROBE_ROUNDS = 2


@dataclass
class _Decayed:
    """Exponentially decayed sum pair (value, weight): mean = value / weight."""

    value: float = 0.0
    weight: float = 0.0

    def add(self, x: float, w: float, keep: float) -> None:
        self.value = self.value * keep + x * w
        self.weight = self.weight * keep + w

    def mean(self) -> float | None:
        return self.value / self.weight if self.weight > 0 else None


@dataclass
class _Bucket:
    round_ms: list[_Decayed]
    measured: list[int]  # rounds measured per candidate
    tried: list[int]  # rounds chosen per candidate (exploration counts choices, not the lagged measurements)
    last_measured: list[int]  # round index of the last measurement
    waited: list[int]  # rounds exploration waited for the candidate's first timed round
    recent: list[collections.deque]  # the last RECENT measured round ms per candidate
    recent_at: list[collections.deque]  # the bucket's round at each of them (FORGET_START)
    # per candidate, of `recent` (_Bucket.timed keeps them current): its median, interquartile spread as a normal
    # sigma and least; kept, not recomputed, because the chooser reads them every round and only the timed
    # candidate's change (sorting every candidate's times each round was ~half of choose())
    median: list = field(default_factory=list)
    spread: list = field(default_factory=list)
    least: list = field(default_factory=list)
    rounds: int = 0
    last_choices: collections.deque = field(default_factory=lambda: collections.deque(maxlen=CHAIN_RUN))
    others_in_run: int = 0  # of last_choices, those not the chain (index 0)
    held: int = 0  # the last decision, repeated while hold > 0
    hold: int = 0  # rounds the held choice still runs without a decision (HOLD_ROUNDS)
    best: int | None = None  # the last decision of the best (probes, exploration and waits aside)
    streak: int = 0  # decisions of the best in a row that repeated the one before (HOLD_MAX)
    settled: bool = False  # the hold grew to SETTLED_HOLD: sampled rounds at the idle interval (SETTLED_HOLD)
    decisions: int = 0  # rounds that decided (choose() past a hold), for the export
    forgot: bool = False  # its start was re-measured (FORGET_START)
    expired_least: list = field(default_factory=list)  # per candidate, the least of its last expired times
    # FORGET_START: candidate -> (the start's last round, the round it was flagged at, new times needed): its times of
    # the start's rounds are dropped once it has that many timed after the flag
    replace: dict = field(default_factory=dict)
    next_probe: int = 0  # the first round at which a probe may run again (probe_every)
    last_probe: int = -(10 ** 9)  # the round of the last probe (a RELATIVE_TIMES re-probe waits REPROBE_GAP after it)
    seen: list = field(default_factory=list)  # rounds observed per candidate, timed or not (WARM_ROUNDS)
    last_observed: int = -1  # the candidate of the bucket's last observed round (SWITCH_UNTIMED)
    elsewhere: set = field(default_factory=set)  # candidates explored as another bucket's best (EXPLORE_BEST_ELSEWHERE)
    mad: bool = False  # spread as the median absolute deviation, else the interquartile range (SPREAD)
    # RELATIVE_TIMES: rounds observed in the bucket; per sampled flag the last timed round (candidate, observed round,
    # log ms); per candidate pair (lo, hi) the last RECENT log(ms_hi / ms_lo) of neighbouring timed rounds and their
    # (median, sigma); the candidates of the last REFERENCE_WINDOW timed rounds and their counts
    relative: bool = False
    observed_rounds: int = 0
    last_timed: dict = field(default_factory=dict)
    pairs: dict = field(default_factory=dict)
    pair_stats: dict = field(default_factory=dict)
    window: collections.deque = field(default_factory=lambda: collections.deque(maxlen=REFERENCE_WINDOW))
    window_counts: list = field(default_factory=list)
    reprobe: set = field(default_factory=set)  # candidates to probe at the next decision
    reprobed: set = field(default_factory=set)  # pairs whose newest entry lies off and that asked for that probe

    def __post_init__(self):
        n = len(self.recent)
        self.median, self.spread, self.least = [None] * n, [None] * n, [None] * n
        self.expired_least = [None] * n
        self.seen = [0] * n
        self.window_counts = [0] * n

    def chose(self, i: int) -> None:
        if len(self.last_choices) == self.last_choices.maxlen and self.last_choices[0] != 0:
            self.others_in_run -= 1  # leaves the window
        self.last_choices.append(i)
        self.others_in_run += i != 0

    def expire(self, i: int, before: int) -> bool:
        """Drop candidate i's times taken at bucket rounds before `before` (TIMES_EXPIRE); True if any went. Its
        statistics are recomputed by the next `timed` call (the caller's)."""
        at = self.recent_at[i]
        if not at or at[0] >= before:
            return False
        dropped = []
        while at and at[0] < before:
            at.popleft()
            dropped.append(self.recent[i].popleft())
        self.expired_least[i] = min(dropped)  # still its cost floor until it has enough new times (_cost_floor)
        return True

    def timed(self, i: int, ms: float, sampled: bool = False) -> None:
        """Candidate i's round took ms (sampled: the round computed the expectations): into its recent times and
        their statistics, and with RELATIVE_TIMES into its ratio to the last timed round of another candidate."""
        if self.relative:
            self._pair(i, math.log(ms), sampled)
        self.recent[i].append(ms)
        self.recent_at[i].append(self.rounds)
        if i in self.replace:  # re-measured (FORGET_START): once it has `needed` new times, the start's go
            start, flagged, needed = self.replace[i]
            if sum(a > flagged for a in self.recent_at[i]) >= needed:
                del self.replace[i]
                kept = [(x, a) for x, a in zip(self.recent[i], self.recent_at[i]) if a > start]
                self.recent[i].clear()
                self.recent_at[i].clear()
                for x, a in kept:
                    self.recent[i].append(x)
                    self.recent_at[i].append(a)
        xs = sorted(self.recent[i])
        n = len(xs)
        self.median[i], self.least[i] = xs[n // 2], xs[0]
        if self.mad:  # the median absolute deviation as a normal sigma (SPREAD)
            deviations = sorted(abs(x - xs[n // 2]) for x in xs)
            self.spread[i] = 1.4826 * deviations[n // 2]
        else:
            self.spread[i] = 0.7413 * (xs[(3 * n) // 4] - xs[n // 4])  # the interquartile range as a normal sigma

    def _pair(self, i: int, log_ms: float, sampled: bool) -> None:
        """RELATIVE_TIMES' bookkeeping for a timed round of candidate i (before observed_rounds moves on)."""
        last = self.last_timed.get(sampled)
        if last is not None and last[0] != i and self.observed_rounds - last[1] <= PAIR_GAP:
            j, _, log_j = last
            key = (min(i, j), max(i, j))
            diffs = self.pairs.setdefault(key, collections.deque(maxlen=RECENT))
            self.reprobed.discard(key)
            diff = log_ms - log_j if i > j else log_j - log_ms  # log(ms_hi / ms_lo)
            before = self.pair_stats.get(key)
            # the newest entry off the pair's median by more than LEVEL_MOVED and two sigmas: the ratio may have
            # changed (one candidate's cost stepped alone); two such entries in a row, the same way, restart the pair
            off = 0
            if before is not None and diffs and before[2] >= 2 and abs(diff - before[0]) > max(LEVEL_MOVED,
                                                                                                2.0 * before[1]):
                off = 1 if diff > before[0] else -1
                if before[4] == off:
                    diffs = self.pairs[key] = collections.deque(list(diffs)[-1:], maxlen=RECENT)
                    off = 0
            diffs.append(diff)
            xs = sorted(diffs)
            n = len(xs)
            median = 0.5 * (xs[(n - 1) // 2] + xs[n // 2])  # the true median: the pair's two orders read alike
            self.pair_stats[key] = (median, 0.7413 * (xs[(3 * n) // 4] - xs[n // 4]), n, self.observed_rounds, off)
        self.last_timed[sampled] = (i, self.observed_rounds, log_ms)
        if len(self.window) == self.window.maxlen:
            self.window_counts[self.window[0]] -= 1
        self.window.append(i)
        self.window_counts[i] += 1

    def reference(self) -> int | None:
        """The candidate timed most in the last REFERENCE_WINDOW timed rounds (the later one on a tie)."""
        if not self.window:
            return None
        top = max(self.window_counts)
        for i in reversed(self.window):
            if self.window_counts[i] == top:
                return i
        return None

    def log_ratio(self, i: int, ref: int) -> tuple[float, float, int] | None:
        """(median log(ms_i / ms_ref), its sigma, pairs) over neighbouring timed rounds; None below PAIR_MIN or when
        the pair's newest entry is older than STALE_ROUNDS observed rounds. While that entry lies off the median
        (_pair), i is probed at the next decision: a second such entry restarts the pair."""
        key = (min(i, ref), max(i, ref))
        stats = self.pair_stats.get(key)
        if stats is None or stats[2] < PAIR_MIN:
            return None
        median, sigma, n, at, off = stats
        if off and key not in self.reprobed:  # once: the probe's time is in flight for a round or two
            self.reprobed.add(key)
            self.reprobe.add(i)
        if self.observed_rounds - at > STALE_ROUNDS:
            return None
        return (median if i > ref else -median), sigma, n


@dataclass
class AutoBudgetPolicy:
    candidates: list[int]  # sorted, CHAIN (0) first
    widths: list[int] | None = None  # verify tokens per request of each candidate (default: chain 16, b + 1)
    explore: int | None = None  # rounds a candidate is explored per bucket (None: the module's EXPLORE_ROUNDS)
    # Explore every candidate `explore` rounds per bucket, even one that cannot win (SGLANG_DDTREE_AUTO_EXPLORE_ALL=1,
    # a testing mode): the GPU server tests then verify every candidate's tree losslessly. Off, a candidate whose
    # best case cannot beat the best measured rate is skipped (lease 19's server module, ten servers sharing the
    # GPU: one slow 64-tree time ruled the 128-tree out at batch 1 for all of a short test).
    explore_all: bool = False
    # Also explore the candidates with the best rate in another bucket (None: the module's EXPLORE_BEST_ELSEWHERE),
    # for an A/B in one interleaved run (SGLANG_DDTREE_AUTO_EXPLORE_BEST_ELSEWHERE=1).
    explore_best_elsewhere: bool | None = None
    shrink_z: float | None = None  # the trees' time shrinkage for this policy (None: the module's SHRINK_Z)
    # Cost floors from other candidates' times measured in the bucket's last floor_fresh rounds only (None: the
    # module's FLOOR_FRESH; 0: every recent time, as before). Lease 21e: a narrower tree's slow first rounds, at the
    # server's start, floored the 64- and 128-trees out of exploration for ~250 rounds. Simulated (the tiny-like
    # case, mean / min of the best rate, auto_flat_sim.json against auto_flat_sim_floor_fresh64.json): 0.981 / 0.887
    # -> 0.990 / 0.979 at 64 rounds, the 8B-like batch-16 case 0.998 -> 0.993 (the wide trees explored once, then
    # probed when stale). Off until a GPU run decides (SGLANG_DDTREE_AUTO_FLOOR_FRESH): lease 22's paired tiny sweep,
    # with no lock-out in either server, could not tell 64 from off (x0.954 [0.906, 1.004] against x0.914 [0.873,
    # 0.958] of DDTREE 128).
    floor_fresh: int | None = None
    # A candidate's first rounds per bucket left untimed (None: the module's WARM_ROUNDS), for an A/B in one
    # interleaved run (SGLANG_DDTREE_AUTO_WARM_ROUNDS; lease_steps.sh tiny-paired with TP_TWIN_ENV).
    warm_rounds: int | None = None
    # Timed rounds a candidate needs in a bucket before its times bound cost floors (None: the module's
    # FLOOR_MIN_TIMES), for an A/B in one interleaved run (SGLANG_DDTREE_AUTO_FLOOR_MIN_TIMES).
    floor_min_times: int | None = None
    # The spread SHRINK_Z's standard error uses, "iqr" or "mad" (None: the module's SPREAD), for an A/B in one
    # interleaved run (SGLANG_DDTREE_AUTO_SPREAD).
    spread: str | None = None
    # Candidates' times read against the bucket's reference candidate's neighbouring rounds (None: the module's
    # RELATIVE_TIMES), for an A/B in one run (SGLANG_DDTREE_AUTO_RELATIVE_TIMES).
    relative_times: bool | None = None
    # Every round verifies this candidate (an index; None: the policy decides), sampled on the usual schedule: the
    # GPU server module and benchmarks run one candidate through `auto`'s whole round (SGLANG_DDTREE_AUTO_FORCE),
    # e.g. the chain's lean round (worker._chain_round) against DFLASH's.
    force: int | None = None
    probe_every: int = 64
    # a bucket re-measures its start once, at this round of it (None: the module's FORGET_START; 0: never)
    forget_start: int | None = None
    # a new time drops the candidate's times older than this many rounds of its bucket (None: the module's
    # TIMES_EXPIRE; 0: never), for an A/B in one run (SGLANG_DDTREE_AUTO_TIMES_EXPIRE)
    times_expire: int | None = None
    # a round after a switch of candidate untimed and probes PROBE_ROUNDS long (None: the module's SWITCH_UNTIMED),
    # for an A/B in one run (SGLANG_DDTREE_AUTO_SWITCH_UNTIMED)
    switch_untimed: bool | None = None
    hold_rounds: int = 0  # a decision holds this many rounds of its bucket (0: the module's HOLD_ROUNDS)
    # the longest hold of a repeated decision (None: the module's HOLD_MAX; hold_rounds or less: no growth) and
    # whether a settled bucket samples at the idle interval (None: True), for an A/B in one run
    # (SGLANG_DDTREE_AUTO_HOLD_MAX, SGLANG_DDTREE_AUTO_SETTLED_SAMPLING)
    hold_max: int | None = None
    settled_sampling: bool | None = None
    # Rounds between sampled rounds while a tree may win (None: the module's SAMPLE_EVERY; the idle interval scales
    # with it, SAMPLE_EVERY_IDLE / SAMPLE_EVERY times longer), for an A/B in one run (SGLANG_DDTREE_AUTO_SAMPLE_EVERY)
    sample_every: int | None = None
    half_life_rounds: float = 200.0
    expected: list[_Decayed] = field(default_factory=list)  # expected tokens per request
    observed: list[_Decayed] = field(default_factory=list)  # (observed, expected) pairs: see ratio()
    observed_expected: list[_Decayed] = field(default_factory=list)
    buckets: dict[int, _Bucket] = field(default_factory=dict)
    chosen_total: list[int] = field(default_factory=list)
    rounds_observed: int = 0
    _last_sampled: int = 0  # rounds_observed at the last round that carried expectations
    _last_observed: list[int] = field(default_factory=list)  # rounds_observed at each ratio's last sample
    sampling: bool | None = None  # the last choice's sampling: True (it explores or probes), None (the schedule's)
    # The estimates change only in observe(): choose() and sample_interval() of one round, and every best case
    # they bound, reuse them (the same picks: auto_sim, 6 seeds x 3000 rounds). choose + sample_interval + observe a
    # round on the CPU machine (benchmarks/simulate_auto_phases.py): 29.7 us at a72dd6a, 25.1 with this and
    # SHRINK_Z's shrinkage (auto_chooser_cpu_a72dd6a.json, auto_chooser_cpu.json).
    # Tokens change only on a round that brought expectations (one in SAMPLE_EVERY or fewer): their own version,
    # so that the rounds between reuse them. With the bucket's time statistics kept (_Bucket.timed) and decisions
    # held (HOLD_ROUNDS), the same script: 32.4 us a round at c52e322 -> 16.6 at 28dfe2d, run one after the other
    # (auto_chooser_cpu_c52e322.json, auto_chooser_cpu_28dfe2d.json; the machine reads 25.1 -> 32.4 for c52e322's
    # policy against the older file, so only ratios within one session compare).
    _version: int = 0
    _tokens_version: int = 0
    _memo: dict = field(default_factory=dict)  # ("tokens" | "rates" | "interval", bucket) -> (version, values)
    _explore_order: list[int] = field(default_factory=list)  # candidate indices, narrowest verify first
    _explore_tries: int = field(default=0, init=False)
    _keep: float = field(default=0.0, init=False)  # keep, from half_life_rounds (set at construction only)

    def __post_init__(self):
        self.candidates = [int(c) for c in self.candidates]
        if self.candidates != sorted(set(self.candidates)) or not self.candidates or self.candidates[0] != CHAIN:
            raise ValueError(f"auto candidates must be sorted, distinct and start with the chain (0), got "
                             f"{self.candidates}.")
        if len(self.candidates) < 2:
            raise ValueError("auto needs at least one tree budget besides the chain.")
        self.explore = EXPLORE_ROUNDS if self.explore is None else self.explore
        self.forget_start = FORGET_START if self.forget_start is None else self.forget_start
        if self.forget_start < 0:
            raise ValueError(f"forget_start must be >= 0, got {self.forget_start}.")
        self.times_expire = TIMES_EXPIRE if self.times_expire is None else self.times_expire
        if self.times_expire < 0:
            raise ValueError(f"times_expire must be >= 0, got {self.times_expire}.")
        self.switch_untimed = SWITCH_UNTIMED if self.switch_untimed is None else bool(self.switch_untimed)
        if self.explore < 1 or self.probe_every < 1 or self.half_life_rounds <= 0 or self.hold_rounds < 0:
            raise ValueError("explore and probe_every must be >= 1, half_life_rounds > 0 and hold_rounds >= 0.")
        self.hold_rounds = self.hold_rounds or HOLD_ROUNDS
        self._keep = 0.5 ** (1.0 / self.half_life_rounds)
        self.hold_max = max(self.hold_rounds, HOLD_MAX if self.hold_max is None else self.hold_max)
        self.settled_sampling = True if self.settled_sampling is None else bool(self.settled_sampling)
        self.sample_every = SAMPLE_EVERY if self.sample_every is None else self.sample_every
        if self.sample_every < 1:
            raise ValueError(f"sample_every must be >= 1, got {self.sample_every}.")
        self._sample_every_idle = self.sample_every * (SAMPLE_EVERY_IDLE // SAMPLE_EVERY)
        self.warm_rounds = WARM_ROUNDS if self.warm_rounds is None else self.warm_rounds
        if self.warm_rounds < 0:
            raise ValueError(f"warm_rounds must be >= 0, got {self.warm_rounds}.")
        self.spread = SPREAD if self.spread is None else self.spread
        if self.spread not in ("iqr", "mad"):
            raise ValueError(f"spread must be 'iqr' or 'mad', got {self.spread!r}.")
        self.floor_min_times = FLOOR_MIN_TIMES if self.floor_min_times is None else self.floor_min_times
        if self.floor_min_times < 1:
            raise ValueError(f"floor_min_times must be >= 1, got {self.floor_min_times}.")
        # exploration's tries per candidate: as many timed rounds as `explore` rounds with a cold first one gave
        self._explore_tries = self.explore + max(0, self.warm_rounds - 1)
        if self.explore_best_elsewhere is None:
            self.explore_best_elsewhere = EXPLORE_BEST_ELSEWHERE
        if self.relative_times is None:
            self.relative_times = RELATIVE_TIMES
        if self.relative_times:
            # its re-probes (an off pair entry's candidate, at the next decision) need decisions at HOLD_ROUNDS:
            # with holds growing, test_relative_times_follow_a_step's 16-tree took over ~30 rounds later
            self.hold_max = self.hold_rounds
        n = len(self.candidates)
        if self.widths is None:
            self.widths = [16 if c == CHAIN else c + 1 for c in self.candidates]
        if len(self.widths) != n:
            raise ValueError(f"one verify width per candidate, got {self.widths} for {self.candidates}.")
        self.expected = [_Decayed() for _ in range(n)]
        self.observed = [_Decayed() for _ in range(n)]
        self.observed_expected = [_Decayed() for _ in range(n)]
        self.chosen_total = [0] * n
        self._last_observed = [0] * n
        self._explore_order = sorted(range(n), key=lambda i: (self.widths[i], i))

    @property
    def keep(self) -> float:
        return self._keep  # observe() reads it every round: computed once (__post_init__)

    def _bucket(self, bucket: int) -> _Bucket:
        if bucket not in self.buckets:
            n = len(self.candidates)
            self.buckets[bucket] = _Bucket([_Decayed() for _ in range(n)], [0] * n, [0] * n, [-1] * n, [0] * n,
                                           [collections.deque(maxlen=RECENT) for _ in range(n)],
                                           [collections.deque(maxlen=RECENT) for _ in range(n)],
                                           next_probe=self.probe_every, mad=self.spread == "mad",
                                           relative=self.relative_times)
        return self.buckets[bucket]

    # ---------------------------------------------------------------------------------------------- estimates

    def ratio(self, i: int) -> float:
        """Observed / expected committed tokens for candidate i (nearest smaller observed candidate, else 1)."""
        for j in range(i, -1, -1):
            obs, exp = self.observed[j].mean(), self.observed_expected[j].mean()
            if obs is not None and exp:
                return obs / exp
        return 1.0

    def _own_tokens(self, i: int) -> float | None:
        exp = self.expected[i].mean()
        return None if exp is None else exp * self.ratio(i)

    def _cached(self, key, compute, version: int):
        hit = self._memo.get(key)
        if hit is not None and hit[0] == version:
            return hit[1]
        values = compute()
        self._memo[key] = (version, values)
        return values

    def _all_tokens(self) -> list[float | None]:
        """est_tokens of every candidate, in one pass: a tree's is the running max over the narrower trees."""
        out, best = [], None
        for i, c in enumerate(self.candidates):
            own = self._own_tokens(i)
            if c == CHAIN or own is None:
                out.append(own)
            else:
                best = own if best is None else max(best, own)
                out.append(best)
        return out

    def est_tokens(self, i: int) -> float | None:
        """Candidate i's estimated committed tokens per request: its expectation x ratio, and for a tree at least
        a narrower tree candidate's estimate (the narrower tree is its first slots: per round it commits at least
        as much)."""
        return self._tokens()[i]

    def _tokens(self) -> list[float | None]:
        """Every candidate's est_tokens, recomputed only after a round that brought expectations."""
        return self._cached(("tokens", None), self._all_tokens, self._tokens_version)

    @staticmethod
    def _typical_ms(b: _Bucket, i: int) -> float | None:
        """Candidate i's round ms for its rate: the median of its last RECENT timed rounds once there are 3 (one
        slow round cannot move it), before that the decayed mean."""
        if len(b.recent[i]) >= 3:
            return b.median[i]
        return b.round_ms[i].mean()

    def rates(self, bucket: int) -> list[float | None]:
        return list(self._cached(("rates", bucket), lambda: self._rates(bucket), self._version))

    def _rates(self, bucket: int) -> list[float | None]:
        b = self._bucket(bucket)
        ms = self._shrunk_tree_ms(b)
        tokens = self._tokens()
        return [t / m if t is not None and m else None for t, m in zip(tokens, ms)]

    def _shrunk_tree_ms(self, b: _Bucket) -> list[float | None]:
        """Every candidate's round ms for its rate (_typical_ms), the tree candidates' drawn toward their pooled
        time by the standard error of their median (SHRINK_Z): a tree's cost differs from the others' only by what
        its recent times can tell apart from noise. The chain keeps its own (it verifies causally: another cost
        curve)."""
        ms = [self._typical_ms(b, i) for i in range(len(self.candidates))]
        z = SHRINK_Z if self.shrink_z is None else self.shrink_z
        trees = [i for i, c in enumerate(self.candidates) if c != CHAIN and ms[i] and len(b.recent[i]) >= 3]
        if len(trees) < 2:
            return ms
        weights = [len(b.recent[i]) for i in trees]
        pooled = sum(ms[i] * w for i, w in zip(trees, weights)) / sum(weights)
        for i in trees:
            error = z * 1.25 * b.spread[i] / math.sqrt(len(b.recent[i]))  # the median's standard error
            gap = ms[i] - pooled
            ms[i] = pooled + math.copysign(max(0.0, abs(gap) - error), gap)
        return self._relative_ms(b, ms, z) if b.relative else ms

    def _relative_ms(self, b: _Bucket, ms: list[float | None], z: float) -> list[float | None]:
        """RELATIVE_TIMES: each candidate with PAIR_MIN neighbouring pairs with the bucket's reference candidate
        costs the reference's time (as _shrunk_tree_ms gives it) times their median ratio, between two trees drawn
        toward 1 by z standard errors of the median (the chain verifies causally: another cost curve)."""
        ref = b.reference()
        if ref is None or not ms[ref]:
            return ms
        out = list(ms)
        for i in range(len(self.candidates)):
            relative = None if i == ref else b.log_ratio(i, ref)
            if relative is None:
                continue
            log_ratio, sigma, n = relative
            if self.candidates[i] != CHAIN and self.candidates[ref] != CHAIN:
                # a few pairs' spread can read near 0: at least the two candidates' own relative spreads combined
                own = [b.spread[j] / b.median[j] for j in (i, ref) if len(b.recent[j]) >= 3 and b.median[j]]
                sigma = max(sigma, math.sqrt(sum(x * x for x in own)))
                log_ratio = math.copysign(max(0.0, abs(log_ratio) - z * 1.25 * sigma / math.sqrt(n)), log_ratio)
            out[i] = ms[ref] * math.exp(log_ratio)
        return out

    # ---------------------------------------------------------------------------------------------- decisions

    def _cost_floor(self, b: _Bucket, i: int) -> float | None:
        """A lower bound of candidate i's round ms in this bucket, from what is measured (None: nothing is). Every
        time used here is a candidate's least recent one (RECENT), not its mean.
        A candidate's times count here once it has floor_min_times of them (FLOOR_MIN_TIMES).
        - Measured itself: its least time, less NOISE (a probe re-measures what would win at that price).
        - Otherwise: the dearest measured candidate of its kind (tree or chain) that verifies no more tokens (a
          wider verify does not cost less), and, from two measured narrower trees, the secant through them extended
          to i's width: round time is a convex function of the verify width (flat while launch- or memory-bound,
          then linear once compute-bound), so the extension stays below it. The slope is taken less NOISE, so timing
          noise cannot rule out a candidate that would win. The chain's round is another code path on another cost
          curve (a causal verify in the lean chain round, worker._chain_round): its times bound no tree's floor.
          Lease 33c's two tiny batch-1 servers timed its exploration rounds, the server's first, at 7.8 / 6.4 ms
          against 3.7-5.4 for the trees (leases 31b-32: 26-40 ms); as the narrowest candidate's least time it
          floored every tree, and neither server explored the 128-tree in its batch-1 rows (one ran the 16-tree in
          80% of them, x0.90 of its fixed 128-tree arm). Where a tree costs at least the chain (8B shapes) the
          16-tree's own times give the wider trees the same floor.
        Lease 10 (8B shapes, batch 16, a drafter never right), when the floor was the narrower candidates' dearest
        time alone: the 128-tree (2064 verify tokens) was verified in 7 of 382 rounds, the 32-tree in 5."""
        least = [self._bound_ms(b, j) for j in range(len(self.candidates))]
        if least[i] is not None:
            return least[i] * (1.0 - NOISE)
        fresh = FLOOR_FRESH if self.floor_fresh is None else self.floor_fresh
        usable = [least[j] is not None and (not fresh or b.rounds - b.last_measured[j] <= fresh)
                  for j in range(len(self.candidates))]
        chain = self.candidates[i] == CHAIN
        narrower = [least[j] for j in range(len(self.candidates))
                    if j != i and self.widths[j] <= self.widths[i] and usable[j]
                    and (self.candidates[j] == CHAIN) == chain]
        if not narrower:
            return None
        floor = max(narrower)
        trees = [(self.widths[j], least[j]) for j in range(len(self.candidates))
                 if j != i and self.candidates[j] != CHAIN and self.widths[j] < self.widths[i] and usable[j]]
        if len(trees) >= 2:
            (w1, t1), (w2, t2) = min(trees), max(trees)
            if w2 > w1:
                slope = (t2 - t1 * (1.0 + NOISE)) / (w2 - w1)
                if slope > 0:
                    floor = max(floor, t2 + slope * (self.widths[i] - w2))
        return floor

    def _bound_ms(self, b: _Bucket, j: int) -> float | None:
        """The time candidate j's cost floors use: its least recent time once it has floor_min_times of them; before
        that, after its older times expired (TIMES_EXPIRE), the least of the expired and the new ones (an expiry
        must not let the wide trees that cannot win be probed more: at 8B-like shapes a 128-tree probe costs ~6
        chain rounds); else None."""
        if len(b.recent[j]) >= self.floor_min_times:
            return b.least[j]
        old = b.expired_least[j]
        if old is None:
            return None
        return old if b.least[j] is None else min(old, b.least[j])

    def _could_win(self, b: _Bucket, i: int, best_rate: float | None) -> bool:
        """Whether candidate i may beat the best measured rate: its estimated tokens over the floor of its round
        time (_cost_floor)."""
        best_case = self._best_case_rate(b, i)
        if best_rate is None or best_case is None:
            return True
        return best_case > best_rate * (1.0 + 1e-6)  # at best a tie (up to rounding) is not a win

    def _within(self, b: _Bucket, i: int, best_rate: float | None, factor: float) -> bool:
        """Whether candidate i's best case reaches factor x the best measured rate (True when either is unknown)."""
        best_case = self._best_case_rate(b, i)
        return best_rate is None or best_case is None or best_case >= factor * best_rate

    def _best_case_rate(self, b: _Bucket, i: int) -> float | None:
        """Candidate i's estimated tokens over the floor of its round time (None: either is unknown)."""
        tokens, floor = self.est_tokens(i), self._cost_floor(b, i)
        return tokens / floor if tokens is not None and floor else None

    def _remeasure_start(self, b: _Bucket, bucket: int) -> None:
        """FORGET_START: every candidate with times from the bucket's first forget_start // 2 rounds and a rate of at
        least STALE_HOPE of the best is explored again, whether or not it could win (a start ran at most ~2x slow:
        leases 24-33c read 1.13-2.0x; one further behind cannot be a slow start's victim, and at 8B-like batch 16
        the wide trees, 3-7x the chain's cost, would be explored again for nothing). Its start times stay until it
        has three new ones (_Bucket.timed), so the floors they give the wider candidates hold meanwhile: a wider
        tree is still never explored blind."""
        start = self.forget_start // 2
        rates = self.rates(bucket)
        known = [r for r in rates if r is not None and math.isfinite(r)]
        hope = STALE_HOPE * max(known) if known else 0.0
        for i in range(len(self.candidates)):
            if any(at <= start for at in b.recent_at[i]) and (rates[i] is None or rates[i] >= hope):
                # three new times: the rates' median needs three (_typical_ms), floors floor_min_times
                b.replace[i] = (start, b.rounds, max(3, self.floor_min_times))
                b.measured[i] = b.tried[i] = b.waited[i] = 0
        b.best, b.streak, b.settled = None, 0, False
        b.forgot = True

    def choose(self, bucket: int) -> int:
        """Index into candidates for the next round of a batch in this bucket. Exploration and probes skip a
        candidate that cannot win (`_could_win`): with a drafter that is rarely right (a dummy model, an
        unfamiliar prompt) the wide trees are then never tried, and `auto` runs the chain. Exploration goes
        narrowest first and waits for a candidate's first measurement (its rounds reach the host a round or two
        late, and a cold first round is not timed) before it explores a wider one: a wider tree is judged by the
        narrower ones' times, never blind."""
        b = self._bucket(bucket)
        b.rounds += 1
        if b.hold > 0:  # the last decision holds (HOLD_ROUNDS)
            b.hold -= 1
            self.sampling = None
            return self._chosen(b, b.held)
        b.decisions += 1
        if self.forget_start and not b.forgot and b.rounds >= self.forget_start:
            self._remeasure_start(b, bucket)
        if self.force is not None:  # held as a decision is, so the feedback is drained as often as `auto` drains it
            self.sampling = None
            if b.rounds >= b.next_probe:  # the probe slot passes with nothing to probe, so the holds grow as a
                # settled bucket's do (a hold never runs past the next probe: with next_probe left at probe_every,
                # lease 35's held servers decided every 4 rounds, 118-121 decisions in ~520 batch-4 rounds against
                # 34-45 for `auto` as it is, so their "own cost" counted three times the decisions)
                b.last_probe, b.next_probe = b.rounds, b.rounds + self.probe_every
            b.held, b.hold = self.force, self._hold_after(b, self.force)
            return self._chosen(b, self.force)
        n = len(self.candidates)
        rates = self.rates(bucket)
        # Ties go to the wider candidate. They are exact on a flat cost curve: a tree whose own estimate fell below
        # a narrower one's is estimated at the narrower one's tokens (est_tokens), and SHRINK_Z pools times that
        # noise cannot tell apart, yet per round the wider tree commits at least as much and observes every
        # narrower tree's tokens. The narrowest won such ties until lease 21, whose tiny batch-1 servers ran the
        # 16- to 64-trees in 70% / 64% of their rounds (leases 21 / 21b). Simulated (simulate_auto_flat.py, mean /
        # min of the best rate over 8-20 seeds, auto_flat_sim_narrowest_ties.json against auto_flat_sim.json): token
        # noise and content drift 0.990 / 0.964 -> 0.995 / 0.989, the lock-out test 0.993 / 0.971 -> 0.996 / 0.988,
        # every other case within 0.001 of its mean or better.
        known = [(r, i) for i, r in enumerate(rates) if r is not None and math.isfinite(r)]
        best = max(known)[1] if known else None
        best_rate = rates[best] if best is not None else None
        choice, waiting = None, False
        for i in self._explore_order:  # explore: narrowest unmeasured first
            if b.measured[i] >= self.explore:
                continue
            if b.tried[i] < self._explore_tries and (self.explore_all or i in b.replace
                                                     or self._could_win(b, i, best_rate)):
                choice = i
                break
            if (b.tried[i] < self._explore_tries and self.explore_best_elsewhere
                    and i in self._best_elsewhere(bucket)):
                b.elsewhere.add(i)  # explored against its cost floor: its stale probes need hope (STALE_HOPE)
                choice = i
                break
            if b.tried[i] > 0 and b.measured[i] == 0 and b.waited[i] < MAX_UNMEASURED:
                b.waited[i] += 1  # its time is in flight: run the best known meanwhile, explore nothing wider yet
                waiting = True
                break
        exploring = choice is not None  # (a probe below is not: with SWITCH_UNTIMED it runs PROBE_ROUNDS rounds)
        if choice is not None or waiting:  # exploring: the next decision of the best starts its holds (and
            b.best, b.streak, b.settled = None, 0, False  # the sampling interval) over
        if (choice is None and b.reprobe
                and b.rounds >= b.last_probe + min(self.probe_every, REPROBE_GAP)):
            # RELATIVE_TIMES: a candidate whose pair's newest entry lies off, if it could win: a probe brought forward
            again = [i for i in sorted(b.reprobe) if i != best and self._could_win(b, i, best_rate)]
            b.reprobe.clear()
            if again:
                choice = min(again, key=lambda i: (b.last_measured[i], i))
                b.last_probe, b.next_probe = b.rounds, b.rounds + self.probe_every
        if choice is None and b.rounds >= b.next_probe:
            b.last_probe, b.next_probe = b.rounds, b.rounds + self.probe_every
            # re-measure the stalest that could still win, or whose times are stale (STALE_ROUNDS)
            probes = [i for i in range(n) if i != best and (
                self._could_win(b, i, best_rate) or (b.recent[i] and b.rounds - b.last_measured[i] > STALE_ROUNDS
                                                     and (i not in b.elsewhere
                                                          or self._within(b, i, best_rate, STALE_HOPE))))]
            if probes:
                choice = min(probes, key=lambda i: (b.last_measured[i], i))
        probing = choice is not None
        self.sampling = True if probing else None
        if choice is None:
            choice = best if best is not None else 0
        # exploration and probes are one round each, and so is a choice made while exploration waits for a time (it
        # counts its waits in decisions); a choice of the best holds, longer when it repeats (HOLD_MAX). With
        # SWITCH_UNTIMED a probe runs PROBE_ROUNDS rounds (its first, after the switch, untimed: observe)
        if probing:
            hold = PROBE_ROUNDS - 1 if self.switch_untimed and not exploring else 0
        else:
            hold = 0 if waiting else self._hold_after(b, choice)
        b.held, b.hold = choice, hold
        return self._chosen(b, choice)

    def _hold_after(self, b: _Bucket, choice: int) -> int:
        """The rounds a decision of the best (`choice`) holds after its own round (HOLD_MAX): HOLD_ROUNDS x 2^k for
        the k-th repeat in a row of the previous decision of the best (counted while every wider candidate was
        explored), up to hold_max and never past the bucket's next probe (but at least HOLD_ROUNDS); the bucket is
        settled while that doubling reaches SETTLED_HOLD."""
        # only once every candidate wider than the choice was timed `explore` times do its holds grow: exploration
        # goes narrowest first, so a wider tree not explored yet (its cost floor keeps it out for now) keeps its
        # chance at every HOLD_ROUNDS-th round; a narrower candidate that never could win does not stop the growth
        explored = all(m >= self.explore for m, w in zip(b.measured, self.widths) if w > self.widths[choice])
        if choice == b.best and explored:
            b.streak += 1
        else:
            b.best, b.streak = choice, 0
        grown = min(self.hold_max, self.hold_rounds << min(b.streak, 16))
        b.settled = grown >= SETTLED_HOLD
        return max(self.hold_rounds, min(grown, b.next_probe - b.rounds)) - 1

    def _best_elsewhere(self, bucket: int) -> set[int]:
        """The candidates with the best measured rate in another bucket (EXPLORE_BEST_ELSEWHERE)."""
        out = set()
        for other, b in self.buckets.items():
            if other == bucket:
                continue
            rates = self.rates(other)
            known = [(r, i) for i, r in enumerate(rates) if r is not None and math.isfinite(r) and b.measured[i]]
            if known:
                out.add(max(known)[1])
        return out

    def sampled(self, counter: int, bucket: int) -> bool:
        """Whether the round just chosen computes the expectations: an exploration or probe round always (it is how
        a rarely chosen candidate's ratio refreshes), any other one in sample_interval of the worker's round
        counter."""
        if self.sampling is not None:
            return self.sampling
        return counter % self.sample_interval(bucket) == 0

    def _chosen(self, b: _Bucket, choice: int) -> int:
        b.tried[choice] += 1
        b.chose(choice)
        self.chosen_total[choice] += 1
        return choice

    def held_round(self, bucket: int, counter: int) -> tuple[int, bool] | None:
        """The worker's one call for a round of a bucket whose last decision holds (HOLD_ROUNDS): (the candidate
        index, whether the round samples), what choose() and sampled(counter, bucket) would return; None when the
        bucket decides this round (the worker then drains the feedback and calls choose() and sampled()). Why:
        lease 31's in-process A/B timed `auto`'s chooser block at 0.09-0.12 ms a round on the tiny pair, most rounds
        held ones."""
        b = self.buckets.get(bucket)
        if b is None or b.hold <= 0:
            return None
        b.rounds += 1
        b.hold -= 1
        self.sampling = None
        return self._chosen(b, b.held), counter % self._sample_interval(b, bucket) == 0

    def deciding(self, bucket: int) -> bool:
        """Whether the bucket's next choose() decides (else it repeats the held choice): the worker drains the
        feedback only before a decision."""
        b = self.buckets.get(bucket)
        return b is None or b.hold == 0

    def sample_interval(self, bucket: int) -> int:
        """Rounds between sampled rounds (SAMPLE_EVERY_IDLE divides by SAMPLE_EVERY, so a round counter modulo
        either stays in step): SAMPLE_EVERY_IDLE while the bucket is settled (SETTLED_HOLD), when the bucket's last
        CHAIN_RUN choices were the chain but for at most CHAIN_RUN_OTHERS, or when the chain's rate is known and
        beats every tree candidate's best case (_best_case_rate) by more than CLOSE."""
        return self._sample_interval(self._bucket(bucket), bucket)

    def _sample_interval(self, b: _Bucket, bucket: int) -> int:
        if (b.settled and self.settled_sampling) or (len(b.last_choices) == CHAIN_RUN
                                                     and b.others_in_run <= CHAIN_RUN_OTHERS):
            return self._sample_every_idle
        # the rest changes only with the estimates (observe): kept between, as the worker asks every round
        return self._cached(("interval", bucket), lambda: self._chain_lead_interval(b, bucket), self._version)

    def _chain_lead_interval(self, b: _Bucket, bucket: int) -> int:
        rates = self.rates(bucket)
        if rates[0] is None:
            return self.sample_every
        for i in range(1, len(self.candidates)):
            best_case = self._best_case_rate(b, i)
            if best_case is None or best_case >= (1.0 - CLOSE) * rates[0]:
                return self.sample_every
        return self._sample_every_idle

    def observe(self, bucket: int, chosen: int, batch_size: int, round_ms: float | None,
                expected_sum: list[float] | None, observed_sum: list[float | None]) -> None:
        """One completed round: its GPU ms (None when unknown), the batch's expected tokens per candidate (None on
        a round that did not sample them) and the committed tokens of the candidates it observed (None = not
        observed; used only next to the same round's expectation)."""
        if batch_size < 1:
            return
        self._version += 1
        if expected_sum:
            self._tokens_version += 1
        keep = self.keep
        b = self._bucket(bucket)
        b.seen[chosen] += 1
        warm = b.seen[chosen] > self.warm_rounds  # else a first use of the candidate in this bucket (WARM_ROUNDS)
        if self.switch_untimed:  # the switch's round is not the candidate's cost (tracked only with the knob on)
            if chosen != b.last_observed:
                round_ms = None
            b.last_observed = chosen
        if warm and round_ms is not None and math.isfinite(round_ms) and round_ms > 0:
            if self.times_expire and b.expire(chosen, b.rounds - self.times_expire):
                b.round_ms[chosen] = _Decayed()  # restarts from the times kept (TIMES_EXPIRE)
                for x in b.recent[chosen]:
                    b.round_ms[chosen].add(x, 1.0, keep)
            b.round_ms[chosen].add(round_ms, 1.0, keep)
            b.timed(chosen, round_ms, sampled=bool(expected_sum))
            b.measured[chosen] += 1
            b.last_measured[chosen] = b.rounds
        b.observed_rounds += 1
        self.rounds_observed += 1
        if expected_sum:
            # One sampled round stands for the SAMPLE_EVERY-round stretches since the last one, so the decayed
            # means follow the drafter at the same pace in rounds whether sampling is at SAMPLE_EVERY or
            # SAMPLE_EVERY_IDLE (weight k and keep^k: k identical samples).
            k = max(1.0, (self.rounds_observed - self._last_sampled) / SAMPLE_EVERY)
            self._last_sampled = self.rounds_observed
            keep_k = keep ** k
            for i, e in enumerate(expected_sum):
                self.expected[i].add(e / batch_size, k, keep_k)
                o = observed_sum[i]
                if o is not None:
                    # decayed over the rounds since this candidate's last sample (STALE_ROUNDS), at the same pace
                    since = max(1.0, (self.rounds_observed - self._last_observed[i]) / SAMPLE_EVERY)
                    self._last_observed[i] = self.rounds_observed
                    self.observed[i].add(o / batch_size, k, keep ** since)
                    self.observed_expected[i].add(e / batch_size, k, keep ** since)

    def export(self) -> dict:
        """The chooser's state, for logs and the debug dump."""
        labels = [candidate_label(c) for c in self.candidates]
        return {
            "candidates": labels,
            "rounds_chosen": dict(zip(labels, self.chosen_total)),
            "expected_tokens": {k: _r(self.expected[i].mean()) for i, k in enumerate(labels)},
            "observed_over_expected": {k: _r(self.ratio(i)) for i, k in enumerate(labels)},
            "round_ms": {str(bucket): {k: _r(b.round_ms[i].mean()) for i, k in enumerate(labels)}
                         for bucket, b in sorted(self.buckets.items())},
            # per bucket: its rounds, the decisions among them (the rest held: HOLD_ROUNDS / HOLD_MAX), whether
            # it is settled now (SETTLED_HOLD) and whether it re-measured its start (FORGET_START)
            "decisions": {str(bucket): {"rounds": b.rounds, "decisions": b.decisions, "settled": b.settled,
                                        "forgot_start": b.forgot}
                          for bucket, b in sorted(self.buckets.items())},
            # per bucket: the rounds each candidate ran (observed so far) and the median of its recent times, what
            # rates compare (round_ms above is the decayed mean): a bucket locked on one candidate shows here
            # (lease 36 read its lock-ins from the A/B tallies: the totals above mix the buckets)
            "rounds_by_bucket": {str(bucket): dict(zip(labels, b.seen)) for bucket, b in sorted(self.buckets.items())},
            "median_ms": {str(bucket): {k: _r(b.median[i]) for i, k in enumerate(labels)}
                          for bucket, b in sorted(self.buckets.items())},
        }


class WalkSchedule:
    """Which of a candidate's walk stages a round runs: "plain" (an unsampled round: no feedback but its time),
    "sampled" (every observed candidate's committed tokens, for the chooser), "scored" (those and the calibration
    table's scoring and delta: the first sampled tree round and then one in `every`, CALIBRATION_EVERY; every one
    while the table is young, CALIBRATION_YOUNG; every tree round, sampled or not, while it learns all,
    CALIBRATION_LEARN_ALL), "learn" (the scored walk of an unsampled tree round while the table learns all: the
    same computation, captured on the unsampled tree stage's outputs, so that its tree inputs are that stage's own
    memory and not copied in: six copies a round, every round of a fresh server's first CALIBRATION_LEARN_ALL
    request-rounds, which lease 32b's A/B measured throughout at batch 1). The chain is never scored (a chain teaches
    only the top-1 cells, which every tree's first path teaches too)."""

    VARIANTS = ("plain", "sampled", "scored", "learn")
    SCORED = frozenset({"scored", "learn"})  # the variants whose walk computes the calibration's delta
    SAMPLED_TREE = frozenset({"sampled", "scored"})  # the variants that follow the sampled tree stage

    def __init__(self, every: int = CALIBRATION_EVERY):
        if every < 1:
            raise ValueError(f"the calibration scores one sampled tree round in every >= 1, got {every}.")
        self.every = every
        self.sampled_tree_rounds = 0

    def variant(self, chain: bool, sampled: bool, young: bool = False, learn_all: bool = False) -> str:
        """young: the table has scored fewer than CALIBRATION_YOUNG request-rounds; learn_all: it has learnt fewer
        than CALIBRATION_LEARN_ALL."""
        if chain:
            return "sampled" if sampled else "plain"
        if not sampled:
            return "learn" if learn_all else "plain"
        scored = learn_all or young or self.sampled_tree_rounds % self.every == 0
        self.sampled_tree_rounds += 1
        return "scored" if scored else "sampled"


def _r(x):
    return None if x is None else round(float(x), 4)


def observed_candidates(candidates: list[int], chosen: int) -> list[bool]:
    """Which candidates' committed tokens a round verifying candidates[chosen] observes exactly: the chain only
    itself; a tree every tree candidate up to its own budget (their trees are its first slots)."""
    c = candidates[chosen]
    if c == CHAIN:
        return [b == CHAIN for b in candidates]
    return [b != CHAIN and b <= c for b in candidates]


def _env_at_least(name: str, kind, minimum, what: str):
    """A knob from the environment: None when unset or empty, else kind(value) >= minimum (ValueError otherwise)."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or (isinstance(value, float) and not math.isfinite(value)) or value < minimum:
        raise ValueError(f"{name} must be {what}, got {raw!r}.")
    return value


def _env_choice(name: str, choices: tuple[str, ...]) -> str | None:
    """A knob from the environment: None when unset or empty, else one of choices (ValueError otherwise)."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    if raw not in choices:
        raise ValueError(f"{name} must be {' or '.join(choices)}, got {raw!r}.")
    return raw


def auto_shrink_z() -> float | None:
    """SGLANG_DDTREE_AUTO_SHRINK_Z: the policy's SHRINK_Z for this server (None when unset: the module's value), so
    that one interleaved sweep can run `auto` with and without the time shrinkage side by side (lease_steps.sh
    auto-final with AF_SHRINK_AB=1; lease 20 changed two things at once and could not tell them apart)."""
    return _env_at_least("SGLANG_DDTREE_AUTO_SHRINK_Z", float, 0.0, "a number >= 0 (standard errors)")


def auto_floor_fresh() -> int | None:
    """SGLANG_DDTREE_AUTO_FLOOR_FRESH: the policy's floor_fresh for this server (None when unset: the module's
    FLOOR_FRESH; 0: every recent time bounds the wider candidates), for an A/B in one interleaved run
    (lease_steps.sh tiny-twins, TW_FLOOR_FRESH)."""
    return _env_at_least("SGLANG_DDTREE_AUTO_FLOOR_FRESH", int, 0, "a round count >= 0 (0: off)")


def auto_spread() -> str | None:
    """SGLANG_DDTREE_AUTO_SPREAD: the policy's spread for this server, "iqr" or "mad" (None when unset: the
    module's SPREAD), for an A/B in one interleaved run."""
    return _env_choice("SGLANG_DDTREE_AUTO_SPREAD", ("iqr", "mad"))


def auto_relative_times() -> bool | None:
    """SGLANG_DDTREE_AUTO_RELATIVE_TIMES: the policy's relative_times for this server (None when unset: the module's
    RELATIVE_TIMES; 1 on, 0 off), for an A/B in one run."""
    raw = _env_choice("SGLANG_DDTREE_AUTO_RELATIVE_TIMES", ("0", "1"))
    return None if raw is None else raw == "1"


def auto_explore_rounds() -> int | None:
    """SGLANG_DDTREE_AUTO_EXPLORE_ROUNDS: the policy's explore for this server (None when unset: the module's
    EXPLORE_ROUNDS), for an A/B in one interleaved run."""
    return _env_at_least("SGLANG_DDTREE_AUTO_EXPLORE_ROUNDS", int, 1, "a round count >= 1")


def auto_floor_min_times() -> int | None:
    """SGLANG_DDTREE_AUTO_FLOOR_MIN_TIMES: the policy's floor_min_times for this server (None when unset: the
    module's FLOOR_MIN_TIMES; 1: every timed round counts), for an A/B in one interleaved run."""
    return _env_at_least("SGLANG_DDTREE_AUTO_FLOOR_MIN_TIMES", int, 1, "a round count >= 1")


def auto_warm_rounds() -> int | None:
    """SGLANG_DDTREE_AUTO_WARM_ROUNDS: the policy's warm_rounds for this server (None when unset: the module's
    WARM_ROUNDS; 0: every timed round counts), for an A/B in one interleaved run."""
    return _env_at_least("SGLANG_DDTREE_AUTO_WARM_ROUNDS", int, 0, "a round count >= 0")


def auto_explore_best_elsewhere() -> bool | None:
    """SGLANG_DDTREE_AUTO_EXPLORE_BEST_ELSEWHERE: the policy's explore_best_elsewhere for this server (None when
    unset: the module's EXPLORE_BEST_ELSEWHERE; 1 on, 0 off), for an A/B in one interleaved run."""
    raw = _env_choice("SGLANG_DDTREE_AUTO_EXPLORE_BEST_ELSEWHERE", ("0", "1"))
    return None if raw is None else raw == "1"


def calibration_prior_mass() -> float | None:
    """SGLANG_DDTREE_CALIBRATION_PRIOR_MASS: the server's calibration table's prior mass (None when unset:
    adaptive.CalibratorConfig's), for an A/B of young tables in one interleaved run (benchmarks/calibration_prior.py
    compares masses offline)."""
    return _env_at_least("SGLANG_DDTREE_CALIBRATION_PRIOR_MASS", float, 1e-9, "a positive number (probability mass)")


def auto_calibration_learn_all() -> int:
    """SGLANG_DDTREE_AUTO_CALIBRATION_LEARN_ALL: request-rounds during which every tree round teaches the table
    (the module's CALIBRATION_LEARN_ALL when unset; 0: off), for an A/B in one interleaved run."""
    value = _env_at_least("SGLANG_DDTREE_AUTO_CALIBRATION_LEARN_ALL", int, 0, "a request-round count >= 0")
    return CALIBRATION_LEARN_ALL if value is None else value


def auto_force(candidates) -> int | None:
    """SGLANG_DDTREE_AUTO_FORCE=chain|<budget> (unset: none): the index of the candidate every `auto` round verifies
    (AutoBudgetPolicy.force), a testing and measuring mode; it must be one of the server's candidates."""
    from sglang_ddtree.adaptive import candidate_label

    raw = os.environ.get("SGLANG_DDTREE_AUTO_FORCE", "").strip().lower()
    if not raw:
        return None
    labels = [candidate_label(c) for c in candidates]
    if raw not in labels:
        raise ValueError(f"SGLANG_DDTREE_AUTO_FORCE must name one of the auto candidates {labels}, got {raw!r}.")
    return labels.index(raw)


def auto_ab_block() -> int:
    """SGLANG_DDTREE_AUTO_AB=N (unset or 0: off): an `auto` server's decode rounds alternate in blocks of N between
    `auto` and the fixed widest candidate tree (the fixed-budget server's own round), each arm's tokens and time
    tallied apart (stats.ABTallies): a measuring mode. Why: on a host-bound pair the host's speed moves by a third
    from run to run and between servers (lease 21b: vCPUs 0.32-0.68 s for one loop; two identical DDTREE 128 servers
    x0.887 apart), so two servers' ratio cannot resolve the 3% the issue asks about in a lease; rounds a few
    milliseconds apart in one process share the host's speed and the text being decoded, so the ratio of the arms'
    tokens per second cancels both."""
    return _env_at_least("SGLANG_DDTREE_AUTO_AB", int, 0, "a block length in rounds >= 0 (0: off)") or 0


class StallDetector:
    """Which decode rounds stalled on the host (STALL_HOST_MS): one call per round with its host time (ms; None when
    the round was not timed). The limit is re-read every STALL_WINDOW / 4 rounds from the median of the last
    STALL_WINDOW rounds' host times, stalled ones included, so that a server whose every round is long (STALL_FACTOR
    times the floor's share) raises it instead of calling all its rounds stalled."""

    def __init__(self, floor_ms: float = STALL_HOST_MS, factor: float = STALL_FACTOR, window: int = STALL_WINDOW):
        if floor_ms <= 0 or factor <= 1 or window < 4:
            raise ValueError("a stall limit needs floor_ms > 0, factor > 1 and window >= 4.")
        self.floor_ms, self.factor = floor_ms, factor
        self.recent: collections.deque = collections.deque(maxlen=window)
        self.limit_ms = floor_ms
        self._every = window // 4
        self._since = 0
        self.stalls = 0

    def stalled(self, host_ms: float | None) -> bool:
        if host_ms is None:
            return False
        out = host_ms > self.limit_ms
        self.stalls += out
        self.recent.append(host_ms)
        self._since += 1
        if self._since >= self._every:
            self._since = 0
            xs = sorted(self.recent)
            self.limit_ms = max(self.floor_ms, self.factor * xs[len(xs) // 2])
        return out


class ABSchedule:
    """SGLANG_DDTREE_AUTO_AB's arms round by round: `block` decode rounds of `auto`, then `block` of the fixed widest
    tree, and so on (block 0: `auto` every round). Counted over decode rounds whatever their batch size, so both
    arms meet every batch size and every stretch of the text alike."""

    def __init__(self, block: int):
        if block < 0:
            raise ValueError(f"an A/B block is >= 0 rounds, got {block}.")
        self.block = block
        self.rounds = 0

    def next_is_fixed(self) -> bool:
        """Whether the next decode round is the fixed arm's."""
        if not self.block:
            return False
        fixed = (self.rounds // self.block) % 2 == 1
        self.rounds += 1
        return fixed


def auto_hold_rounds() -> int | None:
    """SGLANG_DDTREE_AUTO_HOLD_ROUNDS: the policy's hold_rounds for this server (None when unset: the module's
    HOLD_ROUNDS), for an A/B in one run (with SGLANG_DDTREE_AUTO_AB, each server against its own fixed arm)."""
    return _env_at_least("SGLANG_DDTREE_AUTO_HOLD_ROUNDS", int, 1, "a round count >= 1")


def auto_hold_max() -> int | None:
    """SGLANG_DDTREE_AUTO_HOLD_MAX: the policy's hold_max for this server (None when unset: the module's HOLD_MAX;
    HOLD_ROUNDS or less: decisions never hold longer), for an A/B in one run."""
    return _env_at_least("SGLANG_DDTREE_AUTO_HOLD_MAX", int, 1, "a round count >= 1")


def auto_forget_start() -> int | None:
    """SGLANG_DDTREE_AUTO_FORGET_START: the policy's forget_start for this server (None when unset: the module's
    FORGET_START; 0: never), for an A/B in one run."""
    return _env_at_least("SGLANG_DDTREE_AUTO_FORGET_START", int, 0, "a round count >= 0")


def auto_times_expire() -> int | None:
    """SGLANG_DDTREE_AUTO_TIMES_EXPIRE: the policy's times_expire for this server (None when unset: the module's
    TIMES_EXPIRE; 0: never), for an A/B in one run."""
    return _env_at_least("SGLANG_DDTREE_AUTO_TIMES_EXPIRE", int, 0, "a round count >= 0")


def auto_switch_untimed() -> bool | None:
    """SGLANG_DDTREE_AUTO_SWITCH_UNTIMED=0/1: the policy's switch_untimed for this server (None when unset: the
    module's SWITCH_UNTIMED), for an A/B in one run."""
    raw = _env_choice("SGLANG_DDTREE_AUTO_SWITCH_UNTIMED", ("0", "1"))
    return None if raw is None else raw == "1"


def auto_settled_sampling() -> bool | None:
    """SGLANG_DDTREE_AUTO_SETTLED_SAMPLING=0/1: whether a settled bucket samples at the idle interval (None when
    unset: yes), for an A/B in one run."""
    raw = _env_choice("SGLANG_DDTREE_AUTO_SETTLED_SAMPLING", ("0", "1"))
    return None if raw is None else raw == "1"


def auto_host_detail() -> bool:
    """SGLANG_DDTREE_AUTO_HOST_DETAIL=1 (unset or 0: off): `auto`'s rounds mark its own host work apart
    (stages.AUTO_HOST_DETAIL: the chooser block's parts, the round counter and walk variant, the feedback and table
    work after the commit), a measuring mode for an A/B arm; each mark costs a clock read and a list append."""
    return _env_choice("SGLANG_DDTREE_AUTO_HOST_DETAIL", ("0", "1")) == "1"


def auto_sample_every() -> int | None:
    """SGLANG_DDTREE_AUTO_SAMPLE_EVERY: the policy's sample_every for this server (None when unset: the module's
    SAMPLE_EVERY), for an A/B in one run."""
    return _env_at_least("SGLANG_DDTREE_AUTO_SAMPLE_EVERY", int, 1, "a round count >= 1")


def auto_log_every() -> int:
    """SGLANG_DDTREE_AUTO_LOG_EVERY (default 2000): rounds between `auto`'s chooser-table log lines. Benchmarks set
    it lower (lease_steps.sh auto-final: 100) so that a row of a few hundred rounds carries the table it ran with
    (bench.sweep.last_auto_table); each line costs a few hundred microseconds of host time."""
    raw = os.environ.get("SGLANG_DDTREE_AUTO_LOG_EVERY", "2000")
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"SGLANG_DDTREE_AUTO_LOG_EVERY must be a positive integer (rounds), got {raw!r}.")
    return value


class CalibrationMonitor:
    """The host side of the server's calibration table (adaptive.ScoreCalibrator, on the GPU; the scored rounds'
    walk stages (one sampled tree round in CALIBRATION_EVERY, every one while the table is young: CALIBRATION_YOUNG)
    compute what it learns, the worker applies it: `learn`).

    - Prediction errors: each scored round's |raw prediction - committed| and |calibrated prediction - committed|
      summed over its requests (ops.calibration_round), both predicted before the table learns the round, arrive
      through AutoFeedback: running totals here (mean absolute error per request-round, raw against calibrated:
      the issue's measure of whether calibration predicts better), Prometheus counters.
    - The table: its per-(depth, path class, rank class) sums are copied to pinned memory without a sync and, once
      the copy completed, published as Prometheus gauges, at most once in EXPORT_SECONDS (the clock is read every
      EXPORT_EVERY rounds; the first check publishes) (the debug dump writes the whole table every 100 rounds,
      `ScoreCalibrator.export`).
    - reset (POST /set_internal_state {"server_args": {"ddtree_calibration_reset": 1}}, plugin hook ->
      `DDTreeWorker.reset_calibration`): an empty table, totals zeroed, the gauges published at once, and again
      EXPORT_EVERY rounds later without waiting EXPORT_SECONDS."""

    # A publish sets every cell's two gauges (~180 sets: bench_calibration_publish.py; 0.43 ms on the dev CPU with
    # the summary's rows, results/auto_bookkeeping_cpu.json). Every 256 rounds that was ~2 us a round on the CPU,
    # more in the server (lease 38's detail split put `auto`'s after-commit bookkeeping at ~14 us a tiny-pair round,
    # with the log at LOG_EVERY=100); a dashboard reads the table on a scale of seconds, so a publish waits
    # EXPORT_SECONDS since the last one started (at 5 ms a round: one in ~2000 rounds).
    EXPORT_EVERY = 64
    EXPORT_SECONDS = 10.0

    def __init__(self, calibrator, prometheus=None):
        self.calibrator = calibrator
        self.prometheus = prometheus
        self.raw_abs = self.calibrated_abs = self.gated_abs = self.request_rounds = 0.0
        self.learnt = 0  # request-rounds the table learnt since its last reset (CALIBRATION_LEARN_ALL, _GATE)
        self.resets = 0
        pin = calibrator.device.type == "cuda"
        self._snapshot = torch.zeros((3, *calibrator.config.shape[:3]), dtype=torch.float64, pin_memory=pin)
        self._pending = None  # the snapshot copy's event (or True on CPU) while one is in flight
        self._rounds = 0
        self._last_export = None  # time.monotonic() when the last snapshot started (None: none yet)

    def young(self) -> bool:
        """Whether the gated predictor is still the raw one (CALIBRATION_GATE): asked when the round is pushed,
        before the table learns it, as both predictions were made."""
        return self.learnt < CALIBRATION_GATE

    def errors(self, raw_abs: float, calibrated_abs: float, requests: float, young: bool = False) -> None:
        """A scored round's summed errors; young: the table had learnt fewer than CALIBRATION_GATE request-rounds
        when it predicted (the gated predictor's error is then the raw one)."""
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
        """A scored round's table delta (after the round's stages: graph warm-ups and captures never get here);
        requests: the round's real requests, known on the host (the stage's errors[2] counts the same rows on the
        device; the host number makes the table's update one kernel instead of seven: ScoreCalibrator.learn)."""
        self.calibrator.learn(delta, int(requests))
        self.learnt += requests

    def after_round(self) -> None:
        """Every decode round: publish a completed snapshot; every EXPORT_EVERY rounds start the next one if
        EXPORT_SECONDS passed since the last one started."""
        self._rounds += 1
        if self.prometheus is None:
            return
        if self._pending is not None and (self._pending is True or self._pending.query()):
            self._publish(self._snapshot)
            self._pending = None
        if self._pending is None and self._rounds % self.EXPORT_EVERY == 0:
            now = time.monotonic()
            if self._last_export is not None and now - self._last_export < self.EXPORT_SECONDS:
                return
            self._last_export = now
            self._snapshot.copy_(self.calibrator.summary(), non_blocking=True)
            if self._snapshot.is_pinned():
                self._pending = torch.cuda.Event()
                self._pending.record()
            else:
                self._pending = True

    def _publish(self, summary: torch.Tensor) -> None:
        from sglang_ddtree.adaptive import summary_rows

        try:
            self.prometheus.calibration_table(summary_rows(summary, self.calibrator.config.prior_mass))
        except Exception:  # metrics must never take the server down
            logger.exception("DDTREE calibration metrics update failed")

    def reset(self) -> None:
        """Between rounds (the scheduler's request handling): the zeroing runs on the rounds' stream, in order; a
        round already queued may still add its delta."""
        self.calibrator.reset()
        self.raw_abs = self.calibrated_abs = self.gated_abs = self.request_rounds = 0.0
        self.learnt = 0
        self.resets += 1
        self._pending = None
        # the check EXPORT_EVERY rounds after the reset publishes whatever the clock says: whoever reset the table
        # wants to see it learn again soon, not EXPORT_SECONDS later (lease 39's server module caught that wait);
        # counting from the reset gives the young table EXPORT_EVERY rounds to learn before that publish
        self._last_export = None
        self._rounds = 0
        if self.prometheus is not None:
            self._publish(self.calibrator.summary().cpu())

    def export(self) -> dict:
        """For logs and the debug dump (host values only: no sync)."""
        n = self.request_rounds
        return {"scored_request_rounds": int(n), "resets": self.resets,
                "tau_mae_raw": _r(self.raw_abs / n) if n else None,
                "tau_mae_calibrated": _r(self.calibrated_abs / n) if n else None,
                "tau_mae_gated": _r(self.gated_abs / n) if n else None}


class AutoFeedback:
    """The GPU -> host channel of `auto`: one small vector per round copied into pinned memory, read once its event
    and the round's timer events have completed (never waits)."""

    RING = 4 * HOLD_MAX  # rounds queued between two decisions: a settled hold (HOLD_MAX) and the lag, with room
    CALIBRATION = 3  # the vector's last entries: ops.calibration_round's errors (zeros on unsampled rounds)

    def __init__(self, policy: AutoBudgetPolicy, device, calibration: CalibrationMonitor | None = None):
        self.policy = policy
        self.calibration = calibration
        self.width = 2 * len(policy.candidates) + self.CALIBRATION
        pin = torch.device(device).type == "cuda"
        # one pinned block, a row per slot (its rows are views: copied into without a sync, read with tolist)
        self.ring = torch.zeros((self.RING, self.width), dtype=torch.float32, pin_memory=pin)
        self.pending: collections.deque = collections.deque()
        self.index = 0
        self.dropped = 0

    def push(self, vector: torch.Tensor | None, timer, bucket: int, chosen: int, batch_size: int,
             cold: bool = False, sampled: bool = True, young: bool = False) -> None:
        """vector: [expected per candidate (sum over the batch), observed per candidate (0 where not observed),
        calibration errors (ops.calibration_round; zeros when the round did not score)]; None on a round that did
        not sample (the policy learns only its time: observe() reads observed tokens only next to the same round's
        expectations, so the round's walk does not compute them and nothing is copied).
        cold: the round did one-time work (graph captures): its tokens count, its time does not.
        sampled: the round computed the expectations (else only its time counts).
        young: the calibration table was young when the round predicted (CalibrationMonitor.young)."""
        if sampled and vector is None:
            raise ValueError("a sampled round must bring its feedback vector.")
        if len(self.pending) >= self.RING:
            self.dropped += 1
            return
        slot = event = None
        if sampled:
            slot = self.ring[self.index % self.RING]
            self.index += 1
            slot.copy_(vector, non_blocking=True)
            if vector.is_cuda:
                event = torch.cuda.Event()
                event.record(getattr(timer, "stream", None))  # the round's stream, when the timer has it
        self.pending.append((event, slot, None if cold else timer, bucket, chosen, batch_size, sampled, young))

    def drain(self) -> int:
        done = 0
        while self.pending:
            event, slot, timer, bucket, chosen, batch_size, sampled, young = self.pending[0]
            if (event is not None and not event.query()) or (timer is not None and not timer.done()):
                break
            self.pending.popleft()
            n = len(self.policy.candidates)
            stages = timer.elapsed_ms() if timer is not None and timer.enabled and timer.marks else {}
            round_ms = sum(stages.values()) if stages else None
            if slot is None:  # an unsampled round: its time only
                self.policy.observe(bucket, chosen, batch_size, round_ms, None, [None] * n)
                done += 1
                continue
            values = slot.tolist()
            seen = observed_candidates(self.policy.candidates, chosen)
            observed = [values[n + i] if seen[i] else None for i in range(n)]
            self.policy.observe(bucket, chosen, batch_size, round_ms, values[:n], observed)
            if self.calibration is not None:
                self.calibration.errors(*values[2 * n: 2 * n + self.CALIBRATION], young=young)
            done += 1
        return done
