"""Does the tiny pair still behave at long context? Target NLL by position, greedy loops and drafter tau, on the CPU.

The tiny target was trained on windows of at most 1024 tokens and its drafter on 384-token sequences (rope_theta 1e4
at head dim 64). Its widening to Qwen3-8B shapes (sglang_ddtree/widen.py) computes the same logits, so what the tiny
pair does at 8K / 32K positions is what the GPU benchmarks see when they time plain / DFLASH / DDTREE on 2K / 8K /
32K-token prompts (runs/bench/long_prompts.jsonl, built by ddtree_bench/long_prompts.py from held-out stdlib files).
If the model degenerates past its training length, tokens/s and tau measured there describe a broken model, not the
method; this script measures whether it does (float32, CPU, greedy, the project's offline reference decoders):

  1. nll       the target's next-token NLL (nats) of every prompt token, by position bin of the predicted token,
               pooled over prompts (token-weighted). Next to it the same tokens scored with a sliding window
               (`windowed_nll`: at most `window` tokens of context, positions < window, i.e. inside the training
               length): `delta` = full - windowed per bin. A model that extrapolates has delta <= ~0 (more context
               helps); one that breaks past its training length has NLL rising with position and delta >> 0.
               Held-out reference: the card's perplexity 6.78 (NLL 1.914) on 1024-token windows.
  2. greedy    plain greedy continuations of the long prompts and of two short controls cut from the same prompt:
               `head` (its first `short` tokens) and `tail` (its last `short` tokens: the same cut point, the same
               local text, only the far context removed). Per continuation: the share of its last `tail` tokens
               inside a short loop (period <= 4 repeated for >= 8 tokens) or any loop (period <= 32, repeated for
               >= max(8, 2 * period) tokens), the distinct 4-gram share, and how many distinct continuations a
               group produced.
  3. tau       DFLASH chain and DDTREE (each budget) on the same prompts and controls: tau = committed tokens per
               round (accepted drafts + the bonus, pooled over prompts); each output compared token for token with
               plain decoding's (greedy speculative decoding must reproduce it exactly).

    PYTHONPATH=. python benchmarks/long_context_offline.py \\
        --out benchmarks/results/long_context_offline_tiny_cpu_<date>_<commit>.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sglang_ddtree.compare import first_divergence  # noqa: E402
from sglang_ddtree.offline.decoders import plain_decode, speculative_decode  # noqa: E402

EDGES = (0, 512, 1024, 2048, 4096, 8192, 16384, 32768)
DEFAULT_PROMPTS = ROOT / "runs" / "bench" / "long_prompts.jsonl"
TRAIN_WINDOW = 1024  # the target's training sequence length (training_log.json: args.target_seq)


# ----------------------------------------------------------------------------------------------- NLL by position


@torch.no_grad()
def prompt_nll(target, ids: list[int], chunk: int = 4096) -> torch.Tensor:
    """NLL (nats, float64) of every token given all tokens before it: out[t] for t >= 1, out[0] = nan.

    A causal forward in chunks of `chunk` tokens on top of a KV cache, so a 32K prompt never holds all its logits
    (or an all-pairs mask) at once; chunking changes no math, only float rounding."""
    from transformers import DynamicCache

    n = len(ids)
    x = torch.tensor(ids, dtype=torch.long)
    out = torch.full((n,), float("nan"), dtype=torch.float64)
    cache = DynamicCache(config=target.config)
    for s in range(0, n - 1, chunk):
        e = min(s + chunk, n - 1)  # forward tokens s..e-1: they predict tokens s+1..e
        logits = target(input_ids=x[s:e].view(1, -1), position_ids=torch.arange(s, e).view(1, -1),
                        past_key_values=cache, use_cache=True).logits[0].float()
        out[s + 1:e + 1] = torch.nn.functional.cross_entropy(logits, x[s + 1:e + 1], reduction="none").double()
    return out


@torch.no_grad()
def windowed_nll(target, ids: list[int], window: int = TRAIN_WINDOW, stride: int = TRAIN_WINDOW // 2) -> torch.Tensor:
    """The same tokens scored with a sliding window: out[t] uses at most `window` tokens of context, re-positioned
    to start at 0 (positions < window, as in training). Windows start every `stride` tokens and each scores only its
    last `stride` tokens (the first window scores all of its own), so every token t >= window keeps at least
    window - stride tokens of context and tokens t < window get exactly what `prompt_nll` gives them."""
    if not 0 < stride <= window:
        raise ValueError(f"need 0 < stride <= window, got stride {stride}, window {window}.")
    n = len(ids)
    x = torch.tensor(ids, dtype=torch.long)
    out = torch.full((n,), float("nan"), dtype=torch.float64)
    s = 0
    while True:
        e = min(s + window, n)
        logits = target(input_ids=x[s:e].view(1, -1), use_cache=False).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, x[s + 1:e], reduction="none").double()  # nll[k]: token s+k+1
        first = 1 if s == 0 else s + window - stride
        out[first:e] = nll[first - s - 1:]
        if e == n:
            return out
        s += stride


def bin_sums(nll: torch.Tensor, edges=EDGES) -> list[dict]:
    """Per position bin [lo, hi) of the predicted token: the NLL sum and token count (nan positions skipped); bins
    that start at or past the prompt's end are left out."""
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        if lo >= nll.numel():
            break
        part = nll[lo:hi]
        part = part[~torch.isnan(part)]
        rows.append({"lo": lo, "hi": hi, "sum": float(part.sum()), "count": int(part.numel())})
    return rows


