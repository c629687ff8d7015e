"""What build() changed on the user's Python objects, found by comparing before and after.

Capture watches the registered modules and the Graph itself. Before build() runs, each watched
object's ``vars`` are copied, and so are the contents of every dict, list and set among them
(a module's ``_buffers`` and hook dicts, a list a library appends to). After build(), every
difference is one ``Change`` at a ``Place`` (``records/replays.py``): an attribute rebound,
added or deleted; a dict entry set or removed; a list's or set's contents changed in place.
``restore`` puts everything back exactly, the same objects in the same containers.

Which changes are dataflow already seen by the trace is decided here too: a registered
buffer's new value (the trace outputs it and the step writes it in place) and torch's own
private caches (``nn.LSTM``'s ``_flat_weights``, rebuilt by the next eager forward) are not
changes of the user's state.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn as nn

from ..records.frames import UserFrame
from ..records.replays import MISSING, Place
from ..torchkit.fxutil import current_user_frame
from ..torchkit.process_state import SharedPatch
from .reads import held_configs


@dataclass
class Change:
    """One place build() changed: its value before and after (MISSING where there was none),
    and where build() first wrote it when known."""

    place: Place
    before: Any
    after: Any
    frame: UserFrame | None = None

    def where(self) -> str:
        return f" at {self.frame}" if self.frame is not None else ""


@dataclass
class _Snapshot:
    label: str
    obj: Any
    attrs: dict[str, Any]
    contents: dict[str, Any]  # attribute name -> copy of the container's contents


def _copy_contents(value: Any) -> Any:
    return dict(value) if isinstance(value, dict) else list(value)


def _items(container: Any) -> list:
    """A container's contents as a list: a dict's (key, value) pairs, in order."""
    return list(container.items()) if isinstance(container, dict) else list(container)


def _same_items(old: Any, container: Any) -> bool:
    """Does ``container`` hold what the copy ``old`` holds: the same objects (by identity)
    in the same order (a set: equal members)?"""
    if isinstance(container, set):
        return set(old) == container
    a, b = _items(old), _items(container)
    if isinstance(container, dict):
        return len(a) == len(b) and all(k1 == k2 and v1 is v2 for (k1, v1), (k2, v2) in zip(a, b))
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _snapshot(label: str, obj: Any) -> _Snapshot:
    attrs = dict(vars(obj))
    contents = {
        name: _copy_contents(v)
        for name, v in attrs.items()
        if type(v) in (dict, list, set) or isinstance(v, dict)
    }
    return _Snapshot(label, obj, attrs, contents)


def _changes(snap: _Snapshot, frames: dict) -> list[Change]:
    """The places of ``snap.obj`` that differ from the snapshot now."""
    now, obj, label = vars(snap.obj), snap.obj, snap.label
    out = []
    for name in sorted(now.keys() | snap.attrs.keys()):
        before, after = snap.attrs.get(name, MISSING), now.get(name, MISSING)
        if before is not after:
            place = Place(obj, name, "attribute", label=label)
            out.append(Change(place, before, after, frames.get((id(obj), name))))
        elif name in snap.contents and not _same_items(snap.contents[name], after):
            out += _content_changes(snap, name, frames)
        elif (id(obj), name) in frames:
            # set again to the value it had: a write all the same, which the runtime replays
            # (another step, for other sizes, may have left another value there meanwhile)
            place = Place(obj, name, "attribute", label=label)
            out.append(Change(place, before, after, frames[(id(obj), name)]))
    return out


def _content_changes(snap: _Snapshot, name: str, frames: dict) -> list[Change]:
    """A container changed in place: one change per dict entry (a reordering alone is no
    change: restore puts the order back), or the whole contents of a list or set."""
    old, container, obj = snap.contents[name], snap.attrs[name], snap.obj
    if not isinstance(container, dict):
        place = Place(obj, name, "contents", label=snap.label)
        return [Change(place, list(old), list(container))]
    out = []
    for key in [*container.keys(), *(k for k in old if k not in container)]:
        before, after = old.get(key, MISSING), container.get(key, MISSING)
        if before is not after:
            place = Place(obj, name, "entry", key, snap.label)
            out.append(Change(place, before, after, frames.get((id(obj), key))))
    return out


def _restore(snap: _Snapshot) -> None:
    """``snap.obj`` exactly as when the snapshot was taken: the same attribute objects, each
    container holding what it held, in the same order."""
    for name, old in snap.contents.items():
        container = snap.attrs[name]
        if not _same_items(old, container):
            container.clear()
            if isinstance(container, list):
                container.extend(old)
            else:
                container.update(old)
    now = vars(snap.obj)
    if now.keys() != snap.attrs.keys() or any(now[k] is not v for k, v in snap.attrs.items()):
        now.clear()
        now.update(snap.attrs)


def _is_torch_internal(obj: Any) -> bool:
    return isinstance(obj, nn.Module) and type(obj).__module__.startswith("torch.")


def _same_layout(before: Any, after: Any) -> bool:
    """Two tensors of the same static shape and dtype (a symbolic size is never the same: the
    step's state has fixed sizes). Compared without guarding on symbolic sizes."""
    if not (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)):
        return False
    if before.dtype != after.dtype or before.dim() != after.dim():
        return False
    return all(type(a) is int and a == b for a, b in zip(after.shape, before.shape))


