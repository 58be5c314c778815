"""DDTREE server flags: definitions, parsing and validation (no SGLang import, CPU-testable).

  --speculative-ddtree-budget N     draft nodes per tree (root excluded), 1..1024, or `auto`: each round picks
                                    one of the candidate budgets below (sglang_ddtree.sglang.auto)
  --speculative-ddtree-auto-candidates LIST
                                    with `auto`: comma-separated budgets, `chain` (the drafter's top-1 path, i.e.
                                    DFLASH) always included, `plain` (a round without a draft: one target
                                    decode step, for batches where speculation costs more than it gains; dense
                                    targets); default chain,16,32,64,128
  --speculative-ddtree-auto-calibration on|off
                                    with `auto`: the calibration table that learns the drafter's over-confidence
                                    and reports its predictions next to the raw scores' (Prometheus); it feeds no
                                    decision. off: no scored walk is built or run. Default off
  --speculative-ddtree-prune P      drop nodes whose prefix probability is below P (default: off)
  --speculative-ddtree-debug PATH   per-round JSONL dumps (tree, target choices, accepted path, timings);
                                    synchronises every round: for debugging, not for serving
  --speculative-ddtree-oracle       the sequential oracle: every round verifies the accepted path once more as a
                                    chain and commits what that chain verify accepts (two target passes a round;
                                    for checking the tree path, and a fallback); fixed budgets only
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from sglang_ddtree.tree import MAX_BUDGET

SUPPORTED_ATTENTION_BACKENDS = ("triton", "flashinfer")
# Default budget: 15 nodes, so the verify is 16 tokens a request, DFLASH's own width: GEMM tiles and attention
# programs come in multiples of 16 rows, and one more token (B=16) cost 9-10% of a round at batch 16 and 64 on the
# real-size pair (benchmarks/results/sweep_8b-real-widths_h200_2026-12-07_cfd3ed3.jsonl). With a trained drafter's
# acceptance (the DDTree paper's Qwen3-8B profile, ddtree_bench/projection.py) B=15 projects x1.02 / 1.02 / 0.99 /
# 1.00 of DFLASH at batch 1 / 4 / 16 / 64: the best fixed budget at 16 and 64, behind B=63 at batch 1 (x1.09) and
# B=32 at batch 4 (x1.11), both of which lose 23-58% to DFLASH at batch 16 and 64. A safe default; `auto` or a sweep
# of one's own pair does better at small batches.
DEFAULT_BUDGET = 15
# Without an explicit --max-running-requests, keep batch x (budget + 1) verify tokens per step near this, so the
# static CUDA-graph buffers (logits, masks) sized by max_bs x (B + 1) stay reasonable at large budgets.
VERIFY_TOKENS_PER_STEP = 8192
DFLASH_DEFAULT_MAX_RUNNING_REQUESTS = 48

DEFAULT_AUTO_CANDIDATES = "chain,16,32,64,128"
# With `auto` the largest candidate tree must hold the chain's verify width (the drafter block, 16): the KV
# reserved per round and the verify graphs SGLang captures itself are the largest candidate's.
MIN_AUTO_MAX_BUDGET = 15

# Where the flag values live on a ServerArgs record: plain attributes named as FLAG_DEST's values (a dataclass record,
# through its hooked __init__), or one dict under FLAGS_ATTR (a record whose __init__ cannot be hooked: an underscore
# name is bookkeeping SGLang lets a record carry and pickles with it). The drafter's block size resolved at start-up
# is kept next to them: BLOCK_DEST as an attribute, BLOCK_KEY in the dict (sglang.engine.store_drafter_block).
FLAGS_ATTR = "_ddtree_flags"
BLOCK_DEST = "speculative_ddtree_block_size"
BLOCK_KEY = "block_size"

FLAG_DEST = {
    "--speculative-ddtree-budget": "speculative_ddtree_budget",
    "--speculative-ddtree-prune": "speculative_ddtree_prune",
    "--speculative-ddtree-debug": "speculative_ddtree_debug",
    "--speculative-ddtree-auto-candidates": "speculative_ddtree_auto_candidates",
    "--speculative-ddtree-oracle": "speculative_ddtree_oracle",
    "--speculative-ddtree-auto-calibration": "speculative_ddtree_auto_calibration",
}


@dataclass(frozen=True)
class DDTreeOptions:
    budget: int = DEFAULT_BUDGET  # with `auto`: the largest candidate (tree built, KV reserved, max verify width)
    prune: float | None = None
    debug_path: str | None = None
    candidates: tuple[int, ...] | None = None  # `auto` only: sorted, 0 = the chain first
    oracle: bool = False  # re-verify each round's accepted path as a chain and commit that (sglang.modes.Oracle)
    auto_calibration: bool = False  # `auto` only: the calibration table scores and learns (auto.AutoConfig)

    @property
    def auto(self) -> bool:
        return self.candidates is not None


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("DDTREE speculative decoding (sglang-ddtree)")
    group.add_argument("--speculative-ddtree-budget", dest=FLAG_DEST["--speculative-ddtree-budget"], type=str,
                       default=None, help=f"Draft tree budget: draft nodes per request per round, 1..{MAX_BUDGET} "
                                          f"(default {DEFAULT_BUDGET}), or auto (a budget per round from "
                                          f"--speculative-ddtree-auto-candidates).")
    group.add_argument("--speculative-ddtree-prune", dest=FLAG_DEST["--speculative-ddtree-prune"], type=str,
                       default=None, help="Drop draft nodes whose prefix probability under the drafter is below "
                                          "this threshold, in [0, 1) (default: off).")
    group.add_argument("--speculative-ddtree-debug", dest=FLAG_DEST["--speculative-ddtree-debug"], type=str,
                       default=None, help="Write one JSON line per verify round to this path (slow: syncs).")
    group.add_argument("--speculative-ddtree-auto-candidates", dest=FLAG_DEST["--speculative-ddtree-auto-candidates"],
                       type=str, default=None,
                       help="With --speculative-ddtree-budget auto: the budgets a round chooses from, e.g. "
                            f"chain,16,64 ('chain' = DFLASH's top-1 path, always included; 'plain' = a round without a "
                            f"draft, dense targets; default {DEFAULT_AUTO_CANDIDATES}).")
    group.add_argument("--speculative-ddtree-oracle", dest=FLAG_DEST["--speculative-ddtree-oracle"],
                       action="store_true", default=None,
                       help="Sequential oracle: verify each round's accepted path once more as a chain and commit "
                            "what that chain verify accepts (two target passes a round: for checking the tree "
                            "verify, e.g. on hybrid targets, or as a fallback). Fixed budgets only.")
    group.add_argument("--speculative-ddtree-auto-calibration", dest=FLAG_DEST["--speculative-ddtree-auto-calibration"],
                       type=str, default=None,
                       help="With --speculative-ddtree-budget auto: on or off (default). The calibration table "
                            "learns how far the drafter's scores are off and reports its predictions next to the "
                            "raw ones (Prometheus); it feeds no decision. off: no scoring work in any round.")


def parse_budget(value) -> int:
    if value is None:
        return DEFAULT_BUDGET
    if isinstance(value, bool):
        raise ValueError(f"--speculative-ddtree-budget must be an integer in 1..{MAX_BUDGET} or auto, got {value!r}.")
    try:
        budget = int(str(value).strip())
    except ValueError:
        raise ValueError(
            f"--speculative-ddtree-budget must be an integer in 1..{MAX_BUDGET} or auto, got {value!r}."
        ) from None
    if not 1 <= budget <= MAX_BUDGET:
        raise ValueError(f"--speculative-ddtree-budget must be in 1..{MAX_BUDGET}, got {budget}.")
    return budget


def parse_prune(value) -> float | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "off")):
        return None
    try:
        prune = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"--speculative-ddtree-prune must be a probability in [0, 1), got {value!r}.") from None
    if not math.isfinite(prune) or not 0.0 <= prune < 1.0:
        raise ValueError(f"--speculative-ddtree-prune must be a probability in [0, 1), got {value!r}.")
    return prune if prune > 0 else None


def is_auto(value) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def parse_auto_candidates(value) -> tuple[int, ...]:
    from sglang_ddtree.adaptive import parse_candidates

    try:
        candidates = parse_candidates(DEFAULT_AUTO_CANDIDATES if value is None else value, allow_plain=True)
    except ValueError as e:
        raise ValueError(f"--speculative-ddtree-auto-candidates: {e}") from None
    if max(candidates) < MIN_AUTO_MAX_BUDGET:
        raise ValueError(f"--speculative-ddtree-auto-candidates needs a budget of at least {MIN_AUTO_MAX_BUDGET} "
                         f"(the largest tree must cover the chain's 16 verify tokens), got {value!r}.")
    return tuple(candidates)


def parse_switch(value, flag: str) -> bool:
    """A boolean flag given on the command line (True / None) or as an Engine keyword (bool, 0/1, a word)."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off", ""):
        return value.strip().lower() in ("1", "true", "yes", "on")
    raise ValueError(f"{flag} takes no value (or true / false as a keyword), got {value!r}.")