def pool_bins(per_prompt: list[list[dict]]) -> list[dict]:
    """Token-weighted mean NLL per bin over prompts (each prompt's `bin_sums`), with its perplexity."""
    acc: dict[tuple[int, int], list[float]] = {}
    for bins in per_prompt:
        for b in bins:
            a = acc.setdefault((b["lo"], b["hi"]), [0.0, 0, 0])
            a[0] += b["sum"]
            a[1] += b["count"]
            a[2] += 1
    out = []
    for (lo, hi), (total, count, prompts) in sorted(acc.items()):
        mean = total / count if count else float("nan")
        out.append({"lo": lo, "hi": hi, "tokens": count, "prompts": prompts, "nll": mean,
                    "ppl": math.exp(mean) if count else float("nan")})
    return out


def nll_report(target, ids: list[int], *, chunk: int, window: int, stride: int) -> dict:
    """One prompt's full-context and windowed NLL, binned, with the delta per bin."""
    full = prompt_nll(target, ids, chunk=chunk)
    win = windowed_nll(target, ids, window=window, stride=stride)
    return {"tokens": len(ids), "full": bin_sums(full), "windowed": bin_sums(win),
            "mean_full": float(full[1:].mean()), "mean_windowed": float(win[1:].mean())}


def compact_nll(rep: dict) -> dict:
    """`nll_report` as stored: per bin the token count, the mean full-context and windowed NLL and their delta."""
    bins = [{"lo": f["lo"], "hi": f["hi"], "tokens": f["count"], "nll": round(f["sum"] / f["count"], 4),
             "nll_windowed": round(w["sum"] / w["count"], 4), "delta": round((f["sum"] - w["sum"]) / f["count"], 4)}
            for f, w in zip(rep["full"], rep["windowed"]) if f["count"]]
    return {"tokens": rep["tokens"], "mean_full": round(rep["mean_full"], 4),
            "mean_windowed": round(rep["mean_windowed"], 4), "bins": bins}


# ----------------------------------------------------------------------------------------------- greedy loops


def loop_mask(tokens: list[int], max_period: int, min_run: int = 8, copies: int = 2) -> list[bool]:
    """True for every token inside a loop: a stretch where tokens[j] == tokens[j - p] holds for at least
    max(min_run, copies * p) consecutive j, for some period p <= max_period (the stretch's first period counts)."""
    n = len(tokens)
    flag = [False] * n
    for p in range(1, max_period + 1):
        need = max(min_run, copies * p)
        j = p
        while j < n:
            if tokens[j] != tokens[j - p]:
                j += 1
                continue
            k = j
            while k < n and tokens[k] == tokens[k - p]:
                k += 1
            if k - j >= need:
                for i in range(j - p, k):
                    flag[i] = True
            j = k
    return flag


