"""Test-only scripted drafts for the SGLang worker (`SGLANG_DDTREE_TEST_SCRIPT=path.json`).

A GPU test needs rounds that accept deep paths and non-first siblings on targets whose drafter is random (dummy or
random-weight pairs accept nothing). The script holds the target's own greedy continuation of each prompt (e.g. from a
plain-decoding run) and a rank pattern; each round, the drafter's top-K at every depth is replaced by the true
next token at the pattern's rank for that output position:
  top     the truth first (log-prob log 0.9), one decoy after it;
  branch  a decoy first (log 0.55), the truth second (log 0.4): accepting it takes a non-first sibling;
  miss    two decoys, the truth absent: the walk must stop there.
The output must still equal plain decoding's whatever the drafts are (that is the point of the test); the script
only decides which paths get accepted. It syncs with the host every round: never on outside tests.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

ENV = "SGLANG_DDTREE_TEST_SCRIPT"
RANKS = ("top", "branch", "miss")


def rank_head(rule: str, truth: int | None, decoys: list[int]) -> tuple[list[int], list[float]]:
    """One depth's scripted head (tokens, probabilities) under a rank rule; decoys[0:2] are tokens other than the
    truth. The offline test double (tests/fixtures/hybrid_models.ScriptedBranchDraft) uses the same rule."""
    if rule == "top":
        return [truth, decoys[0]], [0.9, 0.05]
    if rule == "branch":
        return [decoys[0], truth], [0.55, 0.4]
    if rule == "miss":
        return [decoys[0], decoys[1]], [0.5, 0.45]
    raise ValueError(f"unknown scripted rank {rule!r}; known: {RANKS}")


def scripted_topk(truth: list[int | None], pattern: list[str], offset: int, k: int, vocab: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-depth top-k (log-probs float32 [L, k] descending, token ids int64 [L, k]) for depths 1..L, where
    truth[d - 1] is the target's token at depth d (None: unknown, scripted as a miss) and the rank rule of depth d
    is pattern[(offset + d) % len(pattern)] (offset = the output index of the round's root)."""
    if k < 3 or vocab < k + 2:
        raise ValueError(f"scripted drafts need k >= 3 and vocab >= k + 2, got k={k}, vocab={vocab}.")
    depth = len(truth)
    values = torch.empty(depth, k, dtype=torch.float32)
    tokens = torch.empty(depth, k, dtype=torch.int64)
    for d in range(1, depth + 1):
        t = truth[d - 1]
        rule = pattern[(offset + d) % len(pattern)] if t is not None else "miss"
        decoys = [x for x in range(vocab) if x != t][: k + 1]  # deterministic, never the truth
        head, head_p = rank_head(rule, t, decoys)
        rest = [x for x in decoys if x not in head][: k - 2]
        spread = 0.05 / (vocab - 2)  # the remaining mass, spread; strictly below every head entry
        row = [math.log(p) for p in head_p] + [math.log(spread) - 1e-3 * i for i in range(len(rest))]
        values[d - 1] = torch.tensor(row, dtype=torch.float32)
        tokens[d - 1] = torch.tensor(head + rest, dtype=torch.int64)
    return values, tokens


class ScriptedDrafts:
    """Loaded from the JSON file {"pattern": [...], "continuations": [{"prompt": [...], "output": [...]}]}."""

    def __init__(self, path: str | Path, vocab: int):
        data = json.loads(Path(path).read_text())
        self.pattern = [str(r) for r in data["pattern"]]
        unknown = sorted(set(self.pattern) - set(RANKS))
        if not self.pattern or unknown:
            raise ValueError(f"{path}: pattern must be a non-empty list of {RANKS}, got {self.pattern}.")
        self.outputs = {tuple(c["prompt"]): [int(x) for x in c["output"]] for c in data["continuations"]}
        self.vocab = vocab
        self.rounds_scripted = 0

    def apply(self, reqs, seq_lens: torch.Tensor, values: torch.Tensor, tokens: torch.Tensor) -> None:
        """Overwrite values / tokens [bs, L, K] in place for the requests whose prompt the script knows."""
        bs, depth, k = values.shape
        lens = seq_lens.to("cpu").tolist()  # host sync: test-only
        for i, req in enumerate(list(reqs or [])[:bs]):
            prompt = tuple(int(x) for x in getattr(req, "origin_input_ids", ()) or ())
            output = self.outputs.get(prompt)
            if output is None:
                continue
            root = int(lens[i]) - len(prompt)  # output index of the round's root (the last committed token + 1)
            truth = [output[root + d] if 0 <= root + d < len(output) else None for d in range(1, depth + 1)]
            v, t = scripted_topk(truth, self.pattern, root, k, self.vocab)
            values[i].copy_(v.to(values.device, values.dtype))
            tokens[i].copy_(t.to(tokens.device, tokens.dtype))
        self.rounds_scripted += 1
