"""benchmarks/results/summary.json is generated from the committed raw result files and must not be stale."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _make_summary():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_summary", ROOT / "scripts" / "make_summary.py")
    ms = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ms)
    return ms




def test_summary_is_regenerated_from_raw_files():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_summary.py"), "--check"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr + "\n(run: python scripts/make_summary.py)"
    summary = json.loads((ROOT / "benchmarks" / "results" / "summary.json").read_text())
    assert summary["missing"] == [], summary["missing"]


def test_auto_ratios_flag_a_server_without_decode_graphs():
    """An auto ratio against a graphed rival while auto ran eager (the planner's graph-token cap, as in a
    committed 8B batch-64 row) is not like for like: the summary lists such rows."""
    ms = _make_summary()
    graphed = {"batch_size": 64, "server_args": ["--cuda-graph-bs-decode", "16", "64", "--x"]}
    assert ms._decode_graphs(graphed) and not ms._decode_graphs({**graphed, "batch_size": 32})
    assert not ms._decode_graphs({"batch_size": 64, "server_args": ["--disable-decode-cuda-graph"]})
    assert ms._decode_graphs({"batch_size": 64, "decode_graphs": True, "server_args": []})
    rows = ms._sweep_rows("sweep_auto_8b_bs64_2026-11-30_bb6232e.jsonl")  # committed: auto eager, DFLASH graphed
    assert not ms._decode_graphs(rows[("8b-dummy", "auto", None, 64)])
    assert ms._decode_graphs(rows[("8b-dummy", "dflash", None, 64)])
    summary = json.loads((ROOT / "benchmarks" / "results" / "summary.json").read_text())
    assert summary["sglang_auto_rows_without_decode_graphs"] == {}  # today's sources compare like with like


def test_a_copied_auto_setup_is_compared_with_its_base_setups_rivals(tmp_path):
    """An A/B of a worker switch (`--copy-setup tiny-dchain=tiny`, the copy holding only auto): its auto row's
    ratio is against the base setup's DFLASH and fixed-budget rows of the same run."""
    ms = _make_summary()

    def row(setup, method, budget, tps, runs):
        return {"kind": "result", "status": "ok", "setup": setup, "method": method, "budget": budget,
                "batch_size": 4, "decode_tokens_per_s": tps, "decode_graphs": True, "interleaved": True,
                "decode_tokens_per_s_runs": runs}

    lines = [{"kind": "run", "argv": ["--setups", "tiny,tiny-dchain", "--copy-setup", "tiny-dchain=tiny"]},
             row("tiny", "dflash", None, 1000.0, [1000.0, 800.0]), row("tiny", "ddtree", 128, 900.0, [900.0, 900.0]),
             row("tiny", "auto", None, 850.0, [850.0, 990.0]), row("tiny-dchain", "auto", None, 990.0, [990.0, 450.0])]
    (tmp_path / "ab.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = ms.sglang_auto([ms.source("ab.jsonl", tmp_path)])
    ratios = out["sglang_auto_vs_max_fixed_or_dflash_tokens_per_s"]
    assert ratios == {"tiny": {"4": 0.85}, "tiny-dchain": {"4": 0.99}}
    assert out["sglang_auto_rivals_measured"]["tiny-dchain"] == {"4": ["ddtree-128", "dflash"]}
    assert out["sglang_auto_rows_without_decode_graphs"] == {}
    # per repeat: run i over the best rival's run i (repeat 2: DDTREE 900 beats DFLASH's slow 800)
    assert out["sglang_auto_vs_max_per_repeat"] == {"tiny": {"4": [0.85, 1.1]}, "tiny-dchain": {"4": [0.99, 0.5]}}


def test_same_config_servers_compare_a_copy_with_its_original(tmp_path):
    """`--copy-setup tiny-b=tiny` with the same methods: each copied row over the original's row of the same method,
    budget and batch size, and per repeat; rows without a twin are left out, and a sweep without any twin fails."""
    import pytest

    ms = _make_summary()

    def row(setup, method, budget, tps, runs):
        return {"kind": "result", "status": "ok", "setup": setup, "method": method, "budget": budget,
                "batch_size": 1, "decode_tokens_per_s": tps, "decode_tokens_per_s_runs": runs}

    lines = [{"kind": "run", "argv": ["--setups", "tiny,tiny-b", "--copy-setup", "tiny-b=tiny"]},
             row("tiny", "ddtree", 128, 1000.0, [1000.0, 800.0]), row("tiny-b", "ddtree", 128, 900.0, [900.0, 880.0]),
             row("tiny", "auto", None, 700.0, [700.0, 700.0]), row("tiny-b", "dflash", None, 500.0, [500.0])]
    (tmp_path / "twins.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = ms.same_config_servers([ms.source("twins.jsonl", tmp_path)])
    assert out["sglang_same_config_servers"] == {
        "twins.jsonl": {"tiny|ddtree-128|1": {"copy_over_original": 0.9, "per_repeat": [0.9, 1.1]}}}
    (tmp_path / "lonely.jsonl").write_text("\n".join(json.dumps(x) for x in lines[:2]) + "\n")
    with pytest.raises(ValueError, match="lonely.jsonl: no copied setup"):
        ms.same_config_servers([ms.source("lonely.jsonl", tmp_path)])


def test_a_server_on_another_commits_package_is_recognised_from_its_environment():
    """A setup run on another commit's package, runs/bench/base-<commit> (PYTHONSAFEPATH=1, PYTHONPATH on it): that
    row is an A/B's base, not the code measured. Without PYTHONSAFEPATH the checkout comes first on sys.path, so
    such a row ran the checkout and counts."""
    ms = _make_summary()
    base = "PYTHONPATH=/tmp/site:/tmp/detached/tp/repo/runs/bench/base-a0828ce2367d"
    assert ms._other_commit({"server_env": ["SGLANG_DDTREE_AUTO_LOG_EVERY=100", "PYTHONSAFEPATH=1", base]}) \
        == "base-a0828ce2367d"
    assert ms._other_commit({"server_env": ["SGLANG_DDTREE_AUTO_LOG_EVERY=100", base]}) is None
    assert ms._other_commit({"server_env": ["PYTHONSAFEPATH=1", "PYTHONPATH=/tmp/site"]}) is None
    assert ms._other_commit({}) is None


def test_an_auto_server_held_on_one_candidate_is_left_out_of_the_headline():
    """A committed sweep's `tiny-b|auto` ran with SGLANG_DDTREE_AUTO_FORCE=chain (the lean chain round against DFLASH): a
    measurement of one candidate, not of `auto`'s choice. The committed headline takes `tiny` from that sweep and
    keeps `tiny-b` from the sweep before it."""
    ms = _make_summary()
    assert ms._forced({"server_env": ["SGLANG_DDTREE_AUTO_LOG_EVERY=100", "SGLANG_DDTREE_AUTO_FORCE=chain"]}) == "chain"
    assert ms._forced({"server_env": ["SGLANG_DDTREE_AUTO_LOG_EVERY=100"]}) is None
    assert ms._forced({}) is None
    summary = json.loads((ROOT / "benchmarks" / "results" / "summary.json").read_text())
    sources = summary["sglang_auto_sources"]
    assert sources["tiny"]["16"] == "sweep_paired_tiny_2026-12-01_ae3b0f3.jsonl"
    assert "sweep_paired_tiny_2026-12-01_ae3b0f3.jsonl" not in sources["tiny-b"].values()


def test_ab_servers_are_left_out_of_the_headline_and_named_by_their_arm():
    """An `auto` server with SGLANG_DDTREE_AUTO_AB alternates rounds with the fixed tree: its tokens/s mixes both arms,
    so the cross-server headline leaves it out, and sglang_auto_ab reports its arms instead, named by what the `auto`
    arm ran (a knob its commit defaulted to, the source's `implied_env`, named too unless the server set it). The committed
    summary's headline A/B entry is `auto` as it is in the `headline` sources, per batch size, every such server's runs
    pooled (between the servers' own ratios)."""
    ms = _make_summary()
    ab = ["SGLANG_DDTREE_AUTO_LOG_EVERY=100", "SGLANG_DDTREE_AUTO_AB=8"]
    assert ms._ab_server({"server_env": ab}) and ms._not_auto_as_it_is({"server_env": ab})
    assert not ms._ab_server({"server_env": ["SGLANG_DDTREE_AUTO_AB=0"]}) and not ms._ab_server({})
    assert ms._ab_arm(ab) == "as it is"
    assert ms._ab_arm(ab + ["SGLANG_DDTREE_AUTO_FORCE=128"]) == "forced=128"
    assert ms._ab_arm(ab + ["SGLANG_DDTREE_AUTO_SHRINK_Z=2"]) == "AUTO_SHRINK_Z=2"
    implied = ("SGLANG_DDTREE_AUTO_RELATIVE_TIMES=1",)
    assert ms._ab_arm(ab, implied) == "AUTO_RELATIVE_TIMES=1"
    assert ms._ab_arm(ab + ["SGLANG_DDTREE_AUTO_RELATIVE_TIMES=0"], implied) == "AUTO_RELATIVE_TIMES=0"
    # a knob set to what is the default now (CURRENT_DEFAULTS) is `auto` as it is; the default of the servers' own
    # commit, where it differed, names their arm (FORGET_START was 128, is 0)
    then = ("SGLANG_DDTREE_AUTO_FORGET_START=128",)
    assert ms._ab_arm(ab + ["SGLANG_DDTREE_AUTO_FORGET_START=0"], then) == "as it is"
    assert ms._ab_arm(ab, then) == "AUTO_FORGET_START=128"
    # servers whose commit had no expiry of old times (TIMES_EXPIRE 256 now); a held server's other knobs
    # name its arm too (they change its own cost), the expiry not (a held server makes no choice)
    before = ("SGLANG_DDTREE_AUTO_TIMES_EXPIRE=0",)
    assert ms._ab_arm(ab, before) == "AUTO_TIMES_EXPIRE=0"
    assert ms._ab_arm(ab + ["SGLANG_DDTREE_AUTO_TIMES_EXPIRE=256"], before) == "as it is"
    assert ms._ab_arm(ab + ["SGLANG_DDTREE_AUTO_FORCE=128"], before) == "forced=128"
    assert ms._ab_arm(ab + ["SGLANG_DDTREE_AUTO_FORCE=128", "SGLANG_DDTREE_AUTO_CALIBRATION_LEARN_ALL=0"],
                      before) == "forced=128,AUTO_CALIBRATION_LEARN_ALL=0"
    assert ms._not_auto_as_it_is({"server_env": ["SGLANG_DDTREE_AUTO_TIMES_EXPIRE=0"]})
    summary = json.loads((ROOT / "benchmarks" / "results" / "summary.json").read_text())
    # the headline pools `auto` as it is over the `headline` sources (one chooser's files)
    headline_sweeps = ms.figure_sources("sglang_auto_ab", headline=True)
    assert set(headline_sweeps) < set(ms.figure_sources("sglang_auto_ab"))
    servers = {(name, label) for name in headline_sweeps
               for label, entry in summary["sglang_auto_ab"][name].items() if entry["arm"] == "as it is"}
    labels = sorted({label for _, label in servers})
    # the `e` servers of each headline sweep (tiny-e1..e12 at most); the `w` servers (a longer warm-up,
    # setup_notes), held `f` servers, `s` servers (SWITCH_UNTIMED, SAMPLE_EVERY=8) and `d` servers (HOST_DETAIL) are
    # named by their arm and left out
    assert len(servers) == 42 and labels == sorted(f"tiny-e{i}|auto" for i in range(1, 13))
    assert summary["sglang_auto_ab"]["sweep_ab_tiny_run1_2026-12-02_c8f6ae0.jsonl"]["tiny-w1|auto"]["arm"] == "warmup_new_tokens=640"
    assert summary["sglang_auto_ab"]["sweep_ab_tiny_run2_2026-12-02_80c380a.jsonl"]["tiny-s5|auto"]["arm"] == "AUTO_SWITCH_UNTIMED=1"
    assert summary["sglang_auto_ab"]["sweep_ab_tiny_run3_2026-12-02_468f487.jsonl"]["tiny-s8|auto"]["arm"] == "AUTO_SAMPLE_EVERY=8"
    assert summary["sglang_auto_ab"]["sweep_ab_tiny_run2_2026-12-02_468f487.jsonl"]["tiny-d3|auto"]["arm"] == ms.AB_DETAIL_ARM
    assert summary["sglang_auto_ab_over_fixed_128_tiny_source"] == (
        f"{' + '.join(headline_sweeps)} (`auto` as it is: 42 servers, {' + '.join(labels)} in each sweep "
        f"that has them, runs pooled)")
    headline = summary["sglang_auto_ab_over_fixed_128_tiny"]
    assert sorted(headline) == ["1", "16", "4", "64"]
    for bs, ratio in headline.items():
        own = sorted(summary["sglang_auto_ab"][name][label]["by_batch_size"][bs]["runs"]["ratio"]
                     for name, label in servers if bs in summary["sglang_auto_ab"][name][label]["by_batch_size"])
        assert len(own) >= 3 and own[0] - 1e-3 <= ratio <= own[-1] + 1e-3
    # the same servers' own host time over their fixed arms, by stage: one row per server and batch size
    own = summary["sglang_auto_ab_own_host_ms_tiny"]
    assert sorted(own) == ["1", "16", "4", "64"] and all(d["rows"] == len(servers) for d in own.values())
    assert all("choose" in d["stages"] for d in own.values())
    # the as-it-is servers mark no detail; the two HOST_DETAIL servers of the `detail` source (the bookkeeping as it
    # is; earlier HOST_DETAIL servers ran the code before aa3bbae) split `choose` and `after`
    from sglang_ddtree.stages import AUTO_HOST_DETAIL

    assert not any(name in d["stages"] for d in own.values() for name in AUTO_HOST_DETAIL)
    detail = summary["sglang_auto_ab_host_detail_ms_tiny"]
    assert sorted(detail) == ["1", "16", "4", "64"] and all(d["rows"] == 2 for d in detail.values())
    assert all(set(AUTO_HOST_DETAIL) - {"after_learn"} <= set(d["stages"]) for d in detail.values())
    # no A/B server's own tokens/s reaches the cross-server headline's sources
    assert not set(ms.figure_sources("sglang_auto_ab")) & set(ms.figure_sources("sglang_auto"))


def test_a_figure_is_one_table_row_and_a_generic_sweep_reader(tmp_path):
    """A new headline figure from a sweep is one [[figure]] row with the `sweep_table` reader: tokens/s and tau per
    method and batch size, ratios over `base`; a row whose source is missing is listed under `missing`."""
    ms = _make_summary()

    def row(method, budget, bs, tps, tau):
        return {"kind": "result", "status": "ok", "setup": "8b-real", "method": method, "budget": budget,
                "batch_size": bs, "decode_tokens_per_s": tps, "tau": tau}

    lines = [row("dflash", None, 1, 100.0, 3.0), row("ddtree", 32, 1, 120.0, 4.0), row("dflash", None, 16, 800.0, 3.0),
             row("ddtree", 32, 16, 760.0, 4.0), {**row("plain", None, 1, 50.0, None), "setup": "tiny"}]
    (tmp_path / "sweep_real8b.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    table = [{"name": "real8b", "reader": "sweep_table", "setup": "8b-real", "base": "dflash",
              "sources": ["sweep_real8b.jsonl"]},
             {"name": "gone", "reader": "offline", "sources": ["nowhere.json"]}]
    out = ms.build(table, results=tmp_path)
    assert out["real8b_tokens_per_s"] == {"ddtree-32": {"1": 120.0, "16": 760.0}, "dflash": {"1": 100.0, "16": 800.0}}
    assert out["real8b_over_dflash"] == {"ddtree-32": {"1": 1.2, "16": 0.95}}
    assert out["real8b_tau"]["ddtree-32"] == {"1": 4.0, "16": 4.0}
    assert out["real8b_source"] == ["sweep_real8b.jsonl"]
    assert out["missing"] == ["gone: nowhere.json"]


def test_real_size_auto_from_several_runs_merges_per_batch_size(tmp_path):
    """`auto` at real size may come from one run per group of batch sizes (role `auto` more than once): each batch
    size's ratio is over the best rival of its own run, and a later source's batch size replaces an earlier one's."""
    ms = _make_summary()

    def row(method, budget, bs, tps):
        return {"kind": "result", "status": "ok", "setup": "8b-real", "method": method, "budget": budget,
                "batch_size": bs, "decode_tokens_per_s": tps, "tau": 3.0, "step_ms": 5.0,
                "decode_tokens_per_s_runs": [tps, tps]}

    def write(name, rows):
        (tmp_path / name).write_text("\n".join(json.dumps(x) for x in rows) + "\n")

    write("sweep.jsonl", [row("dflash", None, 1, 100.0), row("ddtree", 16, 1, 110.0)])
    write("small.jsonl", [row("dflash", None, 1, 100.0), row("ddtree", 64, 1, 125.0), row("auto", None, 1, 120.0),
                          row("dflash", None, 16, 500.0), row("ddtree", 16, 16, 400.0), row("auto", None, 16, 450.0)])
    write("large.jsonl", [row("dflash", None, 16, 800.0), row("ddtree", 16, 16, 700.0), row("auto", None, 16, 792.0),
                          row("dflash", None, 64, 2000.0), row("ddtree", 16, 64, 1000.0),
                          row("auto", None, 64, 1900.0)])
    table = [{"name": "real8b", "reader": "real8b", "setups": {"triton": "8b-real"},
              "sources": [{"file": "sweep.jsonl", "role": "sweep"}, {"file": "small.jsonl", "role": "auto"},
                          {"file": "large.jsonl", "role": "auto"}]}]
    out = ms.build(table, results=tmp_path)
    assert out["real8b_auto_over_best"] == {"1": 0.96, "16": 0.99, "64": 0.95}
    assert list(out["real8b_auto_over_best_run_range"]) == ["1", "16", "64"]


def test_hybrid_real_reads_the_best_budget_per_batch_size_and_lossless_only_when_measured(tmp_path):
    """The real-shape hybrid figure: tokens/s and tau by batch size and method, the best DDTREE budget over DFLASH
    per batch size, and the lossless / oracle keys only from a lossless source, read for its own pair."""
    ms = _make_summary()

    def row(method, budget, bs, tps):
        return {"kind": "result", "status": "ok", "run_id": "r1", "setup": "27b-hybrid", "method": method,
                "budget": budget, "batch_size": bs, "decode_tokens_per_s": tps, "tau": 5.0,
                "stage_ms": {"verify": 20.0, "draft": 2.0}}

    run = {"kind": "run", "run_id": "r1", "gpu": "GPU X", "options": {"repeats": 3}}
    rows = [run, row("dflash", None, 1, 100.0), row("ddtree", 16, 1, 110.0), row("ddtree", 64, 1, 90.0),
            row("dflash", None, 4, 300.0), row("ddtree", 16, 4, 270.0), {**row("dflash", None, 1, 1.0), "setup": "x"}]
    (tmp_path / "sweep.jsonl").write_text("\n".join(json.dumps(x) for x in rows) + "\n")
    table = [{"name": "hybrid_real", "reader": "hybrid_real", "sources": [{"file": "sweep.jsonl", "role": "sweep"}]}]
    out = ms.build(table, results=tmp_path)
    assert out["hybrid_real_ddtree_best_over_dflash"] == {"1": 1.1, "4": 0.9}
    assert out["hybrid_real_tokens_per_s"]["1"] == {"ddtree-16": 110.0, "ddtree-64": 90.0, "dflash": 100.0}
    assert out["hybrid_real_source"] == {"file": "sweep.jsonl", "gpu": ["GPU X"], "repeats": [3]}
    assert not any("lossless" in k or "oracle" in k for k in out)
    greedy = {"kind": "real8b_greedy", "config": "ddtree-16/bs1", "exact": 15, "prompts": 16, "max_gap": 0.03,
              "failures": []}
    records = [{**greedy, "pair": "27b-hybrid"}, {**greedy, "pair": "tiny-hybrid", "failures": ["x"]},
               {"kind": "real8b_oracle", "pair": "27b-hybrid", "config": "ddtree-16-oracle", "differ": 1,
                "checked": 300}]
    (tmp_path / "suite.json").write_text(json.dumps({"records": records}))
    table[0]["sources"].append({"file": "suite.json", "role": "lossless"})
    out = ms.build(table, results=tmp_path)
    assert out["hybrid_real_lossless_up_to_ties"] is True  # the tiny pair's failing record is not read
    assert out["hybrid_real_oracle_disagreements"] == {"ddtree-16-oracle": [1, 300]}
    records[0]["failures"] = [{"prompt": 3}]
    (tmp_path / "suite.json").write_text(json.dumps({"records": records}))
    assert ms.build(table, results=tmp_path)["hybrid_real_lossless_up_to_ties"] is False


def test_every_committed_result_file_is_cited_by_the_results_readme():
    """benchmarks/results/README.md has one row per kept file or folder (results of record only)."""
    results = ROOT / "benchmarks" / "results"
    readme = (results / "README.md").read_text()
    kept = sorted(p.name for p in results.iterdir() if p.name != "README.md")
    assert [name for name in kept if f"`{name}" not in readme] == []


def test_gpu_projection_reproduces_the_h200_fit_and_the_committed_projection():
    """scripts/project_gpu.py with the H200's own bandwidth and compute gives back the cost model's projection
    (best_budget_projected.json), and the committed RTX PRO 6000 projection is what the script writes from its
    inputs."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("project_gpu", ROOT / "scripts" / "project_gpu.py")
    pg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pg)
    results = ROOT / "benchmarks" / "results"
    base = json.loads((results / "best_budget_projected.json").read_text())
    assert base["projected"] is True
    same = pg.project(dict(base), dict(pg.H200))
    for b, row in base["by_batch"].items():
        assert same["by_batch"][b]["best_budget"] == row["best_budget"]
        assert abs(same["by_batch"][b]["tokens_per_s"] - row["projected_tokens_per_s"]) < 0.1
        assert abs(same["by_batch"][b]["dflash_tokens_per_s"] - row["dflash_tokens_per_s_projected"]) < 0.1
    (committed,) = results.glob("projection_rtx_pro_6000_*.json")
    data = json.loads(committed.read_text())
    base["_path"] = "best_budget_projected.json"
    assert pg.project(base, data["gpu"]) == data
    # the measured best budgets carry no fit: the script refuses them instead of projecting nothing
    assert pg.main(["--fit", str(results / "best_budget.json"), "--name", "x", "--bandwidth-gbs", "1",
                    "--bf16-tflops", "1"]) == 2


def test_committed_best_budget_is_measured_from_the_real_size_sweep():
    """best_budget.json is what ddtree_bench.best_budget writes from the real-size sweep it names, and its choices
    and ratios are the summary's real-size figures (scripts/make_summary.py reads the same rows)."""
    from ddtree_bench import best_budget as bb

    committed = json.loads((ROOT / "benchmarks" / "results" / "best_budget.json").read_text())
    assert committed["projected"] is False
    regenerated = json.loads(json.dumps(bb.build(ROOT / committed["sweep"], committed["setup"])))
    assert regenerated.pop("sweep") == str(ROOT / committed["sweep"])
    assert regenerated == {k: v for k, v in committed.items() if k != "sweep"}
    summary = json.loads((ROOT / "benchmarks" / "results" / "summary.json").read_text())
    assert summary["best_budget_by_batch_is_projected"] is False
    assert summary["best_budget_by_batch"] == summary["real8b_best_budget"]
    for b, row in committed["by_batch"].items():
        assert row["over_dflash"] == summary["real8b_ddtree_best_over_dflash"][b]
        assert row["over_dflash_run_range"] == summary["real8b_ddtree_best_over_dflash_run_range"][b]
        # (`auto`'s figure of record is the later sweep that measured it in one wave with DFLASH and the fixed
        # budgets: summary real8b_auto_over_best; this file keeps the benchmark sweep's own, another wave's)


def test_long_context_keys_rows_by_prompt_tokens_and_pairs_rounds_within_one_file(tmp_path):
    """The long-context figure: tokens/s and tau by context (a row's prompt_tokens), batch size and method, whatever
    setup a row came from (short-prompt rows left out), and DDTREE's round over DFLASH's only where both ran in one
    file, with the range of their repeat-by-repeat ratios."""
    ms = _make_summary()

    def row(setup, method, budget, ctx, bs, tps, step, kind="long"):
        return {"kind": "result", "status": "ok", "setup": setup, "method": method, "budget": budget,
                "batch_size": bs, "prompt_kind": kind, "prompt_tokens": ctx, "decode_tokens_per_s": tps,
                "tau": 1.5, "step_ms": step, "step_ms_runs": [step, step * 1.1]}

    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(x) for x in [
        row("real-8k", "dflash", None, 8192, 1, 40.0, 20.0), row("real-8k-va", "ddtree", 15, 8192, 1, 70.0, 10.0),
        row("8b-real", "dflash", None, 330, 1, 500.0, 5.0, kind="humaneval")]) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps(row("plain-32k", "plain", None, 32768, 4, 90.0, 30.0)) + "\n")
    out = ms.build([{"name": "long_context", "reader": "long_context", "sources": ["a.jsonl", "b.jsonl"]}],
                   results=tmp_path)
    assert out["real8b_long_context"] == {"8192": {"1": {"dflash": 40.0, "ddtree-15": 70.0}},
                                          "32768": {"4": {"plain": 90.0}}}
    rounds = out["real8b_long_context_round_over_dflash"]
    assert list(rounds) == ["8192"] and rounds["8192"]["1"]["ratio"] == 0.5
    assert rounds["8192"]["1"]["range"] == [0.5, 0.5] and rounds["8192"]["1"]["budget"] == 15


