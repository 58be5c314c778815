"""GPU: DDTREE served by SGLang 0.5.17 through our plugin, against plain decoding on the same GPU.

Every configuration below is one server; they start in parallel (one start costs 1-3 minutes, most of it JIT
and graph capture, which 16 CPU cores overlap well), each with a small share of GPU memory.

Checked here:
  - lossless at T=0: DDTREE output == plain output, token for token, for budgets 16..1024, batch 1 and 8 (mixed
    prompt lengths), triton with and without CUDA graphs, and flashinfer. A difference is tolerated only where
    plain decoding's own top-2 log-probs tie within DDTREE_TIE_NATS (default 0.25 nats: the target computes in
    bf16, whose logit spacing is 0.0625 at |logit| in [8, 16), and a verify of B+1 tokens rounds differently from
    a one-token decode; a GPU run saw gaps of 0.0625 and 0.125 at such positions, for DFLASH and DDTREE alike);
  - acceptance is reported (meta_info) and the verify really ran as a CUDA graph where graphs are on;
  - T>0: token frequencies of DDTREE sampling match plain sampling (chi-square, two samples);
  - long outputs in a batch: 256 tokens for 16 requests sent together, == plain one at a time up to the same ties;
  - no KV leak: after 200 mixed requests, aborted ones included, the pool returns to its idle usage;
  - `auto`: every candidate verified; its calibration table scored, exported, kept by /flush_cache and reset by
    /set_internal_state; held on the chain, its lean chain rounds ran, lossless and counted in the metrics; the
    in-process A/B (SGLANG_DDTREE_AUTO_AB) lossless, both arms run and tallied apart.
Records (accept lengths, ties, timings) go to gpu_suite.json through `gpu_record`.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import re
import time
import urllib.error
import urllib.request

import pytest
from serving_common import (BATCH, COMMON, MAX_NEW_TOKENS, compare, ddtree, mixed_and_aborted_load, prompt,
                            run_batch1, run_batch8, select_configs, tau_of, used_tokens)

TIE_NATS = float(os.environ.get("DDTREE_TIE_NATS", "0.25"))


def configs(pair):
    draft = ["--speculative-draft-model-path", str(pair.drafter)]
    triton = ["--attention-backend", "triton"]
    return {
        "plain": pair.base_args() + COMMON + triton,
        "dflash": pair.base_args() + COMMON + triton + ["--speculative-algorithm", "DFLASH"] + draft,
        "ddtree-16": pair.base_args() + COMMON + triton + ddtree(16) + draft,
        "ddtree-64": pair.base_args() + COMMON + triton + ddtree(64) + draft,
        "ddtree-256": pair.base_args() + COMMON + triton + ddtree(256) + draft,
        "ddtree-1024": pair.base_args() + COMMON + triton + ddtree(1024) + draft,
        "ddtree-64-eager": pair.base_args() + COMMON + triton + ddtree(64) + draft + ["--disable-cuda-graph"],
        "ddtree-64-flashinfer": pair.base_args() + COMMON + ["--attention-backend", "flashinfer"] + ddtree(64)
        + draft,
        # a budget per round from chain,16,32,64,128 (four extra verify widths, each with its own graphs); every
        # candidate explored (SGLANG_DDTREE_AUTO_EXPLORE_ALL), so the greedy tests verify each one's tree
        "ddtree-auto": (pair.base_args() + COMMON + triton + ddtree("auto") + draft
                        + ["--enable-metrics", "--speculative-ddtree-auto-calibration", "on"],
                        {"SGLANG_DDTREE_AUTO_EXPLORE_ALL": "1"}),
        # `auto` held on the chain (SGLANG_DDTREE_AUTO_FORCE): its unsampled rounds run the lean chain round
        # (worker._chain_round), its sampled ones the general round
        "ddtree-auto-chain": (pair.base_args() + COMMON + triton + ddtree("auto") + draft + ["--enable-metrics"],
                              {"SGLANG_DDTREE_AUTO_FORCE": "chain"}),
        # rounds without a draft (`plain`) and 16-tree rounds in turn, a few rounds each (SGLANG_DDTREE_AUTO_FORCE
        # with a list): every drafted stretch starts from a drafter context that plain rounds extended
        "ddtree-auto-plain": (pair.base_args() + COMMON + triton + ddtree("auto") + draft
                              + ["--speculative-ddtree-auto-candidates", "plain,chain,16", "--enable-metrics"],
                              {"SGLANG_DDTREE_AUTO_FORCE": "plain,16"}),
        # verify CUDA graphs only up to batch 4: batch 8 verifies eagerly, and so do the round's stages (unpadded)
        "ddtree-auto-past-graphs": (pair.base_args() + COMMON + triton + ddtree("auto") + draft
                                    + ["--cuda-graph-max-bs-decode", "4"], {}),
        # the in-process A/B (SGLANG_DDTREE_AUTO_AB): blocks of 4 decode rounds of `auto`, then 4 of the fixed
        # 128-tree, each arm tallied apart
        "ddtree-auto-ab": (pair.base_args() + COMMON + triton + ddtree("auto") + draft + ["--enable-metrics"],
                           {"SGLANG_DDTREE_AUTO_AB": "4"}),
    }


DDTREE_NAMES = ["ddtree-16", "ddtree-64", "ddtree-256", "ddtree-1024", "ddtree-64-eager", "ddtree-64-flashinfer",
                "ddtree-auto", "ddtree-auto-chain", "ddtree-auto-plain", "ddtree-auto-past-graphs", "ddtree-auto-ab"]
AUTO_NAMES = ["ddtree-auto"]


@pytest.fixture(scope="module")
def servers(sglang_servers, model_pair):
    env = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}
    return sglang_servers(select_configs(configs(model_pair)), env=env)


def need(servers, *names):
    missing = [n for n in names if n not in servers]
    if missing:
        pytest.skip(f"configuration(s) {missing} not selected (DDTREE_GPU_CONFIGS)")






@pytest.fixture(scope="module")
def outputs(servers, model_pair):
    """Greedy outputs of every server, batch 1 and batch 8; plain with top-2 log-probs for the tie rule."""
    results = {"plain": {"bs1": run_batch1(servers["plain"], model_pair, return_logprob=True, top_logprobs_num=2)}}
    results["plain"]["bs8"] = run_batch8(servers["plain"], model_pair)

    def run(name):
        t0 = time.perf_counter()
        res = {"bs1": run_batch1(servers[name], model_pair), "bs8": run_batch8(servers[name], model_pair)}
        res["seconds"] = time.perf_counter() - t0
        return name, res

    names = [n for n in ["dflash"] + DDTREE_NAMES if n in servers]
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        for name, res in pool.map(run, names):
            results[name] = res
    return results



@pytest.mark.parametrize("name", ["dflash"] + DDTREE_NAMES)
def test_greedy_equals_plain(servers, outputs, name, model_pair, gpu_record):
    need(servers, name)
    plain_bs1 = outputs["plain"]["bs1"]
    report = {}
    all_failures = []
    for mode in ("bs1", "bs8"):
        # batch-8 outputs are compared with plain batch-1, whose top-2 log-probs the tie rule needs
        exact, ties, failures = compare(plain_bs1, outputs[name][mode], TIE_NATS)
        report[mode] = {"exact": exact, "ties": ties, "failures": failures}
        all_failures += [f"{mode}: {f}" for f in failures]
    tau = tau_of(outputs[name]["bs1"])
    gpu_record("ddtree_greedy_equality", config=name, mode=model_pair.mode, tau_bs1=round(tau, 4), **report,
               seconds=round(outputs[name]["seconds"], 3))
    assert not all_failures, f"{name} differs from plain decoding:\n" + "\n".join(map(str, all_failures))


@pytest.mark.parametrize("name", DDTREE_NAMES)
def test_acceptance_is_reported_and_sane(servers, outputs, name):
    need(servers, name)
    for i, out in enumerate(outputs[name]["bs1"]):
        meta = out["meta_info"]
        rounds = meta["spec_verify_ct"]
        assert math.ceil(MAX_NEW_TOKENS / 16) <= rounds <= MAX_NEW_TOKENS, f"prompt {i}: {rounds} rounds"
        assert 1.0 <= meta["spec_accept_length"] <= 16.0
    for mode in ("bs1", "bs8"):  # branch counts per request (cap_lens channel), with and without round graphs
        for i, out in enumerate(outputs[name][mode]):
            meta = out["meta_info"]
            hist = meta.get("ddtree_branch_tokens_histogram")
            assert hist is not None, f"{mode} prompt {i}: no ddtree_branch_* keys; meta_info: {sorted(meta)}"
            assert sum(hist) == meta["spec_verify_ct"], (mode, i, hist, meta["spec_verify_ct"])
            assert meta["ddtree_branch_tokens"] <= meta["spec_num_correct_drafts"], (mode, i)


@pytest.mark.parametrize("name", [n for n in DDTREE_NAMES if "eager" not in n])
def test_verify_runs_in_cuda_graphs(servers, outputs, name):
    need(servers, name)
    flags = re.findall(r"cuda graph: (True|False)", servers[name].log_text())
    assert "True" in flags, f"{name}: decode never ran in a CUDA graph: {flags[-5:]}"


def test_larger_budget_accepts_at_least_as_much_as_the_chain(outputs, model_pair, gpu_record):
    """Recorded for every budget; asserted only between the chain and the largest budget on the trained pair."""
    need(outputs, "dflash", "ddtree-1024")
    taus = {}
    for name in ["dflash", "ddtree-16", "ddtree-64", "ddtree-256", "ddtree-1024"]:
        if name not in outputs:
            continue
        taus[name] = tau_of(outputs[name]["bs1"])
    gpu_record("ddtree_tau_by_budget", mode=model_pair.mode, taus=taus)
    if not model_pair.dummy:
        assert taus["ddtree-1024"] >= taus["dflash"], taus


@pytest.mark.parametrize("name", AUTO_NAMES)
def test_auto_verifies_every_candidate(servers, outputs, gpu_record, name):
    """`auto` with SGLANG_DDTREE_AUTO_EXPLORE_ALL explores each candidate (EXPLORE_ROUNDS, 4 rounds per batch-size
    bucket, even one whose measured costs say it cannot win: ten servers share the GPU here) before it
    exploits: after the batch-1 and batch-8 runs every candidate was verified (losslessness:
    test_greedy_equals_plain[ddtree-auto]) and the choices are exported per candidate. Every batch-size bucket met had
    all its stage graphs captured together at its first round, and no stage was captured in a later round of such a
    bucket (a warning would say so)."""
    need(servers, name)
    server = servers[name]
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    rounds = {m.group(1): float(m.group(2)) for m in
              re.finditer(r'sglang:ddtree_auto_rounds_total\{[^}]*candidate="([^"]+)"[^}]*\} ([0-9.e+]+)', text)}
    log = server.log_text()
    together = [l.split("DDTREE auto: ", 1)[1] for l in log.splitlines() if "stage graphs captured together" in l]
    gpu_record("ddtree_auto_rounds", config=name, rounds=rounds, captured_together=together,
               candidates_line=next((l for l in log.splitlines() if "DDTREE auto: candidates" in l), None))
    assert together, "no batch-size bucket had its stage graphs captured together"
    assert "after the bucket's stages were all captured" not in log
    assert set(rounds) == {"chain", "16", "32", "64", "128"}, rounds
    assert all(v >= 3 for v in rounds.values()), rounds
    assert "DDTREE auto: candidates" in log


def test_auto_past_the_largest_graph_captures_nothing_there(servers, outputs, gpu_record):
    """Verify graphs up to batch 4, a batch of 8 (test_greedy_equals_plain[ddtree-auto-past-graphs] checks its
    tokens): `auto` captured its stage graphs together for the graph buckets it met and for no batch size past
    them (there the stages run eagerly: a capture per batch size met was a stall each)."""
    name = "ddtree-auto-past-graphs"
    need(servers, name)
    log = servers[name].log_text()
    buckets = [int(m) for m in re.findall(r"batch-size bucket (\d+): \d+ stage graphs captured together", log)]
    gpu_record("ddtree_auto_past_graphs", captured_buckets=buckets,
               late=len(re.findall(r"after the bucket's stages were all captured", log)))
    assert buckets and max(buckets) <= 4, buckets
    assert "after the bucket's stages were all captured" not in log


def test_auto_lean_chain_rounds_ran_and_were_counted(servers, outputs, gpu_record):
    """The server held on the chain ran lean chain rounds (its greedy outputs equal plain decoding's:
    test_greedy_equals_plain[ddtree-auto-chain]; its T>0 samples plain's: test_sampling_matches_plain_sampling), and
    its metrics count the lean rounds too: Prometheus' request-rounds and accepted tokens reach at least 90% of what
    meta_info reports over the batch-1 and batch-8 runs (the last round or two of a run are published by a later
    round; most rounds here are lean ones)."""
    name = "ddtree-auto-chain"
    need(servers, name)
    server = servers[name]
    log = server.log_text()
    rounds = _metric_values(server, "sglang:ddtree_auto_rounds_total")
    gpu_record("ddtree_auto_lean_chain", rounds=rounds,
               first_lean=next((l for l in log.splitlines() if "first lean chain round" in l), None))
    assert "DDTREE auto: first lean chain round" in log
    assert rounds and all('candidate="chain"' in labels for labels in rounds), rounds
    metas = [out["meta_info"] for mode in ("bs1", "bs8") for out in outputs[name][mode]]
    request_rounds = sum(_metric_values(server, "sglang:ddtree_rounds_total").values())
    accepted = sum(_metric_values(server, "sglang:ddtree_accepted_tokens_total").values())
    # meta_info's verify count and committed tokens per request (the first token comes from prefill)
    verify_total = sum(m["spec_verify_ct"] for m in metas)
    tokens_total = sum(m["completion_tokens"] - 1 for m in metas)
    gpu_record("ddtree_auto_lean_chain_counts", request_rounds=request_rounds, verify_total=verify_total,
               accepted=accepted, tokens_total=tokens_total)
    assert request_rounds >= 0.9 * verify_total, (request_rounds, verify_total)
    assert accepted >= 0.9 * tokens_total, (accepted, tokens_total)


def test_auto_rounds_without_a_draft_keep_the_drafters_context(servers, outputs, gpu_record):
    """The server held in turn on `plain` and the 16-tree ran both kinds of round (its outputs equal plain
    decoding's: test_greedy_equals_plain[ddtree-auto-plain]), and its drafted rounds accept what the fixed 16-tree's
    rounds accept: the drafter's context took the plain rounds' tokens (a context with holes would draft from the
    wrong text and accept far less). Prometheus counts drafted request-rounds only (a plain round's summary is
    zeros), so accepted / rounds there is the 16-tree rounds' tau; the fixed server's is SGLang's, over the same
    prompts at batch 1."""
    name = "ddtree-auto-plain"
    need(servers, name, "ddtree-16")
    server = servers[name]
    rounds = _metric_values(server, "sglang:ddtree_auto_rounds_total")
    by_candidate = {c: sum(v for labels, v in rounds.items() if f'candidate="{c}"' in labels) for c in ("plain", "16")}
    request_rounds = sum(_metric_values(server, "sglang:ddtree_rounds_total").values())
    accepted = sum(_metric_values(server, "sglang:ddtree_accepted_tokens_total").values())
    drafted_tau = accepted / request_rounds if request_rounds else 0.0
    fixed_tau = tau_of(outputs["ddtree-16"]["bs1"])
    log = server.log_text()
    gpu_record("ddtree_auto_plain", rounds=by_candidate, drafted_tau=round(drafted_tau, 4),
               fixed_tau=round(fixed_tau, 4), verify_states=next(
                   (l for l in log.splitlines() if "verify states built" in l), None))
    assert by_candidate["plain"] >= 20 and by_candidate["16"] >= 20, by_candidate
    assert 0.3 <= by_candidate["plain"] / (by_candidate["plain"] + by_candidate["16"]) <= 0.7, by_candidate
    assert drafted_tau >= 0.85 * fixed_tau, (drafted_tau, fixed_tau)


def test_auto_ab_runs_both_arms_and_tallies_them_apart(servers, outputs, gpu_record):
    """The A/B server (SGLANG_DDTREE_AUTO_AB=4) alternated its decode rounds between `auto` and the fixed 128-tree
    (its greedy outputs equal plain decoding's: test_greedy_equals_plain[ddtree-auto-ab]), and its counters keep the
    arms apart: both arms counted rounds with committed tokens and GPU time, each arm at least one token a
    request-round and at most the drafter block's 16, the counted and skipped rounds of both arms together no more
    than the server's batch rounds, and `auto`'s per-candidate rounds no more than its own arm's."""
    name = "ddtree-auto-ab"
    need(servers, name)
    server = servers[name]

    def by_arm(metric):
        return {arm: sum(v for labels, v in _metric_values(server, metric).items() if f'arm="{arm}"' in labels)
                for arm in ("auto", "fixed")}

    fields = ("rounds", "request_rounds", "tokens", "seconds", "skipped_rounds", "host_rounds", "host_seconds",
              "sampled_rounds", "narrower_rounds", "narrower_request_rounds")
    tallies = {field: by_arm(f"sglang:ddtree_ab_{field}_total") for field in fields}
    batch_rounds = sum(v for labels, v in _metric_values(server, "sglang:ddtree_stage_seconds_count").items()
                       if 'stage="commit"' in labels)  # every round published (the A/B's publish lags it)
    auto_rounds = sum(_metric_values(server, "sglang:ddtree_auto_rounds_total").values())
    log = server.log_text()
    gpu_record("ddtree_auto_ab", tallies=tallies, batch_rounds=batch_rounds, auto_rounds=auto_rounds,
               line=next((l for l in log.splitlines() if "DDTREE A/B" in l), None))
    assert "DDTREE A/B (SGLANG_DDTREE_AUTO_AB=4)" in log
    for arm in ("auto", "fixed"):
        assert tallies["rounds"][arm] >= 10 and tallies["seconds"][arm] > 0 and tallies["host_seconds"][arm] > 0
        tau = tallies["tokens"][arm] / tallies["request_rounds"][arm]
        assert 1.0 <= tau <= 16.0, (arm, tau)
    counted = sum(tallies["rounds"].values()) + sum(tallies["skipped_rounds"].values())
    assert counted <= batch_rounds + 1, (counted, batch_rounds)
    # alternating blocks of 4: neither arm has more than about half the rounds (a block or two apart)
    assert abs(tallies["rounds"]["auto"] + tallies["skipped_rounds"]["auto"]
               - tallies["rounds"]["fixed"] - tallies["skipped_rounds"]["fixed"]) <= 0.2 * counted + 8
    # `auto`'s candidate counter counts at the round, the tallies a publish later (ABTallies.FLUSH_ROUNDS + in flight)
    assert auto_rounds <= tallies["rounds"]["auto"] + tallies["skipped_rounds"]["auto"] + 10
    # the arms' split (recorded per arm): `auto` sampled some of its rounds (exploration samples every round), the
    # fixed arm none and verified only the widest tree; `auto`'s narrower rounds are a part of its counted ones
    assert 0 < tallies["sampled_rounds"]["auto"] <= tallies["rounds"]["auto"]
    assert tallies["sampled_rounds"]["fixed"] == 0 and tallies["narrower_rounds"]["fixed"] == 0
    assert tallies["narrower_rounds"]["auto"] <= tallies["rounds"]["auto"]
    assert tallies["narrower_request_rounds"]["auto"] <= tallies["request_rounds"]["auto"]


def _metric_values(server, name):
    """{labels text: value} of one metric in the server's /metrics (every sample of it)."""
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(re.escape(name) + r'(\{[^}]*\}) ([0-9.e+-]+)', text)}


def _observations(server):
    return sum(_metric_values(server, "sglang:ddtree_calibration_observations").values())


def _decode_until_published(server, model_pair, attempts=8):
    """Greedy 512-token requests one at a time until the calibration gauges show observations (published at most
    once in stats.TableGauges.SECONDS; the first check of a server and the one EVERY rounds after a
    reset publish at once): -> the number of requests sent."""
    params = {"temperature": 0.0, "max_new_tokens": 512, "ignore_eos": True}
    for sent in range(1, attempts + 1):
        server.generate(**prompt(model_pair, sent % BATCH), sampling_params=params)
        if _observations(server) > 0:
            return sent
    return None


def _post(server, path, body=None, attempts=20):
    """POST JSON (or nothing) to the server, retried while it answers 400 (/flush_cache with requests in flight):
    -> the decoded body, or None."""
    data = None if body is None else json.dumps(body).encode()
    for _ in range(attempts):
        request = urllib.request.Request(server.base_url + path, data=data, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as resp:
                return resp.read().decode()
        except urllib.error.HTTPError:
            time.sleep(0.5)
    return None


@pytest.mark.parametrize("name", AUTO_NAMES)
def test_auto_calibration_table_is_scored_exported_and_resettable(servers, outputs, model_pair, gpu_record, name):
    """`auto`'s calibration table in the server (sglang_ddtree.sglang.auto.CalibrationMonitor): sampled rounds score
    the raw and the calibrated predictions of the committed tokens (both exported, with their request-round count),
    the table's cells are published as gauges; /flush_cache leaves it alone (benchmark harnesses flush between
    runs) and POST /set_internal_state {"server_args": {"ddtree_calibration_reset": 1}} empties it (gauges back to
    0 observations and ratio 1), after which it learns again. The MAEs are recorded: the server's own
    raw-against-calibrated measure."""
    need(servers, name)
    server = servers[name]
    sent = _decode_until_published(server, model_pair)
    errors = _metric_values(server, "sglang:ddtree_auto_tau_abs_error_total")
    scored = sum(_metric_values(server, "sglang:ddtree_auto_tau_scored_total").values())
    raw = sum(v for k, v in errors.items() if 'scores="raw"' in k)
    calibrated = sum(v for k, v in errors.items() if 'scores="calibrated"' in k)
    gated = sum(v for k, v in errors.items() if 'scores="gated"' in k)
    ratios = _metric_values(server, "sglang:ddtree_calibration_ratio")
    gpu_record("ddtree_auto_calibration", config=name, scored_request_rounds=scored, requests_to_publish=sent,
               tau_mae_raw=raw / scored if scored else None, tau_mae_calibrated=calibrated / scored if scored else None,
               tau_mae_gated=gated / scored if scored else None,
               cells=len(ratios), observations=_observations(server))
    assert sent is not None, "the calibration gauges never showed observations"
    assert scored > 0 and raw > 0 and calibrated > 0 and gated > 0, errors
    assert ratios and any(abs(r - 1.0) > 1e-3 for r in ratios.values()), ratios  # the table learnt something
    assert _post(server, "/flush_cache") is not None, "/flush_cache did not succeed"
    assert _observations(server) > 0  # a flush is not a reset
    answer = _post(server, "/set_internal_state", {"server_args": {"ddtree_calibration_reset": 1}})
    assert answer is not None and json.loads(answer) == [True], answer
    assert _observations(server) == 0
    assert all(r == 1.0 for r in _metric_values(server, "sglang:ddtree_calibration_ratio").values())
    assert "DDTREE auto: calibration table reset" in server.log_text()
    assert _decode_until_published(server, model_pair) is not None  # learning again after the reset


def chi_square_two_sample(counts_a, counts_b):
    keys = set(counts_a) | set(counts_b)
    na, nb = sum(counts_a.values()), sum(counts_b.values())
    stat, dof = 0.0, -1
    pooled_small = [0, 0]
    for k in keys:
        a, b = counts_a.get(k, 0), counts_b.get(k, 0)
        if a + b < 10:  # merge rare categories
            pooled_small[0] += a
            pooled_small[1] += b
            continue
        ea, eb = (a + b) * na / (na + nb), (a + b) * nb / (na + nb)
        stat += (a - ea) ** 2 / ea + (b - eb) ** 2 / eb
        dof += 1
    if sum(pooled_small) > 0:
        a, b = pooled_small
        ea, eb = (a + b) * na / (na + nb), (a + b) * nb / (na + nb)
        stat += (a - ea) ** 2 / ea + (b - eb) ** 2 / eb
        dof += 1
    return stat, max(dof, 1)


LONG_NEW_TOKENS = 256
LONG_REQUESTS = 16


def long_prompts(pair):
    """16 distinct prompts (the 8 of serving_common and each with a trailing newline), one request each."""
    base = [prompt(pair, i) for i in range(BATCH)]
    if pair.dummy:
        return base + [{"input_ids": p["input_ids"] + [15]} for p in base]
    return base + [{"text": p["text"] + "\n"} for p in base]


@pytest.fixture(scope="module")
def long_outputs(servers, model_pair):
    """256-token greedy outputs of 16 requests sent as one batch (at most 8 run at once: requests join and leave
    mid-flight), per server; plain also one request at a time with top-2 log-probs, the reference for the tie rule.
    Earlier 8B sweep rows saw about half the requests at batch 4-64 end with a different output from DFLASH's,
    for fixed budgets and auto alike; this says whether those are ties."""
    prompts = long_prompts(model_pair)
    params = {"temperature": 0.0, "max_new_tokens": LONG_NEW_TOKENS, "ignore_eos": True}
    key = "input_ids" if model_pair.dummy else "text"
    results = {"plain_bs1": [servers["plain"].generate(**p, sampling_params=params, return_logprob=True,
                                                        top_logprobs_num=2) for p in prompts]}

    def run(name):
        out = servers[name].generate(**{key: [p[key] for p in prompts]}, sampling_params=params)
        assert isinstance(out, list) and len(out) == LONG_REQUESTS
        return name, out

    names = [n for n in ["plain", "dflash", "ddtree-64", *AUTO_NAMES] if n in servers]
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        results.update(dict(pool.map(run, names)))
    return results


@pytest.mark.parametrize("name", ["plain", "dflash", "ddtree-64", *AUTO_NAMES])
def test_long_outputs_of_a_batch_equal_plain_up_to_ties(servers, long_outputs, name, gpu_record):
    """256 tokens, 16 requests in one batch: output == plain decoding one request at a time, except at a near-tie
    of plain's own top-2 log-probs (TIE_NATS). Plain itself in a batch and DFLASH are the controls: batching alone
    changes bf16 rounding."""
    need(servers, name)
    exact, ties, failures = compare(long_outputs["plain_bs1"], long_outputs[name], TIE_NATS)
    gpu_record("long_batch_equality", config=name, requests=LONG_REQUESTS, new_tokens=LONG_NEW_TOKENS, exact=exact,
               ties=ties, failures=failures)
    assert not failures, f"{name}: differences from plain beyond near-ties:\n" + "\n".join(map(str, failures))


def chi2_critical(dof, z=3.09):
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize("name", ["ddtree-64", *AUTO_NAMES, "ddtree-auto-chain"])
def test_sampling_matches_plain_sampling(servers, model_pair, gpu_record, name):
    need(servers, name)
    n = 400
    params = {"temperature": 1.0, "top_p": 0.95, "max_new_tokens": 3, "ignore_eos": True}
    p = prompt(model_pair, 3)
    many = {k: [v] * n for k, v in p.items()}

    def tokens(server):
        out = server.generate(**many, sampling_params=params)
        return [o["output_ids"] for o in out]

    plain, tree = tokens(servers["plain"]), tokens(servers[name])
    results = {}
    for pos in range(3):
        ca, cb = {}, {}
        for seq in plain:
            ca[seq[pos]] = ca.get(seq[pos], 0) + 1
        for seq in tree:
            cb[seq[pos]] = cb.get(seq[pos], 0) + 1
        stat, dof = chi_square_two_sample(ca, cb)
        results[pos] = {"stat": round(stat, 2), "dof": dof, "critical": round(chi2_critical(dof), 2),
                        "distinct_plain": len(ca), "distinct_ddtree": len(cb)}
    gpu_record("ddtree_sampling_chi2", config=name, mode=model_pair.mode, samples=n, results=results)
    for pos, r in results.items():
        assert r["stat"] < r["critical"], f"position {pos}: DDTREE sampling differs from plain: {r}"
    assert results[0]["distinct_plain"] > 1, "the prompt's first token is not random at T=1: test is vacuous"


@pytest.mark.parametrize("name", ["ddtree-64", "ddtree-auto"])
def test_no_kv_leak_after_mixed_and_aborted_requests(servers, model_pair, gpu_record, name):
    need(servers, name)
    server = servers[name]
    idle_tokens, idle_reqs = used_tokens(server)
    assert idle_reqs == 0
    tokens, reqs, kinds = mixed_and_aborted_load(server, lambda i: prompt(model_pair, i % BATCH))
    gpu_record("kv_leak", config=name, idle_tokens=idle_tokens, after_tokens=tokens, after_reqs=reqs, kinds=kinds)
    assert reqs == 0, f"{reqs} requests still running 60 s after the load ended"
    assert tokens == idle_tokens, f"KV leak: {tokens - idle_tokens} tokens still in use after the load"
    assert kinds.get("aborted", 0) > 0, f"no request was really aborted: {kinds}"
    assert server.proc.poll() is None, "the server died (SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE raises on leaks)"
