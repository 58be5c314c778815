"""Ratios of two rows of an interleaved sweep taken run by run, with a confidence interval.

On the lent machines a host-bound row's tokens/s moves by up to a third between runs (measured: two identical
DDTREE 128 servers, per-run ratios 0.65-0.92), so the ratio of two rows' medians cannot show a few percent. In an
interleaved sweep (SweepOptions.interleave) run r of every row of one batch size is measured in the same round,
one server after the other; with rotate_prompts those runs also send the same prompts. The ratio of run r of A to
run r of B then cancels what the round shares (the prompt, a slow phase of the host), and the spread of those
per-round ratios says how far their mean can be trusted:

    d_r = ln(a_r / b_r),  ratio = exp(mean d),  95% interval = exp(mean d +- t(0.975, n - 1) * sd(d) / sqrt(n))

This is the geometric mean of the per-round ratios. It cannot remove a difference that lasts the whole run between
two servers' processes (seen: whole schedulers ran at different speeds); pinning every server to the same CPUs
(bench_budgets.py --server-cpus) is for that, and two identical servers in the same run show what is left
(measured, tiny pair, pinned: x1.005 [0.960, 1.051] over 96 rounds). On that host the runs of one round still varied
independently (log-ratio spread ~0.2 a round), so the interval narrows with the number of rounds only.
"""

from __future__ import annotations

import math

# Student's t, 0.975 quantile, by degrees of freedom (standard tables); between entries, interpolated in 1 / df.
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
         20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
         29: 2.045, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}
_T975_INF = 1.960


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with df degrees of freedom (df >= 1)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}.")
    if df in _T975:
        return _T975[df]
    known = sorted(_T975)
    above = [k for k in known if k > df]
    if not above:  # past 120: between t(120) and the normal quantile, linear in 1 / df
        lo_df, lo_t, w = 120, _T975[120], (1 / 120 - 1 / df) / (1 / 120)
        return lo_t + (_T975_INF - lo_t) * w
    hi_df = above[0]
    lo_df = max(k for k in known if k < df)
    w = (1 / lo_df - 1 / df) / (1 / lo_df - 1 / hi_df)
    return _T975[lo_df] + (_T975[hi_df] - _T975[lo_df]) * w


def paired_ratio(a: list[float], b: list[float]) -> dict:
    """a over b, run r against run r: {"ratio", "ci95": [lo, hi], "rounds", "sd_log"}. Both lists must be the
    same length (the same rounds) and hold at least two positive numbers."""
    return group_ratio([a], [b])


def group_ratio(a: list[list[float]], b: list[list[float]]) -> dict:
    """Servers a over servers b (several copies of one configuration each, measured in the same rounds), round by
    round: d_r = mean over a's copies of ln(run r) - the same over b's, then as paired_ratio (which is one copy
    each). Why copies: a server's first rounds (`auto`'s exploration) vary from one server start to the next by more
    than a chooser change moves them (measured on the tiny pair), so an arm of a chooser A/B is several servers
    (steps.sh tiny-starts), and their mean per round is one sample of the arm."""
    groups = [*a, *b]
    if not a or not b:
        raise ValueError("a group ratio needs at least one server on each side.")
    n = len(groups[0])
    if any(len(g) != n for g in groups):
        raise ValueError(f"paired runs must come in the same rounds: {[len(g) for g in groups]} runs.")
    if n < 2:
        raise ValueError(f"a paired ratio needs at least 2 rounds, got {n}.")
    if any(x <= 0 for g in groups for x in g):
        raise ValueError("tokens/s must be positive in every run.")
    d = [sum(math.log(g[r]) for g in a) / len(a) - sum(math.log(g[r]) for g in b) / len(b) for r in range(n)]
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    half = t975(n - 1) * sd / math.sqrt(n)
    return {"ratio": round(math.exp(mean), 4),
            "ci95": [round(math.exp(mean - half), 4), round(math.exp(mean + half), 4)],
            "rounds": n, "sd_log": round(sd, 4)}


def row_label(row: dict) -> str:
    """setup|method or setup|method-budget, as the paired tables name rows."""
    budget = row.get("budget")
    return f"{row['setup']}|{row['method']}" + ("" if budget is None else f"-{budget}")


def _measured(rows: list[dict]):
    """The result rows that measured something (status ok)."""
    return (r for r in rows if r.get("kind", "result") == "result" and r.get("status") == "ok")


