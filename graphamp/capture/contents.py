"""A container of settings that also holds objects, kept as a guard: ``{"w": 0.5, "act": F.gelu}``.

``reads.guard_form`` keeps a container of plain values (numbers, strings, flags) as a copy and
compares it by equality at every call. A dict of hyperparameters often holds a function, a
module or a tensor beside its numbers; a copy cannot be made of those (a tensor would be copied,
a module's equality is identity anyway), so such a container was compared by identity only, and
a number changed in it in place was baked into the step. ``Contents`` keeps its structure with
the plain values copied and the other objects by reference: it is equal to a container of the
same shape whose plain values are equal and whose other values are the same objects.

Only containers holding at least one plain value are kept this way: a container of objects alone
is a registry or a cache (a library's table of kernels filled as it is used), not settings, and
stays compared by identity.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import sys
import types
from typing import Any

import torch

_PLAIN = (type(None), bool, int, float, complex, str, bytes, enum.Enum, torch.dtype, torch.device)
_RECORDS = (argparse.Namespace, types.SimpleNamespace)  # objects that are their fields


def is_plain(value: Any) -> bool:
    """Immutable values compared by equality (a tuple of them too; numpy's scalars, which a
    schedule made with numpy gives: ``np.linspace(0, 1, n, dtype=np.float32)[step]``)."""
    if isinstance(value, _PLAIN) or _is_numpy_scalar(value):
        return True
    return isinstance(value, (tuple, frozenset)) and all(map(is_plain, value))


def _is_numpy_scalar(value: Any) -> bool:
    numpy = sys.modules.get("numpy")  # never imported here: a value of it means it is
    return numpy is not None and isinstance(value, numpy.generic)


def is_record(value: Any) -> bool:
    """A dataclass object or a namespace: an object that is its fields."""
    return (dataclasses.is_dataclass(value) and not isinstance(value, type)) or isinstance(
        value, _RECORDS
    )


def items_of(value: Any) -> list[tuple[Any, Any]] | None:
    """(key, value) of a container's entries (``None`` keys for a sequence or set); None for
    anything that is not a dict (or a subclass of dict), list, tuple, set, dataclass object or
    namespace."""
    if isinstance(value, dict):  # an OrderedDict, an attribute dict of hyperparameters too
        return list(value.items())
    if type(value) in (list, set, tuple, frozenset):
        return [(None, v) for v in value]
    if is_record(value):
        return list(fields_of(value).items())
    return None


def fields_of(record: Any) -> dict:
    """A dataclass object's or namespace's fields by name: its ``__dict__`` (the object's own
    dict, not a copy), or, for a dataclass with ``slots=True``, its fields that are set."""
    try:
        return vars(record)
    except TypeError:  # no __dict__: a slotted dataclass
        unset = object()
        values = {f.name: getattr(record, f.name, unset) for f in dataclasses.fields(record)}
        return {name: v for name, v in values.items() if v is not unset}


def plain_contents(value: Any, limit: int) -> bool:
    """Is ``value`` a container of at most ``limit`` entries in all whose keys and values are
    all plain (a dict of hyperparameters)?"""
    counts = _count(value, limit)
    return counts is not None and counts[1] == 0


def mixed_contents(value: Any, limit: int) -> bool:
    """Is ``value`` a container of at most ``limit`` entries in all, whose keys are plain, that
    holds plain values and other objects beside them?"""
    counts = _count(value, limit)
    return counts is not None and counts[0] > 0 and counts[1] > 0


def _count(value: Any, limit: int) -> tuple[int, int] | None:
    """(plain values, other objects) among a container's leaves; None for what is not a
    container, one with a key that is not plain, or past ``limit``. A nested container that
    holds plain values is walked; one that holds none (a list of batches, a table of
    functions) is one object, kept by identity: comparing its every item at every call would
    cost more than the step of a small model."""
    items = items_of(value)
    if items is None:
        return None
    plain = other = 0
    for key, item in items:
        limit -= 1
        if limit < 0 or not is_plain(key):
            return None
        if is_plain(item):
            plain += 1
            continue
        inner = _settings_in(item, limit)
        if inner is None:
            other += 1
        else:
            plain, other, limit = plain + inner[0], other + inner[1], limit - sum(inner)
    return plain, other


def _settings_in(value: Any, limit: int) -> tuple[int, int] | None:
    """``_count`` of a nested container that holds plain values or nothing (a list the loop
    may fill); None for anything else."""
    if is_plain(value) or items_of(value) is None:
        return None
    counts = _count(value, limit)
    return counts if counts is not None and (counts[0] > 0 or counts[1] == 0) else None


class Contents:
    """A container's snapshot: plain values copied, other objects by reference (module
    docstring); ``==`` to a container that still holds the same."""

    __hash__ = None  # type: ignore[assignment]

    def __init__(self, value: Any, limit: int = 256) -> None:
        self.kind = type(value)
        items = items_of(value) or []
        self.items = [
            (k, Contents(v, limit) if _settings_in(v, limit) is not None else v) for k, v in items
        ]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Contents):
            return other is self
        if type(other) is not self.kind:
            return False
        now = items_of(other) or []
        if len(now) != len(self.items):
            return False
        if self.kind in (set, frozenset):  # sets hold plain values only (hashable)
            return set(other) == {v for _, v in self.items}  # type: ignore[call-overload]
        if issubclass(self.kind, dict):  # as dicts compare: whatever the order of the keys
            by_key = dict(now)
            return all(k in by_key and _same(v, by_key[k]) for k, v in self.items)
        return all(
            k == k_now and _same(v, v_now) for (k, v), (k_now, v_now) in zip(self.items, now)
        )

    def __repr__(self) -> str:
        if issubclass(self.kind, dict):
            return "{" + ", ".join(f"{k!r}: {v!r}" for k, v in self.items) + "}"
        if self.kind in (list, tuple):
            inner = ", ".join(repr(v) for _, v in self.items)
            return f"[{inner}]" if self.kind is list else f"({inner})"
        if self.kind in (set, frozenset):
            return "{" + ", ".join(repr(v) for _, v in self.items) + "}"
        fields = ", ".join(f"{k}={v!r}" for k, v in self.items)
        return f"{self.kind.__name__}({fields})"


def _same(kept: Any, now: Any) -> bool:
    if isinstance(kept, Contents):
        return kept == now
    if is_plain(kept):
        try:
            return type(now) is type(kept) and bool(now == kept)
        except Exception:  # a value that cannot say whether it is equal has changed
            return False
    return now is kept
