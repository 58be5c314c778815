"""Widen the committed tiny pair to a real model's shapes without changing what it computes.

The real-size benchmark needs both real costs (a Qwen3-8B-shaped target and a z-lab-8B-shaped DFlash drafter) and
real acceptance (a pair that was trained). Random weights give the first and accept nothing; the tiny pair gives
the second and is host-bound. A widened pair gives both: every weight of the tiny pair is placed into a zero
tensor of the big shape so that, in exact arithmetic, the big model's logits over the real vocabulary equal the tiny
model's, and the drafter's block logits equal the tiny drafter's. Served, it does the work of an 8B model and
accepts what the tiny pair accepts.

How each part stays exact (h, H: small and big hidden; d, D = 2d: small and big head_dim; r = h / H, a power of 4):

* Residual stream: the small stream lives in dims [0, h); one spare dim (H - 1) carries a constant C that no layer
  writes (o_proj / down_proj rows zero) and no projection reads (columns zero). Every other dim stays zero.
* RMSNorm over the hidden: the big mean of squares is r x the small one, so eps_big = r x eps_small and the
  weight is scaled by sqrt(r) (a power of two, exact in bf16). C^2 / H enters the mean too; with C = 2^-10 it is
  ~0.4% of the eps term at the 8B shape, far below float32 noise.
* One config eps serves the q/k norms over head_dim too. q is duplicated: its d dims sit where rotary pairs them
  as in the small model and again in the free dims (where k is zero, so they add nothing to q.k); its q_proj rows
  are scaled by sqrt(r), so its normalised value is exactly the small one. k sits only in the paired dims: its
  normalised value is sqrt(2) x the small one (half its dims live), which turns the softmax scale 1/sqrt(D) into
  exactly 1/sqrt(d). k_proj rows take the power of two that leaves its eps closest to the small eps (the only
  inexact term, relative size ~eps / mean(k^2)).
* Rotary: small dims [0, d/2) -> [0, d/2) and [d/2, d) -> [D/2, D/2 + d/2), so small pair i is big pair i, and
  rope_theta_big = rope_theta_small^2 gives big pair i the small pair's frequency.
* Heads: small q head h of kv head g goes to big q head g * G + (h mod g_small) (G: big group size); kv head g to
  big kv head g; other heads zero (their output meets zero o_proj columns). v lives in dims [0, d).
* Layers: live layers at chosen indices (the drafter's feature layers fixed by its `target_layer_ids`), the
  others zero (an all-zero pre-norm layer adds nothing to the stream).
* Vocabulary: rows past the small vocabulary exist for their cost only; the final norm's weight on the constant
  dim and a -1 in those lm_head rows give them a logit of about -2^12 x sqrt(H / h) / rms(stream), so they never
  win and carry no probability. The lm_head is untied (as Qwen3-8B) and holds the small tied embedding.
* Drafter: same placements; its fc reads the big feature blocks of the layers that hold the small features, the
  other blocks' columns zero; its block embeddings (the target's) carry C, so its padded logits are negative too.

`python -m sglang_ddtree.widen --shape qwen3-8b --out DIR` writes DIR/target (with the tiny tokenizer) and
DIR/drafter in HF / z-lab format, bf16, deterministic (same bytes every run). `--meta` prints parameter counts
without building.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from sglang_ddtree.tiny import tiny_dir

CONST_VALUE = 2.0 ** -10      # the constant carried by the spare hidden dim
CONST_NORM_GAIN = 2.0 ** 22   # the final norms' weight on that dim: gain x value = 2^12
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


@dataclass(frozen=True)
class BigShape:
    """The widths a widened pair is given (target and drafter share hidden, heads and MLP widths)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_positions: int
    drafter_layers: int
    drafter_layer_ids: tuple[int, ...]  # the big drafter's target_layer_ids


SHAPES = {
    # Qwen3-8B (hidden 4096, 36 layers, 32 q / 8 kv heads of 128, MLP 12288, vocab 151936, untied lm_head) and the
    # z-lab Qwen3-8B DFlash drafter's shape (5 layers, feature layers 1, 9, 17, 25, 33).
    "qwen3-8b": BigShape("qwen3-8b", 4096, 36, 32, 8, 128, 12288, 151936, 40960, 5, (1, 9, 17, 25, 33)),
    # Small enough to check in float32 on a CPU, with every kind of padding the 8B shape has.
    "medium": BigShape("medium", 1024, 10, 8, 4, 128, 1536, 5000, 4096, 4, (1, 4, 7)),
}


