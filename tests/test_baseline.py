"""Baseline file format: writer/reader round trip, resume, version checks, and the reference importer."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from sglang_ddtree.baseline import (
    FORMAT_NAME, FORMAT_VERSION, Baseline, BaselineHeader, BaselineWriter, MethodRecord, comparability_warnings,
    fingerprint_dir, fingerprint_module, method_name, parse_method, read_baseline, write_baseline,
)
from sglang_ddtree.reference_import import import_reference

FIXTURES = Path(__file__).parent / "fixtures"


def _header(**kw):
    base = dict(source="offline", target={"path": "/m/t", "fingerprint": "aa"}, drafter={"path": "/m/d", "fingerprint": "bb"},
                dtype="float32", device="cpu", temperature=0.0, seed=0, max_new_tokens=8, block_size=4,
                dataset="humaneval")
    base.update(kw)
    return BaselineHeader(**base)


def _record(pid="p0", method="ddtree_tb4", out=(5, 6, 7, 8, 9)):
    out = list(out)
    return MethodRecord(
        prompt_id=pid, method=method, output_ids=out, prompt_index=0, num_input_tokens=3, prompt_sha256="x",
        finish_reason="length", accept_lengths=[2, 2], accepted_ranks=[[0], [1]], tree_sizes=[4, 4],
        expected_accepts=[1.5, 1.7], margins=[0.5, float("inf"), 1.0, 2.0, 0.1],
        stage_ms={s: [0.1, 0.2] for s in ("draft", "tree", "verify", "walk", "commit")}, prefill_ms=1.0,
        total_ms=3.0,
        trees=[{"tokens": [5, 6, 3, 4, 2], "parents": [-1, 0, 0, 1, 1], "scores": [0.0, -0.1, -1.0, -1.2, -2.0],
                "ranks": [0, 0, 1, 0, 1]},
               {"tokens": [7, 1, 8, 3, 4], "parents": [-1, 0, 0, 2, 2], "scores": [0.0, -0.2, -0.3, -1.0, -1.5],
                "ranks": [0, 0, 1, 0, 1]}],
    )


def test_method_names():
    assert method_name("ddtree", 64) == "ddtree_tb64" and parse_method("ddtree_tb64") == ("ddtree", 64)
    assert parse_method("plain") == ("plain", None) and parse_method("dflash") == ("dflash", None)
    for bad in ("ddtree", "ddtree_tb0", "baseline", "ddtree_tb-1", "chain"):
        with pytest.raises(ValueError, match="unknown method name"):
            parse_method(bad)
    with pytest.raises(ValueError, match="budget"):
        method_name("ddtree", None)


def test_write_read_round_trip(tmp_path):
    path = tmp_path / "b.jsonl"
    recs = [_record("p0"), _record("p1", "plain", (1, 2, 3))]
    recs[1].accept_lengths, recs[1].accepted_ranks, recs[1].tree_sizes = [1, 1], None, None
    recs[1].expected_accepts, recs[1].trees, recs[1].margins = None, None, None
    recs[1].stage_ms = {"verify": [0.1, 0.1]}
    write_baseline(path, _header(), recs)
    first = json.loads(path.read_text().splitlines()[0])
    assert first["format"] == FORMAT_NAME and first["version"] == FORMAT_VERSION
    b = read_baseline(path)
    assert b.methods == ["plain", "ddtree_tb4"] and b.prompt_ids() == ["p0", "p1"]
    got = b.get("p0", "ddtree_tb4")
    assert got.output_ids == recs[0].output_ids and got.trees == recs[0].trees
    assert got.accepted_ranks == [[0], [1]] and got.stage_ms == recs[0].stage_ms
    assert got.margins[1] != got.margins[1]  # inf is not JSON: stored as null, read back as NaN
    assert got.margins[0] == 0.5 and got.budget == 4 and got.round_root_positions() == [0, 2]
    assert [got.round_of_position(i) for i in range(5)] == [None, 0, 0, 1, 1]
    assert b.header.dataset == "humaneval" and b.header.target["fingerprint"] == "aa"


def test_version_and_format_mismatch_are_clear_errors(tmp_path):
    path = tmp_path / "b.jsonl"
    write_baseline(path, _header(), [_record()])
    lines = path.read_text().splitlines()
    head = json.loads(lines[0])
    head["version"] = 2
    path.write_text("\n".join([json.dumps(head)] + lines[1:]) + "\n")
    with pytest.raises(ValueError, match="version 2 is not supported.*version 1"):
        read_baseline(path)
    head["version"], head["format"] = 1, "something-else"
    path.write_text("\n".join([json.dumps(head)] + lines[1:]) + "\n")
    with pytest.raises(ValueError, match="not a baseline file"):
        read_baseline(path)
    with pytest.raises(ValueError, match="does not exist"):
        read_baseline(tmp_path / "missing.jsonl")


def test_invalid_records_are_rejected(tmp_path):
    bad = _record()
    bad.accepted_ranks = [[0, 0], [1]]  # round 0 accepted 1 node
    with pytest.raises(ValueError, match="round 0 accepted 1 draft nodes but lists 2 ranks"):
        bad.validate()
    bad = _record()
    bad.trees[1]["parents"] = [-1, 0, 3, 0, 2]  # parent after child
    with pytest.raises(ValueError, match="parent must be an earlier node"):
        bad.validate()
    bad = _record()
    bad.accept_lengths = [1, 1]
    with pytest.raises(ValueError, match="must cover every output token"):
        bad.validate()
    path = tmp_path / "b.jsonl"
    write_baseline(path, _header(), [_record()])
    with open(path, "a") as f:
        f.write(json.dumps(_record().to_json()) + "\n")
    with pytest.raises(ValueError, match="duplicate record"):
        read_baseline(path)


def test_writer_resumes_and_refuses_different_settings(tmp_path):
    path = tmp_path / "b.jsonl"
    with BaselineWriter(path, _header()) as w:
        w.write(_record("p0"))
    with open(path, "a") as f:
        f.write('{"prompt_id": "p1", "meth')  # a run killed mid-line
    with pytest.raises(ValueError, match="truncated write"):
        read_baseline(path)
    with BaselineWriter(path, _header()) as w:
        assert w.done("p0", "ddtree_tb4") and not w.done("p1", "ddtree_tb4")
        w.write(_record("p1"))
        with pytest.raises(ValueError, match="already written"):
            w.write(_record("p1"))
    b = read_baseline(path)
    assert b.prompt_ids() == ["p0", "p1"]
    with pytest.raises(ValueError, match="cannot resume.*temperature"):
        BaselineWriter(path, _header(temperature=0.7))
    with pytest.raises(ValueError, match="target model fingerprint"):
        BaselineWriter(path, _header(target={"path": "/m/t", "fingerprint": "zz"}))
    with BaselineWriter(path, _header(temperature=0.7), resume=False):
        pass
    assert read_baseline(path).records == []


def test_comparability_warnings():
    assert comparability_warnings(_header(), _header()) == []
    w = comparability_warnings(_header(), _header(temperature=1.0, max_new_tokens=16, dtype="bfloat16"))
    assert any("temperature" in x for x in w) and any("max_new_tokens" in x for x in w)
    assert any("dtype" in x for x in w)


def test_fingerprints_change_with_content(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"abc")
    a = fingerprint_dir(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"abd")
    assert fingerprint_dir(tmp_path) != a
    m = torch.nn.Linear(2, 2)
    f = fingerprint_module(m)
    with torch.no_grad():
        m.weight[0, 0] += 1
    assert fingerprint_module(m) != f


# ----------------------------------------------------------------------------------------------------------
# importer


def test_import_reference_fixture_round_trip(tmp_path):
    from fixtures import make_reference_fixture as gen

    # the committed file is what the script writes
    fresh = gen.main(str(tmp_path / "fresh.pt"))
    committed = import_reference(FIXTURES / "reference_small.pt", prompt_ids=["a", "b", "c"])
    regenerated = import_reference(fresh, prompt_ids=["a", "b", "c"])
    assert [r.to_json() for r in committed.records] == [r.to_json() for r in regenerated.records]

    raw = gen.make()
    b = committed
    assert b.methods == ["plain", "dflash", "ddtree_tb4", "ddtree_tb8"]  # 'baseline' -> 'plain'
    assert b.header.block_size == 4 and b.header.max_new_tokens == 16 and b.header.temperature == 0.0
    for i, pid in enumerate("abc"):
        for ref_name, ref in raw["responses"][i].items():
            rec = b.get(pid, "plain" if ref_name == "baseline" else ref_name)
            assert rec.output_ids == ref.output_ids[0, ref.num_input_tokens:].tolist()
            assert rec.num_input_tokens == ref.num_input_tokens
            assert rec.accept_lengths == list(ref.acceptance_lengths)
            assert rec.prefill_ms == pytest.approx(ref.time_to_first_token * 1000)
            if ref.round_trees is not None:
                assert [t["tokens"] for t in rec.trees] == [t["tokens"].tolist() for t in ref.round_trees]
                # each round's tree hangs from the token emitted just before it
                roots = rec.round_root_positions()
                assert [t["tokens"][0] for t in rec.trees] == [rec.output_ids[p] for p in roots]
            if ref.stage_times:
                assert rec.stage_ms["verify"] == pytest.approx([s * 1000 for s in ref.stage_times["verify"]])
    # and it survives our own writer/reader
    out = tmp_path / "imported.jsonl"
    write_baseline(out, b.header, b.records)
    again = read_baseline(out)
    assert [r.to_json() for r in again.records] == [r.to_json() for r in b.records]
    assert again.header.source == "import:ddtree-reference"


def _save(tmp_path, obj, name="ref.pt"):
    p = tmp_path / name
    torch.save(obj, p)
    return p


def _ns(**kw):
    d = dict(output_ids=torch.tensor([[1, 2, 3, 4, 5]]), num_input_tokens=2, num_output_tokens=3,
             acceptance_lengths=[2])
    d.update(kw)
    return types.SimpleNamespace(**d)


def test_import_accepts_dict_results_and_rootless_trees(tmp_path):
    tree = {"node_tokens": torch.tensor([4, 9]), "parent_ids": torch.tensor([-1, -1])}  # no root node
    res = {"output_ids": torch.tensor([3, 4, 5]), "num_input_tokens": 0, "num_output_tokens": 3,
           "acceptance_lengths": [2], "round_trees": [tree]}
    b = import_reference(_save(tmp_path, {"responses": [{"ddtree_tb2": res}], "block_size": 4, "args": {}}))
    rec = b.get("0", "ddtree_tb2")
    assert rec.trees == [{"tokens": [3, 4, 9], "parents": [-1, 0, 0]}]


@pytest.mark.parametrize("obj,msg", [
    ([1, 2], "top level must be a dict with 'responses'"),
    ({"responses": {"a": 1}}, "'responses' must be a list"),
    ({"responses": [{"eagle": _ns()}]}, "unknown method key 'eagle'"),
    ({"responses": [{"dflash": _ns(num_output_tokens=7)}]}, "neither num_input_tokens"),
    ({"responses": [{"dflash": types.SimpleNamespace(output_ids=torch.tensor([[1]]))}]}, "lacks field"),
    ({"responses": [{"dflash": _ns(round_trees=[{"nodes": [1]}])}]}, "unknown tree shape"),
    ({"responses": [{"dflash": _ns(round_trees=[None, None])}]}, "round_trees has 2 rounds"),
    ({"responses": [{"dflash": _ns(stage_times=[1.0])}]}, "stage_times must be a dict"),
    ({"responses": [{"dflash": _ns(output_ids=torch.tensor([[1, 2, 3, 4, 5]] * 2))}]}, "batch 2"),
])
def test_import_rejects_unknown_shapes(tmp_path, obj, msg):
    with pytest.raises(ValueError, match=msg):
        import_reference(_save(tmp_path, obj))


class _Evil:  # not allowed by the safe unpickler
    pass


def test_import_refuses_arbitrary_pickles_unless_trusted(tmp_path):
    p = _save(tmp_path, {"responses": [{"dflash": _ns()}], "extra": _Evil()})
    with pytest.raises(ValueError, match="weights_only=True.*trust_pickle"):
        import_reference(p)
    assert import_reference(p, trust_pickle=True).get("0", "dflash").output_ids == [3, 4, 5]
    with pytest.raises(ValueError, match="does not exist"):
        import_reference(tmp_path / "nope.pt")


def test_baseline_rejects_duplicates():
    with pytest.raises(ValueError, match="duplicate"):
        Baseline(_header(), [_record(), _record()])


# The reference's own tree traces (`ddtree_generate(..., save_tree_traces=True)`): per round
# {"accepted_indices": [0, ...], "tree": {"node_token_ids", "node_depths", "parents"}}, draft nodes without the root,
# parents with the root's entry. Hand-written: prompt [5, 6, 7], max_new_tokens 6, block size 4. Round 0 hangs from
# 10 and accepts 11, 12 (bonus 13); round 1 hangs from 13 and accepts 14 (bonus 15): the output is then exactly full,
# and the reference loop runs round 2 anyway (its root sits below prompt + max_new_tokens) and records it.
def _trace(tokens, parents, depths, accepted):
    return {"accepted_indices": accepted, "tree": {"node_token_ids": tokens, "node_depths": depths, "parents": parents}}


def _trace_file(tmp_path, **changes):
    trees = [_trace([11, 20, 12, 21], [-1, 0, 0, 1, 1], [1, 1, 2, 2], [0, 1, 3]),
             _trace([14, 30], [-1, 0, 1], [1, 2], [0, 1]),
             _trace([16, 17], [-1, 0, 1], [1, 2], [0, 1, 2])]
    ddtree = dict(output_ids=torch.tensor([[5, 6, 7, 10, 11, 12, 13, 14, 15]]), num_input_tokens=3,
                  num_output_tokens=6, time_to_first_token=0.01, time_per_output_token=0.002,
                  acceptance_lengths=[3, 2, 3], decode_rounds=3,
                  stage_times={"draft": 0.1, "tree_build": 0.01, "verify": 0.2, "commit": 0.01},
                  round_timestamps=[0.1, 0.2, 0.3], round_trees=trees)
    ddtree.update(changes)
    plain = dict(output_ids=torch.tensor([[5, 6, 7, 10, 11, 12, 13, 14, 15]]), num_input_tokens=3,
                 num_output_tokens=6, acceptance_lengths=[1] * 6)
    obj = {"responses": [{"baseline": types.SimpleNamespace(**plain), "ddtree_tb4": types.SimpleNamespace(**ddtree)}],
           "block_size": 4, "draft_attn_implementation": "flash_attention_2", "target_attn_implementation": "sdpa",
           "args": {"model_name_or_path": "t", "draft_name_or_path": "d", "dataset": "humaneval",
                    "max_new_tokens": 6, "temperature": 0.0, "tree_budget": "4"}}
    return _save(tmp_path, obj, "trace.pt")


def test_import_reference_tree_traces(tmp_path):
    from sglang_ddtree.baseline import prompt_sha256, tree_hash
    from sglang_ddtree.compare import compare

    b = import_reference(_trace_file(tmp_path))
    rec = b.get("0", "ddtree_tb4")
    assert rec.output_ids == [10, 11, 12, 13, 14, 15] and rec.prompt_sha256 == prompt_sha256([5, 6, 7])
    assert rec.trees[0] == {"tokens": [10, 11, 20, 12, 21], "parents": [-1, 0, 0, 1, 1], "depths": [0, 1, 1, 2, 2],
                            "accepted": [0, 1, 3]}
    assert rec.trees[1]["tokens"] == [13, 14, 30] and rec.trees[1]["accepted"] == [0, 1]
    # the extra final round is recognised, kept aside and not counted
    assert rec.accept_lengths == [3, 2] and len(rec.trees) == 2
    assert rec.extra["reference_extra_final_round"]["accept_length"] == 3
    assert rec.extra["reference_extra_final_round"]["tree_hash"] == tree_hash([15, 16, 17], [-1, 0, 1])
    assert rec.tree_hashes == [tree_hash(t["tokens"], t["parents"]) for t in rec.trees]
    plain = b.get("0", "plain")
    assert plain.accept_lengths == [1] * 5 and "reference_extra_final_round" in plain.extra
    # honest metadata: the file does not say dtype or device
    assert b.header.dtype is None and b.header.device is None
    assert b.header.extra["reference_extra_final_rounds"] == 2
    given = import_reference(_trace_file(tmp_path), dtype="torch.bfloat16", device="cuda")
    assert (given.header.dtype, given.header.device) == ("bfloat16", "cuda")
    # our record of the same prompt under another name pairs by the prompt's tokens
    ours = MethodRecord(prompt_id="HumanEval/0", method="ddtree_tb4", output_ids=rec.output_ids,
                        num_input_tokens=3, prompt_sha256=prompt_sha256([5, 6, 7]), accept_lengths=[3, 2],
                        tree_hashes=[tree_hash([10, 20, 11, 21, 12], [-1, 0, 0, 2, 2]),  # same tree, other order
                                     rec.tree_hashes[1]])
    rep = compare(b, Baseline(_header(max_new_tokens=6, block_size=4), [ours]), methods=["ddtree_tb4"])
    m = rep["methods"]["ddtree_tb4"]
    assert rep["passed"] and m["matched_by"] == "prompt token hash" and m["tree_rounds_compared"] == 2
    assert m["tree_difference_counts"] == {}
    ours.tree_hashes[1] = tree_hash([13, 14, 31], [-1, 0, 1])
    bad = compare(b, Baseline(_header(dtype=None, max_new_tokens=6, block_size=4), [ours]), methods=["ddtree_tb4"])
    assert bad["methods"]["ddtree_tb4"]["tree_difference_counts"] == {"unknown": 1}  # hash only: not called noise


@pytest.mark.parametrize("changes,msg", [
    ({"round_trees": [_trace([11], [-1, 0], [1], [0, 1, 2])] * 3}, "not a path from the root"),
    ({"round_trees": [_trace([11, 20, 12, 21], [-1, 0, 0, 1, 1], [1, 1, 3, 2], [0, 1, 3])] * 3}, "depths disagree"),
    ({"round_trees": [_trace([11, 20, 99, 21], [-1, 0, 0, 1, 1], [1, 1, 2, 2], [0, 1, 3])] * 3}, "not the output's"),
    ({"round_trees": [_trace([11, 12], [-1, 0, 1], [1, 2], [0, 1, 2])] + [None] * 2,
      "acceptance_lengths": [2, 2, 3]}, "accepted indices but the round's acceptance length is 2"),
])
def test_import_rejects_inconsistent_tree_traces(tmp_path, changes, msg):
    with pytest.raises(ValueError, match=msg):
        import_reference(_trace_file(tmp_path, **changes))
