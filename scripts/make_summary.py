"""Regenerate benchmarks/results/summary.json (one flat JSON object) from the committed raw result files.

Never edit summary.json by hand. Which figure comes from which file is a table, `scripts/summary_sources.toml`:
one `[[figure]]` row per figure (or group of keys) naming a reader (a function below) and its source files.
A figure whose source file is missing is left out and listed under `missing`, never guessed.

  python scripts/make_summary.py            # rewrite benchmarks/results/summary.json
  python scripts/make_summary.py --check    # exit 1 if summary.json is stale

Adding a headline figure is one row. For a new sweep (e.g. the real-size `8b-real` setup), commit its JSONL
under benchmarks/results/ and add:

  [[figure]]
  name = "real8b"                       # keys: real8b_tokens_per_s, real8b_tau, real8b_over_dflash, real8b_source
  reader = "sweep_table"                # tokens/s and tau per method (budget) and batch size, ratios over `base`
  setup = "8b-real"                     # the sweep's setup name
  base = "dflash"                       # the method every ratio is taken over
  sources = ["sweep_real8b_2026-12-03_abc1234.jsonl"]

then run this script and commit summary.json. A source over 100 KB is committed xz-compressed (NAME.jsonl.xz) and
still named NAME.jsonl here: sources are read through sglang_ddtree.results_file, which finds the .xz copy. A figure that no reader computes yet needs a reader: a function
`name(srcs, **options) -> dict` registered in READERS, where `srcs` are the row's Source objects (path, name,
per-file options) and the options are the row's other keys.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from sglang_ddtree.results_file import read_text, stored_path  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TABLE = Path(__file__).resolve().with_name("summary_sources.toml")


class Source:
    """One source file of a figure: its name as the table gives it, its path, and its per-file options."""

    def __init__(self, name: str, path: Path, opts: dict | None = None):
        self.name, self.path, self.opts = name, path, opts or {}

    def json(self):
        return json.loads(read_text(self.path))


def source(entry, results: Path | None = None) -> Source:
    """A table entry (a file name, or {file = ..., options}) as a Source; "repo:" names are repository-relative."""
    results = RESULTS if results is None else results
    opts = dict(entry) if isinstance(entry, dict) else {"file": entry}
    name = opts.pop("file")
    path = ROOT / name.removeprefix("repo:") if name.startswith("repo:") else results / name
    return Source(name, stored_path(path), opts)


def _row(rows, **match):
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def _sweep_rows(path: Path | str) -> dict:
    """{(setup, method, budget, batch size): row} of a sweep JSONL's ok rows (resumed runs append: the last wins)."""
    path = RESULTS / path if isinstance(path, str) else path
    rows = {}
    for line in read_text(path).splitlines():
        r = json.loads(line)
        if r.get("status") == "ok":
            rows[(r["setup"], r["method"], r.get("budget"), r["batch_size"])] = r
    return rows


def _by_batch_size(by_setup: dict) -> dict:
    """{setup: {batch size: value}} with setups in name order and batch sizes in numeric order."""
    return {k: dict(sorted(v.items(), key=lambda kv: int(kv[0]))) for k, v in sorted(by_setup.items())}


def _method_label(method: str, budget) -> str:
    return method if budget is None else f"{method}-{budget}"


# ---------------------------------------------------------------------------------------------------------------
# Generic readers

def sweep_table(srcs: list[Source], name: str, setup: str, base: str = "dflash") -> dict:
    """A sweep's (later files win per row) tokens/s and tau per method (`ddtree-<B>` for a budget) and batch size,
    and each method's tokens/s over `base`'s at the same batch size: keys <name>_tokens_per_s, <name>_tau,
    <name>_over_<base>, <name>_source."""
    rows: dict = {}
    for src in srcs:
        rows.update({k: r for k, r in _sweep_rows(src.path).items() if k[0] == setup})
    if not rows:
        raise ValueError(f"{name}: no ok rows of setup {setup!r}")
    tps: dict = {}
    tau: dict = {}
    for (_, method, budget, bs), r in rows.items():
        label = _method_label(method, budget)
        tps.setdefault(label, {})[str(bs)] = round(r["decode_tokens_per_s"], 1)
        if r.get("tau") is not None:
            tau.setdefault(label, {})[str(bs)] = round(r["tau"], 4)
    ratios = {label: {bs: round(v / tps[base][bs], 4) for bs, v in by_bs.items() if bs in tps.get(base, {})}
              for label, by_bs in tps.items() if label != base}
    return {f"{name}_tokens_per_s": _by_batch_size(tps), f"{name}_tau": _by_batch_size(tau),
            f"{name}_over_{base}": _by_batch_size({k: v for k, v in ratios.items() if v}),
            f"{name}_source": [s.name for s in srcs]}


def real8b(srcs: list[Source], setup: str = "8b-real", setups: dict | None = None, **_) -> dict:
    """The real-size benchmark of record (the widened 8B pair). Sources by option `role`: `sweep` (the interleaved
    sweep: per backend's setup, tokens/s, tau and round ms per method; the best fixed DDTREE over DFLASH with the
    min-max of its run-by-run ratios; `auto` over the best of DFLASH and every fixed budget), `lossless` (the GPU
    module: ties, unjudged differences, KV leak) and `offline_tau` (the widening's DFLASH tau over the tiny pair's,
    offline, same prompts)."""
    by_role = {s.opts.get("role"): s for s in srcs}
    setups = setups or {"triton": setup}
    rows = _sweep_rows(by_role["sweep"].path)
    out: dict = {}
    for backend, name in setups.items():
        mine = {(m, b, bs): r for (st, m, b, bs), r in rows.items() if st == name}
        key = "real8b" if backend == "triton" else f"real8b_{backend}"
        best, best_b, ratio_runs, auto_best = {}, {}, {}, {}
        tps, tau = _tokens_and_tau(mine, lambda m, b: m if b is None else str(b))
        for bs, rec in _best_fixed(rows, name).items():
            if rec.get("over_dflash") is None:
                continue
            best[bs], best_b[bs], ratio_runs[bs] = rec["over_dflash"], rec["best_budget"], rec["over_dflash_run_range"]
            if rec.get("auto_over_best") is not None:
                auto_best[bs] = rec["auto_over_best"]
        order = lambda d: dict(sorted(d.items(), key=lambda kv: int(kv[0])))  # noqa: E731
        out[f"{key}_tokens_per_s"] = order(tps)
        out[f"{key}_tau"] = order(tau)
        out[f"{key}_ddtree_best_over_dflash"] = order(best)
        out[f"{key}_ddtree_best_over_dflash_run_range"] = order(ratio_runs)
        out[f"{key}_best_budget"] = order(best_b)
        if auto_best:
            out[f"{key}_auto_over_best"] = order(auto_best)
        cal = {str(bs): (r.get("ddtree_metrics") or {}).get("auto_calibration")
               for (m, b, bs), r in mine.items() if m == "auto"}
        cal = {bs: c for bs, c in cal.items() if c}
        if cal:  # the calibration table's MAE of committed tokens per request-round, against the raw scores'
            out[f"{key}_calibrated_tau_mae"] = order({bs: round(c["tau_mae_calibrated"], 4) for bs, c in cal.items()})
            out[f"{key}_raw_tau_mae"] = order({bs: round(c["tau_mae_raw"], 4) for bs, c in cal.items()})
        bs1 = {("plain" if m == "plain" else m if b is None else str(b)): round(r["step_ms"], 3)
               for (m, b, bs), r in mine.items() if bs == 1}
        out[f"{key}_round_ms_bs1"] = bs1
        if "dflash" in bs1 and "64" in bs1:
            out[f"{key}_ddtree64_round_over_dflash_bs1"] = round(bs1["64"] / bs1["dflash"], 4)
    # `auto` measured in the same wave as DFLASH and the fixed budgets: its figure of record. Several `auto` sources
    # (one run per group of batch sizes) merge per batch size, a later source's batch size replacing an earlier one's.
    for src in (s for s in srcs if s.opts.get("role") == "auto"):
        for key, by_bs in _real8b_auto(_sweep_rows(src.path), setup).items():
            out.setdefault(key, {}).update(by_bs)
            out[key] = dict(sorted(out[key].items(), key=lambda kv: int(kv[0])))
    if "plugin_before" in by_role:  # the same fixed-budget servers from this commit's plugin and an earlier one
        opts = by_role["plugin_before"].opts
        out["real8b_plugin_now_over_before"] = _now_over_before(_sweep_rows(by_role["plugin_before"].path),
                                                                opts["now"], opts["before"])
        out["real8b_plugin_before_commit"] = opts["before"].rsplit("-", 1)[-1]
    if "profile" in by_role:
        out["real8b_profile_bs1"] = _profile_summary(by_role["profile"].json())
    if "lossless" in by_role:
        recs = _suite_records(by_role["lossless"])
        greedy = [r for r in recs if r["kind"] == "real8b_greedy"]
        gaps = [t["logprob_gap"] for r in greedy for t in r["ties"] if t.get("logprob_gap") is not None]
        unjudged = {(f["prompt"], f["position"]) for r in greedy for f in r["failures"]}
        out["real8b_lossless_up_to_ties"] = bool(greedy) and not unjudged
        out["real8b_max_tie_gap_nats"] = max(gaps, default=0.0)
        out["real8b_unjudged_first_differences"] = len(unjudged)
        leak = [r for r in recs if r["kind"] == "real8b_kv_leak"]
        if leak:
            out["real8b_kv_leak_tokens"] = leak[-1]["leaked"]
    if "offline_tau" in by_role:
        d = by_role["offline_tau"].json()
        out["real8b_dflash_tau_over_tiny"] = {f"offline_{k}": v for k, v in d["widened_over_tiny"].items()}
    out["real8b_source"] = list(dict.fromkeys(s.name for s in srcs))
    return out


