"""DDTREE on hybrid (gated-delta-net) targets in SGLang, the parts that run without a GPU: the node whose recurrent
state a round commits (against a brute-force reading of the path), the tree links, target detection and the
refusals, the test-only scripted drafts, the hidden-state capture the plugin gives SGLang's text-only Qwen3.5
wrapper, and the SGLang 0.5.17 internals the path relies on (pinned sources).
The server itself is checked on the GPU (tests/gpu/test_ddtree_hybrid.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from sglang_ddtree.layout import parents_from_retrieve
from sglang_ddtree.sglang import args as ddtree_args
from sglang_ddtree.sglang import ops
from sglang_ddtree.sglang.scripted import ScriptedDrafts, scripted_topk
from sglang_ddtree.tree import build_tree, build_tree_from_topk
from sglang_ddtree.walk import greedy_walk
from test_sglang_plugin import local_pinned_sglang_source, module_defs, pinned_sglang_source


def random_round(seed, bs=3, depth=6, budget=24, vocab=7):
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(bs, depth, vocab, generator=g) * 2, dim=-1)
    roots = torch.randint(0, vocab, (bs,), generator=g)
    tree = build_tree(logp, budget, roots)
    n = tree.tokens.shape[1]
    # target choices: a tree child half the time (deep paths), else a random token
    choices = torch.randint(0, vocab, (bs, n), generator=g)
    for b in range(bs):
        for i in range(n):
            kids = [j for j in range(n) if int(tree.parents[b, j]) == i and bool(tree.valid[b, j])]
            if kids and torch.rand((), generator=g) < 0.7:
                choices[b, i] = tree.tokens[b, kids[int(torch.randint(len(kids), (), generator=g))]]
    logits = torch.full((bs, n, vocab), -5.0)
    logits.scatter_(2, choices.unsqueeze(2), 5.0)
    return tree, greedy_walk(tree, logits)


def brute_force_steps(path, accept_len, prefix, interval):
    """Per request: committed tokens are root + accepted drafts at positions prefix + j; the state after the last
    one is node path[accept_len]; tracking stores the state at length m (a multiple of interval) reached inside
    the round, i.e. after committed token m - 1 - prefix."""
    last, track = [], []
    for b in range(path.shape[0]):
        a, p = int(accept_len[b]), int(prefix[b])
        nodes = [int(x) for x in path[b, : a + 1]]
        last.append(nodes[-1])
        step = -1
        if interval is not None:
            for j in range(a + 1):  # committed token j ends at length p + j + 1
                if (p + j + 1) % interval == 0:
                    step = nodes[j]
        track.append(step)
    return last, track


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("interval", [None, 2, 4, 16])
def test_mamba_commit_steps_match_brute_force(seed, interval):
    tree, walk = random_round(seed)
    prefix = torch.tensor([5, 14, 31])
    last, track = ops.mamba_commit_steps(walk.path, walk.accept_len, prefix, interval)
    want_last, want_track = brute_force_steps(walk.path, walk.accept_len, prefix, interval)
    assert last.tolist() == want_last
    assert (walk.accept_len > 0).any(), "the random rounds must accept drafts for this test to mean anything"
    if interval is None:
        assert track is None
    else:
        assert track.tolist() == want_track


def test_mamba_commit_steps_on_a_chain_equal_dflash():
    """A chain (path 0, 1, 2, ...) commits DFLASH's steps: commit_lens - 1, and its to_track_ith rule
    (sglang dflash_worker_v2._update_target_mamba_state_after_verify)."""
    depth, interval = 8, 4
    prefix = torch.tensor([0, 3, 6, 7, 12])
    accept = torch.tensor([0, 1, 5, 8, 2])
    path = torch.where(torch.arange(depth + 1) <= accept.unsqueeze(1), torch.arange(depth + 1), -1)
    last, track = ops.mamba_commit_steps(path, accept, prefix, interval)
    commit = accept + 1
    new = prefix + commit
    to_track = prefix // interval != new // interval
    ith = (new // interval * interval - prefix - 1).clamp(min=0)
    want = torch.where(to_track & (ith < commit), ith, -1)
    assert last.tolist() == (commit - 1).tolist()
    assert track.tolist() == want.tolist()
    assert (track >= 0).any() and (track < 0).any()


@pytest.mark.parametrize("seed", range(3))
def test_tree_links_are_int32_and_give_back_the_parents(seed):
    tree, _ = random_round(seed)
    next_token, next_sibling = ops.tree_links(tree)
    assert next_token.dtype == next_sibling.dtype == torch.int32
    parents = parents_from_retrieve(next_token.long(), next_sibling.long())
    assert torch.equal(torch.where(tree.valid, parents, -1), torch.where(tree.valid, tree.parents, -1))


def test_target_recurrence_from_transformers_configs():
    from transformers import PretrainedConfig, Qwen3Config, Qwen3NextConfig

    assert ddtree_args.target_recurrence(Qwen3NextConfig(num_hidden_layers=4)) == "gdn"
    assert ddtree_args.target_recurrence(Qwen3Config(num_hidden_layers=2)) is None
    other = PretrainedConfig(layer_types=["mamba", "full_attention"])
    other.model_type = "falcon_h1"
    assert ddtree_args.target_recurrence(other) == "other"
    swa = PretrainedConfig(layer_types=["sliding_attention", "full_attention"])
    assert ddtree_args.target_recurrence(swa) is None


def test_hybrid_config_refusals():
    fixed = ddtree_args.parse_options(budget="64")
    ddtree_args.check_hybrid_config(fixed, replayssm_spec=False, radix_strategy=None)
    ddtree_args.check_hybrid_config(fixed, replayssm_spec=False, radix_strategy="extra_buffer")
    cases = [
        (ddtree_args.parse_options(budget="auto"), False, None, "auto"),
        (ddtree_args.parse_options(budget="64", prune="0.01"), False, None, "prune"),
        (fixed, True, None, "replayssm"),
        (fixed, False, "extra_buffer_lazy", "extra_buffer_lazy"),
    ]
    for options, replayssm, strategy, word in cases:
        with pytest.raises(ValueError, match=word):
            ddtree_args.check_hybrid_config(options, replayssm_spec=replayssm, radix_strategy=strategy)


def test_scripted_topk_places_the_truth_at_the_scripted_rank():
    truth = [5, 6, 7, None]
    pattern = ["top", "branch", "miss"]
    values, tokens = scripted_topk(truth, pattern, offset=2, k=6, vocab=20)
    rules = [pattern[(2 + d) % 3] for d in range(1, 4)]  # the root is output 2: depth d is output 2 + d
    assert rules == ["top", "branch", "miss"]
    assert tokens[0, 0] == 5
    assert tokens[1, 1] == 6 and tokens[1, 0] != 6
    assert 7 not in tokens[2].tolist()
    assert all(len(set(row)) == 6 for row in tokens.tolist())
    assert (values[:, :-1] > values[:, 1:]).all()
    assert torch.logsumexp(values, dim=1).max() <= 0  # (sub-)probabilities
    assert math.isclose(float(values[0, 0]), math.log(0.9), rel_tol=1e-6)
    with pytest.raises(ValueError, match="unknown scripted rank"):
        scripted_topk([1], ["sideways"], 0, 4, 10)


def test_scripted_drafts_make_the_walk_accept_branches(tmp_path):
    """Through the real tree and walk: a scripted round accepts the truth down to the first miss, taking the
    second sibling at branch depths."""
    vocab, depth, budget = 50, 8, 32
    prompt, output = [3, 4, 5], [10 + i for i in range(40)]
    path = tmp_path / "script.json"
    path.write_text(json.dumps({"pattern": ["top", "branch", "top", "top", "miss"],
                                "continuations": [{"prompt": prompt, "output": output}]}))
    script = ScriptedDrafts(path, vocab)
    req = type("Req", (), {"origin_input_ids": prompt})()
    other = type("Req", (), {"origin_input_ids": [9, 9]})()
    values = torch.zeros(2, depth, budget)
    tokens = torch.zeros(2, depth, budget, dtype=torch.int64)
    seq_lens = torch.tensor([len(prompt) + 7, 11])  # root = output[7]
    script.apply([req, other], seq_lens, values, tokens)
    assert tokens[1].eq(0).all(), "a request the script does not know keeps its drafts"
    tree = build_tree_from_topk(values[:1], tokens[:1], budget, torch.tensor([output[7]]))  # as the worker does
    n = tree.tokens.shape[1]
    # the target's choice at a node is the truth that follows it when the node is on the true path
    logits = torch.full((1, n, vocab), -5.0)
    on_path = {0: 7}  # node -> output index
    for j in range(1, n):
        p = int(tree.parents[0, j])
        if p in on_path and int(tree.tokens[0, j]) == output[on_path[p] + 1]:
            on_path[j] = on_path[p] + 1
    for j, k in on_path.items():
        logits[0, j, output[k + 1]] = 5.0
    walk = greedy_walk(tree, logits)
    rules = [script.pattern[(7 + d) % 5] for d in range(1, depth + 1)]
    expect = rules.index("miss")
    assert int(walk.accept_len[0]) == expect
    accepted = walk.path[0, 1: expect + 1]
    ranks = tree.ranks[0, accepted]
    assert [int(r) for r in ranks] == [1 if r == "branch" else 0 for r in rules[:expect]]


def test_pinned_sglang_has_the_hybrid_tree_verify_the_worker_relies_on():
    src = pinned_sglang_source()
    backend = (src / "srt/layers/attention/hybrid_linear_attn_backend.py").read_text()
    # tree mode switches on speculative_eagle_topk, read at construction; graph replay refreshes the static links
    # from any spec_info that carries them (our DDTreeVerifyInput), eager verify reads them from the spec_info
    assert "self.topk = model_runner.server_args.speculative_eagle_topk or 0" in backend
    assert 'getattr(spec_info, "retrieve_next_token", None) is not None' in backend
    assert "retrieve_next_token = forward_batch.spec_info.retrieve_next_token" in backend
    defs = module_defs(src, "srt.layers.attention.hybrid_linear_attn_backend")
    assert defs["HybridLinearAttnBackend"]["update_mamba_state_after_mtp_verify"] == [
        "self", "last_correct_step_indices", "mamba_track_indices", "mamba_steps_to_track", "model",
        "req_pool_indices"]
    pool = (src / "srt/mem_cache/memory_pool.py").read_text()
    assert "(speculative_eagle_topk is None or speculative_eagle_topk <= 1)" in pool  # dense windows for trees
    gdn = (src / "srt/layers/attention/linear/gdn_backend.py").read_text()
    assert "retrieve_parent_token=retrieve_parent_token" in gdn
    assert "hybrid_gdn_config" in module_defs(src, "srt.configs.hybrid_arch")
    worker = (src / "srt/speculative/dflash_worker_v2.py").read_text()
    assert "self._need_mamba_verify_commit = mambaish_config(" in worker
    # the DFLASH argument handling forces topk to 1; the plugin raises it afterwards for hybrid targets
    hook = (src / "srt/arg_groups/speculative_hook.py").read_text()
    assert "server_args.speculative_eagle_topk = 1" in hook
    from sglang_ddtree.sglang import plugin

    import inspect
    handle = inspect.getsource(plugin._make_spec_class)
    assert handle.index("engine.handle_dflash(server_args)") < handle.index("server_args.speculative_eagle_topk = 2")
    assert "def get_config(" in (src / "srt/utils/hf_transformers/config.py").read_text()
    assert "from sglang.srt.utils.hf_transformers import *" in (src / "srt/utils/hf_transformers_utils.py").read_text()
    assert '"get_config",' in (src / "srt/utils/hf_transformers/__init__.py").read_text()


# ---------------------------------------------------------------------------------------------------------------
# The text-only Qwen3.5 wrapper's hidden-state capture (plugin.add_dflash_capture), with stand-in classes


class StandInBody:
    """What the wrapper's body offers: its layers and its own capture method, which takes marked layer ids."""

    def __init__(self, layers=8):
        self.layers = [object() for _ in range(layers)]
        self.marked = None

    def set_dflash_layers_to_capture(self, layers_to_capture):
        self.marked = list(layers_to_capture)


