"""DDTREE on a hybrid target in SGLang: a random-weight Qwen3-Next (3 gated-delta-net layers + 1
attention layer, written by transformers on the device, no download) served plain and with DDTREE.

The drafter is random, so without help nothing would be accepted and the recurrent-state commit would only ever
take the root. The DDTREE servers therefore run with scripted drafts (SGLANG_DDTREE_TEST_SCRIPT, see
sglang_ddtree/sglang/scripted.py): the target's greedy continuation (transformers, float32, same weights), put at
rank 0 ("top"), rank 1 ("branch": the walk must take a non-first sibling) or left out ("miss") per output
position. The reference is the model itself in float32 (transformers on the CPU): the bf16 servers, plain
decoding included, approximate it (plain decoding's tokens were up to 1.03 nats below its choices in one GPU run).
The checks, at batch 1, 4 and 8, budgets 16 / 64 (CUDA graphs) and 16 eager (any
hybrid-ddtree-<budget>[-eager][-oracle] on request, DDTREE_HYBRID_CONFIGS):
  - output == plain decoding, except where the float32 model rates DDTREE's token at the first difference no
    worse than plain's (or within FP32_TOL_NATS of its best);
  - every DDTREE token teacher-forced on the float32 model is no further from its choice than plain decoding's
    own tokens are (which also covers what follows a first difference);
  - the rounds really accepted deep paths and branches (rounds accepting >= 4 drafts, branch tokens from
    meta_info), so a wrong committed state (e.g. DFLASH's chain step instead of the accepted node) would show;
  - the batch-1 time per verify round of each budget, wall and stage split (recorded; scripted drafts sync
    every round).
The sequential oracle is the offline one (sglang_ddtree/offline/hybrid.py, tests/test_offline_hybrid.py).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import time

import pytest
from serving_common import COMMON, ID_PROMPTS, compare

# Near-tie tolerance of plain's own log-probs when a first difference is classified: two bf16 steps of this model's
# logits (0.25 nats each at their magnitude, seen on the served model).
FORCED_TOL_NATS = 0.5
# How far below the float32 model's choice a token may be and still count as bf16 numerics: bf16 greedy outputs of
# this model under CPU transformers strayed up to 1.6 nats (8 prompts x 64 tokens, hybrid_model_conditioning_cpu.json
# in benchmarks/results); the checks
# take the larger of this and what plain decoding on the server shows. A wrong recurrent state after an accepted
# branch would put the tokens that follow far below the model's choice (the corrupted-output check records how far).
FP32_TOL_NATS = float(os.environ.get("DDTREE_HYBRID_FP32_TOL", "2.0"))
MAX_NEW = 64
PATTERN = ["top", "top", "branch", "top", "top", "top", "branch", "top", "branch", "top", "top", "miss"]
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
# bf16 (float32 servers do not start on the pinned stack: no float32 rmsnorm in sgl_kernel). The earlier, top-2
# routed random model's logits are large enough that bf16 steps are 0.25-0.5 nats and plain decoding itself has exact
# top-2 ties; every first difference from plain fell on such a gap (<= 0.5 nats, one outside plain's top 2), after
# identical stretches of up to 59 tokens through rounds accepting 6-11 drafts with branches. Teacher
# forcing on plain's own prefill does not settle it (plain's decoded tokens fall outside its prefill's top 5 at
# some position for 3 of 8 prompts); the float32 model does.
HYBRID_ARGS = ["--skip-tokenizer-init", "--attention-backend", "triton", "--max-mamba-cache-size", "64"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory, sglang_env):
    from fixtures.hybrid_models import save_sglang_hybrid_pair

    return save_sglang_hybrid_pair(tmp_path_factory.mktemp("hybrid-pair"))


def ddtree_args(pair, budget, *extra):
    target, drafter = pair
    return (["--model-path", str(target)] + COMMON + HYBRID_ARGS
            + ["--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget", str(budget),
               "--speculative-draft-model-path", str(drafter), "--enable-metrics", *extra])


MODES = ("bs1", "bs4", "bs8")


def metrics(server):
    import urllib.request

    from ddtree_bench import prom

    with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as resp:
        return prom.parse(resp.read().decode())


def generate_all(server, logprobs=False):
    """The prompts one at a time (bs1), as two batches of 4 (bs4) and as one batch of 8 (bs8)."""
    extra = {"return_logprob": True, "top_logprobs_num": 5} if logprobs else {}
    bs1 = [server.generate(input_ids=p, sampling_params=GREEDY, **extra) for p in ID_PROMPTS]
    bs4 = [o for half in (ID_PROMPTS[:4], ID_PROMPTS[4:]) for o in server.generate(input_ids=half,
                                                                                    sampling_params=GREEDY)]
    bs8 = server.generate(input_ids=ID_PROMPTS, sampling_params=GREEDY)
    assert isinstance(bs8, list) and len(bs8) == len(ID_PROMPTS) == len(bs4)
    return {"bs1": bs1, "bs4": bs4, "bs8": bs8}


def timed_bs1(server):
    """The batch-1 loop once more, alone on the GPU (the caller runs one server at a time): its wall seconds, its
    outputs and the DDTREE round's stage split over it (Prometheus, GPU-event times per round). An earlier version
    timed the concurrent runs instead, with six servers sharing the GPU: those times were the neighbours' as much as
    their own."""
    from ddtree_bench import prom

    before = metrics(server)
    t0 = time.perf_counter()
    outputs = [server.generate(input_ids=p, sampling_params=GREEDY) for p in ID_PROMPTS]
    seconds = time.perf_counter() - t0
    return {"outputs": outputs, "seconds": seconds, "stages": prom.ddtree_summary(prom.diff(metrics(server), before))}


@pytest.fixture(scope="module")
def exact(pair):
    """The target in float32 under transformers on the CPU: the reference for what the model computes (the bf16
    servers, plain decoding included, approximate it). Not on the GPU: there cuDNN runs the gated-delta-net's conv
    in TF32 by default, and in one GPU run that "float32" greedy output (of the earlier, top-2 routed model) strayed up
    to 24 nats from the CPU float32 model's choices (hybrid_model_conditioning_cpu.json)."""
    import torch
    from transformers import Qwen3NextForCausalLM

    target, _ = pair
    return Qwen3NextForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def script(exact, tmp_path_factory, gpu_record):
    """The scripted drafts' truth: the float32 model's greedy continuation, so the DDTREE servers can start next to
    the plain one. It only steers acceptance; what the outputs are judged by is below."""
    import torch

    continuations = []
    with torch.no_grad():
        for p in ID_PROMPTS:
            out = exact.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False,
                                 attention_mask=torch.ones(1, len(p), dtype=torch.long))
            continuations.append({"prompt": p, "output": out[0, len(p):].tolist()})
    gpu_record("hybrid_fp32_greedy", outputs=[c["output"] for c in continuations])
    path = tmp_path_factory.mktemp("hybrid-script") / "script.json"
    path.write_text(json.dumps({"pattern": PATTERN, "continuations": continuations}))
    return path


