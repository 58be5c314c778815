"""Replaying fixed-shape stages of a round as CUDA graphs, so the host launches one graph instead of dozens of kernels.

Why: at batch 1 with a small target the DDTREE round is host-bound (tiny pair on an H200: the worker's host time per
round 5.1 ms against 1.0 ms of GPU work; 113-131 eager kernel launches a round against DFLASH's 26). The stages between SGLang's own graph replays (draft top-K,
tree build, verify inputs, walk, commit plan) have shapes fixed by the batch size, so they can be captured once per
batch size and replayed. Measured after (tiny pair, batch 1, one sweep after the other): 3.6 ms per round
with the graphs at B=32 and 128 against 5.0 and 5.7 ms without.

`GraphedStage(fn)` calls fn(*inputs) -> outputs (tensors, or any object holding them). On CUDA, for each new
signature of the inputs (shapes, dtypes) it clones the inputs into static buffers, runs fn once to warm up (Triton
compiles, lazily cached tensors get allocated), captures fn into a graph, and from then on copies the inputs in and
replays. Every graph of a GraphedStage shares one memory pool. On CPU, or when disabled, fn runs eagerly.

- `borrow` names inputs that are another stage's graph outputs (memory this process owns, at a fixed address):
  their static buffer is the tensor itself, and the copy is skipped whenever the caller passes that same tensor,
  as chained stages do. Never borrow memory someone else may reuse: a copy into it would overwrite their data.
- The outputs live in the graph's memory and are OVERWRITTEN by the next replay of the same signature: a caller
  that keeps an output beyond that must clone it.
- fn must not write its inputs, must not read tensor values on the host (no .item(), no data-dependent shapes) and
  must not keep Python state that changes between calls; its non-tensor arguments are bound at construction
  (functools.partial) and must not change.
- With `bucket_of` (and `unpad`), a call with rows=n runs the graph of batch size bucket_of(n) (None: eagerly,
  unpadded): the requests past n are padding (copies of the last real one at capture, stale real data afterwards), and the call returns
  unpad(outputs, n), views of the first n requests. With `rows_arg`, fn also gets n as a trailing 0-dim tensor, so
  that its sums over the batch select the real requests.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)


def _padded_shape(x: torch.Tensor, rows: int, bucket: int) -> tuple:
    """x's shape with its requests padded from `rows` to `bucket` (dim 0 holds rows x per-request entries)."""
    if x.shape[0] % rows:
        raise ValueError(f"GraphedStage padding: dim 0 of {tuple(x.shape)} is not a multiple of {rows} requests.")
    return (x.shape[0] // rows * bucket, *x.shape[1:])


def pad_rows(x: torch.Tensor, rows: int, bucket: int) -> torch.Tensor:
    """A new tensor of `bucket` requests: x's `rows` requests, then copies of its last one (real data, so a padding
    request never feeds a kernel values it would not meet in a real round)."""
    per = x.shape[0] // rows
    out = x.new_empty(_padded_shape(x, rows, bucket))
    out[: per * rows] = x
    if bucket > rows:
        out.view(bucket, per, *x.shape[1:])[rows:] = x.reshape(rows, per, *x.shape[1:])[-1:]
    return out


class GraphedStage:
    # Captures by every stage of the process: the SGLang worker reads it twice a round to tell a round that did
    # one-time work (summing the `auto` worker's 26 stages' counters cost ~5 us a round).
    total_captures = 0

    def __init__(self, fn: Callable, *, name: str, enabled: bool = True, max_graphs: int = 64,
                 borrow: tuple[int, ...] = (), bucket_of: Callable[[int], int] | None = None,
                 unpad: Callable[[Any, int], Any] | None = None, rows_arg: bool = False):
        """bucket_of: requests -> the batch size the stage runs at (>= requests; SGLang's CUDA-graph sizes), so one
        graph serves every batch size up to its bucket instead of one capture per size (480 stage captures
        in one `auto` server of the tiny sweep, one per batch size met as requests finished); needs `unpad`
        (outputs, requests) -> the first `requests` requests' outputs, and a call with rows=requests. bucket_of
        answers None past the largest bucket: the stage then runs eagerly, unpadded (there the verify runs
        eagerly too, and a capture per batch size met was a stall each: at 8B shapes an `auto` server at batch 64,
        verify graphs up to 16, captured 22-44 stage graphs in every measured run).
        rows_arg: fn takes a trailing 0-dim int64 tensor, the number of real requests, so that its sums over the
        batch leave padding requests out."""
        if bucket_of is not None and unpad is None:
            raise ValueError("GraphedStage: bucket_of needs unpad.")
        self.fn = fn
        self.borrow = frozenset(borrow)
        self.name = name
        self.enabled = enabled
        self.max_graphs = max_graphs
        self.bucket_of = bucket_of
        self.unpad = unpad
        self.rows_arg = rows_arg
        self.pad_eagerly = False  # tests: pad and unpad without graphs too (the CPU runs the same arithmetic)
        self._graphs: dict[tuple, tuple[list[torch.Tensor], torch.cuda.CUDAGraph, Any, torch.Tensor | None]] = {}
        self._pool = None
        self._rows_filled: dict[tuple, int] = {}  # per graph, the real-request count its rows tensor holds
        self.captures = 0
        self.replays = 0

    def __call__(self, *inputs: torch.Tensor, rows: int | None = None):
        if self.rows_arg and rows is None:
            raise ValueError(f"GraphedStage {self.name}: this stage needs rows= (the number of real requests).")
        graphed = self.enabled and bool(inputs) and inputs[0].is_cuda
        pad = self.bucket_of is not None and rows is not None and (graphed or self.pad_eagerly)
        bucket = self.bucket_of(rows) if pad else rows
        if pad and bucket is None:  # past the largest bucket: eager and unpadded (see __init__)
            graphed = pad = False
        bucket = max(bucket, rows) if pad else rows
        if not graphed:
            if pad and bucket != rows:
                padded = [pad_rows(x, rows, bucket) for x in inputs]
                return self.unpad(self.fn(*padded, *self._rows(rows, padded[0].device)), rows)
            return self.fn(*inputs, *self._rows(rows, inputs[0].device if inputs else None))
        shapes = [_padded_shape(x, rows, bucket) if pad else tuple(x.shape) for x in inputs]
        key = tuple((shape, x.dtype, x.device) for shape, x in zip(shapes, inputs))
        entry = self._graphs.get(key)
        if entry is None:
            if len(self._graphs) >= self.max_graphs:  # unbounded signatures would mean unbounded memory
                return self.fn(*inputs, *self._rows(rows, inputs[0].device))
            entry = self._capture(inputs, shapes, rows, bucket if pad else None)
            self._graphs[key] = entry
            self._rows_filled[key] = rows  # _capture made the rows tensor with this count
        static_inputs, graph, outputs, rows_t = entry
        for static, x in zip(static_inputs, inputs):
            if x.data_ptr() != static.data_ptr() or x.stride() != static.stride():
                static[: x.shape[0]].copy_(x)
        if rows_t is not None and self._rows_filled.get(key) != rows:
            # an eager kernel launch: only when the count changes (every round at a steady batch size cost ~5 us of
            # host time per stage, three stages a round)
            rows_t.fill_(rows)
            self._rows_filled[key] = rows
        graph.replay()
        self.replays += 1
        return self.unpad(outputs, rows) if pad else outputs

    def _rows(self, rows, device) -> tuple:
        return (torch.tensor(rows, dtype=torch.int64, device=device),) if self.rows_arg else ()

    def _static_input(self, i: int, x: torch.Tensor, shape: tuple, rows: int, bucket: int | None) -> torch.Tensor:
        """The graph's buffer for input i. A borrowed input is another stage's output (rows of its padded buffer
        when both pad): the buffer is that memory itself, all `shape` of it; anything else is a private copy."""
        if i in self.borrow:
            if bucket is None:
                return x.detach()
            # x is the first requests of its producer's padded output (a view from the producer's unpad) when that
            # output starts where x does and holds all `shape`; else (an unpadded producer) a private copy
            base = x._base if x._base is not None else x
            numel = math.prod(shape)
            if x.is_contiguous() and base.data_ptr() == x.data_ptr() and base.numel() == numel:
                return base.detach().view(shape)
        if bucket is None:
            return x.detach().clone()
        return pad_rows(x.detach(), rows, bucket)

    def _capture(self, inputs, shapes, rows, bucket):
        # kept alive here: the graph reads these addresses
        static_inputs = [self._static_input(i, x, shape, rows, bucket)
                         for i, (x, shape) in enumerate(zip(inputs, shapes))]
        rows_t = torch.full((), rows, dtype=torch.int64, device=inputs[0].device) if self.rows_arg else None
        extra = (rows_t,) if rows_t is not None else ()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(side):
            self.fn(*static_inputs, *extra)  # warm-up: compiles and lazily cached tensors happen outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls (none expected in SGLang's scheduler) cannot break the capture
        with torch.no_grad(), torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            outputs = self.fn(*static_inputs, *extra)
        self._pool = graph.pool()
        self.captures += 1
        GraphedStage.total_captures += 1
        logger.info("DDTREE: captured the %s stage for inputs %s", self.name, [tuple(s) for s in shapes])
        return static_inputs, graph, outputs, rows_t
