"""DFlash drafter module: cache path == full path, mask semantics, config format, checkpoint round trip."""

import json

import pytest
import torch
from torch import nn

from sglang_ddtree.drafter import (
    DFlashDrafter, DrafterCache, DrafterConfig, block_training_mask, draft_block_logits, target_context_features,
)


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny tensors: a second intra-op thread only adds wake-up latency on small CI machines.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def make_config(seed=0, **over) -> DrafterConfig:
    g = torch.Generator().manual_seed(seed)
    heads = [(2, 1), (4, 2), (4, 4)][int(torch.randint(0, 3, (1,), generator=g))]
    kw = dict(
        hidden_size=32, num_layers=int(torch.randint(1, 3, (1,), generator=g)), num_heads=heads[0],
        num_kv_heads=heads[1], head_dim=8 * int(torch.randint(1, 3, (1,), generator=g)), intermediate_size=48,
        rms_norm_eps=1e-6, rope_theta=10000.0, block_size=int(torch.randint(4, 9, (1,), generator=g)),
        target_layer_ids=[0, 2], mask_token_id=3, vocab_size=50, num_target_layers=4,
    )
    kw.update(over)
    return DrafterConfig(**kw)


def make_drafter(cfg: DrafterConfig, seed=0) -> DFlashDrafter:
    torch.manual_seed(seed)
    d = DFlashDrafter(cfg)
    with torch.no_grad():  # non-trivial norm gains so a mixed-up norm would show
        for name, p in d.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return d.eval()


def heads(cfg, seed=1):
    torch.manual_seed(seed)
    embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    return embed, lm_head


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_cache_path_equals_full_forward(seed):
    cfg = make_config(seed)
    d = make_drafter(cfg, seed)
    embed, lm_head = heads(cfg, seed)
    bs, T, B = 2, 11, cfg.block_size
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(bs, T, cfg.num_features * cfg.hidden_size, generator=g)
    ctx = d.project_context(feats)
    pos = torch.arange(T).expand(bs, T)
    bonus = torch.randint(0, cfg.vocab_size, (bs,), generator=g)

    # Full path: block = [bonus, mask...] at positions T..T+B-1, default mask (all ctx + all block keys).
    ids = torch.full((bs, B), cfg.mask_token_id)
    ids[:, 0] = bonus
    block_pos = T + torch.arange(B).expand(bs, B)
    with torch.no_grad():
        full = lm_head(d(embed(ids), block_pos, ctx, pos)[:, 1:])

    # Cache path, filled in two uneven chunks as a decoder would commit tokens.
    cache = DrafterCache(d, bs, "cpu", torch.float32)
    cache.append(ctx[:, :4], pos[:, :4])
    cache.append(ctx[:, 4:], pos[:, 4:])
    assert cache.length == T
    got = draft_block_logits(d, cache, bonus, torch.full((bs,), T), embed, lm_head)
    assert got.shape == (bs, B - 1, cfg.vocab_size) and got.dtype == torch.float32
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)

    # Truncating and re-appending the same entries gives the same result.
    cache.truncate(6)
    assert cache.length == 6
    cache.append(ctx[:, 6:], pos[:, 6:])
    torch.testing.assert_close(draft_block_logits(d, cache, bonus, torch.full((bs,), T), embed, lm_head), full,
                               rtol=1e-5, atol=1e-5)


def test_cache_padding_slots_are_ignored():
    cfg = make_config(5)
    d = make_drafter(cfg, 5)
    embed, lm_head = heads(cfg)
    T = 7
    ctx = d.project_context(torch.randn(2, T, cfg.num_features * cfg.hidden_size))
    pos = torch.arange(T).expand(2, T)
    bonus = torch.tensor([4, 9])
    ref = DrafterCache(d, 2, "cpu", torch.float32)
    ref.append(ctx, pos)
    want = draft_block_logits(d, ref, bonus, torch.full((2,), T), embed, lm_head)

    # Same context, but row 1 receives its last 3 entries one round later, with garbage padding in between.
    padded = DrafterCache(d, 2, "cpu", torch.float32)
    padded.append(ctx[:, :4], pos[:, :4])
    junk = torch.randn(2, 3, cfg.hidden_size) * 5
    first = torch.where(torch.tensor([True, False])[:, None, None], ctx[:, 4:], junk)
    padded.append(first, pos[:, 4:], valid=torch.tensor([[True] * 3, [False] * 3]))
    second = torch.where(torch.tensor([False, True])[:, None, None], ctx[:, 4:], junk)
    padded.append(second, pos[:, 4:], valid=torch.tensor([[False] * 3, [True] * 3]))
    got = draft_block_logits(d, padded, bonus, torch.full((2,), T), embed, lm_head)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_training_mask_hides_context_at_and_after_anchor():
    cfg = make_config(7, block_size=4)
    d = make_drafter(cfg, 7)
    bs, T, B = 2, 20, cfg.block_size
    anchors = torch.tensor([[3, 9, 15], [5, 6, 16]])
    mask = block_training_mask(anchors, T, B)
    assert mask.shape == (bs, 1, 3 * B, T + 3 * B)
    feats = torch.randn(bs, T, cfg.num_features * cfg.hidden_size)
    pos = torch.arange(T).expand(bs, T)
    block_pos = (anchors[:, :, None] + torch.arange(B)).reshape(bs, -1)
    embeds = torch.randn(bs, 3 * B, cfg.hidden_size)
    with torch.no_grad():
        out = d(embeds, block_pos, d.project_context(feats), pos, mask)
        # Each block equals running that block alone with the context cut at its anchor.
        for b in range(bs):
            for a in range(3):
                p = int(anchors[b, a])
                sl = slice(a * B, (a + 1) * B)
                alone = d(embeds[b:b + 1, sl], block_pos[b:b + 1, sl], d.project_context(feats[b:b + 1, :p]),
                          pos[b:b + 1, :p])
                torch.testing.assert_close(out[b:b + 1, sl], alone, rtol=1e-5, atol=1e-5)
        # Changing the features at positions >= the first anchor of row 0 leaves that block unchanged ...
        changed = feats.clone()
        changed[0, 3:] = torch.randn_like(changed[0, 3:]) * 10
        out2 = d(embeds, block_pos, d.project_context(changed), pos, mask)
        torch.testing.assert_close(out2[0, :B], out[0, :B], rtol=0, atol=0)
        # ... but changes the later blocks of that row, which do see those positions.
        assert not torch.allclose(out2[0, B:], out[0, B:])


