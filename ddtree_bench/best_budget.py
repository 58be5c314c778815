"""The best fixed DDTREE budget per batch size, MEASURED: read straight from one setup's rows of a budget sweep
(benchmarks/bench_budgets.py), no model in between. The projection from step-time fits and offline acceptance is
ddtree_bench/cost_model.py's; this is what the servers did.

Per batch size of the setup:
  best_budget              the fixed DDTREE budget whose row has the highest decode tokens/s (a row's tokens/s is
                           its median run; a tie goes to the smaller budget)
  tokens_per_s, tau        that row's
  dflash_*, plain_*        the DFLASH chain's and plain decoding's rows of the same batch size, when present
  over_dflash              best / DFLASH, on the rows' tokens/s
  over_dflash_runs         the same ratio run by run (run r of one row over run r of the other), with its min-max in
                           over_dflash_run_range: in an interleaved sweep run r of every row of a batch size was
                           measured in the same round. Only when both rows carry per-run tokens/s
                           (decode_tokens_per_s_runs) of the same length; otherwise null and `run_pairing` says why.
  auto_*                   the `auto` row's tokens/s and tau, and auto over the best of plain decoding, DFLASH and the
                           best fixed budget, those measured (the rival is picked on the rows' tokens/s; its run-by-run
                           ratios pair auto's runs with that rival's runs); auto_choice: the share of its batch
                           rounds each candidate ran (its Prometheus counts over the row's runs)
  rate_outlier_runs        runs (indices) in which a compared row had requests decoding far above its median rate
                           (a request timed short inflates that run's summed tokens/s): kept in the ratios, named
                           here so a reader can discount them
  candidates               every fixed budget's tokens/s, per-run tokens/s, tau and ratio over DFLASH

The file also names the sweep, the setup, its attention backend, and the commit and date of the run(s) its rows came
from (the sweep's `run` lines). A setup without acceptance (random weights: acceptance_meaningful false) is refused:
its tokens/s say nothing about which budget is best.

  python -m ddtree_bench.best_budget --sweep benchmarks/results/sweep_X.jsonl --setup 8b-real \\
      --out benchmarks/results/best_budget.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sglang_ddtree.results_file import ok_results, read_rows

MEASURED_NOTE = ("MEASURED end to end: every number is a row of the sweep (decode tokens/s of the row's median run, "
                 "tau of that run); the best budget is the fixed DDTREE budget with the highest measured tokens/s.")


def _r(x: float | None, nd: int) -> float | None:
    return None if x is None else round(float(x), nd)


def _runs(row: dict) -> list[float]:
    return [float(x) for x in row.get("decode_tokens_per_s_runs") or []]


def paired_runs(num: dict, den: dict) -> tuple[list[float] | None, str]:
    """Run-by-run ratios num / den ([num run r / den run r]) and how they were paired: run r with run r when both
    rows carry the same number (>= 2) of per-run tokens/s, else (None, why not)."""
    a, b = _runs(num), _runs(den)
    if not a or not b:
        return None, "no per-run tokens/s in " + ("either row" if not a and not b else
                                                   "the numerator row" if not a else "the denominator row")
    if len(a) != len(b):
        return None, f"unpaired: {len(a)} runs against {len(b)}"
    if len(a) < 2:
        return None, "one run each: no run-by-run ratio beyond the rows' own"
    if any(x <= 0 for x in b):
        return None, "a run of the denominator row has no positive tokens/s"
    if num.get("interleaved") and den.get("interleaved"):
        how = "run r with run r (interleaved rounds)"
    else:
        how = "run r with run r (rows not interleaved: the runs were not taken in the same rounds)"
    return [x / y for x, y in zip(a, b)], how


def _outlier_runs(*rows: dict) -> list[int]:
    """Indices of runs in which any of `rows` had rate-outlier requests (decode_rate_outliers_runs)."""
    flagged: set[int] = set()
    for row in rows:
        flagged |= {i for i, n in enumerate(row.get("decode_rate_outliers_runs") or []) if n}
    return sorted(flagged)


def _ratio_fields(prefix: str, num: dict, den: dict) -> dict:
    """{prefix: num/den on the rows, prefix_runs, prefix_run_range: [min, max], prefix_run_pairing: how}."""
    runs, how = paired_runs(num, den)
    return {prefix: _r(num["decode_tokens_per_s"] / den["decode_tokens_per_s"], 4),
            f"{prefix}_runs": [_r(x, 4) for x in runs] if runs else None,
            f"{prefix}_run_range": [_r(min(runs), 4), _r(max(runs), 4)] if runs else None,
            f"{prefix}_run_pairing": how}


def best_by_batch(rows: list[dict]) -> dict:
    """{batch size (str): the per-batch record of the module docstring} from one setup's latest ok result rows;
    batch sizes without a fixed DDTREE row are left out."""
    by_bs: dict[int, dict] = {}
    for r in rows:
        if r.get("decode_tokens_per_s") is None:
            continue
        slot = by_bs.setdefault(int(r["batch_size"]), {"ddtree": {}})
        if r["method"] == "ddtree":
            slot["ddtree"][int(r["budget"])] = r
        elif r["method"] in ("dflash", "plain", "auto"):
            slot[r["method"]] = r
    out = {}
    for bs in sorted(by_bs):
        slot = by_bs[bs]
        trees = slot["ddtree"]
        if not trees:
            continue
        # sorted budgets + max keeps the first of equal rates: a tie goes to the smaller tree
        best_b = max(sorted(trees), key=lambda b: trees[b]["decode_tokens_per_s"])
        best = trees[best_b]
        dflash, plain, auto = slot.get("dflash"), slot.get("plain"), slot.get("auto")
        rec: dict = {"best_budget": best_b, "tokens_per_s": _r(best["decode_tokens_per_s"], 1),
                     "tau": _r(best.get("tau"), 4),
                     "tokens_per_s_runs": [_r(x, 1) for x in _runs(best)] or None}
        if dflash is not None:
            rec.update({"dflash_tokens_per_s": _r(dflash["decode_tokens_per_s"], 1),
                        "dflash_tau": _r(dflash.get("tau"), 4)})
            rec.update(_ratio_fields("over_dflash", best, dflash))
        if plain is not None:
            rec.update({"plain_tokens_per_s": _r(plain["decode_tokens_per_s"], 1),
                        "over_plain": _r(best["decode_tokens_per_s"] / plain["decode_tokens_per_s"], 4)})
        compared = [best] + [x for x in (dflash, plain) if x is not None]
        if auto is not None:
            rival_name, rival = f"ddtree-{best_b}", best
            for name, other in (("dflash", dflash), ("plain", plain)):
                if other is not None and other["decode_tokens_per_s"] > rival["decode_tokens_per_s"]:
                    rival_name, rival = name, other
            rec.update({"auto_tokens_per_s": _r(auto["decode_tokens_per_s"], 1), "auto_tau": _r(auto.get("tau"), 4),
                        "auto_rival": rival_name})
            rec.update(_ratio_fields("auto_over_best", auto, rival))
            rounds = (auto.get("ddtree_metrics") or {}).get("auto_rounds") or {}
            total = sum(rounds.values())
            rec["auto_choice"] = {c: _r(n / total, 4) for c, n in sorted(rounds.items())} if total else None
            compared.append(auto)
        rec["rate_outlier_runs"] = _outlier_runs(*compared)
        rec["candidates"] = [
            {"budget": b, "tokens_per_s": _r(r["decode_tokens_per_s"], 1),
             "tokens_per_s_runs": [_r(x, 1) for x in _runs(r)] or None, "tau": _r(r.get("tau"), 4),
             "over_dflash": (_r(r["decode_tokens_per_s"] / dflash["decode_tokens_per_s"], 4)
                             if dflash is not None else None)}
            for b, r in sorted(trees.items())]
        out[str(bs)] = rec
    return out


def _backend(lines: list[dict], setup: str) -> str | None:
    """The setup's --attention-backend from the sweep's `server` lines (None if absent or not one value)."""
    seen = set()
    for line in lines:
        if line.get("kind") == "server" and line.get("setup") == setup:
            args = line.get("args") or []
            seen |= {args[i + 1] for i, a in enumerate(args[:-1]) if a == "--attention-backend"}
    return seen.pop() if len(seen) == 1 else None


def build(sweep: str | Path, setup: str) -> dict:
    lines = read_rows(sweep)
    rows = ok_results(lines, setup)
    if not rows:
        raise ValueError(f"{sweep}: no ok result rows of setup {setup!r}.")
    if not any(r.get("acceptance_meaningful") for r in rows):
        raise ValueError(f"{sweep}: setup {setup!r} has no real acceptance (random weights): its tokens/s cannot "
                         "pick a budget; use ddtree_bench.cost_model for a projection.")
    by_batch = best_by_batch(rows)
    if not by_batch:
        raise ValueError(f"{sweep}: setup {setup!r} has no ok fixed-budget DDTREE row.")
    run_ids = sorted({r["run_id"] for r in rows if r.get("run_id")})
    runs = [line for line in lines if line.get("kind") == "run" and line.get("run_id") in run_ids]
    commits = sorted({line["commit"] for line in runs if line.get("commit")})
    return {
        "projected": False,
        "note": MEASURED_NOTE,
        "sweep": str(sweep),
        "setup": setup,
        "attention_backend": _backend(lines, setup),
        # the commit the sweep ran (its --commit); a file resumed over runs of several commits lists them all
        "commit": commits[0] if len(commits) == 1 else commits or None,
        "dates": sorted({line["date"][:10] for line in runs if line.get("date")}),
        "gpu": sorted({line["gpu"] for line in runs if line.get("gpu")}),
        "run_ids": run_ids,
        "interleaved": all(bool(r.get("interleaved")) for r in rows),
        "by_batch": by_batch,
    }


def format_report(result: dict) -> str:
    lines = [f"{result['setup']} ({result['attention_backend'] or 'backend unknown'}) from {result['sweep']}, "
             f"commit {result['commit']}: MEASURED"]
    for b, r in result["by_batch"].items():
        text = f"batch {b:>3}: best budget {r['best_budget']:>4}  {r['tokens_per_s']:.1f} tok/s"
        if r.get("over_dflash") is not None:
            rng = r["over_dflash_run_range"]
            text += f", x{r['over_dflash']:.3f} over DFLASH" + (f" (runs {rng[0]:.3f}-{rng[1]:.3f})" if rng else "")
        if r.get("auto_over_best") is not None:
            text += (f"; auto x{r['auto_over_best']:.3f} of the best of plain, DFLASH and the best budget "
                     f"({r['auto_rival']})")
        lines.append(text)
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", required=True, help="results JSONL of benchmarks/bench_budgets.py")
    ap.add_argument("--setup", required=True, help="the setup whose rows are read (one backend and model pair)")
    ap.add_argument("--out", required=True, help="write the measured best budgets here (JSON)")
    args = ap.parse_args(argv)
    try:
        result = build(args.sweep, args.setup)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(format_report(result))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
