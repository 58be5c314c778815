"""The offline runner and the `offline` / `compare` / `import-reference` subcommands, end to end on saved random
models (local folders, no downloads): progress, resume, header metadata."""

from __future__ import annotations

import argparse
import json

import pytest

from fixtures.offline_models import OracleDraft, one_thread, random_dflash, random_target
from sglang_ddtree.baseline import BaselineHeader, BaselineWriter, read_baseline
from sglang_ddtree.offline import runner
from sglang_ddtree.offline.cli_commands import add_compare_parser, add_import_parser, add_offline_parser
from sglang_ddtree.offline.runner import PromptInput, RunSettings, expand_methods, run_offline


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    with one_thread():
        yield


def test_expand_methods():
    assert expand_methods(["plain", "ddtree", "dflash"], [16, 4]) == ["plain", "ddtree_tb16", "ddtree_tb4", "dflash"]
    assert expand_methods(["ddtree_tb8", "ddtree"], [8]) == ["ddtree_tb8"]
    with pytest.raises(ValueError, match="needs --budgets"):
        expand_methods(["ddtree"], [])
    with pytest.raises(ValueError, match="unknown method"):
        expand_methods(["eagle"], [4])
    with pytest.raises(ValueError, match=">= 1"):
        runner.parse_int_list("16,0", "--budgets")


def test_run_offline_resumes(tmp_path, monkeypatch):
    target = random_target(seed=4)
    settings = RunSettings(methods=["plain", "ddtree_tb8"], max_new_tokens=10)
    prompts = [PromptInput(f"p{i}", i, [5 + i, 7, 9]) for i in range(3)]
    header = BaselineHeader(source="offline", target={"path": None, "fingerprint": "x"}, max_new_tokens=10)
    path = tmp_path / "run.jsonl"
    with BaselineWriter(path, header) as w:
        run_offline(target, OracleDraft(target), prompts[:2], settings, w, progress=False)
    before = path.read_text()
    calls = []
    real = runner.decode_one
    monkeypatch.setattr(runner, "decode_one", lambda *a: calls.append(a[2].id) or real(*a))
    with BaselineWriter(path, header) as w:
        taus = run_offline(target, OracleDraft(target), prompts, settings, w, progress=True)
    assert calls == ["p2", "p2"]  # only the new prompt's two methods ran
    assert path.read_text().startswith(before)
    b = read_baseline(path)
    assert len(b.records) == 6 and b.prompt_ids() == ["p0", "p1", "p2"]
    assert taus["ddtree_tb8"]["rounds"] == len(b.get("p2", "ddtree_tb8").accept_lengths)


def _char_tokenizer(vocab_size: int):
    """A character-level fast tokenizer with ids < vocab_size (id 0 = eos, 1 = mask, 2 = unk)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = "abcdefghijklmnopqrstuvwxyz0123456789 ()=+-*:,.\n_"[: vocab_size - 3]
    vocab = {"<eos>": 0, "<mask>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    target = random_target(seed=6)
    target.generation_config.eos_token_id = None
    target.save_pretrained(root / "target")
    tok = _char_tokenizer(target.config.vocab_size)
    tok.save_pretrained(root / "target")
    random_dflash(target, seed=8, block_size=8).save_pretrained(root / "drafter")
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"def f{i}(x):\n    return"}) + "\n"
                            for i in range(3)))
    return root


def _cli(sub_adder, argv):
    parser = argparse.ArgumentParser()
    sub_adder(parser.add_subparsers())
    args = parser.parse_args([str(a) for a in argv])
    return args.func(args)


def test_offline_command_end_to_end(model_dirs, tmp_path, capsys):
    out = tmp_path / "b.jsonl"
    argv = ["offline", "--target", model_dirs / "target", "--drafter", model_dirs / "drafter", "--dataset", "jsonl",
            "--dataset-path", model_dirs / "prompts.jsonl", "--methods", "plain,dflash,ddtree", "--budgets", "4,16",
            "--max-new-tokens", 12, "--device", "cpu", "--record-trees", "--out", out, "--no-progress"]
    assert _cli(add_offline_parser, argv + ["--limit", 2]) == 0
    b = read_baseline(out)
    assert b.methods == ["plain", "dflash", "ddtree_tb4", "ddtree_tb16"] and b.prompt_ids() == ["q0", "q1"]
    h = b.header
    assert h.source == "offline" and h.block_size == 8 and h.dtype == "float32" and h.max_new_tokens == 12
    assert h.target["fingerprint"] and h.drafter["fingerprint"] and h.versions["transformers"]
    for pid in ("q0", "q1"):  # lossless at T=0
        plain = b.get(pid, "plain").output_ids
        assert all(b.get(pid, m).output_ids == plain for m in b.methods)
        assert b.get(pid, "ddtree_tb16").trees is not None
    assert _cli(add_offline_parser, argv) == 0  # resume: adds q2 only
    assert read_baseline(out).prompt_ids() == ["q0", "q1", "q2"]
    assert _cli(add_offline_parser, argv[:-4] + ["--temperature", "0.5", "--out", out]) == 2
    assert "cannot resume" in capsys.readouterr().err
    assert _cli(add_compare_parser, ["compare", out, out, "--noise-margin", "1e-4", "--min-match-rate", "1"]) == 0
    assert _cli(add_offline_parser, ["offline", "--target", tmp_path / "none", "--out", out]) == 2
    assert _cli(add_offline_parser, ["offline", "--target", model_dirs / "target", "--dataset", "gsm8k",
                                     "--dataset-path", tmp_path / "none.jsonl", "--out", out]) == 2


def test_import_reference_command(tmp_path):
    from pathlib import Path

    ref = Path(__file__).parent / "fixtures" / "reference_small.pt"
    out = tmp_path / "imported.jsonl"
    assert _cli(add_import_parser, ["import-reference", ref, "--out", out, "--dataset", "humaneval"]) == 0
    b = read_baseline(out)
    assert b.header.dataset == "humaneval" and len(b.records) == 12
    assert _cli(add_import_parser, ["import-reference", tmp_path / "x.pt", "--out", out]) == 2
