"""Widen a small gated-delta-net hybrid target (and its DFlash drafter) to a real hybrid shape, same function.

The hybrid counterpart of `widen.py`: a small Qwen3.5-style target (gated-delta-net "linear attention" layers mixed
with gated full attention, dense MLP) is placed into zero tensors of a big shape (Qwen3.5-27B) so that the big
model's logits over the small vocabulary equal the small model's and its padded vocabulary never wins. Served, it
does the work of the big model (the same GEMMs, recurrent states, KV) and accepts what the small pair accepts.

Both transformers layouts of the same layers are read and written: `qwen3_5_text` (Qwen3_5ForCausalLM:
in_proj_qkv / in_proj_z / in_proj_b / in_proj_a) and `qwen3_next` (Qwen3NextForCausalLM: in_proj_qkvz /
in_proj_ba interleaved per key head, dense MLP through `mlp_only_layers`). The math is identical.

Notation: h, H small / big hidden, r = H / h; d, D full-attention head_dim (m = D / d); dk, DK and dv, DV
linear-attention key / value head dims; f = (DK / dk)(DV / dv). Every scale below is a power of two when r and f
are powers of 4 and m is 1 or a power of 4; then the big bf16 weights are exact copies of the small ones times
powers of two and the big model is the small one in exact arithmetic (float32: equal up to rounding order; the
test measures ~1e-6 relative). Where a scale is not a power of two the result is exact in float32 weights and off
by bf16 rounding (~2^-9 relative per weight) in bf16; `HybridScales.bf16_exact` says which.

* eps. One config `rms_norm_eps` serves the hidden norms, the q/k head norms and the gated output norm of every
  linear-attention layer. That norm sees the recurrence output over DV dims, of which dv live, and the output itself
  is sqrt(dk / DK) x the small one (the recurrence scales q by 1 / sqrt(key head dim), and q and k are l2-normalised,
  so no weight can undo it; v passes a SiLU after the conv, so no weight before it can either). Its mean of squares
  is therefore exactly (1 / f) x the small one, and the big eps is eps_small / f: that norm is exact, and everything
  else is arranged around the same factor F = 1 / f.
* Residual stream: the small stream x lives in dims [0, h) as s * x with s = sqrt(r / f) (embeddings x s, every
  o_proj / out_proj / down_proj row x s), so every hidden RMSNorm sees F x the small mean of squares and F x the small
  eps: exact. Its output is sqrt(r) x the small normalised value, so every projection that reads a norm (q/k/v/gate,
  qkvz/ba, gate/up, lm_head) takes its columns x 1 / sqrt(r). Norm weights are copied unchanged. That matters:
  Qwen3.5 / Qwen3-Next RMSNorms compute (1 + w) * x_hat, so a scaled gain would not be a scaled weight (nor exact in
  bf16), and a zero-padded weight is a gain of 1, harmless only because the padded dims carry zero.
  One spare dim (H - 1) carries a constant C = 2^-16 that nothing writes or reads except the final norm and the
  padded lm_head rows; it adds C^2 / H to the hidden mean of squares (relative ~1e-12 of it: below float32
  resolution, so even the norms' float32 rounding matches the small model's).
* Linear-attention layers: small key head g -> big key head g, small value head g * rho + j -> big value head
  g * R + j (rho, R: value heads per key head). q / k / v / z rows, their conv1d channels (depthwise, so a channel is
  independent), b / a rows, A_log / dt_bias and the gated norm weight are copied into the first dk / dv dims of their
  heads; everything else is zero. Zero key dims leave the l2 norms (a sum, eps 1e-6 inside) unchanged; a padded value
  head has v = 0, so its state stays 0 whatever its decay (A_log = dt_bias = 0 there: finite) and its output is 0.
  out_proj columns x s * sqrt(dv / DV) undo the norm's sqrt(DV / dv).
* Full-attention layers (gated: q_proj holds [q, gate] per head): q is duplicated into all m disjoint d-dim copies
  of its big head (rows x sqrt(F)), so the q norm's mean equals the small one (x F, with eps x F): q_hat exact in every
  copy. k lives in one copy only (rows x sqrt(m F)): k_hat = sqrt(m) x the small one. k is zero in the other copies,
  so q . k = sqrt(m) x the small product and the softmax scale 1 / sqrt(D) makes it exactly the small 1 / sqrt(d). v,
  gate and o_proj use the same copy. Heads: small q head i of kv head g -> big q head g * G + (i mod g_small).
* Partial rotary: transformers rotates the first rd = head_dim * partial_rotary_factor dims, pairing i with
  i + rd / 2 at frequency theta^(-2i / rd). With k = rd_big / rd_small an integer, small pair i goes to big pair k * i,
  whose frequency theta^(-2ki / rd_big) is the small pair's, bit for bit, at the same theta (no theta change, unlike
  widen.py's squared theta). Small pass-through dims go to big pass-through dims. The other copies pair only among
  themselves, and k is zero there. The drafter's attention (rotary over its whole head) uses the same placement.
* MLP: gate / up rows copied (columns x 1 / sqrt(r)), down rows x s; padded intermediate units give silu(0) * 0.
* Layers: big layer types follow the real pattern (every `full_attention_interval`-th layer full attention). Each
  small layer goes to a big layer of its own type; the rest are all zero. A zero layer of either type is an identity:
  its pre-norm has gain 1 but every projection after it is zero (a zero GDN layer: q = k = v = 0, finite decay, output
  0). The drafter reads big layer b for small feature layer s when s's big layer <= b < (s + 1)'s.
* Vocabulary: padded lm_head rows are -1 on the constant dim and the final norm's gain there is 2^28, so their
  logits are about -2^12 / (sqrt(F) rms(stream)): they never win. The lm_head is untied (as Qwen3.5-27B).
* Drafter (Qwen3-style RMSNorm w * x, no output gate): the same stream scale s (it adds onto the target's
  embeddings), the same F and eps factor, fc copied unchanged (it reads s x the small features and writes s x the small
  context, which hidden_norm turns into sqrt(r) x the small normalised value), attention as above with its own m.

`python -m sglang_ddtree.widen_hybrid --shape qwen3.5-27b --small DIR --out OUT` writes OUT/target and
OUT/drafter (bf16, deterministic; refused before anything is written or removed when OUT's disk has not room for
it: the 27B pair is 57.3 GB, the GPU machine's disk 64 GiB); `--if-missing` does nothing when OUT already holds this
shape's widening; `--meta` prints the big shape's parameter counts without building, and `--check` prints the plan
and scales for --small without building (`check_hybrid_pair`).
The shapes, their tensors and the layer / head-dim index maps are in `widen_hybrid_shapes.py`.
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

from sglang_ddtree.widen import TOKENIZER_FILES, _ShardWriter, feature_anchors, is_built
from sglang_ddtree.widen_hybrid_shapes import (FULL, HYBRID_SHAPES, LINEAR, HybridShape, head_slots,
                                             hybrid_drafter_shapes, hybrid_layer_shapes, hybrid_target_shapes,
                                             meta, param_count, typed_layer_map)

LAYOUTS = ("qwen3_5_text", "qwen3_next")
# The constant dim's value and the final norms' gain on it (value x gain = 2^12, as in widen.py). The value is smaller
# than widen.py's 2^-10: its C^2 / H in the hidden norms' mean of squares then stays far below float32 resolution
# (transformers computes these norms in float32 whatever the model dtype), so the widened model rounds as the small one.
CONST_VALUE = 2.0 ** -16
CONST_NORM_GAIN = 2.0 ** 28


# ------------------------------------------------------------------------------------------------ small side


def small_layout(cfg: dict) -> str:
    mt = cfg.get("model_type")
    if mt not in LAYOUTS:
        raise ValueError(f"model_type {mt!r} is not a gated-delta-net hybrid layout this widening reads {LAYOUTS}.")
    return mt


def small_layer_types(cfg: dict) -> list[str]:
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if not types:
        k = int(cfg.get("full_attention_interval", 4))
        types = [FULL if (i + 1) % k == 0 else LINEAR for i in range(n)]
    if len(types) != n or set(types) - {LINEAR, FULL}:
        raise ValueError(f"layer_types {types} do not describe {n} linear / full attention layers.")
    return list(types)


def _rope(cfg: dict) -> tuple[float, float]:
    rp = cfg.get("rope_parameters") or {}
    theta = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    prf = float(rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    return theta, prf


def _check_dense(cfg: dict) -> None:
    if cfg.get("model_type") == "qwen3_next" and int(cfg.get("num_experts") or 0) > 0:
        n = int(cfg["num_hidden_layers"])
        if sorted(int(i) for i in cfg.get("mlp_only_layers") or []) != list(range(n)):
            raise ValueError("only dense-MLP hybrids are widened (set mlp_only_layers to every layer): top-k expert "
                             "routing flips under bf16 noise, and an MoE is not what the real dense shape computes.")


# ------------------------------------------------------------------------------------------------ scales


def _pow2(x: float) -> bool:
    return x > 0 and 2.0 ** round(math.log2(x)) == x


@dataclass
class HybridScales:
    r: float            # H / h
    f: float            # (DK / dk)(DV / dv)
    stream: float       # s: the small stream lives in the big one as s * x
    read: float         # columns of every projection that reads a hidden norm: 1 / sqrt(r)
    eps_factor: float   # F = 1 / f: big eps = F x small eps
    m: int              # target full-attention head_dim ratio
    m_drafter: int      # drafter head_dim ratio
    gdn_out: float      # out_proj columns: s * sqrt(dv / DV)

    def q(self) -> float:
        return math.sqrt(self.eps_factor)

    def k(self, m: int) -> float:
        return math.sqrt(m * self.eps_factor)

    @property
    def bf16_exact(self) -> bool:
        vals = [self.stream, self.read, self.gdn_out, self.q(), self.k(self.m), self.k(self.m_drafter)]
        return all(_pow2(v) for v in vals)

    def asdict(self) -> dict:
        return {"r": self.r, "f": self.f, "stream": self.stream, "read": self.read, "eps_factor": self.eps_factor,
                "m": self.m, "m_drafter": self.m_drafter, "gdn_out": self.gdn_out, "q": self.q(),
                "k": self.k(self.m), "k_drafter": self.k(self.m_drafter), "bf16_exact": self.bf16_exact}


def hybrid_scales(tcfg: dict, big: HybridShape, dcfg: dict | None = None) -> HybridScales:
    h, H = int(tcfg["hidden_size"]), big.hidden
    dk, dv = int(tcfg["linear_key_head_dim"]), int(tcfg["linear_value_head_dim"])
    f = (big.linear_key_head_dim / dk) * (big.linear_value_head_dim / dv)
    d = int(tcfg.get("head_dim") or h // int(tcfg["num_attention_heads"]))
    if big.head_dim % d:
        raise ValueError(f"big head_dim {big.head_dim} is not a multiple of the small {d}.")
    md = 1
    if dcfg is not None:
        dd = int(dcfg.get("head_dim") or int(dcfg["hidden_size"]) // int(dcfg["num_attention_heads"]))
        if big.drafter_head_dim % dd:
            raise ValueError(f"big drafter head_dim {big.drafter_head_dim} is not a multiple of the small {dd}.")
        md = big.drafter_head_dim // dd
    r = H / h
    s = math.sqrt(r / f)
    return HybridScales(r=r, f=f, stream=s, read=1 / math.sqrt(r), eps_factor=1 / f, m=big.head_dim // d,
                        m_drafter=md, gdn_out=s * math.sqrt(dv / big.linear_value_head_dim))


# ------------------------------------------------------------------------------------------------ target


class HybridWidener:
    """Big tensors of one small hybrid target (float32 in, `dtype` out)."""

    def __init__(self, cfg: dict, big: HybridShape, dtype: torch.dtype, scales: HybridScales, layout: str):
        self.cfg, self.big, self.dtype, self.s, self.layout = cfg, big, dtype, scales, layout
        self.h = int(cfg["hidden_size"])
        self.v = int(cfg["vocab_size"])
        self.nq, self.nkv = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
        self.d = int(cfg.get("head_dim") or self.h // self.nq)
        _, prf = _rope(cfg)
        self.rd = int(self.d * prf)
        self.RD = int(big.head_dim * big.partial_rotary_factor)
        self.nk, self.nv = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
        self.dk, self.dv = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])
        self.K = int(cfg["linear_conv_kernel_dim"])
        self.inter = int(cfg["intermediate_size"])
        self.rho, self.R = self.nv // self.nk, big.linear_value_heads // big.linear_key_heads
        self.g, self.G = self.nq // self.nkv, big.heads // big.kv_heads
        problems = []
        if big.hidden < self.h + 1 or big.intermediate < self.inter or big.vocab < self.v:
            problems.append("hidden / MLP / vocab narrower than the small model's (the hidden needs one spare dim)")
        if big.kv_heads < self.nkv or self.G < self.g:
            problems.append(f"too few full-attention heads for {self.nq} q / {self.nkv} kv")
        if big.linear_key_heads < self.nk or self.R < self.rho:
            problems.append(f"too few linear-attention heads for {self.nk} key / {self.nv} value")
        if big.linear_key_head_dim < self.dk or big.linear_value_head_dim < self.dv:
            problems.append("linear-attention head dims narrower than the small model's")
        if big.conv_kernel != self.K:
            problems.append(f"conv kernel {big.conv_kernel} != the small model's {self.K}")
        if problems:
            raise ValueError(f"{big.name}: " + "; ".join(problems) + ".")
        self.prim, self.copies = head_slots(self.d, big.head_dim, self.rd, self.RD)
        self.const_dim = big.hidden - 1

    def zeros(self, *shape) -> torch.Tensor:
        return torch.zeros(*shape, dtype=self.dtype)

    def put(self, out: torch.Tensor, index, value: torch.Tensor, scale: float = 1.0) -> None:
        out[index] = (value.double() * scale).to(self.dtype)

    # -- norms (Qwen3.5 / Qwen3-Next convention: (1 + w) * x_hat; weights copied, never scaled)

    def hidden_norm(self, w: torch.Tensor | None, const_gain: float | None = None) -> torch.Tensor:
        out = self.zeros(self.big.hidden)
        if w is not None:
            self.put(out, slice(0, self.h), w)
        if const_gain is not None:
            out[self.const_dim] = const_gain - 1.0
        return out

    # -- layers

    def full_attention(self, sd: dict, p: str) -> dict:
        B, D, d, H, h = self.big, self.big.head_dim, self.d, self.big.hidden, self.h
        rd = self.s.read
        q = self.zeros(B.heads * 2 * D, H)
        k = self.zeros(B.kv_heads * D, H)
        v = self.zeros(B.kv_heads * D, H)
        o = self.zeros(H, B.heads * D)
        sq = sd[p + "q_proj.weight"].float().view(self.nq, 2 * d, h)
        sk, sv = sd[p + "k_proj.weight"].float(), sd[p + "v_proj.weight"].float()
        so = sd[p + "o_proj.weight"].float()
        for i in range(self.nq):
            g, j = divmod(i, self.g)
            base = (g * self.G + j) * 2 * D
            for slots in [self.prim] + self.copies:
                self.put(q, (base + slots, slice(0, h)), sq[i, :d], self.s.q() * rd)
            self.put(q, (base + D + self.prim, slice(0, h)), sq[i, d:], rd)                  # gate
            self.put(o, (slice(0, h), (g * self.G + j) * D + self.prim), so[:, i * d:(i + 1) * d], self.s.stream)
        for g in range(self.nkv):
            self.put(k, (g * D + self.prim, slice(0, h)), sk[g * d:(g + 1) * d], self.s.k(self.s.m) * rd)
            self.put(v, (g * D + self.prim, slice(0, h)), sv[g * d:(g + 1) * d], rd)
        qn, kn = self.zeros(D), self.zeros(D)
        for slots in [self.prim] + self.copies:
            self.put(qn, slots, sd[p + "q_norm.weight"])
        self.put(kn, self.prim, sd[p + "k_norm.weight"])
        return {p + "q_proj.weight": q, p + "k_proj.weight": k, p + "v_proj.weight": v, p + "o_proj.weight": o,
                p + "q_norm.weight": qn, p + "k_norm.weight": kn}

    def _gdn_logical(self, sd: dict, p: str) -> dict:
        """The small layer's per-head tensors, whatever its layout."""
        h, nk, nv, dk, dv, rho = self.h, self.nk, self.nv, self.dk, self.dv, self.rho
        if self.layout == "qwen3_next":
            qkvz = sd[p + "in_proj_qkvz.weight"].float().view(nk, 2 * dk + 2 * rho * dv, h)
            ba = sd[p + "in_proj_ba.weight"].float().view(nk, 2 * rho, h)
            q, k = qkvz[:, :dk], qkvz[:, dk:2 * dk]
            v = qkvz[:, 2 * dk:2 * dk + rho * dv].reshape(nv, dv, h)
            z = qkvz[:, 2 * dk + rho * dv:].reshape(nv, dv, h)
            b, a = ba[:, :rho].reshape(nv, h), ba[:, rho:].reshape(nv, h)
        else:
            qkv = sd[p + "in_proj_qkv.weight"].float()
            q = qkv[:nk * dk].view(nk, dk, h)
            k = qkv[nk * dk:2 * nk * dk].view(nk, dk, h)
            v = qkv[2 * nk * dk:].view(nv, dv, h)
            z = sd[p + "in_proj_z.weight"].float().view(nv, dv, h)
            b, a = sd[p + "in_proj_b.weight"].float(), sd[p + "in_proj_a.weight"].float()
        conv = sd[p + "conv1d.weight"].float()  # [q, k, v channels, 1, K]
        return {"q": q, "k": k, "v": v, "z": z, "b": b, "a": a,
                "cq": conv[:nk * dk].view(nk, dk, -1), "ck": conv[nk * dk:2 * nk * dk].view(nk, dk, -1),
                "cv": conv[2 * nk * dk:].view(nv, dv, -1),
                "A_log": sd[p + "A_log"].float(), "dt_bias": sd[p + "dt_bias"].float(),
                "norm": sd[p + "norm.weight"].float(), "out": sd[p + "out_proj.weight"].float().view(h, nv, dv)}

    def gdn(self, sd: dict, p: str) -> dict:
        B, H, h = self.big, self.big.hidden, self.h
        NK, NV, DK, DV, R, K = B.linear_key_heads, B.linear_value_heads, B.linear_key_head_dim, \
            B.linear_value_head_dim, self.R, self.K
        L = self._gdn_logical(sd, p)
        rd = self.s.read
        q, k = self.zeros(NK, DK, H), self.zeros(NK, DK, H)
        v, z = self.zeros(NV, DV, H), self.zeros(NV, DV, H)
        b, a = self.zeros(NV, H), self.zeros(NV, H)
        cq, ck, cv = self.zeros(NK, DK, K), self.zeros(NK, DK, K), self.zeros(NV, DV, K)
        A_log, dt_bias = torch.zeros(NV, dtype=torch.float32), self.zeros(NV)
        out = self.zeros(H, NV, DV)
        self.put(q, (slice(0, self.nk), slice(0, self.dk), slice(0, h)), L["q"], rd)
        self.put(k, (slice(0, self.nk), slice(0, self.dk), slice(0, h)), L["k"], rd)
        self.put(cq, (slice(0, self.nk), slice(0, self.dk)), L["cq"])
        self.put(ck, (slice(0, self.nk), slice(0, self.dk)), L["ck"])
        big_v = torch.tensor([g * R + j for g in range(self.nk) for j in range(self.rho)])  # small value head order
        self.put(v, (big_v[:, None], torch.arange(self.dv)[None], slice(0, h)), L["v"], rd)
        self.put(z, (big_v[:, None], torch.arange(self.dv)[None], slice(0, h)), L["z"], rd)
        self.put(cv, (big_v[:, None], torch.arange(self.dv)[None]), L["cv"])
        self.put(b, (big_v, slice(0, h)), L["b"], rd)
        self.put(a, (big_v, slice(0, h)), L["a"], rd)
        A_log[big_v] = L["A_log"]  # kept float32, as the real checkpoints keep it
        self.put(dt_bias, big_v, L["dt_bias"])
        self.put(out, (slice(0, h), big_v[:, None], torch.arange(self.dv)[None]), L["out"], self.s.gdn_out)
        norm = self.zeros(DV)
        self.put(norm, slice(0, self.dv), L["norm"])
        t = {"conv1d.weight": torch.cat([cq.reshape(-1, K), ck.reshape(-1, K), cv.reshape(-1, K)])[:, None],
             "A_log": A_log, "dt_bias": dt_bias, "norm.weight": norm, "out_proj.weight": out.reshape(H, NV * DV)}
        t.update(pack_gdn(self.layout, q, k, v, z, b, a))
        return {p + n: x for n, x in t.items()}

    def mlp(self, sd: dict, p: str) -> dict:
        H, I, h = self.big.hidden, self.big.intermediate, self.h
        gate, up, down = self.zeros(I, H), self.zeros(I, H), self.zeros(H, I)
        self.put(gate, (slice(0, self.inter), slice(0, h)), sd[p + "gate_proj.weight"], self.s.read)
        self.put(up, (slice(0, self.inter), slice(0, h)), sd[p + "up_proj.weight"], self.s.read)
        self.put(down, (slice(0, h), slice(0, self.inter)), sd[p + "down_proj.weight"], self.s.stream)
        return {p + "gate_proj.weight": gate, p + "up_proj.weight": up, p + "down_proj.weight": down}

    def layer(self, sd: dict | None, kind: str, small: int | None, big: int) -> dict:
        bp = f"model.layers.{big}."
        if sd is None:
            return {bp + n: torch.zeros(*shape, dtype=torch.float32 if n.endswith("A_log") else self.dtype)
                    for n, shape in hybrid_layer_shapes(self.big, kind, self.layout).items()}
        sp = f"model.layers.{small}."
        out = self.full_attention(sd, sp + "self_attn.") if kind == FULL else self.gdn(sd, sp + "linear_attn.")
        out.update(self.mlp(sd, sp + "mlp."))
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[sp + n] = self.hidden_norm(sd[sp + n])
        return {bp + n[len(sp):]: t for n, t in out.items()}

    def embeddings(self, sd: dict) -> dict:
        V, H, h, v = self.big.vocab, self.big.hidden, self.h, self.v
        embed = sd["model.embed_tokens.weight"]
        lm = sd.get("lm_head.weight", embed)
        big_embed, lm_head = self.zeros(V, H), self.zeros(V, H)
        self.put(big_embed, (slice(0, v), slice(0, h)), embed, self.s.stream)
        big_embed[:, self.const_dim] = CONST_VALUE
        self.put(lm_head, (slice(0, v), slice(0, h)), lm, self.s.read)
        lm_head[v:, self.const_dim] = -1.0
        return {"model.embed_tokens.weight": big_embed, "lm_head.weight": lm_head,
                "model.norm.weight": self.hidden_norm(sd["model.norm.weight"], CONST_NORM_GAIN)}


