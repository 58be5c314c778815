"""Server-produced baselines (sglang_ddtree/sglang_baseline.py) and the worker's debug dump (stats.record_round).

A DDTREE server cannot run here, so its side is simulated from a real offline DDTree run: every round's tree is
rebuilt as a batched DraftTree, walked with walk_choices under target choices that accept exactly the offline
path, and written by the worker's own DDTreeStats.record_round with fake SGLang requests (rid, prompt) and
committed lengths, several requests per batch round, started at different rounds, each with the extra round that
overlap scheduling runs after a request finished. The converted file must equal the offline run field by field
and pass the comparator; planted faults (rows attributed to the wrong request, a lost round, SGLang's counters
disagreeing, a walk that accepts less on the same tree) must be reported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from fixtures.offline_models import OracleDraft, one_thread, random_target
from sglang_ddtree import sglang_baseline as sb
from sglang_ddtree.baseline import Baseline, BaselineHeader, read_baseline, write_baseline
from sglang_ddtree.compare import Thresholds, compare
from sglang_ddtree.offline.runner import PromptInput, RunSettings, decode_one
from sglang_ddtree.sglang.stats import DDTreeStats, request_identity
from sglang_ddtree.tree import DraftTree
from sglang_ddtree.walk import walk_choices

BUDGET = 16
SLOTS = BUDGET + 1
DEPTH = 15
MAX_NEW = 30
METHOD = f"ddtree_tb{BUDGET}"
SENTINEL = 10**6  # a target choice no draft token equals: the walk stops at that node


@pytest.fixture(scope="module")
def offline():
    """A real offline DDTree run with trees recorded (tiny random target, oracle drafts with noise)."""
    with one_thread():
        target = random_target(seed=3)
        settings = RunSettings(methods=[METHOD], max_new_tokens=MAX_NEW, record_trees=True)
        prompts = [PromptInput(f"p{i}", i, [5 + i, 9, 20 + 2 * i, 4, 17, 33 - i][: 4 + i]) for i in range(3)]
        records = [decode_one(target, OracleDraft(target, noise=0.6, seed=i), p, METHOD, settings)
                   for i, p in enumerate(prompts)]
    header = BaselineHeader(source="offline", target={"path": None, "fingerprint": "t"}, dtype="float32",
                            device="cpu", max_new_tokens=MAX_NEW, block_size=DEPTH + 1, dataset="synthetic")
    base = Baseline(header, records)
    assert any(a > 2 for r in records for a in r.accept_lengths)  # deep acceptance: the tree path is exercised
    return base, {p.id: p.token_ids for p in prompts}


# ----------------------------------------------------------------------------------------------------------
# the simulated server


@dataclass
class SimRound:
    tree: dict  # offline tree dump (tokens/parents/scores/ranks), root = the round's root token
    accepted: list[int]  # accepted draft tokens
    bonus: int
    root_position: int


@dataclass
class SimRequest:
    rid: str
    prompt: list[int]
    output: list[int]
    rounds: list[SimRound]
    start_round: int = 0  # batch round at which the request joins


def sim_request(rec, prompt, rid, start_round=0) -> SimRequest:
    rounds = []
    for r, (a, root) in enumerate(zip(rec.accept_lengths, rec.round_root_positions())):
        # the accepted path from the recorded ranks (siblings have distinct tokens, so distinct ranks): the last
        # round's tokens may be cut from the output at max_new_tokens, its path is not
        t, node, accepted = rec.trees[r], 0, []
        for rank in rec.accepted_ranks[r]:
            node = next(i for i in range(1, len(t["tokens"])) if t["parents"][i] == node and t["ranks"][i] == rank)
            accepted.append(t["tokens"][node])
        assert accepted[: len(rec.output_ids) - root - 1] == rec.output_ids[root + 1: root + a]
        bonus = rec.output_ids[root + a] if root + a < len(rec.output_ids) else 7  # cut: not kept anyway
        rounds.append(SimRound(t, accepted, bonus, root))
    return SimRequest(rid, list(prompt), list(rec.output_ids), rounds, start_round)


def _tree(dump: dict) -> tuple[DraftTree, list[int]]:
    n = len(dump["tokens"])
    tokens = torch.zeros(1, SLOTS, dtype=torch.int64)
    parents = torch.full((1, SLOTS), -1, dtype=torch.int64)
    depth = torch.zeros(1, SLOTS, dtype=torch.int64)
    scores = torch.full((1, SLOTS), float("-inf"))
    ranks = torch.full((1, SLOTS), -1, dtype=torch.int64)
    valid = torch.zeros(1, SLOTS, dtype=torch.bool)
    tokens[0, :n] = torch.tensor(dump["tokens"])
    parents[0, :n] = torch.tensor(dump["parents"])
    for i in range(1, n):
        depth[0, i] = depth[0, dump["parents"][i]] + 1
    scores[0, :n] = torch.tensor([float("-inf") if s is None else s for s in dump["scores"]])
    ranks[0, :n] = torch.tensor(dump["ranks"])
    valid[0, :n] = True
    return DraftTree(tokens, parents, depth, scores, ranks, valid, DEPTH), dump["tokens"]


def _choices(tokens: list[int], parents: list[int], accepted: list[int], bonus: int) -> torch.Tensor:
    """Target choices that accept exactly `accepted` from the root, then pick `bonus`."""
    choice = torch.full((1, SLOTS), SENTINEL, dtype=torch.int64)
    node = 0
    for tok in accepted:
        child = next(i for i in range(1, len(tokens)) if parents[i] == node and tokens[i] == tok)
        choice[0, node] = tok
        node = child
    choice[0, node] = bonus
    return choice


@dataclass
class FakeReq:
    rid: str
    origin_input_ids: list[int]


class FakeTimer:
    enabled = False
    end_event = None

    def elapsed_ms(self):
        return {"draft": 1.0, "tree": 0.1, "verify": 2.0, "walk": 0.05, "commit": 0.3}


def run_server(requests: list[SimRequest], dump_path: Path, noise_rid: str | None = "warmup") -> None:
    """Batch rounds over the active requests through the worker's DDTreeStats.record_round (debug dump on)."""
    stats = DDTreeStats(enable_metrics=False, debug_path=str(dump_path), depth_limit=DEPTH, budget=BUDGET)
    queues = {r.rid: list(r.rounds) for r in requests}
    done_once: set[str] = set()
    step = 0
    while any(queues.values()) or len(done_once) < len(requests):
        rows = []  # (FakeReq, SimRound)
        for r in requests:
            if step < r.start_round:
                continue
            if queues[r.rid]:
                rows.append((FakeReq(r.rid, r.prompt), queues[r.rid].pop(0)))
            elif r.rid not in done_once:  # overlap: one more round launched before the finish is seen
                done_once.add(r.rid)
                last = r.rounds[-1] if r.rounds else None
                root = last.root_position + len(last.accepted) + 1 if last else 0
                tree = dict(last.tree if last else {"tokens": [r.output[0]], "parents": [-1], "scores": [0.0],
                                                    "ranks": [0]})
                rows.append((FakeReq(r.rid, r.prompt), SimRound(tree, [], 3, root)))
        if noise_rid and step % 3 == 0:  # another request the converter must ignore
            rows.append((FakeReq(noise_rid, [1, 2]), SimRound(requests[0].rounds[0].tree, [], 5, 0)))
        step += 1
        if not rows:
            continue
        trees, choices = [], []
        for _, rnd in rows:
            tree, tokens = _tree(rnd.tree)
            trees.append(tree)
            choices.append(_choices(tokens, rnd.tree["parents"], rnd.accepted, rnd.bonus))
        batch = DraftTree(*(torch.cat([getattr(t, f) for t in trees]) for f in
                            ("tokens", "parents", "depth", "scores", "ranks", "valid")), DEPTH)
        walk = walk_choices(batch, torch.cat(choices))
        assert walk.accept_len.tolist() == [len(rnd.accepted) for _, rnd in rows]  # the simulation is faithful
        seq_lens = torch.tensor([len(req.origin_input_ids) + rnd.root_position for req, rnd in rows])
        stats.record_round(batch, walk, FakeTimer(), batch_size=len(rows), reqs=[req for req, _ in rows],
                           seq_lens=seq_lens)
    stats.debug.close()