def _tokens_and_tau(rows: dict, label) -> tuple[dict, dict]:
    """({batch size: {label(method, budget): tokens/s}}, the same of tau) from {(method, budget, batch size): row},
    batch sizes in numeric order."""
    tps: dict = {}
    tau: dict = {}
    for (m, b, bs), r in sorted(rows.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1] or 0)):
        tps.setdefault(str(bs), {})[label(m, b)] = round(r["decode_tokens_per_s"], 1)
        if r.get("tau") is not None:
            tau.setdefault(str(bs), {})[label(m, b)] = round(r["tau"], 3)
    return tps, tau


def _best_fixed(rows: dict, setup: str) -> dict:
    """One setup's per-batch best fixed budget, its ratio over DFLASH and `auto`'s over the better of the two, with
    their run-by-run ranges: ddtree_bench.best_budget's reading of the rows (best_budget.json is the same)."""
    sys.path.insert(0, str(ROOT))
    from ddtree_bench.best_budget import best_by_batch

    return best_by_batch([r for (st, _, _, _), r in rows.items() if st == setup])


def _real8b_auto(rows: dict, setup: str) -> dict:
    """`auto` over max(plain where measured, DFLASH, best fixed DDTREE) per batch size, the min-max of its
    run-by-run ratios, and the share of its rounds each candidate ran."""
    recs = {bs: r for bs, r in _best_fixed(rows, setup).items()
            if r.get("over_dflash") is not None and r.get("auto_over_best") is not None}
    return {"real8b_auto_over_best": {bs: r["auto_over_best"] for bs, r in recs.items()},
            "real8b_auto_over_best_run_range": {bs: r["auto_over_best_run_range"] for bs, r in recs.items()},
            "real8b_auto_choice": {bs: r["auto_choice"] for bs, r in recs.items() if r.get("auto_choice")}}


def _now_over_before(rows: dict, now: str, before: str) -> dict:
    """{"B/batch": [ratio of tokens/s, min, max of the run-by-run ratios]} of two setups' fixed-budget rows."""
    out = {}
    for (st, m, b, bs), r in sorted(rows.items(), key=lambda kv: (kv[0][2] or 0, kv[0][3])):
        other = rows.get((before, m, b, bs))
        if st != now or m != "ddtree" or other is None:
            continue
        runs = [a / o for a, o in zip(r["decode_tokens_per_s_runs"], other["decode_tokens_per_s_runs"])]
        out[f"{b}/{bs}"] = [round(r["decode_tokens_per_s"] / other["decode_tokens_per_s"], 4), round(min(runs), 4),
                            round(max(runs), 4)]
    return out


def _profile_summary(profile: dict) -> dict:
    """Per profiled server (batch 1): wall and GPU-busy ms per scheduler step, the target's attention kernel's ms
    (SGLang's triton extend `_fwd_kernel`) and the DDTREE stage ranges' GPU ms."""
    out = {}
    for s in profile["servers"].values():
        label = s["method"] if s["budget"] is None else str(s["budget"])
        attention = sum(k["ms"] for k in s["kernels"] if k["name"] == "_fwd_kernel")
        out[label] = {"wall_ms": round(s["wall_ms"], 3), "gpu_busy_ms": round(s["gpu_busy_ms"], 3),
                      "attention_ms": round(attention, 3),
                      **{f"{k}_gpu_ms": round(v["gpu_ms"], 3) for k, v in (s.get("ranges") or {}).items()}}
    return out


def planted_bugs(srcs: list[Source], **_) -> dict:
    d = srcs[0].json()
    return {"compare_planted_bugs_caught": f"{d['caught']} of {d['total']}",
            "compare_planted_bugs_called_noise": d["called_noise"]}


def auto_knobs(srcs: list[Source], **_) -> dict:
    """How many `auto` settings a user may set (auto.USER_KNOBS, read from the committed source)."""
    import ast

    tree = ast.parse(srcs[0].path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "USER_KNOBS" for t in node.targets):
            return {"auto_knobs": len(node.value.keys)}
    raise ValueError("auto.py has no USER_KNOBS")


# ---------------------------------------------------------------------------------------------------------------
# Readers of the figures in summary_sources.toml

def tree_stages(srcs: list[Source], **_) -> dict:
    """Top-K + tree + layout + walk, median ms of one graph replay at batch 1 (`triton_fused`: the picked tree kernel
    and the fused top-K on bf16 logits); each source's `suffix` names its drafts. The tree kernels stop at the
    last depth that can enter the tree, so the time depends on the drafts' confidence."""
    out: dict = {}
    depths: dict = {}
    for src in srcs:
        run, suffix = src.json(), src.opts.get("suffix", "")
        for budget in (256, 1024):
            r = _row(run["rows"], batch_size=1, budget=budget)
            out[f"tree_stages_ms_h200_b{budget}_bs1{suffix}"] = round(r["triton_fused_graph_all_ms"], 4)
            out[f"tree_stages_impl_h200_b{budget}_bs1{suffix}"] = (
                "picked tree kernel + fused top-K and logsumexp (bf16 logits)")
            depths.setdefault(f"randn_x{run['meta']['draft_scale']:g}", {})[str(budget)] = r["tree_depth_max"]
    out["tree_stages_tree_depth_h200_bs1"] = depths
    return out


def tiny_pair(srcs: list[Source], **_) -> dict:
    """The committed tiny pair's size on disk, held-out perplexity and offline chain walk."""
    root = srcs[0].path
    files = [p for p in root.rglob("*") if p.is_file()]
    log = json.loads((root / "training_log.json").read_text())
    return {"tiny_pair_bytes": sum(p.stat().st_size for p in files),
            "tiny_target_heldout_ppl": round(log["target"]["heldout_ppl"], 3),
            "tiny_drafter_heldout_chain_walk": round(log["acceptance"]["mean_accept_len_chain_walk"], 4)}


def offline(srcs: list[Source], **_) -> dict:
    """Offline decoders on HumanEval, T=0."""
    data = srcs[0].json()
    out = {"offline_lossless_t0": bool(data["lossless"]), "offline_prompts": int(data["prompts"]),
           "offline_tau_humaneval_t0": {k: round(v, 4) for k, v in data["tau"].items()}}
    if "dflash" in data["tau"]:
        out["tiny_dflash_tau_humaneval_t0"] = round(data["tau"]["dflash"], 4)
    return out


def _suite_run(src: Source) -> dict:
    """runs[i] of a committed GPU-suite file (one gpu_suite.json per device call), i = the source's `run`."""
    return src.json()["runs"][src.opts.get("run", 0)]


def _suite_records(src: Source) -> list[dict]:
    """The records of one device call's gpu_suite.json (none made is an empty list, not a file of runs), or of
    runs[i] of a file of several runs."""
    data = src.json()
    return data["records"] if "records" in data else _suite_run(src).get("records", [])


def gpu_suite(srcs: list[Source], **_) -> dict:
    """One GPU-suite run: device seconds (install + suite) and its counts."""
    full = _suite_run(srcs[0])
    phases = full["phases_s"]
    return {"gpu_suite_device_seconds": round(phases["install"] + phases["suite"], 1),
            "gpu_suite_passed": full["counts"]["passed"],
            "gpu_suite_failed": full["counts"]["failed"] + full["counts"]["errors"]}


