"""The importer for the DDTree paper's reference benchmark output (a torch.save file) into a Baseline
(baseline.py; the format: docs/baseline-format.md). `sglang-ddtree import-reference` and `compare` on a .pt use it.
"""

from __future__ import annotations

import json
import os
import types
from typing import Any

from sglang_ddtree.baseline import (REFERENCE_EXTRA_ROUND_KEY, Baseline, BaselineHeader, MethodRecord, parse_method,
                                    prompt_sha256, round_tree_hashes, tree_hash, validate_tree_dump)


_REFERENCE_METHOD_FIELDS = ("output_ids", "num_input_tokens", "num_output_tokens", "acceptance_lengths")


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _has(obj: Any, name: str) -> bool:
    return (name in obj) if isinstance(obj, dict) else hasattr(obj, name)


def _to_list(x: Any, where: str) -> list:
    if x is None:
        return []
    if hasattr(x, "tolist"):
        x = x.tolist()
    if isinstance(x, (list, tuple)):
        return list(x)
    if isinstance(x, (int, float)):
        return [x]
    raise ValueError(f"{where}: expected a list or tensor, got {type(x).__name__}.")


def _int(x: Any, where: str) -> int:
    """int(x) for a whole number (a Python or tensor scalar); a ValueError naming `where` for anything else."""
    if hasattr(x, "item") and getattr(x, "numel", lambda: 1)() == 1:
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, (int, float)) or (isinstance(x, float) and not x.is_integer()):
        raise ValueError(f"{where}: expected a whole number, got {type(x).__name__} {str(x)[:40]!r}.")
    return int(x)


_EXPECTED = "the .pt file that the DDTree paper's benchmark wrote with torch.save"


def _refuse_other_formats(path: str) -> None:
    """After torch.load failed: raise ValueError saying what the file is when it cannot be a torch.save output
    (those are zip archives, or pickles in torch's legacy format), so that --trust-pickle is suggested only for a
    file that may be one."""
    with open(path, "rb") as f:
        head = f.read(4096)
    if head.startswith(b"PK\x03\x04") or head[:1] == b"\x80":
        return
    note = ""
    if not head.strip():
        what = "is empty"
    elif head.lstrip()[:1] in (b"{", b"["):
        what = "is JSON text, not a torch.save file"
        note = " (a baseline JSONL needs no import: `sglang-ddtree compare` reads it as it is)"
    elif b"\x00" not in head:
        what = "is a text file, not a torch.save file"
    else:
        what = "is not a torch.save file (neither a zip archive nor a pickle)"
    raise ValueError(f"{path} {what}; expected {_EXPECTED}{note}.")


def load_reference_file(path: str | os.PathLike, *, trust_pickle: bool = False) -> dict:
    """torch.load the reference output. Default: weights_only=True with SimpleNamespace allowed (the reference
    stores per-method results as namespaces); trust_pickle=True loads arbitrary pickles: only for files you made."""
    import torch

    path = str(path)
    if not os.path.exists(path):
        raise ValueError(f"reference file {path!r} does not exist.")
    if os.path.isdir(path):
        raise ValueError(f"reference {path!r} is a folder; expected {_EXPECTED}.")
    if trust_pickle:
        try:
            data = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as e:  # a file that is not a torch.save output fails anywhere in the unpickler
            _refuse_other_formats(path)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"{path}: not a file written by torch.save "
                             f"({type(e).__name__}: {first[:200].rstrip('.')}).") from None
    else:
        try:
            with torch.serialization.safe_globals([types.SimpleNamespace]):
                data = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # the unpickler's message is long; keep the first line
            _refuse_other_formats(path)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(
                f"{path}: could not load with weights_only=True ({first[:200]}). If you made this file yourself, "
                "retry with trust_pickle=True (--trust-pickle)."
            ) from None
    return data


