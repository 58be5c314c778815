"""Run every planted decoder bug (sglang_ddtree/offline/planted_bugs.py) through the CI correctness check and
write what `compare` said: benchmarks/results/compare_planted_bugs.json.

Per bug: the DDTree methods of the check (budgets 16 and 64) decoded with the bug on, compared with the committed
baselines in our format and in the reference's file shape; `caught` when every comparison fails, `called_noise`
the differences a comparison classed as noise (0 expected: float32 exact decoders on both sides), and the first
bad prompt and round each comparison names; for contrast, what the margin rule at 0.5 (compare's rule before it
chose by what is compared) calls noise against our baseline. The clean decoder is run the same way and must pass.

  python scripts/planted_bugs.py [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BUG_METHODS = ("ddtree_tb16", "ddtree_tb64")


def evaluate(pair=None, bugs=None) -> dict:
    """{"bugs": {name: {...}}, "clean": {...}, caught / total / called_noise} (see the module docstring)."""
    from sglang_ddtree.baseline import read_baseline
    from sglang_ddtree.compare import Thresholds
    from sglang_ddtree.offline import correctness as cc
    from sglang_ddtree.offline.planted_bugs import BUGS

    pair = pair or cc.TinyPair()
    baselines = {"ours": read_baseline(cc.OURS_PATH), "reference": cc.load_reference_baseline()}

    def one(bug):
        run = pair.decode(BUG_METHODS, bug=bug)
        reports = cc.check(run, baselines, methods=list(BUG_METHODS))
        # for contrast: the rule compare used before it looked at what is compared (larger margin < 0.5: noise)
        old = cc.check(run, {"ours": baselines["ours"]}, methods=list(BUG_METHODS),
                       thresholds=Thresholds(rule="margin", noise_margin=0.5))["ours"]
        per = {}
        for name, rep in reports.items():
            firsts = [(m, r["first_bug"]) for m, r in rep["methods"].items() if r.get("first_bug")]
            per[name] = {"passed": rep["passed"], "rule": rep["rule"]["name"], "called_noise": cc.called_noise(rep),
                         "first_bug": ({"method": firsts[0][0], **firsts[0][1]} if firsts else None),
                         "failures": rep["failures"][:4]}
        per["ours"]["margin_rule_0.5_called_noise"] = cc.called_noise(old)
        per["ours"]["margin_rule_0.5_passed"] = old["passed"]
        return per

    out = {"bugs": {}, "methods": list(BUG_METHODS), "prompts": [p.id for p in pair.prompts],
           "max_new_tokens": cc.CHECK.max_new_tokens}
    clean = one(None)
    out["clean"] = {"passed": all(v["passed"] for v in clean.values()), "comparisons": clean}
    for bug in bugs or BUGS:
        per = one(bug)
        out["bugs"][bug] = {"caught": all(not v["passed"] for v in per.values()),
                            "called_noise": sum(v["called_noise"] for v in per.values()), "comparisons": per}
    out["total"] = len(out["bugs"])
    out["caught"] = sum(1 for v in out["bugs"].values() if v["caught"])
    out["called_noise"] = sum(v["called_noise"] for v in out["bugs"].values())
    return out


def main(argv: list[str] | None = None) -> int:
    from ddtree_bench.results import emit_result, head_commit

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "benchmarks" / "results"
                                         / "compare_planted_bugs.json"))
    args = ap.parse_args(argv)
    result = {"what": "planted decoder bugs through the CI correctness check (scripts/planted_bugs.py)",
              "commit": head_commit(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              **evaluate()}
    emit_result(result, Path(args.out))
    return 0 if result["clean"]["passed"] and result["caught"] == result["total"] else 1


if __name__ == "__main__":
    sys.exit(main())