def fp32_gaps(exact, prompt, output):
    """Teacher forcing on the float32 model: per output position, its best log-prob minus the output token's given
    the output's own prefix (0 = the exact model's argmax). One forward over prompt + output."""
    import torch

    ids = torch.tensor([list(prompt) + list(output)])
    with torch.no_grad():
        logprobs = exact(ids).logits[0, len(prompt) - 1: len(prompt) - 1 + len(output)].float().log_softmax(-1)
    chosen = logprobs.gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1)
    return (logprobs.max(dim=-1).values - chosen).tolist()


# Budgets above 64 only on request: SGLang's tree conv kernel unrolls over the B+1 nodes (tl.static_range), and its
# verify-graph capture took 108 s at B=64 and had not finished after 5 minutes at B=256; with our tree
# conv (sglang_ddtree/tree_conv.py) 128 with graphs and 256 eager start in ~2 minutes.
EAGER = "--disable-cuda-graph"
ORACLE = "--speculative-ddtree-oracle"
DEFAULT_CONFIGS = "hybrid-ddtree-16,hybrid-ddtree-64,hybrid-ddtree-16-eager"
CONFIG_NAME = re.compile(r"hybrid-ddtree-(\d+)(-eager)?(-oracle)?")


def config_args(name: str) -> tuple:
    """hybrid-ddtree-<budget>[-eager][-oracle] -> (budget, extra server args...)."""
    m = CONFIG_NAME.fullmatch(name)
    if m is None:
        raise ValueError(f"DDTREE_HYBRID_CONFIGS: {name!r} is not hybrid-ddtree-<budget>[-eager][-oracle]")
    return (int(m[1]),) + ((EAGER,) if m[2] else ()) + ((ORACLE,) if m[3] else ())