def test_long_context_acceptance_says_whether_the_pairs_long_context_tau_means_anything(tmp_path):
    """The offline study's taus with the whole long prompt and on its tail alone: meaningful only where every
    method keeps `keep` of its tail tau at every length; the NLL deltas come from the longest prompts' bins; a file
    without decode groups is refused."""
    ms = _make_summary()

    def study(long_tau, path):
        group = {part: {"taus": {"dflash": {"tau": t}, "ddtree_b16": {"tau": t * 1.2}}}
                 for part, t in (("long", long_tau), ("tail", 3.0), ("head", 4.0))}
        bins = {"2048": {"bins": [{"lo": 0, "hi": 512, "delta": 0.0}, {"lo": 1024, "hi": 2048, "delta": 0.1}]},
                "8192": {"bins": [{"lo": 0, "hi": 512, "delta": 0.0}, {"lo": 4096, "hi": 8192, "delta": 0.9}]}}
        path.write_text(json.dumps({"decode_groups": {"8192": group, "2048": group}, "nll_pooled": bins,
                                    "lossless_all": True}))

    def read(name):
        return ms.build([{"name": "lca", "reader": "long_context_acceptance", "sources": [name]}], results=tmp_path)

    study(2.7, tmp_path / "good.json")
    study(1.2, tmp_path / "broken.json")
    good, broken = read("good.json"), read("broken.json")
    assert good["real8b_long_context_acceptance_meaningful"] is True
    assert broken["real8b_long_context_acceptance_meaningful"] is False
    assert list(broken["tiny_long_context_tau"]) == ["2048", "8192"]
    assert broken["tiny_long_context_tau"]["8192"]["dflash"] == {"long": 1.2, "tail": 3.0}
    assert broken["tiny_long_context_nll_delta"] == {"0-512": 0.0, "4096-8192": 0.9}
    (tmp_path / "empty.json").write_text(json.dumps({"decode_groups": {}, "nll_pooled": {}, "lossless_all": True}))
    with pytest.raises(ValueError, match="no decode groups"):
        read("empty.json")