def responses(requests: list[SimRequest]) -> list[sb.ServerRequest]:
    out = []
    for r in requests:
        hist = [0] * (DEPTH + 1)
        for rnd in r.rounds:
            hist[len(rnd.accepted)] += 1
        while hist and hist[-1] == 0:
            hist.pop()
        meta = {"id": r.rid, "prompt_tokens": len(r.prompt), "finish_reason": {"type": "length", "length": MAX_NEW},
                "spec_verify_ct": len(r.rounds), "spec_correct_drafts_histogram": hist, "num_retractions": 0}
        pid = r.rid.split(":")[-1]  # rids "run1:p<i>": the prompt id is sent as part of the rid
        out.append(sb.ServerRequest({"output_ids": list(r.output), "meta_info": meta}, prompt_id=pid,
                                    prompt_ids=r.prompt, prompt_index=int(pid[-1]),
                                    sampling_params={"temperature": 0.0, "max_new_tokens": MAX_NEW}))
    return out


def sim_requests(offline):
    base, prompts = offline
    return [sim_request(rec, prompts[rec.prompt_id], f"run1:{rec.prompt_id}", start_round=2 * i)
            for i, rec in enumerate(base.records)]


# ----------------------------------------------------------------------------------------------------------
# the happy path


def test_dump_converts_back_to_the_offline_records_and_compares_equal(offline, tmp_path):
    base, _ = offline
    reqs = sim_requests(offline)
    dump = tmp_path / "debug.jsonl"
    run_server(reqs, dump)
    lines = [json.loads(x) for x in dump.read_text().splitlines()]
    assert lines[0] == {"type": "header", "budget": BUDGET, "depth_limit": DEPTH}
    assert max(x["batch_size"] for x in lines[1:]) >= 3  # requests really shared batch rounds
    row = next(x for x in lines[1:] if x["rid"] == "run1:p1")
    assert row["prompt_len"] == len(reqs[1].prompt) and row["output_tokens_before"] == 1  # round 0: prefill token

    conv = sb.convert(dump, responses(reqs))
    assert conv.problems == []
    server = conv.baseline
    assert server.methods == [METHOD] and server.header.source == "sglang"
    assert server.header.max_new_tokens == MAX_NEW and server.header.block_size == DEPTH + 1
    for rec in base.records:
        got = server.get(rec.prompt_id, METHOD)
        assert got.output_ids == rec.output_ids
        assert got.accept_lengths == rec.accept_lengths
        assert got.accepted_ranks == rec.accepted_ranks
        assert got.tree_sizes == rec.tree_sizes
        assert got.expected_accepts == pytest.approx(rec.expected_accepts, rel=1e-5)
        assert got.trees == rec.trees
        assert got.num_input_tokens == rec.num_input_tokens and got.prompt_sha256 == rec.prompt_sha256
        assert got.finish_reason == "length" and got.margins is None
        assert got.extra["server"]["rounds_after_end"] == 1  # the overlap round was dropped
        assert got.stage_ms["verify"] == [2.0] * len(rec.accept_lengths)

    report = compare(base, server, thresholds=Thresholds(min_match_rate=1.0, max_tau_drop=0.0))
    m = report["methods"][METHOD]
    assert report["passed"], report["failures"]
    assert m["exact_match"] == 3 and m["accept_len_difference_count"] == 0
    assert m["tree_rounds_compared"] == sum(len(r.accept_lengths) for r in base.records)
    assert m["tree_difference_counts"] == {}


