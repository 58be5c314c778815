"""The DDTREE worker's in-process state that SGLang hooks read, and the hooks the worker itself installs.

The plugin (sglang/plugin.py) registers hooks in every SGLang process; some of them must act only in a scheduler
process that runs a DDTreeWorker, and some only while the worker captures a causal verify. Both the plugin and
the worker import this module (neither imports the other at load time).
"""

from __future__ import annotations

import contextlib

from sglang_ddtree import config

# Set in a scheduler process once a DDTreeWorker exists there; read by the hooks that run in that process.
_ACTIVE_IN_PROCESS = False


def mark_active() -> None:
    global _ACTIVE_IN_PROCESS
    _ACTIVE_IN_PROCESS = True


def is_active() -> bool:
    return _ACTIVE_IN_PROCESS


# Set while the worker captures the verify graphs of `auto`'s chain candidate: a chain is causal, so it verifies
# the way DFLASH does, without a custom mask (cheaper attention at 8B shapes).
_CAUSAL_CAPTURE = False


@contextlib.contextmanager
def causal_verify_capture():
    global _CAUSAL_CAPTURE
    _CAUSAL_CAPTURE = True
    try:
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
TREE_CONV_TARGET = "sglang.srt.layers.attention.linear.gdn_backend.causal_conv1d_update"
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
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _TREE_CONV = config.get("SGLANG_DDTREE_TREE_CONV")
    HookRegistry.register(TREE_CONV_TARGET, around_tree_conv, HookType.AROUND)
    HookRegistry.apply_hooks()  # applies the targets not patched yet: this one
    return _TREE_CONV
