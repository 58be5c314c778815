#!/usr/bin/env python3
"""Print the device calls that install the packed site and run the GPU suite, each checked against the device
tool's limits (command <= 2000 characters, <= 8 carry paths, working tree + carried paths <= 64 MiB).

  python scripts/device/plan.py                         # install + tests/gpu, JIT cache carried if present
  python scripts/device/plan.py tests/gpu/test_server_smoke.py --bench 'bench1=python3 benchmarks/x.py'
  python scripts/device/plan.py --json                  # the same as JSON: [{"command", "carry", "mib"}, ...]

The last chunk's install shares a call with the suite (one call fewer, while /tmp is still warm); earlier
chunks get a call each. Run them back to back: the machine is given back 30 s after a call ends.
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


def tree_bytes(repo: Path = REPO_ROOT) -> int:
    """What travels on every call: tracked files plus untracked files git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo, capture_output=True,
                         check=True).stdout.decode()
    return sum((repo / p).stat().st_size for p in out.split("\0") if p and (repo / p).is_file())


def path_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def plan(manifest: dict, tests: list[str], benches: list[str], deadline_s: int, return_jit: bool,
         repo: Path = REPO_ROOT, base_bytes: int | None = None) -> list[dict]:
    base = tree_bytes(repo) if base_bytes is None else base_bytes
    chunks = manifest["chunks"]
    if not chunks:
        raise ValueError("the manifest lists no chunks; run scripts/device/pack_site.py first.")
    calls = []
    for c in chunks[:-1]:
        calls.append({"command": f"bash scripts/device/install_chunk.sh {c['carry']}", "carry": [c["carry"]]})
    last = chunks[-1]
    suite = ["python3", "scripts/device/run_gpu_suite.py", *tests, "--deadline-s", str(deadline_s)]
    carry = [last["carry"]]
    if (repo / JIT_CACHE).exists():
        suite += ["--jit-cache", JIT_CACHE]
        carry.append(str(Path(JIT_CACHE).parent))
    if return_jit:
        suite.append("--return-jit-cache")
    for b in benches:
        suite += ["--bench", b]
    calls.append({"command": f"bash scripts/device/install_chunk.sh {last['carry']} && "
                             f"source scripts/device/env.sh && {shlex.join(suite)}",
                  "carry": carry})
    for call in calls:
        call["mib"] = round((base + sum(path_bytes(repo / p) for p in call["carry"])) / 2**20, 2)
        problems = []
        if len(call["command"]) > MAX_COMMAND:
            problems.append(f"command is {len(call['command'])} characters (limit {MAX_COMMAND})")
        if len(call["carry"]) > MAX_CARRY:
            problems.append(f"{len(call['carry'])} carry paths (limit {MAX_CARRY})")
        if call["mib"] > MAX_TREE_MIB:
            problems.append(f"{call['mib']} MiB travel (limit {MAX_TREE_MIB}); pack smaller chunks")
        call["problems"] = problems
    return calls


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tests", nargs="*", default=["tests/gpu"])
    ap.add_argument("--bench", action="append", default=[], metavar="NAME=CMD")
    ap.add_argument("--deadline-s", type=int, default=540)
    ap.add_argument("--no-return-jit-cache", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    manifest_path = CACHE_DIR / "manifest.json"
    if not manifest_path.exists():
        print("no .device-cache/manifest.json: run scripts/device/fetch_wheels.py and pack_site.py first",
              file=sys.stderr)
        return 2
    calls = plan(json.loads(manifest_path.read_text()), args.tests, args.bench, args.deadline_s,
                 not args.no_return_jit_cache)
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
