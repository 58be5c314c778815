#!/usr/bin/env python
"""Train the tiny target/drafter pair in one command (phases stop on wall-clock budgets, not step counts).

    python scripts/build_corpus.py                                   # once, on CPU (writes .cache/corpus)
    PYTHONUNBUFFERED=1 python scripts/train_tiny_pair.py --data .cache/corpus --out models/tiny --device cuda
    PYTHONUNBUFFERED=1 python scripts/train_tiny_pair.py --target-arch qwen3_5_text --data .cache/corpus --device cuda
    python scripts/train_tiny_pair.py --smoke --data <corpus> --out <tmp>   # seconds on CPU (tests)
    python scripts/train_tiny_pair.py --target-arch qwen3_5_text --configs-only --out benchmarks/configs/tiny-hybrid
        # only the two config.json files this run would save (what a benchmark plans from before the training)

--target-arch picks the target (scripts/tiny_targets.py): `qwen3`, a dense Qwen3ForCausalLM (the default; the
committed models/tiny), or `qwen3_5_text`, a dense-MLP gated-delta-net hybrid Qwen3_5ForCausalLM (3 linear-attention
layers : 1 gated full-attention layer; default out models/tiny-hybrid) whose shape widens exactly to Qwen3.5-27B with
`python -m sglang_ddtree.widen_hybrid` (checked before training: --widen-shape). Only the target's construction, its
shape options and batch, the drafter's default feature layers, shape and final-norm start, and the saved config
differ; the phases below are the same for both.

Phases (each one saves its results before the next starts; default budgets for one H200, ~6 minutes in all):
  1. target (70s): a transformers causal LM trained as a next-token LM on the train split (bf16 autocast,
     AdamW, warmup + cosine over the time budget); a held-out probe every 10s stops it early and the best
     probe's weights are shipped (the 8.7M-token corpus is overfitted within about a minute); held-out
     perplexity; saved in bf16 with tokenizer files.
  2. data (100s): the target's own greedy continuations of random train-split windows (batched loop with the
     transformers cache: KV, and the conv / recurrent states of a hybrid's linear-attention layers),
     so every generated position holds "the target's greedy token given the prefix". Batch size and number
     of batches are time-budgeted (the loop is launch-bound: bigger batches cost little more per step).
  3. drafter (the rest, ~140s): DFlash block-diffusion objective exactly as SGLang runs the drafter: anchor p in
     a generated region, block [x_p, MASK x 15] at positions p..p+15, context = target features at positions
     < p, labels x_{p+1..p+15}, per-position CE weighted by exp(-(j-1)/gamma). Many anchors per sequence in one
     attention call with a block-sparse boolean mask. Rows are visited in shuffled epochs (logged); every 20s
     the chain acceptance on greedy continuations of HELD-OUT prompts is measured next to that on a few
     training rows (memorization shows as a gap), and the best held-out drafter is saved and shipped.
  4. evaluation (~25s) on held-out prompts (acceptance of the chain drafter) and references for the tests.
The last line printed is a one-line JSON summary.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import shutil
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tiny_targets, also when loaded by path (tests)
import tiny_targets  # noqa: E402
from sglang_ddtree.drafter import (  # noqa: E402
    DFlashDrafter, DrafterConfig, block_training_mask, target_context_features,
)
from sglang_ddtree.tiny import (  # noqa: E402
    MASK_TOKEN, load_corpus_tokens, sha256_file,
)

REPO_ROOT = Path(__file__).resolve().parents[1]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# A fixed prompt for the greedy reference the tests replay (our own text, not from the corpus).
REFERENCE_PROMPT = 'import os\n\n\ndef read_config(path):\n    """Return the parsed config file at path."""\n'
REFERENCE_NEW_TOKENS = 32


# ---------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.t0 = time.time()

    def __call__(self) -> float:
        return time.time() - self.t0


def log(msg: str) -> None:
    print(msg, flush=True)


def fmt_s(s: float) -> str:
    return f"{int(s) // 60}m{int(s) % 60:02d}s"


def lr_at(step: int, progress: float, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warmup over `warmup` steps, then cosine from peak to floor*peak as progress goes 0 -> 1."""
    warm = min(1.0, (step + 1) / max(1, warmup))
    cos = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return peak * warm * (floor + (1.0 - floor) * cos)


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, device: torch.device):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        # Norm gains and embeddings are not decayed (standard for small LMs).
        (no_decay if p.dim() < 2 or "embed" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kwargs = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, **kwargs)


def autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=False)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def device_generator(device: torch.device, seed: int) -> torch.Generator:
    # Sampling on the device avoids a host->device copy (and with it a stream sync) every step.
    return torch.Generator(device=device).manual_seed(seed)


