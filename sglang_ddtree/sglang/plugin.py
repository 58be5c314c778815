"""SGLang plugin: registers the DDTREE speculative algorithm and its server flags.

Entry point (pyproject `[project.entry-points."sglang.srt.plugins"] ddtree = ...:register`), run by SGLang's
`load_plugins()` in the launcher before argument parsing and again in every scheduler process.

What SGLang's plugin API reaches directly: the algorithm registry (`SpeculativeAlgorithm.register` with our
`CustomSpecAlgo` subclass) and `HookRegistry` hooks. Hooks used, and why:
  - ServerArgs.add_cli_args (AFTER): add the --speculative-ddtree-* flags (sglang_ddtree.sglang.args) to the parser;
  - ServerArgs.from_cli_args / ServerArgs.__init__ (AROUND): ServerArgs keeps only its own fields, so the flag
    values are carried into the instance as plain attributes before __post_init__ resolves the algorithm (a
    dataclass record), or as one bookkeeping dict after it is built (a msgspec record, whose __init__ is not
    hooked); both survive the pickle to the scheduler processes (sglang_ddtree.sglang.engine);
  - Engine.__init__ (AROUND): Engine(speculative_ddtree_*=...) on a record class that takes no extra keywords;
  - dflash_utils.resolve_dflash_verify_mask_policy (AROUND): SGLang captures DFLASH-family verify graphs without a
    custom mask on triton/flashinfer; a tree needs the mask in the captured graph (`auto`'s chain candidate is
    captured without it: causal_verify_capture);
  - dflash_utils.validate_dflash_request (AFTER): refuse per request what DDTREE cannot serve (grammar);
  - TokenizerManager._calculate_spec_decoding_metrics (AFTER): per-request DDTREE acceptance in meta_info (see
    `ddtree_meta_info`), since SGLang's `spec_accept_rate` divides by the budget B per round for DDTREE. Branch
    acceptance per request needs no patch: the worker returns each round's branch counts as SGLang's
    per-request `cap_lens` (a field DSpark uses), which SGLang copies with accept_lens, sums and histograms per
    request and sends to the tokenizer; the hook renames it.
  - Scheduler.run_batch (AROUND), only with SGLANG_DDTREE_HOST_PROFILE set: a cProfile of the decode loop
    (sglang_ddtree.sglang.host_profile), in DFLASH servers as well;
  - Scheduler.set_internal_state (AROUND): the key `ddtree_calibration_reset` (POST /set_internal_state
    {"server_args": {"ddtree_calibration_reset": 1}}) empties `auto`'s calibration table; SGLang's own keys pass
    through (SGLang accepts only its listed keys there, so the key has to be taken out before it looks);
  - attention_backend_setup.configure_aux_hidden_state_capture (BEFORE), in DFLASH servers as well: SGLang
    0.5.17's text-only Qwen3.5 wrapper (`qwen3_5_text`, `Qwen3_5ForCausalLM`) has no set_dflash_layers_to_capture,
    so a DFLASH-family server with that target stopped there; the hook gives the class one that forwards to its body
    (`add_dflash_capture`), unless the class has one already.
Nothing heavy is imported at load time (no prometheus_client: SGLang sets its multiprocess dir later).
"""

from __future__ import annotations

import contextvars
import logging
from pathlib import Path

from sglang_ddtree.sglang import args as ddtree_args
from sglang_ddtree.sglang import engine, host_profile
from sglang_ddtree.sglang.hooks import around_mask_policy, is_active

logger = logging.getLogger(__name__)

ALGORITHM = "DDTREE"
SPEC_METRICS_TARGET = engine.hook_target("TokenizerManager._calculate_spec_decoding_metrics")
_PENDING_FLAGS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("ddtree_pending_flags", default=None)
# ---------------------------------------------------------------------------------------------------------------
# ServerArgs hooks


def _after_add_cli_args(result, parser, *args, **kwargs):
    ddtree_args.add_cli_args(parser)
    return result


def _around_from_cli_args(original, *args, **kwargs):
    namespace = args[-1] if args else kwargs.get("args")
    values = {dest: getattr(namespace, dest, None) for dest in ddtree_args.FLAG_DEST.values()}
    token = _PENDING_FLAGS.set(values)
    try:
        record = original(*args, **kwargs)
    finally:
        _PENDING_FLAGS.reset(token)
    if not engine.has_flags(record):  # no hooked __init__ took them (a msgspec record): carried as bookkeeping
        engine.attach_flags(record, values)
    return record


