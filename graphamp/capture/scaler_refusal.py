"""A torch.amp.GradScaler used inside build(): the one place that refuses it.

graphamp scales the loss, unscales, skips non-finite steps and updates the scale inside the
compiled step (``set_grad_scaler``); a torch scaler called in build() would bake its scale into
the graph. It shows up two ways while build() is traced: as torch functions called from the
scaler's own code (``scale()`` multiplies, ``unscale_()`` reads ``.grad``: the capture mode asks
``called_from_torch_grad_scaler``), or as an exception raised there before any torch function
(``step()`` or ``update()`` with no scale: the tracer asks ``raised_in_torch_grad_scaler``).
Both raise ``torch_grad_scaler_error``.
"""

from __future__ import annotations

import os
import sys
from types import FrameType

from ..errors import CaptureError
from ..records.frames import UserFrame
from ..torchkit.fxutil import is_library_file

# torch/amp/grad_scaler.py (torch.cuda.amp.GradScaler's methods run there too)
_SCALER_FILE = os.path.join("amp", "grad_scaler.py")


def called_from_torch_grad_scaler() -> bool:
    """Is torch's GradScaler code between the user's frame and here?"""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and is_library_file(frame.f_code.co_filename):
        if frame.f_code.co_filename.endswith(_SCALER_FILE):
            return True
        frame = frame.f_back
    return False


def raised_in_torch_grad_scaler(error: BaseException) -> bool:
    """Was ``error`` raised in (or through) torch's GradScaler code?"""
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(_SCALER_FILE):
            return True
        tb = tb.tb_next
    return False


def torch_grad_scaler_error(where: UserFrame | None, graph_name: str = "") -> CaptureError:
    who = f"{graph_name}.build()" if graph_name else "build()"
    at = f" at {where}" if where is not None else ""
    return CaptureError(
        f"{who} uses a torch.amp.GradScaler{at}: graphamp scales the loss, unscales, skips "
        "non-finite steps and updates the scale inside the compiled step, and a scale used in "
        "build() would be baked into the graph. Fix: call set_grad_scaler(scaler) in __init__ "
        "(a torch.amp.GradScaler is accepted), remove scaler.scale() / step() / unscale_() / "
        "update() from build(), and call loss.backward() on the unscaled loss"
    )
