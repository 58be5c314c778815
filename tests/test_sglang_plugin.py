"""The plugin's flags and hooks without SGLang, and its dependence on the pinned SGLang sources (static check)."""

import argparse
import ast
import dataclasses
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from sglang_ddtree.sglang import args as ddtree_args
from sglang_ddtree.sglang import engine, hooks, plugin

ROOT = Path(__file__).resolve().parents[1]
PINNED = engine.SUPPORTED[0]


def test_flags_parse_and_validate():
    parser = argparse.ArgumentParser()
    ddtree_args.add_cli_args(parser)
    ns = parser.parse_args(["--speculative-ddtree-budget", "256", "--speculative-ddtree-prune", "0.001"])
    opts = ddtree_args.options_from(ns)
    assert opts == ddtree_args.DDTreeOptions(budget=256, prune=0.001, debug_path=None)
    assert ddtree_args.options_from(parser.parse_args([])).budget == ddtree_args.DEFAULT_BUDGET
    for bad, match in [("0", "1..1024"), ("1025", "1..1024"), ("abc", "integer"), ("12.5", "integer")]:
        with pytest.raises(ValueError, match=match):
            ddtree_args.parse_budget(bad)
    for bad in ("1.0", "-0.1", "nan", "x"):
        with pytest.raises(ValueError, match="prune"):
            ddtree_args.parse_prune(bad)
    assert ddtree_args.parse_prune("0") is None and ddtree_args.parse_prune("off") is None
    # the sequential oracle: a switch, fixed budgets only
    assert ddtree_args.options_from(parser.parse_args(["--speculative-ddtree-oracle"])).oracle is True
    assert ddtree_args.options_from(parser.parse_args([])).oracle is False
    assert ddtree_args.parse_options(budget="64", oracle="true").oracle and not ddtree_args.parse_options(oracle=0).oracle
    with pytest.raises(ValueError, match="oracle needs a fixed"):
        ddtree_args.parse_options(budget="auto", oracle=True)
    with pytest.raises(ValueError, match="takes no value"):
        ddtree_args.parse_options(oracle="sometimes")


def test_static_config_refusals():
    ok = dict(attention_backends=("triton", "triton"), page_size=1, draft_model_path="d")
    ddtree_args.check_static_config(**ok)
    with pytest.raises(ValueError, match="fa3"):
        ddtree_args.check_static_config(**{**ok, "attention_backends": ("fa3", "triton")})
    with pytest.raises(ValueError, match="page-size"):
        ddtree_args.check_static_config(**{**ok, "page_size": 16})
    with pytest.raises(ValueError, match="speculative-draft-model-path"):
        ddtree_args.check_static_config(**{**ok, "draft_model_path": None})
    with pytest.raises(ValueError, match="dp-attention"):
        ddtree_args.check_static_config(**ok, dp_attention=True)
    with pytest.raises(ValueError, match="auto does not support tensor parallelism"):
        ddtree_args.check_static_config(**ok, auto=True, tp_size=2)
    ddtree_args.check_static_config(**ok, auto=True, tp_size=1)
    ddtree_args.check_static_config(**ok, auto=False, tp_size=2)
    with pytest.raises(ValueError, match="0.5.17"):
        engine.check_release("0.5.18", allow="")
    engine.check_release("0.5.17", allow="")


def test_default_max_running_requests_bounds_verify_tokens():
    assert ddtree_args.default_max_running_requests(16) == 48
    assert ddtree_args.default_max_running_requests(1024) == 7
    assert all(b * (ddtree_args.default_max_running_requests(b) ) <= 8192 or
               ddtree_args.default_max_running_requests(b) == 1 for b in (64, 256, 512, 1024))


@dataclasses.dataclass
class FakeServerArgs:
    """Mimics SGLang's ServerArgs: dataclass fields only; __post_init__ reads the algorithm's options."""

    model_path: str = "m"
    seen: tuple = ()

    def __post_init__(self):
        self.seen = tuple(getattr(self, d, "missing") for d in ddtree_args.FLAG_DEST.values())

    @classmethod
    def from_cli_args(cls, ns):
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)})


