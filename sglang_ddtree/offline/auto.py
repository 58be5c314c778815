"""Offline DDTree with an adaptive budget per round (`ddtree_auto`), in lockstep over a group of requests.

Every round, for the active requests of the group together:
  draft    each request's draft source proposes log-probs for depths 1..L after its root;
  tree     one batched best-first tree at the largest candidate budget B_max (`tree.build_tree_from_topk`);
  expect   E[i, c] = expected committed tokens of request i's best-c tree, raw or calibrated (`adaptive`);
  choose   one candidate for the whole group: argmax_c sum_i E[i, c] / round_ms[c] (`adaptive.choose_budget`),
           round_ms = the cost model's round time at the nominal batch size (the H200 sweep by default);
  verify   each request verifies its chosen tree (the first c slots of its B_max tree, the c most probable nodes
           by calibrated probability with select='calibrated', or the top-1 chain), walk, commit: exactly the
           DDTree decoder's verify / walk / commit (decoders.py), so the output is the target's own (lossless);
  learn    the calibrator (if any) records, per request, the calibrated prediction of the verified tree BEFORE it
           learns from this round's walk, then updates.
A group of one request is the batch-1 decoder that `sglang-ddtree offline --methods ddtree_auto` runs per prompt.
The group shares one decision per round because verify shapes are uniform in a real batch; requests that
finished drop out of the group (their rows no longer count in the decision).

A single candidate [B] (or [CHAIN]) is the fixed-budget DDTree (or the chain) with the calibrator observing: the
evaluation uses it to measure prediction errors on fixed budgets; tests check it equals `speculative_decode`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from sglang_ddtree import adaptive
from sglang_ddtree.adaptive import CHAIN, ScoreCalibrator
from sglang_ddtree.baseline import MethodRecord, method_name
from sglang_ddtree import round_cost
from sglang_ddtree.layout import ancestor_mask
from sglang_ddtree.offline.decoders import _check_common, _Clock, _Output, _Sampler, _trim, _tree_dump
from sglang_ddtree.offline.target import TargetState, check_target, refuse_hybrid, top2_margin
from sglang_ddtree.tree import DraftTree, build_tree_from_topk, chain_tree, topk_draft

SELECT_MODES = ("raw", "calibrated")


@dataclass
class AutoPolicy:
    """How a round picks its tree. candidates: sorted budgets, CHAIN (0) = the top-1 chain; round_ms: predicted round
    time per candidate at the nominal `batch_size` (needed with more than one candidate)."""

    candidates: list[int]
    round_ms: list[float] | None = None
    batch_size: int = 1
    calibrator: ScoreCalibrator | None = None
    select: str = "raw"  # which scores choose the budget and the tree: 'raw' or 'calibrated' (needs a calibrator)
    learn: bool = True  # update the calibrator after every round
    info: dict = field(default_factory=dict)  # recorded as is (cost description, sweep path, ...)
    name: str | None = None  # method name of the records (default: ddtree_auto, or the fixed method it reduces to)
    observers: dict[str, ScoreCalibrator] = field(default_factory=dict)  # predict + learn, never choose (evaluation)
    counterfactual: list[int] | None = None  # record per round what these budgets (<= the verified one) would commit

    def __post_init__(self):
        self.candidates = sorted(int(b) for b in self.candidates)
        if not self.candidates or len(set(self.candidates)) != len(self.candidates) or self.candidates[0] < 0:
            raise ValueError(f"candidates must be distinct budgets >= 1 or CHAIN (0), got {self.candidates}.")
        if len(self.candidates) > 1 and (self.round_ms is None or len(self.round_ms) != len(self.candidates)):
            raise ValueError("a choice between several candidates needs one round time per candidate (round_ms).")
        if self.select not in SELECT_MODES:
            raise ValueError(f"select must be one of {SELECT_MODES}, got {self.select!r}.")
        if self.select == "calibrated" and self.calibrator is None:
            raise ValueError("select='calibrated' needs a calibrator.")
        tables = [id(c) for c in self.observers.values()] + ([id(self.calibrator)] if self.calibrator else [])
        if len(set(tables)) != len(tables):
            raise ValueError("each observer needs its own ScoreCalibrator (one table learns once per round).")
        if any(k in ("raw", "cal") for k in self.observers):
            raise ValueError("observer names 'raw' and 'cal' are taken (pred_raw, pred_cal).")

    @property
    def max_budget(self) -> int:
        return max(self.candidates)

    def method(self) -> str:
        if self.name is not None:
            return self.name
        if len(self.candidates) > 1:
            return method_name("ddtree_auto")
        b = self.candidates[0]
        return method_name("dflash") if b == CHAIN else method_name("ddtree", b)

    def describe(self) -> dict:
        return {"candidates": [adaptive.candidate_label(b) for b in self.candidates],
                "round_ms": None if self.round_ms is None else [round(float(x), 4) for x in self.round_ms],
                "batch_size": self.batch_size, "select": self.select, "calibrated": self.calibrator is not None,
                "learn": self.learn, "observers": sorted(self.observers), **self.info}


class _Request:
    def __init__(self, index, ids, target, draft, sampler, out, want_hidden):
        self.index = index
        self.ids = ids
        self.state = TargetState(target, want_hidden=want_hidden)
        self.draft = draft
        self.sampler = sampler
        self.out = out
        self.done = False
        self.root = None
        self.start = len(ids)
        self.rec: MethodRecord | None = None
        self.t0 = 0.0


@torch.no_grad()
def auto_decode(target, drafts: Sequence, prompts: Sequence, *, policy: AutoPolicy, max_new_tokens: int,
                eos_token_ids: Sequence[int] = (), temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                generators: Sequence[torch.Generator | None] | None = None,
                record_trees: bool = False) -> list[MethodRecord]:
    """Decode `prompts` (token id lists) in lockstep, one draft source per prompt; returns one record per prompt."""
    if len(drafts) != len(prompts) or not prompts:
        raise ValueError(f"need one draft source per prompt, got {len(drafts)} for {len(prompts)} prompts.")
    if len({id(d) for d in drafts}) != len(drafts):
        raise ValueError("each request of a group needs its own draft source instance (they hold its context).")
    generators = list(generators) if generators is not None else [None] * len(prompts)
    refuse_hybrid(target, "the adaptive decoder's attention-mask tree verify")
    check_target(target, needs_custom_mask=True)
    block = {int(d.block_size) for d in drafts}
    if len(block) != 1:
        raise ValueError(f"all draft sources of a group must share one block size, got {sorted(block)}.")
    depth_limit = block.pop() - 1
    if depth_limit < 1:
        raise ValueError("the drafter's block size must be >= 2.")
    if policy.max_budget > 1024:
        raise ValueError("candidate budgets must be <= 1024.")

    name = policy.method()
    cal = policy.calibrator
    reqs: list[_Request] = []
    for i, (p, d, g) in enumerate(zip(prompts, drafts, generators)):
        ids = _check_common(p, max_new_tokens, temperature, top_k, top_p)
        r = _Request(i, ids, target, d, _Sampler(temperature, top_k, top_p, g), _Output(max_new_tokens, eos_token_ids),
                     bool(d.uses_hidden_states))
        r.rec = MethodRecord(prompt_id="", method=name, output_ids=[], num_input_tokens=len(ids), accepted_ranks=[],
                             tree_sizes=[], expected_accepts=[], trees=[] if record_trees else None,
                             stage_ms={s: [] for s in ("draft", "tree", "verify", "walk", "commit")})
        r.rec.extra["auto"] = {"policy": policy.describe(), "budget": [], "pred_raw": [], "pred_cal": [],
                               "group_size": len(prompts), **{f"pred_{k}": [] for k in policy.observers}}
        if policy.counterfactual:
            r.rec.extra["auto"]["counterfactual"] = {adaptive.candidate_label(b): [] for b in policy.counterfactual}
        reqs.append(r)
    clock = _Clock(reqs[0].state.device)

    # Prefill, request by request (same as decoders.speculative_decode).
    for r in reqs:
        t0 = r.t0 = clock.now()
        prompt = torch.tensor(r.ids)
        logits, hidden = r.state.causal(prompt, 0)
        r.draft.start()
        feats = r.draft.features(hidden) if r.draft.uses_hidden_states else None
        r.draft.append(prompt.view(1, -1), torch.arange(len(r.ids)).view(1, -1), feats)
        r.root = r.sampler.choose(logits[-1:])
        r.rec.prefill_ms = (clock.now() - t0) * 1e3
        r.done = r.out.emit(r.root.tolist(), top2_margin(logits[-1:]).tolist())

    round_ms = torch.tensor(policy.round_ms, dtype=torch.float32) if policy.round_ms is not None else None
    bmax = policy.max_budget
    while True:
        active = [r for r in reqs if not r.done]
        if not active:
            break
        draft_ms = []
        lps = []
        for r in active:
            t = clock.now()
            lps.append(r.draft.propose(int(r.root), r.start).float())
            draft_ms.append((clock.now() - t) * 1e3)
        t_tree = clock.now()
        lp = torch.cat(lps, dim=0)  # [n, L, V]
        if lp.shape[1] != depth_limit:
            raise ValueError(f"draft sources proposed {lp.shape[1]} depths, expected {depth_limit}.")
        n, _, vocab = lp.shape
        roots = torch.stack([r.root.view(()) for r in active]).to(lp.device)
        k = min(max(bmax, 1), vocab)
        values, tokens = topk_draft(lp, k)
        top1 = values[:, :, 0]
        big = build_tree_from_topk(values, tokens, bmax, roots) if bmax > 0 else None
        cal_probs = cal.node_probs(big) if (cal is not None and big is not None) else None

        # The choice (one per group).
        if len(policy.candidates) == 1:
            c = 0
        else:
            scorer = cal if policy.select == "calibrated" else None
            expected = adaptive.expected_acceptance(big, policy.candidates, top1, scorer)
            c = int(adaptive.choose_budget(expected, round_ms))  # host read: offline only
        budget = policy.candidates[c]
        if budget == CHAIN:
            chosen = chain_tree(lp, roots)
        elif policy.select == "calibrated":
            chosen = adaptive.select_by_probs(big, cal_probs, budget)
        else:
            chosen = adaptive.first_slots(big, budget)
        tree_ms = (clock.now() - t_tree) * 1e3 / n

        verified: list[tuple[_Request, DraftTree, torch.Tensor]] = []
        for j, r in enumerate(active):
            tree = chosen.select(j)
            nn = int(tree.num_nodes[0])
            tree = _trim(tree, nn)
            tree = DraftTree(*(x.to(r.state.device) for x in (tree.tokens, tree.parents, tree.depth, tree.scores,
                                                             tree.ranks, tree.valid)), tree.depth_limit)
            pred_raw = float(tree.expected_tokens()[0])
            pred_cal = float(cal.expected(tree)[0]) if cal is not None else None
            for k, obs in policy.observers.items():
                r.rec.extra["auto"][f"pred_{k}"].append(float(obs.expected(tree)[0]))
            t = clock.now()
            logits, hidden = r.state.tree(tree.tokens[0], tree.depth[0], ancestor_mask(tree)[0], r.start)
            t_verify = clock.now()
            walk = r.sampler.walk(tree, logits)
            acc = int(walk.accept_len[0])
            path = walk.path[0, : acc + 1]
            emitted = walk.out_tokens[0, : acc + 1].cpu()
            t_walk = clock.now()
            path_tokens = tree.tokens[0][path]
            r.state.keep_nodes(r.start, path)
            feats = r.draft.features(hidden)[:, path] if r.draft.uses_hidden_states else None
            r.draft.append(path_tokens.view(1, -1), (r.start + torch.arange(acc + 1)).view(1, -1), feats)
            t_commit = clock.now()

            rec = r.rec
            rec.accept_lengths.append(acc + 1)
            rec.accepted_ranks.append(tree.ranks[0, path[1:]].tolist())
            rec.tree_sizes.append(nn - 1)
            rec.expected_accepts.append(pred_raw)
            rec.extra["auto"]["budget"].append(budget)
            rec.extra["auto"]["pred_raw"].append(pred_raw)
            rec.extra["auto"]["pred_cal"].append(pred_cal)
            if record_trees:
                rec.trees.append(_tree_dump(tree))
            if policy.counterfactual:
                would = adaptive.subtree_accept_lengths(tree, walk.path, policy.counterfactual)[0].tolist()
                for b, v in zip(policy.counterfactual, would):
                    rec.extra["auto"]["counterfactual"][adaptive.candidate_label(b)].append(int(v))
            for stage, ms in zip(("draft", "tree", "verify", "walk", "commit"),
                                 (draft_ms[j], tree_ms, (t_verify - t) * 1e3, (t_walk - t_verify) * 1e3,
                                  (t_commit - t_walk) * 1e3)):
                rec.stage_ms[stage].append(ms)
            verified.append((r, tree, walk.path))

            r.done = r.out.emit(emitted.tolist(), top2_margin(logits[path]).tolist())
            r.root = walk.bonus.view(())
            r.start += acc + 1

        # Learn only after every request of the round made its prediction.
        if policy.learn:
            for table in ([cal] if cal is not None else []) + list(policy.observers.values()):
                for r, tree, path in verified:
                    table.update(tree, path)

    out = []
    for r in reqs:
        rec = r.rec
        rec.output_ids = r.out.tokens
        rec.margins = r.out.margins
        rec.finish_reason = r.out.finish_reason
        rec.total_ms = (clock.now() - r.t0) * 1e3
        if cal is None:
            rec.extra["auto"].pop("pred_cal")
        out.append(rec)
    return out


def build_policy(candidates, *, batch_size: int = 1, calibrate: bool = False, select: str | None = None,
                 sweep=None, kernels="default", overhead: bool = True, max_gain: float | None = 2.0,
                 tau_prior: dict[int, float] | None = None, window: float = 0.05,
                 calibrator: ScoreCalibrator | None = None, depth_limit: int = 15) -> AutoPolicy:
    """An AutoPolicy whose round times come from the committed H200 sweep through the cost model (`RoundCost`).

    candidates: 'chain,16,32,...' or a list. Per batch size they are narrowed with `candidate_window(tau_prior,
    window)` when a prior acceptance curve is given, else with the prior-free `prune_candidates(max_gain)` (None:
    keep all). calibrate: attach a fresh ScoreCalibrator (or pass `calibrator`); select defaults to 'calibrated' then.
    """
    cands = adaptive.parse_candidates(candidates)
    cost = round_cost.RoundCost.from_sweep(
        sweep or round_cost.DEFAULT_SWEEP,
        kernels=(round_cost.DEFAULT_KERNELS if kernels == "default" else kernels), overhead=overhead)
    if tau_prior is not None:
        cands = round_cost.candidate_window(cost, batch_size, cands, tau_prior, window)
        rule = {"rule": "window", "tolerance": window,
                "tau_prior": {adaptive.candidate_label(b): t for b, t in sorted(tau_prior.items())}}
    elif max_gain is not None:
        cands = round_cost.prune_candidates(cost, batch_size, cands, max_gain)
        rule = {"rule": "max_gain", "max_gain": max_gain}
    else:
        rule = {"rule": "all"}
    if calibrate and calibrator is None:
        calibrator = ScoreCalibrator(depth_limit=depth_limit)
    select = select or ("calibrated" if calibrator is not None else "raw")
    info = {"cost": cost.describe(batch_size, cands), "sweep": cost.sweep, "candidate_rule": rule,
            "decision_overhead": overhead}
    return AutoPolicy(candidates=cands, round_ms=cost.round_ms(batch_size, cands) if len(cands) > 1
                      else None, batch_size=batch_size, calibrator=calibrator, select=select, info=info,
                      name=method_name("ddtree_auto"))