def pack_gdn(layout: str, q, k, v, z, b, a) -> dict:
    """Big per-head tensors [heads, head_dim, H] -> the projection weights of `layout`."""
    NK, NV, H = q.shape[0], v.shape[0], q.shape[-1]
    if layout == "qwen3_next":
        R = NV // NK
        qkvz = torch.cat([q, k, v.reshape(NK, -1, H), z.reshape(NK, -1, H)], dim=1).reshape(-1, H)
        ba = torch.cat([b.view(NK, R, H), a.view(NK, R, H)], dim=1).reshape(-1, H)
        return {"in_proj_qkvz.weight": qkvz, "in_proj_ba.weight": ba}
    return {"in_proj_qkv.weight": torch.cat([q.reshape(-1, H), k.reshape(-1, H), v.reshape(-1, H)]),
            "in_proj_z.weight": z.reshape(-1, H), "in_proj_b.weight": b, "in_proj_a.weight": a}


# ------------------------------------------------------------------------------------------------ plan + configs


def plan_hybrid(tcfg: dict, big: HybridShape, dcfg: dict | None = None) -> dict:
    """Where each small target / drafter layer goes, and which big feature block carries each small feature."""
    reads, which, small_ids = {}, [], []
    if dcfg is not None:
        small_ids = [int(i) for i in (dcfg.get("dflash_config") or {}).get("target_layer_ids")
                     or dcfg["target_layer_ids"]]
        which = feature_anchors(small_ids, big.drafter_layer_ids)
        reads = {s: big.drafter_layer_ids[j] for s, j in zip(small_ids, which)}
    live = typed_layer_map(small_layer_types(tcfg), big.layer_types, reads)
    plan = {"target_live_layers": live, "feature_blocks": which, "small_feature_ids": small_ids}
    if dcfg is not None:
        n = int(dcfg["num_hidden_layers"])
        if n > big.drafter_layers:
            raise ValueError(f"the small drafter has {n} layers, the big one {big.drafter_layers}.")
        plan["drafter_live_layers"] = [round((i + 1) * big.drafter_layers / n) - 1 for i in range(n)]
    return plan