def test_flag_values_reach_post_init_through_the_hooks():
    def init(self, *a, **kw):
        return FakeServerArgs.__init__(self, *a, **kw)

    def construct(**kw):
        obj = FakeServerArgs.__new__(FakeServerArgs)
        plugin._around_server_args_init(init, obj, **kw)
        return obj

    # CLI path: from_cli_args sees the namespace, __init__ picks the values up before __post_init__
    ns = argparse.Namespace(model_path="x", speculative_ddtree_budget="32", speculative_ddtree_prune=None,
                            speculative_ddtree_debug="/tmp/d.jsonl")

    def original_from_cli(ns_):
        return construct(**{"model_path": ns_.model_path})

    obj = plugin._around_from_cli_args(original_from_cli, ns)
    assert obj.seen == ("32", None, "/tmp/d.jsonl", None, None, None)
    assert ddtree_args.options_from(obj).budget == 32
    # Engine(**kwargs) path: our keys are removed from the dataclass kwargs and kept as attributes
    obj2 = construct(model_path="y", speculative_ddtree_budget=128)
    assert obj2.seen == (128, None, None, None, None, None) and obj2.model_path == "y"
    obj3 = construct(speculative_ddtree_budget="auto", speculative_ddtree_auto_candidates="16,64")
    assert ddtree_args.options_from(obj3).candidates == (0, 16, 64)
    assert not ddtree_args.options_from(obj3).auto_calibration  # off by default
    obj4 = construct(speculative_ddtree_budget="auto", speculative_ddtree_auto_calibration=True)
    assert ddtree_args.options_from(obj4).auto_calibration
    # no DDTREE flags at all: attributes exist and default
    assert ddtree_args.options_from(construct()).budget == ddtree_args.DEFAULT_BUDGET


def test_request_validation_hook_only_acts_when_ddtree_is_active(monkeypatch):
    class Params:
        json_schema = '{"type": "object"}'
        regex = None

    class Req:
        sampling_params = Params()

    monkeypatch.setattr(hooks, "_ACTIVE_IN_PROCESS", False)
    assert plugin._after_validate_request(None, Req(), True) is None
    monkeypatch.setattr(hooks, "_ACTIVE_IN_PROCESS", True)
    assert "structured output" in plugin._after_validate_request(None, Req(), True)
    assert plugin._after_validate_request("earlier refusal", Req(), True) == "earlier refusal"
    assert hooks.around_mask_policy(lambda backend: ("TritonAttnBackend", False), object()) == \
        ("TritonAttnBackend", True)


def test_calibration_reset_key_is_taken_out_of_set_internal_state(monkeypatch):
    """POST /set_internal_state {"server_args": {"ddtree_calibration_reset": 1}}: the hook resets the DDTREE worker's
    table and answers itself (SGLang would refuse a key it does not list); with SGLang's own keys next to it, those
    go to SGLang; a server without the table answers updated=False; requests without the key pass untouched."""
    import types

    class Output:
        def __init__(self, updated):
            self.updated = updated

    io_struct = types.ModuleType("sglang.srt.managers.io_struct")
    io_struct.SetInternalStateReqOutput = Output
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", io_struct)

    class Worker:
        resets = 0

        def reset_calibration(self):
            self.resets += 1
            return True

    class Req:
        def __init__(self, **values):
            self.server_args = values

    seen = []

    def original(scheduler, req):
        seen.append(dict(req.server_args))
        return Output(True)

    scheduler = types.SimpleNamespace(draft_worker=Worker())
    out = plugin._around_set_internal_state(original, scheduler, Req(**{plugin.CALIBRATION_RESET_KEY: 1}))
    assert out.updated and scheduler.draft_worker.resets == 1 and seen == []
    out = plugin._around_set_internal_state(original, scheduler, Req(ddtree_calibration_reset=1,
                                                                     pp_max_micro_batch_size=4))
    assert out.updated and scheduler.draft_worker.resets == 2 and seen == [{"pp_max_micro_batch_size": 4}]
    assert plugin._around_set_internal_state(original, scheduler, Req(pp_max_micro_batch_size=2)).updated
    assert seen[-1] == {"pp_max_micro_batch_size": 2} and scheduler.draft_worker.resets == 2
    plain = types.SimpleNamespace(draft_worker=None)
    assert not plugin._around_set_internal_state(original, plain, Req(ddtree_calibration_reset=1)).updated


