"""The host's handle on one compiled step's overflow record (step input group ``forensics``)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..records.probes import RING_ROWS, OverflowEvent, ProbeTable
from .analysis import analyse
from .reports import RangeRow, range_rows

__all__ = ["ForensicsState"]


class ForensicsState:
    """The tensors one compiled step writes its overflow record into (step layout group
    ``forensics``): ``count`` (overflowing steps, int64), ``ring`` (``RING_ROWS`` rows of step,
    scale and probe vector; row ``count % RING_ROWS`` is written next) and ``ranges`` (running
    largest finite magnitude per probe). The host reads them only when asked (``read``) or, for
    autofix and debug logging, polls ``count`` without waiting for the device (``poll``)."""

    def __init__(self, table: ProbeTable, tensors: list[torch.Tensor]):
        """``tensors``: a fresh record for ``table`` (``records.probes.record_tensors``)."""
        self.table = table
        self.count, self.ring, self.ranges = tensors
        self.analysed = 0  # overflowing steps already turned into events
        self._host_count: torch.Tensor | None = None
        self._copied: Any = None  # the CUDA event of the last asynchronous copy of ``count``

    def tensors(self) -> list[torch.Tensor]:
        return [self.count, self.ring, self.ranges]

    def start_poll(self) -> None:
        """Queue a copy of ``count`` to the host behind the step (CUDA; nothing to do on CPU)."""
        if self.count.device.type != "cuda":
            return
        if self._host_count is None:
            self._host_count = torch.empty((), dtype=torch.int64, pin_memory=True)
        self._host_count.copy_(self.count, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def poll(self, wait: bool = False) -> int | None:
        """The overflow count as of a finished step (CUDA: the step before the last one queued
        with ``start_poll``), without waiting unless ``wait`` (None: not known yet)."""
        if self.count.device.type != "cuda":
            return int(self.count)
        if self._copied is None or self._host_count is None:
            return None
        if wait:
            self._copied.synchronize()
        elif not self._copied.query():
            return None
        return int(self._host_count)

    def read_new(self) -> tuple[list[OverflowEvent], int]:
        """Analyse the overflowing steps recorded since the last read (one device sync):
        (events oldest first, how many were overwritten before this read)."""
        count = int(self.count.item())
        new = count - self.analysed
        if new <= 0:
            return [], 0
        kept = min(new, RING_ROWS)
        rows = self.ring.detach().cpu()
        events = [
            analyse(self.table, rows[n % RING_ROWS].tolist()) for n in range(count - kept, count)
        ]
        self.analysed = count
        return events, new - kept

    def range_rows(self, events: Sequence[OverflowEvent] = ()) -> list[RangeRow]:
        return range_rows(self.table, self.ranges.detach().cpu().tolist(), events)