def _around_server_args_init(original, self, *args, **kwargs):
    pending = dict(_PENDING_FLAGS.get() or {})
    for dest in ddtree_args.FLAG_DEST.values():
        if dest in kwargs:  # Engine(**kwargs) path
            pending[dest] = kwargs.pop(dest)
        object.__setattr__(self, dest, pending.get(dest))
    return original(self, *args, **kwargs)


def _after_validate_request(result, req, *args, **kwargs):
    if result is not None or not is_active():
        return result
    if getattr(req, "return_logprob", False):  # an SGLang whose DFLASH check lets it through: refused here
        return "DDTREE speculative decoding does not support return_logprob yet."
    params = getattr(req, "sampling_params", None)
    if any(getattr(params, key, None) for key in ("json_schema", "regex", "ebnf", "structural_tag")):
        return "DDTREE speculative decoding does not support structured output (json_schema/regex/ebnf) yet."
    return result


# ---------------------------------------------------------------------------------------------------------------
# Per-request meta_info (tokenizer manager process)


def ddtree_meta_info(histogram, depth_limit: int, branch_histogram=None) -> dict:
    """DDTREE acceptance of one finished request from SGLang's `spec_correct_drafts_histogram` (index k = rounds
    that accepted k draft tokens, the bonus excluded) and, when given, the histogram of the worker's per-round
    branch counts (index k = rounds whose accepted path held k draft tokens that were not the drafter's top-1 at
    their depth; it reaches the tokenizer as SGLang's `spec_cap_lens_histogram`, see DDTreeWorker). Keys added to
    /generate's meta_info:

      ddtree_accept_length                tau: mean tokens committed per round, bonus included
                                          (sum (k+1) h[k] / rounds, as verified: the last round is not cut at
                                          max_new_tokens, unlike SGLang's completion_tokens / spec_verify_ct)
      ddtree_accept_rate_by_depth         list over depth d = 1..depth_limit: P(a round accepts >= d draft tokens)
      ddtree_depth_normalized_accept_rate accepted draft tokens / (rounds x depth_limit): the fraction of the
                                          deepest possible path accepted. The DDTREE-correct replacement of
                                          SGLang's `spec_accept_rate`, whose denominator is rounds x
                                          (speculative_num_draft_tokens - 1) = rounds x B for DDTREE (tree nodes
                                          verified, at most depth_limit of which can be accepted in a round).
      ddtree_branch_tokens                accepted draft tokens that were not the drafter's top-1 (a chain would
                                          have stopped before each of them)
      ddtree_branch_accept_rate           ddtree_branch_tokens / accepted draft tokens (0.0 when none accepted)
      ddtree_branch_round_rate            fraction of rounds whose accepted path took at least one branch
      ddtree_branch_tokens_histogram      the branch histogram itself
    Empty when there are no rounds; no branch keys without a branch histogram."""
    counts = _histogram(histogram, depth_limit, "accept")
    rounds = sum(counts)
    if rounds <= 0 or depth_limit < 1:
        return {}
    accepted = sum(k * c for k, c in enumerate(counts))
    at_least = [sum(counts[d:]) / rounds for d in range(1, depth_limit + 1)]
    info = {
        "ddtree_accept_length": (accepted + rounds) / rounds,
        "ddtree_accept_rate_by_depth": at_least,
        "ddtree_depth_normalized_accept_rate": accepted / (rounds * depth_limit),
    }
    if branch_histogram:
        branches = _histogram(branch_histogram, depth_limit, "branch")
        if sum(branches) != rounds:
            raise ValueError(f"the DDTREE branch histogram counts {sum(branches)} rounds, the accept histogram "
                             f"{rounds}.")
        tokens = sum(k * c for k, c in enumerate(branches))
        if tokens > accepted:
            raise ValueError(f"a DDTREE request took {tokens} branch tokens but accepted only {accepted} drafts.")
        info.update({
            "ddtree_branch_tokens": tokens,
            "ddtree_branch_accept_rate": tokens / accepted if accepted else 0.0,
            "ddtree_branch_round_rate": (rounds - branches[0]) / rounds,
            "ddtree_branch_tokens_histogram": branches,
        })
    return info