def _gpu_suite_file(path, records):
    """A gpu_suite.json as scripts/device/run_gpu_suite.py writes it for one device call: the report's keys, its
    records those of tests/gpu/conftest.py's record() (kind, time, the test's fields), server starts apart."""
    report = {"tests_requested": ["tests/gpu/x.py"], "out": "/tmp/out", "env": {"gpu": "GPU X"}, "site": {},
              "site_check": {}, "jit_cache": {"restore": {}}, "pytest_exit_code": 0, "pytest_timed_out": False,
              "leftover_servers_killed": [], "bench": [], "counts": {"passed": 1, "failed": 0, "skipped": 0,
                                                                     "errors": 0},
              "tests": [], "server_starts": [{"kind": "server_start", "time": 1.0, "name": "plain", "ok": True}],
              "records": [{"kind": kind, "time": 2.0 + i, **fields} for i, (kind, fields) in enumerate(records)],
              "moved_to_logs": [], "ok": True, "phases_s": {"install": 1.0, "suite": 2.0}}
    path.write_text(json.dumps(report, indent=1) + "\n")


def _tie(prompt, gap):
    """A first difference as serving_common.compare() records it."""
    return {"prompt": prompt, "position": 7, "plain": 11, "candidate": 12, "logprob_gap": gap}