def _pairs(rows: list[dict], base: str) -> list[tuple[int, dict, list[tuple[str, dict]]]]:
    """Per batch size that has the base row, in order: (batch size, the base row, [(label, row) of every other
    measured row, by label]). Rows measured without interleaving cannot be paired and are refused. An interleaved
    row is written only once all its rounds are in, so ok rows of one batch size have the same number of runs
    (group_ratio checks)."""
    by_bs: dict[int, dict[str, dict]] = {}
    for r in _measured(rows):
        if not r.get("interleaved"):
            raise ValueError(f"{r.get('key', row_label(r))}: measured without --interleave; its runs cannot be "
                             "paired with another row's.")
        by_bs.setdefault(int(r["batch_size"]), {})[row_label(r)] = r
    return [(bs, labelled[base], [(label, r) for label, r in sorted(labelled.items()) if label != base])
            for bs, labelled in sorted(by_bs.items()) if base in labelled]


def _runs(row: dict) -> list[float]:
    return row.get("decode_tokens_per_s_runs") or []


def _outlier_flags(row: dict) -> list[bool]:
    """Per run, whether it had requests decoding far above its median rate (measure.RATE_OUTLIER; newer sweeps
    record it, older rows have no flags)."""
    return [bool(n) for n in row.get("decode_rate_outliers_runs") or []]


def _clean_rounds(rows: list[dict], drop_outliers: bool) -> list[int]:
    """The rounds every one of `rows` may be paired in: all of them, or with drop_outliers those where no row had a
    rate outlier. Why: a run's tokens/s is the sum of its requests' rates, and one request timed short inflates it
    (measured, tiny pair, batch 64: DDTREE 128's flagged runs read 115-156k tokens/s against a median of 54k, their
    rates over the whole run's window 36-39k against a median of 28k): the round's ratio then measures the timing
    artifact, not the servers."""
    n = max((len(_runs(r)) for r in rows), default=0)
    if not drop_outliers:
        return list(range(n))
    flags = [_outlier_flags(r) for r in rows]
    return [i for i in range(n) if not any(i < len(f) and f[i] for f in flags)]


def _group(a: list[dict], b: list[dict], drop_outliers: bool) -> dict:
    """group_ratio of rows a over rows b on their clean rounds, with "dropped_runs" when rounds were left out;
    {"ratio": None, "rounds": n, "dropped_runs": k} when fewer than two are left."""
    lengths = [len(_runs(r)) for r in [*a, *b]]
    if len(set(lengths)) != 1:
        raise ValueError(f"paired runs must come in the same rounds: {lengths} runs.")
    keep = _clean_rounds([*a, *b], drop_outliers)
    total = lengths[0]
    dropped = total - len(keep)
    if len(keep) < 2:
        return {"ratio": None, "ci95": None, "rounds": len(keep), "dropped_runs": dropped}
    picked = [[[_runs(r)[i] for i in keep] for r in side] for side in (a, b)]
    out = group_ratio(*picked)
    if dropped:
        out["dropped_runs"] = dropped
    return out


def rate_outlier_runs(rows: list[dict]) -> dict[str, dict[int, list[int]]]:
    """{label: {batch size: [indices of runs with decode_rate_outliers]}} over measured rows that recorded them
    (newer sweeps): runs whose summed tokens/s may be inflated by a request timed short; the tables leave
    the rounds they are in out unless asked to keep them. Rows without such runs are left out."""
    out: dict[str, dict[int, list[int]]] = {}
    for r in _measured(rows):
        runs = [i for i, flagged in enumerate(_outlier_flags(r)) if flagged]
        if runs:
            out.setdefault(row_label(r), {})[int(r["batch_size"])] = runs
    return out


def paired_table(rows: list[dict], base: str, drop_outliers: bool = True) -> dict:
    """Per batch size, every measured row over the row labelled `base` (row_label), run by run; with drop_outliers
    a round either row had a rate outlier in is left out (_clean_rounds). `rows`: the latest result rows of one
    interleaved sweep; a batch size without the base row is left out. {batch_size: {label: _group(...)}}."""
    return {bs: {label: _group([row], [base_row], drop_outliers) for label, row in others}
            for bs, base_row, others in _pairs(rows, base)}


