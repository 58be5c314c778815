"""GPU (two of them): DDTREE with tensor parallelism 2.

Checked, in the served dtype (bf16; a float32 run is not possible on the pinned stack: sgl_kernel's rmsnorm has no
float32 kernel):
  - lossless: DDTREE at --tp-size 2 == plain decoding at --tp-size 2, token for token at T=0, budgets 16, 64, 256,
    batch 1 and 8; a difference is tolerated only at a near-tie of plain's own top-2 (DDTREE_TIE_NATS, as in
    test_ddtree_server.py), and every one is recorded;
  - the tree is the same on both ranks and as good as at TP=1: over the prompts whose output is identical at TP=1
    and TP=2, tau agrees within 5% (every rank builds its tree from the all-gathered top-K; a rank disagreement
    desynchronises the KV and shows up as a different output, or as lost acceptance); rounds per prompt recorded;
  - step-time breakdown TP=2 vs TP=1 (budget 64, batch 1 and 8): per-round stage times from the worker's
    Prometheus histograms and decode tokens/s, recorded (not asserted: a tiny model at TP=2 mostly adds NCCL
    latency, the number says how much).
Skipped with a reason on a machine with fewer than two GPUs (the single-GPU kind), even under DDTREE_GPU_REQUIRED.
"""

from __future__ import annotations

import os

import pytest
from serving_common import COMMON, GREEDY, TEXT_PROMPTS, ID_PROMPTS, compare, ddtree, run_batch1, run_batch8, tau_of

from ddtree_bench import measure, prom

TIE_NATS = float(os.environ.get("DDTREE_TIE_NATS", "0.25"))
BUDGETS = (16, 64, 256)
TIMING_BUDGET = 64


@pytest.fixture(scope="module", autouse=True)
def two_gpus(gpu_env):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs (nvidia-h200-x2), this machine has {torch.cuda.device_count()}")


def configs(pair):
    draft = ["--speculative-draft-model-path", str(pair.drafter)]
    base = pair.base_args() + COMMON + ["--attention-backend", "triton", "--enable-metrics"]
    out = {}
    for tp in (1, 2):
        tp_args = ["--tp-size", str(tp)]
        out[f"plain-tp{tp}"] = base + tp_args
        for b in BUDGETS:
            out[f"ddtree-{b}-tp{tp}"] = base + tp_args + ddtree(b) + draft
    return out


@pytest.fixture(scope="module")
def servers(sglang_servers, model_pair):
    # all_or_nothing=False: a configuration that does not start fails only its own tests
    return sglang_servers(configs(model_pair), all_or_nothing=False)


def running(servers, *names):
    for n in names:
        if not hasattr(servers[n], "generate"):
            pytest.fail(f"server {n} did not start:\n{servers[n]}", pytrace=False)
    return [servers[n] for n in names]


_CACHE: dict = {}


def greedy(server, pair, mode, logprobs=False):
    key = (server.name, mode, logprobs)
    if key not in _CACHE:
        if mode == "bs1":
            extra = {"return_logprob": True, "top_logprobs_num": 2} if logprobs else {}
            _CACHE[key] = run_batch1(server, pair, **extra)
        else:
            _CACHE[key] = run_batch8(server, pair)
    return _CACHE[key]


@pytest.mark.parametrize("budget", BUDGETS)
def test_tp2_greedy_equals_plain_tp2(servers, model_pair, gpu_record, budget):
    plain, tree = running(servers, "plain-tp2", f"ddtree-{budget}-tp2")
    reference = greedy(plain, model_pair, "bs1", logprobs=True)
    report, failures = {}, []
    for mode in ("bs1", "bs8"):
        exact, ties, fails = compare(reference, greedy(tree, model_pair, mode), TIE_NATS)
        report[mode] = {"exact": exact, "ties": ties, "failures": fails}
        failures += [f"{mode}: {f}" for f in fails]
    gpu_record("tp2_greedy_equality", config=tree.name, tie_nats=TIE_NATS,
               tau_bs1=round(tau_of(greedy(tree, model_pair, "bs1")), 4), **report)
    assert not failures, f"{tree.name} differs from {plain.name}:\n" + "\n".join(failures)


@pytest.mark.parametrize("budget", BUDGETS)
def test_tp2_rounds_equal_tp1_where_outputs_agree(servers, model_pair, gpu_record, budget):
    tp1, tp2 = running(servers, f"ddtree-{budget}-tp1", f"ddtree-{budget}-tp2")
    out1, out2 = greedy(tp1, model_pair, "bs1"), greedy(tp2, model_pair, "bs1")
    same_tokens = [a["output_ids"] == b["output_ids"] for a, b in zip(out1, out2)]
    rounds1 = [o["meta_info"]["spec_verify_ct"] for o in out1]
    rounds2 = [o["meta_info"]["spec_verify_ct"] for o in out2]
    gpu_record("tp2_tau_vs_tp1", budget=budget, tau_tp1=round(tau_of(out1), 4), tau_tp2=round(tau_of(out2), 4),
               rounds_tp1=rounds1, rounds_tp2=rounds2, same_tokens=same_tokens)
    # Over the prompts whose outputs agree, acceptance must agree too. Not round for round: bf16 trees can differ
    # by a node swapped at the budget cut between near-equal drafter scores (seen TP=1 vs offline).
    agree = [i for i, same in enumerate(same_tokens) if same]
    assert len(agree) >= len(same_tokens) // 2, f"B={budget}: TP=1 and TP=2 outputs mostly differ: {same_tokens}"
    tau1 = tau_of([out1[i] for i in agree])
    tau2 = tau_of([out2[i] for i in agree])
    assert abs(tau2 - tau1) <= 0.05 * tau1, f"B={budget}: tau TP=2 {tau2:.3f} vs TP=1 {tau1:.3f} on the same outputs"


def _timed(server, pair, batch):
    client = measure.HttpClient(server.base_url)
    before = prom.parse(client.metrics_text())
    payloads = []
    for i in range(len(TEXT_PROMPTS)):
        body = {"input_ids": ID_PROMPTS[i]} if pair.dummy else {"text": TEXT_PROMPTS[i]}
        payloads.append({**body, "sampling_params": {**GREEDY, "max_new_tokens": 128}})
    results = []
    if batch == 1:
        for p in payloads:
            results += measure.run_batch(client, [p], 120)
    else:
        results = measure.run_batch(client, payloads[:batch], 120)
    method = "plain" if server.name.startswith("plain") else "ddtree"
    row = measure.summarize(results, method=method, max_new_tokens=128)
    stages = prom.ddtree_summary(prom.diff(prom.parse(client.metrics_text()), before))
    return {"decode_tokens_per_s": round(row["decode_tokens_per_s"], 1), "step_ms": row["step_ms"],
            "tau": row.get("tau"), "stage_ms": (stages or {}).get("stage_ms")}


def test_tp2_step_time_breakdown(servers, model_pair, gpu_record):
    names = ["plain-tp1", "plain-tp2", f"ddtree-{TIMING_BUDGET}-tp1", f"ddtree-{TIMING_BUDGET}-tp2"]
    running(servers, *names)
    rows = {}
    for name in names:
        for batch in (1, 8):
            rows[f"{name}/bs{batch}"] = _timed(servers[name], model_pair, batch)
    gpu_record("tp2_step_breakdown", budget=TIMING_BUDGET, rows=rows)
    for key, row in rows.items():
        assert row["decode_tokens_per_s"] > 0, key
        if key.startswith("ddtree"):
            assert row["stage_ms"] and set(row["stage_ms"]) >= {"draft", "tree", "verify", "walk", "commit"}, row