def test_prompt_ids_from_an_offline_baseline_by_prompt_sha(offline, tmp_path):
    base, _ = offline
    reqs = sim_requests(offline)
    for r in reqs:
        r.rid = f"anon-{r.rid[-1]}"  # rids say nothing about the prompt
    dump = tmp_path / "debug.jsonl"
    run_server(reqs, dump)
    sreqs = responses(reqs)
    for s in sreqs:
        s.prompt_id = None
    sreqs[2].prompt_ids = [63, 62, 61]  # a prompt the offline run never saw (its length check fails too)
    sreqs[2].response["meta_info"]["prompt_tokens"] = 3
    conv = sb.convert(dump, sreqs, match_prompts=base)
    assert sorted(r.prompt_id for r in conv.baseline.records) == ["p0", "p1"]
    assert len(conv.problems) == 1 and "anon-2" in conv.problems[0] and "not in the baseline" in conv.problems[0]
    # without a match the rid is the prompt id
    conv = sb.convert(dump, [sb.ServerRequest(sreqs[0].response)])
    assert [r.prompt_id for r in conv.baseline.records] == ["anon-0"]


# ----------------------------------------------------------------------------------------------------------
# planted faults


def test_rows_of_the_wrong_request_are_reported(offline, tmp_path):
    reqs = sim_requests(offline)
    for r in reqs:
        r.start_round = 0  # all three in every batch round
    dump = tmp_path / "debug.jsonl"
    run_server(reqs, dump, noise_rid=None)
    lines = dump.read_text().splitlines()
    # swap the rids of the first two rows of one batch round (a worker that mixed up its batch rows)
    rows = [json.loads(x) for x in lines]
    idx = [i for i, d in enumerate(rows) if d.get("round") == 2]
    a, b = idx[0], idx[1]
    rows[a]["rid"], rows[b]["rid"] = rows[b]["rid"], rows[a]["rid"]
    dump.write_text("\n".join(json.dumps(d) for d in rows) + "\n")
    conv = sb.convert(dump, responses(reqs))
    named = {p.split(" ")[1] for p in conv.problems}
    assert {"p0", "p1"} <= named, conv.problems
    assert "p2" not in named


