"""Long code prompts cut from the standard library's sources: a set token count, ending inside a function body.

The tiny pair and its widenings (which share its tokenizer) are base models of Python code, so a long-context
benchmark needs long prompts of code for them to continue. These are built on the CPU from the running interpreter's
standard library and written to a JSONL file that travels to the GPU machine (whose Python is another version, with
other sources), where `bench_budgets.py` reads them for setups of prompt kind `long` or `shared`:

  python benchmarks/bench_budgets.py --write-long-prompts runs/bench/long_prompts.jsonl \\
      --context-tokens 2048,8192,32768 --count 16 --shared-prefix 8192

Sources: the tiny pair's held-out corpus files (`tiny.is_heldout`: text it was not trained on, so acceptance is not
inflated by memorised text), test files left out, in sorted order, each read whole and led by a `# file: <path>`
line. Same Python version (and patch release), same files, same text: every record names its files and carries the
sha256 of its text and of the tokenizer.

A prompt ends after the last line of a statement inside a function whose body goes on after that line, so the model
continues code mid-function. Its length is at most the target, at most `tolerance(target)` tokens under it: it
starts at the top of its first file or, when no such end lands close enough under the target from there, at a later
statement of that file.

Records (one JSON object a line; `id` and `text` are what the sweep sends):
  long_code      id code-<T>-<i>: the i-th prompt of about T tokens, each from another first file; target_tokens,
                 tokens, files, start and cut ({file, line}: the first and the last line of the text)
  shared_prefix  id shared-<P>-<i>: one prefix of about P tokens (ending after a complete statement) shared by every
                 record, then a suffix of about SHARED_SUFFIX_TOKENS from a file of its own, from a top-level
                 statement to a cut inside a function; prefix_target_tokens, prefix_tokens, prefix_sha256, the
                 prefix's files and the suffix's. The prefix ends in a newline after a visible character and every
                 suffix starts with a visible character, so the prompts' first prefix_tokens token ids are the
                 prefix's own (checked as each record is made).
  both           python (version), stdlib_split, tokens, sha256 (of text), tokenizer_sha256.
"""

from __future__ import annotations

import ast
import bisect
import functools
import hashlib
import json
import platform
from dataclasses import dataclass
from pathlib import Path

from ddtree_bench.plan import LONG_PROMPT_KINDS, SHARED_SUFFIX_TOKENS

TEST_DIRS = frozenset({"test", "tests", "idle_test"})
# a setup's prompt_kind -> the records it reads
KINDS = dict(zip(LONG_PROMPT_KINDS, ("long_code", "shared_prefix")))


