"""Shared by the GPU modules that compare a speculative server with plain decoding (not a test module).

Prompts, greedy parameters, the common server arguments, the comparison with plain decoding's outputs that
tolerates a difference only at a near-tie of plain's own top log-probs (`tie_nats`), and the mixed and aborted load
of the KV-leak checks.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
import urllib.request
from dataclasses import dataclass

MAX_NEW_TOKENS = 64
BATCH = 8
COMMON = [
    # Parallel starts: every server sizes its KV pool from the memory free before it loads, so cap the pool
    # (--max-total-tokens) instead of relying on a small --mem-fraction-static (see tests/gpu/conftest.py).
    "--mem-fraction-static", "0.5",
    "--max-total-tokens", "65536",
    "--max-running-requests", "8",
    "--cuda-graph-max-bs-decode", "8",
    "--decode-log-interval", "1",
    "--random-seed", "0",
]
TEXT_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
    "    # Return the number of lines in the file\n    with open(path) as f:\n",
    "x = [",
    '"""Utilities for working with dates.\n\nThis module provides',
]
ID_PROMPTS = [[11 + i, 12, 13 + i, 14] * (1 + i % 3) for i in range(8)]
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}


def select_configs(all_configs: dict) -> dict:
    """DDTREE_GPU_CONFIGS=name,name,...: only those of a module's server configurations, and "plain" always (the
    reference the others are compared with); unset, all of them. An unknown name is refused with the known ones."""
    wanted = os.environ.get("DDTREE_GPU_CONFIGS")
    if not wanted:
        return all_configs
    names = [n.strip() for n in wanted.split(",") if n.strip()]
    unknown = [n for n in names if n not in all_configs]
    if unknown:
        raise ValueError(f"DDTREE_GPU_CONFIGS names unknown configurations {unknown}; known: {sorted(all_configs)}")
    return {n: all_configs[n] for n in ["plain"] + [n for n in names if n != "plain"]}


def ddtree(budget, *extra):
    return ["--speculative-algorithm", "DDTREE", "--speculative-ddtree-budget", str(budget), *extra]


ORACLE_FLAG = "--speculative-ddtree-oracle"


@dataclass(frozen=True)
class RealSizePlan:
    """What the real-size module (test_real8b.py) runs on one pair (DDTREE_GPU_MODELS): its DDTREE configurations
    (`ddtree-<budget>[-oracle]`, -oracle: the in-server sequential oracle of a hybrid target), the size of the
    all-at-once batch (also --max-running-requests), the configuration of the KV-leak check, and whether the servers
    run one at a time, each started once the one before it has answered and stopped (a 27B server fills most of an
    H100: two do not fit)."""

    configs: tuple[str, ...]
    batch: int
    leak_config: str
    one_at_a_time: bool = False


# `auto` with a round without a draft and small trees among its candidates; ddtree-auto-plain holds it in turn on
# `plain` and the 15-tree (SGLANG_DDTREE_AUTO_FORCE, REAL_SIZE_ENV), so that rounds without a draft run at real size
# whatever the chooser would pick there
AUTO_SMALL_CANDIDATES = "plain,chain,7,15,63"
REAL_SIZE_ENV = {"ddtree-auto-plain": {"SGLANG_DDTREE_AUTO_FORCE": "plain,15"}}
REAL_SIZE_PLANS = {
    "8b-real": RealSizePlan(("ddtree-15", "ddtree-64", "ddtree-256", "ddtree-auto", "ddtree-auto-plain"), 16,
                            "ddtree-64"),
    # no `auto` (refused on hybrid targets); the oracle re-verifies every accepted path as a chain
    "tiny-hybrid": RealSizePlan(("ddtree-16", "ddtree-64", "ddtree-64-oracle"), 16, "ddtree-64"),
    # 27B: weights and drafter 57 GB a server, the GDN state 147 MiB per request and verify node: alone on an H100,
    # DDTREE 16 at batch 4 (~10 GiB of state) fits; DDTREE 64 at batch 4 (~37 GiB) does not
    "27b-hybrid": RealSizePlan(("ddtree-16", "ddtree-16-oracle"), 4, "ddtree-16", one_at_a_time=True),
}
# every configuration any pair runs (the module's parametrization; a pair skips the others)
REAL_SIZE_CONFIGS = tuple(dict.fromkeys(c for plan in REAL_SIZE_PLANS.values() for c in plan.configs))


def real_size_config_args(name: str) -> list[str]:
    """ddtree-<budget>[-oracle] (or ddtree-auto-plain) -> the DDTREE server flags (the drafter path comes from the
    caller; a configuration's environment: REAL_SIZE_ENV)."""
    if name == "ddtree-auto-plain":
        return ddtree("auto", "--speculative-ddtree-auto-candidates", AUTO_SMALL_CANDIDATES)
    budget, _, oracle = name.removeprefix("ddtree-").partition("-")
    if not budget or oracle not in ("", "oracle") or not (budget == "auto" or budget.isdigit()):
        raise ValueError(f"{name!r} is not ddtree-<budget>[-oracle] or ddtree-auto-plain")
    return ddtree(budget, *([ORACLE_FLAG] if oracle else []))