def _equality(records: list[dict], kind: str) -> tuple[bool, bool, float]:
    """(exact everywhere, equal up to near-ties, largest log-prob gap at a difference) over equality records."""
    equal = [r for r in records if r.get("kind") == kind]
    exact = bool(equal) and all(not r[m]["failures"] and not r[m]["ties"] for r in equal for m in ("bs1", "bs8"))
    up_to_ties = bool(equal) and all(not r[m]["failures"] for r in equal for m in ("bs1", "bs8"))
    gaps = [t["logprob_gap"] for r in equal for m in ("bs1", "bs8") for t in r[m]["ties"] + r[m]["failures"]
            if isinstance(t, dict) and t.get("logprob_gap") is not None]
    return exact, up_to_ties, max(gaps) if gaps else 0.0


def sglang_lossless(srcs: list[Source], **_) -> dict:
    """The DDTREE server module's greedy equality with plain decoding (exact, and up to bf16 near-ties) and KV leak."""
    records = _suite_run(srcs[0])["records"]
    exact, up_to_ties, gap = _equality(records, "ddtree_greedy_equality")
    out = {"sglang_lossless_t0": exact, "sglang_lossless_t0_up_to_bf16_ties": up_to_ties,
           "sglang_max_divergence_logprob_gap_nats": gap}
    leak = [r for r in records if r.get("kind") == "kv_leak"]
    if leak:
        out["sglang_kv_leak_tokens"] = leak[-1]["after_tokens"] - leak[-1]["idle_tokens"]
    return out


def sglang_tiny_bs1(srcs: list[Source], **_) -> dict:
    """Tiny pair, batch 1, one sweep: plain, DFLASH and the best DDTREE budget's tokens/s, tau per method."""
    rows = _sweep_rows(srcs[0].path)
    plain, dflash = rows[("tiny", "plain", None, 1)], rows[("tiny", "dflash", None, 1)]
    ddtree = {k[2]: r for k, r in rows.items() if k[0] == "tiny" and k[1] == "ddtree" and k[3] == 1}
    best = max(ddtree, key=lambda b: ddtree[b]["decode_tokens_per_s"])
    return {"sglang_tiny_bs1_tokens_per_s": {
                "plain": round(plain["decode_tokens_per_s"], 1), "dflash": round(dflash["decode_tokens_per_s"], 1),
                "ddtree_best": round(ddtree[best]["decode_tokens_per_s"], 1), "ddtree_best_budget": best},
            "ddtree_over_dflash_tokens_per_s_bs1": round(ddtree[best]["decode_tokens_per_s"]
                                                         / dflash["decode_tokens_per_s"], 4),
            "sglang_tiny_tau_humaneval_bs1": {"dflash": round(dflash["tau"], 4),
                                              **{f"ddtree_{b}": round(r["tau"], 4) for b, r in sorted(ddtree.items())}}}


def round_graphs(srcs: list[Source], **_) -> dict:
    """DDTREE step ms with the round's stage graphs on and off (sources' `arm`), one sweep after the other."""
    arms = {src.opts["arm"]: _sweep_rows(src.path) for src in srcs}
    on, off = arms["on"], arms["off"]
    return {"round_graphs_tiny_bs1_step_ms": {
        str(k[2]): {"on": round(r["step_ms"], 2), "off": round(off[k]["step_ms"], 2)}
        for k, r in sorted(on.items(), key=lambda kv: kv[0][2] or 0) if k[1] == "ddtree" and k in off}}


def tree_overhead(srcs: list[Source], **_) -> dict:
    """Tree + walk + commit over the GPU time of a round (the stage split chains CUDA events round to round, so the
    stages, `between` included, add up to it), 8B shapes, B=256, batch 1."""
    stages = _sweep_rows(srcs[0].path)[("8b-dummy", "ddtree", 256, 1)]["stage_ms"]
    return {"tree_overhead_fraction_8b_b256_bs1": round(
        (stages["tree"] + stages["walk"] + stages["commit"]) / sum(stages.values()), 4)}


def best_budget(srcs: list[Source], **_) -> dict:
    """The best fixed budget per batch size of a best-budget file: measured (ddtree_bench.best_budget, from a sweep's
    rows) or projected (ddtree_bench.cost_model), as the file's `projected` says (a file that does not say is
    taken as projected)."""
    data = srcs[0].json()
    return {"best_budget_by_batch": {b: v["best_budget"] for b, v in data["by_batch"].items()},
            "best_budget_by_batch_is_projected": bool(data.get("projected", True))}


def tp2(srcs: list[Source], **_) -> dict:
    """TP=2: DDTREE == plain at TP=2 (bf16), and rounds per prompt equal to TP=1 where the outputs agree."""
    records = _suite_run(srcs[0])["records"]
    exact, up_to_ties, gap = _equality(records, "tp2_greedy_equality")
    taus = [r for r in records if r.get("kind") == "tp2_tau_vs_tp1"]
    return {"tp2_lossless_t0": exact, "tp2_lossless_t0_up_to_bf16_ties": up_to_ties,
            "tp2_max_divergence_logprob_gap_nats": gap,
            "tp2_budgets_checked": sorted(int(r["config"].split("-")[1]) for r in records
                                          if r.get("kind") == "tp2_greedy_equality"),
            "tp2_rounds_equal_tp1_where_outputs_agree": bool(taus) and all(
                a == b for r in taus for a, b, same in zip(r["rounds_tp1"], r["rounds_tp2"], r["same_tokens"])
                if same)}


def hybrid(srcs: list[Source], **_) -> dict:
    """Hybrid targets: lossless offline (float32: fast == oracle == plain), the offline verify ms, and the server's
    fast path vs the sequential oracle (GPU ms a round at batch 1, stage split summed, each server alone on the GPU;
    256 eager, the others with CUDA graphs)."""
    by_role = {src.opts["role"]: src.json() for src in srcs}
    data, run = by_role["offline"], by_role["server"]
    timing = [r for r in run["records"] if r["kind"] == "hybrid_round_ms"][-1]
    assert timing.get("measured") == "one server at a time", "the oracle's times are of one server at a time"
    step = {}
    for config, split in timing["stage_split_bs1"].items():
        budget = config.removeprefix("hybrid-ddtree-").split("-")[0]
        path = "oracle" if config.endswith("-oracle") else "fast"
        step[f"{path}_b{budget}" + ("_eager" if "-eager" in config else "")] = round(sum(split["stage_ms"].values()), 2)
    return {"hybrid_lossless_t0": bool(data["hybrid_lossless_t0"]),
            "hybrid_step_ms_offline": {k: round(v, 1) for k, v in data["hybrid_step_ms"].items()},
            "hybrid_step_ms": dict(sorted(step.items())),
            "hybrid_step_ms_source": ("SGLang server, batch 1, GPU ms per round (stage split summed), each config "
                                      "alone on the GPU; bf16 Qwen3-Next with scripted drafts"),
            "sglang_hybrid_oracle": {r["config"]: {"request_rounds_differing": r["differ"],
                                                   "request_rounds_checked": r["checked"],
                                                   "outputs_equal_to_fast": r["outputs_equal_to_fast"]}
                                     for r in run["records"] if r["kind"] == "hybrid_oracle"}}


