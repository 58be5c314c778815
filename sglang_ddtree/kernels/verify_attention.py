"""The tree verify's attention: at small batch the shared prefix split across programs, then one merge; at
large batch, for narrow verifies, one small program per (request, head) instead of SGLang's 128-row one.

Why: SGLang's Triton extend attention runs one program per (request, head, 128 query rows) and walks the whole
prefix KV in it, one block after another. At batch 1 that is 32 programs on 132 SMs for an 8B target, and a
65-token tree verify spent 46 us a layer in it against a 16-token chain's 33 (profile of the real-size pair:
+0.52 ms a round over 41 layers), latency-bound while the KV it reads takes well under a microsecond at 4 TB/s.
Here each (request, head) splits its prefix into `splits` chunks and the tree block (the verify's own tokens
under the tree mask) is one more part; all parts run side by side and write their softmax partials (running max,
sum and unnormalised output, float32), which a second kernel merges. Both kernels take only tensor shapes from
the host, so the pair is captured in the verify's CUDA graphs like SGLang's kernel.
Once a batch fills the SMs there is nothing to split, but a verify of 16 or 17 tokens still runs SGLang's 128-row
programs at 1/8 or 1/4 occupancy of their matrix work, one program a query head, each reading its KV head's whole
prefix. The whole-prefix kernel runs one program a (request, KV head): the group's query heads packed as rows (4
heads x 16 rows for a 16-token verify at Qwen3-8B's 32/8 heads), so every prefix block is read once for the group,
then the tree block, and it writes the normalised output itself.

Inputs are SGLang's target-verify layout (what its extend_attention_fwd reads): q [bs*W, H, D], the verify's own
k / v [bs*W, H_kv, D], the KV pool [slots, H_kv, D] addressed through kv_indptr / kv_indices (the prefix only),
and the custom mask: per request, W rows of (prefix + W) booleans from mask_indptr[b], the last W columns the
tree's (the prefix columns are all visible and not read).

Used for every plain tree verify of a dense target on the Triton backend where plan_splits says ours is faster
(sglang_ddtree/sglang/hooks.py decides); the result equals exact attention up to float32 summation order and the bf16
rounding of the probabilities before the value product, as SGLang's does.
"""

from __future__ import annotations

import torch

from sglang_ddtree.kernels.common import _pow2, tl, triton

BLOCK_N = 64  # prefix / tree keys per loop step
MAX_SPLITS = 4
MERGE_ROWS = 16  # query rows a merge program takes
WIDE_BATCH_MAX_WIDTH = 64  # verify widths the whole-prefix kernel takes once the SMs are full (plan_splits)
MAX_HEAD_DIM = 128  # head sizes measured on a GPU (Qwen3-8B's 128); larger ones stay with SGLang's kernel


def plan_splits(bs: int, heads: int, width: int, sms: int) -> int:
    """How many chunks the prefix of each (request, head) is cut into: 0 leaves the call to SGLang's kernel, 1 is
    the whole-prefix kernel (no partials, no merge), 2-4 the split kernel. `fit` is how many times the programs
    SGLang's kernel would run (bs x heads x query blocks) fit the SMs' program slots (one 128-row program an SM, two
    64-row, four smaller). Measured one layer at a time in CUDA graphs at Qwen3-8B heads (H200 and H100,
    benchmarks/bench_verify_attention.py and tests/gpu/test_verify_attention_cuda.py, prefixes of 400-2000 tokens):
    - fit >= 3: split the prefix, 2-4 chunks (more lose: every part's float32 partials are written and merged).
      Batch 1, 16 tokens: 12.9 us against SGLang's 33.5 and the whole kernel's 23.6 (H100).
    - otherwise, verifies of at most 64 tokens: the whole-prefix kernel, a KV group's heads packed into one program.
      Batch 4, 64 tokens: 28.7 us against the split kernel's 33.5 and SGLang's 34.7; batch 16, 16 tokens: 33.6
      against SGLang's 127.2; batch 64, 16 tokens, 2000-token prefixes: 287 against 2173 (SGLang's kernel runs 128
      query rows a program, one head each, so a 16-token verify does 8x the matrix work it needs and reads each KV
      head's prefix once a query head).
    - wider verifies at fit 2: split in two (batch 1, 129 tokens: 41.6 us against SGLang's 45.4); at fit < 2
      SGLang's kernel (batch 4, 65 tokens: 40.0 against the whole kernel's 41.6, batch 8: 79.4 against 86.9)."""
    block_m = _block_m(width)
    slots = sms * (1 if block_m >= 128 else 2 if block_m == 64 else 4)
    fit = slots // (bs * heads * _m_blocks(width))
    if fit >= 3 or (fit == 2 and width > WIDE_BATCH_MAX_WIDTH):
        return max(2, min(MAX_SPLITS, fit - 1))
    return 1 if width <= WIDE_BATCH_MAX_WIDTH else 0