def arm_table(rows: list[dict], base: str, arms: dict[str, list[str]], drop_outliers: bool = True) -> dict:
    """Per batch size, each arm (its servers' row labels) over the row `base` and over the first arm, by
    group_ratio on the rounds clean in every row compared (_clean_rounds).
    {batch_size: {"<arm> over <base>" | "<arm> over <first arm>": _group(...)}}."""
    if not arms:
        raise ValueError("no arms given.")
    out = {}
    first = next(iter(arms))
    for bs, base_row, others in _pairs(rows, base):
        by_label = dict(others)
        missing = [label for labels in arms.values() for label in labels if label not in by_label]
        if missing:
            raise ValueError(f"batch {bs}: no measured row {', '.join(missing)}; rows: {', '.join(sorted(by_label))}.")
        table = {}
        for name, labels in arms.items():
            table[f"{name} over {base}"] = _group([by_label[x] for x in labels], [base_row], drop_outliers)
        for name, labels in list(arms.items())[1:]:
            table[f"{name} over {first}"] = _group([by_label[x] for x in labels],
                                                   [by_label[x] for x in arms[first]], drop_outliers)
        out[bs] = table
    return out


def pooled_ratios(rows: list[dict], base: str, drop_outliers: bool = True) -> dict:
    """Every row over `base` with the rounds of all batch sizes together (each round still paired within its batch
    size, on the rounds clean in both rows: _clean_rounds): one ratio per row label and a tighter interval when the
    batch sizes agree. {label: paired_ratio(...)}, with "dropped_runs" when rounds were left out."""
    runs: dict[str, tuple[list, list, int]] = {}
    for bs, base_row, others in _pairs(rows, base):
        base_runs = _runs(base_row)
        for label, row in others:
            mine = _runs(row)
            if len(mine) != len(base_runs):
                raise ValueError(f"{label}: {len(mine)} runs against {len(base_runs)} of {base} at batch {bs}.")
            keep = _clean_rounds([row, base_row], drop_outliers)
            a, b, dropped = runs.get(label, ([], [], 0))
            runs[label] = (a + [mine[i] for i in keep], b + [base_runs[i] for i in keep],
                           dropped + len(mine) - len(keep))
    out = {}
    for label, (a, b, dropped) in sorted(runs.items()):
        out[label] = paired_ratio(a, b)
        if dropped:
            out[label]["dropped_runs"] = dropped
    return out


def _ab_pairs(row: dict) -> tuple[list[float], list[float]]:
    """An SGLANG_DDTREE_AUTO_AB row's runs with both arms counted: (auto tokens/s, fixed tokens/s) run by run."""
    a, f = [], []
    for run in row.get("ab_runs") or []:
        if run and "auto" in run and "fixed" in run:
            a.append(run["auto"]["tokens_per_s"])
            f.append(run["fixed"]["tokens_per_s"])
    return a, f


def ab_table(rows: list[dict]) -> dict:
    """SGLANG_DDTREE_AUTO_AB rows (an `auto` server alternating blocks of rounds with the fixed widest tree, each
    arm tallied apart: sglang_ddtree.sglang.stats.ABTallies): per row label and batch size, the arms' tokens/s
    ratio over the whole row ("ratio": their tallies summed), run by run ("runs": the geometric mean of the runs'
    ratios with its 95% interval, paired_ratio), and each arm's tau, GPU ms and host ms a round, with `auto`'s rounds
    of a candidate other than the widest tree (narrower_rounds, their ms a round; a row locked on the chain or a
    narrower tree shows here) and its sampled rounds where the server tallied them; under "all batch
    sizes" every run of the row's batch sizes together. The arms share the process, the moment and the text, so
    the interval is the rounds' own spread, not the host's speed from run to run (auto.auto_ab_block).
    {label: {"by_batch_size": {bs: {...}}, "all_batch_sizes": paired_ratio(...) | None}}."""
    out: dict = {}
    for r in _measured(rows):
        if not r.get("ab_runs"):
            continue
        label = row_label(r)
        arms = (r.get("ddtree_metrics") or {}).get("ab") or {}
        a, f = _ab_pairs(r)
        entry = {"block": r.get("ab_block"), "ratio": round(arms["ratio"], 4) if "ratio" in arms else None,
                 "runs": paired_ratio(a, f) if len(a) >= 2 else None, "runs_with_both_arms": len(a),
                 "arms": {arm: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in numbers.items()
                                if k in ("tau", "round_ms", "host_ms", "rounds", "skipped_rounds", "tokens_per_s",
                                         "narrower_rounds", "narrower_round_ms", "sampled_rounds")}
                          for arm, numbers in arms.items() if isinstance(numbers, dict)}}
        out.setdefault(label, {"by_batch_size": {}})["by_batch_size"][int(r["batch_size"])] = entry
    for label, table in out.items():
        table["by_batch_size"] = dict(sorted(table["by_batch_size"].items()))
        table["all_batch_sizes"] = ab_pooled(rows, {label})["all_batch_sizes"]
    return out


