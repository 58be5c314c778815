"""How a calibration table that starts empty predicts while it is young, by its prior mass (tiny pair, CPU).

The server's table starts empty and, at batch 1 (a sweep's first rows), has learnt from only a few hundred
request-rounds when it is scored: there its calibrated predictions came out worse than the raw scores in four
runs. This replays that start offline: one fixed-budget DDTree decode of HumanEval prompts, with several
empty tables (`adaptive.ScoreCalibrator`, one per `--masses` prior mass) that each predict a round's committed
length before learning from it, as the server's do. Prints and writes the mean absolute error of the raw and of each
table's prediction over round windows (the first 100, the next 200, the rest, all).

`--learn-every N`: the tables learn only from every N-th round and the errors count only those rounds, as in the
server, where only the sampled rounds (one in auto.SAMPLE_EVERY = 4) are scored and learnt; windows then count
learnt rounds. `--score-every N` alone: the tables learn from every round, the errors count every N-th (the same
rounds as `--learn-every N` scores, for a like-for-like comparison). `--young M`: the tables learn from every one
of the first M rounds, then every `--learn-every`-th.

    python benchmarks/calibration_prior.py --budget 128 --offset 40 --out benchmarks/results/calibration_prior_b128.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WINDOWS = ((0, 100), (100, 300), (300, None), (0, None))


def window_mae(pred: list[float], obs: list[int]) -> dict:
    out = {}
    for lo, hi in WINDOWS:
        p, o = pred[lo:hi], obs[lo:hi]
        if o:
            out[f"{lo}-{hi if hi is not None else 'end'}"] = round(sum(abs(a - b) for a, b in zip(p, o)) / len(o), 4)
    return out


def learnt_before(i: int, young: int, every: int) -> int:
    """Rounds a sparse_learner(every, young) table has learnt before round i (0-based, one update a round)."""
    return min(i, young) + max(0, -(-(i - young) // every))


def sparse_learner(every: int, config, young: int = 0):
    """An adaptive.ScoreCalibrator that learns from each of its first `young` updates, then only from every
    `every`-th (one update a round at batch 1)."""
    from sglang_ddtree.adaptive import ScoreCalibrator

    class Sparse(ScoreCalibrator):
        def __init__(self):
            super().__init__(config)
            self.updates = 0

        def update(self, tree, path, active=None):
            self.updates += 1
            if self.updates > young and (self.updates - young - 1) % every:
                return self.expected(tree)
            return super().update(tree, path, active)

    return Sparse()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=int, default=128, help="the fixed DDTree budget decoded")
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--offset", type=int, default=40, help="first HumanEval prompt (file order)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--masses", default="1,3,10,30,100", help="prior masses, one empty table each")
    ap.add_argument("--learn-every", type=int, default=1, help="tables learn (and are scored) every N-th round")
    ap.add_argument("--young", type=int, default=0, help="tables learn from every one of the first M rounds")
    ap.add_argument("--score-every", type=int, default=None,
                    help="errors counted every N-th round (default: --learn-every's N)")
    ap.add_argument("--first-budget", type=int, default=None,
                    help="decode at this budget until --first-rounds rounds (whole prompts), then at --budget, the "
                         "same tables throughout: a server whose chooser ran a narrow tree first")
    ap.add_argument("--first-rounds", type=int, default=0)
    ap.add_argument("--gates", default="",
                    help="comma-separated M: also score each table gated, its prediction replaced by the raw one "
                         "until it has learnt M rounds (a table not consulted while young)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    masses = [float(m) for m in args.masses.split(",") if m.strip()]
    try:
        gates = [int(g) for g in args.gates.split(",") if g.strip()]
    except ValueError:
        ap.error(f"--gates must be comma-separated round counts, got {args.gates!r}")
    if any(g < 1 for g in gates):
        ap.error("--gates must be >= 1")
    score_every = args.learn_every if args.score_every is None else args.score_every
    if not masses or any(m <= 0 for m in masses) or min(args.budget, args.prompts, args.learn_every, score_every) < 1 \
            or args.young < 0 or args.first_rounds < 0 or (args.first_budget is not None and args.first_budget < 1):
        ap.error("--masses must be positive numbers; --budget, --prompts, --learn-every, --score-every and "
                 "--first-budget >= 1; --young and --first-rounds >= 0")

    import torch

    from sglang_ddtree.adaptive import CalibratorConfig
    from sglang_ddtree.datasets import encode_prompt, load_prompts
    from sglang_ddtree.offline.auto import AutoPolicy, auto_decode
    from sglang_ddtree.offline.cli_commands import _eos_ids, _load_models
    from sglang_ddtree.offline.drafts import DFlashDraftSource

    torch.set_num_threads(args.threads)
    model_args = argparse.Namespace(tiny=True, target=None, drafter=None, tokenizer=None, device="cpu",
                                    dtype="float32", attn="sdpa")
    target, drafter, tokenizer, _ = _load_models(model_args)
    eos = _eos_ids(tokenizer, target)
    prompts = load_prompts("humaneval", None)[args.offset: args.offset + args.prompts]
    ids = [encode_prompt(tokenizer, p) for p in prompts]
    depth = int(drafter.config.block_size) - 1
    tables = {f"mass_{m:g}": sparse_learner(args.learn_every, CalibratorConfig(depth_limit=depth, prior_mass=m),
                                            args.young) for m in masses}
    policy = AutoPolicy(candidates=[args.budget], observers=tables)
    first = AutoPolicy(candidates=[args.first_budget], observers=tables) if args.first_budget else None
    started = time.time()
    records = []
    first_rounds = 0  # rounds decoded at --first-budget (whole prompts)
    for i, p in enumerate(ids):
        rounds = sum(len(r.accept_lengths) for r in records)
        in_first = first is not None and rounds < args.first_rounds
        records += auto_decode(target, [DFlashDraftSource(drafter, target)], [p], policy=first if in_first else policy,
                               max_new_tokens=args.max_new_tokens, eos_token_ids=eos)
        if in_first:
            first_rounds = sum(len(r.accept_lengths) for r in records)
        print(f"prompt {i + 1}/{len(ids)}: {sum(len(r.accept_lengths) for r in records)} rounds", file=sys.stderr)
    observed = [a for r in records for a in r.accept_lengths]
    scored = range(0, len(observed), score_every)  # with --learn-every, the rounds the tables learnt from
    preds = {name: [x for r in records for x in r.extra["auto"][f"pred_{name}"]] for name in ["raw", *tables]}
    for gate in gates:  # the table's prediction once it has learnt `gate` rounds, the raw one before
        for name in tables:
            preds[f"{name}_gate{gate}"] = [preds["raw"][i] if learnt_before(i, args.young, args.learn_every) < gate
                                           else x for i, x in enumerate(preds[name])]
    mae = {name: window_mae([pred[i] for i in scored], [observed[i] for i in scored]) for name, pred in preds.items()}
    for name, row in mae.items():
        print(f"{name:>10}  " + "  ".join(f"{w} {v:.3f}" for w, v in row.items()))
    after_first = None
    if first is not None:  # the rounds at --budget only, after the narrow start
        later = [i for i in scored if i >= first_rounds]
        after_first = {name: window_mae([pred[i] for i in later], [observed[i] for i in later])
                       for name, pred in preds.items()}
        for name, row in after_first.items():
            print(f"{name:>10}  after the first {first_rounds} rounds: " +
                  "  ".join(f"{w} {v:.3f}" for w, v in row.items()))
    if args.out:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "what": "per-round MAE of the predicted committed length: raw scores and empty calibration tables by "
                    "prior mass, each predicting before it learns the round (round windows)",
            "date": dt.date.today().isoformat(), "machine": "CPU (this repo's dev machine), float32, tiny pair",
            "commit": head.stdout.strip() or None,
            "command": "python benchmarks/calibration_prior.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "budget": args.budget, "first_budget": args.first_budget, "first_rounds": first_rounds,
            "prompts": [p.id for p in prompts], "rounds": len(observed),
            "learn_every": args.learn_every, "young": args.young, "gates": gates, "score_every": score_every,
            "scored_rounds": len(scored),
            "tau": round(sum(observed) / len(observed), 4), "wall_s": round(time.time() - started, 1),
            "mae": mae, "mae_after_first": after_first}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
