"""Stage 5, compile: hand the assembled step to a torch.compile backend.

graphamp already holds the whole step as one functional, guard-free aten graph, so it calls the
backend (inductor, aot_eager, eager) on it directly rather than re-tracing it with Dynamo: the
same compiler, no bytecode tracing at the first call and no guard checks at every call. The
cache of compiled steps per input signature is graphamp's own (see Graph); across processes,
inductor's FX-graph cache and AOTAutograd's cache (``TORCHINDUCTOR_CACHE_DIR``) serve a restart,
as they do for torch.compile. Replaying the compiled step as a CUDA graph is ``cudagraph.py``.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.fx as fx

from ..records.spec import StepFn
from ..torchkit.backends import call_backend
from ..torchkit.fxutil import graph_modules


def compile_step(
    gm: fx.GraphModule,
    example: list[torch.Tensor],
    backend: str,
    inductor_options: dict | None = None,
    cached: bool = False,
) -> StepFn:
    """A callable ``fn(*flat) -> outputs`` running the step ``gm`` compiled with ``backend``
    (``torchkit.backends.call_backend``; ``cached``: the step came from graphamp's step cache),
    with inductor's settings for a whole step and the user's ``inductor_options``."""
    if backend == "eager":  # the step runs as traced: nothing to lay out again
        return gm
    views_as_reshapes(gm)  # the pipeline did it before saving: this is for other callers
    options = {}
    if backend == "inductor":
        options = {**default_inductor_options(gm, example), **(inductor_options or {})}
    return cast(StepFn, call_backend(gm, example, backend, options, cached))


def views_as_reshapes(gm: fx.GraphModule) -> None:
    """Every ``view`` of the step becomes a ``reshape``, in place, for any backend but eager
    (the pipeline does it before the step cache saves the step, so a loaded step needs no
    change: its graph modules' code is generated once, on load).

    The backend traces the step again with its own decompositions, which can lay an
    intermediate out differently from assembly's trace, and a ``view`` recorded for one layout
    fails on the other. Seen with inductor on GPT-2's attention: with symbolic sizes (strides
    (64*s, 32, 1, 64) where assembly had (64*s, 32*s, 1, 32)), and with static ones on
    transformers' GPT-2 given an attention mask under bf16 AMP ("Cannot view a tensor with
    shape [8, 4, 32, 8] and strides (1024, 32, 1, 128) as (32, 32, 8)"). ``reshape`` is that same view
    wherever a view is possible, and a copy where not; the graph holds no in-place write to a
    view (it is functional until its final copies into the state), so values are unchanged.
    Outlined blocks' subgraphs too: the backend traces them again as well (transformers'
    GPT-2 with an attention mask failed there, with the same message)."""
    for module in graph_modules(gm):
        views = module.graph.find_nodes(op="call_function", target=torch.ops.aten.view.default)
        for node in views:
            node.target = torch.ops.aten.reshape.default
        if views:
            module.recompile()


def default_inductor_options(gm: fx.GraphModule, example: list[torch.Tensor]) -> dict:
    """Inductor settings for a whole training step (forward, backward and optimizer in one graph).

    Inductor's layout optimization (convolutions and what surrounds them in channels-last)
    decides with heuristics tuned for separate forward and backward graphs, and a whole step
    fools both of its rules:

    - On CUDA one gives up when a graph has more than 300 nodes per convolution, which a whole
      step passes. Measured on an H100 with torch 2.11 (benchmarks/results/README.md): forcing
      it left ResNet-50 at 40.1 ms/step, cuDNN still transposing NCHW<->NHWC around every
      convolution; together with channels-last copies of the convolution weights (then
      persistent; now step/gradients.parameter_casts) the step took 23.2 ms. Whether this
      option is still needed beside those copies was not measured separately. Grouped
      convolutions, where channels-last can be slower, keep inductor's own decision.
    - On the CPU it lays out every graph with a convolution channels-last (a rule for
      inference). torch.compile's backward graph holds no ``convolution`` and keeps the
      traced layout; a whole step holds both, so its backward went channels-last too: batch
      norm's reductions, the copies in and out and oneDNN's convolution backward were slower
      there on every convolution network measured (``benchmarks/conv_layout.py``, one thread,
      bf16: the step 1.07-1.63x slower on ResNet-18 as the images get smaller, 1.09x on
      ResNet-50, 1.02x on MobileNetV3-Small; fp32 ResNet-18 1.71x). A step holding a
      convolution's backward keeps the layout it was traced in: the model's and the batch's
      own, so a user who made them channels-last still gets channels-last.
    """
    options: dict = {}
    devices = {t.device.type for t in example if isinstance(t, torch.Tensor)}
    convs = [n for n in gm.graph.nodes if n.target is torch.ops.aten.convolution.default]
    if "cuda" in devices and convs and all(n.args[-1] == 1 for n in convs):
        options["force_layout_optimization"] = True
    elif devices == {"cpu"} and _holds(gm, torch.ops.aten.convolution_backward.default):
        options["layout_optimization"] = False
    return options


def _holds(gm: fx.GraphModule, target) -> bool:
    """Whether ``target`` is called in ``gm`` or in a graph module it holds (outlined blocks)."""
    return any(m.graph.find_nodes(op="call_function", target=target) for m in graph_modules(gm))
