#!/usr/bin/env python3
"""Pack the locked wheels as an already-installed site dir, in .tar.xz chunks small enough to carry.

  python scripts/device/pack_site.py                 # .wheels/ -> .device-cache/site-N/site-N.tar.xz + manifest
  python scripts/device/pack_site.py --max-chunk-mib 30   # smaller chunks (more calls)

Why a site dir and not the wheels: the device then only decompresses (no pip, no zip, no RECORD/script
rewriting), and xz packs the files 10-30% smaller than the wheels' deflate. The numbers of both are in the
manifest ("raw_wheels_trimmed_bytes" vs the chunks' "bytes").

How: one `pip install --no-deps --no-compile --target` of all locked wheels (for CPython 3.12 x86-64, whatever
this machine runs), files trimmed per _common.TRIM_PATTERNS, then each distribution's files (from its RECORD)
become one xz-compressed piece of tar (members sorted, owner/time zeroed: the same wheels give the same bytes).
A chunk is a concatenation of whole pieces plus an end-of-archive piece; xz and Python's tarfile read
concatenated xz streams as one, so each chunk is a plain .tar.xz. Pieces are sized exactly before they are
grouped, so no chunk can exceed the limit.

Each chunk lives in its own folder, `.device-cache/site-N/` (with a copy of manifest.json), so one `carry`
entry names it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import fnmatch
import io
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass, field
from email.parser import Parser
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    CACHE_DIR,
    LOCK_PATH,
    REPO_ROOT,
    TRIM_PATTERNS,
    WHEEL_DIR,
    LockEntry,
    normalize,
    read_lock,
    sha256_file,
    target_pip_args,
)

MIB = 1 << 20
# A call carries the working tree (~30 MB, ~17 MB of it the tiny pair's weights) + one chunk within 64 MiB: at
# 32 MiB the locked set (~64 MB of xz) packs as two chunks of ~34 and ~30 MB, each one install call with room to spare.
DEFAULT_MAX_CHUNK_MIB = 32.0
XZ_PRESET = 9  # decoder needs 65 MiB of memory: fine there
END_OF_ARCHIVE = b"\0" * (2 * tarfile.BLOCKSIZE)
# Where pip --target puts console scripts (shebang = this machine's python) and data files (man pages):
# nothing there is importable, so they are left out.
NOT_PACKED = {"bin", "share"}


@dataclass
class Dist:
    name: str  # normalized
    version: str
    files: list[str] = field(default_factory=list)  # paths relative to the site dir, sorted
    trimmed: list[str] = field(default_factory=list)
    unpacked_bytes: int = 0
    piece: Path | None = None
    piece_bytes: int = 0


def install_target(wheels: list[Path], site: Path) -> None:
    if site.exists():
        shutil.rmtree(site)
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile", "--no-index",
           "--disable-pip-version-check", "--target", str(site), *target_pip_args(), *map(str, wheels)]
    env = dict(os.environ, PIP_CONFIG_FILE=os.devnull)
    env.pop("PIP_FIND_LINKS", None)
    subprocess.run(cmd, check=True, env=env)


def read_dists(site: Path) -> dict[str, Dist]:
    """Map each installed distribution to the files its RECORD lists (inside the site dir only)."""
    dists = {}
    for info in sorted(site.glob("*.dist-info")):
        meta = Parser().parsestr((info / "METADATA").read_text(encoding="utf-8"))
        dist = Dist(normalize(meta["Name"]), meta["Version"])
        for row in (info / "RECORD").read_text(encoding="utf-8").splitlines():
            rel = row.rsplit(",", 2)[0].strip('"') if row else ""
            path = (site / rel).resolve() if rel else None
            root = site.resolve()
            if path is None or root not in path.parents or path.relative_to(root).parts[0] in NOT_PACKED:
                continue
            if path.is_file():
                dist.files.append(path.relative_to(site.resolve()).as_posix())
        dist.files.sort()
        dists[dist.name] = dist
    return dists


def trim(site: Path, dist: Dist, patterns: list[str]) -> None:
    """Delete matching files and drop them from RECORD, so the installed metadata stays truthful."""
    gone = [f for f in dist.files if any(fnmatch.fnmatch(f, p) for p in patterns)]
    if not gone:
        raise SystemExit(f"trim patterns {patterns} match nothing in {dist.name}: update _common.TRIM_PATTERNS")
    for f in gone:
        (site / f).unlink()
    for d in sorted({str(Path(f).parent) for f in gone}, key=len, reverse=True):
        try:
            (site / d).rmdir()  # only if now empty
        except OSError:
            pass
    gone_set = set(gone)
    record = next(f for f in dist.files if f.endswith(".dist-info/RECORD"))
    rows = (site / record).read_text(encoding="utf-8").splitlines()
    (site / record).write_text("\n".join(r for r in rows if r.rsplit(",", 2)[0] not in gone_set) + "\n")
    dist.files = [f for f in dist.files if f not in gone_set]
    dist.trimmed = gone


def _tarinfo(site: Path, rel: str, mtime: int) -> tarfile.TarInfo:
    st = (site / rel).stat()
    ti = tarfile.TarInfo(rel)
    ti.size = st.st_size
    ti.mode = 0o755 if st.st_mode & 0o111 else 0o644
    ti.mtime = mtime
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    return ti


def lock_mtime(lock_sha256: str) -> int:
    """One timestamp for every member, derived from the lock: reproducible bytes, yet a new lock gives new
    mtimes, so Python's mtime+size check never reuses a stale .pyc after a chunk is replaced."""
    return 1_600_000_000 + int(lock_sha256[:5], 16)  # a September 2020 date: never in the future


