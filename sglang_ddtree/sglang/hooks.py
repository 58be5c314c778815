"""The DDTREE worker's in-process state that SGLang hooks read, and the hooks the worker itself installs.

The plugin (sglang/plugin.py) registers hooks in every SGLang process; some of them must act only in a scheduler
process that runs a DDTreeWorker, and some only while the worker captures a causal verify. Both the plugin and
the worker import this module (neither imports the other at load time).
"""

from __future__ import annotations

import contextlib

import torch

from sglang_ddtree import config
from sglang_ddtree.sglang import engine

# Set in a scheduler process once a DDTreeWorker exists there; read by the hooks that run in that process.
_ACTIVE_IN_PROCESS = False


def mark_active() -> None:
    global _ACTIVE_IN_PROCESS
    _ACTIVE_IN_PROCESS = True


def is_active() -> bool:
    return _ACTIVE_IN_PROCESS


# Set while the worker captures the verify graphs of a causal verify (`auto`'s chain candidate, its rounds without a
# draft, the oracle's chain): a chain is causal, so it is captured the way DFLASH's verify is, without a custom mask.
_CAUSAL_CAPTURE = False
# Set while the worker runs or captures a causal verify: its extend-attention calls may take our kernel (causal
# over the verify's own tokens), which the drafter's and the prefills' causal calls never do.
_CAUSAL_VERIFY = False


@contextlib.contextmanager
def causal_verify():
    global _CAUSAL_VERIFY
    _CAUSAL_VERIFY = True
    try:
        yield
    finally:
        _CAUSAL_VERIFY = False


@contextlib.contextmanager
def causal_verify_capture():
    global _CAUSAL_CAPTURE
    _CAUSAL_CAPTURE = True
    try:
        with causal_verify():
            yield
    finally:
        _CAUSAL_CAPTURE = False


def around_mask_policy(original, attn_backend, *args, **kwargs):
    """dflash_utils.resolve_dflash_verify_mask_policy (AROUND): a DDTREE verify graph is captured with the custom
    tree mask, except `auto`'s causal chain (causal_verify_capture)."""
    name, build_custom_mask = original(attn_backend, *args, **kwargs)
    return (name, True) if is_active() and not _CAUSAL_CAPTURE else (name, build_custom_mask)


# The conv update SGLang's gated-delta-net backend calls in a tree verify (a name it imports): large trees take
# ours (sglang_ddtree/tree_conv.py: SGLang's unrolls over the verify tokens and compiled for minutes).
TREE_CONV_TARGET = engine.hook_target("causal_conv1d_update")
# SGLANG_DDTREE_TREE_CONV as install_tree_conv_hook read it (at the worker's start)
_TREE_CONV = "auto"


def around_tree_conv(original, *args, **kwargs):
    from sglang_ddtree import tree_conv

    if kwargs.get("retrieve_next_token") is not None and args and tree_conv.use_ours(args[0].shape[-1],
                                                                                      _TREE_CONV):
        return tree_conv.causal_conv1d_tree_update(*args, **kwargs)
    return original(*args, **kwargs)


def install_tree_conv_hook() -> str:
    """Put around_tree_conv on SGLang's gated-delta-net conv update. DDTreeWorker calls it on a hybrid target, in
    its scheduler process, after the plugins' own hooks were applied: no other server imports that backend for it
    or runs through the hook. The backend looks the name up at call time, so patching it now takes effect.
    -> the SGLANG_DDTREE_TREE_CONV choice it read."""
    global _TREE_CONV
    _TREE_CONV = config.get("SGLANG_DDTREE_TREE_CONV")
    engine.register_hook("causal_conv1d_update", around_tree_conv, "AROUND")
    engine.apply_hooks()  # applies the targets not patched yet: this one
    return _TREE_CONV


# The attention SGLang's Triton backend runs for a target verify (a name the backend imports when it is built):
# a tree verify takes ours (kernels/verify_attention.py) where its plan is faster; SGLANG_DDTREE_VERIFY_ATTENTION=sglang
# leaves every call to SGLang's kernel.
VERIFY_ATTENTION_TARGET = engine.hook_target("extend_attention_fwd")
# SGLANG_DDTREE_VERIFY_ATTENTION as install_verify_attention_hook read it (at the worker's start)
_VERIFY_ATTENTION = "sglang"  # until then nothing is hooked
_SMS: dict = {}  # device index -> its SM count