def tolerance(target: int) -> int:
    """How far under its target a prompt (or a shared prompt's suffix) may end."""
    return max(8, target // 64)


def is_test_file(rel: str) -> bool:
    parts = rel.split("/")
    return any(p in TEST_DIRS for p in parts[:-1]) or parts[-1].startswith("test_")


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# ----------------------------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class Piece:
    """One source file as it appears in a prompt: its `# file:` line, its text (ending in a newline) and a blank
    line. Offsets are character positions in `text`, ascending."""

    rel: str
    text: str
    line_starts: tuple[int, ...]  # where source line L begins: line_starts[L - 1]
    cuts: tuple[int, ...]  # just after a line that ends a statement inside a function that goes on after it
    ends: tuple[int, ...]  # just after a line that ends any statement (a shared prefix's ends)
    starts: tuple[int, ...]  # where a line that begins a statement begins (0: the `# file:` line)
    top_starts: tuple[int, ...]  # where a line that begins a top-level statement (or its decorators) begins

    def line_at(self, offset: int) -> int:
        """The source line holding character `offset` (0: the `# file:` line)."""
        return bisect.bisect_right(self.line_starts, offset)


def _first_line(node: ast.stmt) -> int:
    decorators = getattr(node, "decorator_list", None) or []
    return min([node.lineno] + [d.lineno for d in decorators])


def make_piece(rel: str, source: str) -> Piece | None:
    """The piece of one file, or None when it does not parse (a file of another Python's syntax)."""
    source = source.replace("\r\n", "\n")
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    if not source.endswith("\n"):
        source += "\n"
    header = f"# file: {rel}\n"
    lines = source.split("\n")[:-1]
    offsets = [len(header)]
    for line in lines:
        offsets.append(offsets[-1] + len(line) + 1)  # offsets[L]: just after line L's newline

    def ends_cleanly(node: ast.stmt) -> bool:
        """Nothing but a comment after the statement on its last line, and no trailing blank before the newline."""
        line = lines[node.end_lineno - 1]
        rest = line.encode()[node.end_col_offset:].decode(errors="replace").strip()  # ast's offsets count bytes
        return (not rest or rest.startswith("#")) and bool(line) and not line[-1].isspace()

    cuts, ends, starts, tops = set(), set(), {0}, {0}
    for node in ast.walk(tree):
        if not isinstance(node, ast.stmt):
            continue
        first = _first_line(node)
        if not lines[first - 1].encode()[:node.col_offset].strip():
            starts.add(offsets[first - 1])
        if ends_cleanly(node):
            ends.add(offsets[node.end_lineno])
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if (isinstance(inner, ast.stmt) and inner is not node and inner.end_lineno < node.end_lineno
                        and lines[inner.end_lineno - 1][:1] in (" ", "\t") and ends_cleanly(inner)):
                    cuts.add(offsets[inner.end_lineno])
    for node in tree.body:
        tops.add(offsets[_first_line(node) - 1])
    return Piece(rel, header + source + "\n", tuple(offsets[:-1]), tuple(sorted(cuts)), tuple(sorted(ends)),
                 tuple(sorted(starts)), tuple(sorted(tops)))


@functools.lru_cache(maxsize=2)
def source_pieces(root: str | None = None) -> tuple[Piece, ...]:
    """The held-out, non-test standard library files that read as UTF-8 and parse here, sorted by path."""
    from sglang_ddtree.tiny import EOS_TOKEN, MASK_TOKEN, is_heldout, stdlib_files, stdlib_root

    base = Path(root) if root else stdlib_root()
    pieces = []
    for rel in stdlib_files(base):
        if not is_heldout(rel) or is_test_file(rel):
            continue
        try:
            source = (base / rel).read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not source.strip() or EOS_TOKEN in source or MASK_TOKEN in source:
            continue
        piece = make_piece(rel, source)
        if piece is not None:
            pieces.append(piece)
    if not pieces:
        raise ValueError(f"no usable held-out source files under {base}.")
    return tuple(pieces)


# ------------------------------------------------------------------------------------------------ cutting


class Counter:
    """Token counts with the pair's tokenizer (the `tokenizers` library on tokenizer.json: the same ids SGLang's
    transformers tokenizer gives, without importing transformers)."""

    def __init__(self, tokenizer_dir: str | Path):
        from tokenizers import Tokenizer

        path = Path(tokenizer_dir) / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{path} does not exist; pass the pair's tokenizer folder.")
        self.tok = Tokenizer.from_file(str(path))
        self.sha256 = hashlib.sha256(path.read_bytes()).hexdigest()
        self._pieces: dict[str, int] = {}

    def ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def count(self, text: str) -> int:
        return len(self.ids(text))

    def piece(self, piece: Piece) -> int:
        if piece.rel not in self._pieces:
            self._pieces[piece.rel] = self.count(piece.text)
        return self._pieces[piece.rel]

    def ends(self, text: str) -> list[int]:
        """Where each token of `text` ends (character offsets, ascending)."""
        return [b for _, b in self.tok.encode(text, add_special_tokens=False).offsets]


@dataclass(frozen=True)
class Span:
    start: int
    end: int
    tokens: int


def best_span(counter: Counter, text: str, starts, ends, target: int) -> Span | None:
    """The span text[s:e] (s from `starts`, e from `ends`, both ascending) of at most `target` tokens: the first
    start whose longest fitting span is within tolerance(target) of the target, else the longest over all starts
    (None when nothing fits). Token positions come from one tokenization of `text`; each chosen span is counted
    again on its own, since a cut can change how the tokens at its edges merge."""
    token_ends = counter.ends(text)

    def before(offset):
        return bisect.bisect_right(token_ends, offset)

    end_tokens = [before(e) for e in ends]
    best = None
    for s in starts:
        i = bisect.bisect_right(end_tokens, before(s) + target) - 1
        found = None
        while i >= 0 and ends[i] > s:
            n = counter.count(text[s:ends[i]])
            if n <= target:
                found = Span(s, ends[i], n)
                break
            i -= 1
        if found is None:
            continue
        if best is None or found.tokens > best.tokens:
            best = found
        if found.tokens >= target - tolerance(target):
            return found
    return best


def _stream(pieces, first: int, counter: Counter, need: int) -> tuple[str, list[int], list[Piece]]:
    """Pieces from index `first` on (wrapping around, each once) until those after the first hold `need` tokens:
    (their text, where each piece begins in it, the pieces)."""
    chosen, bases, text, after = [], [], "", 0
    for k in range(len(pieces)):
        piece = pieces[(first + k) % len(pieces)]
        chosen.append(piece)
        bases.append(len(text))
        text += piece.text
        if k:
            after += counter.piece(piece)
        if after >= need:
            return text, bases, chosen
    raise ValueError(f"the source files hold fewer than {need} tokens after {pieces[first].rel}: the prompts would "
                     "repeat a file.")


def _where(chosen: list[Piece], bases: list[int], offset: int, end: bool = False) -> dict:
    """{file, line} of a stream offset (`end`: the line just before it)."""
    at = offset - 1 if end else offset
    k = bisect.bisect_right(bases, at) - 1
    return {"file": chosen[k].rel, "line": chosen[k].line_at(at - bases[k])}


def _files(chosen: list[Piece], bases: list[int], span: Span) -> list[str]:
    return [p.rel for p, b in zip(chosen, bases) if b < span.end and b + len(p.text) > span.start]


def _common(counter: Counter, text: str, tokens: int) -> dict:
    return {"tokens": tokens, "sha256": sha256_text(text), "python": platform.python_version(),
            "stdlib_split": "heldout", "tokenizer_sha256": counter.sha256}


def _cut(pieces, home: int, counter: Counter, target: int, ends_of, taken=()) -> tuple:
    """The first file from index `home` on (not in `taken`) that gives a span of target - tolerance(target) to
    target tokens from one of its statements to one of `ends_of(piece)` in it or the files after it:
    (its index, the span, the stream's text, where its pieces begin, the pieces)."""
    for k in range(len(pieces)):
        first = (home + k) % len(pieces)
        if first in taken:
            continue
        text, bases, chosen = _stream(pieces, first, counter, target + 64)
        ends = [b + c for p, b in zip(chosen, bases) for c in ends_of(p)]
        span = best_span(counter, text, chosen[0].starts, ends, target)
        if span is not None and span.tokens >= target - tolerance(target):
            return first, span, text, bases, chosen
    raise ValueError(f"no span of {target} tokens with the ends asked for found in the source files.")


def long_code_prompts(counter: Counter, target: int, count: int, pieces=None) -> list[dict]:
    """`count` prompts of at most `target` tokens, each from another first file (spread over the sorted list)."""
    pieces = pieces or source_pieces()
    if count > len(pieces):
        raise ValueError(f"{count} prompts need {count} first files; there are {len(pieces)}.")
    out, used = [], set()
    for i in range(count):
        first, span, text, bases, chosen = _cut(pieces, i * len(pieces) // count, counter, target,
                                                lambda p: p.cuts, used)
        used.add(first)
        body = text[span.start:span.end]
        out.append({"id": f"code-{target}-{i:02d}", "kind": KINDS["long"], "target_tokens": target,
                    "text": body, "files": _files(chosen, bases, span), "start": _where(chosen, bases, span.start),
                    "cut": _where(chosen, bases, span.end, end=True), **_common(counter, body, span.tokens)})
    return out


def shared_prefix_prompts(counter: Counter, prefix_target: int, count: int,
                          suffix_target: int = SHARED_SUFFIX_TOKENS, pieces=None) -> list[dict]:
    """`count` prompts: one prefix of at most `prefix_target` tokens, then a suffix of at most `suffix_target`
    tokens from a file of its own (the files after the prefix's, in order), ending in a function body."""
    pieces = pieces or source_pieces()
    _, span, text, bases, chosen = _cut(pieces, 0, counter, prefix_target, lambda p: p.ends)
    prefix, prefix_files = text[span.start:span.end], _files(chosen, bases, span)
    prefix_ids = counter.ids(prefix)
    start = pieces.index(chosen[len(prefix_files) - 1]) + 1  # the suffixes' files: those after the prefix's
    out = []
    for k in range(len(pieces)):
        if len(out) == count:
            break
        piece = pieces[(start + k) % len(pieces)]
        tops = [s for s in piece.top_starts if piece.text[s:s + 1].strip()]
        suffix = best_span(counter, piece.text, tops, piece.cuts, suffix_target)
        if suffix is None or suffix.tokens < suffix_target - tolerance(suffix_target):
            continue
        body = prefix + piece.text[suffix.start:suffix.end]
        ids = counter.ids(body)
        if ids[:len(prefix_ids)] != prefix_ids:
            raise ValueError(f"the suffix from {piece.rel} changes how the shared prefix tokenizes.")
        where = {"file": piece.rel, "line": piece.line_at(suffix.start)}
        out.append({"id": f"shared-{prefix_target}-{len(out):02d}", "kind": KINDS["shared"],
                    "prefix_target_tokens": prefix_target, "prefix_tokens": len(prefix_ids),
                    "prefix_sha256": sha256_text(prefix), "prefix_files": prefix_files, "text": body,
                    "suffix_file": piece.rel, "suffix_start": where,
                    "cut": {"file": piece.rel, "line": piece.line_at(suffix.end - 1)},
                    **_common(counter, body, len(ids))})
    if len(out) < count:
        raise ValueError(f"only {len(out)} source files give a suffix of {suffix_target} tokens; asked for {count}.")
    return out


def write_long_prompts(path: str | Path, tokenizer_dir: str | Path, lengths, count: int,
                       shared_prefix: int = 0) -> list[dict]:
    """Every record (long_code for each length, then shared_prefix when shared_prefix > 0) into `path` (JSONL)."""
    if count < 1 or any(int(n) < 64 for n in lengths) or (shared_prefix and shared_prefix < 64):
        raise ValueError("prompt counts must be >= 1 and token targets >= 64.")
    counter = Counter(tokenizer_dir)
    records = [r for n in lengths for r in long_code_prompts(counter, int(n), count)]
    if shared_prefix:
        records += shared_prefix_prompts(counter, shared_prefix, count)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
    return records


def read_long_prompts(path: str | Path, prompt_kind: str, tokens: int) -> list[dict]:
    """The records a setup of prompt kind `long` (target_tokens == tokens) or `shared` (prefix_target_tokens ==
    tokens) reads, in file order."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"the long prompts file {path} does not exist: write it here with `python "
                         f"benchmarks/bench_budgets.py --write-long-prompts {path}` and carry its folder.")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    key = "target_tokens" if prompt_kind == "long" else "prefix_target_tokens"
    picked = [r for r in rows if r.get("kind") == KINDS[prompt_kind] and r.get(key) == tokens]
    if not picked:
        have = sorted({f"{r.get('kind')} {r.get('target_tokens') or r.get('prefix_target_tokens')}" for r in rows})
        raise ValueError(f"{path} holds no {KINDS[prompt_kind]} prompts of {tokens} tokens (it holds: "
                         f"{', '.join(have) or 'nothing'}).")
    return picked
