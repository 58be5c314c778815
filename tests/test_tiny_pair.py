"""The committed tiny pair (models/tiny) is complete, intact and actually trained; the trainer works end to end.

Missing model files FAIL these tests on purpose: the pair is committed (run scripts/build_corpus.py then
scripts/train_tiny_pair.py on a GPU to recreate it).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sglang_ddtree import tiny
from sglang_ddtree.drafter import (
    DrafterCache, DrafterConfig, draft_block_logits, target_context_features,
)

REPO = Path(__file__).resolve().parent.parent
LOG_PATH = tiny.tiny_dir() / "training_log.json"


@pytest.fixture(autouse=True)
def _one_thread():
    # Small matrices: extra intra-op threads only add latency on 2-core CI machines.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def log():
    assert LOG_PATH.is_file(), f"{LOG_PATH} is missing: run scripts/train_tiny_pair.py and commit models/tiny."
    data = json.loads(LOG_PATH.read_text())
    assert data["status"] == "done", f"training did not finish: status={data['status']!r} {data.get('error', '')}"
    return data


@pytest.fixture(scope="module")
def tokenizer():
    return tiny.load_tokenizer()


@pytest.fixture(scope="module")
def target():
    return tiny.load_target(device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def drafter():
    return tiny.load_drafter(device="cpu", dtype=torch.float32)


def test_files_match_the_training_log(log):
    # Catches partial writes, Git LFS pointers and weights swapped without retraining.
    assert log["files"], "training_log.json lists no files"
    for rel, meta in log["files"].items():
        path = tiny.tiny_dir() / rel
        assert path.is_file(), f"{path} is missing"
        assert path.stat().st_size == meta["bytes"], f"{path} has the wrong size"
        assert tiny.sha256_file(path) == meta["sha256"], f"{path} differs from what training wrote"
    assert {"target/config.json", "target/model.safetensors", "drafter/config.json",
            "drafter/model.safetensors"} <= set(log["files"])
    total = sum(f.stat().st_size for f in tiny.tiny_dir().rglob("*") if f.is_file())
    assert total <= 40 * 2**20, f"models/tiny is {total / 2**20:.1f} MiB, over the 40 MiB budget"
    # The target ships the same tokenizer as models/tiny/tokenizer (SGLang loads it from the model path).
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert tiny.sha256_file(tiny.tiny_dir() / "target" / name) == tiny.sha256_file(
            tiny.tiny_dir() / "tokenizer" / name)


def test_missing_files_fail_loudly(tmp_path):
    with pytest.raises(FileNotFoundError, match="train_tiny_pair"):
        tiny.load_target(tmp_path)
    with pytest.raises(FileNotFoundError, match="train_tiny_pair"):
        tiny.load_drafter(tmp_path)
    with pytest.raises(FileNotFoundError, match="build_corpus"):
        tiny.load_tokenizer(tmp_path)


def test_tokenizer_and_configs_agree(tokenizer, target, drafter):
    text = 'def f(x):\n    return {"a": x ** 2}  # note\n\tpass\n'
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text) / 1.5  # BPE merges learned on code, not raw bytes
    assert tokenizer.eos_token == tiny.EOS_TOKEN and tokenizer.eos_token_id == 0
    assert tokenizer.mask_token == tiny.MASK_TOKEN
    cfg = drafter.config
    assert tokenizer.convert_tokens_to_ids(cfg.mask_token) == cfg.mask_token_id == tokenizer.mask_token_id
    assert len(tokenizer) == target.config.vocab_size == cfg.vocab_size
    assert cfg.hidden_size == target.config.hidden_size
    assert cfg.num_target_layers == target.config.num_hidden_layers
    assert all(0 <= k < cfg.num_target_layers - 1 for k in cfg.target_layer_ids)
    assert cfg.block_size == 16
    assert target.config.tie_word_embeddings
    raw = json.loads((tiny.tiny_dir() / "drafter" / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and DrafterConfig.from_json(raw) == cfg
    # Served dtype: both checkpoints are bf16.
    from safetensors import safe_open

    for sub in ("target", "drafter"):
        with safe_open(str(tiny.tiny_dir() / sub / "model.safetensors"), "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}


def manual_greedy(model, ids, n):
    x = torch.tensor([ids])
    out, margins = [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=x, use_cache=False).logits[0, -1]
            top = logits.topk(2)
            out.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            x = torch.cat([x, top.indices[:1][None]], dim=1)
    return out, margins


def agree_until_tie(a, b, margins, eps=1e-3):
    """a == b up to the first step whose top-1/top-2 margin is too small to call."""
    for i, (x, y) in enumerate(zip(a, b)):
        if margins[i] < eps:
            return i
        assert x == y, f"greedy token {i} differs: {x} vs {y}"
    return len(a)


def test_target_greedy_is_reproducible(log, tokenizer, target):
    ref = log["greedy_reference"]
    ids = tokenizer(ref["prompt"], add_special_tokens=False)["input_ids"]
    assert ids == ref["prompt_ids"]
    n = len(ref["tokens"])
    manual, margins = manual_greedy(target, ids, n)
    # Same weights + same prompt => the greedy tokens recorded right after training.
    checked = agree_until_tie(manual, ref["tokens"], [min(a, b) for a, b in zip(margins, ref["margins"])])
    assert checked >= 8, "greedy reference is too close to ties to check anything"
    # transformers' KV-cached generate agrees with the cache-free argmax loop.
    gen = target.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    agree_until_tie(gen[0, len(ids):].tolist(), manual, margins)
    # A trained code model does not just repeat one token.
    assert len(set(manual)) >= 4


def test_target_heldout_perplexity(log, tokenizer, target):
    logged = log["target"]["heldout_ppl"]
    assert 1.0 < logged < 40.0, f"logged held-out ppl {logged} is not that of a trained model (vocab 4096)"
    sample = tiny.heldout_sample(tokenizer)
    assert len(sample) >= 2, "too few held-out stdlib files found on this interpreter"
    res = tiny.sample_perplexity(target, sample)
    # Same text as measured after training (same file hashes) => same number up to float noise.
    ref = {f["path"]: f for f in log["stdlib_sample"]["files"]}
    same = [s["path"] for s in sample if s["path"] in ref and ref[s["path"]]["sha256"] == s["sha256"]]
    for path in same:
        assert math.isclose(res["per_file"][path], ref[path]["ppl"], rel_tol=2e-3), path
    # Held-out code from this interpreter: a few files, so it varies by file (the GPU run measured 18.8 on its 3.12
    # stdlib sample against 6.8 on the 632k-token held-out split); a trained model stays far below a unigram
    # model of code (hundreds) and chance (4096), a broken or random one does not.
    assert res["ppl"] < 60.0, (res, logged)


def chain_agreement(tokenizer, target, drafter, n_new=48, prompt_len=48, stride=4):
    """Drafter top-1 vs the target's greedy continuation on held-out prompts, through the offline cache API."""
    cfg = drafter.config
    B = cfg.block_size
    embed, lm_head = target.get_input_embeddings(), target.lm_head
    accepted, first_hits, blocks = [], 0, 0
    for item in tiny.heldout_sample(tokenizer, n_files=3):
        prompt = torch.tensor([item["ids"][:prompt_len]])
        with torch.no_grad():
            seq = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n_new,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)
            hs = target(input_ids=seq, output_hidden_states=True, use_cache=False).hidden_states
            ctx = drafter.project_context(target_context_features(hs, cfg.target_layer_ids))
        T = seq.shape[1]
        for p in range(prompt_len, T - B + 1, stride):
            cache = DrafterCache(drafter, 1, "cpu", torch.float32)
            cache.append(ctx[:, :p], torch.arange(p)[None])
            logits = draft_block_logits(drafter, cache, seq[:, p], torch.tensor([p]), embed, lm_head)
            assert logits.shape == (1, B - 1, cfg.vocab_size)
            hit = (logits[0].argmax(-1) == seq[0, p + 1:p + B]).int()
            accepted.append(int(hit.cumprod(0).sum()))
            first_hits += int(hit[0])
            blocks += 1
    return blocks, first_hits / blocks, 1.0 + sum(accepted) / blocks


