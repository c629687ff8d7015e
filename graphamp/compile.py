"""Compile: hand the assembled step to a torch.compile backend, and replay it as a CUDA graph.

graphamp already holds the whole step as one functional, guard-free aten graph, so it calls the
backend (inductor, aot_eager, eager) on it directly rather than re-tracing it with Dynamo: the
same compiler, no bytecode tracing at the first call and no guard checks at every call. The
cache of compiled steps per input signature is graphamp's own (see Graph).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import torch
import torch.fx as fx

log = logging.getLogger("graphamp")

StepFn = Callable[..., Sequence[torch.Tensor]]


def compile_step(gm: fx.GraphModule, example: list[torch.Tensor], backend: str,
                 inductor_options: dict | None = None) -> StepFn:
    """A callable ``fn(*flat) -> outputs`` running ``gm`` compiled with ``backend``."""
    if backend == "eager":
        return gm
    import torch._dynamo  # noqa: F401 - registers the backends

    compiler = torch._dynamo.lookup_backend(backend)
    if backend != "inductor":
        return compiler(gm, example)
    import torch._inductor.config as inductor_config

    options = {**default_inductor_options(gm, example), **(inductor_options or {})}
    with inductor_config.patch(options):
        return compiler(gm, example)


def default_inductor_options(gm: fx.GraphModule, example: list[torch.Tensor]) -> dict:
    """Inductor settings for a whole training step (forward, backward and optimizer in one graph).

    Channels-last layout for convolutions on CUDA: inductor decides it with heuristics tuned for
    separate forward and backward graphs, one of which gives up when a graph has more than 300
    nodes per convolution, which a whole step passes. Measured on an H100 with torch 2.11
    (benchmarks/results/README.md): this option alone left ResNet-50 at 40.1 ms/step, cuDNN still
    transposing NCHW<->NHWC around every convolution; together with channels-last copies of the
    convolution weights (Graph._shadow) the step took 23.2 ms. Whether this option is still
    needed beside those copies was not measured separately. Grouped convolutions, where
    channels-last can be slower, keep inductor's own decision.
    """
    options = {}
    on_cuda = any(t.is_cuda for t in example if isinstance(t, torch.Tensor))
    convs = [n for n in gm.graph.nodes if n.target is torch.ops.aten.convolution.default]
    if on_cuda and convs and all(n.args[-1] == 1 for n in convs):
        options["force_layout_optimization"] = True
    return options


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
