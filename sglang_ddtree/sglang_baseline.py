"""Baseline files from a DDTREE server run: the worker's debug dump plus the server's /generate results.

A DDTREE server started with `--speculative-ddtree-debug DUMP` writes one JSON line per (verify round, batch row)
(sglang_ddtree/sglang/stats.py): the request's `rid`, `output_tokens_before` (output tokens it had before the
round), the round's tree, accepted path and emitted tokens. /generate answers every request with its `output_ids`
and `meta_info` (`id` = the rid, `prompt_tokens`, `finish_reason`, `spec_verify_ct`,
`spec_correct_drafts_histogram`). Joining the two by rid gives one baseline record per request, in the format of
docs/baseline-format.md, so `sglang-ddtree compare OFFLINE.jsonl SERVER.jsonl` can check the same run token for
token and round for round.

Attribution of a request's dump lines (file order):
  * the round's root (the token its tree hangs from) sits at output position `output_tokens_before - 1`;
  * rounds whose root is the last output token or later emitted nothing the request kept: with overlap scheduling
    the scheduler launches one more round before it learns that the request finished. They are dropped (counted
    in `extra.server.rounds_after_end`);
  * the kept rounds must chain: round 0 hangs from position 0 (the prefill token), round r+1 from round r's root +
    its accept length; the tree's root token must be the output token there, the emitted tokens the output tokens
    that follow (up to the end of the output), their number SGLang's `spec_verify_ct` and their accept lengths
    SGLang's histogram. Anything else is reported as a problem for that request (its record is still written when
    the rounds cover the output, so the comparator can show where it differs).

Prompt identity: the baseline keys records by prompt id. Each request gives its prompt id explicitly, or the
converter takes it from an offline baseline by the sha256 of the prompt token ids, or falls back to the rid.

Command line: `sglang-ddtree from-server --debug DUMP --results RESULTS.jsonl --out SERVER.jsonl`, where each line
of RESULTS.jsonl is `{"prompt_id": ..., "prompt_ids": [...], "prompt_index": ..., "sampling_params": {...},
"response": <the /generate answer for that prompt>}` (everything but `response` optional), or a bare /generate
answer.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable

from sglang_ddtree.baseline import (
    Baseline, BaselineHeader, MethodRecord, fingerprint_dir, method_name, prompt_sha256, validate_tree_dump,
)
from sglang_ddtree.stages import STAGES



# ----------------------------------------------------------------------------------------------------------
# inputs


@dataclass
class DebugDump:
    """The debug dump's header and its round lines grouped by request id (file order kept)."""

    budget: int | None
    depth_limit: int | None
    rows_by_rid: dict[str, list[dict]]
    rows_without_rid: int = 0
    path: str | None = None


def read_debug_dump(path: str | os.PathLike, rids: Iterable[str] | None = None) -> DebugDump:
    """Read a `--speculative-ddtree-debug` file. Only lines of `rids` are kept when given (dumps grow with the
    budget). A half-written last line (the server may still be writing a round) is ignored."""
    path = str(path)
    if not os.path.exists(path):
        raise ValueError(f"debug dump {path!r} does not exist; start the server with --speculative-ddtree-debug.")
    wanted = None if rids is None else set(rids)
    with open(path, encoding="utf-8") as f:
        lines = [ln for ln in f.read().split("\n") if ln.strip()]
    headers: list[dict] = []
    rows: dict[str, list[dict]] = {}
    without = 0
    for n, line in enumerate(lines, start=1):
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines):
                break
            raise ValueError(f"{path}:{n}: not valid JSON (a truncated write?).") from None
        if not isinstance(d, dict):
            raise ValueError(f"{path}:{n}: a debug dump line must be a JSON object.")
        if d.get("type") == "header":
            headers.append(d)
            continue
        if d.get("type") is not None:  # state lines (e.g. `auto`'s chooser table): not rounds of a request
            continue
        rid = d.get("rid")
        if rid is None:
            without += 1
            continue
        if wanted is None or rid in wanted:
            rows.setdefault(str(rid), []).append(d)
    budgets = {h.get("budget") for h in headers}
    if len(budgets) > 1:
        raise ValueError(f"{path}: headers of several servers with different budgets {sorted(budgets)}; "
                         "use one dump file per server.")
    if without and not rows:
        raise ValueError(f"{path}: its round lines carry no request id (rid); it was written by an older "
                         "sglang-ddtree, whose rounds cannot be attributed to requests.")
    header = headers[0] if headers else {}
    return DebugDump(budget=header.get("budget"), depth_limit=header.get("depth_limit"), rows_by_rid=rows,
                     rows_without_rid=without, path=path)


