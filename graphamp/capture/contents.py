"""A container build() read, kept as a guard by its contents: ``{"w": 0.5, "act": F.gelu}``.

``reads.guard_form`` keeps a container of plain values (numbers, strings, flags) as a copy and
compares it by equality at every call. A container that also holds functions, modules or
tensors (a dict of hyperparameters with an activation; a list of layers; a table of
functions) cannot be copied (a tensor would be copied, a module's equality is identity
anyway): ``Contents`` keeps its structure with the plain values copied and the other objects by
reference, and is equal to a container of the same shape whose plain values are equal and
whose other values are the same objects. So an entry changed in place, of any kind, is seen.
Mappings that are not dicts (``os.environ``) are kept the same way.

Every container is kept so, whatever its size, up to ``SIZE_LIMIT`` entries (a container
larger than that is compared by identity, and ``reads`` says so in a warning): a compare of
100,000 plain values costs about a millisecond per call, which the INFO line of a build that
guards one that large states (``reads.log_large_guards``).
"""

from __future__ import annotations

import argparse
import collections.abc
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


def numpy_values(value: Any) -> ArrayCopy | None:
    """A copy of a numpy array of numbers, bools or strings (not objects) of at most
    ``SIZE_LIMIT`` values, kept to compare by value: a NumPy array build() reads
    (``float(WEIGHTS[k])``) and the loop changes in place; None for anything else."""
    numpy = sys.modules.get("numpy")
    if numpy is None or not isinstance(value, numpy.ndarray):
        return None
    if value.dtype.hasobject or value.size > SIZE_LIMIT:
        return None
    return ArrayCopy(value.copy())


@dataclasses.dataclass(frozen=True, eq=False)
class ArrayCopy:
    """A numpy array's values as recorded: equal to an array of the same dtype and shape that
    holds the same values (NaN where it held NaN)."""

    array: Any
    # numpy defers ``array == copy`` to ``ArrayCopy.__eq__`` (instead of comparing elementwise)
    __array_ufunc__ = None
    __hash__ = None  # type: ignore[assignment]

    def __eq__(self, other: object) -> bool:
        numpy = sys.modules["numpy"]
        a = self.array
        if not isinstance(other, numpy.ndarray) or (other.dtype, other.shape) != (a.dtype, a.shape):
            return False
        return bool(numpy.array_equal(other, a, equal_nan=a.dtype.kind in "fc"))


def is_record(value: Any) -> bool:
    """A dataclass object or a namespace: an object that is its fields."""
    return (dataclasses.is_dataclass(value) and not isinstance(value, type)) or isinstance(
        value, _RECORDS
    )


SIZE_LIMIT = 1 << 20  # entries in all, nested ones included, kept by contents at most


def items_of(value: Any) -> list[tuple[Any, Any]] | None:
    """(key, value) of a container's entries (``None`` keys for a sequence or set); None for
    anything that is not a mapping (a dict, a subclass of dict, ``os.environ``), list, tuple,
    set, dataclass object or namespace."""
    if is_record(value):  # first: a dataclass that is also a dict (transformers' ModelOutput,
        # diffusers' BaseOutput) holds its fields, tensors included, before its entries
        return list(fields_of(value).items())
    if isinstance(value, dict):  # an OrderedDict, an attribute dict of hyperparameters too
        return list(value.items())
    if isinstance(value, collections.abc.Mapping) and not _is_torch_object(value):
        try:
            return list(value.items())
        except Exception:  # a mapping whose items cannot be listed: not kept by contents
            return None
    if type(value) in (list, set, tuple, frozenset):
        return [(None, v) for v in value]
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


def _is_torch_object(value: Any) -> bool:
    """torch's own mappings (a module's ``_parameters``, a ParameterDict) are state the
    structure key and the step's inputs track, not settings."""
    module = type(value).__module__
    return module == "torch" or module.startswith("torch.")


def count_entries(value: Any) -> tuple[int, int] | None:
    """(plain values, other objects) among a container's leaves, nested containers walked;
    None for what is not a container, one with a key that is not plain, or one past
    ``SIZE_LIMIT`` entries. A container that holds itself, or one holding it (a tree whose
    nodes know their parent), counts the way back as an object (kept by identity)."""
    return _count(value, SIZE_LIMIT, frozenset())


def _count(value: Any, limit: int, path: frozenset[int]) -> tuple[int, int] | None:
    items = items_of(value)
    if items is None or len(items) > limit:
        return None
    path = path | {id(value)}  # the containers from the top to this one
    plain = other = 0
    for key, item in items:
        limit -= 1
        if not is_plain(key):
            return None
        if is_plain(item):
            plain += 1
            continue
        walk = items_of(item) is not None and id(item) not in path
        inner = _count(item, limit, path) if walk else None
        if inner is None:
            other += 1
            continue
        plain, other, limit = plain + inner[0], other + inner[1], limit - sum(inner)
        if limit < 0:
            return None
    return plain, other


class Contents:
    """A container's snapshot: plain values copied, other objects by reference (module
    docstring); ``==`` to a container that still holds the same."""

    __hash__ = None  # type: ignore[assignment]

    def __init__(self, value: Any, path: frozenset[int] = frozenset()) -> None:
        self.kind = type(value)
        items = items_of(value) or []
        path = path | {id(value)}  # a way back up (a cycle) is kept by identity
        self.items = [(k, Contents(v, path) if _walked(v, path) else v) for k, v in items]

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
        if issubclass(self.kind, collections.abc.Mapping):  # whatever the order of the keys
            by_key = dict(now)
            return all(k in by_key and _same(v, by_key[k]) for k, v in self.items)
        return all(
            k == k_now and _same(v, v_now) for (k, v), (k_now, v_now) in zip(self.items, now)
        )

    def __repr__(self) -> str:
        if issubclass(self.kind, collections.abc.Mapping):
            return "{" + ", ".join(f"{k!r}: {v!r}" for k, v in self.items) + "}"
        if self.kind in (list, tuple):
            inner = ", ".join(repr(v) for _, v in self.items)
            return f"[{inner}]" if self.kind is list else f"({inner})"
        if self.kind in (set, frozenset):
            return "{" + ", ".join(repr(v) for _, v in self.items) + "}"
        fields = ", ".join(f"{k}={v!r}" for k, v in self.items)
        return f"{self.kind.__name__}({fields})"


def _walked(value: Any, path: frozenset[int]) -> bool:
    return items_of(value) is not None and not is_plain(value) and id(value) not in path


def _same(kept: Any, now: Any) -> bool:
    if isinstance(kept, Contents):
        return kept == now
    if is_plain(kept):
        try:
            return type(now) is type(kept) and bool(now == kept)
        except Exception:  # a value that cannot say whether it is equal has changed
            return False
    return now is kept
