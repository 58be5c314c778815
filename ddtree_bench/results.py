"""The sweep's results file, written here (ResultsWriter) and read by sglang_ddtree/results_file.py (the format: its
docstring; its readers are re-exported here for the harness)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from ddtree_bench.plan import METHODS
from sglang_ddtree.results_file import latest_results, load_ok_results, ok_results, read_rows  # noqa: F401

RESULTS_NAME = "bench_budgets.jsonl"
STATUSES = ("ok", "skipped", "failed", "interrupted")
_REPO = Path(__file__).resolve().parents[1]


def head_commit() -> str | None:
    """The checkout's HEAD commit (None outside a git checkout): names the code a one-file CPU bench measured."""
    return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=_REPO).stdout.strip() or None


def emit_result(result: dict, out: Path | None) -> None:
    """A one-file CPU bench's result: printed, and written to `out` when given (indented JSON, one trailing
    newline)."""
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


class ResultsWriter:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # A torn last line from a killed writer would glue onto the next one: start on a fresh line.
        if self.path.exists() and self.path.stat().st_size > 0:
            with open(self.path, "rb") as fh:
                fh.seek(-1, 2)
                torn = fh.read(1) != b"\n"
        else:
            torn = False
        self._fh = open(self.path, "a", encoding="utf-8")
        if torn:
            self._fh.write("\n")

    def write(self, obj: dict) -> None:
        if obj.get("kind") == "result" and obj.get("status") not in STATUSES:
            raise ValueError(f"result status must be one of {STATUSES}, got {obj.get('status')!r}.")
        self._fh.write(json.dumps(obj, separators=(",", ":"), default=str, allow_nan=True) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def row_tau(row: dict) -> float | None:
    """A row's acceptance for display: over all its runs where it has several (tau_pooled), else its run's."""
    return row.get("tau_pooled", row.get("tau"))


def format_table(rows: list[dict]) -> str:
    """One line per ok row: setup, method, budget, batch, decode tokens/s, step ms, tau (where meaningful; over all
    runs of a repeated row, row_tau)."""
    ok = sorted(ok_results(rows), key=lambda r: (r["setup"], METHODS.index(r["method"]),
                                                 r.get("budget") or 0, r["batch_size"]))
    lines = [f"{'setup':9} {'method':7} {'budget':>6} {'batch':>5} {'tok/s':>9} {'step ms':>8} {'tau':>5} "
             f"{'draft/tree/verify/walk/commit ms':>34}"]
    for r in ok:
        tau = f"{row_tau(r):.2f}" if row_tau(r) is not None and r.get("acceptance_meaningful") else "-"
        step = f"{r['step_ms']:.2f}" if r.get("step_ms") is not None else "-"
        stages = r.get("stage_ms") or {}
        split = "/".join(f"{stages[s]:.2f}" for s in ("draft", "tree", "verify", "walk", "commit") if s in stages)
        lines.append(f"{r['setup']:9} {r['method']:7} {r.get('budget') or '-':>6} {r['batch_size']:>5} "
                     f"{r['decode_tokens_per_s']:>9.1f} {step:>8} {tau:>5} {split:>34}")
    return "\n".join(lines)