@dataclass
class ServerRequest:
    """One prompt sent to the server and its /generate answer."""

    response: dict  # {"output_ids": [...], "meta_info": {"id": rid, ...}, ...}
    prompt_id: str | None = None
    prompt_ids: list[int] | None = None  # the prompt's token ids (for prompt_sha256 and prompt matching)
    prompt_index: int | None = None
    sampling_params: dict | None = None

    @property
    def rid(self) -> str:
        return str(self.response["meta_info"]["id"])

    def check(self, where: str) -> None:
        r = self.response
        if not isinstance(r, dict) or "output_ids" not in r or not isinstance(r.get("meta_info"), dict):
            raise ValueError(f"{where}: a /generate answer needs 'output_ids' and 'meta_info' (one prompt's dict).")
        if r["meta_info"].get("id") is None:
            raise ValueError(f"{where}: meta_info has no 'id' (the request id that the debug dump records).")
        if not isinstance(r["output_ids"], list) or any(not isinstance(t, int) for t in r["output_ids"]):
            raise ValueError(f"{where}: output_ids must be a list of token ids.")


def read_results(path: str | os.PathLike) -> list[ServerRequest]:
    """RESULTS.jsonl: one request per line (see the module docstring)."""
    path = str(path)
    if not os.path.exists(path):
        raise ValueError(f"results file {path!r} does not exist.")
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(f"{path}:{n}: not valid JSON.") from None
            if not isinstance(d, dict):
                raise ValueError(f"{path}:{n}: each line must be a JSON object.")
            if "response" in d:
                req = ServerRequest(response=d["response"], prompt_id=d.get("prompt_id"),
                                    prompt_ids=d.get("prompt_ids"), prompt_index=d.get("prompt_index"),
                                    sampling_params=d.get("sampling_params"))
            else:
                req = ServerRequest(response=d)
            req.check(f"{path}:{n}")
            out.append(req)
    return out


# ----------------------------------------------------------------------------------------------------------
# one request


def _finish_reason(meta: dict) -> str | None:
    fr = meta.get("finish_reason")
    kind = fr.get("type") if isinstance(fr, dict) else fr
    if kind == "length":
        return "length"
    if kind == "stop" and isinstance(fr, dict) and isinstance(fr.get("matched"), int):
        return "eos"  # a stop token (EOS or stop_token_ids); a matched stop string is not one
    return None


