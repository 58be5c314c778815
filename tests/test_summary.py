"""benchmarks/results/summary.json is generated from the committed raw result files and must not be stale."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_summary_is_regenerated_from_raw_files():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_summary.py"), "--check"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr + "\n(run: python scripts/make_summary.py)"
    summary = json.loads((ROOT / "benchmarks" / "results" / "summary.json").read_text())
    assert summary["missing"] == [], summary["missing"]


def test_auto_ratios_flag_a_server_without_decode_graphs():
    """An auto ratio against a graphed rival while auto ran eager (the planner's graph-token cap, lease 13's 8B
    batch-64 row) is not like for like: the summary lists such rows."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_summary", ROOT / "scripts" / "make_summary.py")
    ms = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ms)
    graphed = {"batch_size": 64, "server_args": ["--cuda-graph-bs-decode", "16", "64", "--x"]}
    assert ms._decode_graphs(graphed) and not ms._decode_graphs({**graphed, "batch_size": 32})
    assert not ms._decode_graphs({"batch_size": 64, "server_args": ["--disable-decode-cuda-graph"]})
    assert ms._decode_graphs({"batch_size": 64, "decode_graphs": True, "server_args": []})
    rows = ms._sweep_rows("sweep_auto_8b_lease13_bs64.jsonl")  # committed: auto eager, DFLASH graphed
    assert not ms._decode_graphs(rows[("8b-dummy", "auto", None, 64)])
    assert ms._decode_graphs(rows[("8b-dummy", "dflash", None, 64)])
    summary = json.loads((ROOT / "benchmarks" / "results" / "summary.json").read_text())
    assert summary["sglang_auto_rows_without_decode_graphs"] == {}  # today's sources compare like with like


def test_a_copied_auto_setup_is_compared_with_its_base_setups_rivals(tmp_path, monkeypatch):
    """An A/B of a worker switch (`--copy-setup tiny-dchain=tiny`, the copy holding only auto): its auto row's
    ratio is against the base setup's DFLASH and fixed-budget rows of the same run."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_summary", ROOT / "scripts" / "make_summary.py")
    ms = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ms)

    def row(setup, method, budget, tps, runs):
        return {"kind": "result", "status": "ok", "setup": setup, "method": method, "budget": budget,
                "batch_size": 4, "decode_tokens_per_s": tps, "decode_graphs": True, "interleaved": True,
                "decode_tokens_per_s_runs": runs}

    lines = [{"kind": "run", "argv": ["--setups", "tiny,tiny-dchain", "--copy-setup", "tiny-dchain=tiny"]},
             row("tiny", "dflash", None, 1000.0, [1000.0, 800.0]), row("tiny", "ddtree", 128, 900.0, [900.0, 900.0]),
             row("tiny", "auto", None, 850.0, [850.0, 990.0]), row("tiny-dchain", "auto", None, 990.0, [990.0, 450.0])]
    (tmp_path / "ab.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    monkeypatch.setattr(ms, "RESULTS", tmp_path)
    monkeypatch.setattr(ms, "SGLANG_AUTO_SWEEPS", ("ab.jsonl",))
    out = {}
    ms.sglang_auto(out)
    ratios = out["sglang_auto_vs_max_fixed_or_dflash_tokens_per_s"]
    assert ratios == {"tiny": {"4": 0.85}, "tiny-dchain": {"4": 0.99}}
    assert out["sglang_auto_rivals_measured"]["tiny-dchain"] == {"4": ["ddtree-128", "dflash"]}
    assert out["sglang_auto_rows_without_decode_graphs"] == {}
    # per repeat: run i over the best rival's run i (repeat 2: DDTREE 900 beats DFLASH's slow 800)
    assert out["sglang_auto_vs_max_per_repeat"] == {"tiny": {"4": [0.85, 1.1]}, "tiny-dchain": {"4": [0.99, 0.5]}}


def test_same_config_servers_compare_a_copy_with_its_original(tmp_path, monkeypatch):
    """`--copy-setup tiny-b=tiny` with the same methods: each copied row over the original's row of the same method,
    budget and batch size, and per repeat; rows without a twin are left out, and a sweep without any twin fails."""
    import importlib.util

    import pytest

    spec = importlib.util.spec_from_file_location("make_summary", ROOT / "scripts" / "make_summary.py")
    ms = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ms)

    def row(setup, method, budget, tps, runs):
        return {"kind": "result", "status": "ok", "setup": setup, "method": method, "budget": budget,
                "batch_size": 1, "decode_tokens_per_s": tps, "decode_tokens_per_s_runs": runs}

    lines = [{"kind": "run", "argv": ["--setups", "tiny,tiny-b", "--copy-setup", "tiny-b=tiny"]},
             row("tiny", "ddtree", 128, 1000.0, [1000.0, 800.0]), row("tiny-b", "ddtree", 128, 900.0, [900.0, 880.0]),
             row("tiny", "auto", None, 700.0, [700.0, 700.0]), row("tiny-b", "dflash", None, 500.0, [500.0])]
    (tmp_path / "twins.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    monkeypatch.setattr(ms, "RESULTS", tmp_path)
    monkeypatch.setattr(ms, "SAME_CONFIG_SWEEPS", ("twins.jsonl",))
    out = {}
    ms.same_config_servers(out)
    assert out["sglang_same_config_servers"] == {
        "twins.jsonl": {"tiny|ddtree-128|1": {"copy_over_original": 0.9, "per_repeat": [0.9, 1.1]}}}
    (tmp_path / "lonely.jsonl").write_text("\n".join(json.dumps(x) for x in lines[:2]) + "\n")
    monkeypatch.setattr(ms, "SAME_CONFIG_SWEEPS", ("lonely.jsonl",))
    with pytest.raises(ValueError, match="lonely.jsonl: no copied setup"):
        ms.same_config_servers({})


def test_a_server_on_another_commits_package_is_recognised_from_its_environment():
    """lease_steps.sh tiny-paired TP_TWIN_BASE runs a setup on runs/bench/base-<commit> (PYTHONSAFEPATH=1, PYTHONPATH
    on it): that row is an A/B's base, not the code measured. Without PYTHONSAFEPATH the checkout came first on
    sys.path (lease 28's `tiny-b`), so that row ran the checkout and counts."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_summary", ROOT / "scripts" / "make_summary.py")
    ms = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ms)
    base = "PYTHONPATH=/tmp/site:/tmp/detached/tp/repo/runs/bench/base-a0828ce2367d"
    assert ms._other_commit({"server_env": ["SGLANG_DDTREE_AUTO_LOG_EVERY=100", "PYTHONSAFEPATH=1", base]}) \
        == "base-a0828ce2367d"
    assert ms._other_commit({"server_env": ["SGLANG_DDTREE_AUTO_LOG_EVERY=100", base]}) is None
    assert ms._other_commit({"server_env": ["PYTHONSAFEPATH=1", "PYTHONPATH=/tmp/site"]}) is None
    assert ms._other_commit({}) is None


