#!/usr/bin/env python3
"""On the GPU machine (after `source scripts/device/env.sh`): check every Requires-Dist of the carried site
dir against what this interpreter actually resolves (the site dir first, then the image), like `pip check`
restricted to our wheels. Confirms the image versions that fetch_wheels.py --check could not know.

  python3 scripts/device/check_site.py [--json out.json]

Exit status 0 even with unmet requirements (they are reported, and the suite's tests decide); 2 if the site
dir holds no distributions at all.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import normalize, read_wanted  # noqa: E402


def check(site: Path) -> dict:
    skipped = read_wanted().skipped
    carried = list(metadata.distributions(path=[str(site)]))
    result = {"site": str(site), "distributions": len(carried), "unmet": [], "skipped": [], "shadowed": []}
    for dist in carried:
        name = normalize(dist.metadata["Name"])
        try:
            resolved = metadata.distribution(name)
            if resolved.version != dist.version:
                result["shadowed"].append(f"{name}: site has {dist.version} but {resolved.version} is found first")
        except metadata.PackageNotFoundError:
            pass
        for raw in dist.requires or []:
            req = Requirement(raw)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            dep = normalize(req.name)
            try:
                have = metadata.version(dep)
            except metadata.PackageNotFoundError:
                have = None
            ok = have is not None
            if ok and str(req.specifier):
                try:
                    ok = req.specifier.contains(Version(have), prereleases=True)
                except InvalidVersion:
                    ok = False
            if ok:
                continue
            line = f"{name} needs {req}, found {have or 'nothing'}"
            (result["skipped"] if dep in skipped else result["unmet"]).append(line)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--site", type=Path, default=Path(os.environ.get("DDTREE_SITE", "/tmp/site")))
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args(argv)
    result = check(args.site)
    for key in ("unmet", "shadowed"):
        for line in result[key]:
            print(f"check_site: {key}: {line}")
    print(f"check_site: {result['distributions']} distributions in {args.site}, {len(result['unmet'])} unmet, "
          f"{len(result['skipped'])} skipped on purpose (wheels.in), {len(result['shadowed'])} shadowed")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 2 if result["distributions"] == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
