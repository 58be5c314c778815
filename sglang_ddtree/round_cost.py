"""The round-cost model of `auto`'s offline evaluation: what a round of each candidate costs at a batch size, from a
committed sweep's step-time fit (step_fit.py) and the kernel bench's top-K and tree times, and the candidate
windows it implies. Offline only (offline/auto.py, scripts/adaptive_eval.py): the server measures its own rounds.
Its default inputs are the checkout's committed results (benchmarks/results/)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from sglang_ddtree.adaptive import CHAIN, candidate_label
from sglang_ddtree.results_file import load_ok_results
from sglang_ddtree.step_fit import by_batch, fit_step_time


REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SWEEP = REPO_ROOT / "benchmarks" / "results" / "sweep_h200.jsonl"
DEFAULT_KERNELS = REPO_ROOT / "benchmarks" / "results" / "tree_kernels_h200.json"
KERNEL_PREFIX = "triton_sort_graph"  # the shipped Triton tree kernel, CUDA-graph replay timings


@dataclass
class KernelCosts:
    """Measured per-round costs (ms) of the top-K and tree-build kernels by (batch, budget); bench_tree.py rows.

    Linear interpolation in budget between measured budgets, and in batch size between measured batch sizes;
    beyond the measured batch sizes the last two points are extrapolated linearly (`extrapolated` says when).
    """

    topk_ms: dict[int, dict[int, float]] = field(default_factory=dict)  # batch -> budget -> ms
    tree_ms: dict[int, dict[int, float]] = field(default_factory=dict)
    source: str | None = None

    @classmethod
    def load(cls, path: str | Path = DEFAULT_KERNELS, prefix: str = KERNEL_PREFIX) -> "KernelCosts":
        data = json.loads(Path(path).read_text())
        out = cls(source=str(path))
        for r in data["rows"]:
            if r.get("device") != "cuda" or f"{prefix}_tree_ms" not in r:
                continue
            b, budget = int(r["batch_size"]), int(r["budget"])
            out.topk_ms.setdefault(b, {})[budget] = float(r[f"{prefix}_topk_ms"])
            out.tree_ms.setdefault(b, {})[budget] = float(r[f"{prefix}_tree_ms"])
        if not out.tree_ms:
            raise ValueError(f"{path}: no CUDA rows with {prefix}_* timings.")
        return out

    @staticmethod
    def _interp(points: dict[float, float], x: float) -> float:
        """Piecewise linear through the points; clamped below the first, extrapolated from the last two above."""
        xs = sorted(points)
        if len(xs) == 1 or x <= xs[0]:
            return points[xs[0]]
        if x >= xs[-1]:
            lo, hi = xs[-2], xs[-1]
        else:
            hi = next(v for v in xs if v >= x)
            lo = max(v for v in xs if v < x)
        w = (x - lo) / (hi - lo)
        return max(0.0, (1 - w) * points[lo] + w * points[hi])

    def _at(self, table: dict[int, dict[int, float]], batch: int, budget: int) -> float:
        if budget <= 0:
            return 0.0
        per_batch = {b: self._interp({float(k): v for k, v in row.items()}, float(budget)) for b, row in table.items()}
        return self._interp({float(b): v for b, v in per_batch.items()}, float(batch))

    def topk(self, batch: int, budget: int) -> float:
        return self._at(self.topk_ms, batch, budget)

    def tree(self, batch: int, budget: int) -> float:
        return self._at(self.tree_ms, batch, budget)

    def extrapolated(self, batch: int) -> bool:
        return batch > max(self.tree_ms) or batch < min(self.tree_ms)


@dataclass
class RoundCost:
    """Predicted round time (ms) of each candidate at a batch size, on the machine the sweep measured.

    tree candidate B:  StepFit T(b, b*(B+1))  [the DDTREE step at a fixed budget B, its own top-K and tree build
                       included] + decision overhead: build at B_max instead of B (top-K and tree kernels,
                       measured) + `decide_ms`.
    chain candidate:   DFLASH's measured step at b + top-K and tree build at B_max + `decide_ms` (the round had to
                       build the tree to know the chain was best).
    With one candidate only there is no decision and no overhead (the fixed method's own cost).
    `overhead=False` drops the decision overhead (the cost model alone).
    """

    fit: object  # step_fit.StepFit
    dflash_step_ms: dict[int, float]
    kernels: KernelCosts | None = None
    decide_ms: float = 0.02
    overhead: bool = True
    sweep: str | None = None

    @classmethod
    def from_sweep(cls, sweep: str | Path = DEFAULT_SWEEP, *, cost_setup: str = "8b-dummy",
                   kernels: str | Path | None = DEFAULT_KERNELS, **kw) -> "RoundCost":
        rows = load_ok_results(sweep, cost_setup)
        points = [(int(r["batch_size"]), int(r["budget"]), float(r["step_ms"])) for r in rows
                  if r["method"] == "ddtree" and r.get("step_ms")]
        fit = fit_step_time(points)
        dflash = by_batch(rows, "dflash", "step_ms")
        if not dflash:
            raise ValueError(f"{sweep}: no DFLASH step times in setup {cost_setup!r}; the chain candidate has no cost.")
        return cls(fit=fit, dflash_step_ms=dflash, kernels=KernelCosts.load(kernels) if kernels else None,
                   sweep=str(sweep), **kw)

    def dflash_ms(self, batch: int) -> float:
        pts = {float(b): v for b, v in self.dflash_step_ms.items()}
        if batch in self.dflash_step_ms:
            return self.dflash_step_ms[batch]
        return KernelCosts._interp(pts, float(batch))

    def fixed_ms(self, batch: int, budget: int) -> float:
        """A fixed method's round (no decision): DDTREE at budget B from the fit, or DFLASH (budget CHAIN)."""
        if budget == CHAIN:
            return self.dflash_ms(batch)
        return float(self.fit.predict(batch, batch * (budget + 1)))

    def overhead_ms(self, batch: int, budget: int, candidates: Sequence[int]) -> float:
        if not self.overhead or len(candidates) < 2:
            return 0.0
        bmax = max(candidates)
        extra = self.decide_ms
        if self.kernels is not None:
            own = 0 if budget == CHAIN else budget
            extra += max(0.0, self.kernels.topk(batch, bmax) - self.kernels.topk(batch, own))
            extra += max(0.0, self.kernels.tree(batch, bmax) - self.kernels.tree(batch, own))
        return extra

    def round_ms(self, batch: int, candidates: Sequence[int]) -> list[float]:
        return [self.fixed_ms(batch, b) + self.overhead_ms(batch, b, candidates) for b in candidates]

    def describe(self, batch: int, candidates: Sequence[int]) -> dict:
        return {
            "batch_size": batch,
            "candidates": [candidate_label(b) for b in candidates],
            "round_ms": [round(x, 4) for x in self.round_ms(batch, candidates)],
            "fixed_ms": [round(self.fixed_ms(batch, b), 4) for b in candidates],
            "overhead_ms": [round(self.overhead_ms(batch, b, candidates), 4) for b in candidates],
            "extrapolated": {
                "step_fit": [b != CHAIN and not self.fit.measured(batch, batch * (b + 1)) for b in candidates],
                "kernels": self.kernels.extrapolated(batch) if self.kernels else None,
                "dflash": batch not in self.dflash_step_ms,
            },
        }


def prune_candidates(cost: RoundCost, batch: int, candidates: Sequence[int], max_gain: float = 2.0) -> list[int]:
    """Prior-free pruning: drop a budget whose fixed round costs more than `max_gain` x the chain's, since its tree
    would have to commit more than max_gain x the chain's tokens, which a drafter's tree does not do on average
    (tau(1024) / tau(chain) = 1.9 on the tiny pair). Static per batch size (host side, once). Removing candidates
    also lowers B_max, hence the decision overhead; when only the chain is left there is no decision at all."""
    chain_ms = cost.fixed_ms(batch, CHAIN)
    return [b for b in candidates if b == CHAIN or cost.fixed_ms(batch, b) <= max_gain * chain_ms]


def tau_from_baseline(path: str | Path) -> dict:
    """{"ddtree": {budget: tau}, "dflash": tau} (tau: mean committed tokens a round) from a baseline file (.jsonl) or
    the paper's reference output (.pt, needs torch)."""
    from sglang_ddtree.baseline import parse_method, read_baseline
    from sglang_ddtree.reference_import import import_reference

    data = import_reference(path) if str(path).endswith(".pt") else read_baseline(path)
    sums: dict[str, list[int]] = {}
    for rec in data.records:
        if rec.accept_lengths:
            s = sums.setdefault(rec.method, [0, 0])
            s[0] += sum(rec.accept_lengths)
            s[1] += len(rec.accept_lengths)
    out: dict = {"ddtree": {}, "dflash": None}
    for method, (tokens, rounds) in sums.items():
        kind, budget = parse_method(method)
        if kind == "ddtree":
            out["ddtree"][budget] = tokens / rounds
        elif kind == "dflash":
            out["dflash"] = tokens / rounds
    if not out["ddtree"]:
        raise ValueError(f"{path}: no ddtree_tb<B> records with accept_lengths; nothing to project.")
    return out


def load_tau_prior(path: str | Path) -> dict[int, float]:
    """A prior acceptance curve {CHAIN or budget: tau} for `candidate_window`, from a baseline file (.jsonl: tau of
    its dflash / ddtree_tb<B> records), an adaptive_eval.py result (its warm-up's tau_prior) or a JSON object
    {"chain": tau, "16": tau, ...}."""
    path = Path(path)
    if path.suffix == ".jsonl":
        t = tau_from_baseline(path)
        out = {int(b): float(v) for b, v in t["ddtree"].items()}
        if t.get("dflash") is not None:
            out[CHAIN] = float(t["dflash"])
        return out
    data = json.loads(path.read_text())
    if isinstance(data, dict) and "runs" in data:
        data = data["runs"]["warmup"]["tau_prior"]
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{path}: expected a JSON object {{'chain': tau, '16': tau, ...}}.")
    return {(CHAIN if str(k).lower() in ("chain", "dflash") else int(k)): float(v) for k, v in data.items()}


def candidate_window(cost: RoundCost, batch: int, candidates: Sequence[int], tau: dict[int, float],
                     tolerance: float = 0.05, allow_extrapolated: bool = False) -> list[int]:
    """Candidates worth deciding between at this batch size, from a prior acceptance curve tau[b] (b: CHAIN or a
    budget; e.g. measured on warm-up rounds with `subtree_accept_lengths`): the chain, plus the budgets whose
    projected tokens/s = tau[b] / fixed round time is within `tolerance` of the best candidate's. Budgets whose
    verify size lies outside the sweep's measured range at this batch size are left out unless allow_extrapolated.

    Why: every round pays for the decision (top-K and tree build at the largest candidate); a budget whose average
    rate is clearly below the best one rarely wins a round, so it only makes every round dearer. The chain always
    stays, so no tree is ever forced; when it is left alone, there is no decision and no overhead (the chain is the
    DFLASH path)."""
    rates = {}
    for b in candidates:
        if b not in tau:
            continue
        if b != CHAIN and not allow_extrapolated and not cost.fit.measured(batch, batch * (b + 1)):
            continue
        rates[b] = tau[b] / cost.fixed_ms(batch, b)
    if not rates:
        return [CHAIN]
    best = max(rates.values())
    return sorted({CHAIN} | {b for b, r in rates.items() if r >= (1 - tolerance) * best})