def parse_on_off(value, flag: str, default: bool = False) -> bool:
    """on / off (also true / false, 1 / 0, yes / no, or a bool as an Engine keyword); None: the default."""
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word in ("on", "1", "true", "yes"):
        return True
    if word in ("off", "0", "false", "no"):
        return False
    raise ValueError(f"{flag} must be on or off, got {value!r}.")


def parse_options(budget=None, prune=None, debug=None, auto_candidates=None, oracle=None,
                  auto_calibration=None) -> DDTreeOptions:
    oracle = parse_switch(oracle, "--speculative-ddtree-oracle")
    if is_auto(budget):
        if oracle:
            raise ValueError("--speculative-ddtree-oracle needs a fixed --speculative-ddtree-budget, not auto.")
        candidates = parse_auto_candidates(auto_candidates)
        return DDTreeOptions(budget=max(candidates), prune=parse_prune(prune), debug_path=debug or None,
                             candidates=candidates,
                             auto_calibration=parse_on_off(auto_calibration, "--speculative-ddtree-auto-calibration"))
    if auto_candidates is not None:
        raise ValueError("--speculative-ddtree-auto-candidates needs --speculative-ddtree-budget auto.")
    if auto_calibration is not None:
        raise ValueError("--speculative-ddtree-auto-calibration needs --speculative-ddtree-budget auto.")
    return DDTreeOptions(budget=parse_budget(budget), prune=parse_prune(prune), debug_path=debug or None,
                         oracle=oracle)


