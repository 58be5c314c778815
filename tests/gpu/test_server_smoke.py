"""GPU smoke: SGLang 0.5.17 serves the tiny pair with plain decoding and with DFLASH (block 16, triton
attention, CUDA graphs on); DFLASH reports its acceptance, and its greedy output is plain decoding's.

Acceptance numbers come from /generate's meta_info, which SGLang 0.5.17 fills for finished requests of a
speculative server (srt/managers/tokenizer_manager.py, _calculate_spec_decoding_metrics):
  spec_verify_ct        verify rounds for the request
  spec_accept_length    completion_tokens / spec_verify_ct (accepted drafts + the bonus token, per round)
  spec_accept_rate      accepted drafts / (spec_verify_ct * (num_draft_tokens - 1))
  spec_num_correct_drafts, spec_num_proposed_drafts, spec_correct_drafts_histogram (when non-empty)
They are recorded (gpu_suite.json "records"), together with the scheduler log's "accept len: X" lines.

Greedy equality allows one thing: at the first position where DFLASH and plain decoding differ, plain's own
distribution must have (nearly) tied the two tokens (|logprob gap| <= DDTREE_TIE_NATS, default 0.25), since a
16-token verify and a 1-token decode round bf16 differently. Anything else fails.
"""

from __future__ import annotations

import math
import os
import re
from importlib import metadata

import pytest
from serving_common import COMMON, compare

BLOCK = 16
MAX_NEW_TOKENS = 48  # three DFLASH blocks
TIE_NATS = float(os.environ.get("DDTREE_TIE_NATS", "0.25"))
# The shared serving args (a capped KV pool so that servers starting together on one GPU do not starve each
# other, few graphs, a decode log line per step: "cuda graph: ..." and, for DFLASH, "accept len").
COMMON_ARGS = ["--attention-backend", "triton", *COMMON]
# The tiny pair is trained on Python's standard library (sglang_ddtree/tiny.py): code prompts.
TEXT_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(",
]
# Dummy mode has no tokenizer; ids stay below the drafter's mask token (2047) and the dummy bos/eos (2045/2046).
ID_PROMPTS = [
    [11, 12, 13, 14, 15, 16, 17, 18],
    [100, 7, 100, 7, 100, 7],
    [1500, 3, 998, 42, 42, 42, 1001, 5, 6],
    [2000, 1999, 1998, 1997],
]
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}
CUDA_GRAPH_LINE = re.compile(r"cuda graph: (True|False)")
ACCEPT_LINE = re.compile(r"accept len: ([0-9.]+)")


def prompt_kwargs(pair, i: int) -> dict:
    return {"input_ids": ID_PROMPTS[i]} if pair.dummy else {"text": TEXT_PROMPTS[i]}


def run_prompts(server, pair, **extra) -> list[dict]:
    return [server.generate(**prompt_kwargs(pair, i), sampling_params=GREEDY, **extra)
            for i in range(len(TEXT_PROMPTS))]


@pytest.fixture(scope="module")
def servers(sglang_servers, model_pair):
    # Started together: JIT builds (file-locked caches) and graph captures overlap, so two starts cost about one.
    # all_or_nothing=False: a DFLASH server that fails to start fails the DFLASH tests only.
    base = model_pair.base_args() + COMMON_ARGS
    return sglang_servers({"plain": base, "dflash": base + model_pair.dflash_args(BLOCK)}, all_or_nothing=False)


def _running(server):
    if isinstance(server, Exception):
        pytest.fail(str(server), pytrace=False)
    return server


@pytest.fixture(scope="module")
def plain_server(servers):
    return _running(servers["plain"])


@pytest.fixture(scope="module")
def dflash_server(servers):
    return _running(servers["dflash"])


@pytest.fixture(scope="module")
def plain_greedy(plain_server, model_pair) -> list[dict]:
    # Top-2 logprobs make the tie rule of the equality test checkable.
    return run_prompts(plain_server, model_pair, return_logprob=True, top_logprobs_num=2)


@pytest.fixture(scope="module")
def dflash_greedy(dflash_server, model_pair) -> list[dict]:
    return run_prompts(dflash_server, model_pair)


def test_ddtree_entry_point_is_discoverable(sglang_env):
    """env.sh's dist-info makes our plugin visible to SGLang's loader (importlib.metadata entry points)."""
    eps = {ep.name: ep for ep in metadata.entry_points(group="sglang.srt.plugins")}
    assert "ddtree" in eps, f"no 'ddtree' in sglang.srt.plugins entry points: {sorted(eps)}"
    assert eps["ddtree"].value == "sglang_ddtree.sglang.plugin:register"


