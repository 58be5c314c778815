"""The short causal convolution of gated-delta-net layers over a verify tree, without unrolling over the tree.

A hybrid target's recurrent layers start with a depthwise causal conv1d of width K (4 in Qwen3-Next): token t's
output mixes t's input with its K-1 predecessors. In a tree verify the predecessors of node t are its ancestors
(parent, grand-parent, ...) and, above the root, the last K-1 inputs before the round (the layer's conv state).

SGLang 0.5.17 computes this in its conv-update kernel (`causal_conv1d_triton.py`), which unrolls a loop over the
verify tokens at compile time and derives every node's parent on the way: its first compile took 166 s for 129
tokens on an H200 and had not finished after 7 minutes for 257, so trees of 128+ nodes could not serve.
Here the parents come first (`parents_from_retrieve`, from the same next-token / next-sibling arrays, a few
gathers), and one program per (request, block of channels) walks the tokens in an ordinary loop, following the
parent array for each token's window: compile time no longer depends on the tree size.

What the kernel reproduces, for the tree verify call of SGLang's `causal_conv1d_update` (no circular buffer, no
accepted-token offset):
  - out[b, :, t] = act(bias + sum_j x[a_j] * w[:, K-1-j]) with a_0 = t, a_j = parent(a_{j-1}); above the root the
    conv state's columns, newest first; each product in the inputs' dtype (bf16 in serving, as SGLang's kernels and
    so plain decoding compute it), accumulated in float32 in that order; act = SiLU or none;
  - the per-token window kept for the commit: intermediate[line_b, t, :, K-2-j] = x[a_j] for j <= K-2;
  - the conv state rolled by the verify tokens (the last K-1 of [old state, x[b]]), as a chain verify would leave it;
  - the derived parent of every token written to retrieve_parent_token (0 for the root and for padding slots, as
    SGLang's kernel leaves them), which SGLang's tree-aware recurrent kernel reads next;
  - rows whose conv-state index is the pad slot are left alone.
`tree_conv_reference` is the same in plain torch, for tests.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference still works
    triton = None
    tl = None

PAD_SLOT_ID = -1

# Verify tokens up to which a tree verify takes SGLang's conv kernel under SGLANG_DDTREE_TREE_CONV=auto (the one
# the hybrid GPU module passed with at B = 16 and 64): above it SGLang's, which unrolls over the verify tokens,
# compiles for minutes, so ours runs.
SGLANG_MAX_TOKENS = 65


def use_ours(verify_tokens: int, choice: str = "auto") -> bool:
    """Whether a tree verify of this many tokens per request takes causal_conv1d_tree_update. choice: the
    SGLANG_DDTREE_TREE_CONV value (config.py) the hook read when it was installed (sglang/hooks.py, by DDTreeWorker
    on hybrid targets only): auto, ddtree (always ours) or sglang (always SGLang's)."""
    if choice == "sglang":
        return False
    return choice == "ddtree" or verify_tokens > SGLANG_MAX_TOKENS


def parents_from_retrieve(next_token: torch.Tensor, next_sibling: torch.Tensor) -> torch.Tensor:
    """Parent of every verify slot from EAGLE-style links ([bs, N], -1 = none): a first child's parent is the slot
    that points to it; a later sibling's parent is its chain's first child's. Slots that are nobody's child (the
    root, padding) get 0. Static shapes, no host sync (pointer jumping along the sibling chains)."""
    bs, n = next_token.shape
    device = next_token.device
    slots = torch.arange(n, device=device).expand(bs, n)
    spill = torch.full((bs, 1), -1, dtype=torch.int64, device=device)  # targets of "none" links land here
    first_parent = torch.cat([torch.zeros((bs, n), dtype=torch.int64, device=device), spill], dim=1)
    first_parent.scatter_(1, torch.where(next_token >= 0, next_token.long(), n), slots.long())
    prev_sibling = torch.cat([torch.full((bs, n), -1, dtype=torch.int64, device=device), spill], dim=1)
    prev_sibling.scatter_(1, torch.where(next_sibling >= 0, next_sibling.long(), n), slots.long())
    head = torch.where(prev_sibling[:, :n] >= 0, prev_sibling[:, :n], slots)
    for _ in range(max(1, math.ceil(math.log2(max(n, 2))))):
        head = head.gather(1, head)
    return first_parent[:, :n].gather(1, head)


def _silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + torch.exp(-x))


def tree_conv_reference(x, conv_state, weight, bias, silu: bool, state_indices, parents, intermediate=None,
                        intermediate_indices=None, pad_slot_id: int = PAD_SLOT_ID) -> torch.Tensor:
    """Plain-torch statement of the kernel (see the module doc). x [bs, dim, N], conv_state [lines, dim, K-1],
    weight [dim, K], parents [bs, N] (parents_from_retrieve). Updates conv_state / intermediate in place."""
    bs, dim, n = x.shape
    k = weight.shape[1]
    out = torch.zeros_like(x)
    for b in range(bs):
        line = int(state_indices[b])
        if line == pad_slot_id:
            continue
        old = conv_state[line].clone()
        for t in range(n):
            acc = bias.float().clone() if bias is not None else torch.zeros(dim, dtype=torch.float32)
            node = t
            for j in range(k):
                xj = x[b, :, node] if node >= 0 else old[:, k - 1 + node]
                if intermediate is not None and j <= k - 2:
                    intermediate[int(intermediate_indices[b]), t, :, k - 2 - j] = xj
                acc = acc + (xj * weight[:, k - 1 - j]).float()
                node = int(parents[b, node]) if node > 0 else node - 1
            out[b, :, t] = (_silu(acc) if silu else acc).to(x.dtype)
        conv_state[line] = torch.cat([old, x[b]], dim=1)[:, -(k - 1):]
    return out


