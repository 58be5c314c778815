"""The target model side of the offline decoders: a transformers causal LM plus its `DynamicCache`.

Verification of a draft tree is ONE forward over all tree nodes on top of the KV cache of the committed tokens,
with a 4D additive float mask (0 = may attend, dtype-min = may not) that lets each node see the whole committed
past plus itself and its ancestors, and position ids start + depth. transformers 5.12 passes a 4D mask through
unchanged (masking_utils: "already prepared 4D mask") to both the eager path (added to the scores) and SDPA (float
attn_mask, added too); flash-attention kernels ignore custom masks, so only eager and sdpa are accepted.

Commit (after the walk picked the accepted path): the cache then holds past + all N tree nodes. We keep the past
and the K/V of the accepted path nodes only, in path order ("gather"). That is exact: a path node's K/V were
computed at its true position (start + depth) from a hidden state that saw exactly its causal context (past +
ancestors = the accepted prefix), which is what a causal forward over the accepted tokens computes. The cross-check
mode "rerun" crops the cache to the past and recomputes the accepted tokens with a causal forward (one more
forward per round, no reliance on cache internals); tests check both give the same tokens.

Hybrid targets (recurrent layers: gated-delta-net, mamba, ...) cannot use any of this: a recurrent layer's state is
one running summary of the whole sequence, so a masked forward over the tree chains all nodes through it, and
`crop` cannot roll it back. `is_hybrid` detects them; `tree`, `keep_nodes` and a shrinking `crop` refuse them, and
the decoders send them to `hybrid.HybridTargetState` instead.
"""

from __future__ import annotations

import torch

_MASKABLE = ("eager", "sdpa")
_RECURRENT_LAYER_TYPES = ("linear_attention", "mamba", "conv")  # transformers' linear-attention cache layer types


def is_hybrid(model) -> bool:
    """True when the model keeps recurrent state that a KV-cache crop cannot roll back: transformers flags such
    models with `_is_stateful` (Qwen3-Next, Qwen3.5, Jamba, Mamba, ...); a config whose `layer_types` lists a
    recurrent layer ("linear_attention", "mamba", "conv") counts too."""
    if bool(getattr(model, "_is_stateful", False)):
        return True
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    layer_types = getattr(cfg, "layer_types", None) or []
    return any(t in _RECURRENT_LAYER_TYPES for t in layer_types)


def refuse_hybrid(model, what: str) -> None:
    if is_hybrid(model):
        raise ValueError(
            f"{what} only works for attention-only targets; {type(model).__name__} has recurrent (linear-attention / "
            f"mamba) layers whose state cannot be masked per tree node or cropped: use hybrid_verify='oracle' or "
            f"'tree' (CLI: --hybrid-verify)."
        )


def attn_implementation(model) -> str:
    return str(getattr(model.config, "_attn_implementation", None) or "eager")


def check_target(model, needs_custom_mask: bool) -> None:
    impl = attn_implementation(model)
    if needs_custom_mask and impl not in _MASKABLE:
        raise ValueError(
            f"tree verification needs a custom 4D attention mask; the target uses attn_implementation={impl!r}, "
            f"allowed: {', '.join(_MASKABLE)} (load it with attn_implementation='sdpa')."
        )


class TargetState:
    """A target model and the KV cache of one sequence's committed tokens (batch size 1)."""

    def __init__(self, model, *, want_hidden: bool):
        from transformers import DynamicCache

        self.model = model
        self.want_hidden = want_hidden
        self.cache = DynamicCache(config=model.config)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype

    @property
    def committed(self) -> int:
        return self.cache.get_seq_length()

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None):
        out = self.model(
            input_ids=ids.to(self.device).view(1, -1),
            position_ids=positions.to(self.device).view(1, -1),
            attention_mask=mask,
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=self.want_hidden,
        )
        return out.logits[0].float(), (out.hidden_states if self.want_hidden else None)

    @torch.no_grad()
    def causal(self, ids: torch.Tensor, start: int):
        """Causal forward of `ids` at positions start.. on top of the cache (which must hold `start` tokens).
        Returns (logits [n, V] float32, hidden_states tuple or None). The cache grows by n."""
        if self.committed != start:
            raise ValueError(f"cache holds {self.committed} tokens but the forward starts at position {start}.")
        n = ids.numel()
        return self._forward(ids, torch.arange(start, start + n, device=self.device), None)

    @torch.no_grad()
    def tree(self, ids: torch.Tensor, depth: torch.Tensor, ancestors: torch.Tensor, start: int):
        """Tree forward: ids/depth [n], ancestors [n, n] bool (row i: the nodes node i may see). Positions are
        start + depth; every node also sees the whole committed past. The cache grows by n (all nodes)."""
        refuse_hybrid(self.model, "tree verification with an ancestor attention mask")
        if self.committed != start:
            raise ValueError(f"cache holds {self.committed} tokens but the tree root sits at position {start}.")
        n = ids.numel()
        ancestors = ancestors.to(self.device, torch.bool)
        allowed = torch.cat([torch.ones(n, start, dtype=torch.bool, device=self.device), ancestors], dim=1)
        mask = torch.zeros((n, start + n), dtype=self.dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return self._forward(ids, start + depth.to(self.device), mask.view(1, 1, n, start + n))

    def crop(self, length: int) -> None:
        if length < self.committed:
            refuse_hybrid(self.model, "cropping the cache (chain verify / commit='rerun')")
        self.cache.crop(length)

    @torch.no_grad()
    def keep_nodes(self, start: int, nodes: torch.Tensor) -> None:
        """After a tree forward: keep the past (start tokens) and the K/V of `nodes` (tree node indices, in the
        order they are committed)."""
        refuse_hybrid(self.model, "gather-commit of tree nodes from the cache")
        idx = (start + nodes.to(torch.int64)).to(self.device)
        kept = []
        for layer in self.cache.layers:
            if getattr(layer, "is_sliding", False) or not hasattr(layer, "keys"):
                raise ValueError("gather-commit needs plain full-attention cache layers; use commit='rerun'.")
            kept.append((layer.keys.index_select(2, idx), layer.values.index_select(2, idx)))
        self.cache.crop(start)
        for layer_idx, (k, v) in enumerate(kept):
            self.cache.update(k, v, layer_idx)


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...]: top-1 minus top-2 logit (how far the argmax is from a tie)."""
    if logits.shape[-1] < 2:
        return torch.full(logits.shape[:-1], float("inf"))
    top = logits.float().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]
