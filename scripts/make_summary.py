"""Regenerate benchmarks/results/summary.json (one flat JSON object) from the raw result files.

Never edit summary.json by hand: every figure in it is read from a committed raw result file by an extractor below.
A figure whose raw file is missing is left out (and listed under `missing`), never guessed.

  python scripts/make_summary.py            # rewrite benchmarks/results/summary.json
  python scripts/make_summary.py --check    # exit 1 if summary.json is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def _load(name: str):
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def _row(rows, **match):
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def tree_stages(out: dict) -> None:
    """Issue 2: top-K + tree build + layout + walk on the H200, median ms of one CUDA-graph replay, batch 1, the
    production stages (`triton_fused`: the picked tree kernel and the fused top-K on the bf16 logits), lease 18
    (commit 5a51797: the top-K's radix selections in 2 passes on bf16 logits; the same run measured f6e1b49's
    kernels too, tree_kernels_h200_lease18_base_f6e1b49_*). The tree kernels stop at the last depth that can enter
    the tree, so the time depends on the drafts: the headline fields use bench_tree.py's drafts of every earlier
    lease (randn x 4 logits, an unsure drafter: trees 3-4 deep at batch 1), the `_confident_drafter` fields
    randn x 12 (top-1 p ~0.7: trees 12-15 deep)."""
    names = ("tree_kernels_h200_lease18_scale4.json", "tree_kernels_h200_lease18_scale12.json")
    runs = {"": _load(names[0]), "_confident_drafter": _load(names[1])}
    if any(run is None for run in runs.values()):
        raise FileNotFoundError(" / ".join(names))
    depths = {}
    for suffix, run in runs.items():
        for budget in (256, 1024):
            r = _row(run["rows"], batch_size=1, budget=budget)
            out[f"tree_stages_ms_h200_b{budget}_bs1{suffix}"] = round(r["triton_fused_graph_all_ms"], 4)
            out[f"tree_stages_impl_h200_b{budget}_bs1{suffix}"] = (
                "picked tree kernel + fused top-K and logsumexp (bf16 logits)")
            depths.setdefault(f"randn_x{run['meta']['draft_scale']:g}", {})[str(budget)] = r["tree_depth_max"]
    out["tree_stages_tree_depth_h200_bs1"] = depths


def tiny_pair(out: dict) -> None:
    """Issue 3: the committed tiny pair's size, held-out perplexity and offline chain tau on HumanEval."""
    root = RESULTS.parents[1] / "models" / "tiny"
    files = [p for p in root.rglob("*") if p.is_file()]
    if not files:
        raise FileNotFoundError("models/tiny")
    out["tiny_pair_bytes"] = sum(p.stat().st_size for p in files)
    log = json.loads((root / "training_log.json").read_text())
    out["tiny_target_heldout_ppl"] = round(log["target"]["heldout_ppl"], 3)
    out["tiny_drafter_heldout_chain_walk"] = round(log["acceptance"]["mean_accept_len_chain_walk"], 4)


def offline(out: dict) -> None:
    """Issue 4: offline decoders on HumanEval, T=0."""
    data = _load("offline_humaneval_t0.json")
    if data is None:
        raise FileNotFoundError("offline_humaneval_t0.json")
    out["offline_lossless_t0"] = bool(data["lossless"])
    out["offline_prompts"] = int(data["prompts"])
    out["offline_tau_humaneval_t0"] = {k: round(v, 4) for k, v in data["tau"].items()}
    if "dflash" in data["tau"]:
        out["tiny_dflash_tau_humaneval_t0"] = round(data["tau"]["dflash"], 4)


def _sweep_rows(name: str = "sweep_h200.jsonl") -> dict:
    path = RESULTS / name
    if not path.exists():
        raise FileNotFoundError(name)
    rows = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r.get("status") == "ok":  # the last ok row of a configuration wins (resumed runs append)
            rows[(r["setup"], r["method"], r.get("budget"), r["batch_size"])] = r
    return rows


def _suite_runs(name: str) -> list[dict]:
    """The runs of a committed gpu_suite_lease*.json (runs[i] is the i-th call's gpu_suite.json)."""
    data = _load(name)
    if data is None:
        raise FileNotFoundError(name)
    return data["runs"]


def gpu_suite(out: dict) -> None:
    """Issue 5: lease 3's GPU-suite run on GPU 0 (core + kernels + the DDTREE server module)."""
    full = _suite_runs("gpu_suite_lease3.json")[0]
    phases = full["phases_s"]
    out["gpu_suite_device_seconds"] = round(phases["install"] + phases["suite"], 1)
    out["gpu_suite_passed"] = full["counts"]["passed"]
    out["gpu_suite_failed"] = full["counts"]["failed"] + full["counts"]["errors"]


def _equality(records: list[dict], kind: str) -> tuple[bool, bool, float]:
    """(exact everywhere, equal up to near-ties, largest log-prob gap at a difference) over equality records."""
    equal = [r for r in records if r.get("kind") == kind]
    exact = bool(equal) and all(not r[m]["failures"] and not r[m]["ties"] for r in equal for m in ("bs1", "bs8"))
    up_to_ties = bool(equal) and all(not r[m]["failures"] for r in equal for m in ("bs1", "bs8"))
    gaps = [t["logprob_gap"] for r in equal for m in ("bs1", "bs8") for t in r[m]["ties"] + r[m]["failures"]
            if isinstance(t, dict) and t.get("logprob_gap") is not None]
    return exact, up_to_ties, max(gaps) if gaps else 0.0


def sglang(out: dict) -> None:
    """Issue 6: losslessness and KV leak from the newest run of the DDTREE server module (lease 8, round graphs on,
    per-request branch counts checked: run 0 of gpu_suite_lease8.json); tiny-pair batch-1 throughput of one run (lease 6's sequential sweep with the round
    graphs on, the server alone on the machine)."""
    records = _suite_runs("gpu_suite_lease8.json")[0]["records"]
    # true only if every configuration matched plain decoding token for token (near-ties count as mismatches)
    exact, up_to_ties, gap = _equality(records, "ddtree_greedy_equality")
    out["sglang_lossless_t0"] = exact
    out["sglang_lossless_t0_up_to_bf16_ties"] = up_to_ties
    out["sglang_max_divergence_logprob_gap_nats"] = gap
    leak = [r for r in records if r.get("kind") == "kv_leak"]
    if leak:
        out["sglang_kv_leak_tokens"] = leak[-1]["after_tokens"] - leak[-1]["idle_tokens"]
    rows = _sweep_rows("sweep_tiny_bs1_lease6_graphs_on.jsonl")
    plain, dflash = rows[("tiny", "plain", None, 1)], rows[("tiny", "dflash", None, 1)]
    ddtree = {k[2]: r for k, r in rows.items() if k[0] == "tiny" and k[1] == "ddtree" and k[3] == 1}
    best = max(ddtree, key=lambda b: ddtree[b]["decode_tokens_per_s"])
    out["sglang_tiny_bs1_tokens_per_s"] = {
        "plain": round(plain["decode_tokens_per_s"], 1), "dflash": round(dflash["decode_tokens_per_s"], 1),
        "ddtree_best": round(ddtree[best]["decode_tokens_per_s"], 1), "ddtree_best_budget": best}
    out["ddtree_over_dflash_tokens_per_s_bs1"] = round(ddtree[best]["decode_tokens_per_s"]
                                                       / dflash["decode_tokens_per_s"], 4)
    out["sglang_tiny_tau_humaneval_bs1"] = {"dflash": round(dflash["tau"], 4),
                                            **{f"ddtree_{b}": round(r["tau"], 4) for b, r in sorted(ddtree.items())}}


