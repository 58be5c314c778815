"""Run every planted decoder bug (sglang_ddtree/offline/planted_bugs.py) through the CI correctness check and
write what `compare` said: benchmarks/results/compare_planted_bugs.json.

Per bug: the DDTree methods of the check (budgets 16 and 64) decoded with the bug on, compared with the committed
baselines in our format and in the reference's file shape; `caught` when every comparison fails, `called_noise`
the differences a comparison classed as noise (0 expected: float32 exact decoders on both sides), and the first
bad prompt and round each comparison names; for contrast, what the margin rule at 0.5 (compare's rule before it
chose by what is compared) calls noise against our baseline. The clean decoder is run the same way and must pass.

Bugs that only sampling shows (SAMPLED_BUGS) are run at T > 0 (`SAMPLED`): the check's prompts, each sampled
`repeats` times (other prompt indices, so other random streams), decoded with seed 0 as the baseline; the clean
decoder with seed 1 must pass against it and each bug with seed 1 must fail (compare's T > 0 tests of acceptance
per depth and token frequencies; their p-values are recorded).

  python scripts/planted_bugs.py [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BUG_METHODS = ("ddtree_tb16", "ddtree_tb64")
SAMPLED = {"method": "ddtree_tb16", "temperature": 0.6, "repeats": 12, "max_new_tokens": 64}


def sampled_run(pair, seed: int, bug: str | None = None):
    """The SAMPLED run of the tiny pair (a Baseline), optionally with a planted bug."""
    import contextlib

    from sglang_ddtree.baseline import Baseline
    from sglang_ddtree.offline import correctness as cc
    from sglang_ddtree.offline.planted_bugs import planted
    from sglang_ddtree.offline.runner import PromptInput, RunSettings, decode_one

    n, m = SAMPLED["max_new_tokens"], SAMPLED["method"]
    prompts = [PromptInput(f"{p.id}#{r}", r * 1000 + p.index, p.token_ids)
               for r in range(SAMPLED["repeats"]) for p in pair.prompts]
    s = RunSettings(methods=[m], max_new_tokens=n, temperature=SAMPLED["temperature"], seed=seed,
                    eos_token_ids=pair.eos)
    with cc.one_thread(), (planted(bug) if bug else contextlib.nullcontext()):
        records = [decode_one(pair.target, pair.draft, p, m, s) for p in prompts]
    for r in records:
        r.stage_ms, r.prefill_ms, r.total_ms = None, None, None
    header = pair.header(n)
    header.temperature, header.seed = SAMPLED["temperature"], seed
    return Baseline(header, records)


def evaluate_sampled(pair, bugs) -> dict:
    """{"settings", "clean": {...}, "bugs": {name: {...}}} (see the module docstring)."""
    from sglang_ddtree.compare import compare

    base = sampled_run(pair, seed=0)

    def one(bug):
        rep = compare(base, sampled_run(pair, seed=1, bug=bug), n_boot=200)
        r = rep["methods"][SAMPLED["method"]]
        s = r.get("sampled") or {}
        return {"passed": rep["passed"], "failures": rep["failures"][:4],
                "divergence_counts": r.get("divergence_counts"),
                "tau": {k: r["tau"][k] for k in ("baseline", "candidate", "diff_ci95")},
                "alpha_per_test": s.get("alpha"), "not_judged": s.get("not_judged"),
                "p": {name: t["p"] for name, t in (s.get("tests") or {}).items()}}

    out = {"settings": {**SAMPLED, "prompts": SAMPLED["repeats"] * len(pair.prompts), "baseline_seed": 0,
                        "candidate_seed": 1},
           "clean": one(None), "bugs": {}}
    for bug in bugs:
        res = one(bug)
        out["bugs"][bug] = {"caught": not res["passed"], **res}
    return out


def evaluate(pair=None, bugs=None) -> dict:
    """{"bugs": {name: {...}}, "clean": {...}, caught / total / called_noise} (see the module docstring)."""
    from sglang_ddtree.baseline import read_baseline
    from sglang_ddtree.compare import Thresholds
    from sglang_ddtree.offline import correctness as cc
    from sglang_ddtree.offline.planted_bugs import BUGS, SAMPLED_BUGS

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
    for bug in (b for b in bugs or BUGS if b in BUGS):
        per = one(bug)
        out["bugs"][bug] = {"caught": all(not v["passed"] for v in per.values()),
                            "called_noise": sum(v["called_noise"] for v in per.values()), "comparisons": per}
    sampled_bugs = [b for b in bugs or SAMPLED_BUGS if b in SAMPLED_BUGS]
    if sampled_bugs:
        out["sampled"] = evaluate_sampled(pair, sampled_bugs)
        out["clean"]["passed"] = out["clean"]["passed"] and out["sampled"]["clean"]["passed"]
    caught = [v["caught"] for v in out["bugs"].values()] + [v["caught"] for v in out.get("sampled", {}).get(
        "bugs", {}).values()]
    out["total"] = len(caught)
    out["caught"] = sum(caught)
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
