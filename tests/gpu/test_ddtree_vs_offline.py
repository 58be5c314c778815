"""GPU: one DDTREE run checked against the offline DDTree decoder, round for round.

A DDTREE server (tiny pair, budget 32, triton, CUDA graphs on) runs with `--speculative-ddtree-debug`; the same
prompts go through the offline decoder (sglang_ddtree.offline, transformers) on the same GPU. The server's dump
and /generate answers become a baseline file (sglang_ddtree/sglang_baseline.py) and the comparator
(sglang_ddtree/compare.py) checks it against the offline one. Prompts are sent as token ids, so both sides see
exactly the same prompt; greedy, ignore_eos, 64 new tokens; batch 1 (one request at a time) and batch 4 (the four
prompts in one /generate call, so rounds of several requests share a batch and must be told apart by rid).

Checked, per batch mode:
  1. attribution: every round the server kept is in the dump under the request's rid, chained from the prefill
     token; each tree's root is the output token it hangs from, its emitted tokens are the output's, and the
     number of rounds and their accept lengths equal SGLang's own spec_verify_ct and accept histogram;
  2. tokens: output == offline output, or the first divergence is a near-tie of the offline target (its top-1
     minus top-2 logit there below NOISE_MARGIN);
  3. rounds: up to the first output divergence, every round's accept length equals the offline round's, unless
     that round's tree differs by float noise (a node swapped at the budget cut, an order flip between near-equal
     scores): the first such round is recorded with the comparator's explanation. A different accept length on
     an identical tree, or a tree that differs beyond noise (a node whose drafter score beats the other side's
     cut, scores apart by more than SCORE_TOL) fails;
  4. meta_info: the plugin's ddtree_* keys equal what the dump's rounds give.

Why the offline side runs in float32 (on CUDA), not bf16 like the server: float32 is the reference semantics, and
its per-token margins are the exact model's, so "near-tie" is judged on the true margin instead of a bf16-rounded
one (bf16 logits are spaced 0.0625 at |logit| in [8, 16): a bf16 margin of 0 or 0.06 says little). A bf16 offline
run would not reproduce the server bit for bit anyway (transformers' sdpa and SGLang's triton kernels round
differently), so it would add its own noise without removing the server's. The cost is that every tree score
carries the server's bf16 drift, hence the loose SCORE_TOL (the largest drift seen is recorded, to tighten it).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import pytest

BUDGET = 32
MAX_NEW_TOKENS = 64
DEPTH_LIMIT = 15
NOISE_MARGIN = float(os.environ.get("DDTREE_VS_OFFLINE_NOISE_MARGIN", "0.5"))  # logits (nats)
SCORE_TOL = float(os.environ.get("DDTREE_VS_OFFLINE_SCORE_TOL", "0.5"))  # drafter prefix log-probs
TEXT_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n",
    "    # Return the number of lines in the file\n    with open(path) as f:\n",
]
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}
COMMON = [
    "--attention-backend", "triton",
    "--mem-fraction-static", "0.5",
    "--max-total-tokens", "65536",
    "--max-running-requests", "8",
    "--cuda-graph-max-bs-decode", "8",
    "--random-seed", "0",
]


def out_dir() -> Path:
    """The suite's log folder (bundled into logs.tar.xz by scripts/device/run_gpu_suite.py)."""
    path = Path(os.environ.get("GPU_SUITE_LOG_DIR") or Path(__file__).resolve().parents[2] / "runs" / "gpu-logs")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def pair(model_pair):
    if model_pair.dummy:
        pytest.skip("needs the trained tiny pair (models/tiny): the offline decoder cannot load dummy weights")
    return model_pair


@pytest.fixture(scope="module")
def prompts(pair):
    from sglang_ddtree import tiny

    tok = tiny.load_tokenizer()
    return [tok(text)["input_ids"] for text in TEXT_PROMPTS]


@pytest.fixture(scope="module")
def server_run(sglang_server, pair, prompts):
    """(dump path, batch-1 answers, batch-4 answers) of one DDTREE server with the debug dump on."""
    dump = out_dir() / f"ddtree-vs-offline-debug-{os.getpid()}-{int(time.time())}.jsonl"
    args = pair.base_args() + COMMON + [
        "--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget", str(BUDGET),
        "--speculative-draft-model-path", str(pair.drafter), "--speculative-ddtree-debug", str(dump)]
    server = sglang_server("ddtree-vs-offline", args)
    bs1 = [server.generate(input_ids=ids, sampling_params=GREEDY, rid=f"vs-offline-bs1-p{i}")
           for i, ids in enumerate(prompts)]
    bs4 = server.generate(input_ids=prompts, sampling_params=GREEDY,
                          rid=[f"vs-offline-bs4-p{i}" for i in range(len(prompts))])
    assert isinstance(bs4, list) and len(bs4) == len(prompts)
    return dump, bs1, bs4


