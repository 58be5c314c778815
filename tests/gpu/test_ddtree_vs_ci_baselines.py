"""GPU: a DDTREE server (tiny pair, budget 64, bf16, CUDA graphs) against the committed CI baselines of the offline
float32 decoder (sglang_ddtree/offline/correctness.py): our format (with the target's top-2 gaps) and the
reference's file shape (tree traces, no gaps).

The server gets the CI check's prompts as token ids (greedy, 128 new tokens), its debug dump becomes a baseline
(sglang_ddtree/sglang_baseline.py), and `compare` judges it with the rule it picks for bf16 against float32
(`float32-tie`): a first divergence is a tie only where the float32 model's own top-2 gap is below the threshold;
up to it, a round whose tree hashes alike must accept the same length. Against our file everything must pass;
against the reference's file (no gaps recorded) a divergence cannot be judged (`unknown`), but nothing may be a bug.
Run on the GPU suite (docs/gpu-suite.md), e.g. `python -m pytest -q tests/gpu/test_ddtree_vs_ci_baselines.py`.
"""

from __future__ import annotations

import math
import os
import time

import pytest

BUDGET = 64
METHOD = f"ddtree_tb{BUDGET}"


def tau_rule_off():
    """compare's thresholds without its tau rule: a bf16 server's texts move at ties away from the float32
    baseline's, and a moved text accepts what it accepts (the rule fails any drop its interval confirms)."""
    from sglang_ddtree.compare import Thresholds

    return Thresholds(max_tau_drop=math.inf)
COMMON = ["--attention-backend", "triton", "--mem-fraction-static", "0.5", "--max-total-tokens", "65536",
          "--max-running-requests", "8", "--cuda-graph-max-bs-decode", "8", "--random-seed", "0"]


@pytest.fixture(scope="module")
def server_baseline(model_pair, sglang_server, tmp_path_factory):
    if model_pair.dummy:
        pytest.skip("needs the trained tiny pair (models/tiny): the CI baselines are of its weights")
    from sglang_ddtree import sglang_baseline as sb
    from sglang_ddtree import tiny
    from sglang_ddtree.baseline import read_baseline
    from sglang_ddtree.datasets import encode_prompt, load_prompts
    from sglang_ddtree.offline import correctness as cc

    tok = tiny.load_tokenizer()
    rows = load_prompts(cc.CHECK.dataset, limit=max(cc.CHECK.prompt_indices) + 1)
    prompts = [(rows[i].id, encode_prompt(tok, rows[i])) for i in cc.CHECK.prompt_indices]
    dump = tmp_path_factory.mktemp("ci") / f"debug-{os.getpid()}-{int(time.time())}.jsonl"
    args = model_pair.base_args() + COMMON + [
        "--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget", str(BUDGET),
        "--speculative-draft-model-path", str(model_pair.drafter), "--speculative-ddtree-debug", str(dump)]
    server = sglang_server("ddtree-vs-ci-baselines", args)
    params = {"temperature": 0.0, "max_new_tokens": cc.CHECK.max_new_tokens}
    requests = [sb.ServerRequest(response=server.generate(input_ids=ids, sampling_params=params, rid=f"ci-{i}"),
                                 prompt_id=pid, prompt_ids=ids, prompt_index=i, sampling_params=params)
                for i, (pid, ids) in enumerate(prompts)]
    loaded = sb.read_debug_dump(dump, rids=[r.rid for r in requests])
    header = sb.server_header(budget=loaded.budget, depth_limit=loaded.depth_limit, requests=requests,
                              target=str(model_pair.target), drafter=str(model_pair.drafter), dtype="bfloat16",
                              seed=0, dataset=cc.CHECK.dataset)
    conv = sb.convert(loaded, requests, header=header, match_prompts=read_baseline(cc.OURS_PATH))
    assert not conv.problems, conv.problems[:5]
    return conv.baseline


def test_server_against_our_ci_baseline(server_baseline, gpu_record):
    from sglang_ddtree.baseline import read_baseline
    from sglang_ddtree.compare import compare
    from sglang_ddtree.compare_report import format_report
    from sglang_ddtree.offline import correctness as cc

    rep = compare(read_baseline(cc.OURS_PATH), server_baseline, methods=[METHOD], n_boot=200,
                  thresholds=tau_rule_off())
    m = rep["methods"][METHOD]
    gpu_record("ddtree_vs_ci_baselines", baseline="ours", rule=rep["rule"], passed=rep["passed"],
               failures=rep["failures"], divergence_counts=m.get("divergence_counts"),
               tree_rounds_compared=m.get("tree_rounds_compared"), tau=m.get("tau"))
    assert rep["rule"]["name"] == "float32-tie" and rep["rule"]["float32_side"] == "baseline"
    assert m["prompts"] == len(server_baseline.records) and m["matched_by"] == "prompt token hash"
    assert rep["passed"], format_report(rep)


def test_server_against_reference_format_baseline(server_baseline, gpu_record):
    from sglang_ddtree.compare import compare
    from sglang_ddtree.offline import correctness as cc

    rep = compare(cc.load_reference_baseline(), server_baseline, methods=[METHOD], n_boot=200,
                  thresholds=tau_rule_off())
    m = rep["methods"][METHOD]
    gpu_record("ddtree_vs_ci_baselines", baseline="reference", rule=rep["rule"], passed=rep["passed"],
               failures=rep["failures"], divergence_counts=m.get("divergence_counts"))
    assert m["prompts"] == len(server_baseline.records)
    assert m["divergence_counts"].get("bug", 0) == 0 and m["tree_difference_counts"].get("bug", 0) == 0
    assert not [f for f in m["failures"] if "cannot be judged" not in f and not f.startswith("first bug")], \
        m["failures"]
