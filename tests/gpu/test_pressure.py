"""A KV pool under pressure: DDTREE stays lossless when SGLang retracts running requests and resumes them later,
and the pool goes back to idle afterwards.

Servers (the module's model pair, the tiny pair by default; text prompts, so not the dummy configs):
  - plain: the reference, a pool with room to spare, one request at a time with its top-2 log-probs;
  - ddtree-pressure: DDTREE at the default budget with a KV pool that holds about half of what the 16 requests sent
    at once will need (prompt + NEW_TOKENS + a round's reserve each), so that SGLang admits them on its estimate of
    their remaining tokens and retracts running requests once the pool is full ("KV cache pool is full. Retract
    requests." in its log);
  - ddtree-retract and dflash-retract: DDTREE and DFLASH with SGLang's own retraction test switch
    (SGLANG_TEST_RETRACT=1: every third decode step retracts requests, whatever the pool holds), so that retraction
    is exercised even where the pool's arithmetic would not force it; DFLASH beside it tells a fault of SGLang's
    speculative retraction from one of ours.
Checks: every output of the 16 requests sent at once equals plain's up to a tie (TIE_NATS); each server retracted
at least once (counted from its log); after the run and after 200 mixed, sampled and aborted requests on the
pressured server, its pool is back to idle (no KV leak); a request that fills the whole context ends as plain's.
"""

from __future__ import annotations

import re

import pytest
from serving_common import COMMON, TEXT_PROMPTS, compare, ddtree, mixed_and_aborted_load, select_configs, used_tokens

TIE_NATS = 0.25  # as the tiny pair's other modules (bf16 served, near-ties of plain's own top two)
NEW_TOKENS = 256
REQUESTS = 16
PROMPT_TOKENS_BOUND = 48  # the module's prompts are short code openings (TEXT_PROMPTS and their variants)
VERIFY_WIDTH = 16  # the default budget's verify (B=15), DFLASH's block
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
RETRACT_LINE = re.compile(r"(?:KV cache pool is full\. Retract requests|Testing retraction)\. #retracted_reqs: (\d+)")
SPECULATIVE = ("ddtree-pressure", "ddtree-retract", "dflash-retract")
CONTEXT = 1024  # every server's --context-length


def prompts() -> list[str]:
    return (TEXT_PROMPTS + [p + "    " for p in TEXT_PROMPTS])[:REQUESTS]


