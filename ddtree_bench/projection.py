"""What DDTREE would give over DFLASH with a TRAINED drafter: a sweep's measured round costs combined with a
published acceptance profile (a projection, not a measurement).

The pairs the sweep can serve (the tiny pair and its widenings) accept far less than a trained drafter, and a weak
drafter gains more from branching, so their tokens/s ratios overstate what a user with a trained DFlash drafter gets.
What a sweep does measure at real shapes is the cost of a round. Per (setup, attention backend, batch size, budget B):

  round ratio       DDTREE's round ms over DFLASH's at the same batch size, on the rows' step_ms (the round ms of
                    each row's median-tokens/s repeat, as the sweep reports it). Those two medians may come from
                    different repeats, so this ratio can fall outside the per-repeat ratios (step_ms_runs, repeat r
                    over repeat r: in an interleaved sweep they were measured in the same round), given with their
                    min-max, geometric mean and 95% interval (ddtree_bench/paired.py)
  tau gain          tau_tree(B) / tau_chain of the profile (benchmarks/configs/acceptance_profiles.json)
  projected ratio   tau gain / round ratio: the tokens/s ratio DDTREE B over DFLASH when both commit what the
                    profile's drafter commits and a round costs what the sweep measured
  measured ratio    the served pair's own tokens/s ratio, beside it

tau_tree(B) is interpolated log-linearly in B between published budgets; below the smallest, down to the profile's
`extrapolate_down_to` (15: DFLASH's verify width), from the first segment's slope; outside that range there is no
tau and no projection. DFLASH and DDTREE rows are paired only within one setup and one --attention-backend (read from
each row's server arguments). The best projected budget per batch size is the one with the highest projected ratio.

  python -m ddtree_bench.projection benchmarks/results/sweep_8b-real_2026-12-04_b171d51.jsonl --setup 8b-real
  python -m ddtree_bench.projection SWEEP.jsonl --profile paper-qwen3-8b-math500-t0 --json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from ddtree_bench.paired import paired_ratio
from sglang_ddtree.results_file import ok_results, read_rows

PROFILES_FILE = Path(__file__).resolve().parents[1] / "benchmarks" / "configs" / "acceptance_profiles.json"
DEFAULT_PROFILE = "paper-qwen3-8b-math500-t0"

PROJECTION_NOTE = ("PROJECTED, not measured end to end: the sweep's measured DDTREE / DFLASH round ms combined with "
                   "a published acceptance profile of a trained drafter (tau_tree(B) / tau_chain over the round "
                   "ratio).")


# ------------------------------------------------------------------------------------------------------ acceptance


def load_profile(name: str = DEFAULT_PROFILE, path: Path = PROFILES_FILE) -> dict:
    """The named profile of the profiles file, with its name added."""
    profiles = json.loads(Path(path).read_text())["profiles"]
    if name not in profiles:
        raise ValueError(f"no acceptance profile {name!r} in {path} (there: {', '.join(sorted(profiles))}).")
    return {"name": name, **profiles[name]}


def tau_for_budget(profile: dict, budget: int) -> float | None:
    """The profile's DDTREE tau at `budget`: published, log-linear in B between published budgets, or below the
    smallest down to `extrapolate_down_to` from the first segment's slope; None where nothing supports a value
    (below that floor or above the largest published budget)."""
    points = sorted((int(b), float(t)) for b, t in profile["tree_tau_by_budget"].items())
    floor = int(profile.get("extrapolate_down_to", points[0][0]))
    published = dict(points)
    if budget in published:
        return published[budget]
    if budget < floor or budget > points[-1][0] or len(points) < 2:
        return None
    if budget < points[0][0]:
        (b0, t0), (b1, t1) = points[0], points[1]
        return t0 + (t1 - t0) / math.log2(b1 / b0) * math.log2(budget / b0)
    lo, t_lo, hi, t_hi = next((lo, t_lo, hi, t_hi) for (lo, t_lo), (hi, t_hi) in zip(points, points[1:])
                              if lo < budget < hi)
    return t_lo + (t_hi - t_lo) * math.log2(budget / lo) / math.log2(hi / lo)


# ------------------------------------------------------------------------------------------------------ sweep rows


def _backend_arg(args: list | None) -> str | None:
    args = list(args or [])
    return next((args[i + 1] for i, a in enumerate(args[:-1]) if a == "--attention-backend"), None)


def row_backend(row: dict, server_args: dict[str, list]) -> str:
    """The row's --attention-backend: from its own server_args, else from its server's `server` line; "default"
    where neither names one (SGLang then picks its own)."""
    return (_backend_arg(row.get("server_args")) or _backend_arg(server_args.get(row.get("server")))
            or "default")


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(float(x), nd)


def round_ratio(tree: dict, chain: dict) -> dict:
    """DDTREE's round ms over DFLASH's: on the rows' step_ms, and repeat by repeat when both rows carry step_ms_runs
    of the same length (>= 2), with their min-max, geometric mean and its 95% interval; otherwise those are None
    and `run_pairing` says why."""
    out = {"round_ratio": tree["step_ms"] / chain["step_ms"], "round_ratio_runs": None,
           "round_ratio_run_range": None, "round_ratio_paired": None, "round_ratio_ci95": None}
    a, b = tree.get("step_ms_runs") or [], chain.get("step_ms_runs") or []
    if not a or not b:
        out["run_pairing"] = "no per-repeat step_ms in " + ("either row" if not a and not b else
                                                            "the DDTREE row" if not a else "the DFLASH row")
    elif len(a) != len(b):
        out["run_pairing"] = f"unpaired: {len(a)} repeats against {len(b)}"
    elif len(a) < 2:
        out["run_pairing"] = "one repeat each: no per-repeat ratio beyond the rows' own"
    elif any(x <= 0 for x in a + b):
        out["run_pairing"] = "a repeat without a positive step_ms"
    else:
        runs = [x / y for x, y in zip(a, b)]
        paired = paired_ratio(a, b)
        out.update(round_ratio_runs=runs, round_ratio_run_range=[min(runs), max(runs)],
                   round_ratio_paired=paired["ratio"], round_ratio_ci95=paired["ci95"],
                   run_pairing="repeat r with repeat r" + ("" if tree.get("interleaved") and chain.get("interleaved")
                                                           else " (rows not interleaved: not the same rounds)"))
    return out


def project_rows(rows: list[dict], profile: dict, server_args: dict[str, list] | None = None,
                 chain_from: dict[str, str] | None = None) -> list[dict]:
    """One group per (setup, backend) that has DFLASH and DDTREE rows at a common batch size, each {"setup",
    "backend", "by_batch": {batch size (str): {"dflash_step_ms", "dflash_tau", "budgets": [per budget: round
    ratio fields, measured_tokens_per_s_ratio, tau_gain, projected_ratio, projected_run_range], "best": {"budget",
    "projected_ratio"} or None}}}, in (setup, backend) order. chain_from {arm setup: base setup}: an arm (a
    --copy-setup of the same pair with another server switch) that measured no DFLASH of its own is paired with its
    base's DFLASH rows of the same run."""
    server_args = server_args or {}
    chain_from = chain_from or {}
    chain_tau = float(profile["chain_tau"])
    groups: dict[tuple[str, str], dict[int, dict]] = {}
    for r in rows:
        if r.get("method") not in ("dflash", "ddtree") or r.get("step_ms") is None:
            continue
        slot = groups.setdefault((r["setup"], row_backend(r, server_args)), {}).setdefault(
            int(r["batch_size"]), {"ddtree": {}})
        if r["method"] == "dflash":
            slot["dflash"] = r
        else:
            slot["ddtree"][int(r["budget"])] = r
    out = []
    for (setup, backend), by_bs in sorted(groups.items()):
        by_batch = {}
        base = groups.get((chain_from.get(setup), backend), {})
        for bs, slot in sorted(by_bs.items()):
            chain = slot.get("dflash") or base.get(bs, {}).get("dflash")
            if chain is None or not slot["ddtree"]:
                continue
            recs = []
            for budget, tree in sorted(slot["ddtree"].items()):
                rec = {"budget": budget, "ddtree_step_ms": _r(tree["step_ms"], 3)}
                ratio = round_ratio(tree, chain)
                rec.update({k: [_r(x) for x in v] if isinstance(v, list) else _r(v) if isinstance(v, float) else v
                            for k, v in ratio.items()})
                if tree.get("decode_tokens_per_s") and chain.get("decode_tokens_per_s"):
                    rec["measured_tokens_per_s_ratio"] = _r(tree["decode_tokens_per_s"] / chain["decode_tokens_per_s"])
                rec["measured_tau"] = _r(tree.get("tau"))
                tau = tau_for_budget(profile, budget)
                gain = None if tau is None else tau / chain_tau
                rec["profile_tau"] = _r(tau)
                rec["tau_gain"] = _r(gain)
                rec["projected_ratio"] = None if gain is None else _r(gain / ratio["round_ratio"])
                rng = ratio["round_ratio_run_range"]
                rec["projected_run_range"] = (None if gain is None or rng is None
                                              else [_r(gain / rng[1]), _r(gain / rng[0])])
                recs.append(rec)
            projected = [x for x in recs if x["projected_ratio"] is not None]
            best = max(projected, key=lambda x: x["projected_ratio"], default=None)  # a tie keeps the smaller B
            by_batch[str(bs)] = {"dflash_step_ms": _r(chain["step_ms"], 3), "dflash_tau": _r(chain.get("tau")),
                                 "budgets": recs,
                                 "best": None if best is None else {"budget": best["budget"],
                                                                    "projected_ratio": best["projected_ratio"]}}
        if by_batch:
            out.append({"setup": setup, "backend": backend, "by_batch": by_batch})
    return out