def write_piece(site: str, files: list[str], out: str, mtime: int) -> int:
    """One distribution's files as tar members without the end-of-archive blocks, xz-compressed."""
    site_p = Path(site)
    raw = io.BytesIO()
    tf = tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT)
    for rel in files:
        with open(site_p / rel, "rb") as fh:
            tf.addfile(_tarinfo(site_p, rel, mtime), fh)
    # tf.close() would append the end-of-archive blocks; the chunk adds them once, at its end.
    data = raw.getvalue()
    Path(out).write_bytes(lzma.compress(data, format=lzma.FORMAT_XZ, preset=XZ_PRESET))
    return Path(out).stat().st_size


def group_into_chunks(dists: list[Dist], limit: int, end_bytes: int) -> list[list[Dist]]:
    """First-fit decreasing by compressed size; every chunk holds whole distributions and stays <= limit."""
    chunks: list[list[Dist]] = []
    sizes: list[int] = []
    for d in sorted(dists, key=lambda d: (-d.piece_bytes, d.name)):
        if d.piece_bytes + end_bytes > limit:
            raise SystemExit(f"{d.name} alone is {d.piece_bytes / MIB:.1f} MiB compressed, over the "
                             f"{limit / MIB:.1f} MiB chunk limit: trim it (TRIM_PATTERNS) or raise the limit.")
        for i, used in enumerate(sizes):
            if used + d.piece_bytes <= limit:
                chunks[i].append(d)
                sizes[i] += d.piece_bytes
                break
        else:
            chunks.append([d])
            sizes.append(d.piece_bytes + end_bytes)
    return [sorted(c, key=lambda d: d.name) for c in chunks]


def raw_wheel_bytes_trimmed(entries: list[LockEntry]) -> int:
    """What carrying the wheels themselves would cost, with the same files trimmed (for the comparison)."""
    total = 0
    for e in entries:
        path = WHEEL_DIR / e.filename
        total += path.stat().st_size
        pats = TRIM_PATTERNS.get(e.key, [])
        if pats:
            with zipfile.ZipFile(path) as zf:
                total -= sum(i.compress_size for i in zf.infolist()
                             if any(fnmatch.fnmatch(i.filename, p) for p in pats))
    return total