def round_graphs(out: dict) -> None:
    """The round's stage graphs (sglang_ddtree/graphs.py): tiny pair, batch 1, DDTREE step ms with them on and
    off, two sweeps one after the other on the same GPU (lease 6; single runs of 128 tokens: noisy)."""
    on = _sweep_rows("sweep_tiny_bs1_lease6_graphs_on.jsonl")
    off = _sweep_rows("sweep_tiny_bs1_lease6_graphs_off.jsonl")
    out["round_graphs_tiny_bs1_step_ms"] = {
        str(k[2]): {"on": round(r["step_ms"], 2), "off": round(off[k]["step_ms"], 2)}
        for k, r in sorted(on.items(), key=lambda kv: kv[0][2] or 0) if k[1] == "ddtree" and k in off}


def tp2(out: dict) -> None:
    """Issue 9: TP=2 (lease 6, two H200s, budgets 16/64/256, round graphs on): DDTREE == plain at TP=2, bf16;
    rounds per prompt equal to TP=1 on the prompts whose output is the same at TP=1 and TP=2."""
    records = _suite_runs("gpu_suite_lease6.json")[2]["records"]
    exact, up_to_ties, gap = _equality(records, "tp2_greedy_equality")
    out["tp2_lossless_t0"] = exact
    out["tp2_lossless_t0_up_to_bf16_ties"] = up_to_ties
    out["tp2_max_divergence_logprob_gap_nats"] = gap
    out["tp2_budgets_checked"] = sorted(int(r["config"].split("-")[1]) for r in records
                                        if r.get("kind") == "tp2_greedy_equality")
    taus = [r for r in records if r.get("kind") == "tp2_tau_vs_tp1"]
    out["tp2_rounds_equal_tp1_where_outputs_agree"] = bool(taus) and all(
        a == b for r in taus for a, b, same in zip(r["rounds_tp1"], r["rounds_tp2"], r["same_tokens"]) if same)


def hybrid(out: dict) -> None:
    """Issue 7: lossless offline (transformers, float32: fast == oracle == plain token for token) and the step times
    of the sequential oracle and the fast path in the SGLang server (lease 15, `--speculative-ddtree-oracle` next to
    the fast path, each server's batch-1 loop timed alone: GPU ms per round, stage split summed; 256 eager, the
    others with CUDA graphs); the offline paths' verify times stay as `hybrid_step_ms_offline`."""
    data = _load("bench_hybrid_h200.json")
    run = _load("gpu_suite_lease15_hybrid_oracle.json")
    if data is None or run is None:
        raise FileNotFoundError("bench_hybrid_h200.json / gpu_suite_lease15_hybrid_oracle.json")
    out["hybrid_lossless_t0"] = bool(data["hybrid_lossless_t0"])
    out["hybrid_step_ms_offline"] = {k: round(v, 1) for k, v in data["hybrid_step_ms"].items()}
    timing = [r for r in run["records"] if r["kind"] == "hybrid_round_ms"][-1]
    assert timing.get("measured") == "one server at a time", "lease 15 times each server alone"
    step = {}
    for config, split in timing["stage_split_bs1"].items():
        budget = config.removeprefix("hybrid-ddtree-").split("-")[0]
        path = "oracle" if config.endswith("-oracle") else "fast"
        step[f"{path}_b{budget}" + ("_eager" if "-eager" in config else "")] = round(sum(split["stage_ms"].values()), 2)
    out["hybrid_step_ms"] = dict(sorted(step.items()))
    out["hybrid_step_ms_source"] = ("SGLang server, batch 1, GPU ms per round (stage split summed), each config "
                                    "alone on the GPU; bf16 Qwen3-Next with scripted drafts (lease 15)")
    out["sglang_hybrid_oracle"] = {r["config"]: {"request_rounds_differing": r["differ"],
                                                 "request_rounds_checked": r["checked"],
                                                 "outputs_equal_to_fast": r["outputs_equal_to_fast"]}
                                   for r in run["records"] if r["kind"] == "hybrid_oracle"}


def sglang_hybrid(out: dict) -> None:
    """Issue 7 in SGLang (lease 12, gpu_suite_lease12_hybrid.json, commit 357b64e: budgets 16 / 64 with graphs and
    16 eager; lease 13, gpu_suite_lease13_hybrid.json, commit a8635a2: 128 with graphs and 256 eager, which take our
    tree conv kernel; lease 15, gpu_suite_lease15_hybrid_oracle.json, commit a68bcab: 16 / 64 / 256 eager, each
    also with the sequential oracle, timed one server at a time, so its round times replace the earlier ones of
    those configs; the same test module): DDTREE on a bf16 Qwen3-Next target (random weights, all 4 experts
    routed) with scripted drafts, judged by the same model in float32 on the CPU. Token-for-token equality with
    plain decoding (false: bf16 near-ties), whether every difference is explained by the float32 model (at each
    first difference DDTREE's token is no further from the float32 choice than plain's, or within the tolerance) and
    every DDTREE token is no further from the float32 choice than plain decoding's own worst (teacher forced), the
    float32 gaps at the first differences, the worst teacher-forced gaps, tokens per round and the server's ms per
    round (GPU, stage split summed) at batch 1."""
    rows, forced, timing = [], [], []
    for name in ("gpu_suite_lease12_hybrid.json", "gpu_suite_lease13_hybrid.json",
                 "gpu_suite_lease15_hybrid_oracle.json"):
        run = _load(name)
        if run is None:
            raise FileNotFoundError(name)
        records = run["records"]
        got = ([r for r in records if r["kind"] == "hybrid_greedy_equality"],
               [r for r in records if r["kind"] == "hybrid_fp32_teacher_forced"],
               [r for r in records if r["kind"] == "hybrid_round_ms"])
        if not all(got):
            raise FileNotFoundError(f"{name} has no hybrid records")
        rows += got[0]
        forced += got[1]
        timing += got[2]
    modes = [m for m in ("bs1", "bs4", "bs8") if all(m in r for r in rows)]
    tol = forced[0]["tol_nats"]
    out["sglang_hybrid_lossless_t0"] = all(not r[m]["differences"] for r in rows for m in modes)
    explained = all(d["fp32_gap_ddtree"] <= max(d["fp32_gap_plain"], tol)
                    for r in rows for m in modes for d in r[m]["differences"])
    faithful = all(f[m]["worst"] <= f["bound_nats"] for f in forced for m in modes)
    out["sglang_hybrid_lossless_t0_up_to_bf16_ties"] = explained and faithful
    out["sglang_hybrid_dtype"] = "bfloat16"
    out["sglang_hybrid_configs_checked"] = sorted({r["config"] for r in rows})
    out["sglang_hybrid_batch_sizes_checked"] = [int(m[2:]) for m in modes]
    out["sglang_hybrid_first_difference_fp32_gaps_nats_bs1"] = {
        r["config"]: {"ddtree": sorted(d["fp32_gap_ddtree"] for d in r["bs1"]["differences"]),
                      "plain": sorted(d["fp32_gap_plain"] for d in r["bs1"]["differences"])} for r in rows}
    out["sglang_hybrid_fp32_teacher_forced_worst_nats"] = {
        "plain": max(f["plain"]["worst"] for f in forced),
        **{f["config"]: max(f[m]["worst"] for m in modes) for f in forced}}
    out["sglang_hybrid_tau_bs1"] = {r["config"]: r["tau_bs1"] for r in rows}
    out["sglang_hybrid_round_ms_bs1"] = {c: round(sum(v["stage_ms"].values()), 3)
                                         for t in timing for c, v in t["stage_split_bs1"].items()}


