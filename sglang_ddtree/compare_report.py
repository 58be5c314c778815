"""The comparator's report (compare.compare) as text: what `sglang-ddtree compare` prints."""

from __future__ import annotations

import math
from typing import Any

from sglang_ddtree.baseline import parse_method


def _f(x, nd=3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return f"{x:.{nd}f}"


def _ci(c) -> str:
    return "-" if not c else f"[{c[0]:+.3f}, {c[1]:+.3f}]"


def _sampled_lines(s: dict[str, Any] | None) -> list[str]:
    if not s:
        return []
    if s["not_judged"]:
        return [f"  sampled distributions not judged: {s['not_judged']}"]
    out = []
    t = s["tests"].get("acceptance_by_depth")
    if t:
        m = t["most_different"]
        out.append(f"  sampled acceptance by depth: p = {t['p']:.3g} (level {s['alpha']:.2g}); largest difference at "
                   f"depth {m['depth']}: base {_f(m['baseline'])} cand {_f(m['candidate'])} (z {m['z']:+.2f})")
    t = s["tests"].get("token_frequencies")
    if t:
        m = t["most_different"]
        where = "" if m is None else (f"; largest difference at position {m['position']}: "
                                      f"{'end of output' if m['token'] is None else 'token ' + str(m['token'])} "
                                      f"base {m['baseline_count']} cand {m['candidate_count']} times")
        out.append(f"  sampled token frequencies over {t['positions']} positions: p = {t['p']:.3g} "
                   f"(level {s['alpha']:.2g}){where}")
    return out


def format_report(report: dict[str, Any]) -> str:
    lines = [f"baseline : {report['baseline']['path']} ({report['baseline']['source']}, "
             f"T={report['baseline']['temperature']}, {report['baseline']['dtype']} on {report['baseline']['device']})",
             f"candidate: {report['candidate']['path']} ({report['candidate']['source']}, "
             f"T={report['candidate']['temperature']}, {report['candidate']['dtype']} on {report['candidate']['device']})"]
    rule = report.get("rule")
    if rule:
        lines.append(f"rule     : {rule['name']}: {rule['why']}"
                     + (f" (threshold {report['thresholds']['noise_margin']} nats)"
                        if rule["name"] in ("float32-tie", "margin") else ""))
    for w in report["warnings"]:
        lines.append(f"warning: {w}")
    sj = report.get("sampled_judgement")
    if sj:
        lines.append(f"sampled  : acceptance by depth and token frequencies tested against the baseline's "
                     f"(permutation tests over prompts; false-alarm rate {sj['alpha']:g} over the comparison, "
                     f"{sj['alpha_per_test']:.2g} per test)")
    matched = sorted({r.get("matched_by") for r in report["methods"].values() if r.get("matched_by")})
    if matched:
        lines.append(f"prompts paired by {' / '.join(matched)}")
    lines.append("")
    head = f"{'method':<14} {'prompts':>7} {'match':>9} {'diverged (bug/noise/other)':>27} {'tau base':>9} " \
           f"{'tau cand':>9} {'diff':>7} {'95% CI':>19} {'trees (bug/noise)':>18}  status"
    lines += [head, "-" * len(head)]
    for m, r in report["methods"].items():
        if "tau" not in r:
            lines.append(f"{m:<14} {'-':>7} {'-':>9} {'':>27} {'':>9} {'':>9} {'':>7} {'':>19} {'':>18}  FAIL")
            continue
        dc = r["divergence_counts"]
        other = sum(v for k, v in dc.items() if k not in ("bug", "noise"))
        tc = r["tree_difference_counts"]
        tau = r["tau"]
        n_ok = r["prompts"] - len(r["prompt_mismatches"])
        lines.append(
            f"{m:<14} {r['prompts']:>7} {str(r['exact_match']) + '/' + str(n_ok):>9} "
            f"{str(dc.get('bug', 0)) + '/' + str(dc.get('noise', 0)) + '/' + str(other):>27} "
            f"{_f(tau['baseline']):>9} {_f(tau['candidate']):>9} {_f(tau['diff']):>7} {_ci(tau.get('diff_ci95')):>19} "
            f"{str(tc.get('bug', 0)) + '/' + str(tc.get('noise', 0)) + ' of ' + str(r['tree_rounds_compared']):>18}  "
            f"{'ok' if r['passed'] else 'FAIL'}"
        )
    for m, r in report["methods"].items():
        ex = r.get("reference_extra_final_rounds") or {}
        if "tau" not in r or (r["passed"] and not r["divergences"] and not r["first_tree_difference"]
                              and parse_method(m)[0] == "plain" and not any(ex.values()) and not r.get("sampled")):
            continue
        lines += ["", f"== {m}"]
        if r.get("first_bug"):
            fb = r["first_bug"]
            lines.append(f"  first bug: prompt {fb['prompt_id']} round {fb['round']}: {fb['what']} "
                         f"({r['prompts_with_bugs']} prompt(s) with bugs)")
        ex = r.get("reference_extra_final_rounds") or {}
        for side in ("baseline", "candidate"):
            if ex.get(side):
                lines.append(f"  {side}: {ex[side]} reference extra final round(s) recognised (the reference loop "
                             f"ran once more after an exactly full output); not counted in tau")
        for d in r.get("margin_drifts", [])[:3]:
            lines.append(f"  top-2 gap drift: prompt {d['prompt_id']} position {d['position']} (cand round "
                         f"{d['candidate_round']}): base {_f(d['baseline_margin'], 5)} cand "
                         f"{_f(d['candidate_margin'], 5)}")
        for d in r["divergences"]:
            lines.append(
                f"  divergence prompt {d['prompt_id']} pos {d['position']} (cand round {d['candidate_round']}, base "
                f"round {d['baseline_round']}): base {d['baseline_token']} vs cand {d['candidate_token']}, margins "
                f"base {_f(d['baseline_margin'], 4)} cand {_f(d['candidate_margin'], 4)} -> {d['class']}: {d['reason']}")
        t = r["first_tree_difference"]
        if t:
            lines.append(f"  first tree difference: prompt {t['prompt_id']} round {t['round']} node {t['node']} "
                         f"[{', '.join(t['fields'])}] base {t['baseline']} cand {t['candidate']} -> {t['class']}: "
                         f"{t['reason']}")
        for a in r["accept_len_differences"][:3]:
            lines.append(f"  accept length differs: prompt {a['prompt_id']} round {a['round']}: "
                         f"{a['baseline_accept_len']} vs {a['candidate_accept_len']}"
                         f"{' (identical trees!)' if a['trees_identical'] else ''}")
        sb, sc = r["stats"]["baseline"], r["stats"]["candidate"]
        if sb.get("rounds") and sc.get("rounds") and parse_method(m)[0] != "plain":
            lines.append(f"  {'accept len':>10} {'base rounds':>12} {'cand rounds':>12}   {'depth':>5} {'P(reach) b':>11} "
                         f"{'c':>6} {'branch b':>9} {'c':>6}")
            hb, hc = sb["accept_len_hist"], sc["accept_len_hist"]
            keys = sorted({int(k) for k in hb} | {int(k) for k in hc})
            rb, rc = sb["accept_rate_by_depth"], sc["accept_rate_by_depth"]
            bb, bc = sb.get("branch_rate_by_depth") or [], sc.get("branch_rate_by_depth") or []
            for i in range(max(len(keys), len(rb), len(rc))):
                k = keys[i] if i < len(keys) else None
                left = (f"  {k:>10} {hb.get(str(k), 0):>12} {hc.get(str(k), 0):>12}" if k is not None
                        else " " * 38)
                d = i + 1
                right = ""
                if d <= max(len(rb), len(rc)):
                    right = (f"   {d:>5} {_f(rb[d - 1] if d <= len(rb) else None):>11} "
                             f"{_f(rc[d - 1] if d <= len(rc) else None):>6} "
                             f"{_f(bb[d - 1] if d <= len(bb) else None):>9} {_f(bc[d - 1] if d <= len(bc) else None):>6}")
                lines.append(left + right)
            lines.append(f"  branch acceptance: base {_f(sb.get('branch_accept_rate'))} cand "
                         f"{_f(sc.get('branch_accept_rate'))}")
        if (r.get("tau_rule") or {}).get("reason") and not r["tau_rule"]["failed"]:
            lines.append(f"  tau: {r['tau_rule']['reason']}")
        lines += _sampled_lines(r.get("sampled"))
        for f in r["failures"]:
            lines.append(f"  FAIL: {f}")
    if report.get("file_failures"):
        lines.append("")
        lines += [f"FAIL: {f}" for f in report["file_failures"]]
    lines.append("")
    o = report["overall"]
    lines.append(f"overall: {o['exact_match']}/{o['pairs']} exact matches; "
                 f"{'PASS' if report['passed'] else 'FAIL (' + str(len(report['failures'])) + ' problem(s))'}")
    return "\n".join(lines)
