"""The big hybrid shapes that widen_hybrid.py widens a small gated-delta-net pair to, and where the small pair goes.

HYBRID_SHAPES: the real shape (Qwen3.5-27B and its DFlash drafter) and a medium one for CPU tests. For each: its layer
types (every `full_attention_interval`-th layer full attention), the name and shape of every tensor of the big target
(in either transformers layout, `qwen3_5_text` or `qwen3_next`) and of the big drafter, and their parameter counts
(`python -m sglang_ddtree.widen_hybrid --meta`). Then the index maps that place the small model in a big shape: its
layers (typed_layer_map) and the dims of an attention head (head_slots). No weights or scales here: those are
widen_hybrid.py's, and so is the reasoning behind both placements (its module docstring).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# ------------------------------------------------------------------------------------------------ shapes


LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True)
class HybridShape:
    """A big hybrid target (and the DFlash drafter that goes with it)."""

    name: str
    hidden: int
    layers: int
    full_attention_interval: int
    heads: int
    kv_heads: int
    head_dim: int
    partial_rotary_factor: float
    linear_key_heads: int
    linear_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel: int
    intermediate: int
    vocab: int
    max_positions: int
    drafter_layers: int
    drafter_heads: int
    drafter_kv_heads: int
    drafter_head_dim: int
    drafter_intermediate: int
    drafter_layer_ids: tuple[int, ...]

    @property
    def layer_types(self) -> list[str]:
        k = self.full_attention_interval
        return [FULL if (i + 1) % k == 0 else LINEAR for i in range(self.layers)]


HYBRID_SHAPES = {
    # Qwen3.5-27B (text decoder): 64 layers, 3 gated-delta-net : 1 gated full attention (interval 4); hidden 5120;
    # full attention 24 q / 4 kv heads of 256, partial rotary 0.25; linear attention 16 key / 48 value heads of 128,
    # conv kernel 4; dense MLP 17408; vocab 248320, untied. Its DFlash drafter's shape (a public Qwen3.5-27B-shaped
    # DFlashDraftModel config): 5 Qwen3 layers, 32 q / 8 kv heads of 128, MLP 17408, feature layers 1, 16, 31, 46, 61.
    "qwen3.5-27b": HybridShape("qwen3.5-27b", 5120, 64, 4, 24, 4, 256, 0.25, 16, 48, 128, 128, 4, 17408, 248320,
                               262144, 5, 32, 8, 128, 17408, (1, 16, 31, 46, 61)),
    # Small enough for float32 CPU tests, with every kind of padding the 27B shape has (and head-dim padding of the
    # linear-attention heads, which the 27B widening of a well-chosen tiny target does not need).
    "medium": HybridShape("medium", 256, 8, 4, 8, 2, 64, 0.25, 4, 8, 32, 32, 4, 512, 1000, 4096,
                          3, 8, 4, 32, 256, (1, 3, 5)),
}


def hybrid_layer_shapes(big: HybridShape, kind: str, layout: str = "qwen3_5_text") -> dict[str, tuple[int, ...]]:
    H, D, I = big.hidden, big.head_dim, big.intermediate
    out: dict[str, tuple[int, ...]] = {}
    if kind == FULL:
        out.update({"self_attn.q_proj.weight": (2 * big.heads * D, H), "self_attn.k_proj.weight": (big.kv_heads * D, H),
                    "self_attn.v_proj.weight": (big.kv_heads * D, H), "self_attn.o_proj.weight": (H, big.heads * D),
                    "self_attn.q_norm.weight": (D,), "self_attn.k_norm.weight": (D,)})
    else:
        kd, vd = big.linear_key_heads * big.linear_key_head_dim, big.linear_value_heads * big.linear_value_head_dim
        nv, p = big.linear_value_heads, "linear_attn."
        if layout == "qwen3_next":
            out.update({p + "in_proj_qkvz.weight": (2 * kd + 2 * vd, H), p + "in_proj_ba.weight": (2 * nv, H)})
        else:
            out.update({p + "in_proj_qkv.weight": (2 * kd + vd, H), p + "in_proj_z.weight": (vd, H),
                        p + "in_proj_b.weight": (nv, H), p + "in_proj_a.weight": (nv, H)})
        out.update({p + "conv1d.weight": (2 * kd + vd, 1, big.conv_kernel), p + "A_log": (nv,), p + "dt_bias": (nv,),
                    p + "norm.weight": (big.linear_value_head_dim,), p + "out_proj.weight": (H, vd)})
    out.update({"mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I),
                "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,)})
    return out


def hybrid_target_shapes(big: HybridShape, layout: str = "qwen3_5_text") -> dict[str, tuple[int, ...]]:
    out = {"model.embed_tokens.weight": (big.vocab, big.hidden), "model.norm.weight": (big.hidden,),
           "lm_head.weight": (big.vocab, big.hidden)}
    for i, kind in enumerate(big.layer_types):
        out.update({f"model.layers.{i}.{n}": s for n, s in hybrid_layer_shapes(big, kind, layout).items()})
    return out


def hybrid_drafter_shapes(big: HybridShape) -> dict[str, tuple[int, ...]]:
    H, D, I = big.hidden, big.drafter_head_dim, big.drafter_intermediate
    layer = {"self_attn.q_proj.weight": (big.drafter_heads * D, H), "self_attn.k_proj.weight": (big.drafter_kv_heads * D, H),
             "self_attn.v_proj.weight": (big.drafter_kv_heads * D, H), "self_attn.o_proj.weight": (H, big.drafter_heads * D),
             "self_attn.q_norm.weight": (D,), "self_attn.k_norm.weight": (D,),
             "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I),
             "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,)}
    out = {"fc.weight": (H, len(big.drafter_layer_ids) * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(big.drafter_layers):
        out.update({f"layers.{i}.{n}": s for n, s in layer.items()})
    return out


def param_count(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes.values())


def meta(big: HybridShape) -> dict:
    t, d = param_count(hybrid_target_shapes(big)), param_count(hybrid_drafter_shapes(big))
    embed = 2 * big.vocab * big.hidden
    return {"shape": big.name, "layer_types": "".join("F" if k == FULL else "L" for k in big.layer_types),
            "target_params": t, "target_params_without_embeddings": t - embed, "drafter_params": d,
            "bf16_gb": round(2 * (t + d) / 1e9, 1)}


# ------------------------------------------------------------------------------------------------ placements


def typed_layer_map(small_types: list[str], big_types: list[str], reads: dict[int, int] | None = None) -> list[int]:
    """Big index of each small layer: strictly increasing, same type, spread evenly; reads[s] = b (the drafter reads
    small layer s's output at big layer b) requires map[s] <= b < map[s + 1]."""
    n, N = len(small_types), len(big_types)
    lo, hi = [0] * n, [N - 1] * n
    for s, b in (reads or {}).items():
        hi[s] = min(hi[s], b)
        if s + 1 < n:
            lo[s + 1] = max(lo[s + 1], b + 1)
    latest = [0] * n  # the latest feasible big index of each small layer, leaving room for the ones after it
    nxt = N
    for i in range(n - 1, -1, -1):
        j = min(hi[i], nxt - 1)
        while j >= 0 and big_types[j] != small_types[i]:
            j -= 1
        if j < lo[i]:
            raise ValueError(f"small layer {i} ({small_types[i]}) has no big layer of its type in [{lo[i]}, "
                             f"{min(hi[i], nxt - 1)}] (big types {big_types}, reads {reads}).")
        latest[i] = nxt = j
    out, prev = [], -1
    for i in range(n):
        ideal = round((i + 1) * N / n) - 1
        cands = [j for j in range(max(lo[i], prev + 1), latest[i] + 1) if big_types[j] == small_types[i]]
        if not cands:
            raise ValueError(f"cannot place small layer {i} ({small_types[i]}) after big layer {prev}.")
        prev = min(cands, key=lambda j: (abs(j - ideal), j))
        out.append(prev)
    return out


def head_slots(d: int, D: int, rd: int, RD: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Big head dims for small head dims 0..d-1: the primary copy (rotary pairs i -> k i, k = RD / rd; pass-through
    dims after the big rotary block) and the other m - 1 disjoint copies (m = D / d) in the remaining dims."""
    if D % d or (rd and RD % rd) or rd % 2 or RD % 2 or D - RD < d - rd:
        raise ValueError(f"cannot place a head of {d} dims (rotary {rd}) into {D} dims (rotary {RD}): need D a "
                         "multiple of d and the big rotary dims a multiple of the small ones.")
    k = RD // rd if rd else 1
    half, HALF = rd // 2, RD // 2
    prim = [k * j for j in range(half)] + [HALF + k * j for j in range(half)] + [RD + j for j in range(d - rd)]
    used = set(prim)
    rest = [j for j in range(D) if j not in used]
    copies = [torch.tensor(rest[c * d:(c + 1) * d]) for c in range(D // d - 1)]
    return torch.tensor(prim), copies