def _block_m(width: int) -> int:
    """Query rows a program: the verify's width rounded up to a power of two (16-128); 64 past 128 tokens (a
    129-token verify in three blocks of 64 ran faster than in two of 128)."""
    return 64 if width > 128 else min(max(_pow2(width), 16), 128)


def _m_blocks(width: int) -> int:
    return -(-width // _block_m(width))


def _heads_per_block(group: int, splits: int, block_w: int) -> int:
    """Query heads of one KV group a program takes. The whole-prefix kernel packs the group's heads into one
    program of up to 128 rows (4 heads x 16 rows for a 16-token verify at Qwen3-8B's 32/8 heads), so each prefix
    block is read once for the group instead of once a head, and its matrix products run 64 rows instead of 16.
    The split kernel keeps one head a program: at the batches it serves, programs are what is short."""
    if splits != 1:
        return 1
    fit = max(1, 128 // block_w)
    hpb = 1
    while hpb * 2 <= min(group, fit) and group % (hpb * 2) == 0:
        hpb *= 2
    return hpb


if triton is not None:

    @triton.jit
    def _query_block(Q, kv_indptr, b, hb, mb, q_st, q_sh, W, GROUP: tl.constexpr, D: tl.constexpr,
                     BLOCK_D: tl.constexpr, HPB: tl.constexpr, BLOCK_W: tl.constexpr):
        """Query block mb of request b, head block hb: HPB heads of one KV group, BLOCK_W verify rows of each
        (program row r is head hb*HPB + r // BLOCK_W, verify row mb*BLOCK_W + r % BLOCK_W), their queries, the
        group's KV head and the request's prefix."""
        r = tl.arange(0, HPB * BLOCK_W)
        rows = mb * BLOCK_W + r % BLOCK_W
        heads = hb * HPB + r // BLOCK_W
        row_ok = rows < W
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        q = tl.load(Q + (b * W + rows)[:, None] * q_st + heads[:, None] * q_sh + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        kv_start = tl.load(kv_indptr + b)
        prefix = tl.load(kv_indptr + b + 1) - kv_start
        return q, rows, heads, row_ok, offs_d, d_ok, (hb * HPB) // GROUP, kv_start, prefix

    @triton.jit
    def _softmax_step(s, v, m_i, l_i, acc, MAY_BE_EMPTY: tl.constexpr):
        """One block of keys into the running softmax: scores s (log2 units, -inf where unseen) and values v update
        the running max m_i, sum l_i and unnormalised output acc. MAY_BE_EMPTY: a row may have seen no key yet (the
        tree block before its root), so its max stays -inf and its reference is 0 instead of a NaN."""
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = m_new
        if MAY_BE_EMPTY:
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)

    @triton.jit
    def _prefix_steps(q, m_i, l_i, acc, lo, hi, kv_start, kv_indices, K_pool, V_pool, kp_st, kp_sh, vp_st, vp_sh,
                      kvh, offs_d, d_ok, scale_log2, BLOCK_N: tl.constexpr):
        """The online softmax over prefix keys lo..hi-1 of one request (all visible to every row)."""
        offs_n = tl.arange(0, BLOCK_N)
        start = lo
        while start < hi:  # (a while loop: Triton's interpreter cannot range() over loaded bounds)
            cols = start + offs_n
            col_ok = cols < hi
            loc = tl.load(kv_indices + kv_start + cols, mask=col_ok, other=0).to(tl.int64)
            k = tl.load(K_pool + loc[None, :] * kp_st + kvh * kp_sh + offs_d[:, None],
                        mask=col_ok[None, :] & d_ok[:, None], other=0.0)
            s = tl.where(col_ok[None, :], tl.dot(q, k) * scale_log2, float("-inf"))
            v = tl.load(V_pool + loc[:, None] * vp_st + kvh * vp_sh + offs_d[None, :],
                        mask=col_ok[:, None] & d_ok[None, :], other=0.0)
            m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, False)  # every row sees a prefix key: no empty row
            start += BLOCK_N
        return m_i, l_i, acc

    @triton.jit
    def _tree_steps(q, m_i, l_i, acc, b, rows, row_ok, prefix, W, K_new, V_new, Mask, mask_indptr, kn_st, kn_sh,
                    vn_st, vn_sh, kvh, offs_d, d_ok, scale_log2, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
        """The online softmax over the verify's own W keys under the tree mask (causal: a chain)."""
        offs_n = tl.arange(0, BLOCK_N)
        mask_row = tl.load(mask_indptr + b) + rows.to(tl.int64) * (prefix + W) + prefix
        start = 0
        while start < W:
            cols = start + offs_n
            col_ok = cols < W
            k = tl.load(K_new + (b * W + cols)[None, :] * kn_st + kvh * kn_sh + offs_d[:, None],
                        mask=col_ok[None, :] & d_ok[:, None], other=0.0)
            s = tl.dot(q, k) * scale_log2
            if CAUSAL:
                seen = (cols[None, :] <= rows[:, None]) & col_ok[None, :]
            else:
                seen = tl.load(Mask + mask_row[:, None] + cols[None, :],
                               mask=row_ok[:, None] & col_ok[None, :], other=0) != 0
            s = tl.where(seen, s, float("-inf"))
            v = tl.load(V_new + (b * W + cols)[:, None] * vn_st + kvh * vn_sh + offs_d[None, :],
                        mask=col_ok[:, None] & d_ok[None, :], other=0.0)
            m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, True)
            start += BLOCK_N
        return m_i, l_i, acc

    @triton.jit
    def _verify_parts_kernel(Q, K_new, V_new, K_pool, V_pool, kv_indptr, kv_indices, Mask, mask_indptr,
                             Acc, Max, Sum, scale_log2,
                             q_st, q_sh, kn_st, kn_sh, vn_st, vn_sh, kp_st, kp_sh, vp_st, vp_sh,
                             W, SPLITS, M_BLOCKS, H: tl.constexpr, GROUP: tl.constexpr, CAUSAL: tl.constexpr,
                             D: tl.constexpr, BLOCK_D: tl.constexpr, HPB: tl.constexpr, BLOCK_W: tl.constexpr,
                             BLOCK_N: tl.constexpr):
        """One part of one (request, head block, query block): a prefix chunk (part < SPLITS) or the tree block."""
        b = tl.program_id(0)
        part = tl.program_id(2) // M_BLOCKS
        q, rows, heads, row_ok, offs_d, d_ok, kvh, kv_start, prefix = _query_block(
            Q, kv_indptr, b, tl.program_id(1), tl.program_id(2) % M_BLOCKS, q_st, q_sh, W, GROUP, D, BLOCK_D, HPB,
            BLOCK_W)
        m_i = tl.full([HPB * BLOCK_W], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([HPB * BLOCK_W], dtype=tl.float32)
        acc = tl.zeros([HPB * BLOCK_W, BLOCK_D], dtype=tl.float32)
        if part < SPLITS:
            chunk = tl.cdiv(tl.cdiv(prefix, SPLITS), BLOCK_N) * BLOCK_N
            lo = part * chunk
            hi = tl.minimum(lo + chunk, prefix)
            m_i, l_i, acc = _prefix_steps(q, m_i, l_i, acc, lo, hi, kv_start, kv_indices, K_pool, V_pool, kp_st,
                                          kp_sh, vp_st, vp_sh, kvh, offs_d, d_ok, scale_log2, BLOCK_N)
        else:
            m_i, l_i, acc = _tree_steps(q, m_i, l_i, acc, b, rows, row_ok, prefix, W, K_new, V_new, Mask,
                                        mask_indptr, kn_st, kn_sh, vn_st, vn_sh, kvh, offs_d, d_ok, scale_log2,
                                        CAUSAL, BLOCK_N)
        # the real rows only; an empty part (a prefix shorter than its chunk) leaves its outputs unwritten but for
        # the running max, which tells the merge to skip it
        slot = ((b * H + heads) * (SPLITS + 1) + part) * (M_BLOCKS * BLOCK_W) + rows
        tl.store(Max + slot, m_i, mask=row_ok)
        tl.store(Sum + slot, l_i, mask=row_ok)
        filled = row_ok & (m_i > float("-inf"))
        tl.store(Acc + slot[:, None] * BLOCK_D + offs_d[None, :], acc, mask=filled[:, None])

    @triton.jit
    def _verify_whole_kernel(Q, K_new, V_new, K_pool, V_pool, kv_indptr, kv_indices, Mask, mask_indptr, O,
                             scale_log2, q_st, q_sh, kn_st, kn_sh, vn_st, vn_sh, kp_st, kp_sh, vp_st, vp_sh, o_st,
                             o_sh, W, GROUP: tl.constexpr, CAUSAL: tl.constexpr, D: tl.constexpr,
                             BLOCK_D: tl.constexpr, HPB: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr):
        """One (request, head block, query block) whole: the prefix, then the tree block, the output normalised in
        O's dtype (no partials, no merge): for batches whose programs already fill the SMs."""
        b = tl.program_id(0)
        q, rows, heads, row_ok, offs_d, d_ok, kvh, kv_start, prefix = _query_block(
            Q, kv_indptr, b, tl.program_id(1), tl.program_id(2), q_st, q_sh, W, GROUP, D, BLOCK_D, HPB, BLOCK_W)
        m_i = tl.full([HPB * BLOCK_W], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([HPB * BLOCK_W], dtype=tl.float32)
        acc = tl.zeros([HPB * BLOCK_W, BLOCK_D], dtype=tl.float32)
        m_i, l_i, acc = _prefix_steps(q, m_i, l_i, acc, 0, prefix, kv_start, kv_indices, K_pool, V_pool, kp_st, kp_sh,
                                      vp_st, vp_sh, kvh, offs_d, d_ok, scale_log2, BLOCK_N)
        m_i, l_i, acc = _tree_steps(q, m_i, l_i, acc, b, rows, row_ok, prefix, W, K_new, V_new, Mask, mask_indptr,
                                    kn_st, kn_sh, vn_st, vn_sh, kvh, offs_d, d_ok, scale_log2, CAUSAL, BLOCK_N)
        out = acc / tl.where(row_ok, l_i, 1.0)[:, None]  # every real row sees its tree root: l_i > 0
        tl.store(O + (b * W + rows)[:, None] * o_st + heads[:, None] * o_sh + offs_d[None, :],
                 out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _verify_merge_kernel(Acc, Max, Sum, O, o_st, o_sh, W, PARTS, ROWS_PAD, H: tl.constexpr, D: tl.constexpr,
                             BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
        """The parts of BLOCK_R query rows of one (request, head) merged by their running maxima, the output in
        O's dtype. Few rows a program: at batch 1 a program per (head, 128 rows) read 9 parts x 64 KB alone and
        was the slower half of the pair."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        rows = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < W
        offs_d = tl.arange(0, BLOCK_D)
        base = (b * H + h) * PARTS * ROWS_PAD + rows
        m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        part = 0
        while part < PARTS:  # (while loops: Triton's interpreter cannot range() over an argument)
            m = tl.maximum(m, tl.load(Max + base + part * ROWS_PAD, mask=row_ok, other=float("-inf")))
            part += 1
        m = tl.where(m == float("-inf"), 0.0, m)  # padding rows only: every real row sees its tree root
        total = tl.zeros([BLOCK_R], dtype=tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        part = 0
        while part < PARTS:
            slot = base + part * ROWS_PAD
            part_max = tl.load(Max + slot, mask=row_ok, other=float("-inf"))
            filled = part_max > float("-inf")
            w = tl.where(filled, tl.exp2(part_max - m), 0.0)
            total += w * tl.load(Sum + slot, mask=filled, other=0.0)
            acc += w[:, None] * tl.load(Acc + slot[:, None] * BLOCK_D + offs_d[None, :], mask=filled[:, None],
                                        other=0.0)
            part += 1
        out = acc / tl.where(row_ok, total, 1.0)[:, None]
        tl.store(O + (b * W + rows)[:, None] * o_st + h * o_sh + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_d < D)[None, :])


def tree_verify_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, out: torch.Tensor,
                          k_pool: torch.Tensor, v_pool: torch.Tensor, kv_indptr: torch.Tensor,
                          kv_indices: torch.Tensor, mask: torch.Tensor | None, mask_indptr: torch.Tensor,
                          width: int, sm_scale: float, splits: int, block_m: int | None = None,
                          heads_per_block: int | None = None) -> torch.Tensor:
    """Attention of a verify of `width` tokens per request (q [bs*width, H, D]) over each request's prefix in
    the pool and its own tokens under the tree mask (mask None: causal, a chain), written into out
    [bs*width, H, D]. splits: plan_splits (1: the whole-prefix kernel, >= 2: that many prefix chunks and a merge);
    block_m: verify rows of one head a program (default _block_m); heads_per_block: query heads of one KV group
    a program (default _heads_per_block). Returns out."""
    tokens, heads, dim = q.shape
    bs = tokens // width
    group = heads // k_new.shape[1]
    block_w = block_m or _block_m(width)
    hpb = heads_per_block or _heads_per_block(group, splits, block_w)
    if group % hpb:
        raise ValueError(f"heads_per_block {hpb} does not divide the GQA group {group}")
    m_blocks = -(-width // block_w)
    block_d = _pow2(dim)
    warps = 8 if hpb * block_w >= 128 else 4
    scale_log2 = sm_scale * 1.4426950408889634  # exp2 below: e^x = 2^(x log2 e)
    causal = mask is None
    strides = (q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
               k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1))
    tiling = dict(GROUP=group, CAUSAL=causal, D=dim, BLOCK_D=block_d, HPB=hpb, BLOCK_W=block_w, BLOCK_N=BLOCK_N,
                  num_warps=warps, num_stages=2)
    if splits == 1:
        _verify_whole_kernel[(bs, heads // hpb, m_blocks)](
            q, k_new, v_new, k_pool, v_pool, kv_indptr, kv_indices, mask if not causal else kv_indptr, mask_indptr,
            out, scale_log2, *strides, out.stride(0), out.stride(1), width, **tiling)
        return out
    parts = splits + 1
    rows = bs * heads * parts * m_blocks * block_w
    acc = torch.empty((rows, block_d), dtype=torch.float32, device=q.device)
    run_max = torch.empty(rows, dtype=torch.float32, device=q.device)
    run_sum = torch.empty(rows, dtype=torch.float32, device=q.device)
    _verify_parts_kernel[(bs, heads // hpb, parts * m_blocks)](
        q, k_new, v_new, k_pool, v_pool, kv_indptr, kv_indices, mask if not causal else kv_indptr, mask_indptr,
        acc, run_max, run_sum, scale_log2, *strides, width, splits, m_blocks, H=heads, **tiling)
    _verify_merge_kernel[(bs, heads, -(-width // MERGE_ROWS))](
        acc, run_max, run_sum, out, out.stride(0), out.stride(1), width, parts, m_blocks * block_w, H=heads, D=dim,
        BLOCK_D=block_d, BLOCK_R=MERGE_ROWS, num_warps=4)
    return out


def tree_verify_attention_reference(q, k_new, v_new, k_pool, v_pool, kv_indptr, kv_indices, mask, mask_indptr,
                                    width: int, sm_scale: float) -> torch.Tensor:
    """The same attention in float32 torch, one request at a time (the tests' reference)."""
    tokens, heads, dim = q.shape
    group = heads // k_new.shape[1]
    out = torch.empty((tokens, heads, dim), dtype=torch.float32)
    for b in range(tokens // width):
        lo, hi = int(kv_indptr[b]), int(kv_indptr[b + 1])
        prefix = hi - lo
        locs = kv_indices[lo:hi].long()
        keys = torch.cat([k_pool[locs], k_new[b * width:(b + 1) * width]]).float().repeat_interleave(group, 1)
        values = torch.cat([v_pool[locs], v_new[b * width:(b + 1) * width]]).float().repeat_interleave(group, 1)
        if mask is None:
            tree = torch.ones(width, width, dtype=torch.bool).tril()
        else:
            start = int(mask_indptr[b])
            tree = mask[start:start + width * (prefix + width)].view(width, prefix + width)[:, prefix:].bool()
        seen = torch.cat([torch.ones(width, prefix, dtype=torch.bool), tree], dim=1)
        scores = torch.einsum("thd,khd->htk", q[b * width:(b + 1) * width].float(), keys) * sm_scale
        probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        out[b * width:(b + 1) * width] = torch.einsum("htk,khd->thd", probs, values)
    return out