def big_target_config(tcfg: dict, big: HybridShape, scales: HybridScales, plan: dict) -> dict:
    layout = small_layout(tcfg)
    theta, _ = _rope(tcfg)
    t = {k: v for k, v in tcfg.items() if not k.startswith("_")}
    t.update(hidden_size=big.hidden, num_hidden_layers=big.layers, layer_types=big.layer_types,
             full_attention_interval=big.full_attention_interval, num_attention_heads=big.heads,
             num_key_value_heads=big.kv_heads, head_dim=big.head_dim, partial_rotary_factor=big.partial_rotary_factor,
             linear_num_key_heads=big.linear_key_heads, linear_num_value_heads=big.linear_value_heads,
             linear_key_head_dim=big.linear_key_head_dim, linear_value_head_dim=big.linear_value_head_dim,
             linear_conv_kernel_dim=big.conv_kernel, intermediate_size=big.intermediate, vocab_size=big.vocab,
             max_position_embeddings=big.max_positions, tie_word_embeddings=False,
             rms_norm_eps=float(tcfg["rms_norm_eps"]) * scales.eps_factor, rope_theta=theta)
    t["rope_parameters"] = dict(tcfg.get("rope_parameters") or {"rope_type": "default"}, rope_theta=theta,
                                partial_rotary_factor=big.partial_rotary_factor)
    if layout == "qwen3_next":
        t["mlp_only_layers"] = list(range(big.layers))
        t["architectures"] = ["Qwen3NextForCausalLM"]
    else:
        t["architectures"] = ["Qwen3_5ForCausalLM"]
    t["widened_from"] = {"shape": big.name, "layout": layout, "scales": scales.asdict(),
                         "constant_dim": big.hidden - 1, **plan}
    return t


