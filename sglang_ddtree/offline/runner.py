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
    """'plain', 'dflash', 'ddtree' (one per budget), explicit 'ddtree_tb<B>' or 'ddtree_auto' -> method names."""
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
        raise ValueError("no method given; allowed: plain, dflash, ddtree, ddtree_tb<B>, ddtree_auto.")
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
class AutoSettings:
    """ddtree_auto: candidate budgets, the batch size whose round costs (committed H200 sweep) drive the choice, and
    calibration. Offline each prompt decodes alone and decides as if every request of the batch looked like it."""

    candidates: str = "chain,16,32,64,128,256"
    batch_size: int = 1
    calibrate: bool = False
    max_gain: float | None = 2.0
    decision_overhead: bool = True
    sweep: str | None = None  # default: benchmarks/results/sweep_h200.jsonl
    tau_prior: str | None = None  # prior acceptance curve file (round_cost.load_tau_prior): windowed candidates
    window: float = 0.05


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
    auto: AutoSettings | None = None  # method ddtree_auto (sglang_ddtree/offline/auto.py)


@dataclass
class PromptInput:
    id: str
    index: int
    token_ids: list[int]


def prompt_generator(device: torch.device, seed: int, prompt_index: int) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + prompt_index) % (2**63))
    return g


def auto_policy(s: RunSettings, depth_limit: int):
    """The AutoPolicy of a run (one per run: its calibrator learns across prompts, in prompt order)."""
    from sglang_ddtree.offline.auto import build_policy

    from sglang_ddtree.round_cost import load_tau_prior

    a = s.auto or AutoSettings()
    return build_policy(a.candidates, batch_size=a.batch_size, calibrate=a.calibrate, sweep=a.sweep,
                        overhead=a.decision_overhead, max_gain=a.max_gain, window=a.window,
                        tau_prior=load_tau_prior(a.tau_prior) if a.tau_prior else None, depth_limit=depth_limit)


def decode_one(target, draft, prompt: PromptInput, method: str, s: RunSettings, *, policy=None) -> MethodRecord:
    """One (prompt, method) record. ddtree_auto uses `policy` (built from s.auto when None)."""
    kind, budget = parse_method(method)
    device = next(target.parameters()).device
    gen = prompt_generator(device, s.seed, prompt.index) if s.temperature > 0 else None
    common = dict(max_new_tokens=s.max_new_tokens, eos_token_ids=s.eos_token_ids, temperature=s.temperature,
                  top_k=s.top_k, top_p=s.top_p, generator=gen)
    if kind == "plain":
        rec = plain_decode(target, prompt.token_ids, **common)
    elif kind == "ddtree_auto":
        from sglang_ddtree.offline.auto import auto_decode

        if draft is None:
            raise ValueError(f"method {method} needs a drafter.")
        if s.hybrid_verify is not None:
            raise ValueError("ddtree_auto verifies with the attention-mask tree forward; hybrid targets are not "
                             "supported.")
        if s.commit != "gather":
            raise ValueError("ddtree_auto commits by gathering the accepted nodes' KV (commit='gather' only).")
        policy = policy if policy is not None else auto_policy(s, int(draft.block_size) - 1)
        gen = common.pop("generator")
        rec = auto_decode(target, [draft], [prompt.token_ids], policy=policy, generators=[gen],
                          record_trees=s.record_trees, **common)[0]
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
    policy = None
    if any(m == "ddtree_auto" for _, m in todo):
        policy = auto_policy(settings, int(draft.block_size) - 1) if draft is not None else None
    skipped = len(prompts) * len(settings.methods) - len(todo)
    totals = {m: [0, 0] for m in settings.methods}  # tokens, rounds
    bar = tqdm(todo, disable=not progress, unit="run", dynamic_ncols=True,
               desc=f"offline ({skipped} done before)" if skipped else "offline")
    with bar:  # closed (its line ended) also when a decode raises or Ctrl-C stops the run
        for p, m in bar:
            bar.set_postfix_str(f"{p.id} {m}", refresh=False)
            extra = {"policy": policy} if m == "ddtree_auto" else {}
            rec = decode_one(target, draft, p, m, settings, **extra)
            writer.write(rec)
            totals[m][0] += sum(rec.accept_lengths)
            totals[m][1] += len(rec.accept_lengths)
            taus = {k: v[0] / v[1] for k, v in totals.items() if v[1] and parse_method(k)[0] != "plain"}
            bar.set_postfix_str(f"{p.id} {m} " + " ".join(f"{k}:tau={t:.2f}" for k, t in taus.items()))
    out = {m: {"tau": v[0] / v[1] if v[1] else float("nan"), "rounds": v[1]} for m, v in totals.items()}
    if policy is not None and policy.calibrator is not None:
        out["ddtree_auto"]["calibration"] = policy.calibrator.export()
    return out
