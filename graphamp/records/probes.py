"""What overflow tracing measures, and what one overflowing step is: the records of forensics.

With ``config.enable_overflow_tracing()`` the compiled step reduces every *probed* value to its
largest magnitude (one reduction per value: NaN and inf survive it) and keeps the results on the
device (``forensics.device_record.ForensicsState``): nothing reaches the host until asked.

- A **probe** is a forward value (a floating placeholder, or an op's result that is not a view),
  the gradient arriving at it in the backward, or a parameter's gradient. ``ProbeTable`` lists
  them (``step/components/overflow_probes.py`` plans it); the step's vector of magnitudes has
  ``ProbeTable.size`` entries in that order.
- On a step that overflows, the vector is kept in a ring of the last ``RING_ROWS`` such steps,
  with the step number and the loss scale used (``ROW_HEADER``).
- ``OverflowEvent`` is what the host's analysis (``forensics/analysis.py``) makes of one ring
  row; the graph's history keeps them, and its state dict saves them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .frames import UserFrame
from .pins import AmpPin

__all__ = [
    "GradParam",
    "OverflowEvent",
    "PLACEHOLDER_KINDS",
    "Probe",
    "ProbeTable",
    "RING_ROWS",
    "ROW_HEADER",
    "record_tensors",
]

RING_ROWS = 16  # overflowing steps the device keeps until the host reads them
ROW_HEADER = 2  # a ring row: step, loss scale, then the probe vector
PLACEHOLDER_KINDS = ("input", "parameter", "buffer", "constant", "parameter copy")


@dataclass(frozen=True)
class Probe:
    """One forward value the step measures, and where it comes from."""

    node: str  # the forward graph's node name
    label: str  # what reports call it: the node name, or a placeholder's parameter/input name
    kind: str  # PLACEHOLDER_KINDS, "op", or "cast" (a cast the AMP passes inserted)
    op: str  # "aten.mm"; for placeholders their kind ("input", ...)
    dtype: torch.dtype | None  # the floating dtype it has after AMP
    module: str  # innermost module path ('' outside modules)
    source: UserFrame | None  # the user's line that made it
    inputs: tuple[int, ...]  # the probes it reads (through views), ascending
    pin: AmpPin | None  # what names this op across builds (ops only)

    @property
    def low_precision(self) -> bool:
        return self.dtype in (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class GradParam:
    """A trained parameter whose gradient is probed."""

    name: str  # qualified parameter name
    placeholders: tuple[int, ...]  # forward probes of the parameter and its low-precision copy


@dataclass
class ProbeTable:
    """The probes of one compiled step. Vector layout: ``forward`` (topological order), then the
    gradient arriving at each forward probe (``backward_slot``), then each parameter gradient
    (``param_slot``). Slots whose value gets no gradient hold 0."""

    forward: tuple[Probe, ...]
    params: tuple[GradParam, ...]
    losses: tuple[int, ...]  # forward probes holding build()'s losses
    consumers: tuple[tuple[int, ...], ...] = field(init=False)  # forward probes reading each

    def __post_init__(self) -> None:
        readers: list[list[int]] = [[] for _ in self.forward]
        for i, probe in enumerate(self.forward):
            for j in probe.inputs:
                readers[j].append(i)
        self.consumers = tuple(tuple(r) for r in readers)

    @property
    def n_forward(self) -> int:
        return len(self.forward)

    @property
    def size(self) -> int:
        return 2 * len(self.forward) + len(self.params)

    def backward_slot(self, i: int) -> int:
        return len(self.forward) + i

    def param_slot(self, k: int) -> int:
        return 2 * len(self.forward) + k


@dataclass(frozen=True)
class OverflowEvent:
    """What went non-finite first on one overflowing step (``OverflowReport.events``)."""

    step: int  # the graph's step number (history row)
    scale: float  # the loss scale the step used (1 without a scaler)
    phase: str  # "forward", "backward", or "unknown" (no probe saw it)
    kind: str  # PLACEHOLDER_KINDS, "op", "cast", "gradient" (of a parameter), or ""
    node: str  # the forward node (for "gradient": the parameter's name)
    op: str
    dtype: str
    module: str
    source: str  # "file:line in function: code", or ""
    location: str  # "file.py:line", or ""
    value: str  # "inf" or "nan"
    input_amax: float | None  # largest finite magnitude among its inputs (None: no inputs)
    reads: tuple[str, ...] = ()  # the probed values it read (forward)
    consumers: tuple[str, ...] = ()  # forward nodes whose backward (or read of a cast) made it
    pins: tuple[AmpPin, ...] = ()  # what autofix pins for it (empty: nothing can help)
    note: str = ""  # why there is nothing to pin

    @property
    def is_data_fault(self) -> bool:
        return self.kind == "input"

    def describe(self) -> str:
        """Two or three lines: what, where, and what can be done."""
        head = f"step {self.step} (loss scale {self.scale:g}): "
        if self.phase == "unknown":
            return head + "skipped, but no probed value was non-finite (" + self.note + ")"
        if self.kind in PLACEHOLDER_KINDS:
            what = f"{self.kind} {self.node!r} ({self.dtype}) holds {self.value}"
        elif self.phase == "backward":
            subject = (
                f"parameter {self.node!r}"
                if self.kind == "gradient"
                else f"{self.op} (node {self.node}, {self.dtype}) in {self.module or '-'}"
            )
            what = f"backward: the gradient of {subject} became {self.value}" + (
                f" in the backward of {', '.join(self.consumers)}" if self.consumers else ""
            )
        elif self.kind == "cast":
            what = (
                f"forward: the cast to {self.dtype} of {', '.join(self.reads)} (node "
                f"{self.node}) for {', '.join(self.consumers) or '-'} in {self.module or '-'} "
                f"produced {self.value}"
            )
        else:
            what = (
                f"forward: {self.op} (node {self.node}, {self.dtype}) in "
                f"{self.module or '-'} produced {self.value}"
            )
        if self.input_amax is not None:
            what += f"; largest finite input magnitude {self.input_amax:.4g}"
        lines = [head + what]
        if self.source:
            lines.append(f"    at {self.source}")
        lines.append(
            "    fix: pin " + ", ".join(p.describe() for p in self.pins) + " to fp32"
            if self.pins
            else f"    nothing to pin: {self.note}"
        )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain values only (loads with ``torch.load(weights_only=True)``)."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["consumers"] = list(self.consumers)
        d["reads"] = list(self.reads)
        d["pins"] = [p.to_dict() for p in self.pins]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OverflowEvent:
        values = dict(d)
        values["consumers"] = tuple(values.get("consumers", ()))
        values["reads"] = tuple(values.get("reads", ()))
        values["pins"] = tuple(AmpPin.from_dict(p) for p in values.get("pins", ()))
        return cls(**{k: values[k] for k in cls.__dataclass_fields__ if k in values})


def record_tensors(table: ProbeTable, device: torch.device) -> list[torch.Tensor]:
    """A fresh overflow record for ``table`` (step input group ``forensics``): the overflowing
    steps' count (int64), the ring of their rows (``RING_ROWS`` x ``ROW_HEADER + table.size``,
    NaN; float64, so the step number in each row is exact for 2**53 steps) and the running largest finite magnitude of each probe (zeros)."""
    count = torch.zeros((), dtype=torch.int64, device=device)
    ring = torch.full(
        (RING_ROWS, ROW_HEADER + table.size), math.nan, dtype=torch.float64, device=device
    )
    return [count, ring, torch.zeros(table.size, dtype=torch.float32, device=device)]
