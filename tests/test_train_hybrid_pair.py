"""scripts/train_tiny_pair.py --target-arch qwen3_5_text: the hybrid pair trains end to end on CPU (--smoke), saves a
Qwen3.5 text target that transformers loads (and SGLang's config reads) and a DFlash drafter on its features, and the
saved pair is one sglang_ddtree.widen_hybrid widens bf16-exactly to Qwen3.5-27B. The widening is only planned here
(the 27B checkpoint is 57 GB); tests/test_widen_hybrid.py checks that a widened pair computes what the small one does.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sglang_ddtree import widen_hybrid as wh
from sglang_ddtree.drafter import DFlashDrafter, DrafterCache, draft_block_logits, target_context_features
from sglang_ddtree.tiny import sha256_file

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parent.parent
BIG = wh.HYBRID_SHAPES["qwen3.5-27b"]
LINEAR, FULL = "linear_attention", "full_attention"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", REPO / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def trainer():
    return load_script("train_tiny_pair")


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """One --smoke run of the hybrid arch on an 80-file stdlib corpus (vocab 512): (out dir, summary)."""
    tmp = tmp_path_factory.mktemp("hybrid_pair")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    corpus, out = tmp / "corpus", tmp / "models"
    subprocess.run([sys.executable, str(REPO / "scripts" / "build_corpus.py"), "--out", str(corpus),
                    "--tokenizer-out", "", "--max-files", "80", "--vocab-size", "512"],
                   check=True, env=env, capture_output=True, timeout=120)
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "train_tiny_pair.py"), "--smoke", "--device", "cpu",
                           "--target-arch", "qwen3_5_text", "--data", str(corpus), "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def saved(smoke_run):
    out = smoke_run[0]
    target = transformers.AutoModelForCausalLM.from_pretrained(str(out / "target"), dtype=torch.float32).eval()
    drafter = DFlashDrafter.from_pretrained(out / "drafter").eval()
    return target, drafter


# ------------------------------------------------------------------------------------------------ without training


def test_hybrid_defaults_widen_exactly_and_dense_defaults_are_unchanged(trainer):
    args = trainer.parse_args(["--target-arch", "qwen3_5_text"])
    assert Path(args.out).name == "tiny-hybrid" and args.widen_shape == "qwen3.5-27b" and args.target_batch == 32
    config = trainer.tiny_targets.target_config(args, 4096, 0)  # the committed corpus's vocab, eos 0
    assert config.layer_types == ([LINEAR] * 3 + [FULL]) * 2
    result = trainer.check_widening(args, config, mask_id=1)
    assert result["scales"]["bf16_exact"] and result["small_feature_ids"] == [1, 3, 6]
    assert [BIG.layer_types[b] for b in result["target_live_layers"]] == config.layer_types
    # the committed dense pair's command still means what it meant
    dense = trainer.parse_args([])
    assert (dense.target_arch, dense.hidden, dense.layers, dense.head_dim, dense.intermediate, dense.target_batch) == \
        ("qwen3", 256, 6, 64, 768, 128)
    assert Path(dense.out).name == "tiny" and dense.widen_shape is None and dense.drafter_heads is None
    assert trainer.parse_args(["--smoke"]).hidden == 64


def test_committed_plan_configs_are_what_the_trainer_saves(trainer, tmp_path):
    """benchmarks/configs/tiny-hybrid (what setups tiny-hybrid / 27b-hybrid plan from before the pair is trained on
    the device) equals the trainer's --configs-only output for its default hybrid run, and that output equals what a
    run saves (the same config objects; save_target's extra serving keys included)."""
    committed = REPO / "benchmarks" / "configs" / "tiny-hybrid"
    argv = ["--target-arch", "qwen3_5_text", "--device", "cpu", "--data", str(tmp_path / "no-corpus")]
    assert trainer.main(argv + ["--configs-only", "--out", str(tmp_path / "pair")]) == 0
    for sub in ("target", "drafter"):
        mine = json.loads((tmp_path / "pair" / sub / "config.json").read_text())
        theirs = json.loads((committed / sub / "config.json").read_text())
        mine.pop("transformers_version", None), theirs.pop("transformers_version", None)
        assert mine == theirs, sub
    args = trainer.parse_args(argv)
    target, drafter = trainer.pair_configs(args, 4096, 0, 1)
    config = trainer.tiny_targets.target_config(args, 4096, 0)
    model = trainer.tiny_targets.build_target(config).to(torch.bfloat16)
    model.config.use_cache = True
    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert dict(saved, **trainer.tiny_targets.serving_config_keys(model.config)) == target
    assert drafter == trainer.make_drafter_config(args, config, 1).to_json()
    assert drafter["dflash_config"]["target_layer_ids"] == [1, 3, 6] and target["layer_types"] == config.layer_types


@pytest.mark.parametrize("extra, match", [
    (["--hidden", "256"], "inexactly in bf16"),                  # 5120 / 256 = 20: not a power of 4
    (["--head-dim", "32"], "inexactly in bf16"),                 # 256 / 32 = 8: sqrt(8) scales
    (["--drafter-head-dim", "64"], "inexactly in bf16"),         # 128 / 64 = 2
    (["--heads", "14", "--kv-heads", "2"], "full-attention heads"),  # 7 q heads per kv head, the 27B has 6
    (["--linear-value-heads", "8"], "linear-attention heads"),   # 4 value heads per key head, the 27B has 3
    (["--conv-kernel", "3"], "conv kernel"),
])
def test_a_pair_that_would_not_widen_is_refused_before_training(trainer, extra, match):
    args = trainer.parse_args(["--target-arch", "qwen3_5_text", *extra])
    config = trainer.tiny_targets.target_config(args, 4096, 0)
    with pytest.raises(ValueError, match=match):
        trainer.check_widening(args, config, mask_id=1)
    args = trainer.parse_args(["--target-arch", "qwen3_5_text", "--widen-shape", "none", *extra])
    assert trainer.check_widening(args, config, mask_id=1) is None


def test_hybrid_options_are_refused_for_the_dense_arch(trainer):
    with pytest.raises(ValueError, match="only for --target-arch qwen3_5_text"):
        trainer.parse_args(["--linear-key-heads", "2"])
    with pytest.raises(ValueError, match="only for --target-arch qwen3_5_text"):
        trainer.parse_args(["--widen-shape", "qwen3.5-27b"])


# ------------------------------------------------------------------------------------------------ one smoke run


@pytest.mark.slow
def test_smoke_run_finishes_with_acceptance_numbers(smoke_run):
    out, summary = smoke_run
    assert summary["status"] == "done" and summary["target_arch"] == "qwen3_5_text"
    assert summary["widen_bf16_exact"] is True
    assert summary["target_steps"] > 0 and summary["drafter_steps"] > 0 and summary["greedy_tokens"] > 0
    log = json.loads((out / "training_log.json").read_text())
    assert log["status"] == "done" and log["target"]["class"] == "Qwen3_5ForCausalLM"
    block = log["args"]["block_size"]
    acc = log["acceptance"]
    # 1 + accepted drafts per round: between 1 (nothing accepted) and the block size
    for key in ("mean_accept_len_per_anchor", "mean_accept_len_chain_walk"):
        assert 1.0 <= acc[key] <= block, (key, acc[key])
    assert summary["accept_len_per_anchor"] == acc["mean_accept_len_per_anchor"]
    assert len(acc["top1_match_by_depth"]) == block - 1 and all(0 <= x <= 1 for x in acc["top1_match_by_depth"])
    assert log["drafter"]["heldout_checks"] and log["target"]["loss_curve"] and log["drafter"]["loss_curve"]
    assert {"target/config.json", "target/model.safetensors", "drafter/model.safetensors"} <= set(log["files"])
    for rel, meta in log["files"].items():
        assert sha256_file(out / rel) == meta["sha256"], rel


@pytest.mark.slow
def test_saved_target_is_a_qwen35_hybrid_sglang_can_read(smoke_run, saved, trainer):
    out = smoke_run[0]
    target, _ = saved
    assert type(target).__name__ == "Qwen3_5ForCausalLM" and target.config.model_type == "qwen3_5_text"
    types = [LINEAR] * 3 + [FULL]
    assert list(target.config.layer_types) == types
    for layer, kind in zip(target.model.layers, types):
        assert hasattr(layer, "linear_attn") == (kind == LINEAR) and hasattr(layer, "self_attn") == (kind == FULL)
        assert hasattr(layer.mlp, "gate_proj")  # dense MLP, no experts
    raw = json.loads((out / "target" / "config.json").read_text())
    # SGLang 0.5.17 derives the layer types from full_attention_interval, not from layer_types
    k = raw["full_attention_interval"]
    assert [FULL if (i + 1) % k == 0 else LINEAR for i in range(raw["num_hidden_layers"])] == raw["layer_types"]
    assert raw["architectures"] == ["Qwen3_5ForCausalLM"] and raw["partial_rotary_factor"] == 0.25
    # The drafter's data is the trainer's cached greedy decoding (conv and recurrent states in the transformers
    # cache): it must equal decoding without a cache, one full forward per token.
    prompts = torch.randint(2, target.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    cached = trainer.greedy_generate(target, prompts, 12)
    x = prompts
    with torch.no_grad():
        for _ in range(12):
            x = torch.cat([x, target(input_ids=x, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(cached, x)


@pytest.mark.slow
def test_saved_drafter_reads_the_hybrid_target(saved):
    target, drafter = saved
    cfg = drafter.config
    assert cfg.target_layer_ids == [1, 2] and cfg.num_target_layers == 4 and cfg.head_dim == 128
    assert cfg.hidden_size == target.config.hidden_size and cfg.vocab_size == target.config.vocab_size
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        hs = target(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
        cache = DrafterCache(drafter, 1, "cpu", torch.float32)
        cache.append(drafter.project_context(target_context_features(hs, cfg.target_layer_ids)), torch.arange(5)[None])
        logits = draft_block_logits(drafter, cache, torch.tensor([10]), torch.tensor([5]),
                                    target.get_input_embeddings(), target.lm_head)
    assert logits.shape == (1, cfg.block_size - 1, cfg.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.slow
def test_saved_pair_widens_bf16_exactly_to_qwen35_27b(smoke_run, capsys):
    out = smoke_run[0]
    tcfg = json.loads((out / "target" / "config.json").read_text())
    dcfg = json.loads((out / "drafter" / "config.json").read_text())
    plan = wh.check_hybrid_pair(tcfg, BIG, dcfg)
    assert plan["scales"]["bf16_exact"] and plan["layout"] == "qwen3_5_text"
    live = plan["target_live_layers"]
    assert [BIG.layer_types[b] for b in live] == tcfg["layer_types"] and live == sorted(set(live))
    # each small feature layer is read at a big feature layer after its own big layer and before the next small one
    for s, block in zip(plan["small_feature_ids"], plan["feature_blocks"]):
        read = BIG.drafter_layer_ids[block]
        assert live[s] <= read < (live[s + 1] if s + 1 < len(live) else BIG.layers), (s, read, live)
    # the trainer checked the same plan before training; the CLI prints it without building anything
    log = json.loads((out / "training_log.json").read_text())
    assert log["widening"] == json.loads(json.dumps(plan))
    assert wh.main(["--shape", "qwen3.5-27b", "--small", str(out), "--check"]) == 0
    assert json.loads(capsys.readouterr().out) == log["widening"]
    assert not (out / "big").exists()


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5_text"])
def test_final_norm_gain_is_what_a_qwen3_style_norm_would_hold(trainer, arch):
    """The drafter's final norm (w * x_hat) starts at the target's: for Qwen3.5, whose norm computes (1 + w) * x_hat,
    that is 1 + w."""
    args = trainer.parse_args(["--smoke", "--target-arch", arch])
    target = trainer.tiny_targets.build_target(trainer.tiny_targets.target_config(args, 64, 0))
    norm = target.model.norm
    with torch.no_grad():
        norm.weight.normal_(0.0, 0.5)
        x = torch.randn(3, args.hidden)
        x_hat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + target.config.rms_norm_eps)
        assert torch.allclose(norm(x), trainer.tiny_targets.final_norm_gain(target) * x_hat, rtol=1e-5, atol=1e-6)