def sample_windows(tokens: torch.Tensor, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """n random windows [n, length] (int64) from a 1-D token stream; gen lives on the stream's device."""
    starts = torch.randint(0, tokens.numel() - length, (n,), generator=gen, device=tokens.device)
    idx = starts[:, None] + torch.arange(length, device=tokens.device)
    return tokens[idx].long()


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


# ---------------------------------------------------------------------------------------------------------
# target
# ---------------------------------------------------------------------------------------------------------
def spread_windows(tokens: torch.Tensor, n: int, length: int, offset: float = 0.0) -> torch.Tensor:
    """Up to n windows [n, length], evenly spread over the whole stream (files differ a lot: docstring prose,
    tables, tests), without overlap. offset in [0, 1) shifts every window by that fraction of the stride, so two
    calls with different offsets give disjoint windows when length <= stride / 2."""
    n = min(n, tokens.numel() // length)
    if n <= 0:
        raise ValueError(f"held-out split has {tokens.numel()} tokens, fewer than one window of {length}.")
    stride = tokens.numel() // n
    shift = min(int(offset * stride), stride - length)
    return torch.stack([tokens[i * stride + shift: i * stride + shift + length] for i in range(n)]).long()


@torch.no_grad()
def heldout_ppl(model, held: torch.Tensor, seq: int, max_windows: int, batch: int, device) -> tuple[float, int]:
    windows = spread_windows(held, max_windows, seq + 1)
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        x = windows[i:i + batch].to(device)
        with autocast(device):
            logits = model(input_ids=x[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
        total += loss.item()
        count += x[:, 1:].numel()
    return math.exp(total / count), count


def train_target(args, config, train: torch.Tensor, held: torch.Tensor, device, rec):
    model = tiny_targets.build_target(config).to(device)
    vocab_size = config.vocab_size
    model.config.use_cache = False
    n_params = sum(p.numel() for p in model.parameters())
    types = getattr(config, "layer_types", None) or []
    layers = "".join("F" if t == "full_attention" else "L" for t in types) if "linear_attention" in types else ""
    log(f"[target] {type(model).__name__} {n_params / 1e6:.2f}M params" + (f" (layers {layers})" if layers else "")
        + f"; batch {args.target_batch} x {args.target_seq} tokens; budget {args.target_seconds:.0f}s"
        + (f" / {args.target_max_steps} steps" if args.target_max_steps else ""))
    opt = make_optimizer(model, args.target_lr, 0.1, device)
    fwd = model
    if args.compile and device.type == "cuda":
        fwd = torch.compile(model)
    gen = device_generator(device, args.seed + 1)
    # A fixed held-out probe, evaluated every --target-eval-every seconds: logged, and training stops early
    # once it has not improved for --target-patience probes (the corpus is small; a long run can overfit).
    probe = spread_windows(held, args.probe_windows, args.target_seq + 1).to(device)
    model.train()
    t_start, step, tokens_seen = time.time(), 0, 0
    curve, loss_acc, loss_n, last_print = [], torch.zeros((), device=device), 0, time.time()
    probes, best_probe, bad_probes, last_probe, stopped_early = [], float("inf"), 0, time.time(), False
    best_state, best_step = None, None
    while True:
        elapsed = time.time() - t_start
        if elapsed >= args.target_seconds or (args.target_max_steps and step >= args.target_max_steps):
            break
        if args.target_eval_every > 0 and time.time() - last_probe >= args.target_eval_every:
            model.eval()
            with torch.no_grad(), autocast(device):
                pl = model(input_ids=probe[:, :-1], use_cache=False).logits
            probe_loss = F.cross_entropy(pl.float().reshape(-1, vocab_size), probe[:, 1:].reshape(-1)).item()
            del pl
            model.train()
            probes.append({"step": step, "seconds": round(elapsed, 1), "heldout_loss": round(probe_loss, 4)})
            log(f"[target] held-out probe at step {step}: loss {probe_loss:.4f} (ppl {math.exp(probe_loss):.2f})")
            if probe_loss < best_probe - 1e-3:
                best_probe, bad_probes = probe_loss, 0
                if args.target_keep_best:  # 5.8M params: a device copy costs nothing next to a step
                    best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
                    best_step = step
            else:
                bad_probes += 1
            last_probe = time.time()
            if args.target_patience and bad_probes >= args.target_patience:
                stopped_early = True
                log(f"[target] held-out loss has not improved for {bad_probes} probes: stopping early")
                break
        progress = max(elapsed / args.target_seconds, step / args.target_max_steps if args.target_max_steps else 0.0)
        lr = lr_at(step, progress, args.target_lr, args.target_warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        x = sample_windows(train, args.target_batch, args.target_seq + 1, gen)
        with autocast(device):
            logits = fwd(input_ids=x[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, vocab_size), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens_seen += x[:, 1:].numel()
        loss_acc += loss.detach()
        loss_n += 1
        if time.time() - last_print >= args.log_every or step == 1:
            avg = (loss_acc / loss_n).item()  # one sync per print, not per step
            el = time.time() - t_start
            curve.append({"step": step, "seconds": round(el, 1), "loss": round(avg, 4), "lr": lr})
            log(f"[target] step {step:6d}  loss {avg:.4f}  lr {lr:.2e}  {tokens_seen / max(el, 1e-6):,.0f} tok/s  "
                f"{fmt_s(el)} / {fmt_s(args.target_seconds)}  (ETA {fmt_s(max(0.0, args.target_seconds - el))})")
            loss_acc.zero_()
            loss_n, last_print = 0, time.time()
    sync(device)
    seconds = time.time() - t_start
    if loss_n:
        curve.append({"step": step, "seconds": round(seconds, 1), "loss": round((loss_acc / loss_n).item(), 4), "lr": lr})
    model.eval()
    restored = None
    if best_state is not None:
        # The corpus is small and the target overfits it within a minute: ship the weights of the best held-out
        # probe unless the final weights are at least as good on the same probe.
        with torch.no_grad(), autocast(device):
            pl = model(input_ids=probe[:, :-1], use_cache=False).logits
        final_probe = F.cross_entropy(pl.float().reshape(-1, vocab_size), probe[:, 1:].reshape(-1)).item()
        del pl
        if final_probe > best_probe:
            model.load_state_dict(best_state)
            restored = {"step": best_step, "heldout_loss": round(best_probe, 4), "final_heldout_loss": round(final_probe, 4)}
            log(f"[target] restored the best held-out probe (step {best_step}, loss {best_probe:.4f}; final weights "
                f"{final_probe:.4f})")
        del best_state
    model.to(torch.bfloat16)  # what we ship and what SGLang serves
    ppl, n_tok = heldout_ppl(model, held, args.target_seq, args.eval_windows, max(1, args.target_batch // 2), device)
    log(f"[target] done: {step} steps, {tokens_seen:,} tokens in {seconds:.1f}s; held-out ppl {ppl:.3f} "
        f"(bf16 weights, {n_tok:,} tokens)")
    rec["target"] = {
        "arch": args.target_arch, "class": type(model).__name__, "params": n_params, "steps": step,
        "tokens_seen": tokens_seen, "seconds": round(seconds, 1),
        "tokens_per_second": round(tokens_seen / max(seconds, 1e-6)), "batch": args.target_batch,
        "seq_len": args.target_seq, "peak_lr": args.target_lr, "final_loss": curve[-1]["loss"] if curve else None,
        "heldout_ppl": round(ppl, 4), "heldout_ppl_tokens": n_tok, "loss_curve": curve,
        "heldout_probes": probes, "stopped_early": stopped_early, "restored_best": restored,
    }
    return model


def save_target(model, out: Path, tokenizer_dir: Path) -> None:
    tdir = out / "target"
    if tdir.exists():
        shutil.rmtree(tdir)
    model.config.use_cache = True
    model.save_pretrained(str(tdir))
    extra = tiny_targets.serving_config_keys(model.config)
    if extra:  # keys SGLang reads that transformers does not write
        config_path = tdir / "config.json"
        config_path.write_text(json.dumps(dict(json.loads(config_path.read_text()), **extra), indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, tdir / name)


# ---------------------------------------------------------------------------------------------------------
# greedy data
# ---------------------------------------------------------------------------------------------------------
@torch.no_grad()
def greedy_generate(model, prompts: torch.Tensor, n_new: int) -> torch.Tensor:
    """Batched greedy continuation with the HF KV cache; returns [B, P + n_new] (prompt + new tokens)."""
    out = model(input_ids=prompts, use_cache=True, logits_to_keep=1)
    past = out.past_key_values
    nxt = out.logits[:, -1].argmax(-1)
    new = [nxt]
    for _ in range(n_new - 1):
        out = model(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
        past = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1)
        new.append(nxt)
    return torch.cat([prompts, torch.stack(new, dim=1)], dim=1)


class StepTimeModel:
    """Seconds per decode step as a function of the batch size, from the batches generated so far.

    With one batch size measured, larger batches are assumed to cost proportionally more (pessimistic: a model
    this small is usually launch-bound, so the real cost grows much more slowly); with two or more sizes, an
    affine fit a + c * batch of the latest measurement per size (c >= 0)."""

    def __init__(self):
        self.by_size: dict[int, float] = {}

    def add(self, batch: int, seconds: float, steps: int) -> None:
        self.by_size[batch] = seconds / max(1, steps)

    def __call__(self, batch: int) -> float:
        sizes = sorted(self.by_size)
        if len(sizes) == 1:
            b0 = sizes[0]
            return self.by_size[b0] * max(1.0, batch / b0)
        x = np.array(sizes, dtype=np.float64)
        y = np.array([self.by_size[k] for k in sizes])
        c = max(0.0, float(np.polyfit(x, y, 1)[0]))
        a = float(np.mean(y - c * x))
        # Never predict less than the cheapest measured step (the fit's intercept can be optimistic).
        return max(a + c * batch, float(y.min()))


def next_gen_batch(model: StepTimeModel, steps: int, remaining: float, current: int, max_batch: int,
                   min_batch: int) -> int:
    """Largest batch (a power-of-two multiple of min_batch, at most 2x the largest size tried so far, at most
    max_batch) whose predicted time fits in `remaining` seconds; 0 if not even min_batch fits."""
    best, b = 0, min_batch
    limit = min(max_batch, 2 * max([current] + list(model.by_size)))
    while b <= limit:
        if model(b) * steps <= remaining:
            best = b
        b *= 2
    return best


def generate_data(args, model, train: torch.Tensor, device, budget: float, rec):
    """Greedy continuations of random train-split windows until the time budget is spent.

    Batch size is time-budgeted: the first batch has --gen-batch rows, later ones grow (x2 at a time, up to
    --gen-max-batch) while the measured cost per decode step says the next batch still fits in the budget, and
    shrink when it does not. A CUDA out-of-memory error halves --gen-max-batch and retries."""
    gen = device_generator(device, args.seed + 2)
    prompt_lens = [p for p in args.gen_prompt_lens if p + args.block_size + 1 < args.gen_total_len]
    if not prompt_lens:
        raise ValueError(f"--gen-prompt-lens must leave room for a block in --gen-total-len {args.gen_total_len}.")
    seqs, starts, log_batches = [], [], []
    t_start, batches, timing = time.time(), 0, StepTimeModel()
    batch, max_batch = args.gen_batch, max(args.gen_batch, args.gen_max_batch)
    min_batch = max(1, min(args.gen_batch, args.gen_min_batch))
    log(f"[data] greedy continuations of random train-split windows: first batch {batch}, at most {max_batch} "
        f"rows; total length {args.gen_total_len}, prompt lengths {prompt_lens}; budget {budget:.0f}s")
    while True:
        if args.gen_max_batches and batches >= args.gen_max_batches:
            break
        P = prompt_lens[batches % len(prompt_lens)]
        steps = args.gen_total_len - P
        remaining = budget - (time.time() - t_start)
        if batches >= 1:
            # The scheduled prompt length first; near the end of the budget a longer prompt (fewer decode
            # steps) may still fit where the scheduled one does not.
            for P in [P] + sorted(prompt_lens, reverse=True):
                steps = args.gen_total_len - P
                batch = next_gen_batch(timing, steps, remaining, batch, max_batch, min_batch)
                if batch:
                    break
            if batch == 0:
                break
        t0 = time.time()
        seq = None
        try:
            seq = greedy_generate(model, sample_windows(train, batch, P, gen), steps).to(torch.int32).cpu()
        except torch.OutOfMemoryError:
            if batch <= min_batch:
                raise
        if seq is None:  # out of memory: free the half-built cache (outside the except block) and go smaller
            if device.type == "cuda":
                torch.cuda.empty_cache()
            max_batch = batch // 2
            log(f"[data] out of memory at batch {batch}: at most {max_batch} rows from now on")
            batch = max_batch
            timing.by_size = {k: v for k, v in timing.by_size.items() if k <= max_batch}
            continue
        seconds = time.time() - t0
        timing.add(batch, seconds, steps)
        seqs.append(seq)
        starts.append(torch.full((batch,), P, dtype=torch.int32))
        batches += 1
        el = time.time() - t_start
        n_seq = sum(x.shape[0] for x in seqs)
        log_batches.append({"batch": batch, "prompt_len": P, "new_tokens": steps, "seconds": round(seconds, 2),
                            "ms_per_step": round(1e3 * seconds / steps, 2)})
        log(f"[data] batch {batches}: {batch} rows, prompt {P}, {steps} new tokens in {seconds:.1f}s "
            f"({1e3 * seconds / steps:.1f} ms/step, {batch * steps / max(seconds, 1e-6):,.0f} tok/s); "
            f"{n_seq:,} sequences; {fmt_s(el)} / {fmt_s(budget)}")
    seqs_t, starts_t = torch.cat(seqs), torch.cat(starts)
    min_anchor_choices = args.gen_total_len - args.block_size - max(prompt_lens) + 2
    if args.anchors > min_anchor_choices:
        raise ValueError(f"--anchors {args.anchors} exceeds the {min_anchor_choices} anchor positions of the "
                         "shortest generated region; lower --anchors or the prompt lengths.")
    generated = int((args.gen_total_len - starts_t).sum())
    rec["data"] = {
        "sequences": int(seqs_t.shape[0]), "total_len": args.gen_total_len, "generated_tokens": generated,
        "batches": batches, "batch_log": log_batches, "prompt_lens": prompt_lens,
        "distinct_prompts": int(seqs_t.shape[0]), "seconds": round(time.time() - t_start, 1),
        "eos_fraction": round(float((seqs_t == 0).float().mean()), 5),
    }
    log(f"[data] done: {seqs_t.shape[0]:,} sequences, {generated:,} generated tokens in {rec['data']['seconds']}s")
    return seqs_t, starts_t


# ---------------------------------------------------------------------------------------------------------
# drafter
# ---------------------------------------------------------------------------------------------------------
def make_drafter_config(args, target_config, mask_id: int) -> DrafterConfig:
    """The drafter's shape: --drafter-* options where given (the hybrid's defaults set them), else the target's."""
    n_t = target_config.num_hidden_layers
    layer_ids = args.target_layer_ids or tiny_targets.default_feature_layers(args.target_arch, n_t)
    return DrafterConfig(
        hidden_size=target_config.hidden_size, num_layers=args.drafter_layers,
        num_heads=args.drafter_heads or target_config.num_attention_heads,
        num_kv_heads=args.drafter_kv_heads or target_config.num_key_value_heads,
        head_dim=args.drafter_head_dim or target_config.head_dim,
        intermediate_size=args.drafter_intermediate or target_config.intermediate_size,
        rms_norm_eps=target_config.rms_norm_eps, rope_theta=10000.0, block_size=args.block_size,
        target_layer_ids=layer_ids, mask_token_id=mask_id, vocab_size=target_config.vocab_size,
        num_target_layers=n_t, max_position_embeddings=target_config.max_position_embeddings,
        mask_token=MASK_TOKEN,
    )


def pair_configs(args, vocab_size: int, eos_id: int, mask_id: int) -> tuple[dict, dict]:
    """The target's and the drafter's config.json content as this run saves them (shapes and ids; no weights)."""
    config = tiny_targets.target_config(args, vocab_size, eos_id)
    config.use_cache = True
    target = dict(json.loads(config.to_json_string()), dtype="bfloat16", **tiny_targets.serving_config_keys(config))
    return target, make_drafter_config(args, config, mask_id).to_json()


def write_pair_configs(args) -> int:
    """--configs-only: <out>/target/config.json and <out>/drafter/config.json from pair_configs, with the corpus
    manifest's vocabulary and special ids (build_corpus.py's defaults when --data has no manifest: vocab 4096,
    <|endoftext|> 0, <|mask|> 1)."""
    manifest_path = Path(args.data) / "manifest.json"
    m = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    target, drafter = pair_configs(args, m.get("vocab_size", 4096), m.get("eos_token_id", 0),
                                   m.get("mask_token_id", 1))
    check_widening(args, tiny_targets.target_config(args, target["vocab_size"], target["eos_token_id"]),
                   drafter["dflash_config"]["mask_token_id"])
    for sub, cfg in (("target", target), ("drafter", drafter)):
        (Path(args.out) / sub).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / sub / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    log(f"[configs] {args.target_arch} target and drafter config.json in {args.out} (no weights)")
    return 0


def check_widening(args, target_config, mask_id: int) -> dict | None:
    """--widen-shape: widen_hybrid's plan for the pair this run will train, refused before anything trains."""
    if not args.widen_shape:
        return None
    result = tiny_targets.check_widening(args.widen_shape, target_config,
                                         make_drafter_config(args, target_config, mask_id).to_json())
    log(f"[setup] widens bf16-exactly to {args.widen_shape}: target layers -> {result['target_live_layers']}, "
        f"drafter feature layers {result['small_feature_ids']} -> feature blocks {result['feature_blocks']}")
    return result


def init_drafter(drafter: DFlashDrafter, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in drafter.named_parameters():
        with torch.no_grad():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            else:
                p.fill_(1.0)  # RMSNorm gains


@torch.no_grad()
def target_features(model, seqs: torch.Tensor, layer_ids) -> torch.Tensor:
    out = model.model(input_ids=seqs, output_hidden_states=True, use_cache=False)
    return target_context_features(out.hidden_states, layer_ids)


def sample_anchors(starts: torch.Tensor, total_len: int, block: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """n distinct anchors per row in [start - 1, total_len - block], sorted. starts [B] (generated region start).
    Anchor start - 1 puts the last prompt token in the bonus slot; start is SGLang's first decode round."""
    B = starts.shape[0]
    pos = torch.arange(total_len, device=starts.device)
    ok = (pos[None, :] >= (starts[:, None] - 1)) & (pos[None, :] <= total_len - block)
    scores = torch.rand(B, total_len, generator=gen, device=starts.device).masked_fill(~ok, -1.0)
    return scores.topk(n, dim=1).indices.sort(dim=1).values


def block_inputs(seqs: torch.Tensor, anchors: torch.Tensor, block: int, mask_id: int):
    """Block token ids / positions [B, A*block] and labels [B, A, block-1] for the given anchors."""
    B, A = anchors.shape
    offs = torch.arange(block, device=seqs.device)
    pos = anchors[:, :, None] + offs                       # [B, A, block]
    ids = torch.full_like(pos, mask_id)
    ids[:, :, 0] = torch.gather(seqs, 1, anchors)
    labels = torch.gather(seqs, 1, pos[:, :, 1:].reshape(B, -1)).view(B, A, block - 1)
    return ids.view(B, -1), pos.view(B, -1), labels


def drafter_block_logits_train(drafter, model, feats, seqs, anchors, block, mask_id):
    """Run the drafter for many anchors per sequence at once; returns logits [B, A, block-1, V], labels."""
    B, T = seqs.shape
    A = anchors.shape[1]
    ids, pos, labels = block_inputs(seqs, anchors, block, mask_id)
    embeds = model.get_input_embeddings()(ids)
    ctx = drafter.project_context(feats)
    ctx_pos = torch.arange(T, device=seqs.device).expand(B, T)
    mask = block_training_mask(anchors, T, block)
    hidden = drafter(embeds, pos, ctx, ctx_pos, mask).view(B, A, block, -1)[:, :, 1:]
    logits = model.lm_head(hidden.to(model.lm_head.weight.dtype))
    return logits, labels


@torch.no_grad()
def chain_metrics(drafter, model, feats, seqs, first_anchor: int, device, chunk: int = 32) -> dict:
    """Chain acceptance of the drafter against greedy sequences seqs [n, T] (feats = their target features):
    for every anchor p >= first_anchor, accepted = number of leading block positions whose drafter argmax equals
    the sequence's next tokens. Reports the per-anchor mean (1 + accepted), the mean along a simulated chain-
    decoding walk (anchor p -> p + accepted + 1, i.e. DFLASH tau), top-1 match and acceptance by depth."""
    cfg = drafter.config
    block = cfg.block_size
    n, T = seqs.shape
    anchors_all = torch.arange(first_anchor, T - block + 1, device=device)
    if anchors_all.numel() == 0:
        raise ValueError(f"sequences of length {T} leave no anchor after {first_anchor} for block {block}.")
    accepted, matches_all = [], []
    for i in range(0, anchors_all.numel(), chunk):
        anchors = anchors_all[i:i + chunk].expand(n, -1).contiguous()
        with autocast(device):
            logits, labels = drafter_block_logits_train(drafter, model, feats, seqs, anchors, block, cfg.mask_token_id)
        match = logits.argmax(-1) == labels                       # [n, A, block-1]
        accepted.append(match.int().cumprod(-1).sum(-1))
        matches_all.append(match.float())
    acc = torch.cat(accepted, dim=1).cpu()                          # [n, n_anchors]
    match = torch.cat(matches_all, dim=1)
    walk = []
    for r in range(n):
        p = 0
        while p < acc.shape[1]:
            a = int(acc[r, p])
            walk.append(a + 1)
            p += a + 1
    per_depth = (acc[..., None] >= torch.arange(1, block)).float().mean(dim=(0, 1))
    return {
        "sequences": n, "anchors": int(acc.numel()),
        "mean_accept_len_per_anchor": round(float(acc.float().mean()) + 1.0, 4),
        "mean_accept_len_chain_walk": round(float(np.mean(walk)), 4),
        "chain_walk_rounds": len(walk),
        "top1_match_by_depth": [round(float(x), 4) for x in match.mean(dim=(0, 1)).tolist()],
        "accept_rate_by_depth": [round(float(x), 4) for x in per_depth.tolist()],
    }


class DrafterMonitor:
    """Held-out acceptance during drafter training, so memorization shows in the log: greedy continuations of
    HELD-OUT prompts (other windows than the final evaluation's) vs a few of the drafter's own training
    sequences. Target features are computed once."""

    def __init__(self, args, model, held, seqs, starts, cfg: DrafterConfig, device):
        self.model, self.device = model, device
        prompts = spread_windows(held, args.monitor_prompts, args.eval_prompt_len, offset=0.37).to(device)
        self.held_seqs = greedy_generate(model, prompts, args.monitor_new)
        self.held_feats = target_features(model, self.held_seqs, cfg.target_layer_ids)
        self.held_first = args.eval_prompt_len
        # Training rows of the first data batch (one prompt length), up to the same number of tokens.
        first = starts[0].item()
        same = torch.nonzero(starts == first).flatten()[: args.monitor_prompts]
        self.train_seqs = seqs[same].to(device).long()
        self.train_feats = target_features(model, self.train_seqs, cfg.target_layer_ids)
        self.train_first = int(first)

    def __call__(self, drafter) -> dict:
        was_training = drafter.training
        drafter.eval()
        held = chain_metrics(drafter, self.model, self.held_feats, self.held_seqs, self.held_first, self.device)
        train = chain_metrics(drafter, self.model, self.train_feats, self.train_seqs, self.train_first, self.device)
        drafter.train(was_training)
        return {"heldout": held, "train_rows": train}


def train_drafter(args, model, seqs, starts, cfg: DrafterConfig, device, budget: float, rec, held=None,
                  on_best=None):
    """DFlash objective on the greedy data. Rows are visited in shuffled epochs (logged, so repeated data shows);
    every --drafter-eval-every seconds a held-out acceptance check runs, the best drafter by held-out
    acceptance per anchor is kept (on_best(drafter) saves it) and restored at the end."""
    t_setup = time.time()
    drafter = DFlashDrafter(cfg)
    init_drafter(drafter, args.seed + 3)
    with torch.no_grad():
        # Both final norms feed the same lm_head: start the drafter's at the target's scale.
        drafter.norm.weight.copy_(tiny_targets.final_norm_gain(model).cpu())
    drafter.to(device).train()
    for p in model.parameters():
        p.requires_grad_(False)
    n_params = sum(p.numel() for p in drafter.parameters())
    mask_norm = float(model.get_input_embeddings().weight[cfg.mask_token_id].float().norm())
    block, mask_id = cfg.block_size, cfg.mask_token_id
    n_seq, total_len = seqs.shape
    anchor_slots = int((total_len - block - (starts.long() - 1) + 1).clamp(min=0).sum())
    monitor = None
    if held is not None and args.drafter_eval_every > 0:
        monitor = DrafterMonitor(args, model, held, seqs, starts, cfg, device)
    budget = max(1.0, budget - (time.time() - t_setup))
    log(f"[drafter] {n_params / 1e6:.2f}M params, {cfg.num_layers} layers, block {cfg.block_size}, target layers "
        f"{cfg.target_layer_ids}; batch {args.drafter_batch} seqs x {args.anchors} anchors; data {n_seq:,} sequences, "
        f"{anchor_slots:,} anchor positions; budget {budget:.0f}s; |embed(<|mask|>)| = {mask_norm:.3f}")
    opt = make_optimizer(drafter, args.drafter_lr, 0.01, device)
    gen = device_generator(device, args.seed + 4)
    w = torch.exp(-torch.arange(block - 1, dtype=torch.float32) / args.loss_gamma).to(device)
    w = w / w.sum()
    seqs_dev, starts_dev = seqs.to(device), starts.to(device).long()
    order, cursor, rows_seen = torch.randperm(n_seq, generator=gen, device=device), 0, 0
    t_start, step, curve, last_print = time.time(), 0, [], time.time()
    evals, best, best_state, last_eval = [], -1.0, None, time.time()
    loss_acc, acc_acc, n_acc = torch.zeros((), device=device), torch.zeros(block - 1, device=device), 0

    def run_eval(el: float) -> None:
        nonlocal best, best_state, last_eval
        m = monitor(drafter)
        h, t = m["heldout"], m["train_rows"]
        entry = {"step": step, "seconds": round(el, 1), "seq_epochs": round(rows_seen / n_seq, 3),
                 "heldout_accept_per_anchor": h["mean_accept_len_per_anchor"],
                 "heldout_chain_walk": h["mean_accept_len_chain_walk"],
                 "heldout_top1_by_depth": h["top1_match_by_depth"],
                 "train_rows_accept_per_anchor": t["mean_accept_len_per_anchor"],
                 "train_rows_chain_walk": t["mean_accept_len_chain_walk"],
                 "train_rows_top1_by_depth": t["top1_match_by_depth"]}
        evals.append(entry)
        mark = ""
        if h["mean_accept_len_per_anchor"] > best:
            best = h["mean_accept_len_per_anchor"]
            best_state = {k: v.detach().clone() for k, v in drafter.state_dict().items()}
            mark = " (best)"
            if on_best is not None:
                on_best(drafter)
        log(f"[drafter] held-out check at step {step} ({rows_seen / n_seq:.2f} epochs): accept/anchor "
            f"{h['mean_accept_len_per_anchor']:.3f}, chain walk {h['mean_accept_len_chain_walk']:.3f}, top-1 @1 "
            f"{h['top1_match_by_depth'][0]:.3f} @4 {h['top1_match_by_depth'][min(3, block - 2)]:.3f}; on its "
            f"training rows: accept/anchor {t['mean_accept_len_per_anchor']:.3f}, top-1 @1 "
            f"{t['top1_match_by_depth'][0]:.3f}{mark}")
        last_eval = time.time()

    while True:
        elapsed = time.time() - t_start
        if elapsed >= budget or (args.drafter_max_steps and step >= args.drafter_max_steps):
            break
        if monitor is not None and time.time() - last_eval >= args.drafter_eval_every:
            run_eval(elapsed)
        progress = max(elapsed / budget, step / args.drafter_max_steps if args.drafter_max_steps else 0.0)
        lr = lr_at(step, progress, args.drafter_lr, args.drafter_warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        # Shuffled epochs over the sequences: each row is used once per epoch (with fresh anchors each time).
        if cursor + args.drafter_batch > n_seq:
            order, cursor = torch.randperm(n_seq, generator=gen, device=device), 0
        rows = order[cursor:cursor + args.drafter_batch]
        cursor += rows.numel()
        rows_seen += rows.numel()
        anchors = sample_anchors(starts_dev[rows], total_len, block, args.anchors, gen)
        batch = seqs_dev[rows].long()
        feats = target_features(model, batch, cfg.target_layer_ids)
        with autocast(device):
            logits, labels = drafter_block_logits_train(drafter, model, feats, batch, anchors, block, mask_id)
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        ce = ce.view(labels.shape)                                  # [B, A, block-1]
        loss = (ce.mean(dim=(0, 1)) * w).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        step += 1
        loss_acc += loss.detach()
        acc_acc += (logits.detach().argmax(-1) == labels).float().mean(dim=(0, 1))
        n_acc += 1
        if time.time() - last_print >= args.log_every or step == 1:
            el = time.time() - t_start
            acc = (acc_acc / n_acc).tolist()
            avg = (loss_acc / n_acc).item()
            epochs = rows_seen / n_seq
            curve.append({"step": step, "seconds": round(el, 1), "loss": round(avg, 4), "lr": lr,
                          "seq_epochs": round(epochs, 3), "acc_depth": [round(a, 4) for a in acc]})
            log(f"[drafter] step {step:6d}  loss {avg:.4f}  train acc@1 {acc[0]:.3f} @2 {acc[1]:.3f} "
                f"@4 {acc[min(3, len(acc) - 1)]:.3f} @{len(acc)} {acc[-1]:.3f}  epochs {epochs:.2f}  lr {lr:.2e}  "
                f"{step * args.drafter_batch * args.anchors / max(el, 1e-6):,.0f} blocks/s  "
                f"{fmt_s(el)} / {fmt_s(budget)}  (ETA {fmt_s(max(0.0, budget - el))})")
            loss_acc.zero_()
            acc_acc.zero_()
            n_acc, last_print = 0, time.time()
    sync(device)
    seconds = time.time() - t_start
    if n_acc:
        curve.append({"step": step, "seconds": round(seconds, 1), "loss": round((loss_acc / n_acc).item(), 4), "lr": lr,
                      "seq_epochs": round(rows_seen / n_seq, 3),
                      "acc_depth": [round(a, 4) for a in (acc_acc / n_acc).tolist()]})
    restored = None
    if monitor is not None:
        run_eval(time.time() - t_start)
        if evals[-1]["heldout_accept_per_anchor"] < best and best_state is not None:
            drafter.load_state_dict(best_state)
            restored = next(e for e in evals if e["heldout_accept_per_anchor"] == best)["step"]
            log(f"[drafter] restored the best held-out check (step {restored}, accept/anchor {best:.3f})")
    log(f"[drafter] done: {step} steps in {seconds:.1f}s, {rows_seen / n_seq:.2f} epochs over {n_seq:,} sequences, "
        f"{step * args.drafter_batch * args.anchors / max(1, anchor_slots):.2f} blocks per anchor position")
    rec["drafter"] = {
        "params": n_params, "steps": step, "seconds": round(seconds, 1), "batch": args.drafter_batch,
        "anchors_per_seq": args.anchors, "blocks_seen": step * args.drafter_batch * args.anchors,
        "anchor_positions": anchor_slots, "seq_epochs": round(rows_seen / n_seq, 3),
        "blocks_per_anchor_position": round(step * args.drafter_batch * args.anchors / max(1, anchor_slots), 3),
        "peak_lr": args.drafter_lr, "loss_gamma": args.loss_gamma, "mask_embedding_norm": round(mask_norm, 4),
        "final_loss": curve[-1]["loss"] if curve else None, "loss_curve": curve,
        "heldout_checks": evals, "restored_best_step": restored,
    }
    drafter.eval()
    return drafter


# ---------------------------------------------------------------------------------------------------------
# evaluation
# ---------------------------------------------------------------------------------------------------------
@torch.no_grad()
def acceptance_estimate(args, model, drafter, held: torch.Tensor, device, prompt_len: int, n_new: int) -> dict:
    """Chain acceptance on held-out prompts (see chain_metrics)."""
    prompts = spread_windows(held, args.eval_prompts, prompt_len).to(device)
    seqs = greedy_generate(model, prompts, n_new)
    feats = target_features(model, seqs, drafter.config.target_layer_ids)
    res = chain_metrics(drafter, model, feats, seqs, prompt_len, device)
    return {"prompts": prompts.shape[0], "prompt_len": prompt_len, "new_tokens": n_new, **res}


@torch.no_grad()
def greedy_reference(target_dir: Path, tokenizer_dir: Path) -> dict:
    """Greedy tokens + top-1/top-2 logit margins of the SAVED target (reloaded in fp32 on CPU, no KV cache):
    the tests replay this and must agree wherever the margin is not tiny."""
    from sglang_ddtree.tiny import load_target, load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    model = load_target(target_dir, device="cpu", dtype=torch.float32)
    ids = tok(REFERENCE_PROMPT, add_special_tokens=False)["input_ids"]
    x = torch.tensor([ids])
    tokens, margins = [], []
    for _ in range(REFERENCE_NEW_TOKENS):
        logits = model(input_ids=x, use_cache=False).logits[0, -1]
        top2 = logits.topk(2)
        tokens.append(int(top2.indices[0]))
        margins.append(round(float(top2.values[0] - top2.values[1]), 6))
        x = torch.cat([x, top2.indices[:1][None]], dim=1)
    return {"prompt": REFERENCE_PROMPT, "prompt_ids": ids, "tokens": tokens, "margins": margins,
            "text": tok.decode(tokens)}


@torch.no_grad()
def stdlib_sample_ppl(target_dir: Path, tokenizer_dir: Path) -> dict:
    """Perplexity of the SAVED target (fp32, CPU) on `tiny.heldout_sample` of this machine's stdlib; the tests
    recompute it wherever the same files (same sha256) are found."""
    from sglang_ddtree.tiny import heldout_sample, load_target, load_tokenizer, sample_perplexity

    sample = heldout_sample(load_tokenizer(tokenizer_dir))
    res = sample_perplexity(load_target(target_dir, device="cpu", dtype=torch.float32), sample)
    return {"python_version": platform.python_version(), "ppl": round(res["ppl"], 4), "tokens": res["tokens"],
            "files": [{"path": s["path"], "sha256": s["sha256"], "ppl": round(res["per_file"][s["path"]], 4)}
                      for s in sample]}


# ---------------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------------
# --smoke: a few steps of everything (the shapes are the arch's smoke shapes: tiny_targets.ARCH_DEFAULTS)
SMOKE = dict(target_batch=8, target_seq=64, target_seconds=30.0, target_max_steps=12, target_warmup=4,
             gen_batch=4, gen_max_batch=8, gen_min_batch=4, gen_total_len=64, gen_prompt_lens=[8, 16],
             gen_seconds=20.0, gen_max_batches=2, drafter_layers=1, block_size=16, drafter_batch=4, anchors=4,
             drafter_seconds=30.0, drafter_max_steps=12, drafter_warmup=4, drafter_eval_every=1.0,
             monitor_prompts=2, monitor_new=40, eval_prompts=2, eval_new=40, eval_prompt_len=8,
             eval_windows=4, probe_windows=2, target_eval_every=0.0, log_every=5.0, total_seconds=300.0)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=str(REPO_ROOT / ".cache" / "corpus"))
    ap.add_argument("--out", default=None, help="default models/tiny (qwen3) or models/tiny-hybrid (qwen3_5_text)")
    ap.add_argument("--target-arch", choices=tiny_targets.ARCHS, default=tiny_targets.DEFAULT_ARCH,
                    help="qwen3: dense Qwen3ForCausalLM; qwen3_5_text: dense-MLP gated-delta-net hybrid "
                         "Qwen3_5ForCausalLM (scripts/tiny_targets.py)")
    ap.add_argument("--widen-shape", default=None,
                    help="hybrid only: refuse, before training, a pair that sglang_ddtree.widen_hybrid cannot widen "
                         "bf16-exactly to this shape (default qwen3.5-27b; 'none' skips the check)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and a few steps (CPU, tests)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the target's training forward (CUDA)")
    ap.add_argument("--configs-only", action="store_true",
                    help="write <out>/target/config.json and <out>/drafter/config.json as this run would save them, "
                         "train nothing (a benchmark's plan before the training)")
    ap.add_argument("--reuse-target", action="store_true",
                    help="skip phase 1: load <out>/target (and its log entry) and redo phases 2-4 only")
    ap.add_argument("--log-every", type=float, default=10.0, help="seconds between progress lines")
    ap.add_argument("--total-seconds", type=float, default=350.0,
                    help="hard cap for the whole run: later phases shrink if earlier ones overran")
    g = ap.add_argument_group("target (shape defaults by --target-arch and --smoke: scripts/tiny_targets.py)")
    g.add_argument("--hidden", type=int, default=None)
    g.add_argument("--layers", type=int, default=None)
    g.add_argument("--heads", type=int, default=None)
    g.add_argument("--kv-heads", type=int, default=None)
    g.add_argument("--head-dim", type=int, default=None, help="full-attention head dim")
    g.add_argument("--intermediate", type=int, default=None)
    tiny_targets.add_hybrid_options(g)
    g.add_argument("--target-batch", type=int, default=None, help="default 128 (qwen3), 32 (qwen3_5_text)")
    g.add_argument("--target-seq", type=int, default=1024)
    g.add_argument("--target-lr", type=float, default=2e-3)
    g.add_argument("--target-warmup", type=int, default=100)
    g.add_argument("--target-seconds", type=float, default=70.0,
                   help="the held-out loss stops improving after ~40-60s on an H200 (8.7M-token corpus)")
    g.add_argument("--target-max-steps", type=int, default=0, help="0 = only the time budget")
    g.add_argument("--eval-windows", type=int, default=128, help="held-out ppl windows of --target-seq tokens")
    g.add_argument("--probe-windows", type=int, default=16, help="held-out windows of the periodic probe")
    g.add_argument("--target-eval-every", type=float, default=10.0, help="seconds between held-out probes; 0 = off")
    g.add_argument("--target-patience", type=int, default=3,
                   help="stop the target early after this many probes without improvement; 0 = never")
    g.add_argument("--no-target-keep-best", dest="target_keep_best", action="store_false",
                   help="ship the final target weights even when an earlier held-out probe was better")
    g = ap.add_argument_group("greedy data")
    g.add_argument("--gen-batch", type=int, default=8192, help="rows of the first batch (later ones are time-budgeted)")
    g.add_argument("--gen-max-batch", type=int, default=16384, help="largest batch the time budget may pick")
    g.add_argument("--gen-min-batch", type=int, default=1024, help="stop generating when not even this fits")
    g.add_argument("--gen-total-len", type=int, default=384)
    g.add_argument("--gen-prompt-lens", type=lambda s: [int(x) for x in s.split(",")],
                   default=[16, 64, 128, 32, 192, 96], help="used in this order, one per batch, cycling")
    g.add_argument("--gen-seconds", type=float, default=100.0)
    g.add_argument("--gen-max-batches", type=int, default=0, help="0 = only the time budget")
    g = ap.add_argument_group("drafter")
    g.add_argument("--drafter-layers", type=int, default=2)
    g.add_argument("--drafter-heads", type=int, default=None, help="default: the arch's, else the target's")
    g.add_argument("--drafter-kv-heads", type=int, default=None)
    g.add_argument("--drafter-head-dim", type=int, default=None)
    g.add_argument("--drafter-intermediate", type=int, default=None)
    g.add_argument("--target-layer-ids", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="comma list; default 1,<layers-2> (hybrid: 1,<layers/2-1>,<layers-2>)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--drafter-batch", type=int, default=128)
    g.add_argument("--anchors", type=int, default=32, help="anchors (blocks) per sequence per step")
    g.add_argument("--drafter-lr", type=float, default=2e-3)
    g.add_argument("--drafter-warmup", type=int, default=50)
    g.add_argument("--loss-gamma", type=float, default=7.0, help="block position weight exp(-(j-1)/gamma)")
    g.add_argument("--drafter-seconds", type=float, default=150.0)
    g.add_argument("--drafter-max-steps", type=int, default=0, help="0 = only the time budget")
    g.add_argument("--drafter-eval-every", type=float, default=20.0,
                   help="seconds between held-out acceptance checks (best one is shipped); 0 = off")
    g.add_argument("--monitor-prompts", type=int, default=32, help="held-out prompts of those checks")
    g.add_argument("--monitor-new", type=int, default=96, help="greedy tokens per held-out prompt of those checks")
    g = ap.add_argument_group("evaluation")
    g.add_argument("--eval-prompts", type=int, default=64)
    g.add_argument("--eval-prompt-len", type=int, default=64)
    g.add_argument("--eval-new", type=int, default=192)
    args = ap.parse_args(argv)
    if args.smoke:
        explicit = {a.lstrip("-").replace("-", "_") for a in (argv if argv is not None else sys.argv[1:])
                    if a.startswith("--")}
        for k, v in SMOKE.items():
            if k not in explicit:
                setattr(args, k, v)
    hybrid = tiny_targets.is_hybrid(args.target_arch)
    if not hybrid:
        given = [k for k in tiny_targets.HYBRID_ONLY_KEYS if getattr(args, k) is not None]
        if given or args.widen_shape not in (None, "none"):
            raise ValueError(f"{', '.join(given) or 'widen_shape'}: only for --target-arch qwen3_5_text.")
    for k, v in tiny_targets.arch_defaults(args.target_arch, args.smoke).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.out is None:
        args.out = str(REPO_ROOT / "models" / ("tiny-hybrid" if hybrid else "tiny"))
    if hybrid and args.widen_shape is None:
        args.widen_shape = "qwen3.5-27b"
    if args.widen_shape == "none":
        args.widen_shape = None
    if args.block_size < 2:
        raise ValueError(f"--block-size must be >= 2, got {args.block_size}.")
    if args.anchors < 1 or args.drafter_batch < 1 or args.gen_batch < 1 or args.target_batch < 1:
        raise ValueError("batch sizes and --anchors must be positive.")
    if args.gen_min_batch < 1 or args.gen_max_batch < 1:
        raise ValueError("--gen-min-batch and --gen-max-batch must be positive.")
    if args.drafter_eval_every > 0 and (args.monitor_prompts < 1 or args.monitor_new < args.block_size):
        raise ValueError(f"--monitor-prompts must be >= 1 and --monitor-new >= --block-size ({args.block_size}).")
    fitting = [p for p in args.gen_prompt_lens if p + args.block_size + 1 < args.gen_total_len]
    if not fitting or args.anchors > args.gen_total_len - args.block_size - max(fitting) + 2:
        raise ValueError(f"--anchors {args.anchors} does not fit the shortest generated region of --gen-total-len "
                         f"{args.gen_total_len} with --gen-prompt-lens {args.gen_prompt_lens}; lower --anchors.")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.configs_only:
        return write_pair_configs(args)
    clock = Clock()
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    random.seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    import transformers

    try:  # progress bars of weight loading/saving would interleave with our own progress lines
        transformers.utils.logging.disable_progress_bar()
    except AttributeError:
        pass
    data_dir, out = Path(args.data), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    manifest = json.loads((data_dir / "manifest.json").read_text())
    tokenizer_dir = data_dir / "tokenizer"
    for name, digest in manifest["sha256"].items():
        if sha256_file(data_dir / name) != digest:
            raise ValueError(f"{data_dir / name} does not match manifest.json; rebuild with scripts/build_corpus.py.")
    vocab_size, eos_id, mask_id = manifest["vocab_size"], manifest["eos_token_id"], manifest["mask_token_id"]
    train_np = load_corpus_tokens(data_dir, "train")
    held_np = load_corpus_tokens(data_dir, "heldout")
    train = torch.from_numpy(train_np.astype(np.int32)).to(device)
    held = torch.from_numpy(held_np.astype(np.int32))
    log(f"[setup] device {device}" + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
        + f"; torch {torch.__version__}, transformers {transformers.__version__}; corpus {train.numel():,} train / "
          f"{held.numel():,} held-out tokens, vocab {vocab_size}; seed {args.seed}")

    log_path = out / "training_log.json"
    if args.reuse_target and (out / "target" / "config.json").is_file():  # refused before the log is rewritten
        reused_type = json.loads((out / "target" / "config.json").read_text()).get("model_type")
        if reused_type != args.target_arch:
            raise ValueError(f"{out / 'target'} is a {reused_type} model: pass --target-arch {reused_type} to "
                             "reuse it.")
    rec = {
        "status": "running", "seed": args.seed, "args": {k: v for k, v in vars(args).items()},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "corpus": {k: manifest[k] for k in ("python_version", "vocab_size", "files", "tokens", "bytes")},
        "timings": {},
    }
    summary = {"status": "running"}
    try:
        # Phase 1: target (a hybrid pair's widening is checked first: no time is spent on a shape it refuses)
        t0 = clock()
        if args.reuse_target:
            from sglang_ddtree.tiny import load_target

            model = load_target(out / "target", device=device, dtype=torch.bfloat16)
            rec["widening"] = check_widening(args, model.config, mask_id)
            previous = json.loads(log_path.read_text()) if log_path.is_file() else {}
            rec["target"] = dict(previous.get("target", {}), reused=True)
            log(f"[target] reusing {out / 'target'} (held-out ppl {rec['target'].get('heldout_ppl')})")
        else:
            config = tiny_targets.target_config(args, vocab_size, eos_id)
            rec["widening"] = check_widening(args, config, mask_id)
            args.target_seconds = min(args.target_seconds, max(1.0, args.total_seconds - 120.0))
            model = train_target(args, config, train, held, device, rec)
            save_target(model, out, tokenizer_dir)
            log(f"[target] saved to {out / 'target'}")
        rec["timings"]["target"] = round(clock() - t0, 1)
        rec["status"] = "target_saved"
        write_json(log_path, rec)

        # Phase 2: greedy data (at most ~45% of what is left after the evaluation reserve: the drafter needs
        # the rest; the data only has to be large enough not to be repeated many times)
        t0 = clock()
        eval_reserve = 30.0 if device.type == "cuda" else 5.0
        remaining = args.total_seconds - clock() - eval_reserve
        gen_budget = max(1.0, min(args.gen_seconds, remaining * 0.45))
        seqs, starts = generate_data(args, model, train, device, gen_budget, rec)
        rec["timings"]["data"] = round(clock() - t0, 1)
        rec["status"] = "data_done"
        write_json(log_path, rec)

        # Phase 3: drafter (the best held-out check is saved as soon as it happens, then the final choice)
        t0 = clock()
        cfg = make_drafter_config(args, model.config, mask_id)
        budget = max(1.0, min(args.drafter_seconds, args.total_seconds - clock() - eval_reserve))
        ddir = out / "drafter"

        def save_drafter(d) -> None:
            if ddir.exists():
                shutil.rmtree(ddir)
            d.save_pretrained(ddir)

        drafter = train_drafter(args, model, seqs, starts, cfg, device, budget, rec, held=held, on_best=save_drafter)
        save_drafter(drafter)
        rec["timings"]["drafter"] = round(clock() - t0, 1)
        rec["status"] = "drafter_saved"
        write_json(log_path, rec)
        log(f"[drafter] saved to {ddir}")

        # Phase 4: evaluation with the shipped (bf16) weights
        t0 = clock()
        eval_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        shipped = DFlashDrafter.from_pretrained(ddir, device=device, dtype=eval_dtype).eval()
        rec["acceptance"] = acceptance_estimate(args, model, shipped, held, device, args.eval_prompt_len, args.eval_new)
        log(f"[eval] held-out chain acceptance: {rec['acceptance']['mean_accept_len_per_anchor']:.3f} tokens/round "
            f"per anchor, {rec['acceptance']['mean_accept_len_chain_walk']:.3f} along a chain walk; top-1 match by "
            f"depth {rec['acceptance']['top1_match_by_depth'][:4]} ...")
        rec["greedy_reference"] = greedy_reference(out / "target", tokenizer_dir)
        log(f"[eval] greedy reference: {rec['greedy_reference']['text']!r}")
        rec["stdlib_sample"] = stdlib_sample_ppl(out / "target", tokenizer_dir)
        log(f"[eval] held-out stdlib sample (python {rec['stdlib_sample']['python_version']}): ppl "
            f"{rec['stdlib_sample']['ppl']:.3f} over {rec['stdlib_sample']['tokens']} tokens")
        rec["timings"]["eval"] = round(clock() - t0, 1)
        rec["files"] = {}
        for sub in ("target", "drafter"):
            for f in sorted((out / sub).iterdir()):
                rec["files"][f"{sub}/{f.name}"] = {"sha256": sha256_file(f), "bytes": f.stat().st_size}
        rec["total_bytes"] = sum(v["bytes"] for v in rec["files"].values())
        rec["status"] = "done"
        summary["status"] = "done"
        code = 0
    except Exception as exc:  # keep whatever was saved and say what failed
        traceback.print_exc()
        rec["status"] = f"failed after {rec['status']}"
        rec["error"] = f"{type(exc).__name__}: {exc}"
        summary["status"] = rec["status"]
        summary["error"] = rec["error"]
        code = 1
    rec["timings"]["total"] = round(clock(), 1)
    write_json(log_path, rec)
    summary.update({
        "target_arch": args.target_arch,
        "widen_bf16_exact": (rec.get("widening") or {}).get("scales", {}).get("bf16_exact"),
        "seconds": rec["timings"]["total"],
        "target_steps": rec.get("target", {}).get("steps"),
        "heldout_ppl": rec.get("target", {}).get("heldout_ppl"),
        "greedy_sequences": rec.get("data", {}).get("sequences"),
        "greedy_tokens": rec.get("data", {}).get("generated_tokens"),
        "drafter_steps": rec.get("drafter", {}).get("steps"),
        "drafter_epochs": rec.get("drafter", {}).get("seq_epochs"),
        "heldout_checks": [(c["seconds"], c["heldout_accept_per_anchor"])
                           for c in rec.get("drafter", {}).get("heldout_checks", [])],
        "accept_len_per_anchor": rec.get("acceptance", {}).get("mean_accept_len_per_anchor"),
        "accept_len_chain_walk": rec.get("acceptance", {}).get("mean_accept_len_chain_walk"),
        "total_bytes": rec.get("total_bytes"),
        "out": str(out),
    })
    print(json.dumps(summary), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