@pytest.fixture(scope="module")
def offline_baseline(pair, prompts):
    """The offline DDTree decoder on CUDA in float32, trees recorded."""
    import torch

    from sglang_ddtree import tiny
    from sglang_ddtree.baseline import (
        Baseline, BaselineHeader, fingerprint_dir, method_name, prompt_sha256, write_baseline,
    )
    from sglang_ddtree.offline.decoders import speculative_decode
    from sglang_ddtree.offline.drafts import DFlashDraftSource

    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # no TF32: the reference must be float32
    try:
        target = tiny.load_target(pair.target, device="cuda", dtype=torch.float32)
        target.config._attn_implementation = "sdpa"  # custom 4D tree masks
        drafter = tiny.load_drafter(pair.drafter, device="cuda", dtype=torch.float32)
        draft = DFlashDraftSource(drafter, target)
        records = []
        t0 = time.perf_counter()
        for i, ids in enumerate(prompts):
            rec = speculative_decode(target, draft, ids, method="ddtree", budget=BUDGET,
                                     max_new_tokens=MAX_NEW_TOKENS, eos_token_ids=[], record_trees=True)
            rec.prompt_id, rec.prompt_index, rec.prompt_sha256 = f"p{i}", i, prompt_sha256(ids)
            records.append(rec)
        seconds = time.perf_counter() - t0
    finally:
        torch.set_float32_matmul_precision(precision)
    assert all(r.method == method_name("ddtree", BUDGET) for r in records)
    header = BaselineHeader(
        source="offline", target={"path": str(pair.target), "fingerprint": fingerprint_dir(pair.target)},
        drafter={"path": str(pair.drafter), "fingerprint": fingerprint_dir(pair.drafter)}, dtype="float32",
        device="cuda", attn_implementation="sdpa", temperature=0.0, max_new_tokens=MAX_NEW_TOKENS,
        block_size=int(drafter.config.block_size), dataset="code-prompts", extra={"seconds": round(seconds, 2)})
    base = Baseline(header, records)
    write_baseline(out_dir() / "ddtree-vs-offline-offline.jsonl", header, records)
    return base


def server_baseline(pair, prompts, dump, answers, mode):
    from sglang_ddtree import sglang_baseline as sb

    requests = [sb.ServerRequest(response=a, prompt_id=f"p{i}", prompt_ids=ids, prompt_index=i,
                                 sampling_params=GREEDY) for i, (a, ids) in enumerate(zip(answers, prompts))]
    loaded = sb.read_debug_dump(dump, rids=[r.rid for r in requests])
    header = sb.server_header(budget=loaded.budget, depth_limit=loaded.depth_limit, requests=requests,
                              target=str(pair.target), drafter=str(pair.drafter), dtype="bfloat16", seed=0,
                              dataset="code-prompts", extra={"mode": mode, "debug_dump": dump.name})
    conv = sb.convert(loaded, requests, header=header)
    sb.write_server_baseline(out_dir() / f"ddtree-vs-offline-server-{mode}.jsonl", conv.baseline)
    return conv


def rounds_before_divergence(base, cand):
    """Rounds both runs share (same index, same root) before the first output divergence, stopping after the
    first round whose accept length differs (later rounds hang from different positions)."""
    from sglang_ddtree.compare import first_divergence

    pos = first_divergence(base.output_ids, cand.output_ids)
    limit = len(base.output_ids) if pos is None else pos
    shared = []
    for r, (rb, rc) in enumerate(zip(base.round_root_positions(), cand.round_root_positions())):
        if rb != rc or rb >= limit:
            break
        shared.append(r)
        if base.accept_lengths[r] != cand.accept_lengths[r]:
            break
    return pos, shared


def score_drift(base_tree, cand_tree):
    """Largest |score difference| over nodes of two trees with the same nodes in the same order, else None."""
    if base_tree["tokens"] != cand_tree["tokens"] or base_tree["parents"] != cand_tree["parents"]:
        return None
    return max((abs(a - b) for a, b in zip(base_tree["scores"][1:], cand_tree["scores"][1:])
                if a is not None and b is not None), default=0.0)