def _reference_tree(t: Any, root_token: int | None, where: str) -> dict[str, list]:
    """One round's tree from the reference dump. Accepted shapes (anything else is rejected):

    * the reference's own tree trace (`ddtree_generate(..., save_tree_traces=True)`): a dict
      `{"accepted_indices": [0, i1, ...], "tree": {"node_token_ids": [n tokens], "node_depths": [n depths],
      "parents": [-1, p1, ..., pn]}}`: the draft nodes are listed without the root, `parents` has one entry more
      (index 0 is the root) and node i of the verify is draft node i - 1;
    * a dict with tokens (`tokens`|`node_tokens`|`token_ids`|`node_token_ids`) and parents
      (`parents`|`parent_ids`), optional scores (`scores`|`log_probs`|`logw`) and depths (`depths`|`node_depths`);
    * a tuple/list (tokens, parents[, scores]).
    When the tokens list only the draft nodes, a root with the round's root token is prepended: either `parents`
    already has the root's entry (one longer than the tokens, parents[0] = -1) or the depth-1 nodes have parent -1
    and every parent index is shifted by one. The dump keeps `depths` (checked against the parents) and
    `accepted` (the accepted node indices, root first) when the file has them."""

    def pick(d, names):
        for n in names:
            if _has(d, n) and _get(d, n) is not None:
                return _get(d, n)
        return None

    accepted = None
    depths = None
    if isinstance(t, (dict, types.SimpleNamespace)) and _has(t, "tree") and _get(t, "tree") is not None:
        acc = _get(t, "accepted_indices")
        accepted = None if acc is None else [int(x) for x in _to_list(acc, where)]
        t = _get(t, "tree")
    if isinstance(t, (tuple, list)) and 2 <= len(t) <= 3 and all(hasattr(x, "__len__") for x in t):
        tokens, parents = _to_list(t[0], where), _to_list(t[1], where)
        scores = _to_list(t[2], where) if len(t) == 3 else None
    elif isinstance(t, (dict, types.SimpleNamespace)):
        tokens = pick(t, ("tokens", "node_tokens", "token_ids", "node_token_ids"))
        parents = pick(t, ("parents", "parent_ids"))
        if tokens is None or parents is None:
            keys = sorted(t.keys() if isinstance(t, dict) else vars(t).keys())
            raise ValueError(f"{where}: unknown tree shape, keys {keys}; expected tokens (node_token_ids) and "
                             "parents, or the reference's {'accepted_indices', 'tree'} trace.")
        tokens, parents = _to_list(tokens, where), _to_list(parents, where)
        sc = pick(t, ("scores", "log_probs", "logw"))
        scores = _to_list(sc, where) if sc is not None else None
        dp = pick(t, ("depths", "node_depths"))
        depths = [int(x) for x in _to_list(dp, where)] if dp is not None else None
    else:
        raise ValueError(f"{where}: unknown tree shape {type(t).__name__}; expected a dict or (tokens, parents[, scores]).")
    tokens = [int(x) for x in tokens]
    parents = [int(x) for x in parents]
    scores = None if scores is None else [float(x) for x in scores]
    if len(parents) == len(tokens) + 1 and parents and parents[0] == -1:
        # the reference's layout: parents include the root's entry, the tokens do not
        if root_token is None:
            raise ValueError(f"{where}: the tree lists draft nodes only and the round's root token is unknown.")
        tokens = [root_token] + tokens
        scores = None if scores is None else [0.0] + scores
        if depths is not None and len(depths) == len(tokens) - 1:
            depths = [0] + depths
    elif len(tokens) != len(parents) or (scores is not None and len(scores) != len(tokens)):
        raise ValueError(f"{where}: tree tokens/parents/scores have different lengths "
                         f"({len(tokens)}/{len(parents)}/{'-' if scores is None else len(scores)}).")
    else:
        roots = [i for i, p in enumerate(parents) if p == -1]
        rooted = roots == [0] and (root_token is None or tokens[0] == root_token)
        if not rooted:
            if root_token is None:
                raise ValueError(f"{where}: tree has no root node and the round's root token is unknown.")
            tokens = [root_token] + tokens
            parents = [-1] + [p + 1 for p in parents]
            scores = None if scores is None else [0.0] + scores
            if depths is not None and len(depths) == len(tokens) - 1:
                depths = [0] + depths
    dump: dict[str, list] = {"tokens": tokens, "parents": parents}
    if scores is not None:
        dump["scores"] = scores
    if depths is not None:
        dump["depths"] = depths
    validate_tree_dump(dump, where)
    if depths is not None:
        for i in range(1, len(tokens)):
            if depths[i] != depths[parents[i]] + 1:
                raise ValueError(f"{where}: node {i} has depth {depths[i]} but its parent {parents[i]} has depth "
                                 f"{depths[parents[i]]}; node depths disagree with the parents.")
    if accepted is not None:
        if not accepted or accepted[0] != 0:
            raise ValueError(f"{where}: accepted_indices must start with the root (0), got {accepted[:4]}.")
        for prev, cur in zip(accepted, accepted[1:]):
            if not 0 < cur < len(tokens) or parents[cur] != prev:
                raise ValueError(f"{where}: accepted_indices {accepted} is not a path from the root "
                                 f"(node {cur} is not a child of node {prev}).")
        dump["accepted"] = accepted
    return dump



