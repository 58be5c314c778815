"""The exact top-K over the vocabulary (and the rows' logsumexp) in Triton: the draft's top-K log-probs without a
float32 copy of the lm_head's output or a full sort. Same result as tree.exact_topk, bit for bit."""

from __future__ import annotations

import torch

from sglang_ddtree.kernels.common import (_float_key, _key_from_prefix, _pow2, _radix_digit,  # noqa: F401
                                          _radix_select, _warps, tl, triton)

if triton is not None:

    # ---- per-row statistics of the lm_head's output in its own dtype: max, first index of the max, logsumexp,
    # computed by the top-K's first two launches (below): per (row, chunk of GB x S entries) a max and a sum of
    # exp(x - max), then per row their combination. row_max_lse runs the same two kernels with the same launch
    # shapes, so both give the same logsumexp bit for bit (an `auto` chain round's top-1 must stay the top-K's first
    # column): two separate kernels with the same source gave different bits on the H200 (a sum's order
    # follows the launch's warps).

    @triton.jit
    def _load_group_block(x_ptr, row, prog, stride_x, V: tl.constexpr, GB: tl.constexpr, S: tl.constexpr):
        """Entries prog*GB*S .. (prog+1)*GB*S - 1 of a row as a [GB, S] float32 block (-inf past V) and their
        indices."""
        g = prog * GB + tl.arange(0, GB)
        offs = g[:, None] * S + tl.arange(0, S)[None, :]
        x = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        return offs, x

    # ---- exact top-K over the vocabulary (topk_triton): a threshold from group maxima, then a radix selection
    # among the few keys above it

    @triton.jit
    def _vocab_keys(x_ptr, row, chunk, stride_x, V: tl.constexpr, CHUNK: tl.constexpr):
        offs = chunk * CHUNK + tl.arange(0, CHUNK)
        inside = offs < V
        x = tl.load(x_ptr + row * stride_x + offs, mask=inside, other=0.0).to(tl.float32)
        return offs, inside, _float_key(x).to(tl.int64) + 2147483648  # unsigned order in [0, 2^32)

    @triton.jit
    def _group_max_kernel(x_ptr, gmax_ptr, pm_ptr, ps_ptr, parg_ptr, stride_x, groups, parts, V: tl.constexpr,
                          GB: tl.constexpr, S: tl.constexpr, LSE: tl.constexpr):
        """The largest key of each group of S consecutive entries (GB groups a program); LSE: also the program's
        max, the first index holding it, and the sum of exp(x - max) (0 for a block of -inf only)."""
        row = tl.program_id(0).to(tl.int64)
        prog = tl.program_id(1)
        offs, x = _load_group_block(x_ptr, row, prog, stride_x, V, GB, S)
        g = prog * GB + tl.arange(0, GB)
        tl.store(gmax_ptr + row * groups + g, tl.max(_float_key(x), axis=1), mask=g < groups)
        if LSE:
            m = tl.max(tl.max(x, 1), 0)
            total = tl.sum(tl.sum(tl.exp(x - m), 1), 0)
            tl.store(pm_ptr + row * parts + prog, m)
            tl.store(ps_ptr + row * parts + prog, tl.where(m > float("-inf"), total, 0.0))
            tl.store(parg_ptr + row * parts + prog, tl.min(tl.min(tl.where(x == m, offs, V), 1), 0))

    @triton.jit
    def _group_threshold_kernel(gmax_ptr, thresh_ptr, pm_ptr, ps_ptr, parg_ptr, lse_ptr, max_ptr, arg_ptr, groups,
                                parts, K: tl.constexpr, GP: tl.constexpr, LSE: tl.constexpr, PP: tl.constexpr,
                                KEY_BITS: tl.constexpr):
        """t = the K-th largest group maximum (K <= groups; 0 otherwise, which keeps every key). K groups hold a
        key >= t, so the K-th largest key T >= t: the top K lie among the keys >= t. LSE: the row's logsumexp from
        the chunks' parts, its max and the first index holding it (ties keep the earlier chunk)."""
        row = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, GP)
        live = i < groups
        ukey = tl.load(gmax_ptr + row * groups + i, mask=live, other=0).to(tl.int64) + 2147483648
        if K > 0:
            thresh, k_left = _radix_select(ukey, live, K, KEY_BITS, False)
        else:
            thresh = tl.zeros([], dtype=tl.int64)
        tl.store(thresh_ptr + row, thresh)
        if LSE:
            c = tl.arange(0, PP)
            counted = c < parts
            pm = tl.load(pm_ptr + row * parts + c, mask=counted, other=float("-inf"))
            ps = tl.load(ps_ptr + row * parts + c, mask=counted, other=0.0)
            top = tl.max(pm, 0)
            tl.store(lse_ptr + row, top + tl.log(tl.sum(ps * tl.exp(pm - top), 0)))
            first_chunk = tl.min(tl.where(counted & (pm == top), c, PP), 0)
            parg = tl.load(parg_ptr + row * parts + c, mask=counted, other=0)
            tl.store(max_ptr + row, top)
            tl.store(arg_ptr + row, tl.sum(tl.where(c == first_chunk, parg, 0), 0).to(tl.int64))

    @triton.jit
    def _threshold_count_kernel(x_ptr, thresh_ptr, counts_ptr, stride_x, chunks, V: tl.constexpr,
                                CHUNK: tl.constexpr):
        """Per chunk: how many keys lie above t, and how many equal it."""
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        offs, inside, key = _vocab_keys(x_ptr, row, chunk, stride_x, V, CHUNK)
        thresh = tl.load(thresh_ptr + row)
        slot = counts_ptr + (row * chunks + chunk) * 2
        tl.store(slot, tl.sum((inside & (key > thresh)).to(tl.int32), 0))
        tl.store(slot + 1, tl.sum((inside & (key == thresh)).to(tl.int32), 0))

    @triton.jit
    def _threshold_collect_kernel(x_ptr, thresh_ptr, counts_ptr, cand_ptr, stride_x, chunks, cap,
                                  V: tl.constexpr, K: tl.constexpr, CHUNK: tl.constexpr, CHP: tl.constexpr):
        """The candidates in two index-ordered runs: every key above t (fewer than K groups hold one, so at most
        S(K-1) of them), then the first K keys equal to t (the lowest-index ties are the ones the top K can
        take). Inside each run, position order is index order: ties at the final threshold are then taken
        lowest position first."""
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        offs, inside, key = _vocab_keys(x_ptr, row, chunk, stride_x, V, CHUNK)
        thresh = tl.load(thresh_ptr + row)
        c = tl.arange(0, CHP)
        counted = c < chunks
        gt_counts = tl.load(counts_ptr + (row * chunks + c) * 2, mask=counted, other=0)
        eq_counts = tl.load(counts_ptr + (row * chunks + c) * 2 + 1, mask=counted, other=0)
        earlier = c < chunk
        gt_before = tl.sum(tl.where(earlier, gt_counts, 0), 0)
        eq_before = tl.sum(tl.where(earlier, eq_counts, 0), 0)
        n_gt = tl.sum(gt_counts, 0)
        gt = inside & (key > thresh)
        eq = inside & (key == thresh)
        out = cand_ptr + row * cap
        tl.store(out + gt_before + tl.cumsum(gt.to(tl.int32), 0) - 1, offs.to(tl.int32), mask=gt)
        eq_rank = eq_before + tl.cumsum(eq.to(tl.int32), 0) - 1
        tl.store(out + n_gt + eq_rank, offs.to(tl.int32), mask=eq & (eq_rank < K))

    @triton.jit
    def _candidate_topk_kernel(x_ptr, counts_ptr, cand_ptr, scratch_ptr, out_values_ptr, out_ids_ptr, stride_x,
                               chunks, cap, id_offset, K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr,
                               CHP: tl.constexpr, KEY_BITS: tl.constexpr):
        """Exact top K of a row's candidates (typically ~K of them, at most S(K-1) + K): KEY_BITS / 8 histogram
        passes over 8-bit digits find the K-th largest key T (see _radix_select), a pass collects the keys above T
        and the lowest-position (= lowest-index) ties at T, a sort of K gives the canonical order (value descending,
        then index ascending)."""
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride_x
        cand = cand_ptr + row * cap
        c = tl.arange(0, CHP)
        counted = c < chunks
        n_gt = tl.sum(tl.load(counts_ptr + (row * chunks + c) * 2, mask=counted, other=0), 0)
        n_eq = tl.sum(tl.load(counts_ptr + (row * chunks + c) * 2 + 1, mask=counted, other=0), 0)
        n = n_gt + tl.minimum(n_eq, K)
        prefix = tl.zeros([], dtype=tl.int64)  # the digits of T fixed so far
        k_left = tl.zeros([], dtype=tl.int32) + K  # how many of the K still lie at or below the prefix
        for p in tl.static_range(KEY_BITS // 8):
            shift = 24 - 8 * p
            hist = tl.zeros([256], dtype=tl.int32)
            start = tl.zeros([], dtype=tl.int32)
            while start < n:  # a while: the interpreter cannot take a tensor bound in range()
                pos = start + tl.arange(0, BLOCK)
                live = pos < n
                idx = tl.load(cand + pos, mask=live, other=0)
                x = tl.load(base + idx, mask=live, other=0.0).to(tl.float32)
                key = _float_key(x).to(tl.int64) + 2147483648
                match = live & ((key >> (shift + 8)) == prefix)
                hist += tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=match)
                start += BLOCK
            digit, k_left = _radix_digit(hist, k_left)
            prefix = prefix * 256 + digit.to(tl.int64)
        prefix = _key_from_prefix(prefix, KEY_BITS)
        above = K - k_left
        n_above = tl.zeros([], dtype=tl.int32)
        n_tied = tl.zeros([], dtype=tl.int32)
        out_scratch = scratch_ptr + row * KP
        start = tl.zeros([], dtype=tl.int32)
        while start < n:
            pos = start + tl.arange(0, BLOCK)
            live = pos < n
            idx = tl.load(cand + pos, mask=live, other=0)
            x = tl.load(base + idx, mask=live, other=0.0).to(tl.float32)
            key = _float_key(x).to(tl.int64) + 2147483648
            gt = live & (key > prefix)
            eq = live & (key == prefix)
            tl.store(out_scratch + n_above + tl.cumsum(gt.to(tl.int32), 0) - 1, idx.to(tl.int64), mask=gt)
            eq_rank = n_tied + tl.cumsum(eq.to(tl.int32), 0) - 1
            tl.store(out_scratch + above + eq_rank, idx.to(tl.int64), mask=eq & (eq_rank < k_left))
            n_above += tl.sum(gt.to(tl.int32), 0)
            n_tied += tl.sum(eq.to(tl.int32), 0)
            start += BLOCK
        tl.debug_barrier()
        slots = tl.arange(0, KP)
        ok = slots < K
        chosen = tl.load(out_scratch + slots, mask=ok, other=0)
        values = tl.load(base + chosen, mask=ok, other=0.0).to(tl.float32)
        packed = (_float_key(values).to(tl.int64) << 32) | (4294967295 - chosen)
        packed = tl.sort(tl.where(ok, packed, -9223372036854775807 - 1), 0, descending=True)
        ids = 4294967295 - (packed & 4294967295)
        tl.store(out_ids_ptr + row * K + slots, ids + id_offset, mask=ok)
        tl.store(out_values_ptr + row * K + slots, tl.load(base + ids, mask=ok, other=0.0).to(tl.float32),
                 mask=ok)