def test_plain_decoding_returns_tokens(plain_greedy, model_pair):
    for i, out in enumerate(plain_greedy):
        ids = out["output_ids"]
        assert len(ids) == MAX_NEW_TOKENS, f"prompt {i}: {len(ids)} tokens, asked for {MAX_NEW_TOKENS}"
        assert out["meta_info"]["completion_tokens"] == MAX_NEW_TOKENS
        assert all(isinstance(t, int) and t >= 0 for t in ids)
        if not model_pair.dummy:
            assert isinstance(out.get("text"), str) and out["text"], f"prompt {i}: no text decoded"
        assert "spec_verify_ct" not in out["meta_info"], "plain server reports speculative metrics"


def test_plain_decoding_uses_cuda_graphs(plain_server, plain_greedy):
    flags = CUDA_GRAPH_LINE.findall(plain_server.log_text())
    assert flags, "no 'cuda graph:' decode log line (is --decode-log-interval 1 honoured?)"
    assert "True" in flags, f"decode never ran in a CUDA graph: {flags[-5:]}"


def test_dflash_returns_tokens_and_reports_acceptance(dflash_server, dflash_greedy, model_pair, gpu_record):
    per_prompt = []
    for i, out in enumerate(dflash_greedy):
        meta = out["meta_info"]
        ids = out["output_ids"]
        assert len(ids) == MAX_NEW_TOKENS, f"prompt {i}: {len(ids)} tokens, asked for {MAX_NEW_TOKENS}"
        if not model_pair.dummy:
            assert isinstance(out.get("text"), str) and out["text"], f"prompt {i}: no text decoded"
        for key in ("spec_verify_ct", "spec_accept_length", "spec_num_correct_drafts"):
            assert key in meta, f"prompt {i}: meta_info lacks {key}; keys: {sorted(meta)}"
        rounds = meta["spec_verify_ct"]
        # Each verify round commits between 1 (bonus only) and BLOCK tokens.
        assert math.ceil(MAX_NEW_TOKENS / BLOCK) <= rounds <= MAX_NEW_TOKENS, f"prompt {i}: {rounds} rounds"
        assert 1.0 <= meta["spec_accept_length"] <= BLOCK, f"prompt {i}: accept length {meta['spec_accept_length']}"
        assert 0 <= meta["spec_num_correct_drafts"] <= rounds * (BLOCK - 1)
        per_prompt.append({
            "prompt": i,
            "completion_tokens": meta["completion_tokens"],
            "spec_verify_ct": rounds,
            "spec_accept_length": meta["spec_accept_length"],
            "spec_accept_rate": meta.get("spec_accept_rate"),
            "spec_num_correct_drafts": meta["spec_num_correct_drafts"],
            "histogram": meta.get("spec_correct_drafts_histogram"),
        })
    log_accept = [float(x) for x in ACCEPT_LINE.findall(dflash_server.log_text())]
    total_tokens = sum(p["completion_tokens"] for p in per_prompt)
    total_rounds = sum(p["spec_verify_ct"] for p in per_prompt)
    gpu_record("dflash_accept", mode=model_pair.mode, block=BLOCK, max_new_tokens=MAX_NEW_TOKENS,
               mean_accept_length=round(total_tokens / total_rounds, 4), per_prompt=per_prompt,
               log_accept_len=log_accept[-20:], server_start_s=dflash_server.start_seconds)
    assert log_accept, "the DFLASH server never logged 'accept len'"


def test_dflash_uses_cuda_graphs(dflash_server, dflash_greedy):
    flags = CUDA_GRAPH_LINE.findall(dflash_server.log_text())
    assert flags, "no 'cuda graph:' decode log line from the DFLASH server"
    assert "True" in flags, f"DFLASH decode never ran in a CUDA graph: {flags[-5:]}"


def test_dflash_greedy_equals_plain(plain_greedy, dflash_greedy, model_pair, gpu_record):
    # the near-tie rule shared with the DDTREE modules: a difference counts only where plain's own top-2 log-probs
    # are within TIE_NATS
    assert len(plain_greedy) == len(dflash_greedy)
    exact, ties, failures = compare(plain_greedy, dflash_greedy, TIE_NATS)
    gpu_record("greedy_equality", mode=model_pair.mode, prompts=len(plain_greedy), exact=exact, ties=ties,
               failures=failures)
    assert not failures, "DFLASH greedy output differs from plain decoding:\n" + "\n".join(map(str, failures))