def budgets(out: dict) -> None:
    """Issue 8: tree-stage overhead at real size (8b-dummy, B=256, batch 1, round graphs on; lease 7's sweep, whose
    stage split chains CUDA events round to round, so the stages, `between` included, add up to the GPU time per
    round) and the projected best budgets."""
    rows = _sweep_rows("sweep_8b_bs1_lease6_graphs_on.jsonl")
    r = rows[("8b-dummy", "ddtree", 256, 1)]
    stages = r["stage_ms"]
    out["tree_overhead_fraction_8b_b256_bs1"] = round(
        (stages["tree"] + stages["walk"] + stages["commit"]) / sum(stages.values()), 4)
    projection = _load("best_budget.json")
    if projection is None:
        raise FileNotFoundError("best_budget.json")
    out["best_budget_by_batch"] = {b: v["best_budget"] for b, v in projection["by_batch"].items()}
    out["best_budget_by_batch_is_projected"] = bool(projection.get("projected", True))


def adaptive(out: dict) -> None:
    """Issue 10: auto budget vs the best fixed budget / chain (PROJECTED) and the calibration's tau MAE, offline on
    the tiny pair (scripts/adaptive_eval.py)."""
    data = _load("adaptive_tiny.json")
    if data is None:
        raise FileNotFoundError("adaptive_tiny.json")
    fields = data["summary_fields"]
    out["auto_vs_best_fixed_tokens_per_s"] = {str(b): round(r, 4) for b, r in
                                              fields["auto_vs_best_fixed_tokens_per_s"].items()}
    out["auto_vs_best_fixed_is_projected"] = True
    out["raw_tau_mae"] = round(fields["raw_tau_mae"], 4)
    out["calibrated_tau_mae"] = round(fields["calibrated_tau_mae"], 4)
    out["adaptive_lossless_t0"] = bool(data["lossless"]) if isinstance(data["lossless"], bool) else \
        all(bool(v) for v in data["lossless"].values())


# Issue 10 in SGLang, later files winning for the same (setup, batch size):
# - tiny pair: lease 19 (076d51a: auto's stage graphs captured per batch-size bucket, the stale-evidence policy of
#   3a18576), one detached run alone on the machine (DFLASH, DDTREE 32 / 128, auto; 3 repeats of 1024 tokens x 4
#   prompt groups, interleaved). It predates the chooser's time shrinkage (SHRINK_Z) and the server's calibration
#   table; lease 20's tiny sweep (sweep_auto_tiny_lease20.jsonl) ran a chooser fed by the table's expectations,
#   reverted since (1bfb0c3), so it is a raw record, not the standing: the current code's tiny ratios are unmeasured.
# - 8B shapes (DFLASH and auto, 3 repeats x 4 prompt groups, interleaved, decode CUDA graphs at every batch size):
#   lease 20 (52a645d) for batch 16 / 64 (that chooser ran the chain in 383 / 396 of 384 / 397 rounds, as lease 19's
#   did), lease 20b (c916db4, the current chooser) for batch 4, and lease 20c (0a762d0, the current chooser and
#   table) for batch 1 (lease 20b's batch 1: x0.953, the results README).
# - tiny pair, since lease 23b (971cdb1: decisions held HOLD_ROUNDS, the calibration scored on one sampled tree round
#   in four): the paired sweep (DFLASH, DDTREE 128, auto; servers pinned, 40 runs of 512 tokens a row), medians.
# - lease 25 (ebae9a7, the current chooser with the young table scored every sampled round): the tiny paired sweep
#   (DFLASH, DDTREE 128, auto; 32 runs of 512 tokens a row) and the 8B shapes (DFLASH and auto, 8 repeats x 4 prompt
#   groups, interleaved), both at every batch size: the standing of the current code.
# - lease 26 (7b26283: EXPLORE_BEST_ELSEWHERE and CALIBRATION_LEARN_ALL = 500 on by default): the tiny paired sweep
#   (as lease 25's) replaces lease 25's tiny rows. The 8B rows stay lease 25's: lease 26's 8B run (c5451c0) was the
#   A/B that made EXPLORE_BEST_ELSEWHERE a default, its `8b-dummy|auto` without it (PAIRED_SWEEPS has both arms).
# - lease 27 (d125f6a: FLOOR_MIN_TIMES = 2 and EXPLORE_ROUNDS = 4 by default): the tiny paired sweep replaces lease
#   26's tiny rows. The 8B rows stay lease 25's: lease 27's 8B run (6d1b1c6) was the A/B, its `8b-dummy|auto` the
#   chooser before (PAIRED_SWEEPS has the arms).
# - lease 28 (fbba433: `auto`'s host cost cut, the chooser unchanged): the tiny paired sweep replaces lease 27's tiny
#   rows. Its `tiny-b|auto` was meant to run the previous commit's package (PYTHONPATH) but ran fbba433 as well (the
#   servers start in the repository root, which Python puts before PYTHONPATH): a second `auto` server of the same
#   code, so its entry is a twin of `tiny`'s (SAME_CONFIG_SWEEPS has both). The 8B rows stay lease 25's.
# - lease 29 (05312c8, the code as it is): the tiny paired sweep replaces lease 28's `tiny` rows and the 8B shapes
#   (DFLASH and auto, 8 repeats x 4 prompt groups, as lease 25's) replace lease 25's. Its `tiny-b|auto` ran a0828ce's
#   package (TP_TWIN_BASE: the A/B of fbba433's cut), older code: left out (_other_commit), so `tiny-b` stays lease
#   28's twin.
# - lease 30 (aa06f0d: `auto`'s lean chain round): the tiny paired sweep (batch 4 / 16 / 64 only) replaces lease 29's
#   `tiny` rows at those batch sizes (batch 1 stays lease 29's) and the 8B shapes (6 repeats x 4 prompt groups)
#   replace lease 29's. Its `tiny-b|auto` was held on the chain (SGLANG_DDTREE_AUTO_FORCE=chain: the lean chain round
#   against DFLASH), not `auto`: left out (_forced).
# - lease 33 (1341668: settled holds and sampling): the 8B shapes (DFLASH, `auto`, and `8b-o|auto` with the holds and
#   sampling before, left out: ARM_KNOBS; 5 repeats x 4 prompt groups) replace lease 30's. The chain that `auto` runs
#   there is the narrowest candidate, so its holds grow under ff32690's rule exactly when they did under 1341668's
#   (every wider candidate explored). The tiny pair since lease 31 is measured in-process (AB_SWEEPS).
# - lease 34 (c941520: the chain's times no longer floor the trees, each bucket re-measures its start at round 128):
#   the 8B shapes (DFLASH and `auto`, 3 repeats x 4 prompt groups) replace lease 33's. The re-measure (FORGET_START)
#   was on by default there and is off since; at 8B shapes it re-explores only the 16- and 32-trees, once a bucket
#   (the wider trees are far behind the chain), so these rows stand for the code as it is to within that.
# - lease 35 (7a3115e, 5 repeats x 4 prompt groups) replaces lease 34's 8B shapes. TIMES_EXPIRE was off there and is
#   on since; at 8B shapes `auto` runs the chain and the trees' expired times still bound their floors (_bound_ms),
#   so the expiry changes only which stale probe's time a tree keeps (simulated 8B-like cases 0.997-0.998 either way).
# - lease 36 (940a7e6, the expiry on by default, 5 repeats x 4 prompt groups) replaces lease 35's 8B shapes.
# - lease 37 (493a9a3, the code as lease 36's with SWITCH_UNTIMED off by default, 5 repeats x 4 prompt groups)
#   replaces lease 36's 8B shapes; its `8b-s|auto` set SGLANG_DDTREE_AUTO_SWITCH_UNTIMED=1: left out (ARM_KNOBS).
# - lease 38 (3a7b8c1, the chooser as lease 37's; SGLANG_DDTREE_AUTO_HOST_DETAIL new and off, 5 repeats x 4 prompt
#   groups) replaces lease 37's 8B shapes; its `8b-f|auto` set SGLANG_DDTREE_AUTO_FORGET_START=128: left out.
SGLANG_AUTO_SWEEPS = ("sweep_auto_8b_lease19.jsonl", "sweep_auto_tiny_lease19.jsonl", "sweep_auto_8b_lease20.jsonl",
                      "sweep_auto_8b_lease20b.jsonl", "sweep_auto_8b_bs1_lease20c.jsonl",
                      "sweep_auto_tiny_lease21.jsonl", "sweep_auto_8b_lease21.jsonl",
                      "sweep_paired_tiny_lease23b.jsonl", "sweep_paired_tiny_lease25.jsonl",
                      "sweep_auto_8b_lease25.jsonl", "sweep_paired_tiny_lease26.jsonl",
                      "sweep_paired_tiny_lease27.jsonl", "sweep_paired_tiny_lease28.jsonl",
                      "sweep_paired_tiny_lease29.jsonl", "sweep_auto_8b_lease29.jsonl",
                      "sweep_paired_tiny_lease30.jsonl", "sweep_auto_8b_lease30.jsonl", "sweep_auto_8b_lease33.jsonl",
                      "sweep_auto_8b_lease34.jsonl", "sweep_auto_8b_lease35.jsonl", "sweep_auto_8b_lease36.jsonl",
                      "sweep_auto_8b_lease37.jsonl", "sweep_auto_8b_lease38.jsonl")
