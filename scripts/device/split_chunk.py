"""Split a site chunk (scripts/device/pack_site.py) into parts that travel in separate device calls.

    python3 scripts/device/split_chunk.py .device-cache/site-1 --part-mb 20

Why: a call carries at most 64 MiB with the working tree; a chunk that does not fit next to the tree (one packed
with a larger --max-chunk-mib than pack_site.py's default, or after the tree grew) travels in parts. Writes .device-cache/site-1-part1/, -part2/, ... next to the chunk's folder, each with one
`<name>.tar.xz.part-<i>-of-<n>`, the set's manifest.json and parts.json (chunk name, part count, the whole chunk's
sha256). On the device, `bash scripts/device/install_chunk.sh .device-cache/site-1-partK` in one call per part (back
to back): each part is kept under the site dir, and the call that brings the last one joins them, checks the
sha256 and installs the chunk.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path


def split(chunk_dir: Path, part_bytes: int) -> list[Path]:
    chunks = sorted(chunk_dir.glob("*.tar.xz"))
    if len(chunks) != 1:
        raise SystemExit(f"{chunk_dir}: expected one *.tar.xz, found {len(chunks)}")
    chunk = chunks[0]
    name = chunk.name[: -len(".tar.xz")]
    data = chunk.read_bytes()
    count = max(1, -(-len(data) // part_bytes))
    meta = {"chunk": name, "parts": count, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    folders = []
    for i in range(count):
        folder = chunk_dir.parent / f"{chunk_dir.name}-part{i + 1}"
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        (folder / f"{name}.tar.xz.part-{i + 1}-of-{count}").write_bytes(data[i * part_bytes:(i + 1) * part_bytes])
        (folder / "parts.json").write_text(json.dumps(meta, indent=1) + "\n")
        if (chunk_dir / "manifest.json").exists():
            shutil.copy(chunk_dir / "manifest.json", folder / "manifest.json")
        folders.append(folder)
    return folders


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("chunk_dir", type=Path)
    ap.add_argument("--part-mb", type=float, default=20.0, help="largest part, in MB (10^6 bytes)")
    args = ap.parse_args(argv)
    if args.part_mb <= 0:
        raise SystemExit("--part-mb must be positive")
    for folder in split(args.chunk_dir, int(args.part_mb * 1e6)):
        print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
