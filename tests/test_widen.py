"""The widened pair computes what the tiny pair computes (float32, CPU), at exactly the shapes it claims."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch

from sglang_ddtree import widen
from sglang_ddtree.tiny import tiny_dir
from fixtures.offline_models import block_logits
from sglang_ddtree.drafter import DFlashDrafter

transformers = pytest.importorskip("transformers")

SMALL_VOCAB = 4096


@pytest.fixture(scope="module")
def medium(tmp_path_factory):
    out = tmp_path_factory.mktemp("medium")
    info = widen.widen_pair(tiny_dir(), widen.SHAPES["medium"], out, log=lambda *_: None)
    return out, info


@pytest.fixture(scope="module")
def models(medium):
    out, _ = medium
    load = transformers.AutoModelForCausalLM.from_pretrained
    small = load(str(tiny_dir() / "target"), dtype=torch.float32).eval()
    big = load(str(out / "target"), dtype=torch.float32).eval()
    return small, big


def test_qwen3_8b_shape_has_exactly_the_real_parameter_counts():
    big = widen.SHAPES["qwen3-8b"]
    # Qwen3-8B (untied lm_head) and the z-lab Qwen3-8B DFlash drafter
    assert widen.param_count(widen.target_shapes(big)) == 8_190_735_360
    assert widen.param_count(widen.drafter_shapes(big)) == 1_048_626_432
    t, d = widen.big_configs(tiny_dir(), big)
    assert (t["hidden_size"], t["num_hidden_layers"], t["num_attention_heads"], t["num_key_value_heads"],
            t["head_dim"], t["intermediate_size"], t["vocab_size"], t["tie_word_embeddings"]) == (
        4096, 36, 32, 8, 128, 12288, 151936, False)
    assert d["dflash_config"]["target_layer_ids"] == [1, 9, 17, 25, 33] and d["num_hidden_layers"] == 5
    assert t["rope_theta"] == 10000.0 ** 2 and t["rms_norm_eps"] == 1e-6 / 16


def test_meta_placements_keep_the_drafter_features():
    plan = widen.plan_pair(tiny_dir(), widen.SHAPES["qwen3-8b"])
    live = plan["target_live_layers"]
    big_ids = widen.SHAPES["qwen3-8b"].drafter_layer_ids
    assert len(live) == 6 and live == sorted(set(live)) and live[-1] <= 35
    # small feature layer s is read at big layer b: s's big layer is b, the next live layer comes after b
    for s, block in zip(plan["small_feature_ids"], plan["feature_blocks"]):
        assert live[s] == big_ids[block] and (s + 1 == len(live) or live[s + 1] > big_ids[block])


def test_layer_map_refuses_what_cannot_fit():
    assert widen.layer_map(3, 5, {}) == [1, 2, 4]
    with pytest.raises(ValueError):
        widen.layer_map(4, 6, {3: 2})


def test_scales_refuse_shapes_that_cannot_be_exact():
    with pytest.raises(ValueError, match="twice"):
        widen.scales_for(256, 4096, 64, 64, 1e-6)
    with pytest.raises(ValueError, match="power of 4"):
        widen.scales_for(256, 2048, 64, 128, 1e-6)


def test_widened_logits_equal_the_tiny_models(models):
    small, big = models
    torch.manual_seed(0)
    ids = torch.randint(3, SMALL_VOCAB, (2, 160))
    with torch.no_grad():
        a, b = small(ids).logits, big(ids).logits
    assert b.shape[-1] == widen.SHAPES["medium"].vocab
    rel = ((a - b[..., :SMALL_VOCAB]).abs().max() / a.abs().max()).item()
    assert rel <= 1e-4, rel
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    # padded vocabulary rows never win and carry no probability
    assert b[..., SMALL_VOCAB:].max() < a.min() - 100


def test_widened_greedy_generation_is_identical(models):
    small, big = models
    ids = torch.tensor([[5, 17, 99, 1024, 7, 301, 2048, 11], [9, 8, 7, 6, 5, 4, 3, 2]])
    kw = dict(max_new_tokens=40, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(small.generate(ids, **kw), big.generate(ids, **kw))


def test_widened_drafter_block_logits_equal_the_tiny_drafters(medium, models):
    out, _ = medium
    small, big = models
    ds = DFlashDrafter.from_pretrained(tiny_dir() / "drafter")
    db = DFlashDrafter.from_pretrained(out / "drafter")
    torch.manual_seed(1)
    ids = torch.randint(3, SMALL_VOCAB, (2, 120))
    ls, lb = block_logits(small, ds, ids, 100), block_logits(big, db, ids, 100)
    rel = ((ls - lb[..., :SMALL_VOCAB]).abs().max() / ls.abs().max()).item()
    assert rel <= 1e-4, rel
    assert torch.equal(ls.argmax(-1), lb.argmax(-1))
    assert lb[..., SMALL_VOCAB:].max() < ls.min() - 100


def test_widening_is_deterministic_and_marked_built(medium, tmp_path):
    out, _ = medium
    assert widen.is_built(out, widen.SHAPES["medium"])
    assert not widen.is_built(out, widen.SHAPES["qwen3-8b"])
    again = tmp_path / "again"
    widen.widen_pair(tiny_dir(), widen.SHAPES["medium"], again, log=lambda *_: None)
    for sub in ("target", "drafter"):
        digest = [hashlib.sha256((d / sub / "model.safetensors").read_bytes()).hexdigest() for d in (out, again)]
        assert digest[0] == digest[1]
    configs_only = tmp_path / "configs"
    widen.write_configs(tiny_dir(), widen.SHAPES["medium"], configs_only)
    assert not widen.is_built(configs_only, widen.SHAPES["medium"])


def test_cli_meta_prints_counts(capsys):
    assert widen.main(["--shape", "qwen3-8b", "--meta"]) == 0
    assert "8190735360" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        widen.main(["--shape", "qwen3-8b"])  # --out missing


def test_shapes_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        widen.SHAPES["medium"].hidden = 1
