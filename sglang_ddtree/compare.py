"""Correctness comparator: a candidate baseline file against a reference one.

Per method, over the prompts both files have:
  * exact output match rate and, per mismatching prompt, the first divergence position;
  * at a divergence, the target's top-1/top-2 logit margin there (both files record one per output token).
    Both runs saw the same prefix, so a genuine float tie shows a tiny margin; a large margin means the target was
    sure of its token and the other run disagreed anyway: a bug. The larger of the recorded margins is compared
    with `noise_margin` (a bug unless every recorded margin is below it). Sampled runs (T > 0) are not expected to
    match token for token; their divergences are reported as 'sampled' and never fail by themselves: instead the
    candidate's acceptance per depth and per-position token frequencies are tested against the baseline's
    (compare_sampled: a permutation test over prompts; its false-alarm rate over the whole comparison is at most
    `sampled_alpha`);
  * tau (mean tokens per round) per method, the difference and a 95% confidence interval from a paired bootstrap
    over prompts (see `paired_bootstrap_tau`). A speculative method fails when the whole interval lies below
    -max_tau_drop (default 0: any drop the interval confirms); at T > 0 the acceptance test judges tau instead,
    unless max_tau_drop is given;
  * acceptance-length histograms, per-depth acceptance and branch acceptance side by side (metrics.aggregate);
  * for files with tree dumps, the first round whose tree differs (only rounds whose root lies before the first
    output divergence, so both trees hang from the same context), what differs (tokens, parents, scores) and
    whether the difference is a near-tie at the budget cut (noise) or not (bug).
The verdict fails on: any bug divergence, a bug tree difference, a round whose accept length differs although both
trees are identical (T = 0), prompt mismatches, a tau drop confirmed by its interval, a significant difference of
the sampled distributions (T > 0) and the optional --min-match-rate threshold.

Prompts are paired by the sha256 of their token ids when both files record it for every record of a method (so a
reference file whose prompts are called "0", "1", ... pairs with ours called "HumanEval/0", ...), else by name.

Which differences are noise depends on what is compared (`choose_rule`; the report names the rule):
  * `exact`: both files come from exact decoders (our offline decoders, the paper's reference decoder) in the same
    known dtype: the target's choices are the same computation on both sides, so EVERY difference is a bug: an
    output divergence, a round's accept length, a round's tree (its hash; node order is ignored), a tree score or a
    recorded margin beyond `exact_tol` (float reassociation between machines stays far below it);
  * `float32-tie`: one side ran in float32 and recorded margins, the other in another dtype (a bf16 server): a first
    divergence is a tie only where the float32 model's own top-1 minus top-2 log-prob gap there is below
    `noise_margin`; anything else is a bug; trees are judged by `compare_trees` when both files dumped them;
  * `margin`: neither side is float32 (or a dtype is unknown): the larger recorded margin decides, as above.
A divergence that cannot be judged (no margin where one is needed) is `unknown`, which fails a greedy comparison:
nothing is called noise without evidence.

The report as text (what `sglang-ddtree compare` prints): compare_report.format_report.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from sglang_ddtree.baseline import (
    REFERENCE_EXTRA_ROUND_KEY, Baseline, BaselineHeader, MethodRecord, comparability_warnings, method_sort_key,
    parse_method, round_tree_hashes, validate_tree_dump,
)
from sglang_ddtree.compare_sampled import sampled_tests
from sglang_ddtree.metrics import RoundRecord, aggregate

MAX_LISTED = 10  # divergences / tree differences listed per method (all are counted)


RULES = ("auto", "exact", "float32-tie", "margin")
EXACT_SOURCES = ("offline", "import:ddtree-reference")  # decoders whose T=0 output is the target's own computation


@dataclass
class Thresholds:
    min_match_rate: float | None = None  # fail when the exact-match rate is below
    # tolerated tau drop (speculative methods): fail when the 95% interval of tau(candidate) - tau(baseline) lies
    # entirely below -max_tau_drop; None: 0 for greedy runs, and at T > 0 the acceptance test judges tau instead
    max_tau_drop: float | None = None
    noise_margin: float = 0.25  # top-2 log-prob gap below which a first divergence may be a tie (tie rules only)
    score_tol: float = 0.05  # log-prob tolerance for tree scores (near-tie at the budget cut, score drift)
    check_trees: bool = True
    rule: str = "auto"  # auto | exact | float32-tie | margin (see the module docstring)
    exact_tol: float = 1e-3  # exact rule: largest |difference| of a recorded margin or tree score that is not a bug
    sampled_alpha: float = 0.01  # T > 0: false-alarm rate of the distribution tests over the whole comparison (0: off)

    def validate(self) -> None:
        if self.min_match_rate is not None and not 0 <= self.min_match_rate <= 1:
            raise ValueError(f"min_match_rate must be in [0, 1], got {self.min_match_rate}.")
        if self.max_tau_drop is not None and not self.max_tau_drop >= 0:
            raise ValueError(f"max_tau_drop must be >= 0, got {self.max_tau_drop}.")
        if self.noise_margin < 0 or self.score_tol < 0 or self.exact_tol < 0:
            raise ValueError("noise_margin, score_tol and exact_tol must be >= 0.")
        if not 0 <= self.sampled_alpha < 1:
            raise ValueError(f"sampled_alpha must be in [0, 1), got {self.sampled_alpha}.")
        if self.rule not in RULES:
            raise ValueError(f"rule must be one of {', '.join(RULES)}, got {self.rule!r}.")


def _is_exact_source(h: BaselineHeader) -> bool:
    return h.source in EXACT_SOURCES or h.source.startswith("offline")


def choose_rule(base: BaselineHeader, cand: BaselineHeader, requested: str = "auto") -> dict[str, Any]:
    """{"name": exact | float32-tie | margin, "float32_side": baseline | candidate | None, "why": one sentence}."""
    da, db = base.dtype, cand.dtype
    f32 = "baseline" if da == "float32" else ("candidate" if db == "float32" else None)
    if requested != "auto":
        if requested == "float32-tie" and f32 is None:
            raise ValueError("rule float32-tie needs one file made in float32 (its header's dtype); neither is.")
        return {"name": requested, "float32_side": f32 if requested == "float32-tie" else None,
                "why": f"asked for ({requested})"}
    if da and db and da == db and _is_exact_source(base) and _is_exact_source(cand):
        return {"name": "exact", "float32_side": None,
                "why": f"both files come from exact decoders ({base.source}, {cand.source}) in {da}: every difference "
                       "is a bug"}
    if f32 is not None and da != db:
        other = db if f32 == "baseline" else da
        return {"name": "float32-tie", "float32_side": f32,
                "why": f"the {f32} ran in float32 and the other in {other or 'an unknown dtype'}: a first difference "
                       f"is a tie only where the float32 model's own top-2 gap is below the threshold"}
    return {"name": "margin", "float32_side": None,
            "why": f"dtypes {da or 'unknown'} / {db or 'unknown'} (sources {base.source}, {cand.source}): no exact "
                   "pair and no float32 side without doubt; the larger recorded top-2 gap decides"}


# ----------------------------------------------------------------------------------------------------------
# tau and its confidence interval


def _tau(tokens: np.ndarray, rounds: np.ndarray) -> float:
    r = rounds.sum()
    return float(tokens.sum() / r) if r > 0 else float("nan")


def paired_bootstrap_tau(base: list[MethodRecord], cand: list[MethodRecord], *, n_boot: int = 2000,
                         seed: int = 0) -> dict[str, Any]:
    """tau of both files on the same prompts and a 95% CI of the difference (candidate - baseline).

    tau is pooled over rounds (sum of tokens / number of rounds), the paper's definition. Rounds of one prompt are
    correlated (same text, same difficulty), so the independent units are prompts: each bootstrap resample draws
    prompts with replacement and recomputes both pooled taus on the SAME prompts (paired), which cancels the large
    between-prompt variance out of the difference. Percentile interval, seeded, so reports are reproducible.
    """
    bt = np.array([sum(r.accept_lengths) for r in base], dtype=np.float64)
    br = np.array([len(r.accept_lengths) for r in base], dtype=np.float64)
    ct = np.array([sum(r.accept_lengths) for r in cand], dtype=np.float64)
    cr = np.array([len(r.accept_lengths) for r in cand], dtype=np.float64)
    out: dict[str, Any] = {"baseline": _tau(bt, br), "candidate": _tau(ct, cr), "prompts": len(base),
                           "ci_method": f"paired bootstrap over prompts, {n_boot} resamples, seed {seed}, percentile"}
    out["diff"] = out["candidate"] - out["baseline"]
    n = len(base)
    if n < 2 or br.sum() == 0 or cr.sum() == 0:
        out["diff_ci95"] = out["baseline_ci95"] = out["candidate_ci95"] = None
        return out
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(n_boot, n))
    with np.errstate(invalid="ignore", divide="ignore"):
        tb = bt[idx].sum(1) / br[idx].sum(1)
        tc = ct[idx].sum(1) / cr[idx].sum(1)
    d = tc - tb

    def ci(x):
        x = x[np.isfinite(x)]
        return [float(np.percentile(x, 2.5)), float(np.percentile(x, 97.5))] if x.size else None

    out["diff_ci95"], out["baseline_ci95"], out["candidate_ci95"] = ci(d), ci(tb), ci(tc)
    return out


# ----------------------------------------------------------------------------------------------------------
# per-record statistics


def round_records(rec: MethodRecord) -> list[RoundRecord]:
    """metrics.RoundRecord per round (branch flags False when the file has no ranks; see `has_ranks`)."""
    out = []
    for r, a in enumerate(rec.accept_lengths):
        ranks = rec.accepted_ranks[r] if rec.accepted_ranks is not None else [0] * (a - 1)
        out.append(RoundRecord(
            accept_len=a, branch_taken=[x != 0 for x in ranks],
            tree_size=rec.tree_sizes[r] if rec.tree_sizes is not None else 0,
            max_depth=a - 1, expected_accept=rec.expected_accepts[r] if rec.expected_accepts is not None else 0.0,
            budget=rec.budget,
        ))
    return out


def method_stats(records: list[MethodRecord]) -> dict[str, Any]:
    rounds = [rr for rec in records for rr in round_records(rec)]
    if not rounds:
        return {"rounds": 0}
    s = aggregate(rounds)
    keep = ("rounds", "tokens", "tau", "accept_len_hist", "accept_rate_by_depth", "conditional_accept_by_depth",
            "branch_accept_rate", "branch_rate_by_depth", "mean_tree_size")
    out = {k: s[k] for k in keep if k in s}
    if not all(rec.accepted_ranks is not None for rec in records):
        out["branch_accept_rate"] = None
        out["branch_rate_by_depth"] = None
    if not all(rec.tree_sizes is not None for rec in records):
        out["mean_tree_size"] = None
    return out


# ----------------------------------------------------------------------------------------------------------
# output divergence


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _margin_at(rec: MethodRecord, pos: int) -> float | None:
    if rec.margins is None or pos >= len(rec.margins):
        return None
    m = rec.margins[pos]
    return None if m is None or (isinstance(m, float) and math.isnan(m)) else float(m)


def classify_divergence(base: MethodRecord, cand: MethodRecord, pos: int, sampled: bool,
                        noise_margin: float, rule: dict[str, Any] | None = None) -> dict[str, Any]:
    bt = base.output_ids[pos] if pos < len(base.output_ids) else None
    ct = cand.output_ids[pos] if pos < len(cand.output_ids) else None
    info: dict[str, Any] = {
        "prompt_id": base.prompt_id, "position": pos, "baseline_token": bt, "candidate_token": ct,
        "baseline_margin": _margin_at(base, pos), "candidate_margin": _margin_at(cand, pos),
        "baseline_round": base.round_of_position(pos), "candidate_round": cand.round_of_position(pos),
    }
    if bt is None or ct is None:
        shorter = base if bt is None else cand
        # One output stops where the other goes on: fine if it stopped on its length limit (prefix agreement).
        info["class"] = "truncation" if shorter.finish_reason == "length" else ("sampled" if sampled else "bug")
        info["reason"] = f"{'baseline' if bt is None else 'candidate'} output ends here ({shorter.finish_reason})"
        return info
    if sampled:
        info["class"] = "sampled"
        info["reason"] = "sampled run: token-level agreement is not expected"
        return info
    name = (rule or {}).get("name", "margin")
    if name == "exact":
        info["class"] = "bug"
        info["reason"] = "exact decoders in the same dtype on both sides: every difference is a bug"
        return info
    if name == "float32-tie":
        side = rule["float32_side"]
        m = info[f"{side}_margin"]
        if m is None:
            info["class"] = "unknown"
            info["reason"] = f"the float32 {side} recorded no top-2 gap here: cannot tell a tie from a bug"
        elif m < noise_margin:
            info["class"] = "noise"
            info["reason"] = f"float32 top-2 gap {m:.3g} < {noise_margin}: a tie"
        else:
            info["class"] = "bug"
            info["reason"] = f"float32 top-2 gap {m:.3g} >= {noise_margin}: the float32 model was sure"
        return info
    margins = [m for m in (info["baseline_margin"], info["candidate_margin"]) if m is not None]
    if not margins:
        info["class"] = "unknown"
        info["reason"] = "no margins recorded: cannot tell a near-tie from a bug"
    elif max(margins) < noise_margin:
        info["class"] = "noise"
        info["reason"] = f"top-2 margin {max(margins):.3g} < {noise_margin}: a near-tie"
    else:
        info["class"] = "bug"
        info["reason"] = f"top-2 margin {max(margins):.3g} >= {noise_margin}: the target was sure"
    return info


# ----------------------------------------------------------------------------------------------------------
# tree comparison


def _paths(tree: dict[str, list]) -> dict[tuple[int, ...], float | None]:
    """token path (root excluded) -> score, for every draft node; raises on duplicate siblings."""
    tokens, parents = tree["tokens"], tree["parents"]
    scores = tree.get("scores")
    paths: list[tuple[int, ...]] = [()]
    out: dict[tuple[int, ...], float | None] = {}
    for i in range(1, len(tokens)):
        p = paths[parents[i]] + (tokens[i],)
        if p in out:
            raise ValueError(f"node {i} repeats its sibling's token {tokens[i]} under parent {parents[i]}")
        paths.append(p)
        out[p] = None if scores is None or scores[i] is None else float(scores[i])
    return out


def compare_trees(base: dict[str, list], cand: dict[str, list], score_tol: float) -> dict[str, Any] | None:
    """None when equal (tokens, parents, scores within tol); else what differs first and a noise/bug class."""
    first = None
    for i in range(max(len(base["tokens"]), len(cand["tokens"]))):
        fields = []
        for name in ("tokens", "parents", "scores"):
            a = base.get(name)[i] if base.get(name) is not None and i < len(base[name]) else None
            b = cand.get(name)[i] if cand.get(name) is not None and i < len(cand[name]) else None
            if name == "scores":
                if a is not None and b is not None and abs(a - b) > score_tol:
                    fields.append(name)
            elif a != b:
                fields.append(name)
        if fields:
            def node(t):
                return {k: (t[k][i] if t.get(k) is not None and i < len(t[k]) else None)
                        for k in ("tokens", "parents", "scores")}
            first = {"node": i, "fields": fields, "baseline": node(base), "candidate": node(cand)}
            break
    if first is None:
        return None

    def verdict(cls, reason):
        return {**first, "class": cls, "reason": reason}

    try:
        validate_tree_dump(cand, "candidate tree")
        cp = _paths(cand)
    except ValueError as e:
        return verdict("bug", f"candidate tree is malformed: {e}")
    try:
        bp = _paths(base)
    except ValueError as e:
        return verdict("bug", f"baseline tree is malformed: {e}")
    if base["tokens"][0] != cand["tokens"][0]:
        return verdict("bug", "root tokens differ although the context is the same")
    if len(bp) != len(cp):
        return verdict("bug", f"tree sizes differ ({len(bp)} vs {len(cp)} draft nodes)")
    have_scores = all(v is not None for v in bp.values()) and all(v is not None for v in cp.values())
    only_b = [p for p in bp if p not in cp]
    only_c = [p for p in cp if p not in bp]
    if not have_scores:
        if only_b or only_c:
            return verdict("unknown", f"{len(only_c)} node(s) differ and the trees have no scores to judge them")
        return verdict("unknown", "same nodes in a different order; no scores to judge it")
    for p in bp.keys() & cp.keys():
        if abs(bp[p] - cp[p]) > score_tol:
            return verdict("bug", f"node {list(p)} has score {bp[p]:.4g} vs {cp[p]:.4g}")
    cut_b = min(bp.values()) if bp else 0.0
    cut_c = min(cp.values()) if cp else 0.0
    for p in only_c:
        if cp[p] > cut_b + score_tol:
            return verdict("bug", f"candidate node {list(p)} (score {cp[p]:.4g}) is missing from the baseline "
                                  f"although it beats the baseline's cut {cut_b:.4g}")
    for p in only_b:
        if bp[p] > cut_c + score_tol:
            return verdict("bug", f"baseline node {list(p)} (score {bp[p]:.4g}) is missing from the candidate "
                                  f"although it beats the candidate's cut {cut_c:.4g}")
    if only_b or only_c:
        return verdict("noise", f"{len(only_c)} node(s) swapped at the budget cut (scores within {score_tol})")
    a, b = first["baseline"]["scores"], first["candidate"]["scores"]
    if a is not None and b is not None and abs(a - b) <= score_tol:
        return verdict("noise", "same nodes; order differs only between near-equal scores")
    return verdict("bug", "same nodes in a different order although the scores are not tied")


# ----------------------------------------------------------------------------------------------------------
# the comparison


def _prompt_mismatch(b: MethodRecord, c: MethodRecord) -> str | None:
    if b.prompt_sha256 and c.prompt_sha256 and b.prompt_sha256 != c.prompt_sha256:
        return "prompt token hashes differ"
    if b.num_input_tokens is not None and c.num_input_tokens is not None and b.num_input_tokens != c.num_input_tokens:
        return f"prompt lengths differ ({b.num_input_tokens} vs {c.num_input_tokens})"
    return None


def pair_records(base: Baseline, cand: Baseline, method: str) -> dict[str, Any]:
    """Pairs (baseline record, candidate record) of one method, in baseline order.

    By the prompts' token hashes when every record of the method in both files has one (names may differ: the
    reference names prompts by index), else by prompt id. Returns pairs, the unpaired prompt ids of each side and
    `matched_by`."""
    brecs = [r for r in base.records if r.method == method]
    crecs = [r for r in cand.records if r.method == method]
    if brecs and crecs and all(r.prompt_sha256 for r in brecs) and all(r.prompt_sha256 for r in crecs):
        pool: dict[str, list[MethodRecord]] = {}
        for c in crecs:
            pool.setdefault(c.prompt_sha256, []).append(c)
        pairs, missing_c = [], []
        for b in brecs:
            lst = pool.get(b.prompt_sha256)
            if lst:
                pairs.append((b, lst.pop(0)))
            else:
                missing_c.append(b.prompt_id)
        used = {id(c) for _, c in pairs}
        missing_b = [c.prompt_id for c in crecs if id(c) not in used]
        return {"pairs": pairs, "missing_in_candidate": missing_c, "missing_in_baseline": missing_b,
                "matched_by": "prompt token hash"}
    cand_by_id = {r.prompt_id: r for r in crecs}
    base_ids = {r.prompt_id for r in brecs}
    return {"pairs": [(b, cand_by_id[b.prompt_id]) for b in brecs if b.prompt_id in cand_by_id],
            "missing_in_candidate": [b.prompt_id for b in brecs if b.prompt_id not in cand_by_id],
            "missing_in_baseline": [c.prompt_id for c in crecs if c.prompt_id not in base_ids],
            "matched_by": "prompt id"}


def _pid(b: MethodRecord, c: MethodRecord) -> str:
    return b.prompt_id if b.prompt_id == c.prompt_id else f"{b.prompt_id} (candidate: {c.prompt_id})"


def _margin_drift(b: MethodRecord, c: MethodRecord, limit: int, tol: float) -> dict[str, Any] | None:
    """First output position below `limit` whose recorded margins differ by more than `tol` (exact rule)."""
    if b.margins is None or c.margins is None:
        return None
    for i in range(min(limit, len(b.margins), len(c.margins))):
        x, y = b.margins[i], c.margins[i]
        if x is None or y is None or not (math.isfinite(x) and math.isfinite(y)):
            continue
        if abs(x - y) > tol:
            return {"position": i, "baseline_margin": x, "candidate_margin": y,
                    "baseline_round": b.round_of_position(i), "candidate_round": c.round_of_position(i)}
    return None


def _score_drift(base: dict[str, list], cand: dict[str, list], tol: float) -> dict[str, Any] | None:
    """Two trees with the same nodes: the first node (candidate order) whose score differs by more than tol."""
    try:
        bp, cp = _paths(base), _paths(cand)
    except ValueError as e:
        return {"node": None, "fields": ["parents"], "baseline": None, "candidate": None, "class": "bug",
                "reason": f"malformed tree: {e}"}
    for i, (p, sc) in enumerate(cp.items(), start=1):
        sb = bp.get(p)
        if sb is not None and sc is not None and abs(sb - sc) > tol:
            return {"node": i, "fields": ["scores"], "baseline": {"scores": sb}, "candidate": {"scores": sc},
                    "class": "bug", "reason": f"node {list(p)} has score {sb:.6g} vs {sc:.6g}"}
    return None


def compare_method(base: Baseline, cand: Baseline, method: str, th: Thresholds, *, sampled: bool,
                   n_boot: int, seed: int, rule: dict[str, Any] | None = None,
                   sampled_alpha: float | None = None) -> dict[str, Any]:
    """One method's comparison; `sampled_alpha`: level of each of its T > 0 distribution tests (None: none run)."""
    rule = rule or choose_rule(base.header, cand.header, th.rule)
    exact = rule["name"] == "exact" and not sampled
    paired = pair_records(base, cand, method)
    res: dict[str, Any] = {
        "method": method, "prompts": len(paired["pairs"]), "matched_by": paired["matched_by"],
        "missing_in_candidate": paired["missing_in_candidate"],
        "missing_in_baseline": paired["missing_in_baseline"],
        "failures": [],
    }
    pairs, n_exact, divergences, prompt_mismatches = [], 0, [], []
    tree_rounds, tree_diffs, accept_diffs, drifts = 0, [], [], []
    first_bugs: list[dict[str, Any]] = []  # per pair, its earliest bug-class event
    if paired["matched_by"] == "prompt id":
        for b, c in paired["pairs"]:
            bad = _prompt_mismatch(b, c)
            if bad:
                prompt_mismatches.append({"prompt_id": b.prompt_id, "reason": bad})
            else:
                pairs.append((b, c))
    else:
        pairs = list(paired["pairs"])
        cand_ids = {c.prompt_id for c in cand.records if c.method == method}
        for pid in paired["missing_in_candidate"]:
            if pid in cand_ids:  # same name, other tokens
                prompt_mismatches.append({"prompt_id": pid, "reason": "prompt token hashes differ"})
    for b, c in pairs:
        pid = _pid(b, c)
        events: list[dict[str, Any]] = []
        pos = first_divergence(b.output_ids, c.output_ids)
        if pos is None:
            n_exact += 1
            limit = len(b.output_ids)
        else:
            d = classify_divergence(b, c, pos, sampled, th.noise_margin, rule)
            d["prompt_id"] = pid
            if d["class"] == "truncation":
                n_exact += 1
            divergences.append(d)
            limit = pos
            if d["class"] in ("bug", "unknown"):
                events.append({"round": d["candidate_round"], "what": f"output diverges at position {pos}: "
                                                                      f"{d['reason']}"})
        if exact:
            dr = _margin_drift(b, c, limit, th.exact_tol)
            if dr is not None:
                dr["prompt_id"] = pid
                drifts.append(dr)
                events.append({"round": dr["candidate_round"],
                               "what": f"the target's top-2 gap at position {dr['position']} differs "
                                       f"({dr['baseline_margin']:.5g} vs {dr['candidate_margin']:.5g})"})
        # Rounds hanging from the same context: root position < first divergence (or everything on a match).
        b_roots = {r: i for i, r in enumerate(b.round_root_positions())}
        bh, ch = round_tree_hashes(b), round_tree_hashes(c)
        for ci, root in enumerate(c.round_root_positions()):
            bi = b_roots.get(root)
            if root >= limit or bi is None:
                continue
            same_tree = None  # unknown
            if th.check_trees and bh is not None and ch is not None and bh[bi] is not None and ch[ci] is not None:
                tree_rounds += 1
                have_full = (b.trees is not None and c.trees is not None and b.trees[bi] is not None
                             and c.trees[ci] is not None)
                diff = None
                if have_full:
                    diff = compare_trees(b.trees[bi], c.trees[ci], th.exact_tol if exact else th.score_tol)
                    if (diff is not None and exact and bh[bi] == ch[ci]
                            and _score_drift(b.trees[bi], c.trees[ci], th.exact_tol) is None):
                        diff = None  # the same nodes with the same scores in another order: the same tree
                elif bh[bi] != ch[ci]:
                    diff = {"node": None, "fields": ["nodes"], "baseline": None, "candidate": None,
                            "class": "unknown", "reason": "the trees' hashes differ (no dumped trees to say where)"}
                if diff is None:
                    same_tree = True
                else:
                    same_tree = False
                    if exact:
                        diff = {**diff, "class": "bug",
                                "reason": f"exact decoders on the same context built different trees: {diff['reason']}"}
                    tree_diffs.append({"prompt_id": pid, "round": ci, "baseline_round": bi, "root_position": root,
                                       **diff})
                    if diff["class"] == "bug":
                        events.append({"round": ci, "what": f"tree differs ({diff['reason']})"})
            if b.accept_lengths[bi] != c.accept_lengths[ci]:
                accept_diffs.append({
                    "prompt_id": pid, "round": ci, "baseline_round": bi, "root_position": root,
                    "baseline_accept_len": b.accept_lengths[bi], "candidate_accept_len": c.accept_lengths[ci],
                    "trees_identical": bool(same_tree),
                })
                if exact or (same_tree and not sampled):
                    events.append({"round": ci, "what": f"accept length {c.accept_lengths[ci]} vs baseline "
                                                        f"{b.accept_lengths[bi]}"
                                                        + (" on identical trees" if same_tree else "")})
        if events:
            first = min(events, key=lambda e: (math.inf if e["round"] is None else e["round"]))
            first_bugs.append({"prompt_id": pid, **first})

    n = len(pairs)
    res["exact_match"] = n_exact
    res["match_rate"] = n_exact / n if n else None
    res["prompt_mismatches"] = prompt_mismatches
    counts: dict[str, int] = {}
    for d in divergences:
        counts[d["class"]] = counts.get(d["class"], 0) + 1
    res["divergence_counts"] = counts
    res["divergences"] = divergences[:MAX_LISTED]
    res["tree_rounds_compared"] = tree_rounds
    tree_counts: dict[str, int] = {}
    for t in tree_diffs:
        tree_counts[t["class"]] = tree_counts.get(t["class"], 0) + 1
    res["tree_difference_counts"] = tree_counts
    res["first_tree_difference"] = tree_diffs[0] if tree_diffs else None
    res["tree_differences"] = tree_diffs[:MAX_LISTED]
    res["accept_len_differences"] = accept_diffs[:MAX_LISTED]
    res["accept_len_difference_count"] = len(accept_diffs)
    res["margin_drifts"] = drifts[:MAX_LISTED]
    res["margin_drift_count"] = len(drifts)
    res["first_bug"] = first_bugs[0] if first_bugs else None
    res["prompts_with_bugs"] = len(first_bugs)
    res["reference_extra_final_rounds"] = {
        "baseline": sum(1 for b, _ in pairs if REFERENCE_EXTRA_ROUND_KEY in b.extra),
        "candidate": sum(1 for _, c in pairs if REFERENCE_EXTRA_ROUND_KEY in c.extra)}
    kind = parse_method(method)[0]
    res["tau"] = paired_bootstrap_tau([p[0] for p in pairs], [p[1] for p in pairs], n_boot=n_boot, seed=seed)
    res["stats"] = {"baseline": method_stats([p[0] for p in pairs]), "candidate": method_stats([p[1] for p in pairs])}

    fail = res["failures"]
    if not pairs and not prompt_mismatches:
        fail.append("no prompt in common" + (" (matched by prompt token hash)"
                                             if paired["matched_by"] == "prompt token hash" else ""))
    if prompt_mismatches:
        fail.append(f"{len(prompt_mismatches)} prompt(s) are not the same prompt in both files "
                    f"(first: {prompt_mismatches[0]['prompt_id']}: {prompt_mismatches[0]['reason']})")
    bugs = [d for d in divergences if d["class"] == "bug"]
    if bugs:
        d = bugs[0]
        fail.append(f"{len(bugs)} divergence(s) are bugs, not ties (first: prompt {d['prompt_id']} position "
                    f"{d['position']}, candidate round {d['candidate_round']}: {d['reason']})")
    unknown = [d for d in divergences if d["class"] == "unknown"]
    if unknown:
        d = unknown[0]
        fail.append(f"{len(unknown)} divergence(s) cannot be judged and are not called noise (first: prompt "
                    f"{d['prompt_id']} position {d['position']}: {d['reason']})")
    tree_bugs = [t for t in tree_diffs if t["class"] == "bug"]
    if tree_bugs:
        t = tree_bugs[0]
        fail.append(f"{len(tree_bugs)} tree(s) differ beyond noise (first: prompt {t['prompt_id']} round "
                    f"{t['round']} node {t['node']} [{', '.join(t['fields'])}]: {t['reason']})")
    walk_bugs = [a for a in accept_diffs if (exact or a["trees_identical"]) and not sampled]
    if walk_bugs:
        a = walk_bugs[0]
        what = "accept a different length" + ("" if exact else " on identical trees")
        fail.append(f"{len(walk_bugs)} round(s) {what} (first: prompt "
                    f"{a['prompt_id']} round {a['round']}: {a['baseline_accept_len']} vs {a['candidate_accept_len']})")
    if drifts:
        d = drifts[0]
        fail.append(f"{len(drifts)} prompt(s) where the target's recorded top-2 gaps drift beyond {th.exact_tol} on "
                    f"the same tokens (first: prompt {d['prompt_id']} position {d['position']}, candidate round "
                    f"{d['candidate_round']})")
    if th.min_match_rate is not None and n and res["match_rate"] < th.min_match_rate:
        fail.append(f"match rate {res['match_rate']:.3f} < {th.min_match_rate}")
    tau = res["tau"]
    tolerated = th.max_tau_drop if th.max_tau_drop is not None else (None if sampled else 0.0)
    res["tau_rule"] = tau_rule(tau, tolerated, kind)
    if res["tau_rule"]["failed"]:
        fail.append(res["tau_rule"]["reason"])
    if sampled_alpha is not None:
        res["sampled"] = sampled_tests(pairs, speculative=kind != "plain", alpha=sampled_alpha, seed=seed)
        fail += res["sampled"]["failures"]
    if first_bugs and fail:
        fb = first_bugs[0]
        fail.insert(0, f"first bug: prompt {fb['prompt_id']} round {fb['round']}: {fb['what']}")
    res["passed"] = not fail
    return res


