"""Overflow forensics: which node first produced a non-finite value, and how close the others came.

With ``config.enable_overflow_tracing()`` the compiled step reduces every *probed* value to its
largest magnitude (one reduction per value: NaN and inf survive it) and writes the results into
tensors it owns on the device (``ForensicsState``): nothing reaches the host until asked.

- A **probe** is a forward value (a floating placeholder, or an op's result that is not a view),
  the gradient arriving at it in the backward, or a parameter's gradient. ``ProbeTable`` lists
  them; the step's vector of magnitudes has ``ProbeTable.size`` entries in that order.
- On a step that overflows, the vector is kept in a ring of the last ``RING_ROWS`` such steps,
  with the step number and the loss scale used. ``analyse`` turns a row into an
  ``OverflowEvent``: the first value (forward in topological order, then backward) that went
  non-finite from finite inputs **and** whose non-finite value reached the loss or a gradient.
  The second condition keeps the by-design infinities of attention masks (``masked_fill(-inf)``,
  a ``finfo.min`` mask cast to fp16), which the softmax absorbs, from being blamed.
- The running largest finite magnitude of every probe is kept too (``range_rows``): the headroom
  of each low-precision value and gradient against its dtype's largest number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..records.fxutil import UserFrame
from ..records.pins import AmpPin
from ..records.validate import dtype_name

__all__ = [
    "ForensicsState",
    "GradParam",
    "OverflowEvent",
    "OverflowReport",
    "Probe",
    "ProbeTable",
    "RING_ROWS",
    "RangeReport",
    "RangeRow",
    "analyse",
    "range_rows",
]

RING_ROWS = 16  # overflowing steps the device keeps until the host reads them
ROW_HEADER = 2  # a ring row: step, loss scale, then the probe vector
PLACEHOLDER_KINDS = ("input", "parameter", "buffer", "constant", "parameter copy")
_NOTHING_TO_PIN = {
    "input": "the batch holds non-finite values: a data fault, not an op's overflow",
    "parameter": "a parameter holds non-finite values: load or fix the weights",
    "buffer": "a buffer holds non-finite values",
    "constant": "a tensor build() reads holds non-finite values",
}


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


# -- analysis of one ring row (host side) ----------------------------------------------------------


def analyse(table: ProbeTable, row: Sequence[float]) -> OverflowEvent:
    """The first relevant non-finite value of one overflowing step's row."""
    step, scale, values = int(row[0]), float(row[1]), list(row[ROW_HEADER:])
    bad = [not math.isfinite(v) for v in values]
    root = _forward_root(table, bad)
    if root is not None:
        return _forward_event(table, values, root, step, scale)
    root = _backward_root(table, bad)
    if root is not None:
        return _backward_event(table, values, root, step, scale)
    return OverflowEvent(
        step,
        scale,
        "unknown",
        "",
        "",
        "",
        "",
        "",
        "",
        "",
        "",
        None,
        note="the overflow came from outside the probed values, e.g. a "
        "non-finite gradient norm when clipping",
    )


def _roots(start: list[int], preds, bad: list[bool]) -> set[int]:
    """Non-finite slots reachable from ``start`` through non-finite slots (``preds(slot)`` goes
    one step towards the cause), that have no non-finite predecessor themselves."""
    seen, stack, roots = set(start), list(start), set()
    while stack:
        slot = stack.pop()
        bad_preds = [p for p in preds(slot) if bad[p]]
        if not bad_preds:
            roots.add(slot)
        for p in bad_preds:
            if p not in seen:
                seen.add(p)
                stack.append(p)
    return roots


def _forward_root(table: ProbeTable, bad: list[bool]) -> int | None:
    sinks = [i for i in table.losses if bad[i]]
    roots = _roots(sinks, lambda i: table.forward[i].inputs, bad)
    return min(roots) if roots else None


def _backward_root(table: ProbeTable, bad: list[bool]) -> int | None:
    """Backward slots: the gradient at forward probe i comes from the gradients at its
    consumers; a parameter's from the gradients at its placeholders' consumers."""
    sinks = [table.param_slot(k) for k in range(len(table.params)) if bad[table.param_slot(k)]]
    roots = _roots(sinks, lambda s: [table.backward_slot(c) for c in _slot_readers(table, s)], bad)
    if not roots:
        return None
    # the backward runs the forward in reverse: the root made in the backward of the latest
    # forward node came first
    return max(roots, key=lambda s: (max(_slot_readers(table, s), default=-1), -s))


def _slot_readers(table: ProbeTable, slot: int) -> list[int]:
    """The forward probes whose backward computes backward slot ``slot``, ascending."""
    n = table.n_forward
    if slot >= 2 * n:
        return sorted(
            {c for p in table.params[slot - 2 * n].placeholders for c in table.consumers[p]}
        )
    return list(table.consumers[slot - n])


def _where(probe: Probe) -> tuple[str, str]:
    """(full source line, short file:line) of a probe."""
    if probe.source is None:
        return "", ""
    return str(probe.source), probe.source.short()


def _value(v: float) -> str:
    return "nan" if math.isnan(v) else "inf"


def _largest(values: list[float], slots) -> float | None:
    finite = [abs(values[s]) for s in slots if math.isfinite(values[s])]
    return max(finite) if finite else None


def _forward_event(
    table: ProbeTable, values: list[float], i: int, step: int, scale: float
) -> OverflowEvent:
    probe = table.forward[i]
    pins, note = _forward_pins(table, probe, i)
    return OverflowEvent(
        step,
        scale,
        "forward",
        probe.kind,
        probe.label,
        probe.op,
        _dtype(probe.dtype),
        probe.module,
        *_where(probe),
        _value(values[i]),
        _largest(values, probe.inputs) if probe.inputs else None,
        tuple(table.forward[j].label for j in probe.inputs),
        tuple(table.forward[c].label for c in table.consumers[i]) if probe.kind == "cast" else (),
        pins,
        note,
    )