def _is_state_dataflow(change: Change) -> bool:
    """Changes the trace already turns into dataflow, or torch's own caches."""
    place = change.place
    if place.kind == "entry" and place.name in ("_buffers", "_parameters"):
        # a registered buffer given a new value of its shape: the trace outputs it, the step
        # writes it in place; one of another shape (a cache that grows) is rebound state
        return _same_layout(change.before, change.after)
    # torch's private caches only: a name the user writes on a torch module (a call counter on
    # an nn.Sequential) is the user's state like any other
    return (
        place.kind == "attribute" and place.name.startswith("_") and _is_torch_internal(place.owner)
    )


def watched_objects(root: nn.Module) -> list[tuple[str, Any]]:
    """The objects whose Python state capture watches, by the names users know them by: the
    modules under ``root`` (a BuildRoot: the registered modules), the transformers configs they
    hold (a model's forward may write one: BERT sets ``config.problem_type`` on its first
    call), and the Graph itself."""
    watched: list[tuple[str, Any]] = [
        (f"self.{n}", m) for n, m in root.named_modules() if m is not root
    ]
    watched += held_configs(watched)
    owner = getattr(root, "owner", None)  # the Graph (BuildRoot.owner)
    return watched + ([("self", owner)] if owner is not None else [])


class StateWatch:
    """Snapshots of the watched objects, taken when ``recording`` starts; ``changes`` lists
    what build() changed since; leaving ``recording`` puts everything back."""

    def __init__(self, watched: list[tuple[str, Any]]):
        self.watched = [(label, obj) for label, obj in watched if hasattr(obj, "__dict__")]
        self._snapshots: list[_Snapshot] = []
        self._frames: dict = {}

    @contextlib.contextmanager
    def recording(self) -> Iterator[StateWatch]:
        self._snapshots = [_snapshot(label, obj) for label, obj in self.watched]
        with _recording_lines() as frames:
            self._frames = frames
            try:
                yield self
            finally:
                for snap in self._snapshots:
                    _restore(snap)

    def changes(self) -> list[Change]:
        """What build() changed on the user's objects (dataflow and torch's caches left out)."""
        found = [c for snap in self._snapshots for c in _changes(snap, self._frames)]
        return [c for c in found if not _is_state_dataflow(c)]


# -- where each module attribute is first written ----------------------------------------------

_local = threading.local()  # .lines: {(id(obj), name): UserFrame} for the capture in this thread


def _recording_setattr(self: nn.Module, name: str, value: Any) -> None:
    lines = getattr(_local, "lines", None)
    if lines is not None and (id(self), name) not in lines:
        lines[(id(self), name)] = current_user_frame()
    _PATCH.original(self, name, value)


_PATCH = SharedPatch(nn.Module, "__setattr__", _recording_setattr)


@contextlib.contextmanager
def _recording_lines() -> Iterator[dict]:
    """Where each module attribute is first written during the block (this thread's writes)."""
    with _PATCH.applied():
        previous = getattr(_local, "lines", None)
        _local.lines = {}
        try:
            yield _local.lines
        finally:
            _local.lines = previous