def pressure_pool_tokens() -> int:
    """About half of what REQUESTS requests need at their longest, in whole 256-token pages."""
    from ddtree_bench.plan import request_tokens

    need = REQUESTS * request_tokens(PROMPT_TOKENS_BOUND, NEW_TOKENS, VERIFY_WIDTH)
    return -(-(need // 2) // 256) * 256


def with_flags(args: list[str], **flags) -> list[str]:
    """args with each --flag-name (given as flag_name=value) set to value, replacing an earlier value."""
    out = list(args)
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if flag in out:
            out[out.index(flag) + 1] = str(value)
        else:
            out += [flag, str(value)]
    return out


def configs(pair) -> dict:
    triton = ["--attention-backend", "triton"]
    draft = ["--speculative-draft-model-path", str(pair.drafter)]
    batch = dict(max_running_requests=REQUESTS, cuda_graph_max_bs_decode=REQUESTS, context_length=CONTEXT)
    base = with_flags(pair.base_args() + COMMON + triton, **batch)
    retract = {"SGLANG_TEST_RETRACT": "1"}
    return {
        "plain": base,
        "ddtree-pressure": with_flags(base + ddtree(15) + draft, max_total_tokens=pressure_pool_tokens()),
        "ddtree-retract": (base + ddtree(15) + draft, retract),
        "dflash-retract": (base + ["--speculative-algorithm", "DFLASH"] + draft, retract),
    }


@pytest.fixture(scope="module")
def servers(sglang_servers, model_pair):
    if model_pair.dummy:
        pytest.skip("the pressure module sends text prompts: it needs a pair with a tokenizer (not the dummy configs)")
    return sglang_servers(select_configs(configs(model_pair)), env={"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"})


def need(servers, name):
    if name not in servers:
        pytest.skip(f"configuration {name} not selected (DDTREE_GPU_CONFIGS)")


@pytest.fixture(scope="module")
def outputs(servers):
    """Plain one request at a time with its top-2 log-probs; every other server all REQUESTS at once, with the
    pool's idle use before it."""
    texts = prompts()
    out = {"plain": [servers["plain"].generate(text=t, sampling_params=GREEDY, return_logprob=True,
                                               top_logprobs_num=2) for t in texts]}
    for name in SPECULATIVE:
        if name in servers:
            idle = used_tokens(servers[name])
            answers = servers[name].generate(text=texts, sampling_params=GREEDY)
            assert isinstance(answers, list) and len(answers) == len(texts)
            out[name] = {"answers": answers, "idle": idle}
    return out


def retractions(server) -> int:
    return sum(int(n) for n in RETRACT_LINE.findall(server.log_text()))


@pytest.mark.parametrize("name", SPECULATIVE)
def test_outputs_under_retraction_equal_plain_up_to_ties(servers, outputs, name, gpu_record):
    need(servers, name)
    exact, ties, failures = compare(outputs["plain"], outputs[name]["answers"], TIE_NATS)
    retracted = retractions(servers[name])
    gpu_record("pressure_greedy", config=name, requests=REQUESTS, new_tokens=NEW_TOKENS, exact=exact, ties=ties,
               failures=failures, retracted_reqs=retracted,
               pool_tokens=pressure_pool_tokens() if name == "ddtree-pressure" else None)
    assert not failures, f"{name} under retraction differs from plain decoding: {failures}"


@pytest.mark.parametrize("name", SPECULATIVE)
def test_each_server_retracted_requests(servers, outputs, name):
    need(servers, name)
    assert retractions(servers[name]) > 0, f"{name}: no retraction in its log; the check above proved nothing"


@pytest.mark.parametrize("name", ["ddtree-pressure", "ddtree-retract"])
def test_pool_back_to_idle_after_retractions_and_aborts(servers, outputs, name, gpu_record):
    need(servers, name)
    server = servers[name]
    idle_tokens, idle_reqs = outputs[name]["idle"]
    after_run = used_tokens(server)
    texts = prompts()
    tokens, reqs, kinds = mixed_and_aborted_load(server, lambda i: {"text": texts[i % len(texts)]})
    gpu_record("pressure_kv_leak", config=name, idle_tokens=idle_tokens, after_run=list(after_run),
               after_load_tokens=tokens, after_load_reqs=reqs, kinds=kinds, retracted_reqs=retractions(server))
    assert idle_reqs == 0 and after_run == (idle_tokens, 0), (idle_tokens, after_run)
    assert reqs == 0 and tokens == idle_tokens, f"{name}: {tokens - idle_tokens} KV tokens leaked ({kinds})"
    assert kinds.get("aborted", 0) > 0, kinds
    assert server.proc.poll() is None, f"{name} died under the load"


@pytest.mark.parametrize("name", ["ddtree-pressure", "dflash-retract"])
def test_a_request_that_fills_the_context_ends_as_plain_decoding_ends_it(servers, outputs, name, gpu_record):
    """A greedy request whose prompt plus max_new_tokens is exactly the context length (the most SGLang admits):
    its last rounds verify nodes past the context's end (DDTREE reserves B + 1 slots a round, DFLASH its block), so
    nothing may be written or read out of bounds there. The output equals plain's up to a tie, full length, and the
    server still serves afterwards. DFLASH beside it tells a limit of SGLang's speculative path from one of ours."""
    need(servers, name)
    text = prompts()[0]
    prompt_tokens = servers["plain"].generate(text=text, sampling_params={**GREEDY, "max_new_tokens": 1}
                                              )["meta_info"]["prompt_tokens"]
    params = {**GREEDY, "max_new_tokens": CONTEXT - prompt_tokens}
    plain = servers["plain"].generate(text=text, sampling_params=params, return_logprob=True, top_logprobs_num=2)
    answer = servers[name].generate(text=text, sampling_params=params)
    exact, ties, failures = compare([plain], [answer], TIE_NATS)
    alive = servers[name].generate(text=text, sampling_params={**GREEDY, "max_new_tokens": 8})
    gpu_record("pressure_full_context", config=name, prompt_tokens=prompt_tokens, new_tokens=params["max_new_tokens"],
               completion_tokens=answer["meta_info"]["completion_tokens"], exact=exact, ties=ties, failures=failures)
    assert answer["meta_info"]["completion_tokens"] == params["max_new_tokens"], answer["meta_info"]
    assert not failures, failures
    assert alive["meta_info"]["completion_tokens"] == 8 and servers[name].proc.poll() is None
