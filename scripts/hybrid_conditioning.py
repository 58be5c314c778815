"""How well the hybrid GPU test model is conditioned for a lossless check: on the CPU, with transformers,
bf16 greedy outputs of the random Qwen3-Next test target teacher-forced on the same model in float32 (per output
position: the float32 model's best log-prob minus the chosen token's). A model whose bf16 outputs stray far from
its float32 choices cannot tell a wrong recurrent state from numerics.

  python scripts/hybrid_conditioning.py --out benchmarks/results/hybrid_model_conditioning_cpu.json \
      [--gpu-suite benchmarks/results/gpu_suite_hybrid_2026-11-30_cf19fa9.json --gpu-run 1]

Compares the test target with a top-2 of 4 experts routed (the earlier test model) and with all 4 routed (the model
of tests/gpu/test_ddtree_hybrid.py now). With --gpu-suite it also teacher-forces the "float32" greedy outputs
that transformers produced on the GPU in that run (record `hybrid_fp32_greedy`, top-2 routed model) on the CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))
from fixtures.hybrid_models import sglang_hybrid_target  # noqa: E402
from serving_common import ID_PROMPTS  # noqa: E402

from sglang_ddtree.results_file import read_text  # noqa: E402


def gaps(model, prompt, output) -> list[float]:
    ids = torch.tensor([list(prompt) + list(output)])
    with torch.no_grad():
        logprobs = model(ids).logits[0, len(prompt) - 1: len(prompt) - 1 + len(output)].float().log_softmax(-1)
    chosen = logprobs.gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1)
    return (logprobs.max(dim=-1).values - chosen).tolist()


def summarize(per_prompt: list[list[float]]) -> dict:
    flat = [g for gs in per_prompt for g in gs]
    return {"worst_per_prompt": [round(max(g), 3) for g in per_prompt], "worst": round(max(flat), 3),
            "at_argmax": round(sum(g == 0.0 for g in flat) / len(flat), 4), "positions": len(flat)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--gpu-suite", type=Path, default=None)
    ap.add_argument("--gpu-run", type=int, default=1)
    args = ap.parse_args(argv)
    report: dict = {"new_tokens": args.new_tokens, "prompts": len(ID_PROMPTS), "variants": {}}
    t0 = time.time()
    for experts in (2, 4):
        exact = sglang_hybrid_target(0, experts_per_token=experts).float().eval()
        bf16 = sglang_hybrid_target(0, experts_per_token=experts).to(torch.bfloat16).eval()
        outputs = []
        for p in ID_PROMPTS:
            out = bf16.generate(torch.tensor([p]), max_new_tokens=args.new_tokens, do_sample=False,
                                attention_mask=torch.ones(1, len(p), dtype=torch.long))
            outputs.append(out[0, len(p):].tolist())
        report["variants"][f"experts_per_token_{experts}"] = summarize(
            [gaps(exact, p, o) for p, o in zip(ID_PROMPTS, outputs)])
        print(f"experts per token {experts}: {report['variants'][f'experts_per_token_{experts}']}", flush=True)
        if experts == 2 and args.gpu_suite is not None:
            run = json.loads(read_text(args.gpu_suite))["runs"][args.gpu_run]  # the committed file is .json.xz
            gpu = next(r for r in run["records"] if r["kind"] == "hybrid_fp32_greedy")["outputs"]
            report["gpu_fp32_greedy_top2_model"] = {"source": f"{args.gpu_suite.name} runs[{args.gpu_run}]",
                                                   **summarize([gaps(exact, p, o) for p, o in zip(ID_PROMPTS, gpu)])}
            print(f"GPU float32 greedy (top-2 model): {report['gpu_fp32_greedy_top2_model']}", flush=True)
    report["seconds"] = round(time.time() - t0, 1)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
