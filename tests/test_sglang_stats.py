"""The DDTREE Prometheus series from one folded round vector (CPU: no CUDA needed for the arithmetic)."""

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from sglang_ddtree.metric_names import SummaryLayout  # noqa: E402
from sglang_ddtree.sglang.prometheus import PrometheusSeries  # noqa: E402


def value(registry, name, **labels):
    return registry.get_sample_value(name, {"budget": "8", **labels})


def summary_vector(by_accepted, **fields) -> list[float]:
    """A round summary vector (metric_names.SummaryLayout) of depth limit len(by_accepted) - 1; fields: its
    SUMMARY_FIELDS by name (0 where left out)."""
    layout = SummaryLayout(len(by_accepted) - 1)
    vec = [0.0] * layout.width
    vec[layout.by_accepted] = [float(c) for c in by_accepted]
    for field, v in fields.items():
        vec[layout.index(field)] = float(v)
    return vec


def test_round_vector_becomes_counters():
    registry = prometheus_client.CollectorRegistry()
    prom = PrometheusSeries(depth_limit=3, budget=8, registry=registry)
    # 4 request-rounds: accepted draft tokens 0, 2, 2, 3 -> by_accepted = [1, 0, 2, 1]
    totals = summary_vector([1, 0, 2, 1], branches=2, nodes=30, expected=9.5, requests=4)
    prom.observe(totals, rounds_seen=1, stage_ms=[{"draft": 1.0, "verify": 3.0, "host": 2.5}])
    assert value(registry, "sglang:ddtree_rounds_total") == 4
    assert value(registry, "sglang:ddtree_accepted_tokens_total") == 1 + 3 + 3 + 4
    assert [value(registry, "sglang:ddtree_accept_length_total", tokens=str(t)) for t in (1, 3, 4)] == [1, 2, 1]
    assert value(registry, "sglang:ddtree_accept_length_total", tokens="2") == 0  # exported, never incremented
    # at least d accepted: d=1 -> 3 rounds, d=2 -> 3, d=3 -> 1
    assert [value(registry, "sglang:ddtree_depth_reached_total", depth=str(d)) for d in (1, 2, 3)] == [3, 3, 1]
    assert value(registry, "sglang:ddtree_branch_accepted_total") == 2
    assert value(registry, "sglang:ddtree_tree_nodes_total") == 30
    assert value(registry, "sglang:ddtree_expected_tokens_total") == 9.5
    assert value(registry, "sglang:ddtree_stage_seconds_count", stage="verify") == 1
    assert value(registry, "sglang:ddtree_stage_seconds_sum", stage="verify") == pytest.approx(0.003)
    assert value(registry, "sglang:ddtree_round_host_seconds_sum") == pytest.approx(0.0025)
    assert value(registry, "sglang:ddtree_stage_seconds_count", stage="host") is None  # not a GPU stage


def test_round_summary_vector_counts_rounds_by_accepted_length():
    import torch

    from sglang_ddtree.sglang.stats import round_summary_vector
    from sglang_ddtree.tree import build_tree_from_topk, topk_draft
    from sglang_ddtree.walk import walk_choices

    gen = torch.Generator().manual_seed(5)
    values, tokens = topk_draft((torch.randn(6, 4, 30, generator=gen) * 3).log_softmax(-1), 8)
    tree = build_tree_from_topk(values, tokens, 8, torch.zeros(6, dtype=torch.long), max_budget=8)
    choice = torch.where(torch.rand(tree.tokens.shape, generator=gen) < 0.5, tree.tokens,
                         torch.randint(0, 30, tree.tokens.shape, generator=gen))
    walk = walk_choices(tree, choice)
    vec = round_summary_vector(tree, walk)
    by_accepted = vec[: tree.depth_limit + 1]
    expect = torch.bincount(walk.accept_len, minlength=tree.depth_limit + 1).float()
    assert torch.equal(by_accepted, expect) and by_accepted.sum() == 6
    layout = SummaryLayout(tree.depth_limit)
    assert len(vec) == layout.width
    assert vec[layout.index("requests")] == 6 and vec[layout.index("nodes")] == tree.num_nodes.sum() - 6