def row_max_lse(x: torch.Tensor, block: int = 4096) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of x [rows, V] (float32, bfloat16 or float16, read in its dtype; -inf-free rows): (max float32, first
    index of the max int64, logsumexp float32), in one read of x spread over (row, chunk) programs: the top-K's
    first two launches (topk_launches) with the same shapes. The max and its index equal torch.max over x.float();
    the logsumexp equals torch.logsumexp up to float32 rounding (a different summation order) and topk_logits_lse's
    bit for bit."""
    x = _readable(x)
    out_max = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    out_arg = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    out_lse = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    launches, _ = topk_launches(x, 1, None, None, block=block, lse=out_lse, row_max=(out_max, out_arg))
    for _, launch in launches[:2]:
        launch()
    return out_max, out_arg, out_lse


# Largest k topk_triton orders in one program (a register sort of k keys); the serving path needs k <= 1024.
TOPK_TRITON_MAX_K = 4096
# Entries per group whose maxima give topk_triton's threshold: the candidates are at most S(K-1) + K.
TOPK_GROUP = 32


# The float32 bits that can differ between values read in each dtype (the rest follow from the sign, see
# _key_from_prefix): the radix selections of the top-K run one 8-bit pass per 8 of them, so a bfloat16 lm_head
# output takes 2 passes instead of 4 in both of its selections.
_KEY_BITS = {torch.float32: 32, torch.float16: 24, torch.bfloat16: 16}


def _readable(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels read it: its own float dtype where Triton loads it (no float32 copy of a bf16 lm_head
    output), rows contiguous."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        x = x.float()
    return x.contiguous()


def _chunking(width: int, block: int) -> tuple[int, int, int]:
    """(entries per group S, groups per program GB, programs per row) of a row of `width` entries: programs read
    GB * S = min(block, next power of two of width) consecutive entries."""
    chunk = min(block, _pow2(width))
    group = min(TOPK_GROUP, chunk)
    return group, chunk // group, triton.cdiv(width, chunk)


def topk_triton(x: torch.Tensor, k: int, *, id_offset: int = 0, block: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Same result as tree.exact_topk(x.float(), k, id_offset=id_offset) for a [rows, V] tensor without NaN (bit
    for bit: values as float32, then ids, in the canonical order); bfloat16 / float16 rows are read as they are.

    How: the maxima of groups of TOPK_GROUP entries give t = their K-th largest, a lower bound of the K-th largest
    entry (K groups hold an entry >= t); two passes over (row, chunk of `block`) programs count and collect the
    entries above t and the first K equal to it, in index order; one program per row finds the exact top K among
    those candidates (radix selection) and sorts them. Three reads of the row, all of them cheap compares and
    maxima. Why: torch.topk took 0.20 / 0.60 ms at batch 1 / 8 for K=256 on the H200, and a radix
    selection over the whole row (four histogram passes) 0.15 / 0.67 ms: histograms of every entry cost
    more than the reads."""
    values, ids, _ = _topk(x, k, id_offset, block, with_lse=False)
    return values, ids


