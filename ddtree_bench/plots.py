"""PNG plots of a sweep results file (and, optionally, the cost model's projection).

  tau_vs_budget.png           measured tau per budget (setups with real acceptance), the DFLASH chain's per batch size
  tokens_per_s_vs_budget.png  decode tokens/s per budget, one line per batch size, plain / DFLASH / `auto` as levels,
                              the best fixed budget starred; a costs-only setup (random weights) shows its step time
                              instead; projected tokens/s from the cost model get their own panel, titled as projected
  stage_breakdown.png         DDTREE ms per round by stage (draft/tree/verify/walk/commit), stacked, per batch size
  speedup.png                 DDTREE (and `auto`, dotted) over plain and over the DFLASH chain, measured (and
                              projected when given); one panel per reference the setup has rows of
Measured points carry the min-max of their runs as error bars when the rows have several runs (tokens/s: each run;
speedup: run r over the reference's run r, when both rows have the same number of runs); runs in which a row had
rate-outlier requests (a request timed short inflates the run's summed tokens/s) are left out of the bars, as
ddtree_bench/paired.py leaves them out of its ratios. The points themselves are the rows' tokens/s (median run).
Projected curves are dotted; hollow markers are budgets outside the verify sizes the cost setup measured.

  python -m ddtree_bench.plots --sweep results.jsonl [--projection best_budget_projected.json] [--out-dir DIR]

--projection takes the cost model's output (ddtree_bench/cost_model.py); the measured best budgets
(ddtree_bench/best_budget.py) are the sweep's own rows, drawn from the sweep already, and are refused there.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from ddtree_bench.results import ok_results, read_rows
from sglang_ddtree.stages import SERVER_STAGES as STAGES

STAGE_COLORS = ("#bbbbbb", "#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _group(rows, setup, method):
    """batch -> sorted [(budget, row)] for ddtree; batch -> row for plain/dflash."""
    out = defaultdict(list) if method == "ddtree" else {}
    for r in rows:
        if r["setup"] != setup or r["method"] != method:
            continue
        if method == "ddtree":
            out[r["batch_size"]].append((r["budget"], r))
        else:
            out[r["batch_size"]] = r
    if method == "ddtree":
        for b in out:
            out[b].sort(key=lambda x: x[0])
    return out


def _setups(rows):
    return sorted({r["setup"] for r in rows})


def _flagged(row) -> set[int]:
    """Runs with rate-outlier requests (a request timed short inflates the run's summed tokens/s)."""
    return {i for i, n in enumerate(row.get("decode_rate_outliers_runs") or []) if n}


def _runs(row) -> list[float]:
    """The row's per-run tokens/s, flagged runs (_flagged) left out."""
    bad = _flagged(row)
    return [float(x) for i, x in enumerate(row.get("decode_tokens_per_s_runs") or []) if i not in bad]


def _span(value: float, runs: list[float]) -> tuple[float, float]:
    """(below, above) `value` to the min and max of `runs` (0, 0 without runs): an asymmetric error bar."""
    if not runs:
        return 0.0, 0.0
    return max(0.0, value - min(runs)), max(0.0, max(runs) - value)


def _line_with_spread(ax, pts, color, label, **kw):
    """pts: [(x, y, (below, above))]; a marked line with min-max error bars where a point has a spread."""
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    ax.plot(xs, ys, marker=kw.pop("marker", "o"), color=color, label=label, **kw)
    spread = [p for p in pts if p[2] != (0.0, 0.0)]
    if spread:
        ax.errorbar([p[0] for p in spread], [p[1] for p in spread],
                    yerr=[[p[2][0] for p in spread], [p[2][1] for p in spread]],
                    fmt="none", ecolor=color, elinewidth=0.8, capsize=2)


def _run_ratios(num, den) -> list[float]:
    """num's run r over den's run r when both rows have the same number (>= 2) of runs, rounds in which either
    row has a flagged run (_flagged) left out; [] when they cannot be paired."""
    a, b = num.get("decode_tokens_per_s_runs") or [], den.get("decode_tokens_per_s_runs") or []
    if len(a) < 2 or len(a) != len(b):
        return []
    bad = _flagged(num) | _flagged(den)
    return [x / y for i, (x, y) in enumerate(zip(a, b)) if i not in bad and y > 0]


def _colors(batches):
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2"]
    return {b: palette[i % len(palette)] for i, b in enumerate(sorted(batches))}


def _projected_line(ax, candidates, key, color, label):
    """Dotted line through a projection; hollow markers where it extrapolates beyond the measured verify sizes."""
    pts = [(c["budget"], c[key], c.get("extrapolated")) for c in candidates if c.get(key)]
    if not pts:
        return
    ax.plot([p[0] for p in pts], [p[1] for p in pts], linestyle=":", color=color, label=label)
    inside = [p for p in pts if not p[2]]
    outside = [p for p in pts if p[2]]
    if inside:
        ax.plot([p[0] for p in inside], [p[1] for p in inside], "o", color=color)
    if outside:
        ax.plot([p[0] for p in outside], [p[1] for p in outside], "o", mfc="white", color=color)


def _legend_or_note(ax, outside: bool = False):
    """The panel's legend (outside: right of the axes, where it hides no curve), or a note that it is empty."""
    if ax.get_legend_handles_labels()[0]:
        if outside:
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
        else:
            ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no rows to compare", transform=ax.transAxes, ha="center", color="gray")


def _log2_budget_axis(ax):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("budget B (draft nodes per tree)")


def plot_tau(rows, out: Path, plt, dpi: int = 120) -> Path | None:
    setups = [s for s in _setups(rows) if any(r["setup"] == s and r.get("acceptance_meaningful") and
                                             r.get("tau") is not None for r in rows)]
    if not setups:
        return None
    fig, axes = plt.subplots(1, len(setups), figsize=(6 * len(setups), 4.2), squeeze=False)
    for ax, setup in zip(axes[0], setups):
        dd = _group(rows, setup, "ddtree")
        colors = _colors(set(dd) | set(_group(rows, setup, "dflash")))
        for b, pts in sorted(dd.items()):
            pts = [(B, r["tau"]) for B, r in pts if r.get("tau") is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", color=colors[b], label=f"DDTREE, batch {b}")
        fl = _group(rows, setup, "dflash")
        shown = False
        for b, r in sorted(fl.items()):
            if r.get("tau") is not None:
                ax.axhline(r["tau"], color=colors.get(b, "gray"), linestyle="-.", lw=0.8)
                shown = True
        if shown:
            ax.plot([], [], color="gray", linestyle="-.", label="DFLASH chain (per batch colour)")
        _log2_budget_axis(ax)
        ax.set_ylabel("tau: tokens committed per round")
        ax.set_title(f"{setup}: acceptance (measured)")
        ax.grid(alpha=0.3)
        _legend_or_note(ax)
    fig.tight_layout()
    path = out / "tau_vs_budget.png"
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_tokens_per_s(rows, out: Path, plt, projection: dict | None, dpi: int = 120) -> Path | None:
    setups = _setups(rows)
    panels = [(s, "measured") for s in setups] + ([("projection", "projected")] if projection else [])
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 4.4), squeeze=False)
    for ax, (setup, kind) in zip(axes[0], panels):
        if kind == "projected":
            by_batch = projection["by_batch"]
            colors = _colors(int(b) for b in by_batch)
            for b, entry in by_batch.items():
                _projected_line(ax, entry["candidates"], "tokens_per_s_projected", colors[int(b)],
                                f"batch {b} (projected)")
                if entry.get("plain_tokens_per_s_measured"):
                    ax.axhline(entry["plain_tokens_per_s_measured"], color=colors[int(b)], linestyle="--", lw=0.8)
            ax.set_title(f"PROJECTED tokens/s ({projection.get('cost_setup')} costs x tau from "
                         f"{projection.get('tau_source', {}).get('kind')})", fontsize=9)
            ax.set_ylabel("decode tokens/s (projected)")
        else:
            costs_only = not any(r.get("acceptance_meaningful") for r in rows if r["setup"] == setup)
            field, label = (("step_ms", "ms per step (round)") if costs_only else
                            ("decode_tokens_per_s", "decode tokens/s (measured)"))
            dd = _group(rows, setup, "ddtree")
            others = {m: _group(rows, setup, m) for m in ("plain", "dflash", "auto")}
            colors = _colors(set(dd).union(*others.values()))
            starred = False
            for b, pts in sorted(dd.items()):
                pts = [(B, r[field], _span(r[field], _runs(r)) if field == "decode_tokens_per_s" else (0.0, 0.0))
                       for B, r in pts if r.get(field) is not None]
                if pts:
                    _line_with_spread(ax, pts, colors[b], f"DDTREE, batch {b}")
                    if not costs_only:  # the best fixed budget of the batch size, by measured tokens/s
                        best = max(pts, key=lambda p: p[1])
                        ax.plot(best[0], best[1], marker="*", ms=13, color=colors[b], mec="black", mew=0.6)
                        starred = True
            for method, style in (("plain", "--"), ("dflash", "-."), ("auto", ":")):
                for b, r in others[method].items():
                    if r.get(field) is not None:
                        ax.axhline(r[field], color=colors[b], linestyle=style, lw=1.0 if method == "auto" else 0.8)
            for method, style, name in (("plain", "--", "plain (per batch colour)"), ("dflash", "-.", "DFLASH chain"),
                                        ("auto", ":", "auto")):
                if others[method]:
                    ax.plot([], [], color="gray", linestyle=style, label=name)
            if starred:
                ax.plot([], [], marker="*", ms=11, color="gray", mec="black", mew=0.6, linestyle="none",
                        label="best fixed budget")
            ax.set_title(f"{setup}: " + ("step time (costs only: random weights)" if costs_only else
                                         "decode throughput (measured)"), fontsize=10)
            ax.set_ylabel(label)
        ax.set_yscale("log")
        _log2_budget_axis(ax)
        ax.grid(alpha=0.3, which="both")
        _legend_or_note(ax, outside=kind == "measured")
    fig.tight_layout()
    path = out / "tokens_per_s_vs_budget.png"
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_stages(rows, out: Path, plt, dpi: int = 120) -> Path | None:
    setups = [s for s in _setups(rows) if any(r["setup"] == s and r.get("stage_ms") for r in rows)]
    if not setups:
        return None
    batches = sorted({r["batch_size"] for r in rows if r.get("stage_ms")})
    fig, axes = plt.subplots(len(setups), len(batches), figsize=(3.6 * len(batches), 3.4 * len(setups)),
                             squeeze=False)
    for i, setup in enumerate(setups):
        dd = _group(rows, setup, "ddtree")
        for j, b in enumerate(batches):
            ax = axes[i][j]
            pts = [(B, r["stage_ms"]) for B, r in dd.get(b, []) if r.get("stage_ms")]
            if not pts:
                ax.set_visible(False)
                continue
            x = range(len(pts))
            bottom = [0.0] * len(pts)
            for stage, color in zip(STAGES, STAGE_COLORS):
                h = [s.get(stage, 0.0) for _, s in pts]
                ax.bar(x, h, bottom=bottom, color=color, label=stage)
                bottom = [u + v for u, v in zip(bottom, h)]
            ax.set_xticks(list(x), [str(B) for B, _ in pts], fontsize=7)
            ax.set_title(f"{setup}, batch {b}", fontsize=9)
            ax.set_xlabel("budget")
            if j == 0:
                ax.set_ylabel("ms per round (GPU, by stage)")
            ax.grid(alpha=0.3, axis="y")
    handles, labels = next((a.get_legend_handles_labels() for row in axes for a in row if a.get_visible()), ([], []))
    fig.legend(handles, labels, loc="upper right", fontsize=8)
    fig.tight_layout(rect=(0, 0, 0.93, 1))
    path = out / "stage_breakdown.png"
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_speedup(rows, out: Path, plt, projection: dict | None, dpi: int = 120) -> Path | None:
    setups = [s for s in _setups(rows) if any(r["setup"] == s and r.get("acceptance_meaningful") for r in rows)]
    panels = [(s, ref) for s in setups for ref in ("plain", "dflash") if _group(rows, s, ref)]
    if projection:
        panels += [("projection", "plain"), ("projection", "dflash")]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2), squeeze=False)
    for ax, (setup, ref) in zip(axes[0], panels):
        if setup == "projection":
            key = f"speedup_vs_{ref}_projected"
            colors = _colors(int(b) for b in projection["by_batch"])
            for b, entry in projection["by_batch"].items():
                _projected_line(ax, entry["candidates"], key, colors[int(b)], f"batch {b}")
            ax.set_title(f"PROJECTED speedup over {'plain' if ref == 'plain' else 'DFLASH chain'}", fontsize=9)
        else:
            dd = _group(rows, setup, "ddtree")
            base = _group(rows, setup, ref)
            auto = _group(rows, setup, "auto")
            colors = _colors(set(dd) | set(auto))
            for b, pts in sorted(dd.items()):
                if b not in base or not base[b].get("decode_tokens_per_s"):
                    continue
                ref_tps = base[b]["decode_tokens_per_s"]
                pts = [(B, r["decode_tokens_per_s"] / ref_tps) for B, r in pts]
                pts = [(B, y, _span(y, _run_ratios(r, base[b]))) for (B, y), (_, r) in zip(pts, dd[b])]
                _line_with_spread(ax, pts, colors[b], f"batch {b}")
                if b in auto and auto[b].get("decode_tokens_per_s"):
                    ax.axhline(auto[b]["decode_tokens_per_s"] / ref_tps, color=colors[b], linestyle=":", lw=1.0)
            if auto:
                ax.plot([], [], color="gray", linestyle=":", label="auto (per batch colour)")
            ax.set_title(f"{setup}: speedup over {'plain' if ref == 'plain' else 'DFLASH chain'} (measured)",
                         fontsize=9)
        ax.axhline(1.0, color="black", lw=0.8)
        _log2_budget_axis(ax)
        ax.set_ylabel("DDTREE tokens/s / reference tokens/s")
        ax.grid(alpha=0.3)
        _legend_or_note(ax)
    fig.tight_layout()
    path = out / "speedup.png"
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def make_plots(sweep: str | Path, out_dir: str | Path, projection: str | Path | None = None,
               setups: list[str] | None = None, dpi: int = 120) -> list[Path]:
    """The PNGs of the module docstring for the sweep's ok rows (of `setups` only, when given)."""
    rows = ok_results(read_rows(sweep))
    if setups:
        rows = [r for r in rows if r["setup"] in setups]
    if not rows:
        raise ValueError(f"{sweep}: no ok result rows to plot" + (f" in setups {setups}." if setups else "."))
    proj = json.loads(Path(projection).read_text()) if projection else None
    if proj is not None and (not proj.get("projected", True) or "fit" not in proj):
        raise ValueError(f"{projection}: not a cost-model projection (measured best budgets are the sweep's own "
                         "rows); pass the output of python -m ddtree_bench.cost_model.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plt = _plt()
    made = [plot_tau(rows, out, plt, dpi), plot_tokens_per_s(rows, out, plt, proj, dpi),
            plot_stages(rows, out, plt, dpi), plot_speedup(rows, out, plt, proj, dpi)]
    return [p for p in made if p is not None]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", required=True, help="results JSONL of benchmarks/bench_budgets.py")
    ap.add_argument("--projection", default=None,
                    help="the cost model's output (best_budget_projected.json of ddtree_bench.cost_model)")
    ap.add_argument("--setups", default=None, help="comma-separated setups to plot (default: every setup)")
    ap.add_argument("--dpi", type=int, default=120, help="resolution of the PNGs")
    ap.add_argument("--out-dir", default="benchmarks/results")
    args = ap.parse_args(argv)
    if args.dpi < 20:
        ap.error("--dpi must be at least 20")
    try:
        paths = make_plots(args.sweep, args.out_dir, args.projection,
                           setups=args.setups.split(",") if args.setups else None, dpi=args.dpi)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for p in paths:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