def test_branch_counts_per_request_equal_the_round_records():
    """The per-request counts the worker returns as cap_lens = the records' branch_taken, on walks that do
    take non-first siblings (each node's target choice is the token of a random child of that node)."""
    import torch

    from sglang_ddtree.metrics import records_from_round
    from sglang_ddtree.sglang.stats import branch_counts, round_summary_vector
    from sglang_ddtree.tree import build_tree_from_topk, topk_draft
    from sglang_ddtree.walk import walk_choices

    gen = torch.Generator().manual_seed(11)
    values, tokens = topk_draft((torch.randn(8, 6, 12, generator=gen) * 0.5).log_softmax(-1), 12)
    tree = build_tree_from_topk(values, tokens, 40, torch.zeros(8, dtype=torch.long), max_budget=40)
    choice = torch.randint(0, 12, tree.tokens.shape, generator=gen)
    for b in range(8):
        for i in range(tree.tokens.shape[1]):
            children = ((tree.parents[b] == i) & tree.valid[b]).nonzero().view(-1)
            if len(children):
                pick = children[torch.randint(0, len(children), (1,), generator=gen)]
                choice[b, i] = tree.tokens[b, pick]
    walk = walk_choices(tree, choice)
    counts = branch_counts(tree, walk)
    records = records_from_round(tree, walk)
    assert counts.dtype == torch.int32 and counts.tolist() == [sum(r.branch_taken) for r in records]
    assert int(counts.sum()) >= 4 and all(c <= r.accept_len - 1 for c, r in zip(counts.tolist(), records))
    assert round_summary_vector(tree, walk)[SummaryLayout(tree.depth_limit).index("branches")] == counts.sum()


class _ClockEvent:
    """Stands in for torch.cuda.Event on CPU: record() reads a scripted GPU clock (ms)."""

    clock = [0.0]
    elapsed_calls = 0

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self, stream=None):  # torch.cuda.Event.record's signature: the timer passes its round's stream
        self.t = _ClockEvent.clock[0]

    def query(self):
        return True

    def elapsed_time(self, end):
        _ClockEvent.elapsed_calls += 1
        return end.t - self.t


def test_round_timers_chain_so_stages_add_up_to_the_gpu_time_per_round(monkeypatch):
    """`between` = previous decode round's last event -> this round's start; none after a prefill/idle batch.
    Scripted clock: round 1 runs 0..10 ms, round 2 starts at 12 and ends at 20, a prefill, round 3 at 40..45."""
    import torch

    from sglang_ddtree.sglang.stats import DDTreeStats

    monkeypatch.setattr(torch.cuda, "Event", _ClockEvent)
    stats = DDTreeStats(enable_metrics=False, debug_path=None, depth_limit=3, budget=8)
    stats.enabled = True  # timers on without a registry or a dump: only the chaining is under test here
    clock = _ClockEvent.clock

    def round_at(start, stage_ends):
        clock[0] = start
        timer = stats.round_timer()
        for name, t in zip(("draft", "tree", "verify", "walk", "commit"), stage_ends):
            clock[0] = t
            timer.mark(name)
        stats.record_round(None, None, timer, batch_size=1)  # no registry, no dump: only the chaining runs
        return timer.elapsed_ms()

    first = round_at(0.0, (2.0, 3.0, 8.0, 8.5, 10.0))
    assert "between" not in first and sum(first.values()) == pytest.approx(10.0)
    second = round_at(12.0, (13.0, 14.0, 18.0, 18.5, 20.0))
    assert second["between"] == pytest.approx(2.0)
    assert sum(second.values()) == pytest.approx(20.0 - 10.0)  # from the first round's end to the second's
    stats.other_batch()
    third = round_at(40.0, (41.0, 41.5, 44.0, 44.2, 45.0))
    assert "between" not in third and sum(third.values()) == pytest.approx(5.0)
    calls = _ClockEvent.elapsed_calls
    timer = stats.round_timer()  # with `between` (the third round's end) and one stage: two elapsed_time calls
    timer.mark("draft")
    assert timer.elapsed_ms() is timer.elapsed_ms() and _ClockEvent.elapsed_calls == calls + 2  # read once, kept


