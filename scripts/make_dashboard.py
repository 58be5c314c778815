"""Write the Grafana dashboard JSON (dashboards/sglang-ddtree.json) from the panel list in sglang_ddtree/dashboard.py.

  python scripts/make_dashboard.py          # (re)write it
  python scripts/make_dashboard.py --check  # exit 1 when the committed file differs from the panel list
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sglang_ddtree.dashboard import DASHBOARD_PATH, dashboard_json  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="fail when the committed file is stale")
    args = p.parse_args(argv)
    text = dashboard_json()
    if args.check:
        current = DASHBOARD_PATH.read_text() if DASHBOARD_PATH.exists() else ""
        if current != text:
            print(f"{DASHBOARD_PATH} is stale: run python scripts/make_dashboard.py", file=sys.stderr)
            return 1
        return 0
    DASHBOARD_PATH.parent.mkdir(parents=True, exist_ok=True)
    DASHBOARD_PATH.write_text(text)
    print(f"wrote {DASHBOARD_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