# ---------------------------------------------------------------------------------------------------------------
# Per-request meta_info on a DDTREE server (the tokenizer manager hook), with a fake tokenizer manager


class FakeTokenizerManager:
    """What the hooked method reads: server_args (as handle_server_args left them) and SGLang's own metrics."""

    def __init__(self, algorithm="DDTREE", budget=32, block_size=16):
        self.server_args = argparse.Namespace(speculative_algorithm=algorithm,
                                              speculative_num_draft_tokens=budget + 1,
                                              speculative_ddtree_block_size=block_size)

    def _calculate_spec_decoding_metrics(self, meta_info, recv_obj, i):
        # SGLang 0.5.17's own numbers (tokenizer_manager.py): accept rate over (num_draft_tokens - 1) per round
        rounds = recv_obj.spec_verify_ct[i]
        meta_info["spec_accept_rate"] = recv_obj.spec_num_correct_drafts[i] / (
            rounds * (self.server_args.speculative_num_draft_tokens - 1))
        meta_info["spec_accept_length"] = recv_obj.completion_tokens[i] / rounds
        # ... and the "cap" keys, filled from the per-request cap_lens channel our worker uses for branch counts
        cap_tokens = getattr(recv_obj, "spec_num_cap_tokens", None)
        if cap_tokens and cap_tokens[i] > 0:
            meta_info["spec_cap_length"] = cap_tokens[i] / rounds
        cap_hist = getattr(recv_obj, "spec_cap_lens_histogram", None)
        if cap_hist and cap_hist[i]:
            meta_info["spec_cap_lens_histogram"] = cap_hist[i]


def histogram(values):
    hist = [0] * (max(values) + 1)
    for v in values:
        hist[v] += 1
    return hist


def recv_for(rounds_accept_lens, i=1, rounds_branches=None):
    """A BatchTokenIDOutput-like object whose request i had these accept lengths (bonus included) per round and,
    optionally, these branch tokens per round (what the worker returns as cap_lens; SGLang sums and histograms
    them per request as in batch_result_processor.py)."""
    other = {"spec_verify_ct": 3, "spec_num_correct_drafts": 0, "completion_tokens": 4, "hist": [3],
             "spec_num_cap_tokens": 0, "cap_hist": [3]}
    mine = {"spec_verify_ct": len(rounds_accept_lens), "spec_num_correct_drafts": sum(rounds_accept_lens) -
            len(rounds_accept_lens), "completion_tokens": sum(rounds_accept_lens) + 1,
            "hist": histogram([a - 1 for a in rounds_accept_lens])}
    if rounds_branches is not None:
        mine.update(spec_num_cap_tokens=sum(rounds_branches), cap_hist=histogram(rounds_branches))
    rows = [other] * i + [mine]
    recv = argparse.Namespace(**{k: [r[k] for r in rows] for k in ("spec_verify_ct", "spec_num_correct_drafts",
                                                                   "completion_tokens")},
                              spec_correct_drafts_histogram=[r["hist"] for r in rows])
    if rounds_branches is not None:
        recv.spec_num_cap_tokens = [r["spec_num_cap_tokens"] for r in rows]
        recv.spec_cap_lens_histogram = [r["cap_hist"] for r in rows]
    return recv


def call_hooked(manager, meta_info, recv_obj, i):
    """HookType.AFTER semantics (hook_registry._wrap_fn): original, then hook(result, *args)."""
    result = type(manager)._calculate_spec_decoding_metrics(manager, meta_info, recv_obj, i)
    modified = plugin._after_spec_metrics(result, manager, meta_info, recv_obj, i)
    return modified if modified is not None else result