def test_debug_dump_carries_the_auto_candidate_and_the_chooser_table(tmp_path):
    import json

    import torch

    from sglang_ddtree.sglang.auto import AutoBudgetPolicy
    from sglang_ddtree.sglang.stats import DDTreeStats
    from sglang_ddtree.sglang_baseline import read_debug_dump
    from sglang_ddtree.tree import build_tree_from_topk, topk_draft
    from sglang_ddtree.walk import walk_choices

    class Req:
        def __init__(self, rid):
            self.rid, self.origin_input_ids = rid, [1, 2, 3]

    class Timer:
        enabled, end_event, marks = False, None, []

        def elapsed_ms(self):
            return {}

    path = tmp_path / "dump.jsonl"
    stats = DDTreeStats(enable_metrics=False, debug_path=str(path), depth_limit=4, budget=8, budget_label="auto")
    policy = AutoBudgetPolicy([0, 8])
    values, tokens = topk_draft(torch.randn(2, 4, 20).log_softmax(-1), 8)
    tree = build_tree_from_topk(values, tokens, 8, torch.zeros(2, dtype=torch.long), max_budget=8)
    walk = walk_choices(tree, tree.tokens)
    for n in range(4):
        stats.record_round(tree, walk, Timer(), batch_size=2, reqs=[Req("a"), Req("b")],
                           seq_lens=torch.tensor([5 + n, 7 + n]), extra={"auto_candidate": "8"})
        stats.dump_state("auto", policy.export(), every=2)
    stats.debug.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[0]["type"] == "header" and lines[0]["budget"] == "auto"
    states = [x for x in lines if x.get("type") == "auto"]
    assert [x["round"] for x in states] == [2, 4] and states[0]["candidates"] == ["chain", "8"]
    # the chooser's decisions: the chosen-budget distribution, in total and per batch-size bucket
    assert states[0]["rounds_chosen"] == {"chain": 0, "8": 0} and "rounds_by_bucket" in states[0]
    rows = [x for x in lines if "rid" in x]
    assert len(rows) == 8 and all(x["auto_candidate"] == "8" for x in rows)
    dump = read_debug_dump(path)
    assert dump.rows_without_rid == 0 and sorted(dump.rows_by_rid) == ["a", "b"]


def test_host_stage_times_are_summed_per_stage_and_read_back_as_means(monkeypatch):
    """The worker's host time per stage (RoundTimer.host_stage_ms, DDTreeStats.finish_round): each mark closes the
    stage since the previous one (`choose`, a host-only mark, is `auto`'s chooser before the draft), `after` runs to
    the end of the round call; sums go to Prometheus every HOST_FLUSH_ROUNDS rounds with their round count, and
    ddtree_bench.prom.ddtree_summary reads the means back. Scripted clocks: no CUDA."""
    import torch

    from ddtree_bench import prom
    from sglang_ddtree.sglang import stats as stats_mod

    monkeypatch.setattr(torch.cuda, "Event", _ClockEvent)
    host = [100.0]  # seconds
    monkeypatch.setattr(stats_mod.time, "perf_counter", lambda: host[0])
    registry = prometheus_client.CollectorRegistry()
    stats = stats_mod.DDTreeStats(enable_metrics=False, debug_path=None, depth_limit=3, budget=8)
    stats.enabled = True
    stats.prometheus = PrometheusSeries(depth_limit=3, budget=8, registry=registry)
    before = prom.parse(prometheus_client.generate_latest(registry).decode())
    # `auto` marks the preparation as draft (host only), then its chooser as choose, then the draft forward
    steps = [("prep", 0.02), ("choose", 0.05), ("draft", 1.0), ("tree", 0.3), ("verify", 1.2), ("walk", 0.1),
             ("commit", 0.7)]

    def one_round(auto: bool):
        timer = stats.round_timer()
        for name, ms in steps:
            host[0] += ms / 1e3
            if name == "prep":
                if auto:
                    timer.host_mark("draft")
            elif name == "choose":
                if auto:
                    timer.host_mark(name)
            else:
                timer.mark(name)
        host[0] += 0.4e-3
        return timer

    timer = one_round(auto=True)
    expected = {"choose": 0.05, "draft": 1.02, "tree": 0.3, "verify": 1.2, "walk": 0.1, "commit": 0.7, "after": 0.4}
    assert timer.host_stage_ms(host[0]) == pytest.approx(expected)
    assert timer.host_ms == pytest.approx(sum(ms for _, ms in steps))  # to the commit, as before
    assert list(timer.host_stage_ms(host[0])) == ["draft", "choose", "tree", "verify", "walk", "commit", "after"]
    stats.finish_round(timer)
    for _ in range(stats.HOST_FLUSH_ROUNDS - 2):
        stats.finish_round(one_round(auto=True))
    assert value(registry, "sglang:ddtree_stage_host_rounds_total") == 0  # not yet flushed
    stats.finish_round(one_round(auto=True))
    n = stats.HOST_FLUSH_ROUNDS
    assert value(registry, "sglang:ddtree_stage_host_rounds_total") == n
    assert value(registry, "sglang:ddtree_stage_host_seconds_total", stage="verify") == pytest.approx(n * 1.2e-3)
    after = prom.parse(prometheus_client.generate_latest(registry).decode())
    summary = prom.ddtree_summary(prom.diff(after, before), budget=8)
    assert summary["host_stage_ms"] == pytest.approx(expected)
    # a fixed-budget round marks no `choose`: the draft's host time starts at the timer, `choose` reads 0
    for _ in range(n):
        stats.finish_round(one_round(auto=False))
    later = prom.parse(prometheus_client.generate_latest(registry).decode())
    fixed = prom.ddtree_summary(prom.diff(later, after), budget=8)["host_stage_ms"]
    assert fixed == pytest.approx({**expected, "choose": 0.0, "draft": 1.07})


