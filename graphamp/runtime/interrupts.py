"""Ctrl-C between a step's first write and its last: held back until the step is committed.

A compiled step writes parameters, optimizer state, scaler state and counters in place, and the
Graph then updates its own counters. A KeyboardInterrupt is raised between Python bytecodes, so
without care it can land in the middle of that sequence and leave some tensors updated and
others not. While a step commits, graphamp's SIGINT handler only records the signal; when the
commit is done, the handler that was installed before graphamp's is called with it (Python's
default raises KeyboardInterrupt), so the interrupt arrives once, at the latest right after the
step, and never needs a second Ctrl-C.

The handler is installed once, from the main thread, the first time a step commits there (it
replaces nothing the user can see: outside a commit it calls the previous handler at once).
Signals are only delivered to the main thread in Python, so steps run from other threads need
no deferral. A SIGINT handler the user installs later replaces graphamp's: its own semantics
then apply inside a step too.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

_MAIN = threading.main_thread()


class _Deferral:
    def __init__(self) -> None:
        self.depth = 0  # commits in progress in the main thread
        self.pending: tuple[int, FrameType | None] | None = None
        self.previous: Any = None  # the handler graphamp's replaced
        self.installed = False

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.depth > 0:
            self.pending = (signum, frame)
            return
        self.deliver(signum, frame)

    def deliver(self, signum: int, frame: FrameType | None) -> None:
        previous = self.previous
        if callable(previous):
            previous(signum, frame)  # Python's default raises KeyboardInterrupt
        elif previous == signal.SIG_DFL:  # the process was to terminate: let it
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        # SIG_IGN: ignored, as before graphamp

    def enter(self) -> bool:
        """Start holding SIGINT back; False (nothing to undo) outside the main thread."""
        if threading.current_thread() is not _MAIN:
            return False
        if not self.installed:
            self.previous = signal.signal(signal.SIGINT, self.handle)
            self.installed = True
        self.depth += 1
        return True

    def exit(self) -> None:
        """Stop holding back; deliver an interrupt that arrived meanwhile."""
        self.depth -= 1
        if self.depth == 0 and self.pending is not None:
            pending, self.pending = self.pending, None
            self.deliver(*pending)


_deferral = _Deferral()
hold_interrupts = _deferral.enter
release_interrupts = _deferral.exit