CONFIGS = {n: config_args(n) for n in os.environ.get("DDTREE_HYBRID_CONFIGS", DEFAULT_CONFIGS).split(",")}


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
    """Every config's outputs (all servers at once), then each config's batch-1 loop timed alone, one server after
    the other ("timed_bs1")."""
    servers = {n: servers[n] for n in CONFIGS}

    def run(name):
        server = servers[name]
        if not hasattr(server, "generate"):
            return name, server  # its start error
        return name, generate_all(server)

    with concurrent.futures.ThreadPoolExecutor(len(servers)) as pool:
        results = dict(pool.map(run, servers))
    for name, res in results.items():
        if isinstance(res, dict):
            res["timed_bs1"] = timed_bs1(servers[name])
    return results


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hybrid_ddtree_equals_plain_up_to_what_the_fp32_model_explains(name, plain, ddtree_outputs, exact,
                                                                       gpu_record):
    """DDTREE == plain decoding token for token, except where the exact (float32) model says the difference is
    plain's numerics, not DDTREE's: at the first difference (same prefix for both), the float32 model must rate
    DDTREE's token no worse than plain's or within FP32_TOL_NATS of its own best. A GPU run showed why plain alone
    cannot be the judge: at one first difference plain's bf16 decode chose a token 3.4 nats below the float32
    model's choice, which DDTREE chose (with the earlier, top-2 routed model). Also required: rounds that accepted
    deep paths and branches."""
    res = ddtree_outputs[name]
    if not isinstance(res, dict):
        pytest.fail(f"{name} did not start:\n{res}", pytrace=False)
    report, failures = {}, []
    for mode in MODES:
        exact_count, ties, fails = compare(plain["bs1"], res[mode], FORCED_TOL_NATS)
        judged = []
        for info in ties + fails:
            if not isinstance(info, dict):  # not a token difference (e.g. lengths differ): nothing to judge
                failures.append(f"{mode}: {info}")
                continue
            i, pos = info["prompt"], info["position"]
            ours = fp32_gaps(exact, ID_PROMPTS[i], res[mode][i]["output_ids"][: pos + 1])[-1]
            theirs = fp32_gaps(exact, ID_PROMPTS[i], plain["bs1"][i]["output_ids"][: pos + 1])[-1]
            entry = {**info, "fp32_gap_ddtree": round(ours, 4), "fp32_gap_plain": round(theirs, 4)}
            judged.append(entry)
            if ours > max(theirs, FP32_TOL_NATS):
                failures.append(f"{mode}: {entry}")
        report[mode] = {"exact": exact_count, "differences": judged}
    metas = [o["meta_info"] for o in res["bs1"]]
    rounds = sum(m["spec_verify_ct"] for m in metas)
    tau = sum(m["completion_tokens"] for m in metas) / rounds
    branch = sum(m.get("ddtree_branch_tokens", 0) for m in metas)
    deep = max((m.get("ddtree_accept_rate_by_depth") or [0.0] * 4)[3] for m in metas)
    gpu_record("hybrid_greedy_equality", config=name, tau_bs1=round(tau, 4), rounds_bs1=rounds,
               branch_tokens_bs1=branch, seconds_bs1_alone=round(res["timed_bs1"]["seconds"], 3), **report,
               outputs_bs1=[o["output_ids"] for o in res["bs1"]], plain_bs1=[o["output_ids"] for o in plain["bs1"]])
    # The script puts the truth in the tree at most depths until an output leaves the scripted path (acceptance
    # then drops to the bonus): rounds accepting >= 4 drafts and non-first siblings must have happened, or the
    # recurrent-state commit was not exercised.
    assert deep > 0, f"{name}: no round accepted 4 drafts (tau {tau:.2f}): the scripted drafts were not accepted"
    assert branch > 0, f"{name}: no non-first sibling accepted: the branch commit was not exercised"
    assert not failures, f"{name}: differences from plain the float32 model does not explain:\n" + "\n".join(failures)