def test_ddtree_meta_info_from_the_accept_histogram():
    lens = [1, 3, 16, 2, 3]  # tokens committed per round (bonus included); depth limit 15
    meta = {}
    assert call_hooked(FakeTokenizerManager(), meta, recv_for(lens), 1) is None
    assert meta["ddtree_accept_length"] == pytest.approx(sum(lens) / len(lens))
    by_depth = meta["ddtree_accept_rate_by_depth"]
    assert len(by_depth) == 15
    assert by_depth == pytest.approx([sum(a - 1 >= d for a in lens) / len(lens) for d in range(1, 16)])
    assert by_depth[0] == pytest.approx(0.8) and by_depth[14] == pytest.approx(0.2)  # 4 of 5 accept; 1 reaches 15
    drafts = sum(a - 1 for a in lens)
    assert meta["ddtree_depth_normalized_accept_rate"] == pytest.approx(drafts / (len(lens) * 15))
    # SGLang's rate divides by B = 32 per round: the same run looks 32/15 times worse there
    assert meta["spec_accept_rate"] == pytest.approx(drafts / (len(lens) * 32))
    # a block of 8 (depth limit 7): normalization and list length follow the drafter's block
    meta8 = {}
    call_hooked(FakeTokenizerManager(block_size=8), meta8, recv_for([1, 8, 4], i=0), 0)
    assert len(meta8["ddtree_accept_rate_by_depth"]) == 7
    assert meta8["ddtree_depth_normalized_accept_rate"] == pytest.approx((0 + 7 + 3) / (3 * 7))


def test_branch_acceptance_per_request_from_the_cap_channel():
    lens = [1, 3, 16, 2, 3]
    branches = [0, 1, 4, 0, 2]  # branch tokens of each round's accepted path (<= accepted drafts: 0, 2, 15, 1, 2)
    meta = {}
    call_hooked(FakeTokenizerManager(), meta, recv_for(lens, rounds_branches=branches), 1)
    drafts = sum(a - 1 for a in lens)
    assert meta["ddtree_branch_tokens"] == 7
    assert meta["ddtree_branch_accept_rate"] == pytest.approx(7 / drafts)
    assert meta["ddtree_branch_round_rate"] == pytest.approx(3 / 5)
    assert meta["ddtree_branch_tokens_histogram"] == [2, 1, 1, 0, 1]
    # SGLang's names for that channel mean DSpark's cap lengths: not left in a DDTREE answer
    assert "spec_cap_length" not in meta and "spec_cap_lens_histogram" not in meta
    assert meta["ddtree_accept_length"] == pytest.approx(sum(lens) / len(lens))  # the rest as before
    # a chain-like request (no branch ever taken) reports zeros, not missing keys
    meta = {}
    call_hooked(FakeTokenizerManager(), meta, recv_for([2, 3, 1], i=0, rounds_branches=[0, 0, 0]), 0)
    assert meta["ddtree_branch_tokens"] == 0 and meta["ddtree_branch_round_rate"] == 0.0
    assert meta["ddtree_branch_tokens_histogram"] == [3]
    # nothing accepted at all: the rate is 0.0, not a division error
    assert plugin.ddtree_meta_info([4], 15, [4])["ddtree_branch_accept_rate"] == 0.0
    # other servers keep SGLang's cap keys
    meta = {}
    call_hooked(FakeTokenizerManager(algorithm="DSPARK"), meta, recv_for(lens, rounds_branches=branches), 1)
    assert meta["spec_cap_length"] == pytest.approx(7 / 5) and "ddtree_branch_tokens" not in meta


def test_inconsistent_branch_histograms_are_refused():
    with pytest.raises(ValueError, match="counts 2 rounds"):
        plugin.ddtree_meta_info([1, 2], 15, [1, 1])
    with pytest.raises(ValueError, match="took 3 branch tokens but accepted only 2"):
        plugin.ddtree_meta_info([1, 2], 15, [2, 0, 0, 1])
    assert "ddtree_branch_tokens" not in plugin.ddtree_meta_info([1, 2], 15, None)


def test_meta_info_hook_leaves_other_servers_and_odd_inputs_alone(caplog):
    for algo in ("EAGLE", "DFLASH", "ddtree"):  # the algorithm name as the user typed it
        meta = {}
        call_hooked(FakeTokenizerManager(algorithm=algo), meta, recv_for([2, 3]), 1)
        assert any(k.startswith("ddtree_") for k in meta) == (algo == "ddtree"), algo
        assert "spec_accept_rate" in meta  # SGLang's own keys untouched
    meta = {}
    recv = recv_for([2, 3])
    recv.spec_correct_drafts_histogram = None  # SGLang leaves it out when empty
    call_hooked(FakeTokenizerManager(), meta, recv, 1)
    assert not any(k.startswith("ddtree_") for k in meta) and "spec_accept_rate" in meta
    meta = {}
    recv.spec_correct_drafts_histogram = [[1], [0, 1] + [0] * 20]  # longer than the depth limit allows
    call_hooked(FakeTokenizerManager(), meta, recv, 1)  # logged, never raised into the request
    assert not any(k.startswith("ddtree_") for k in meta)
    assert "DDTREE per-request metrics failed" in caplog.text
    assert plugin.ddtree_meta_info([], 15) == {} and plugin.ddtree_meta_info([0, 0], 15) == {}


