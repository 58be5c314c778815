"""Reading the sweep's results file (written by the benchmark harness, ddtree_bench/results.py): JSON Lines,
appended and flushed one line at a time. The offline `auto` decoder's round-cost model reads a committed one.

Line kinds (field `kind`):
  run     one per invocation: run_id, date, GPU, commit, versions, argv, the plan (servers, waves, skipped rows)
  server  one per server start: name, setup, method, budget, args, start seconds or the error, server_info subset
  result  one per row attempt: key "setup|method|budget|batch", status ok | skipped | failed | interrupted, the
          reason when not ok, the row's signature (workload + server args), and the measured numbers when ok
A row is done when its latest result line is `ok` (or `failed`, unless the sweep is told to retry failures) with
the signature the current plan gives it; `skipped` rows are re-decided by every run; `interrupted` (deadline or
signal mid-row) is never done. Readers take the latest line per key.
"""

from __future__ import annotations

import json
from pathlib import Path


def read_rows(path: str | Path, *, strict: bool = False) -> list[dict]:
    """Every JSON object of the file, in order. A line that is not JSON can only be a write torn by a kill (the
    writer starts every line on a fresh one): it is skipped, or with strict=True raises ValueError with its number.
    A line that is JSON but not a row object always raises."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            if strict:
                raise ValueError(f"{path}:{n}: not valid JSON.") from None
            continue
        if not isinstance(obj, dict) or "kind" not in obj:
            raise ValueError(f"{path}:{n}: every line must be an object with a 'kind' field.")
        rows.append(obj)
    return rows


def latest_results(rows: list[dict]) -> dict[str, dict]:
    """key -> the last `result` line with that key."""
    out: dict[str, dict] = {}
    for row in rows:
        if row.get("kind") == "result":
            out[row["key"]] = row
    return out


def ok_results(rows: list[dict], setup: str | None = None) -> list[dict]:
    return [r for r in latest_results(rows).values()
            if r.get("status") == "ok" and (setup is None or r.get("setup") == setup)]


def load_ok_results(path: str | Path, setup: str | None = None) -> list[dict]:
    return ok_results(read_rows(path), setup)