def request_record(rows: list[dict], req: ServerRequest, prompt_id: str, method: str,
                   problems: list[str]) -> MethodRecord | None:
    """The baseline record of one request from its dump lines. Appends what does not add up to `problems`;
    returns None when the rounds cannot be placed on the output (no record can be built)."""
    meta = req.response["meta_info"]
    out = [int(t) for t in req.response["output_ids"]]
    n = len(out)
    tag = f"prompt {prompt_id} (rid {req.rid})"

    def problem(msg: str) -> None:
        problems.append(f"{tag}: {msg}")

    kept, after_end = [], 0
    for row in rows:
        before = row.get("output_tokens_before")
        if before is None:
            problem("a dump line has no output_tokens_before; cannot place its round on the output")
            return None
        if int(before) - 1 >= n - 1:
            after_end += 1  # launched before the scheduler saw the request finish: emitted nothing kept
        else:
            kept.append(row)

    accept, ranks, sizes, expected, trees = [], [], [], [], []
    stage_ms: dict[str, list[float]] = {s: [] for s in STAGES}
    have_ranks, have_stages = True, True
    pos = 0  # output position of the next round's root
    for r, row in enumerate(kept):
        root = int(row["output_tokens_before"]) - 1
        if root != pos:
            problem(f"round {r} hangs from output position {root}, expected {pos} (rounds are missing or repeated)")
            return None
        a = int(row["accept_len"])
        tokens = [int(t) for t in row["tree_tokens"]]
        if tokens[0] != out[root]:
            problem(f"round {r}: the tree's root token {tokens[0]} is not output token {root} ({out[root]})")
        emitted = [int(t) for t in row["out_tokens"]][: max(0, min(a, n - 1 - root))]
        if emitted != out[root + 1: root + 1 + len(emitted)]:
            problem(f"round {r}: emitted {emitted} but the output has {out[root + 1: root + 1 + len(emitted)]} "
                    f"at positions {root + 1}..")
        path = [int(p) for p in row["path"]]
        if len(path) != a or (path and path[0] != 0):
            problem(f"round {r}: accepted path {path} does not match accept length {a}")
        tree = {"tokens": tokens, "parents": [int(p) for p in row["tree_parents"]],
                "scores": [None if s is None else float(s) for s in row["tree_scores"]]}
        if row.get("tree_ranks") is not None:
            tree["ranks"] = [int(x) for x in row["tree_ranks"]]
            ranks.append([tree["ranks"][p] for p in path[1:]])
        else:
            have_ranks = False
        accept.append(a)
        sizes.append(int(row["tree_size"]))
        expected.append(float(row["expected_accept"]))
        trees.append(tree)
        ms = row.get("stage_ms") or {}
        if all(s in ms for s in STAGES):
            for s in STAGES:
                stage_ms[s].append(float(ms[s]))
        else:
            have_stages = False
        pos = root + a
    if n and pos + 1 < n:
        problem(f"the dump's rounds cover output tokens 0..{pos} of {n}: rounds are missing "
                "(a dump from another server or a rank that does not write it?)")
        return None

    verify_ct = meta.get("spec_verify_ct")
    if verify_ct is not None and int(verify_ct) != len(accept):
        problem(f"{len(accept)} rounds in the dump but SGLang counted spec_verify_ct={verify_ct}")
    hist = meta.get("spec_correct_drafts_histogram")
    if hist:
        mine = [0] * max(len(hist), max(accept) if accept else 0)
        for a in accept:
            mine[a - 1] += 1
        if [int(x) for x in hist] + [0] * (len(mine) - len(hist)) != mine:
            problem(f"accept lengths {accept} do not give SGLang's histogram {hist}")
    prompt_len = meta.get("prompt_tokens")
    dump_lens = {row.get("prompt_len") for row in kept} - {None}
    if prompt_len is not None and dump_lens and dump_lens != {int(prompt_len)}:
        problem(f"prompt length {prompt_len} in meta_info but {sorted(dump_lens)} in the dump")
    if req.prompt_ids is not None and prompt_len is not None and len(req.prompt_ids) != int(prompt_len):
        problem(f"{len(req.prompt_ids)} prompt token ids given but the server saw {prompt_len}")
    if meta.get("num_retractions"):
        problem(f"the request was retracted {meta['num_retractions']} time(s); its rounds may not chain")

    rec = MethodRecord(
        prompt_id=prompt_id, method=method, output_ids=out, prompt_index=req.prompt_index,
        num_input_tokens=int(prompt_len) if prompt_len is not None else (
            len(req.prompt_ids) if req.prompt_ids is not None else None),
        prompt_sha256=prompt_sha256(req.prompt_ids) if req.prompt_ids is not None else None,
        finish_reason=_finish_reason(meta), accept_lengths=accept, accepted_ranks=ranks if have_ranks else None,
        tree_sizes=sizes, expected_accepts=expected, margins=None, stage_ms=stage_ms if have_stages else None,
        trees=trees,
        extra={"server": {"rid": req.rid, "rounds_after_end": after_end,
                          "batch_sizes": sorted({int(row.get("batch_size") or 0) for row in kept}),
                          "stage_ms_note": "per batch round: shared by every request of the batch"}},
    )
    try:
        rec.validate(tag, check_trees=False)
    except ValueError as e:
        problem(str(e))
        return None
    for r, tree in enumerate(trees):
        try:
            validate_tree_dump(tree, f"round {r}")
        except ValueError as e:  # kept in the record: the comparator reports the round
            problem(f"malformed tree: {e}")
    return rec