def loop_stats(tokens: list[int], tail: int = 64) -> dict:
    """Degeneration signs of one continuation: loop shares among its last `tail` tokens, distinct 4-gram share."""
    short = loop_mask(tokens, 4)[-tail:]
    anyp = loop_mask(tokens, 32)[-tail:]
    grams = [tuple(tokens[i:i + 4]) for i in range(len(tokens) - 3)]
    return {"loop_share_p4": sum(short) / max(len(short), 1), "loop_share_p32": sum(anyp) / max(len(anyp), 1),
            "distinct_4gram_share": len(set(grams)) / len(grams) if grams else 1.0}


def common_prefix(a: list[int], b: list[int]) -> int:
    """Tokens two outputs share from their start (sglang_ddtree.compare.first_divergence; equal ones: all)."""
    at = first_divergence(a, b)
    return len(a) if at is None else at


# ----------------------------------------------------------------------------------------------- decoding


def decode_methods(target, draft, ids: list[int], *, max_new_tokens: int, eos_token_ids, budgets) -> dict:
    """Plain, DFLASH and DDTREE (each budget) on one prompt: outputs, tau counts, losslessness, seconds.
    An output that ends at its first token (EOS from the prefill) has no rounds: its tau reads 0 here and it adds
    nothing to a pooled tau."""
    out = {}
    t = time.perf_counter()
    plain = plain_decode(target, ids, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids)
    out["plain"] = {"output_ids": plain.output_ids, "finish_reason": plain.finish_reason,
                    "seconds": round(time.perf_counter() - t, 2)}
    specs = [("dflash", "dflash", None)] + [(f"ddtree_b{b}", "ddtree", b) for b in budgets]
    for name, method, budget in specs:
        t = time.perf_counter()
        rec = speculative_decode(target, draft, ids, method=method, budget=budget, max_new_tokens=max_new_tokens,
                                 eos_token_ids=eos_token_ids)
        out[name] = {"tokens": sum(rec.accept_lengths), "rounds": len(rec.accept_lengths),
                     "tau": sum(rec.accept_lengths) / max(len(rec.accept_lengths), 1),
                     "max_commit": max(rec.accept_lengths, default=0),
                     "equals_plain": rec.output_ids == plain.output_ids
                     and rec.finish_reason == plain.finish_reason,
                     "seconds": round(time.perf_counter() - t, 2)}
    return out


def pool_taus(records: list[dict], methods: list[str]) -> dict:
    """Pooled tau (committed tokens over rounds) per method over a group's per-prompt `decode_methods` results."""
    out = {}
    for m in methods:
        tokens = sum(r[m]["tokens"] for r in records)
        rounds = sum(r[m]["rounds"] for r in records)
        out[m] = {"tau": tokens / rounds if rounds else None, "tokens": tokens, "rounds": rounds,
                  "per_prompt": [round(r[m]["tau"], 3) for r in records],
                  "lossless": f"{sum(r[m]['equals_plain'] for r in records)}/{len(records)}"}
    return out


# ----------------------------------------------------------------------------------------------- main


def parse_counts(text: str) -> dict[int, int]:
    """'2048:4,8192:16' -> {2048: 4, 8192: 16}."""
    out = {}
    for part in text.split(","):
        if part.strip():
            length, count = part.split(":")
            out[int(length)] = int(count)
    return out


