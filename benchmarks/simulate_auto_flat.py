"""`auto`'s host policy on a flat cost curve, on the CPU (sglang_ddtree.bench.auto_sim): how often it verifies the
widest tree, and how close its picks stay to the best candidate's rate, when every candidate's round costs about the
same and wider trees commit more - lease 19's tiny pair (sweep_auto_tiny_lease19.jsonl: at batch 1 the chooser timed
the 32-, 64- and 128-trees at 4.31 / 4.41 / 4.32 ms and gave the narrower ones 32% of its rounds). Next to it:
8B-like cases where the chain should win, a case with real cost gaps, and the scenarios of tests/test_sglang_auto.py
that guard against lock-outs (a slow start, one slow sample, slow host phases). `--set FIELD=VALUE` (repeatable)
runs the chooser with that auto.AutoConfig field changed, e.g. `--set shrink_z=0`, `--set hold_rounds=1`,
`--set hold_max=4`, `--set recent=16`; `--explore-all` with explore_all; `--cases TEXT` runs only the cases whose
name holds TEXT. (The options of the experiments deleted from auto.py - floor freshness, warm rounds, MAD spread,
relative times, start re-measure, untimed switches - went with them; git history has them.)

    python benchmarks/simulate_auto_flat.py --out benchmarks/results/auto_flat_sim.json
    python benchmarks/simulate_auto_flat.py --set shrink_z=0 --out benchmarks/results/auto_flat_sim_z0.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Lease 19's chooser table at tiny batch 1: committed tokens per request (expected x observed / expected) and the
# drafter's expectation, chain, 16, 32, 64, 128.
TOKENS = [2.55, 3.86, 4.13, 4.37, 4.54]
EXPECTED = [3.85, 4.62, 5.01, 5.36, 5.70]
LOCKOUT_TOKENS = [3.6, 3.9, 4.1, 4.3, 4.55]
TINY12_BASE, TINY12_TOKENS = [4.6, 4.7, 4.6, 4.8, 4.7], [5.47, 5.62, 6.05, 6.59, 6.69]
# The tiny-like batch-1 start (lease 21e's servers, below): the chain's round cheaper, the 128-tree's a little cheaper
# than the narrower trees', Poisson token counts, a new prompt every 350 rounds; cases override what they vary.
TINY_START = dict(base=[3.75, 4.4, 4.4, 4.4, 4.2], noise=0.10, outlier=0.05, rounds=1400, skip=0, seeds=48, batch=1,
                  poisson_tokens=True, prompt_sigma=0.3, prompt_rounds=350)
CASES = {
    "flat, noise 0.10": dict(base=[4.4] * 5, noise=0.10, outlier=0.05),
    "flat, noise 0.20": dict(base=[4.4] * 5, noise=0.20, outlier=0.05),
    "flat, noise 0.15, slow phases x1.5": dict(base=[4.4] * 5, noise=0.15, outlier=0.05, phase_mult=1.5,
                                               phase_len=150),
    "128-tree 8% dearer, noise 0.15": dict(base=[5.0, 5.0, 5.1, 5.2, 5.4], noise=0.15, outlier=0.05),
    "real cost gaps, 32- and 64-tree rates 0.5% apart": dict(base=[10.0, 10.3, 11.0, 12.5, 16.0], noise=0.05,
                                                              outlier=0.02, tokens=[3.0, 4.0, 4.6, 5.2, 5.5],
                                                              expected=[4.0, 5.0, 6.0, 7.0, 8.0]),
    "8B-like batch 16 (convex, drafter never right)": dict(base=[11.0, 11.5, 20.0, 38.0, 73.0], noise=0.03,
                                                           outlier=0.01, tokens=[1.0] * 5,
                                                           expected=[1.5, 2.0, 3.0, 4.0, 6.0]),
    "8B-like batch 1 (drafter never right)": dict(base=[8.0, 8.2, 8.5, 9.0, 10.0], noise=0.03, outlier=0.01,
                                                  tokens=[1.0] * 5, expected=[1.5, 2.0, 3.0, 4.0, 6.0]),
    # lease 21: what the simulation had left out. A sampled round costs more (the chooser timed a probed candidate's
    # rounds, which are sampled, against the incumbent's, three in four not); the host's speed drifts (the device's
    # vCPUs ran one Python loop in 0.32-0.68 s, the order changing between passes); what a round commits moves with
    # the text, all candidates together (content) and per round (token noise), the expectations following half of it
    "flat, sampled rounds +0.3 ms": dict(base=[4.4] * 5, noise=0.10, outlier=0.05, sampled_ms=0.3),
    "flat, host drift 0.2 over 250 rounds": dict(base=[4.4] * 5, noise=0.10, outlier=0.05, drift_sigma=0.2,
                                                 drift_rounds=250),
    "flat, host drift 0.3 over 1000 rounds": dict(base=[4.4] * 5, noise=0.10, outlier=0.05, drift_sigma=0.3,
                                                  drift_rounds=1000),
    "flat, content 0.4 over 500 rounds, token noise 0.6": dict(base=[4.4] * 5, noise=0.10, outlier=0.05,
                                                                content_sigma=0.4, content_rounds=500,
                                                                token_noise=0.6),
    "flat, all of lease 21's effects": dict(base=[4.4] * 5, noise=0.10, outlier=0.05, sampled_ms=0.3,
                                            drift_sigma=0.2, drift_rounds=250, content_sigma=0.4,
                                            content_rounds=500, token_noise=0.6),
    "8B-like batch 1, host drift 0.2 over 250 rounds": dict(base=[8.0, 8.2, 8.5, 9.0, 10.0], noise=0.03,
                                                            outlier=0.01, tokens=[1.0] * 5,
                                                            expected=[1.5, 2.0, 3.0, 4.0, 6.0], drift_sigma=0.2,
                                                            drift_rounds=250),
    # Lease 21e's tiny batch-1 servers (sweep_twins_tiny_lease21e.jsonl): ~1400 rounds from the server's start, the
    # chain's round cheaper (3.75 against ~4.4 ms), a round's tokens drawn per round (Poisson counts, a wider tree
    # adding to the narrower one's), a new prompt every 350 rounds, the first 20 rounds 1.5x slow. Both servers kept
    # the 128-tree out for hundreds of rounds: its cost floor came from a narrower tree's slow first rounds.
    "tiny-like batch 1 from the start: Poisson tokens, prompts, slow start": dict(
        TINY_START, base=[3.75, 4.4, 4.4, 4.4, 4.4], seeds=24, start_rounds=20, start_mult=1.5),
    # The same from the start with a sampled-round extra guessed from lease 23b's batch-1 chooser table (the 16- and
    # 64-trees' probed / explored rounds 0.6-1.1 ms above their times once they ran; the chain, only probed, 4.5 ms),
    # and the 128-tree's round a little cheaper than the narrower trees' as that table read it. Lease 24 measured the
    # extra directly (a server timing sampled rounds apart, auto_chooser_log_tiny_lease24.txt): 0.13-0.33 ms (3-8%)
    # for the 128-tree at batch 1-64, ~0.5 ms for the chain at batch 4: smaller than guessed here; the rounds after a
    # candidate's first use (the cases below) were slower than that.
    "tiny-like batch 1 from the start, sampled rounds +0.6 ms (chain +0.9)": dict(
        TINY_START, seeds=24, start_rounds=20, start_mult=1.5,
        sampled_ms=[0.9, 0.6, 0.6, 0.6, 0.6]),
    # Lease 24's debug dump (tiny pair, batch 1, every round timed): a candidate's first timed round (the one after
    # its cold first use) 1.13-1.47x its median, the second 1.04-1.17x; the explored candidates' few times read dear
    # against the incumbent's many. The same tiny-like start with that warm-up and without the slow first rounds.
    "tiny-like batch 1 from the start, first uses slow (x1.3, x1.08)": dict(TINY_START, warm_mult=(1.3, 1.08)),
    "tiny-like batch 1 from the start, no warm-up": dict(TINY_START),
    # Lease 26's ten batch-1 servers (auto_chooser_log_starts_lease26.txt): the first tree explored after the leaders
    # read 6.3-8.9 ms in its one or two timed rounds against ~4.0-4.4 later (x1.5-2), and the 64- and 128-trees stayed
    # unexplored until the first stale probe (FLOOR_MIN_TIMES).
    "tiny-like batch 1 from the start, first uses slower (x1.8, x1.15)": dict(
        TINY_START, warm_mult=(1.8, 1.15)),
    "tiny-like batch 1 from the start, first two uses slower (x1.8, x1.5)": dict(
        TINY_START, warm_mult=(1.8, 1.5)),
    # Lease 33c's two batch-1 servers (sweep_ab_tiny_lease33c.jsonl, the chooser table after 300 rounds): the lean
    # chain round, explored first, read 7.8 / 6.4 ms in its three timed rounds against 3.7-5.4 for the trees; as
    # the narrowest candidate's least time it floored every tree, and neither server explored the 128-tree in its
    # batch-1 rows (one ran the 16-tree in 80% of them). Leases 31b-32 read the chain at 26-40 ms there.
    "tiny-like batch 1 from the start, the chain's first uses slow (x1.8)": dict(
        TINY_START, warm_mult=(1.3, 1.08), chain_warm_mult=(1.8, 1.8, 1.8)),
    # The same dump's rounds right after a switch of candidate (after its first three uses): ~4% dearer at the
    # median, twice as often >= 1.4x (auto_sim.simulate's switch_mult / switch_outlier). Probes time only such
    # rounds. (ebae9a7's SWITCH_SETTLE left them untimed and timed a probe's second round: no gain simulated,
    # auto_flat_sim_switch_settle.json, none measured, sweep_starts_tiny_lease25.jsonl; removed.)
    # Lease 34's chain runs (sweep_ab_tiny_lease34d.jsonl, auto_chooser_log_tiny_lease34d.txt): on the tiny pair the
    # lean chain round is the cheapest (3.5-3.8 ms against ~4.4) and commits ~4.1 tokens against the 128-tree's ~5.9;
    # the trees' ratios came from a few start rounds that committed less (the 128-tree's observed / expected
    # 0.74-0.86), and a chain round observes no tree, so 4 of 12 servers ran the chain for 95-310 rounds of a row.
    # Here the trees' first 100 rounds commit 80% and the chain's first uses cost 1.6x.
    "tiny-like batch 1, the trees' start rounds commit 80% (lease 34's chain runs)": dict(
        TINY_START, base=[3.6, 4.4, 4.4, 4.4, 4.4], tokens=[4.1, 4.7, 5.1, 5.5, 5.9],
        expected=[4.1, 4.6, 4.9, 5.2, 5.5], seeds=24, start_rounds=100,
        start_tokens=[4.1, 3.76, 4.08, 4.4, 4.72], warm_mult=(1.3, 1.08), chain_warm_mult=(1.6, 1.6, 1.6)),
    "tiny-like batch 1 from the start, switches x1.04 (+5% at x1.5)": dict(
        TINY_START, warm_mult=(1.3, 1.08), switch_mult=1.04,
        switch_outlier=0.05),
    "tiny-like batch 1, switches x1.04 (+5% at x1.5), rounds 1400-6000": dict(
        TINY_START, rounds=6000, skip=1400, seeds=24, warm_mult=(1.3, 1.08), switch_mult=1.04,
        switch_outlier=0.05),
    "flat, noise 0.10, switches x1.04 (+5% at x1.5)": dict(base=[4.4] * 5, noise=0.10, outlier=0.05,
                                                            switch_mult=1.04, switch_outlier=0.05),
    "8B-like batch 16, switches x1.04 (+5% at x1.5)": dict(base=[11.0, 11.5, 20.0, 38.0, 73.0], noise=0.03,
                                                            outlier=0.01, tokens=[1.0] * 5,
                                                            expected=[1.5, 2.0, 3.0, 4.0, 6.0], switch_mult=1.04,
                                                            switch_outlier=0.05),
    # A new batch-size bucket after another (the policy keeps the first bucket's state; `first` is run before the
    # measured rounds at its own batch size). Lease 25's tiny sweep at batch 4, after batch 1 where the 128-tree led:
    # the 64-tree's first timed rounds read 6.86 ms against the 32-tree's 3.9 and floored the 128-tree out for ~900
    # rounds (EXPLORE_BEST_ELSEWHERE). The costs are that bucket's medians from the server's log.
    "tiny-like batch 4 after batch 1, first uses slow (x1.6, x1.3)": dict(
        base=[4.8, 5.2, 3.9, 4.3, 4.0], noise=0.10, outlier=0.05, rounds=1500, skip=0, seeds=24, batch=4,
        poisson_tokens=True, prompt_sigma=0.3, prompt_rounds=350, warm_mult=(1.6, 1.3),
        first=dict(base=TINY_START["base"], batch=1, rounds=1500, warm_mult=(1.3, 1.08))),
    "8B-like batch 16 after batch 1 (convex; the 128-tree best at batch 1)": dict(
        base=[11.0, 11.5, 20.0, 38.0, 73.0], noise=0.03, outlier=0.01, tokens=[3.0, 4.0, 4.5, 5.0, 5.5],
        expected=[4.0, 5.0, 6.0, 7.0, 8.0], rounds=1500, skip=0, seeds=16, batch=16,
        first=dict(base=[8.0, 8.2, 8.5, 9.0, 10.0], batch=1, rounds=1500)),
    "8B-like batch 16 after batch 1 (milder convex)": dict(
        base=[11.0, 11.5, 13.0, 16.0, 22.0], noise=0.03, outlier=0.01, tokens=[3.0, 4.0, 4.5, 5.0, 5.5],
        expected=[4.0, 5.0, 6.0, 7.0, 8.0], rounds=1500, skip=0, seeds=16, batch=16,
        first=dict(base=[8.0, 8.2, 8.5, 9.0, 10.0], batch=1, rounds=1500)),
    # Lease 36's A/B tallies (ab_arms' narrower_*): a round of a candidate that is not the incumbent (probes,
    # exploration) took ~1.25x the fixed 128-tree's round (1.12-1.55x; a switch, a sampled round and a decision in
    # one), and servers whose first decisions went to the chain or the 64-tree kept them for hundreds of rounds
    # (tiny-e4 at batch 4, the chain in 448 of 465 rounds: the lean chain 4.77 ms and ~4.7 tokens a round against the
    # 128-tree's 5.27 ms and ~6.6; tiny-e3 at batch 1). These cases: the lean chain ~0.9x of the trees' flat cost, a
    # switched round x1.2 (5% of them x1.5 more) plus 0.3 ms when sampled, a row's length of rounds (SWITCH_UNTIMED).
    "tiny-like batch 1, lean chain, switches x1.2 (lease 36)": dict(
        TINY_START, base=[4.1, 4.6, 4.6, 4.65, 4.7], tokens=[4.4, 5.3, 5.6, 5.9, 6.2],
        expected=[4.2, 4.85, 5.15, 5.4, 5.6], rounds=700, warm_mult=(1.3, 1.08), switch_mult=1.2,
        switch_outlier=0.05, sampled_ms=0.3),
    "tiny-like batch 4 after batch 1, lean chain, switches x1.2 (lease 36)": dict(
        base=[4.77, 5.1, 5.15, 5.2, 5.27], tokens=[4.7, 5.6, 6.0, 6.3, 6.6], expected=[4.45, 5.08, 5.38, 5.64, 5.87],
        noise=0.10, outlier=0.05, rounds=600, skip=0, seeds=48, batch=4, poisson_tokens=True, prompt_sigma=0.3,
        prompt_rounds=350, warm_mult=(1.3, 1.08), switch_mult=1.2, switch_outlier=0.05, sampled_ms=0.3,
        first=dict(base=[4.1, 4.6, 4.6, 4.65, 4.7], batch=1, rounds=600, warm_mult=(1.3, 1.08))),
    "8B-like batch 16, switches x1.2 (+5% at x1.5)": dict(base=[11.0, 11.5, 20.0, 38.0, 73.0], noise=0.03,
                                                           outlier=0.01, tokens=[1.0] * 5,
                                                           expected=[1.5, 2.0, 3.0, 4.0, 6.0], switch_mult=1.2,
                                                           switch_outlier=0.05),
    "8B-like batch 16 after batch 1 (milder convex), switches x1.2": dict(
        base=[11.0, 11.5, 13.0, 16.0, 22.0], noise=0.03, outlier=0.01, tokens=[3.0, 4.0, 4.5, 5.0, 5.5],
        expected=[4.0, 5.0, 6.0, 7.0, 8.0], rounds=1500, skip=0, seeds=16, batch=16, switch_mult=1.2,
        switch_outlier=0.05, first=dict(base=[8.0, 8.2, 8.5, 9.0, 10.0], batch=1, rounds=1500)),
    # Lease 37's 8B shapes at batch 1 (auto_chooser_log_8b_lease37.txt; dummy weights, every candidate commits 1
    # token): the server's first rounds were slow (the chain's five exploration times a median 8.02 ms against its
    # warm 6.81, the 16-tree's 8.85 against 7.55), the 32-tree's 7.62 came later, and the chain could not win until
    # the stale probe near round 256: 249 of 713 rounds on the 32-tree, x0.931 of DFLASH. Here the server's first 10
    # rounds cost 1.18x: 16 seeds read 0.995 of the best rate, the worst 0.950 (the same lock); with the start
    # re-measure (--forget-start 128) 0.996 / 0.979 (auto_flat_sim_lease37_start*.json).
    "8B-like batch 1 from the start, dummy drafter, slow first rounds (lease 37)": dict(
        base=[6.8, 7.5, 7.6, 8.1, 9.0], noise=0.03, outlier=0.01, tokens=[1.0] * 5,
        expected=[1.0, 1.0001, 1.0002, 1.0004, 1.0008], rounds=713, skip=0, seeds=16, batch=1, start_rounds=10,
        start_mult=1.18, warm_mult=(1.1, 1.05)),
    # tests/test_sglang_auto.py's scenarios, with more seeds
    "slow start committing little (lock-out test)": dict(base=[4.4, 4.5, 4.6, 4.68, 4.75], noise=0.08, outlier=0.0,
                                                         tokens=LOCKOUT_TOKENS, expected=[4.0, 4.8, 5.2, 5.5, 5.9],
                                                         rounds=3000, skip=1000, seeds=20, start_rounds=60,
                                                         start_mult=1.4, start_tokens=[1.0, 1.1, 1.2, 1.3, 1.2]),
    "one slow sample (lease 12's chain lock-in test)": dict(base=TINY12_BASE, noise=0.10, outlier=0.05,
                                                             tokens=TINY12_TOKENS,
                                                             expected=[8.0, 9.0, 10.5, 12.0, 13.0], rounds=750,
                                                             skip=0, seeds=40),
    "slow host phases x1.6 (phase test)": dict(base=TINY12_BASE, noise=0.10, outlier=0.0, tokens=TINY12_TOKENS,
                                               expected=[8.0, 9.0, 10.5, 12.0, 13.0], rounds=2000, skip=0, seeds=20,
                                               phase_mult=1.6, phase_len=300),
}


def main(argv=None) -> int:
    from sglang_ddtree.bench import auto_sim
    from sglang_ddtree.sglang import auto

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=8, help="seeds of the cases that do not set their own")
    ap.add_argument("--rounds", type=int, default=4000)
    ap.add_argument("--skip", type=int, default=300, help="first rounds left out (exploration)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="an auto.AutoConfig field for this run (repeatable), e.g. shrink_z=0")
    ap.add_argument("--explore-all", action="store_true",
                    help="policies with explore_all (exploration ignores cost floors: SGLANG_DDTREE_AUTO_EXPLORE_ALL)")
    ap.add_argument("--cases", default=None, help="only the cases whose name contains this text")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.rounds <= args.skip:
        ap.error("--rounds must exceed --skip")
    changes = {"explore_all": True} if args.explore_all else {}
    for item in args.set:
        name, sep, value = item.partition("=")
        default = getattr(auto.AutoConfig, name, None)
        if not sep or name not in auto.AutoConfig.__dataclass_fields__ or isinstance(default, (bool, str)) \
                or default is None:
            ap.error(f"--set expects a numeric AutoConfig field, FIELD=VALUE, got {item!r}")
        changes[name] = type(default)(value)
    try:
        config = auto.AutoConfig(**changes)
    except ValueError as e:
        ap.error(str(e))
    rows = []
    for name, case in CASES.items():
        if args.cases is not None and args.cases not in name:
            continue
        tokens, expected = case.get("tokens", TOKENS), case.get("expected", EXPECTED)
        rounds, skip, seeds = case.get("rounds", args.rounds), case.get("skip", args.skip), case.get("seeds", args.seeds)
        start = {k: case[k] for k in ("start_rounds", "start_mult", "start_tokens", "sampled_ms", "drift_sigma",
                                      "drift_rounds", "content_sigma", "content_rounds", "token_noise",
                                      "poisson_tokens", "prompt_sigma", "prompt_rounds", "warm_mult",
                                      "chain_warm_mult", "switch_mult", "switch_outlier") if k in case}
        ratios, shares = [], [0] * len(tokens)
        for seed in range(seeds):
            policy = auto.AutoBudgetPolicy(list(auto_sim.CANDIDATES), widths=auto_sim.WIDTHS, config=config)
            if "first" in case:  # another bucket's rounds first, same policy (its own noise, no start effects)
                first = case["first"]
                auto_sim.simulate(seed + 10_000, first["base"], tokens, expected, first["rounds"], first["batch"],
                                  case["noise"], case["outlier"], 2, policy=policy,
                                  warm_mult=first.get("warm_mult", ()),
                                  **{k: case[k] for k in ("poisson_tokens", "prompt_sigma", "prompt_rounds")
                                     if k in case})
            picks = auto_sim.simulate(seed, case["base"], tokens, expected, rounds, case.get("batch", 4), case["noise"],
                                      case["outlier"], 2, policy=policy, phase_mult=case.get("phase_mult", 1.0),
                                      phase_len=case.get("phase_len"), **start)[skip:]
            ratios.append(auto_sim.rate_over_best(picks, case["base"], tokens))
            for i in picks:
                shares[i] += 1
        total = sum(shares)
        rows.append({"case": name, "seeds": seeds, "rounds": rounds, "skipped_rounds": skip,
                     "rate_over_best_mean": round(statistics.mean(ratios), 3),
                     "rate_over_best_min": round(min(ratios), 3),
                     "share_by_candidate": {auto_sim.CANDIDATES[i] or "chain": round(n / total, 3)
                                            for i, n in enumerate(shares)}})
        print(json.dumps(rows[-1]))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "machine": "CPU (this repo's dev machine, 2 cores)",
            "command": "python benchmarks/simulate_auto_flat.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "config": {k: v for k, v in vars(config).items() if k != "force"},
            "cases_filter": args.cases,
            "cases": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