# ------------------------------------------------------------------------------------------------ placements


def layer_map(small_layers: int, big_layers: int, anchors: dict[int, int]) -> list[int]:
    """Big index of each small layer: strictly increasing, anchors[s] = b fixed (small layer s's output must be the
    stream after big layer b, so the next live layer comes after b); the rest spread evenly between anchors."""
    fixed = dict(sorted(anchors.items()))
    if not fixed:
        fixed = {small_layers - 1: big_layers - 1}
    points = [(-1, -1)] + list(fixed.items())
    out: list[int] = []
    for (s0, b0), (s1, b1) in zip(points, points[1:]):
        n = s1 - s0  # layers s0+1 .. s1 into big (b0, b1], the last at b1
        if b1 - b0 < n:
            raise ValueError(f"cannot fit small layers {s0 + 1}..{s1} below big layer {b1}.")
        out += [b0 + round((b1 - b0) * (k + 1) / n) for k in range(n)]
    s_last, b_last = points[-1]
    n = small_layers - 1 - s_last
    if n > 0:
        if big_layers - 1 - b_last < n:
            raise ValueError(f"cannot fit small layers after {s_last} above big layer {b_last}.")
        out += [b_last + round((big_layers - 1 - b_last) * (k + 1) / n) for k in range(n)]
    assert len(out) == small_layers and all(a < b for a, b in zip(out, out[1:])), out
    return out


def feature_anchors(small_ids: list[int], big_ids: tuple[int, ...]) -> list[int]:
    """Which big feature layer carries each small feature layer: spread over the big list, first to first."""
    if len(big_ids) < len(small_ids):
        raise ValueError(f"the big drafter reads {len(big_ids)} target layers, fewer than the small one's {len(small_ids)}.")
    if len(small_ids) == 1:
        return [0]
    return [round(j * (len(big_ids) - 1) / (len(small_ids) - 1)) for j in range(len(small_ids))]


def rotary_slots(d: int) -> torch.Tensor:
    """Big head dims that hold small head dims 0..d-1 (rotate-half pairing kept: small pair i -> big pair i)."""
    half = d // 2
    return torch.cat([torch.arange(half), torch.arange(half) + d])  # D = 2d, so big half is d


def free_slots(d: int) -> torch.Tensor:
    """The big head dims no small dim uses (where q's copy goes)."""
    half = d // 2
    return torch.cat([torch.arange(half) + half, torch.arange(half) + d + half])


def pow2_closest(x: float) -> float:
    return 2.0 ** round(math.log2(x))


@dataclass
class Scales:
    hidden_norm: float  # weight scale of every RMSNorm over the hidden (sqrt(r))
    q: float            # q_proj row scale (q duplicated): sqrt(r)
    k: float            # k_proj row scale (k single): a power of two
    eps: float          # the big config's rms_norm_eps


def scales_for(h: int, H: int, d: int, D: int, eps_small: float) -> Scales:
    ratio = h / H
    if D != 2 * d:
        raise ValueError(f"big head_dim must be twice the small one ({2 * d}), got {D}.")
    root = math.sqrt(ratio)
    if pow2_closest(root) != root:
        raise ValueError(f"small / big hidden ({h} / {H}) must be a power of 4 so norm weights scale exactly.")
    # k: mean of squares (k_scale^2 / 2) x small, eps r x small; exact when k_scale^2 = 2r, else the closest power
    # of two (the small model then sees eps x 2r / k_scale^2 in its k norm: off by at most a factor 2 of 1e-6).
    k_scale = pow2_closest(math.sqrt(2 * ratio))
    return Scales(hidden_norm=root, q=root, k=k_scale, eps=eps_small * ratio)


# ------------------------------------------------------------------------------------------------ building


