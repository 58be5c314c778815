"""One measurement: `batch_size` concurrent streaming /generate requests, and what they say.

Decode throughput excludes time to first token. Each request streams (`stream: true`, one chunk per scheduler
step), and SGLang's tokenizer manager stamps the arrival of the first chunk (the prefill token) and of the last;
with --enable-metrics the final chunk's meta_info carries `decode_throughput` = (completion_tokens - 1) /
(finished - first token), measured in the server process, free of HTTP and client-thread jitter. The client also
stamps both chunks itself; that is the fallback when the server value is missing (and a cross-check).
Why not e2e_latency: it includes queueing and the prefill of every request of the batch; streaming costs the
server one message per step per request, which is how SGLang is normally served anyway.

For a batch of N requests that run together, the aggregate decode rate is the sum of the per-request rates:
sum_i (c_i - 1) / d_i. Requests finish at slightly different rounds when acceptance differs, and the last ones run
in a smaller batch; `decode_tokens_per_s_window` (all decode tokens over the span from the first request's first
token to the last request's end, client clock) is the conservative companion.

Step time: d_i / rounds_i, rounds_i = spec_verify_ct for speculative methods (one draft + verify per round),
completion_tokens - 1 for plain. Acceptance: tau = mean tokens committed per round, from SGLang's per-request
spec_correct_drafts_histogram (counts of rounds by accepted draft tokens, as verified, before any truncation at
max_new_tokens); per-depth acceptance P(>= d draft tokens accepted) from the same. SGLang's own
completion_tokens / spec_verify_ct (`tau_meta`) counts the prefill token too and is kept for reference.
"""

from __future__ import annotations

import concurrent.futures
import json
import statistics
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class RequestResult:
    index: int
    t_send: float
    t_first: float | None = None  # client clock: first chunk with >= 1 completion token
    t_last: float | None = None  # client clock: the final chunk
    meta: dict = field(default_factory=dict)  # meta_info of the final chunk
    chunks: int = 0
    error: str | None = None
    output_ids: list | None = None  # the final chunk's output_ids (cumulative in SGLang's default streaming)


class Client(Protocol):
    """What a measurement needs from a server (the real one is HttpClient; tests fake it)."""

    def generate_stream(self, payload: dict, timeout_s: float) -> RequestResult: ...

    def metrics_text(self) -> str: ...

    def server_info(self) -> dict: ...

    def flush_cache(self) -> bool: ...


class HttpClient:
    def __init__(self, base_url: str, clock=time.perf_counter):
        self.base_url = base_url.rstrip("/")
        self.clock = clock
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # localhost: never a proxy

    def _open(self, path: str, body: dict | None = None, timeout_s: float = 30.0):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base_url + path, data=data, method="POST" if data else "GET",
                                     headers={"Content-Type": "application/json"} if data else {})
        return self._opener.open(req, timeout=timeout_s)

    def generate_stream(self, payload: dict, timeout_s: float, index: int = 0, on_chunk=None) -> RequestResult:
        """on_chunk(result): called after each streamed chunk (e.g. to act once a request reached some length)."""
        result = RequestResult(index=index, t_send=self.clock())
        try:
            with self._open("/generate", {**payload, "stream": True}, timeout_s) as resp:
                for raw in resp:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    body = line[5:].strip()
                    if body == b"[DONE]":
                        break
                    now = self.clock()
                    chunk = json.loads(body)
                    if "error" in chunk:
                        result.error = str(chunk["error"])[:500]
                        break
                    result.chunks += 1
                    meta = chunk.get("meta_info") or {}
                    if result.t_first is None and int(meta.get("completion_tokens") or 0) >= 1:
                        result.t_first = now
                    result.t_last = now
                    result.meta = meta
                    if chunk.get("output_ids") is not None:
                        result.output_ids = chunk["output_ids"]
                    if on_chunk is not None:
                        on_chunk(result)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            detail = exc.read().decode(errors="replace")[:500] if isinstance(exc, urllib.error.HTTPError) else ""
            result.error = f"{type(exc).__name__}: {exc} {detail}".strip()
        return result

    def metrics_text(self) -> str:
        with self._open("/metrics", timeout_s=30) as resp:
            return resp.read().decode()

    def server_info(self) -> dict:
        with self._open("/server_info", timeout_s=30) as resp:
            return json.loads(resp.read())

    def flush_cache(self) -> bool:
        try:
            with self._open("/flush_cache", {}, timeout_s=30) as resp:
                return 200 <= resp.status < 300
        except (urllib.error.URLError, OSError):
            return False


def run_batch(client: Client, payloads: list[dict], timeout_s: float) -> list[RequestResult]:
    """Send every payload at once (one thread each, released together) and wait for all of them."""
    start = threading.Barrier(len(payloads))

    def one(i: int) -> RequestResult:
        start.wait()
        res = client.generate_stream(payloads[i], timeout_s)
        res.index = i
        return res

    pool = concurrent.futures.ThreadPoolExecutor(len(payloads))
    try:
        return list(pool.map(one, range(len(payloads))))
    finally:
        # On an interrupt do not wait for requests still streaming: the caller is about to kill the servers,
        # which ends them.
        pool.shutdown(wait=False, cancel_futures=True)


# A request's decode rate this many times the run's median counts as an outlier (decode_rate_outliers). Requests of one
# run differ by prompt (acceptance) and by when they joined the batch, well within 2x in the committed sweeps.
RATE_OUTLIER = 3.0


def _decode_seconds(r: RequestResult) -> tuple[float | None, str]:
    c = int(r.meta.get("completion_tokens") or 0)
    tp = r.meta.get("decode_throughput")
    if tp and c > 1:
        return (c - 1) / float(tp), "server"
    if r.t_first is not None and r.t_last is not None and r.t_last > r.t_first:
        return r.t_last - r.t_first, "client"
    return None, "none"