def real_size_configs(plan: RealSizePlan, base: list[str], drafter_args: list[str]) -> dict[str, list[str]]:
    """{"plain": base, config: DDTREE args, ...} for `plan`, narrowed by DDTREE_GPU_CONFIGS (select_configs); plain
    first, as a plan that runs its servers one at a time starts them."""
    return select_configs({"plain": base, **{c: base + real_size_config_args(c) + drafter_args for c in plan.configs}})


def prompt(pair, i):
    return {"input_ids": ID_PROMPTS[i]} if pair.dummy else {"text": TEXT_PROMPTS[i]}


def batch_prompt(pair):
    return {"input_ids": ID_PROMPTS} if pair.dummy else {"text": TEXT_PROMPTS}


def run_batch1(server, pair, **extra):
    return [server.generate(**prompt(pair, i), sampling_params=GREEDY, **extra) for i in range(BATCH)]


def run_batch8(server, pair):
    out = server.generate(**batch_prompt(pair), sampling_params=GREEDY)
    assert isinstance(out, list) and len(out) == BATCH
    return out


def compare(reference, candidate, tie_nats):
    """(exact count, ties, failures) of candidate outputs vs reference greedy outputs (the reference with top-2
    log-probs). A first difference counts as a tie when the reference's log-prob gap between its own token and the
    candidate's there is at most tie_nats."""
    exact, ties, failures = 0, [], []
    for i, (ref, out) in enumerate(zip(reference, candidate)):
        a, b = ref["output_ids"], out["output_ids"]
        pos = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if pos is None and len(a) == len(b):
            exact += 1
            continue
        if pos is None:
            failures.append(f"prompt {i}: lengths differ ({len(a)} vs {len(b)})")
            continue
        top = ref["meta_info"].get("output_top_logprobs") or []
        logprob = {int(e[1]): float(e[0]) for e in (top[pos] if pos < len(top) and top[pos] else [])}
        gap = logprob[a[pos]] - logprob[b[pos]] if a[pos] in logprob and b[pos] in logprob else None
        info = {"prompt": i, "position": pos, "plain": a[pos], "candidate": b[pos], "logprob_gap": gap}
        (ties if gap is not None and gap <= tie_nats else failures).append(info)
    return exact, ties, failures


def tau_of(outputs):
    """Tokens per verify round over a list of /generate answers (SGLang's completion_tokens / spec_verify_ct)."""
    metas = [o["meta_info"] for o in outputs]
    return sum(m["completion_tokens"] for m in metas) / sum(m["spec_verify_ct"] for m in metas)


def post_raw(server, path, body):
    """POST whose answer may be empty (SGLang's /abort_request answers with no body)."""
    req = urllib.request.Request(server.base_url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.status


def flush_cache(server):
    """POST /flush_cache: the radix cache's idle entries freed (SGLang refuses it while requests run)."""
    urllib.request.urlopen(urllib.request.Request(server.base_url + "/flush_cache", method="POST"), timeout=60).read()


def used_tokens(server):
    """(KV tokens in use, running requests) after /flush_cache (the radix cache's idle entries freed)."""
    flush_cache(server)
    with urllib.request.urlopen(server.base_url + "/get_load", timeout=30) as resp:
        loads = json.loads(resp.read())
    return sum(x["num_tokens"] for x in loads), sum(x["num_reqs"] for x in loads)


def mixed_and_aborted_load(server, prompt_of, requests: int = 200, settle_s: float = 60.0):
    """`requests` requests, 16 at a time: greedy and sampled, of several lengths, every fifth aborted mid-generation
    through /abort_request; prompt_of(i) gives the i-th request's generate() keywords. Then waits up to settle_s for
    the server to go idle. Returns (tokens in use, running requests, {kind: count}), kinds ok / aborted /
    finished (an abort that came after the end)."""
    lengths = [1, 5, 17, 40, 64, 90]

    def one(i):
        params = {"temperature": 0.0 if i % 2 else 0.8, "max_new_tokens": lengths[i % len(lengths)]}
        if i % 5 == 0:
            rid = f"leak-test-{i}"
            params = {**params, "max_new_tokens": 400, "ignore_eos": True}
            with concurrent.futures.ThreadPoolExecutor(1) as one_pool:
                fut = one_pool.submit(server.generate, **prompt_of(i), sampling_params=params, rid=rid)
                time.sleep(0.05 * (1 + i % 4))
                post_raw(server, "/abort_request", {"rid": rid})
                out = fut.result(timeout=120)
            reason = (out.get("meta_info", {}).get("finish_reason") or {}).get("type")
            return "aborted" if reason == "abort" else "finished"
        server.generate(**prompt_of(i), sampling_params=params)
        return "ok"

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        kinds = list(pool.map(one, range(requests)))
    deadline = time.time() + settle_s
    while True:
        tokens, reqs = used_tokens(server)
        if reqs == 0 or time.time() > deadline:
            break
        time.sleep(1)
    return tokens, reqs, {k: kinds.count(k) for k in set(kinds)}
