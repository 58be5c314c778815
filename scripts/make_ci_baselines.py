"""Rewrite the CI correctness baselines (see sglang_ddtree/offline/correctness.py):

  benchmarks/results/baselines/ci_tiny_t0.jsonl          our format: outputs, accept lengths, tree hashes, margins
  benchmarks/results/baselines/ci_tiny_t0_reference.pt   the reference harness's file shape, with tree traces

Both come from the offline decoders on the committed tiny pair (CPU, float32, T=0). Run it only when a change is
meant to alter what the decoders compute (a new tiny pair, a new tree rule), and say so in the commit: the CI check
(tests/test_correctness_ci.py) exists to notice everything else.

  python scripts/make_ci_baselines.py [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    import torch

    from sglang_ddtree.baseline import write_baseline
    from sglang_ddtree.offline import correctness as cc

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=str(cc.BASELINE_DIR), help="folder for the two files")
    args = ap.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)

    pair = cc.TinyPair()
    s = cc.CHECK
    ours = pair.decode()
    write_baseline(out / cc.OURS_PATH.name, ours.header, ours.records)
    block = int(pair.drafter.config.block_size)
    long_run = pair.decode(s.reference_methods, max_new_tokens=s.max_new_tokens + block, record_trees=True)
    ref = cc.export_reference_style(
        long_run, pair.prompts, s.max_new_tokens, block, s.reference_methods, stop_token_ids=pair.eos,
        args={"model_name_or_path": "models/tiny/target", "draft_name_or_path": "models/tiny/drafter",
              "dataset": s.dataset, "max_new_tokens": s.max_new_tokens, "temperature": 0.0,
              "tree_budget": ",".join(m[len("ddtree_tb"):] for m in s.reference_methods if m.startswith("ddtree_tb")),
              "dtype": "float32", "device": "cpu",
              "made_by": "sglang_ddtree/offline/correctness.py export_reference_style (our decoder, the reference's "
                         "file shape; not the paper's code)"})
    torch.save(ref, out / cc.REFERENCE_PATH.name)
    for name in (cc.OURS_PATH.name, cc.REFERENCE_PATH.name):
        print(f"wrote {out / name} ({(out / name).stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
