"""One attribute of torch replaced for as long as any capture needs it, in any thread.

Capture replaces a few process-wide attributes while build() is traced
(``torch.autograd.Function.apply``: ``capture/functions.py``; ``nn.Module.__setattr__``:
``capture/state_writes.py``; classes' ``__getattribute__``: ``capture/reads.py``; host random
generators: ``capture/host_randomness.py``), and ``torch.compiler._is_compiling_flag`` while
build() or an optimizer's ``step()`` is traced (``COMPILING``, below). Captures may run in several
threads at once, so each replacement is reference-counted: the first to enter installs it, the
last to leave puts back what was there before, on every path. What each replacement does for
the capture of *this* thread is the caller's business (thread-locals). Every process-wide patch
graphamp makes is a ``SharedPatch`` (``tests/test_architecture.py`` checks it).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch.compiler

_MISSING = object()


class SharedPatch:
    """``owner.name = replacement`` while at least one ``applied()`` block is open."""

    def __init__(self, owner: Any, name: str, replacement: Any) -> None:
        self.owner = owner
        self.name = name
        self.replacement = replacement
        self.original: Any = _MISSING  # what the first user found (the raw class attribute)
        self._users = 0
        self._lock = threading.Lock()

    @property
    def in_use(self) -> bool:
        """Is the replacement installed (some ``applied()`` block open)?"""
        return self._users > 0

    @property
    def available(self) -> bool:
        """Does the attribute exist in this torch release?"""
        return hasattr(self.owner, self.name)

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        with self._lock:
            if self._users == 0:
                self.original = vars(self.owner).get(self.name, _MISSING)
                setattr(self.owner, self.name, self.replacement)
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    if self.original is _MISSING:
                        delattr(self.owner, self.name)
                    else:
                        setattr(self.owner, self.name, self.original)


# torch's optimizers (and other library code) take their traced path (tensors for step counts,
# no host reads, no device checks meant for eager capturable steps) while
# ``torch.compiler.is_compiling()``, which reads this flag (torch 2.13-2.15): what
# torch.compile sets while Dynamo traces
COMPILING = SharedPatch(torch.compiler, "_is_compiling_flag", True)


def compiling() -> contextlib.AbstractContextManager[None]:
    """``torch.compiler.is_compiling()`` True for the block (``COMPILING``): while build() is
    captured (libraries skip host-side checks of tensor values, as under torch.compile) and
    while an optimizer's ``step()`` is traced or tried (its traced path). A release without the
    flag has nothing to set."""
    return COMPILING.applied() if COMPILING.available else contextlib.nullcontext()
