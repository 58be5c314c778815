"""The tree verify's attention at Qwen3-8B head shapes (32 query heads, 8 KV heads, head dim 128, bf16): SGLang
0.5.17's Triton extend kernel against sglang_ddtree/kernels/verify_attention.py over its two tiling choices
(query rows a program, prefix splits), per verify width, prefix length and batch size. Each configuration is
timed as one layer's call inside a CUDA graph of 36 calls (a verify's layers), replayed: GPU time without the host.

  python benchmarks/bench_verify_attention.py --out $OUT/verify_attention.json      # on the GPU machine

Prints one line per (batch, width, prefix): SGLang's time, the default plan's and the best configuration's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sglang_ddtree.kernels import verify_attention as va  # noqa: E402

HEADS, KV_HEADS, DIM, LAYERS = 32, 8, 128, 36


def graph_time_us(fn, layers: int = LAYERS, replays: int = 20) -> float:
    """One call's GPU time: `layers` calls captured in one CUDA graph, replayed `replays` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(layers):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * layers)


def verify_case(bs: int, width: int, prefix: int, seed: int = 0) -> dict:
    """Every request with the same prefix length, its slots scattered over the pool, an all-visible tree mask
    (the mask's values do not change the time)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)

    slots = bs * prefix + 64
    mask_rows = width * (prefix + width)
    return {"q": rand(bs * width, HEADS, DIM), "k": rand(bs * width, KV_HEADS, DIM), "v": rand(bs * width, KV_HEADS, DIM),
            "k_pool": rand(slots, KV_HEADS, DIM), "v_pool": rand(slots, KV_HEADS, DIM),
            "qo_indptr": torch.arange(0, (bs + 1) * width, width, dtype=torch.int32, device="cuda"),
            "kv_indptr": torch.arange(0, (bs + 1) * prefix, prefix, dtype=torch.int32, device="cuda"),
            "kv_indices": torch.randperm(slots, generator=gen, device="cuda")[: bs * prefix],
            "mask": torch.ones(bs * mask_rows, dtype=torch.bool, device="cuda"),
            "mask_indptr": torch.arange(0, (bs + 1) * mask_rows, mask_rows, dtype=torch.int64, device="cuda")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch-sizes", default="1,2,4")
    ap.add_argument("--widths", default="17,33,65,129")
    ap.add_argument("--prefixes", default="400,1500")
    ap.add_argument("--block-m", default="16,32,64,128")
    ap.add_argument("--splits", default="1,2,3,4,6,8,12,16")
    args = ap.parse_args(argv)
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for bs, width, prefix in itertools.product(ints(args.batch_sizes), ints(args.widths), ints(args.prefixes)):
        d = verify_case(bs, width, prefix)
        out = torch.empty_like(d["q"])
        scale = DIM ** -0.5
        theirs = graph_time_us(lambda: extend_attention_fwd(
            d["q"], d["k"], d["v"], out, d["k_pool"], d["v_pool"], d["qo_indptr"], d["kv_indptr"], d["kv_indices"],
            d["mask"], True, d["mask_indptr"], width, 1.0, 1.0, scale))
        ours = {}
        for block_m, splits in itertools.product(ints(args.block_m), ints(args.splits)):
            if block_m > max(16, 1 << (width - 1).bit_length()):
                continue
            ours[(block_m, splits)] = graph_time_us(lambda: va.tree_verify_attention(
                d["q"], d["k"], d["v"], out, d["k_pool"], d["v_pool"], d["kv_indptr"], d["kv_indices"], d["mask"],
                d["mask_indptr"], width, scale, splits, block_m=block_m))
        plan = (va._block_m(width), va.plan_splits(bs, HEADS, width, sms))
        best = min(ours, key=ours.get)
        row = {"bs": bs, "width": width, "prefix": prefix, "sglang_us": round(theirs, 2),
               "plan": list(plan), "plan_us": round(ours[plan], 2) if plan in ours else None,
               "best": list(best), "best_us": round(ours[best], 2),
               "ours_us": {f"{m}x{s}": round(t, 2) for (m, s), t in ours.items()}}
        rows.append(row)
        print(f"bs {bs:2d} width {width:3d} prefix {prefix:5d}: sglang {theirs:6.1f} us, plan {plan} "
              f"{row['plan_us']}, best {best} {ours[best]:6.1f} us", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(0), "sms": sms, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
