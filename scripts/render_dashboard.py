"""Render the Grafana dashboard's panels as one PNG for the docs (docs/img/dashboard.png), from a real Prometheus.

The same harness as tests/test_dashboard.py (sglang_ddtree/dashboard.py): the recorded tiny-pair rounds
(tests/fixtures/recorded_rounds_tiny.jsonl, offline decoders on CPU, DDTree at budget 64 and `ddtree_auto`) are fed
into two servers' Prometheus series, `--repeat` times over, spread over `--seconds`; a local `prometheus` scrapes
them every second; each panel's query is then evaluated (range queries for time series, instant ones over the whole
run for bar gauges) and drawn with matplotlib. Needs the `prometheus` binary (scripts/install_prometheus.sh).

  python scripts/render_dashboard.py [--out docs/img/dashboard.png] [--seconds 60] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from sglang_ddtree import metric_names as mn  # noqa: E402
from sglang_ddtree.dashboard import (DASHBOARD_PATH, PrometheusServer, ReplayServer, replay_rounds,  # noqa: E402
                                     substitute)

FIXTURE = ROOT / "tests" / "fixtures" / "recorded_rounds_tiny.jsonl"


def legend(fmt: str, metric: dict) -> str:
    out = fmt
    for k, v in metric.items():
        out = out.replace("{{" + k + "}}", v)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "docs" / "img" / "dashboard.png"))
    p.add_argument("--seconds", type=float, default=60.0, help="wall time over which the rounds are fed")
    p.add_argument("--repeat", type=int, default=3, help="feed the recorded rounds this many times")
    p.add_argument("--rate-interval", default="10s", help="what Grafana would put in $__rate_interval")
    args = p.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fixed, depth_limit = replay_rounds(FIXTURE, "ddtree_tb64")
    auto, _ = replay_rounds(FIXTURE, "ddtree_auto")
    servers = [(ReplayServer("64", depth_limit, 65), fixed * args.repeat),
               (ReplayServer("auto", depth_limit, 257), auto * args.repeat)]
    dash = json.loads(DASHBOARD_PATH.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        try:
            targets = [srv.serve() for srv, _ in servers]
            with PrometheusServer(targets, Path(tmp) / "prometheus", scrape_interval="1s") as prom:
                prom.wait_for(mn.ROUNDS.name, lambda r: len(r) == 2)
                start = time.time()
                ticks = int(args.seconds * 4)
                for k in range(ticks):
                    for srv, rounds in servers:
                        n = len(rounds)
                        for batch in rounds[k * n // ticks:(k + 1) * n // ticks]:
                            srv.feed(batch)
                    time.sleep(args.seconds / ticks)
                for srv, _ in servers:
                    srv.flush()
                time.sleep(2.5)
                end = time.time()
                span = f"{math.ceil(end - start)}s"
                results = []
                for panel in dash["panels"]:
                    series = []
                    for t in panel["targets"]:
                        expr = substitute(t["expr"], rate_interval=args.rate_interval, range_=span)
                        if t.get("instant"):
                            for s in prom.query(expr, at=end):
                                series.append((legend(t["legendFormat"], s["metric"]), float(s["value"][1])))
                        else:
                            for s in prom.query_range(expr, start, end, 1):
                                xs = [float(v[0]) - start for v in s["values"]]
                                ys = [float(v[1]) for v in s["values"]]
                                series.append((legend(t["legendFormat"], s["metric"]), (xs, ys)))
                    results.append((panel, series))
        finally:
            for srv, _ in servers:
                srv.close()

    rows = math.ceil(len(results) / 2)
    fig, axes = plt.subplots(rows, 2, figsize=(13, 3.1 * rows))
    for ax, (panel, series) in zip(axes.flat, results):
        ax.set_title(panel["title"], fontsize=9, loc="left")
        ax.tick_params(labelsize=7)
        unit = panel["fieldConfig"]["defaults"]["unit"]
        scale = 1e3 if unit == "s" else 100.0 if unit == "percentunit" else 1.0
        ylabel = {"s": "ms", "percentunit": "%"}.get(unit, "")
        if panel["type"] == "bargauge":
            bars = sorted(series, key=lambda s: (s[0].split()[0], int(s[0].split("=")[-1])))
            by_budget: dict[str, list] = {}
            for name, v in bars:
                by_budget.setdefault(name.split()[0], []).append((int(name.split("=")[-1]), v * scale))
            width = 0.8 / max(len(by_budget), 1)
            for i, (b, pts) in enumerate(by_budget.items()):
                ax.bar([x + (i - (len(by_budget) - 1) / 2) * width for x, _ in pts], [y for _, y in pts], width,
                       label=b)
            ax.set_xlabel("depth d" if "depth" in panel["title"] else "tokens n", fontsize=7)
        else:
            stack = panel["fieldConfig"]["defaults"].get("custom", {}).get("stacking", {}).get("mode") == "normal"
            named = sorted(series, key=lambda s: s[0])
            if stack and named:  # on the union of the series' timestamps, a missing point counting 0
                xs = sorted({x for _, (sx, _) in named for x in sx})
                ys = []
                for _, (sx, sy) in named:
                    at = dict(zip(sx, sy))
                    ys.append([at.get(x, 0.0) * scale if math.isfinite(at.get(x, 0.0)) else 0.0 for x in xs])
                ax.stackplot(xs, ys, labels=[name for name, _ in named], alpha=0.8)
            else:
                for name, (xs, ys) in named:
                    ax.plot(xs, [y * scale for y in ys], label=name, lw=1)
            ax.set_xlabel("seconds", fontsize=7)
        ax.set_ylabel(ylabel, fontsize=7)
        ax.legend(fontsize=6, ncol=2, loc="best", frameon=False)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(results):]:
        ax.axis("off")
    fig.suptitle("dashboards/sglang-ddtree.json, each panel's query evaluated by Prometheus: rounds recorded from "
                 "the offline decoders on the tiny pair (CPU), replayed into the server's metrics", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    import io

    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, dpi=72, format="png")
    buf.seek(0)  # a 128-colour palette: a third of the size, no visible change for line plots
    Image.open(buf).convert("RGB").quantize(colors=128).save(args.out, optimize=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