def test_rounds_whose_tokens_are_not_the_output_are_reported(offline, tmp_path):
    """The chain of positions holds, but a tree hangs from another token or emitted other tokens than the output
    (a stale bonus as root, or an output the scheduler changed after the walk)."""
    reqs = sim_requests(offline)
    dump = tmp_path / "debug.jsonl"
    run_server(reqs, dump, noise_rid=None)
    rows = [json.loads(x) for x in dump.read_text().splitlines()]
    r0 = next(d for d in rows if d.get("rid") == "run1:p0" and d["output_tokens_before"] > 1)
    r0["tree_tokens"][0] = (r0["tree_tokens"][0] + 1) % 64
    r1 = next(d for d in rows if d.get("rid") == "run1:p1" and d["accept_len"] > 1)
    r1["out_tokens"][0] = (r1["out_tokens"][0] + 1) % 64
    dump.write_text("\n".join(json.dumps(d) for d in rows) + "\n")
    conv = sb.convert(dump, responses(reqs))
    p0 = [p for p in conv.problems if p.startswith("prompt p0 ")]
    p1 = [p for p in conv.problems if p.startswith("prompt p1 ")]
    assert len(p0) == 1 and "root token" in p0[0]
    assert len(p1) == 1 and "emitted" in p1[0]
    assert len(conv.problems) == 2  # p2 is clean


def test_a_malformed_tree_is_kept_for_the_comparator(offline, tmp_path):
    base, _ = offline
    reqs = sim_requests(offline)
    dump = tmp_path / "debug.jsonl"
    run_server(reqs, dump, noise_rid=None)
    rows = [json.loads(x) for x in dump.read_text().splitlines()]
    bad = next(d for d in rows if d.get("rid") == "run1:p2" and len(d["tree_parents"]) > 6
               and d["output_tokens_before"] > 1)
    bad["tree_parents"][3] = 5  # a parent after its child
    dump.write_text("\n".join(json.dumps(d) for d in rows) + "\n")
    conv = sb.convert(dump, responses(reqs))
    assert len(conv.problems) == 1 and conv.problems[0].startswith("prompt p2 ") and "malformed" in conv.problems[0]
    out = tmp_path / "server.jsonl"
    sb.write_server_baseline(out, conv.baseline)
    report = compare(base, read_baseline(out))
    first = report["methods"][METHOD]["first_tree_difference"]
    assert not report["passed"] and first["prompt_id"] == "p2" and first["class"] == "bug"
    assert "malformed" in first["reason"]


