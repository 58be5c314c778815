"""Long code prompts from the standard library (ddtree_bench/long_prompts.py) and the sweep's use of them: the same
file twice, token counts at most the target and within tolerance under it, every prompt ending inside a function
body, shared-prefix prompts whose first tokens are exactly the prefix's, and the servers' context length derived
from the prompt length. Small targets keep it fast; the real lengths (2K / 8K / 32K) run the same code."""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json

import pytest

from ddtree_bench import long_prompts as LP
from ddtree_bench import plan as P
from sglang_ddtree.tiny import stdlib_root

TOKENIZER = P.REPO_ROOT / "models" / "tiny" / "tokenizer"
LENGTHS, COUNT, PREFIX = (256, 1024), 4, 512

spec = importlib.util.spec_from_file_location("bench_budgets", P.REPO_ROOT / "benchmarks" / "bench_budgets.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The file written twice through the command line, the source files read again in between."""
    folder = tmp_path_factory.mktemp("long")
    paths = [folder / "a.jsonl", folder / "b.jsonl"]
    for path in paths:
        LP.source_pieces.cache_clear()
        assert bench.main(["--write-long-prompts", str(path), "--context-tokens", ",".join(map(str, LENGTHS)),
                           "--count", str(COUNT), "--shared-prefix", str(PREFIX)]) == 0
    return paths


@pytest.fixture(scope="module")
def records(written):
    return [json.loads(line) for line in written[0].read_text().splitlines()]


@pytest.fixture(scope="module")
def counter():
    return LP.Counter(TOKENIZER)


def test_the_same_file_twice(written, records):
    assert written[0].read_bytes() == written[1].read_bytes()
    ids = [r["id"] for r in records]
    assert ids == [f"code-{n}-{i:02d}" for n in LENGTHS for i in range(COUNT)] + \
        [f"shared-{PREFIX}-{i:02d}" for i in range(COUNT)]
    for r in records:
        assert r["sha256"] == hashlib.sha256(r["text"].encode()).hexdigest()
        assert r["python"].count(".") == 2 and r["stdlib_split"] == "heldout"
        assert r["tokenizer_sha256"] == hashlib.sha256((TOKENIZER / "tokenizer.json").read_bytes()).hexdigest()


def test_token_counts_are_at_most_the_target_and_within_tolerance(records, counter):
    from transformers import AutoTokenizer

    served = AutoTokenizer.from_pretrained(str(TOKENIZER))  # how the server tokenizes a text prompt
    for r in records:
        assert r["tokens"] == counter.count(r["text"]) == len(served.encode(r["text"]))
        if r["kind"] == "long_code":
            target = r["target_tokens"]
        else:
            target = r["prefix_tokens"] + P.SHARED_SUFFIX_TOKENS
            assert PREFIX - LP.tolerance(PREFIX) <= r["prefix_tokens"] <= PREFIX
        assert target - LP.tolerance(target) <= r["tokens"] <= target, r["id"]
    long = [r for r in records if r["kind"] == "long_code"]
    for n in LENGTHS:  # distinct prompts, each from another first file, the files named in order
        group = [r for r in long if r["target_tokens"] == n]
        assert len({r["text"] for r in group}) == len({r["start"]["file"] for r in group}) == COUNT
        assert all(r["files"][0] == r["start"]["file"] and r["files"][-1] == r["cut"]["file"] for r in group)


def _functions_around(rel: str, line: int) -> list[ast.AST]:
    tree = ast.parse((stdlib_root() / rel).read_text(encoding="utf-8"))
    return [f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            and f.lineno < line < f.end_lineno]


def test_every_prompt_ends_inside_a_function_body(records):
    for r in records:
        text, cut = r["text"], r["cut"]
        source = (stdlib_root() / cut["file"]).read_text(encoding="utf-8").split("\n")
        last = text[:-1].rsplit("\n", 1)[-1]
        assert text.endswith("\n") and last == source[cut["line"] - 1], r["id"]
        assert last[:1] in (" ", "\t") and not last[-1].isspace()
        assert _functions_around(cut["file"], cut["line"]), f"{r['id']}: line {cut['line']} of {cut['file']}"


def test_shared_prefix_prompts_share_exactly_the_prefix_tokens(records, counter):
    shared = [r for r in records if r["kind"] == "shared_prefix"]
    assert len(shared) == COUNT and len({r["text"] for r in shared}) == COUNT
    assert len({r["suffix_file"] for r in shared}) == COUNT
    n = shared[0]["prefix_tokens"]
    heads = {tuple(counter.ids(r["text"])[:n]) for r in shared}
    assert len(heads) == 1 and all(r["prefix_tokens"] == n for r in shared)
    prefix = counter.tok.decode(list(heads.pop()), skip_special_tokens=False)
    assert all(r["text"].startswith(prefix) for r in shared)
    assert hashlib.sha256(prefix.encode()).hexdigest() == shared[0]["prefix_sha256"]
    assert prefix.endswith("\n") and not prefix[-2].isspace()
    for r in shared:  # the suffix is one top-level statement's start to a cut in a function of its file
        suffix = r["text"][len(prefix):]
        assert not suffix[0].isspace() and 0 < len(counter.ids(suffix)) <= P.SHARED_SUFFIX_TOKENS
        assert r["suffix_start"]["file"] == r["cut"]["file"] == r["suffix_file"] not in r["prefix_files"]


def test_a_cut_needs_a_function_that_goes_on():
    piece = LP.make_piece("m.py", "import os\n\ndef f(x):\n    y = x\n    return y\n\nclass C:\n    z = 1\n")
    lines = [piece.line_at(c - 1) for c in piece.cuts]
    assert lines == [4]  # after `y = x`: not after `return y` (the function ends there), not in the class body
    assert [piece.line_at(s) for s in piece.top_starts] == [0, 1, 3, 7]
    wide = LP.make_piece("w.py", "def f():\n    s = 'éééé'  # four two-byte letters\n    return s\n")
    assert [wide.line_at(c - 1) for c in wide.cuts] == [2]  # ast's column offsets count bytes, not letters
    assert LP.make_piece("old.py", "print 'py2'\n") is None
    assert LP.is_test_file("test/test_os.py") and LP.is_test_file("ctypes/test/x.py")
    assert LP.is_test_file("idlelib/idle_test/a.py") and not LP.is_test_file("unittest/case.py")


def test_setups_read_their_group_and_refuse_what_the_file_lacks(written, tmp_path):
    setups = P.apply_sets(P.default_setups(), ["tiny.prompt_kind=long", "tiny.prompt_tokens=1024",
                                               "tiny.batch_sizes=1,8"])
    prompts = bench.build_prompts([setups["tiny"]], None, 1, str(written[0]))["tiny"]
    texts = [r["text"] for r in LP.read_long_prompts(written[0], "long", 1024)]
    assert [p["text"] for p in prompts] == texts + texts  # four prompts cycled to the batch of 8
    shared = P.apply_sets(setups, ["tiny.prompt_kind=shared", f"tiny.prompt_tokens={PREFIX}"])["tiny"]
    assert len(bench.build_prompts([shared], None, 1, str(written[0]))["tiny"]) == 8
    with pytest.raises(ValueError, match="no long_code prompts of 2048 tokens.*long_code 256"):
        LP.read_long_prompts(written[0], "long", 2048)
    with pytest.raises(ValueError, match="--write-long-prompts"):
        LP.read_long_prompts(tmp_path / "none.jsonl", "shared", PREFIX)
    with pytest.raises(ValueError, match="prompt_kind must be one of"):
        P.apply_sets(P.default_setups(), ["tiny.prompt_kind=audio"])["tiny"].validate()


def test_long_prompts_raise_the_context_length_within_the_models_positions():
    base = P.default_setups()
    # 8B shapes (40960 positions), context 4096: 8192-token prompts, 32 new tokens, DDTREE 1024's verify reserve
    sets = ["8b-dummy.prompt_kind=long", "8b-dummy.prompt_tokens=8192", "8b-dummy.batch_sizes=1"]
    plan = P.expand([P.apply_sets(base, sets)["8b-dummy"]])
    need = 8192 + 32 + 2 * 1025 + 32
    for server in plan.servers:
        args = server.args
        assert int(args[args.index("--context-length") + 1]) == -(-need // 1024) * 1024
        pool = int(args[args.index("--max-total-tokens") + 1])
        assert pool >= 8192 + 32 + 2 * server.width
    shared = P.apply_sets(base, [s.replace("=long", "=shared") for s in sets] + ["8b-dummy.methods=plain"])
    server = P.expand([shared["8b-dummy"]]).servers[0]
    need = 8192 + P.SHARED_SUFFIX_TOKENS + 32 + 2 + 32
    assert server.args[server.args.index("--context-length") + 1] == str(-(-need // 1024) * 1024)
    # short prompts keep the setup's own context (and the signatures of the runs made with it)
    for name in ("tiny", "8b-dummy"):
        plan = P.expand([base[name]])
        assert all(s.setup.context_length == base[name].context_length for s in plan.servers)
    # the tiny pair has 4096 positions: 4096-token prompts do not fit, and say so before any server starts
    with pytest.raises(ValueError, match="over the models' 4096 positions"):
        P.expand([P.apply_sets(base, ["tiny.prompt_kind=long", "tiny.prompt_tokens=4096"])["tiny"]])
