"""The DFlash block-diffusion drafter as a plain torch module (training and offline decoding).

It reproduces what SGLang 0.5.17 computes for a `DFlashDraftModel` checkpoint:
  * context: for every committed position, the target's residual stream after each layer k in
    `target_layer_ids` (HF `output_hidden_states[k + 1]`), concatenated, then ctx = hidden_norm(fc(concat)).
    Every draft layer turns the SAME ctx into context keys/values: K = rope(k_norm(k_proj(ctx))), V = v_proj(ctx)
    (no input_layernorm on ctx).
  * block: the target's embeddings of [bonus, mask x (block_size - 1)] at positions p .. p + block_size - 1,
    where p = number of committed tokens. Qwen3-style pre-norm layers; attention is NON-causal: every block
    query sees all context keys (positions < p) and all block keys. Final `norm`; logits = target lm_head.
  * block position j >= 1 predicts the token at position p + j; position 0's output is unused.

Checkpoint format (as z-lab publishes DFlash drafters): config.json with "architectures": ["DFlashDraftModel"],
"model_type": "qwen3", Qwen3 attention/MLP fields, "block_size", "num_target_layers" and
"dflash_config": {"mask_token_id", "mask_token", "target_layer_ids"}; model.safetensors with `layers.*`,
`fc.weight`, `hidden_norm.weight`, `norm.weight` (no embedding, no lm_head).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
DEFAULT_MASK_TOKEN = "<|mask|>"


@dataclass
class DrafterConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    vocab_size: int
    num_target_layers: int
    max_position_embeddings: int = 4096
    mask_token: str = DEFAULT_MASK_TOKEN
    extra: dict = field(default_factory=dict)  # unknown config.json keys, kept for round trips

    def __post_init__(self):
        self.target_layer_ids = [int(k) for k in self.target_layer_ids]
        self.validate()

    def validate(self) -> None:
        positive = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                    "intermediate_size", "block_size", "vocab_size", "num_target_layers")
        for name in positive:
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"DrafterConfig.{name} must be a positive integer, got {getattr(self, name)}.")
        if self.block_size < 2:
            raise ValueError(f"DrafterConfig.block_size must be >= 2 (bonus + at least one draft), got {self.block_size}.")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads}) for GQA."
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}.")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must list at least one target layer.")
        # SGLang captures the stream "before layer k + 1", so k + 1 must be a real layer of the target; and it
        # concatenates captured features in layer order, so the ids must be strictly increasing.
        for k in self.target_layer_ids:
            if not 0 <= k < self.num_target_layers - 1:
                raise ValueError(
                    f"target_layer_ids must lie in [0, num_target_layers - 1) = [0, {self.num_target_layers - 1}), "
                    f"got {self.target_layer_ids}."
                )
        if any(b <= a for a, b in zip(self.target_layer_ids, self.target_layer_ids[1:])):
            raise ValueError(f"target_layer_ids must be strictly increasing, got {self.target_layer_ids}.")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id must be in [0, vocab_size={self.vocab_size}), got {self.mask_token_id}.")

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    def to_json(self) -> dict:
        """The z-lab / SGLang `DFlashDraftModel` config.json content."""
        out = dict(self.extra)
        out.update({
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "attention_bias": False,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
            # SGLang picks ENCODER_ONLY (non-causal) draft attention unless the config says is_causal=True.
            "is_causal": False,
            "dtype": "bfloat16",
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {
                "mask_token": self.mask_token,
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
        })
        return out

    @classmethod
    def from_json(cls, data: dict) -> "DrafterConfig":
        if not isinstance(data, dict):
            raise ValueError(f"A drafter config must be a JSON object, got {type(data).__name__}.")
        archs = data.get("architectures") or []
        if "DFlashDraftModel" not in archs:
            raise ValueError(f"Not a DFlash drafter config: architectures={archs!r}, expected ['DFlashDraftModel'].")
        dflash = data.get("dflash_config") or {}
        layer_ids = dflash.get("target_layer_ids", data.get("target_layer_ids"))
        mask_id = dflash.get("mask_token_id", data.get("mask_token_id"))
        if layer_ids is None or mask_id is None:
            raise ValueError("The drafter config needs dflash_config.target_layer_ids and dflash_config.mask_token_id.")
        rope_theta = data.get("rope_theta")
        if rope_theta is None:
            rope_theta = (data.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        num_layers = int(data["num_hidden_layers"])
        known = {
            "architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "intermediate_size", "hidden_act", "attention_bias", "rms_norm_eps",
            "rope_theta", "rope_parameters", "max_position_embeddings", "vocab_size", "tie_word_embeddings",
            "is_causal", "dtype", "torch_dtype", "block_size", "num_target_layers", "dflash_config",
        }
        if data.get("hidden_act", "silu") != "silu":
            raise ValueError(f"Only hidden_act 'silu' is supported (as in SGLang), got {data.get('hidden_act')!r}.")
        return cls(
            hidden_size=int(data["hidden_size"]),
            num_layers=num_layers,
            num_heads=int(data["num_attention_heads"]),
            num_kv_heads=int(data.get("num_key_value_heads", data["num_attention_heads"])),
            head_dim=int(data.get("head_dim", int(data["hidden_size"]) // int(data["num_attention_heads"]))),
            intermediate_size=int(data["intermediate_size"]),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            block_size=int(dflash.get("block_size", data.get("block_size", 16))),
            target_layer_ids=[int(k) for k in layer_ids],
            mask_token_id=int(mask_id),
            vocab_size=int(data["vocab_size"]),
            num_target_layers=int(dflash.get("num_target_layers", data.get("num_target_layers", num_layers))),
            max_position_embeddings=int(data.get("max_position_embeddings", 4096)),
            mask_token=str(dflash.get("mask_token", DEFAULT_MASK_TOKEN)),
            extra={k: v for k, v in data.items() if k not in known},
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "DrafterConfig":
        return cls.from_json(json.loads(Path(path).read_text()))

    def asdict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalize in float32, cast back, then scale."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def apply_rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Neox-style rotary embedding. x: [bs, heads, n, head_dim]; positions: [bs, n] int."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=x.device, dtype=torch.float32) / head_dim))
    angles = positions.to(torch.float32)[..., None] * inv_freq  # [bs, n, head_dim/2]
    emb = torch.cat([angles, angles], dim=-1)[:, None]          # [bs, 1, n, head_dim]
    cos, sin = emb.cos(), emb.sin()
    x32 = x.float()
    half = head_dim // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(h, nh * hd, bias=False)
        self.k_proj = nn.Linear(h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def _heads(self, x: Tensor, n_heads: int) -> Tensor:
        bs, n, _ = x.shape
        return x.view(bs, n, n_heads, self.cfg.head_dim).transpose(1, 2)  # [bs, heads, n, hd]

    def kv(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Keys (normed + rotated) and values for x [bs, n, H] at positions [bs, n] -> [bs, nkv, n, hd] each."""
        k = self.k_norm(self._heads(self.k_proj(x), self.cfg.num_kv_heads))
        v = self._heads(self.v_proj(x), self.cfg.num_kv_heads)
        return apply_rope(k, positions, self.cfg.rope_theta), v

    def forward(self, x: Tensor, positions: Tensor, ctx_k: Tensor, ctx_v: Tensor,
                attn_mask: Optional[Tensor]) -> Tensor:
        q = self.q_norm(self._heads(self.q_proj(x), self.cfg.num_heads))
        q = apply_rope(q, positions, self.cfg.rope_theta)
        k, v = self.kv(x, positions)
        k = torch.cat([ctx_k.to(k.dtype), k], dim=2)
        v = torch.cat([ctx_v.to(v.dtype), v], dim=2)
        groups = self.cfg.num_heads // self.cfg.num_kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # non-causal by design
        bs, _, n, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(bs, n, -1))


class DrafterMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DrafterAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DrafterMLP(cfg)

    def forward(self, h: Tensor, positions: Tensor, ctx_k: Tensor, ctx_v: Tensor,
                attn_mask: Optional[Tensor]) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), positions, ctx_k, ctx_v, attn_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.layers = nn.ModuleList([DrafterLayer(config) for _ in range(config.num_layers)])
        self.fc = nn.Linear(config.num_features * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.norm = RMSNorm(h, config.rms_norm_eps)

    # ---- checkpoint I/O -------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path, device="cpu", dtype=torch.float32) -> "DFlashDrafter":
        from safetensors.torch import load_file

        path = Path(path)
        for name in (CONFIG_NAME, WEIGHTS_NAME):
            if not (path / name).is_file():
                raise FileNotFoundError(f"Drafter checkpoint {path} has no {name}.")
        model = cls(DrafterConfig.load(path / CONFIG_NAME))
        state = load_file(str(path / WEIGHTS_NAME))
        # Checkpoints saved with a "model." prefix (as SGLang also accepts) load too.
        state = {k[len("model."):] if k.startswith("model.") else k: v for k, v in state.items()}
        expected = set(model.state_dict())
        missing, unexpected = expected - set(state), set(state) - expected
        if missing or unexpected:
            raise ValueError(
                f"Drafter weights in {path} do not match its config: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}."
            )
        model.load_state_dict(state)
        return model.to(device=device, dtype=dtype)

    def save_pretrained(self, path) -> None:
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.config.save(path / CONFIG_NAME)
        state = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(path / WEIGHTS_NAME), metadata={"format": "pt"})

    # ---- compute --------------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def project_context(self, target_feats: Tensor) -> Tensor:
        """[..., n_feat * H] concatenated target features -> [..., H] context hidden (hidden_norm(fc(x)))."""
        expected = self.fc.in_features
        if target_feats.shape[-1] != expected:
            raise ValueError(
                f"target_feats must end with dim {expected} (= {self.config.num_features} target layers x hidden "
                f"{self.config.hidden_size}), got shape {tuple(target_feats.shape)}."
            )
        return self.hidden_norm(self.fc(target_feats.to(self.dtype)))

    def context_kv(self, ctx_hidden: Tensor, ctx_positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Per-layer context (K, V), each [bs, nkv, T, hd], from projected context hidden [bs, T, H]."""
        ctx_hidden = ctx_hidden.to(self.dtype)
        return [layer.self_attn.kv(ctx_hidden, ctx_positions) for layer in self.layers]

    def run_block(self, block_embeds: Tensor, block_positions: Tensor, ctx_kv: list[tuple[Tensor, Tensor]],
                  attn_mask: Optional[Tensor]) -> Tensor:
        """Block forward given already materialized context K/V; returns hidden after the final norm."""
        h = block_embeds.to(self.dtype)
        for layer, (ck, cv) in zip(self.layers, ctx_kv):
            h = layer(h, block_positions, ck, cv, attn_mask)
        return self.norm(h)

    def forward(self, block_embeds: Tensor, block_positions: Tensor, ctx_hidden: Tensor, ctx_positions: Tensor,
                attn_mask: Optional[Tensor] = None) -> Tensor:
        """block_embeds [bs, S, H], block_positions [bs, S], ctx_hidden [bs, T, H] (projected), ctx_positions
        [bs, T]; attn_mask bool broadcastable to [bs, 1, S, T + S] (True = may attend, keys = ctx then block).
        Default mask: every block query sees every context key and every block key. Returns [bs, S, H]."""
        H = self.config.hidden_size
        if block_embeds.dim() != 3 or block_embeds.shape[-1] != H:
            raise ValueError(f"block_embeds must be [bs, S, {H}], got shape {tuple(block_embeds.shape)}.")
        bs, S, _ = block_embeds.shape
        if tuple(block_positions.shape) != (bs, S):
            raise ValueError(f"block_positions must be [{bs}, {S}], got shape {tuple(block_positions.shape)}.")
        if ctx_hidden.dim() != 3 or ctx_hidden.shape[0] != bs or ctx_hidden.shape[-1] != H:
            raise ValueError(f"ctx_hidden must be [{bs}, T, {H}] (projected context), got {tuple(ctx_hidden.shape)}.")
        T = ctx_hidden.shape[1]
        if tuple(ctx_positions.shape) != (bs, T):
            raise ValueError(f"ctx_positions must be [{bs}, {T}], got shape {tuple(ctx_positions.shape)}.")
        if attn_mask is not None:
            if attn_mask.dtype != torch.bool:
                raise ValueError(f"attn_mask must be a bool tensor (True = may attend), got {attn_mask.dtype}.")
            try:
                torch.broadcast_shapes(attn_mask.shape, (bs, 1, S, T + S))
            except RuntimeError:
                raise ValueError(
                    f"attn_mask must broadcast to [bs, 1, S, T + S] = {[bs, 1, S, T + S]}, got {list(attn_mask.shape)}."
                ) from None
        return self.run_block(block_embeds, block_positions, self.context_kv(ctx_hidden, ctx_positions), attn_mask)


class DrafterCache:
    """Context K/V per drafter layer for incremental (offline) decoding.

    Slots are appended in commit order. Rows of a batch may commit different numbers of tokens per round:
    pass `valid` [bs, t] to append, and padded slots (valid=False) are never attended. Each slot carries its own
    position (RoPE is applied at append time), so padding does not shift anything.
    """

    def __init__(self, drafter: DFlashDrafter, batch_size: int, device, dtype):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}.")
        self.drafter = drafter
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.dtype = dtype
        cfg = drafter.config
        empty = torch.empty(batch_size, cfg.num_kv_heads, 0, cfg.head_dim, device=self.device, dtype=dtype)
        self.k = [empty.clone() for _ in range(cfg.num_layers)]
        self.v = [empty.clone() for _ in range(cfg.num_layers)]
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=self.device)

    @property
    def length(self) -> int:
        """Number of slots stored (including padded ones)."""
        return self.valid.shape[1]

    @torch.no_grad()
    def append(self, ctx_hidden: Tensor, positions: Tensor, valid: Optional[Tensor] = None) -> None:
        """ctx_hidden [bs, t, H] (projected context, see `DFlashDrafter.project_context`), positions [bs, t]."""
        H = self.drafter.config.hidden_size
        if ctx_hidden.dim() != 3 or ctx_hidden.shape[0] != self.batch_size or ctx_hidden.shape[-1] != H:
            raise ValueError(
                f"ctx_hidden must be [{self.batch_size}, t, {H}] (projected context), got {tuple(ctx_hidden.shape)}."
            )
        t = ctx_hidden.shape[1]
        if tuple(positions.shape) != (self.batch_size, t):
            raise ValueError(f"positions must be [{self.batch_size}, {t}], got shape {tuple(positions.shape)}.")
        if valid is None:
            valid = torch.ones(self.batch_size, t, dtype=torch.bool, device=self.device)
        elif tuple(valid.shape) != (self.batch_size, t) or valid.dtype != torch.bool:
            raise ValueError(f"valid must be a bool tensor [{self.batch_size}, {t}], got {valid.dtype} {tuple(valid.shape)}.")
        kv = self.drafter.context_kv(ctx_hidden.to(self.device), positions.to(self.device))
        for i, (k, v) in enumerate(kv):
            self.k[i] = torch.cat([self.k[i], k.to(self.dtype)], dim=2)
            self.v[i] = torch.cat([self.v[i], v.to(self.dtype)], dim=2)
        self.valid = torch.cat([self.valid, valid.to(self.device)], dim=1)

    def truncate(self, length: int) -> None:
        """Drop every slot at index >= length."""
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate length must be in [0, {self.length}], got {length}.")
        self.k = [k[:, :, :length] for k in self.k]
        self.v = [v[:, :, :length] for v in self.v]
        self.valid = self.valid[:, :length]


@torch.no_grad()
def draft_block_logits(drafter: DFlashDrafter, cache: DrafterCache, bonus_tokens: Tensor, start_positions: Tensor,
                       embed: nn.Embedding, lm_head: nn.Module) -> Tensor:
    """One drafter pass: logits [bs, block_size - 1, V] (float32) for depths 1 .. block_size - 1.

    bonus_tokens [bs]: the token at position start (not yet in the cache); start_positions [bs]: its position,
    i.e. the number of committed tokens. The cache must hold exactly the committed context of each row.
    """
    cfg = drafter.config
    bs, B = cache.batch_size, cfg.block_size
    if bonus_tokens.shape != (bs,) or start_positions.shape != (bs,):
        raise ValueError(
            f"bonus_tokens and start_positions must both be [{bs}], got {tuple(bonus_tokens.shape)} and "
            f"{tuple(start_positions.shape)}."
        )
    device = cache.device
    ids = torch.full((bs, B), cfg.mask_token_id, dtype=torch.long, device=device)
    ids[:, 0] = bonus_tokens.to(device)
    positions = start_positions.to(device).long()[:, None] + torch.arange(B, device=device)
    block_embeds = embed(ids)
    mask = torch.cat([cache.valid, torch.ones(bs, B, dtype=torch.bool, device=device)], dim=1)
    mask = mask[:, None, None, :]  # [bs, 1, 1, T + B]: same for every block query
    hidden = drafter.run_block(block_embeds, positions, list(zip(cache.k, cache.v)), mask)
    return lm_head(hidden[:, 1:].to(lm_head.weight.dtype)).float()


def target_context_features(hidden_states, target_layer_ids) -> Tensor:
    """Concatenate HF `output_hidden_states[k + 1]` (stream after layer k) for k in target_layer_ids.

    The last entry of HF hidden_states has the final norm applied, so k + 1 must index a raw layer output.
    """
    n = len(hidden_states)  # num_layers + 1
    for k in target_layer_ids:
        if not 0 <= k < n - 2:
            raise ValueError(
                f"target layer id {k} is out of range: with {n - 1} target layers, ids must be in [0, {n - 2})."
            )
    return torch.cat([hidden_states[k + 1] for k in target_layer_ids], dim=-1)


def block_training_mask(anchors: Tensor, ctx_len: int, block_size: int) -> Tensor:
    """Mask for many blocks in one call: anchors [bs, A] (anchor positions p) -> bool [bs, 1, A*B, ctx_len + A*B].

    Query (a, j) sees context positions < anchors[a] and the keys of its own block only.
    """
    bs, A = anchors.shape
    device = anchors.device
    ctx_ok = torch.arange(ctx_len, device=device)[None, None, :] < anchors[:, :, None]  # [bs, A, T]
    ctx_ok = ctx_ok.repeat_interleave(block_size, dim=1)                                   # [bs, A*B, T]
    block_id = torch.arange(A * block_size, device=device) // block_size
    same = (block_id[:, None] == block_id[None, :]).expand(bs, -1, -1)                     # [bs, A*B, A*B]
    return torch.cat([ctx_ok, same], dim=2)[:, None]
