"""Every environment variable sglang-ddtree reads, in one registry: name, default, type and meaning.

Nothing reads the environment at import: a caller asks `get(NAME)` when it needs the value (a server reads its
switches when its worker starts; a loader when it is called), so a bad value fails there, with the variable's
name, and a test can set a variable before the code it drives asks for it.

The `auto` policy's own tuning knobs (SGLANG_DDTREE_AUTO_*) are read by sglang/auto.py and its measuring modes by
sglang/auto_ab.py, both through env_value below (it takes an environment mapping, so a test can pass its own); the
benchmark harness reads its own (SGLANG_DDTREE_PORT_REGISTRY).

The user-facing choices are flags (`--speculative-ddtree-*`, sglang/args.py); what is here is for debugging,
measuring and testing, or a path a loader would otherwise have to be given.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Variable:
    name: str
    default: object
    parse: Callable[[str], object]
    meaning: str


def _switch(name: str) -> Callable[[str], bool]:
    def parse(text: str) -> bool:
        if text not in ("0", "1"):
            raise ValueError(f"{name} must be 0 or 1, got {text!r}.")
        return text == "1"
    return parse


def _choice(name: str, *allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {text!r}.")
        return text
    return parse


def _text(text: str) -> str:
    return text


VARIABLES = {v.name: v for v in (
    Variable("SGLANG_DDTREE_TORCH_PATH", False, _switch("SGLANG_DDTREE_TORCH_PATH"),
             "1: the round's tree, mask, walk and KV move run the torch reference implementations (tree.py, "
             "layout.py, walk.py) instead of the Triton kernels, without the round's stage graphs: identical "
             "tokens, ~150 small launches a round. For debugging a divergence."),
    Variable("SGLANG_DDTREE_TREE_CONV", "auto", _choice("SGLANG_DDTREE_TREE_CONV", "auto", "ddtree", "sglang"),
             "Hybrid targets: which conv kernel a tree verify runs. auto: sglang_ddtree/tree_conv.py above 65 verify "
             "tokens (SGLang's unrolls over the tokens and compiles for minutes there), SGLang's up to 65; "
             "ddtree / sglang: always ours / always SGLang's."),
    Variable("SGLANG_DDTREE_VERIFY_ATTENTION", "ddtree", _choice("SGLANG_DDTREE_VERIFY_ATTENTION", "ddtree", "sglang"),
             "Triton attention backend, dense targets: which kernel a tree verify's attention runs. ddtree (the "
             "default): kernels/verify_attention.py wherever its plan is faster than SGLang's extend kernel (the "
             "prefix split across programs at small batches, one program a request and KV group for verifies of "
             "at most 64 tokens at larger ones), SGLang's elsewhere; sglang: SGLang's extend kernel for every "
             "verify, to measure ours against it or to rule it out when debugging a divergence."),
    Variable("SGLANG_DDTREE_PROFILE_RANGES", False, _switch("SGLANG_DDTREE_PROFILE_RANGES"),
             "1: each round stage is wrapped in a `ddtree:<stage>` profiler range (a measuring mode: "
             "benchmarks/profile_rounds.py reads them from a torch profiler trace)."),
    Variable("SGLANG_DDTREE_HOST_PROFILE", None, _text,
             "A directory: cProfile of the scheduler's decode batches written there as .pstats (a measuring mode, "
             "sglang/host_profile.py)."),
    Variable("SGLANG_DDTREE_HOST_PROFILE_ROUNDS", None, _text,
             "START,COUNT: which decode batches SGLANG_DDTREE_HOST_PROFILE profiles (default 200,2000)."),
    Variable("SGLANG_DDTREE_TEST_SCRIPT", None, _text,
             "A JSON file of scripted drafts (sglang/scripted.py): the drafter's top-K is replaced by a script that "
             "puts the target's own continuation at chosen ranks. A test-only mode (tests/gpu)."),
    Variable("SGLANG_DDTREE_ALLOW_UNVERIFIED_SGLANG", "", _text,
             "A comma-separated list of SGLang releases whose adapters exist but never ran on a GPU "
             "(sglang/engine.py UNVERIFIED, e.g. 0.5.23): a server on one of them starts instead of being refused. "
             "A measuring switch for a GPU session checking that release, not support."),
    Variable("SGLANG_DDTREE_DATA", None, _text,
             "A directory searched first for the benchmark datasets' files (datasets.py)."),
    Variable("SGLANG_DDTREE_TINY_DIR", None, _text,
             "The tiny model pair's directory (tiny.py); default models/tiny under the working directory (a "
             "checkout's root)."),
)}


def get(name: str):
    """The variable's value now: parsed from the environment, or its default when unset or empty."""
    var = VARIABLES[name]
    text = os.environ.get(name)
    if text is None or text == "":
        return var.default
    return var.parse(text)


def describe() -> list[dict]:
    """The registry as rows (name, default, meaning), e.g. for a table in the docs."""
    return [{"name": v.name, "default": v.default, "meaning": v.meaning} for v in VARIABLES.values()]


# -- parsing helpers for the variables read outside the registry (the `auto` knobs and measuring modes)

def env_value(environ, name: str, parse, what: str):
    """A variable through parse (None: unset or empty); a ValueError naming it where parse fails or gives None."""
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = parse(raw)
    except ValueError:
        value = None
    if value is None:
        raise ValueError(f"{name} must be {what}, got {raw!r}.")
    return value


def at_least(minimum: int):
    """A parse for env_value: an integer >= minimum (None otherwise)."""
    return lambda raw: int(raw) if int(raw) >= minimum else None


switch = {"0": False, "1": True}.get  # a parse for env_value: "0" or "1" (None otherwise)
