"""Summarise an offline baseline file (sglang-ddtree offline ...) into benchmarks/results/offline_*.json.

Per method: tau (tokens per verify round, bonus included), rounds, prompts, and whether every prompt's output equals
plain decoding's token for token; overall `lossless` is true only if all methods match on all prompts.

  python scripts/offline_summary.py runs/offline/humaneval_t0.jsonl benchmarks/results/offline_humaneval_t0.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sglang_ddtree.baseline import method_sort_key, read_baseline  # noqa: E402


def summarize(path: str) -> dict:
    base = read_baseline(path)
    plain = {r.prompt_id: r.output_ids for r in base.records if r.method == "plain"}
    methods: dict[str, dict] = {}
    for rec in base.records:
        m = methods.setdefault(rec.method, {"tokens": 0, "rounds": 0, "prompts": 0, "matches_plain": 0})
        m["tokens"] += sum(rec.accept_lengths)
        m["rounds"] += len(rec.accept_lengths)
        m["prompts"] += 1
        m["matches_plain"] += int(rec.output_ids == plain.get(rec.prompt_id))
    tau = {}
    for name in sorted(methods, key=method_sort_key):
        m = methods[name]
        if name != "plain":
            tau[name.replace("ddtree_tb", "ddtree_")] = m["tokens"] / m["rounds"]
    prompts = len(plain)
    return {
        "source": str(path),
        "header": {k: v for k, v in base.header.__dict__.items() if k in ("dataset", "max_new_tokens", "temperature",
                                                                           "dtype", "device", "target", "drafter")},
        "prompts": prompts,
        "lossless": all(m["matches_plain"] == prompts for m in methods.values()) and prompts > 0,
        "tau": tau,
        "methods": methods,
    }


def main(argv=None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    summary = summarize(args[0])
    Path(args[1]).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: summary[k] for k in ("prompts", "lossless", "tau")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
