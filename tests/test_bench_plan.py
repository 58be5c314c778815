"""The budget sweep's plan: configuration expansion, skip rules, server arguments, memory packing into waves."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ddtree_bench import plan as P

SETUPS = P.default_setups()
TINY, BIG = SETUPS["tiny"], SETUPS["8b-dummy"]


def arg(args, flag):
    i = args.index(flag)
    vals = []
    for a in args[i + 1:]:
        if a.startswith("--"):
            break
        vals.append(a)
    return vals


def test_expansion_covers_every_method_budget_and_batch():
    plan = P.expand([TINY])
    keys = {r.key for r in plan.rows} | {r.key for r, _ in plan.skipped}
    expected = {P.row_key("tiny", m, None, b) for m in ("plain", "dflash") for b in P.ALL_BATCH_SIZES}
    expected |= {P.row_key("tiny", "ddtree", B, b) for B in P.ALL_BUDGETS for b in P.ALL_BATCH_SIZES}
    assert keys == expected
    # one server per (setup, method, budget); budgets only for ddtree
    names = [s.name for s in plan.servers]
    assert len(names) == len(set(names)) == 2 + len(P.ALL_BUDGETS)
    assert all((s.budget is None) == (s.method != "ddtree") for s in plan.servers)
    assert all(r.batch_size in s.batch_sizes for s in plan.servers for r in s.rows)


def test_real_size_shapes_match_the_published_model_sizes():
    target, drafter = BIG.shapes()
    # Qwen3-8B is published as 8.2 B parameters (embeddings untied); the z-lab 8B block-16 drafter as ~1 B.
    assert 8.1e9 < target.params(embeddings=True) < 8.3e9
    assert 0.9e9 < drafter.params(embeddings=False) < 1.2e9
    assert drafter.block_size == 16 and drafter.aux_layers == 5
    # K and V, bf16: 2 * layers * kv_heads * head_dim * 2 bytes
    assert target.kv_bytes_per_token() == 2 * 36 * 8 * 128 * 2


def test_8b_config_files_carry_the_issue_fields():
    t = json.loads((P.REPO_ROOT / BIG.target / "config.json").read_text())
    d = json.loads((P.REPO_ROOT / BIG.drafter / "config.json").read_text())
    assert (t["num_hidden_layers"], t["hidden_size"], t["num_attention_heads"], t["num_key_value_heads"],
            t["head_dim"], t["intermediate_size"], t["vocab_size"]) == (36, 4096, 32, 8, 128, 12288, 151936)
    assert t["rope_theta"] == 1e6 and t["max_position_embeddings"] == 40960 and t["tie_word_embeddings"] is False
    assert d["architectures"] == ["DFlashDraftModel"] and d["model_type"] == "qwen3"
    assert d["num_hidden_layers"] == 5 and d["block_size"] == 16 and d["num_target_layers"] == 36
    assert d["dflash_config"] == {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}
    assert max(d["dflash_config"]["target_layer_ids"]) < t["num_hidden_layers"]
    assert d["dflash_config"]["mask_token_id"] < t["vocab_size"]


def test_the_8b_skip_rule_drops_only_what_cannot_fit():
    plan = P.expand([BIG])
    skipped = {r.key: why for r, why in plan.skipped}
    assert P.row_key("8b-dummy", "ddtree", 1024, 64) in skipped
    why = skipped[P.row_key("8b-dummy", "ddtree", 1024, 64)]
    assert "logits" in why and "64*1025*151936*4" in why
    # the fp32 logits of every runnable row stay below the activation limit
    target, _ = BIG.shapes()
    for r in plan.rows:
        width = P.verify_width(r.method, r.budget, 16)
        assert P.logits_bytes(target, r.batch_size * width) / P.GIB < BIG.max_activation_gib
    # B=1024 still runs its smaller batches, on a server sized for them
    big = next(s for s in plan.servers if s.name == "8b-dummy-ddtree-b1024")
    assert big.batch_sizes == (1, 4, 16)
    assert arg(big.args, "--max-running-requests") == ["16"]
    # raising the limit brings the row back: the rule is the limit, not a hard-coded list
    roomy = P.expand([dataclasses.replace(BIG, max_activation_gib=1000.0)])
    assert not roomy.skipped
    # the tiny vocabulary (4096) makes even B=1024 x 64 cheap
    assert not P.expand([TINY]).skipped


def test_server_args_per_method():
    plan = P.expand([BIG])
    by = {s.name: s for s in plan.servers}
    plain, dflash, dd = by["8b-dummy-plain"], by["8b-dummy-dflash"], by["8b-dummy-ddtree-b256"]
    for s in (plain, dflash, dd):
        assert "--host" not in s.args and "--port" not in s.args
        assert arg(s.args, "--load-format") == ["dummy"] and "--skip-tokenizer-init" in s.args
        assert "--enable-metrics" in s.args and arg(s.args, "--attention-backend") == ["triton"]
        assert int(arg(s.args, "--max-running-requests")[0]) == max(s.batch_sizes)
        assert int(arg(s.args, "--max-total-tokens")[0]) == s.memory.kv_pool_tokens
    assert "--speculative-algorithm" not in plain.args
    assert arg(dflash.args, "--speculative-algorithm") == ["DFLASH"]
    assert "--speculative-ddtree-budget" not in dflash.args
    assert arg(dd.args, "--speculative-algorithm") == ["DDTREE"]
    assert arg(dd.args, "--speculative-ddtree-budget") == ["256"]
    assert arg(dd.args, "--speculative-draft-model-path")[0].endswith("qwen3-8b-dummy/drafter")
    # graphs only where batch * (B+1) fits the cap; the rest runs eager
    graphs = [int(x) for x in arg(dd.args, "--cuda-graph-bs-decode")]
    assert graphs == [b for b in (1, 4, 16, 64) if b * 257 <= BIG.graph_token_cap] == [1, 4, 16]
    tiny = P.expand([TINY])
    assert all("--load-format" not in s.args and "--skip-tokenizer-init" not in s.args for s in tiny.servers)


def test_no_graph_fits_means_graphs_off():
    small_cap = dataclasses.replace(BIG, graph_token_cap=100, budgets=(256,), methods=("ddtree",))
    (server,) = P.expand([small_cap]).servers
    assert "--disable-decode-cuda-graph" in server.args and "--cuda-graph-bs-decode" not in server.args


def test_kv_pool_holds_every_request_with_its_speculative_reserve():
    for setup in (TINY, BIG):
        for server in P.expand([setup]).servers:
            width = P.verify_width(server.method, server.budget, 16)
            need = max(server.batch_sizes) * (setup.prompt_tokens + setup.max_new_tokens + 2 * width)
            assert server.memory.kv_pool_tokens >= need


def test_waves_respect_parallelism_memory_and_order():
    servers = P.expand([TINY, dataclasses.replace(BIG, budgets=(16, 64, 256, 1024))]).servers
    waves = P.plan_waves(servers, mem_budget_gib=119.0, max_parallel=12)
    assert [s.name for w in waves for s in w] == [s.name for s in servers]  # order kept, nothing lost
    for w in waves:
        assert len(w) <= 12
        need = sum(s.memory.resident_gib for s in w) + max(s.memory.activation_gib for s in w)
        assert need <= 119.0 or len(w) == 1
    assert len(P.plan_waves(servers, mem_budget_gib=1e6, max_parallel=4)) == -(-len(servers) // 4)
    # a budget below one 8B server: every 8B server gets a wave of its own
    eight = [s for s in servers if s.setup.name == "8b-dummy"]
    assert all(len(w) == 1 for w in P.plan_waves(eight, mem_budget_gib=20.0, max_parallel=12))
    with pytest.raises(ValueError, match="max_parallel"):
        P.plan_waves(servers, mem_budget_gib=100, max_parallel=0)


def test_a_server_over_the_whole_budget_is_skipped_with_the_reason():
    plan = P.expand([dataclasses.replace(BIG, methods=("plain",))], mem_budget_gib=10.0)
    assert not plan.servers
    assert len(plan.skipped) == len(P.ALL_BATCH_SIZES)
    assert all("memory budget" in why for _, why in plan.skipped)


def test_signatures_change_with_the_workload_but_not_with_the_checkout_path():
    a = P.expand([TINY]).signatures
    b = P.expand([dataclasses.replace(TINY, max_new_tokens=64)]).signatures
    assert a.keys() == b.keys() and all(a[k] != b[k] for k in a)
    assert P.expand([TINY]).signatures == a
    # the same workload served from another folder (relative vs absolute paths) keeps its signature
    moved = dataclasses.replace(TINY, target=str(P.REPO_ROOT / TINY.target), drafter=str(P.REPO_ROOT / TINY.drafter))
    assert P.expand([moved]).signatures == a


@pytest.mark.parametrize("change, match", [
    ({"methods": ("beam",)}, "methods"),
    ({"batch_sizes": (0,)}, "batch sizes"),
    ({"budgets": (2048,)}, "budgets"),
    ({"prompt_kind": "audio"}, "prompt_kind"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"target": "no/such/model"}, "config.json"),
])
def test_bad_setups_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        P.expand([dataclasses.replace(TINY, **change)])


def test_auto_method_is_one_server_sized_for_its_widest_candidate():
    setup = dataclasses.replace(TINY, methods=("dflash", "auto"), batch_sizes=(1, 4))
    plan = P.expand([setup])
    auto = {s.name: s for s in plan.servers}["tiny-auto"]
    assert [r.key for r in auto.rows] == [P.row_key("tiny", "auto", None, b) for b in (1, 4)]
    assert arg(auto.args, "--speculative-algorithm") == ["DDTREE"]
    assert arg(auto.args, "--speculative-ddtree-budget") == ["auto"]
    assert auto.width == 129  # the default candidates' largest tree, 128, plus the root
    assert "auto" not in P.Setup.methods  # not part of the default sweep


def test_verify_width():
    assert P.verify_width("plain", None, 16) == 1
    assert P.verify_width("dflash", None, 16) == 16
    assert P.verify_width("ddtree", 64, 16) == 65
    assert P.verify_width("auto", None, 16) == 129
    with pytest.raises(ValueError):
        P.verify_width("ddtree", None, 16)
    with pytest.raises(ValueError):
        P.verify_width("medusa", None, 16)


def test_auto_rows_are_timed_at_the_narrowest_tree_not_the_widest():
    """An `auto` server holds memory for its widest candidate, but its deadline estimate uses its narrowest tree's
    width: at the widest a batch-64 row read ~5x its measured time and the sweep refused short device calls."""
    setup = dataclasses.replace(BIG, methods=("ddtree", "auto"), budgets=(16,), batch_sizes=(64,))
    servers = {s.method: s for s in P.expand([setup]).servers}
    auto, tree = servers["auto"], servers["ddtree"]
    assert auto.width > tree.width == 17  # memory and graphs: the widest candidate
    # the same step time; only the warm-up differs (`auto` warms up longer)
    tokens = {m: setup.max_new_tokens + setup.warmup_tokens(m) for m in ("auto", "ddtree")}
    per_token = [(s.est_row_seconds(s.rows[0]) - 1.5) / tokens[s.method] for s in (auto, tree)]
    assert per_token[0] == pytest.approx(per_token[1])




def test_auto_gets_graphs_wherever_its_chain_fits_the_graph_budget():
    """SGLang captures every candidate's verify at every size it is given: `auto`'s sizes are chosen by its chain's
    width, so at batch 64 (64 x 129 tokens over the 8B setups' budget) the chain and the small trees replay graphs as
    DFLASH and DDTREE 16 do, not eagerly."""
    setup = dataclasses.replace(BIG, methods=("dflash", "ddtree", "auto"), budgets=(16,), batch_sizes=(16, 64))
    servers = {s.method: s for s in P.expand([setup]).servers}
    assert 64 * servers["auto"].width > setup.graph_token_cap
    assert servers["auto"].memory.graph_batch_sizes == servers["dflash"].memory.graph_batch_sizes == (16, 64)
    assert arg(servers["auto"].args, "--cuda-graph-bs-decode") == ["16", "64"]


def test_auto_graph_memory_counts_a_runner_per_candidate_and_one_shared_logits_buffer():
    """Each candidate width is its own verify runner (static buffers per captured token), while the fp32 logits
    buffer is one for all runners, sized for the widest: another narrow candidate adds its runner's buffers and no
    logits."""
    target, drafter = BIG.shapes()

    def auto_memory(candidates):
        setup = dataclasses.replace(BIG, methods=("auto",), batch_sizes=(64,), auto_candidates=candidates)
        return P.estimate_memory(setup, target, drafter, "auto", None, (64,))

    base, more = auto_memory("chain,128"), auto_memory("chain,16,128")
    logits = target.vocab * 4
    per_token = P.graph_bytes_per_token(target, BIG.context_length, 17, True) - logits
    assert (more.graph_gib - base.graph_gib) * P.GIB == pytest.approx(64 * 17 * per_token)
    widest_alone = 64 * 129 * P.graph_bytes_per_token(target, BIG.context_length, 129, True)
    assert base.graph_gib * P.GIB > widest_alone  # the chain's runner on top of the widest's
    assert base.graph_gib * P.GIB < widest_alone + 64 * 16 * (per_token + logits)  # ... without a second logits buffer


def test_auto_candidates_are_a_setup_field_passed_to_auto_servers_only():
    """auto_candidates (one string: --set keeps its commas) reaches the `auto` servers' flags and sets their widths in
    the plan; in server_args the list would be split at its commas, so it is refused there; a bad list is refused
    before any server starts."""
    def setup(candidates=None, *args):
        return dataclasses.replace(BIG, methods=("dflash", "auto"), batch_sizes=(4,), auto_candidates=candidates,
                                   server_args=args)

    flag = P.AUTO_CANDIDATES_FLAG
    assert P.auto_widths(setup("plain,chain,7,15,63"), 16) == (1, 16, 8, 16, 64)
    assert P.auto_widths(setup("chain,32"), 16) == (16, 33)
    assert max(P.auto_widths(setup(), 16)) == P.verify_width("auto", None, 16)
    servers = {s.method: s for s in P.expand([setup("plain,chain,7,15,63")]).servers}
    assert servers["auto"].width == 64 and arg(servers["auto"].args, flag) == ["plain,chain,7,15,63"]
    assert flag not in servers["dflash"].args and flag not in P.expand([setup()]).servers[1].args
    changed = P.apply_sets({"8b-dummy": BIG}, ["8b-dummy.auto_candidates=plain,chain,15"])["8b-dummy"]
    assert changed.auto_candidates == "plain,chain,15"
    with pytest.raises(ValueError, match="auto_candidates"):
        P.expand([setup(None, flag, "chain,16")])
    with pytest.raises(ValueError, match="auto-candidates"):
        P.expand([setup("chain,x")])


# ------------------------------------------------------------------------------------------- hybrid setups


def widened_27b(tmp_path) -> P.Setup:
    """27b-hybrid planned from the widening's configs (written from the committed tiny-hybrid configs, no weights)."""
    from sglang_ddtree import widen_hybrid

    setup = SETUPS["27b-hybrid"]
    widen_hybrid.write_configs(setup.path("plan_configs"), widen_hybrid.HYBRID_SHAPES[setup.widen_shape], tmp_path)
    return dataclasses.replace(setup, target=str(tmp_path / "target"), drafter=str(tmp_path / "drafter"))


def test_hybrid_shapes_count_the_gated_delta_net_layers(tmp_path):
    """The plan's shape of the 27B widening: the weights the widening writes (its own tensor list), KV for the 16
    attention layers only, and the recurrent state the 48 GDN layers keep per request."""
    from sglang_ddtree import widen_hybrid

    big = widen_hybrid.HYBRID_SHAPES["qwen3.5-27b"]
    target, drafter = widened_27b(tmp_path).shapes()
    assert (target.layers, target.linear_layers) == (64, 48)
    written = widen_hybrid.param_count(widen_hybrid.hybrid_target_shapes(big))
    assert abs(target.params(embeddings=True) - written) / written < 1e-4  # norms, A_log, dt_bias left out
    written = widen_hybrid.param_count(widen_hybrid.hybrid_drafter_shapes(big))
    assert drafter.linear_layers == 0 and abs(drafter.params(embeddings=False) - written) / written < 1e-4
    assert target.kv_bytes_per_token() == 2 * 16 * 4 * 256 * 2
    # per GDN layer: fp32 SSM [48 value heads, 128, 128] + bf16 conv window of 3 steps over q, k (16 x 128 each), v
    assert target.state_bytes_per_request() == 48 * (48 * 128 * 128 * 4 + (2 * 16 * 128 + 48 * 128) * 3 * 2)
    dense, _ = SETUPS["8b-dummy"].shapes()
    assert dense.linear_layers == 0 and dense.state_bytes_per_request() == 0


def test_hybrid_state_sizes_the_servers_and_skips_what_cannot_fit(tmp_path):
    setup = widened_27b(tmp_path)
    target, drafter = setup.shapes()
    per = target.state_bytes_per_request()
    plan = P.expand([setup])
    skipped = {r.key: why for r, why in plan.skipped}
    assert list(skipped) == [P.row_key("27b-hybrid", "ddtree", 64, 16)]
    assert "recurrent state" in skipped[P.row_key("27b-hybrid", "ddtree", 64, 16)]
    by = {s.name: s for s in plan.servers}
    for s in plan.servers:
        batch = max(s.batch_sizes)
        slots = P.MAMBA_SLOTS_PER_REQUEST * batch
        assert arg(s.args, "--max-mamba-cache-size") == [str(slots)] and s.memory.mamba_slots == slots
        nodes = (batch + 1) * s.width if s.method != "plain" else 0
        assert s.memory.state_gib == pytest.approx(per * (slots + 1 + nodes) / P.GIB)
        assert s.memory.state_gib <= setup.max_state_gib
        assert s.memory.resident_gib > s.memory.weights_gib + s.memory.state_gib
    assert by["27b-hybrid-ddtree-b64"].batch_sizes == (1, 4)
    assert arg(by["27b-hybrid-ddtree-b64"].args, "--max-running-requests") == ["4"]
    # the rule is the limit: without it the row comes back, on a server sized for batch 16
    roomy = P.expand([dataclasses.replace(setup, max_state_gib=None)])
    assert not roomy.skipped
    b64 = {s.name: s for s in roomy.servers}["27b-hybrid-ddtree-b64"]
    assert b64.memory.state_gib > 2 * setup.max_state_gib
    # one 27B server per wave on an H200-sized budget; the plain server fits an H100-sized one
    waves = P.plan_waves(plan.servers, mem_budget_gib=0.85 * 139, max_parallel=12)
    assert all(len(w) == 1 for w in waves) and len(waves) == len(plan.servers)
    assert by["27b-hybrid-plain"].memory.total_gib < 0.85 * 78 < by["27b-hybrid-dflash"].memory.total_gib
    # attention-only setups get no mamba flag
    assert all("--max-mamba-cache-size" not in s.args and s.memory.state_gib == 0
               for s in P.expand([TINY, BIG]).servers)


def test_tiny_hybrid_plans_from_the_trainers_configs_until_the_pair_is_trained(tmp_path):
    setup = dataclasses.replace(SETUPS["tiny-hybrid"], target=str(tmp_path / "pair" / "target"),
                                drafter=str(tmp_path / "pair" / "drafter"))
    assert setup.config_dir("target") == setup.path("plan_configs") / "target"
    target, drafter = setup.shapes()
    assert (target.layers, target.linear_layers, target.hidden) == (8, 6, 320)
    assert drafter.block_size == 16 and drafter.aux_layers == 3
    plan = P.expand([setup])
    assert not plan.skipped and {s.method for s in plan.servers} == {"plain", "dflash", "ddtree"}
    assert all(arg(s.args, "--max-mamba-cache-size") == ["48"] for s in plan.servers)
    assert all(arg(s.args, "--context-length") == ["4096"] for s in plan.servers)
    # a trained pair's own config wins (here: one with another hidden size)
    cfg = json.loads((setup.path("plan_configs") / "target" / "config.json").read_text())
    (tmp_path / "pair" / "target").mkdir(parents=True)
    (tmp_path / "pair" / "target" / "config.json").write_text(json.dumps(dict(cfg, hidden_size=640)))
    assert setup.config_dir("target") == tmp_path / "pair" / "target" and setup.shapes()[0].hidden == 640
    # a widened setup never plans its own shapes from plan_configs (they are the small pair's)
    with pytest.raises(ValueError, match="config.json"):
        dataclasses.replace(SETUPS["27b-hybrid"], target=str(tmp_path / "none" / "target")).shapes()