def stand_in_wrapper(last_rank=True):
    """A fresh class each call (the patch changes the class), shaped as qwen3_5_text.Qwen3_5ForCausalLM."""
    import types

    class Wrapper:
        def __init__(self):
            self.pp_group = types.SimpleNamespace(is_last_rank=last_rank)
            self.model = StandInBody()
            self.capture_aux_hidden_states = False

    return Wrapper


def test_text_wrapper_gets_a_capture_method_that_forwards_shifted_ids():
    from sglang_ddtree.sglang import plugin

    Wrapper = stand_in_wrapper()
    assert not hasattr(Wrapper, "set_dflash_layers_to_capture")
    assert plugin.add_dflash_capture(Wrapper) is True
    target = Wrapper()
    target.set_dflash_layers_to_capture([1, 3, 6])  # the tiny hybrid drafter's target_layer_ids (8 layers)
    assert target.model.marked == [2, 4, 7]  # the body marks where each layer's output enters the next layer
    assert target.capture_aux_hidden_states is True
    target.set_dflash_layers_to_capture([0])
    assert target.model.marked == [1]
    # the last layer's output has no next layer to be read at; ids out of range and None are refused
    with pytest.raises(ValueError, match="ids run 0..6"):
        target.set_dflash_layers_to_capture([1, 7])
    with pytest.raises(ValueError, match=r"cannot be captured"):
        target.set_dflash_layers_to_capture([-1])
    with pytest.raises(ValueError, match="target layer ids"):
        target.set_dflash_layers_to_capture(None)
    # a subclass (as Qwen3_5MoeForCausalLM subclasses the dense wrapper) inherits it; a second call adds nothing
    Moe = type("Moe", (Wrapper,), {})
    assert plugin.add_dflash_capture(Moe) is False and plugin.add_dflash_capture(Wrapper) is False
    moe = Moe()
    moe.set_dflash_layers_to_capture([5])
    assert moe.model.marked == [6]
    # not the last pipeline rank: nothing marked, the flag stays off
    other_rank = stand_in_wrapper(last_rank=False)
    plugin.add_dflash_capture(other_rank)
    middle = other_rank()
    middle.set_dflash_layers_to_capture([1, 3])
    assert middle.model.marked is None and middle.capture_aux_hidden_states is False


