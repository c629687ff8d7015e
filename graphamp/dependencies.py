"""What a compiled step depends on besides its inputs, checked at every call.

A compiled step bakes in the module tree it was captured from (which modules, parameters and
buffers exist and which are in training mode), each optimizer's param groups (which parameters,
``requires_grad``, structural options such as momentum on/off), the config and the scaler's
settings. ``StructureKey`` turns all of that into one hashable key per call; the Graph's cache of
compiled steps is keyed on it, so any change rebuilds the step, and ``describe_change`` names
what changed for the log.

Walking every module's children at every call would cost tens of microseconds on a large
model, so the tree's identity fingerprint is recomputed only when torch registered a module,
parameter or buffer anywhere since the last look (global registration hooks bump an epoch) or
when a module lost a child, a parameter or a buffer (the per-call sizes below).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Iterable

import torch.nn as nn
from torch.nn.modules import module as module_hooks

_epoch = itertools.count()
_current = [next(_epoch)]


def _bump(*args: Any) -> None:
    _current[0] = next(_epoch)


# Any assignment of a module, parameter or buffer anywhere (model.fc = nn.Linear(...),
# seq.append(...), model.weight = nn.Parameter(...)) moves the epoch; graphamp's own capture
# writes the dicts directly and moves nothing.
module_hooks.register_module_module_registration_hook(_bump)
module_hooks.register_module_parameter_registration_hook(_bump)
module_hooks.register_module_buffer_registration_hook(_bump)

PARTS = ("modules", "module modes", "optimizers", "config", "grad scaler")


class StructureKey:
    """The structure part of a Graph's cache key (see the module docstring)."""

    def __init__(self) -> None:
        self._epoch = -1
        self._roots: tuple = ()
        self._modules: list[nn.Module] = []
        self._fingerprint: tuple = ()

    def __call__(self, registered: dict[str, nn.Module], optimizers: Iterable[Any],
                 config: Any, scaler: Any) -> tuple:
        roots = tuple(registered.items())
        if self._epoch != _current[0] or roots != self._roots:
            self._refresh(roots)
        sizes_and_modes = tuple((m.training, len(m._modules), len(m._parameters), len(m._buffers))
                                for m in self._modules)
        return (self._fingerprint, sizes_and_modes,
                tuple(slot.structure() for slot in optimizers), config,
                (id(scaler), scaler.settings()) if scaler is not None else None)

    def _refresh(self, roots: tuple) -> None:
        self._epoch, self._roots = _current[0], roots
        self._modules = [m for _, top in roots for m in top.modules()]
        self._fingerprint = tuple(
            (name, id(top), tuple((path, id(m), tuple(map(id, m._parameters.values())),
                                   tuple(map(id, m._buffers.values())))
                                  for path, m in top.named_modules()))
            for name, top in roots)


def describe_change(old: tuple, new: tuple) -> str:
    """Which parts of two structure keys differ, in words."""
    changed = [part for part, a, b in zip(PARTS, old, new) if a != b]
    words = {"modules": "the registered modules changed (a layer, parameter or buffer was "
                        "added, removed or replaced)",
             "module modes": "a module switched between train() and eval(), or lost a child",
             "optimizers": "an optimizer's param groups changed (parameters, requires_grad or "
                           "options such as momentum)",
             "config": "the graph's config changed" + _config_fields(old[3], new[3]),
             "grad scaler": "the grad scaler's settings changed"}
    return "; ".join(words[c] for c in changed) or "nothing the key records"


def _config_fields(old: Any, new: Any) -> str:
    """' (field, field)': the settings two config snapshots differ in (AMP pins, overflow
    tracing, backend, ...), or '' when they are not dataclasses."""
    if not (dataclasses.is_dataclass(old) and dataclasses.is_dataclass(new)):
        return ""
    fields = [f.name for f in dataclasses.fields(old)
              if getattr(old, f.name) != getattr(new, f.name)]
    return f" ({', '.join(fields)})" if fields else ""