def pack(entries: list[LockEntry], wheel_dir: Path, out_dir: Path, max_chunk_mib: float,
         lock_path: Path, trim_patterns: dict[str, list[str]]) -> dict:
    wheels = [wheel_dir / e.filename for e in entries]
    missing = [w.name for w in wheels if not w.exists()]
    if missing:
        raise SystemExit(f"missing wheels {missing}: run scripts/device/fetch_wheels.py first.")
    for e, w in zip(entries, wheels, strict=True):
        if sha256_file(w) != e.sha256:
            raise SystemExit(f"{w.name}: sha256 differs from {lock_path.name}; fetch again.")
    build = out_dir / "build"
    site = build / "site"
    install_target(wheels, site)
    dists = read_dists(site)
    want = {e.key: e for e in entries}
    if set(dists) != set(want):
        raise SystemExit(f"installed {sorted(dists)} but the lock lists {sorted(want)}")
    for name, e in want.items():
        if dists[name].version != e.version:
            raise SystemExit(f"{name}: installed {dists[name].version}, lock says {e.version}")
    for name, pats in trim_patterns.items():
        if name in dists:
            trim(site, dists[name], pats)
    owned = {f for d in dists.values() for f in d.files}
    unowned = sorted(p.relative_to(site).as_posix() for p in site.rglob("*")
                     if p.is_file() and p.relative_to(site).parts[0] not in NOT_PACKED
                     and p.relative_to(site).as_posix() not in owned)
    if unowned:
        raise SystemExit(f"files no RECORD claims (would be left out): {unowned[:10]}")
    for d in dists.values():
        d.unpacked_bytes = sum((site / f).stat().st_size for f in d.files)

    pieces = build / "pieces"
    pieces.mkdir(parents=True, exist_ok=True)
    order = sorted(dists.values(), key=lambda d: -d.unpacked_bytes)  # biggest first keeps the pool busy
    mtime = lock_mtime(sha256_file(lock_path))
    with concurrent.futures.ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        futs = {d.name: pool.submit(write_piece, str(site), d.files, str(pieces / f"{d.name}.tar.xz"), mtime)
                for d in order}
        for d in order:
            d.piece_bytes = futs[d.name].result()
            d.piece = pieces / f"{d.name}.tar.xz"
    end_piece = lzma.compress(END_OF_ARCHIVE, format=lzma.FORMAT_XZ, preset=XZ_PRESET)
    groups = group_into_chunks(list(dists.values()), int(max_chunk_mib * MIB), len(end_piece))

    for old in out_dir.glob("site-*"):
        shutil.rmtree(old)
    chunks = []
    for i, group in enumerate(groups, 1):
        folder = out_dir / f"site-{i}"
        folder.mkdir()
        path = folder / f"site-{i}.tar.xz"
        with open(path, "wb") as fh:
            for d in group:
                fh.write(d.piece.read_bytes())
            fh.write(end_piece)
        chunks.append({
            "name": f"site-{i}",
            "path": path.relative_to(out_dir.parent).as_posix() if out_dir.parent == REPO_ROOT else str(path),
            "carry": folder.relative_to(out_dir.parent).as_posix() if out_dir.parent == REPO_ROOT else str(folder),
            "bytes": path.stat().st_size,
            "sha256": sha256_file(path),
            "unpacked_bytes": sum(d.unpacked_bytes for d in group),
            "files": sum(len(d.files) for d in group),
            "packages": [{"name": d.name, "version": d.version, "wheel": want[d.name].filename,
                          "wheel_sha256": want[d.name].sha256, "unpacked_bytes": d.unpacked_bytes,
                          "xz_bytes": d.piece_bytes, "trimmed_files": d.trimmed} for d in group],
        })
    shutil.rmtree(build)
    manifest = {
        "lock": lock_path.name,
        "lock_sha256": sha256_file(lock_path),
        "target": "CPython 3.12, manylinux x86-64",
        "xz_preset": XZ_PRESET,
        "member_mtime": mtime,
        "max_chunk_bytes": int(max_chunk_mib * MIB),
        "chunks": chunks,
        "total_bytes": sum(c["bytes"] for c in chunks),
        "total_unpacked_bytes": sum(c["unpacked_bytes"] for c in chunks),
        "raw_wheels_bytes": sum(w.stat().st_size for w in wheels),
        "raw_wheels_trimmed_bytes": raw_wheel_bytes_trimmed(entries) if wheel_dir == WHEEL_DIR else None,
    }
    text = json.dumps(manifest, indent=1) + "\n"
    (out_dir / "manifest.json").write_text(text)
    # A copy travels with every chunk, so the device can tell whether all chunks of this set are in.
    for c in chunks:
        (out_dir / c["name"] / "manifest.json").write_text(text)
    return manifest


def device_commands(manifest: dict) -> list[tuple[str, list[str]]]:
    """(command, carry) for each chunk's install call, in order."""
    return [(f"bash scripts/device/install_chunk.sh {c['carry']}", [c["carry"]]) for c in manifest["chunks"]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-chunk-mib", type=float, default=DEFAULT_MAX_CHUNK_MIB,
                    help=f"largest chunk, compressed (default {DEFAULT_MAX_CHUNK_MIB})")
    ap.add_argument("--wheel-dir", type=Path, default=WHEEL_DIR)
    ap.add_argument("--out-dir", type=Path, default=CACHE_DIR)
    ap.add_argument("--lock", type=Path, default=LOCK_PATH)
    args = ap.parse_args(argv)
    if args.max_chunk_mib <= 1:
        raise SystemExit(f"--max-chunk-mib must be > 1 (MiB per chunk), got {args.max_chunk_mib}.")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    manifest = pack(read_lock(args.lock), args.wheel_dir, args.out_dir, args.max_chunk_mib, args.lock,
                    TRIM_PATTERNS)
    for c in manifest["chunks"]:
        names = ", ".join(p["name"] for p in c["packages"])
        print(f"{c['name']}: {c['bytes'] / MIB:6.2f} MiB ({c['unpacked_bytes'] / MIB:7.1f} MiB unpacked, "
              f"{c['files']} files): {names}")
    print(f"total {manifest['total_bytes'] / MIB:.2f} MiB in {len(manifest['chunks'])} chunks "
          f"({manifest['total_unpacked_bytes'] / MIB:.1f} MiB unpacked); raw wheels "
          f"{manifest['raw_wheels_bytes'] / MIB:.1f} MiB"
          + (f", trimmed {manifest['raw_wheels_trimmed_bytes'] / MIB:.1f} MiB"
             if manifest["raw_wheels_trimmed_bytes"] else ""))
    print("\ninstall calls (back to back, the machine stays warm only 30 s):")
    for cmd, carry in device_commands(manifest):
        print(f"  carry={json.dumps(carry)}  command: {cmd}")
    print("scripts/device/plan.py prints the whole sequence (the last install shares a call with the suite), "
          "checked against the device tool's limits.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
