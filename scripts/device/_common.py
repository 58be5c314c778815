"""Helpers shared by the scripts in scripts/device/ (run here, on the CPU machine, with the repo's venv).

Nothing here runs on the GPU machine: the device side is plain bash (install_chunk.sh, env.sh) plus
run_gpu_suite.py, which imports nothing from this file.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

DEVICE_DIR = Path(__file__).resolve().parent
REPO_ROOT = DEVICE_DIR.parent.parent
WANTED_PATH = DEVICE_DIR / "wheels.in"
LOCK_PATH = DEVICE_DIR / "wheels.lock"
IMAGE_PATH = DEVICE_DIR / "image_packages.txt"
WHEEL_DIR = REPO_ROOT / ".wheels"
CACHE_DIR = REPO_ROOT / ".device-cache"

# The GPU image's interpreter: CPython 3.12.3 on x86-64 Linux (glibc of a current Ubuntu).
TARGET_PYTHON = "3.12"
# pip matches platform tags exactly, so list every manylinux level a wheel may be tagged with.
TARGET_PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)] + [
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
]
# Environment for evaluating Requires-Dist markers as the GPU image would.
TARGET_MARKER_ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "implementation_version": "3.12.3",
    "platform_python_implementation": "CPython",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "sys_platform": "linux",
    "os_name": "posix",
    "extra": "",
}

# Files dropped from a wheel when packing, as fnmatch patterns on the path inside the site dir.
TRIM_PATTERNS = {
    # FA3 (1.1 GB unpacked; we use the triton/flashinfer backends) and Blackwell-only kernels (H200 is sm_90).
    "sglang-kernel": ["sgl_kernel/flash_ops*.so", "sgl_kernel/sm100/*"],
    # A static library for C++ users (61 MB); Python loads libxgrammar_bindings.so, never the .a.
    "xgrammar": ["xgrammar/lib/*.a"],
}


def target_pip_args() -> list[str]:
    """pip options that select cp312 manylinux x86-64 binaries, whatever this machine is."""
    args = ["--only-binary=:all:", "--python-version", TARGET_PYTHON, "--implementation", "cp"]
    for plat in TARGET_PLATFORMS:
        args += ["--platform", plat]
    return args


def normalize(name: str) -> str:
    """PEP 503 normalized project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class LockEntry:
    name: str  # as written in the lock (normalized)
    version: str
    sha256: str
    filename: str

    @property
    def key(self) -> str:
        return normalize(self.name)


_LOCK_LINE = re.compile(
    r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>\S+)\s+--hash=sha256:(?P<sha>[0-9a-f]{64})"
    r"\s+#\s*(?P<file>\S+\.whl)\s*$"
)


def read_lock(path: Path = LOCK_PATH) -> list[LockEntry]:
    """Parse wheels.lock: `name==version --hash=sha256:HEX  # filename.whl` per line (a pip requirements file)."""
    entries = []
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _LOCK_LINE.match(line)
        if not m:
            raise ValueError(
                f"{path}:{lineno}: expected 'name==version --hash=sha256:<64 hex>  # file.whl', got {raw!r}"
            )
        entries.append(LockEntry(m["name"], m["version"], m["sha"], m["file"]))
    keys = [e.key for e in entries]
    dupes = sorted({k for k in keys if keys.count(k) > 1})
    if dupes:
        raise ValueError(f"{path}: packages listed more than once: {', '.join(dupes)}; keep one version of each.")
    return entries


@dataclass(frozen=True)
class Wanted:
    carried: dict[str, str | None]  # normalized name -> exact version pin or None
    skipped: dict[str, str]  # normalized name -> reason


def read_wanted(path: Path = WANTED_PATH) -> Wanted:
    """Parse wheels.in (see the header of that file for the three line forms)."""
    carried: dict[str, str | None] = {}
    skipped: dict[str, str] = {}
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split(" #", 1)[0].strip() if not raw.lstrip().startswith("!") else raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("!"):
            parts = line[1:].split(None, 1)
            if len(parts) < 2:
                raise ValueError(f"{path}:{lineno}: a skip line needs a reason: '!name  why it is not needed'.")
            skipped[normalize(parts[0])] = parts[1].strip()
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)(?:==(\S+))?", line)
        if not m:
            raise ValueError(f"{path}:{lineno}: expected 'name' or 'name==version', got {raw!r}.")
        carried[normalize(m[1])] = m[2]
    both = sorted(set(carried) & set(skipped))
    if both:
        raise ValueError(f"{path}: listed as both carried and skipped: {', '.join(both)}.")
    return Wanted(carried, skipped)


def read_image_packages(path: Path = IMAGE_PATH) -> dict[str, str | None]:
    """Normalized name -> known version (or None when the image's version was not recorded)."""
    out: dict[str, str | None] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, _, version = line.partition("==")
        out[normalize(name)] = version or None
    return out
