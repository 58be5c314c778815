"""Prometheus text exposition: parse, diff two scrapes, and read the DDTREE series out of a diff.

The DDTREE worker's series are read by the names the server registers them under (sglang_ddtree/metric_names.py,
all labelled with `budget`): per batch round the stage times (STAGE_SECONDS: stage_ms), the host's time in the
worker's round call (ROUND_HOST_SECONDS: host_ms) and per stage (STAGE_HOST_SECONDS over STAGE_HOST_ROUNDS:
host_stage_ms); per request-round the counters ROUNDS, ACCEPTED_TOKENS (tau), DEPTH_REACHED (accept_rate_by_depth),
BRANCH_ACCEPTED (branch_accept_rate), EXPECTED_TOKENS (expected_accept_length: the drafter's own expectation) and
TREE_NODES (tree_nodes_mean); `auto`'s AUTO_ROUNDS and calibration errors; SGLANG_DDTREE_AUTO_AB's per-arm AB
counters.
A workload's share is the difference of two scrapes (before / after). The worker folds a round's numbers in a
round or two later (no host sync), so the last one or two rounds of a workload can land in the next scrape:
means (per-round stage times, per-depth rates) are unaffected, totals can be short by that much.
"""

from __future__ import annotations

import math
import re
from sglang_ddtree import metric_names as mn
from sglang_ddtree.stages import AUTO_HOST_DETAIL, HOST_STAGES, SERVER_STAGES as STAGES

Sample = tuple[str, tuple[tuple[str, str], ...]]

_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?\s*$")
_LABEL = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


def _unescape(value: str) -> str:
    return value.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")


def _float(text: str) -> float:
    lowered = text.lower()
    if lowered in ("+inf", "inf"):
        return math.inf
    if lowered == "-inf":
        return -math.inf
    return float(text)  # also "NaN"


def parse(text: str) -> dict[Sample, float]:
    """{(sample name, sorted label pairs): value}. Comment and blank lines are skipped; a malformed line raises."""
    out: dict[Sample, float] = {}
    for n, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None:
            raise ValueError(f"metrics line {n} is not in the Prometheus text format: {line[:200]!r}")
        labels = []
        body = m.group(3) or ""
        pos = 0
        while pos < len(body):
            lm = _LABEL.match(body, pos)
            if lm is None:
                raise ValueError(f"metrics line {n} has malformed labels: {line[:200]!r}")
            labels.append((lm.group(1), _unescape(lm.group(2))))
            pos = lm.end()
        out[(m.group(1), tuple(sorted(labels)))] = _float(m.group(4))
    return out


def diff(after: dict[Sample, float], before: dict[Sample, float]) -> dict[Sample, float]:
    """after - before for every sample of `after` (a sample absent before counts from 0)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def _select(delta: dict[Sample, float], names: tuple[str, ...], **labels) -> list[tuple[dict, float]]:
    hits = []
    for (name, pairs), value in delta.items():
        if name not in names:
            continue
        d = dict(pairs)
        if all(d.get(k) == v for k, v in labels.items()):
            hits.append((d, value))
    return hits


def _total(delta, sample: str, **labels) -> float:
    return sum(v for _, v in _select(delta, (sample,), **labels))


def auto_rounds(delta: dict[Sample, float]) -> dict[str, int]:
    """`auto` servers: batch rounds per candidate budget in one workload's scrape difference (every batch bucket)."""
    out: dict[str, int] = {}
    for d, value in _select(delta, (mn.AUTO_ROUNDS.name,)):
        if "candidate" in d and value > 0:
            out[d["candidate"]] = out.get(d["candidate"], 0) + int(round(value))
    return out