# ----------------------------------------------------------------------------------------------------------
# a whole run


@dataclass
class ServerConversion:
    baseline: Baseline
    problems: list[str] = field(default_factory=list)


def prompt_ids_by_sha(baseline: Baseline) -> dict[str, str]:
    """sha256 of the prompt token ids -> prompt id, from a baseline (e.g. the offline run of the same prompts)."""
    out: dict[str, str] = {}
    for rec in baseline.records:
        if rec.prompt_sha256:
            out.setdefault(rec.prompt_sha256, rec.prompt_id)
    return out


def sampling_settings(requests: list[ServerRequest]) -> dict[str, Any]:
    """temperature / top_k / top_p / max_new_tokens common to every request's sampling_params (None if unknown);
    requests with different settings are not one run."""
    out: dict[str, Any] = {}
    for key in ("temperature", "top_k", "top_p", "max_new_tokens"):
        values = {json.dumps((r.sampling_params or {}).get(key)) for r in requests if r.sampling_params}
        values.discard("null")
        if len(values) > 1:
            raise ValueError(f"requests were sent with different {key} values {sorted(values)}; "
                             "a baseline file holds one decoding configuration.")
        out[key] = json.loads(values.pop()) if values else None
    return out


def server_header(*, budget: int | None, depth_limit: int | None, requests: list[ServerRequest],
                  target: str | None = None, drafter: str | None = None, dtype: str | None = None,
                  dataset: str | None = None, seed: int | None = None, extra: dict | None = None) -> BaselineHeader:
    """Header of a server-produced baseline. target/drafter: model folders (fingerprinted like the offline runner
    does, so the comparator can tell whether both runs used the same weights)."""
    s = sampling_settings(requests)
    return BaselineHeader(
        source="sglang",
        target={"path": os.path.abspath(target) if target else None,
                "fingerprint": fingerprint_dir(target) if target else None},
        drafter={"path": os.path.abspath(drafter) if drafter else None,
                 "fingerprint": fingerprint_dir(drafter) if drafter else None},
        dtype=dtype, device="cuda", attn_implementation=None,
        temperature=float(s["temperature"] or 0.0), top_k=s["top_k"], top_p=s["top_p"], seed=seed,
        max_new_tokens=s["max_new_tokens"], block_size=depth_limit + 1 if depth_limit is not None else None,
        dataset=dataset, extra={"budget": budget, **(extra or {})},
    )


def convert(dump: DebugDump | str | os.PathLike, requests: list[ServerRequest], *,
            header: BaselineHeader | None = None, match_prompts: Baseline | None = None,
            method: str | None = None) -> ServerConversion:
    """One record per request. Prompt ids: the request's own, else by prompt sha256 in `match_prompts`, else the
    rid. The method is `ddtree_tb{budget}` from the dump's header unless given."""
    for i, req in enumerate(requests):
        req.check(f"request {i}")
    if not isinstance(dump, DebugDump):
        dump = read_debug_dump(dump, rids=[r.rid for r in requests])
    if method is None:
        if dump.budget is None:
            raise ValueError("the debug dump has no header with the budget; pass convert(method='ddtree_tb<B>').")
        method = method_name("ddtree", int(dump.budget))
    if header is None:
        header = server_header(budget=dump.budget, depth_limit=dump.depth_limit, requests=requests)
    by_sha = prompt_ids_by_sha(match_prompts) if match_prompts is not None else {}
    problems: list[str] = []
    records: list[MethodRecord] = []
    seen: set[str] = set()
    for req in requests:
        pid = req.prompt_id
        if pid is None and by_sha:
            if req.prompt_ids is None:
                raise ValueError(f"request {req.rid}: matching prompts by sha256 needs its prompt token ids.")
            pid = by_sha.get(prompt_sha256(req.prompt_ids))
            if pid is None:
                problems.append(f"rid {req.rid}: its prompt is not in the baseline used to match prompts")
                continue
        pid = str(pid if pid is not None else req.rid)
        if pid in seen:
            raise ValueError(f"prompt id {pid!r} appears twice; a baseline file has one record per prompt and method.")
        seen.add(pid)
        rows = dump.rows_by_rid.get(req.rid, [])
        if not rows and req.response["meta_info"].get("spec_verify_ct"):
            problems.append(f"prompt {pid} (rid {req.rid}): no round of this request in the dump")
            continue
        rec = request_record(rows, req, pid, method, problems)
        if rec is not None:
            records.append(rec)
    return ServerConversion(Baseline(header, records), problems)


