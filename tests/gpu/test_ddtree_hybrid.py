"""DDTREE on a hybrid target in SGLang (issue 7): a random-weight Qwen3-Next (3 gated-delta-net layers + 1
attention layer, written by transformers on the device, no download) served plain and with DDTREE.

The drafter is random, so without help nothing would be accepted and the recurrent-state commit would only ever
take the root. The DDTREE servers therefore run with scripted drafts (SGLANG_DDTREE_TEST_SCRIPT, see
sglang_ddtree/sglang/scripted.py): plain decoding's own greedy continuation, put at rank 0 ("top"), rank 1
("branch": the walk must take a non-first sibling) or left out ("miss") per output position. The checks:
  - output == plain decoding, token for token (differences allowed only at plain's own top-2 near-ties), at
    batch 1 and batch 8, budgets 16 / 64 (CUDA graphs) and 16 eager;
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
MAX_NEW = 64
PATTERN = ["top", "top", "branch", "top", "top", "top", "branch", "top", "branch", "top", "top", "miss"]
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
# bf16 (float32 servers do not start on the pinned stack: no float32 rmsnorm in sgl_kernel). Lease 10: this
# random model's logits are large enough that bf16 steps are 0.25-0.5 nats and plain decoding itself has exact
# top-2 ties; every first difference from plain fell on such a gap (<= 0.5 nats, one outside plain's top 2), after
# identical stretches of up to 59 tokens through rounds accepting 6-11 drafts with branches. What would settle it
# (not done): a teacher-forced check of every position against plain's own log-probs on DDTREE's prefix.
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
def script(pair, tmp_path_factory):
    """The scripted drafts' truth: transformers' own greedy continuation of the saved target (float32, on the GPU),
    so the DDTREE servers can start next to the plain one. It only steers acceptance; the reference the outputs
    are compared with is the plain server."""
    import torch
    from transformers import Qwen3NextForCausalLM

    target, _ = pair
    model = Qwen3NextForCausalLM.from_pretrained(str(target), dtype=torch.float32).cuda().eval()
    continuations = []
    with torch.no_grad():
        for p in ID_PROMPTS:
            out = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=MAX_NEW, do_sample=False,
                                 attention_mask=torch.ones(1, len(p), dtype=torch.long, device="cuda"))
            continuations.append({"prompt": p, "output": out[0, len(p):].tolist()})
    del model
    torch.cuda.empty_cache()
    path = tmp_path_factory.mktemp("hybrid-script") / "script.json"
    path.write_text(json.dumps({"pattern": PATTERN, "continuations": continuations}))
    return path


# No budget 256: SGLang's tree conv kernel unrolls over the B+1 nodes (tl.static_range), and its verify-graph
# capture took 108 s at B=64 and had not finished after 5 minutes at B=256 (lease 10).
CONFIGS = {"hybrid-ddtree-16": (16,), "hybrid-ddtree-64": (64,), "hybrid-ddtree-16-eager": (16, "--disable-cuda-graph")}
if os.environ.get("DDTREE_HYBRID_CONFIGS"):  # a subset, e.g. for a short lease
    CONFIGS = {n: CONFIGS[n] for n in os.environ["DDTREE_HYBRID_CONFIGS"].split(",")}


@pytest.fixture(scope="module")
def servers(sglang_servers, pair, script):
    target, _ = pair
    configs = {"hybrid-plain": ["--model-path", str(target)] + COMMON + HYBRID_ARGS}
    configs.update({n: ddtree_args(pair, *a) for n, a in CONFIGS.items()})
    # one parallel start; the script variable only matters to DDTREE servers
    return sglang_servers(configs, env={"SGLANG_DDTREE_TEST_SCRIPT": str(script)}, all_or_nothing=False)


@pytest.fixture(scope="module")
def plain(servers):
    server = servers["hybrid-plain"]
    if not hasattr(server, "generate"):
        pytest.fail(f"the plain server did not start:\n{server}", pytrace=False)
    return generate_all(server, logprobs=True)


@pytest.fixture(scope="module")
def ddtree_outputs(servers, plain):
    servers = {n: servers[n] for n in CONFIGS}

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
