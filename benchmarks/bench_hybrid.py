"""Hybrid-target DDTree verify: the node-by-node oracle vs the depth-by-depth tree path, lossless check + timings.

Target: a random-weight (seeded, float32) transformers Qwen3-Next: layers alternate 3 gated-delta-net (linear
attention) : 1 full attention, MoE MLPs, like the real model but small (defaults: hidden 512, 8 layers, vocab 4096).
Drafter: the test suite's ScriptedBranchDraft (tests/fixtures/hybrid_models.py). It runs the target to know the
true greedy continuation and puts it, per depth, at rank 0, at rank 1 (below a decoy: the walk must take a
non-first sibling) or nowhere (the walk stops), by a seeded script. So deep and branching acceptance really
happens on random weights, and the verify sees the tree shapes a good drafter would produce. Its own target
forwards (one per depth, plus one to append the accepted tokens) land in the round's "draft" and "commit" stages,
never in the verify timings.

Per budget (batch 1, greedy) the script decodes every prompt with
  plain    plain_decode (the reference tokens, and ms per token);
  oracle   speculative_decode(..., hybrid_verify="oracle")  (one cache copy + one-token forward per node);
  tree     speculative_decode(..., hybrid_verify="tree")    (one batched forward per depth);
checks oracle == tree == plain token for token, and times each round's verify (CUDA events on CUDA, perf_counter
on CPU) and the whole round (the decoder's own synchronized stage clock). Warm-up decodes run first.

  python benchmarks/bench_hybrid.py --out runs/bench/hybrid.json                       # GPU, defaults
  python benchmarks/bench_hybrid.py --device cpu --hidden 64 --layers 4 --vocab 512 \\
      --budgets 16,64 --prompts 2 --max-new-tokens 16 --out /tmp/hybrid.json           # quick CPU check

Exit status: 0 when every budget is lossless, 1 when any output differs from plain decoding, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the scripted drafter is the hybrid tests' own test double
from fixtures.hybrid_models import ScriptedBranchDraft, seeded_script  # noqa: E402
from sglang_ddtree.offline.decoders import plain_decode, speculative_decode  # noqa: E402
from sglang_ddtree.offline.hybrid import HybridTargetState  # noqa: E402
from sglang_ddtree.offline.runner import parse_int_list  # noqa: E402
from sglang_ddtree.stages import STAGES  # noqa: E402

PATHS = ("oracle", "tree")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--budgets", default="16,64,256", help="comma-separated DDTree budgets")
    p.add_argument("--prompts", type=int, default=4, help="number of random prompts")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--warmup-tokens", type=int, default=2,
                   help="tokens of the warm-up decode per (path, budget); 2 = prefill + one full-budget round")
    p.add_argument("--block-size", type=int, default=16, help="drafter block: depths 1..block_size-1")
    g = p.add_argument_group("target model (random weights)")
    g.add_argument("--hidden", type=int, default=512)
    g.add_argument("--layers", type=int, default=8, help="a multiple of --full-attention-interval")
    g.add_argument("--full-attention-interval", type=int, default=4, help="every k-th layer is full attention")
    g.add_argument("--vocab", type=int, default=4096)
    g.add_argument("--experts", type=int, default=8)
    g.add_argument("--experts-per-token", type=int, default=2)
    g.add_argument("--experts-impl", choices=("eager", "grouped_mm"), default="eager",
                   help="transformers MoE kernel; eager (a matmul per routed expert) runs float32 everywhere, "
                        "float32 grouped_mm on CUDA depends on the torch version")
    g.add_argument("--init-range", type=float, default=0.3,
                   help="weight init std; large = peaky logits, so greedy picks stay far from float32 ties")
    p.add_argument("--seed", type=int, default=0, help="weights, prompts and the drafter's script")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: 1 on CPU, torch's default on CUDA)")
    p.add_argument("--out", required=True, help="result JSON file")
    args = p.parse_args(argv)
    try:
        args.budgets = parse_int_list(args.budgets, "--budgets")
    except ValueError as e:
        p.error(str(e))
    if args.layers % args.full_attention_interval or args.layers < args.full_attention_interval:
        p.error("--layers must be a positive multiple of --full-attention-interval (k-1 linear : 1 attention).")
    if min(args.prompts, args.max_new_tokens, args.prompt_len, args.warmup_tokens) < 1:
        p.error("--prompts, --prompt-len, --max-new-tokens and --warmup-tokens must be >= 1.")
    if args.vocab < 8:
        p.error("--vocab must be >= 8 (prompt tokens start at 3; the drafter needs decoy tokens).")
    return args


def model_config(args) -> dict:
    """Qwen3-Next-shaped keyword arguments scaled down to --hidden (head sizes follow the hidden size)."""
    heads = max(2, args.hidden // 64)
    head_dim = args.hidden // heads
    return dict(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, full_attention_interval=args.full_attention_interval,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=head_dim,
        linear_num_key_heads=max(1, heads // 2), linear_num_value_heads=heads,
        linear_key_head_dim=head_dim, linear_value_head_dim=head_dim, linear_conv_kernel_dim=4,
        num_experts=args.experts, num_experts_per_tok=args.experts_per_token, moe_intermediate_size=args.hidden,
        shared_expert_intermediate_size=args.hidden, decoder_sparse_step=1,
        max_position_embeddings=max(1024, 2 * (args.prompt_len + args.max_new_tokens + args.block_size)),
        tie_word_embeddings=False, initializer_range=args.init_range,
    )


def build_target(args, device: torch.device):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(args.seed)
    cfg = Qwen3NextConfig(**model_config(args))
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = args.experts_impl
    model = Qwen3NextForCausalLM(cfg).eval()
    with torch.no_grad():  # as in the tests' fixture: peakier logits, margins far above float32 noise
        model.lm_head.weight.mul_(4.0)
    return model.to(device=device, dtype=torch.float32)


def make_prompts(args) -> list[list[int]]:
    g = torch.Generator().manual_seed(args.seed + 1)
    return [torch.randint(3, args.vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]


class DeviceScriptedDraft(ScriptedBranchDraft):
    """The tests' scripted drafter, with its target forwards on the target's device (the fixture builds CPU
    tensors) and CPU log-probs out (the decoder builds the tree on the proposal's device, then moves it)."""

    @torch.no_grad()
    def _step(self, cache, ids: list[int], start: int) -> torch.Tensor:
        dev = next(self.target.parameters()).device
        pos = torch.arange(start, start + len(ids), device=dev).view(1, -1)
        out = self.target(input_ids=torch.tensor([ids], device=dev), position_ids=pos, past_key_values=cache,
                          use_cache=True)
        return out.logits[0, -1].float().cpu()


@contextlib.contextmanager
def verify_timer(device: torch.device):
    """Time every HybridTargetState.verify call made inside the block; yields the list of ms it fills.

    The decoder builds its HybridTargetState itself, so the method is wrapped on the class for the block's
    duration (restored afterwards). On CUDA the span is measured with events (device time of the verify's
    kernels, launch gaps included) rather than host clocks; the decoder synchronizes before verify starts.
    """
    times: list[float] = []
    original = HybridTargetState.verify

    def timed(self, tree, start):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            out = original(self, tree, start)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            t = time.perf_counter()
            out = original(self, tree, start)
            times.append((time.perf_counter() - t) * 1e3)
        return out

    HybridTargetState.verify = timed
    try:
        yield times
    finally:
        HybridTargetState.verify = original


def speculative(target, prompt, budget: int, path: str, args, max_new_tokens: int, prompt_index: int):
    # one script per prompt (the same for both paths and every budget): prompts see different tree shapes
    script = seeded_script(1000 * (args.seed + 1) + prompt_index)
    draft = DeviceScriptedDraft(target, script, block_size=args.block_size)
    return speculative_decode(target, draft, prompt, method="ddtree", budget=budget, max_new_tokens=max_new_tokens,
                              hybrid_verify=path)


def run_path(target, prompts, budget: int, path: str, args, device) -> dict:
    """Decode every prompt through one hybrid verify path; records plus per-round verify / round / stage ms."""
    speculative(target, prompts[0], budget, path, args, args.warmup_tokens, 0)  # warm-up: kernels, allocator
    recs, verify_ms = [], []
    for i, prompt in enumerate(prompts):
        with verify_timer(device) as times:
            rec = speculative(target, prompt, budget, path, args, args.max_new_tokens, i)
        if len(times) != len(rec.accept_lengths):
            raise AssertionError(f"{len(times)} timed verifies for {len(rec.accept_lengths)} rounds")
        recs.append(rec)
        verify_ms += times
        print(f"  B={budget:<4} {path:<6} prompt {i + 1}/{len(prompts)}: {len(rec.accept_lengths)} rounds, "
              f"tau {sum(rec.accept_lengths) / len(rec.accept_lengths):.2f}, "
              f"verify median {statistics.median(times):.2f} ms", flush=True)
    return {"recs": recs, "verify_ms": verify_ms}


def path_summary(run: dict) -> dict:
    recs = run["recs"]
    per_round = {s: [ms for r in recs for ms in r.stage_ms[s]] for s in STAGES}
    rounds = sum(len(r.accept_lengths) for r in recs)
    round_ms = [sum(parts) for parts in zip(*(per_round[s] for s in STAGES))]
    return {
        "verify_ms_median": statistics.median(run["verify_ms"]),
        "verify_ms_mean": statistics.fmean(run["verify_ms"]),
        "round_ms_median": statistics.median(round_ms),
        # the scripted drafter's own target forwards land in "draft" (one per depth) and "commit" (its context
        # append); "verify" is the path under test
        "stage_ms_median": {s: statistics.median(v) for s, v in per_round.items()},
        "rounds": rounds,
        "tau": sum(sum(r.accept_lengths) for r in recs) / rounds,
    }


def acceptance(recs) -> tuple[dict, dict]:
    """Accepted depth per round (histogram) and the accepted non-first siblings (rank > 0) by depth."""
    depths = collections.Counter(a - 1 for r in recs for a in r.accept_lengths)
    branch_depths = collections.Counter(d for r in recs for ranks in r.accepted_ranks
                                        for d, rank in enumerate(ranks, start=1) if rank != 0)
    rounds_with_branch = sum(any(rank != 0 for rank in ranks) for r in recs for ranks in r.accepted_ranks)
    histogram = {str(d): depths[d] for d in sorted(depths)}
    branches = {"total": sum(branch_depths.values()), "rounds_with_branch": rounds_with_branch,
                "by_depth": {str(d): branch_depths[d] for d in sorted(branch_depths)}}
    return histogram, branches


def mismatches(plain, runs: dict) -> list[dict]:
    """Outputs that differ from plain decoding: where, and plain's top-1 margin there (a margin near float32
    noise points at a near-tie, not at a wrong verify)."""
    out = []
    for path, run in runs.items():
        for i, (ref, rec) in enumerate(zip(plain, run["recs"])):
            got, want = rec.output_ids, ref.output_ids
            if got != want:
                first = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                margin = ref.margins[first] if first < len(ref.margins) else None
                out.append({"prompt": i, "path": path, "first_diff_at": first, "plain_margin_there": margin})
    return out


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip() or "unknown"
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment(argv, device: torch.device) -> dict:
    import platform

    import transformers
    from transformers.models.qwen3_next import modeling_qwen3_next

    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        # from the shell: exactly what ran; from main(argv) (tests): the equivalent command
        "command": shlex.join([sys.executable, *sys.argv] if argv is None else [sys.executable, __file__, *argv]),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        # fla + causal-conv1d kernels for the gated-delta-net layers, else transformers' torch fallbacks
        "gdn_fast_path": bool(modeling_qwen3_next.is_fast_path_available),
        "threads": torch.get_num_threads(),
    }