def test_block_is_non_causal():
    # The bonus position must see the mask positions after it (SGLang runs the draft as ENCODER_ONLY).
    cfg = make_config(2)
    d = make_drafter(cfg, 2)
    T, B = 5, cfg.block_size
    ctx = d.project_context(torch.randn(1, T, cfg.num_features * cfg.hidden_size))
    pos = torch.arange(T)[None]
    emb = torch.randn(1, B, cfg.hidden_size)
    bpos = T + torch.arange(B)[None]
    with torch.no_grad():
        out = d(emb, bpos, ctx, pos)
        emb2 = emb.clone()
        emb2[0, -1] += 1.0
        out2 = d(emb2, bpos, ctx, pos)
    assert not torch.allclose(out[0, 0], out2[0, 0])


def test_rope_uses_absolute_positions_consistently():
    # Shifting every position (context and block) by the same offset leaves the output unchanged (relative RoPE).
    cfg = make_config(3)
    d = make_drafter(cfg, 3)
    T, B = 6, cfg.block_size
    ctx = d.project_context(torch.randn(1, T, cfg.num_features * cfg.hidden_size))
    emb = torch.randn(1, B, cfg.hidden_size)
    with torch.no_grad():
        a = d(emb, T + torch.arange(B)[None], ctx, torch.arange(T)[None])
        b = d(emb, 40 + T + torch.arange(B)[None], ctx, 40 + torch.arange(T)[None])
        c = d(emb, T + 1 + torch.arange(B)[None], ctx, torch.arange(T)[None])  # a gap changes things
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(a, c, atol=1e-4)


def sglang_expectations(data: dict) -> None:
    """What SGLang 0.5.17 reads from a DFlash draft config.json (checked here without importing sglang)."""
    assert data["architectures"] == ["DFlashDraftModel"]
    assert data["model_type"] == "qwen3"
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "rms_norm_eps", "max_position_embeddings", "vocab_size"):
        assert isinstance(data[key], (int, float)) and data[key] > 0, key
    assert data["hidden_act"] == "silu"
    assert data.get("is_causal", False) is False  # ENCODER_ONLY draft attention
    assert "layer_types" not in data or all(t == "full_attention" for t in data["layer_types"])
    rope = data.get("rope_parameters") or {}
    assert rope.get("rope_theta", data.get("rope_theta")) == data["rope_theta"]
    dc = data["dflash_config"]
    assert isinstance(dc["mask_token"], str) and dc["mask_token"]
    assert isinstance(dc["mask_token_id"], int) and 0 <= dc["mask_token_id"] < data["vocab_size"]
    ids = dc["target_layer_ids"]
    assert isinstance(ids, list) and ids and all(isinstance(k, int) for k in ids)
    # Captured "before layer k + 1" and concatenated in layer order.
    assert all(0 <= k < data["num_target_layers"] - 1 for k in ids) and ids == sorted(set(ids))
    assert isinstance(data["block_size"], int) and data["block_size"] >= 2


def test_config_json_round_trip_and_sglang_fields(tmp_path):
    cfg = make_config(4)
    data = cfg.to_json()
    sglang_expectations(data)
    again = DrafterConfig.from_json(json.loads(json.dumps(data)))
    assert again == cfg
    cfg.save(tmp_path / "config.json")
    assert DrafterConfig.load(tmp_path / "config.json") == cfg
    # Unknown keys survive a round trip.
    data["some_future_field"] = [1, 2]
    assert DrafterConfig.from_json(data).to_json()["some_future_field"] == [1, 2]


