"""Replay a compiled step as a CUDA graph: the step's state at fixed addresses, the batch copied
into static buffers, nothing synchronising with the host."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any, Callable

import torch

from ..records.spec import StepFn

log = logging.getLogger("graphamp")


class CudaGraphStep:
    """Replays a compiled step as a CUDA graph.

    State tensors (parameters, buffers, optimizer and scaler state) are static: the graph reads
    and writes them at their addresses, so the user's tensors stay the truth. The batch is copied
    into static buffers before each replay and outputs are cloned after it (a later replay
    overwrites the static outputs). If a state tensor moves (``model.to()``, a new optimizer
    state), the graph is captured again.
    """

    def __init__(
        self,
        fn: StepFn,
        n_state: int,
        flat: list[torch.Tensor],
        warmup: int = 2,
        pool: Any = None,
    ):
        self.fn = fn
        self.n_state = n_state
        self.warmup = warmup
        self.pool = pool  # a memory pool shared with other graphs of the same program
        self._capture(flat)

    @torch.no_grad()
    def _capture(self, flat: list[torch.Tensor]) -> None:
        start = time.perf_counter()
        state, inputs = flat[: self.n_state], flat[self.n_state :]
        self.static_inputs = [t.clone() for t in inputs]
        self.addresses = [t.data_ptr() for t in state]
        snapshot = [t.clone() for t in state]  # warm-up runs must not change the user's state
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):
                self.fn(*state, *self.static_inputs)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.pool):
            outputs = self.fn(*state, *self.static_inputs)
        self.static_outputs = list(outputs)
        torch.cuda.synchronize()
        for t, saved in zip(state, snapshot):
            t.copy_(saved)
        log.info("captured the step as a CUDA graph in %.2fs", time.perf_counter() - start)

    def __call__(self, *flat: torch.Tensor) -> list[torch.Tensor]:
        state = flat[: self.n_state]
        if any(t.data_ptr() != a for t, a in zip(state, self.addresses)):
            log.info("a state tensor moved since the CUDA graph was captured: capturing again")
            self._capture(list(flat))
        for static, t in zip(self.static_inputs, flat[self.n_state :]):
            static.copy_(t, non_blocking=True)
        self.graph.replay()
        return [t.clone() for t in self.static_outputs]


class CudaGraphsBySize:
    """Replays a dynamic program (one compiled step for many batch sizes) as one CUDA graph per
    batch shape, captured the first time that shape comes, least recently used dropped beyond
    ``capacity``.

    The graphs share one memory pool: a graph's intermediates live only during its replay and
    its outputs are cloned at once, and replays never overlap, so the pool holds about the
    largest graph's intermediates rather than the sum (plus each graph's static batch buffers).
    ``capture`` makes one graph (``CudaGraphStep``; tests count captures with a stand-in)."""

    def __init__(
        self,
        fn: StepFn,
        n_state: int,
        flat: list[torch.Tensor],
        capacity: int,
        capture: Callable[..., Any] | None = None,
    ) -> None:
        self.fn = fn
        self.n_state = n_state
        self.capacity = capacity
        self.graphs: OrderedDict[tuple, Any] = OrderedDict()
        self.captures = 0
        self._pool = torch.cuda.graph_pool_handle() if capture is None else None
        self._capture = capture or (lambda fn, n, flat: CudaGraphStep(fn, n, flat, pool=self._pool))
        self(*flat, replay=False)

    def __call__(self, *flat: torch.Tensor, replay: bool = True) -> list[torch.Tensor]:
        key = tuple((t.shape, t.stride()) for t in flat[self.n_state :])
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._capture(self.fn, self.n_state, list(flat))
            self.captures += 1
            self.graphs[key] = graph
            while len(self.graphs) > self.capacity:
                self.graphs.popitem(last=False)
        else:
            self.graphs.move_to_end(key)
        return graph(*flat) if replay else []