def test_a_class_with_its_own_capture_method_is_left_alone():
    from sglang_ddtree.sglang import plugin

    def own(self, layer_ids):
        self.model.set_dflash_layers_to_capture(["own"])

    Later = type("Later", (stand_in_wrapper(),), {"set_dflash_layers_to_capture": own})
    assert plugin.add_dflash_capture(Later) is False
    assert Later.__dict__["set_dflash_layers_to_capture"] is own
    target = Later()
    target.set_dflash_layers_to_capture([1])
    assert target.model.marked == ["own"]
    # inherited from a base counts as having one too
    Child = type("Child", (Later,), {})
    assert plugin.add_dflash_capture(Child) is False and "set_dflash_layers_to_capture" not in Child.__dict__


def test_aux_capture_hook_patches_the_sglang_wrapper_only_on_dflash_runners(monkeypatch, caplog):
    """The hook imports SGLang's text wrapper by its module path (a stand-in module here) and gives it the method
    when a DFLASH-family runner configures the capture; without that module it does nothing and says nothing."""
    import logging
    import sys
    import types

    from sglang_ddtree.sglang import plugin

    name = "sglang.srt.models.qwen3_5_text"
    module = types.ModuleType(name)
    module.Qwen3_5ForCausalLM = stand_in_wrapper()
    monkeypatch.setitem(sys.modules, name, module)
    kwargs = dict(model=None, eagle_use_aux_hidden_state=False, eagle_aux_hidden_state_layer_ids=None,
                  dflash_target_layer_ids=[1], is_dspark=False)
    assert plugin._before_aux_capture(**kwargs, dflash_use_aux_hidden_state=False) is None  # BEFORE: args unchanged
    assert not hasattr(module.Qwen3_5ForCausalLM, "set_dflash_layers_to_capture")  # not a DFLASH-family runner
    with caplog.at_level(logging.INFO, logger=plugin.__name__):
        assert plugin._before_aux_capture(**kwargs, dflash_use_aux_hidden_state=True) is None
    assert module.Qwen3_5ForCausalLM.set_dflash_layers_to_capture is plugin._capture_through_body
    assert "set_dflash_layers_to_capture (through its body, layer ids + 1)" in caplog.text
    caplog.clear()
    monkeypatch.setitem(sys.modules, name, None)  # import fails: an SGLang without that model class
    with caplog.at_level(logging.DEBUG):
        assert plugin._before_aux_capture(**kwargs, dflash_use_aux_hidden_state=True) is None
    assert caplog.records == []


