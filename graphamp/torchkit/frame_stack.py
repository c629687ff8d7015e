"""Builds run on a roomy Python frame stack, so that tracing does not map memory per op.

CPython (3.11 and later) keeps the frames of Python calls in chunks of memory, 16 KiB each,
that it maps from the operating system as a call needs one and unmaps as soon as the frame at
the start of a chunk returns. Tracing a training step is deep (make_fx, functionalization, fake
tensors and the proxy modes each add frames to every op) and repeats the same calls thousands
of times: where the depth at which each op is dispatched sits on a chunk's edge, every op maps
a chunk, touches its pages and unmaps it again. On the 2-core test machine one such cycle costs
about 10 us (an ``mmap``, page faults, a ``munmap``); a 12-layer GPT-2's build made 154,000 of
them where the 6-layer one made 68,000 (``strace``), and its step's assembly ran 2.7 times as
long as the 6-layer one's for 2 times the ops. Which depth sits on an edge is chance: it moves
with anything that changes the stack above the build (the user's script, a notebook, a
launcher).

``on_roomy_stack(fn)`` calls ``fn`` from a frame that declares a 1 MiB value stack. No chunk in
use has room for it, so CPython maps a chunk of 2 MiB for it alone and every frame ``fn`` calls
goes into that chunk's free megabyte (tens of thousands of frames of the size the trace makes)
instead of crossing an edge. One map and unmap per build; the declared stack is never touched,
so it costs pages only for the frames that run. Where the interpreter does not keep frames so
(or refuses the code change), the call is a plain call.
"""

from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")

# 2**17 stack slots of 8 bytes: a 1 MiB frame, which CPython rounds up to a 2 MiB chunk
_SLOTS = 1 << 17


def _call(fn, args, kwargs):
    return fn(*args, **kwargs)


try:
    _call.__code__ = _call.__code__.replace(co_stacksize=_SLOTS)
except (ValueError, TypeError):  # an interpreter that checks or lacks the field: a plain call
    pass


def on_roomy_stack(fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)``, its frames kept in one chunk of CPython's frame memory (the
    module docstring says why)."""
    return _call(fn, args, kwargs)