def topk_logits_lse(x: torch.Tensor, k: int, *, id_offset: int = 0, block: int = 4096
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_triton of raw logits plus each row's logsumexp (float32, = row_max_lse's bit for bit), computed in the
    top-K's first pass: the draft's top-K log-probs are values - lse, without a float32 copy of the logits or a
    separate logsumexp (a profile at 8B shapes, batch 16: those took ~0.27 ms a round)."""
    return _topk(x, k, id_offset, block, with_lse=True)


def _topk(x, k, id_offset, block, with_lse):
    x = _readable(x)
    rows, width = x.shape
    if not 1 <= k <= width:
        raise ValueError(f"top-k needs 1 <= k <= {width}, got k={k}.")
    if k > TOPK_TRITON_MAX_K:
        raise ValueError(f"topk_triton orders at most {TOPK_TRITON_MAX_K} keys a row, got k={k}; use tree.exact_topk.")
    values = torch.empty((rows, k), dtype=torch.float32, device=x.device)
    ids = torch.empty((rows, k), dtype=torch.int64, device=x.device)
    lse = torch.empty(rows, dtype=torch.float32, device=x.device) if with_lse else None
    launches, _ = topk_launches(x, k, values, ids, id_offset=id_offset, block=block, lse=lse)
    for _, launch in launches:
        launch()
    return values, ids, lse


def topk_launches(x: torch.Tensor, k: int, values: torch.Tensor | None, ids: torch.Tensor | None, *,
                  id_offset: int = 0, block: int = 4096, lse: torch.Tensor | None = None,
                  row_max: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[list[tuple[str, object]], torch.Tensor]:
    """topk_triton's five launches in order, as (name, callable) over their scratch buffers (x: as _readable gives
    it; results into values / ids, the rows' logsumexp into `lse` when given, and their max and its first index into
    `row_max` when given: row_max_lse runs the first two launches only), and the per-chunk counts of keys above / at
    the threshold they fill (the candidates per row: above + min(at, k)). topk_triton runs them back to back;
    benchmarks/profile_kernels.py times each."""
    rows, width = x.shape
    device = x.device
    group, gb, chunks = _chunking(width, block)
    chunk = gb * group
    groups = triton.cdiv(width, group)
    cap = min(width, group * (k - 1) + k)
    gmax = torch.empty((rows, groups), dtype=torch.int32, device=device)
    thresh = torch.empty(rows, dtype=torch.int64, device=device)
    counts = torch.empty((rows, chunks, 2), dtype=torch.int32, device=device)
    cand = torch.empty((rows, cap), dtype=torch.int32, device=device)
    kp = _pow2(max(k, 2))
    scratch = torch.empty((rows, kp), dtype=torch.int64, device=device)
    # With the logsumexp, both launches also give each row's max and its index, for row_max_lse and topk_logits_lse
    # alike: the two then run the same code with the same shapes (only K differs).
    with_lse = lse is not None
    parts_shape = (rows, chunks) if with_lse else 1
    pm = torch.empty(parts_shape, dtype=torch.float32, device=device)
    ps = torch.empty(parts_shape, dtype=torch.float32, device=device)
    parg = torch.empty(parts_shape, dtype=torch.int32, device=device)
    lse_out = lse if with_lse else pm
    if row_max is not None:
        max_out, arg_out = row_max
    elif with_lse:
        max_out = torch.empty(rows, dtype=torch.float32, device=device)
        arg_out = torch.empty(rows, dtype=torch.int64, device=device)
    else:
        max_out, arg_out = pm, parg
    gp = _pow2(groups)
    chp = _pow2(chunks)
    grid = (rows, chunks)
    key_bits = _KEY_BITS[x.dtype]
    launches = [
        ("group_max", lambda: _group_max_kernel[grid](
            x, gmax, pm, ps, parg, x.stride(0), groups, chunks, V=width, GB=gb, S=group, LSE=with_lse, num_warps=4)),
        ("threshold", lambda: _group_threshold_kernel[(rows,)](
            gmax, thresh, pm, ps, parg, lse_out, max_out, arg_out, groups, chunks, K=k if k <= groups else 0, GP=gp,
            LSE=with_lse, PP=chp, KEY_BITS=key_bits, num_warps=_warps(gp))),
        ("count", lambda: _threshold_count_kernel[grid](
            x, thresh, counts, x.stride(0), chunks, V=width, CHUNK=chunk, num_warps=4)),
        ("collect", lambda: _threshold_collect_kernel[grid](
            x, thresh, counts, cand, x.stride(0), chunks, cap, V=width, K=k, CHUNK=chunk, CHP=chp, num_warps=4)),
        ("candidates_topk", lambda: _candidate_topk_kernel[(rows,)](
            x, counts, cand, scratch, values, ids, x.stride(0), chunks, cap, id_offset, K=k, KP=kp,
            BLOCK=min(2048, _pow2(cap)), CHP=chp, KEY_BITS=key_bits, num_warps=4 if kp <= 256 else 8)),
    ]
    return launches, counts