def tau_rule(tau: dict[str, Any], tolerated: float | None, kind: str) -> dict[str, Any]:
    """{"failed", "reason"}: a speculative method fails when the whole 95% interval of tau(candidate) -
    tau(baseline) lies below -tolerated (the data show a drop larger than the tolerated one); None: not applied."""
    if tolerated is None or kind == "plain":
        return {"failed": False, "reason": None}
    ci = tau.get("diff_ci95")
    if not ci or not math.isfinite(tau["diff"]):
        return {"failed": False, "reason": "no interval (fewer than two prompts with rounds): the tau drop is not "
                                           "judged"}
    drop = f"tau drop {-tau['diff']:.3f} ({tau['baseline']:.3f} -> {tau['candidate']:.3f}, 95% interval of the " \
           f"difference [{ci[0]:+.3f}, {ci[1]:+.3f}])"
    if ci[1] < -tolerated:
        return {"failed": True, "reason": f"{drop}: the interval lies below " + (
            "zero" if tolerated == 0 else f"-{tolerated:g} (--max-tau-drop)")}
    return {"failed": False, "reason": None}


def sampling_mismatch(a: BaselineHeader, b: BaselineHeader) -> str | None:
    """Why two sampled files cannot draw from the same distribution by design (different settings), or None."""
    diffs = [f"{name} {getattr(a, name)!r} vs {getattr(b, name)!r}" for name in ("temperature", "top_k", "top_p")
             if getattr(a, name) is not None and getattr(b, name) is not None and getattr(a, name) != getattr(b, name)]
    return ", ".join(diffs) or None