def flag_values(server_args) -> dict:
    """The raw DDTREE flag values a ServerArgs record carries (see FLAGS_ATTR), None for the ones not given."""
    carried = getattr(server_args, FLAGS_ATTR, None)
    if isinstance(carried, dict):
        return {dest: carried.get(dest) for dest in FLAG_DEST.values()}
    return {dest: getattr(server_args, dest, None) for dest in FLAG_DEST.values()}


def options_from(server_args) -> DDTreeOptions:
    """The DDTREE options stored on a ServerArgs (attributes or the FLAGS_ATTR dict, both pickled with the record to
    the scheduler processes)."""
    return parse_options(*flag_values(server_args).values())


def default_max_running_requests(budget: int) -> int:
    return max(1, min(DFLASH_DEFAULT_MAX_RUNNING_REQUESTS, VERIFY_TOKENS_PER_STEP // (budget + 1)))


DRAFT_HEADS = {"selector": "DFlash2's candidate selector", "domino": "Domino's rollout head",
               "lilicorr": "LiLiCorr's lattice head"}


def draft_head_refusal(kind: str) -> str:
    """The one-sentence refusal of a DFlash drafter whose head DDTREE's tree cannot use yet."""
    return (f"DDTREE builds its tree from a plain DFlash head's top-K and cannot use this drafter's "
            f"{DRAFT_HEADS[kind]} yet; use --speculative-algorithm DFLASH with it.")


def check_static_config(*, attention_backends: tuple[str | None, ...], page_size: int | None,
                        draft_model_path: str | None, dp_attention: bool = False, auto: bool = False,
                        tp_size: int = 1) -> None:
    """Configuration DDTREE cannot serve, refused at startup with one sentence each."""
    if not draft_model_path:
        raise ValueError("DDTREE needs a DFlash drafter: pass --speculative-draft-model-path.")
    for backend in attention_backends:
        if backend is not None and backend not in SUPPORTED_ATTENTION_BACKENDS:
            raise ValueError(
                f"DDTREE verifies a tree with a custom attention mask, which the '{backend}' backend does not "
                f"apply; use --attention-backend triton or --attention-backend flashinfer."
            )
    if page_size not in (None, 1):
        raise ValueError(f"DDTREE supports --page-size 1 only for now, got {page_size}.")
    if dp_attention:
        raise ValueError("DDTREE does not support --enable-dp-attention.")
    if auto and tp_size > 1:
        # each rank would choose from its own timings; ranks verifying different widths would hang the collectives
        raise ValueError("--speculative-ddtree-budget auto does not support tensor parallelism yet; use a fixed "
                         "budget with --tp-size > 1.")


# Hybrid targets whose recurrent layers are gated-delta-net (GDN): SGLang 0.5.17 verifies a tree through them
# (per-node conv windows and SSM states linked by retrieve_next_token / retrieve_next_sibling) once
# speculative_eagle_topk > 1. Other recurrent families (Mamba2, KDA, lightning) are refused.
GDN_MODEL_TYPES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"})
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "attention", "chunked_attention"})
OTHER_RECURRENT_REFUSAL = ("DDTREE supports hybrid targets with gated-delta-net layers (Qwen3-Next, Qwen3.5) only; "
                           "this target's recurrent layers (Mamba2 / KDA / lightning) have no tree verify in SGLang "
                           "0.5.17. Use --speculative-algorithm DFLASH.")