def test_an_auto_server_held_on_one_candidate_is_left_out_of_the_headline():
    """Lease 30's `tiny-b|auto` ran with SGLANG_DDTREE_AUTO_FORCE=chain (the lean chain round against DFLASH): a
    measurement of one candidate, not of `auto`'s choice. The committed headline takes `tiny` from that sweep and
    keeps `tiny-b` from the sweep before it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_summary", ROOT / "scripts" / "make_summary.py")
    ms = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ms)
    assert ms._forced({"server_env": ["SGLANG_DDTREE_AUTO_LOG_EVERY=100", "SGLANG_DDTREE_AUTO_FORCE=chain"]}) == "chain"
    assert ms._forced({"server_env": ["SGLANG_DDTREE_AUTO_LOG_EVERY=100"]}) is None
    assert ms._forced({}) is None
    summary = json.loads((ROOT / "benchmarks" / "results" / "summary.json").read_text())
    sources = summary["sglang_auto_sources"]
    assert sources["tiny"]["16"] == "sweep_paired_tiny_lease30.jsonl"
    assert "sweep_paired_tiny_lease30.jsonl" not in sources["tiny-b"].values()


def test_ab_servers_are_left_out_of_the_headline_and_named_by_their_arm():
    """An `auto` server with SGLANG_DDTREE_AUTO_AB alternates rounds with the fixed tree: its tokens/s mixes both arms,
    so the cross-server headline leaves it out, and sglang_auto_ab reports its arms instead, named by what the `auto`
    arm ran (a knob its commit defaulted to, AB_IMPLIED_ENV, named too unless the server set it). The committed
    summary's headline A/B entry is `auto` as it is in AB_HEADLINE_SWEEPS, per batch size, every such server's runs
    pooled (between the servers' own ratios)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_summary", ROOT / "scripts" / "make_summary.py")
    ms = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ms)
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
    # commit, where it differed, names their arm (lease 34: FORGET_START 128 then, 0 now)
    then = ("SGLANG_DDTREE_AUTO_FORGET_START=128",)
    assert ms._ab_arm(ab + ["SGLANG_DDTREE_AUTO_FORGET_START=0"], then) == "as it is"
    assert ms._ab_arm(ab, then) == "AUTO_FORGET_START=128"
    # lease 35: the servers' commit had no expiry of old times (TIMES_EXPIRE 256 now); a held server's other knobs
    # name its arm too (they change its own cost), the expiry not (a held server makes no choice)
    before = ("SGLANG_DDTREE_AUTO_TIMES_EXPIRE=0",)
    assert ms._ab_arm(ab, before) == "AUTO_TIMES_EXPIRE=0"
    assert ms._ab_arm(ab + ["SGLANG_DDTREE_AUTO_TIMES_EXPIRE=256"], before) == "as it is"
    assert ms._ab_arm(ab + ["SGLANG_DDTREE_AUTO_FORCE=128"], before) == "forced=128"
    assert ms._ab_arm(ab + ["SGLANG_DDTREE_AUTO_FORCE=128", "SGLANG_DDTREE_AUTO_CALIBRATION_LEARN_ALL=0"],
                      before) == "forced=128,AUTO_CALIBRATION_LEARN_ALL=0"
    assert ms._not_auto_as_it_is({"server_env": ["SGLANG_DDTREE_AUTO_TIMES_EXPIRE=0"]})
    summary = json.loads((ROOT / "benchmarks" / "results" / "summary.json").read_text())
    # the headline pools `auto` as it is over AB_HEADLINE_SWEEPS (one chooser's files)
    assert set(ms.AB_HEADLINE_SWEEPS) <= set(ms.AB_SWEEPS)
    servers = {(name, label) for name in ms.AB_HEADLINE_SWEEPS
               for label, entry in summary["sglang_auto_ab"][name].items() if entry["arm"] == "as it is"}
    labels = sorted({label for _, label in servers})
    # lease 35: tiny-e1..e3 (35), e4 (35b), e5 and e6 (35c); lease 36: e1..e3 (36), e4..e9 (36b); its `w` servers
    # (a longer warm-up, AB_SETUP_NOTES) and held `f1` are named by their arm and left out; lease 37: e1..e4 (37),
    # e5..e7 (37b), its `s` servers (SWITCH_UNTIMED) named by their knob and left out; lease 38: e1..e3 (38), e4, e5
    # (38b), e6..e8 (38c), its `s` (SAMPLE_EVERY=8) and `d` (HOST_DETAIL) servers named and left out; lease 39:
    # e1..e6 (39), e7..e12 (39b), its `d` servers left out
    assert len(servers) == 42 and labels == sorted(f"tiny-e{i}|auto" for i in range(1, 13))
    assert summary["sglang_auto_ab"]["sweep_ab_tiny_lease36.jsonl"]["tiny-w1|auto"]["arm"] == "warmup_new_tokens=640"
    assert summary["sglang_auto_ab"]["sweep_ab_tiny_lease37b.jsonl"]["tiny-s5|auto"]["arm"] == "AUTO_SWITCH_UNTIMED=1"
    assert summary["sglang_auto_ab"]["sweep_ab_tiny_lease38c.jsonl"]["tiny-s8|auto"]["arm"] == "AUTO_SAMPLE_EVERY=8"
    assert summary["sglang_auto_ab"]["sweep_ab_tiny_lease38b.jsonl"]["tiny-d3|auto"]["arm"] == ms.AB_DETAIL_ARM
    assert summary["sglang_auto_ab_over_fixed_128_tiny_source"] == (
        f"{' + '.join(ms.AB_HEADLINE_SWEEPS)} (`auto` as it is: 42 servers, {' + '.join(labels)} in each sweep "
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
    # the as-it-is servers mark no detail; the two HOST_DETAIL servers of AB_DETAIL_SWEEPS (lease 39: the
    # bookkeeping as it is; lease 38's four ran the code before aa3bbae) split `choose` and `after`
    from sglang_ddtree.stages import AUTO_HOST_DETAIL

    assert not any(name in d["stages"] for d in own.values() for name in AUTO_HOST_DETAIL)
    detail = summary["sglang_auto_ab_host_detail_ms_tiny"]
    assert sorted(detail) == ["1", "16", "4", "64"] and all(d["rows"] == 2 for d in detail.values())
    assert all(set(AUTO_HOST_DETAIL) - {"after_learn"} <= set(d["stages"]) for d in detail.values())
    # no A/B server's own tokens/s reaches the cross-server headline's sources
    assert all(name not in ms.AB_SWEEPS for name in ms.SGLANG_AUTO_SWEEPS)