def project_sweep(sweep: str | Path, profile: str | dict = DEFAULT_PROFILE, setup: str | None = None,
                  chain_from: dict[str, str] | None = None) -> dict:
    """The projection of a sweep file's latest ok rows (one setup, or every setup that has both methods; an arm in
    chain_from with its base's DFLASH rows)."""
    lines = read_rows(sweep)
    if not lines:
        raise ValueError(f"{sweep}: no such file or no rows in it.")
    profile = load_profile(profile) if isinstance(profile, str) else profile
    rows = ok_results(lines, None)
    wanted = {setup, (chain_from or {}).get(setup)} if setup else None
    rows = [r for r in rows if wanted is None or r.get("setup") in wanted]
    server_args = {x["server"]: x.get("args") for x in lines if x.get("kind") == "server" and x.get("server")}
    groups = project_rows(rows, profile, server_args, chain_from)
    if setup:
        groups = [g for g in groups if g["setup"] == setup]
    if not groups:
        which = f"setup {setup!r}" if setup else "any setup"
        raise ValueError(f"{sweep}: {which} has no DFLASH and DDTREE rows at a common batch size.")
    runs = {x.get("run_id"): x for x in lines if x.get("kind") == "run"}
    for g in groups:
        g["gpu"] = sorted({runs.get(r.get("run_id"), {}).get("gpu") for r in rows if r["setup"] == g["setup"]} - {None})
    commits = {runs.get(r.get("run_id"), {}).get("commit") for r in rows} - {None}
    return {"projected": True, "note": PROJECTION_NOTE, "sweep": str(sweep),
            "commit": sorted(commits),
            "profile": {k: profile.get(k) for k in ("name", "source", "model", "chain_tau", "tree_tau_by_budget",
                                                    "extrapolate_down_to")},
            "groups": groups}