def target_recurrence(hf_config) -> str | None:
    """'gdn' for a gated-delta-net hybrid target, 'other' for another recurrent / linear-attention target, None for
    an attention-only target. Reads the (text) config's model_type and layer_types only."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    model_type = str(getattr(text, "model_type", "") or "")
    if model_type in GDN_MODEL_TYPES:
        return "gdn"
    layer_types = getattr(text, "layer_types", None) or []
    if any(str(t) not in ATTENTION_LAYER_TYPES for t in layer_types):
        return "other"
    return None


def check_hybrid_config(options: DDTreeOptions, *, replayssm_spec: bool, radix_strategy: str | None) -> None:
    """What DDTREE cannot serve on a GDN hybrid target yet, refused at startup with one sentence each."""
    if options.auto:
        raise ValueError("--speculative-ddtree-budget auto does not support hybrid (linear-attention) targets yet; "
                         "use a fixed budget.")
    if options.prune is not None:
        # a pruned slot is nobody's child: SGLang's tree conv kernel would read a stale parent index for it
        raise ValueError("--speculative-ddtree-prune does not support hybrid (linear-attention) targets yet.")
    if replayssm_spec:
        raise ValueError("--enable-linear-replayssm-spec verifies a chain only; DDTREE verifies a tree on hybrid "
                         "targets: drop the flag.")
    if radix_strategy == "extra_buffer_lazy":
        raise ValueError("--mamba-radix-cache-strategy extra_buffer_lazy is not supported by the DFlash family "
                         "(DDTREE included); use extra_buffer or the default.")
