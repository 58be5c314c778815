"""Baseline files: one JSONL file per run, a header line then one line per (prompt, method).

The format is documented field by field in docs/baseline-format.md. This module owns the schema
(`BaselineHeader`, `MethodRecord`), reading and writing (with resume), comparability checks between two
headers and model fingerprints. The importer for the DDTree paper's reference benchmark output is
reference_import.py.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from sglang_ddtree.results_file import read_text, stored_path

FORMAT_NAME = "sglang-ddtree-baseline"
FORMAT_VERSION = 1

_METHOD_RE = re.compile(r"^(plain|dflash|ddtree_auto|ddtree_tb([1-9][0-9]*))$")


# ----------------------------------------------------------------------------------------------------------
# method names


def method_name(kind: str, budget: int | None = None) -> str:
    """`plain`, `dflash`, `ddtree_auto` (adaptive budget per round, sglang_ddtree/adaptive.py) or
    `ddtree_tb{budget}`."""
    if kind in ("plain", "dflash", "ddtree_auto"):
        if budget is not None and kind == "ddtree_auto":
            raise ValueError("ddtree_auto chooses its budget every round; it takes no fixed budget.")
        return kind
    if kind == "ddtree":
        if budget is None or int(budget) < 1:
            raise ValueError(f"ddtree needs a budget >= 1, got {budget!r}.")
        return f"ddtree_tb{int(budget)}"
    raise ValueError(f"unknown method kind {kind!r}; allowed: plain, dflash, ddtree, ddtree_auto.")


def parse_method(name: str) -> tuple[str, int | None]:
    """Inverse of `method_name`: 'ddtree_tb64' -> ('ddtree', 64), 'dflash' -> ('dflash', None),
    'ddtree_auto' -> ('ddtree_auto', None)."""
    m = _METHOD_RE.match(name)
    if m is None:
        raise ValueError(f"unknown method name {name!r}; allowed: plain, dflash, ddtree_auto, ddtree_tb<budget> "
                         "(e.g. ddtree_tb64).")
    if m.group(2) is not None:
        return "ddtree", int(m.group(2))
    return m.group(1), None


def method_sort_key(name: str) -> tuple[int, int]:
    kind, budget = parse_method(name)
    return ({"plain": 0, "dflash": 1, "ddtree": 2, "ddtree_auto": 3}[kind], budget or 0)


# ----------------------------------------------------------------------------------------------------------
# schema


@dataclass
class BaselineHeader:
    """Run metadata: enough to decide whether two files are comparable (see `comparability_warnings`)."""

    source: str  # "offline", "import:ddtree-reference", "sglang", ...
    target: dict[str, Any]  # {"path": str|None, "fingerprint": str|None}
    drafter: dict[str, Any] | None = None
    tokenizer: str | None = None
    dtype: str | None = None
    device: str | None = None
    attn_implementation: str | None = None
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    max_new_tokens: int | None = None
    block_size: int | None = None
    dataset: str | None = None
    created: str = ""
    package_version: str = ""
    versions: dict[str, str] = field(default_factory=dict)  # torch / transformers / python versions
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if not self.created:
            self.created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        if not self.package_version:
            from sglang_ddtree import __version__

            self.package_version = __version__

    def to_json(self) -> dict[str, Any]:
        d = {"format": FORMAT_NAME, "version": FORMAT_VERSION}
        d.update(dataclasses.asdict(self))
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any], where: str = "header") -> "BaselineHeader":
        check_format_line(d, where)
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        unknown = {k: v for k, v in d.items() if k not in names and k not in ("format", "version")}
        if "source" not in kwargs or "target" not in kwargs:
            raise ValueError(f"{where}: a baseline header needs 'source' and 'target' fields.")
        hdr = cls(**kwargs)
        if unknown:  # written by a newer minor writer: keep it, don't fail
            hdr.extra = {**hdr.extra, "_unknown_header_fields": unknown}
        return hdr


def check_format_line(d: Any, where: str) -> None:
    if not isinstance(d, dict) or d.get("format") != FORMAT_NAME:
        got = d.get("format") if isinstance(d, dict) else type(d).__name__
        raise ValueError(f"{where}: not a baseline file (first line must have format={FORMAT_NAME!r}, got {got!r}).")
    if d.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{where}: baseline format version {d.get('version')!r} is not supported; "
            f"this sglang-ddtree reads version {FORMAT_VERSION} only."
        )


@dataclass
class MethodRecord:
    """One (prompt, method) result. Lists indexed by round cover speculative rounds only: the first output
    token comes from the prefill and belongs to no round."""

    prompt_id: str
    method: str
    output_ids: list[int]
    prompt_index: int | None = None
    num_input_tokens: int | None = None
    prompt_sha256: str | None = None
    finish_reason: str | None = None  # "eos" | "length" | None (unknown)
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per round incl. bonus
    accepted_ranks: list[list[int]] | None = None  # per round: drafter rank of each accepted draft node
    tree_sizes: list[int] | None = None  # per round: draft nodes in the tree (root excluded)
    expected_accepts: list[float] | None = None  # per round: 1 + sum of exp(score) over draft nodes
    margins: list[float] | None = None  # per output token: target top-1 minus top-2 logit where it was chosen
    stage_ms: dict[str, list[float]] | None = None  # per stage, per round
    prefill_ms: float | None = None
    total_ms: float | None = None
    trees: list[dict[str, list]] | None = None  # per round: tokens / parents / scores / ranks (valid nodes)
    tree_hashes: list[str] | None = None  # per round: `tree_hash` of the round's tree (node order ignored)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        parse_method(self.method)

    @property
    def kind(self) -> str:
        return parse_method(self.method)[0]

    @property
    def budget(self) -> int | None:
        return parse_method(self.method)[1]

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def key(self) -> tuple[str, str]:
        return (self.prompt_id, self.method)

    def round_root_positions(self) -> list[int]:
        """Output position of each round's root: the token its tree hangs from (the previous round's bonus,
        or the prefill token for round 0). Round r's tree depends on the prompt plus output_ids[:root + 1]."""
        starts, pos = [], 0
        for a in self.accept_lengths:
            starts.append(pos)
            pos += a
        return starts

    def round_of_position(self, position: int) -> int | None:
        """Round that emitted output token `position` (None: the prefill token, or past the last round)."""
        pos = 1
        for r, a in enumerate(self.accept_lengths):
            if position < pos + a:
                return r if position >= pos else None
            pos += a
        return None

    def validate(self, where: str = "record", *, check_trees: bool = True) -> None:
        """Internal consistency; raises ValueError with the first problem. Readers pass check_trees=False so a
        malformed tree from a buggy engine reaches the comparator, which reports its round."""
        n_rounds = len(self.accept_lengths)
        if any((not isinstance(t, int)) or t < 0 for t in self.output_ids):
            raise ValueError(f"{where}: output_ids must be non-negative integers.")
        if any((not isinstance(a, int)) or a < 1 for a in self.accept_lengths):
            raise ValueError(f"{where}: accept_lengths must be integers >= 1 (they include the bonus token).")
        if self.output_ids and n_rounds and sum(self.accept_lengths) + 1 < len(self.output_ids):
            raise ValueError(
                f"{where}: accept_lengths sum to {sum(self.accept_lengths)} but there are {len(self.output_ids)} "
                "output tokens; rounds plus the prefill token must cover every output token."
            )
        for name in ("accepted_ranks", "tree_sizes", "expected_accepts", "trees", "tree_hashes"):
            v = getattr(self, name)
            if v is not None and len(v) != n_rounds:
                raise ValueError(f"{where}: {name} has {len(v)} entries but there are {n_rounds} rounds.")
        if self.accepted_ranks is not None:
            for r, (ranks, a) in enumerate(zip(self.accepted_ranks, self.accept_lengths)):
                if len(ranks) != a - 1:
                    raise ValueError(
                        f"{where}: round {r} accepted {a - 1} draft nodes but lists {len(ranks)} ranks."
                    )
        if self.margins is not None and len(self.margins) != len(self.output_ids):
            raise ValueError(f"{where}: margins has {len(self.margins)} entries for {len(self.output_ids)} tokens.")
        if self.stage_ms is not None:
            for stage, vals in self.stage_ms.items():
                if len(vals) != n_rounds:
                    raise ValueError(f"{where}: stage_ms[{stage!r}] has {len(vals)} entries for {n_rounds} rounds.")
        if self.tree_hashes is not None and not all(isinstance(h, str) or h is None for h in self.tree_hashes):
            raise ValueError(f"{where}: tree_hashes must be strings (or null for a round without a tree).")
        if self.trees is not None and check_trees:
            for r, t in enumerate(self.trees):
                if t is not None:
                    validate_tree_dump(t, f"{where} round {r}")

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["margins"] is not None:  # JSON has no inf/nan: store them as null
            d["margins"] = [None if (m is None or not math.isfinite(m)) else m for m in d["margins"]]
        if d["trees"] is not None:
            for t in d["trees"]:
                if t is not None and t.get("scores") is not None:
                    t["scores"] = [None if (s is None or not math.isfinite(s)) else s for s in t["scores"]]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any], where: str = "record") -> "MethodRecord":
        if not isinstance(d, dict):
            raise ValueError(f"{where}: a record line must be a JSON object.")
        names = {f.name for f in dataclasses.fields(cls)}
        missing = [k for k in ("prompt_id", "method", "output_ids") if k not in d]
        if missing:
            raise ValueError(f"{where}: record lacks required field(s) {missing}.")
        kwargs = {k: v for k, v in d.items() if k in names}
        unknown = {k: v for k, v in d.items() if k not in names}
        try:
            rec = cls(**kwargs)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if rec.margins is not None:
            rec.margins = [float("nan") if m is None else float(m) for m in rec.margins]
        if unknown:
            rec.extra = {**rec.extra, "_unknown_fields": unknown}
        return rec


