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

Committed result files over 100 KB are stored xz-compressed (`NAME.jsonl.xz`: they travel with every GPU call,
docs/gpu-suite.md section 5). Every reader of a result file goes through `stored_path` / `open_text`, so a caller may
name a file either way: `X.jsonl` finds `X.jsonl.xz` when only that is there, and a `.xz` name is decompressed.
"""

from __future__ import annotations

import json
import lzma
from pathlib import Path
from typing import TextIO

XZ_SUFFIX = ".xz"


def stored_path(path: str | Path) -> Path:
    """Where `path` is stored: itself when it exists, else its xz-compressed copy `<path>.xz` when that exists, else
    `path` unchanged (so a caller's own "does not exist" check still names what it asked for)."""
    path = Path(path)
    if path.exists() or path.suffix == XZ_SUFFIX:
        return path
    packed = path.with_name(path.name + XZ_SUFFIX)
    return packed if packed.exists() else path


def open_text(path: str | Path) -> TextIO:
    """The text of a result file (UTF-8), read through xz when it is stored as `.xz` (see stored_path)."""
    path = stored_path(path)
    if path.suffix == XZ_SUFFIX:
        return lzma.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def read_text(path: str | Path) -> str:
    """The whole text of a result file (see open_text); a damaged or cut `.xz` file raises ValueError."""
    try:
        with open_text(path) as fh:
            return fh.read()
    except (lzma.LZMAError, EOFError):
        raise ValueError(f"{path}: not a complete xz file.") from None


def read_rows(path: str | Path, *, strict: bool = False) -> list[dict]:
    """Every JSON object of the file, in order. A line that is not JSON can only be a write torn by a kill (the
    writer starts every line on a fresh one): it is skipped, or with strict=True raises ValueError with its number.
    A line that is JSON but not a row object always raises."""
    path = stored_path(path)
    if not path.exists():
        return []
    rows = []
    for n, line in enumerate(read_text(path).splitlines(), start=1):
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
