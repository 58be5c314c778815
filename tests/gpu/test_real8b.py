"""Lossless at real size: the widened Qwen3-8B-shaped pair served with DDTREE == plain decoding up to bf16 ties;
the same checks on the hybrid pairs (the tiny gated-delta-net hybrid trained on the device and its Qwen3.5-27B
widening).

Runs only with DDTREE_GPU_MODELS=8b-real (the pair is built into runs/8b-real on first use, ~20 s on the H200),
tiny-hybrid (models/tiny-hybrid: scripts/device/hybrid.sh train) or 27b-hybrid (runs/27b-hybrid, widened from
models/tiny-hybrid on first use: 57.3 GB, refused when the disk has no room). serving_common.REAL_SIZE_PLANS gives
each pair's DDTREE configurations and batch. DDTREE_GPU_BACKEND picks the attention backend (triton, the default,
or flashinfer).

  - greedy, 128 new tokens, 16 HumanEval prompts (runs/bench/humaneval_prompts.jsonl, written by
    `benchmarks/bench_budgets.py --write-prompts`; the serving prompts otherwise): DDTREE at B = 15, 64 and 256,
    `auto` (its default candidates) and `auto` held in turn on rounds without a draft and 15-tree rounds
    (ddtree-auto-plain: serving_common.REAL_SIZE_ENV, started on its own) for 8b-real, at B = 16 and 64 and the in-server oracle at 64 (a hybrid target:
    every accepted path verified again as a chain) for tiny-hybrid, at B = 16 and its oracle for 27b-hybrid; one
    request at a time and the pair's batch at once (16; 4 for 27b-hybrid), against plain decoding one at a time; a
    first difference passes only where plain's own log-probs of its token and DDTREE's are within TIE_NATS, and every
    first difference's gap is recorded. The gap comes from plain's top-5; a DDTREE token outside them is judged by
    decoding the same prompt on the plain server again with SGLang's token_ids_logprob for both tokens (the same decode
    path, so the same numbers), and its gap on plain's prefill path (the prompt and the common prefix as one extend, the
    kind of forward a verify is) is recorded next to it (27b-hybrid: plain has stopped by then, so such a difference
    fails, marked not judged);
  - the KV pool is back to idle after 200 mixed, sampled and aborted requests (B = 64; B = 16 for 27b-hybrid);
  - an oracle server's count of request-rounds whose chain re-verify differed from its tree verify.

DDTREE_GPU_PROMPTS=long:8192 (or long:2048, long:32768, shared:8192) runs the same checks on 16 long prompts of
runs/bench/long_prompts.jsonl (`benchmarks/bench_budgets.py --write-long-prompts`, carried with runs/bench) instead:
batch 4, the servers' context length and KV pool raised to what those prompts need, and from 16K tokens one server at
a time; every record names the prompt set.

DDTREE_GPU_CONFIGS=ddtree-64,ddtree-auto,... starts only those DDTREE servers (plain always): all six 8B servers at
once are sized for an H200; on an H100 select fewer. 27b-hybrid runs its servers one at a time, plain first, each
stopped once it has answered (a 27B server fills most of an H100). Tests of servers not selected skip.

Each check is judged and recorded (gpu_record: real8b_greedy, real8b_kv_leak, real8b_oracle, each with `ok`) as soon
as its server has answered and plain's outputs are in, so a call cut by its deadline keeps the records of every server
that had answered (the tests, which run once every server has answered, then assert what was judged).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field

import pytest

from conftest import REPO_ROOT
from serving_common import (ORACLE_FLAG, REAL_SIZE_CONFIGS, REAL_SIZE_ENV, REAL_SIZE_PLANS, TEXT_PROMPTS, compare,
                            flush_cache, mixed_and_aborted_load, real_size_configs, tau_of, used_tokens)

TIE_NATS = 0.125
NEW_TOKENS = 128
PROMPTS = 16
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
MODES = ("bs1", "batch")  # one request at a time; the pair's batch at once (recorded as bs<batch>)
LONG_BATCH = 4  # the all-at-once batch with long prompts (DDTREE_GPU_PROMPTS)
ONE_AT_A_TIME_FROM = 16384  # prompt tokens from which two 8B servers with their KV pools do not fit an H100


@pytest.fixture(scope="module")
def pair(model_pair):
    if model_pair.mode not in REAL_SIZE_PLANS:
        pytest.skip(f"real-size module: set DDTREE_GPU_MODELS to one of {', '.join(REAL_SIZE_PLANS)}")
    return model_pair


@pytest.fixture(scope="module")
def prompt_set():
    """DDTREE_GPU_PROMPTS, read once for the module (prompt_choice)."""
    return prompt_choice()


@pytest.fixture(scope="module")
def plan(pair, prompt_set):
    return prompt_plan(REAL_SIZE_PLANS[pair.mode], prompt_set)


def prompt_choice() -> tuple[str, int] | None:
    """DDTREE_GPU_PROMPTS: None (HumanEval) or (prompt kind, tokens) for `long:TOKENS` / `shared:TOKENS`."""
    value = os.environ.get("DDTREE_GPU_PROMPTS", "").strip()
    if not value or value == "humaneval":
        return None
    kind, _, tokens = value.partition(":")
    if kind not in ("long", "shared") or not tokens.isdigit():
        raise ValueError(f"DDTREE_GPU_PROMPTS={value!r}: use humaneval, long:TOKENS or shared:TOKENS")
    return kind, int(tokens)


def prompt_set_name(choice: tuple[str, int] | None) -> str:
    return "humaneval" if choice is None else f"{choice[0]}:{choice[1]}"


def prompt_plan(plan, choice: tuple[str, int] | None):
    """The pair's plan for the prompt set: long prompts run at batch LONG_BATCH, one server at a time from
    ONE_AT_A_TIME_FROM tokens."""
    if choice is None:
        return plan
    return dataclasses.replace(plan, batch=min(plan.batch, LONG_BATCH),
                               one_at_a_time=plan.one_at_a_time or choice[1] >= ONE_AT_A_TIME_FROM)


def widest_verify(plan) -> int:
    """The widest verify (tokens a request) among the plan's configurations: B + 1, `auto` its default widest."""
    from sglang_ddtree.adaptive import parse_candidates
    from sglang_ddtree.sglang.args import DEFAULT_AUTO_CANDIDATES

    budgets = [max(parse_candidates(DEFAULT_AUTO_CANDIDATES)) if b == "auto" else int(b)
               for b in (c.removeprefix("ddtree-").partition("-")[0] for c in plan.configs)]
    return max(budgets) + 1