def test_pressure_reads_retraction_records_and_refuses_a_file_without_them(tmp_path):
    """tests/gpu/test_pressure.py's records, by a table row naming the `pressure` reader: lossless under retraction
    only while no pressure_greedy record has a failure; exact / ties / requests and the retractions per config (summed
    where a config ran twice), the largest gap at a first difference, the KV left over idle after the load and the
    full-context request; a suite file without pressure records is an error, not a figure."""
    import pytest

    ms = _make_summary()

    def greedy(config, exact, ties, failures, retracted):
        return ("pressure_greedy", {"config": config, "requests": 16, "new_tokens": 256, "exact": exact, "ties": ties,
                                    "failures": failures, "retracted_reqs": retracted, "pool_tokens": None})

    records = [("model_pair", {"mode": "tiny", "target": "t", "drafter": "d", "tiny_missing": None}),
               greedy("ddtree-pressure", 15, [_tie(3, 0.0625)], [], 9),
               greedy("ddtree-retract", 16, [], [], 40),
               greedy("dflash-retract", 14, [_tie(1, 0.125), _tie(5, 0.25)], [], 38),
               ("pressure_kv_leak", {"config": "ddtree-pressure", "idle_tokens": 0, "after_run": [0, 0],
                                     "after_load_tokens": 0, "after_load_reqs": 0, "kinds": {"aborted": 20},
                                     "retracted_reqs": 12}),
               ("pressure_kv_leak", {"config": "ddtree-retract", "idle_tokens": 64, "after_run": [64, 0],
                                     "after_load_tokens": 320, "after_load_reqs": 0, "kinds": {"aborted": 20},
                                     "retracted_reqs": 50}),
               ("pressure_full_context", {"config": "ddtree-pressure", "prompt_tokens": 30, "new_tokens": 994,
                                          "completion_tokens": 994, "exact": 1, "ties": [], "failures": []}),
               ("pressure_full_context", {"config": "dflash-retract", "prompt_tokens": 30, "new_tokens": 994,
                                          "completion_tokens": 990, "exact": 0, "ties": [], "failures": []})]
    _gpu_suite_file(tmp_path / "suite.json", records)
    table = [{"name": "pressure", "reader": "pressure", "sources": ["suite.json"]}]
    out = ms.build(table, results=tmp_path)
    assert out["retraction_lossless_up_to_ties"] is True
    assert out["retraction_exact_ties_requests"] == {"ddtree-pressure": [15, 1, 16], "ddtree-retract": [16, 0, 16],
                                                     "dflash-retract": [14, 2, 16]}
    assert out["retractions_observed"] == {"ddtree-pressure": 9, "ddtree-retract": 40, "dflash-retract": 38}
    assert out["retraction_max_gap_nats"] == 0.25
    assert out["pressure_kv_leak_tokens"] == {"ddtree-pressure": 0, "ddtree-retract": 256}
    assert out["pressure_full_context_up_to_ties"] == {"ddtree-pressure": True, "dflash-retract": False}
    assert out["pressure_model_pair"] == ["tiny"] and out["pressure_source"] == ["suite.json"]
    assert out["missing"] == []
    # a second run of one config, with a difference plain's log-probs do not call a tie: not lossless; counts add up
    _gpu_suite_file(tmp_path / "again.json", [greedy("ddtree-retract", 15, [], [_tie(2, 1.5)], 7)])
    table[0]["sources"].append("again.json")
    out = ms.build(table, results=tmp_path)
    assert out["retraction_lossless_up_to_ties"] is False
    assert out["retraction_exact_ties_requests"]["ddtree-retract"] == [31, 0, 32]
    assert out["retractions_observed"]["ddtree-retract"] == 47 and out["retraction_max_gap_nats"] == 1.5
    # a failure of lengths (a string) fails the figure too, and has no gap
    _gpu_suite_file(tmp_path / "short.json", [greedy("ddtree-pressure", 15, [], ["prompt 4: lengths differ"], 3)])
    out = ms.pressure([ms.source("short.json", tmp_path)])
    assert out["retraction_lossless_up_to_ties"] is False and out["retraction_max_gap_nats"] == 0.0
    # leak and full-context keys only where those tests recorded
    assert "pressure_kv_leak_tokens" not in out and "pressure_full_context_up_to_ties" not in out
    for name, recs in (("other.json", records[:1]), ("empty.json", [])):
        _gpu_suite_file(tmp_path / name, recs)
        with pytest.raises(ValueError, match=f"{name}: no pressure_greedy records"):
            ms.pressure([ms.source(name, tmp_path)])