def import_reference(path: str | os.PathLike, *, trust_pickle: bool = False, prompt_ids: list[str] | None = None,
                     dataset: str | None = None, target_path: str | None = None,
                     drafter_path: str | None = None, dtype: str | None = None,
                     device: str | None = None) -> Baseline:
    """Convert the DDTree paper's benchmark output into a Baseline. `baseline` is renamed `plain`.

    Expected top level: {"responses": [ {method: result, ...} per prompt ], "block_size": int, "args": dict}.
    A result (dict or namespace) holds output_ids (prompt + generated, [1, T] or [T]), num_input_tokens,
    num_output_tokens, acceptance_lengths, and optionally time_to_first_token, time_per_output_token,
    decode_rounds, stage_times, round_timestamps, round_trees (see `_reference_tree`).

    Every record gets the sha256 of its prompt's token ids (the first num_input_tokens of output_ids), so `compare`
    matches prompts by their tokens whatever they are called. Prompt ids: `prompt_ids`, else the response index.
    dtype / device: what the run used. The file does not say (the published harness loads bf16 on CUDA, a run on
    other hardware had to change it), so they come from these arguments, else from `args['dtype']` /
    `args['device']` when the harness recorded them, else stay unknown (null).
    The reference loop runs one more round when a round leaves the output exactly full (its loop goes on while
    the root position is below prompt + max_new_tokens) and records that round's acceptance, although none of its
    tokens is kept; such a final round is taken out of `accept_lengths` (and `trees`) and kept in
    `extra['reference_extra_final_round']`, so tau counts the rounds that produced output, as our decoders do.
    """
    path = str(path)
    data = load_reference_file(path, trust_pickle=trust_pickle)
    if not isinstance(data, dict) or "responses" not in data:
        got = sorted(data.keys()) if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{path}: not a reference benchmark file (top level must be a dict with 'responses'; got {got}).")
    responses = data["responses"]
    if not isinstance(responses, (list, tuple)):
        raise ValueError(f"{path}: 'responses' must be a list with one dict per prompt, got {type(responses).__name__}.")
    if prompt_ids is not None and len(prompt_ids) != len(responses):
        raise ValueError(f"{path}: {len(prompt_ids)} prompt ids given for {len(responses)} responses.")
    args = data.get("args") or {}
    if not isinstance(args, dict):
        args = dict(vars(args)) if hasattr(args, "__dict__") else {"repr": repr(args)}
    block_size = data.get("block_size")
    temperature = float(args.get("temperature", 0.0) or 0.0)

    records = []
    for i, resp in enumerate(responses):
        where = f"{path}: responses[{i}]"
        if not isinstance(resp, dict) or not resp:
            raise ValueError(f"{where}: must be a non-empty dict keyed by method (baseline, dflash, ddtree_tb<B>).")
        pid = prompt_ids[i] if prompt_ids is not None else str(i)
        for ref_method, res in resp.items():
            method = "plain" if ref_method == "baseline" else ref_method
            try:
                parse_method(method)
            except ValueError:
                raise ValueError(f"{where}: unknown method key {ref_method!r}; expected baseline, dflash or ddtree_tb<B>.") from None
            records.append(_import_result(res, pid, i, method, f"{where}[{ref_method!r}]"))

    dtype = dtype or _str_or_none(args.get("dtype") or args.get("torch_dtype"))
    device = device or _str_or_none(args.get("device"))
    extra_rounds = sum(1 for r in records if REFERENCE_EXTRA_ROUND_KEY in r.extra)
    header = BaselineHeader(
        source="import:ddtree-reference",
        target={"path": target_path or args.get("model_name_or_path"), "fingerprint": None},
        drafter={"path": drafter_path or args.get("draft_name_or_path"), "fingerprint": None},
        dtype=_normalise_dtype(dtype),
        device=device,
        attn_implementation=data.get("target_attn_implementation"),
        temperature=temperature,
        seed=0,  # the reference seeds everything with 0
        max_new_tokens=args.get("max_new_tokens"),
        block_size=int(block_size) if block_size is not None else None,
        dataset=dataset or args.get("dataset"),
        extra={"imported_from": os.path.abspath(path), "reference_args": _jsonable(args),
               "dtype_source": "given" if dtype else "unknown (the reference file does not record it)",
               "reference_extra_final_rounds": extra_rounds},
    )
    return Baseline(header, records, path)