def validate_tree_dump(t: dict[str, list], where: str = "tree") -> None:
    """A dumped tree lists valid nodes only; node 0 is the root; every parent precedes its child."""
    if not isinstance(t, dict) or "tokens" not in t or "parents" not in t:
        raise ValueError(f"{where}: a tree dump needs 'tokens' and 'parents' lists.")
    tokens, parents = t["tokens"], t["parents"]
    if len(tokens) != len(parents) or not tokens:
        raise ValueError(f"{where}: tree tokens and parents must be non-empty and of equal length.")
    if parents[0] != -1:
        raise ValueError(f"{where}: node 0 must be the root (parent -1), got parent {parents[0]}.")
    for i, p in enumerate(parents[1:], start=1):
        if not (0 <= p < i):
            raise ValueError(f"{where}: node {i} has parent {p}; a parent must be an earlier node.")
    for name in ("scores", "ranks", "depths"):
        if t.get(name) is not None and len(t[name]) != len(tokens):
            raise ValueError(f"{where}: tree {name} has {len(t[name])} entries for {len(tokens)} nodes.")


# ----------------------------------------------------------------------------------------------------------
# reading and writing


@dataclass
class Baseline:
    header: BaselineHeader
    records: list[MethodRecord]
    path: str | None = None

    def __post_init__(self):
        self.by_key: dict[tuple[str, str], MethodRecord] = {}
        for r in self.records:
            if r.key in self.by_key:
                raise ValueError(f"{self.path or 'baseline'}: duplicate record for prompt {r.prompt_id!r} method {r.method!r}.")
            self.by_key[r.key] = r

    @property
    def methods(self) -> list[str]:
        return sorted({r.method for r in self.records}, key=method_sort_key)

    def prompt_ids(self, method: str | None = None) -> list[str]:
        """Prompt ids in file order (first appearance)."""
        seen: dict[str, None] = {}
        for r in self.records:
            if method is None or r.method == method:
                seen.setdefault(r.prompt_id, None)
        return list(seen)

    def get(self, prompt_id: str, method: str) -> MethodRecord | None:
        return self.by_key.get((prompt_id, method))


