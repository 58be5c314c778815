"""The door to SGLang (sglang_ddtree/sglang/engine.py) against the real sources of every checked release.

The table (engine.SURFACE) is checked against each release where its adapters expect each entry; the rest of the
package is checked to reach SGLang only through the door; the adapters that need no SGLang are run here; and the
server-argument path (flags, Engine keywords, DDTREE's handler after DFLASH's, the pickle to scheduler processes)
runs with each release's real ServerArgs in a subprocess, its GPU and serving packages stubbed (tests/sglang_stubs.py).
"""

import ast
import inspect
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from sglang_ddtree.sglang import args as ddtree_args
from sglang_ddtree.sglang import engine, hooks, plugin
from test_sglang_plugin import ROOT, module_defs, module_file, module_names, sglang_source

RELEASES = engine.SUPPORTED + engine.UNVERIFIED
PACKAGE = ROOT / "sglang_ddtree" / "sglang"


def class_members(src: Path, module: str, cls: str) -> tuple[dict, set]:  # noqa: C901
    """(methods -> parameter names, attributes: assigned `self.x` anywhere in the class, annotated or assigned in
    its body) of a class in a release's module."""
    tree = ast.parse(module_file(src, module).read_text())
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None)
    assert node is not None, f"{module}.{cls} missing"
    methods, attrs = {}, set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = item.args
            methods[item.name] = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            attrs.add(item.target.id)
        elif isinstance(item, ast.Assign):
            attrs.update(t.id for t in item.targets if isinstance(t, ast.Name))
    for sub in ast.walk(node):
        targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(
            sub, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            for x in ast.walk(t):
                if isinstance(x, ast.Attribute) and isinstance(x.value, ast.Name) and x.value.id == "self":
                    attrs.add(x.attr)
    return methods, attrs


def function_params(src: Path, module: str, name: str) -> list[str]:
    """A module-level function's parameter names, positional then keyword-only."""
    tree = ast.parse(module_file(src, module).read_text())
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name:
            return [x.arg for x in n.args.posonlyargs + n.args.args + n.args.kwonlyargs]
    raise AssertionError(f"{module}.{name} is not a function")


def params_hold(theirs: list[str], ours: tuple[str, ...]) -> bool:
    """ours: leading parameters in order, or `*name` anywhere (see engine.Touch)."""
    leading = [p for p in ours if not p.startswith("*")]
    anywhere = [p[1:] for p in ours if p.startswith("*")]
    body = theirs[1:] if theirs[:1] in (["self"], ["cls"]) and leading[:1] not in (["self"], ["cls"]) else theirs
    return body[: len(leading)] == leading and all(p in theirs for p in anywhere)


def _defs(src: Path, module: str) -> dict:
    """module_defs of a module file or a package's __init__."""
    path = module_file(src, module)
    rel = path.relative_to(src).with_suffix("")
    return module_defs(src, ".".join(rel.parts))


def present(src: Path, touch: engine.Touch) -> tuple[bool, list[str] | None]:
    """Whether the release has what the Touch names (and the parameter names, where it is a function)."""
    if module_file(src, touch.module) is None:
        return False, None
    head, _, member = touch.name.partition(".")
    defs = _defs(src, touch.module)
    if not member:
        if touch.module == "_version":
            return "version" in module_names(src, touch.module), None
        if head not in module_names(src, touch.module):
            return False, None
        if isinstance(defs.get(head), dict):  # a class: called with its constructor's parameters
            return True, class_members(src, touch.module, head)[0].get("__init__")
        if isinstance(defs.get(head), list):
            return True, function_params(src, touch.module, head)
        return True, None
    if head not in defs:
        return False, None
    methods, attrs = class_members(src, touch.module, head)
    if member in methods:
        return True, methods[member]
    return member in attrs, None


@pytest.mark.parametrize("release", RELEASES)
def test_door_table_holds_in_each_release(release):
    """Every Touch exists where its adapter expects it, with the parameters we pass; an `only` Touch (the one an
    adapter tells releases apart by) is absent from the other checked releases."""
    src = sglang_source(release)
    assert f"version = '{release}'" in (src / "_version.py").read_text()
    checked, wrong = 0, []
    for touch in engine.SURFACE:
        if touch.kind == "hook":
            continue  # test_hook_targets_resolve_in_each_release
        found, params = present(src, touch)
        if release in touch.releases:
            if not found:
                wrong.append(f"{touch.module}.{touch.name} missing")
            elif touch.params and not (params is not None and params_hold(params, touch.params)):
                wrong.append(f"{touch.module}.{touch.name}{tuple(params or ())} lacks {touch.params}")
            checked += 1
        elif touch.only and found:
            wrong.append(f"{touch.module}.{touch.name} present; its adapter assumes not")
    assert not wrong, f"SGLang {release}: " + "; ".join(wrong)
    assert checked >= 70


@pytest.mark.parametrize("release", RELEASES)
def test_hook_targets_resolve_in_each_release(release):
    """HookRegistry resolves a target as the longest module prefix, then a module-level name, optionally a class
    attribute: each of ours exists there with the parameters the hook reads; a dataclass ServerArgs (the release
    that hooks its __init__) and a record class the Engine builds through `server_args_class`."""
    src = sglang_source(release)
    for touch in engine.touches("hook"):
        if release not in touch.releases:
            continue
        head, _, member = touch.name.partition(".")
        if touch.name == "causal_conv1d_update":  # an imported name; drop-in checked in test_sglang_plugin
            assert "causal_conv1d_update" in module_names(src, touch.module)
            continue
        if not member:
            params = function_params(src, touch.module, head)
        else:
            methods, _ = class_members(src, touch.module, head)
            if member == "__init__" and member not in methods:
                decorators = module_defs(src, touch.module)[head]["__decorators__"]
                assert any("dataclass" in d for d in decorators), f"{touch.name}: no __init__ to hook"
                continue
            assert member in methods, f"SGLang {release}: {touch.module}.{touch.name} missing"
            params = methods[member]
        assert params_hold(params, touch.params), f"SGLang {release}: {touch.name}{tuple(params)} lacks {touch.params}"
    engine_py = (src / "srt" / "entrypoints" / "engine.py").read_text()
    assert "server_args = self.server_args_class(**kwargs)" in engine_py  # engine.around_engine_init's seam


@pytest.mark.parametrize("release", RELEASES)
def test_extend_attention_keywords_are_ones_the_verify_gate_knows(release):
    """Every keyword SGLang's Triton backend passes to extend_attention_fwd in its extend path is one the verify
    hook's gate knows (engine.EXTEND_ATTENTION_PLAIN / _HINTS), so a release that adds one cannot silently turn our
    verify attention off again."""
    src = sglang_source(release)
    backend = ast.parse((src / "srt" / "layers" / "attention" / "triton_backend.py").read_text())
    calls = [n for n in ast.walk(backend) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "extend_attention_fwd" and len(n.args) >= 13]
    keywords = {k.arg for call in calls for k in call.keywords if k.arg is not None}
    named = set(inspect.signature(hooks.around_extend_attention).parameters)  # passed through by name
    known = set(engine.EXTEND_ATTENTION_PLAIN) | set(engine.EXTEND_ATTENTION_HINTS) | named
    assert calls and keywords <= known, keywords - known


def imports_of(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out.append(node.module or "")
    return out


def test_only_the_door_imports_sglang():
    """No module of the package but engine.py imports SGLang, at module level or inside a function; worker.py (the
    round) in particular."""
    for path in sorted((ROOT / "sglang_ddtree").rglob("*.py")):
        if path == PACKAGE / "engine.py":
            continue
        found = [m for m in imports_of(path) if m == "sglang" or m.startswith("sglang.")]
        assert not found, f"{path.relative_to(ROOT)} imports {found}"
    assert "importlib" not in imports_of(PACKAGE / "worker.py")
    assert any(m == "sglang_ddtree.sglang" for m in imports_of(PACKAGE / "worker.py"))  # engine, through the door


def door_calls() -> dict[str, set[str]]:
    """The names the package passes to engine.load / try_load and engine.register_hook / hook_target."""
    calls = {"load": set(), "try_load": set(), "register_hook": set(), "hook_target": set()}
    for path in sorted((ROOT / "sglang_ddtree").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            if name in calls:
                calls[name].add(node.args[0].value)
    return calls


def test_the_door_table_is_what_the_package_uses():
    """Every name loaded and hook registered is a table entry, and every name and hook of the table is used."""
    calls = door_calls()
    names = {t.name for t in engine.touches("name")}
    hook_names = {t.name for t in engine.touches("hook")}
    assert calls["load"] | calls["try_load"] <= names
    assert names <= calls["load"] | calls["try_load"], names - calls["load"] - calls["try_load"]
    assert calls["register_hook"] | calls["hook_target"] <= hook_names
    assert hook_names <= calls["register_hook"] | calls["hook_target"]
    assert plugin.SPEC_METRICS_TARGET == engine.hook_target("TokenizerManager._calculate_spec_decoding_metrics")
    assert hooks.VERIFY_ATTENTION_TARGET.endswith(".extend_attention_fwd")
    ours = list(inspect.signature(hooks.around_extend_attention).parameters)
    assert tuple(ours[1:17]) == engine.touches("hook")[-1].params


def test_release_gate_starts_supported_refuses_others_in_one_sentence():
    engine.check_release("0.5.17", allow="")
    for version, allow in (("0.5.23", ""), ("0.5.23", "0.5.22"), ("0.5.22", "0.5.22"), ("0.5.18", "")):
        with pytest.raises(ValueError) as err:
            engine.check_release(version, allow=allow)
        message = str(err.value)
        assert "0.5.17" in message and version in message and message.count(". ") == 0
        assert (engine.ALLOW_ENV in message) == (version in engine.UNVERIFIED)
    engine.check_release("0.5.23", allow="0.5.23")
    engine.check_release("0.5.23", allow=" 0.5.21 , 0.5.23")


def test_release_gate_without_a_version_module_reads_the_distribution_or_refuses_in_one_sentence(monkeypatch):
    from importlib import metadata

    monkeypatch.setattr(engine, "try_load", lambda name: None)  # a source checkout: no generated _version.py
    monkeypatch.setattr(metadata, "version", lambda name: "0.5.17")
    engine.check_release(allow="")

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    with pytest.raises(ValueError, match="SGLang of unknown version is installed"):
        engine.check_release(allow="")


def test_release_gate_reads_the_switch_when_called_not_at_import(monkeypatch):
    monkeypatch.delenv(engine.ALLOW_ENV, raising=False)
    with pytest.raises(ValueError):
        engine.check_release("0.5.23")
    monkeypatch.setenv(engine.ALLOW_ENV, "0.5.23")
    engine.check_release("0.5.23")


class ShardedProcessor:
    """A vocabulary-parallel logits processor of rank 0 at TP = 2 as 0.5.23 defers it: the verify's logits stay
    rank 0's shard until finish_deferred_gather, which here gathers the two shards (the other rank's is given)."""

    def __init__(self, vocab_size, other_shard):
        self.vocab_size, self.other, self.defer_verify_gather = vocab_size, other_shard, True

    def is_deferred_shard(self, logits):
        return self.defer_verify_gather and logits.shape[-1] < self.vocab_size

    def finish_deferred_gather(self, logits):
        return torch.cat([logits, self.other], dim=-1)


def test_deferred_verify_gather_gives_the_full_vocabulary_argmax():
    """Two vocabulary shards of 5: the full argmax lies in the second shard for every row, so rank 0's shard alone
    would choose another token; the door's gather gives back the full row, whose argmax is the full one."""
    torch.manual_seed(0)
    full = torch.randn(6, 10)
    full[:, 7] = full.max() + 1.0
    shard0, shard1 = full[:, :5], full[:, 5:]
    worker = types.SimpleNamespace(_target_logits_processor=ShardedProcessor(10, shard1))
    gathered = engine.full_vocab_logits(worker, shard0.clone())
    assert torch.equal(gathered.argmax(-1), full.argmax(-1)) and torch.all(full.argmax(-1) == 7)
    assert not torch.equal(shard0.argmax(-1), full.argmax(-1))
    # a release without the deferral (or TP = 1): the logits are returned as they are
    assert engine.full_vocab_logits(types.SimpleNamespace(), full) is full
    worker._target_logits_processor.defer_verify_gather = False
    assert engine.full_vocab_logits(worker, shard0) is shard0


def test_draft_heads_the_tree_cannot_use_are_refused_from_the_drafter_config():
    cfg = types.SimpleNamespace
    assert engine.draft_head_kind(cfg(architectures=["DFlashDraftModel"], dflash_config={"block_size": 16})) is None
    assert engine.draft_head_kind(cfg(architectures=["DFlash2DraftModel"])) == "selector"
    assert engine.draft_head_kind(cfg(architectures=["LiLiCorrDraftModel"])) == "lilicorr"
    assert engine.draft_head_kind(cfg(architectures=["DFlashDraftModel"],
                                      dflash_config={"projector_type": "domino"})) == "domino"
    assert engine.draft_head_kind(cfg(architectures=None, projector_type="domino")) == "domino"
    for kind in ddtree_args.DRAFT_HEADS:
        message = ddtree_args.draft_head_refusal(kind)
        assert message.count(". ") == 0 and "DFLASH" in message


def test_return_logprob_is_refused_per_request(monkeypatch):
    monkeypatch.setattr(hooks, "_ACTIVE_IN_PROCESS", True)
    req = types.SimpleNamespace(return_logprob=True, sampling_params=types.SimpleNamespace())
    assert "return_logprob" in plugin._after_validate_request(None, req, True)
    req.return_logprob = False
    assert plugin._after_validate_request(None, req, True) is None
    monkeypatch.setattr(hooks, "_ACTIVE_IN_PROCESS", False)  # another algorithm's server: untouched
    assert plugin._after_validate_request(None, types.SimpleNamespace(return_logprob=True), True) is None


def test_host_lengths_of_either_draft_input():
    lens = torch.tensor([3, 4])
    assert engine.reserved_lens_cpu(types.SimpleNamespace(reserved_seq_lens_cpu=lens)) is lens
    assert engine.reserved_lens_cpu(types.SimpleNamespace(nxt_kv_lens_cpu=lens, nxt_kv_lens_sum=7)) is lens
    assert engine.reserved_lens_cpu(types.SimpleNamespace(nxt_kv_lens_cpu=None)) is None


def test_worker_base_takes_either_constructor_and_forward(monkeypatch):
    """The base adapts DFLASH's worker of either shape: a constructor with `ps` (and no parallel accessor) or
    without it (the worker reads get_parallel()), a forward with or without pp_proxy_tensors."""
    calls = []

    class WithPs:
        def __init__(self, server_args, gpu_id, ps, nccl_port, target_worker):
            calls.append(("ps", ps))
            self.ps = ps

        def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None):
            calls.append(("fwd", batch, on_publish, grammar_barrier))

    class WithoutPs:
        def __init__(self, server_args, gpu_id, nccl_port, target_worker):
            calls.append(("no ps", gpu_id))

        def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None):
            calls.append(("fwd", batch, on_publish, pp_proxy_tensors))

    parallel = types.SimpleNamespace(tp_rank=0, tp_size=2)
    names = {"DFlashWorkerV2": WithPs, "get_parallel": lambda: parallel}
    monkeypatch.setattr(engine, "load", lambda name: names[name])
    engine.worker_base.cache_clear()
    try:
        old = engine.worker_base()(server_args=None, gpu_id=0, nccl_port=1, target_worker=None, ps="PS")
        assert old.ps == "PS"
        old.dflash_forward("b", on_publish="p", grammar_barrier="g", pp_proxy_tensors="pp")
        engine.worker_base.cache_clear()
        names["DFlashWorkerV2"] = WithoutPs
        new = engine.worker_base()(server_args=None, gpu_id=3, nccl_port=1, target_worker=None)
        assert new.ps is parallel
        new.dflash_forward("b", on_publish="p", grammar_barrier="g", pp_proxy_tensors="pp")
    finally:
        engine.worker_base.cache_clear()
    assert calls == [("ps", "PS"), ("fwd", "b", "p", "g"), ("no ps", 3), ("fwd", "b", "p", "pp")]


def test_drafter_block_lives_on_either_record():
    dataclass_record = types.SimpleNamespace()
    engine.store_drafter_block(dataclass_record, 16)
    assert dataclass_record.speculative_ddtree_block_size == 16 and engine.drafter_block(dataclass_record) == 16
    msgspec_record = types.SimpleNamespace()
    engine.attach_flags(msgspec_record, {"speculative_ddtree_budget": "64"})
    engine.store_drafter_block(msgspec_record, 8)
    assert engine.drafter_block(msgspec_record) == 8 and not hasattr(msgspec_record, "speculative_ddtree_block_size")
    assert ddtree_args.options_from(msgspec_record).budget == 64
    assert engine.drafter_block(types.SimpleNamespace()) == 16


# ---------------------------------------------------------------------------------------------------------------
# The server-argument path with each release's real ServerArgs (a subprocess per release)

RESOLVE = r'''
import argparse, json, os, pickle, sys, types
sys.path[:0] = [sys.argv[1], os.path.join(sys.argv[1], "tests")]
import sglang_stubs
sglang_stubs.import_sglang(sys.argv[2], sys.argv[3:])
sglang_stubs.CONFIGS["/ckpt/draft"] = types.SimpleNamespace(architectures=["DFlashDraftModel"], dflash_config={})
sglang_stubs.CONFIGS["/ckpt/selector"] = types.SimpleNamespace(architectures=["DFlash2DraftModel"])
sglang_stubs.CONFIGS["/ckpt/target"] = types.SimpleNamespace(architectures=["LlamaForCausalLM"], model_type="llama")
from sglang.srt.server_args import ServerArgs
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang_ddtree.sglang import args as ddtree_args, engine, plugin
plugin.register()
HookRegistry.apply_hooks()
out = {}
declares = engine.record_resolves_by_declaration(ServerArgs)
if not declares:  # a dataclass record resolves in __post_init__: what reaches it, then the handlers by hand
    def post_init(self):
        out.setdefault("at_post_init", ddtree_args.flag_values(self))
    ServerArgs.__post_init__ = post_init

def build(argv):
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(argv))

def resolve(record):
    if declares:
        from sglang.srt.arg_groups.speculative_hook import handle_speculative_decoding
        from sglang.srt.arg_groups.overrides import resolution_result
        handle_speculative_decoding(record)
        return {f: resolution_result(record, f) for f in ("speculative_num_draft_tokens", "max_running_requests")}
    algo = SpeculativeAlgorithm.from_string("DDTREE")
    algo.validate_server_args(record)
    algo.handle_server_args(record)
    return {f: getattr(record, f) for f in ("speculative_num_draft_tokens", "max_running_requests")}

base = ["--model-path", "/ckpt/target", "--speculative-algorithm", "DDTREE", "--device", "cuda",
        "--attention-backend", "triton", "--page-size", "1", "--speculative-dflash-block-size", "16"]
record = build(base + ["--speculative-draft-model-path", "/ckpt/draft", "--speculative-ddtree-budget", "256",
                       "--speculative-ddtree-prune", "0.01"])
out["flags"] = ddtree_args.flag_values(record)
out["resolved"] = resolve(record)
copy = pickle.loads(pickle.dumps(record))
out["pickled"] = {"budget": ddtree_args.options_from(copy).budget, "prune": ddtree_args.options_from(copy).prune,
                  "block": engine.drafter_block(copy)}
try:
    resolve(build(base + ["--speculative-draft-model-path", "/ckpt/selector"]))
except ValueError as e:
    out["selector"] = str(e)

class Engine:  # Engine.__init__ builds the record as SGLang's does: self.server_args_class(**kwargs)
    server_args_class = ServerArgs
    def __init__(self, **kwargs):
        self.server_args = self.server_args_class(**kwargs)
made = Engine.__new__(Engine)
engine.around_engine_init(Engine.__init__, made, model_path="/ckpt/target", speculative_ddtree_budget="auto")
out["engine"] = ddtree_args.options_from(made.server_args).auto
print("RESULT " + json.dumps(out))
'''


def _msgspec_site() -> Path:
    """A directory of the pure test dependencies SGLang's argument modules import that this environment may lack
    (msgspec), installed once from PyPI into .cache/."""
    site = ROOT / ".cache" / "sglang-test-site"
    try:
        import msgspec  # noqa: F401
        return site
    except ImportError:
        pass
    if not (site / "msgspec").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), "msgspec"],
                       check=True, timeout=600)
    return site


