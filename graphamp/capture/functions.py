"""Custom ``torch.autograd.Function``s at capture: one node each, with the user's backward.

``Function.apply`` is implemented in C and is invisible to torch-function modes, so while
build() is traced (and only in the tracing thread) ``torch.autograd.Function.apply`` is
replaced by ``_capturing_apply``: a user's Function becomes one ``graphamp.autograd_function``
node (``ops.FunctionCall``), which step assembly expands by calling the Function again under
autograd. Functions defined inside torch run as usual (custom ops' autograd, for one), except
reentrant activation checkpointing, whose meaning is simply ``function(*args)``: it is traced
inline, with gradients when an input requires grad, and as eager without (no gradient inside,
torch's warning).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch
from torch.utils.checkpoint import CheckpointFunction, check_backward_validity

from ..torchkit.function_calls import _ORIGINAL_APPLY, FunctionCall
from ..torchkit.fxutil import current_user_frame, last_node, nodes_after, tracing_graph
from ..torchkit.ops import AUTOGRAD_FUNCTION
from ..torchkit.process_state import SharedPatch

_active = threading.local()  # .calls: the FunctionCalls of the capture running in this thread


def _capturing_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    calls = getattr(_active, "calls", None)
    if calls is None or (cls.__module__.startswith("torch.") and cls is not CheckpointFunction):
        return _ORIGINAL_APPLY.__get__(None, cls)(*args, **kwargs)
    if cls is CheckpointFunction:  # checkpoint(function, *args, use_reentrant=True)
        function, _preserve_rng_state, *inputs = args
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
            return function(*inputs)
        # eager: the Function's output then does not require grad, so nothing inside gets a
        # gradient, and torch warns (its own check, its own words)
        check_backward_validity(inputs)
        with torch.no_grad():
            return function(*inputs)
    call = FunctionCall(cls, args, kwargs)
    calls.append(call)
    graph = tracing_graph()
    marker = last_node(graph) if graph is not None else None
    outputs = torch.ops.graphamp.autograd_function(call.tensor_args(args, kwargs), call.key)
    if graph is not None and marker is not None:
        for node in nodes_after(graph, marker):
            if node.target is AUTOGRAD_FUNCTION:
                node.meta["autograd_function"] = cls
                node.meta.setdefault("user_frame", current_user_frame())
    return call.rebuild_outputs(list(outputs))


_PATCH = SharedPatch(torch.autograd.Function, "apply", classmethod(_capturing_apply))


@contextlib.contextmanager
def capturing_autograd_functions(calls: list[FunctionCall]) -> Iterator[None]:
    """Within the block, custom Functions applied in this thread are recorded into ``calls``."""
    previous = getattr(_active, "calls", None)
    _active.calls = calls
    try:
        with _PATCH.applied():
            yield
    finally:
        _active.calls = previous