# Servers of one configuration started side by side in one interleaved run (a setup and its --copy-setup copy): how
# far two identical servers' tokens/s lie apart on this host.
SAME_CONFIG_SWEEPS = ("sweep_noise_tiny_lease21b.jsonl", "sweep_twins_tiny_lease21e.jsonl",
                      "sweep_paired_tiny_lease28.jsonl")
# Interleaved sweeps with every server pinned to the same CPUs once ready and the prompts rotating per run
# (lease_steps.sh tiny-paired): every row over the base row run by run, with 95% intervals (bench/paired.py).
# Lease 23 (217d929) and 23b (971cdb1): DFLASH, DDTREE 128 and auto only. Lease 24 (8fec388): DFLASH, DDTREE 128,
# `tiny|auto` with SGLANG_DDTREE_AUTO_SAMPLED_APART=1 (a trial, removed since) and `tiny-b|auto` as the code is (the
# rows' server_env says which). Lease 24c (55fff9a, batch 1 and 4): DDTREE 128, `tiny|auto` with WARM_ROUNDS = 3
# (that commit's default, off since) and `tiny-b|auto` with SGLANG_DDTREE_AUTO_WARM_ROUNDS=0 (as the code is).
# Lease 24d (445c2e8, batch 1 and 4): DDTREE 128 and `auto` as the code is (the young table scored every round).
# Lease 25 (ebae9a7): DFLASH, DDTREE 128 and `auto` at every batch size; and lease_steps.sh tiny-starts at batch 1
# (DDTREE 128 and three `auto` servers per arm: a1-a3 as the code is, b1-b3 SGLANG_DDTREE_AUTO_SWITCH_SETTLE=1 (a
# trial, removed since), c1-c3 SGLANG_DDTREE_AUTO_EXPLORE_ALL=1); lease 25b (253df2b) the same with two per arm,
# b1-b2 SGLANG_DDTREE_CALIBRATION_PRIOR_MASS=10 (the rows' server_env says which). Lease 26 (c5451c0): tiny-starts at
# batch 1 then 4, a1-a3 as that code was, b1-b3 SGLANG_DDTREE_AUTO_EXPLORE_BEST_ELSEWHERE=1, c1-c3
# SGLANG_DDTREE_AUTO_CALIBRATION_LEARN_ALL=500; the 8B shapes with DFLASH, `8b-dummy|auto` as that code was and
# `8b-b|auto` with EXPLORE_BEST_ELSEWHERE=1 (base DFLASH); then at 7b26283 (both on by default) the tiny paired sweep.
# Lease 27 (6d1b1c6): tiny-starts at batch 1 then 4, a1-a3 as that code was, b1-b3 SGLANG_DDTREE_AUTO_FLOOR_MIN_TIMES=2
# with SGLANG_DDTREE_AUTO_EXPLORE_ROUNDS=4, c1-c3 those and SGLANG_DDTREE_AUTO_SPREAD=mad; the 8B shapes with DFLASH,
# `8b-dummy|auto` as that code was, `8b-b|auto` (arm b) and `8b-c|auto` (arm c, a second wave: not paired with DFLASH);
# then at d125f6a (arm b by default) the tiny paired sweep. Lease 28 (fbba433): DFLASH, DDTREE 128, `tiny|auto` and
# `tiny-b|auto`, both auto servers running fbba433 (see SGLANG_AUTO_SWEEPS). Since then the tables leave out the rounds
# where a compared row had a rate outlier (bench/paired.py _clean_rounds; "dropped_runs" counts them). Lease 29
# (05312c8): DFLASH, DDTREE 128, `tiny|auto` and `tiny-b|auto` running a0828ce's package (the A/B of fbba433's cut);
# 29c (05312c8, batch 4 only): DFLASH, DDTREE 64 and 128, `auto` (is the 64-tree, which `auto` ran in most batch-4
# rounds, the better fixed budget there?); the 8B shapes, DFLASH and `auto`. Lease 30 (aa06f0d, batch 4 / 16 / 64):
# DFLASH, DDTREE 128, `tiny|auto` and `tiny-b|auto` held on the chain (SGLANG_DDTREE_AUTO_FORCE=chain); the 8B shapes.
PAIRED_SWEEPS = {"sweep_paired_tiny_lease22.jsonl": "tiny|ddtree-128",
                 "sweep_paired_tiny_lease23.jsonl": "tiny|ddtree-128",
                 "sweep_paired_tiny_lease23b.jsonl": "tiny|ddtree-128",
                 "sweep_paired_tiny_lease24.jsonl": "tiny|ddtree-128",
                 "sweep_paired_tiny_lease24c.jsonl": "tiny|ddtree-128",
                 "sweep_paired_tiny_lease24d.jsonl": "tiny|ddtree-128",
                 "sweep_paired_tiny_lease25.jsonl": "tiny|ddtree-128",
                 "sweep_starts_tiny_lease25.jsonl": "tiny|ddtree-128",
                 "sweep_starts_tiny_lease25b.jsonl": "tiny|ddtree-128",
                 "sweep_starts_tiny_lease26.jsonl": "tiny|ddtree-128",
                 "sweep_auto_8b_lease26.jsonl": "8b-dummy|dflash",
                 "sweep_paired_tiny_lease26.jsonl": "tiny|ddtree-128",
                 "sweep_starts_tiny_lease27.jsonl": "tiny|ddtree-128",
                 "sweep_auto_8b_lease27.jsonl": "8b-dummy|dflash",
                 "sweep_paired_tiny_lease27.jsonl": "tiny|ddtree-128",
                 "sweep_paired_tiny_lease28.jsonl": "tiny|ddtree-128",
                 "sweep_paired_tiny_lease29.jsonl": "tiny|ddtree-128",
                 "sweep_paired_tiny_lease29c_b64.jsonl": "tiny|ddtree-128",
                 "sweep_auto_8b_lease29.jsonl": "8b-dummy|dflash",
                 "sweep_paired_tiny_lease30.jsonl": "tiny|ddtree-128",
                 "sweep_auto_8b_lease30.jsonl": "8b-dummy|dflash",
                 "sweep_ab_tiny_lease31.jsonl": "tiny|ddtree-128",  # lease 31b's A/B servers ran alone: no base row
                 "sweep_auto_8b_lease33.jsonl": "8b-dummy|dflash",
                 "sweep_auto_8b_lease34.jsonl": "8b-dummy|dflash"}
