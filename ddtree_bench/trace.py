"""Read a torch.profiler Chrome trace (SGLang's /start_profile) of a decode run: where a round's time goes.

Per scheduler step (the trace covers `steps` of them, one decode round each at batch 1):
  wall_ms        span of the GPU activity in the trace / steps
  gpu_busy_ms    union of kernel, memcpy and memset intervals / steps (idle_ms = wall_ms - gpu_busy_ms: the GPU
                 waiting for the host, e.g. after a host sync or behind slow launches)
  kernels        GPU ms and launches per step by kernel name, largest first
  runtime        host ms and calls per step by CUDA runtime/driver call (launches, graph launches, copies, syncs)
  syncs          the calls among those that make the host wait for the GPU, and device-to-host copies into
                 pageable memory (synchronous even when issued as async)
  ranges         for profiler ranges named `<prefix><stage>` (the DDTREE worker's, with
                 SGLANG_DDTREE_PROFILE_RANGES=1): host ms per step, and GPU ms per step of the work launched inside
  annotations    host ms and count per step of the other profiler ranges (SGLang's own: `scheduler.run_batch`,
                 ...), so two methods' host time compares where only one of them has stage ranges
                 (both: `python_ms`, the part of that host time inside no torch op and no CUDA runtime call of the
                 range's thread: Python between the calls; where the DDTREE worker's extra host time was found)
  cpu_ops        host ms and calls per step by torch op (an op inside another counts in both)
Plain data in, plain data out: tests feed it synthetic traces.
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from pathlib import Path

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
RUNTIME_CATS = {"cuda_runtime", "cuda_driver"}
SYNC_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cuStreamSynchronize",
              "cuCtxSynchronize", "cuEventSynchronize", "cudaMemcpy", "cuMemcpyDtoH_v2")


def load(path: str | Path) -> dict:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as fh:
        return json.load(fh)


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total / 1e3  # trace times are microseconds


def _short(name: str, width: int = 96) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def analyze(trace: dict, steps: int, *, range_prefix: str = "ddtree:", top: int = 25) -> dict:
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in events if str(e.get("cat", "")).lower() in GPU_CATS]
    runtime = [e for e in events if str(e.get("cat", "")).lower() in RUNTIME_CATS]
    annotations = [e for e in events if str(e.get("cat", "")).lower() == "user_annotation"]
    ranges = [e for e in annotations if str(e.get("name", "")).startswith(range_prefix)]
    others = [e for e in annotations if not str(e.get("name", "")).startswith(range_prefix)]
    cpu_ops = [e for e in events if str(e.get("cat", "")).lower() == "cpu_op"]
    if not gpu:
        raise ValueError("no GPU activity in the trace (was it recorded with the GPU activity on?)")

    begin = min(float(e["ts"]) for e in gpu)
    end = max(float(e["ts"]) + float(e["dur"]) for e in gpu)
    wall_ms = (end - begin) / 1e3
    busy_ms = _union_ms([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu])

    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    gpu_ms_by_corr: dict[int, float] = defaultdict(float)
    for e in gpu:
        k = kernels[_short(str(e.get("name", "?")))]
        k[0] += float(e["dur"]) / 1e3
        k[1] += 1
        corr = (e.get("args") or {}).get("correlation")
        if corr is not None:
            gpu_ms_by_corr[int(corr)] += float(e["dur"]) / 1e3

    calls: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in runtime:
        c = calls[str(e.get("name", "?"))]
        c[0] += float(e["dur"]) / 1e3
        c[1] += 1
    pageable_dtoh = [e for e in gpu if str(e.get("cat", "")).lower() == "gpu_memcpy"
                     and "DtoH" in str(e.get("name", "")) and "Pageable" in str(e.get("name", ""))]

    per_range: dict[str, dict] = {}
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in runtime:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    covered: dict[tuple, list[tuple[float, float]]] = defaultdict(list)  # op and runtime-call intervals per thread
    for e in cpu_ops + runtime:
        covered[(e.get("pid"), e.get("tid"))].append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))

    def python_ms(e: dict) -> float:
        """The range's host time inside no op and no runtime call of its thread."""
        start, stop = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        inside = [(max(a, start), min(b, stop)) for a, b in covered.get((e.get("pid"), e.get("tid")), [])
                  if a < stop and b > start]
        return float(e["dur"]) / 1e3 - _union_ms(inside)

    for e in ranges:
        stage = str(e["name"])[len(range_prefix):]
        r = per_range.setdefault(stage, {"host_ms": 0.0, "python_ms": 0.0, "gpu_ms": 0.0, "launches": 0,
                                         "count": 0})
        start, stop = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        r["host_ms"] += float(e["dur"]) / 1e3
        r["python_ms"] += python_ms(e)
        r["count"] += 1
        for call in by_thread.get((e.get("pid"), e.get("tid")), []):
            if start <= float(call["ts"]) <= stop:
                corr = (call.get("args") or {}).get("correlation")
                if corr is not None and int(corr) in gpu_ms_by_corr:
                    r["gpu_ms"] += gpu_ms_by_corr[int(corr)]
                    r["launches"] += 1

    def tally(evs: list[dict]) -> dict[str, list[float]]:
        table: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for e in evs:
            t = table[_short(str(e.get("name", "?")))]
            t[0] += float(e["dur"]) / 1e3
            t[1] += 1
        return table

    annotation_python: dict[str, float] = defaultdict(float)
    for e in others:
        annotation_python[_short(str(e.get("name", "?")))] += python_ms(e)

    def per_step(table: dict[str, list[float]]) -> list[dict]:
        rows = [{"name": n, "ms": ms / steps, "calls": cnt / steps} for n, (ms, cnt) in table.items()]
        return sorted(rows, key=lambda r: -r["ms"])

    return {
        "steps": steps,
        "wall_ms": wall_ms / steps,
        "gpu_busy_ms": busy_ms / steps,
        "gpu_idle_ms": (wall_ms - busy_ms) / steps,
        "kernels": per_step(kernels)[:top],
        "kernel_launches": sum(k[1] for k in kernels.values()) / steps,
        "runtime": per_step(calls)[:top],
        "syncs": [r for r in per_step(calls) if r["name"] in SYNC_CALLS],
        "pageable_dtoh_copies": len(pageable_dtoh) / steps,
        "ranges": {stage: {"host_ms": r["host_ms"] / steps, "python_ms": r["python_ms"] / steps,
                           "gpu_ms": r["gpu_ms"] / steps, "launches": r["launches"] / steps,
                           "count": r["count"] / steps}
                   for stage, r in per_range.items()},
        "annotations": {r["name"]: {"host_ms": r["ms"], "python_ms": annotation_python[r["name"]] / steps,
                                    "count": r["calls"]} for r in per_step(tally(others))[:top]},
        "cpu_ops": per_step(tally(cpu_ops))[:top],
    }


def main(argv=None) -> int:
    """python -m ddtree_bench.trace TRACE[.gz] --steps N [--out F]: analyze() as JSON."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, required=True, help="scheduler steps the trace covers")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    text = json.dumps(analyze(load(args.trace), args.steps, top=args.top), indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
