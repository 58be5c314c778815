"""Offline reference decoders (batch size 1): plain decoding, the DFLASH chain and DDTree.

All three share one token-selection rule, so they are comparable token for token:
  * T = 0: the target's argmax (first index on ties);
  * T > 0: `walk.sample_choices` (temperature / top-k / top-p, exponential race) with the caller's generator.
The first output token always comes from the prefill logits, exactly as in plain decoding.

One speculative round (root = the last emitted token, not yet in the target's KV cache, at position `start`):
  draft   the draft source proposes log-probs for depths 1..L after the root;
  tree    DFLASH: `chain_tree` (top-1 at every depth); DDTree: `build_tree` with the budget;
  verify  DFLASH: a causal forward over the chain; DDTree: one forward over all nodes with the ancestor mask
          (positions start + depth) on top of the committed KV;
  walk    `greedy_walk` / `sampled_walk`: the accepted path and the bonus token;
  commit  target KV keeps the root + accepted nodes (see target.py); the draft source receives those tokens, their
          true positions and the target features computed for them in the verify forward.
Emitted per round: accepted draft tokens + bonus, cut at EOS (kept) or max_new_tokens exactly like plain decoding.
Recorded per round: accept length, accepted ranks, tree size, expected accepts, a hash of the tree
(`baseline.tree_hash`, cheap, always) and the whole tree with `record_trees`.
The per-token margin (target top-1 minus top-2 logit) is taken from the logits of the node that chose the token.

Hybrid targets (recurrent + attention layers, `target.is_hybrid`) need `hybrid_verify='oracle'|'tree'`: verify and
commit then go through `hybrid.HybridTargetState` (per-node recurrent state); the attention-mask verify refuses them.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import torch

from sglang_ddtree.baseline import MethodRecord, method_name, tree_hash
from sglang_ddtree.layout import ancestor_mask
from sglang_ddtree.offline.hybrid import MODES as HYBRID_MODES
from sglang_ddtree.offline.hybrid import HybridTargetState
from sglang_ddtree.offline.target import TargetState, check_target, refuse_hybrid, top2_margin
from sglang_ddtree.tree import DraftTree, build_tree, chain_tree
from sglang_ddtree.walk import greedy_walk, sample_choices, sampled_walk


class _Clock:
    """Wall-clock stage timer; synchronizes CUDA so a stage's time is its own."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def _check_common(prompt_ids, max_new_tokens, temperature, top_k, top_p) -> list[int]:
    ids = [int(t) for t in (prompt_ids.tolist() if hasattr(prompt_ids, "tolist") else prompt_ids)]
    if not ids:
        raise ValueError("prompt_ids is empty; decoding needs at least one prompt token.")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}.")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}.")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = disabled), got {top_k}.")
    return ids


class _Sampler:
    def __init__(self, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None):
        self.temperature, self.top_k, self.top_p, self.generator = float(temperature), int(top_k), float(top_p), generator

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """[n, V] -> [n] the target's choice at each row (argmax at T=0)."""
        if self.temperature == 0:
            return logits.argmax(dim=-1)
        return sample_choices(logits.unsqueeze(0), self.temperature, self.top_k, self.top_p, self.generator)[0]

    def walk(self, tree: DraftTree, logits: torch.Tensor):
        if self.temperature == 0:
            return greedy_walk(tree, logits.unsqueeze(0))
        return sampled_walk(tree, logits.unsqueeze(0), self.temperature, self.top_k, self.top_p, self.generator)


class _Output:
    """Emitted tokens with the stop rule shared by every decoder: EOS is kept and ends the output."""

    def __init__(self, max_new_tokens: int, eos_token_ids: Sequence[int]):
        self.max_new_tokens = max_new_tokens
        self.eos = {int(t) for t in eos_token_ids}
        self.tokens: list[int] = []
        self.margins: list[float] = []
        self.finish_reason: str | None = None

    def emit(self, tokens: Sequence[int], margins: Sequence[float]) -> bool:
        """Append tokens in order until a stop; returns True when the output is finished."""
        for t, m in zip(tokens, margins):
            self.tokens.append(int(t))
            self.margins.append(float(m))
            if int(t) in self.eos:
                self.finish_reason = "eos"
                return True
            if len(self.tokens) >= self.max_new_tokens:
                self.finish_reason = "length"
                return True
        return False