def _histogram(values, depth_limit: int, what: str) -> list[int]:
    counts = [int(c) for c in (values or [])]
    if any(c < 0 for c in counts) or len(counts) > depth_limit + 1:
        raise ValueError(f"a DDTREE {what} histogram has non-negative counts for 0..{depth_limit} draft tokens, "
                         f"got {counts}.")
    return counts


# SGLang's names for the per-request channel that carries our branch counts (DSpark's "cap" lengths); on a DDTREE
# server they would be misread, so meta_info gets ours instead.
_CAP_KEYS = ("spec_cap_length", "spec_cap_lens_histogram")


def _after_spec_metrics(result, manager, meta_info, recv_obj, i, *args, **kwargs):
    """AFTER TokenizerManager._calculate_spec_decoding_metrics(self, meta_info, recv_obj, i): SGLang has just
    filled meta_info for a finished request; on a DDTREE server add our keys (`ddtree_meta_info`)."""
    server_args = getattr(manager, "server_args", None)
    if str(getattr(server_args, "speculative_algorithm", None) or "").upper() != ALGORITHM:
        return result
    try:
        for key in _CAP_KEYS:
            meta_info.pop(key, None)
        histograms = getattr(recv_obj, "spec_correct_drafts_histogram", None)
        branch_histograms = getattr(recv_obj, "spec_cap_lens_histogram", None)
        if histograms and len(histograms) > i and histograms[i]:
            depth_limit = engine.drafter_block(server_args) - 1
            branches = branch_histograms[i] if branch_histograms and len(branch_histograms) > i else None
            meta_info.update(ddtree_meta_info(histograms[i], depth_limit, branches))
    except Exception:  # a metrics bug must never fail a request
        logger.exception("DDTREE per-request metrics failed")
    return result


# ---------------------------------------------------------------------------------------------------------------
# Target model classes (scheduler processes)

AUX_CAPTURE_TARGET = engine.hook_target("configure_aux_hidden_state_capture")


def _capture_through_body(self, layer_ids):
    """set_dflash_layers_to_capture for a text wrapper whose body (`self.model`) has its own (see add_dflash_capture).

    layer_ids are the drafter's `target_layer_ids`: 0-based target layers whose outputs it reads. The body records
    the hidden state entering each layer it marks (the residual SGLang's layer communicator appends before the
    layer's attention), and what enters layer i + 1 is what layer i put out: so reading layer i marks layer i + 1,
    the same shift SGLang's own wrappers of this body apply. The last layer's output has no next layer to be read at.
    """
    if not self.pp_group.is_last_rank:
        return  # the captured states go on with the logits, which only the last pipeline rank computes
    if layer_ids is None:
        raise ValueError("DFLASH needs the drafter's target layer ids to capture the target's hidden states.")
    layers = len(self.model.layers)
    marks = [int(i) + 1 for i in layer_ids]
    unreadable = [m - 1 for m in marks if not 1 <= m < layers]
    if unreadable:
        raise ValueError(f"{type(self).__name__}: the outputs of layers {unreadable} cannot be captured; a layer's "
                         f"output is read where the next layer starts, so the ids run 0..{layers - 2}.")
    self.capture_aux_hidden_states = True  # the flag SGLang's context-parallel runners read on the wrapper
    self.model.set_dflash_layers_to_capture(marks)


def add_dflash_capture(cls) -> bool:
    """Give cls `set_dflash_layers_to_capture` (_capture_through_body) unless it already has one: a DFLASH-family
    drafter reads the target's hidden states at given layers, and SGLang asks the target model for them through that
    method. SGLang 0.5.17's text-only Qwen3.5 wrapper (models/qwen3_5_text.py) lacks it and does not pass the
    request on to its body, which has it. A class that has the method (a later SGLang's) is left as it is.
    -> whether the method was added."""
    if hasattr(cls, "set_dflash_layers_to_capture"):
        return False
    cls.set_dflash_layers_to_capture = _capture_through_body
    return True


