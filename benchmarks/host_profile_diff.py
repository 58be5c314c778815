"""Two host profiles of the decode loop (sglang_ddtree.sglang.host_profile's .pstats, e.g. an `auto` server's and
the fixed 128-tree's from `scripts/device/steps.sh host-profile`) side by side, per function, in ms per decode batch: the
functions whose own time (or, with --cumulative, cumulative time) differs most, and the functions one profile has
that the other lacks. Why: the in-process A/B puts `auto`'s own host time at 0.10-0.15 ms a tiny-pair round over the
fixed arm's, ~0.047 of it in the worker's chooser block (`sglang_auto_ab_own_host_ms_tiny`), while the
policy's whole per-round block takes 10-18 us a round on this repo's 2-core VM (bench_auto_round_host.py,
auto_round_host_cpu_5c47395.json): the profiles say which functions hold the server's time.

    python benchmarks/host_profile_diff.py hp/host_profile_ddtree_auto_1.pstats hp/host_profile_ddtree_128_2.pstats

Times are cProfile's (its overhead inflates small Python functions ~2x): compare the two columns with each other,
not with the A/B's wall times. The two servers are two processes on shared CPUs: one profiled pair ran the functions
both have ~7% apart (the `auto` server faster), so the functions only one profile has say more than the differences.
The batch count is read from each profile's .txt next to it (host_profile.py writes "N decode batches" there);
--batches overrides it for both.
"""

from __future__ import annotations

import argparse
import json
import pstats
import re
import sys
from pathlib import Path


def batches_of(path: Path) -> int | None:
    """The decode batch count host_profile.py wrote in the .txt next to a .pstats file (None: not found)."""
    txt = path.with_suffix(".txt")
    if not txt.exists():
        return None
    match = re.search(r"(\d+) decode batches", txt.read_text())
    return int(match.group(1)) if match else None


def per_batch(path: Path, batches: int) -> dict[str, tuple[float, float, float]]:
    """{"file:line:function": (own ms, cumulative ms, calls) per batch} of one profile."""
    out: dict = {}
    for (filename, line, name), (_, calls, own, cumulative, _) in pstats.Stats(str(path)).stats.items():
        # a builtin's name carries its address ("<function Event.record at 0x7f...>"), which differs per process
        key = f"{Path(filename).name}:{line}:{re.sub(r' at 0x[0-9a-f]+', '', name)}"
        own0, cum0, calls0 = out.get(key, (0.0, 0.0, 0.0))
        out[key] = (own0 + 1e3 * own / batches, cum0 + 1e3 * cumulative / batches, calls0 + calls / batches)
    return out


def diff(a: dict, b: dict, cumulative: bool = False, top: int = 25) -> dict:
    """The `top` functions by |a - b| of own (or cumulative) ms per batch, and those only in a / only in b whose
    time is at least 1 us a batch, each sorted by time."""
    col = 1 if cumulative else 0
    both = [(k, a[k][col] - b[k][col], a[k], b[k]) for k in a.keys() & b.keys()]
    both.sort(key=lambda x: -abs(x[1]))
    only = lambda x, y: sorted(((k, v) for k, v in x.items() if k not in y and v[col] >= 1e-3),  # noqa: E731
                               key=lambda kv: -kv[1][col])
    row = lambda v: {"own_ms": round(v[0], 4), "cum_ms": round(v[1], 4), "calls": round(v[2], 2)}  # noqa: E731
    return {"measure": "cumulative" if cumulative else "own",
            "total_own_ms": [round(sum(v[0] for v in a.values()), 4), round(sum(v[0] for v in b.values()), 4)],
            "largest_differences": [{"function": k, "delta_ms": round(d, 4), "a": row(va), "b": row(vb)}
                                    for k, d, va, vb in both[:top]],
            "only_in_a": [{"function": k, **row(v)} for k, v in only(a, b)[:top]],
            "only_in_b": [{"function": k, **row(v)} for k, v in only(b, a)[:top]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path, help="a host_profile .pstats file (e.g. the `auto` server's)")
    ap.add_argument("b", type=Path, help="the one to subtract (e.g. the fixed 128-tree server's)")
    ap.add_argument("--batches", type=int, default=None, help="decode batches in each profile (default: from the .txt)")
    ap.add_argument("--cumulative", action="store_true", help="rank by cumulative time instead of own time")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", type=Path, default=None, help="also write the result as JSON")
    args = ap.parse_args(argv)
    counts = []
    for path in (args.a, args.b):
        if not path.exists():
            ap.error(f"{path}: no such file")
        n = args.batches or batches_of(path)
        if not n or n < 1:
            ap.error(f"{path}: no batch count in {path.with_suffix('.txt').name}; pass --batches")
        counts.append(n)
    result = diff(per_batch(args.a, counts[0]), per_batch(args.b, counts[1]), args.cumulative, args.top)
    result["a"], result["b"], result["batches"] = str(args.a), str(args.b), counts
    print(f"ms per decode batch ({result['measure']} time, cProfile's), a = {args.a.name} ({counts[0]} batches), "
          f"b = {args.b.name} ({counts[1]}); own time in all: a {result['total_own_ms'][0]:.3f}, "
          f"b {result['total_own_ms'][1]:.3f}")
    print("largest differences (a - b):")
    for r in result["largest_differences"]:
        ra, rb = r["a"], r["b"]
        print(f"  {r['delta_ms']:+8.4f}  a {ra['own_ms']:.4f} own / {ra['cum_ms']:.4f} cum x{ra['calls']:.2f}"
              f"  b {rb['own_ms']:.4f} / {rb['cum_ms']:.4f} x{rb['calls']:.2f}  {r['function']}")
    for side in ("a", "b"):
        print(f"only in {side}:")
        for r in result[f"only_in_{side}"]:
            print(f"  {r['own_ms']:.4f} own / {r['cum_ms']:.4f} cum x{r['calls']:.2f}  {r['function']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
