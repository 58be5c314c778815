"""Draft sources for the offline decoders.

A draft source proposes, for the next block, the log-probs of the tokens at depths 1..L after the round's root.
The decoders only use this small interface, so the lossless tests can also run with test doubles (any proposal is
allowed: losslessness must hold whatever the drafter says).

Interface (duck-typed):
    block_size: int                  L = block_size - 1 draft depths per round
    uses_hidden_states: bool         whether `features` needs the target's hidden states
    start() -> None                  forget the previous sequence
    features(hidden_states) -> [1, T, F] or None   what to keep from one target forward
    append(tokens [1, t], positions [1, t], feats [1, t, F] | None) -> None   committed tokens, true positions
    propose(root_token: int, root_position: int) -> [1, L, V] float32 log-probs
"""

from __future__ import annotations

import torch


class DFlashDraftSource:
    """The DFlash block-diffusion drafter (sglang_ddtree.drafter) on top of a transformers target."""

    uses_hidden_states = True

    def __init__(self, drafter, target):
        from sglang_ddtree import drafter as drafter_mod

        self._mod = drafter_mod
        self.drafter = drafter
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.block_size = int(drafter.config.block_size)
        self.layer_ids = list(drafter.config.target_layer_ids)
        self.device = next(drafter.parameters()).device
        self.dtype = next(drafter.parameters()).dtype
        if self.lm_head is None:
            raise ValueError("the target has no output embeddings (lm_head); the DFlash drafter shares the target's.")
        self.cache = None

    def start(self) -> None:
        self.cache = self._mod.DrafterCache(self.drafter, 1, self.device, self.dtype)

    def features(self, hidden_states) -> torch.Tensor:
        return self._mod.target_context_features(hidden_states, self.layer_ids)

    @torch.no_grad()
    def append(self, tokens: torch.Tensor, positions: torch.Tensor, feats: torch.Tensor | None) -> None:
        if feats is None:
            raise ValueError("the DFlash drafter needs the target's hidden features of every committed token.")
        ctx = self.drafter.project_context(feats.to(self.device))
        self.cache.append(ctx, positions.to(self.device))

    @torch.no_grad()
    def propose(self, root_token: int, root_position: int) -> torch.Tensor:
        if self.cache is None or self.cache.length != root_position:
            raise ValueError(
                f"drafter context holds {None if self.cache is None else self.cache.length} tokens but the root sits at "
                f"position {root_position}; the context must be exactly the committed tokens."
            )
        logits = self._mod.draft_block_logits(
            self.drafter, self.cache,
            torch.tensor([root_token], device=self.device), torch.tensor([root_position], device=self.device),
            self.embed, self.lm_head,
        )
        return torch.log_softmax(logits.float(), dim=-1)