def compare(base: Baseline, cand: Baseline, *, methods: list[str] | None = None, thresholds: Thresholds | None = None,
            n_boot: int = 2000, seed: int = 0) -> dict[str, Any]:
    th = thresholds or Thresholds()
    th.validate()
    if methods:
        for m in methods:
            parse_method(m)
        chosen = list(methods)
    else:
        chosen = sorted(set(base.methods) & set(cand.methods), key=method_sort_key)
    sampled = base.header.temperature > 0 or cand.header.temperature > 0
    rule = choose_rule(base.header, cand.header, th.rule)
    if sampled:
        rule = {**rule, "why": rule["why"] + " (sampled run: token-level differences are reported; the "
                                             "distributions are tested instead)"}
    report: dict[str, Any] = {
        "baseline": {"path": base.path, "source": base.header.source, "temperature": base.header.temperature,
                     "dtype": base.header.dtype, "device": base.header.device, "methods": base.methods},
        "candidate": {"path": cand.path, "source": cand.header.source, "temperature": cand.header.temperature,
                      "dtype": cand.header.dtype, "device": cand.header.device, "methods": cand.methods},
        "thresholds": asdict(th),
        "rule": rule,
        "sampled": sampled,
        "warnings": comparability_warnings(base.header, cand.header),
        "methods": {},
        "failures": [],
    }
    general = report["file_failures"] = []  # problems of the files as a whole, listed before the methods' problems
    for side, b in (("baseline", base), ("candidate", cand)):
        if not b.records:
            general.append(f"the {side} file{' ' + str(b.path) if b.path else ''} has no records (a header line "
                           f"only)")
    if not chosen and not general:
        general.append(f"the files have no method in common (baseline: {', '.join(base.methods)}; candidate: "
                       f"{', '.join(cand.methods)})")
    comparable = [m for m in chosen if m in base.methods and m in cand.methods]
    alpha = None
    report["sampled_judgement"] = None
    if sampled:
        mismatch = sampling_mismatch(base.header, cand.header)
        if min(base.header.temperature, cand.header.temperature) <= 0 or mismatch:
            general.append("the files sample with different settings (" + (mismatch or "one is greedy") +
                           "): their distributions differ by design, so the sampled run cannot be judged")
        elif th.sampled_alpha > 0 and comparable:
            # Bonferroni: every method's tests share the comparison's false-alarm rate
            n_tests = sum(1 if parse_method(m)[0] == "plain" else 2 for m in comparable)
            alpha = th.sampled_alpha / n_tests
            report["sampled_judgement"] = {"alpha": th.sampled_alpha, "tests": n_tests, "alpha_per_test": alpha}
    for m in chosen:
        if m not in comparable:
            where = "baseline" if m not in base.methods else "candidate"
            report["methods"][m] = {"method": m, "passed": False, "failures": [f"method {m} is not in the {where}"]}
        else:
            report["methods"][m] = compare_method(base, cand, m, th, sampled=sampled, n_boot=n_boot, seed=seed,
                                                  rule=rule, sampled_alpha=alpha)
    report["failures"] = general + [f"{m}: {f}" for m, r in report["methods"].items() for f in r["failures"]]
    exact = sum(r.get("exact_match", 0) for r in report["methods"].values())
    total = sum(r.get("prompts", 0) - len(r.get("prompt_mismatches", [])) for r in report["methods"].values())
    report["overall"] = {"exact_match": exact, "pairs": total, "match_rate": exact / total if total else None}
    report["passed"] = not report["failures"]
    return report