def big_drafter_config(dcfg: dict, big: HybridShape, scales: HybridScales) -> dict:
    d = {k: v for k, v in dcfg.items() if not k.startswith("_")}
    d.update(hidden_size=big.hidden, num_hidden_layers=big.drafter_layers, num_attention_heads=big.drafter_heads,
             num_key_value_heads=big.drafter_kv_heads, head_dim=big.drafter_head_dim,
             intermediate_size=big.drafter_intermediate, vocab_size=big.vocab, max_position_embeddings=big.max_positions,
             num_target_layers=big.layers, rms_norm_eps=float(dcfg["rms_norm_eps"]) * scales.eps_factor)
    d["dflash_config"] = dict(dcfg.get("dflash_config") or {}, target_layer_ids=list(big.drafter_layer_ids))
    d["layer_types"] = ["full_attention"] * big.drafter_layers
    return d


def drafter_dims(dcfg: dict, tcfg: dict, big: HybridShape) -> tuple[int, int, int, int, int]:
    """(hidden, q heads, kv heads, head_dim, intermediate) of the small drafter; refused where the big one cannot
    hold it."""
    h = int(dcfg["hidden_size"])
    if h != int(tcfg["hidden_size"]):
        raise ValueError("the small drafter's hidden size differs from its target's.")
    nq, nkv = int(dcfg["num_attention_heads"]), int(dcfg["num_key_value_heads"])
    d = int(dcfg.get("head_dim") or h // nq)
    inter = int(dcfg["intermediate_size"])
    if big.drafter_kv_heads < nkv or big.drafter_heads // big.drafter_kv_heads < nq // nkv \
            or big.drafter_intermediate < inter:
        raise ValueError(f"{big.name}: the big drafter is narrower than the small one.")
    return h, nq, nkv, d, inter


def check_hybrid_pair(tcfg: dict, big: HybridShape, dcfg: dict | None = None) -> dict:
    """What the builders would refuse, checked without building a tensor (a 27B widening writes 57 GB): the layout,
    the layer / feature plan, the head and dim fits, and the scales. `scales["bf16_exact"]` says whether the bf16
    checkpoint would be the small one times powers of two."""
    layout = small_layout(tcfg)
    _check_dense(tcfg)
    scales = hybrid_scales(tcfg, big, dcfg)
    plan = plan_hybrid(tcfg, big, dcfg)
    HybridWidener(tcfg, big, torch.bfloat16, scales, layout)  # its constructor refuses what does not fit
    if dcfg is not None:
        d = drafter_dims(dcfg, tcfg, big)[3]
        head_slots(d, big.drafter_head_dim, d, big.drafter_head_dim)
    return {"shape": big.name, "layout": layout, **plan, "scales": scales.asdict()}


# ------------------------------------------------------------------------------------------------ builders


def widen_hybrid_target(tcfg: dict, tsd: dict, big: HybridShape, *, dcfg: dict | None = None,
                        dtype: torch.dtype = torch.bfloat16, emit=None) -> tuple[dict, dict]:
    """(big config, big state dict) of the target. `emit(tensors)`, when given, receives the tensors piece by piece
    (for a streaming writer) and the returned state dict stays empty."""
    layout = small_layout(tcfg)
    _check_dense(tcfg)
    scales = hybrid_scales(tcfg, big, dcfg)
    plan = plan_hybrid(tcfg, big, dcfg)
    w = HybridWidener(tcfg, big, dtype, scales, layout)
    sd: dict = {}
    sink = emit or sd.update
    emb = w.embeddings(tsd)
    sink({"model.embed_tokens.weight": emb.pop("model.embed_tokens.weight")})
    live = {b: s for s, b in enumerate(plan["target_live_layers"])}
    for i, kind in enumerate(big.layer_types):
        s = live.get(i)
        sink(w.layer(tsd if s is not None else None, kind, s, i))
    sink(emb)
    return big_target_config(tcfg, big, scales, plan), sd


def widen_hybrid_drafter(dcfg: dict, dsd: dict, tcfg: dict, big: HybridShape, *,
                         dtype: torch.dtype = torch.bfloat16) -> tuple[dict, dict]:
    """(big config, big state dict) of a DFlash drafter (sglang_ddtree.drafter format) of the small target."""
    scales = hybrid_scales(tcfg, big, dcfg)
    plan = plan_hybrid(tcfg, big, dcfg)
    h, nq, nkv, d, inter = drafter_dims(dcfg, tcfg, big)
    H, D = big.hidden, big.drafter_head_dim
    g, G = nq // nkv, big.drafter_heads // big.drafter_kv_heads
    prim, copies = head_slots(d, D, d, D)
    z = lambda *shape: torch.zeros(*shape, dtype=dtype)  # noqa: E731

    def put(out, index, value, scale=1.0):
        out[index] = (value.double() * scale).to(dtype)

    def norm(w, const_gain=None):
        out = z(H)
        put(out, slice(0, h), w)
        if const_gain is not None:
            out[H - 1] = const_gain  # Qwen3-style w * x_hat
        return out

    sd: dict = {}
    nf = len(big.drafter_layer_ids)
    fc = z(H, nf * H)
    fcs = dsd["fc.weight"].float()
    for j, block in enumerate(plan["feature_blocks"]):
        put(fc, (slice(0, h), slice(block * H, block * H + h)), fcs[:, j * h:(j + 1) * h])
    sd["fc.weight"] = fc
    sd["hidden_norm.weight"] = norm(dsd["hidden_norm.weight"])
    sd["norm.weight"] = norm(dsd["norm.weight"], CONST_NORM_GAIN)
    live = {b: s for s, b in enumerate(plan["drafter_live_layers"])}
    rd = scales.read
    for i in range(big.drafter_layers):
        bp = f"layers.{i}."
        s = live.get(i)
        if s is None:
            sd.update({bp + n[len("layers.0."):]: z(*shape) for n, shape in hybrid_drafter_shapes(big).items()
                       if n.startswith("layers.0.")})
            continue
        sp = f"layers.{s}."
        a = sp + "self_attn."
        sq, sk = dsd[a + "q_proj.weight"].float(), dsd[a + "k_proj.weight"].float()
        sv, so = dsd[a + "v_proj.weight"].float(), dsd[a + "o_proj.weight"].float()
        q, k, v, o = z(big.drafter_heads * D, H), z(big.drafter_kv_heads * D, H), z(big.drafter_kv_heads * D, H), \
            z(H, big.drafter_heads * D)
        for hq in range(nq):
            gg, j = divmod(hq, g)
            base = (gg * G + j) * D
            for slots in [prim] + copies:
                put(q, (base + slots, slice(0, h)), sq[hq * d:(hq + 1) * d], scales.q() * rd)
            put(o, (slice(0, h), base + prim), so[:, hq * d:(hq + 1) * d], scales.stream)
        for gg in range(nkv):
            put(k, (gg * D + prim, slice(0, h)), sk[gg * d:(gg + 1) * d], scales.k(scales.m_drafter) * rd)
            put(v, (gg * D + prim, slice(0, h)), sv[gg * d:(gg + 1) * d], rd)
        qn, kn = z(D), z(D)
        for slots in [prim] + copies:
            put(qn, slots, dsd[a + "q_norm.weight"])
        put(kn, prim, dsd[a + "k_norm.weight"])
        m = sp + "mlp."
        I = big.drafter_intermediate
        gate, up, down = z(I, H), z(I, H), z(H, I)
        put(gate, (slice(0, inter), slice(0, h)), dsd[m + "gate_proj.weight"], rd)
        put(up, (slice(0, inter), slice(0, h)), dsd[m + "up_proj.weight"], rd)
        put(down, (slice(0, h), slice(0, inter)), dsd[m + "down_proj.weight"], scales.stream)
        sd.update({bp + "self_attn.q_proj.weight": q, bp + "self_attn.k_proj.weight": k,
                   bp + "self_attn.v_proj.weight": v, bp + "self_attn.o_proj.weight": o,
                   bp + "self_attn.q_norm.weight": qn, bp + "self_attn.k_norm.weight": kn,
                   bp + "mlp.gate_proj.weight": gate, bp + "mlp.up_proj.weight": up, bp + "mlp.down_proj.weight": down,
                   bp + "input_layernorm.weight": norm(dsd[sp + "input_layernorm.weight"]),
                   bp + "post_attention_layernorm.weight": norm(dsd[sp + "post_attention_layernorm.weight"])})
    return big_drafter_config(dcfg, big, scales), sd


# ------------------------------------------------------------------------------------------------ files


def _load(folder: Path) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no safetensors weights.")
    sd = {}
    for f in files:
        sd.update(load_file(str(f)))
    return cfg, sd


class NoRoomError(ValueError):
    """The widening would not fit on its disk (raised before anything is written or removed)."""


DISK_MARGIN_BYTES = 2 * 2**30  # shard indexes, tokenizer files, and room left for logs beside a full disk


def pair_bytes(big: HybridShape, layout: str = "qwen3_5_text", *, drafter: bool = True,
               dtype: torch.dtype = torch.bfloat16) -> int:
    """The widened pair's weight bytes (the files are a few KB more)."""
    n = param_count(hybrid_target_shapes(big, layout)) + (param_count(hybrid_drafter_shapes(big)) if drafter else 0)
    return n * torch.empty((), dtype=dtype).element_size()


def check_room(out_dir: Path, need: int) -> dict:
    """Refuses (NoRoomError) when out_dir's disk cannot take `need` bytes plus DISK_MARGIN_BYTES; an earlier
    widening in out_dir/target and out_dir/drafter counts as free (it is replaced)."""
    out_dir = Path(out_dir)
    probe = out_dir
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    old = sum(f.stat().st_size for sub in ("target", "drafter") if (out_dir / sub).is_dir()
              for f in (out_dir / sub).rglob("*") if f.is_file())
    info = {"need_bytes": need, "free_bytes": free, "reclaimed_bytes": old}
    if free + old < need + DISK_MARGIN_BYTES:
        raise NoRoomError(f"widen_hybrid: the widened pair needs {need / 1e9:.1f} GB (+ {DISK_MARGIN_BYTES / 2**30:g} "
                          f"GiB margin) at {out_dir}, but its disk has {free / 1e9:.1f} GB free"
                          + (f" (+ {old / 1e9:.1f} GB of the widening there, which it would replace)" if old else "")
                          + "; nothing was written. Free some space (`df -h`, `du -sh /tmp/* runs/*`) or pick another "
                            "--out.")
    return info


def small_configs(small_dir: Path) -> tuple[dict, dict | None]:
    """The small pair's target config and its drafter's (None when small_dir has no drafter)."""
    small_dir = Path(small_dir)
    tcfg = json.loads((small_dir / "target" / "config.json").read_text())
    dpath = small_dir / "drafter" / "config.json"
    return tcfg, (json.loads(dpath.read_text()) if dpath.is_file() else None)


def write_configs(small_dir: Path, big: HybridShape, out_dir: Path) -> None:
    """Only the two big config.json files of small_dir's widening (enough to plan a benchmark; no weights, so
    is_built stays False)."""
    out_dir = Path(out_dir)
    tcfg, dcfg = small_configs(small_dir)
    scales = hybrid_scales(tcfg, big, dcfg)
    configs = {"target": big_target_config(tcfg, big, scales, plan_hybrid(tcfg, big, dcfg))}
    if dcfg is not None:
        configs["drafter"] = big_drafter_config(dcfg, big, scales)
    for sub, cfg in configs.items():
        (out_dir / sub).mkdir(parents=True, exist_ok=True)
        (out_dir / sub / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def widen_hybrid_pair(small_dir: Path, big: HybridShape, out_dir: Path, *, dtype: torch.dtype = torch.bfloat16,
                      shard_gib: float = 4.0, log=print) -> dict:
    """small_dir/target (+ small_dir/drafter if present) -> out_dir/target (+ out_dir/drafter). NoRoomError, before
    anything is written or removed, when out_dir's disk has no room for it (check_room)."""
    t0 = time.time()
    small_dir, out_dir = Path(small_dir), Path(out_dir)
    tcfg, tsd = _load(small_dir / "target")
    has_drafter = (small_dir / "drafter" / "config.json").is_file()
    dcfg, dsd = _load(small_dir / "drafter") if has_drafter else (None, None)
    room = check_room(out_dir, pair_bytes(big, small_layout(tcfg), drafter=has_drafter, dtype=dtype))
    log(f"[widen_hybrid] {big.name}: {room['need_bytes'] / 1e9:.1f} GB to write, {room['free_bytes'] / 1e9:.1f} GB "
        f"free at {out_dir}")
    for sub in ("target", "drafter"):
        if (out_dir / sub).exists():
            shutil.rmtree(out_dir / sub)
    (out_dir / "target").mkdir(parents=True)
    writer = _ShardWriter(out_dir / "target", int(shard_gib * 2**30))
    cfg, _ = widen_hybrid_target(tcfg, tsd, big, dcfg=dcfg, dtype=dtype, emit=writer.add)
    writer.close()
    for name in TOKENIZER_FILES:
        if (small_dir / "target" / name).is_file():
            shutil.copy(small_dir / "target" / name, out_dir / "target" / name)
    info = {"shape": big.name, "out": str(out_dir), **cfg["widened_from"],
            "target_params": param_count(hybrid_target_shapes(big, small_layout(tcfg)))}
    if has_drafter:
        (out_dir / "drafter").mkdir(parents=True)
        dcfg_big, dsd_big = widen_hybrid_drafter(dcfg, dsd, tcfg, big, dtype=dtype)
        writer = _ShardWriter(out_dir / "drafter", int(shard_gib * 2**30))
        writer.add(dsd_big)
        writer.close()
        (out_dir / "drafter" / "config.json").write_text(json.dumps(dcfg_big, indent=2) + "\n")
        info["drafter_params"] = param_count(hybrid_drafter_shapes(big))
    # the target config last: its presence marks a finished widening
    (out_dir / "target" / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    info["seconds"] = round(time.time() - t0, 1)
    log(f"[widen_hybrid] {big.name}: target {info['target_params']:,} parameters "
        f"(drafter {info.get('drafter_params', 0):,}) in {info['seconds']} s -> {out_dir}")
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_ddtree.widen_hybrid", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(HYBRID_SHAPES), required=True)
    ap.add_argument("--small", type=Path, help="folder with target/ (and drafter/) of the small hybrid pair")
    ap.add_argument("--out", type=Path, help="folder for target/ and drafter/ (replaced)")
    ap.add_argument("--meta", action="store_true", help="print the big shape's parameter counts, build nothing")
    ap.add_argument("--check", action="store_true",
                    help="print the plan and scales for --small (refused if it does not fit), build nothing")
    ap.add_argument("--if-missing", action="store_true", help="do nothing when --out already holds this shape")
    ap.add_argument("--shard-gib", type=float, default=4.0)
    args = ap.parse_args(argv)
    big = HYBRID_SHAPES[args.shape]
    if args.meta:
        print(json.dumps(meta(big), indent=1))
        return 0
    if args.check:
        if args.small is None:
            ap.error("--check needs --small.")
        tcfg, dcfg = small_configs(args.small)
        print(json.dumps(check_hybrid_pair(tcfg, big, dcfg), indent=1))
        return 0
    if args.small is None or args.out is None:
        ap.error("--small and --out are required unless --meta or --check.")
    if args.if_missing and is_built(args.out, big):
        print(f"[widen_hybrid] {args.out} already holds the {big.name} widening")
        return 0
    if not (args.small / "target" / "config.json").is_file():
        ap.error(f"{args.small / 'target'} has no config.json; --small must hold target/ (and drafter/).")
    try:
        widen_hybrid_pair(args.small, big, args.out, shard_gib=args.shard_gib)
    except NoRoomError as exc:
        print(exc, file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
