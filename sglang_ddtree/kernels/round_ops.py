"""The round's Triton kernels after the tree build: the verify mask, the walk, the lean chain round's accept, and the
commit's KV move. Each gives the same result as its torch version (layout.py, walk.py, sglang/ops.py), in one
launch instead of one small kernel per depth or step."""

from __future__ import annotations

import functools

import torch

from sglang_ddtree.kernels.common import _pow2, tl, triton
from sglang_ddtree.metric_names import SummaryLayout
from sglang_ddtree.tree import DraftTree
from sglang_ddtree.walk import WalkResult

if triton is not None:

    @triton.jit
    def _path_kv_move_kernel(data_ptrs, strides, tgt_ptr, src_ptr, ROWS: tl.constexpr, RP: tl.constexpr,
                             TILE: tl.constexpr):
        """One program per (KV buffer, request, byte tile): the request's moved rows (src != tgt) of that tile,
        all loaded before any is stored."""
        buf = tl.program_id(0)
        req = tl.program_id(1).to(tl.int64)
        tile = tl.program_id(2)
        stride = tl.load(strides + buf).to(tl.int64)
        base = tl.load(data_ptrs + buf).to(tl.pointer_type(tl.uint8))
        r = tl.arange(0, RP)
        in_rows = r < ROWS
        src = tl.load(src_ptr + req * ROWS + r, mask=in_rows, other=0)
        tgt = tl.load(tgt_ptr + req * ROWS + r, mask=in_rows, other=0)
        moved = in_rows & (src != tgt)
        off = tile * TILE + tl.arange(0, TILE)
        m = moved[:, None] & (off < stride)[None, :]
        vals = tl.load(base + src[:, None] * stride + off[None, :], mask=m)
        tl.store(base + tgt[:, None] * stride + off[None, :], vals, mask=m)

    @triton.jit
    def _verify_mask_kernel(
        parents_ptr, valid_ptr, start_ptr, seq_lens_ptr, mask_ptr,
        N: tl.constexpr, L: tl.constexpr, BLOCK_ROWS: tl.constexpr, NP: tl.constexpr,
    ):
        """Tree block of SGLang's FULL_MASK for rows [row0, row0+BLOCK_ROWS) of request b: row r, column c is
        True iff node c is node r or an ancestor of it (invalid rows: only themselves)."""
        b = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        cols = tl.arange(0, NP)
        row_ok = rows < N
        prefix = tl.load(seq_lens_ptr + b).to(tl.int64)
        row_base = tl.load(start_ptr + b) + rows.to(tl.int64) * (prefix + N) + prefix
        ptrs = mask_ptr + row_base[:, None] + cols[None, :]
        tl.store(ptrs, tl.zeros([BLOCK_ROWS, NP], dtype=tl.int8), mask=row_ok[:, None] & (cols[None, :] < N))
        tl.debug_barrier()
        node = rows.to(tl.int64)
        for _ in range(L + 1):
            alive = row_ok & (node >= 0)
            tl.store(mask_ptr + row_base + node, tl.full([BLOCK_ROWS], 1, tl.int8), mask=alive)
            node = tl.load(parents_ptr + b * N + node, mask=alive, other=-1)

    @triton.jit
    def _walk_kernel(
        tokens_ptr, parents_ptr, valid_ptr, choice_ptr, match_ptr,
        path_ptr, accept_ptr, bonus_ptr, out_tokens_ptr,
        N: tl.constexpr, NP: tl.constexpr, L: tl.constexpr, LP: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, NP)
        in_tree = offs < N
        tok = tl.load(tokens_ptr + b * N + offs, mask=in_tree, other=0)
        par = tl.load(parents_ptr + b * N + offs, mask=in_tree, other=-1)
        val = tl.load(valid_ptr + b * N + offs, mask=in_tree, other=0) != 0
        is_child = in_tree & val & (par >= 0)
        choice_at_parent = tl.load(choice_ptr + b * N + par, mask=is_child, other=-1)
        hit = is_child & (tok == choice_at_parent)
        tl.store(match_ptr + b * N + par, offs.to(tl.int64), mask=hit)  # siblings carry distinct tokens
        tl.debug_barrier()
        steps = tl.arange(0, LP)
        path = tl.where(steps == 0, 0, -1).to(tl.int64)
        node = tl.zeros([1], dtype=tl.int64)
        for s in range(1, L + 1):
            node = tl.load(match_ptr + b * N + node, mask=node >= 0, other=-1)
            path = tl.where(steps == s, node, path)
        accept = tl.sum(((path >= 0) & (steps > 0)).to(tl.int64))
        last = tl.max(tl.where(steps == accept, path, -1))
        bonus = tl.load(choice_ptr + b * N + last)
        tl.store(path_ptr + b * (L + 1) + steps, path, mask=steps < L + 1)
        tl.debug_barrier()
        following = tl.load(path_ptr + b * (L + 1) + steps + 1, mask=steps < L, other=-1)
        ftok = tl.load(tokens_ptr + b * N + following, mask=following >= 0, other=-1)
        out = tl.where(steps < accept, ftok, tl.where(steps == accept, bonus, -1))
        tl.store(out_tokens_ptr + b * (L + 1) + steps, out, mask=steps < L + 1)
        tl.store(accept_ptr + b, accept)
        tl.store(bonus_ptr + b, bonus)

    @triton.jit
    def _chain_accept_kernel(
        cand_ptr, choice_ptr, logp_ptr, prefix_ptr, accept_ptr, commit_ptr, bonus_ptr, out_ptr, new_len_ptr,
        branch_ptr, summary_ptr, bs, L: tl.constexpr, W: tl.constexpr, ROWS: tl.constexpr, BLOCKS: tl.constexpr,
        AT_ACCEPTED: tl.constexpr, AT_BRANCHES: tl.constexpr, AT_NODES: tl.constexpr, AT_EXPECTED: tl.constexpr,
        AT_REQUESTS: tl.constexpr,
    ):
        """One program for the whole batch (the batch sums need no atomics): see chain_accept_triton. AT_*: the
        summary vector's entries (metric_names.SummaryLayout)."""
        cols = tl.arange(0, W)
        node_cols = cols < L + 1
        draft_cols = cols < L
        counts = tl.zeros([W], dtype=tl.float32)
        expected = tl.zeros([ROWS], dtype=tl.float32)
        requests = tl.zeros([ROWS], dtype=tl.float32)
        for block in range(BLOCKS):
            rows = block * ROWS + tl.arange(0, ROWS)
            live = rows < bs
            r = rows.to(tl.int64)
            drafts = live[:, None] & draft_cols[None, :]
            choice = tl.load(choice_ptr + r[:, None] * (L + 1) + cols[None, :],
                             mask=live[:, None] & node_cols[None, :], other=0)
            # the draft at node j + 1 is accepted when the target's choice at node j is that token
            following = tl.load(cand_ptr + r[:, None] * (L + 1) + cols[None, :] + 1, mask=drafts, other=0)
            miss = (choice != following) | ~draft_cols[None, :]
            accept = tl.min(tl.where(miss, cols[None, :], W), axis=1)  # the first miss: accepted drafts, <= L
            at_accept = cols[None, :] == accept[:, None]
            bonus = tl.sum(tl.where(at_accept, choice, 0), axis=1)
            out = tl.where(cols[None, :] < accept[:, None], following, tl.where(at_accept, bonus[:, None], 0))
            tl.store(out_ptr + r[:, None] * (L + 1) + cols[None, :], out, mask=live[:, None] & node_cols[None, :])
            tl.store(accept_ptr + r, accept, mask=live)
            tl.store(commit_ptr + r, accept + 1, mask=live)
            tl.store(bonus_ptr + r, bonus, mask=live)
            tl.store(branch_ptr + r, tl.zeros([ROWS], dtype=tl.int32), mask=live)  # no draft off the top-1
            prefix = tl.load(prefix_ptr + r, mask=live, other=0)
            tl.store(new_len_ptr + r, prefix + accept + 1, mask=live)
            # the drafter's expected committed tokens: 1 + the sum over the chain's nodes of their prefix probability
            logp = tl.load(logp_ptr + r[:, None] * L + cols[None, :], mask=drafts, other=0.0)
            prob = tl.where(drafts, tl.exp(tl.cumsum(logp, axis=1)), 0.0)
            expected += tl.where(live, 1.0 + tl.sum(prob, axis=1), 0.0)
            requests += live.to(tl.float32)
            counts += tl.sum((live[:, None] & at_accept).to(tl.float32), axis=0)
        n = tl.sum(requests, axis=0)
        tl.store(summary_ptr + AT_ACCEPTED + cols, counts, mask=node_cols)
        tl.store(summary_ptr + AT_BRANCHES, 0.0)  # a chain has none
        tl.store(summary_ptr + AT_NODES, n * L)  # draft nodes verified
        tl.store(summary_ptr + AT_EXPECTED, tl.sum(expected, axis=0))
        tl.store(summary_ptr + AT_REQUESTS, n)