class Widener:
    """Builds the big tensors of one model from the small state dict (float32 in, any dtype out)."""

    def __init__(self, small_cfg: dict, big: BigShape, eps_small: float, dtype: torch.dtype):
        self.h = int(small_cfg["hidden_size"])
        self.d = int(small_cfg.get("head_dim") or self.h // int(small_cfg["num_attention_heads"]))
        self.nq = int(small_cfg["num_attention_heads"])
        self.nkv = int(small_cfg["num_key_value_heads"])
        self.inter = int(small_cfg["intermediate_size"])
        self.big = big
        self.dtype = dtype
        self.s = scales_for(self.h, big.hidden, self.d, big.head_dim, eps_small)
        if big.kv_heads < self.nkv or big.heads // big.kv_heads < self.nq // self.nkv:
            raise ValueError(f"{big.name}: too few heads for the small model's {self.nq} q / {self.nkv} kv heads.")
        if big.intermediate < self.inter or big.hidden < self.h + 1:
            raise ValueError(f"{big.name}: hidden or MLP narrower than the small model's.")
        self.const_dim = big.hidden - 1
        self.G, self.g = big.heads // big.kv_heads, self.nq // self.nkv

    def zeros(self, *shape) -> torch.Tensor:
        return torch.zeros(*shape, dtype=self.dtype)

    def hidden_norm(self, w: torch.Tensor | None, const_gain: float = 0.0) -> torch.Tensor:
        out = self.zeros(self.big.hidden)
        if w is not None:
            out[: self.h] = (w.float() * self.s.hidden_norm).to(self.dtype)
        out[self.const_dim] = const_gain
        return out

    def head_norm(self, w: torch.Tensor, duplicate: bool) -> torch.Tensor:
        out = self.zeros(self.big.head_dim)
        out[rotary_slots(self.d)] = w.to(self.dtype)
        if duplicate:
            out[free_slots(self.d)] = w.to(self.dtype)
        return out

    def big_q_head(self, small_head: int) -> int:
        g, j = divmod(small_head, self.g)
        return g * self.G + j

    def attention(self, sd: dict, p: str) -> dict:
        B, D, d, H = self.big, self.big.head_dim, self.d, self.big.hidden
        q = self.zeros(B.heads * D, H)
        k = self.zeros(B.kv_heads * D, H)
        v = self.zeros(B.kv_heads * D, H)
        o = self.zeros(H, B.heads * D)
        rot, free = rotary_slots(d), free_slots(d)
        sq, sk, sv, so = (sd[p + n].float() for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"))
        for hq in range(self.nq):
            big = self.big_q_head(hq) * D
            rows = (sq[hq * d:(hq + 1) * d] * self.s.q).to(self.dtype)
            q[big + rot, : self.h] = rows
            q[big + free, : self.h] = rows
            o[: self.h, big: big + d] = so[:, hq * d:(hq + 1) * d].to(self.dtype)
        for g in range(self.nkv):
            k[g * D + rot, : self.h] = (sk[g * d:(g + 1) * d] * self.s.k).to(self.dtype)
            v[g * D: g * D + d, : self.h] = sv[g * d:(g + 1) * d].to(self.dtype)
        return {p + "q_proj.weight": q, p + "k_proj.weight": k, p + "v_proj.weight": v, p + "o_proj.weight": o,
                p + "q_norm.weight": self.head_norm(sd[p + "q_norm.weight"], duplicate=True),
                p + "k_norm.weight": self.head_norm(sd[p + "k_norm.weight"], duplicate=False)}

    def mlp(self, sd: dict, p: str) -> dict:
        H, I = self.big.hidden, self.big.intermediate
        gate, up, down = self.zeros(I, H), self.zeros(I, H), self.zeros(H, I)
        gate[: self.inter, : self.h] = sd[p + "gate_proj.weight"].to(self.dtype)
        up[: self.inter, : self.h] = sd[p + "up_proj.weight"].to(self.dtype)
        down[: self.h, : self.inter] = sd[p + "down_proj.weight"].to(self.dtype)
        return {p + "gate_proj.weight": gate, p + "up_proj.weight": up, p + "down_proj.weight": down}

    def layer(self, sd: dict | None, small_prefix: str, big_prefix: str) -> dict:
        """One decoder layer; sd None: an all-zero (identity) layer of the big shape."""
        if sd is None:
            return {big_prefix + name: self.zeros(*shape) for name, shape in layer_shapes(self.big).items()}
        out = {}
        out.update(self.attention(sd, small_prefix + "self_attn."))
        out.update(self.mlp(sd, small_prefix + "mlp."))
        out[small_prefix + "input_layernorm.weight"] = self.hidden_norm(sd[small_prefix + "input_layernorm.weight"])
        out[small_prefix + "post_attention_layernorm.weight"] = self.hidden_norm(
            sd[small_prefix + "post_attention_layernorm.weight"])
        return {big_prefix + name[len(small_prefix):]: t for name, t in out.items()}


def layer_shapes(big: BigShape) -> dict[str, tuple[int, ...]]:
    H, D, I = big.hidden, big.head_dim, big.intermediate
    return {
        "self_attn.q_proj.weight": (big.heads * D, H), "self_attn.k_proj.weight": (big.kv_heads * D, H),
        "self_attn.v_proj.weight": (big.kv_heads * D, H), "self_attn.o_proj.weight": (H, big.heads * D),
        "self_attn.q_norm.weight": (D,), "self_attn.k_norm.weight": (D,),
        "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I),
        "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
    }


def target_shapes(big: BigShape) -> dict[str, tuple[int, ...]]:
    out = {"model.embed_tokens.weight": (big.vocab, big.hidden), "model.norm.weight": (big.hidden,),
           "lm_head.weight": (big.vocab, big.hidden)}
    for i in range(big.layers):
        out.update({f"model.layers.{i}.{k}": s for k, s in layer_shapes(big).items()})
    return out


def drafter_shapes(big: BigShape) -> dict[str, tuple[int, ...]]:
    out = {"fc.weight": (big.hidden, len(big.drafter_layer_ids) * big.hidden), "hidden_norm.weight": (big.hidden,),
           "norm.weight": (big.hidden,)}
    for i in range(big.drafter_layers):
        out.update({f"layers.{i}.{k}": s for k, s in layer_shapes(big).items()})
    return out


def param_count(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes.values())


# ------------------------------------------------------------------------------------------------ whole pair


def _load(folder: Path) -> tuple[dict, dict]:
    from safetensors.torch import load_file
    return json.loads((folder / "config.json").read_text()), load_file(str(folder / "model.safetensors"))


def _theta(cfg: dict) -> float:
    return float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0)))


