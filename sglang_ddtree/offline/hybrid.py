"""Tree verification through a hybrid target (recurrent layers mixed with full attention), batch size 1.

Why the attention-mask verify of target.py is wrong here: a recurrent layer (gated-delta-net, mamba) carries one
running state per sequence, updated token after token. A forward over the N tree nodes as one sequence would push
every node through the states of ALL the nodes before it in slot order, siblings and cousins included; no mask can
express "start from your parent's state". And after the walk, the committed state must be the accepted node's,
which `crop` cannot produce (transformers does not crop linear-attention state at all).

What a node needs, per layer kind:
  recurrent layer   the layer state (conv window + SSM state) after its parent, i.e. after committed + ancestors;
  attention layer   the K/V of the committed tokens and of its ancestors, at positions start + depth.

Two verify paths, same outputs (logits [N, V] per node, optional hidden states per node):
  oracle  node by node in slot order (parents come first): copy the parent's whole cache (the committed cache for
          the root), run the node's one token on the copy. Obviously right: it is plain decoding of the node's
          root-to-node path, with the cache cloned at every branch point. N one-token forwards; N cache copies.
  tree    depth by depth: all nodes of depth d in ONE batched forward, one row per node, each row a one-token
          causal forward on a cache assembled for that row: recurrent layers get the parent's state (gathered
          from per-node state buffers), attention layers get committed K/V + the K/V of the row's d ancestors in
          depth order (gathered), so no mask is needed. After the forward each row's new state and K/V are stored
          per node. max_depth + 1 forwards per round. The per-node recurrent states are exactly what SGLang's tree
          mode keeps per draft token (docs/hybrid-design.md).
Commit (after the walk picked the accepted path root..last):
  gather  tree: attention layers append the path nodes' K/V; recurrent layers take node `last`'s state.
          oracle: the committed cache becomes node `last`'s cache (it holds committed + path, token by token).
  rerun   replay root + accepted tokens with one causal forward on the untouched committed cache.

Only transformers caches made of full-attention `DynamicLayer`s and `LinearAttentionLayer`s (conv_states +
recurrent_states) are supported; anything else raises a ValueError naming the layer.
"""

from __future__ import annotations

import copy

import torch

from sglang_ddtree.offline.target import TargetState
from sglang_ddtree.tree import DraftTree

MODES = ("oracle", "tree")
ATTENTION, RECURRENT = "attention", "recurrent"


def cache_layer_kinds(cache) -> list[str]:
    """Per layer of a transformers cache: 'attention' (full-attention K/V) or 'recurrent' (conv + SSM state)."""
    from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

    kinds = []
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, LinearAttentionCacheLayerMixin) and not isinstance(layer, DynamicLayer):
            kinds.append(RECURRENT)
        elif type(layer) is DynamicLayer:
            kinds.append(ATTENTION)
        else:
            raise ValueError(
                f"cache layer {i} is a {type(layer).__name__}; hybrid verification supports full-attention "
                f"DynamicLayer and LinearAttentionLayer caches only."
            )
    return kinds