# The in-process A/B (SGLANG_DDTREE_AUTO_AB: an `auto` server alternating blocks of 8 decode rounds with the fixed
# 128-tree, each arm tallied apart), lease 31 (e04941f), tiny pair, 20 runs of 512 tokens a row, next to DFLASH and
# DDTREE 128 servers: `tiny-ab` `auto` as it is, `tiny-f` held on the 128-tree (SGLANG_DDTREE_AUTO_FORCE=128: `auto`'s
# own cost, no choice), `tiny-l` with HOLD_ROUNDS = 16 and SAMPLE_EVERY = 16. Lease 31b (a9ea0f2: held_round, a forced
# candidate holding as a decision does), A/B servers alone, 14 runs a row: `tiny-ab`, `tiny-f`, `tiny-h` (HOLD_ROUNDS =
# 16, SAMPLE_EVERY = 16), `tiny-z` (SHRINK_Z = 2), `tiny-hz` (all three). Lease 32 (e033bee, whose default had
# RELATIVE_TIMES on: AB_IMPLIED_ENV), A/B servers alone, 14 runs: `tiny-r`, `tiny-r2` (relative times), `tiny-o`,
# `tiny-o2` (off), `tiny-h` (relative, HOLD_ROUNDS = 16, SAMPLE_EVERY = 16). Lease 32b (4fc4ebf: STALL_HOST_MS, the lean
# chain's kernel warmed), 10 runs: `tiny-a`, `tiny-a2` (as it is), `tiny-h`, `tiny-h2` (HOLD_ROUNDS = 16, SAMPLE_EVERY =
# 16). Lease 33 (1341668: holds grow to HOLD_MAX once every candidate was explored, settled sampling, the learn walk),
# 12 runs: `tiny-n`, `tiny-n2` (as it is), `tiny-o` (SGLANG_DDTREE_AUTO_HOLD_MAX=4, ..._SETTLED_SAMPLING=0: the holds
# and sampling before); 33b (the same commit): `tiny-n3`, `tiny-n4`, `tiny-f` (held on the 128-tree); 33c (ff32690:
# holds grow once the candidates wider than the choice were explored), 8 runs: `tiny-n5`, `tiny-n6`. Lease 34
# (c941520: the chain's times no longer floor the trees; each bucket re-measures its start at round 128,
# FORGET_START): 34 at batch 1 only, 12 runs, `tiny-n1`-`n3` with the start re-measure and `tiny-o1`-`o3` with
# SGLANG_DDTREE_AUTO_FORGET_START=0; 34b at every batch size, 8 runs, `tiny-n1`-`n3`; 34c the same with `tiny-n4`-`n6`
# and `tiny-o1`-`o3`; 34d (cbe84ca, the same code) `tiny-n7`-`n9` and `tiny-f1`-`f3` (held on the 128-tree: `auto`'s
# own cost). FORGET_START was 128 by default in those servers and is 0 since (AB_IMPLIED_ENV names the `n` servers'
# arm; CURRENT_DEFAULTS makes the `o` servers, which set 0, `auto` as it is). The headline is `auto` as it is in
# AB_HEADLINE_SWEEPS, every such server's runs pooled (bench.paired.ab_pooled): six servers at batch 1, three at 4 /
# 16 / 64. Lease 35 (7a3115e, TIMES_EXPIRE off by default there and on since), 8 runs a row: 35 `tiny-e1`-`e3`
# (SGLANG_DDTREE_AUTO_TIMES_EXPIRE=256) and `tiny-o1`-`o3` (no expiry); 35b `tiny-f1`, `tiny-f2` (held on the
# 128-tree), `tiny-L1`, `tiny-L2` (held, SGLANG_DDTREE_AUTO_CALIBRATION_LEARN_ALL=0), `tiny-e4`, `tiny-o4`; 35c
# `tiny-e5`, `tiny-e6`, `tiny-o5`, `tiny-o6`, `tiny-f3`, `tiny-L3`. The headline is the six `e` servers (`auto` as it
# is since), runs pooled. Every server before lease 35 ran without the expiry (AB_IMPLIED_ENV). Lease 36 (940a7e6, the
# same chooser as lease 35's `e` servers, the expiry on by default), 8 runs a row: 36 `tiny-e1`-`e3` (as it is),
# `tiny-w1`-`w3` (as it is, each row's warm-up 640 new tokens instead of 128: AB_SETUP_NOTES) and `tiny-f1` (held on
# the 128-tree); 36b `tiny-e4`-`e9`. Lease 37 (493a9a3, the same chooser with SWITCH_UNTIMED, new and off by
# default), 8 runs a row: 37 `tiny-e1`-`e4` (as it is) and `tiny-s1`-`s4` (SGLANG_DDTREE_AUTO_SWITCH_UNTIMED=1); 37b
# `tiny-e5`-`e7` and `tiny-s5`-`s7`. Lease 38 (3a7b8c1, the same chooser; SGLANG_DDTREE_AUTO_HOST_DETAIL new and
# off), 8 runs a row: 38 `tiny-e1`-`e3` (as it is), `tiny-s1`-`s3` (SGLANG_DDTREE_AUTO_SAMPLE_EVERY=8), `tiny-d1`,
# `tiny-d2` (SGLANG_DDTREE_AUTO_HOST_DETAIL=1: its marks add their own cost, so not as it is; AB_DETAIL_ARM); 38b
# `tiny-e4`, `e5`, `s4`, `s5`, `d3`, `d4`; 38c `tiny-e6`-`e8`, `s6`-`s8`. Lease 39 (dbf4e29: aa3bbae's bookkeeping
# cuts, the same picks), 8 runs a row: 39 `tiny-e1`-`e6` (as it is), `tiny-d1`, `tiny-d2` (HOST_DETAIL); 39b
# `tiny-e7`-`e12`. The headline pools the `auto` as it is servers of leases 35-39 (42 servers).
AB_SWEEPS = ("sweep_ab_tiny_lease31.jsonl", "sweep_ab_tiny_lease31b.jsonl", "sweep_ab_tiny_lease32.jsonl",
             "sweep_ab_tiny_lease32b.jsonl", "sweep_ab_tiny_lease33.jsonl", "sweep_ab_tiny_lease33b.jsonl",
             "sweep_ab_tiny_lease33c.jsonl", "sweep_ab_tiny_lease34.jsonl", "sweep_ab_tiny_lease34b.jsonl",
             "sweep_ab_tiny_lease34c.jsonl", "sweep_ab_tiny_lease34d.jsonl", "sweep_ab_tiny_lease35.jsonl",
             "sweep_ab_tiny_lease35b.jsonl", "sweep_ab_tiny_lease35c.jsonl", "sweep_ab_tiny_lease36.jsonl",
             "sweep_ab_tiny_lease36b.jsonl", "sweep_ab_tiny_lease37.jsonl", "sweep_ab_tiny_lease37b.jsonl",
             "sweep_ab_tiny_lease38.jsonl", "sweep_ab_tiny_lease38b.jsonl", "sweep_ab_tiny_lease38c.jsonl",
             "sweep_ab_tiny_lease39.jsonl", "sweep_ab_tiny_lease39b.jsonl")