def tree_verify_mask_triton(tree: DraftTree, seq_lens: torch.Tensor, numel: int) -> torch.Tensor:
    """Same result as sglang.ops.tree_verify_mask(layout.ancestor_mask(tree), seq_lens, numel)."""
    bs, n = tree.tokens.shape
    device = tree.tokens.device
    seq_lens = seq_lens.to(device=device, dtype=torch.int64)
    block = n * (seq_lens + n)
    start = torch.cumsum(block, dim=0) - block
    mask = torch.ones(numel, dtype=torch.bool, device=device)
    rows = 16
    _verify_mask_kernel[(bs, triton.cdiv(n, rows))](
        tree.parents.contiguous(), tree.valid, start, seq_lens, mask.view(torch.int8),
        N=n, L=tree.depth_limit, BLOCK_ROWS=rows, NP=_pow2(n), num_warps=4,
    )
    return mask


def walk_triton(tree: DraftTree, target_choice: torch.Tensor):
    """Same result as walk.walk_choices(tree, target_choice)."""
    bs, n = tree.tokens.shape
    device = tree.tokens.device
    depth = tree.depth_limit
    choice = target_choice.to(torch.int64).contiguous()
    match = torch.full((bs, n), -1, dtype=torch.int64, device=device)
    path = torch.empty((bs, depth + 1), dtype=torch.int64, device=device)
    accept = torch.empty(bs, dtype=torch.int64, device=device)
    bonus = torch.empty(bs, dtype=torch.int64, device=device)
    out_tokens = torch.empty((bs, depth + 1), dtype=torch.int64, device=device)
    _walk_kernel[(bs,)](
        tree.tokens.contiguous(), tree.parents.contiguous(), tree.valid.to(torch.int8), choice, match,
        path, accept, bonus, out_tokens, N=n, NP=_pow2(n), L=depth, LP=_pow2(depth + 1), num_warps=4,
    )
    return WalkResult(path=path, accept_len=accept, bonus=bonus, out_tokens=out_tokens, target_choice=choice)