def plan_pair(small_dir: Path, big: BigShape) -> dict:
    """Layer placements of a widening, from the small configs alone."""
    tcfg = json.loads((small_dir / "target" / "config.json").read_text())
    dcfg = json.loads((small_dir / "drafter" / "config.json").read_text())
    small_ids = list(dcfg["dflash_config"]["target_layer_ids"])
    which = feature_anchors(small_ids, big.drafter_layer_ids)
    anchors = {s: big.drafter_layer_ids[j] for s, j in zip(small_ids, which)}
    target_live = layer_map(int(tcfg["num_hidden_layers"]), big.layers, anchors)
    drafter_live = layer_map(int(dcfg["num_hidden_layers"]), big.drafter_layers, {})
    return {"target_live_layers": target_live, "drafter_live_layers": drafter_live,
            "feature_blocks": which, "small_feature_ids": small_ids}


class _ShardWriter:
    """Writes tensors into safetensors shards of at most `shard_bytes`, then the HF index."""

    def __init__(self, folder: Path, shard_bytes: int):
        self.folder, self.shard_bytes = folder, shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.size = 0
        self.shards: list[dict[str, torch.Tensor]] = []
        self.written: list[tuple[str, list[str]]] = []
        self.total = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            self.pending[name] = t.contiguous()
            nbytes = t.numel() * t.element_size()
            self.size += nbytes
            self.total += nbytes
        if self.size >= self.shard_bytes:
            self._flush()

    def _flush(self) -> None:
        from safetensors.torch import save_file
        if not self.pending:
            return
        tmp = self.folder / f"shard-{len(self.written):05d}.safetensors"
        save_file(self.pending, str(tmp), metadata={"format": "pt"})
        self.written.append((tmp.name, list(self.pending)))
        self.pending, self.size = {}, 0

    def close(self) -> None:
        self._flush()
        n = len(self.written)
        if n == 1:
            (self.folder / self.written[0][0]).rename(self.folder / "model.safetensors")
            return
        weight_map = {}
        for i, (tmp, names) in enumerate(self.written):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.folder / tmp).rename(self.folder / final)
            weight_map.update({k: final for k in names})
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")


