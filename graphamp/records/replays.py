"""Python state build() writes on every call, replayed after each step as eager leaves it.

Some libraries keep tensors they compute in forward on their modules and read them back in the
same forward (torchvision's RAFT keeps its correlation pyramid in ``corr_block.corr_pyramid``).
Inside the step that is plain dataflow; what is left to do is the write itself: after eager's
call the attribute holds that call's tensors. Capture makes those tensors extra outputs of
the step (after build()'s own tensors, among ``CapturedForward``'s user outputs), and the
runtime puts them where build() put them after every call (``apply_replays``), as
torch.compile replays the side effects of a compiled frame. Python values among them (a list's
structure, flags) are the ones capture saw, the same on every call (capture checks that).
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch.utils._pytree
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch.utils._pytree as pytree

MISSING = object()  # an attribute or entry that does not exist (before, or after a delete)
TENSOR_SLOT = object()  # where a replayed value holds a tensor the step computes


@dataclass(frozen=True)
class Place:
    """Where a value lives on a user's object: ``vars(owner)[name]`` ("attribute"), one entry
    ``vars(owner)[name][key]`` of a dict ("entry"), or the whole contents of a list or set
    ``vars(owner)[name]`` changed in place ("contents"). A global's or a closure variable's
    dict entry (``metrics["ce"] = ce.detach()`` in build()) has ``namespace``: the module's
    globals, or the cell as ``guards.CellNamespace``, which hold ``name`` instead of
    ``vars(owner)`` (``owner`` is then the globals dict or the cell)."""

    owner: Any
    name: str
    kind: str  # "attribute" | "entry" | "contents"
    key: Any = None
    label: str = ""  # how the user names the owner ("self.model.corr_block")
    namespace: Any = field(default=None, compare=False)

    def describe(self) -> str:
        if self.namespace is not None:  # the label names the variable: "global metrics (...)"
            return f"{self.label}[{self.key!r}]"
        if self.kind == "entry":
            return f"{self.label}.{self.name}[{self.key!r}]"
        return f"{self.label}.{self.name}"

    def holder(self) -> Any:
        """What holds ``name``: ``vars(owner)``, or the namespace of a global or closure."""
        return vars(self.owner) if self.namespace is None else self.namespace

    def read(self) -> Any:
        holder = self.holder()
        if self.kind == "entry":
            return holder.get(self.name, {}).get(self.key, MISSING)
        value = holder.get(self.name, MISSING)
        if self.kind == "contents" and value is not MISSING:
            return list(value)
        return value

    def write(self, value: Any) -> None:
        """Put ``value`` there as build() did (MISSING deletes), bypassing any ``__setattr__``
        (the snapshot is of ``vars``: a module's routing of tensors to buffers is already
        reflected in which dict holds them)."""
        holder = self.holder()
        if self.kind == "entry":
            table = holder.get(self.name)
            if value is MISSING:
                table.pop(self.key, None)
            else:
                table[self.key] = value
        elif self.kind == "contents":
            container = holder.get(self.name)
            container.clear()
            if isinstance(container, list):
                container.extend(value)
            else:
                container.update(value)
        elif value is MISSING:
            holder.pop(self.name, None)
        else:
            holder[self.name] = value


@dataclass(frozen=True)
class StateReplay:
    """One place build() writes on every call, and the value's structure: ``template`` holds
    TENSOR_SLOT where the step's output tensors go (``num_tensors`` of them), every other leaf
    as capture saw it."""

    place: Place
    spec: pytree.TreeSpec
    template: tuple[Any, ...]

    @property
    def num_tensors(self) -> int:
        return sum(1 for leaf in self.template if leaf is TENSOR_SLOT)

    def value(self, tensors: Sequence[Any]) -> Any:
        it = iter(tensors)
        leaves = [next(it) if leaf is TENSOR_SLOT else leaf for leaf in self.template]
        return pytree.tree_unflatten(leaves, self.spec)


def apply_replays(replays: Sequence[StateReplay], tensors: Sequence[Any]) -> None:
    """Write each replayed value, its tensors taken in order from ``tensors``."""
    start = 0
    for replay in replays:
        end = start + replay.num_tensors
        replay.place.write(replay.value(tensors[start:end]))
        start = end
