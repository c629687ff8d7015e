"""An aten FX graph handed to a torch.compile backend directly, as torch.compile's backends
see Dynamo's graphs, without Dynamo: the whole step (``backend/compile.py``) and the blocks'
update kernels (``step/block_update.py``) are compiled this way.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._dynamo, torch._guards, torch._inductor, torch._subclasses
import os
from contextlib import nullcontext
from typing import Callable
from unittest import mock

import torch
import torch.fx as fx
from torch._guards import TracingContext, detect_fake_mode, tracing
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from .update_region import GatherUpdate


def call_backend(
    gm: fx.GraphModule,
    example: list,
    backend: str,
    options: dict | None = None,
    cached: bool = False,
) -> Callable[..., object]:
    """A callable ``fn(*flat) -> outputs`` running ``gm`` compiled with ``backend`` (``options``:
    inductor's config for this call).

    ``cached``: the graph came from graphamp's step cache, so inductor's caches are expected to
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
    no_pool = cached and backend == "inductor"
    config = _inductor_config(options) if backend == "inductor" else nullcontext()
    with config, tracing(TracingContext(fake_mode)), _pool_warm_up(not no_pool):
        return compiler(gm, fakes)


def _pool_warm_up(wanted: bool):
    """``TORCH_WARM_POOL=0`` for one backend call (inductor reads it at every call)."""
    return nullcontext() if wanted else mock.patch.dict(os.environ, {"TORCH_WARM_POOL": "0"})


def _inductor_config(options: dict | None):
    """Inductor's config for one call: graphamp's pass gathering the optimizer update
    (``update_region.py``) unless ``options`` name their own post-grad pass, and ``options``."""
    import torch._inductor.config as inductor_config

    return inductor_config.patch({"post_grad_custom_post_pass": GatherUpdate(), **(options or {})})


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