def run_budget(target, prompts, plain, budget: int, args, device) -> dict:
    """Both hybrid paths at one budget: timings, losslessness against plain decoding, acceptance."""
    runs = {path: run_path(target, prompts, budget, path, args, device) for path in ("tree", "oracle")}
    histogram, branches = acceptance(runs["tree"]["recs"])
    diffs = mismatches(plain, runs)
    entry = {path: path_summary(runs[path]) for path in PATHS}
    entry.update(
        plain_ms_per_token=statistics.median(ms for r in plain for ms in r.stage_ms["verify"]),  # 1 step = 1 token
        lossless=not diffs, mismatches=diffs,
        oracle_tree_same_acceptance=all(a.accept_lengths == b.accept_lengths and a.accepted_ranks == b.accepted_ranks
                                        for a, b in zip(runs["tree"]["recs"], runs["oracle"]["recs"])),
        accepted_depth_histogram=histogram, branch_accepts=branches,
    )
    return entry


def write_result(path: Path, env: dict, args, target, plain, per_budget: dict, device, t_start: float) -> dict:
    """The JSON report; rewritten after every budget, so a run cut short still leaves the budgets it finished."""
    lossless = all(e["lossless"] for e in per_budget.values())
    b64 = per_budget.get("64")
    result = {
        **env,
        "model_config": {**model_config(args), "layer_types": target.config.layer_types,
                         "params": sum(p.numel() for p in target.parameters()), "dtype": "float32",
                         "attn_implementation": "sdpa", "experts_implementation": args.experts_impl,
                         "lm_head_scale": 4.0},
        "settings": {"budgets": args.budgets, "batch_size": 1, "prompts": args.prompts,
                     "prompt_len": args.prompt_len, "max_new_tokens": args.max_new_tokens,
                     "warmup_tokens": args.warmup_tokens, "block_size": args.block_size, "seed": args.seed,
                     "temperature": 0.0, "timer": "cuda events" if device.type == "cuda" else "perf_counter"},
        "complete": len(per_budget) == len(args.budgets),
        "plain_ms_per_token": statistics.median(ms for r in plain for ms in r.stage_ms["verify"]),
        "plain_min_margin": min(m for r in plain for m in r.margins),  # how far greedy picks are from ties
        "budgets": per_budget,
        "hybrid_lossless_t0": lossless,
        "hybrid_step_ms": {"oracle_b64": b64["oracle"]["verify_ms_median"] if b64 else None,
                           "fast_b64": b64["tree"]["verify_ms_median"] if b64 else None},
        "wall_s": time.perf_counter() - t_start,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.threads or device.type == "cpu":
        # small ops: a multi-thread pool costs more than it saves, and collapses when cores are shared
        torch.set_num_threads(args.threads or 1)
    # float32 means float32: TF32 matmuls/convs would round differently per batch shape
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # "fast path is not available" on machines without fla: expected
    t_start = time.perf_counter()
    env = environment(argv, device)
    target = build_target(args, device)
    n_params = sum(p.numel() for p in target.parameters())
    print(f"target: Qwen3-Next random, {n_params / 1e6:.1f}M params, layers {target.config.layer_types}, "
          f"on {env['device']}", flush=True)
    prompts = make_prompts(args)

    plain_decode(target, prompts[0], max_new_tokens=args.warmup_tokens)  # warm-up
    plain = [plain_decode(target, p, max_new_tokens=args.max_new_tokens) for p in prompts]
    print(f"plain: {statistics.median(ms for r in plain for ms in r.stage_ms['verify']):.2f} ms/token (median), "
          f"smallest top-1 margin {min(m for r in plain for m in r.margins):.3f}", flush=True)

    out, per_budget = Path(args.out), {}
    for budget in args.budgets:
        entry = per_budget[str(budget)] = run_budget(target, prompts, plain, budget, args, device)
        result = write_result(out, env, args, target, plain, per_budget, device, t_start)
        o, t = entry["oracle"], entry["tree"]
        print(f"B={budget}: lossless={entry['lossless']} tau={t['tau']:.2f} "
              f"branch accepts={entry['branch_accepts']['total']} | verify median oracle "
              f"{o['verify_ms_median']:.2f} ms, tree {t['verify_ms_median']:.2f} ms "
              f"({o['verify_ms_median'] / t['verify_ms_median']:.1f}x) | round median oracle "
              f"{o['round_ms_median']:.1f} ms, tree {t['round_ms_median']:.1f} ms | {result['wall_s']:.0f} s so far",
              flush=True)

    print(f"lossless={result['hybrid_lossless_t0']}  hybrid_step_ms={result['hybrid_step_ms']}  "
          f"wall {result['wall_s']:.1f} s  -> {out}", flush=True)
    return 0 if result["hybrid_lossless_t0"] else 1


if __name__ == "__main__":
    sys.exit(main())