def auto_rounds_by_batch(delta: dict[Sample, float]) -> dict[str, dict[str, int]]:
    """`auto` servers: {batch-size bucket: {candidate: batch rounds}} in one workload's scrape difference (a row at
    batch 16 passes through smaller buckets as its requests finish); {} from a server without the `batch` label."""
    out: dict[str, dict[str, int]] = {}
    for d, value in _select(delta, (mn.AUTO_ROUNDS.name,)):
        if "candidate" in d and "batch" in d and value > 0:
            cell = out.setdefault(d["batch"], {})
            cell[d["candidate"]] = cell.get(d["candidate"], 0) + int(round(value))
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def auto_calibration(delta: dict[Sample, float]) -> dict | None:
    """`auto` servers: the calibration table's prediction errors in one workload's scrape difference (request-rounds
    scored, and the mean absolute error per request-round of the raw, the calibrated and, where exported, the gated
    predicted committed tokens); None when no round was scored."""
    scored = _total(delta, mn.AUTO_TAU_SCORED.name)
    if scored <= 0:
        return None
    out = {"scored_request_rounds": int(round(scored)),
           **{f"tau_mae_{scores}": _total(delta, mn.AUTO_TAU_ABS_ERROR.name, scores=scores) / scored
              for scores in ("raw", "calibrated")}}
    # the gated predictor (auto.AutoConfig.calibration_gate), from servers that export it (newer ones)
    gated = _select(delta, (mn.AUTO_TAU_ABS_ERROR.name,), scores="gated")
    if gated:
        out["tau_mae_gated"] = sum(v for _, v in gated) / scored
    return out


AB_ARMS = ("auto", "fixed")


def ab_arms(delta: dict[Sample, float]) -> dict | None:
    """SGLANG_DDTREE_AUTO_AB servers: each arm's tallies in one scrape difference (stats.ABTallies) -> {arm: {rounds,
    request_rounds, tokens, seconds, skipped_rounds, tokens_per_s, tau, round_ms, host_ms, host_stage_ms}, "ratio":
    auto's tokens/s over fixed's}; None when neither arm has a round that counts."""
    out: dict = {}
    for arm in AB_ARMS:
        sums = {field: _total(delta, mn.AB[field].name, arm=arm)
                for field in ("rounds", "request_rounds", "tokens", "seconds", "skipped_rounds", "host_rounds",
                              "host_seconds")}
        if sums["rounds"] <= 0 or sums["seconds"] <= 0:
            continue
        arm_out = {"rounds": int(round(sums["rounds"])), "request_rounds": int(round(sums["request_rounds"])),
                   "tokens": int(round(sums["tokens"])), "seconds": sums["seconds"],
                   "skipped_rounds": int(round(sums["skipped_rounds"])),
                   "tokens_per_s": sums["tokens"] / sums["seconds"],
                   "tau": sums["tokens"] / sums["request_rounds"] if sums["request_rounds"] > 0 else None,
                   "round_ms": 1e3 * sums["seconds"] / sums["rounds"]}
        arm_out.update(_ab_split(delta, arm, sums))
        if sums["host_rounds"] > 0:
            arm_out["host_ms"] = 1e3 * sums["host_seconds"] / sums["host_rounds"]
            arm_out["host_stage_ms"] = {
                stage: 1e3 * _total(delta, mn.AB_HOST_STAGE_SECONDS.name, arm=arm, stage=stage)
                / sums["host_rounds"]
                for stage in HOST_STAGES + AUTO_HOST_DETAIL
                if _select(delta, (mn.AB_HOST_STAGE_SECONDS.name,), arm=arm, stage=stage)}
        out[arm] = arm_out
    if not out:
        return None
    if all(arm in out for arm in AB_ARMS):
        out["ratio"] = out["auto"]["tokens_per_s"] / out["fixed"]["tokens_per_s"]
    return out


