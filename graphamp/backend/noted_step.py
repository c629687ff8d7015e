"""A restart's step compiled from the note alone: its graph is not unpickled.

On a restart the step cache holds the step's graph, and ``aot_key.py``'s note holds AOTAutograd's
key of it with the compile's context. AOTAutograd looks a key up and, on a hit, builds the
compiled program from its cache entry alone; the graph it was given is not read again. So a
restart whose note matches needs only the step's inputs: inductor is handed a *stand-in*, a
graph of the step's inputs (the note's names, the example's fakes) that returns nothing, and
AOTAutograd's key of the stand-in is the note's (``aot_key.noted_key``), where the context
computed in this compile is the note's. The step's graph is unpickled when something reads it
(``records/deferred.py``). On a 12-layer GPT-2 step (CPU) the step cache's stage of a restart
went from 0.76-0.89 s (GraphPickler's rebuild of the graph, its values and code) to 0.09-0.12 s
(round 7 of ``benchmarks/results/first_call_cpu.md``).

The stand-in must never be compiled as if it were the step. Two things stop that, each with
``aot_key.NotNoted`` (a BaseException, so no ``except Exception`` of torch's turns it into a
compile of the stand-in):
- another context (a setting, the thread count, torch) raises it where the key is computed;
- a miss in inductor's caches (cleared, evicted, damaged, AOTAutograd's cache turned off) makes
  AOTAutograd trace the stand-in, and its one op raises it: nothing is compiled or saved.
Either way the caller loads the step and compiles it as before (``stages.compile``).
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._subclasses
import logging
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ..records.spec import StepFn
from ..torchkit.backends import call_backend
from . import aot_key

log = logging.getLogger("graphamp")


def usable(note: dict | None) -> bool:
    """Whether ``note`` holds what a compile from it needs (notes of typed inputs do not):
    the step's input names and size, inductor's settings derived from its graph, and the
    ``spec`` of each distinct update kernel its blocks call (``step/block_update.py``)."""
    return (
        note is not None
        and isinstance(note.get("inputs"), list)
        and all(isinstance(name, str) for name in note["inputs"])
        and isinstance(note.get("nodes"), int)
        and isinstance(note.get("defaults"), dict)
        and isinstance(note.get("block_specs"), list)
        and all(isinstance(spec, str) for spec in note["block_specs"])
    )


def compile_noted(
    graph_name: str,
    note: dict,
    example: list,
    fake_mode: FakeTensorMode,
    user_options: dict,
) -> StepFn | None:
    """The step ``note`` was written for, compiled by inductor from its caches without its
    graph; None where the note does not hold this compile's context or the caches miss (then
    nothing was compiled)."""
    names: list[str] = note["inputs"]
    if len(names) != len(example):
        return None
    fakes = [_fake(t, fake_mode) for t in example]
    stand_in = _stand_in(names, fakes)
    options = {**note["defaults"], **user_options}
    with aot_key.noted_key(stand_in, note, graph_name) as memo:
        try:
            compiled = call_backend(stand_in, fakes, "inductor", options, cached=True)
        except aot_key.NotNoted as e:
            log.debug("%s: the step is compiled from its graph: %s", graph_name, e)
            return None
        except Exception as e:  # a damaged cache file, say: the step's own compile handles it
            log.debug("%s: compiling from the note failed (%s: %s)", graph_name, type(e), e)
            return None
    if not memo.remembered:  # cannot complete without the note's key; checked all the same
        return None
    return compiled  # type: ignore[return-value]


def compile_kernel(
    graph_name: str,
    key: str,
    trace: Callable[[], fx.GraphModule],
    example: list,
    cached: bool,
) -> StepFn:
    """A block's update kernel (``step/block_update.py``) compiled as the step is: its first
    compile notes AOTAutograd's key of it under ``key``; a restart (``cached``) compiles it from
    the note without tracing the kernel's math again (``trace()``: 0.2 s for a GPT-2 block's
    AdamW on the CPU, most of a restart's kernel). Inductor's defaults, no options of graphamp's:
    as the kernel was compiled before notes."""
    if cached:
        note = aot_key.read_note(graph_name, key)
        if usable(note):
            mode = FakeTensorMode(shape_env=ShapeEnv())
            compiled = compile_noted(graph_name, note, example, mode, {})  # type: ignore[arg-type]
            if compiled is not None:
                return compiled
    gm = trace()
    kept: dict[str, Any] = {"block_specs": [], "defaults": {}}  # inductor's defaults
    with aot_key.remembered_key(gm, key, graph_name, kept):
        return call_backend(gm, example, "inductor", cached=cached)  # type: ignore[return-value]


def _fake(t: Any, mode: FakeTensorMode) -> Any:
    """An input as the step's placeholders hold it: a fake of the build's mode, static sizes,
    no autograd (the step computes its gradients itself)."""
    if isinstance(t, FakeTensor) and t.fake_mode is mode:
        return t
    if isinstance(t, torch.Tensor):
        return mode.from_tensor(t.detach(), static_shapes=True)
    return t


def _stand_in(names: list[str], fakes: list) -> fx.GraphModule:
    """The step's inputs, and one op that stops a compile that reached tracing."""
    graph = fx.Graph()
    for name, fake in zip(names, fakes, strict=True):
        node = graph.placeholder(name)
        node.meta["val"] = fake
    stop = graph.call_function(_not_in_caches, ())
    graph.output((stop,))
    return fx.GraphModule(torch.nn.Module(), graph)


def _not_in_caches() -> None:
    raise aot_key.NotNoted("inductor's caches do not hold the step")