def widen_pair(small_dir: Path, big: BigShape, out_dir: Path, *, dtype: torch.dtype = torch.bfloat16,
               shard_gib: float = 4.0, log=print) -> dict:
    """Write out_dir/target and out_dir/drafter; returns what was built (placements, parameter counts)."""
    t0 = time.time()
    tcfg, tsd = _load(small_dir / "target")
    dcfg, dsd = _load(small_dir / "drafter")
    if not tcfg.get("tie_word_embeddings", False) and "lm_head.weight" not in tsd:
        raise ValueError("the small target is untied but has no lm_head.weight.")
    eps = float(tcfg["rms_norm_eps"])
    if float(dcfg["rms_norm_eps"]) != eps:
        raise ValueError("the small target and drafter must share rms_norm_eps.")
    plan = plan_pair(small_dir, big)
    tw = Widener(tcfg, big, eps, dtype)
    shard_bytes = int(shard_gib * 2**30)
    for sub in ("target", "drafter"):
        folder = out_dir / sub
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)

    # target
    H, V, h, v = big.hidden, big.vocab, tw.h, int(tcfg["vocab_size"])
    embed = tsd["model.embed_tokens.weight"]
    lm_small = tsd.get("lm_head.weight", embed)
    w = _ShardWriter(out_dir / "target", shard_bytes)
    big_embed = tw.zeros(V, H)
    big_embed[:v, :h] = embed.to(dtype)
    big_embed[:, tw.const_dim] = CONST_VALUE
    lm_head = tw.zeros(V, H)
    lm_head[:v, :h] = lm_small.to(dtype)
    lm_head[v:, tw.const_dim] = -1.0
    w.add({"model.embed_tokens.weight": big_embed})
    live = {b: s for s, b in enumerate(plan["target_live_layers"])}
    for i in range(big.layers):
        s = live.get(i)
        w.add(tw.layer(tsd if s is not None else None, f"model.layers.{s}.", f"model.layers.{i}."))
    w.add({"model.norm.weight": tw.hidden_norm(tsd["model.norm.weight"], CONST_NORM_GAIN), "lm_head.weight": lm_head})
    w.close()
    tcfg_big, dcfg_big = big_configs(small_dir, big)
    (out_dir / "target" / "config.json").write_text(json.dumps(tcfg_big, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        src = small_dir / "target" / name
        if src.is_file():
            shutil.copy(src, out_dir / "target" / name)

    # drafter
    dw = Widener(dcfg, big, eps, dtype)
    w = _ShardWriter(out_dir / "drafter", shard_bytes)
    fc_small = dsd["fc.weight"]
    fc = dw.zeros(H, len(big.drafter_layer_ids) * H)
    for j, block in enumerate(plan["feature_blocks"]):
        fc[:h, block * H: block * H + h] = fc_small[:, j * h:(j + 1) * h].to(dtype)
    w.add({"fc.weight": fc, "hidden_norm.weight": dw.hidden_norm(dsd["hidden_norm.weight"])})
    live = {b: s for s, b in enumerate(plan["drafter_live_layers"])}
    for i in range(big.drafter_layers):
        s = live.get(i)
        w.add(dw.layer(dsd if s is not None else None, f"layers.{s}.", f"layers.{i}."))
    w.add({"norm.weight": dw.hidden_norm(dsd["norm.weight"], CONST_NORM_GAIN)})
    w.close()
    (out_dir / "drafter" / "config.json").write_text(json.dumps(dcfg_big, indent=2) + "\n")

    info = {"shape": big.name, "out": str(out_dir), **plan,
            "target_params": param_count(target_shapes(big)), "drafter_params": param_count(drafter_shapes(big)),
            "seconds": round(time.time() - t0, 1)}
    log(f"[widen] {big.name}: target {info['target_params']:,} + drafter {info['drafter_params']:,} parameters "
        f"in {info['seconds']} s -> {out_dir}")
    return info


def big_configs(small_dir: Path, big: BigShape) -> tuple[dict, dict]:
    """The widened target's and drafter's config.json contents."""
    tcfg = json.loads((small_dir / "target" / "config.json").read_text())
    dcfg = json.loads((small_dir / "drafter" / "config.json").read_text())
    eps = float(tcfg["rms_norm_eps"])
    s = scales_for(int(tcfg["hidden_size"]), big.hidden, int(tcfg.get("head_dim") or 0) or
                   int(tcfg["hidden_size"]) // int(tcfg["num_attention_heads"]), big.head_dim, eps)
    plan = plan_pair(small_dir, big)
    t = dict(tcfg)
    t.update(hidden_size=big.hidden, num_hidden_layers=big.layers, num_attention_heads=big.heads,
             num_key_value_heads=big.kv_heads, head_dim=big.head_dim, intermediate_size=big.intermediate,
             vocab_size=big.vocab, max_position_embeddings=big.max_positions, max_window_layers=big.layers,
             tie_word_embeddings=False, rms_norm_eps=s.eps, layer_types=["full_attention"] * big.layers)
    _set_theta(t, _theta(tcfg) ** 2)
    t["widened_from"] = _provenance(small_dir, big, plan, s)
    d = dict(dcfg)
    d.update(hidden_size=big.hidden, num_hidden_layers=big.drafter_layers, num_attention_heads=big.heads,
             num_key_value_heads=big.kv_heads, head_dim=big.head_dim, intermediate_size=big.intermediate,
             vocab_size=big.vocab, max_position_embeddings=big.max_positions, num_target_layers=big.layers,
             rms_norm_eps=s.eps)
    d["dflash_config"] = dict(dcfg["dflash_config"], target_layer_ids=list(big.drafter_layer_ids))
    _set_theta(d, _theta(dcfg) ** 2)
    return t, d


def write_configs(small_dir: Path, big: BigShape, out_dir: Path) -> None:
    """Only the two config.json files (enough to plan a benchmark; no weights, so is_built stays False)."""
    for sub, cfg in zip(("target", "drafter"), big_configs(small_dir, big)):
        (out_dir / sub).mkdir(parents=True, exist_ok=True)
        (out_dir / sub / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def _set_theta(cfg: dict, theta: float) -> None:
    if "rope_parameters" in cfg:
        cfg["rope_parameters"] = dict(cfg["rope_parameters"], rope_theta=theta)
    cfg["rope_theta"] = theta


def _provenance(small_dir: Path, big: BigShape, plan: dict, s: Scales) -> dict:
    return {"shape": big.name, "target_live_layers": plan["target_live_layers"],
            "drafter_live_layers": plan["drafter_live_layers"], "constant_dim": big.hidden - 1,
            "scales": {"hidden_norm": s.hidden_norm, "q": s.q, "k": s.k}}


def is_built(out_dir: Path, big: BigShape) -> bool:
    """A finished widening of this shape is in out_dir: both configs (written after the weights) and weights."""
    out_dir = Path(out_dir)
    try:
        cfg = json.loads((out_dir / "target" / "config.json").read_text())
        json.loads((out_dir / "drafter" / "config.json").read_text())
    except (OSError, ValueError):
        return False
    weights = ("model.safetensors", "model.safetensors.index.json")
    return ((cfg.get("widened_from") or {}).get("shape") == big.name
            and all(any((out_dir / sub / w).is_file() for w in weights) for sub in ("target", "drafter")))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_ddtree.widen", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--out", type=Path, help="folder for target/ and drafter/ (replaced)")
    ap.add_argument("--small", type=Path, default=None, help="the pair to widen (default: tiny.tiny_dir())")
    ap.add_argument("--meta", action="store_true", help="print placements and parameter counts, build nothing")
    ap.add_argument("--if-missing", action="store_true", help="do nothing when --out already holds this shape")
    ap.add_argument("--shard-gib", type=float, default=4.0)
    args = ap.parse_args(argv)
    args.small = args.small or tiny_dir()
    big = SHAPES[args.shape]
    for sub in ("target", "drafter"):
        if not (args.small / sub / "config.json").is_file():
            ap.error(f"{args.small / sub} has no config.json; --small must hold target/ and drafter/.")
    if args.meta:
        print(json.dumps({"shape": big.name, **plan_pair(args.small, big),
                          "target_params": param_count(target_shapes(big)),
                          "drafter_params": param_count(drafter_shapes(big))}, indent=1))
        return 0
    if args.out is None:
        ap.error("--out is required unless --meta.")
    if args.if_missing and is_built(args.out, big):
        print(f"[widen] {args.out} already holds the {big.name} widening")
        return 0
    widen_pair(args.small, big, args.out, shard_gib=args.shard_gib)
    return 0


if __name__ == "__main__":
    sys.exit(main())