@torch.no_grad()
def plain_decode(target, prompt_ids, *, max_new_tokens: int, eos_token_ids: Sequence[int] = (),
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 generator: torch.Generator | None = None) -> MethodRecord:
    """Autoregressive decoding with the target's KV cache; one token per forward."""
    ids = _check_common(prompt_ids, max_new_tokens, temperature, top_k, top_p)
    state = TargetState(target, want_hidden=False)
    clock = _Clock(state.device)
    sampler = _Sampler(temperature, top_k, top_p, generator)
    out = _Output(max_new_tokens, eos_token_ids)

    t0 = clock.now()
    logits, _ = state.causal(torch.tensor(ids), 0)
    last = logits[-1:]
    token = sampler.choose(last)
    prefill_ms = (clock.now() - t0) * 1e3
    done = out.emit(token.tolist(), top2_margin(last).tolist())
    step_ms = []
    while not done:
        t = clock.now()
        last, _ = state.causal(token, state.committed)
        token = sampler.choose(last)
        done = out.emit(token.tolist(), top2_margin(last).tolist())
        step_ms.append((clock.now() - t) * 1e3)
    n_rounds = len(out.tokens) - 1
    return MethodRecord(
        prompt_id="", method="plain", output_ids=out.tokens, num_input_tokens=len(ids),
        finish_reason=out.finish_reason, accept_lengths=[1] * n_rounds, margins=out.margins,
        stage_ms={"verify": step_ms}, prefill_ms=prefill_ms, total_ms=(clock.now() - t0) * 1e3,
    )


def _trim(tree: DraftTree, n: int) -> DraftTree:
    """Keep the first n slots (the valid nodes of a batch-1 tree)."""
    return DraftTree(tree.tokens[:, :n], tree.parents[:, :n], tree.depth[:, :n], tree.scores[:, :n],
                     tree.ranks[:, :n], tree.valid[:, :n], tree.depth_limit)


def _tree_dump(tree: DraftTree) -> dict[str, list]:
    return {
        "tokens": tree.tokens[0].tolist(),
        "parents": tree.parents[0].tolist(),
        "scores": [float(s) if math.isfinite(s) else None for s in tree.scores[0].tolist()],
        "ranks": tree.ranks[0].tolist(),
    }


TreeBuilder = Callable[[torch.Tensor, torch.Tensor], DraftTree]  # (draft_logprobs [1, L, V], root [1]) -> tree