def test_hybrid_step_times(ddtree_outputs, gpu_record):
    """Batch-1 time per verify round of each configuration, each measured alone on the GPU, recorded: the wall time
    (the batch-1 loop's seconds / its rounds, prefill and HTTP included) and the round's stage split from the
    server's Prometheus histograms (CUDA events; `between` holds the host gaps, which the scripted drafts' host sync
    every round inflates; with the oracle, `walk` holds its chain re-verify). No speed claim; checked: both exist
    and are sane, the verify stage ran in every round, and the timed loop gave the outputs the first one gave."""
    times, splits, failures = {}, {}, []
    for name, res in ddtree_outputs.items():
        if isinstance(res, dict):
            timed = res["timed_bs1"]
            rounds = sum(o["meta_info"]["spec_verify_ct"] for o in timed["outputs"])
            times[name] = round(1000 * timed["seconds"] / max(rounds, 1), 3)
            split = timed["stages"] or {}
            splits[name] = {"stage_ms": {k: round(v, 4) for k, v in (split.get("stage_ms") or {}).items()},
                            "batch_rounds": split.get("batch_rounds")}
            same = [a["output_ids"] == b["output_ids"] for a, b in zip(timed["outputs"], res["bs1"])]
            if not all(same):
                failures.append(f"{name}: the timed batch-1 loop differs from the first at prompts "
                                f"{[i for i, ok in enumerate(same) if not ok]}")
    gpu_record("hybrid_round_ms", per_config=times, stage_split_bs1=splits, measured="one server at a time")
    assert times and all(0 < t < 1000 for t in times.values()), times
    for name, split in splits.items():
        assert split["stage_ms"].get("verify", 0) > 0 and split["batch_rounds"], (name, split)
    assert not failures, "\n".join(failures)


