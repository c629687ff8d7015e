"""What a first call says while it builds a step (issue 31): a minutes-long compile is never a
silent prompt.

- One INFO line per stage on the ``graphamp`` logger, with its seconds and what it made (node
  counts; for the compile, the backend and what inductor's caches did: ``inductor_cache.py``).
  The logger's level decides whether they are shown (``Graph.debug(1)`` shows them).
- On a terminal, a tqdm-style line on stderr while the compile runs: it appears once the compile
  has taken ``SHOW_AFTER_S`` (a compile that finishes sooner is not expected to be long and says
  nothing), counts the seconds from a thread, and ends with the total. Never on a non-terminal
  (a log file, a pipe, a notebook's captured stderr), and off with ``config.set_progress(False)``.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from types import TracebackType
from typing import TextIO

log = logging.getLogger("graphamp")

SHOW_AFTER_S = 2.0  # a compile still running after this long gets a progress line
TICK_S = 0.5  # how often the line is redrawn
_SPINNER = "|/-\\"


def log_stage(graph_name: str, stage: str, seconds: float, detail: str) -> None:
    """One INFO line for a finished stage: ``GPT: compile 31.20 s (3912 nodes, inductor)``."""
    log.info("%s: %s %.2f s%s", graph_name, stage, seconds, f" ({detail})" if detail else "")


class CompileProgress:
    """``with CompileProgress("GPT: compiling the step (3912 nodes, inductor)", show=...):``

    Draws ``label  |  12 s`` on ``stream`` (stderr when None, read at entry) from a daemon
    thread while the body runs, once it has run ``show_after`` seconds, if ``show`` and the
    stream is a terminal. The body runs on the calling thread, so Ctrl-C and exceptions reach
    it as without the line; the thread only writes, and is joined on exit."""

    def __init__(
        self,
        label: str,
        *,
        show: bool = True,
        stream: TextIO | None = None,
        show_after: float | None = None,
        tick: float | None = None,
    ) -> None:
        self.label = label
        self.show = show
        self.stream = stream
        self.show_after = SHOW_AFTER_S if show_after is None else show_after
        self.tick = TICK_S if tick is None else tick
        self.shown = False  # the line was drawn at least once
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = 0.0

    def __enter__(self) -> CompileProgress:
        stream = sys.stderr if self.stream is None else self.stream
        self.stream = stream
        self._start = time.perf_counter()
        if self.show and _is_terminal(stream):
            self._thread = threading.Thread(target=self._draw, name="graphamp-progress")
            self._thread.daemon = True  # never keeps the interpreter alive
            self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        if self.shown:
            elapsed = time.perf_counter() - self._start
            end = f"done in {elapsed:.1f} s" if kind is None else "stopped"
            self._write(f"{self.label}  {end}\n")

    def _draw(self) -> None:
        if self._done.wait(self.show_after):
            return  # finished before it was expected to be long
        frame = 0
        while True:
            elapsed = time.perf_counter() - self._start
            self._write(f"{self.label}  {_SPINNER[frame % len(_SPINNER)]}  {elapsed:.0f} s")
            self.shown = True
            frame += 1
            if self._done.wait(self.tick):
                return

    def _write(self, text: str) -> None:
        # \r and erase-line: the line is redrawn in place, as tqdm does
        stream = self.stream
        if stream is None:
            return
        try:
            stream.write("\r\x1b[K" + text)
            stream.flush()
        except (OSError, ValueError):  # a closed or broken terminal: the compile goes on
            self.show = False


def _is_terminal(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):
        return False