def test_drafter_predicts_the_target(log, tokenizer, target, drafter):
    blocks, top1, accept_len = chain_agreement(tokenizer, target, drafter)
    assert blocks >= 12
    # Chance is ~1/4096 per position; an untrained drafter accepts ~nothing.
    assert top1 >= 0.3, f"depth-1 agreement {top1:.3f}"
    assert accept_len >= 1.5, f"mean accepted length {accept_len:.3f}"
    # The training log's estimate is of the same quantity (other prompts, bf16): same ballpark.
    logged = log["acceptance"]["mean_accept_len_per_anchor"]
    assert accept_len >= 0.5 * logged, (accept_len, logged)


@pytest.mark.slow
def test_trainer_smoke_end_to_end(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    corpus, out = tmp_path / "corpus", tmp_path / "models"
    subprocess.run([sys.executable, str(REPO / "scripts" / "build_corpus.py"), "--out", str(corpus),
                    "--tokenizer-out", "", "--max-files", "80", "--vocab-size", "512"],
                   check=True, env=env, capture_output=True, timeout=120)
    manifest = json.loads((corpus / "manifest.json").read_text())
    assert manifest["tokens"]["train"] > 10_000 and manifest["tokens"]["heldout"] > 500
    assert manifest["mask_token_id"] == 1 and manifest["eos_token_id"] == 0
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "train_tiny_pair.py"), "--smoke", "--device", "cpu",
                           "--data", str(corpus), "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["status"] == "done" and summary["target_steps"] > 0 and summary["drafter_steps"] > 0
    log = json.loads((out / "training_log.json").read_text())
    assert log["status"] == "done"
    assert log["target"]["loss_curve"] and log["drafter"]["loss_curve"]
    # The smoke pair loads through the same API as the committed one.
    tok = tiny.load_tokenizer(out / "target")
    model = tiny.load_target(out / "target")
    d = tiny.load_drafter(out / "drafter")
    assert d.config.mask_token_id == tok.mask_token_id and d.config.vocab_size == model.config.vocab_size
    cache = DrafterCache(d, 1, "cpu", torch.float32)
    hs = model(input_ids=torch.tensor([[5, 6, 7, 8]]), output_hidden_states=True).hidden_states
    cache.append(d.project_context(target_context_features(hs, d.config.target_layer_ids)), torch.arange(4)[None])
    logits = draft_block_logits(d, cache, torch.tensor([9]), torch.tensor([4]), model.get_input_embeddings(),
                                model.lm_head)
    assert logits.shape == (1, d.config.block_size - 1, model.config.vocab_size)
    for rel, meta in log["files"].items():
        assert tiny.sha256_file(out / rel) == meta["sha256"]