def sglang_hybrid(srcs: list[Source], **_) -> dict:
    """DDTREE on a bf16 Qwen3-Next target (random weights, all 4 experts routed, scripted drafts) judged by the same
    model in float32 on the CPU: token-for-token equality with plain (false: bf16 near-ties), whether every
    difference is explained by the float32 model (DDTREE's token no further from the float32 choice than plain's,
    or within the tolerance) and every DDTREE token no further from it than plain's own worst (teacher forced),
    the gaps, tau and the server's ms a round at batch 1 (later files' configs replace earlier ones' times)."""
    rows, forced, timing = [], [], []
    for src in srcs:
        records = src.json()["records"]
        got = ([r for r in records if r["kind"] == "hybrid_greedy_equality"],
               [r for r in records if r["kind"] == "hybrid_fp32_teacher_forced"],
               [r for r in records if r["kind"] == "hybrid_round_ms"])
        if not all(got):
            raise ValueError(f"{src.name} has no hybrid records")
        rows += got[0]
        forced += got[1]
        timing += got[2]
    modes = [m for m in ("bs1", "bs4", "bs8") if all(m in r for r in rows)]
    tol = forced[0]["tol_nats"]
    explained = all(d["fp32_gap_ddtree"] <= max(d["fp32_gap_plain"], tol)
                    for r in rows for m in modes for d in r[m]["differences"])
    faithful = all(f[m]["worst"] <= f["bound_nats"] for f in forced for m in modes)
    return {
        "sglang_hybrid_lossless_t0": all(not r[m]["differences"] for r in rows for m in modes),
        "sglang_hybrid_lossless_t0_up_to_bf16_ties": explained and faithful,
        "sglang_hybrid_dtype": "bfloat16",
        "sglang_hybrid_configs_checked": sorted({r["config"] for r in rows}),
        "sglang_hybrid_batch_sizes_checked": [int(m[2:]) for m in modes],
        "sglang_hybrid_first_difference_fp32_gaps_nats_bs1": {
            r["config"]: {"ddtree": sorted(d["fp32_gap_ddtree"] for d in r["bs1"]["differences"]),
                          "plain": sorted(d["fp32_gap_plain"] for d in r["bs1"]["differences"])} for r in rows},
        "sglang_hybrid_fp32_teacher_forced_worst_nats": {
            "plain": max(f["plain"]["worst"] for f in forced),
            **{f["config"]: max(f[m]["worst"] for m in modes) for f in forced}},
        "sglang_hybrid_tau_bs1": {r["config"]: r["tau_bs1"] for r in rows},
        "sglang_hybrid_round_ms_bs1": {c: round(sum(v["stage_ms"].values()), 3)
                                       for t in timing for c, v in t["stage_split_bs1"].items()}}


def _lossless_records(src: Source, pair: str) -> tuple[list[dict], list[dict]]:
    """The real-size lossless module's greedy and oracle records of `pair` (gpu_suite.json of run_gpu_suite.py)."""
    records = [r for r in _suite_records(src) if r.get("pair") == pair]
    greedy = [r for r in records if r["kind"] == "real8b_greedy"]
    if not greedy:
        raise ValueError(f"{src.name}: no real8b_greedy records of pair {pair!r}")
    return greedy, [r for r in records if r["kind"] == "real8b_oracle"]


def _lossless_figures(prefix: str, greedy: list[dict], oracle: list[dict]) -> dict:
    """<prefix>_lossless_up_to_ties (every run's first differences ties), the largest gap, the first differences
    (ties), and the oracle's request-rounds differing of those checked."""
    return {f"{prefix}_lossless_up_to_ties": all(not r["failures"] for r in greedy),
            f"{prefix}_lossless_max_gap_nats": max(r["max_gap"] for r in greedy),
            f"{prefix}_lossless_exact_of_prompts": {r["config"]: [r["exact"], r["prompts"]] for r in greedy},
            f"{prefix}_oracle_disagreements": {r["config"]: [r["differ"], r["checked"]] for r in oracle}}


def hybrid_real(srcs: list[Source], setup: str = "27b-hybrid", **_) -> dict:
    """The hybrid pair at a real shape (the tiny hybrid widened to Qwen3.5-27B). Sources by option `role`: `sweep`
    (tokens/s, tau and the round's stage split per method and batch size; the best DDTREE budget over DFLASH, with
    the min-max of its run-by-run ratios when the rows were repeated) and, once there is one, `lossless` (the
    real-size module on the pair: greedy == plain up to ties, the oracle)."""
    by_role = {s.opts.get("role"): s for s in srcs}
    all_rows = _sweep_rows(by_role["sweep"].path)
    mine = {(m, b, bs): r for (st, m, b, bs), r in all_rows.items() if st == setup}
    if not mine:
        raise ValueError(f"hybrid_real: no ok rows of setup {setup!r}")
    tps, tau = _tokens_and_tau(mine, _method_label)
    stages = {}
    for (m, b, bs), r in sorted(mine.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1] or 0)):
        if r.get("stage_ms"):
            stages.setdefault(str(bs), {})[_method_label(m, b)] = {k: round(v, 2) for k, v in r["stage_ms"].items()}
    best_recs = {bs: rec for bs, rec in _best_fixed(all_rows, setup).items() if rec.get("over_dflash") is not None}
    best = {bs: rec["over_dflash"] for bs, rec in best_recs.items()}
    run_ids = {r["run_id"] for r in mine.values()}
    runs = [r for r in map(json.loads, read_text(by_role["sweep"].path).splitlines())
            if r.get("kind") == "run" and r["run_id"] in run_ids]
    out = {"hybrid_real_tokens_per_s": tps, "hybrid_real_tau": tau, "hybrid_real_stage_ms": stages,
           "hybrid_real_ddtree_best_over_dflash": best,
           "hybrid_real_ddtree_best_over_dflash_run_range": {bs: rec["over_dflash_run_range"]
                                                              for bs, rec in best_recs.items()
                                                              if rec.get("over_dflash_run_range")},
           "hybrid_real_source": {"file": by_role["sweep"].name, "gpu": sorted({r["gpu"] for r in runs}),
                                  "repeats": sorted({r["options"]["repeats"] for r in runs})}}
    if "lossless" in by_role:
        out.update(_lossless_figures("hybrid_real", *_lossless_records(by_role["lossless"], setup)))
    return out


def trained_drafter_projection(srcs: list[Source], prefix: str, setup: str, backend: str = "triton",
                               profile: str | None = None, note: str | None = None, chain_from: str | None = None,
                               **_) -> dict:
    """What DDTREE would give over DFLASH with a trained drafter (ddtree_bench/projection.py): one setup's and
    backend's measured DDTREE / DFLASH round ms per batch size and budget (<prefix>_round_over_dflash), and per batch
    size the budget with the highest projected tokens/s ratio, tau_tree(B) / tau_chain of a published profile over
    that round ratio (<prefix>_projected_trained_drafter); the row's `note` says how the profile relates to the
    setup's model. chain_from: the setup whose DFLASH rows an arm without its own is paired with (the same run)."""
    sys.path.insert(0, str(ROOT))
    from ddtree_bench.projection import DEFAULT_PROFILE, project_sweep

    result = project_sweep(srcs[0].path, profile or DEFAULT_PROFILE, setup,
                           {setup: chain_from} if chain_from else None)
    group = next((g for g in result["groups"] if g["backend"] == backend), None)
    if group is None:
        raise ValueError(f"{srcs[0].name}: setup {setup!r} has no {backend} rows of DFLASH and DDTREE")
    rounds = {bs: {str(x["budget"]): x["round_ratio"] for x in b["budgets"]} for bs, b in group["by_batch"].items()}
    best = {bs: {"budget": b["best"]["budget"], "ratio": b["best"]["projected_ratio"]}
            for bs, b in group["by_batch"].items() if b["best"]}
    prof = result["profile"]
    text = (f"PROJECTED: tau_tree(B) / tau_chain of profile {prof['name']} ({prof['model']}, chain tau "
            f"{prof['chain_tau']:g}) over {setup}'s measured DDTREE / DFLASH round ms ({backend}, {srcs[0].name})")
    return {f"{prefix}_round_over_dflash": rounds, f"{prefix}_projected_trained_drafter": best,
            f"{prefix}_projected_trained_drafter_note": text + (f"; {note}" if note else "")}


def hybrid_tiny(srcs: list[Source], setup: str = "tiny-hybrid", **_) -> dict:
    """The trained tiny hybrid pair. Sources by option `role`: `training` (its training_log.json: held-out
    perplexity and chain walk), `offline` (the offline decoders' baseline file: tau per method, outputs equal to
    plain's), `sweep` (served tau per method at batch 1) and `lossless` (the real-size module on the pair)."""
    by_role = {s.opts.get("role"): s for s in srcs}
    log = by_role["training"].json()
    out = {"hybrid_tiny_pair_params": {"target": log["target"]["params"], "drafter": log["drafter"]["params"]},
           "hybrid_tiny_pair_heldout_ppl": round(log["target"]["heldout_ppl"], 2),
           "hybrid_tiny_pair_chain_walk_heldout": round(log["acceptance"]["mean_accept_len_chain_walk"], 3)}
    served = {(m, b, bs): r for (st, m, b, bs), r in _sweep_rows(by_role["sweep"].path).items() if st == setup}
    out["hybrid_tiny_pair_tau"] = _tokens_and_tau(served, _method_label)[1].get("1", {})
    sys.path.insert(0, str(ROOT))
    from sglang_ddtree.baseline import parse_method, read_baseline
    from sglang_ddtree.compare import method_stats

    offline_run = read_baseline(by_role["offline"].path)
    spec = [m for m in offline_run.methods if m != "plain"]
    out["hybrid_tiny_pair_tau_offline"] = {
        _method_label(*parse_method(m)): round(method_stats([r for r in offline_run.records if r.method == m])["tau"], 3)
        for m in spec}
    out["hybrid_tiny_pair_offline_equal_to_plain"] = all(
        r.output_ids == offline_run.get(r.prompt_id, "plain").output_ids for r in offline_run.records)
    out.update(_lossless_figures("hybrid_tiny", *_lossless_records(by_role["lossless"], setup)))
    return out