def ab_pooled(rows: list[dict], labels) -> dict:
    """ab_table's run-by-run ratio for one configuration run on several A/B servers (labels): every run of those
    servers' rows pooled, per batch size and over all of them (two servers of one configuration differ by ~2% in
    their exploration on the tiny pair). {"by_batch_size": {bs: paired_ratio(...)}, "all_batch_sizes": ...}."""
    by_bs: dict = {}
    for r in _measured(rows):
        if r.get("ab_runs") and row_label(r) in labels:
            a, f = _ab_pairs(r)
            runs = by_bs.setdefault(int(r["batch_size"]), ([], []))
            runs[0].extend(a)
            runs[1].extend(f)
    every = ([x for a, _ in by_bs.values() for x in a], [x for _, f in by_bs.values() for x in f])
    return {"by_batch_size": {bs: paired_ratio(a, f) for bs, (a, f) in sorted(by_bs.items()) if len(a) >= 2},
            "all_batch_sizes": paired_ratio(*every) if len(every[0]) >= 2 else None}


def ab_own_host_split(rows: list[dict], labels) -> dict:
    """Where `auto`'s own host time goes, from SGLANG_DDTREE_AUTO_AB rows of the servers `labels`: per batch size,
    the mean over rows of `auto`'s arm's host ms a round less the fixed arm's, in all ("host"), per host stage of the
    worker's round call (the arms' host_stage_ms: `choose` is `auto`'s alone, `after` its feedback and table work
    after the commit) and on the GPU timeline ("round"), with the rows' count and the fixed arm's mean round ms (the
    scale); "sampled_extra": the part of "round" that is the sampled rounds' extra cost over the arm's other rounds,
    per round of the arm, the mean over the rows that tallied them (None where none did: older rows). The
    arms share the process and the moment, so a stage's difference is what `auto`'s code adds to it (measured:
    ~0.10-0.15 ms a tiny-pair round, 2-3%, `choose` ~0.047 of it at every batch size and the sampled rounds' extra
    ~0.045).
    {bs: {"rows": n, "fixed_round_ms": ms, "round": d, "host": d, "sampled_extra": d, "stages": {stage: d}}}."""
    by_bs: dict = {}
    for r in _measured(rows):
        arms = (r.get("ddtree_metrics") or {}).get("ab") or {}
        a, f = arms.get("auto"), arms.get("fixed")
        if not (r.get("ab_runs") and row_label(r) in labels and isinstance(a, dict) and isinstance(f, dict)):
            continue
        if not all(k in arm for arm in (a, f) for k in ("host_ms", "round_ms")):
            continue
        stages_a, stages_f = a.get("host_stage_ms") or {}, f.get("host_stage_ms") or {}
        diffs = {"round": a["round_ms"] - f["round_ms"], "host": a["host_ms"] - f["host_ms"],
                 "fixed_round_ms": f["round_ms"]}
        rounds, sampled = a.get("rounds") or 0, a.get("sampled_rounds") or 0
        if 0 < sampled < rounds and a.get("sampled_round_ms"):  # the sampled rounds' extra over the arm's other
            # rounds, spread over all its rounds (GPU timeline): what sampling costs `auto` a round
            rest_ms = (a["round_ms"] * rounds - a["sampled_round_ms"] * sampled) / (rounds - sampled)
            diffs["sampled_extra"] = sampled / rounds * (a["sampled_round_ms"] - rest_ms)
        for stage in set(stages_a) | set(stages_f):
            diffs[f"stage:{stage}"] = stages_a.get(stage, 0.0) - stages_f.get(stage, 0.0)
        for name, value in diffs.items():
            by_bs.setdefault(int(r["batch_size"]), {}).setdefault(name, []).append(value)
    out = {}
    for bs, d in sorted(by_bs.items()):
        mean = {k: round(sum(v) / len(v), 4) for k, v in d.items()}
        out[bs] = {"rows": len(d["round"]), "fixed_round_ms": mean["fixed_round_ms"], "round": mean["round"],
                   "host": mean["host"], "sampled_extra": mean.get("sampled_extra"),
                   "stages": {k.removeprefix("stage:"): v for k, v in sorted(mean.items()) if k.startswith("stage:")}}
    return out