# one chooser since lease 35: every later A/B sweep is the headline's (a new lease's sweeps go in AB_SWEEPS only)
AB_HEADLINE_SWEEPS = AB_SWEEPS[AB_SWEEPS.index("sweep_ab_tiny_lease35.jsonl"):]
# The arm whose `auto` rounds mark its own host work apart (stages.AUTO_HOST_DETAIL): sglang_auto_ab_host_detail_ms_tiny,
# from the sweeps of the bookkeeping as it is (AB_DETAIL_SWEEPS: aa3bbae changed what `after_auto` and `tree_auto`
# hold, so lease 38's `d` servers are not pooled with lease 39's; their split stays in ab_arms_pooled_lease38.json)
AB_DETAIL_ARM = "AUTO_HOST_DETAIL=1"
AB_DETAIL_SWEEPS = ("sweep_ab_tiny_lease39.jsonl",)
# What a sweep's servers ran without setting it (their commit's default then), for the arm labels.
_NO_EXPIRY = "SGLANG_DDTREE_AUTO_TIMES_EXPIRE=0"  # every commit before lease 35's default (the knob came with it)
_EXPIRY_DEFAULT = AB_SWEEPS[AB_SWEEPS.index("sweep_ab_tiny_lease36.jsonl"):]  # commits with the expiry on
# A setup field an arm changed that its rows do not record (result rows carry warmup_new_tokens since lease 36's
# commit; its own rows do not), named in the arm's label.
AB_SETUP_NOTES = {"sweep_ab_tiny_lease36.jsonl": {f"tiny-w{i}": ["warmup_new_tokens=640"] for i in (1, 2, 3)}}
AB_IMPLIED_ENV = {**{name: [_NO_EXPIRY] for name in AB_SWEEPS if name not in _EXPIRY_DEFAULT},
                  "sweep_ab_tiny_lease32.jsonl": ["SGLANG_DDTREE_AUTO_RELATIVE_TIMES=1", _NO_EXPIRY],
                  **{f"sweep_ab_tiny_lease34{x}.jsonl": ["SGLANG_DDTREE_AUTO_FORGET_START=128", _NO_EXPIRY]
                     for x in ("", "b", "c", "d")}}
# Knob settings equal to the code's default now: an arm that set one ran `auto` as it is.
CURRENT_DEFAULTS = ("SGLANG_DDTREE_AUTO_FORGET_START=0", "SGLANG_DDTREE_AUTO_TIMES_EXPIRE=256")
PAD_AB_SWEEPS = ("sweep_auto_tiny_lease16_pad_ab1.jsonl", "sweep_auto_tiny_lease16_pad_ab2.jsonl")


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


def _copy_bases(name: str) -> dict[str, str]:
    """{NEW: BASE} of the sweep's `--copy-setup NEW=BASE` arguments (its run records' argv)."""
    bases = {}
    for line in (RESULTS / name).read_text().splitlines():
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
    """The package directory a row's server ran instead of the checkout (lease_steps.sh tiny-paired TP_TWIN_BASE:
    PYTHONSAFEPATH=1 with PYTHONPATH on runs/bench/base-<commit>), else None. Such a row is an A/B's base, not the
    code measured, so neither the headline nor the calibration table takes it (PAIRED_SWEEPS keeps it). Without
    PYTHONSAFEPATH the checkout came first on sys.path (lease 28's `tiny-b` ran the checkout that way)."""
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
    """The candidate an `auto` row's server was held on (SGLANG_DDTREE_AUTO_FORCE, lease 30's `tiny-b|auto`: the lean
    chain round against DFLASH), else None. Such a row measures one candidate, not `auto`'s choice: neither the
    headline nor the calibration table takes it (PAIRED_SWEEPS keeps it)."""
    prefix = "SGLANG_DDTREE_AUTO_FORCE="
    return next((entry[len(prefix):] for entry in row.get("server_env") or [] if entry.startswith(prefix)), None)


def _ab_server(row: dict) -> bool:
    """Whether an `auto` row's server alternated its rounds with the fixed widest tree (SGLANG_DDTREE_AUTO_AB, read
    as the sweep reads it: bench.sweep.ab_block_of): its tokens/s mixes the two arms, which its `ab` tallies keep
    apart (sglang_auto_ab)."""
    sys.path.insert(0, str(RESULTS.parents[1]))
    from sglang_ddtree.bench.sweep import ab_block_of

    return ab_block_of(row.get("server_env")) > 0


# Knobs whose rows are an A/B's other arm, not `auto` as it is (lease 33's 8B `8b-o|auto`: the holds and sampling
# before HOLD_MAX; lease 34's `tiny-o*`: no re-measure of the start). Knobs older than these were set in rows that
# the listed files already keep apart.
ARM_KNOBS = ("SGLANG_DDTREE_AUTO_HOLD_MAX=", "SGLANG_DDTREE_AUTO_SETTLED_SAMPLING=",
             "SGLANG_DDTREE_AUTO_FORGET_START=", "SGLANG_DDTREE_AUTO_TIMES_EXPIRE=",
             "SGLANG_DDTREE_AUTO_CALIBRATION_LEARN_ALL=", "SGLANG_DDTREE_AUTO_SWITCH_UNTIMED=")


def _not_auto_as_it_is(row: dict) -> bool:
    """A row the headline and the calibration table leave out: another commit's package (_other_commit), a server
    held on one candidate (_forced), one alternating with the fixed tree (_ab_server) or one setting an arm's knob
    (ARM_KNOBS)."""
    knobbed = any(entry.startswith(ARM_KNOBS) for entry in row.get("server_env") or [])
    return bool(_other_commit(row) or _forced(row) or _ab_server(row) or knobbed)


def sglang_auto(out: dict) -> None:
    """Issue 10, measured in SGLang (SGLANG_AUTO_SWEEPS, 3 or 5 repeats x 4 prompt groups per row): auto tokens/s
    over max(the fixed budgets and DFLASH measured in the same run) per batch size, which rivals each ratio had and
    which file it came from. The issue asks for >= 0.97."""
    ratios: dict = {}
    paired: dict = {}
    rivals_measured: dict = {}
    sources: dict = {}
    unlike: dict = {}
    for name in SGLANG_AUTO_SWEEPS:
        rows = _sweep_rows(name)
        bases = _copy_bases(name)
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
            sources.setdefault(setup, {})[str(bs)] = name
    out["sglang_auto_vs_max_fixed_or_dflash_tokens_per_s"] = _by_batch_size(ratios)
    out["sglang_auto_rivals_measured"] = _by_batch_size(rivals_measured)
    out["sglang_auto_sources"] = _by_batch_size(sources)
    out["sglang_auto_rows_without_decode_graphs"] = dict(sorted(unlike.items()))  # {} = every ratio like for like
    # The same ratio per repeat: run i of auto over the best rival's run i (interleaved sweeps run the i-th repeat of
    # every server of a batch size back to back, so a slow host phase hits them alike); their spread says how far a
    # ratio of medians can be trusted on a host-bound pair (lease 19's tiny rows: 0.74-1.11).
    out["sglang_auto_vs_max_per_repeat"] = _by_batch_size(paired)


def same_config_servers(out: dict) -> None:
    """Two servers of one configuration in one interleaved run (SAME_CONFIG_SWEEPS): the copy's tokens/s over the
    original's per (method, budget, batch size), and per repeat. On a host-bound pair this is the floor under any
    ratio of two servers: lease 21b's two DDTREE 128 servers differed by 11% with nothing else different."""
    table: dict = {}
    for name in SAME_CONFIG_SWEEPS:
        rows = _sweep_rows(name)
        for new, base in _copy_bases(name).items():
            for (setup, method, budget, bs), r in rows.items():
                twin = rows.get((base, method, budget, bs))
                if setup != new or twin is None:
                    continue
                label = f"{base}|{method if budget is None else f'{method}-{budget}'}|{bs}"
                entry = {"copy_over_original": round(r["decode_tokens_per_s"] / twin["decode_tokens_per_s"], 3)}
                runs = list(zip(r.get("decode_tokens_per_s_runs") or [], twin.get("decode_tokens_per_s_runs") or []))
                if len(runs) > 1:
                    entry["per_repeat"] = [round(a / b, 3) for a, b in runs]
                table.setdefault(name, {})[label] = entry
        if name not in table:
            raise ValueError(f"{name}: no copied setup with a twin row")
    out["sglang_same_config_servers"] = {name: dict(sorted(rows.items())) for name, rows in table.items()}