def _str_or_none(x: Any) -> str | None:
    return None if x is None else str(x)


def _normalise_dtype(name: str | None) -> str | None:
    if name is None:
        return None
    n = str(name).replace("torch.", "").lower()
    return {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}.get(n, n)


def _jsonable(x: Any) -> Any:
    try:
        json.dumps(x)
        return x
    except TypeError:
        if isinstance(x, dict):
            return {str(k): _jsonable(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [_jsonable(v) for v in x]
        if hasattr(x, "tolist"):
            return x.tolist()
        return repr(x)


def _import_result(res: Any, pid: str, index: int, method: str, where: str) -> MethodRecord:
    if not isinstance(res, (dict, types.SimpleNamespace)):
        raise ValueError(f"{where}: a method result must be a dict or namespace, got {type(res).__name__}.")
    missing = [n for n in _REFERENCE_METHOD_FIELDS if not _has(res, n)]
    if missing:
        raise ValueError(f"{where}: result lacks field(s) {missing}.")
    ids = _get(res, "output_ids")
    if hasattr(ids, "dim") and ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(f"{where}: output_ids has batch {ids.shape[0]}; the reference runs batch 1.")
        ids = ids[0]
    ids = [_int(t, f"{where} output_ids") for t in _to_list(ids, where)]
    n_in = _int(_get(res, "num_input_tokens"), f"{where} num_input_tokens")
    n_out = _int(_get(res, "num_output_tokens"), f"{where} num_output_tokens")
    sha = None
    if len(ids) == n_in + n_out:
        out = ids[n_in:]
        sha = prompt_sha256(ids[:n_in])
    elif len(ids) == n_out:  # generated part only
        out = ids
    else:
        raise ValueError(
            f"{where}: output_ids has {len(ids)} tokens, neither num_input_tokens+num_output_tokens "
            f"({n_in}+{n_out}) nor num_output_tokens."
        )
    acc = [_int(a, f"{where} acceptance_lengths") for a in _to_list(_get(res, "acceptance_lengths"), where)]
    rec = MethodRecord(prompt_id=pid, method=method, output_ids=out, prompt_index=index, num_input_tokens=n_in,
                       prompt_sha256=sha, accept_lengths=acc)
    ttft = _get(res, "time_to_first_token")
    if ttft is not None:
        rec.prefill_ms = float(ttft) * 1000.0  # reference timings are in seconds
    tpot = _get(res, "time_per_output_token")
    if tpot is not None and ttft is not None:
        rec.total_ms = rec.prefill_ms + float(tpot) * 1000.0 * max(n_out - 1, 0)
    rec.extra["reference"] = {k: _jsonable(_get(res, k)) for k in
                              ("time_to_first_token", "time_per_output_token", "decode_rounds", "round_timestamps")
                              if _has(res, k)}
    stage = _get(res, "stage_times")
    if stage is not None:
        rec.stage_ms = _import_stage_times(stage, len(acc), rec, where)
    trees = _get(res, "round_trees")
    if trees is not None:
        trees = list(trees)
        if len(trees) != len(acc):
            raise ValueError(f"{where}: round_trees has {len(trees)} rounds but acceptance_lengths has {len(acc)}.")
        starts = rec.round_root_positions()
        rec.trees = [
            None if t is None else _reference_tree(t, out[s] if s < len(out) else None, f"{where} round_trees[{r}]")
            for r, (t, s) in enumerate(zip(trees, starts))
        ]
        for r, (t, a, s) in enumerate(zip(rec.trees, acc, starts)):
            if t is None or "accepted" not in t:
                continue
            if len(t["accepted"]) != a:
                raise ValueError(f"{where} round_trees[{r}]: {len(t['accepted'])} accepted indices but the round's "
                                 f"acceptance length is {a}.")
            path_tokens = [t["tokens"][i] for i in t["accepted"][1:]]
            emitted = out[s + 1: s + a]
            if path_tokens[:len(emitted)] != emitted:
                raise ValueError(f"{where} round_trees[{r}]: the accepted nodes' tokens {path_tokens} are not the "
                                 f"output's tokens {emitted} at positions {s + 1}..{s + a - 1}.")
    _drop_extra_final_round(rec)
    if rec.trees is not None:
        rec.tree_hashes = round_tree_hashes(rec)
    rec.validate(where)
    return rec


def _drop_extra_final_round(rec: MethodRecord) -> None:
    """The reference's loop runs one round past an exactly full output (see `import_reference`): when every output
    token was already emitted before the last round, that round is taken out and kept in extra."""
    acc = rec.accept_lengths
    if not acc or sum(acc[:-1]) + 1 < len(rec.output_ids):
        return
    info: dict[str, Any] = {"accept_length": acc[-1], "round": len(acc) - 1,
                            "why": "the reference ran one more round after the output was full; none of its tokens "
                                   "is in the output, so it is not counted in tau"}
    rec.accept_lengths = acc[:-1]
    if rec.trees is not None:
        last = rec.trees.pop()
        if last is not None:
            info["tree_hash"] = tree_hash(last["tokens"], last["parents"])
    if rec.stage_ms is not None:
        rec.stage_ms = {k: v[:-1] for k, v in rec.stage_ms.items()}
    rec.extra[REFERENCE_EXTRA_ROUND_KEY] = info


def _import_stage_times(stage: Any, n_rounds: int, rec: MethodRecord, where: str) -> dict[str, list[float]] | None:
    """Per-round lists (seconds) become stage_ms; totals are kept in extra['reference']['stage_times_s']."""
    if not isinstance(stage, dict):
        raise ValueError(f"{where}: stage_times must be a dict of stage -> seconds (per round list or total).")
    per_round, totals = {}, {}
    for name, v in stage.items():
        vals = _to_list(v, f"{where} stage_times[{name!r}]")
        if len(vals) == n_rounds and not isinstance(v, (int, float)):
            per_round[str(name)] = [float(x) * 1000.0 for x in vals]
        else:
            totals[str(name)] = [float(x) for x in vals] if len(vals) != 1 else float(vals[0])
    if totals:
        rec.extra.setdefault("reference", {})["stage_times_s"] = totals
    return per_round or None