def adaptive(srcs: list[Source], **_) -> dict:
    """`auto` offline on the tiny pair (scripts/adaptive_eval.py): projected tokens/s against the best fixed budget
    and the chain, and the calibration's tau MAE."""
    data = srcs[0].json()
    fields = data["summary_fields"]
    return {"auto_vs_best_fixed_tokens_per_s": {str(b): round(r, 4) for b, r in
                                                fields["auto_vs_best_fixed_tokens_per_s"].items()},
            "auto_vs_best_fixed_is_projected": True,
            "raw_tau_mae": round(fields["raw_tau_mae"], 4),
            "calibrated_tau_mae": round(fields["calibrated_tau_mae"], 4),
            "adaptive_lossless_t0": bool(data["lossless"]) if isinstance(data["lossless"], bool) else
            all(bool(v) for v in data["lossless"].values())}


def _decode_graphs(row: dict) -> bool:
    """Whether a sweep row ran in decode CUDA graphs (its own field, else read from its server args)."""
    if "decode_graphs" in row:
        return bool(row["decode_graphs"])
    args = row.get("server_args") or []
    if "--cuda-graph-bs-decode" not in args:
        return False
    sizes, i = [], args.index("--cuda-graph-bs-decode") + 1
    while i < len(args) and args[i].isdigit():
        sizes.append(int(args[i]))
        i += 1
    return row["batch_size"] in sizes


def _copy_bases(path: Path) -> dict[str, str]:
    """{NEW: BASE} of the sweep's `--copy-setup NEW=BASE` arguments (its run records' argv)."""
    bases = {}
    for line in read_text(path).splitlines():
        r = json.loads(line)
        argv = (r.get("argv") or []) if r.get("kind") == "run" else []
        for flag, value in zip(argv, argv[1:]):
            if flag == "--copy-setup" and "=" in value:
                new, base = value.split("=", 1)
                bases[new] = base
    return bases


def _rival_setup(setup: str, rows: dict, bases: dict[str, str]) -> str:
    """Where an auto row's rivals are: its own setup's fixed-budget and DFLASH rows, or, for a copied setup that
    holds only auto (an A/B of a worker switch, e.g. tiny-dchain), its base setup's rows of the same run."""
    own = any(s == setup and m in ("ddtree", "dflash") for (s, m, _, _) in rows)
    return setup if own or setup not in bases else bases[setup]


def _other_commit(row: dict) -> str | None:
    """The package directory a row's server ran instead of the checkout (PYTHONSAFEPATH=1 with PYTHONPATH on
    runs/bench/base-<commit>), else None. Such a row is an A/B's base, not the code measured. Without
    PYTHONSAFEPATH the checkout came first on sys.path, so such a row ran the checkout."""
    env = row.get("server_env") or []
    if "PYTHONSAFEPATH=1" not in env:
        return None
    for entry in env:
        if entry.startswith("PYTHONPATH="):
            base = next((p for p in entry[len("PYTHONPATH="):].split(":") if "/runs/bench/base-" in p), None)
            if base:
                return base.rsplit("/", 1)[-1]
    return None


def _forced(row: dict) -> str | None:
    """The candidate an `auto` row's server was held on (SGLANG_DDTREE_AUTO_FORCE), else None: such a row measures
    one candidate, not `auto`'s choice."""
    prefix = "SGLANG_DDTREE_AUTO_FORCE="
    return next((entry[len(prefix):] for entry in row.get("server_env") or [] if entry.startswith(prefix)), None)


def _ab_server(row: dict) -> bool:
    """Whether an `auto` row's server alternated its rounds with the fixed widest tree (SGLANG_DDTREE_AUTO_AB): its
    tokens/s mixes the two arms, which its `ab` tallies keep apart (sglang_auto_ab)."""
    sys.path.insert(0, str(ROOT))
    from ddtree_bench.sweep import ab_block_of

    return ab_block_of(row.get("server_env")) > 0


# Knobs whose rows are an A/B's other arm, not `auto` as it is.
ARM_KNOBS = ("SGLANG_DDTREE_AUTO_HOLD_MAX=", "SGLANG_DDTREE_AUTO_SETTLED_SAMPLING=",
             "SGLANG_DDTREE_AUTO_FORGET_START=", "SGLANG_DDTREE_AUTO_TIMES_EXPIRE=",
             "SGLANG_DDTREE_AUTO_CALIBRATION_LEARN_ALL=", "SGLANG_DDTREE_AUTO_SWITCH_UNTIMED=")
# Knob settings equal to the code's default now: an A/B arm that set one ran `auto` as it is.
CURRENT_DEFAULTS = ("SGLANG_DDTREE_AUTO_FORGET_START=0", "SGLANG_DDTREE_AUTO_TIMES_EXPIRE=256")
# The A/B arm whose `auto` rounds mark their own host work apart (stages.AUTO_HOST_DETAIL).
AB_DETAIL_ARM = "AUTO_HOST_DETAIL=1"


def _not_auto_as_it_is(row: dict) -> bool:
    """A row the headline and the calibration table leave out: another commit's package (_other_commit), a server
    held on one candidate (_forced), one alternating with the fixed tree (_ab_server) or one setting an arm's knob
    (ARM_KNOBS)."""
    knobbed = any(entry.startswith(ARM_KNOBS) for entry in row.get("server_env") or [])
    return bool(_other_commit(row) or _forced(row) or _ab_server(row) or knobbed)


def _paired_ratios(auto_row: dict, rival_rows: list[dict]) -> list[float] | None:
    """Per repeat i: auto's i-th run over the best rival's i-th run; None unless the sweep interleaved the repeats
    and every row has the same number of runs."""
    rows = [auto_row, *rival_rows]
    runs = [r.get("decode_tokens_per_s_runs") or [] for r in rows]
    if not rival_rows or not all(r.get("interleaved") for r in rows) or len({len(x) for x in runs}) != 1 \
            or not runs[0]:
        return None
    return [round(a / max(x[i] for x in runs[1:]), 3) for i, a in enumerate(runs[0])]


def sglang_auto(srcs: list[Source], **_) -> dict:
    """`auto` tokens/s over max(the fixed budgets and DFLASH measured in the same run) per setup and batch size, the
    rivals each ratio had, the file it came from, and the same ratio per repeat (run i of auto over the best rival's
    run i: interleaved sweeps run the i-th repeat of every server of a batch size back to back). Later files win."""
    ratios: dict = {}
    paired: dict = {}
    rivals_measured: dict = {}
    sources: dict = {}
    unlike: dict = {}
    for src in srcs:
        rows = _sweep_rows(src.path)
        bases = _copy_bases(src.path)
        for (setup, method, _, bs), r in rows.items():
            if method != "auto" or _not_auto_as_it_is(r):
                continue
            where = _rival_setup(setup, rows, bases)
            rival_rows = {(m, budget): x for (s, m, budget, b), x in rows.items()
                          if s == where and b == bs and m in ("ddtree", "dflash")}
            rivals = {(m if m == "dflash" else f"ddtree-{budget}"): x["decode_tokens_per_s"]
                      for (m, budget), x in rival_rows.items()}
            ratios.setdefault(setup, {})[str(bs)] = round(r["decode_tokens_per_s"] / max(rivals.values()), 4)
            runs = _paired_ratios(r, list(rival_rows.values()))
            if runs is None:
                paired.get(setup, {}).pop(str(bs), None)
            else:
                paired.setdefault(setup, {})[str(bs)] = runs
            graphed = {key: _decode_graphs(x) for key, x in rival_rows.items()}
            graphed[("auto", None)] = _decode_graphs(r)
            unlike.pop(f"{setup}|{bs}", None)
            if len(set(graphed.values())) > 1:  # one server graphed, another eager: not a like-for-like ratio
                unlike[f"{setup}|{bs}"] = sorted(f"{m}{'' if b is None else f'-{b}'}" for (m, b), g in graphed.items()
                                                 if not g)
            rivals_measured.setdefault(setup, {})[str(bs)] = sorted(rivals)
            sources.setdefault(setup, {})[str(bs)] = src.name
    return {"sglang_auto_vs_max_fixed_or_dflash_tokens_per_s": _by_batch_size(ratios),
            "sglang_auto_rivals_measured": _by_batch_size(rivals_measured),
            "sglang_auto_sources": _by_batch_size(sources),
            "sglang_auto_rows_without_decode_graphs": dict(sorted(unlike.items())),  # {} = every ratio like for like
            "sglang_auto_vs_max_per_repeat": _by_batch_size(paired)}


