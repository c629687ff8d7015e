"""Replay a compiled step as a CUDA graph: the step's state at fixed addresses, the batch copied
into static buffers, nothing synchronising with the host."""

from __future__ import annotations

import logging
import time

import torch

from .compile import StepFn

log = logging.getLogger("graphamp")


class CudaGraphStep:
    """Replays a compiled step as a CUDA graph.

    State tensors (parameters, buffers, optimizer and scaler state) are static: the graph reads
    and writes them at their addresses, so the user's tensors stay the truth. The batch is copied
    into static buffers before each replay and outputs are cloned after it (a later replay
    overwrites the static outputs). If a state tensor moves (``model.to()``, a new optimizer
    state), the graph is captured again.
    """

    def __init__(self, fn: StepFn, n_state: int, flat: list[torch.Tensor], warmup: int = 2):
        self.fn = fn
        self.n_state = n_state
        self.warmup = warmup
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
        with torch.cuda.graph(self.graph):
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