def _ab_split(delta: dict[Sample, float], arm: str, sums: dict[str, float]) -> dict:
    """An arm's rounds split (stats.ABTallies, from servers that tally it): sampled_rounds and their GPU ms a round;
    narrower_rounds (a candidate other than the widest tree) with their tau and ms a round; widest_tokens_per_s and
    widest_tau over the other rounds (the widest tree's: for `auto`, its own cost at the fixed arm's choice). {} when
    the arm has neither (the fixed arm; a server before these series)."""
    split = {field: _total(delta, mn.AB[field].name, arm=arm)
             for field in ("sampled_rounds", "sampled_seconds", "narrower_rounds", "narrower_seconds",
                           "narrower_tokens", "narrower_request_rounds")}
    if split["sampled_rounds"] <= 0 and split["narrower_rounds"] <= 0:
        return {}
    out = {"sampled_rounds": int(round(split["sampled_rounds"])),
           "sampled_round_ms": 1e3 * split["sampled_seconds"] / split["sampled_rounds"]
           if split["sampled_rounds"] > 0 else None,
           "narrower_rounds": int(round(split["narrower_rounds"])),
           "narrower_tau": split["narrower_tokens"] / split["narrower_request_rounds"]
           if split["narrower_request_rounds"] > 0 else None,
           "narrower_round_ms": 1e3 * split["narrower_seconds"] / split["narrower_rounds"]
           if split["narrower_rounds"] > 0 else None}
    seconds = sums["seconds"] - split["narrower_seconds"]
    request_rounds = sums["request_rounds"] - split["narrower_request_rounds"]
    tokens = sums["tokens"] - split["narrower_tokens"]
    if seconds > 0 and request_rounds > 0:
        out.update(widest_tokens_per_s=tokens / seconds, widest_tau=tokens / request_rounds)
    return out


def ddtree_summary(delta: dict[Sample, float], budget: int | str | None = None) -> dict | None:
    """What one workload's scrape difference says about DDTREE rounds; None when there are no DDTREE series."""
    labels = {mn.BUDGET: str(budget)} if budget is not None else {}
    stage_ms, stage_rounds = {}, {}
    for stage in STAGES:
        total = _total(delta, mn.STAGE_SECONDS.sum, stage=stage, **labels)
        count = _total(delta, mn.STAGE_SECONDS.count, stage=stage, **labels)
        if count > 0:
            stage_ms[stage] = 1e3 * total / count
            stage_rounds[stage] = int(round(count))
    rounds = _total(delta, mn.ROUNDS.name, **labels)
    host_rounds = _total(delta, mn.STAGE_HOST_ROUNDS.name, **labels)
    if not stage_ms and rounds <= 0 and host_rounds <= 0:
        return None
    out: dict = {"stage_ms": stage_ms, "stage_ms_sum": sum(stage_ms.values()) if stage_ms else None,
                 "batch_rounds": max(stage_rounds.values()) if stage_rounds else 0, "request_rounds": int(rounds)}
    host_count = _total(delta, mn.ROUND_HOST_SECONDS.count, **labels)
    if host_count > 0:
        out["host_ms"] = 1e3 * _total(delta, mn.ROUND_HOST_SECONDS.sum, **labels) / host_count
    if host_rounds > 0:
        out["host_stage_ms"] = {stage: 1e3 * _total(delta, mn.STAGE_HOST_SECONDS.name, stage=stage, **labels)
                                / host_rounds
                                for stage in HOST_STAGES + AUTO_HOST_DETAIL
                                if _select(delta, (mn.STAGE_HOST_SECONDS.name,), stage=stage, **labels)}
    if rounds > 0:
        accepted = _total(delta, mn.ACCEPTED_TOKENS.name, **labels)
        out["tau"] = accepted / rounds
        depth = {}
        for d, value in _select(delta, (mn.DEPTH_REACHED.name,), **labels):
            if "depth" in d:
                depth[int(d["depth"])] = depth.get(int(d["depth"]), 0.0) + value
        out["accept_rate_by_depth"] = [depth.get(k, 0.0) / rounds for k in range(1, max(depth, default=0) + 1)]
        drafted = accepted - rounds  # accepted draft tokens (the bonus excluded)
        branch = _total(delta, mn.BRANCH_ACCEPTED.name, **labels)
        out["branch_accept_rate"] = branch / drafted if drafted > 0 else None
        # the drafter's expected committed tokens and the draft nodes verified, per request-round; None where the
        # scrape has no such series (never a 0 that reads as a measurement)
        out["expected_accept_length"] = _per_round(delta, mn.EXPECTED_TOKENS.name, rounds, labels)
        out["tree_nodes_mean"] = _per_round(delta, mn.TREE_NODES.name, rounds, labels)
    return out


def _per_round(delta: dict[Sample, float], sample: str, rounds: float, labels: dict) -> float | None:
    if not _select(delta, (sample,), **labels):
        return None
    return _total(delta, sample, **labels) / rounds