def _before_aux_capture(*args, **kwargs):
    """BEFORE configure_aux_hidden_state_capture(*, model, ..., dflash_use_aux_hidden_state, ...), the one place SGLang
    asks the target for set_dflash_layers_to_capture: on a DFLASH-family runner, give the method to the text-only
    Qwen3.5 wrapper (add_dflash_capture; also reaches its MoE subclass). Its module was imported with SGLang's model
    registry by then; an SGLang without it gets nothing, quietly."""
    if not kwargs.get("dflash_use_aux_hidden_state"):
        return None
    Qwen3_5ForCausalLM = engine.qwen3_5_text_class()
    if Qwen3_5ForCausalLM is None:  # no such model class in this SGLang: nothing to give
        return None
    if add_dflash_capture(Qwen3_5ForCausalLM):
        logger.info("sglang-ddtree: gave %s.%s set_dflash_layers_to_capture (through its body, layer ids + 1)",
                    Qwen3_5ForCausalLM.__module__, Qwen3_5ForCausalLM.__name__)
    return None


# ---------------------------------------------------------------------------------------------------------------
# Registration


def _validate(server_args) -> None:
    """Runs once in the launcher process, before handle_server_args: refuse what DDTREE cannot serve."""
    engine.check_release()  # the SGLang release: supported, or unverified and allowed for measuring
    options = ddtree_args.options_from(server_args)  # flag values: raises ValueError with the flag name
    view = engine.static_view(server_args)
    ddtree_args.check_static_config(
        attention_backends=engine.attention_backends(view),
        page_size=getattr(view, "page_size", None),
        draft_model_path=server_args.speculative_draft_model_path,
        dp_attention=bool(getattr(view, "enable_dp_attention", False)),
        auto=options.auto,
        tp_size=int(getattr(view, "tp_size", None) or getattr(server_args, "tp_size", 1) or 1),
    )
    head = _draft_head(server_args)
    if head is not None:
        raise ValueError(ddtree_args.draft_head_refusal(head))


def _draft_head(server_args) -> str | None:
    """engine.draft_head_kind of the drafter's config, or None when it cannot be read here (DFLASH's own handler
    reads it next and reports a path it cannot read; the worker checks the loaded drafter again)."""
    path = getattr(server_args, "speculative_draft_model_path", None)
    if not path:
        return None
    try:
        hf_config = engine.read_hf_config(path, bool(getattr(server_args, "trust_remote_code", False)),
                                          getattr(server_args, "speculative_draft_model_revision", None))
    except Exception as e:  # noqa: BLE001 - any failure only means "unknown"
        logger.warning("DDTREE: could not read the drafter config to check its head (%s)", e)
        return None
    return engine.draft_head_kind(hf_config)


def _target_recurrence(server_args) -> str | None:
    """ddtree_args.target_recurrence of the target's config, or None when the config cannot be read here (the
    worker then refuses a hybrid target with a message saying so)."""
    try:
        hf_config = engine.read_hf_config(server_args.model_path, bool(server_args.trust_remote_code),
                                          getattr(server_args, "revision", None))
    except Exception as e:  # noqa: BLE001 - any failure only means "unknown"; the worker checks again
        logger.warning("DDTREE: could not read the target config to check for recurrent layers (%s)", e)
        return None
    return ddtree_args.target_recurrence(hf_config)


def _worker_factory(server_args):
    from sglang_ddtree.sglang.worker import DDTreeWorker

    return DDTreeWorker


