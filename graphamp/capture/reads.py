"""The Python attributes build() reads at capture: what a compiled step assumes of them.

A compiled step is a snapshot of one run of build(): a dropout's ``p``, a norm's ``eps``, a loss's
``label_smoothing``, a flag forward() branches on are baked into it. While build() is traced,
every instance attribute read on a registered module, on the Graph and on a transformers config
held by one of them is recorded with its value (``records.guards.AttributeRead``); the program
runs only while those values hold. Reads are seen through a recording ``__getattribute__`` put on
those classes for the length of the capture (``patching.SharedPatch``); only the capturing
thread records, and only on the objects it watches.

Left out, each for a reason:
- what ``nn.Module.__init__`` itself sets (parameters, buffers, children, hooks, ``training``):
  the structure key already holds the module tree, the hook count and train/eval;
- tensors: parameters and buffers are step inputs and plain tensor attributes are lifted as live
  inputs (``cleanup.lift_constants``), so their values are never baked in;
- modules: the structure key holds the module tree by identity;
- dunder names (``__dict__``, ``__class__``): Python's machinery, not settings;
- what the Graph's own ``__init__`` set (its config, registry and runtime): the config is part
  of the structure key, the rest is graphamp's bookkeeping.
"""

from __future__ import annotations

import contextlib
import enum
import sys
import threading
from typing import Any, Iterator

import torch
import torch.nn as nn

from ..records.guards import AttributeRead
from .patching import SharedPatch

_MODULE_OWN = frozenset(vars(nn.Module()))  # what nn.Module.__init__ sets: see the docstring
_PLAIN = (type(None), bool, int, float, complex, str, bytes, enum.Enum, torch.dtype, torch.device)

_local = threading.local()  # .watch: {id(obj): (label, names left out)}, .reads: {key: read}


def _is_plain(value: Any) -> bool:
    """Immutable values compared by equality (a tuple of them too)."""
    if isinstance(value, _PLAIN):
        return True
    return isinstance(value, (tuple, frozenset)) and all(map(_is_plain, value))


def _record(obj: Any, name: str, value: Any) -> None:
    watch = _local.watch.get(id(obj))
    if watch is None or name.startswith("__") or (id(obj), name) in _local.reads:
        return
    label, left_out = watch
    namespace = object.__getattribute__(obj, "__dict__")
    # only instance attributes: a class attribute, property or method is not one of them
    if name in left_out or namespace.get(name, _record) is not value:
        return
    if isinstance(value, (torch.Tensor, nn.Module)):
        return
    snapshot = list(value) if type(value) is list and _is_plain(tuple(value)) else value
    _local.reads[(id(obj), name)] = AttributeRead(
        label=f"{label}.{name}",
        namespace=namespace,
        name=name,
        value=snapshot,
        by_value=_is_plain(value) or snapshot is not value,
    )


def _recording(original: Any) -> Any:
    def __getattribute__(self: Any, name: str) -> Any:  # noqa: N807 - the slot it fills
        value = original(self, name)
        if getattr(_local, "reads", None) is not None:
            _record(self, name, value)
        return value

    return __getattribute__


_patches: dict[type, SharedPatch] = {}


def _patch_for(cls: type) -> SharedPatch:
    """The recording ``__getattribute__`` of ``cls`` (made once per class): it wraps the one
    the class has, its own (transformers' configs define one) or inherited."""
    patch = _patches.get(cls)
    if patch is None:
        patch = _patches[cls] = SharedPatch(
            cls, "__getattribute__", _recording(cls.__getattribute__)
        )
    return patch


def transformers_config_class() -> type | None:
    """transformers' config base class if transformers is imported (never imported here):
    models read settings such as ``use_cache`` from it inside forward()."""
    module = sys.modules.get("transformers.configuration_utils")
    return getattr(module, "PreTrainedConfig", None) or getattr(module, "PretrainedConfig", None)


def held_configs(modules: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """The transformers configs the labelled modules hold as attributes, each once, labelled
    ``<module label>.<attribute>`` (none when transformers is not imported)."""
    config_class = transformers_config_class()
    if config_class is None:
        return []
    found: dict[int, tuple[str, Any]] = {}
    for label, module in modules:
        for attr, value in vars(module).items():
            if isinstance(value, config_class) and id(value) not in found:
                found[id(value)] = (f"{label}.{attr}", value)
    return list(found.values())


def watched_objects(
    modules: list[tuple[str, nn.Module]], graph: Any
) -> tuple[dict[int, tuple], list[type]]:
    """({id(obj): (label, names left out)}, the classes to intercept reads on) for the
    registered modules (``self.<path>``), the Graph (``self``) and the transformers configs the
    modules hold."""
    watch: dict[int, tuple] = {}
    classes: list[type] = [nn.Module]
    config_class = transformers_config_class()
    if config_class is not None:
        classes.append(config_class)
    for path, module in modules:
        watch[id(module)] = (f"self.{path}", _MODULE_OWN)
    for label, config in held_configs([(f"self.{path}", m) for path, m in modules]):
        watch[id(config)] = (label, frozenset())
    if graph is not None and hasattr(graph, "__dict__"):
        watch[id(graph)] = ("self", frozenset(getattr(graph, "_graphamp_own", ())))
        classes.append(type(graph))
    return watch, classes


@contextlib.contextmanager
def recording_attribute_reads(
    watch: dict[int, tuple], classes: list[type]
) -> Iterator[list[AttributeRead]]:
    """Inside the block, instance attributes this thread reads on the watched objects are
    recorded; the list yielded holds them (in first-read order) when the block ends.
    ``classes``: where the reads are intercepted (``watched_objects`` gives both)."""
    reads: list[AttributeRead] = []
    with contextlib.ExitStack() as stack:
        for cls in classes:
            stack.enter_context(_patch_for(cls).applied())
        _local.watch, _local.reads = watch, {}
        try:
            yield reads
        finally:
            reads.extend(_local.reads.values())
            _local.watch, _local.reads = {}, None