def read_baseline(path: str | os.PathLike, *, allow_partial_last_line: bool = False) -> Baseline:
    """Read and validate a baseline file. A half-written last line (a run killed mid-write) is an error unless
    `allow_partial_last_line`, which the resuming writer uses. An xz-compressed file (`X.jsonl.xz`, as large committed
    baselines are stored) is read as it is, and `X.jsonl` finds `X.jsonl.xz` when only that exists."""
    path = str(path)
    stored = stored_path(path)
    if not stored.exists():
        raise ValueError(f"baseline file {path!r} does not exist.")
    lines = read_text(stored).split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        raise ValueError(f"{path}: empty file; a baseline file starts with a header line.")
    try:
        header = BaselineHeader.from_json(json.loads(lines[0]), f"{path}:1")
    except json.JSONDecodeError:
        raise ValueError(f"{path}:1: the header line is not valid JSON.") from None
    records = []
    for i, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            if allow_partial_last_line and i == len(lines):
                break
            raise ValueError(f"{path}:{i}: not valid JSON (a truncated write?).") from None
        rec = MethodRecord.from_json(d, f"{path}:{i}")
        rec.validate(f"{path}:{i}", check_trees=False)
        records.append(rec)
    return Baseline(header, records, path)


def write_baseline(path: str | os.PathLike, header: BaselineHeader, records: Iterable[MethodRecord]) -> None:
    with BaselineWriter(path, header, resume=False) as w:
        for r in records:
            w.write(r)