@pytest.mark.slow
@pytest.mark.parametrize("release", RELEASES)
def test_server_arguments_resolve_with_each_release(release, tmp_path):
    """With the release's real ServerArgs and HookRegistry: the flags reach the record (before __post_init__ where
    it resolves there), DFLASH's handler then ours give the verify width B+1 and our max_running_requests, the
    drafter's block (16) is kept and, with the flags, survives the pickle to the scheduler processes; a DFlash2
    drafter is refused in one sentence; Engine(speculative_ddtree_budget=...) reaches the record."""
    src = sglang_source(release).parent
    script = tmp_path / "resolve.py"
    script.write_text(RESOLVE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", engine.ALLOW_ENV: release}
    proc = subprocess.run([sys.executable, str(script), str(ROOT), str(src), str(_msgspec_site())], capture_output=True,
                          text=True, timeout=600, env=env, cwd=tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["flags"]["speculative_ddtree_budget"] == "256" and out["flags"]["speculative_ddtree_prune"] == "0.01"
    if "at_post_init" in out:
        assert out["at_post_init"] == out["flags"]
    assert out["resolved"] == {"speculative_num_draft_tokens": 257,
                               "max_running_requests": ddtree_args.default_max_running_requests(256)}
    assert out["pickled"] == {"budget": 256, "prune": 0.01, "block": 16}
    assert out["selector"] == ddtree_args.draft_head_refusal("selector")
    assert out["engine"] is True
