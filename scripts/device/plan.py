#!/usr/bin/env python3
"""Print the device calls that install the packed site and run the GPU suite (or any other work), each checked
against the device tool's limits (command <= 2000 characters, <= 8 carry paths, working tree + carried paths <= 64
MiB).

  python scripts/device/plan.py                         # install + tests/gpu, JIT cache carried if present
  python scripts/device/plan.py tests/gpu/test_server_smoke.py --bench 'bench1=python3 benchmarks/x.py'
  python scripts/device/plan.py --work 'bash scripts/device/steps.sh tiny-ab $OUT abc1234' --carry runs/bench
  python scripts/device/plan.py --json                  # the same as JSON: [{"command", "carry", "mib"}, ...]

Install calls are as few as fit: a call carries the working tree (~30 MB: the results over 100 KB are stored
xz-compressed) plus whole chunks (pack_site.py's default of 32 MiB a chunk makes the two chunks fit one call each),
consecutive chunks sharing a call when they fit together; the last one's install shares a call with the work (one
call fewer, while /tmp is still warm). A chunk too large for a call with the tree is installed from its parts when
split_chunk.py made them (folders <chunk>-part1, -part2, ... whose parts.json names the manifest's chunk and sha256),
else the plan says how to split it. Run the calls back to back: the machine is given back 30 s after a call ends.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import CACHE_DIR, REPO_ROOT  # noqa: E402

MAX_COMMAND = 2000
MAX_CARRY = 8
MAX_TREE_MIB = 64.0
JIT_CACHE = ".device-cache/jit/jit-cache.tar.xz"


def travel_bytes(file: Path) -> int:
    """A file as the device tool counts it against its 64 MiB: as in a tar archive, a 512-byte header and the content
    padded to 512-byte blocks. Plain sizes undercount by ~0.3 MiB for this tree's ~700 files, which is what put calls
    the plain count let through (63.7 MiB) over the tool's limit; this count matches what it took and refused."""
    return 512 + -(-file.stat().st_size // 512) * 512


def tree_bytes(repo: Path = REPO_ROOT) -> int:
    """What travels on every call: tracked files plus untracked files git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo, capture_output=True,
                         check=True).stdout.decode()
    return sum(travel_bytes(repo / p) for p in out.split("\0") if p and (repo / p).is_file())


def path_bytes(path: Path) -> int:
    if path.is_file():
        return travel_bytes(path)
    return sum(travel_bytes(p) for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def install_units(chunk: dict, repo: Path = REPO_ROOT, room: float = float("inf")) -> list[str]:
    """What installs a chunk: the chunk itself when it fits a call (`room`: the bytes a call has next to the
    working tree), else its split parts (split_chunk.py's <carry>-partN folders, when their parts.json names this
    chunk and its sha256, so a part of an older pack is never used), else the chunk (reported as too large)."""
    if path_bytes(repo / chunk["carry"]) <= room:
        return [chunk["carry"]]
    parts = []
    for folder in sorted(repo.glob(chunk["carry"] + "-part*")):
        meta_path = folder / "parts.json"
        if not meta_path.is_file():
            continue
        meta = json.loads(meta_path.read_text())
        if meta.get("chunk") == chunk["name"] and meta.get("sha256") == chunk.get("sha256"):
            parts.append((int(folder.name.rsplit("-part", 1)[1]), folder.relative_to(repo).as_posix(), meta))
    parts.sort()
    if parts and [i for i, _, _ in parts] == list(range(1, parts[0][2]["parts"] + 1)):
        return [path for _, path, _ in parts]
    return [chunk["carry"]]


def group_units(units: list[str], sizes: dict[str, int], room: int, extra: list[str], extra_bytes: int
                ) -> list[list[str]]:
    """Install units in order, as few calls as fit: consecutive units share a call while their bytes stay within
    `room` and its carry within MAX_CARRY paths (taking them in order is optimal for calls that must keep that
    order). The last call also carries `extra` (the work's paths): it keeps the longest tail of its units that
    fits next to them, and the units before that tail get a call of their own."""
    groups: list[list[str]] = []
    for u in units:
        if groups and sum(sizes[x] for x in groups[-1]) + sizes[u] <= room and len(groups[-1]) < MAX_CARRY:
            groups[-1].append(u)
        else:
            groups.append([u])
    last = groups[-1]
    for keep in range(len(last), 0, -1):
        tail = last[len(last) - keep:]
        if sum(sizes[x] for x in tail) + extra_bytes <= room and keep + len(extra) <= MAX_CARRY:
            break
    if keep < len(last):
        groups[-1:] = [last[:len(last) - keep], last[len(last) - keep:]]
    return groups


def plan(manifest: dict, tests: list[str], benches: list[str], deadline_s: int, return_jit: bool,
         repo: Path = REPO_ROOT, base_bytes: int | None = None, work: str | None = None,
         extra_carry: list[str] | None = None) -> list[dict]:
    """The calls: the chunks' install units (a chunk, or the parts of one too large for a call) as few a call as
    fit, the last call with the work: the GPU suite over `tests` (with `benches`), or `work`, a shell command run
    after `source scripts/device/env.sh`."""
    base = tree_bytes(repo) if base_bytes is None else base_bytes
    limit = MAX_TREE_MIB * 2**20
    chunks = manifest["chunks"]
    if not chunks:
        raise ValueError("the manifest lists no chunks; run scripts/device/pack_site.py first.")
    units = [unit for c in chunks for unit in install_units(c, repo, limit - base)]
    sizes = {u: path_bytes(repo / u) for u in units}
    if work is None:
        suite = ["python3", "scripts/device/run_gpu_suite.py", *tests, "--deadline-s", str(deadline_s)]
        if (repo / JIT_CACHE).exists():
            suite += ["--jit-cache", JIT_CACHE]
        if return_jit:
            suite.append("--return-jit-cache")
        for b in benches:
            suite += ["--bench", b]
        work = shlex.join(suite)
    extra = []
    if (repo / JIT_CACHE).exists():  # the suite restores it; steps.sh steps unpack it (unpack_jit_cache)
        extra.append(str(Path(JIT_CACHE).parent))
    extra += list(extra_carry or [])
    groups = group_units(units, sizes, int(limit - base), extra, sum(path_bytes(repo / p) for p in extra))
    calls = [{"command": "bash scripts/device/install_chunk.sh " + " ".join(g), "carry": list(g)} for g in groups]
    calls[-1]["command"] += f" && source scripts/device/env.sh && {work}"
    calls[-1]["carry"] += extra
    for call in calls:
        sizes_here = [path_bytes(repo / p) for p in call["carry"]]
        call["mib"] = round((base + sum(sizes_here)) / 2**20, 2)
        problems = []
        if len(call["command"]) > MAX_COMMAND:
            problems.append(f"command is {len(call['command'])} characters (limit {MAX_COMMAND})")
        if len(call["carry"]) > MAX_CARRY:
            problems.append(f"{len(call['carry'])} carry paths (limit {MAX_CARRY})")
        missing = [p for p in call["carry"] if p in (extra_carry or []) and not (repo / p).exists()]
        if missing:  # the device tool removes a carried path this checkout lacks (a new checkout has no runs/bench:
            # bench_budgets.py --write-prompts runs/bench/humaneval_prompts.jsonl)
            problems.append(f"not in this checkout: {', '.join(missing)}")
        if base + sum(sizes_here) > limit:
            room = limit - base - sum(sizes_here[1:])
            hint = (f"split it: python3 scripts/device/split_chunk.py {call['carry'][0]} --part-mb "
                    f"{max(1, int(room / 1e6) - 1)}" if room > 2e6 else "the working tree alone is too large")
            problems.append(f"{call['mib']} MiB travel (limit {MAX_TREE_MIB}); {hint}")
        call["problems"] = problems
    return calls


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tests", nargs="*", default=["tests/gpu"])
    ap.add_argument("--bench", action="append", default=[], metavar="NAME=CMD")
    ap.add_argument("--deadline-s", type=int, default=540)
    ap.add_argument("--no-return-jit-cache", action="store_true")
    ap.add_argument("--work", default=None, metavar="CMD",
                    help="run this shell command in the last call instead of the GPU suite (after env.sh)")
    ap.add_argument("--carry", action="append", default=[], metavar="PATH",
                    help="another git-ignored path the last call carries (e.g. runs/bench)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    manifest_path = CACHE_DIR / "manifest.json"
    if not manifest_path.exists():
        print("no .device-cache/manifest.json (a new checkout): run scripts/device/fetch_wheels.py and pack_site.py "
              "first, then split_chunk.py on any chunk this plan says is too large (docs/gpu-suite.md, section 1)",
              file=sys.stderr)
        return 2
    calls = plan(json.loads(manifest_path.read_text()), args.tests, args.bench, args.deadline_s,
                 not args.no_return_jit_cache, work=args.work, extra_carry=args.carry)
    if args.json:
        print(json.dumps(calls, indent=1))
    else:
        for i, call in enumerate(calls, 1):
            print(f"call {i}/{len(calls)}: carry={json.dumps(call['carry'])}  ({call['mib']} MiB travel)")
            print(f"  {call['command']}")
            for p in call["problems"]:
                print(f"  PROBLEM: {p}")
    return 1 if any(c["problems"] for c in calls) else 0


if __name__ == "__main__":
    sys.exit(main())