def test_a_lost_round_and_disagreeing_counters_are_reported(offline, tmp_path):
    reqs = sim_requests(offline)
    dump = tmp_path / "debug.jsonl"
    run_server(reqs, dump, noise_rid=None)
    rows = [json.loads(x) for x in dump.read_text().splitlines()]
    lost = next(i for i, d in enumerate(rows) if d.get("rid") == "run1:p1" and d["output_tokens_before"] > 1)
    del rows[lost]
    dump.write_text("\n".join(json.dumps(d) for d in rows) + "\n")
    sreqs = responses(reqs)
    sreqs[2].response["meta_info"]["spec_verify_ct"] += 1
    sreqs[0].response["meta_info"]["spec_correct_drafts_histogram"][0] += 1
    conv = sb.convert(dump, sreqs)
    by_prompt = {p: [x for x in conv.problems if x.startswith(f"prompt {p} ")] for p in ("p0", "p1", "p2")}
    assert any("expected" in x or "missing" in x for x in by_prompt["p1"]), conv.problems  # chain breaks
    assert any("spec_verify_ct" in x for x in by_prompt["p2"])
    assert any("histogram" in x for x in by_prompt["p0"])
    assert sorted(r.prompt_id for r in conv.baseline.records) == ["p0", "p2"]  # p1 cannot be placed


def test_a_walk_that_accepts_less_on_the_same_tree_fails_the_comparison(offline, tmp_path):
    base, _ = offline
    reqs = sim_requests(offline)
    victim = next(r for r in reqs if any(len(x.accepted) >= 2 for x in r.rounds))
    r = next(i for i, x in enumerate(victim.rounds) if len(x.accepted) >= 2)
    rnd = victim.rounds[r]
    tokens, parents = rnd.tree["tokens"], rnd.tree["parents"]
    # the server rejects the last accepted draft token and emits another token there (then its output ends)
    stop_node = 0
    for tok in rnd.accepted[:-1]:
        stop_node = next(i for i in range(1, len(tokens)) if parents[i] == stop_node and tokens[i] == tok)
    children = {tokens[i] for i in range(1, len(tokens)) if parents[i] == stop_node}
    other = next(t for t in range(64) if t not in children)
    victim.rounds = victim.rounds[:r] + [SimRound(rnd.tree, rnd.accepted[:-1], other, rnd.root_position)]
    pos = rnd.root_position + len(rnd.accepted)  # where the rejected token was
    victim.output = victim.output[:pos] + [other]
    dump = tmp_path / "debug.jsonl"
    run_server(reqs, dump)
    conv = sb.convert(dump, responses(reqs))
    assert conv.problems == []  # the dump is consistent: the server really did this
    report = compare(base, conv.baseline)
    m = report["methods"][METHOD]
    assert not report["passed"]
    pid = victim.rid.split(":")[-1]
    assert m["accept_len_difference_count"] == 1
    diff = m["accept_len_differences"][0]
    assert (diff["prompt_id"], diff["round"], diff["trees_identical"]) == (pid, r, True)
    assert diff["candidate_accept_len"] == diff["baseline_accept_len"] - 1
    assert any("identical trees" in f for f in report["failures"])
    assert m["divergences"][0]["position"] == pos and m["divergences"][0]["candidate_round"] == r


# ----------------------------------------------------------------------------------------------------------
# inputs, CLI


def test_dump_reader_refusals_and_a_half_written_last_line(offline, tmp_path):
    reqs = sim_requests(offline)
    dump = tmp_path / "debug.jsonl"
    run_server(reqs, dump)
    with open(dump, "a") as f:
        f.write('{"round": 99, "rid": "run1:p0", "output_tok')  # the server is still writing
    assert sb.convert(dump, responses(reqs)).problems == []
    old = tmp_path / "old.jsonl"
    old.write_text('{"type":"header","budget":16,"depth_limit":15}\n{"round":1,"request":0,"accept_len":1}\n')
    with pytest.raises(ValueError, match="no request id"):
        sb.read_debug_dump(old)
    two = tmp_path / "two.jsonl"
    two.write_text('{"type":"header","budget":16,"depth_limit":15}\n{"type":"header","budget":64,"depth_limit":15}\n')
    with pytest.raises(ValueError, match="different budgets"):
        sb.read_debug_dump(two)
    with pytest.raises(ValueError, match="does not exist"):
        sb.read_debug_dump(tmp_path / "missing.jsonl")
    bad = sb.ServerRequest({"output_ids": [1, 2]})
    with pytest.raises(ValueError, match="meta_info"):
        sb.convert(dump, [bad])
    sreqs = responses(reqs)
    sreqs[1].sampling_params = {"temperature": 0.7}
    with pytest.raises(ValueError, match="different temperature"):
        sb.convert(dump, sreqs)
    sreqs = responses(reqs)
    sreqs[1].prompt_id = sreqs[0].prompt_id
    with pytest.raises(ValueError, match="appears twice"):
        sb.convert(dump, sreqs)