def write_server_baseline(path: str | os.PathLike, baseline: Baseline) -> None:
    """Write the file (overwriting). Records are validated without their trees, like readers do, so a malformed
    tree from a buggy server is kept for the comparator to report instead of stopping the write."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(baseline.header.to_json(), separators=(",", ":"), allow_nan=False) + "\n")
        for rec in baseline.records:
            rec.validate(f"record {rec.prompt_id}/{rec.method}", check_trees=False)
            f.write(json.dumps(rec.to_json(), separators=(",", ":"), allow_nan=False) + "\n")


# ----------------------------------------------------------------------------------------------------------
# command line (wired in sglang_ddtree/cli.py)


def add_from_server_parser(sub) -> None:
    p = sub.add_parser("from-server", help="baseline file from a DDTREE server's debug dump and /generate results")
    p.add_argument("--debug", required=True, help="the server's --speculative-ddtree-debug JSONL")
    p.add_argument("--results", required=True, help="JSONL, one /generate answer per line (see sglang_baseline.py)")
    p.add_argument("--out", required=True, help="baseline JSONL to write (overwritten)")
    p.add_argument("--match-prompts", help="baseline file whose prompt ids are taken by prompt token sha256")
    p.add_argument("--target", help="target model folder the server ran (fingerprinted)")
    p.add_argument("--drafter", help="drafter folder the server ran (fingerprinted)")
    p.add_argument("--dtype", default=None, help="the server's dtype (e.g. bfloat16), recorded in the header")
    p.add_argument("--dataset", default=None, help="prompt set name, recorded in the header")
    p.add_argument("--seed", type=int, default=None, help="the server's --random-seed, recorded in the header")
    p.add_argument("--allow-problems", action="store_true", help="exit 0 even when some rounds do not add up")
    p.set_defaults(func=cmd_from_server)


def cmd_from_server(args) -> int:
    """Exit 0: written, every request adds up; 1: written with problems (listed); 2: bad input."""
    from sglang_ddtree.baseline import read_baseline

    from sglang_ddtree.cli_args import check_output_file

    try:
        check_output_file(args.out)
        requests = read_results(args.results)
        dump = read_debug_dump(args.debug, rids=[r.rid for r in requests])
        if dump.budget is None:  # a server writes the header when its worker starts: not a whole server dump
            with open(args.debug, encoding="utf-8") as f:
                what = "is empty" if not f.read().strip() else "has no header line (the budget the server ran)"
            raise ValueError(f"debug dump {args.debug!r} {what}: pass the whole file that a DDTREE server wrote "
                             "with --speculative-ddtree-debug DUMP (it starts with a header line holding the budget).")
        match = read_baseline(args.match_prompts) if args.match_prompts else None
        for d in (args.target, args.drafter):
            if d is not None and not os.path.isdir(d):
                raise ValueError(f"model folder {d!r} does not exist.")
        header = server_header(budget=dump.budget, depth_limit=dump.depth_limit, requests=requests,
                               target=args.target, drafter=args.drafter, dtype=args.dtype, dataset=args.dataset,
                               seed=args.seed, extra={"debug_dump": os.path.abspath(args.debug)})
        conv = convert(dump, requests, header=header, match_prompts=match)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_server_baseline(args.out, conv.baseline)
    for p in conv.problems:
        print(f"problem: {p}", file=sys.stderr)
    print(f"wrote {len(conv.baseline.records)} of {len(requests)} requests to {args.out}"
          + (f" ({len(conv.problems)} problem(s))" if conv.problems else ""))
    return 1 if conv.problems and not args.allow_problems else 0
