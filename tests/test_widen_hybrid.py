"""The widened hybrid computes what the small gated-delta-net hybrid computes (CPU, float32 and float64), its DFlash
drafter too, and the real shape (Qwen3.5-27B) has the parameter count it claims."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from fixtures.hybrid_models import quiet_single_thread, random_dense_hybrid_target
from fixtures.offline_models import block_logits
from sglang_ddtree import widen_hybrid as wh
from sglang_ddtree.drafter import DFlashDrafter, DrafterConfig

transformers = pytest.importorskip("transformers")

VOCAB = 256
MEDIUM = wh.HYBRID_SHAPES["medium"]
# (layout, key head dim, value head dim): f = 1 (head dims kept, as for the 27B), f = 4 exact in bf16 (key dims x4),
# f = 4 with sqrt(2) scales (both dims x2: exact in float arithmetic only)
VARIANTS = {"qwen3_5-f1": ("qwen3_5_text", 32, 32), "qwen3_next-f4": ("qwen3_next", 8, 32),
            "qwen3_5-f4-inexact-bf16": ("qwen3_5_text", 16, 16)}


@pytest.fixture(scope="module", autouse=True)
def _quiet_single_thread():
    with quiet_single_thread():
        yield


def small_drafter(target, seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    tc = target.config
    cfg = DrafterConfig(hidden_size=tc.hidden_size, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                        intermediate_size=2 * tc.hidden_size, rms_norm_eps=1e-6, rope_theta=10000.0, block_size=8,
                        target_layer_ids=[0, 2], mask_token_id=1, vocab_size=tc.vocab_size,
                        num_target_layers=tc.num_hidden_layers)
    drafter = DFlashDrafter(cfg)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.normal_(0.0, 0.3) if p.dim() == 2 else p.normal_(1.0, 0.3)
    return drafter.eval()


def build_big(cfg: dict, sd: dict, dtype=torch.float32):
    layout = cfg["model_type"]
    if layout == "qwen3_5_text":
        from transformers import Qwen3_5ForCausalLM as M, Qwen3_5TextConfig as C
    else:
        from transformers import Qwen3NextConfig as C, Qwen3NextForCausalLM as M
    kw = {k: v for k, v in cfg.items() if k not in ("widened_from", "architectures", "model_type",
                                                     "transformers_version")}
    config = C(**kw)
    config._attn_implementation = "sdpa"
    model = M(config)
    model.load_state_dict({k: v.to(dtype) for k, v in sd.items()}, strict=True)
    return model.to(dtype).eval()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request):
    layout, dk, dv = VARIANTS[request.param]
    small = random_dense_hybrid_target(layout, seed=0, vocab=VOCAB, key_head_dim=dk, value_head_dim=dv)
    drafter = small_drafter(small)
    dcfg = drafter.config.to_json()
    cfg, sd = wh.widen_hybrid_target(small.config.to_dict(), small.state_dict(), MEDIUM, dcfg=dcfg,
                                     dtype=torch.float64)
    big = build_big(cfg, sd)
    return request.param, small, big, drafter, cfg, sd


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / a.double().abs().max()).item()


def test_widened_hybrid_logits_equal_the_small_models(pair):
    name, small, big, _, cfg, _ = pair
    assert cfg["widened_from"]["scales"]["bf16_exact"] == ("inexact" not in name)
    torch.manual_seed(0)
    ids = torch.randint(3, VOCAB, (2, 150))  # > 2 chunks of the chunked delta rule, every conv window
    with torch.no_grad():
        a, b = small(ids).logits, big(ids).logits
    assert b.shape[-1] == MEDIUM.vocab
    rel = _rel(a, b[..., :VOCAB])
    assert rel <= 1e-4, rel
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    # padded vocabulary rows never win
    assert b[..., VOCAB:].max() < a.min() and b[..., VOCAB:].max() < a.max(-1).values.min() - 50


def test_widened_hybrid_is_exact_in_float64(pair):
    """Float64 weights and activations. transformers still computes the RMSNorms and the delta rule in float32, so
    this shows rounding, not arithmetic: with power-of-two scales (f = 1, or key dims x4) the linear-attention layers'
    outputs are bit-identical and what is left comes from the q/k norms' float32 sums over 64 big dims instead of 16
    (~1e-7); with key and value dims x2, the recurrence's 1 / sqrt(key head dim) differs by sqrt(2) and its float32
    rounding too (~1e-6)."""
    name, small, _, _, cfg, sd = pair
    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (1, 96))
    b64 = build_big(cfg, sd, torch.float64)
    try:
        with torch.no_grad():
            rel = _rel(small.double()(ids).logits, b64(ids).logits[..., :VOCAB])
    finally:
        small.float()
    assert rel <= (1e-5 if "inexact" in name else 1e-6), rel


def test_widened_hybrid_greedy_generation_is_identical(pair):
    """Cached decoding: the one-token recurrent step and the conv-state update, after a prefill."""
    _, small, big, _, _, _ = pair
    ids = torch.tensor([[5, 17, 99, 102, 7, 31, 204, 11], [9, 8, 7, 6, 5, 4, 3, 2]])
    kw = dict(max_new_tokens=32, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(small.generate(ids, **kw), big.generate(ids, **kw))


def test_widened_drafter_block_logits_equal_the_small_drafters(pair):
    _, small, big, ds, _, _ = pair
    dcfg_big, dsd_big = wh.widen_hybrid_drafter(ds.config.to_json(), ds.state_dict(), small.config.to_dict(), MEDIUM,
                                                dtype=torch.float32)
    db = DFlashDrafter(DrafterConfig.from_json(dcfg_big))
    db.load_state_dict(dsd_big, strict=True)
    db.eval()
    assert db.config.target_layer_ids == list(MEDIUM.drafter_layer_ids)
    torch.manual_seed(2)
    ids = torch.randint(3, VOCAB, (2, 90))
    ls, lb = block_logits(small, ds, ids, 80), block_logits(big, db, ids, 80)
    rel = _rel(ls, lb[..., :VOCAB])
    assert rel <= 1e-4, rel
    assert torch.equal(ls.argmax(-1), lb.argmax(-1))
    assert lb[..., VOCAB:].max() < ls.min()


def test_written_bf16_checkpoint_is_the_bf16_small_model(tmp_path):
    """widen_hybrid_pair on saved bf16 files: the big bf16 weights are the small bf16 weights times powers of two,
    so the big checkpoint (read in float32) computes what the small bf16 checkpoint computes; same bytes twice."""
    small = random_dense_hybrid_target("qwen3_5_text", seed=3, vocab=VOCAB)
    small.to(torch.bfloat16).save_pretrained(tmp_path / "small" / "target")
    small_drafter(small).save_pretrained(tmp_path / "small" / "drafter")
    info = wh.widen_hybrid_pair(tmp_path / "small", MEDIUM, tmp_path / "big", log=lambda *_: None)
    assert info["scales"]["bf16_exact"] and info["target_params"] == wh.param_count(wh.hybrid_target_shapes(MEDIUM))
    load = transformers.AutoModelForCausalLM.from_pretrained
    s = load(str(tmp_path / "small" / "target"), dtype=torch.float32).eval()
    b = load(str(tmp_path / "big" / "target"), dtype=torch.float32).eval()
    assert b.config.layer_types == MEDIUM.layer_types and b.config.rms_norm_eps == s.config.rms_norm_eps
    ids = torch.randint(3, VOCAB, (1, 120), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        a, c = s(ids).logits, b(ids).logits
    assert _rel(a, c[..., :VOCAB]) <= 1e-4 and torch.equal(a.argmax(-1), c.argmax(-1))
    DFlashDrafter.from_pretrained(tmp_path / "big" / "drafter")  # loads: names and shapes match its config
    wh.widen_hybrid_pair(tmp_path / "small", MEDIUM, tmp_path / "again", log=lambda *_: None)
    for sub in ("target", "drafter"):
        digest = [hashlib.sha256((d / sub / "model.safetensors").read_bytes()).hexdigest()
                  for d in (tmp_path / "big", tmp_path / "again")]
        assert digest[0] == digest[1]


def test_qwen35_27b_shape_has_the_real_parameter_counts(capsys):
    big = wh.HYBRID_SHAPES["qwen3.5-27b"]
    assert big.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 16
    # counted by hand: embeddings + untied lm_head 2 x 248320 x 5120; 48 GDN layers of 115,876,064 (in_proj_qkv
    # 10240 x 5120, in_proj_z and out_proj 6144 x 5120, b / a 48 x 5120 each, conv 10240 x 4, A_log, dt_bias, norm)
    # and 16 gated-attention layers of 104,858,112 (q_proj 12288 x 5120, k / v 1024 x 5120, o 5120 x 6144, q/k
    # norms), each + MLP 3 x 5120 x 17408 + 2 norms of 5120; final norm 5120
    mlp = 3 * 5120 * 17408 + 2 * 5120
    expected = 2 * 248320 * 5120 + 48 * (115_876_064 + mlp) + 16 * (104_858_112 + mlp) + 5120
    assert wh.param_count(wh.hybrid_target_shapes(big)) == expected == 26_895_998_464
    # the DFlash drafter: 5 layers (q / o 4096 x 5120, k / v 1024 x 5120, MLP, norms) + fc 5 x 5120 -> 5120 + 2 norms
    assert wh.param_count(wh.hybrid_drafter_shapes(big)) == 1_730_213_120
    assert wh.main(["--shape", "qwen3.5-27b", "--meta"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["target_params"] == 26_895_998_464 and out["bf16_gb"] == 57.3


def test_layer_placement_keeps_types_and_drafter_reads():
    small_types = ["linear_attention"] * 3 + ["full_attention"]
    big = wh.HYBRID_SHAPES["qwen3.5-27b"]
    live = wh.typed_layer_map(small_types, big.layer_types, {0: 1, 2: 46})
    assert [big.layer_types[b] for b in live] == small_types
    assert live[0] <= 1 < live[1] and live[2] <= 46 < live[3]
    with pytest.raises(ValueError):  # a full-attention small layer cannot be read before big layer 3
        wh.typed_layer_map(["full_attention", "linear_attention"], big.layer_types, {0: 1})


def test_head_slots_keep_rotary_pairs():
    prim, copies = wh.head_slots(16, 64, 4, 16)  # rotary 4 -> 16: small pair i -> big pair 4 i (pairs i, i + 8)
    assert prim.tolist() == [0, 4, 8, 12] + list(range(16, 28))  # then the 12 pass-through dims after the rotary ones
    every = torch.cat([prim] + copies)
    assert len(copies) == 3 and sorted(every.tolist()) == list(range(64))
    with pytest.raises(ValueError):
        wh.head_slots(16, 40, 4, 16)  # 40 is not a whole number of 16-dim copies


def test_widening_refuses_a_disk_without_room_and_skips_a_finished_one(tmp_path, monkeypatch, capsys):
    """The 27B pair is 57.3 GB and the GPU machine's disk 64 GiB: the widening checks the room first and refuses
    before it writes or removes anything; --if-missing leaves a finished widening alone; a config-only folder (a dry
    run's) counts as not built."""
    small = random_dense_hybrid_target("qwen3_5_text", seed=5, vocab=VOCAB)
    small.to(torch.bfloat16).save_pretrained(tmp_path / "small" / "target")
    small_drafter(small).save_pretrained(tmp_path / "small" / "drafter")
    out = tmp_path / "big"
    big27 = wh.HYBRID_SHAPES["qwen3.5-27b"]
    assert wh.pair_bytes(big27) == 2 * (26_895_998_464 + 1_730_213_120)
    wh.write_configs(tmp_path / "small", MEDIUM, out)  # what a dry run writes
    assert not wh.is_built(out, MEDIUM)
    need = wh.pair_bytes(MEDIUM)
    real_usage = wh.shutil.disk_usage
    monkeypatch.setattr(wh.shutil, "disk_usage", lambda p: real_usage(p)._replace(free=need))  # no margin left
    with pytest.raises(wh.NoRoomError, match="nothing was written"):
        wh.widen_hybrid_pair(tmp_path / "small", MEDIUM, out, log=lambda *_: None)
    assert sorted(p.name for p in out.rglob("*")) == ["config.json", "config.json", "drafter", "target"]
    argv = ["--shape", "medium", "--small", str(tmp_path / "small"), "--out", str(out), "--if-missing"]
    assert wh.main(argv) == 3 and "GB free" in capsys.readouterr().err
    monkeypatch.setattr(wh.shutil, "disk_usage", real_usage)
    assert wh.main(argv) == 0 and wh.is_built(out, MEDIUM)
    # the dry run's configs are the real widening's
    for sub in ("target", "drafter"):
        again = tmp_path / "configs"
        wh.write_configs(tmp_path / "small", MEDIUM, again)
        written = json.loads((out / sub / "config.json").read_text())
        assert json.loads((again / sub / "config.json").read_text()) == written
    stamp = (out / "target" / "model.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    assert wh.main(argv) == 0 and "already holds" in capsys.readouterr().out
    assert (out / "target" / "model.safetensors").stat().st_mtime_ns == stamp
    # room is counted with the widening it replaces
    monkeypatch.setattr(wh.shutil, "disk_usage", lambda p: real_usage(p)._replace(free=wh.DISK_MARGIN_BYTES))
    assert wh.check_room(out, need)["reclaimed_bytes"] >= need