def _cli(*argv) -> int:
    from sglang_ddtree.cli import main

    return main([str(a) for a in argv])


def test_cli_from_server_then_compare(offline, tmp_path, capsys):
    base, _ = offline
    reqs = sim_requests(offline)
    dump = tmp_path / "debug.jsonl"
    run_server(reqs, dump)
    offline_path = tmp_path / "offline.jsonl"
    write_baseline(offline_path, base.header, base.records)
    results = tmp_path / "results.jsonl"
    with open(results, "w") as f:
        for s in responses(reqs):
            f.write(json.dumps({"prompt_ids": s.prompt_ids, "sampling_params": s.sampling_params,
                                "response": s.response}) + "\n")
    out = tmp_path / "server.jsonl"
    assert _cli("from-server", "--debug", dump, "--results", results, "--out", out,
                "--match-prompts", offline_path, "--dtype", "bfloat16") == 0
    server = read_baseline(out)
    assert sorted(server.prompt_ids()) == ["p0", "p1", "p2"] and server.header.dtype == "bfloat16"
    assert _cli("compare", offline_path, out, "--min-match-rate", "1") == 0
    assert "3/3 exact matches" in capsys.readouterr().out

    # a lost round: written with a problem, exit 1; bad input: exit 2
    rows = [json.loads(x) for x in dump.read_text().splitlines()]
    del rows[next(i for i, d in enumerate(rows) if d.get("rid") == "run1:p2" and d["output_tokens_before"] > 1)]
    dump.write_text("\n".join(json.dumps(d) for d in rows) + "\n")
    assert _cli("from-server", "--debug", dump, "--results", results, "--out", out,
                "--match-prompts", offline_path) == 1
    assert "problem: prompt p2" in capsys.readouterr().err
    assert _cli("from-server", "--debug", dump, "--results", results, "--out", out, "--match-prompts",
                offline_path, "--allow-problems") == 0
    results.write_text('{"response": {"output_ids": [1]}}\n')
    assert _cli("from-server", "--debug", dump, "--results", results, "--out", out) == 2


# ----------------------------------------------------------------------------------------------------------
# the worker's side: request identity, and no host work on the default path


def test_request_identity_places_the_round_root_on_the_output():
    reqs = [FakeReq("a", [1, 2, 3]), FakeReq("b", [4] * 10)]
    ident = request_identity(reqs, torch.tensor([3, 17]), 2)
    # KV holds the prompt and every output token but the last one (the root): output tokens = seq - prompt + 1
    assert ident == [{"rid": "a", "prompt_len": 3, "seq_len": 3, "output_tokens_before": 1},
                     {"rid": "b", "prompt_len": 10, "seq_len": 17, "output_tokens_before": 8}]
    assert request_identity(None, None, 1) == [{"rid": None, "prompt_len": None, "seq_len": None,
                                                "output_tokens_before": None}]


class Untouchable:
    """Fails on any use: proves the default path never reads the batch's requests or device lengths."""

    def __getattr__(self, name):
        raise AssertionError(f"the non-debug path touched {name}")

    def __len__(self):
        raise AssertionError("the non-debug path touched the requests")

    def __getitem__(self, i):
        raise AssertionError("the non-debug path touched the requests")


def test_default_path_does_not_read_requests_or_lengths():
    stats = DDTreeStats(enable_metrics=False, debug_path=None, depth_limit=DEPTH, budget=BUDGET)
    assert stats.round_timer().enabled is False
    stats.record_round(Untouchable(), Untouchable(), Untouchable(), batch_size=2, reqs=Untouchable(),
                       seq_lens=Untouchable())
    assert stats.round_index == 1