def _verify_splits(q, k_pool, v_pool, o, qo_indptr, custom_mask, is_causal, width, k_scale, v_scale,
                   args, kwargs, sms: int) -> int:
    """How many prefix chunks our kernel cuts this extend-attention call into (verify_attention.plan_splits; 1: the
    whole-prefix kernel); 0 to leave it to SGLang's: anything but a uniform verify (a tree's, with its mask, or the
    worker's causal one: causal_verify) on a plain bf16/fp16 MHA pool, with heads larger than
    verify_attention.MAX_HEAD_DIM, or a verify where the plan finds SGLang's kernel as fast."""
    if _VERIFY_ATTENTION != "ddtree" or not is_causal or args or (custom_mask is None and not _CAUSAL_VERIFY):
        return 0
    plain, hints = engine.EXTEND_ATTENTION_PLAIN, engine.EXTEND_ATTENTION_HINTS
    if any(name not in hints and (name not in plain or (
            value != plain[name] and not (name == "sliding_window_size" and value is None)))
           for name, value in kwargs.items()):
        return 0
    if k_scale != 1.0 or v_scale != 1.0 or k_pool.dtype != q.dtype or k_pool.dim() != 3 or v_pool.dim() != 3:
        return 0
    bs = qo_indptr.shape[0] - 1
    if width <= 0 or q.shape[0] != bs * width or q.shape[-1] != o.shape[-1] or q.shape[-1] != v_pool.shape[-1]:
        return 0
    from sglang_ddtree.kernels import verify_attention

    if q.shape[-1] > verify_attention.MAX_HEAD_DIM:
        return 0

    return verify_attention.plan_splits(bs, q.shape[1], width, sms)


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def around_extend_attention(original, q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr,
                            kv_indices, custom_mask, is_causal, mask_indptr, max_len_extend, k_scale=1.0,
                            v_scale=1.0, sm_scale=None, *args, **kwargs):
    """SGLang's extend_attention_fwd (the same parameters, so the same call) or, for a verify that _verify_splits
    gives ours, kernels/verify_attention.py into the same output (no custom mask: causal)."""
    q = q_extend
    splits = q.is_cuda and _verify_splits(q, k_buffer, v_buffer, o_extend, qo_indptr, custom_mask, is_causal,
                                          max_len_extend, k_scale, v_scale, args, kwargs, _sm_count(q.device))
    if not splits:
        return original(q_extend, k_extend, v_extend, o_extend, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices,
                        custom_mask, is_causal, mask_indptr, max_len_extend, k_scale, v_scale, sm_scale, *args,
                        **kwargs)
    from sglang_ddtree.kernels import verify_attention

    scale = sm_scale or 1.0 / q.shape[-1] ** 0.5
    verify_attention.tree_verify_attention(q, k_extend, v_extend, o_extend, k_buffer, v_buffer, kv_indptr,
                                           kv_indices, custom_mask, mask_indptr, max_len_extend, scale, splits)


def install_verify_attention_hook() -> str:
    """Put around_extend_attention on SGLang's Triton extend attention unless SGLANG_DDTREE_VERIFY_ATTENTION is
    `sglang`: then nothing is installed, so every call goes straight to SGLang's kernel.
    DDTreeWorker calls it in its scheduler process before the target's attention backends are built (they import
    the function then); only calls with a verify's custom mask take ours, so the drafter's and the prefills' keep
    SGLang's. -> the SGLANG_DDTREE_VERIFY_ATTENTION choice it read."""
    global _VERIFY_ATTENTION
    _VERIFY_ATTENTION = config.get("SGLANG_DDTREE_VERIFY_ATTENTION")
    if _VERIFY_ATTENTION != "ddtree":
        return _VERIFY_ATTENTION
    engine.register_hook("extend_attention_fwd", around_extend_attention, "AROUND")
    engine.apply_hooks()
    return _VERIFY_ATTENTION
