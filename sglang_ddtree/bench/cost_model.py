"""Cost model: fit DDTREE's step time at real size, combine it with acceptance, project the best budget per batch.

Step time. One DDTREE round at batch b and budget B verifies V = b * (B + 1) tokens. The fit is

    T(b, V) = a[b] + s1 * V + s2 * max(0, V - knee)        (milliseconds)

Why this shape and nothing richer:
  - a[b], one intercept per measured batch size: what a round costs whatever the tree size, i.e. reading the
    weights once, the drafter's block pass over b x 16 tokens, per-request KV reads, the tree-build and walk
    kernels' launch overhead, scheduling. It depends on b, not on B, and one free constant per batch size is
    the least structure that says so.
  - s1 * V: per verify token work while the verify is still bandwidth-bound (small);
  - s2 * max(0, V - knee): past the knee the forward is compute-bound (the GPU's ridge point: a few hundred to a
    few thousand tokens for an 8B model on an H200) and every token costs the full matmul and lm_head time.
  One knee shared by all batch sizes, because it is a property of the GPU and the model, not of the batch.
  That is b + 3 numbers for 4 x 7 measured points (fewer with the reduced sweep), monotone in V, and it
  interpolates the budgets the cost sweep did not run. Fitted by least squares on relative error (step times
  span 10 ms to 1 s) for a grid of knees (the measured V values), then a golden-section refinement of the knee.

Acceptance. tau(B) (mean tokens committed per round, bonus included) comes from the sweep's tiny setup (rounds
pooled over batch sizes: acceptance does not depend on the batch) or from a baseline file (docs/baseline-format.md:
our offline decoders, or the paper's reference output imported from .pt).

Projection: tokens/s(b, B) = b * tau(B) / T(b, b*(B+1)); DFLASH: b * tau_dflash / T_dflash(b) with DFLASH's
measured step time at real size; plain: its measured tokens/s at real size (one token per step whatever the
weights). Every number that combines a cost with an acceptance is labelled `projected`. Candidates whose V lies
outside the range measured at their batch size are marked `extrapolated` and are not chosen as best unless
--allow-extrapolation.

  python -m sglang_ddtree.bench.cost_model --sweep results.jsonl [--baseline offline.jsonl] --out best_budget.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sglang_ddtree.bench.results import load_ok_results

PROJECTED_NOTE = ("PROJECTED, not measured end to end: step times fitted on the cost setup (real-size shapes, random "
                  "weights) combined with acceptance (tau) from another source.")


# ------------------------------------------------------------------------------------------------------ the fit


@dataclass
class StepFit:
    intercept_ms: dict[int, float]  # a[b]
    slope_ms: float  # s1, per verify token
    slope2_ms: float  # s2, per verify token past the knee
    knee: float  # tokens; math.inf = no knee
    points: list[dict] = field(default_factory=list)  # batch, budget, verify_tokens, measured_ms, fitted_ms
    v_range: dict[int, tuple[float, float]] = field(default_factory=dict)  # per batch: measured verify tokens

    def measured(self, batch: int, verify_tokens: float) -> bool:
        """Inside the verify-token range measured at this batch size (the fit interpolates, never extrapolates)."""
        lo, hi = self.v_range.get(batch, (math.inf, -math.inf))
        return lo <= verify_tokens <= hi

    def intercept(self, batch: int) -> float:
        if batch in self.intercept_ms:
            return self.intercept_ms[batch]
        known = sorted(self.intercept_ms)
        if batch <= known[0]:
            return self.intercept_ms[known[0]]
        if batch >= known[-1]:
            return self.intercept_ms[known[-1]]
        hi = next(b for b in known if b > batch)
        lo = max(b for b in known if b < batch)
        w = (batch - lo) / (hi - lo)
        return (1 - w) * self.intercept_ms[lo] + w * self.intercept_ms[hi]

    def predict(self, batch: int, verify_tokens: float) -> float:
        hinge = max(0.0, verify_tokens - self.knee) if math.isfinite(self.knee) else 0.0
        return self.intercept(batch) + self.slope_ms * verify_tokens + self.slope2_ms * hinge

    def to_json(self) -> dict:
        rel = [(p["fitted_ms"] - p["measured_ms"]) / p["measured_ms"] for p in self.points]
        return {
            "model": "T_ms = a[batch] + s1 * V + s2 * max(0, V - knee), V = batch * (budget + 1)",
            "intercept_ms": {str(b): round(a, 4) for b, a in sorted(self.intercept_ms.items())},
            "slope_ms_per_token": self.slope_ms, "slope2_ms_per_token": self.slope2_ms,
            "knee_tokens": self.knee if math.isfinite(self.knee) else None,
            "points": len(self.points),
            "verify_tokens_range": {str(b): [int(lo), int(hi)] for b, (lo, hi) in sorted(self.v_range.items())},
            "rms_rel_err": math.sqrt(sum(r * r for r in rel) / len(rel)) if rel else None,
            "max_abs_rel_err": max((abs(r) for r in rel), default=None),
            "residuals": self.points,
        }


def _solve(batches, v, y, knee):
    """Weighted least squares (relative error) for a fixed knee; returns (loss, intercepts, s1, s2)."""
    levels = sorted(set(batches))
    cols = [[1.0 if b == lvl else 0.0 for b in batches] for lvl in levels]
    cols.append(list(v))
    use_knee = math.isfinite(knee)
    if use_knee:
        cols.append([max(0.0, x - knee) for x in v])
    x = np.array(cols, dtype=np.float64).T
    w = 1.0 / np.asarray(y, dtype=np.float64)
    coef, *_ = np.linalg.lstsq(x * w[:, None], np.asarray(y) * w, rcond=None)
    resid = (x @ coef - y) * w
    loss = float(resid @ resid)
    s2 = float(coef[len(levels) + 1]) if use_knee else 0.0
    return loss, dict(zip(levels, map(float, coef[: len(levels)]))), float(coef[len(levels)]), s2


def fit_step_time(points: list[tuple[int, int, float]]) -> StepFit:
    """points: (batch, budget, step_ms). Needs at least batch-levels + 2 points, and two budgets at some batch."""
    if not points:
        raise ValueError("no DDTREE step times to fit: the cost setup has no ok ddtree rows in the sweep file.")
    batches = [int(p[0]) for p in points]
    v = [float(p[0] * (p[1] + 1)) for p in points]
    y = [float(p[2]) for p in points]
    if any(t <= 0 or not math.isfinite(t) for t in y):
        raise ValueError("step times must be positive and finite.")
    n_params = len(set(batches)) + 1
    if len(points) < n_params + 1:
        raise ValueError(f"{len(points)} DDTREE points cannot fit {n_params} step-time parameters plus a knee; "
                         f"measure at least two budgets per batch size.")
    best = (_solve(batches, v, y, math.inf), math.inf)
    if len(points) >= n_params + 2:  # enough for the knee's slope too
        knots = sorted(set(v))
        for k in knots[:-1]:
            cand = (_solve(batches, v, y, k), k)
            if cand[0][0] < best[0][0] - 1e-12:
                best = cand
        if math.isfinite(best[1]):
            i = knots.index(best[1])
            lo, hi = knots[max(0, i - 1)], knots[min(len(knots) - 1, i + 1)]
            best = min([best, _golden(batches, v, y, lo, hi)], key=lambda c: c[0][0])
    (loss, intercepts, s1, s2), knee = best
    ranges = {b: (min(x for bb, x in zip(batches, v) if bb == b), max(x for bb, x in zip(batches, v) if bb == b))
              for b in set(batches)}
    fit = StepFit(intercepts, s1, s2, knee, v_range=ranges)
    fit.points = [{"batch_size": b, "budget": p[1], "verify_tokens": int(x), "measured_ms": t,
                   "fitted_ms": round(fit.predict(b, x), 4)} for b, p, x, t in zip(batches, points, v, y)]
    return fit


def _golden(batches, v, y, lo, hi, iters: int = 60):
    phi = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - phi * (b - a), a + phi * (b - a)
    fc, fd = _solve(batches, v, y, c), _solve(batches, v, y, d)
    for _ in range(iters):
        if fc[0] < fd[0]:
            b, d, fd = d, c, fc
            c = b - phi * (b - a)
            fc = _solve(batches, v, y, c)
        else:
            a, c, fc = c, d, fd
            d = a + phi * (b - a)
            fd = _solve(batches, v, y, d)
    return (fc, c) if fc[0] < fd[0] else (fd, d)


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


def tau_from_baseline(path: str | Path) -> dict:
    """Same shape from a baseline file (.jsonl) or the paper's reference output (.pt, needs torch)."""
    from sglang_ddtree import baseline as bl

    data = bl.import_reference(path) if str(path).endswith(".pt") else bl.read_baseline(path)
    sums: dict[str, list[int]] = {}
    for rec in data.records:
        if rec.accept_lengths:
            s = sums.setdefault(rec.method, [0, 0])
            s[0] += sum(rec.accept_lengths)
            s[1] += len(rec.accept_lengths)
    out: dict = {"ddtree": {}, "dflash": None}
    for method, (tokens, rounds) in sums.items():
        kind, budget = bl.parse_method(method)
        if kind == "ddtree":
            out["ddtree"][budget] = tokens / rounds
        elif kind == "dflash":
            out["dflash"] = tokens / rounds
    if not out["ddtree"]:
        raise ValueError(f"{path}: no ddtree_tb<B> records with accept_lengths; nothing to project.")
    return out


# -------------------------------------------------------------------------------------------------- projection


def _by_batch(rows: list[dict], method: str, field_name: str) -> dict[int, float]:
    return {int(r["batch_size"]): float(r[field_name]) for r in rows
            if r.get("method") == method and r.get(field_name) is not None}


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
                            dflash_step_ms=_by_batch(cost_rows, "dflash", "step_ms"),
                            plain_tokens_per_s=_by_batch(cost_rows, "plain", "decode_tokens_per_s"),
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