def test_long_context_lossless_reads_prompt_sets_from_one_file_or_several(tmp_path):
    """tests/gpu/test_real8b.py's records of the 8B pair with long or shared-prefix prompts (DDTREE_GPU_PROMPTS):
    lossless, the largest gap and exact / ties / prompts per prompt set and run, the shared prefix's own figure and
    its radix-cache hit rate, the KV leak; HumanEval records and other pairs' are not read. The same records in one
    file or split over two give the same figures; a run with a failure or whose judging raised is not lossless; no
    long or shared record is an error."""
    import pytest

    ms = _make_summary()

    def greedy(prompt_set, config, exact, ties, failures, max_gap, pair="8b-real", hit=None):
        fields = {"pair": pair, "config": config, "backend": "triton", "prompt_set": prompt_set, "prompts": 16,
                  "new_tokens": 128, "exact": exact, "ties": ties, "failures": failures, "max_gap": max_gap,
                  "tau": 3.0, "tie_nats": 0.125, "ok": not failures,
                  "cache": {"prompt_tokens": 1000, "cached_tokens": 0, "hit_rate": hit if hit is not None else 0.0},
                  "plain_cache": {"prompt_tokens": 1000, "cached_tokens": 0, "hit_rate": 0.5 if hit else 0.0}}
        return ("real8b_greedy", fields)

    def leak(prompt_set, leaked):
        return ("real8b_kv_leak", {"pair": "8b-real", "config": "ddtree-64", "prompt_set": prompt_set,
                                   "idle_tokens": 0, "idle_reqs": 0, "after_tokens": leaked, "after_reqs": 0,
                                   "kinds": {"aborted": 30}, "alive": True, "leaked": leaked, "ok": leaked == 0})

    long_recs = [("model_pair", {"mode": "8b-real"}),
                 greedy("long:8192", "ddtree-64/bs1", 14, [_tie(2, 0.0625)], [], 0.0625),
                 greedy("long:8192", "ddtree-64/bs4", 13, [_tie(2, 0.0625), _tie(9, 0.125)], [], 0.125),
                 greedy("long:2048", "ddtree-64/bs1", 16, [], [], 0.0),
                 greedy("humaneval", "ddtree-64/bs1", 0, [], [_tie(1, 3.0)], 3.0),  # not a long prompt set
                 greedy("long:8192", "ddtree-16/bs1", 0, [], [_tie(1, 3.0)], 3.0, pair="tiny-hybrid"),
                 leak("long:8192", 0)]
    shared_recs = [greedy("shared:8192", "ddtree-64/bs1", 15, [_tie(0, 0.03125)], [], 0.03125, hit=0.9),
                   greedy("shared:8192", "ddtree-64/bs4", 16, [], [], 0.0, hit=0.95), leak("shared:8192", 0)]
    _gpu_suite_file(tmp_path / "long.json", long_recs)
    _gpu_suite_file(tmp_path / "shared.json", shared_recs)
    _gpu_suite_file(tmp_path / "both.json", long_recs + shared_recs)
    two = ms.build([{"name": "lc", "reader": "long_context_lossless", "sources": ["long.json", "shared.json"]}],
                   results=tmp_path)
    one = ms.long_context_lossless([ms.source("both.json", tmp_path)])
    assert two.pop("missing") == []
    assert two.pop("real8b_long_context_lossless_source") == ["long.json", "shared.json"]
    assert one.pop("real8b_long_context_lossless_source") == ["both.json"]
    assert one == two
    assert list(one["real8b_long_context_lossless_up_to_ties"]) == ["long:2048", "long:8192", "shared:8192"]
    assert all(one["real8b_long_context_lossless_up_to_ties"].values())
    assert one["real8b_long_context_max_gap_nats"] == {"long:2048": 0.0, "long:8192": 0.125, "shared:8192": 0.03125}
    assert one["real8b_long_context_exact_ties_prompts"] == {
        "long:2048": {"ddtree-64/bs1": [16, 0, 16]},
        "long:8192": {"ddtree-64/bs1": [14, 1, 16], "ddtree-64/bs4": [13, 2, 16]},
        "shared:8192": {"ddtree-64/bs1": [15, 1, 16], "ddtree-64/bs4": [16, 0, 16]}}
    assert one["prefix_sharing_lossless_up_to_ties"] is True
    assert one["prefix_sharing_cache_hit_rate"] == {"shared:8192": {"ddtree-64/bs1": 0.9, "ddtree-64/bs4": 0.95,
                                                                    "plain": 0.5}}
    assert one["real8b_long_context_kv_leak_tokens"] == {"long:8192": 0, "shared:8192": 0}
    # long prompts alone: no shared-prefix figure
    alone = ms.long_context_lossless([ms.source("long.json", tmp_path)])
    assert not any(k.startswith("prefix_sharing") for k in alone)
    # a shared-prefix run with a difference that is no tie fails its prompt set and the shared figure
    _gpu_suite_file(tmp_path / "bad.json", shared_recs + [greedy("shared:8192", "ddtree-15/bs4", 15, [],
                                                                  [_tie(4, 0.5)], 0.5)])
    bad = ms.long_context_lossless([ms.source("long.json", tmp_path), ms.source("bad.json", tmp_path)])
    assert bad["prefix_sharing_lossless_up_to_ties"] is False
    assert bad["real8b_long_context_lossless_up_to_ties"] == {"long:2048": True, "long:8192": True,
                                                              "shared:8192": False}
    assert bad["real8b_long_context_max_gap_nats"]["shared:8192"] == 0.5
    # a run whose judging raised (test_real8b.py's _judged: ok False, the error, no counts) is not lossless either
    raised = ("real8b_greedy", {"pair": "8b-real", "config": "ddtree-64/bs1", "backend": "triton",
                                "prompt_set": "long:2048", "ok": False, "error": "KeyError: 'output_ids'"})
    failed_leak = ("real8b_kv_leak", {"pair": "8b-real", "config": "ddtree-64", "prompt_set": "long:8192", "ok": False,
                                      "error": "TimeoutError"})
    _gpu_suite_file(tmp_path / "raised.json", long_recs + [raised, failed_leak])
    got = ms.long_context_lossless([ms.source("raised.json", tmp_path)])
    assert got["real8b_long_context_lossless_up_to_ties"] == {"long:2048": False, "long:8192": True}
    assert got["real8b_long_context_exact_ties_prompts"]["long:2048"] == {"ddtree-64/bs1": [16, 0, 16]}
    assert got["real8b_long_context_kv_leak_tokens"] == {"long:8192": None}
    # HumanEval and other pairs' records only: no figure
    _gpu_suite_file(tmp_path / "short.json", long_recs[:1] + long_recs[4:6])
    with pytest.raises(ValueError, match="short.json: no real8b_greedy records of pair 8b-real"):
        ms.long_context_lossless([ms.source("short.json", tmp_path)])