def _by_batch_size(by_setup: dict) -> dict:
    """{setup: {batch size: value}} with setups in name order and batch sizes in numeric order."""
    return {k: dict(sorted(v.items(), key=lambda kv: int(kv[0]))) for k, v in sorted(by_setup.items())}

def _paired_ratios(auto_row: dict, rival_rows: list[dict]) -> list[float] | None:
    """Per repeat i: auto's i-th run over the best rival's i-th run; None unless the sweep interleaved the repeats
    and every row has the same number of runs."""
    rows = [auto_row, *rival_rows]
    runs = [r.get("decode_tokens_per_s_runs") or [] for r in rows]
    if not rival_rows or not all(r.get("interleaved") for r in rows) or len({len(x) for x in runs}) != 1 \
            or not runs[0]:
        return None
    return [round(a / max(x[i] for x in runs[1:]), 3) for i, a in enumerate(runs[0])]


def pad_stages(out: dict) -> None:
    """Issue 10, stage graphs padded to SGLang's CUDA-graph batch sizes (SGLANG_DDTREE_PAD_STAGES) against one
    capture per batch size met, both in one interleaved tiny sweep (PAD_AB_SWEEPS: setup `tiny` padded,
    `tiny-nopad` not): tokens/s padded over unpadded per batch size for the 32-tree and `auto`, and the captures
    per server (stage_captures_lease16.json)."""
    ratios: dict = {}
    for name in PAD_AB_SWEEPS:
        rows = _sweep_rows(name)
        for (setup, method, budget, bs), r in rows.items():
            off = rows.get(("tiny-nopad", method, budget, bs))
            if setup != "tiny" or off is None:
                continue
            key = "auto" if method == "auto" else f"ddtree-{budget}"
            ratios.setdefault(key, {}).setdefault(str(bs), []).append(
                round(r["decode_tokens_per_s"] / off["decode_tokens_per_s"], 3))
    out["pad_stages_tokens_per_s_padded_over_unpadded_tiny"] = {
        k: dict(sorted(v.items(), key=lambda kv: int(kv[0]))) for k, v in sorted(ratios.items())}
    captures = _load("stage_captures_lease16.json")
    if captures is None:
        raise FileNotFoundError("stage_captures_lease16.json")
    out["pad_stages_captures_per_server_tiny"] = {run["sweep"]: run["captures"] for run in captures["runs"]}


# Issue 10's calibration table measured in the server: lease 21's tiny sweep (d481e4c, the current chooser). Each
# server's table learns from its start and is never reset during the sweep (/flush_cache keeps it since c916db4), so
# a row's error is that of a table warmed by every earlier row of its server. (Lease 20's sweep,
# sweep_auto_tiny_lease20.jsonl, had every table reset 2-12 times a row: 1.666 / 2.092 / 2.432 / 2.376 raw against
# 1.475 / 1.666 / 2.062 / 1.915 calibrated.)
# Since lease 23b the standing is the current code's (the table scores one sampled tree round in four; its table
# warms from the server's start as in lease 21): sweep_paired_tiny_lease23b.jsonl, and for batch 1 and 4 lease 24d's
# (445c2e8: every sampled tree round scored while the table is young, auto.CALIBRATION_YOUNG; at batch 16 / 64 23b's
# tables were past that, 2868 / 12224 scored request-rounds). A later sweep replaces an earlier one per (setup, batch
# size); each entry says which sweep it came from. Lease 25 (ebae9a7) measured every batch size again at that code:
# batch 1 calibrated worse than raw again (24d's was the one run with it ahead), 4-64 better. Lease 26 (7b26283,
# CALIBRATION_LEARN_ALL = 500 on): the same picture, batch 1 worse, 4-64 better. Lease 27 (d125f6a): calibrated
# better than raw at every batch size, batch 1 included (588 scored request-rounds). Lease 28 (fbba433, two `auto`
# servers of that code: `tiny`, `tiny-b`): batch 1 calibrated worse in one, better in the other; 4-64 better in both.
# Lease 29 (05312c8, `tiny` only: its `tiny-b` ran a0828ce, _other_commit): replaces lease 28's `tiny`.
SGLANG_CALIBRATION_SWEEPS = ("sweep_paired_tiny_lease23b.jsonl", "sweep_paired_tiny_lease24d.jsonl",
                             "sweep_paired_tiny_lease25.jsonl", "sweep_paired_tiny_lease26.jsonl",
                             "sweep_paired_tiny_lease27.jsonl", "sweep_paired_tiny_lease28.jsonl",
                             "sweep_paired_tiny_lease29.jsonl", "sweep_paired_tiny_lease30.jsonl")
# Batch-1 tables of several servers started together (lease_steps.sh tiny-starts): every `auto` server's MAE over
# its batch-1 rows, the young table's standing across server starts (not one draw).
SGLANG_STARTS_SWEEPS = ("sweep_starts_tiny_lease25.jsonl", "sweep_starts_tiny_lease25b.jsonl",
                        "sweep_starts_tiny_lease26.jsonl", "sweep_starts_tiny_lease27.jsonl")


def _auto_calibration(name: str):
    """(setup, batch size, row, {"raw", "calibrated", ["gated",] "request_rounds"}) of every `auto` row of a sweep
    that carries `auto_calibration` (Prometheus differences of its measured runs), in key order; "gated" where the
    server exported it (auto.CALIBRATION_GATE, after lease 26)."""
    rows = _sweep_rows(name)
    for (setup, method, _, bs), r in sorted(rows.items(), key=lambda kv: (*kv[0][:2], kv[0][2] or -1, kv[0][3])):
        cal = (r.get("ddtree_metrics") or {}).get("auto_calibration") if method == "auto" else None
        if cal:
            gated = {"gated": round(cal["tau_mae_gated"], 4)} if "tau_mae_gated" in cal else {}
            yield setup, bs, r, {"raw": round(cal["tau_mae_raw"], 4), "calibrated": round(cal["tau_mae_calibrated"], 4),
                                 **gated, "request_rounds": cal["scored_request_rounds"]}


def sglang_calibration(out: dict) -> None:
    """Mean absolute error per request-round of the predicted committed tokens in the `auto` server's sampled
    rounds, raw drafter scores against the calibration table (both predicted before the table learnt the round),
    per batch size: the rows' `auto_calibration` (Prometheus differences of the measured runs)."""
    table: dict = {}
    for name in SGLANG_CALIBRATION_SWEEPS:
        for setup, bs, row, entry in _auto_calibration(name):
            if _not_auto_as_it_is(row):
                continue
            table.setdefault(setup, {})[str(bs)] = {**entry, "source": name}
    if not table:
        raise FileNotFoundError(f"{SGLANG_CALIBRATION_SWEEPS}: no auto_calibration in their rows")
    out["sglang_tau_mae_raw_vs_calibrated"] = _by_batch_size(table)
    out["sglang_tau_mae_source"] = list(SGLANG_CALIBRATION_SWEEPS)
    servers = [{"sweep": name, "server": setup,
                "env": [e for e in r.get("server_env") or [] if "LOG_EVERY" not in e], **entry}
               for name in SGLANG_STARTS_SWEEPS for setup, bs, r, entry in _auto_calibration(name) if bs == 1]
    if not servers:
        raise FileNotFoundError(f"{SGLANG_STARTS_SWEEPS}: no auto_calibration at batch 1")
    out["sglang_tau_mae_bs1_per_server_start"] = servers
    out["sglang_tau_mae_bs1_servers_calibrated_worse"] = f"{sum(x['calibrated'] > x['raw'] for x in servers)} of " \
                                                         f"{len(servers)}"


