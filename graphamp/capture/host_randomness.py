"""Random numbers drawn on the host inside build(), refused at capture.

build() runs once, at capture. A draw from Python's ``random`` or NumPy's generator there
(timm's Mixup choosing lambda and CutMix; transformers' Wav2Vec2 drawing its SpecAugment masks
with ``np.random``) happens once and becomes a constant of the compiled step: every step would
reuse the first step's draw, silently. torch's own random functions (dropout, ``torch.rand``)
are ops of the graph, drawn anew inside every step, and are not affected.

While build() is captured, the module-level functions of ``random`` and ``numpy.random`` raise
a CaptureError naming the function, the library's line that called it and the user's line
that led there, before drawing anything. ``numpy.random.default_rng()`` without a seed (a generator
seeded from the OS, new draws on every eager call) is refused the same way. Draws that bypass
them (a function imported by name before capture, a generator object kept on a module) are
found by comparing the generators' states before and after; the states are then put back and
the capture is refused all the same. A generator made inside build() from a fixed seed draws
the same values on every eager call, so keeping them is right: allowed.
Other threads draw as usual.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import sysconfig
import threading
from types import FrameType, ModuleType
from typing import Any, Callable, Iterator

from ..errors import CaptureError
from ..records.frames import UserFrame
from ..torchkit.process_state import SharedPatch

try:
    import numpy as np
except ImportError:  # numpy is a base dependency; keep capture working without it anyway
    np = None  # type: ignore[assignment]

_local = threading.local()  # .graph_name while this thread captures

_FIX = (
    "Draw it outside build() and pass the values to g(...) as arguments (a tensor or a "
    "number), or draw with torch (torch.rand, torch.randint, torch.distributions), which the "
    "compiled step draws anew on every call"
)
_LIBRARY_DIRS = tuple(
    os.path.abspath(p) + os.sep
    for p in {sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib", "platstdlib")}
)


def _generators() -> list[tuple[ModuleType, Any, str]]:
    """(module, its hidden global generator, the name users know it by)."""
    found: list[tuple[ModuleType, Any, str]] = [(random, random._inst, "random")]  # type: ignore[attr-defined]
    if np is not None:
        found.append((np.random, np.random.mtrand._rand, "numpy.random"))
    return found


def _refusing(module_name: str, name: str, function: Callable) -> Callable:
    def draw(*args: Any, **kwargs: Any) -> Any:
        graph_name = getattr(_local, "graph_name", None)
        if graph_name is not None:
            raise _draw_error(graph_name, f"{module_name}.{name}()", sys._getframe(1))
        return function(*args, **kwargs)

    draw.__name__ = draw.__qualname__ = name
    draw.__wrapped__ = function  # type: ignore[attr-defined]
    return draw


def _refusing_unseeded(module_name: str, name: str, function: Callable) -> Callable:
    """A generator made without a seed draws from the OS's entropy: different on every eager
    call, the same on every compiled one. With a seed it draws the same on every call in eager
    too, and capture is right to keep its draws."""

    def make(*args: Any, **kwargs: Any) -> Any:
        graph_name = getattr(_local, "graph_name", None)
        seed = args[0] if args else kwargs.get("seed")
        if graph_name is not None and seed is None:
            what = f"{module_name}.{name}() without a seed"
            raise _draw_error(graph_name, what, sys._getframe(1))
        return function(*args, **kwargs)

    make.__name__ = make.__qualname__ = name
    make.__wrapped__ = function  # type: ignore[attr-defined]
    return make


def _patches() -> list[SharedPatch]:
    """One patch per module-level function bound to a global generator, and NumPy's
    ``default_rng`` (a fresh generator seeded from the OS)."""
    patches = []
    if np is not None:
        rng = _refusing_unseeded("numpy.random", "default_rng", np.random.default_rng)
        patches.append(SharedPatch(np.random, "default_rng", rng))
    for module, generator, module_name in _generators():
        for name, function in sorted(vars(module).items()):
            if getattr(function, "__self__", None) is generator and not name.startswith("_"):
                if name in ("getstate", "setstate", "get_state", "set_state", "seed"):
                    continue
                wrapped = _refusing(module_name, name, function)
                patches.append(SharedPatch(module, name, wrapped))
    return patches


_PATCHES = _patches()


@contextlib.contextmanager
def refusing_host_randomness(graph_name: str, watched: list[tuple[str, Any]]) -> Iterator[None]:
    """Inside the block, this thread's draws from the host generators raise (module docstring);
    generators kept on the watched objects are checked when it ends."""
    states = _states(watched)
    with contextlib.ExitStack() as stack:
        for patch in _PATCHES:
            stack.enter_context(patch.applied())
        previous, _local.graph_name = getattr(_local, "graph_name", None), graph_name
        try:
            yield
        finally:
            _local.graph_name = previous
            changed = [label for label, get, put, state in states if _moved(get, put, state)]
    if changed:
        raise CaptureError(
            f"{graph_name}.build() draws random numbers on the host from {changed[0]} (it "
            "changed while build() was captured; it was put back). build() is captured once, "
            "so the draw would happen once and every step would reuse it. " + _FIX
        )


def _states(watched: list[tuple[str, Any]]) -> list[tuple[str, Callable, Callable, Any]]:
    """(name, read its state, set its state, its state now) of the global generators and of
    the generators kept on the watched objects."""
    access: list[tuple[str, Callable, Callable]] = [
        ("Python's random module", random.getstate, random.setstate)
    ]
    if np is not None:
        access.append(("NumPy's global generator", np.random.get_state, np.random.set_state))
    for label, obj in watched:
        for name, value in list(getattr(obj, "__dict__", {}).items()):
            found = _state_access(value)
            if found is not None:
                access.append((f"{label}.{name}", *found))
    return [(name, get, put, get()) for name, get, put in access]


def _state_access(value: Any) -> tuple[Callable, Callable] | None:
    if isinstance(value, random.Random):
        return value.getstate, value.setstate
    if np is not None and isinstance(value, np.random.RandomState):
        return value.get_state, value.set_state
    if np is not None and isinstance(value, np.random.Generator):
        bits = value.bit_generator
        return (lambda: bits.state), (lambda state: setattr(bits, "state", state))
    return None


def _moved(get: Callable, put: Callable, state: Any) -> bool:
    """Has the generator moved since ``state``? If so, it is put back."""
    if _equal_states(state, get()):
        return False
    put(state)
    return True


def _equal_states(a: Any, b: Any) -> bool:
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_equal_states(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal_states(a[k], b[k]) for k in a)
    if np is not None and isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.shape == b.shape and bool((a == b).all())
    return bool(a == b)


def _draw_error(graph_name: str, what: str, caller: FrameType | None) -> CaptureError:
    library, user = _frames(caller)
    where = f" at {library}" if library is not None else ""
    if user is not None and user != library:
        where += f", reached from your code at {user}"
    return CaptureError(
        f"{graph_name}.build() draws a random number on the host with {what}{where}. build() "
        "is captured once, so the draw would happen once, at capture, and every step would "
        f"reuse the same value. {_FIX}"
    )


def _frames(frame: FrameType | None) -> tuple[UserFrame | None, UserFrame | None]:
    """(the line that drew, the innermost line of the user's own code above it)."""
    library = _frame(frame) if frame is not None else None
    while frame is not None and _is_installed(frame.f_code.co_filename):
        frame = frame.f_back
    return library, _frame(frame) if frame is not None else None


def _frame(frame: FrameType) -> UserFrame:
    return UserFrame(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)


def _is_installed(filename: str) -> bool:
    """Library code (site-packages, the standard library, graphamp) rather than the user's."""
    absolute = os.path.abspath(filename)
    graphamp_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    return absolute.startswith((*_LIBRARY_DIRS, graphamp_dir)) or filename.startswith("<")