# ---------------------------------------------------------------------------------------------------------------
# Static check against the exact pinned SGLang sources: every SGLang name the plugin and worker rely on exists.


def sglang_source(version: str) -> Path:
    """A checked SGLang release's sources (engine.SUPPORTED + engine.UNVERIFIED): a wheel already here
    (_local_wheels) or the PyPI wheel, unpacked once into .cache/ (PyPI is a package registry, reachable from CI; no
    model hub involved)."""
    target = ROOT / ".cache" / f"sglang-{version}"
    if (target / "sglang" / "srt").is_dir():
        return target / "sglang"
    wheels = target.parent / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = _local_wheels(version)
    if not found:
        # the wheels are cp312 / manylinux_2_34 only: asked for by tag, whatever interpreter runs the tests
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d",
                        str(wheels), "--python-version", "3.12", "--platform", "manylinux_2_34_x86_64",
                        f"sglang=={version}"], check=True, timeout=600)
        found = list(wheels.glob(f"sglang-{version}-*.whl"))
    with zipfile.ZipFile(found[0]) as zf:
        members = [m for m in zf.namelist() if m.startswith("sglang/")]
        zf.extractall(target, members)
    return target / "sglang"


def pinned_sglang_source() -> Path:
    """The sources of the release DDTREE supports (the first of engine.SUPPORTED)."""
    return sglang_source(PINNED)


def _local_wheels(version: str) -> list[Path]:
    """The release's SGLang wheel where this checkout keeps one: .cache/wheels (downloaded by sglang_source) or
    .wheels (the device wheel set)."""
    name = f"sglang-{version}-*.whl"
    return sorted((ROOT / ".cache" / "wheels").glob(name)) + sorted((ROOT / ".wheels").glob(name))


def local_pinned_sglang_source() -> Path:
    """pinned_sglang_source() when the pinned sources or wheel are already here; a skip otherwise (no download)."""
    if not (ROOT / ".cache" / f"sglang-{PINNED}" / "sglang" / "srt").is_dir() and not _local_wheels(PINNED):
        pytest.skip(f"no SGLang {PINNED} wheel or unpacked sources in this checkout")
    return pinned_sglang_source()


