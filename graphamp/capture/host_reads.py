"""Reads of a tensor's value on the host while build() is traced, and torch.optim touching
``.grad`` there: each refused with the user's line and what to write instead (``CaptureMode``
asks; a compiled step cannot stop to read values, and capture has none)."""

from __future__ import annotations

import os
import sys
from types import FrameType

import torch

from ..errors import CaptureError
from ..records.frames import UserFrame
from ..torchkit.fxutil import current_user_frame, is_library_file

__all__ = [
    "HOST_READS",
    "SAFE_ANSWERS",
    "grad_access_error",
    "grad_access_from_optimizer_step",
    "host_read_error",
    "torch_function_reading",
    "where_in_user_code",
]


def where_in_user_code(frame: UserFrame | None) -> str:
    return f" at {frame}" if frame is not None else ""


HOST_READS = {
    torch.Tensor.item: ".item()",
    torch.Tensor.tolist: ".tolist()",
    torch.Tensor.__bool__: "bool() or an if/while on a tensor",
    torch.Tensor.__float__: "float()",
    torch.Tensor.__int__: "int()",
    torch.Tensor.__index__: "a tensor used as an index or size",
    torch.Tensor.numpy: ".numpy()",
}


# Python-level conversions of tensor subclasses (FunctionalTensor.__bool__ calls .item()):
# the conversion the user wrote is the outermost one on the stack.
_CONVERSIONS = {
    "__bool__": torch.Tensor.__bool__,
    "__float__": torch.Tensor.__float__,
    "__int__": torch.Tensor.__int__,
    "__index__": torch.Tensor.__index__,
    "tolist": torch.Tensor.tolist,
}


def host_read_error(func, culprit: tuple[str, str] | None) -> CaptureError:
    """build() (or the torch code ``culprit`` it called) read a tensor's value on the host."""
    where = where_in_user_code(current_user_frame())
    how = _host_read(func)
    if culprit is not None:
        module, function = culprit
        hint = _TORCH_READ_WORKAROUNDS.get(culprit) or _TORCH_READ_WORKAROUNDS.get(
            function,
            "look for an argument of that torch API "
            "that gives the value it computes (a hint or flag), "
            "or call it outside build()",
        )
        return CaptureError(
            f"torch's {module}.{function} reads a tensor's value on the host with {how}, "
            f"called from build(){where}. A compiled step cannot stop to read values, and "
            f"capture has none (it runs on shapes alone). Workaround: {hint}"
        )
    return CaptureError(
        f"build() reads a tensor's value on the host with {how}{where}. That would stop the "
        "compiled step to wait for the device, and capture has no values (it runs on shapes "
        "alone). Return the tensor from build() and call .item() on the result, or keep the "
        "decision in the graph with torch.where"
    )


# Plumbing between a conversion and the code that asked for it (tensor subclasses, dispatch).
_TORCH_DIR = os.path.dirname(torch.__file__)
_PLUMBING = tuple(
    os.path.join(_TORCH_DIR, d)
    for d in ("_subclasses", "overrides.py", "_tensor.py", "utils" + os.sep + "_", "fx", "_ops.py")
)
# .grad inside build() is the gradient book's (gradient_book.py), except from torch.optim's step():
# the optimizers added with add_optimizer step inside the compiled step, after build(), and a
# step() in build() would update the parameters twice.
_STEP_FIX = (
    "remove optimizer.step() from build(): the optimizers added with add_optimizer are "
    "stepped inside the compiled step, on the gradients build() leaves in .grad"
)


def grad_access_from_optimizer_step() -> bool:
    """A torch.optim function other than zero_grad (which only clears .grad) reads or writes."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and is_library_file(frame.f_code.co_filename):
        module = frame.f_globals.get("__name__", "")
        if module.startswith("torch.optim") and frame.f_code.co_name != "zero_grad":
            return True
        frame = frame.f_back
    return False


def grad_access_error(how: str) -> CaptureError:
    return CaptureError(
        f"torch.optim {how} a tensor's .grad inside build(){where_in_user_code(current_user_frame())}. "
        f"Fix: {_STEP_FIX}"
    )


# torch helpers whose value reads only choose a faster path: the answer that keeps the general
# path is always right. nn.Transformer* compare the mask with a causal one to set is_causal;
# "not causal" applies the mask as given.
SAFE_ANSWERS = {"_detect_is_causal_mask": False}
# Known torch helpers that read values, and how users avoid the read.
_TORCH_READ_WORKAROUNDS: dict[object, str] = {
    "_detect_is_causal_mask": "pass is_causal=True with a causal mask (torch then trusts the "
    "flag instead of comparing the mask's values), or build the "
    "mask outside build() and pass is_causal explicitly",
    # BatchNorm built with momentum=None (a cumulative average) divides by its batch count
    ("torch.nn.modules.batchnorm", "forward"): "a BatchNorm built with momentum=None keeps a "
    "cumulative moving average, whose factor 1 / num_batches_tracked it reads on the host at "
    "every call: give it a momentum (the default 0.1 averages exponentially), or train it "
    "eagerly",
}


def torch_function_reading() -> tuple[str, str] | None:
    """(module, function) of the innermost torch code below the user's frame that asked for the
    value, or None when the user's own code did."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and is_library_file(frame.f_code.co_filename):
        filename, name = frame.f_code.co_filename, frame.f_code.co_name
        if (
            filename.startswith(_TORCH_DIR)
            and not filename.startswith(_PLUMBING)
            and not name.startswith("<")
        ):
            return frame.f_globals.get("__name__", "torch"), name
        frame = frame.f_back
    return None


def _host_read(func) -> str:
    """How the user's code read a value: the outermost conversion between it and ``func``."""
    frame: FrameType | None = sys._getframe(1)
    found = func
    while frame is not None and is_library_file(frame.f_code.co_filename):
        found = _CONVERSIONS.get(frame.f_code.co_name, found)
        frame = frame.f_back
    return HOST_READS[found]
