"""What users read of overflow forensics: ``g.overflow_report()`` and ``g.range_report()``.

The running largest finite magnitude of every probe is kept on the device beside the ring of
overflowing steps; ``range_rows`` turns it into the headroom of each low-precision value and
gradient against its dtype's largest number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..records.probes import RING_ROWS, OverflowEvent, ProbeTable
from .analysis import dtype_label

__all__ = ["OverflowReport", "RangeReport", "RangeRow", "range_rows"]


@dataclass
class OverflowReport:
    """``g.overflow_report()``: the overflowing steps the device recorded, analysed."""

    graph: str
    overflows: int  # overflowing steps recorded (events may hold fewer: see ``lost``)
    events: list[OverflowEvent]  # oldest first
    lost: int = 0  # overflowing steps whose record was overwritten before the host read it

    @property
    def last(self) -> OverflowEvent | None:
        return self.events[-1] if self.events else None

    def __str__(self) -> str:
        if not self.overflows:
            return f"{self.graph}: no overflowing step recorded"
        out = [
            f"{self.graph}: {self.overflows} overflowing step{'s' if self.overflows != 1 else ''}"
            + (
                f" ({self.lost} not analysed: more than {RING_ROWS} between two reads)"
                if self.lost
                else ""
            )
        ]
        out += [e.describe() for e in self.events[-8:]]
        if len(self.events) > 8:
            out.insert(1, f"(the last 8 of {len(self.events)} analysed)")
        return "\n".join(out)


@dataclass(frozen=True)
class RangeRow:
    """The largest finite magnitude a low-precision value and its gradient reached so far."""

    node: str
    op: str
    module: str
    dtype: str
    activation_amax: float
    gradient_amax: float  # of the scaled gradient, as it is stored (0: no gradient)
    dtype_max: float  # 65504 for float16
    # overflowing steps on which this value (or its gradient) was the first non-finite one:
    # the magnitudes above are the finite ones, so they alone would show it with room to spare
    overflows: int = 0

    @property
    def headroom(self) -> float:
        """dtype max / largest magnitude, value or gradient (inf when both stayed 0); 0 for a
        value that overflowed."""
        if self.overflows:
            return 0.0
        top = max(self.activation_amax, self.gradient_amax)
        return self.dtype_max / top if top > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass
class RangeReport:
    """``g.range_report()``: headroom of every low-precision value against its dtype."""

    graph: str
    rows: list[RangeRow]

    def tightest(self, n: int = 10) -> list[RangeRow]:
        return sorted(self.rows, key=lambda r: r.headroom)[:n]

    def __str__(self) -> str:
        if not self.rows:
            return f"{self.graph}: no low-precision value measured yet"
        lines = [
            f"{self.graph}: headroom of {len(self.rows)} low-precision values (tightest "
            "first; headroom = dtype max / largest finite magnitude so far; 'overflowed' where "
            "the value was the first to go non-finite on an overflowing step)",
            f"{'node':<28} {'op':<24} {'dtype':<9} {'value amax':>11} {'grad amax':>11} "
            f"{'headroom':>9}  module",
        ]
        for r in self.tightest(20):
            room = f"{'overflowed':>9}" if r.overflows else f"{r.headroom:>9.3g}"
            times = f" ({r.overflows}x)" if r.overflows else ""
            lines.append(
                f"{r.node[:28]:<28} {r.op[:24]:<24} {r.dtype:<9} "
                f"{r.activation_amax:>11.4g} {r.gradient_amax:>11.4g} "
                f"{room}  {r.module}{times}"
            )
        return "\n".join(lines)


_RANGED = ("op", "cast", "parameter copy")  # the kinds range rows are made for


def range_rows(
    table: ProbeTable, ranges: Sequence[float], events: Sequence[OverflowEvent] = ()
) -> list[RangeRow]:
    """One row per low-precision forward value (casts and parameter copies included);
    ``events``: the overflowing steps analysed so far, which mark the values that overflowed."""
    first: dict[str, int] = {}
    for event in events:
        for node in (event.node, *event.consumers) if event.kind == "gradient" else (event.node,):
            first[node] = first.get(node, 0) + 1
    rows = []
    for i, probe in enumerate(table.forward):
        if probe.dtype is not None and probe.low_precision and probe.kind in _RANGED:
            rows.append(
                RangeRow(
                    probe.label,
                    probe.op,
                    probe.module,
                    dtype_label(probe.dtype),
                    float(ranges[i]),
                    float(ranges[table.backward_slot(i)]),
                    float(torch.finfo(probe.dtype).max),
                    first.get(probe.label, 0),
                )
            )
    return rows
