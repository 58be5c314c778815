"""How much acceptance small draft trees keep against the drafter's chain, offline on the tiny pair (greedy, T=0).

The `auto` budget chooser may pick a small tree where the verify's width is what costs (large batches). Whether
such candidates are worth having depends on tau (tokens committed per verify round: accepted drafts + the bonus)
at a verify width at or below the DFLASH chain's (root + block_size - 1 drafts = 16 tokens on the tiny pair).

Measured with the project's offline reference decoders (sglang_ddtree/offline), every prompt decoded by:
  plain          width 1, tau 1 by definition;
  dflash         the drafter's top-1 chain, width block_size;
  chain_L<L>     the same chain cut to its first L drafts (the drafter still proposes its whole block, the verify
                 takes the first L), width L + 1; decoded, not estimated;
  chain_L<L>_est the estimate from the full chain's rounds, min(accept length, L + 1) a round: an approximation,
                 since a shorter chain commits less a round and so drafts from other positions in later rounds;
  ddtree_B<B>    a DDTREE tree of budget B (B + 1 verified tokens).
tau is pooled over prompts (committed tokens over rounds, as `sglang-ddtree offline` counts it); its 95% interval
and those of the ratios are percentile bootstraps over prompts (paired: the same prompts on both sides of a ratio).
Ratios: each tree against the chain at equal verify width (B = block_size - 1 against dflash, B = L against
chain_L<L>) and at half / double the chain's width (B + 1 = block_size / 2 or 2 * block_size against dflash).

    python benchmarks/small_trees_offline.py --prompts 40 --max-new-tokens 128 --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sglang_ddtree.offline.decoders import speculative_decode  # noqa: E402
from sglang_ddtree.offline.runner import PromptInput, RunSettings, decode_one  # noqa: E402
from sglang_ddtree.tree import chain_tree  # noqa: E402

BUDGETS = (1, 3, 7, 15, 31)
CHAIN_LENGTHS = (3, 7)


def methods(budgets, chain_lengths, block_size: int) -> dict[str, dict]:
    """name -> how it decodes (kind, its parameter), its nominal verify width and its deepest draft."""
    full = block_size - 1
    out = {"plain": {"kind": "plain", "width": 1, "depth_limit": 0},
           "dflash": {"kind": "dflash", "width": block_size, "depth_limit": full}}
    for n in chain_lengths:
        if not 1 <= n <= full:
            raise ValueError(f"a chain length must be in 1..{full}, got {n}.")
        out[f"chain_L{n}"] = {"kind": "chain", "drafts": n, "width": n + 1, "depth_limit": n}
    for b in budgets:
        out[f"ddtree_B{b}"] = {"kind": "ddtree", "budget": b, "width": b + 1, "depth_limit": min(b, full)}
    return out


def decode(target, draft, prompt: PromptInput, spec: dict, settings: RunSettings):
    if spec["kind"] == "plain":
        return decode_one(target, draft, prompt, "plain", settings)
    if spec["kind"] == "dflash":
        return decode_one(target, draft, prompt, "dflash", settings)
    if spec["kind"] == "ddtree":
        return decode_one(target, draft, prompt, f"ddtree_tb{spec['budget']}", settings)
    n = spec["drafts"]
    return speculative_decode(target, draft, prompt.token_ids, method="dflash", max_new_tokens=settings.max_new_tokens,
                              eos_token_ids=settings.eos_token_ids,
                              tree_builder=lambda lp, root: chain_tree(lp[:, :n], root))


def _interval(samples: np.ndarray) -> list[float]:
    lo, hi = np.percentile(samples, [2.5, 97.5])
    return [float(lo), float(hi)]


def measure(target, draft, prompts: list[PromptInput], *, max_new_tokens: int, eos_token_ids=(),
            budgets=BUDGETS, chain_lengths=CHAIN_LENGTHS, resamples: int = 2000, seed: int = 0,
            log=sys.stderr) -> dict:
    """Decode every prompt with every method; returns per-method rows, the ratios and the per-prompt counts."""
    block_size = int(draft.block_size)
    specs = methods(budgets, chain_lengths, block_size)
    settings = RunSettings(methods=[], max_new_tokens=max_new_tokens, eos_token_ids=list(eos_token_ids))
    counts = {m: {"tokens": [], "rounds": [], "width_sum": 0, "max_commit": 0, "matches_plain": 0} for m in specs}
    chain_rounds: list[list[int]] = []  # the full chain's accept lengths per prompt (for the chain_L<L>_est rows)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        plain_ids = None
        for name, spec in specs.items():
            rec = decode(target, draft, p, spec, settings)
            c = counts[name]
            c["tokens"].append(sum(rec.accept_lengths))
            c["rounds"].append(len(rec.accept_lengths))
            c["width_sum"] += sum(n + 1 for n in rec.tree_sizes) if rec.tree_sizes else len(rec.accept_lengths)
            c["max_commit"] = max([c["max_commit"], *rec.accept_lengths])
            plain_ids = rec.output_ids if name == "plain" else plain_ids
            c["matches_plain"] += rec.output_ids == plain_ids
            if name == "dflash":
                chain_rounds.append(list(rec.accept_lengths))
        taus = " ".join(f"{m}={sum(c['tokens']) / max(sum(c['rounds']), 1):.2f}" for m, c in counts.items()
                        if m != "plain")
        print(f"[{i + 1}/{len(prompts)}] {p.id} {time.perf_counter() - t0:.0f}s  {taus}", file=log, flush=True)
    for n in chain_lengths:  # the estimate: the full chain's rounds, each cut to n drafts + the bonus
        counts[f"chain_L{n}_est"] = {
            "tokens": [sum(min(a, n + 1) for a in rounds) for rounds in chain_rounds],
            "rounds": [len(rounds) for rounds in chain_rounds],
            "width_sum": (n + 1) * sum(len(r) for r in chain_rounds),
            "max_commit": max((min(a, n + 1) for r in chain_rounds for a in r), default=0),
            "matches_plain": None}
        specs[f"chain_L{n}_est"] = {"kind": "chain_estimate", "drafts": n, "width": n + 1, "depth_limit": n}

    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(prompts), size=(resamples, len(prompts)))
    tok = {m: np.asarray(c["tokens"], dtype=float) for m, c in counts.items()}
    rnd = {m: np.asarray(c["rounds"], dtype=float) for m, c in counts.items()}
    boot = {m: tok[m][picks].sum(1) / np.maximum(rnd[m][picks].sum(1), 1) for m in counts}

    rows = {}
    for m, c in counts.items():
        rounds = sum(c["rounds"])
        tau = sum(c["tokens"]) / rounds if rounds else 1.0
        rows[m] = {"kind": specs[m]["kind"], "width": specs[m]["width"], "depth_limit": specs[m]["depth_limit"],
                   "tau": tau, "tau_ci95": _interval(boot[m]), "tau_per_width": tau / specs[m]["width"],
                   "tokens": sum(c["tokens"]), "rounds": rounds,
                   "mean_width": c["width_sum"] / rounds if rounds else float(specs[m]["width"]),
                   "max_commit": c["max_commit"], "matches_plain": c["matches_plain"]}
        if specs[m]["kind"] == "ddtree":
            rows[m]["budget"] = specs[m]["budget"]

    ratios = []

    def ratio(num: str, den: str, comparison: str) -> None:
        r = rows[num]["tau"] / rows[den]["tau"]
        ratios.append({"num": num, "den": den, "comparison": comparison, "width": [rows[num]["width"],
                       rows[den]["width"]], "ratio": r, "ratio_ci95": _interval(boot[num] / boot[den])})

    for b in budgets:
        tree = f"ddtree_B{b}"
        if b + 1 == block_size:
            ratio(tree, "dflash", "equal width")
        if b in chain_lengths:
            ratio(tree, f"chain_L{b}", "equal width")
            ratio(tree, f"chain_L{b}_est", "equal width (chain estimated from the full chain's rounds)")
        if 2 * (b + 1) == block_size:
            ratio(tree, "dflash", "half the chain's width")
        if b + 1 == 2 * block_size:
            ratio(tree, "dflash", "double the chain's width")
    return {"rows": rows, "ratios": ratios, "block_size": block_size,
            "per_prompt": {"ids": [p.id for p in prompts],
                           **{m: {"tokens": c["tokens"], "rounds": c["rounds"]} for m, c in counts.items()}}}


def table(result: dict) -> str:
    lines = [f"{'method':<16}{'width':>6}{'tau':>8}  {'95% interval':<16}{'tau/width':>10}{'rounds':>8}"]
    for m, r in result["rows"].items():
        ci = f"{r['tau_ci95'][0]:.3f}-{r['tau_ci95'][1]:.3f}"
        lines.append(f"{m:<16}{r['width']:>6}{r['tau']:>8.3f}  {ci:<16}{r['tau_per_width']:>10.3f}{r['rounds']:>8}")
    lines.append("")
    for q in result["ratios"]:
        lines.append(f"{q['num']} / {q['den']} ({q['comparison']}, widths {q['width'][0]} / {q['width'][1]}): "
                     f"x{q['ratio']:.3f} [{q['ratio_ci95'][0]:.3f}, {q['ratio_ci95'][1]:.3f}]")
    return "\n".join(lines)


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, metavar="FILE.json", help="where the JSON result goes")
    ap.add_argument("--prompts", type=int, default=40, help="first N HumanEval prompts (default 40)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)), help="DDTREE budgets B (width B + 1)")
    ap.add_argument("--chain-lengths", default=",".join(map(str, CHAIN_LENGTHS)),
                    help="lengths L of the cut chains (width L + 1)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (the tiny pair gains nothing from more)")
    ap.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples for the 95%% intervals")
    args = ap.parse_args(argv)
    if args.prompts < 1 or args.max_new_tokens < 1:
        ap.error("--prompts and --max-new-tokens must be >= 1")
    budgets = [int(x) for x in args.budgets.split(",") if x.strip()]
    chain_lengths = [int(x) for x in args.chain_lengths.split(",") if x.strip()]

    from sglang_ddtree.datasets import encode_prompt, load_prompts
    from sglang_ddtree.offline.cli_commands import _eos_ids, _load_models, _versions
    from sglang_ddtree.offline.drafts import DFlashDraftSource

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model_args = argparse.Namespace(tiny=True, target=None, drafter=None, tokenizer=None, device="cpu",
                                    dtype="float32", attn="sdpa")
    target, drafter, tokenizer, info = _load_models(model_args)
    draft = DFlashDraftSource(drafter, target)
    prompts = [PromptInput(p.id, p.index, encode_prompt(tokenizer, p))
               for p in load_prompts("humaneval", limit=args.prompts)]
    eos = _eos_ids(tokenizer, target)
    print(f"tiny pair, CPU, {args.threads} thread(s): {len(prompts)} HumanEval prompts x {args.max_new_tokens} "
          f"new tokens", file=sys.stderr, flush=True)
    result = measure(target, draft, prompts, max_new_tokens=args.max_new_tokens, eos_token_ids=eos,
                     budgets=budgets, chain_lengths=chain_lengths, resamples=args.resamples)
    elapsed = time.perf_counter() - started
    setup = {"commit": _git("rev-parse", "--short", "HEAD"),
             "dirty_tree": bool(_git("status", "--porcelain", "--untracked-files=no")),  # tracked files edited
             "versions": _versions(), "device": "cpu", "threads": args.threads, "dtype": "float32",
             "temperature": 0.0, "dataset": "humaneval", "prompts": len(prompts),
             "max_new_tokens": args.max_new_tokens, "eos_token_ids": eos, "block_size": result["block_size"],
             "target": info["target"], "drafter": info["drafter"], "resamples": args.resamples,
             "elapsed_s": round(elapsed, 1),
             "command": "python benchmarks/small_trees_offline.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    for m in (setup["target"], setup["drafter"]):
        m["path"] = str(Path(m["path"]).resolve().relative_to(ROOT)) if ROOT in Path(m["path"]).parents else m["path"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"setup": setup, **result}, indent=1) + "\n")
    print(table(result), file=sys.stderr)
    print(f"wrote {out} ({elapsed:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