def long_context(prompt_tokens: int, plan) -> tuple[int, int]:
    """(--context-length, --max-total-tokens) for prompts of up to prompt_tokens tokens: a request at its longest
    (ddtree_bench.plan.request_tokens, the widest verify's reserve), the context rounded up to 1024, the pool the
    plan's batch of such requests with 20% to spare."""
    from ddtree_bench.plan import request_tokens

    need = request_tokens(prompt_tokens, NEW_TOKENS, widest_verify(plan))
    context = -(-need // 1024) * 1024
    return context, max(24576, -(-int(plan.batch * need * 1.2) // 1024) * 1024)


def run_name(config: str, mode: str, plan) -> str:
    return f"{config}/bs{1 if mode == 'bs1' else plan.batch}"


def prompts(choice: tuple[str, int] | None = None) -> list[str]:
    if choice is not None:
        from ddtree_bench.long_prompts import read_long_prompts

        rows = read_long_prompts(REPO_ROOT / "runs" / "bench" / "long_prompts.jsonl", *choice)
        return [r["text"] for r in rows[:PROMPTS]]
    path = REPO_ROOT / "runs" / "bench" / "humaneval_prompts.jsonl"
    if path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [r["text"] for r in rows[:PROMPTS]]
    return (TEXT_PROMPTS + [p + "    " for p in TEXT_PROMPTS])[:PROMPTS]


def common(pair, backend: str, plan, choice: tuple[str, int] | None = None) -> list[str]:
    # Up to six 8B servers start together: a capped KV pool (--max-total-tokens) with a loose fraction, as the sweep
    # does. A server alone on the GPU (one at a time: the 27B) takes most of it, and a KV pool of what 16 prompts
    # need at the batch, so that its recurrent-state pool fits next to the weights. A hybrid target's mamba pool gets
    # explicit slots (ddtree_bench.plan.mamba_cache_size), or SGLang would size it from the memory free at its start.
    fraction, kv_tokens = ("0.92", "8192") if plan.one_at_a_time else ("0.88", "24576")
    context = "4096"
    if choice is not None:  # long prompts: the context and pool they need (a shared prefix's suffix: ~200 tokens)
        from ddtree_bench.plan import SHARED_SUFFIX_TOKENS

        tokens = choice[1] + (SHARED_SUFFIX_TOKENS if choice[0] == "shared" else 0)
        context, kv_tokens = (str(n) for n in long_context(tokens, plan))
    args = pair.base_args() + [
        "--attention-backend", backend, "--mem-fraction-static", fraction, "--max-total-tokens", kv_tokens,
        "--max-running-requests", str(plan.batch), "--cuda-graph-max-bs-decode", str(plan.batch),
        "--context-length", context, "--random-seed", "0", "--decode-log-interval", "1"]
    if pair.hybrid:
        from ddtree_bench.plan import mamba_cache_size

        args += ["--max-mamba-cache-size", str(mamba_cache_size(plan.batch))]
    return args


@dataclass
class Served:
    """What the module's servers answered and what was judged of it, as each server answered: the servers by name (a
    stopped one keeps its args and log), their greedy outputs by run name (run_name), each DDTREE run's comparison with
    plain by run name, the KV-leak load's numbers (taken while its server was up) and each oracle server's counts."""

    servers: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    greedy: dict = field(default_factory=dict)
    leak: dict | None = None
    oracle: dict = field(default_factory=dict)
    gaps: dict = field(default_factory=dict)  # (prompt, position, plain token, candidate token) -> _gap_on_plain's


def _answers(name: str, server, plan, texts: list[str]) -> dict:
    """{run name: outputs} of one server: plain one prompt at a time with its top-5 log-probs (a first difference
    whose token is not among plain's top-2, a three-way near-tie or a bug, still gets its gap measured instead of
    failing as unjudged); a DDTREE server one at a time and the plan's batch at once."""
    if name == "plain":
        return {"plain": [server.generate(text=t, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=5)
                          for t in texts]}
    alone = [server.generate(text=t, sampling_params=GREEDY) for t in texts]
    together = []
    for i in range(0, len(texts), plan.batch):
        batch = server.generate(text=texts[i:i + plan.batch], sampling_params=GREEDY)
        assert isinstance(batch, list) and len(batch) == len(texts[i:i + plan.batch])
        together += batch
    return {run_name(name, "bs1", plan): alone, run_name(name, "batch", plan): together}


def _leak_load(server, texts: list[str]) -> dict:
    """The KV pool before and after 200 mixed, sampled and aborted requests (serving_common.mixed_and_aborted_load)."""
    idle_tokens, idle_reqs = used_tokens(server)
    tokens, reqs, kinds = mixed_and_aborted_load(server, lambda i: {"text": texts[i % len(texts)]})
    return {"idle_tokens": idle_tokens, "idle_reqs": idle_reqs, "after_tokens": tokens, "after_reqs": reqs,
            "kinds": kinds, "alive": server.proc.poll() is None}


def _with_prompt_set(record, prompt_set: str):
    """record(kind, **fields) with the prompt set (DDTREE_GPU_PROMPTS) named in every record."""
    return lambda kind, **fields: record(kind, prompt_set=prompt_set, **fields)


def _judged(kind: str, record, fields: dict, judge) -> dict:
    """judge()'s fields (or the error it raised, ok False) added to `fields`, recorded as `kind` at once."""
    try:
        fields = {**fields, **judge()}
    except Exception as exc:  # recorded and failed by its test, not by the fixture (the other checks still run)
        fields = {**fields, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    record(kind, **fields)
    return fields


def _judge_new_runs(served: Served, pair, texts: list[str], backend: str, record) -> None:
    """Every run not yet compared with plain, once plain's outputs are in."""
    if "plain" not in served.outputs:
        return
    for name in served.outputs:
        if name != "plain" and name not in served.greedy:
            served.greedy[name] = _judged("real8b_greedy", record, {"pair": pair.mode, "config": name,
                                                                     "backend": backend},
                                          lambda: _greedy_against_plain(served, name, texts))


def _leak_numbers(server, texts: list[str]) -> dict:
    got = _leak_load(server, texts)
    ok = (got["idle_reqs"] == 0 and got["after_reqs"] == 0 and got["after_tokens"] == got["idle_tokens"]
          and got["kinds"].get("aborted", 0) > 0 and got["alive"])
    return {**got, "leaked": got["after_tokens"] - got["idle_tokens"], "ok": ok}


def _oracle_numbers(served: Served, config: str, plan) -> dict:
    """The oracle server's last count of request-rounds whose chain re-verify differed (its log), and how many of its
    outputs equal the fast server's of the same budget (where that one has answered)."""
    from sglang_ddtree.sglang.modes import ORACLE_LOG

    found = re.findall(r"DDTREE oracle: (\d+) of (\d+) greedy request-rounds differ",
                       served.servers[config].log_text())
    differ, checked = (int(x) for x in found[-1]) if found else (None, None)
    fast, outputs = config.removesuffix("-oracle"), served.outputs
    same = {mode: sum(a["output_ids"] == b["output_ids"] for a, b in zip(outputs[run_name(config, mode, plan)],
                                                                        outputs[run_name(fast, mode, plan)]))
            for mode in MODES if run_name(fast, mode, plan) in outputs}
    ok = bool(found) and checked >= ORACLE_LOG and differ <= max(2, checked // 20)
    return {"differ": differ, "checked": checked, "outputs_equal_to_fast": same, "prompts": PROMPTS,
            "ok": ok, **({} if found else {"error": "no oracle line in the server log"})}


def serve(start, pair, plan, texts: list[str], backend: str, record, choice: tuple[str, int] | None = None) -> Served:
    """Start the plan's servers with start({name: args}, env=...) (the sglang_servers factory), collect what they
    answer to texts and judge it as each server answers, recording every judgement with record(kind, **fields) (the
    gpu_record fixture); a plan of one server at a time starts plain first and stops each server once it has
    answered everything asked of it (the KV-leak load too), so that the next one gets the GPU."""
    base = common(pair, backend, plan, choice)
    record = _with_prompt_set(record, prompt_set_name(choice))
    draft = ["--speculative-draft-model-path", str(pair.drafter)]
    configs = real_size_configs(plan, base, draft)
    env = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}
    served = Served()

    def answer(name, server):
        served.outputs.update(_answers(name, server, plan, texts))
        _judge_new_runs(served, pair, texts, backend, record)
        if name == plan.leak_config:
            served.leak = _judged("real8b_kv_leak", record, {"pair": pair.mode, "config": name},
                                  lambda: _leak_numbers(server, texts))
        if name.endswith("-oracle"):
            served.oracle[name] = _judged("real8b_oracle", record, {"pair": pair.mode, "config": name},
                                          lambda: _oracle_numbers(served, name, plan))

    if not plan.one_at_a_time:  # together, but a configuration with its own environment started on its own
        shared = {n: a for n, a in configs.items() if n not in REAL_SIZE_ENV}
        served.servers.update(start(shared, env=env))
        for name in configs.keys() - shared.keys():
            served.servers.update(start({name: configs[name]}, env={**env, **REAL_SIZE_ENV[name]}))
        for name, server in served.servers.items():
            answer(name, server)
        return served
    for name, args in configs.items():
        server = start({name: args}, env={**env, **REAL_SIZE_ENV.get(name, {})})[name]
        served.servers[name] = server
        try:
            answer(name, server)
        finally:
            server.stop()
    return served


@pytest.fixture(scope="module")
def served(sglang_servers, pair, plan, prompt_set, gpu_record):
    try:
        return serve(sglang_servers, pair, plan, prompts(prompt_set), os.environ.get("DDTREE_GPU_BACKEND", "triton"),
                     gpu_record, prompt_set)
    except ValueError as exc:  # a DDTREE_GPU_CONFIGS selection the plan does not know, a long prompt set missing
        pytest.fail(str(exc), pytrace=False)


def _logprobs_of(entries) -> dict[int, float]:
    """{token id: log-prob} from one position's SGLang logprob entries ([logprob, token id, text] each)."""
    return {int(e[1]): float(e[0]) for e in entries or () if e is not None and e[0] is not None}


def _gap_on_plain(plain, text: str, reference: list[int], pos: int, ref_token: int, token: int) -> dict:
    """Plain's log-prob gap between its own token and another at output position pos, from more plain requests
    (the radix cache flushed before each, so nothing is reused from an earlier forward):
    - decode: the same greedy request again to pos + 1 tokens with token_ids_logprob = both tokens, the path the
      reference took (its output up to pos must repeat, else the judgement is void);
    - prefill: the prompt's ids and the reference's first pos tokens as one input, one new token: an extend forward,
      as a verify is."""
    both = [ref_token, token]
    flush_cache(plain)
    again = plain.generate(text=text, sampling_params={**GREEDY, "max_new_tokens": pos + 1}, return_logprob=True,
                           token_ids_logprob=both)
    repeated = list(again["output_ids"][:pos + 1]) == list(reference[:pos + 1])
    decode = _logprobs_of((again["meta_info"].get("output_token_ids_logprobs") or [None] * (pos + 1))[pos])
    flush_cache(plain)
    ids = plain.generate(text=text, sampling_params={**GREEDY, "max_new_tokens": 1}, return_logprob=True,
                         logprob_start_len=0)["meta_info"]["input_token_logprobs"]
    flush_cache(plain)
    once = plain.generate(input_ids=[int(e[1]) for e in ids] + list(reference[:pos]),
                          sampling_params={**GREEDY, "max_new_tokens": 1}, return_logprob=True,
                          token_ids_logprob=both)
    prefill = _logprobs_of((once["meta_info"].get("output_token_ids_logprobs") or [None])[0])

    def gap(lp):
        return round(lp[ref_token] - lp[token], 6) if ref_token in lp and token in lp else None

    return {"decode_gap": gap(decode) if repeated else None, "decode_repeated": repeated,
            "prefill_gap": gap(prefill), "prefill_token": int(once["output_ids"][0])}


def _greedy_against_plain(served: Served, name: str, texts: list[str]) -> dict:
    """Run `name`'s outputs against plain's: exact, ties and failures (compare), a first difference outside plain's
    top-5 judged on the plain server again while it runs (_gap_on_plain, each asked once across runs), the largest gap
    at a difference, tau, and ok (no failure)."""
    outputs, plain = served.outputs, served.servers["plain"]
    exact, ties, failures = compare(outputs["plain"], outputs[name], TIE_NATS)
    still = []
    for f in failures:
        if not (isinstance(f, dict) and f["logprob_gap"] is None):
            still.append(f)
            continue
        key = (f["prompt"], f["position"], f["plain"], f["candidate"])
        if plain.proc.poll() is not None:  # one server at a time: plain has stopped, judged by its top-5
            still.append({**f, "not_judged": "the candidate is outside plain's top-5 and plain no longer runs"})
            continue
        if key not in served.gaps:
            reference = outputs["plain"][f["prompt"]]["output_ids"]
            served.gaps[key] = _gap_on_plain(plain, texts[f["prompt"]], reference, f["position"], f["plain"],
                                             f["candidate"])
        f = {**f, **served.gaps[key], "logprob_gap": served.gaps[key]["decode_gap"]}
        (ties if f["logprob_gap"] is not None and f["logprob_gap"] <= TIE_NATS else still).append(f)
    gaps = [t["logprob_gap"] for t in ties] + [f.get("logprob_gap") for f in still if isinstance(f, dict)]
    # tau per prompt, and over the prompts decoded exactly as plain decodes them: two runs (e.g. two attention
    # kernels) are compared on the same texts there, where a tie moves the rest of a text and its acceptance
    same = [i for i, (a, b) in enumerate(zip(outputs["plain"], outputs[name])) if a["output_ids"] == b["output_ids"]]
    return {"prompts": len(outputs[name]), "new_tokens": NEW_TOKENS, "exact": exact, "ties": ties, "failures": still,
            "max_gap": max((g for g in gaps if g is not None), default=0.0), "tau": tau_of(outputs[name]),
            "tau_by_prompt": [round(tau_of([o]), 4) for o in outputs[name]], "exact_prompts": same,
            "tau_exact_prompts": tau_of([outputs[name][i] for i in same]) if same else None,
            "cache": _cache_use(outputs[name]), "plain_cache": _cache_use(outputs["plain"]),
            "tie_nats": TIE_NATS, "ok": not still}


def _cache_use(outputs) -> dict:
    """The prompts' tokens and how many of them the radix cache served (SGLang's meta_info prompt_tokens and
    cached_tokens; a shared prefix's hits), summed over a run's answers."""
    metas = [o["meta_info"] for o in outputs]
    prompt = sum(int(m.get("prompt_tokens") or 0) for m in metas)
    cached = sum(int(m.get("cached_tokens") or 0) for m in metas)
    return {"prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": round(cached / prompt, 4) if prompt else None}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("config", REAL_SIZE_CONFIGS)
def test_greedy_equals_plain_up_to_ties(pair, plan, served, config, mode):
    if config not in plan.configs:
        pytest.skip(f"{config} is not run on {pair.mode}")
    name = run_name(config, mode, plan)
    if name not in served.outputs:
        pytest.skip(f"{config} not selected (DDTREE_GPU_CONFIGS)")
    got = served.greedy[name]
    assert "error" not in got, f"{name}: judging the outputs failed: {got['error']}"
    assert not got["failures"], \
        f"{name}: differences from plain that are not ties within {TIE_NATS} nats: {got['failures']}"


def test_no_kv_leak_after_mixed_and_aborted_requests(pair, plan, served):
    if plan.leak_config not in served.servers:
        pytest.skip(f"{plan.leak_config} not selected (DDTREE_GPU_CONFIGS)")
    got = served.leak
    assert "error" not in got, f"the KV-leak load failed: {got['error']}"
    assert got["idle_reqs"] == 0
    assert got["after_reqs"] == 0, f"{got['after_reqs']} requests still running 60 s after the load ended"
    assert got["after_tokens"] == got["idle_tokens"], f"KV leak: {got['leaked']} tokens still in use after the load"
    assert got["kinds"].get("aborted", 0) > 0, f"no request was really aborted: {got['kinds']}"
    assert got["alive"], "the server died (SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE raises on leaks)"


@pytest.mark.parametrize("config", [c for c in REAL_SIZE_CONFIGS if c.endswith("-oracle")])
def test_oracle_rechecks_every_round_against_a_chain_verify(pair, plan, served, config):
    """--speculative-ddtree-oracle (a hybrid target): every round's accepted path is verified again as a chain from
    the pre-round state and the round commits what that chain verify accepts; the server logs how many greedy
    request-rounds the tree verify's accepted drafts or bonus differed. Checked as in test_ddtree_hybrid.py: the
    oracle ran on enough rounds and differed on few (bf16 near-ties explain a few; a wrong tree path would differ on
    most rounds that accept one); its outputs against the fast server of the same budget are recorded."""
    from sglang_ddtree.sglang.modes import ORACLE_LOG

    if config not in plan.configs:
        pytest.skip(f"{config} is not run on {pair.mode}")
    if config not in served.servers:
        pytest.skip(f"{config} not selected (DDTREE_GPU_CONFIGS)")
    assert ORACLE_FLAG in served.servers[config].args
    got = served.oracle[config]
    assert "error" not in got, f"{config}: {got['error']}"
    differ, checked = got["differ"], got["checked"]
    assert checked >= ORACLE_LOG, (checked, differ)
    assert differ <= max(2, checked // 20), f"{config}: {differ} of {checked} request-rounds differ from the chain"