def test_auto_host_detail_stages_split_the_chooser_and_after_and_exist_only_where_marked(monkeypatch):
    """SGLANG_DDTREE_AUTO_HOST_DETAIL: the worker marks `auto`'s own host work under stages.AUTO_HOST_DETAIL's names
    (the chooser block's parts before `choose`, tree_auto before the tree stage, the after_* parts after the commit,
    `after` from the last of them). Each reads back as its own mean through Prometheus and the summed stages still
    add up to the round call; a server that never marks them has no such series (made at first use), so its rows
    carry only stages.HOST_STAGES. Scripted clocks: no CUDA."""
    import torch

    from ddtree_bench import prom
    from sglang_ddtree.sglang import stats as stats_mod
    from sglang_ddtree.stages import AUTO_HOST_DETAIL, HOST_STAGES

    monkeypatch.setattr(torch.cuda, "Event", _ClockEvent)
    host = [100.0]
    monkeypatch.setattr(stats_mod.time, "perf_counter", lambda: host[0])
    steps = [("draft", 0.02, True), ("choose_prep", 0.004, True), ("choose_held", 0.003, True),
             ("choose_drain", 0.02, True), ("choose", 0.01, True), ("draft", 1.0, False), ("tree_auto", 0.006, True),
             ("tree", 0.3, False), ("verify", 1.2, False), ("walk", 0.1, False), ("commit", 0.7, False),
             ("after_cat", 0.005, True), ("after_push", 0.007, True), ("after_learn", 0.009, True),
             ("after_auto", 0.002, True)]

    def server(detail: bool):
        registry = prometheus_client.CollectorRegistry()
        stats = stats_mod.DDTreeStats(enable_metrics=False, debug_path=None, depth_limit=3, budget=8)
        stats.enabled = True
        stats.prometheus = PrometheusSeries(depth_limit=3, budget=8, registry=registry)
        before = prom.parse(prometheus_client.generate_latest(registry).decode())
        for _ in range(stats.HOST_FLUSH_ROUNDS):
            timer = stats.round_timer()
            for name, ms, host_only in steps:
                host[0] += ms / 1e3
                if not host_only:
                    timer.mark(name)
                elif detail or name in ("draft", "choose"):
                    timer.host_mark(name)
            host[0] += 0.4e-3
            stats.finish_round(timer)
        text = prometheus_client.generate_latest(registry).decode()
        return text, prom.ddtree_summary(prom.diff(prom.parse(text), before), budget=8)["host_stage_ms"]

    text, detailed = server(detail=True)
    want = {"draft": 1.02, "choose_prep": 0.004, "choose_held": 0.003, "choose_drain": 0.02, "choose": 0.01,
            "tree_auto": 0.006, "tree": 0.3, "verify": 1.2, "walk": 0.1, "commit": 0.7, "after_cat": 0.005,
            "after_push": 0.007, "after_learn": 0.009, "after_auto": 0.002, "after": 0.4}
    assert detailed == pytest.approx(want)
    assert sum(detailed.values()) == pytest.approx(sum(ms for _, ms, _ in steps) + 0.4)
    text, plain = server(detail=False)
    # without the marks the same work lands in the undivided stages: the chooser in `choose`, the rest in after
    assert plain == pytest.approx({"draft": 1.02, "choose": 0.037, "tree": 0.306, "verify": 1.2, "walk": 0.1,
                                   "commit": 0.7, "after": 0.423})
    assert set(plain) <= set(HOST_STAGES) and not any(f'stage="{name}"' in text for name in AUTO_HOST_DETAIL)