def module_defs(src: Path, module: str) -> dict:
    tree = ast.parse((src / (module.replace(".", "/") + ".py")).read_text())
    defs = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defs[node.name] = [a.arg for a in node.args.args]
        elif isinstance(node, ast.ClassDef):
            defs[node.name] = {n.name: [a.arg for a in n.args.args] for n in node.body
                               if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            defs[node.name]["__decorators__"] = [ast.unparse(d) for d in node.decorator_list]
    return defs


def test_pinned_sglang_result_channel_and_algorithm_methods():
    """What the door table cannot say as names: the per-request channel our branch counts ride, and the algorithm
    methods SGLang calls that CustomSpecAlgo lacks (our subclass adds them)."""
    src = pinned_sglang_source()
    assert f"version = '{PINNED}'" in (src / "_version.py").read_text()
    # The per-request "cap" channel that carries our branch counts: result field -> Req sum and histogram ->
    # scheduler output -> detokenizer -> tokenizer meta_info, copied to the host with accept_lens.
    channel = {
        "srt/managers/utils.py": ["cap_lens: Optional[torch.Tensor] = None",
                                  "self.cap_lens = _async_d2h(self.cap_lens)"],
        "srt/managers/scheduler_components/batch_result_processor.py": [
            "cap_lens = result.cap_lens.tolist() if result.cap_lens is not None else None",
            "req.update_spec_cap_lens_histogram(cap_lens[i])"],
        "srt/managers/scheduler_components/output_streamer.py": [
            "self.spec_cap_lens_histogram.append(req.spec_cap_lens_histogram)"],
        "srt/managers/detokenizer_manager.py": ["spec_cap_lens_histogram=recv_obj.spec_cap_lens_histogram"],
        "srt/managers/tokenizer_manager.py": ['meta_info["spec_cap_lens_histogram"] = recv_obj.spec_cap_lens_histogram'],
    }
    for rel, needles in channel.items():
        text = " ".join((src / rel).read_text().split())
        for needle in needles:
            assert " ".join(needle.split()) in text, f"{rel}: {needle!r} missing"
    graph_init = " ".join((src / "srt/model_executor/runner/decode_cuda_graph_runner.py").read_text().split())
    assert "self.capture_bs, self.compile_bs = get_batch_sizes_to_capture(" in graph_init
    # The algorithm methods SGLang calls that CustomSpecAlgo lacks are the ones our subclass adds.
    enum_methods = set(module_defs(src, "srt.speculative.spec_info")["SpeculativeAlgorithm"]) - {"__decorators__"}
    base_methods = set(module_defs(src, "srt.speculative.spec_registry")["CustomSpecAlgo"])
    assert {"need_topk", "create_future_map", "carries_draft_hidden_states"} <= enum_methods - base_methods


def module_file(src: Path, module: str) -> Path | None:
    base = src / module.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def module_names(src: Path, module: str, depth: int = 0) -> set[str]:
    """Every name a module defines at top level: functions, classes, assignments and imports (relative star
    imports followed)."""
    path = module_file(src, module)
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
            if depth >= 4:
                continue
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                names |= module_names(src, f"{base}.{node.module}" if node.module else base, depth + 1)
            elif node.module.startswith("sglang."):
                names |= module_names(src, node.module[len("sglang."):], depth + 1)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def test_hybrid_pool_members_the_oracle_uses_exist_in_the_pinned_sources():
    """--speculative-ddtree-oracle on a hybrid target snapshots and restores the batch's live conv states
    (modes.Oracle._snapshot_conv): the hybrid req-to-token pool resolves slots as the backend does (get_mamba_indices,
    translate_mamba_indices) and holds a MambaPool whose state lists conv tensors indexed [layers, slots, ...]; the
    verify rolls the conv state in place (the kernel stores to it), while the SSM target verify does not update
    its state (disable_state_update=True)."""
    src = pinned_sglang_source()
    pools = module_defs(src, "srt.mem_cache.memory_pool")
    assert {"get_mamba_indices", "translate_mamba_indices"} <= set(pools["HybridReqToTokenPool"])
    pool_text = (src / "srt" / "mem_cache" / "memory_pool.py").read_text()
    assert "self.mamba_pool = self.mamba_pool_cls(" in pool_text and "conv: List[torch.Tensor]" in pool_text
    assert "self.mamba_cache.conv[i][:, dst_indices]" in pool_text  # the [layers, slots, ...] indexing we use
    backend = (src / "srt" / "layers" / "attention" / "hybrid_linear_attn_backend.py").read_text()
    assert "self._translate_mamba_indices(mamba_cache_indices)" in backend
    gdn_triton = (src / "srt" / "layers" / "attention" / "linear" / "kernels" / "gdn_triton.py").read_text()
    verify = gdn_triton[gdn_triton.index("def target_verify"):]
    assert "disable_state_update=True" in verify[:3000]


def test_entry_point_is_declared():
    text = (ROOT / "pyproject.toml").read_text()
    assert '[project.entry-points."sglang.srt.plugins"]' in text
    assert 'ddtree = "sglang_ddtree.sglang.plugin:register"' in text
    assert os.path.exists(ROOT / "sglang_ddtree" / "sglang" / "plugin.py")


def test_tree_conv_hook_target_is_a_drop_in():
    """The conv hook replaces the name SGLang's gated-delta-net backend imported and calls in its tree verify; our
    function takes the same parameters in the same order, and the call site passes the tree links by keyword (the
    hook keys on retrieve_next_token)."""
    import inspect

    from sglang_ddtree import tree_conv

    src = pinned_sglang_source()
    module = hooks.TREE_CONV_TARGET.split(".")[1:-1]
    backend = (src / ("/".join(module) + ".py")).read_text()
    assert "from sglang.kernels.ops.mamba.causal_conv1d_triton import (" in backend
    assert "causal_conv1d_update," in backend[: backend.index("from sglang.srt.configs")]
    call = backend[backend.index("mixed_qkv_processed = causal_conv1d_update("):]
    call = call[: call.index(")\n")]
    for kw in ("retrieve_next_token=", "retrieve_next_sibling=", "retrieve_parent_token=", "intermediate_conv_window=",
               "conv_state_indices="):
        assert kw in call, kw
    theirs = module_defs(src, "kernels.ops.mamba.causal_conv1d_triton")["causal_conv1d_update"]
    ours = list(inspect.signature(tree_conv.causal_conv1d_tree_update).parameters)
    assert ours[: len(theirs)] == theirs


def test_verify_attention_hook_target_is_a_drop_in():
    """The verify-attention hook wraps the extend kernel SGLang's Triton backend imports when a backend is built
    (so a hook installed by the worker, before the target's backends exist, reaches every one of them); our
    wrapper names the kernel's first 16 parameters as the kernel does (the backend passes them by position) and
    passes every other one through, and the options our kernel does not serve are keywords the gate reads."""
    import inspect

    src = pinned_sglang_source()
    backend = (src / "srt" / "layers" / "attention" / "triton_backend.py").read_text()
    init = backend[backend.index("class TritonAttnBackend"):]
    init = init[init.index("def __init__"):init.index("super().__init__()")]
    assert "from sglang.kernels.ops.attention.extend_attention import (" in init and "extend_attention_fwd," in init
    assert "self.extend_attention_fwd = torch.compiler.disable(extend_attention_fwd)" in backend
    theirs = module_defs(src, "kernels.ops.attention.extend_attention")["extend_attention_fwd"]
    ours = list(inspect.signature(hooks.around_extend_attention).parameters)
    assert ours[1:17] == theirs[:16]
    call = backend[backend.index("        self.extend_attention_fwd(\n            q.view(-1, layer.tp_q_head_num"):]
    call = call[: call.index("\n        )\n")]
    for kw in ("logit_cap=", "sliding_window_size=", "sinks=", "window_kv_offsets=", "xai_temperature_len=",
               "page_size=", "score_mod="):
        assert kw in call, kw


def test_tree_conv_hook_is_installed_by_the_hybrid_worker_only_and_routes_large_trees(monkeypatch):
    """plugin.register (every SGLang server with the package installed) does not touch the gated-delta-net backend:
    DDTreeWorker installs the conv hook on hybrid targets only. The hook routes a tree verify above 65 tokens to our
    kernel (SGLANG_DDTREE_TREE_CONV=auto), anything else to SGLang's."""
    import inspect

    from sglang_ddtree import tree_conv

    assert "causal_conv1d_update" not in inspect.getsource(plugin.register)
    assert 'register_hook("causal_conv1d_update"' in inspect.getsource(hooks.install_tree_conv_hook)
    # the worker's start-up checks (a mixin of DDTreeWorker) import sglang: read, not import
    setup_source = (ROOT / "sglang_ddtree" / "sglang" / "worker_setup.py").read_text()
    assert "install_tree_conv_hook()" in setup_source[setup_source.index("self.hybrid = True"):]
    calls = []

    def original(*args, **kwargs):
        calls.append("sglang")
        return "sglang"

    monkeypatch.setattr(tree_conv, "causal_conv1d_tree_update", lambda *a, **k: calls.append("ours") or "ours")
    x = torch.zeros(1, 8, 129)
    links = {"retrieve_next_token": torch.zeros(1, 129), "retrieve_next_sibling": torch.zeros(1, 129)}
    assert hooks.around_tree_conv(original, x, None, None, **links) == "ours"
    assert hooks.around_tree_conv(original, x, None, None) == "sglang"  # not a tree verify
    assert hooks.around_tree_conv(original, torch.zeros(1, 8, 65), None, None, **links) == "sglang"
    monkeypatch.setattr(hooks, "_TREE_CONV", "ddtree")
    assert hooks.around_tree_conv(original, torch.zeros(1, 8, 17), None, None, **links) == "ours"
    monkeypatch.setattr(hooks, "_TREE_CONV", "sglang")
    assert hooks.around_tree_conv(original, x, None, None, **links) == "sglang"
    assert calls == ["ours", "sglang", "sglang", "ours", "sglang"]