def test_pinned_sglang_text_wrapper_lacks_the_capture_its_body_has():
    """What add_dflash_capture relies on in SGLang 0.5.17: the text-only wrapper (and its MoE subclass) has no
    set_dflash_layers_to_capture, builds its body as `self.model` from qwen3_5's Qwen3_5ForCausalLM, whose own
    method takes marked layer ids; a marked layer records the state entering it, so SGLang's own wrappers of this
    body shift the drafter's ids by one; the one caller is configure_aux_hidden_state_capture, called by keyword."""
    src = local_pinned_sglang_source()
    text = module_defs(src, "srt.models.qwen3_5_text")
    assert "set_dflash_layers_to_capture" not in text["Qwen3_5ForCausalLM"]
    assert "set_dflash_layers_to_capture" not in text["Qwen3_5MoeForCausalLM"]
    assert "get_input_embeddings" in text["Qwen3_5ForCausalLM"]  # the other target method DFLASH and we call
    text_source = (src / "srt/models/qwen3_5_text.py").read_text()
    assert "class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):" in text_source  # inherits the added method
    assert "body_cls = qwen3_5.Qwen3_5ForCausalLM" in text_source
    assert "self.model = self.body_cls(" in text_source and "self.pp_group = get_pp_group()" in text_source
    assert "self.capture_aux_hidden_states = False" in text_source
    assert "hidden_states, aux_hidden_states = hidden_states" in text_source  # forward hands the states on
    body = module_defs(src, "srt.models.qwen3_5")
    assert body["Qwen3_5ForCausalLM"]["set_dflash_layers_to_capture"] == ["self", "layers_to_capture"]
    body_source = (src / "srt/models/qwen3_5.py").read_text()
    assert "class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):" in body_source
    method = body_source[body_source.index("    def set_dflash_layers_to_capture"):]
    method = method[: method.index("\n    @property")]
    assert 'setattr(self.layers[layer_id], "_is_layer_to_capture", True)' in method  # ids index self.layers
    assert "self.layers, self._start_layer, self._end_layer = make_layers(" in body_source
    assert 'if getattr(layer, "_is_layer_to_capture", False)' in body_source
    # a marked layer appends the residual entering it, i.e. the previous layer's output
    communicator = (src / "srt/layers/communicator.py").read_text()
    capture = communicator[communicator.index("def prepare_attn_and_capture_last_layer_outputs"):]
    capture = capture[: capture.index("\n    def ")]
    assert "hidden_states=residual" in capture and "captured_last_layer_outputs.append(" in capture
    assert 'SGLang captures "before layer i"' in (src / "srt/speculative/dflash_utils.py").read_text()
    # SGLang's own wrapper of this same body shifts by one (Qwen3_5ForConditionalGeneration -> qwen3_vl's)
    assert "language_model_cls=Qwen3_5ForCausalLM," in body_source
    vl = (src / "srt/models/qwen3_vl.py").read_text()
    vl_method = vl[vl.index("    def set_dflash_layers_to_capture"):]
    assert "self.model.set_dflash_layers_to_capture([val + 1 for val in layer_ids])" in vl_method[:600]
    # the caller: keyword-only arguments, the hasattr check, the call
    setup = (src / "srt/model_executor/model_runner_components/attention_backend_setup.py").read_text()
    import ast

    caller = next(n for n in ast.parse(setup).body
                  if isinstance(n, ast.FunctionDef) and n.name == "configure_aux_hidden_state_capture")
    assert not caller.args.args and {"model", "dflash_use_aux_hidden_state"} <= {a.arg for a in caller.args.kwonlyargs}
    call_site = ast.get_source_segment(setup, caller)
    assert 'elif hasattr(model, "set_dflash_layers_to_capture"):' in call_site
    assert "model.set_dflash_layers_to_capture(dflash_target_layer_ids)" in call_site
    runner = (src / "srt/model_executor/model_runner.py").read_text()
    assert "configure_aux_hidden_state_capture(\n            model=self.model," in runner
    # the flag the added method sets is read on the wrapper by SGLang's runners
    eager = (src / "srt/model_executor/runner/eager_runner.py").read_text()
    assert 'getattr(model, "capture_aux_hidden_states", False)' in eager
