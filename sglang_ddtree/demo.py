"""`sglang-ddtree demo`: the main job on the embedded default (the committed tiny pair, CPU when no GPU).

Plain decoding, the DFLASH chain and DDTree at a few budgets over HumanEval prompts with the offline reference
decoders (greedy, T=0). Each method is warmed up once, then every method decodes the prompts `--repeats` times,
interleaved (the method order rotates per prompt and repeat, so a change of machine load hits every method alike).
Printed per method: tau (counted over emitted tokens only, see `emitted_round_tokens`), the median tokens/s over
the repeats with its min-max, the ratio to plain decoding's median, and whether its tokens equal plain decoding's.
Writes the last repeat's records (baseline JSONL) and a summary JSON under --out. Exit status 1 if a method is not
lossless, 2 on a bad argument (checked before the models load), 130 when interrupted. On a CPU it runs on one torch
thread unless --threads or OMP_NUM_THREADS says otherwise (cli_args.set_cpu_threads).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

WARMUP_TOKENS = 16
CPU_NOTE = ("Note: CPU speeds do not predict GPU speeds (on a GPU, verifying a whole tree costs little more than one "
            "plain decoding step; on a CPU every node costs).")


def emitted_round_tokens(accept_lengths: list[int], num_output_tokens: int) -> list[int]:
    """Tokens each round actually emitted: its accept length, the last rounds cut so that the rounds add up to the
    output tokens after the prefill's (the first output token belongs to no round). A round verified past the
    token cap or an EOS commits tokens that are never emitted; counting them would inflate tau."""
    left = max(num_output_tokens - 1, 0)
    out = []
    for a in accept_lengths:
        n = min(a, left)
        out.append(n)
        left -= n
    return out


def demo_methods(budgets: list[int]) -> list[str]:
    from sglang_ddtree.baseline import method_name

    return ["plain", "dflash"] + [method_name("ddtree", b) for b in budgets]


def summarize(runs: dict[str, list[list]], plain_method: str = "plain") -> dict[str, dict]:
    """runs: method -> one list of MethodRecords per repeat (same prompts, same order). Per method: tau over emitted
    tokens (and as verified), tokens/s per repeat with its median and min-max, and losslessness against plain."""
    plain = {rec.prompt_id: rec.output_ids for rep in runs[plain_method] for rec in rep}
    out = {}
    for name, reps in runs.items():
        per_rep = []
        for rep in reps:
            tokens = sum(len(r.output_ids) for r in rep)
            ms = sum(r.total_ms or 0.0 for r in rep)
            per_rep.append(tokens / (ms / 1e3) if ms > 0 else float("nan"))
        last = reps[-1]
        rounds = sum(len(r.accept_lengths) for r in last)
        emitted = sum(sum(emitted_round_tokens(r.accept_lengths, len(r.output_ids))) for r in last)
        verified = sum(sum(r.accept_lengths) for r in last)
        out[name] = {
            "tau": emitted / rounds if rounds else 1.0,
            "tau_as_verified": verified / rounds if rounds else 1.0,
            "rounds": rounds,
            "tokens_per_s": statistics.median(per_rep),
            "tokens_per_s_min": min(per_rep),
            "tokens_per_s_max": max(per_rep),
            "tokens_per_s_per_repeat": per_rep,
            "lossless": all(r.output_ids == plain.get(r.prompt_id) for rep in reps for r in rep),
        }
    base = out[plain_method]["tokens_per_s"]
    for m in out.values():
        m["speedup_vs_plain"] = m["tokens_per_s"] / base
    return out


def format_table(summary: dict[str, dict], repeats: int) -> str:
    spread = f"min-max of {repeats}" if repeats > 1 else "one run"
    lines = [f"{'method':<14}{'tau':>6}{'tokens/s':>10}  {spread:<16}{'vs plain':>9}  lossless"]
    for name, m in summary.items():
        rng = f"{m['tokens_per_s_min']:.0f}-{m['tokens_per_s_max']:.0f}"
        lines.append(f"{name:<14}{m['tau']:>6.2f}{m['tokens_per_s']:>10.1f}  {rng:<16}{m['speedup_vs_plain']:>8.2f}x  "
                     f"{'yes' if m['lossless'] else 'NO'}")
    return "\n".join(lines)


def model_args(args) -> argparse.Namespace:
    """The offline loader's arguments (offline.cli_commands._load_models) for the demo: the committed tiny pair,
    float32, SDPA attention, on --device."""
    return argparse.Namespace(tiny=True, target=None, drafter=None, tokenizer=None, device=args.device,
                              dtype="float32", attn="sdpa")


def run_demo(args) -> int:
    """args: budgets (list of ints), prompts, max_new_tokens, repeats, device, threads, out, already checked by the
    CLI. Ctrl-C raises cli_args.Interrupted saying which outputs this run wrote (none before the last repeat ends)."""
    from sglang_ddtree.cli_args import Interrupted, made_dirs

    started = time.time()
    with made_dirs(args.out) as state:
        try:
            rc = _run(args)
        except KeyboardInterrupt:
            out = Path(args.out)
            written = [str(out / n) for n in ("baseline.jsonl", "summary.json")
                       if (out / n).exists() and (out / n).stat().st_mtime >= started]
            raise Interrupted(f"this demo run wrote {' and '.join(written)}." if written else
                              "nothing was written (the demo writes its outputs once every repeat is done).") from None
        state["failed"] = rc not in (0, 1)  # 1 (not lossless) keeps its outputs for inspection
        return rc


def _run(args) -> int:
    import dataclasses

    import torch

    from sglang_ddtree.baseline import BaselineHeader, write_baseline
    from sglang_ddtree.cli_args import set_cpu_threads
    from sglang_ddtree.datasets import encode_prompt, load_prompts
    from sglang_ddtree.offline.cli_commands import _eos_ids, _load_models, _versions, run_device
    from sglang_ddtree.offline.drafts import DFlashDraftSource
    from sglang_ddtree.offline.runner import PromptInput, RunSettings, decode_one

    out_dir = Path(args.out)
    methods = demo_methods(args.budgets)
    prompts = load_prompts("humaneval", limit=args.prompts)
    t0 = time.perf_counter()
    margs = model_args(args)
    threads = set_cpu_threads(getattr(args, "threads", None), run_device(margs), tiny=True)
    target, drafter, tokenizer, info = _load_models(margs)
    draft = DFlashDraftSource(drafter, target)
    inputs = [PromptInput(p.id, p.index, encode_prompt(tokenizer, p)) for p in prompts]
    settings = RunSettings(methods=methods, max_new_tokens=args.max_new_tokens, eos_token_ids=_eos_ids(tokenizer, target))
    device = info["device"]
    threads = f", {threads}" if threads else ""
    print(f"demo: tiny pair on {device}{threads}; {len(inputs)} HumanEval prompts x {args.max_new_tokens} new tokens, "
          f"{len(methods)} methods, 1 warm-up + {args.repeats} timed repeat(s)", flush=True)

    warm = dataclasses.replace(settings, max_new_tokens=min(WARMUP_TOKENS, args.max_new_tokens))
    for m in methods:  # first calls allocate, pick kernels and fill caches: not timed
        decode_one(target, draft, inputs[0], m, warm)

    runs: dict[str, list[list]] = {m: [] for m in methods}
    for r in range(args.repeats):
        for m in methods:
            runs[m].append([])
        for i, prompt in enumerate(inputs):
            k = (r + i) % len(methods)
            for m in methods[k:] + methods[:k]:
                runs[m][r].append(decode_one(target, draft, prompt, m, settings))
        for m in methods:
            runs[m][r].sort(key=lambda rec: rec.prompt_index)
        print(f"  repeat {r + 1}/{args.repeats} done ({time.perf_counter() - t0:.0f} s)", flush=True)

    summary = summarize(runs)
    print()
    print(format_table(summary, args.repeats))
    print()
    print("tau = tokens per verify round (accepted draft tokens + the bonus; 1 for plain decoding), over emitted "
          "tokens. tokens/s = the median over the repeats, with its min-max.")
    print(CPU_NOTE if device == "cpu" else "These are the offline reference decoders' speeds, not a serving "
          "engine's: see `sglang-ddtree bench` for SGLang.")

    header = BaselineHeader(
        source="offline", target=info["target"], drafter=info["drafter"], tokenizer=info["tokenizer"],
        dtype="float32", device=device, attn_implementation="sdpa", temperature=0.0, top_k=0, top_p=1.0, seed=0,
        max_new_tokens=args.max_new_tokens, block_size=info["block_size"], dataset="humaneval", versions=_versions(),
        extra={"methods": methods, "limit": args.prompts, "demo_repeat": args.repeats,
               "eos_token_ids": settings.eos_token_ids},
    )
    baseline_path = out_dir / "baseline.jsonl"
    write_baseline(baseline_path, header, [rec for rec in sorted(
        (rec for m in methods for rec in runs[m][-1]), key=lambda rec: (rec.prompt_index, methods.index(rec.method)))])
    (out_dir / "summary.json").write_text(json.dumps(
        {"settings": {"device": device, "cpu_threads": torch.get_num_threads(), "prompts": len(inputs),
                      "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
                      "warmup_new_tokens": warm.max_new_tokens, "methods": methods},
         "methods": summary}, indent=1))
    print(f"wrote {baseline_path} (the last repeat's records) and {out_dir / 'summary.json'}")
    lossless = all(m["lossless"] for m in summary.values())
    if not lossless:
        print("error: a speculative method's output differs from plain decoding", file=sys.stderr)
    return 0 if lossless else 1