# ------------------------------------------------------------------------------------------------------ report


def _range(rng: list | None) -> str:
    return f"{rng[0]:.3f}-{rng[1]:.3f}" if rng else "-"


def format_report(result: dict) -> str:
    prof = result["profile"]
    lines = [f"{result['sweep']}: PROJECTED with profile {prof['name']} (chain tau {prof['chain_tau']:g})",
             "projected = (tau_tree(B) / tau_chain) / (DDTREE round ms / DFLASH round ms); measured = the served "
             "pair's own tokens/s ratio;",
             "round/DFLASH on the rows' median repeats (they may be different repeats), repeats = min-max of the "
             "per-repeat ratios"]
    for g in result["groups"]:
        lines.append("")
        lines.append(f"{g['setup']} ({g['backend']}, {', '.join(g['gpu']) or 'GPU unknown'})")
        for bs, b in g["by_batch"].items():
            lines.append(f"  batch {bs} (DFLASH {b['dflash_step_ms']:.3f} ms a round)")
            lines.append(f"    {'B':>5}  {'tau gain':>8}  {'round/DFLASH':>12}  {'repeats':>11}  {'measured':>8}  "
                         f"{'projected':>9}  {'repeats':>11}")
            for x in b["budgets"]:
                gain = "-" if x["tau_gain"] is None else f"{x['tau_gain']:.3f}"
                proj = "no tau" if x["projected_ratio"] is None else f"x{x['projected_ratio']:.3f}"
                meas = x.get("measured_tokens_per_s_ratio")
                meas = "-" if meas is None else f"x{meas:.3f}"
                lines.append(f"    {x['budget']:>5}  {gain:>8}  {x['round_ratio']:>12.3f}  "
                             f"{_range(x['round_ratio_run_range']):>11}  {meas:>8}  {proj:>9}  "
                             f"{_range(x['projected_run_range']):>11}")
            best = b["best"]
            lines.append("    best projected: " + (f"B={best['budget']} x{best['projected_ratio']:.3f}" if best
                                                   else "none (no measured budget has a published tau)"))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep", help="results JSONL of benchmarks/bench_budgets.py")
    ap.add_argument("--profile", default=DEFAULT_PROFILE,
                    help=f"acceptance profile in {PROFILES_FILE.relative_to(PROFILES_FILE.parents[2])} "
                         f"(default {DEFAULT_PROFILE})")
    ap.add_argument("--setup", help="only this setup's rows (default: every setup with DFLASH and DDTREE rows)")
    ap.add_argument("--chain-from", action="append", default=[], metavar="ARM=BASE",
                    help="pair setup ARM's DDTREE rows with setup BASE's DFLASH rows (an arm of a --copy-setup A/B "
                         "that ran no DFLASH of its own)")
    ap.add_argument("--json", action="store_true", help="print the projection as JSON instead of the table")
    args = ap.parse_args(argv)
    chain_from = {}
    for item in args.chain_from:
        arm, sep, base = item.partition("=")
        if not sep or not arm or not base:
            print(f"error: --chain-from takes ARM=BASE, got {item!r}", file=sys.stderr)
            return 2
        chain_from[arm] = base
    try:
        result = project_sweep(args.sweep, args.profile, args.setup, chain_from)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1) if args.json else format_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
