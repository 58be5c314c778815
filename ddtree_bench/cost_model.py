"""Cost model: fit DDTREE's step time at real size, combine it with acceptance, project the best budget per batch.

Step time. One DDTREE round at batch b and budget B verifies V = b * (B + 1) tokens; its time is the fit
T(b, V) = a[b] + s1 * V + s2 * max(0, V - knee) of sglang_ddtree/step_fit.py (why that shape: its docstring).

Acceptance. tau(B) (mean tokens committed per round, bonus included) comes from the sweep's tiny setup (rounds
pooled over batch sizes: acceptance does not depend on the batch) or from a baseline file (docs/baseline-format.md:
our offline decoders, or the paper's reference output imported from .pt).

Projection: tokens/s(b, B) = b * tau(B) / T(b, b*(B+1)); DFLASH: b * tau_dflash / T_dflash(b) with DFLASH's
measured step time at real size; plain: its measured tokens/s at real size (one token per step whatever the
weights). Every number that combines a cost with an acceptance is labelled `projected`. Candidates whose V lies
outside the range measured at their batch size are marked `extrapolated` and are not chosen as best unless
--allow-extrapolation. The measured counterpart, read straight from a sweep with real acceptance, is
ddtree_bench/best_budget.py.

  python -m ddtree_bench.cost_model --sweep results.jsonl [--baseline offline.jsonl] --out best_budget_projected.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sglang_ddtree.results_file import load_ok_results
from sglang_ddtree.round_cost import tau_from_baseline
from sglang_ddtree.step_fit import StepFit, by_batch, fit_step_time

PROJECTED_NOTE = ("PROJECTED, not measured end to end: step times fitted on the cost setup (real-size shapes, random "
                  "weights) combined with acceptance (tau) from another source.")


# -------------------------------------------------------------------------------------------------- acceptance


def tau_from_sweep(rows: list[dict]) -> dict:
    """{"ddtree": {budget: tau}, "dflash": tau}: rounds pooled over batch sizes (weights = verify rounds)."""
    acc: dict[tuple[str, int | None], list[float]] = {}
    for r in rows:
        if r.get("method") not in ("ddtree", "dflash") or r.get("tau") is None:
            continue
        w = float(r.get("verify_rounds") or 1)
        s = acc.setdefault((r["method"], r.get("budget")), [0.0, 0.0])
        s[0] += w * float(r["tau"])
        s[1] += w
    out: dict = {"ddtree": {}, "dflash": None}
    for (method, budget), (num, den) in acc.items():
        if method == "ddtree":
            out["ddtree"][int(budget)] = num / den
        else:
            out["dflash"] = num / den
    return out




# -------------------------------------------------------------------------------------------------- projection




def project(fit: StepFit, tau: dict, *, batch_sizes: list[int], dflash_step_ms: dict[int, float] | None = None,
            plain_tokens_per_s: dict[int, float] | None = None, allow_extrapolation: bool = False) -> dict:
    dflash_step_ms = dflash_step_ms or {}
    plain_tokens_per_s = plain_tokens_per_s or {}
    out = {}
    for b in sorted(batch_sizes):
        dflash_tps = (b * tau["dflash"] / dflash_step_ms[b] * 1e3
                      if tau.get("dflash") is not None and b in dflash_step_ms else None)
        plain_tps = plain_tokens_per_s.get(b)
        candidates = []
        for budget, t in sorted(tau["ddtree"].items()):
            v = b * (budget + 1)
            step = fit.predict(b, v)
            tps = b * t / step * 1e3
            candidates.append({
                "budget": budget, "tau": t, "verify_tokens": v, "step_ms_projected": step,
                "tokens_per_s_projected": tps,
                "speedup_vs_plain_projected": tps / plain_tps if plain_tps else None,
                "speedup_vs_dflash_projected": tps / dflash_tps if dflash_tps else None,
                "extrapolated": not fit.measured(b, v),
            })
        eligible = [c for c in candidates if allow_extrapolation or not c["extrapolated"]]
        best = max(eligible, key=lambda c: c["tokens_per_s_projected"]) if eligible else None
        out[str(b)] = {
            "best_budget": best["budget"] if best else None,
            "projected_tokens_per_s": best["tokens_per_s_projected"] if best else None,
            "projected_speedup_vs_plain": best["speedup_vs_plain_projected"] if best else None,
            "projected_speedup_vs_dflash": best["speedup_vs_dflash_projected"] if best else None,
            "plain_tokens_per_s_measured": plain_tps,
            "dflash_tokens_per_s_projected": dflash_tps,
            "candidates": candidates,
        }
    return out


def build(sweep: str | Path, *, baseline: str | Path | None = None, cost_setup: str = "8b-dummy",
          tau_setup: str = "tiny", allow_extrapolation: bool = False) -> dict:
    cost_rows = load_ok_results(sweep, cost_setup)
    points = [(int(r["batch_size"]), int(r["budget"]), float(r["step_ms"])) for r in cost_rows
              if r["method"] == "ddtree" and r.get("step_ms")]
    fit = fit_step_time(points)
    if baseline is not None:
        tau = tau_from_baseline(baseline)
        source = {"kind": "baseline", "path": str(baseline)}
    else:
        tau = tau_from_sweep(load_ok_results(sweep, tau_setup))
        source = {"kind": "sweep", "setup": tau_setup}
        if not tau["ddtree"]:
            raise ValueError(f"{sweep}: no ok ddtree rows with tau in setup {tau_setup!r}; pass --baseline.")
    batches = sorted({p[0] for p in points})
    result = {
        "projected": True,
        "note": PROJECTED_NOTE,
        "sweep": str(sweep), "cost_setup": cost_setup, "tau_source": source,
        "fit": fit.to_json(),
        "tau": {"ddtree": {str(k): v for k, v in sorted(tau["ddtree"].items())}, "dflash": tau.get("dflash")},
        "by_batch": project(fit, tau, batch_sizes=batches,
                            dflash_step_ms=by_batch(cost_rows, "dflash", "step_ms"),
                            plain_tokens_per_s=by_batch(cost_rows, "plain", "decode_tokens_per_s"),
                            allow_extrapolation=allow_extrapolation),
    }
    return result


def format_report(result: dict) -> str:
    f = result["fit"]
    knee = f"{f['knee_tokens']:.0f}" if f["knee_tokens"] is not None else "none"
    lines = [f"step-time fit on {result['cost_setup']}: {f['points']} points, knee {knee} tokens, "
             f"s1 {f['slope_ms_per_token']:.5f} ms/token, s2 {f['slope2_ms_per_token']:.5f} ms/token, "
             f"rms rel err {f['rms_rel_err']:.3f}; intercepts {f['intercept_ms']}",
             f"tau from {result['tau_source']}; every number below is PROJECTED"]
    for b, r in result["by_batch"].items():
        if r["best_budget"] is None:
            lines.append(f"batch {b:>3}: no budget inside the measured range")
            continue
        sp = r["projected_speedup_vs_plain"]
        sd = r["projected_speedup_vs_dflash"]
        lines.append(f"batch {b:>3}: best budget {r['best_budget']:>4}  {r['projected_tokens_per_s']:.0f} tok/s "
                     "(projected)" + (f", x{sp:.2f} vs plain" if sp else "")
                     + (f", x{sd:.2f} vs DFLASH" if sd else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", required=True, help="results JSONL of benchmarks/bench_budgets.py")
    ap.add_argument("--baseline", default=None, help="acceptance from a baseline .jsonl (or a reference .pt)")
    ap.add_argument("--out", required=True, help="write the projection JSON here")
    ap.add_argument("--cost-setup", default="8b-dummy", help="setup whose step times are fitted")
    ap.add_argument("--tau-setup", default="tiny", help="setup whose measured tau is used without --baseline")
    ap.add_argument("--allow-extrapolation", action="store_true",
                    help="let budgets outside the measured verify-token range be chosen as best")
    args = ap.parse_args(argv)
    try:
        result = build(args.sweep, baseline=args.baseline, cost_setup=args.cost_setup, tau_setup=args.tau_setup,
                       allow_extrapolation=args.allow_extrapolation)
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
