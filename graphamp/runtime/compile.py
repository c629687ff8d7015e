"""Stage 5, compile: hand the assembled step to a torch.compile backend.

graphamp already holds the whole step as one functional, guard-free aten graph, so it calls the
backend (inductor, aot_eager, eager) on it directly rather than re-tracing it with Dynamo: the
same compiler, no bytecode tracing at the first call and no guard checks at every call. The
cache of compiled steps per input signature is graphamp's own (see Graph); replaying the
compiled step as a CUDA graph is ``cudagraph.py``.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Sequence

import torch
import torch.fx as fx
from torch._guards import TracingContext, detect_fake_mode, tracing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv, free_unbacked_symbols

StepFn = Callable[..., Sequence[torch.Tensor]]


def compile_step(
    gm: fx.GraphModule,
    example: list[torch.Tensor],
    backend: str,
    inductor_options: dict | None = None,
) -> StepFn:
    """A callable ``fn(*flat) -> outputs`` running ``gm`` compiled with ``backend``."""
    if backend == "eager":
        return gm
    import torch._dynamo  # noqa: F401 - registers the backends

    compiler = torch._dynamo.lookup_backend(backend)
    # The backend re-traces the graph on fake tensors. Where sizes depend on values (boolean
    # masks, nonzero), it does so in the fake mode (and ShapeEnv) the step was traced in, so
    # they stay the symbols assembly made.
    context = TracingContext(_fake_mode_of(gm)) if _has_unbacked_sizes(gm) else nullcontext()
    if backend != "inductor":
        with _tracing(context):
            return compiler(gm, example)
    import torch._inductor.config as inductor_config

    options = {**default_inductor_options(gm, example), **(inductor_options or {})}
    with inductor_config.patch(options), _tracing(context):
        return compiler(gm, example)


def _tracing(context):
    return tracing(context) if isinstance(context, TracingContext) else context


def _has_unbacked_sizes(gm: fx.GraphModule) -> bool:
    return any(
        free_unbacked_symbols(n.meta.get("val"))
        for n in gm.graph.nodes
        if isinstance(n.meta.get("val"), torch.Tensor)
    )


def _fake_mode_of(gm: fx.GraphModule) -> FakeTensorMode:
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    return detect_fake_mode(vals) or FakeTensorMode(shape_env=ShapeEnv())


def default_inductor_options(gm: fx.GraphModule, example: list[torch.Tensor]) -> dict:
    """Inductor settings for a whole training step (forward, backward and optimizer in one graph).

    Channels-last layout for convolutions on CUDA: inductor decides it with heuristics tuned for
    separate forward and backward graphs, one of which gives up when a graph has more than 300
    nodes per convolution, which a whole step passes. Measured on an H100 with torch 2.11
    (benchmarks/results/README.md): this option alone left ResNet-50 at 40.1 ms/step, cuDNN still
    transposing NCHW<->NHWC around every convolution; together with channels-last copies of the
    convolution weights (then persistent; now step/gradients.parameter_casts) the step took
    23.2 ms. Whether this option is still
    needed beside those copies was not measured separately. Grouped convolutions, where
    channels-last can be slower, keep inductor's own decision.
    """
    options = {}
    on_cuda = any(t.is_cuda for t in example if isinstance(t, torch.Tensor))
    convs = [n for n in gm.graph.nodes if n.target is torch.ops.aten.convolution.default]
    if on_cuda and convs and all(n.args[-1] == 1 for n in convs):
        options["force_layout_optimization"] = True
    return options
