"""Regenerate benchmarks/results/summary.json (one flat JSON object) from the raw result files.

Never edit summary.json by hand: every figure in it is read from a committed raw result file by an extractor below.
A figure whose raw file is missing is left out (and listed under `missing`), never guessed.

  python scripts/make_summary.py            # rewrite benchmarks/results/summary.json
  python scripts/make_summary.py --check    # exit 1 if summary.json is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def _load(name: str):
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def _row(rows, **match):
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def tree_stages(out: dict) -> None:
    """Issue 2: build (top-K + tree) + layout + walk on the H200, median ms of one CUDA-graph replay, batch 1, with
    the shipped kernels (`triton_sort_*` in tree_kernels_h200.json: that run also timed an alternative kernel)."""
    data = _load("tree_kernels_h200.json")
    if data is None:
        raise FileNotFoundError("tree_kernels_h200.json")
    for budget in (256, 1024):
        row = _row(data["rows"], batch_size=1, budget=budget)
        out[f"tree_stages_ms_h200_b{budget}_bs1"] = round(row["triton_sort_graph_all_ms"], 4)


def tiny_pair(out: dict) -> None:
    """Issue 3: the committed tiny pair's size, held-out perplexity and offline chain tau on HumanEval."""
    root = RESULTS.parents[1] / "models" / "tiny"
    files = [p for p in root.rglob("*") if p.is_file()]
    if not files:
        raise FileNotFoundError("models/tiny")
    out["tiny_pair_bytes"] = sum(p.stat().st_size for p in files)
    log = json.loads((root / "training_log.json").read_text())
    out["tiny_target_heldout_ppl"] = round(log["target"]["heldout_ppl"], 3)


def offline(out: dict) -> None:
    """Issue 4: offline decoders on HumanEval, T=0."""
    data = _load("offline_humaneval_t0.json")
    if data is None:
        raise FileNotFoundError("offline_humaneval_t0.json")
    out["offline_lossless_t0"] = bool(data["lossless"])
    out["offline_prompts"] = int(data["prompts"])
    out["offline_tau_humaneval_t0"] = {k: round(v, 4) for k, v in data["tau"].items()}
    if "dflash" in data["tau"]:
        out["tiny_dflash_tau_humaneval_t0"] = round(data["tau"]["dflash"], 4)


EXTRACTORS = [tree_stages, tiny_pair, offline]


def build() -> dict:
    out: dict = {}
    missing = []
    for extract in EXTRACTORS:
        try:
            extract(out)
        except FileNotFoundError as e:
            missing.append(f"{extract.__name__}: {e}")
    out["missing"] = missing
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="fail if summary.json differs from what the raw files say")
    args = ap.parse_args(argv)
    summary = build()
    text = json.dumps(summary, indent=1, sort_keys=True) + "\n"
    path = RESULTS / "summary.json"
    if args.check:
        current = path.read_text() if path.exists() else ""
        if current != text:
            print("summary.json is stale: run python scripts/make_summary.py", file=sys.stderr)
            return 1
        return 0
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
