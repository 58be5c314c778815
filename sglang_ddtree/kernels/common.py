"""What the Triton kernels share: the import guard, the device check, and the order-preserving float keys and
radix selection that both the tree build and the top-K use."""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: callers fall back to the torch versions
    triton = None
    tl = None


def available(device: torch.device) -> bool:
    return triton is not None and (torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _warps(elements: int) -> int:
    """Warps of a program that sorts or scans `elements` keys (the tree build's one program per request)."""
    return 4 if elements <= 1024 else 8 if elements <= 4096 else 16


if triton is not None:

    @triton.jit
    def _float_key(x):
        bits = x.to(tl.int32, bitcast=True)
        return bits ^ ((bits >> 31) & 0x7FFFFFFF)

    @triton.jit
    def _key_float(k):
        bits = k ^ ((k >> 31) & 0x7FFFFFFF)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _radix_digit(hist, k_left):
        """One step of a radix selection: the digit (bin of the 256) that holds the k_left-th largest counted key,
        and how many of the k_left are still to be found among the keys with that digit."""
        bins = tl.arange(0, 256)
        at_or_above = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # keys with this digit or a larger one
        digit = tl.max(tl.where(at_or_above >= k_left, bins, -1), 0)
        return digit, k_left - tl.sum(tl.where(bins > digit, hist, 0), 0)

    @triton.jit
    def _key_from_prefix(prefix, KEY_BITS: tl.constexpr):
        """The whole unsigned 32-bit key of a value whose float32 bits below the top KEY_BITS are zero (a bfloat16
        value as float32: KEY_BITS = 16; float16: 24 covers its 10 mantissa bits) from those top bits: _float_key
        keeps a non-negative value's low bits (zero) and flips a negative one's (all ones)."""
        LOW: tl.constexpr = 32 - KEY_BITS
        fill = tl.where(prefix >= (1 << (KEY_BITS - 1)), 0, (1 << LOW) - 1).to(tl.int64)
        return (prefix << LOW) | fill

    @triton.jit
    def _radix_select(ukey, live, count, KEY_BITS: tl.constexpr, EARLY: tl.constexpr):
        """The count-th largest of the live keys (int64 holding unsigned 32-bit values) and how many keys equal to
        it belong to the top `count` (histogram passes over 8-bit digits, in registers).
        KEY_BITS: the keys' bits that can differ (32 for float32 values; 16 / 24 for bfloat16 / float16 ones, whose
        low bits follow from the sign: _key_from_prefix): one pass per 8 of them.
        EARLY: stop once the bin holding the count-th largest key lies wholly inside the top `count`; the result is
        then (that bin's smallest key - 1, 0): every key above it is taken, none at it, the same selection. Why:
        after 24 bits a bin of a few thousand float32 scores rarely holds more than the one key, so the 4th pass
        mostly confirmed what the 3rd had found. Measured on an H200 (one run, against the kernels without it): the tree
        kernel's time did not move (B = 256 / 1024 with confident drafts 0.117 -> 0.120 / 0.410 -> 0.409 ms): the
        checks cost what the skipped pass saved. The 2-pass bf16 selections of the top-K (KEY_BITS) gave that run's
        gain (0.080 -> 0.061 ms)."""
        prefix = tl.zeros([], dtype=tl.int64)
        k_left = tl.zeros([], dtype=tl.int32) + count
        whole = tl.zeros([], dtype=tl.int32)  # 1 once a bin was found wholly selected
        early_thresh = tl.zeros([], dtype=tl.int64)
        bins = tl.arange(0, 256)
        for p in tl.static_range(KEY_BITS // 8):
            shift = 24 - 8 * p
            if whole == 0:
                match = live & ((ukey >> (shift + 8)) == prefix)
                hist = tl.histogram(((ukey >> shift) & 255).to(tl.int32), 256, mask=match)
                digit, k_left = _radix_digit(hist, k_left)
                prefix = prefix * 256 + digit.to(tl.int64)
                if EARLY:
                    if p < KEY_BITS // 8 - 1:  # (after the last pass the prefix is the key anyway)
                        if tl.sum(tl.where(bins == digit, hist, 0), 0) == k_left:
                            in_bin = live & ((ukey >> shift) == prefix)
                            early_thresh = tl.min(tl.where(in_bin, ukey, 4294967296), 0) - 1
                            whole = tl.full([], 1, dtype=tl.int32)
        thresh = tl.where(whole != 0, early_thresh, _key_from_prefix(prefix, KEY_BITS))
        k_left = tl.where(whole != 0, 0, k_left)
        return thresh, k_left