def _chain_accept_blocks(bs: int) -> tuple[int, int]:
    """chain_accept_triton's ROWS (row blocks a loop of its one program walks: few compiled variants) and BLOCKS
    (the loop's trips) for bs requests: both constexprs, so each pair is a compiled variant."""
    rows = 16 if bs <= 16 else 64
    return rows, -(-bs // rows)


def chain_accept_batch_sizes(low: int, high: int) -> list[int]:
    """One batch size in low..high (inclusive) per variant of chain_accept_triton that batch sizes compile: its
    ROWS and BLOCKS constexprs and Triton's specialization of the integer `bs` (equal to 1, divisible by 16). Each
    variant's first launch compiles it (~0.3-0.5 s), so `auto` launches these once when it captures a batch-size
    bucket's stages (AutoRounds.capture_bucket): an in-process A/B timed a lean chain round's first launch
    at a new variant inside a measured run (an `auto` arm at 16.5 ms a round over a run against its fixed arm's 5.0)."""
    out, seen = [], set()
    for bs in range(max(1, low), high + 1):
        key = (*_chain_accept_blocks(bs), bs == 1, bs % 16 == 0)
        if key not in seen:
            seen.add(key)
            out.append(bs)
    return out


def chain_accept_triton(candidates: torch.Tensor, choices: torch.Tensor, logprobs: torch.Tensor,
                        prefix_lens: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
    """A chain round's walk, commit arithmetic and stats in one launch (sglang.ops.chain_accept: the same results
    as its torch reference, the expected tokens up to float32 summation order). candidates [bs, L+1] int64 (the
    root, then the drafts), choices [bs, L+1] int64 (the target's token at each), logprobs [bs, L] float32 (the
    drafts' log-probs), prefix_lens [bs]. Writes out's accept_len / commit_lens (int32 [bs]), bonus (int64 [bs]),
    out_tokens (int64 [bs, L+1]: the accepted drafts, the bonus, zeros), new_seq_lens ([bs], prefix_lens' dtype),
    branch_lens (int32 [bs], zeros) and summary (float32, metric_names.SummaryLayout's round summary vector)."""
    bs, width = candidates.shape
    rows, blocks = _chain_accept_blocks(bs)
    _chain_accept_kernel[(1,)](
        candidates.contiguous(), choices.to(torch.int64).contiguous(), logprobs.float().contiguous(),
        prefix_lens.contiguous(), out["accept_len"], out["commit_lens"], out["bonus"], out["out_tokens"],
        out["new_seq_lens"], out["branch_lens"], out["summary"], bs, L=width - 1, W=_pow2(width), ROWS=rows,
        BLOCKS=blocks, **_summary_at(width - 1), num_warps=4,
    )


@functools.lru_cache(maxsize=None)
def _summary_at(depth_limit: int) -> dict[str, int]:
    """_chain_accept_kernel's AT_* arguments: where the round summary vector's entries sit."""
    layout = SummaryLayout(depth_limit)
    return {"AT_ACCEPTED": layout.by_accepted.start, "AT_BRANCHES": layout.index("branches"),
            "AT_NODES": layout.index("nodes"), "AT_EXPECTED": layout.index("expected"),
            "AT_REQUESTS": layout.index("requests")}


def move_path_kv(data_ptrs: torch.Tensor, strides: torch.Tensor, max_stride: int, tgt: torch.Tensor,
                 src: torch.Tensor, rows_per_request: int, tile: int = 512) -> None:
    """KV rows of every buffer (data_ptrs: uint64 [buffers], strides: bytes per slot [buffers], max_stride: their
    maximum, known on the host; SGLang's MHA pool layout) copied from slot src to slot tgt, rows grouped by request
    (ops.accepted_kv_moves' order, bs * L rows). Same result as SGLang's move_kv_cache for these moves (a
    simultaneous copy; ops.accepted_kv_moves shows in-order copying gives the same), but rows with src == tgt move
    nothing: after a round most accepted nodes are already in place, and a profile (8B shapes, batch 16)
    spent 0.94 ms a round in SGLang's all-rows copy (one program per buffer holding up to 128 rows x 512 bytes)."""
    total = tgt.numel()
    if total == 0:
        return
    if total % rows_per_request:
        raise ValueError(f"{total} moves are not whole requests of {rows_per_request} rows.")
    _path_kv_move_kernel[(data_ptrs.numel(), total // rows_per_request, triton.cdiv(max_stride, tile))](
        data_ptrs, strides, tgt.contiguous(), src.contiguous(), ROWS=rows_per_request, RP=_pow2(rows_per_request),
        TILE=tile, num_warps=4)