def same_config_servers(srcs: list[Source], **_) -> dict:
    """Two servers of one configuration in one interleaved run (`--copy-setup`): the copy's tokens/s over the
    original's per (method, budget, batch size), and per repeat: on a host-bound pair, the floor under any ratio
    of two servers."""
    table: dict = {}
    for src in srcs:
        rows = _sweep_rows(src.path)
        for new, base in _copy_bases(src.path).items():
            for (setup, method, budget, bs), r in rows.items():
                twin = rows.get((base, method, budget, bs))
                if setup != new or twin is None:
                    continue
                label = f"{base}|{_method_label(method, budget)}|{bs}"
                entry = {"copy_over_original": round(r["decode_tokens_per_s"] / twin["decode_tokens_per_s"], 3)}
                runs = list(zip(r.get("decode_tokens_per_s_runs") or [], twin.get("decode_tokens_per_s_runs") or []))
                if len(runs) > 1:
                    entry["per_repeat"] = [round(a / b, 3) for a, b in runs]
                table.setdefault(src.name, {})[label] = entry
        if src.name not in table:
            raise ValueError(f"{src.name}: no copied setup with a twin row")
    return {"sglang_same_config_servers": {name: dict(sorted(rows.items())) for name, rows in table.items()}}


def pad_stages(srcs: list[Source], **_) -> dict:
    """Stage graphs padded to SGLang's CUDA-graph batch sizes (setup `tiny`) against one capture per batch size met
    (`tiny-nopad`), in one interleaved sweep: tokens/s padded over unpadded per batch size."""
    ratios: dict = {}
    for src in srcs:
        rows = _sweep_rows(src.path)
        for (setup, method, budget, bs), r in rows.items():
            off = rows.get(("tiny-nopad", method, budget, bs))
            if setup != "tiny" or off is None:
                continue
            key = "auto" if method == "auto" else f"ddtree-{budget}"
            ratios.setdefault(key, {}).setdefault(str(bs), []).append(
                round(r["decode_tokens_per_s"] / off["decode_tokens_per_s"], 3))
    return {"pad_stages_tokens_per_s_padded_over_unpadded_tiny": {
        k: dict(sorted(v.items(), key=lambda kv: int(kv[0]))) for k, v in sorted(ratios.items())}}


def pad_stages_captures(srcs: list[Source], **_) -> dict:
    """Stage-graph captures per server, padded and not."""
    return {"pad_stages_captures_per_server_tiny": {run["sweep"]: run["captures"] for run in srcs[0].json()["runs"]}}


def _auto_calibration(path: Path):
    """(setup, batch size, row, {"raw", "calibrated", ["gated",] "request_rounds"}) of every `auto` row of a sweep
    that carries `auto_calibration` (Prometheus differences of its measured runs), in key order."""
    rows = _sweep_rows(path)
    for (setup, method, _, bs), r in sorted(rows.items(), key=lambda kv: (*kv[0][:2], kv[0][2] or -1, kv[0][3])):
        cal = (r.get("ddtree_metrics") or {}).get("auto_calibration") if method == "auto" else None
        if cal:
            gated = {"gated": round(cal["tau_mae_gated"], 4)} if "tau_mae_gated" in cal else {}
            yield setup, bs, r, {"raw": round(cal["tau_mae_raw"], 4), "calibrated": round(cal["tau_mae_calibrated"], 4),
                                 **gated, "request_rounds": cal["scored_request_rounds"]}


def sglang_tau_mae(srcs: list[Source], **_) -> dict:
    """Mean absolute error per request-round of the predicted committed tokens in the `auto` server's sampled rounds,
    raw drafter scores against the calibration table (both predicted before the table learnt the round), per setup
    and batch size (later files win; each entry names its file)."""
    table: dict = {}
    for src in srcs:
        for setup, bs, row, entry in _auto_calibration(src.path):
            if not _not_auto_as_it_is(row):
                table.setdefault(setup, {})[str(bs)] = {**entry, "source": src.name}
    if not table:
        raise ValueError("no auto_calibration in the rows of " + ", ".join(s.name for s in srcs))
    return {"sglang_tau_mae_raw_vs_calibrated": _by_batch_size(table),
            "sglang_tau_mae_source": [s.name for s in srcs]}


def sglang_tau_mae_starts(srcs: list[Source], **_) -> dict:
    """The same MAE at batch 1 for every `auto` server of runs that started several servers together: the young
    table's standing across server starts (not one draw)."""
    servers = [{"sweep": src.name, "server": setup,
                "env": [e for e in r.get("server_env") or [] if "LOG_EVERY" not in e], **entry}
               for src in srcs for setup, bs, r, entry in _auto_calibration(src.path) if bs == 1]
    if not servers:
        raise ValueError("no auto_calibration at batch 1 in " + ", ".join(s.name for s in srcs))
    return {"sglang_tau_mae_bs1_per_server_start": servers,
            "sglang_tau_mae_bs1_servers_calibrated_worse":
                f"{sum(x['calibrated'] > x['raw'] for x in servers)} of {len(servers)}"}


def paired(srcs: list[Source], **_) -> dict:
    """Per sweep and batch size, each row's tokens/s over the source's `base` row: the geometric mean of the
    per-round ratios with its 95% interval (ddtree_bench/paired.py)."""
    sys.path.insert(0, str(ROOT))
    from ddtree_bench.paired import paired_table, pooled_ratios
    from ddtree_bench.results import latest_results, read_rows

    table = {}
    for src in srcs:
        base = src.opts["base"]
        rows = list(latest_results(read_rows(src.path)).values())
        table[src.name] = {"base": base,
                           "by_batch_size": {str(bs): ratios for bs, ratios in paired_table(rows, base).items()},
                           "all_batch_sizes": pooled_ratios(rows, base)}
    return {"sglang_paired_ratios": table}


def _ab_arm(env: list[str], implied: tuple = ()) -> str:
    """What an A/B server's `auto` arm ran, from its server_env (and the source's `setup_notes`): "as it is",
    "forced=<candidate>", or its knobs; implied: NAME=VALUE knobs its commit defaulted to where the server_env does
    not set NAME (the source's `implied_env`)."""
    named = {e.split("=", 1)[0] for e in env}
    env = list(env) + [e for e in implied if e.split("=", 1)[0] not in named]
    knobs = [e for e in env if not e.startswith(("SGLANG_DDTREE_AUTO_LOG_EVERY=", "SGLANG_DDTREE_AUTO_AB="))
             and e not in CURRENT_DEFAULTS]
    forced = [e.split("=", 1)[1] for e in knobs if e.startswith("SGLANG_DDTREE_AUTO_FORCE=")]
    if forced:  # a held server's other knobs still change its own cost; the expiry does not (it makes no choice)
        others = sorted(k.removeprefix("SGLANG_DDTREE_") for k in knobs
                        if not k.startswith(("SGLANG_DDTREE_AUTO_FORCE=", "SGLANG_DDTREE_AUTO_TIMES_EXPIRE=")))
        return ",".join([f"forced={forced[0]}"] + others)
    return ",".join(sorted(k.removeprefix("SGLANG_DDTREE_") for k in knobs)) or "as it is"