def _make_spec_class():
    class DDTreeSpecAlgo(engine.spec_algo_base()):
        """DDTREE behaves as the DFlash family (drafter loading, aux hidden capture, KV sizing, draft graphs) but
        verifies B+1 tree nodes per request: server_args.speculative_num_draft_tokens = B+1 (verify width, KV
        reservation), while the drafter runner keeps its block of 16."""

        def is_dflash_family(self) -> bool:
            return True

        def supports_target_verify_for_draft(self) -> bool:
            return True

        def supports_grammar_overlap(self) -> bool:
            return False

        def need_topk(self) -> bool:
            return False

        def carries_draft_hidden_states(self) -> bool:
            return False

        def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens=True,
                              needs_confidence_relay=False):
            return engine.future_map(device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)

        def get_num_tokens_per_req_for_target_verify(self, num_draft_tokens: int, is_draft_worker: bool) -> int:
            if is_draft_worker:
                return engine.drafter_block(engine.launcher_server_args(), default=num_draft_tokens)
            return num_draft_tokens

        def handle_server_args(self, server_args) -> None:
            # server_args: the record (a release whose handlers write it) or the stand-in whose field writes SGLang
            # declares after the call (a release whose handlers declare): assignments below suit both
            options = ddtree_args.options_from(server_args)
            if engine.resolved(server_args, "max_running_requests") is None:
                server_args.max_running_requests = ddtree_args.default_max_running_requests(options.budget)
            engine.handle_dflash(server_args)  # drafter block size, draft backend, DFlash checks
            block_size = int(engine.resolved(server_args, "speculative_num_draft_tokens"))
            engine.store_drafter_block(server_args, block_size)
            # The verify width: every captured target-verify graph, KV reservation and mask buffer follows it.
            server_args.speculative_num_draft_tokens = options.budget + 1
            recurrence = _target_recurrence(server_args)
            if recurrence == "other":
                raise ValueError(ddtree_args.OTHER_RECURRENT_REFUSAL)
            if recurrence == "gdn":
                ddtree_args.check_hybrid_config(
                    options, replayssm_spec=bool(getattr(server_args, "enable_linear_replayssm_spec", False)),
                    radix_strategy=getattr(server_args, "mamba_radix_cache_strategy", None))
                # SGLang's hybrid backend, mamba pool (dense per-node conv windows) and verify graphs switch to tree
                # verify on speculative_eagle_topk > 1 (read when they are built); 2 is enough. The other readers of
                # topk are EAGLE draft paths or KV reservations that only grow (sglang_ddtree/sglang/worker.py).
                server_args.speculative_eagle_topk = 2
                logger.info("DDTREE: hybrid (gated-delta-net) target: tree verify through per-node recurrent "
                            "states (speculative_eagle_topk=2)")
            # the package path: an A/B of two commits in one run shows which ran
            logger.info("DDTREE: budget=%s (verify up to %d tokens/request), drafter block=%d, prune=%s, "
                        "max_running_requests=%s, package %s",
                        f"auto {list(options.candidates)}" if options.auto else options.budget,
                        options.budget + 1, block_size, options.prune, server_args.max_running_requests,
                        Path(__file__).resolve().parents[1])

    return DDTreeSpecAlgo


CALIBRATION_RESET_KEY = "ddtree_calibration_reset"


def _around_set_internal_state(original, scheduler, recv_req, *args, **kwargs):
    """Takes CALIBRATION_RESET_KEY out of the request: a true value resets the DDTREE worker's calibration table
    (updated: false when this server has none, i.e. not DDTREE with `auto`); the other keys go to SGLang."""
    values = dict(getattr(recv_req, "server_args", None) or {})
    if CALIBRATION_RESET_KEY not in values:
        return original(scheduler, recv_req, *args, **kwargs)
    wanted = bool(values.pop(CALIBRATION_RESET_KEY))
    reset = getattr(getattr(scheduler, "draft_worker", None), "reset_calibration", None)
    ok = reset() if wanted and reset is not None else not wanted
    if not ok:
        logger.warning("%s: this server has no DDTREE auto calibration table to reset", CALIBRATION_RESET_KEY)
    if not values:
        return engine.set_internal_state_output(ok)
    recv_req.server_args = values
    out = original(scheduler, recv_req, *args, **kwargs)
    return engine.set_internal_state_output(ok and out.updated)


def register() -> None:
    """The `sglang.srt.plugins` entry point."""
    if engine.registered(ALGORITHM):
        return
    engine.register_hook("ServerArgs.add_cli_args", _after_add_cli_args, "AFTER")
    engine.register_hook("ServerArgs.from_cli_args", _around_from_cli_args, "AROUND")
    engine.register_hook("ServerArgs.__init__", _around_server_args_init, "AROUND")
    engine.register_hook("Engine.__init__", engine.around_engine_init, "AROUND")
    engine.register_hook("resolve_dflash_verify_mask_policy", around_mask_policy, "AROUND")
    engine.register_hook("validate_dflash_request", _after_validate_request, "AFTER")
    engine.register_hook("TokenizerManager._calculate_spec_decoding_metrics", _after_spec_metrics, "AFTER")
    engine.register_hook("Scheduler.set_internal_state", _around_set_internal_state, "AROUND")
    engine.register_hook("configure_aux_hidden_state_capture", _before_aux_capture, "BEFORE")
    # only with SGLANG_DDTREE_HOST_PROFILE set (a debugging aid)
    host_profile.install(engine.load("HookRegistry"), engine.load("HookType"))
    engine.register_algorithm(ALGORITHM, _validate, _make_spec_class(), _worker_factory)
