"""DDTREE on a hybrid target in SGLang (issue 7): a random-weight Qwen3-Next (3 gated-delta-net layers + 1
attention layer, written by transformers on the device, no download) served plain and with DDTREE.

The drafter is random, so without help nothing would be accepted and the recurrent-state commit would only ever
take the root. The DDTREE servers therefore run with scripted drafts (SGLANG_DDTREE_TEST_SCRIPT, see
sglang_ddtree/sglang/scripted.py): plain decoding's own greedy continuation, put at rank 0 ("top"), rank 1
("branch": the walk must take a non-first sibling) or left out ("miss") per output position. The checks:
  - output == plain decoding, token for token (differences allowed only at plain's own top-2 near-ties), at
    batch 1 and batch 8, budgets 16 / 64 (CUDA graphs), 16 eager, 256;
  - the rounds really accepted deep paths and branches (mean accepted length, branch tokens from meta_info),
    so a wrong committed state (e.g. DFLASH's chain step instead of the accepted node) would have shown;
  - the step time per round of each budget, from the scheduler's own counters (recorded, committed).
The sequential oracle of the issue is the offline one (sglang_ddtree/offline/hybrid.py, tests/test_offline_hybrid.py);
here plain decoding by the same server stack is the reference.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import time

import pytest
from serving_common import COMMON, ID_PROMPTS, compare

TIE_NATS = float(os.environ.get("DDTREE_TIE_NATS", "0.25"))
MAX_NEW = 96
PATTERN = ["top", "top", "branch", "top", "top", "top", "branch", "top", "branch", "top", "top", "miss"]
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
HYBRID_ARGS = ["--skip-tokenizer-init", "--attention-backend", "triton", "--max-mamba-cache-size", "64"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory, sglang_env):
    from fixtures.hybrid_models import save_sglang_hybrid_pair

    return save_sglang_hybrid_pair(tmp_path_factory.mktemp("hybrid-pair"))


def ddtree_args(pair, budget, *extra):
    target, drafter = pair
    return (["--model-path", str(target)] + COMMON + HYBRID_ARGS
            + ["--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget", str(budget),
               "--speculative-draft-model-path", str(drafter), *extra])


def generate_all(server, logprobs=False):
    extra = {"return_logprob": True, "top_logprobs_num": 2} if logprobs else {}
    t0 = time.perf_counter()
    bs1 = [server.generate(input_ids=p, sampling_params=GREEDY, **extra) for p in ID_PROMPTS]
    seconds_bs1 = time.perf_counter() - t0
    bs8 = server.generate(input_ids=ID_PROMPTS, sampling_params=GREEDY)
    assert isinstance(bs8, list) and len(bs8) == len(ID_PROMPTS)
    return {"bs1": bs1, "bs8": bs8, "seconds_bs1": seconds_bs1}


@pytest.fixture(scope="module")
def plain(sglang_servers, pair):
    target, _ = pair
    server = sglang_servers({"hybrid-plain": ["--model-path", str(target)] + COMMON + HYBRID_ARGS})["hybrid-plain"]
    return generate_all(server, logprobs=True)


CONFIGS = {"hybrid-ddtree-16": (16,), "hybrid-ddtree-64": (64,), "hybrid-ddtree-16-eager": (16, "--disable-cuda-graph"),
           "hybrid-ddtree-256": (256,)}


@pytest.fixture(scope="module")
def ddtree_outputs(sglang_servers, pair, plain, tmp_path_factory):
    script = tmp_path_factory.mktemp("hybrid-script") / "script.json"
    script.write_text(json.dumps({"pattern": PATTERN, "continuations": [
        {"prompt": p, "output": o["output_ids"]} for p, o in zip(ID_PROMPTS, plain["bs1"])]}))
    servers = sglang_servers({n: ddtree_args(pair, *a) for n, a in CONFIGS.items()},
                             env={"SGLANG_DDTREE_TEST_SCRIPT": str(script)}, all_or_nothing=False)

    def run(name):
        server = servers[name]
        if not hasattr(server, "generate"):
            return name, server  # its start error
        return name, generate_all(server)

    with concurrent.futures.ThreadPoolExecutor(len(servers)) as pool:
        return dict(pool.map(run, servers))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hybrid_ddtree_equals_plain_with_deep_and_branch_acceptance(name, plain, ddtree_outputs, gpu_record):
    res = ddtree_outputs[name]
    if not isinstance(res, dict):
        pytest.fail(f"{name} did not start:\n{res}", pytrace=False)
    report, failures = {}, []
    for mode in ("bs1", "bs8"):
        exact, ties, fails = compare(plain["bs1"], res[mode], TIE_NATS)
        report[mode] = {"exact": exact, "ties": ties, "failures": fails}
        failures += [f"{mode}: {f}" for f in fails]
    metas = [o["meta_info"] for o in res["bs1"]]
    rounds = sum(m["spec_verify_ct"] for m in metas)
    tau = sum(m["completion_tokens"] for m in metas) / rounds
    branch = sum(m.get("ddtree_branch_tokens", 0) for m in metas)
    gpu_record("hybrid_greedy_equality", config=name, tau_bs1=round(tau, 4), rounds_bs1=rounds,
               branch_tokens_bs1=branch, seconds_bs1=round(res["seconds_bs1"], 3), **report)
    assert not failures, f"{name} differs from plain decoding:\n" + "\n".join(map(str, failures))
    # The script puts the truth in the tree at most depths: a server that commits the wrong recurrent state goes
    # off plain's path (caught above); one that never accepts anything would leave the state commit untested.
    assert tau > 2.5, f"{name}: {tau:.2f} tokens per round: the scripted drafts were not accepted"
    assert branch > 0, f"{name}: no non-first sibling accepted: the branch commit was not exercised"


def test_hybrid_step_times(ddtree_outputs, gpu_record):
    """Batch-1 wall time per verify round of each budget (the batch-1 loop's seconds / its rounds, prefill and HTTP
    included), recorded; a sanity bound only, no speed claim: the scripted drafts sync with the host every round."""
    times = {}
    for name, res in ddtree_outputs.items():
        if isinstance(res, dict):
            rounds = sum(o["meta_info"]["spec_verify_ct"] for o in res["bs1"])
            times[name] = round(1000 * res["seconds_bs1"] / max(rounds, 1), 3)
    gpu_record("hybrid_round_ms", per_config=times)
    assert times and all(0 < t < 1000 for t in times.values()), times
