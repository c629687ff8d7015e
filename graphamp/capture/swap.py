"""Swap traced values into the user's modules for the length of a trace, and always put the
user's own tensors back.

``torch.func.functional_call(..., tie_weights=True)`` restores an entry reachable under two
names with the swapped-in value (pytorch/pytorch#164759), leaving fake tensors in the user's
model after a failed capture. Here every place that holds a parameter or buffer (every module's
``_parameters`` / ``_buffers`` entry, however many names reach that module) is recorded with
the object it held, replaced by the traced value of that object (tied weights stay tied), and
restored from the record in a ``finally`` block.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn

Slot = tuple[dict, str, torch.Tensor]  # (the dict holding a tensor, its key, the tensor)


def state_slots(root: nn.Module) -> list[Slot]:
    """Every parameter and buffer entry of every module under ``root`` (each module once)."""
    slots = []
    for module in root.modules():
        for store in (module._parameters, module._buffers):
            slots += [(store, key, t) for key, t in store.items() if t is not None]
    return slots


@contextlib.contextmanager
def swapped(slots: list[Slot], replacement: dict[int, torch.Tensor]) -> Iterator[None]:
    """Each slot holds ``replacement[id(its tensor)]`` inside the block, its own tensor after."""
    try:
        for store, key, original in slots:
            store[key] = replacement[id(original)]
        yield
    finally:
        for store, key, original in slots:
            store[key] = original
