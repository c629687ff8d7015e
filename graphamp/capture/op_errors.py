"""An op that fake tensors cannot run, named as such (not as a host read of the user's).

Capture runs build() on fake tensors: shapes, dtypes and devices, no values. torch raises
``DynamicOutputShapeException`` for an op whose output *shape* it can only know from values
(``aten._ctc_loss``'s forward variables, sized by the longest target),
``UnsupportedOperatorException`` for an op with no fake (meta) kernel at all, and a guard on a
data-dependent size when an op's implementation needs one (``F.one_hot`` without
``num_classes`` reads the largest label). None of these is the user reading a value in Python,
so none gets the host-read message and its ``torch.where`` fix: the error names the op the
user called and what graphamp needs, a shape rule that follows from the inputs' shapes.
Results that *are* values on the host (``torch.equal`` returns a Python bool) and Python
control flow on data-dependent sizes (iterating over ``nonzero()``) remain host reads.

``CaptureMode`` marks the exception with the torch function the user's code called when it
was raised inside one (``mark_torch_function``), so the message can name it.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._C, torch._C._fft, torch._C._linalg, torch._C._nn, torch._C._special, torch._subclasses
from typing import Any

import torch
import torch._subclasses.fake_tensor as fake_tensor
import torch.fx.experimental.symbolic_shapes as symbolic_shapes

from ..errors import CaptureError

_NO_FAKE_KERNEL = getattr(fake_tensor, "UnsupportedOperatorException", None)
_GUARD = getattr(symbolic_shapes, "GuardOnDataDependentSymNode", None)
# every failure of an op that needs values to know its output
VALUE_DEPENDENT = tuple(
    e
    for e in (
        _GUARD,
        getattr(fake_tensor, "DataDependentOutputException", None),
        getattr(fake_tensor, "DynamicOutputShapeException", None),
        _NO_FAKE_KERNEL,
    )
    if e is not None
)
_MARK = "graphamp_torch_function"  # the attribute mark_torch_function sets on the exception

# What the user does about a specific function.
_HINTS = {
    torch.nn.functional.one_hot: "pass num_classes=...: the output's width is then known "
    "without reading the labels",
}
_FIX = (
    "compute it outside build() and pass the result in, or wrap the call in a "
    "torch.library.custom_op and give it a fake implementation (register_fake) whose output "
    "shapes follow from the inputs' shapes, padded to a bound if need be (graphamp does this "
    "for F.ctc_loss)"
)


def mark_torch_function(exc: BaseException, func: Any) -> None:
    """Record on ``exc`` the torch function the user's code called when it was raised (the
    outermost one: capture's mode sees no nested calls). Conversions and iteration (``bool``,
    ``int``, ``for x in tensor``) are the user's own reads: not marked."""
    if hasattr(exc, _MARK):
        return
    name = getattr(func, "__name__", "")
    if name.startswith("__") or name in ("tolist", "item", "unbind", "numpy"):
        return
    try:
        setattr(exc, _MARK, func)
    except AttributeError:  # an exception type that refuses attributes
        pass


def fake_kernel_error(graph_name: str, exc: BaseException, where: str) -> CaptureError | None:
    """The error for an op fake tensors could not run, or None when ``exc`` is the user's own
    read of a value (the host-read message describes it)."""
    called = getattr(exc, _MARK, None)
    op = getattr(exc, "func", None)
    if op is not None and _returns_host_value(op):
        return None
    if _GUARD is not None and isinstance(exc, _GUARD) and called is None:
        return None  # Python control flow on a data-dependent size, in the user's code
    if op is None and called is None:
        return None
    if _NO_FAKE_KERNEL is not None and isinstance(exc, _NO_FAKE_KERNEL):
        why = "it has no fake (meta) kernel, so its output shapes are unknown without running it"
    else:
        why = "the shape of its output depends on the values of its inputs"
    names = [_name(f) for f in (called, op) if f is not None]
    what = names[0] + (f" ({names[1]})" if len(names) > 1 and names[1] != names[0] else "")
    fix = _HINTS.get(called, _FIX) if called is not None else _FIX
    return CaptureError(
        f"{graph_name}.build() calls {what}{where}, which torch's fake tensors cannot run: "
        f"{why}. graphamp captures build() once on fake tensors (shapes, no values), so every "
        f"op needs a shape rule that reads no values. Fix: {fix}"
    )


def _returns_host_value(op: Any) -> bool:
    """Does the op return only non-tensors (a bool, a number): a value read on the host?"""
    schema = getattr(op, "_schema", None)
    if schema is None or not schema.returns:
        return False
    return all(str(r.type) in _HOST_TYPES for r in schema.returns)


_HOST_TYPES = frozenset(
    {"bool", "int", "float", "complex", "number", "Scalar", "SymInt", "SymBool"}
)


def _name(func: Any) -> str:
    packet = getattr(func, "overloadpacket", None)
    if packet is not None:
        return str(packet)
    module: str = getattr(func, "__module__", None) or ""
    name: str = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or str(func)
    module = _PUBLIC_MODULES.get(module, "torch" if module.startswith("torch._C") else module)
    return f"{module}.{name}" if module else name


# where torch's C bindings are documented
_PUBLIC_MODULES = {
    "torch._C._nn": "torch.nn.functional",
    "torch._C._linalg": "torch.linalg",
    "torch._C._special": "torch.special",
    "torch._C._fft": "torch.fft",
}