def worst(gaps):
    return max(gaps) if gaps else 0.0


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hybrid_ddtree_is_as_faithful_to_the_fp32_model_as_plain_decoding(name, plain, ddtree_outputs, exact,
                                                                          gpu_record):
    """Every DDTREE output token (batch 1, 4 and 8), not only up to the first difference, teacher-forced on the float32
    model (its log-probs given DDTREE's own prefix): the worst gap from its choice must not exceed what plain bf16
    decoding shows on its own outputs (or FP32_TOL_NATS); shown able to fail on a corrupted output. A wrong
    recurrent state after an accepted branch would put later tokens far below the model's choice.
    (Teacher forcing on the plain server's own prefill is no reference here: in a GPU run, plain decoding's own tokens
    were outside its prefill's top 5 at some position for 3 of 8 prompts.)"""
    res = ddtree_outputs[name]
    if not isinstance(res, dict):
        pytest.fail(f"{name} did not start:\n{res}", pytrace=False)
    plain_gaps = [fp32_gaps(exact, p, o["output_ids"]) for p, o in zip(ID_PROMPTS, plain["bs1"])]
    bound = max(max(worst(g) for g in plain_gaps), FP32_TOL_NATS)

    def stats(gaps_list):
        flat = [g for gaps in gaps_list for g in gaps]
        return {"worst": round(max(flat), 4), "at_argmax": round(sum(g == 0.0 for g in flat) / len(flat), 4),
                "over_tol": sum(g > FP32_TOL_NATS for g in flat), "positions": len(flat)}

    report, failures = {"plain": stats(plain_gaps), "bound_nats": round(bound, 4)}, []
    for mode in MODES:
        gaps = [fp32_gaps(exact, p, o["output_ids"]) for p, o in zip(ID_PROMPTS, res[mode])]
        report[mode] = stats(gaps)
        for i, g in enumerate(gaps):
            if worst(g) > bound:
                k = max(range(len(g)), key=g.__getitem__)
                failures.append(f"{mode} prompt {i}: position {k} is {g[k]:.3f} nats below the float32 model's choice")
    # the check can fail: plain's output with every token replaced by the next one's is far from the model's choices
    corrupted = [worst(fp32_gaps(exact, p, o["output_ids"][1:] + o["output_ids"][:1]))
                 for p, o in zip(ID_PROMPTS[:2], plain["bs1"][:2])]
    gpu_record("hybrid_fp32_teacher_forced", config=name, tol_nats=FP32_TOL_NATS, corrupted_worst=corrupted,
               **report)
    assert all(w > bound for w in corrupted), f"the check would not catch a corrupted output: {corrupted} vs {bound}"
    assert not failures, f"{name}: further from the float32 model than plain decoding:\n" + "\n".join(failures)


@pytest.mark.parametrize("name", [n for n in CONFIGS if ORACLE in CONFIGS[n]])
def test_hybrid_oracle_rechecks_every_round_against_a_chain_verify(name, servers, ddtree_outputs, gpu_record):
    """--speculative-ddtree-oracle (on request, DDTREE_HYBRID_CONFIGS): each round's accepted path is verified
    once more as a chain from the pre-round state (conv state restored) and the round commits what that chain
    verify accepts; the server logs how many greedy request-rounds the tree verify's accepted drafts or bonus
    differed from it. The output checks above apply to it as to every config; here: the oracle really ran on
    enough rounds, and its disagreement count and its outputs against the fast config of the same budget are
    recorded (bf16 near-ties can make the two verifies differ)."""
    from sglang_ddtree.sglang.modes import ORACLE_LOG

    res = ddtree_outputs[name]
    if not isinstance(res, dict):
        pytest.fail(f"{name} did not start:\n{res}", pytrace=False)
    found = re.findall(r"DDTREE oracle: (\d+) of (\d+) greedy request-rounds differ", servers[name].log_text())
    assert found, f"{name}: no oracle line in the server log"
    differ, checked = (int(x) for x in found[-1])
    fast = ddtree_outputs.get(name.removesuffix("-oracle"))
    same_as_fast = None
    if isinstance(fast, dict):
        same_as_fast = {m: sum(a["output_ids"] == b["output_ids"] for a, b in zip(res[m], fast[m])) for m in MODES}
    gpu_record("hybrid_oracle", config=name, differ=differ, checked=checked, outputs_equal_to_fast=same_as_fast)
    assert checked >= ORACLE_LOG, (checked, differ)
    # A tree path that committed a wrong state or misread a branch would differ on most rounds that accept one (the
    # scripted drafts put every third accepted token on a non-first sibling). bf16 near-ties explain a few: plain
    # and DDTREE outputs first differed at such ties about once per 70 tokens in earlier GPU runs, so one request-round
    # in 20 is a generous bound for numerics and far below what a wrong path would give.
    assert differ <= max(2, checked // 20), f"{name}: {differ} of {checked} request-rounds differ from the chain"