def test_config_json_is_a_valid_transformers_qwen3_config():
    from transformers import Qwen3Config

    cfg = make_config(6)
    hf = Qwen3Config.from_dict(cfg.to_json())
    assert hf.num_hidden_layers == cfg.num_layers and hf.head_dim == cfg.head_dim
    assert hf.dflash_config["target_layer_ids"] == cfg.target_layer_ids
    assert hf.block_size == cfg.block_size
    rope = getattr(hf, "rope_parameters", None)
    theta = rope["rope_theta"] if rope else hf.rope_theta
    assert theta == cfg.rope_theta


@pytest.mark.parametrize("bad", [
    dict(target_layer_ids=[3]),          # == num_target_layers - 1: its stream is never captured
    dict(target_layer_ids=[2, 1]),       # not increasing
    dict(target_layer_ids=[]),
    dict(num_heads=3, num_kv_heads=2),
    dict(mask_token_id=50),
    dict(block_size=1),
    dict(head_dim=7),
])
def test_bad_config_raises(bad):
    with pytest.raises(ValueError):
        make_config(0, **bad)


def test_from_json_rejects_non_dflash():
    data = make_config(0).to_json()
    data["architectures"] = ["Qwen3ForCausalLM"]
    with pytest.raises(ValueError):
        DrafterConfig.from_json(data)


def test_save_load_round_trip(tmp_path):
    cfg = make_config(8)
    d = make_drafter(cfg, 8)
    d.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "model.safetensors")))
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(cfg.num_layers):
        for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            expected.add(f"layers.{i}.self_attn.{n}.weight")
        for n in ("gate_proj", "up_proj", "down_proj"):
            expected.add(f"layers.{i}.mlp.{n}.weight")
        expected |= {f"layers.{i}.input_layernorm.weight", f"layers.{i}.post_attention_layernorm.weight"}
    assert names == expected
    sglang_expectations(json.loads((tmp_path / "config.json").read_text()))
    loaded = DFlashDrafter.from_pretrained(tmp_path)
    assert loaded.config == cfg
    for (k, v), (k2, v2) in zip(d.state_dict().items(), loaded.state_dict().items()):
        assert k == k2
        torch.testing.assert_close(v2, v.to(torch.bfloat16).float(), rtol=0, atol=0)  # saved as bf16
    assert loaded.fc.weight.shape == (cfg.hidden_size, cfg.num_features * cfg.hidden_size)


def test_load_rejects_mismatched_weights(tmp_path):
    cfg = make_config(9, num_layers=2)
    make_drafter(cfg).save_pretrained(tmp_path)
    one_layer = DrafterConfig.from_json({**cfg.to_json(), "num_hidden_layers": 1})
    one_layer.save(tmp_path / "config.json")
    with pytest.raises(ValueError):
        DFlashDrafter.from_pretrained(tmp_path)


def test_bad_shapes_raise():
    cfg = make_config(1)
    d = make_drafter(cfg)
    H = cfg.hidden_size
    with pytest.raises(ValueError):
        d.project_context(torch.randn(2, 3, H))  # needs n_feat * H
    ctx = torch.randn(2, 5, H)
    pos = torch.arange(5).expand(2, 5)
    emb = torch.randn(2, 4, H)
    bpos = torch.arange(5, 9).expand(2, 4)
    with pytest.raises(ValueError):
        d(emb[..., :-1], bpos, ctx, pos)
    with pytest.raises(ValueError):
        d(emb, bpos[:, :3], ctx, pos)
    with pytest.raises(ValueError):
        d(emb, bpos, ctx[:1], pos[:1])
    with pytest.raises(ValueError):
        d(emb, bpos, ctx, pos, torch.ones(2, 1, 4, 8, dtype=torch.bool))  # wrong key length
    with pytest.raises(ValueError):
        d(emb, bpos, ctx, pos, torch.ones(2, 1, 4, 9))  # not bool
    cache = DrafterCache(d, 2, "cpu", torch.float32)
    with pytest.raises(ValueError):
        cache.append(torch.randn(3, 2, H), torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError):
        cache.append(torch.randn(2, 2, H), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError):
        cache.truncate(1)
    embed, lm_head = heads(cfg)
    with pytest.raises(ValueError):
        draft_block_logits(d, cache, torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long), embed, lm_head)


def test_target_context_features_picks_raw_layer_outputs():
    hs = tuple(torch.full((1, 2, 3), float(i)) for i in range(5))  # embeddings + 4 layers (last one normed)
    out = target_context_features(hs, [0, 2])
    assert out.shape == (1, 2, 6)
    assert out[0, 0].tolist() == [1.0] * 3 + [3.0] * 3
    with pytest.raises(ValueError):
        target_context_features(hs, [3])  # hs[4] has the final norm applied