def paired(out: dict) -> None:
    """PAIRED_SWEEPS: per sweep and batch size, each row's tokens/s over the base row's, the geometric mean of the
    per-round ratios with its 95% interval (lease 22, tiny pair: `tiny-b|ddtree-128` is a second DDTREE 128 server,
    the noise left; `tiny-b|auto` runs SGLANG_DDTREE_AUTO_FLOOR_FRESH=64)."""
    sys.path.insert(0, str(RESULTS.parents[1]))
    from sglang_ddtree.bench.paired import paired_table, pooled_ratios
    from sglang_ddtree.bench.results import latest_results, read_rows

    table = {}
    for name, base in PAIRED_SWEEPS.items():
        if not (RESULTS / name).exists():
            raise FileNotFoundError(name)
        rows = list(latest_results(read_rows(RESULTS / name)).values())
        table[name] = {"base": base,
                       "by_batch_size": {str(bs): ratios for bs, ratios in paired_table(rows, base).items()},
                       "all_batch_sizes": pooled_ratios(rows, base)}
    out["sglang_paired_ratios"] = table


def _ab_arm(env: list[str], implied: tuple = ()) -> str:
    """What an A/B server's `auto` arm ran, from its server_env (and AB_SETUP_NOTES' setup fields): "as it is",
    "forced=<candidate>", or its knobs; implied: NAME=VALUE knobs its commit defaulted to where the server_env does
    not set NAME (AB_IMPLIED_ENV)."""
    named = {e.split("=", 1)[0] for e in env}
    env = list(env) + [e for e in implied if e.split("=", 1)[0] not in named]
    knobs = [e for e in env if not e.startswith(("SGLANG_DDTREE_AUTO_LOG_EVERY=", "SGLANG_DDTREE_AUTO_AB="))
             and e not in CURRENT_DEFAULTS]
    forced = [e.split("=", 1)[1] for e in knobs if e.startswith("SGLANG_DDTREE_AUTO_FORCE=")]
    if forced:  # a held server's other knobs still change its own cost (lease 35's CALIBRATION_LEARN_ALL=0)
        others = sorted(k.removeprefix("SGLANG_DDTREE_") for k in knobs
                        if not k.startswith(("SGLANG_DDTREE_AUTO_FORCE=", _NO_EXPIRY.split("=")[0] + "=")))
        return ",".join([f"forced={forced[0]}"] + others)
    return ",".join(sorted(k.removeprefix("SGLANG_DDTREE_") for k in knobs)) or "as it is"


def sglang_auto_ab(out: dict) -> None:
    """AB_SWEEPS: each A/B server's `auto` arm over its own fixed 128-tree arm (bench/paired.py ab_table): over the
    whole row and run by run with a 95% interval, per batch size and pooled, with each arm's tau, GPU ms and host ms
    a round. The arms share the process, the moment and the text, so these intervals are the rounds' own spread, not
    the host's speed between servers (the cross-server ratios of the same sweep: sglang_paired_ratios).
    sglang_auto_ab_over_fixed_128_tiny: the arm that ran `auto` as it is, run by run, per batch size, the runs of
    every such server of AB_HEADLINE_SWEEPS (one chooser: leases 35-39) pooled (ab_pooled);
    sglang_auto_ab_own_host_ms_tiny: the same rows' `auto` arm's host ms a round less the fixed arm's, per host stage
    (ab_own_host_split); sglang_auto_ab_host_detail_ms_tiny: the same split over the AB_DETAIL_ARM servers of
    AB_DETAIL_SWEEPS, whose `auto` rounds marked their own host work apart (lease 39)."""
    sys.path.insert(0, str(RESULTS.parents[1]))
    from sglang_ddtree.bench.paired import ab_own_host_split, ab_pooled, ab_table, row_label
    from sglang_ddtree.bench.results import latest_results, read_rows

    table: dict = {}
    headline_rows: list = []
    headline_labels: set = set()
    headline_servers = 0  # labels repeat from sweep to sweep (lease 35's and 36's `tiny-e1` are two servers)
    detail_rows: list = []  # the AB_DETAIL_ARM servers' rows (sglang_auto_ab_host_detail_ms_tiny)
    detail_labels: set = set()
    for name in AB_SWEEPS:
        if not (RESULTS / name).exists():
            raise FileNotFoundError(name)
        rows = list(latest_results(read_rows(RESULTS / name)).values())
        envs = {row_label(r): r.get("server_env") or [] for r in rows if r.get("kind") == "result" and r.get("ab_runs")}
        as_it_is, detailed = [], []
        notes = AB_SETUP_NOTES.get(name, {})
        for label, t in ab_table(rows).items():
            arm = _ab_arm(envs.get(label, []) + notes.get(label.split("|")[0], []),
                          tuple(AB_IMPLIED_ENV.get(name, ())))
            table.setdefault(name, {})[label] = {
                "arm": arm, "by_batch_size": {str(bs): v for bs, v in t["by_batch_size"].items()},
                "all_batch_sizes": t["all_batch_sizes"]}
            if arm == "as it is" and label.startswith("tiny"):
                as_it_is.append(label)
            if arm == AB_DETAIL_ARM and label.startswith("tiny"):
                detailed.append(label)
        if name in AB_HEADLINE_SWEEPS and as_it_is:
            headline_rows += [r for r in rows if row_label(r) in as_it_is]
            headline_labels |= set(as_it_is)
            headline_servers += len(as_it_is)
        if detailed and name in AB_DETAIL_SWEEPS:
            detail_rows += [r for r in rows if row_label(r) in detailed]
            detail_labels |= set(detailed)
    pooled = ab_pooled(headline_rows, headline_labels) if headline_rows else None
    headline = {str(bs): v["ratio"] for bs, v in pooled["by_batch_size"].items() if v} if pooled else {}
    headline_source = (f"{' + '.join(AB_HEADLINE_SWEEPS)} (`auto` as it is: {headline_servers} servers, "
                       f"{' + '.join(sorted(headline_labels))} in each sweep that has them, runs pooled)")
    out["sglang_auto_ab"] = table
    out["sglang_auto_ab_over_fixed_128_tiny"] = headline
    out["sglang_auto_ab_over_fixed_128_tiny_source"] = headline_source if headline else None
    # where the same servers' `auto` arm spends host time beyond its fixed arm's, per host stage (lease 37)
    out["sglang_auto_ab_own_host_ms_tiny"] = (
        {str(bs): v for bs, v in ab_own_host_split(headline_rows, headline_labels).items()} if headline_rows else {})
    out["sglang_auto_ab_host_detail_ms_tiny"] = (
        {str(bs): v for bs, v in ab_own_host_split(detail_rows, detail_labels).items()} if detail_rows else {})


EXTRACTORS = [tree_stages, tiny_pair, offline, gpu_suite, sglang, round_graphs, budgets, tp2, hybrid, adaptive,
              sglang_auto, same_config_servers, pad_stages, sglang_hybrid, sglang_calibration, paired,
              sglang_auto_ab]


def build() -> dict:
    out: dict = {}
    missing = []
    for extract in EXTRACTORS:
        try:
            extract(out)
        except FileNotFoundError as e:
            missing.append(f"{extract.__name__}: {e}")
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
        return 0
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
