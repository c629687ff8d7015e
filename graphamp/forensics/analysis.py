"""Analysis of one overflowing step's ring row: which value went non-finite first, and what to pin.

``analyse`` turns a row of the device record (``records/probes.py``: step, loss scale, probe
vector) into an ``OverflowEvent``: the first value (forward in topological order, then backward)
that went non-finite from finite inputs **and** whose non-finite value reached the loss or a
gradient. The second condition keeps the by-design infinities of attention masks
(``masked_fill(-inf)``, a ``finfo.min`` mask cast to fp16), which the softmax absorbs, from
being blamed.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..records.pins import AmpPin
from ..records.probes import ROW_HEADER, OverflowEvent, Probe, ProbeTable
from ..records.validate import dtype_name

__all__ = ["analyse", "dtype_label"]

_NOTHING_TO_PIN = {
    "input": "the batch holds non-finite values: a data fault, not an op's overflow",
    "parameter": "a parameter holds non-finite values: load or fix the weights",
    "buffer": "a buffer holds non-finite values",
    "constant": "a tensor build() reads holds non-finite values",
}


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
        step=step,
        scale=scale,
        phase="unknown",
        kind="",
        node="",
        op="",
        dtype="",
        module="",
        source="",
        location="",
        value="",
        input_amax=None,
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
    source, location = _where(probe)
    return OverflowEvent(
        step=step,
        scale=scale,
        phase="forward",
        kind=probe.kind,
        node=probe.label,
        op=probe.op,
        dtype=dtype_label(probe.dtype),
        module=probe.module,
        source=source,
        location=location,
        value=_value(values[i]),
        input_amax=_largest(values, probe.inputs) if probe.inputs else None,
        reads=tuple(table.forward[j].label for j in probe.inputs),
        consumers=(
            tuple(table.forward[c].label for c in table.consumers[i])
            if probe.kind == "cast"
            else ()
        ),
        pins=pins,
        note=note,
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
        step=step,
        scale=scale,
        phase="backward",
        kind=kind,
        node=node,
        op=op,
        dtype=dtype_label(probe.dtype),
        module=probe.module,
        source=where[0],
        location=where[1],
        value=_value(values[slot]),
        input_amax=_largest(values, [table.backward_slot(c) for c in readers]),
        reads=(),
        consumers=tuple(table.forward[c].label for c in readers),
        pins=pins,
        note=note,
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
        f"it already computes in {dtype_label(probe.dtype)}: the values themselves exceed "
        "its range, pinning cannot help"
    )


def _low_precision_pins(table: ProbeTable, readers) -> tuple[AmpPin, ...]:
    pins = []
    for c in readers:
        probe = table.forward[c]
        if probe.low_precision and probe.pin is not None and probe.pin not in pins:
            pins.append(probe.pin)
    return tuple(pins)


def dtype_label(dtype: torch.dtype | None) -> str:
    """A dtype's short name for reports, '' for None."""
    return dtype_name(dtype) if dtype is not None else ""
