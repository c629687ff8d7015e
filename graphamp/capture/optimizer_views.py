"""An optimizer's param groups, and its LR scheduler's last lrs, as build()'s code sees them
while it is traced.

An optimizer is not watched as a user's object is: its param groups change at every scheduler
step and its update reads them as step inputs (``step/optimizer_update.py``). But build() may
read an entry itself (``lr = self.opt.param_groups[0]["lr"]`` to log it or to weigh a loss),
and that is a Python value the trace keeps: it was baked in, the first call's lr returned at
every step. Entries are read by subscript, which no attribute hook sees; so while build() runs
each group of an optimizer the capture reaches is replaced, in its list, by a ``GroupView``:
a copy of the group (the same ``params`` list) that reports the entries the user's code reads
(``__getitem__``, ``get``, ``items``, ``values``) as reads of the group's own dict. They are
guards as any read is, and a float among them is lifted into a step input after its first
change (an lr a scheduler sets compiles once more, then never). The list holds the groups
again when the capture ends.

build() setting an entry is refused: the step feeds the update the param groups as they are
when it is called, before build() runs, so the value would reach the update one step late,
and only at capture. A write of the value already there is let through.

An LR scheduler's ``get_last_lr()`` (Lightning's ``self.lr_schedulers().get_last_lr()[0]``)
returns a list its own method reads, which the user's code never reads as an attribute; while
a capture runs the method returns, to the user's code, a ``RecordedList`` whose items read are
reported as reads of ``scheduler._last_lr[i]`` (``LastLrs``), lifted as a group's lr is.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from typing import Any, Callable, Iterator, NoReturn

import torch

from ..errors import CaptureError
from ..torchkit.process_state import SharedPatch

# reports a read: (the group's own dict, its key, the value, the label, the reader's frame)
OnRead = Callable[[dict, Any, Any, str, "types.FrameType | None"], None]


class GroupView(dict):
    """One param group while build() is traced: its entries, copied; reads reported."""

    def __init__(self, group: dict, label: str, on_read: OnRead) -> None:
        super().__init__(group)
        self._group, self._label, self._on_read = group, label, on_read

    def __getitem__(self, key: Any) -> Any:
        value = dict.__getitem__(self, key)
        self._report(key, value, sys._getframe(1))
        return value

    def get(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            return default
        value = dict.__getitem__(self, key)
        self._report(key, value, sys._getframe(1))
        return value

    def items(self):  # type: ignore[override]
        frame = sys._getframe(1)
        for key, value in dict.items(self):
            self._report(key, value, frame)
        return dict.items(self)

    def values(self):  # type: ignore[override]
        frame = sys._getframe(1)
        for key, value in dict.items(self):
            self._report(key, value, frame)
        return dict.values(self)

    def __setitem__(self, key: Any, value: Any) -> None:
        if key in self and dict.__getitem__(self, key) is value:
            return
        self._refuse(f"sets {self._entry(key)} to {value!r}")

    def __delitem__(self, key: Any) -> None:
        self._refuse(f"deletes {self._entry(key)}")

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self._refuse(f"sets {self._entry(key)} to {default!r}")
        return self[key]

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def pop(self, key: Any, *_default: Any) -> Any:
        return self._refuse(f"removes {self._entry(key)}")

    def popitem(self) -> tuple:
        return self._refuse(f"removes an entry of {self._label}")

    def clear(self) -> None:
        self._refuse(f"clears {self._label}")

    def __ior__(self, other: Any) -> GroupView:  # type: ignore[override,misc]
        self.update(other)
        return self

    def __reduce_ex__(self, protocol: Any) -> tuple:
        return dict, (dict(self),)  # copied or pickled: the group as a plain dict

    def _report(self, key: Any, value: Any, frame: types.FrameType | None) -> None:
        if key != "params":  # the parameters are the step's inputs
            self._on_read(self._group, key, value, self._entry(key), frame)

    def _entry(self, key: Any) -> str:
        return f"{self._label}[{key!r}]"

    def _refuse(self, what: str) -> NoReturn:
        raise CaptureError(
            f"build() {what}: the step passes the optimizer its param groups as they are when "
            "the step is called, before build() runs, so a value build() sets would reach the "
            "update one step late, and only at capture. Set it before calling the step (in "
            "the training loop), or let a scheduler set it (add_optimizer(opt, lr_sch=...))"
        )


def holds_param_groups(value: Any) -> bool:
    """An optimizer, or a wrapper that keeps one's groups (Lightning's) or serves them from a
    property (accelerate's ``AcceleratedOptimizer``)."""
    return _groups_of(value) is not None


def _groups_of(value: Any) -> list | None:
    """The param groups list ``value`` holds or serves, read past any recording hook."""
    try:
        groups = object.__getattribute__(value, "__dict__").get("param_groups")
    except AttributeError:
        groups = None
    if groups is None and isinstance(vars(type(value)).get("param_groups"), property):
        try:
            groups = vars(type(value))["param_groups"].__get__(value, type(value))
        except Exception:  # a wrapper not set up yet
            return None
    return groups if isinstance(groups, list) else None


def view_param_groups(
    holder: Any, label: str, stack: contextlib.ExitStack, on_read: OnRead, seen: set[int]
) -> None:
    """Put a ``GroupView`` in place of each group of ``holder``'s param groups until ``stack``
    closes (once per list: an optimizer and its wrapper share one)."""
    groups = _groups_of(holder)
    if groups is None or id(groups) in seen:
        return
    seen.add(id(groups))
    stack.enter_context(_viewed(groups, label, on_read))


@contextlib.contextmanager
def _viewed(groups: list, label: str, on_read: OnRead) -> Iterator[None]:
    originals = list(groups)
    groups[:] = [
        GroupView(g, f"{label}.param_groups[{i}]", on_read) if type(g) is dict else g
        for i, g in enumerate(originals)
    ]
    try:
        yield
    finally:
        groups[:] = originals


class LastLrs:
    """An LR scheduler's last lrs as a namespace of their indices, named as strings (what
    ``get_last_lr()[i]`` returns now: the scheduler puts a new list there at every step)."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner  # the scheduler

    def get(self, index: str, default: Any = None) -> Any:
        lrs = getattr(self.owner, "_last_lr", None)
        return lrs[int(index)] if isinstance(lrs, list) and int(index) < len(lrs) else default

    def __setitem__(self, index: str, value: Any) -> None:
        self.owner._last_lr[int(index)] = value

    def pop(self, index: str, default: Any = None) -> Any:
        return self.get(index, default)  # the list keeps its length


class RecordedList(list):
    """``get_last_lr()``'s list as the user's code gets it during a capture: its items read
    are reported (``on_item(index, value)``)."""

    def __init__(self, items: list, on_item: Callable[[int, Any], None]) -> None:
        super().__init__(items)
        self._on_item = on_item

    def __getitem__(self, index: Any) -> Any:
        value = list.__getitem__(self, index)
        for i in range(len(self))[index] if isinstance(index, slice) else [index % len(self)]:
            self._on_item(i, list.__getitem__(self, i))
        return value

    def __iter__(self):  # type: ignore[override]
        for i, value in enumerate(list.__iter__(self)):
            self._on_item(i, value)
            yield value

    def __reduce_ex__(self, protocol: Any) -> tuple:
        return list, (list(self),)  # copied or pickled: a plain list


OnLastLrs = Callable[[Any, list, "types.FrameType | None"], list]


def last_lrs_patch(on_call: OnLastLrs) -> SharedPatch:
    """A patch of ``LRScheduler.get_last_lr`` (applied while captures run, shared by their
    threads): it returns what ``on_call(scheduler, its list, the caller's frame)`` makes of
    the list."""
    base = torch.optim.lr_scheduler.LRScheduler
    original = vars(base)["get_last_lr"]

    @functools.wraps(original)
    def get_last_lr(self: Any) -> list:
        return on_call(self, original(self), sys._getframe(1))

    return SharedPatch(base, "get_last_lr", get_last_lr)