class HybridTargetState(TargetState):
    """The committed cache of one sequence on a hybrid target, plus tree verify / commit (module docstring).

    `verify(tree, start)` never touches the committed cache; `commit(start, path, rerun)` then advances it by the
    accepted path. The committed length is counted here (recurrent layers do not track one).
    """

    def __init__(self, model, *, want_hidden: bool, mode: str):
        if mode not in MODES:
            raise ValueError(f"hybrid_verify must be one of {', '.join(MODES)}, got {mode!r}.")
        super().__init__(model, want_hidden=want_hidden)
        self.mode = mode
        self.kinds = cache_layer_kinds(self.cache)
        self.length = 0
        self._nodes = None  # what the last verify kept for the commit

    @property
    def committed(self) -> int:
        return self.length

    @torch.no_grad()
    def causal(self, ids: torch.Tensor, start: int):
        if self.length != start:
            raise ValueError(f"cache holds {self.length} tokens but the forward starts at position {start}.")
        out = super()._forward(ids, torch.arange(start, start + ids.numel(), device=self.device), None)
        self.length += ids.numel()
        return out

    def _one_token(self, cache, ids: torch.Tensor, position: int):
        """ids [R] -> rows of one-token forwards at `position` on a cache with batch R."""
        out = self.model(
            input_ids=ids.to(self.device).view(-1, 1),
            position_ids=torch.full((ids.numel(), 1), position, dtype=torch.long, device=self.device),
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=self.want_hidden,
        )
        hidden = tuple(h[:, -1] for h in out.hidden_states) if self.want_hidden else None
        return out.logits[:, -1].float(), hidden

    # ---------------------------------------------------------------------------------------------- verify

    @torch.no_grad()
    def verify(self, tree: DraftTree, start: int):
        """Batch-1 tree (valid slots only) -> (logits [N, V] float32, hidden tuple of [1, N, H] or None)."""
        if self.length != start:
            raise ValueError(f"cache holds {self.length} tokens but the tree root sits at position {start}.")
        if tree.tokens.shape[0] != 1 or not bool(tree.valid.all()):
            raise ValueError("hybrid verify takes a batch-1 tree trimmed to its valid nodes (slots 0..n-1).")
        tokens, parents, depth = tree.tokens[0].to(self.device), tree.parents[0].tolist(), tree.depth[0].tolist()
        if self.mode == "oracle":
            return self._verify_oracle(tokens, parents, depth, start)
        return self._verify_tree(tokens, parents, depth, start)

    def _verify_oracle(self, tokens, parents: list[int], depth: list[int], start: int):
        n = tokens.numel()
        caches, logits, hidden = [], [], []
        for i in range(n):
            cache = copy.deepcopy(self.cache if i == 0 else caches[parents[i]])
            lg, hs = self._one_token(cache, tokens[i : i + 1], start + depth[i])
            caches.append(cache)
            logits.append(lg[0])
            hidden.append(hs)
        self._nodes = {"caches": caches, "hidden": self._stack_hidden(hidden)}
        return torch.stack(logits), self._nodes["hidden"]

    def _stack_hidden(self, per_node):
        """list over nodes of tuples of [1, H] (or Nones) -> tuple over layers of [1, N, H]."""
        if not self.want_hidden:
            return None
        return tuple(torch.cat(layer, dim=0).unsqueeze(0) for layer in zip(*per_node))

    def _verify_tree(self, tokens, parents: list[int], depth: list[int], start: int):
        n = tokens.numel()
        max_depth = max(depth)
        # ancestors[i][k] = the node at depth k on i's root-to-node path (k <= depth[i]); parents precede children
        paths = [[0]]
        for i in range(1, n):
            paths.append(paths[parents[i]] + [i])
        ancestors = torch.tensor([p + [0] * (max_depth + 1 - len(p)) for p in paths], device=self.device)
        parents_t = torch.tensor(parents, device=self.device)
        depth_t = torch.tensor(depth, device=self.device)
        node_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> K, V [N, kv_heads, head_dim]
        node_state: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}  # layer -> conv [N, ...], ssm [N, ...]
        logits = hidden = None
        for d in range(max_depth + 1):
            rows = (depth_t == d).nonzero().view(-1)
            cache = self._row_cache(rows, ancestors[rows, :d], parents_t[rows], d, node_kv, node_state)
            lg, hs = self._one_token(cache, tokens[rows], start + d)
            if logits is None:
                logits = lg.new_empty((n, lg.shape[-1]))
                hidden = [h.new_empty((n, h.shape[-1])) for h in hs] if hs is not None else None
            logits[rows] = lg
            if hidden is not None:
                for buf, h in zip(hidden, hs):
                    buf[rows] = h
            for layer_idx, (kind, layer) in enumerate(zip(self.kinds, cache.layers)):
                if kind == ATTENTION:
                    k, v = layer.keys[:, :, -1], layer.values[:, :, -1]  # the rows' own K/V, [R, kv_heads, hd]
                    if layer_idx not in node_kv:
                        node_kv[layer_idx] = (k.new_empty((n, *k.shape[1:])), v.new_empty((n, *v.shape[1:])))
                    node_kv[layer_idx][0][rows], node_kv[layer_idx][1][rows] = k, v
                else:
                    conv, ssm = layer.conv_states, layer.recurrent_states
                    if layer_idx not in node_state:
                        node_state[layer_idx] = (conv.new_empty((n, *conv.shape[1:])),
                                                 None if ssm is None else ssm.new_empty((n, *ssm.shape[1:])))
                    node_state[layer_idx][0][rows] = conv
                    if ssm is not None:
                        node_state[layer_idx][1][rows] = ssm
        hidden = None if hidden is None else tuple(h.unsqueeze(0) for h in hidden)
        self._nodes = {"kv": node_kv, "state": node_state, "hidden": hidden}
        return logits, hidden

    def _row_cache(self, rows, row_ancestors, row_parents, d: int, node_kv, node_state):
        """A batch-R cache: row j holds node rows[j]'s context (committed + its d ancestors)."""
        from transformers import DynamicCache

        r = rows.numel()
        cache = DynamicCache(config=self.model.config)
        for layer_idx, (kind, committed) in enumerate(zip(self.kinds, self.cache.layers)):
            if kind == ATTENTION:
                keys, values = committed.keys.expand(r, -1, -1, -1), committed.values.expand(r, -1, -1, -1)
                if d > 0:  # ancestors' K/V [R, d, kv_heads, hd] -> [R, kv_heads, d, hd], after the committed ones
                    anc_k, anc_v = (x[row_ancestors].transpose(1, 2) for x in node_kv[layer_idx])
                    keys, values = torch.cat([keys, anc_k], dim=2), torch.cat([values, anc_v], dim=2)
                cache.update(keys.contiguous(), values.contiguous(), layer_idx)
            else:
                if d == 0:
                    conv, ssm = committed.conv_states, committed.recurrent_states
                else:
                    conv, ssm = (None if x is None else x[row_parents] for x in node_state[layer_idx])
                if conv is None:
                    raise ValueError(f"recurrent cache layer {layer_idx} has no conv state; not supported.")
                # the update methods copy into fresh tensors: the forward's in-place writes never reach the buffers
                cache.update_conv_state(conv.expand(r, *conv.shape[1:]), layer_idx)
                if ssm is not None:
                    cache.update_recurrent_state(ssm.expand(r, *ssm.shape[1:]), layer_idx)
        return cache

    # ---------------------------------------------------------------------------------------------- commit

    @torch.no_grad()
    def commit(self, start: int, path: torch.Tensor, *, rerun: bool = False, path_tokens: torch.Tensor | None = None):
        """Commit root + accepted nodes (`path`, node indices in order) after `verify`.

        Returns the hidden states of the committed tokens (tuple of [1, len(path), H]) or None.
        rerun=True replays `path_tokens` with a causal forward instead of reusing what the verify computed.
        """
        if self._nodes is None:
            raise ValueError("commit needs a verify of the same round first.")
        if self.length != start:
            raise ValueError(f"cache holds {self.length} tokens but the round's root sits at position {start}.")
        nodes, self._nodes = self._nodes, None
        path = path.to(self.device)
        if rerun:
            if path_tokens is None:
                raise ValueError("commit(rerun=True) needs the path's tokens.")
            _, hidden = self.causal(path_tokens, start)
            return hidden
        if self.mode == "oracle":
            self.cache = nodes["caches"][int(path[-1])]
        else:
            last = int(path[-1])
            for layer_idx, (kind, layer) in enumerate(zip(self.kinds, self.cache.layers)):
                if kind == ATTENTION:
                    k, v = (x[path].transpose(0, 1).unsqueeze(0) for x in nodes["kv"][layer_idx])
                    self.cache.update(k.contiguous(), v.contiguous(), layer_idx)
                else:
                    conv, ssm = nodes["state"][layer_idx]
                    layer.conv_states.copy_(conv[last : last + 1])
                    if ssm is not None:
                        layer.recurrent_states.copy_(ssm[last : last + 1])
        self.length += path.numel()
        return None if nodes["hidden"] is None else tuple(h[:, path] for h in nodes["hidden"])

    # ---------------------------------------------------------------------------------------------- inspection

    def layer_states(self) -> list[dict[str, torch.Tensor]]:
        """The committed cache per layer (attention: keys/values; recurrent: conv/ssm), for tests and debugging."""
        out = []
        for kind, layer in zip(self.kinds, self.cache.layers):
            if kind == ATTENTION:
                out.append({"keys": layer.keys, "values": layer.values})
            else:
                out.append({"conv": layer.conv_states, "ssm": layer.recurrent_states})
        return out
