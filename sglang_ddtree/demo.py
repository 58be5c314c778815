"""`sglang-ddtree demo`: the main job on the embedded default (the committed tiny pair, CPU when no GPU).

Runs plain decoding, the DFLASH chain and DDTree at a few budgets over HumanEval prompts with the offline reference
decoders, checks losslessness (every method's tokens == plain decoding's, T=0), and prints tau and tokens/s per
method. Writes the baseline JSONL and a summary JSON under --out. Exit code 1 if any method is not lossless.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def run_demo(args) -> int:
    from sglang_ddtree.baseline import read_baseline
    from sglang_ddtree.offline.cli_commands import add_offline_parser, cmd_offline

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    baseline_path = out_dir / "baseline.jsonl"
    parser = argparse.ArgumentParser()
    add_offline_parser(parser.add_subparsers())
    offline_args = ["offline", "--tiny", "--dataset", "humaneval", "--limit", str(args.prompts),
                    "--methods", "plain,dflash,ddtree", "--budgets", args.budgets,
                    "--max-new-tokens", str(args.max_new_tokens), "--out", str(baseline_path), "--no-resume"]
    if args.device:
        offline_args += ["--device", args.device]
    rc = cmd_offline(parser.parse_args(offline_args))
    if rc:
        return rc

    base = read_baseline(baseline_path)
    by_method: dict[str, dict] = {}
    plain = {r.prompt_id: r.output_ids for r in base.records if r.method == "plain"}
    for rec in base.records:
        m = by_method.setdefault(rec.method, {"tokens": 0, "accepted": 0, "rounds": 0, "ms": 0.0,
                                              "lossless": True})
        m["tokens"] += len(rec.output_ids)
        m["accepted"] += sum(rec.accept_lengths)
        m["rounds"] += len(rec.accept_lengths)
        m["ms"] += rec.total_ms or 0.0
        m["lossless"] &= rec.output_ids == plain.get(rec.prompt_id)
    summary = {}
    print(f"\n{'method':<14}{'tau':>8}{'tokens/s':>11}{'vs plain':>10}  lossless")
    plain_tps = by_method["plain"]["tokens"] / (by_method["plain"]["ms"] / 1e3)
    for name, m in by_method.items():
        tps = m["tokens"] / (m["ms"] / 1e3) if m["ms"] else float("nan")
        tau = m["accepted"] / m["rounds"] if m["rounds"] else 1.0
        summary[name] = {"tau": tau, "tokens_per_s": tps, "speedup_vs_plain": tps / plain_tps,
                         "lossless": m["lossless"]}
        print(f"{name:<14}{tau:>8.2f}{tps:>11.1f}{tps / plain_tps:>9.2f}x  {'yes' if m['lossless'] else 'NO'}")
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"\nwrote {baseline_path} and {out_dir / 'summary.json'}")
    print("(tau = tokens per verify round: accepted draft tokens + the bonus; 1 for plain decoding. Offline timings "
          "are the reference decoder's, not a serving engine's.)")
    lossless = all(m["lossless"] for m in summary.values())
    if not lossless:
        print("error: a speculative method's output differs from plain decoding", file=sys.stderr)
    return 0 if lossless else 1