def test_auto_round_counter_is_published_in_sums_of_auto_round_flush_rounds():
    """`auto`'s rounds per candidate and batch-size bucket reach sglang:ddtree_auto_rounds_total in sums
    (PrometheusSeries.AUTO_ROUND_FLUSH): nothing before the flush, then every (candidate, batch) cell's rounds at once,
    none lost, none counted twice, each bucket apart."""
    registry = prometheus_client.CollectorRegistry()
    prom = PrometheusSeries(depth_limit=3, budget="auto", registry=registry)
    n = prom.AUTO_ROUND_FLUSH
    picks = [("128", 1)] * (n - 3) + [("chain", 16), ("64", 1), ("chain", 1)]

    def count(candidate, batch):
        return value(registry, "sglang:ddtree_auto_rounds_total", budget="auto", candidate=candidate,
                     batch=str(batch))

    for candidate, batch in picks[:-1]:
        prom.auto_round(candidate, batch)
    assert count("128", 1) is None
    prom.auto_round(*picks[-1])
    for cell in set(picks):
        assert count(*cell) == picks.count(cell)
    assert count("chain", 16) == count("chain", 1) == 1
    for _ in range(2 * n + 5):
        prom.auto_round("32", 64)
    assert count("32", 64) == 2 * n
    prom.flush_auto_rounds()
    assert count("32", 64) == 2 * n + 5
    assert count("128", 1) == n - 3


def test_auto_host_detail_knob(monkeypatch):
    from sglang_ddtree.sglang.auto_ab import auto_host_detail

    for raw, want in ((None, False), ("", False), ("0", False), ("1", True)):
        if raw is None:
            monkeypatch.delenv("SGLANG_DDTREE_AUTO_HOST_DETAIL", raising=False)
        else:
            monkeypatch.setenv("SGLANG_DDTREE_AUTO_HOST_DETAIL", raw)
        assert auto_host_detail() is want
    monkeypatch.setenv("SGLANG_DDTREE_AUTO_HOST_DETAIL", "yes")
    with pytest.raises(ValueError, match="SGLANG_DDTREE_AUTO_HOST_DETAIL"):
        auto_host_detail()


