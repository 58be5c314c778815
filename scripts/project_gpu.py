"""Project the cost model's H200 fit onto another GPU from its memory bandwidth and bf16 compute (a projection, not
a measurement).

The step-time fit (sglang_ddtree/step_fit.py) is T(b, V) = a[b] + s1 * V + s2 * max(0, V - knee), fitted on
H200 sweeps at Qwen3-8B shapes. On another GPU, the terms are scaled by what bounds them:
  a[b], s1   bandwidth-bound (reading the weights once a round, per-token KV and activations): x BW_h200 / BW_gpu
  s2         compute-bound past the knee (full matmul per verify token):                     x F_h200 / F_gpu
  knee       the ridge point, in verify tokens, moves with F / BW:                           x (F_gpu/BW_gpu) / (F_h200/BW_h200)
DFLASH's round (16 verify tokens a request) and plain decoding (one token a step) are scaled by the fit's own
ratio at their verify width. Acceptance (tau per budget) is the fit file's, unchanged.

The fit file is the cost model's output (ddtree_bench/cost_model.py: benchmarks/results/best_budget_projected.json);
the measured best budgets (ddtree_bench/best_budget.py: best_budget.json) carry no fit and are refused.

  python scripts/project_gpu.py --fit benchmarks/results/best_budget_projected.json --name rtx-pro-6000-blackwell \
      --bandwidth-gbs 1792 --bf16-tflops 500 --out benchmarks/results/projection_rtx_pro_6000_<date>_<commit>.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

H200 = {"name": "h200-sxm", "bandwidth_gbs": 4800.0, "bf16_tflops": 989.0,
        "source": "NVIDIA H200 product page: 4.8 TB/s HBM3e, 989 TFLOPS BF16 dense (1979 with sparsity)"}


def scaled_fit(fit: dict, bw_ratio: float, flops_ratio: float, ridge_ratio: float) -> dict:
    """The fit's terms on the other GPU (ratios: H200 over the other GPU, ridge: the other GPU over H200)."""
    return {"intercept_ms": {b: a * bw_ratio for b, a in fit["intercept_ms"].items()},
            "slope_ms_per_token": fit["slope_ms_per_token"] * bw_ratio,
            "slope2_ms_per_token": fit["slope2_ms_per_token"] * flops_ratio,
            "knee_tokens": fit["knee_tokens"] * ridge_ratio if fit.get("knee_tokens") else None}


def step_ms(fit: dict, batch: int, verify_tokens: int) -> float:
    knee = fit.get("knee_tokens")
    hinge = max(0.0, verify_tokens - knee) if knee is not None and math.isfinite(knee) else 0.0
    return fit["intercept_ms"][str(batch)] + fit["slope_ms_per_token"] * verify_tokens + fit["slope2_ms_per_token"] * hinge


def project(base: dict, gpu: dict) -> dict:
    """Per batch size of the fit file: every budget's projected tokens/s on `gpu`, the best, and DFLASH's."""
    fit = base["fit"]
    bw_ratio = H200["bandwidth_gbs"] / gpu["bandwidth_gbs"]
    flops_ratio = H200["bf16_tflops"] / gpu["bf16_tflops"]
    ridge_ratio = (gpu["bf16_tflops"] / gpu["bandwidth_gbs"]) / (H200["bf16_tflops"] / H200["bandwidth_gbs"])
    new = scaled_fit(fit, bw_ratio, flops_ratio, ridge_ratio)
    tau = {int(b): t for b, t in base["tau"]["ddtree"].items()}
    out = {}
    for b, row in base["by_batch"].items():
        batch = int(b)
        cands = {c["budget"]: c for c in row["candidates"]}
        rows = []
        for budget in sorted(tau):
            if budget not in cands or cands[budget]["extrapolated"]:
                continue  # only what the H200 fit interpolates
            v = batch * (budget + 1)
            ms = step_ms(new, batch, v)
            rows.append({"budget": budget, "tau": round(tau[budget], 4), "step_ms": round(ms, 3),
                         "tokens_per_s": round(batch * tau[budget] / ms * 1e3, 1)})
        dflash_h200 = row.get("dflash_tokens_per_s_projected")
        dflash = None
        if dflash_h200:
            ratio = step_ms(fit, batch, batch * 16) / step_ms(new, batch, batch * 16)
            dflash = round(dflash_h200 * ratio, 1)
        best = max(rows, key=lambda r: r["tokens_per_s"]) if rows else None
        out[b] = {"best_budget": best["budget"] if best else None,
                  "tokens_per_s": best["tokens_per_s"] if best else None,
                  "dflash_tokens_per_s": dflash,
                  "over_dflash": round(best["tokens_per_s"] / dflash, 3) if best and dflash else None,
                  "candidates": rows}
    return {"projected": True,
            "note": "PROJECTED from the H200 step-time fit scaled by bandwidth and bf16 compute; tau from the fit "
                    "file's acceptance source. Not measured on this GPU.",
            "gpu": gpu, "reference_gpu": H200, "fit_file": base.get("_path"), "tau_source": base["tau_source"],
            "scaled_fit": new, "by_batch": out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fit", required=True,
                    help="a cost-model output (benchmarks/results/best_budget_projected.json)")
    ap.add_argument("--name", required=True)
    ap.add_argument("--bandwidth-gbs", type=float, required=True, help="memory bandwidth, GB/s")
    ap.add_argument("--bf16-tflops", type=float, required=True, help="dense bf16 tensor throughput, TFLOPS")
    ap.add_argument("--source", default="", help="where the two numbers come from")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.bandwidth_gbs <= 0 or args.bf16_tflops <= 0:
        print("--bandwidth-gbs and --bf16-tflops must be positive.", file=sys.stderr)
        return 2
    base = json.loads(Path(args.fit).read_text())
    if "fit" not in base:
        print(f"{args.fit}: no step-time fit (measured best budgets?): pass the cost model's output, "
              "python -m ddtree_bench.cost_model ... --out best_budget_projected.json.", file=sys.stderr)
        return 2
    base["_path"] = Path(args.fit).name
    result = project(base, {"name": args.name, "bandwidth_gbs": args.bandwidth_gbs, "bf16_tflops": args.bf16_tflops,
                            "source": args.source})
    text = json.dumps(result, indent=1) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    for b, r in result["by_batch"].items():
        print(f"batch {b:>3}: best B={r['best_budget']} {r['tokens_per_s']} tok/s, DFLASH {r['dflash_tokens_per_s']}, "
              f"x{r['over_dflash']} (projected)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
