"""Per-round DDTree statistics, their aggregation, JSONL dumps and Prometheus text exposition.

Definitions (used everywhere: offline decoders, the SGLang worker, the comparator, the benchmarks):
- accept_len: tokens emitted in one round = accepted draft nodes + the bonus token (>= 1). tau is its mean.
- depth reached: accepted draft nodes = accept_len - 1.
- branch: an accepted node whose token is not the drafter's top-1 at its depth (rank != 0). A chain never branches.
- expected_accept: 1 + the sum of exp(score) over the draft nodes: the accept_len the drafter itself expects, since a
  node is accepted with the probability of its whole prefix if the target behaves like the drafter.
- tree fill: draft nodes in the tree / budget (below 1 when pruning or a small vocabulary cuts the tree).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

import torch

from sglang_ddtree.tree import DraftTree
from sglang_ddtree.walk import WalkResult


@dataclass
class RoundRecord:
    accept_len: int
    branch_taken: list[bool]  # one entry per accepted depth 1..accept_len-1
    tree_size: int
    max_depth: int
    expected_accept: float
    budget: int | None = None
    stage_ms: dict[str, float] = field(default_factory=dict)

    @property
    def depth_reached(self) -> int:
        return self.accept_len - 1

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict) -> "RoundRecord":
        return cls(**{k: obj[k] for k in cls.__dataclass_fields__ if k in obj})


def records_from_round(
    tree: DraftTree, walk: WalkResult, budget: int | None = None, stage_ms: dict[str, float] | None = None
) -> list[RoundRecord]:
    """One record per request of a verified round. Copies to the host: call it off the hot path."""
    accepted_ranks = tree.ranks.gather(1, walk.path.clamp(min=0)).cpu().tolist()
    accept_len = walk.accept_len.cpu().tolist()
    tree_size = (tree.num_nodes - 1).cpu().tolist()
    max_depth = torch.where(tree.valid, tree.depth, 0).max(dim=1).values.cpu().tolist()
    expected = tree.expected_tokens().cpu().tolist()
    records = []
    for b in range(tree.batch_size):
        k = accept_len[b]
        records.append(RoundRecord(
            accept_len=k + 1,
            branch_taken=[r != 0 for r in accepted_ranks[b][1:k + 1]],
            tree_size=tree_size[b],
            max_depth=max_depth[b],
            expected_accept=expected[b],
            budget=budget,
            stage_ms=dict(stage_ms or {}),
        ))
    return records


def aggregate(records: Iterable[RoundRecord], depth_limit: int | None = None) -> dict:
    """Summary statistics over rounds (all requests pooled)."""
    records = list(records)
    if not records:
        return {"rounds": 0, "tokens": 0, "tau": float("nan")}
    lens = [r.accept_len for r in records]
    depth_limit = depth_limit or max(max(lens) - 1, max(r.max_depth for r in records), 1)
    n = len(records)
    reached = [sum(1 for r in records if r.depth_reached >= d) for d in range(depth_limit + 1)]
    branches_at = [sum(1 for r in records if r.depth_reached >= d and r.branch_taken[d - 1])
                   for d in range(1, depth_limit + 1)]
    accepted_nodes = sum(r.depth_reached for r in records)
    stage_names = sorted({s for r in records for s in r.stage_ms})
    budgets = [r.budget for r in records if r.budget]
    summary = {
        "rounds": n,
        "tokens": sum(lens),
        "tau": sum(lens) / n,
        "tau_std": statistics.pstdev(lens) if n > 1 else 0.0,
        "accept_len_hist": {str(k): lens.count(k) for k in range(1, depth_limit + 2)},
        # P(at least d draft tokens accepted in a round)
        "accept_rate_by_depth": [reached[d] / n for d in range(1, depth_limit + 1)],
        # P(depth d accepted | depth d-1 accepted)
        "conditional_accept_by_depth": [
            reached[d] / reached[d - 1] if reached[d - 1] else float("nan") for d in range(1, depth_limit + 1)
        ],
        "branch_accept_rate": (sum(branches_at) / accepted_nodes) if accepted_nodes else 0.0,
        "branch_rate_by_depth": [
            branches_at[d - 1] / reached[d] if reached[d] else float("nan") for d in range(1, depth_limit + 1)
        ],
        "mean_tree_size": sum(r.tree_size for r in records) / n,
        "mean_max_depth": sum(r.max_depth for r in records) / n,
        "mean_expected_accept": sum(r.expected_accept for r in records) / n,
        "stage_ms_mean": {s: sum(r.stage_ms.get(s, 0.0) for r in records) / n for s in stage_names},
    }
    if budgets and len(budgets) == n:
        summary["tree_fill"] = sum(r.tree_size / r.budget for r in records) / n
    return summary


class JsonlWriter:
    """Append-only JSONL file with one header line; flushes every line so a crash loses at most one round."""

    def __init__(self, path: str | Path, header: dict | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        if header is not None and self.path.stat().st_size == 0:
            self.write({"type": "header", **header})

    def write(self, obj: dict) -> None:
        self._file.write(json.dumps(obj, separators=(",", ":"), default=_json_default) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "JsonlWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _json_default(obj):
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def read_jsonl(path: str | Path) -> list[dict]:
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def prometheus_text(summary: dict, prefix: str = "ddtree", labels: dict[str, str] | None = None) -> str:
    """Prometheus text exposition of an `aggregate` summary (gauges; per-depth values get a `depth` label)."""
    base = ",".join(f'{k}="{v}"' for k, v in sorted((labels or {}).items()))

    def series(name: str, value: float, extra: str = "", help_text: str | None = None) -> list[str]:
        label = ",".join(x for x in (base, extra) if x)
        out = [f"# HELP {prefix}_{name} {help_text}", f"# TYPE {prefix}_{name} gauge"] if help_text else []
        value = float("nan") if value is None else value
        out.append(f"{prefix}_{name}{{{label}}} {value}" if label else f"{prefix}_{name} {value}")
        return out

    lines: list[str] = []
    lines += series("tau", summary.get("tau", float("nan")), help_text="mean tokens per round (accepted + bonus)")
    lines += series("rounds", summary.get("rounds", 0), help_text="verified rounds")
    lines += series("branch_accept_rate", summary.get("branch_accept_rate", 0.0),
                    help_text="accepted nodes that were not the drafter's top-1")
    lines += series("mean_tree_size", summary.get("mean_tree_size", 0.0), help_text="draft nodes per tree")
    for i, rate in enumerate(summary.get("accept_rate_by_depth", []), start=1):
        lines += series("accept_rate_by_depth", rate, f'depth="{i}"',
                        help_text="P(at least depth tokens accepted)" if i == 1 else None)
    for i, (stage, ms) in enumerate(summary.get("stage_ms_mean", {}).items()):
        lines += series("stage_ms", ms, f'stage="{stage}"', help_text="mean ms per round" if i == 0 else None)
    return "\n".join(lines) + "\n"