def pooled_histogram(results: list[RequestResult]) -> list[int]:
    pooled: list[int] = []
    for r in results:
        hist = r.meta.get("spec_correct_drafts_histogram") or r.meta.get("spec_accept_histogram") or []
        for k, n in enumerate(hist):
            if k >= len(pooled):
                pooled.extend([0] * (k + 1 - len(pooled)))
            pooled[k] += int(n)
    return pooled


def acceptance_from_histogram(hist: list[int], depth_limit: int | None = None) -> dict:
    """hist[k] = rounds that accepted k draft tokens. tau = mean tokens committed per round (k + the bonus)."""
    rounds = sum(hist)
    if rounds == 0:
        return {"rounds": 0, "tau": None, "accept_rate_by_depth": []}
    depth_limit = depth_limit if depth_limit is not None else len(hist) - 1
    tau = sum((k + 1) * n for k, n in enumerate(hist)) / rounds
    at_least = [sum(hist[d:]) / rounds for d in range(1, depth_limit + 1)]
    return {"rounds": rounds, "tau": tau, "accept_rate_by_depth": at_least}


def _ids_digest(ids) -> str | None:
    if ids is None:
        return None
    import hashlib

    return hashlib.sha256(",".join(str(int(t)) for t in ids).encode()).hexdigest()[:16]


def summarize(results: list[RequestResult], *, method: str, max_new_tokens: int, depth_limit: int = 15,
              groups: int = 1) -> dict:
    """The row's numbers from one run's request results (pure; raises ValueError when nothing usable came).
    groups: the run was that many batches one after the other (equal sizes): tokens/s is the sum of the requests'
    decode rates divided by it, i.e. the mean batch's throughput."""
    if groups < 1 or len(results) % groups:
        raise ValueError(f"{len(results)} results cannot be {groups} equal batches.")
    errors = [r.error for r in results if r.error]
    if errors:
        raise ValueError(f"{len(errors)} of {len(results)} requests failed; first: {errors[0]}")
    spec = method != "plain"
    completions = [int(r.meta.get("completion_tokens") or 0) for r in results]
    decode, sources = [], set()
    for r in results:
        d, src = _decode_seconds(r)
        if d is None or d <= 0:
            raise ValueError(f"request {r.index} has no decode time (completion_tokens "
                             f"{r.meta.get('completion_tokens')}, chunks {r.chunks}).")
        decode.append(d)
        sources.add(src)
    rounds = []
    for r, c in zip(results, completions):
        rounds.append(int(r.meta.get("spec_verify_ct") or 0) if spec else c - 1)
    step_ms = [1e3 * d / n for d, n in zip(decode, rounds) if n > 0]
    firsts = [r.t_first for r in results if r.t_first is not None]
    lasts = [r.t_last for r in results if r.t_last is not None]
    decode_tokens = sum(c - 1 for c in completions)
    rates = [(c - 1) / d for c, d in zip(completions, decode)]
    median_rate = statistics.median(rates)
    out = {
        "requests": len(results),
        "prompt_groups": groups,
        "completion_tokens_min": min(completions),
        "completion_tokens_max": max(completions),
        "all_full_length": all(c == max_new_tokens for c in completions),
        "decode_timing": "+".join(sorted(sources)),
        "decode_tokens_per_s": sum(rates) / groups,
        "decode_tokens_per_s_per_request": statistics.fmean(rates),
        # Requests decoding over RATE_OUTLIER x the run's median rate: a decode time measured short, which alone can
        # inflate the summed rate. Measured at 8B shapes at batch 64 (an `auto` sweep, in the git history): one run
        # in six of two servers read 2.0-2.2x the others while that run took longer and the step time did not move.
        # Tiny pair (a paired sweep, batch 64, in the git history): the flagged runs' summed rates 1.5-2.9x their
        # row's median, their window rates in range, so requests timed short. Counted, not dropped: the row's rate
        # keeps its definition; the paired tables leave the flagged runs' rounds out (ddtree_bench/paired.py).
        "decode_rate_outliers": sum(r > RATE_OUTLIER * median_rate for r in rates),
        "decode_tokens_per_s_window": (decode_tokens / (max(lasts) - min(firsts))  # gaps between batches included
                                       if firsts and lasts and max(lasts) > min(firsts) else None),
        "step_ms": statistics.median(step_ms) if step_ms else None,
        "step_ms_mean": statistics.fmean(step_ms) if step_ms else None,
        "rounds_per_request": statistics.fmean(rounds),
        "ttft_ms_median": (1e3 * statistics.median(r.t_first - r.t_send for r in results if r.t_first is not None)
                           if firsts else None),
        "first_token_spread_s": (max(firsts) - min(firsts)) if firsts else None,
        "e2e_s_max": max((float(r.meta.get("e2e_latency") or 0.0) for r in results), default=None),
        "queue_time_max_s": max((float(r.meta["queue_time"]) for r in results if "queue_time" in r.meta),
                                default=None),
        # Per request (in payload order): a digest of the generated token ids, so rows of different methods on the
        # same prompts can be checked for identical (lossless) greedy output.
        "output_sha256": [_ids_digest(r.output_ids) for r in sorted(results, key=lambda r: r.index)],
    }
    if spec:
        hist = pooled_histogram(results)
        acc = acceptance_from_histogram(hist, depth_limit)
        verify = sum(rounds)
        out.update({
            "tau": acc["tau"],
            "tau_meta": sum(completions) / verify if verify else None,
            "accept_histogram": hist,
            "accept_rate_by_depth": acc["accept_rate_by_depth"],
            "verify_rounds": verify,
        })
    return out
