"""PNG plots of a sweep results file (and, optionally, the cost model's projection).

  tau_vs_budget.png           measured tau per budget (setups with real acceptance), DFLASH chain for reference
  tokens_per_s_vs_budget.png  decode tokens/s per budget, one line per batch size, plain / DFLASH as dashed levels;
                              a costs-only setup (random weights) shows its step time instead; projected tokens/s
                              from the cost model get their own panel, titled as projected
  stage_breakdown.png         DDTREE ms per round by stage (draft/tree/verify/walk/commit), stacked, per batch size
  speedup.png                 DDTREE over plain and over the DFLASH chain, measured (and projected when given)
Projected curves are dotted; hollow markers are budgets outside the verify sizes the cost setup measured.

  python -m ddtree_bench.plots --sweep results.jsonl [--projection best_budget.json] [--out-dir DIR]
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


def _legend_or_note(ax):
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no rows to compare", transform=ax.transAxes, ha="center", color="gray")


def _log2_budget_axis(ax):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("budget B (draft nodes per tree)")


def plot_tau(rows, out: Path, plt) -> Path | None:
    setups = [s for s in _setups(rows) if any(r["setup"] == s and r.get("acceptance_meaningful") and
                                             r.get("tau") is not None for r in rows)]
    if not setups:
        return None
    fig, axes = plt.subplots(1, len(setups), figsize=(6 * len(setups), 4.2), squeeze=False)
    for ax, setup in zip(axes[0], setups):
        dd = _group(rows, setup, "ddtree")
        colors = _colors(dd)
        for b, pts in sorted(dd.items()):
            pts = [(B, r["tau"]) for B, r in pts if r.get("tau") is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", color=colors[b], label=f"DDTREE, batch {b}")
        fl = _group(rows, setup, "dflash")
        taus = [r["tau"] for r in fl.values() if r.get("tau") is not None]
        if taus:
            ax.axhline(sum(taus) / len(taus), color="gray", linestyle="--", label="DFLASH chain (mean over batches)")
        _log2_budget_axis(ax)
        ax.set_ylabel("tau: tokens committed per round")
        ax.set_title(f"{setup}: acceptance (measured)")
        ax.grid(alpha=0.3)
        _legend_or_note(ax)
    fig.tight_layout()
    path = out / "tau_vs_budget.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_tokens_per_s(rows, out: Path, plt, projection: dict | None) -> Path | None:
    setups = _setups(rows)
    panels = [(s, "measured") for s in setups] + ([("projection", "projected")] if projection else [])
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.4), squeeze=False)
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
            others = {m: _group(rows, setup, m) for m in ("plain", "dflash")}
            colors = _colors(set(dd) | set(others["plain"]) | set(others["dflash"]))
            for b, pts in sorted(dd.items()):
                pts = [(B, r[field]) for B, r in pts if r.get(field) is not None]
                if pts:
                    ax.plot(*zip(*pts), marker="o", color=colors[b], label=f"DDTREE, batch {b}")
            for method, style in (("plain", "--"), ("dflash", "-.")):
                for b, r in others[method].items():
                    if r.get(field) is not None:
                        ax.axhline(r[field], color=colors[b], linestyle=style, lw=0.8)
            ax.plot([], [], color="gray", linestyle="--", label="plain (per batch colour)")
            ax.plot([], [], color="gray", linestyle="-.", label="DFLASH chain")
            ax.set_title(f"{setup}: " + ("step time (costs only: random weights)" if costs_only else
                                         "decode throughput (measured)"), fontsize=10)
            ax.set_ylabel(label)
        ax.set_yscale("log")
        _log2_budget_axis(ax)
        ax.grid(alpha=0.3, which="both")
        _legend_or_note(ax)
    fig.tight_layout()
    path = out / "tokens_per_s_vs_budget.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_stages(rows, out: Path, plt) -> Path | None:
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
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_speedup(rows, out: Path, plt, projection: dict | None) -> Path | None:
    setups = [s for s in _setups(rows) if any(r["setup"] == s and r.get("acceptance_meaningful") for r in rows)]
    panels = [(s, ref) for s in setups for ref in ("plain", "dflash")]
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
            colors = _colors(dd)
            for b, pts in sorted(dd.items()):
                if b not in base or not base[b].get("decode_tokens_per_s"):
                    continue
                ref_tps = base[b]["decode_tokens_per_s"]
                pts = [(B, r["decode_tokens_per_s"] / ref_tps) for B, r in pts]
                ax.plot(*zip(*pts), marker="o", color=colors[b], label=f"batch {b}")
            ax.set_title(f"{setup}: speedup over {'plain' if ref == 'plain' else 'DFLASH chain'} (measured)",
                         fontsize=9)
        ax.axhline(1.0, color="black", lw=0.8)
        _log2_budget_axis(ax)
        ax.set_ylabel("DDTREE tokens/s / reference tokens/s")
        ax.grid(alpha=0.3)
        _legend_or_note(ax)
    fig.tight_layout()
    path = out / "speedup.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def make_plots(sweep: str | Path, out_dir: str | Path, projection: str | Path | None = None) -> list[Path]:
    rows = ok_results(read_rows(sweep))
    if not rows:
        raise ValueError(f"{sweep}: no ok result rows to plot.")
    proj = json.loads(Path(projection).read_text()) if projection else None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plt = _plt()
    made = [plot_tau(rows, out, plt), plot_tokens_per_s(rows, out, plt, proj), plot_stages(rows, out, plt),
            plot_speedup(rows, out, plt, proj)]
    return [p for p in made if p is not None]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", required=True, help="results JSONL of benchmarks/bench_budgets.py")
    ap.add_argument("--projection", default=None, help="best_budget.json of ddtree_bench.cost_model")
    ap.add_argument("--out-dir", default="benchmarks/results")
    args = ap.parse_args(argv)
    try:
        paths = make_plots(args.sweep, args.out_dir, args.projection)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for p in paths:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
