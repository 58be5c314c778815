#!/usr/bin/env python3
"""Make the repo's package a discoverable distribution without installing it: write
`<site>/sglang_ddtree-<version>.dist-info/` (METADATA, entry_points.txt, top_level.txt, INSTALLER, RECORD)
from pyproject.toml.

  python3 scripts/device/write_dist_info.py /tmp/site

With the repo root on PYTHONPATH the code imports from the working tree; this dist-info makes
`importlib.metadata` see the project, so SGLang's plugin loader finds our `sglang.srt.plugins` entry point.
Why not `pip install -e .`: that needs the build backend offline (setuptools/wheel versions of the image),
writes a finder into the image's site-packages, and takes seconds; this needs only the standard library and
is rewritten from pyproject.toml on every `source scripts/device/env.sh`, so it never goes stale.
"""

from __future__ import annotations

import re
import shutil
import sys
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent.parent


def dist_info(pyproject: Path) -> dict[str, str]:
    """File name -> contents for the dist-info of the project described by pyproject."""
    project = tomllib.loads(pyproject.read_text())["project"]
    name, version = project["name"], project["version"]
    groups: dict[str, dict[str, str]] = dict(project.get("entry-points", {}))
    if project.get("scripts"):
        groups["console_scripts"] = project["scripts"]
    entry_points = "".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for group, eps in groups.items()
    )
    # Top-level packages: the roots of [tool.setuptools.packages.find] include patterns ("sglang_ddtree*").
    data = tomllib.loads(pyproject.read_text())
    include = data.get("tool", {}).get("setuptools", {}).get("packages", {}).get("find", {}).get("include", [])
    packages = sorted({pat.rstrip("*").split(".")[0] for pat in include if pat.rstrip("*")})
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    if project.get("description"):
        metadata += f"Summary: {project['description']}\n"
    if project.get("requires-python"):
        metadata += f"Requires-Python: {project['requires-python']}\n"
    files = {
        "METADATA": metadata,
        "entry_points.txt": entry_points,
        "top_level.txt": "".join(p + "\n" for p in packages),
        "INSTALLER": "scripts/device/write_dist_info.py\n",
    }
    files["RECORD"] = "".join(f"{dist_dir_name(name, version)}/{f},,\n" for f in [*files, "RECORD"])
    return files


def dist_dir_name(name: str, version: str) -> str:
    return f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}.dist-info"


def write(site: Path, pyproject: Path = REPO_ROOT / "pyproject.toml") -> Path:
    project = tomllib.loads(pyproject.read_text())["project"]
    target = site / dist_dir_name(project["name"], project["version"])
    prefix = dist_dir_name(project["name"], "")[: -len("-.dist-info")]
    for old in site.glob(f"{prefix}-*.dist-info"):  # an older version would be found too
        if old != target:
            shutil.rmtree(old)
    target.mkdir(parents=True, exist_ok=True)
    for fname, text in dist_info(pyproject).items():
        (target / fname).write_text(text)
    return target


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: write_dist_info.py SITE_DIR", file=sys.stderr)
        return 2
    site = Path(argv[0])
    site.mkdir(parents=True, exist_ok=True)
    print(f"write_dist_info: {write(site)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