class BaselineWriter:
    """Appends records one line at a time (flushed), so a killed run loses at most the line in flight.

    resume=True and an existing file: its header must be comparable with `header` (same models, sampling and
    limits); records already there are kept and `done(prompt_id, method)` reports them so callers skip them.
    """

    def __init__(self, path: str | os.PathLike, header: BaselineHeader, *, resume: bool = True):
        self.path = str(path)
        self.header = header
        self.existing: set[tuple[str, str]] = set()
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        if resume and os.path.exists(self.path) and os.path.getsize(self.path) > 0:
            old = read_baseline(self.path, allow_partial_last_line=True)
            problems = resume_conflicts(old.header, header)
            if problems:
                raise ValueError(
                    f"{self.path}: cannot resume, the existing file was made with different settings: "
                    + "; ".join(problems) + ". Use a new --out file."
                )
            self.existing = set(old.by_key)
            self._rewrite_clean()  # drops a half-written last line if there was one
            self._f = open(self.path, "a", encoding="utf-8")
        else:
            self._f = open(self.path, "w", encoding="utf-8")
            self._line(header.to_json())

    def _rewrite_clean(self) -> None:
        with open(self.path, encoding="utf-8") as f:
            lines = f.read().split("\n")
        good = [ln for ln in lines if ln.strip()]
        try:
            json.loads(good[-1])
            return
        except json.JSONDecodeError:
            good = good[:-1]
        with open(self.path, "w", encoding="utf-8") as f:
            f.write("\n".join(good) + "\n")

    def _line(self, d: dict) -> None:
        self._f.write(json.dumps(d, separators=(",", ":"), allow_nan=False) + "\n")
        self._f.flush()

    def done(self, prompt_id: str, method: str) -> bool:
        return (prompt_id, method) in self.existing

    def write(self, rec: MethodRecord) -> None:
        rec.validate(f"record {rec.prompt_id}/{rec.method}")
        if rec.key in self.existing:
            raise ValueError(f"{self.path}: record for prompt {rec.prompt_id!r} method {rec.method!r} already written.")
        self._line(rec.to_json())
        self.existing.add(rec.key)

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ----------------------------------------------------------------------------------------------------------
# comparability


def _fp(d: dict | None) -> str | None:
    return None if not d else d.get("fingerprint")


def resume_conflicts(old: BaselineHeader, new: BaselineHeader) -> list[str]:
    """Settings that must not change between the parts of one resumed file."""
    out = []
    for name in ("temperature", "top_k", "top_p", "seed", "max_new_tokens", "dtype", "dataset", "block_size"):
        if getattr(old, name) != getattr(new, name):
            out.append(f"{name} {getattr(old, name)!r} != {getattr(new, name)!r}")
    if _fp(old.target) != _fp(new.target):
        out.append("target model fingerprint differs")
    if _fp(old.drafter) != _fp(new.drafter):
        out.append("drafter fingerprint differs")
    return out