@torch.no_grad()
def speculative_decode(target, draft, prompt_ids, *, method: str, budget: int | None = None, max_new_tokens: int,
                       eos_token_ids: Sequence[int] = (), temperature: float = 0.0, top_k: int = 0,
                       top_p: float = 1.0, generator: torch.Generator | None = None, record_trees: bool = False,
                       commit: str = "gather", verify: str | None = None,
                       tree_builder: TreeBuilder | None = None, hybrid_verify: str | None = None) -> MethodRecord:
    """DFLASH chain (method='dflash') or DDTree (method='ddtree', budget B) with the draft source `draft`.

    verify: 'causal' (only for chains) or 'tree'; default causal for dflash, tree for ddtree.
    commit: 'gather' (keep the accepted nodes' K/V from the verify forward) or 'rerun' (recompute them).
    tree_builder: override the tree (tests: a DDTree run over chain trees must equal the DFLASH chain).
    hybrid_verify: 'oracle' or 'tree' (see hybrid.py) replaces the attention-mask / causal verify; required for
      hybrid targets, allowed for any target. commit='gather' then keeps the accepted node's state, 'rerun' replays.
    """
    ids = _check_common(prompt_ids, max_new_tokens, temperature, top_k, top_p)
    if method not in ("dflash", "ddtree"):
        raise ValueError(f"method must be 'dflash' or 'ddtree', got {method!r}.")
    name = method_name(method, budget)  # validates the budget for ddtree
    if method == "dflash" and budget is not None:
        raise ValueError("dflash takes no budget: its tree is the drafter's top-1 chain of block_size - 1 nodes.")
    if hybrid_verify is not None:
        if hybrid_verify not in HYBRID_MODES:
            raise ValueError(f"hybrid_verify must be one of {', '.join(HYBRID_MODES)} or None, got {hybrid_verify!r}.")
        if verify is not None:
            raise ValueError("verify selects an attention-only path; leave it unset when hybrid_verify is given.")
    verify = verify or ("causal" if method == "dflash" else "tree")
    if verify not in ("causal", "tree"):
        raise ValueError(f"verify must be 'causal' or 'tree', got {verify!r}.")
    if hybrid_verify is None:
        refuse_hybrid(target, "the attention-mask tree verify" if verify == "tree" else
                      "the causal chain verify (its commit crops the cache)")
    if commit not in ("gather", "rerun"):
        raise ValueError(f"commit must be 'gather' or 'rerun', got {commit!r}.")
    custom_builder = tree_builder is not None
    if tree_builder is None:
        if method == "dflash":
            tree_builder = chain_tree
        else:
            tree_builder = lambda lp, root: build_tree(lp, budget, root)  # noqa: E731
    check_target(target, needs_custom_mask=(verify == "tree" and hybrid_verify is None))

    if hybrid_verify is None:
        state = TargetState(target, want_hidden=bool(draft.uses_hidden_states))
    else:
        state = HybridTargetState(target, want_hidden=bool(draft.uses_hidden_states), mode=hybrid_verify)
    clock = _Clock(state.device)
    sampler = _Sampler(temperature, top_k, top_p, generator)
    out = _Output(max_new_tokens, eos_token_ids)
    rec = MethodRecord(prompt_id="", method=name, output_ids=[], num_input_tokens=len(ids), accepted_ranks=[],
                       tree_sizes=[], expected_accepts=[], trees=[] if record_trees else None, tree_hashes=[],
                       stage_ms={s: [] for s in ("draft", "tree", "verify", "walk", "commit")})
    default_verify = "causal" if method == "dflash" else "tree"
    if verify != default_verify or commit != "gather" or custom_builder:
        rec.extra["variant"] = {"verify": verify, "commit": commit, "custom_tree_builder": custom_builder}
    if hybrid_verify is not None:
        rec.extra["hybrid_verify"] = hybrid_verify
        if "variant" in rec.extra:
            rec.extra["variant"]["verify"] = f"hybrid_{hybrid_verify}"

    # Prefill: the first token, the committed KV of the prompt and the drafter's context.
    t0 = clock.now()
    prompt = torch.tensor(ids)
    logits, hidden = state.causal(prompt, 0)
    draft.start()
    feats = draft.features(hidden) if draft.uses_hidden_states else None
    draft.append(prompt.view(1, -1), torch.arange(len(ids)).view(1, -1), feats)
    root = sampler.choose(logits[-1:])
    rec.prefill_ms = (clock.now() - t0) * 1e3
    done = out.emit(root.tolist(), top2_margin(logits[-1:]).tolist())

    start = len(ids)  # position of the root = number of committed tokens
    while not done:
        t = clock.now()
        draft_lp = draft.propose(int(root), start)
        t_draft = clock.now()
        tree = tree_builder(draft_lp.float(), root.view(1).to(draft_lp.device))
        n = int(tree.num_nodes[0])
        tree = _trim(tree, n)
        tree = DraftTree(*(x.to(state.device) for x in (tree.tokens, tree.parents, tree.depth, tree.scores,
                                                       tree.ranks, tree.valid)), tree.depth_limit)
        t_tree = clock.now()
        tokens = tree.tokens[0]
        if hybrid_verify is not None:
            logits, hidden = state.verify(tree, start)
        elif verify == "causal":
            if not bool((tree.parents[0, 1:].cpu() == torch.arange(n - 1)).all()):
                raise ValueError("causal verification needs a chain (node i's parent is node i - 1).")
            logits, hidden = state.causal(tokens, start)
        else:
            logits, hidden = state.tree(tokens, tree.depth[0], ancestor_mask(tree)[0], start)
        t_verify = clock.now()
        walk = sampler.walk(tree, logits)
        acc = int(walk.accept_len[0])
        path = walk.path[0, : acc + 1]
        emitted = walk.out_tokens[0, : acc + 1].cpu()
        t_walk = clock.now()

        # Commit root + accepted nodes to the target KV and the drafter context.
        path_tokens = tokens[path]
        positions = (start + torch.arange(acc + 1)).view(1, -1)
        if hybrid_verify is not None:
            committed_hidden = state.commit(start, path, rerun=(commit == "rerun"), path_tokens=path_tokens)
            feats = draft.features(committed_hidden) if draft.uses_hidden_states else None
        elif commit == "rerun":
            state.crop(start)
            _, rerun_hidden = state.causal(path_tokens, start)
            feats = draft.features(rerun_hidden) if draft.uses_hidden_states else None
        else:
            if verify == "causal":
                state.crop(start + acc + 1)  # chain nodes 0..acc are already the first acc+1 new entries
            else:
                state.keep_nodes(start, path)
            feats = draft.features(hidden)[:, path] if draft.uses_hidden_states else None
        draft.append(path_tokens.view(1, -1), positions, feats)
        t_commit = clock.now()

        rec.accept_lengths.append(acc + 1)
        rec.accepted_ranks.append(tree.ranks[0, path[1:]].tolist())
        rec.tree_sizes.append(n - 1)
        rec.expected_accepts.append(float(tree.expected_tokens()[0]))
        if record_trees:
            rec.trees.append(_tree_dump(tree))
            rec.tree_hashes.append(tree_hash(rec.trees[-1]["tokens"], rec.trees[-1]["parents"]))
        else:
            rec.tree_hashes.append(tree_hash(tokens.tolist(), tree.parents[0].tolist()))
        for stage, (a, b) in zip(("draft", "tree", "verify", "walk", "commit"),
                                 ((t, t_draft), (t_draft, t_tree), (t_tree, t_verify), (t_verify, t_walk),
                                  (t_walk, t_commit))):
            rec.stage_ms[stage].append((b - a) * 1e3)

        done = out.emit(emitted.tolist(), top2_margin(logits[path]).tolist())
        root = walk.bonus.view(())
        start += acc + 1

    rec.output_ids = out.tokens
    rec.margins = out.margins
    rec.finish_reason = out.finish_reason
    rec.total_ms = (clock.now() - t0) * 1e3
    return rec
