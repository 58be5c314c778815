"""Run offline decoders over a prompt set and append one baseline record per (prompt, method).

Resumable: pairs already in the output file are skipped (the writer checks the file was made with the same
settings). Sampling seeds are per prompt (seed, prompt index), identical for every method of a prompt, so a rerun
of any single pair reproduces it and plain / DFLASH / DDTree share their prefill token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from sglang_ddtree.baseline import BaselineWriter, MethodRecord, method_name, parse_method, prompt_sha256
from sglang_ddtree.offline.decoders import plain_decode, speculative_decode


def expand_methods(methods: Sequence[str], budgets: Sequence[int]) -> list[str]:
    """'plain', 'dflash', 'ddtree' (one per budget) or explicit 'ddtree_tb<B>' -> method names, in order."""
    out: list[str] = []
    for m in methods:
        m = m.strip()
        if not m:
            continue
        if m == "ddtree":
            if not budgets:
                raise ValueError("method 'ddtree' needs --budgets (e.g. 16,32,64).")
            names = [method_name("ddtree", b) for b in budgets]
        else:
            parse_method(m)
            names = [m]
        out += [n for n in names if n not in out]
    if not out:
        raise ValueError("no method given; allowed: plain, dflash, ddtree, ddtree_tb<B>.")
    return out


def parse_int_list(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {text!r}.") from None
    if any(v < 1 for v in vals):
        raise ValueError(f"{what} must all be >= 1, got {text!r}.")
    return vals


@dataclass
class RunSettings:
    methods: list[str]
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    eos_token_ids: list[int] = field(default_factory=list)
    record_trees: bool = False
    commit: str = "gather"
    hybrid_verify: str | None = None  # hybrid (recurrent) targets: "oracle" or "tree" (sglang_ddtree/offline/hybrid.py)


@dataclass
class PromptInput:
    id: str
    index: int
    token_ids: list[int]


def prompt_generator(device: torch.device, seed: int, prompt_index: int) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + prompt_index) % (2**63))
    return g


def decode_one(target, draft, prompt: PromptInput, method: str, s: RunSettings) -> MethodRecord:
    kind, budget = parse_method(method)
    device = next(target.parameters()).device
    gen = prompt_generator(device, s.seed, prompt.index) if s.temperature > 0 else None
    common = dict(max_new_tokens=s.max_new_tokens, eos_token_ids=s.eos_token_ids, temperature=s.temperature,
                  top_k=s.top_k, top_p=s.top_p, generator=gen)
    if kind == "plain":
        rec = plain_decode(target, prompt.token_ids, **common)
    else:
        if draft is None:
            raise ValueError(f"method {method} needs a drafter.")
        rec = speculative_decode(target, draft, prompt.token_ids, method=kind, budget=budget,
                                 record_trees=s.record_trees, commit=s.commit, hybrid_verify=s.hybrid_verify,
                                 **common)
    rec.prompt_id = prompt.id
    rec.prompt_index = prompt.index
    rec.prompt_sha256 = prompt_sha256(prompt.token_ids)
    return rec


def run_offline(target, draft, prompts: Sequence[PromptInput], settings: RunSettings, writer: BaselineWriter, *,
                progress: bool = True) -> dict[str, dict[str, float]]:
    """Decode every (prompt, method) pair not yet in `writer`'s file; returns per-method tau of the new records."""
    from tqdm import tqdm

    todo = [(p, m) for p in prompts for m in settings.methods if not writer.done(p.id, m)]
    skipped = len(prompts) * len(settings.methods) - len(todo)
    totals = {m: [0, 0] for m in settings.methods}  # tokens, rounds
    bar = tqdm(todo, disable=not progress, unit="run", dynamic_ncols=True,
               desc=f"offline ({skipped} done before)" if skipped else "offline")
    for p, m in bar:
        bar.set_postfix_str(f"{p.id} {m}", refresh=False)
        rec = decode_one(target, draft, p, m, settings)
        writer.write(rec)
        totals[m][0] += sum(rec.accept_lengths)
        totals[m][1] += len(rec.accept_lengths)
        taus = {k: v[0] / v[1] for k, v in totals.items() if v[1] and parse_method(k)[0] != "plain"}
        bar.set_postfix_str(f"{p.id} {m} " + " ".join(f"{k}:tau={t:.2f}" for k, t in taus.items()))
    bar.close()
    return {m: {"tau": v[0] / v[1] if v[1] else float("nan"), "rounds": v[1]} for m, v in totals.items()}
