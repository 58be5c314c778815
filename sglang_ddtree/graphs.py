"""Replaying fixed-shape stages of a round as CUDA graphs, so the host launches one graph instead of dozens of kernels.

Why: at batch 1 with a small target the DDTREE round is host-bound (lease 5, tiny pair: the worker's host time per
round 5.1 ms against 1.0 ms of GPU work; 113-131 eager kernel launches a round against DFLASH's 26,
benchmarks/results/profile_rounds_h200_lease5.json). The stages between SGLang's own graph replays (draft top-K,
tree build, verify inputs, walk, commit plan) have shapes fixed by the batch size, so they can be captured once per
batch size and replayed. Measured after (lease 6, tiny pair, batch 1, one sweep after the other): 3.6 ms per round
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
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)


def _signature(inputs: tuple[torch.Tensor, ...]) -> tuple:
    return tuple((tuple(x.shape), x.dtype, x.device) for x in inputs)


class GraphedStage:
    def __init__(self, fn: Callable, *, name: str, enabled: bool = True, max_graphs: int = 64,
                 borrow: tuple[int, ...] = ()):
        self.fn = fn
        self.borrow = frozenset(borrow)
        self.name = name
        self.enabled = enabled
        self.max_graphs = max_graphs
        self._graphs: dict[tuple, tuple[list[torch.Tensor], torch.cuda.CUDAGraph, Any]] = {}
        self._pool = None
        self.captures = 0
        self.replays = 0

    def __call__(self, *inputs: torch.Tensor):
        if not self.enabled or not inputs or not inputs[0].is_cuda:
            return self.fn(*inputs)
        key = _signature(inputs)
        entry = self._graphs.get(key)
        if entry is None:
            if len(self._graphs) >= self.max_graphs:  # unbounded signatures would mean unbounded memory
                return self.fn(*inputs)
            entry = self._capture(inputs)
            self._graphs[key] = entry
        static_inputs, graph, outputs = entry
        for static, x in zip(static_inputs, inputs):
            if x.data_ptr() != static.data_ptr() or x.stride() != static.stride():
                static.copy_(x)
        graph.replay()
        self.replays += 1
        return outputs

    def _capture(self, inputs):
        # kept alive here: the graph reads these addresses
        static_inputs = [x.detach() if i in self.borrow else x.detach().clone() for i, x in enumerate(inputs)]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(side):
            self.fn(*static_inputs)  # warm-up: compiles and lazily cached tensors happen outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls (none expected in SGLang's scheduler) cannot break the capture
        with torch.no_grad(), torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            outputs = self.fn(*static_inputs)
        self._pool = graph.pool()
        self.captures += 1
        logger.info("DDTREE: captured the %s stage for inputs %s", self.name,
                    [tuple(x.shape) for x in inputs])
        return static_inputs, graph, outputs