@pytest.mark.parametrize("mode", ["bs1", "bs4"])
def test_server_run_equals_the_offline_decoder(pair, prompts, server_run, offline_baseline, mode, gpu_record):
    from sglang_ddtree.compare import Thresholds, compare, compare_trees

    dump, bs1, bs4 = server_run
    answers = bs1 if mode == "bs1" else bs4
    conv = server_baseline(pair, prompts, dump, answers, mode)
    server = conv.baseline
    method = f"ddtree_tb{BUDGET}"
    # the tau rule off: a bf16 server against the float32 decoder is judged round by round below, and a text that a
    # tie moved accepts what it accepts (compare's default fails any confirmed tau drop)
    report = compare(offline_baseline, server, methods=[method],
                     thresholds=Thresholds(noise_margin=NOISE_MARGIN, score_tol=SCORE_TOL, max_tau_drop=math.inf))
    m = report["methods"][method]

    per_prompt, unexplained, rounds_compared, deep_rounds, drift = [], [], 0, 0, 0.0
    for base in offline_baseline.records:
        cand = server.get(base.prompt_id, method)
        if cand is None:
            continue
        pos, shared = rounds_before_divergence(base, cand)
        rounds_compared += len(shared)
        deep_rounds += sum(1 for r in shared if base.accept_lengths[r] >= 3)
        for r in shared:
            d = score_drift(base.trees[r], cand.trees[r])
            drift = max(drift, d or 0.0)
        entry = {"prompt": base.prompt_id, "first_divergence": pos,
                 "margin_offline": base.margins[pos] if pos is not None and pos < len(base.margins) else None,
                 "rounds_offline": len(base.accept_lengths), "rounds_server": len(cand.accept_lengths)}
        differing = [r for r in shared if base.accept_lengths[r] != cand.accept_lengths[r]]
        if differing:
            r = differing[0]
            why = compare_trees(base.trees[r], cand.trees[r], SCORE_TOL)
            entry["first_differing_round"] = {
                "round": r, "offline": base.accept_lengths[r], "server": cand.accept_lengths[r],
                "tree_difference": None if why is None else {k: why[k] for k in ("node", "fields", "class", "reason")}}
            if why is None or why["class"] == "bug":
                unexplained.append(entry)
        per_prompt.append(entry)

    dm = {(d["prompt_id"], d["position"]): d for d in m.get("divergences", [])}
    gpu_record("ddtree_vs_offline", mode=mode, budget=BUDGET, max_new_tokens=MAX_NEW_TOKENS,
               noise_margin=NOISE_MARGIN, score_tol=SCORE_TOL, passed=report["passed"], failures=report["failures"],
               warnings=report["warnings"], conversion_problems=conv.problems[:20],
               exact=m.get("exact_match"), divergence_counts=m.get("divergence_counts"),
               divergences=[{k: d[k] for k in ("prompt_id", "position", "class", "baseline_margin", "reason")}
                            for d in dm.values()],
               tree_rounds_compared=m.get("tree_rounds_compared"),
               tree_difference_counts=m.get("tree_difference_counts"),
               first_tree_difference=m.get("first_tree_difference"),
               tau={k: m["tau"][k] for k in ("baseline", "candidate", "diff")} if "tau" in m else None,
               rounds_compared=rounds_compared, deep_rounds=deep_rounds, max_score_drift=round(drift, 5),
               per_prompt=per_prompt)

    # 1. attribution
    assert conv.problems == [], "the dump does not add up with the server's answers:\n" + "\n".join(conv.problems)
    assert sorted(server.prompt_ids()) == sorted(r.prompt_id for r in offline_baseline.records)
    # 2.-3. the comparator: tokens, trees, accept lengths on identical trees, prompts
    assert report["passed"], "server run vs offline decoder:\n" + "\n".join(report["failures"])
    assert not unexplained, f"accept lengths differ on trees that do not differ by noise: {unexplained}"
    # not vacuous: rounds really compared, and drafts accepted deep in them
    assert rounds_compared >= 10 and deep_rounds >= 1, (rounds_compared, deep_rounds)
    assert m["tree_rounds_compared"] >= rounds_compared  # every shared round had both trees
    # 4. the plugin's per-request meta_info, against the dump's rounds
    branch_tokens_seen = 0
    for i, answer in enumerate(answers):
        meta = answer["meta_info"]
        assert "ddtree_accept_length" in meta, (
            "no ddtree_* keys in meta_info: the plugin's TokenizerManager hook was not applied (server log: "
            f"'Failed to apply hooks'?); keys: {sorted(meta)}")
        lens = server.get(f"p{i}", method).accept_lengths
        assert meta["ddtree_accept_length"] == pytest.approx(sum(lens) / len(lens))
        assert len(meta["ddtree_accept_rate_by_depth"]) == DEPTH_LIMIT
        assert meta["ddtree_accept_rate_by_depth"][0] == pytest.approx(sum(a > 1 for a in lens) / len(lens))
        assert meta["ddtree_depth_normalized_accept_rate"] == pytest.approx(
            sum(a - 1 for a in lens) / (len(lens) * DEPTH_LIMIT))
        assert math.isfinite(meta["spec_accept_rate"])  # SGLang's own key is still there
        # branch acceptance per request (the worker's cap_lens channel) against the dump's accepted ranks
        ranks = server.get(f"p{i}", method).accepted_ranks
        assert ranks is not None, "the debug dump has no tree ranks"
        per_round = [sum(r > 0 for r in round_ranks) for round_ranks in ranks]
        assert meta["ddtree_branch_tokens"] == sum(per_round), (meta, per_round)
        assert meta["ddtree_branch_round_rate"] == pytest.approx(sum(c > 0 for c in per_round) / len(per_round))
        assert "spec_cap_length" not in meta and "spec_cap_lens_histogram" not in meta
        branch_tokens_seen += sum(per_round)
    gpu_record("ddtree_vs_offline_branch_tokens", mode=mode, branch_tokens=branch_tokens_seen)
    assert branch_tokens_seen > 0, "no branch taken in any request: the branch check compared only zeros"