def sglang_auto_ab(srcs: list[Source], **_) -> dict:
    """Each A/B server's `auto` arm over its own fixed 128-tree arm (ddtree_bench.paired.ab_table): over the whole row
    and run by run with a 95% interval, per batch size and pooled, with each arm's tau, GPU ms and host ms a round.
    The arms share the process, the moment and the text, so these intervals are the rounds' own spread.
    sglang_auto_ab_over_fixed_128_tiny: the `auto` as it is arms of the `headline` sources, runs pooled
    (ab_pooled); sglang_auto_ab_own_host_ms_tiny: the same rows' `auto` host ms a round less the fixed arm's, per
    host stage; sglang_auto_ab_host_detail_ms_tiny: that split over the AB_DETAIL_ARM servers of the `detail`
    sources."""
    sys.path.insert(0, str(ROOT))
    from ddtree_bench.paired import ab_own_host_split, ab_pooled, ab_table, row_label
    from ddtree_bench.results import latest_results, read_rows

    table: dict = {}
    headline_rows: list = []
    headline_labels: set = set()
    headline_servers = 0  # labels repeat from sweep to sweep (each sweep's servers are its own)
    detail_rows: list = []
    detail_labels: set = set()
    for src in srcs:
        rows = list(latest_results(read_rows(src.path)).values())
        envs = {row_label(r): r.get("server_env") or [] for r in rows if r.get("kind") == "result" and r.get("ab_runs")}
        as_it_is, detailed = [], []
        notes = src.opts.get("setup_notes", {})
        for label, t in ab_table(rows).items():
            arm = _ab_arm(envs.get(label, []) + notes.get(label.split("|")[0], []),
                          tuple(src.opts.get("implied_env", ())))
            table.setdefault(src.name, {})[label] = {
                "arm": arm, "by_batch_size": {str(bs): v for bs, v in t["by_batch_size"].items()},
                "all_batch_sizes": t["all_batch_sizes"]}
            if arm == "as it is" and label.startswith("tiny"):
                as_it_is.append(label)
            if arm == AB_DETAIL_ARM and label.startswith("tiny"):
                detailed.append(label)
        if src.opts.get("headline") and as_it_is:
            headline_rows += [r for r in rows if row_label(r) in as_it_is]
            headline_labels |= set(as_it_is)
            headline_servers += len(as_it_is)
        if src.opts.get("detail") and detailed:
            detail_rows += [r for r in rows if row_label(r) in detailed]
            detail_labels |= set(detailed)
    pooled = ab_pooled(headline_rows, headline_labels) if headline_rows else None
    headline = {str(bs): v["ratio"] for bs, v in pooled["by_batch_size"].items() if v} if pooled else {}
    names = [s.name for s in srcs if s.opts.get("headline")]
    headline_source = (f"{' + '.join(names)} (`auto` as it is: {headline_servers} servers, "
                       f"{' + '.join(sorted(headline_labels))} in each sweep that has them, runs pooled)")
    return {"sglang_auto_ab": table,
            "sglang_auto_ab_over_fixed_128_tiny": headline,
            "sglang_auto_ab_over_fixed_128_tiny_source": headline_source if headline else None,
            "sglang_auto_ab_own_host_ms_tiny": (
                {str(bs): v for bs, v in ab_own_host_split(headline_rows, headline_labels).items()}
                if headline_rows else {}),
            "sglang_auto_ab_host_detail_ms_tiny": (
                {str(bs): v for bs, v in ab_own_host_split(detail_rows, detail_labels).items()}
                if detail_rows else {})}


def long_context(srcs: list[Source], **_) -> dict:
    """The widened 8B pair at long contexts (prompt kind `long`: standard-library source cut to 2K / 8K / 32K tokens).
    Every ok row of the sources (later files win per setup, method, budget, batch size), keyed by its prompt tokens:
    real8b_long_context {ctx: {bs: {method: tok/s}}}, real8b_long_context_tau (the same of tau), and
    real8b_long_context_round_over_dflash {ctx: {bs: DDTREE's round ms / DFLASH's}} where a DDTREE budget and DFLASH
    ran in the same file (the same run: a ratio across runs is not paired), with the per-repeat range. One setup per
    method, context and batch size in a file (an A/B arm of the same method belongs in a figure of its own)."""
    tps: dict = {}
    tau: dict = {}
    rounds: dict = {}
    for src in srcs:
        by_row: dict = {}
        for key, r in _sweep_rows(src.path).items():
            if r.get("prompt_kind") != "long":
                continue
            ctx, bs, label = str(r["prompt_tokens"]), str(r["batch_size"]), _method_label(r["method"], r.get("budget"))
            tps.setdefault(ctx, {}).setdefault(bs, {})[label] = round(r["decode_tokens_per_s"], 1)
            if r.get("tau") is not None:
                tau.setdefault(ctx, {}).setdefault(bs, {})[label] = round(r["tau"], 4)
            by_row.setdefault((ctx, bs), {})[label] = r
        for (ctx, bs), rows in by_row.items():
            chain = rows.get("dflash")
            trees = sorted((label for label in rows if label.startswith("ddtree-")), key=lambda x: int(x.split("-")[1]))
            if chain is None or not trees:
                continue
            tree = rows[trees[0]]
            runs = [t / c for t, c in zip(tree.get("step_ms_runs") or [], chain.get("step_ms_runs") or [])]
            rounds.setdefault(ctx, {})[bs] = {"budget": int(trees[0].split("-")[1]),
                                              "ratio": round(tree["step_ms"] / chain["step_ms"], 4),
                                              "range": [round(min(runs), 4), round(max(runs), 4)] if runs else None,
                                              "source": src.name}

    def ordered(d):
        return {c: dict(sorted(v.items(), key=lambda kv: int(kv[0]))) for c, v in sorted(d.items(), key=lambda kv: int(kv[0]))}

    if not tps:
        raise ValueError("long_context: no rows of prompt kind `long`")
    return {"real8b_long_context": ordered(tps), "real8b_long_context_tau": ordered(tau),
            "real8b_long_context_round_over_dflash": ordered(rounds),
            "real8b_long_context_source": [s.name for s in srcs]}


def long_context_acceptance(srcs: list[Source], keep: float = 0.8, **_) -> dict:
    """Whether the pair that the long-context table measures accepts at long context what it accepts at short
    (benchmarks/long_context_offline.py: the tiny pair offline, which its 8B widening reproduces logit for logit):
    tiny_long_context_tau {ctx: {method: {"long": tau with the whole prompt, "tail": tau on the prompt's last tokens
    alone}}}, tiny_long_context_nll_delta {bin "lo-hi": the target's NLL with all the context over the same tokens'
    with a training-length window}, and real8b_long_context_acceptance_meaningful: every method's tau with the long
    context at least `keep` of its tau on the tail alone, at every length. False: the long-context table's tau and
    tokens/s describe a pair that breaks past its training length, not the methods (its round costs and lossless
    checks stand)."""
    data = srcs[0].json()
    taus: dict = {}
    for ctx, group in sorted(data["decode_groups"].items(), key=lambda kv: int(kv[0])):
        taus[ctx] = {m: {part: round(group[part]["taus"][m]["tau"], 3) for part in ("long", "tail")}
                     for m in group["long"]["taus"]}
    if not taus:
        raise ValueError(f"{srcs[0].name}: no decode groups")
    pooled = data["nll_pooled"]  # the longest prompts' bins: every bin a prompt length reaches
    bins = pooled[max(pooled, key=int)]["bins"] if pooled else []
    deltas = {f"{b['lo']}-{b['hi']}": round(b["delta"], 3) for b in bins}
    meaningful = all(t["long"] >= keep * t["tail"] for by_method in taus.values() for t in by_method.values())
    return {"tiny_long_context_tau": taus, "tiny_long_context_nll_delta": deltas,
            "real8b_long_context_acceptance_meaningful": meaningful,
            "tiny_long_context_lossless": bool(data["lossless_all"]),
            "tiny_long_context_source": srcs[0].name}


def _first_difference_gaps(records: list[dict]) -> list[float]:
    """Plain's log-prob gaps at every first difference of compare()'s records (ties, and failures that carry one; a
    failure of lengths is a string and has none)."""
    return [d["logprob_gap"] for r in records for d in r["ties"] + r["failures"]
            if isinstance(d, dict) and d.get("logprob_gap") is not None]