def _backward_event(
    table: ProbeTable, values: list[float], slot: int, step: int, scale: float
) -> OverflowEvent:
    """A gradient went non-finite first. A value's gradient has the value's dtype, so the fix is
    the forward's: the op itself in fp32, or, for a cast or a parameter copy, fp32 readers. At
    a loss scale above 1 that is the dynamic scaler's business (it backs off and retries), so
    nothing is pinned; at 1 the backward overflows on its own."""
    n = table.n_forward
    readers = _slot_readers(table, slot)
    if slot >= 2 * n:
        param = table.params[slot - 2 * n]
        probe = table.forward[param.placeholders[0]]
        kind, node, op, where = "gradient", param.name, "", ("", "")
        pins = _low_precision_pins(table, readers)
        note = "" if pins else "the ops reading the parameter already compute in float32"
    else:
        probe = table.forward[slot - n]
        kind, node, op, where = probe.kind, probe.label, probe.op, _where(probe)
        pins, note = _forward_pins(table, probe, slot - n)
    if scale > 1:
        pins, note = (
            (),
            (
                f"at loss scale {scale:g} the dynamic scaler backs off and retries; "
                "autofix pins only when the scale is down to 1"
            ),
        )
    return OverflowEvent(
        step,
        scale,
        "backward",
        kind,
        node,
        op,
        _dtype(probe.dtype),
        probe.module,
        *where,
        _value(values[slot]),
        _largest(values, [table.backward_slot(c) for c in readers]),
        (),
        tuple(table.forward[c].label for c in readers),
        pins,
        note,
    )


def _forward_pins(table: ProbeTable, probe: Probe, i: int) -> tuple[tuple[AmpPin, ...], str]:
    """What to pin for a forward root: the op itself if it computes in low precision; for a
    cast (or a low-precision parameter copy) that overflowed, the ops that asked for it."""
    if probe.kind in _NOTHING_TO_PIN:
        return (), _NOTHING_TO_PIN[probe.kind]
    if probe.kind in ("cast", "parameter copy"):
        pins = _low_precision_pins(table, table.consumers[i])
        return pins, "" if pins else "its readers already compute in float32"
    if probe.low_precision and probe.pin is not None:
        return (probe.pin,), ""
    return (), (
        f"it already computes in {_dtype(probe.dtype)}: the values themselves exceed "
        "its range, pinning cannot help"
    )


def _low_precision_pins(table: ProbeTable, readers) -> tuple[AmpPin, ...]:
    pins = []
    for c in readers:
        probe = table.forward[c]
        if probe.low_precision and probe.pin is not None and probe.pin not in pins:
            pins.append(probe.pin)
    return tuple(pins)


def _dtype(dtype: torch.dtype | None) -> str:
    return dtype_name(dtype) if dtype is not None else ""


# -- what users read --------------------------------------------------------------------------------


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

    @property
    def headroom(self) -> float:
        """dtype max / largest magnitude, value or gradient (inf when both stayed 0)."""
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
            "first; headroom = dtype max / largest magnitude so far)",
            f"{'node':<28} {'op':<24} {'dtype':<9} {'value amax':>11} {'grad amax':>11} "
            f"{'headroom':>9}  module",
        ]
        for r in self.tightest(20):
            lines.append(
                f"{r.node[:28]:<28} {r.op[:24]:<24} {r.dtype:<9} "
                f"{r.activation_amax:>11.4g} {r.gradient_amax:>11.4g} "
                f"{r.headroom:>9.3g}  {r.module}"
            )
        return "\n".join(lines)


def range_rows(table: ProbeTable, ranges: Sequence[float]) -> list[RangeRow]:
    """One row per low-precision forward value (casts and parameter copies included)."""
    rows = []
    for i, probe in enumerate(table.forward):
        if probe.low_precision and probe.kind in ("op", "cast", "parameter copy"):
            rows.append(
                RangeRow(
                    probe.label,
                    probe.op,
                    probe.module,
                    _dtype(probe.dtype),
                    float(ranges[i]),
                    float(ranges[table.backward_slot(i)]),
                    float(torch.finfo(probe.dtype).max),
                )
            )
    return rows


# -- the device record ------------------------------------------------------------------------------


class ForensicsState:
    """The tensors one compiled step writes its overflow record into (step layout group
    ``forensics``): ``count`` (overflowing steps, int64), ``ring`` (``RING_ROWS`` rows of step,
    scale and probe vector; row ``count % RING_ROWS`` is written next) and ``ranges`` (running
    largest finite magnitude per probe). The host reads them only when asked (``read``) or, for
    autofix and debug logging, polls ``count`` without waiting for the device (``poll``)."""

    def __init__(self, table: ProbeTable, device: torch.device):
        self.table = table
        self.count = torch.zeros((), dtype=torch.int64, device=device)
        self.ring = torch.full(
            (RING_ROWS, ROW_HEADER + table.size), math.nan, dtype=torch.float32, device=device
        )
        self.ranges = torch.zeros(table.size, dtype=torch.float32, device=device)
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

    def poll(self) -> int | None:
        """The overflow count as of a finished step, without waiting (None: not known yet)."""
        if self.count.device.type != "cuda":
            return int(self.count)
        if self._copied is None or not self._copied.query():
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

    def range_rows(self) -> list[RangeRow]:
        return range_rows(self.table, self.ranges.detach().cpu().tolist())