def comparability_warnings(a: BaselineHeader, b: BaselineHeader) -> list[str]:
    """Differences that make a comparison of two files questionable (the comparator prints them)."""
    out = []
    if a.temperature != b.temperature:
        out.append(f"temperature differs ({a.temperature} vs {b.temperature}): outputs are not expected to match")
    for name in ("max_new_tokens", "dataset", "block_size", "top_k", "top_p"):
        va, vb = getattr(a, name), getattr(b, name)
        if va is not None and vb is not None and va != vb:
            out.append(f"{name} differs ({va!r} vs {vb!r})")
    if a.temperature > 0 and a.seed != b.seed:
        out.append(f"seed differs ({a.seed} vs {b.seed}) in a sampled run")
    for role in ("target", "drafter"):
        fa, fb = _fp(getattr(a, role)), _fp(getattr(b, role))
        if fa and fb and fa != fb:
            out.append(f"{role} fingerprints differ: not the same weights")
    if a.dtype and b.dtype and a.dtype != b.dtype:
        out.append(f"dtype differs ({a.dtype} vs {b.dtype}): expect near-tie divergences")
    return out


# ----------------------------------------------------------------------------------------------------------
# fingerprints


_FULL_HASH_LIMIT = 64 << 20


def fingerprint_file(path: str | os.PathLike) -> str:
    """sha256 of the whole file when <= 64 MiB; above that, of its size plus first and last MiB (hashing
    tens of GB of weights per run would dominate the run, and the sampled bytes catch a different checkpoint)."""
    size = os.path.getsize(path)
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= _FULL_HASH_LIMIT:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        else:
            h.update(f.read(1 << 20))
            f.seek(size - (1 << 20))
            h.update(f.read())
    return h.hexdigest()


def fingerprint_dir(path: str | os.PathLike) -> str:
    """Fingerprint of a model folder: config, tokenizer and weight files (names + fingerprints)."""
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"model path {str(path)!r} is not a folder.")
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.suffix in (".json", ".safetensors", ".bin", ".model", ".txt", ".py"):
            h.update(str(p.relative_to(root)).encode())
            h.update(fingerprint_file(p).encode())
    return h.hexdigest()


def fingerprint_module(module) -> str:
    """Fingerprint of an in-memory torch module's parameters and buffers (names, shapes, bytes)."""
    import torch

    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def prompt_sha256(prompt_ids: Iterable[int]) -> str:
    return hashlib.sha256(json.dumps([int(t) for t in prompt_ids]).encode()).hexdigest()


TREE_HASH_CHARS = 16


def tree_hash(tokens: list[int], parents: list[int]) -> str:
    """A short hash of a round's tree (node 0 = the root, parents point to earlier nodes) that ignores node order:
    sha256 of the sorted list of every node's token path from the root (root token included), first 16 hex
    digits. Two trees with the same draft prefixes hash alike whatever order their builder emitted them in."""
    if len(tokens) != len(parents) or not tokens:
        raise ValueError("tree_hash needs non-empty tokens and parents of equal length.")
    paths: list[tuple[int, ...]] = [(int(tokens[0]),)]
    for i in range(1, len(tokens)):
        p = int(parents[i])
        if not 0 <= p < i:
            raise ValueError(f"tree_hash: node {i} has parent {p}; a parent must be an earlier node.")
        paths.append(paths[p] + (int(tokens[i]),))
    text = json.dumps(sorted(paths), separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:TREE_HASH_CHARS]


def round_tree_hashes(rec: "MethodRecord") -> list[str | None] | None:
    """Per-round tree hashes of a record: computed from its dumped `trees` where it has them (the trees are what is
    compared), else its recorded `tree_hashes`, else None."""
    if rec.trees is None:
        return None if rec.tree_hashes is None else list(rec.tree_hashes)
    out: list[str | None] = []
    for r, t in enumerate(rec.trees):
        if t is None:
            out.append(rec.tree_hashes[r] if rec.tree_hashes is not None and r < len(rec.tree_hashes) else None)
            continue
        try:
            out.append(tree_hash(t["tokens"], t["parents"]))
        except (ValueError, KeyError, TypeError):
            out.append("malformed")
    return out


# The MethodRecord.extra key the reference importer (reference_import.py) sets on a record whose final round it
# dropped; compare.py counts such records.
REFERENCE_EXTRA_ROUND_KEY = "reference_extra_final_round"
