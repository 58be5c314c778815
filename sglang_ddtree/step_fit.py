"""The step-time fit of a DDTREE round from a sweep's measured step times: what the offline `auto` decoder's
round-cost model (round_cost.py) and the harness's budget projection (ddtree_bench/cost_model.py) both stand on.

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


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


def by_batch(rows: list[dict], method: str, field_name: str) -> dict[int, float]:
    """{batch size: the field} of a method's rows (rows without it left out)."""
    return {int(r["batch_size"]): float(r[field_name]) for r in rows
            if r.get("method") == method and r.get(field_name) is not None}