def pressure(srcs: list[Source], **_) -> dict:
    """DDTREE (and DFLASH beside it) with a KV pool under pressure, SGLang retracting running requests and resuming
    them later (tests/gpu/test_pressure.py, the gpu_suite.json of run_gpu_suite.py); records of every source, summed
    per configuration where runs repeat:
    retraction_lossless_up_to_ties (every pressure_greedy record's outputs equal plain's up to a tie),
    retraction_exact_ties_requests {config: [exact, ties, requests]}, retraction_max_gap_nats (the largest gap at a
    first difference), retractions_observed {config: requests retracted, counted from the server's log: a lossless
    figure with none proved nothing}, and where those tests ran: pressure_kv_leak_tokens {config: KV tokens still in
    use after the run and the mixed, sampled and aborted load, over idle; the largest of its records},
    pressure_full_context_up_to_ties {config: a request filling the whole context ended full length and equal to
    plain's up to a tie}, pressure_model_pair (the pair served). No pressure_greedy record is an error."""
    records = [r for src in srcs for r in _suite_records(src)]
    greedy = [r for r in records if r.get("kind") == "pressure_greedy"]
    if not greedy:
        raise ValueError(f"{', '.join(s.name for s in srcs)}: no pressure_greedy records "
                         "(tests/gpu/test_pressure.py did not record)")
    counts: dict = {}
    retracted: dict = {}
    for r in greedy:
        got = counts.setdefault(r["config"], [0, 0, 0])
        for i, n in enumerate((r["exact"], len(r["ties"]), r["requests"])):
            got[i] += n
        retracted[r["config"]] = retracted.get(r["config"], 0) + r["retracted_reqs"]
    out = {"retraction_lossless_up_to_ties": all(not r["failures"] for r in greedy),
           "retraction_exact_ties_requests": dict(sorted(counts.items())),
           "retraction_max_gap_nats": max(_first_difference_gaps(greedy), default=0.0),
           "retractions_observed": dict(sorted(retracted.items()))}
    leaks: dict = {}
    for r in records:
        if r.get("kind") == "pressure_kv_leak":
            leaked = r["after_load_tokens"] - r["idle_tokens"]
            leaks[r["config"]] = max(leaks.get(r["config"], leaked), leaked)
    if leaks:
        out["pressure_kv_leak_tokens"] = dict(sorted(leaks.items()))
    full: dict = {}
    for r in records:
        if r.get("kind") == "pressure_full_context":
            ok = r["completion_tokens"] == r["new_tokens"] and not r["failures"]
            full[r["config"]] = full.get(r["config"], True) and ok
    if full:
        out["pressure_full_context_up_to_ties"] = dict(sorted(full.items()))
    pairs = sorted({r["mode"] for r in records if r.get("kind") == "model_pair"})
    if pairs:
        out["pressure_model_pair"] = pairs
    out["pressure_source"] = [s.name for s in srcs]
    return out


def long_context_lossless(srcs: list[Source], **_) -> dict:
    """The real-size lossless module (tests/gpu/test_real8b.py) on the widened 8B pair with long prompts
    (DDTREE_GPU_PROMPTS=long:TOKENS) or long prompts sharing a prefix (shared:TOKENS): its real8b_greedy records of
    those prompt sets, from one file or several (records of every source, summed per run name where runs repeat).
    real8b_long_context_lossless_up_to_ties {prompt set: every run equal to plain up to a tie, none failing to be
    judged}, real8b_long_context_max_gap_nats {prompt set: the largest gap at a first difference},
    real8b_long_context_exact_ties_prompts {prompt set: {run: [exact, ties, prompts]}},
    prefix_sharing_lossless_up_to_ties (the same over the shared prompt sets, where one ran),
    prefix_sharing_cache_hit_rate {prompt set: {run: the share of prompt tokens the radix cache served, the last
    record's; "plain": plain's}} where the records carry it, and real8b_long_context_kv_leak_tokens {prompt set: KV
    tokens still in use after the load over idle, the largest of its records, None where a load failed} where the
    leak check ran. No real8b_greedy record of a long or shared prompt set is an error."""

    def long_set(r: dict) -> bool:
        return r.get("pair") == "8b-real" and r.get("prompt_set", "humaneval").startswith(("long:", "shared:"))

    records = [r for src in srcs for r in _suite_records(src) if long_set(r)]
    greedy = [r for r in records if r["kind"] == "real8b_greedy"]
    if not greedy:
        raise ValueError(f"{', '.join(s.name for s in srcs)}: no real8b_greedy records of pair 8b-real with a long "
                         "or shared prompt set (DDTREE_GPU_PROMPTS)")
    lossless: dict = {}
    gaps: dict = {}
    counts: dict = {}
    hits: dict = {}
    for r in greedy:
        ps = r["prompt_set"]
        judged = "error" not in r  # a run whose judging raised carries the error, not its counts
        lossless[ps] = lossless.get(ps, True) and judged and not r["failures"]
        if not judged:
            continue
        gaps[ps] = max(gaps.get(ps, 0.0), r["max_gap"])
        got = counts.setdefault(ps, {}).setdefault(r["config"], [0, 0, 0])
        for i, n in enumerate((r["exact"], len(r["ties"]), r["prompts"])):
            got[i] += n
        if ps.startswith("shared:") and r.get("cache"):
            hits.setdefault(ps, {})[r["config"]] = r["cache"]["hit_rate"]
            hits[ps]["plain"] = r["plain_cache"]["hit_rate"]

    def by_set(d: dict) -> dict:  # prompt sets by kind, then tokens in numeric order; runs in name order
        order = sorted(d, key=lambda ps: (ps.partition(":")[0], int(ps.partition(":")[2])))
        return {ps: dict(sorted(d[ps].items())) if isinstance(d[ps], dict) else d[ps] for ps in order}

    out = {"real8b_long_context_lossless_up_to_ties": by_set(lossless),
           "real8b_long_context_max_gap_nats": by_set(gaps),
           "real8b_long_context_exact_ties_prompts": by_set(counts)}
    shared = [ok for ps, ok in lossless.items() if ps.startswith("shared:")]
    if shared:
        out["prefix_sharing_lossless_up_to_ties"] = all(shared)
    if hits:
        out["prefix_sharing_cache_hit_rate"] = by_set(hits)
    leaks: dict = {}
    for r in records:  # a load that failed (its error in the record) has no count: None, whatever other runs leaked
        if r["kind"] == "real8b_kv_leak":
            ps, leaked = r["prompt_set"], r.get("leaked")
            before = leaks.get(ps, leaked)
            leaks[ps] = None if before is None or leaked is None else max(before, leaked)
    if leaks:
        out["real8b_long_context_kv_leak_tokens"] = by_set(leaks)
    out["real8b_long_context_lossless_source"] = [s.name for s in srcs]
    return out


READERS = {f.__name__: f for f in (
    sweep_table, tree_stages, tiny_pair, offline, gpu_suite, sglang_lossless, sglang_tiny_bs1, round_graphs,
    tree_overhead, best_budget, tp2, hybrid, sglang_hybrid, adaptive, sglang_auto, same_config_servers, pad_stages,
    pad_stages_captures, sglang_tau_mae, sglang_tau_mae_starts, paired, sglang_auto_ab, real8b, planted_bugs, auto_knobs,
    hybrid_real, hybrid_tiny, trained_drafter_projection, long_context, long_context_acceptance, pressure,
    long_context_lossless)}


def load_table(path: Path = TABLE) -> list[dict]:
    """The [[figure]] rows of summary_sources.toml, each checked to name a known reader and at least one source."""
    rows = tomllib.loads(path.read_text())["figure"]
    for row in rows:
        if row.get("reader") not in READERS:
            raise ValueError(f"{path.name}: figure {row.get('name')!r} names no known reader {row.get('reader')!r}")
        if not row.get("sources"):
            raise ValueError(f"{path.name}: figure {row.get('name')!r} has no sources")
    return rows


def figure_sources(name: str, **opts) -> list[str]:
    """The source file names of the table's figure `name`, those whose per-file options match `opts` only (e.g.
    figure_sources("sglang_auto_ab", headline=True): the sweeps pooled for the A/B headline)."""
    row = next(r for r in load_table() if r["name"] == name)
    srcs = [source(entry) for entry in row["sources"]]
    return [s.name for s in srcs if all(s.opts.get(k) == v for k, v in opts.items())]


def build(rows: list[dict] | None = None, results: Path | None = None) -> dict:
    out: dict = {}
    missing = []
    for row in load_table() if rows is None else rows:
        srcs = [source(entry, results) for entry in row["sources"]]
        absent = [s.name for s in srcs if not s.path.exists()]
        if absent:
            missing.append(f"{row['name']}: {' / '.join(absent)}")
            continue
        opts = {k: v for k, v in row.items() if k not in ("reader", "sources")}
        out.update(READERS[row["reader"]](srcs, **opts))
    out["missing"] = missing
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="fail if summary.json differs from what the raw files say")
    args = ap.parse_args(argv)
    summary = build()
    text = json.dumps(summary, indent=1, sort_keys=True) + "\n"
    path = RESULTS / "summary.json"
    if args.check:
        current = path.read_text() if path.exists() else ""
        if current != text:
            print("summary.json is stale: run python scripts/make_summary.py", file=sys.stderr)
            return 1
        print("summary.json is current: it matches what the raw result files give.")
        return 0
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
