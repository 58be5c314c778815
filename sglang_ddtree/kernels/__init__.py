"""Triton kernels for the serving hot path, by job: the tree build (tree_build), the draft top-K and logsumexp
(topk), and the round's other steps (round_ops: verify mask, walk, chain accept, KV move). Each gives the same
result as the torch version it replaces (tests compare them, on CPU through TRITON_INTERPRET=1)."""

from sglang_ddtree.kernels.common import available
from sglang_ddtree.kernels.round_ops import (chain_accept_batch_sizes, chain_accept_triton, move_path_kv,
                                             tree_verify_mask_triton, walk_triton)
from sglang_ddtree.kernels.topk import row_max_lse, topk_launches, topk_logits_lse, topk_triton
from sglang_ddtree.kernels.tree_build import SELECT_MIN_WIDTH, build_tree_triton, build_tree_triton_sort, tree_kernel_for

__all__ = ["available", "build_tree_triton", "build_tree_triton_sort", "chain_accept_batch_sizes",
           "chain_accept_triton", "move_path_kv", "row_max_lse", "SELECT_MIN_WIDTH", "topk_launches",
           "topk_logits_lse", "topk_triton", "tree_kernel_for", "tree_verify_mask_triton", "walk_triton"]
