"""The door to SGLang: every SGLang internal the DDTREE plugin and worker reach goes through this module.

SURFACE (below) is the one list of what sglang-ddtree touches in SGLang: the names it imports, the members of
SGLang objects it reads, writes or calls (many of them private), and the HookRegistry targets it wraps, each with
the releases in which the adapters here expect it. The contract tests (tests/test_sglang_door.py) check that table
against each checked release's real sources; nothing else in the package names an SGLang module.

Where releases differ, an adapter here picks its branch by what the running SGLang has (a parameter, a field, an
importable name), never by the version string:
  - server flags: SGLang 0.5.17's ServerArgs is a dataclass whose __init__ the plugin hooks; 0.5.23's is a msgspec
    struct (no __init__ hook, no extra keywords, fields sealed during resolution), so the flag values ride on the
    record as bookkeeping (args.FLAGS_ATTR, pickled with it) and Engine(**kwargs) hands them over (engine_kwargs);
  - resolved values: 0.5.17 handlers write the record; 0.5.23 handlers declare (the record keeps the raw input):
    read through resolving_view / get_spec where they exist (resolved, verify_width);
  - the worker: DFlashWorkerV2's constructor with or without `ps` (get_parallel() otherwise), forward_batch_generation
    with or without pp_proxy_tensors, the drafter's block reset by set_block_size where the base resized it;
  - the draft input's host lengths: reserved_seq_lens_cpu or nxt_kv_lens_cpu;
  - the per-round KV location plan (KVLocPlan) that 0.5.23's draft and verify forwards carry;
  - the verify logits left vocabulary-sharded at TP >= 2 (defer_verify_gather) gathered before the walk reads them;
  - draft heads the tree cannot use (DFlash2's candidate selector, Domino, LiLiCorr), refused from the drafter config.

The release gate (check_release): SUPPORTED releases start; UNVERIFIED ones (adapters written and CPU-checked
against their sources, never run on a GPU) start only when ALLOW_ENV names them, for measuring on a GPU rig; any
other release is refused in one sentence. Nothing here imports SGLang at import time (the plugin imports this
module in every SGLang process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
from dataclasses import dataclass

from sglang_ddtree import config
from sglang_ddtree.sglang import args as ddtree_args

# Releases DDTREE starts on by default: checked on a GPU (the lossless and serving suites).
SUPPORTED = ("0.5.17",)
# Releases whose adapters exist and are checked on CPU against their sources, but that never ran on a GPU: they
# start only with ALLOW_ENV set to the release (read when the server starts), for a GPU session to measure them.
UNVERIFIED = ("0.5.23",)
ALLOW_ENV = "SGLANG_DDTREE_ALLOW_UNVERIFIED_SGLANG"


@dataclass(frozen=True)
class Touch:
    """One thing sglang-ddtree reaches in SGLang.

    kind: "name" (a module-level name it imports, by `load(name)`), "member" (an attribute or method of an SGLang
    class or of the objects it builds, `Class.member`; written `self.member = ...` in `module` or defined on the
    class), or "hook" (a HookRegistry target, `module` + `name` as HookRegistry resolves them).
    releases: the checked releases in which the adapters expect it. only: the adapters tell the releases apart by
    it, so it is absent from the other checked releases. params: the parameters it is called with by name, or
    (hooks) the leading parameters the hook reads, in order; `*` before a name: anywhere in the signature."""

    kind: str
    module: str
    name: str
    releases: tuple[str, ...] = SUPPORTED + UNVERIFIED
    only: bool = False
    params: tuple[str, ...] = ()
    why: str = ""


OLD, NEW = SUPPORTED, UNVERIFIED
_SPEC = "srt.speculative"
_DFW = f"{_SPEC}.dflash_worker_v2"
_RUNNER = "srt.model_executor.model_runner"

SURFACE: tuple[Touch, ...] = (
    # --- names (load)
    Touch("name", "_version", "__version__", why="the release gate"),
    Touch("name", "srt.plugins.hook_registry", "HookRegistry"),
    Touch("name", "srt.plugins.hook_registry", "HookType"),
    Touch("name", f"{_SPEC}.spec_info", "SpeculativeAlgorithm"),
    Touch("name", f"{_SPEC}.spec_registry", "CustomSpecAlgo"),
    Touch("name", f"{_SPEC}.spec_registry", "get_spec", why="whether DDTREE is registered already"),
    Touch("name", "srt.managers.overlap_utils", "FutureMap",
          params=("device", "spec_algo", "req_to_token_pool", "needs_cpu_seq_lens", "needs_confidence_relay")),
    Touch("name", "srt.managers.io_struct", "SetInternalStateReqOutput"),
    Touch("name", "srt.arg_groups.speculative_hook", "_handle_dflash", why="DFLASH's resolution, then ours"),
    Touch("name", "srt.arg_groups.overrides", "resolved_view"),
    Touch("name", "srt.arg_groups.overrides", "attention_backends_of"),
    Touch("name", "srt.arg_groups.overrides", "resolving_view", releases=NEW, only=True,
          why="handlers declare: the live view of what resolution decided so far"),
    Touch("name", "srt.utils.hf_transformers_utils", "get_config"),
    Touch("name", "srt.models.qwen3_5_text", "Qwen3_5ForCausalLM"),
    Touch("name", "srt.runtime_context", "get_server_args"),
    Touch("name", "srt.runtime_context", "get_context"),
    Touch("name", "srt.runtime_context", "get_exec"),
    Touch("name", "srt.runtime_context", "get_spec"),
    Touch("name", "srt.runtime_context", "get_parallel", releases=NEW,
          why="the parallel state, where the worker constructor no longer takes `ps`"),
    Touch("name", "srt.configs.hybrid_arch", "hybrid_gdn_config"),
    Touch("name", "srt.configs.hybrid_arch", "mambaish_config"),
    Touch("name", "srt.model_executor.cuda_graph_config", "Backend"),
    Touch("name", "srt.mem_cache.memory_pool", "MHATokenToKVPool"),
    Touch("name", "srt.distributed", "get_tp_group"),
    Touch("name", "srt.managers.scheduler", "GenerationBatchResult"),
    Touch("name", "srt.model_executor.forward_batch_info", "CaptureHiddenMode"),
    Touch("name", "srt.model_executor.forward_batch_info", "ForwardBatch"),
    Touch("name", "srt.model_executor.forward_batch_info", "ForwardMode"),
    Touch("name", f"{_SPEC}.dflash_info", "DFlashVerifyInput"),
    Touch("name", f"{_SPEC}.dflash_info_v2", "DFlashDraftInputV2"),
    Touch("name", f"{_SPEC}.dflash_utils", "apply_dflash_verify_logits_adjustments",
          params=("next_token_logits", "sampling_info", "draft_token_num")),
    Touch("name", _DFW, "DFlashWorkerV2"),
    Touch("name", f"{_SPEC}.draft_worker_common", "build_block_pos_offsets", params=("length", "device")),
    Touch("name", f"{_SPEC}.draft_worker_common", "make_draft_block_spec_info", params=("draft_token_num", "device")),
    Touch("name", f"{_SPEC}.draft_worker_common", "make_draft_input_v2", params=("bonus_tokens", "new_seq_lens")),
    Touch("name", "kernels.ops.speculative.cache_locs", "assign_extend_cache_locs_func",
          params=("req_pool_indices", "req_to_token", "start_offset", "end_offset", "batch_size", "draft_token_num",
                  "device")),
    Touch("name", "kernels.ops.speculative.dflash", "_prepare_dflash_draft_block_unchecked",
          params=("bonus_tokens", "prefix_lens", "req_pool_indices", "req_to_token", "block_ids_out",
                  "positions_out", "cache_loc_out", "mask_token_id")),
    Touch("name", "srt.mem_cache.kv_loc_plan", "IdSpaceKind", releases=NEW, only=True,
          why="the KV location plan: which sub-pool ids a plan translates"),
    Touch("name", f"{_SPEC}.spec_utils", "draft_tp_context", releases=NEW,
          why="the drafter's forward runs in its own tensor-parallel layout"),
    # --- members: the DFLASH worker DDTreeWorker extends
    Touch("member", _DFW, "DFlashWorkerV2.__init__", releases=OLD, only=False,
          params=("server_args", "gpu_id", "ps", "nccl_port", "target_worker")),
    Touch("member", _DFW, "DFlashWorkerV2.__init__", releases=NEW,
          params=("server_args", "gpu_id", "nccl_port", "target_worker")),
    Touch("member", _DFW, "DFlashWorkerV2.forward_batch_generation", params=("batch", "on_publish", "grammar_barrier")),
    Touch("member", _DFW, "DFlashWorkerV2.forward_batch_generation", releases=NEW, params=("*pp_proxy_tensors",)),
    Touch("member", _DFW, "DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc",
          params=("target_hidden", "cache_loc", "positions", "cache_loc_2d", "commit_lens")),
    Touch("member", _DFW, "DFlashWorkerV2._maybe_build_draft_sampler"),
    Touch("member", _DFW, "DFlashWorkerV2._ensure_draft_block_buffers"),
    Touch("member", _DFW, "DFlashWorkerV2._use_triton_prepare_block"),
    Touch("member", _DFW, "DFlashWorkerV2._draft_block_ids_buf"),
    Touch("member", _DFW, "DFlashWorkerV2._draft_block_positions_buf"),
    Touch("member", _DFW, "DFlashWorkerV2._draft_verify_out_cache_loc_buf"),
    Touch("member", _DFW, "DFlashWorkerV2._mask_token_id"),
    Touch("member", _DFW, "DFlashWorkerV2._need_mamba_verify_commit"),
    Touch("member", _DFW, "DFlashWorkerV2.draft_model_runner"),
    Touch("member", _DFW, "DFlashWorkerV2.model_runner"),
    Touch("member", _DFW, "DFlashWorkerV2.device"),
    Touch("member", _DFW, "DFlashWorkerV2.ps", releases=OLD, only=True),
    Touch("member", _DFW, "DFlashWorkerV2.draft_model", releases=NEW,
          why="set_block_size: the base sizes the drafter's block from the verify width"),
    Touch("member", _DFW, "DFlashWorkerV2.selector", releases=NEW, only=True, why="DFlash2 drafts: refused"),
    Touch("member", _DFW, "DFlashWorkerV2.lilicorr", releases=NEW, only=True, why="LiLiCorr drafts: refused"),
    Touch("member", _DFW, "DFlashWorkerV2._is_domino", releases=NEW, only=True, why="Domino drafts: refused"),
    Touch("member", _DFW, "DFlashWorkerV2._target_logits_processor", releases=NEW, only=True,
          why="the deferred verify gather"),
    Touch("member", _DFW, "DFlashWorkerV2._noise_embed_scale", releases=NEW, only=True),
    Touch("member", _DFW, "DFlashWorkerV2._full_embed_gpu", releases=NEW, only=True),
    Touch("member", _DFW, "DFlashWorkerV2.draft_parallel_layout", releases=NEW, only=True),
    Touch("member", "srt.models.dflash", "DFlashDraftModel.set_block_size", releases=NEW, only=True),
    Touch("member", "srt.layers.logits_processor", "LogitsProcessor.is_deferred_shard", releases=NEW, only=True),
    Touch("member", "srt.layers.logits_processor", "LogitsProcessor.finish_deferred_gather", releases=NEW, only=True),
    Touch("member", f"{_SPEC}.dflash_info_v2", "DFlashDraftInputV2.reserved_seq_lens_cpu", releases=OLD, only=True),
    Touch("member", f"{_SPEC}.dflash_info_v2", "DFlashDraftInputV2.nxt_kv_lens_cpu", releases=NEW, only=True),
    Touch("member", f"{_SPEC}.dflash_info_v2", "DFlashDraftInputV2.create_idle_input"),
    Touch("member", f"{_SPEC}.dflash_info", "DFlashVerifyInput.prepare_for_verify"),
    Touch("member", f"{_SPEC}.dflash_info", "DFlashVerifyInput.kv_loc_plan", releases=NEW, only=True),
    Touch("member", "srt.model_executor.forward_batch_info", "ForwardBatch.can_run_decode_cuda_graph", releases=NEW,
          only=True, why="a hand-built draft batch replays the drafter's graphs only with it set"),
    Touch("member", "srt.model_executor.forward_batch_info", "ForwardBatch.global_num_token_non_padded_cpu",
          releases=NEW, only=True),
    Touch("member", "srt.managers.utils", "GenerationBatchResult.cap_lens", why="the branch counts' channel"),
    Touch("member", "srt.mem_cache.kv_index_translator", "KVIndexTranslator.plan", releases=NEW, only=True,
          params=("req_pool_indices", "seq_lens", "seq_lens_cpu", "write_virtual", "read_extent")),
    Touch("member", "srt.mem_cache.kv_index_translator", "KVIndexTranslator.space", releases=NEW, only=True),
    Touch("member", "srt.mem_cache.kv_loc_plan", "KVLocPlan.bind", releases=NEW, only=True),
    Touch("member", _RUNNER, "ModelRunner.kv_index_translator", releases=NEW, only=True),
    # --- members: the target runner, its pools and graphs (worker_setup, modes)
    Touch("member", _RUNNER, "ModelRunner._get_attention_backend", why="`auto`'s and the oracle's verify states"),
    Touch("member", _RUNNER, "ModelRunner._decode_cuda_graph_runner_cls"),
    Touch("member", _RUNNER, "ModelRunner.init_new_workspace"),
    Touch("member", _RUNNER, "ModelRunner.attn_backend"),
    Touch("member", _RUNNER, "ModelRunner.decode_cuda_graph_runner"),
    Touch("member", "srt.model_executor.runner.decode_cuda_graph_runner", "DecodeCudaGraphRunner.capture_bs"),
    Touch("member", "srt.model_executor.runner.decode_cuda_graph_runner", "DecodeCudaGraphRunner.__init__",
          params=("*attn_backend", "*speculative_num_draft_tokens")),
    Touch("member", "srt.runtime_context", "RuntimeContext.override", params=("self", "source")),
    Touch("member", "srt.mem_cache.memory_pool", "MHATokenToKVPool.move_kv_cache"),
    Touch("member", "srt.mem_cache.memory_pool", "MHATokenToKVPool._move_kv_cache_impl"),
    Touch("member", "srt.mem_cache.memory_pool", "MHATokenToKVPool.data_ptrs"),
    Touch("member", "srt.mem_cache.memory_pool", "MHATokenToKVPool.data_strides"),
    Touch("member", "srt.mem_cache.memory_pool", "HybridReqToTokenPool.get_mamba_indices"),
    Touch("member", "srt.mem_cache.memory_pool", "HybridReqToTokenPool.translate_mamba_indices"),
    Touch("member", "srt.mem_cache.memory_pool", "HybridReqToTokenPool.mamba_pool"),
    Touch("member", "srt.layers.attention.hybrid_linear_attn_backend",
          "HybridLinearAttnBackend.update_mamba_state_after_mtp_verify",
          params=("last_correct_step_indices", "mamba_track_indices", "mamba_steps_to_track", "model",
                  "req_pool_indices")),
    # --- hooks (HookRegistry targets; params: the leading parameters the hook reads)
    Touch("hook", "srt.server_args", "ServerArgs.add_cli_args", params=("parser",)),
    Touch("hook", "srt.server_args", "ServerArgs.from_cli_args", params=("cls", "args")),
    Touch("hook", "srt.server_args", "ServerArgs.__init__", releases=OLD,
          why="a dataclass: the flag values reach the record before __post_init__ resolves it"),
    Touch("hook", "srt.entrypoints.engine", "Engine.__init__", params=("self",),
          why="Engine(**kwargs) on a record that takes no extra keywords (engine_kwargs)"),
    Touch("hook", f"{_SPEC}.dflash_utils", "resolve_dflash_verify_mask_policy", params=("attn_backend",)),
    Touch("hook", f"{_SPEC}.dflash_utils", "validate_dflash_request", params=("req",)),
    Touch("hook", "srt.managers.tokenizer_manager", "TokenizerManager._calculate_spec_decoding_metrics",
          params=("self", "meta_info", "recv_obj", "i")),
    Touch("hook", "srt.managers.scheduler", "Scheduler.set_internal_state", params=("self", "recv_req")),
    Touch("hook", "srt.managers.scheduler", "Scheduler.run_batch", why="SGLANG_DDTREE_HOST_PROFILE only"),
    Touch("hook", "srt.model_executor.model_runner_components.attention_backend_setup",
          "configure_aux_hidden_state_capture", params=("*model", "*dflash_use_aux_hidden_state")),
    Touch("hook", "srt.layers.attention.linear.gdn_backend", "causal_conv1d_update",
          why="a name the gated-delta-net backend imports: the tree verify's conv update (hooks.around_tree_conv)"),
    Touch("hook", "kernels.ops.attention.extend_attention", "extend_attention_fwd",
          params=("q_extend", "k_extend", "v_extend", "o_extend", "k_buffer", "v_buffer", "qo_indptr", "kv_indptr",
                  "kv_indices", "custom_mask", "is_causal", "mask_indptr", "max_len_extend", "k_scale", "v_scale",
                  "sm_scale"),
          why="the Triton verify attention (hooks.around_extend_attention)"),
)

# extend_attention_fwd keywords and the values under which the tree verify kernel computes the same attention
# (hooks._verify_splits); keywords it may ignore whatever their value (host-side hints) are listed apart.
EXTEND_ATTENTION_PLAIN = {"logit_cap": 0.0, "sliding_window_size": -1, "sinks": None, "window_kv_offsets": None,
                          "xai_temperature_len": -1, "lse_extend": None, "skip_prefix": False, "skip_extend": False,
                          "skip_prefix_custom_mask": True, "page_size": 1, "score_mod": None, "aux_tensors": None,
                          "identity_kv_indices": False}
EXTEND_ATTENTION_HINTS = ("extend_seq_lens_cpu",)


def touches(kind: str | None = None) -> tuple[Touch, ...]:
    return tuple(t for t in SURFACE if kind is None or t.kind == kind)


def hook_target(name: str) -> str:
    """The HookRegistry target of the hook Touch named `name` ("Class.method" or a function name)."""
    for t in SURFACE:
        if t.kind == "hook" and t.name == name:
            return f"sglang.{t.module}.{t.name}"
    raise KeyError(f"no hook {name} in engine.SURFACE")


@functools.cache
def load(name: str):
    """A module-level SGLang name of SURFACE, imported on first use."""
    for t in SURFACE:
        if t.kind == "name" and t.name == name:
            module = importlib.import_module(f"sglang.{t.module}")
            return getattr(module, name)
    raise KeyError(f"{name} is not an SGLang name of engine.SURFACE")


def try_load(name: str):
    """load(name), or None where this SGLang has no such module or name (feature detection)."""
    try:
        return load(name)
    except (ImportError, AttributeError):
        return None


# ---------------------------------------------------------------------------------------------------------------
# The release gate


def check_release(version: str | None = None, allow: str | None = None) -> None:
    """Refuse an SGLang release DDTREE does not start on, in one sentence (ValueError). allow: ALLOW_ENV's value,
    read here (at start-up) when not given."""
    if version is None:
        version = try_load("__version__")
    if version is None:  # a source checkout without the generated _version.py: the installed distribution's
        from importlib import metadata

        try:
            version = metadata.version("sglang")
        except metadata.PackageNotFoundError:
            version = "of unknown version"
    if version in SUPPORTED:
        return
    if allow is None:
        allow = config.get(ALLOW_ENV)
    if version in UNVERIFIED and version in {v.strip() for v in allow.split(",")}:
        return
    supported = " or ".join(SUPPORTED)
    hint = (f" (its adapters exist but were never checked on a GPU: {ALLOW_ENV}={version} starts it for measuring)"
            if version in UNVERIFIED else "")
    raise ValueError(f"sglang-ddtree supports SGLang {supported}, but SGLang {version} is installed{hint}; install "
                     f"it with: pip install sglang=={SUPPORTED[-1]}")


# ---------------------------------------------------------------------------------------------------------------
# Server arguments


def record_resolves_by_declaration(server_args) -> bool:
    """Whether handlers declare resolved values instead of writing the record (the record keeps the raw input)."""
    return callable(getattr(type(server_args), "resolve_once", None))


def attach_flags(record, values: dict) -> None:
    """Carry the DDTREE flag values on a ServerArgs record that has no attributes for them (a msgspec record: its
    __init__ is not hooked). An underscore name is bookkeeping, allowed at any time and pickled with the record."""
    setattr(record, ddtree_args.FLAGS_ATTR, dict(values))


def has_flags(record) -> bool:
    return isinstance(getattr(record, ddtree_args.FLAGS_ATTR, None), dict) or hasattr(
        record, next(iter(ddtree_args.FLAG_DEST.values())))


def _record_with_flags(cls, values, **kwargs):
    record = cls(**kwargs)
    if not has_flags(record):
        attach_flags(record, values)
    return record


def around_engine_init(original, engine, *args, **kwargs):
    """Engine(**kwargs) (AROUND): takes our keywords out and, where the record class takes no extra keywords and
    has no __init__ hook (not a dataclass), attaches them to the record Engine builds through its
    `server_args_class`; a dataclass record keeps taking them in its hooked __init__."""
    ours = {dest: kwargs.pop(dest) for dest in ddtree_args.FLAG_DEST.values() if dest in kwargs}
    cls = getattr(engine, "server_args_class", None)
    if not ours or cls is None or dataclasses.is_dataclass(cls):
        kwargs.update(ours)
        return original(engine, *args, **kwargs)
    if "server_args" in kwargs:
        raise ValueError("pass the --speculative-ddtree-* options on the ServerArgs given to Engine, not as "
                         "Engine keywords next to it.")
    values = {dest: ours.get(dest) for dest in ddtree_args.FLAG_DEST.values()}
    engine.server_args_class = functools.partial(_record_with_flags, cls, values)
    try:
        return original(engine, *args, **kwargs)
    finally:
        del engine.server_args_class


def resolved(server_args, field: str):
    """A ServerArgs field as resolution has decided it so far (read through resolving_view where handlers declare
    their decisions; the record itself where they write it)."""
    view = try_load("resolving_view")
    return getattr(view(server_args) if view is not None else server_args, field)


def verify_width(server_args) -> int:
    """The resolved speculative_num_draft_tokens (DDTREE's verify width B+1) in a scheduler process."""
    if record_resolves_by_declaration(server_args):
        return int(load("get_spec")().speculative_num_draft_tokens)
    return int(server_args.speculative_num_draft_tokens)


def store_drafter_block(server_args, block: int) -> None:
    """Keep the drafter's block size (resolved by DFLASH's handler) for the scheduler processes. A dataclass record
    takes a plain attribute; otherwise (a msgspec record, or the stand-in its handlers get) the flag carrier
    (args.FLAGS_ATTR, a dict on the record) takes it."""
    flags = getattr(server_args, ddtree_args.FLAGS_ATTR, None)
    if isinstance(flags, dict):
        flags[ddtree_args.BLOCK_KEY] = int(block)
    else:
        object.__setattr__(server_args, ddtree_args.BLOCK_DEST, int(block))


def drafter_block(server_args, default: int = 16) -> int:
    flags = getattr(server_args, ddtree_args.FLAGS_ATTR, None)
    value = flags.get(ddtree_args.BLOCK_KEY) if isinstance(flags, dict) else getattr(
        server_args, ddtree_args.BLOCK_DEST, None)
    return int(value or default)


def handle_dflash(server_args) -> None:
    load("_handle_dflash")(server_args)


def static_view(server_args):
    """The record with what resolution declared so far, for _validate (resolved_view in every checked release)."""
    return load("resolved_view")(server_args)


def attention_backends(view) -> tuple:
    return tuple(load("attention_backends_of")(view))


def read_hf_config(path, trust_remote_code: bool, revision=None):
    return load("get_config")(path, trust_remote_code=trust_remote_code, revision=revision)


def draft_head_kind(draft_hf_config) -> str | None:
    """'selector' / 'domino' / 'lilicorr' for a DFlash drafter whose head proposes its block another way than a
    plain DFlash head's top-K (DFlash2's candidate selector, Domino's GRU rollout, LiLiCorr's lattice head), None for
    a plain one. Read from the drafter's config as SGLang reads it: the architecture (DFlash2DraftModel,
    LiLiCorrDraftModel) or the projector type (dflash_config.projector_type, else a top-level one)."""
    architectures = [str(a) for a in (getattr(draft_hf_config, "architectures", None) or [])]
    if any(a.startswith("DFlash2") for a in architectures):
        return "selector"
    if any("LiLiCorr" in a for a in architectures):
        return "lilicorr"
    dflash = getattr(draft_hf_config, "dflash_config", None)
    dflash = dflash if isinstance(dflash, dict) else {}
    if dflash.get("projector_type", getattr(draft_hf_config, "projector_type", None)) == "domino":
        return "domino"
    return None


def spec_algo_base():
    return load("CustomSpecAlgo")


def future_map(device, spec_algo, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay):
    return load("FutureMap")(device, spec_algo, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)


def launcher_server_args():
    return load("get_server_args")()


def set_internal_state_output(updated: bool):
    return load("SetInternalStateReqOutput")(updated=updated)


def register_hook(name: str, fn, kind: str) -> None:
    """HookRegistry.register(target of SURFACE's hook `name`, fn, HookType.<kind>)."""
    load("HookRegistry").register(hook_target(name), fn, getattr(load("HookType"), kind))


def apply_hooks() -> None:
    load("HookRegistry").apply_hooks()


def register_algorithm(name: str, validate, spec_class, factory) -> None:
    load("SpeculativeAlgorithm").register(name, supports_overlap=True, validate_server_args=validate,
                                          spec_class=spec_class)(factory)


def registered(name: str) -> bool:
    return load("get_spec")(name) is not None


def qwen3_5_text_class():
    try:
        return load("Qwen3_5ForCausalLM")
    except Exception:  # noqa: BLE001 - no such model class in this SGLang
        return None


# ---------------------------------------------------------------------------------------------------------------
# The worker's base: DFLASH's spec-v2 worker, constructor and forward signature adapted


@functools.cache
def worker_base():
    """DFlashWorkerV2 with the constructor and the forward signature of every checked release (a class built once,
    on the first call: the worker module's import)."""
    base = load("DFlashWorkerV2")
    takes_ps = "ps" in inspect.signature(base.__init__).parameters
    forward_params = inspect.signature(base.forward_batch_generation).parameters

    class DFlashBase(base):
        """DDTreeWorker's DFLASH: `self.ps` (the parallel state) whichever way the release hands it over."""

        def __init__(self, server_args, gpu_id, nccl_port, target_worker, ps=None):
            if takes_ps:
                super().__init__(server_args, gpu_id, ps, nccl_port, target_worker)
            else:
                super().__init__(server_args, gpu_id, nccl_port, target_worker)
                self.ps = load("get_parallel")()

        def dflash_forward(self, batch, **kwargs):
            """DFLASH's own forward (prefill, idle batches), given the keywords this release takes."""
            return base.forward_batch_generation(self, batch, **{k: v for k, v in kwargs.items()
                                                                 if k in forward_params})

    return DFlashBase


def fit_drafter(worker, block_size: int) -> None:
    """After DFLASH's constructor: a base that sized the drafter's block from speculative_num_draft_tokens (the
    verify width B+1 for DDTREE) gets the DFlash block back; a drafter head the tree cannot use is refused; a KV pool
    whose slot ids are translated (a unified pool) is refused, as the commit moves KV by slot id."""
    model = getattr(worker, "draft_model", None)
    if model is not None and hasattr(model, "set_block_size"):
        model.set_block_size(block_size)
    kind = ("selector" if getattr(worker, "selector", None) is not None else
            "lilicorr" if getattr(worker, "lilicorr", None) is not None else
            "domino" if getattr(worker, "_is_domino", False) else None)
    if kind is not None:
        raise ValueError(ddtree_args.draft_head_refusal(kind))
    for runner in (worker.model_runner, worker.draft_model_runner):
        translator = getattr(runner, "kv_index_translator", None)
        if translator is None:
            continue
        space = translator.space(load("IdSpaceKind").FULL)
        if space is not None and space.write is not None:
            raise ValueError("DDTREE moves accepted KV by slot id and does not support SGLang's translated "
                             "(unified) KV pool yet; use --speculative-algorithm DFLASH.")


def reserved_lens_cpu(draft_input):
    """The host copy of the reserved lengths the draft input carries (None where the scheduler sent none)."""
    lens = getattr(draft_input, "nxt_kv_lens_cpu", None)
    return lens if lens is not None else getattr(draft_input, "reserved_seq_lens_cpu", None)


def decode_graphs_on() -> bool:
    return load("get_exec")().graph.cuda_graph_config.decode.backend != load("Backend").DISABLED


def mamba_track_interval():
    return load("get_exec")().mamba.mamba_track_interval


def tp_group():
    return load("get_tp_group")()


def idle_draft_input(device):
    return load("DFlashDraftInputV2").create_idle_input(device=device)


def block_pos_offsets(length: int, device):
    return load("build_block_pos_offsets")(length=length, device=device)


def block_spec_info(block: int, device):
    return load("make_draft_block_spec_info")(draft_token_num=block, device=device)


def next_draft_input(bonus_tokens, new_seq_lens):
    return load("make_draft_input_v2")(bonus_tokens=bonus_tokens, new_seq_lens=new_seq_lens)


def batch_result(**fields):
    return load("GenerationBatchResult")(**fields)


def extend_slots(batch, req_to_token, prefix_lens, count: int, bs: int, device):
    """KV slots of positions prefix .. prefix+count-1 of every request, [bs * count] (req_to_token rows)."""
    return load("assign_extend_cache_locs_func")(
        req_pool_indices=batch.req_pool_indices, req_to_token=req_to_token, start_offset=prefix_lens,
        end_offset=prefix_lens + count, batch_size=bs, draft_token_num=count, device=device)


def prepare_draft_block(bonus_tokens, prefix_lens, req_pool_indices, req_to_token, block_ids, positions, cache_loc,
                        mask_token_id: int) -> None:
    """DFLASH's one-launch block preparation (Triton)."""
    load("_prepare_dflash_draft_block_unchecked")(
        bonus_tokens=bonus_tokens, prefix_lens=prefix_lens, req_pool_indices=req_pool_indices,
        req_to_token=req_to_token, block_ids_out=block_ids, positions_out=positions, cache_loc_out=cache_loc,
        mask_token_id=mask_token_id)


def draft_embeddings(worker, block_ids):
    """The drafter's input embeddings of the block, as DFLASH builds them: the target's embedding (a gathered copy
    where the base keeps one), scaled where the target asks for a noise-embedding scale."""
    full = getattr(worker, "_full_embed_gpu", None)
    if full is not None:
        import torch

        embeds = torch.nn.functional.embedding(block_ids, full)
    else:
        embeds = worker.target_worker.model_runner.model.get_input_embeddings()(block_ids)
    scale = getattr(worker, "_noise_embed_scale", 1.0)
    return embeds * scale if scale != 1.0 else embeds


def kv_plan(runner, req_pool_indices, seq_lens, seq_lens_cpu, write_slots, read_extent: int):
    """The iteration's KV location plan for a forward that writes `write_slots` (virtual ids, flat) and reads up to
    `read_extent` past `seq_lens`, where the runner plans KV locations (None otherwise)."""
    translator = getattr(runner, "kv_index_translator", None)
    if translator is None:
        return None
    return translator.plan(req_pool_indices=req_pool_indices, seq_lens=seq_lens, seq_lens_cpu=seq_lens_cpu,
                           write_virtual=write_slots, read_extent=read_extent)


@functools.cache
def _field_names(cls) -> frozenset:
    return frozenset(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else frozenset()


def draft_forward(worker, batch, block_ids, prefix_lens, cache_loc_2d, positions_2d, seq_lens_cpu, seq_lens_sum,
                  input_embeds):
    """The drafter's forward over the block (TARGET_VERIFY of [bonus, mask x (block - 1)] at its KV slots) -> the
    runner's output. Carries the iteration's KV plan where the release plans KV locations, and the batch's
    CUDA-graph eligibility where the batch has the field."""
    fb_cls, modes = load("ForwardBatch"), load("ForwardMode")
    bs, block = block_ids.shape
    fields = dict(
        forward_mode=modes.TARGET_VERIFY, batch_size=bs, input_ids=block_ids.flatten(),
        req_pool_indices=batch.req_pool_indices, seq_lens=prefix_lens, out_cache_loc=cache_loc_2d.reshape(-1),
        seq_lens_sum=seq_lens_sum, seq_lens_cpu=seq_lens_cpu, positions=positions_2d.reshape(-1),
        input_embeds=input_embeds, spec_algorithm=worker.model_runner.spec_algorithm,
        spec_info=worker._draft_block_spec_info, capture_hidden_mode=load("CaptureHiddenMode").NULL)
    names = _field_names(fb_cls)
    if "can_run_decode_cuda_graph" in names:
        fields["can_run_decode_cuda_graph"] = bool(getattr(batch, "can_run_decode_cuda_graph", False))
    if "global_num_token_non_padded_cpu" in names:
        fields["global_num_token_non_padded_cpu"] = bs * block
    forward_batch = fb_cls(**fields)
    runner = worker.draft_model_runner
    plan = kv_plan(worker.model_runner, batch.req_pool_indices, prefix_lens, seq_lens_cpu,
                   cache_loc_2d.reshape(-1), block)
    if plan is not None:
        plan.bind(forward_batch, runner.kv_index_translator)
    layout = getattr(worker, "draft_parallel_layout", None)
    scope = load("draft_tp_context")(layout) if layout is not None else contextlib.nullcontext()
    import torch

    with torch.inference_mode(), scope:
        return runner.forward(forward_batch)


@functools.cache
def verify_input_class():
    """DFLASH's verify input plus the tree links SGLang's hybrid backend reads when speculative_eagle_topk > 1."""
    base = load("DFlashVerifyInput")

    @dataclass
    class DDTreeVerifyInput(base):
        retrieve_next_token: object = None
        retrieve_next_sibling: object = None

    return DDTreeVerifyInput


def verify_input(runner, batch, width: int, slots, seq_lens_cpu, **fields):
    """A verify input over `width` tokens per request written at `slots` ([bs, width] virtual ids), with the
    iteration's KV plan where the release has one (fields: DFlashVerifyInput's, and the tree links)."""
    cls = verify_input_class()
    if "kv_loc_plan" in _field_names(cls):
        fields["kv_loc_plan"] = kv_plan(runner, batch.req_pool_indices, batch.seq_lens, seq_lens_cpu,
                                        slots.reshape(-1), width)
    return cls(draft_token_num=width, capture_hidden_mode=load("CaptureHiddenMode").FULL, **fields)


def full_vocab_logits(worker, logits):
    """The verify's logits over the whole vocabulary: a release that leaves them vocabulary-sharded at TP >= 2
    until the consumer asks (defer_verify_gather) gathers them here; otherwise they are returned as they are."""
    processor = getattr(worker, "_target_logits_processor", None)
    if processor is not None and processor.is_deferred_shard(logits):
        return processor.finish_deferred_gather(logits)
    return logits


def apply_logit_adjustments(logits, sampling_info, width: int) -> None:
    load("apply_dflash_verify_logits_adjustments")(next_token_logits=logits, sampling_info=sampling_info,
                                                   draft_token_num=width)


# ---------------------------------------------------------------------------------------------------------------
# Target runner internals (worker_setup, modes)


def recurrence(model_config) -> str | None:
    """'gdn' for a gated-delta-net hybrid target, 'other' for another recurrent one, None otherwise (SGLang's own
    detection)."""
    if load("mambaish_config")(model_config) is None:
        return None
    return "gdn" if load("hybrid_gdn_config")(model_config) is not None else "other"


def build_verify_state(runner, width: int, capture_scope):
    """A target attention backend (own workspace) and, with decode graphs on, verify CUDA graphs for `width` tokens
    per request, built the way SGLang's adaptive EAGLE builds its per-step states (capture_scope: entered around
    the graph capture)."""
    context = load("get_context")()
    original = load("get_spec")().speculative_num_draft_tokens
    context.override("ddtree_auto.capture", speculative_num_draft_tokens=width)
    saved_backend, saved_workspace = runner.attn_backend, runner.init_new_workspace
    try:
        backend = runner._get_attention_backend(init_new_workspace=True)
        graphs = None
        if decode_graphs_on():
            runner.attn_backend = backend  # the capture reads the mask policy from runner.attn_backend
            with capture_scope:
                graphs = runner._decode_cuda_graph_runner_cls()(runner, attn_backend=backend,
                                                                speculative_num_draft_tokens=width)
    finally:
        runner.attn_backend, runner.init_new_workspace = saved_backend, saved_workspace
        context.override("ddtree_auto.restore", speculative_num_draft_tokens=original)
    return backend, graphs


def target_kv_pool(runner):
    return runner.token_to_kv_pool_allocator.get_kvcache()


def plain_mha_pool(pool) -> bool:
    """A plain MHA pool (SGLang's all-rows KV copy, bf16/fp16, no head-major layout, no scales): our row copy
    (kernels.move_path_kv) serves it."""
    mha = try_load("MHATokenToKVPool")
    return (mha is not None and type(pool).move_kv_cache is mha.move_kv_cache
            and type(pool)._move_kv_cache_impl is mha._move_kv_cache_impl
            and not getattr(pool, "use_hnd", False) and not getattr(pool, "use_native_move_kv_cache", False)
            and getattr(pool, "k_scale_buffer", None) is None and getattr(pool, "layer_num", 0) > 0
            and getattr(pool, "data_ptrs", None) is not None)


def conv_states(runner, req_pool_indices):
    """A hybrid target's live conv states ([layers, slots, ...] tensors) and the batch's slots in them, resolved as
    the hybrid backend resolves them (virtual -> physical)."""
    pool = runner.req_to_token_pool
    slots = pool.translate_mamba_indices(pool.get_mamba_indices(req_pool_indices))
    return pool.mamba_pool.mamba_cache.conv, slots
