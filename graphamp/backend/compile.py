"""Stage 5, compile: hand the assembled step to a torch.compile backend.

graphamp already holds the whole step as one functional, guard-free aten graph, so it calls the
backend (inductor, aot_eager, eager) on it directly rather than re-tracing it with Dynamo: the
same compiler, no bytecode tracing at the first call and no guard checks at every call. The
cache of compiled steps per input signature is graphamp's own (see Graph); across processes,
inductor's FX-graph cache and AOTAutograd's cache (``TORCHINDUCTOR_CACHE_DIR``) serve a restart,
as they do for torch.compile. Replaying the compiled step as a CUDA graph is ``cudagraph.py``.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from unittest import mock

import torch
import torch.fx as fx
from torch._guards import TracingContext, detect_fake_mode, tracing
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ..records.spec import StepFn


def compile_step(
    gm: fx.GraphModule,
    example: list[torch.Tensor],
    backend: str,
    inductor_options: dict | None = None,
    cached: bool = False,
) -> StepFn:
    """A callable ``fn(*flat) -> outputs`` running ``gm`` compiled with ``backend``.

    ``cached``: the step came from graphamp's step cache, so inductor's caches are expected to
    hold its code, and inductor's pool of compile processes is not started for it. torch's
    inductor backend starts that pool at every call, as early as it can, for the kernels it
    may compile; on a restart it compiles nothing, and the pool's start (processes importing
    torch) took the cores from the first seconds of training: the seed MLP's steady step ran
    3x slower (4.4-5.0 ms against 1.6 ms) on two CPU cores until the pool was up. A miss in
    inductor's caches still compiles, the pool starting when it is needed."""
    if backend == "eager":
        return gm
    import torch._dynamo  # registers the backends

    compiler = torch._dynamo.lookup_backend(backend)
    # The backend sees the step as torch.compile's backends see Dynamo's graphs: inside a
    # TracingContext whose fake mode has a ShapeEnv (inductor's FX-graph cache and
    # AOTAutograd's cache bypass themselves without one: "No shape env"), with fake example
    # inputs of that mode. Those are the step's own placeholder values: the sizes assembly
    # traced, static or symbolic (unbacked sizes of boolean masks keep their symbols). Real
    # tensors would be fakified again by AOTAutograd, with a fresh symbol for every dimension
    # once a ShapeEnv is present; a graph that does not bind those symbols breaks
    # AOTAutograd's tensorify_python_scalars (KeyError on the symbol).
    fake_mode = _fake_mode_of(gm)
    fakes = _example_fakes(gm, example, fake_mode)
    _views_as_reshapes(gm)
    options = {}
    if backend == "inductor":
        options = {**default_inductor_options(gm, example), **(inductor_options or {})}
    no_pool = cached and backend == "inductor"
    with _inductor_config(options), tracing(TracingContext(fake_mode)), _pool_warm_up(not no_pool):
        return compiler(gm, fakes)


def _pool_warm_up(wanted: bool):
    """``TORCH_WARM_POOL=0`` for one backend call (inductor reads it at every call)."""
    return nullcontext() if wanted else mock.patch.dict(os.environ, {"TORCH_WARM_POOL": "0"})


def _views_as_reshapes(gm: fx.GraphModule) -> None:
    """Every ``view`` of the step becomes a ``reshape``, in place.

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
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.target is torch.ops.aten.view.default:
                node.target = torch.ops.aten.reshape.default
        module.recompile()


def _inductor_config(options: dict):
    if not options:
        return nullcontext()
    import torch._inductor.config as inductor_config

    return inductor_config.patch(options)


def _fake_mode_of(gm: fx.GraphModule) -> FakeTensorMode:
    """The fake mode (and ShapeEnv) the step was traced in."""
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    mode = detect_fake_mode(vals)
    if mode is None or mode.shape_env is None:
        return FakeTensorMode(shape_env=ShapeEnv())
    return mode


def _example_fakes(
    gm: fx.GraphModule, example: list[torch.Tensor], mode: FakeTensorMode
) -> list[torch.Tensor]:
    """The step's inputs as fakes of ``mode``: each placeholder's traced value where it has
    one of that mode, else a static-sized fake of the real example."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out: list[torch.Tensor] = []
    for node, real in zip(placeholders, example, strict=True):
        val = node.meta.get("val")
        if isinstance(val, FakeTensor) and val.fake_mode is mode:
            out.append(val)
        elif isinstance(real, torch.Tensor):
            out.append(mode.from_tensor(real, static_shapes=True))
        else:
            out.append(real)
    return out


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