if triton is not None:

    @triton.jit
    def _tree_conv_kernel(
        x_ptr, w_ptr, bias_ptr, state_ptr, state_idx_ptr, inter_ptr, inter_idx_ptr, parent_ptr, o_ptr,
        dim, n_tokens,
        sx_b, sx_d, sx_t, sw_d, sw_k, ss_l, ss_d, ss_t, si_l, si_t, si_d, si_w, so_b, so_d, so_t,
        K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, SAVE_WINDOWS: tl.constexpr,
        PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        feats = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        fm = feats < dim
        line = tl.load(state_idx_ptr + b).to(tl.int64)
        if line == PAD:
            return
        x_base = x_ptr + b * sx_b + feats * sx_d
        state_base = state_ptr + line * ss_l + feats * ss_d
        if HAS_BIAS:
            acc0 = tl.load(bias_ptr + feats, mask=fm, other=0.0).to(tl.float32)
        else:
            acc0 = tl.zeros([BLOCK_N], dtype=tl.float32)
        if SAVE_WINDOWS:
            win_base = inter_ptr + tl.load(inter_idx_ptr + b).to(tl.int64) * si_l + feats * si_d
        t = tl.zeros([], dtype=tl.int32)
        while t < n_tokens:  # a loop, not unrolled: compile time does not grow with the tree
            acc = acc0
            node = t
            for j in tl.static_range(K):
                if node >= 0:
                    xj = tl.load(x_base + node * sx_t, mask=fm, other=0.0)
                else:  # above the root: the conv state, newest column first (not yet rolled)
                    xj = tl.load(state_base + (K - 1 + node) * ss_t, mask=fm, other=0.0)
                if SAVE_WINDOWS:
                    if j <= K - 2:
                        tl.store(win_base + t * si_t + (K - 2 - j) * si_w, xj, mask=fm)
                w = tl.load(w_ptr + feats * sw_d + (K - 1 - j) * sw_k, mask=fm, other=0.0)
                acc += xj * w  # the product in the inputs' dtype, as SGLang's conv kernels (and plain decoding) do
                if j < K - 1:
                    if node > 0:
                        node = tl.load(parent_ptr + b * n_tokens + node).to(tl.int32)
                    else:
                        node = node - 1
            if SILU:
                acc = acc / (1 + tl.exp(-acc))
            tl.store(o_ptr + b * so_b + feats * so_d + t * so_t, acc, mask=fm)
            t += 1
        # roll the conv state by the verify tokens: column s becomes entry s + n of [old state, x] (after every
        # read of the old state above)
        tl.debug_barrier()
        for s in tl.static_range(K - 1):
            c = s + n_tokens
            if c < K - 1:
                v = tl.load(state_base + c * ss_t, mask=fm, other=0.0)
            else:
                v = tl.load(x_base + (c - (K - 1)) * sx_t, mask=fm, other=0.0)
            tl.debug_barrier()
            tl.store(state_base + s * ss_t, v, mask=fm)


def causal_conv1d_tree_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                              conv_state_indices=None, num_accept_tokens=None, intermediate_conv_window=None,
                              intermediate_state_indices=None, retrieve_next_token=None, retrieve_next_sibling=None,
                              retrieve_parent_token=None, pad_slot_id=PAD_SLOT_ID, metadata=None,
                              validate_data=False, block_n: int = 256):
    """Drop-in for SGLang's `causal_conv1d_update` in a tree verify (same arguments; x [bs, dim, N]). Refuses
    what that call never passes in a tree verify (a circular buffer, an accepted-token offset)."""
    if retrieve_next_token is None or retrieve_next_sibling is None:
        raise ValueError("causal_conv1d_tree_update needs retrieve_next_token and retrieve_next_sibling.")
    if cache_seqlens is not None or num_accept_tokens is not None:
        raise ValueError("causal_conv1d_tree_update: cache_seqlens / num_accept_tokens are not used in a tree "
                         "verify and are not supported.")
    if x.dim() != 3:
        raise ValueError(f"x must be [batch, dim, tokens], got {tuple(x.shape)}.")
    if isinstance(activation, bool):
        activation = "silu" if activation else None
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be silu, swish or None, got {activation!r}.")
    bs, dim, n = x.shape
    k = weight.shape[1]
    if conv_state.shape[-1] < k - 1:
        raise ValueError(f"conv_state keeps {conv_state.shape[-1]} columns, the conv needs {k - 1}.")
    if conv_state_indices is None:
        conv_state_indices = torch.arange(bs, device=x.device, dtype=torch.int32)
    # the link buffers may have more rows (graph padding) than this batch: SGLang's kernel reads and writes the
    # first bs rows only
    parents = parents_from_retrieve(retrieve_next_token[:bs, :n], retrieve_next_sibling[:bs, :n])
    if retrieve_parent_token is not None:
        retrieve_parent_token[:bs, :n].copy_(parents)
    parents = parents.to(torch.int32).contiguous()
    out = torch.empty_like(x)
    save = intermediate_conv_window is not None
    inter = intermediate_conv_window if save else out
    inter_idx = intermediate_state_indices if save else conv_state_indices
    si = inter.stride() if save else (0, 0, 0, 0)
    _tree_conv_kernel[(bs, triton.cdiv(dim, block_n))](
        x, weight, bias if bias is not None else weight, conv_state, conv_state_indices, inter, inter_idx, parents, out,
        dim, n, *x.stride(), *weight.stride(), *conv_state.stride(), *si, *out.stride(),
        K=k, HAS_BIAS=bias is not None, SILU=activation is not None, SAVE_WINDOWS=save, PAD=pad_slot_id,
        BLOCK_N=block_n, num_warps=4,
    )
    return out
