"""A graph module made when something first reads it.

A restart whose compiled step inductor's caches hold runs without the step's graph: it is
compiled from the note AOTAutograd's key was kept in (``backend/noted_step.py``), and the
graph, authenticated already, is unpickled from the step cache's entry only when a dump, a
report, ``Graph.compiled_steps`` or a data-parallel fingerprint reads it.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch.fx as fx


class DeferredGraph:
    """A graph module, given (``ready``) or loaded by ``load`` at its first read (``gm``).

    ``nodes`` is its node count, known without loading it."""

    def __init__(
        self,
        load: Callable[[], fx.GraphModule],
        nodes: int,
    ) -> None:
        self._load = load
        self._gm: fx.GraphModule | None = None
        self._lock = threading.Lock()
        self.nodes = nodes

    @classmethod
    def ready(cls, gm: fx.GraphModule) -> DeferredGraph:
        graph = cls(lambda: gm, len(gm.graph.nodes))
        graph._gm = gm
        return graph

    @property
    def in_memory(self) -> bool:
        """Whether the graph module was made (given, or loaded by a read)."""
        return self._gm is not None

    @property
    def gm(self) -> fx.GraphModule:
        with self._lock:  # two threads reading it at once load it once
            gm = self._gm
            if gm is None:
                gm = self._gm = self._load()
                self._load = lambda: gm  # what the loader held (the entry's bytes) can go
            return gm