def pick(rows: list[dict], counts: dict[int, int]) -> list[dict]:
    """The first `count` long_code prompts (file order) of each target length."""
    out = []
    for length, count in counts.items():
        found = [r for r in rows if r.get("kind") == "long_code" and r.get("target_tokens") == length][:count]
        if len(found) < count:
            raise ValueError(f"only {len(found)} long_code prompts of {length} tokens, {count} asked.")
        out += found
    return out


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def _cpu_s() -> float:
    return time.process_time()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, metavar="FILE.json", help="where the JSON result goes")
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="long prompts JSONL (ddtree_bench/long_prompts.py)")
    ap.add_argument("--nll-prompts", default="2048:4,8192:16,32768:4",
                    help="LENGTH:COUNT,...: how many long_code prompts of each length get the NLL measurement")
    ap.add_argument("--decode-prompts", default="2048:4,8192:4,32768:2",
                    help="LENGTH:COUNT,...: how many get the greedy / tau measurement (with their short controls)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--budgets", default="16,64", help="DDTREE budgets, comma-separated (the GPU plan's long-context"
                    " ones)")
    ap.add_argument("--short", type=int, default=300, help="tokens of the head / tail short controls")
    ap.add_argument("--loop-tail", type=int, default=64, help="loop shares are taken over a continuation's last N")
    ap.add_argument("--chunk", type=int, default=4096, help="prefill chunk of the full-context NLL forward")
    ap.add_argument("--window", type=int, default=TRAIN_WINDOW, help="context of the windowed NLL reference")
    ap.add_argument("--stride", type=int, default=TRAIN_WINDOW // 2, help="stride of the windowed NLL reference")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = ap.parse_args(argv)
    budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
    methods = ["dflash"] + [f"ddtree_b{b}" for b in budgets]

    from sglang_ddtree import tiny
    from sglang_ddtree.offline.drafts import DFlashDraftSource

    torch.set_num_threads(args.threads)
    started, cpu0 = time.perf_counter(), _cpu_s()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f}s cpu {_cpu_s() - cpu0:7.1f}s] {msg}", flush=True)

    tok = tiny.load_tokenizer()
    target = tiny.load_target()
    target.config._attn_implementation = "sdpa"
    drafter = tiny.load_drafter()
    draft = DFlashDraftSource(drafter, target)
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    rows = [json.loads(line) for line in open(args.prompts) if line.strip()]
    training = json.loads((tiny.tiny_dir() / "training_log.json").read_text())

    def encode(r: dict) -> list[int]:
        ids = tok.encode(r["text"], add_special_tokens=False)
        if len(ids) != r["tokens"]:
            raise ValueError(f"{r['id']}: {len(ids)} tokens here, {r['tokens']} in the file (another tokenizer?).")
        return ids

    # 1. NLL by position
    nll_rows = pick(rows, parse_counts(args.nll_prompts))
    nll = {}
    for r in nll_rows:
        rep = nll_report(target, encode(r), chunk=args.chunk, window=args.window, stride=args.stride)
        nll.setdefault(r["target_tokens"], {})[r["id"]] = rep
        bins = " ".join(f"[{b['lo']},{b['hi']}):{b['sum'] / max(b['count'], 1):.2f}" for b in rep["full"])
        log(f"nll {r['id']} ({rep['tokens']} tok) mean {rep['mean_full']:.3f} windowed {rep['mean_windowed']:.3f} "
            f"| {bins}")
    nll_pooled = {}
    for length, reps in nll.items():
        full, win = pool_bins([x["full"] for x in reps.values()]), pool_bins([x["windowed"] for x in reps.values()])
        nll_pooled[length] = {"prompts": list(reps), "bins": [
            {**f, "nll_windowed": w["nll"], "delta": f["nll"] - w["nll"]} for f, w in zip(full, win)]}
        for b in nll_pooled[length]["bins"]:
            log(f"nll pooled {length}: [{b['lo']},{b['hi']}) full {b['nll']:.3f} windowed {b['nll_windowed']:.3f} "
                f"delta {b['delta']:+.3f} ({b['tokens']} tok, {b['prompts']} prompts)")

    # 2 + 3. greedy continuations and tau, long prompts vs their head / tail controls
    dec_rows = pick(rows, parse_counts(args.decode_prompts))
    per_prompt = {}
    for r in dec_rows:
        ids = encode(r)
        variants = {"long": ids, "head": ids[:args.short], "tail": ids[-args.short:]}
        entry = {"length": r["target_tokens"], "tokens": len(ids)}
        for name, v in variants.items():
            res = decode_methods(target, draft, v, max_new_tokens=args.max_new_tokens, eos_token_ids=eos,
                                 budgets=budgets)
            out_ids = res["plain"]["output_ids"]
            res["plain"].update(loop_stats(out_ids, tail=args.loop_tail))
            res["plain"]["text"] = tok.decode(out_ids)[:400]
            entry[name] = res
            taus = " ".join(f"{m}={res[m]['tau']:.2f}{'' if res[m]['equals_plain'] else '(NOT LOSSLESS)'}"
                            for m in methods)
            log(f"decode {r['id']} {name} ({len(v)} tok): {len(out_ids)} new, loops p4 "
                f"{res['plain']['loop_share_p4']:.2f} p32 {res['plain']['loop_share_p32']:.2f} 4gram "
                f"{res['plain']['distinct_4gram_share']:.2f} | {taus} | {res['plain']['text'][:80]!r}")
        entry["long_common_prefix_with_tail"] = common_prefix(entry["long"]["plain"]["output_ids"],
                                                              entry["tail"]["plain"]["output_ids"])
        per_prompt[r["id"]] = entry

    groups = {}
    for length in parse_counts(args.decode_prompts):
        ids_ = [pid for pid, e in per_prompt.items() if e["length"] == length]
        g = {"prompts": ids_}
        for name in ("long", "head", "tail"):
            recs = [per_prompt[pid][name] for pid in ids_]
            plains = [x["plain"] for x in recs]
            g[name] = {
                "taus": pool_taus(recs, methods),
                "loop_share_p4": sum(p["loop_share_p4"] for p in plains) / len(plains),
                "loop_share_p32": sum(p["loop_share_p32"] for p in plains) / len(plains),
                "distinct_4gram_share": sum(p["distinct_4gram_share"] for p in plains) / len(plains),
                "distinct_continuations": len({tuple(p["output_ids"]) for p in plains}),
                "eos_finishes": sum(p["finish_reason"] == "eos" for p in plains),
            }
        groups[length] = g
        for name in ("long", "head", "tail"):
            x = g[name]
            log(f"group {length} {name}: " + " ".join(f"{m} tau {x['taus'][m]['tau']:.2f} ({x['taus'][m]['lossless']} "
                                                      f"lossless)" for m in methods)
                + f" | loops p4 {x['loop_share_p4']:.2f} p32 {x['loop_share_p32']:.2f} 4gram "
                  f"{x['distinct_4gram_share']:.2f} distinct {x['distinct_continuations']}/{len(ids_)}")

    for e in per_prompt.values():  # outputs are long; keep their stats, a text excerpt and no id lists
        for name in ("long", "head", "tail"):
            e[name]["plain"]["new_tokens"] = len(e[name]["plain"].pop("output_ids"))

    lossless_all = all(e[name][m]["equals_plain"] for e in per_prompt.values() for name in ("long", "head", "tail")
                       for m in methods)
    files = training.get("files", {})
    prompts_path = Path(args.prompts).resolve()
    prompts_file = str(prompts_path.relative_to(ROOT)) if ROOT in prompts_path.parents else str(prompts_path)
    setup = {
        "command": "python benchmarks/long_context_offline.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "commit": _git("rev-parse", "--short", "HEAD"),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": __import__("transformers").__version__},
        "device": "cpu", "threads": args.threads, "dtype": "float32", "temperature": 0.0,
        "prompts_file": prompts_file, "prompts_sha256": tiny.sha256_file(args.prompts),
        "models": {k: tiny.sha256_file(tiny.tiny_dir() / k) for k in
                   ("target/model.safetensors", "drafter/model.safetensors", "tokenizer/tokenizer.json")},
        "models_match_training_log": bool(files) and all(
            tiny.sha256_file(tiny.tiny_dir() / k) == v["sha256"] for k, v in files.items()),
        "max_new_tokens": args.max_new_tokens, "budgets": budgets, "short": args.short, "loop_tail": args.loop_tail,
        "chunk": args.chunk, "window": args.window, "stride": args.stride, "eos_token_ids": eos,
        "reference": {"heldout_ppl": training["target"]["heldout_ppl"],
                      "heldout_nll": math.log(training["target"]["heldout_ppl"]),
                      "train_seq_len": training["args"]["target_seq"],
                      "drafter_seq_len": training["args"]["gen_total_len"]},
        "elapsed_s": round(time.perf_counter() - started, 1), "cpu_s": round(_cpu_s() - cpu0, 1),
        "max_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2),
    }
    result = {"setup": setup, "nll_pooled": {str(k): v for k, v in nll_pooled.items()},
              "nll_per_prompt": {str(k): {pid: compact_nll(rep) for pid, rep in v.items()} for k, v in nll.items()},
              "decode_groups": {str(k): v for k, v in groups.items()}, "decode_per_prompt": per_prompt,
              "lossless_all": lossless_all}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    log(f"lossless (every speculative output equals plain): {lossless_all}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