def test_ab_tallies_keep_the_arms_apart_and_count_only_rounds_that_follow_a_decode_round(monkeypatch):
    """SGLANG_DDTREE_AUTO_AB: rounds tagged with an arm feed that arm's counters, with their committed tokens (from
    the round vector), request-rounds and GPU time (the stages, `between` included); a round after a prefill (no
    `between`) or one that captured graphs (cold) is a skipped round; the sums reach Prometheus every
    ABTallies.FLUSH_ROUNDS rounds, and ddtree_bench.prom.ab_arms reads them back with the arms' tokens/s ratio. Untagged
    rounds (no A/B) feed nothing. Scripted clocks: no CUDA."""
    import torch

    from ddtree_bench import prom
    from sglang_ddtree.sglang import stats as stats_mod

    monkeypatch.setattr(torch.cuda, "Event", _ClockEvent)
    host = [100.0]
    monkeypatch.setattr(stats_mod.time, "perf_counter", lambda: host[0])
    registry = prometheus_client.CollectorRegistry()
    depth = 3
    stats = stats_mod.DDTreeStats(enable_metrics=False, debug_path=None, depth_limit=depth, budget=8,
                                  budget_label="auto")
    stats.enabled = True
    stats.prometheus = PrometheusSeries(depth_limit=depth, budget="auto", registry=registry)
    stats.ab.prometheus = stats.prometheus
    stats.ring = [torch.zeros(SummaryLayout(depth).width) for _ in range(stats.RING)]
    clock = _ClockEvent.clock
    clock[0] = 0.0

    def one_round(arm, accepted, ms, cold=False, after_prefill=False, host_ms=2.0, sampled=False, widest=True):
        if after_prefill:
            stats.other_batch()
        clock[0] += 0.5  # `between`
        timer = stats.round_timer()
        for name in ("draft", "tree", "verify", "walk", "commit"):
            clock[0] += (ms - 0.5) / 5
            host[0] += host_ms / 5e3
            timer.mark(name)
        timer.arm, timer.cold, timer.sampled, timer.widest = arm, cold, sampled, widest
        by_accepted = [0.0] * (depth + 1)
        for a in accepted:
            by_accepted[a] += 1
        summary = torch.tensor(summary_vector(by_accepted, nodes=10, expected=5, requests=len(accepted)))
        stats.record_round(None, None, timer, batch_size=len(accepted), summary=summary)
        stats.finish_round(timer)

    before = prom.parse(prometheus_client.generate_latest(registry).decode())
    one_round("auto", [3, 3], 4.0, after_prefill=True)  # no `between`: skipped
    for k in range(10):
        # 4 + 3 = 7 tokens in 4 ms; every other one sampled, one in five a narrower candidate's
        one_round("auto", [3, 2], 4.0, sampled=k % 2 == 0, widest=k % 5 != 0)
        one_round("fixed", [2, 2], 5.0)  # 6 tokens in 5 ms
    one_round("fixed", [3, 3], 1.0, cold=True)  # graph captures: skipped
    one_round(None, [3, 3], 1.0)  # no A/B arm: nothing
    for _ in range(stats.ab.FLUSH_ROUNDS):
        one_round("auto", [0], 4.0)  # later rounds drain and flush the ones above; not all flushed yet
    after = prom.parse(prometheus_client.generate_latest(registry).decode())
    arms = prom.ab_arms(prom.diff(after, before))
    assert arms["fixed"]["rounds"] == 10 and arms["fixed"]["skipped_rounds"] == 1
    assert arms["fixed"]["tokens"] == 60 and arms["fixed"]["request_rounds"] == 20
    assert arms["fixed"]["seconds"] == pytest.approx(10 * 5.0e-3)
    assert arms["fixed"]["round_ms"] == pytest.approx(5.0) and arms["fixed"]["tau"] == pytest.approx(3.0)
    # flushed after the 24th tallied round (30 came in, the last 6 wait): the skipped one, the 20 alternating ones,
    # the cold one and the first two 1-token rounds
    assert arms["auto"]["skipped_rounds"] == 1 and arms["auto"]["rounds"] == 12
    assert arms["auto"]["tokens"] == 70 + 2 and arms["auto"]["seconds"] == pytest.approx(12 * 4.0e-3)
    assert arms["ratio"] == pytest.approx((72 / 48.0) / (60 / 50.0))
    assert arms["fixed"]["host_ms"] == pytest.approx(2.0)
    # the auto arm's split (the 1-token rounds after were neither sampled nor narrower): 5 sampled, 2 narrower rounds
    assert arms["auto"]["sampled_rounds"] == 5 and arms["auto"]["sampled_round_ms"] == pytest.approx(4.0)
    assert arms["auto"]["narrower_rounds"] == 2 and arms["auto"]["narrower_tau"] == pytest.approx(3.5)
    assert arms["auto"]["narrower_round_ms"] == pytest.approx(4.0)
    assert arms["auto"]["widest_tokens_per_s"] == pytest.approx((72 - 14) / (10 * 4.0e-3))
    assert arms["auto"]["widest_tau"] == pytest.approx((72 - 14) / (22 - 4))
    assert "sampled_rounds" not in arms["fixed"]  # the fixed arm has no split
    assert sum(arms["fixed"]["host_stage_ms"].values()) == pytest.approx(2.0)
    # the arm-less round and the rounds of both arms all reached the ordinary series too
    assert value(registry, "sglang:ddtree_rounds_total", budget="auto") >= 2 + 40 + 2 + 2


def test_ab_tallies_flush_by_their_own_cadence():
    """ABTallies publishes nothing until FLUSH_ROUNDS rounds came in (a counter update per field and round would be
    the A/B's own cost), then every arm's sums at once, and starts again from zero."""
    from sglang_ddtree.sglang.stats import ABTallies

    class Timer:
        arm, cold, sampled, widest = "auto", False, False, True

        def ab_counted(self):
            return True

        def elapsed_ms(self):
            return {"between": 1.0, "draft": 2.0}

    calls = []

    class Prom:
        def ab(self, arm, sums, host_stage_s):
            calls.append((arm, dict(sums), dict(host_stage_s)))

    tallies = ABTallies(Prom(), depth_limit=2)
    values = summary_vector([1, 0, 1], requests=2)  # two request-rounds: 1 and 3 tokens
    for _ in range(ABTallies.FLUSH_ROUNDS - 1):
        tallies.round_done(Timer(), values)
        tallies.host_done(Timer(), {"draft": 0.5, "after": 0.25})
    assert calls == []
    tallies.round_done(Timer(), values)
    n = ABTallies.FLUSH_ROUNDS
    (arm, sums, host_stage), = calls
    assert arm == "auto" and sums["rounds"] == n and sums["tokens"] == 4 * n and sums["request_rounds"] == 2 * n
    assert sums["seconds"] == pytest.approx(n * 3e-3) and sums["host_rounds"] == n - 1
    assert host_stage == pytest.approx({"draft": (n - 1) * 0.5e-3, "after": (n - 1) * 0.25e-3})
    assert tallies.sums == {} and tallies.host_stage == {}
