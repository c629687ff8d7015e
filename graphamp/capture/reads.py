"""The Python attributes build() reads at capture: what a compiled step assumes of them.

A compiled step is a snapshot of one run of build(): a dropout's ``p``, a norm's ``eps``, a loss's
``label_smoothing``, a flag forward() branches on are baked into it. While build() is traced,
every attribute read on a registered module, on the Graph, on a transformers config held by one
of them, and on a module the code reaches through a global or a closure (``scope_reads.py``)
is recorded with its value (``records.guards.AttributeRead``); the program runs only while
those values hold. Reads are seen through a recording ``__getattribute__`` put on those classes
for the length of the capture (``process_state.SharedPatch``); only the capturing thread
records, and only on the objects it watches.

What is recorded, and how it is compared at every call (``guard_form``):
- plain values (numbers, strings, None, enums, dtypes, devices, tuples of them) by equality;
- containers (a dict of hyperparameters, a list of dicts, a dataclass, an
  ``argparse.Namespace``, a ``SimpleNamespace``, ``os.environ``; of any size up to
  ``contents.SIZE_LIMIT`` entries) by their contents: a copy where they hold plain values
  only, else a snapshot keeping the functions, modules and tensors they hold by identity
  (``contents.Contents``); changed in place, the program no longer serves;
- a class attribute read through an instance (``Block.scale``) on the class, and the instance
  and every class between its own and the one that holds it are checked not to shadow it
  later; read on a class of the user's (``Config.kl_weight``, seen
  by ``scope_reads`` where the code reads it off a global or closure variable) on the class that
  holds it, and its subclasses are checked not to shadow it;
- a function, a ``functools.partial`` or a bound method: with the settings it carries
  (``code_settings``: default arguments and the code of a function of the user's, which a
  reload replaces in place; a partial's keywords);
- other objects by identity; an object of a class of the user's (defined outside torch,
  graphamp, installed packages and Python's own library: a hand-written options object) is
  watched too, from the first read that reaches it, so the attributes build() reads on it are
  recorded as a module's are (its class's ``__getattribute__`` records them until the capture
  ends); so is an object of a library's class (a diffusers scheduler), except that only the
  reads the user's own code makes on it are recorded (its methods keep locks, caches and
  counters no step reads), its properties included where their value compares by value.

Left out, each for a reason:
- what ``nn.Module.__init__`` itself sets (parameters, buffers, children, hooks, ``training``):
  the structure key already holds the module tree, the hook count and train/eval;
- parameters and buffers: they are step inputs. A plain tensor attribute is lifted as a live
  input (``cleanup.lift_constants``), so its values are never baked in, and recorded by identity:
  bound to another tensor, the step is captured again (it would still read the old one);
- modules: the structure key holds the module tree by identity;
- dunder names (``__dict__``, ``__class__``): Python's machinery, not settings;
- what the Graph's own ``__init__`` set (its config, registry and runtime): the config is part
  of the structure key, the rest is graphamp's bookkeeping;
- methods, properties and other descriptors on a class (code, not settings), and the class
  attributes of torch's own classes (constants of torch's machinery).
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._subclasses
import contextlib
import contextvars
import copy
import dataclasses
import enum
import functools
import sys
import sysconfig
import threading
import types
from typing import Any, Iterator

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from ..records.guards import (
    ABSENT,
    AttributeRead,
    ClassNamespace,
    ContextValue,
    ObjectAttributes,
    SlotNamespace,
)
from ..torchkit.fxutil import is_library_file
from ..torchkit.process_state import SharedPatch
from .contents import Contents, count_entries, fields_of, is_plain, is_record, numpy_values
from .optimizer_views import (
    LastLrs,
    RecordedList,
    holds_param_groups,
    last_lrs_patch,
    view_param_groups,
)

_MODULE_OWN = frozenset(vars(nn.Module()))  # what nn.Module.__init__ sets: see the docstring

# .watch: {id(obj): (label, names left out, whether only the user's code's reads count)},
# .reads: {key: read}
_local = threading.local()


def guard_form(value: Any) -> tuple[Any, bool]:
    """(what to keep of ``value``, whether to compare by equality): a plain value itself, a copy
    of a small container of plain values (``Fields`` for a dataclass or namespace), a snapshot
    of one that holds objects beside its plain values (``contents.Contents``), else the object,
    compared by identity."""
    if is_plain(value):
        return value, True
    array = numpy_values(value)
    if array is not None:
        return array, True
    counts = count_entries(value)
    if counts is None:  # not a container (or one past contents.SIZE_LIMIT entries)
        return value, False
    if counts[1] == 0:  # plain values only: a copy, compared by ==
        if is_record(value):
            return Fields(type(value), copy.deepcopy(fields_of(value))), True
        if type(value) in (dict, list, set, tuple, frozenset):
            return copy.deepcopy(value), True
        return Contents(value), True  # a dict subclass: its own copy may not compare alike
    if is_record(value) and is_user_object(value):  # watched: only the fields build() reads
        return value, False
    return Contents(value), True


@dataclasses.dataclass(frozen=True, eq=False)
class Fields:
    """A dataclass's or namespace's fields as recorded: equal to an object of the same class
    whose fields are equal (whatever that class's own ``__eq__`` does)."""

    cls: type
    values: dict

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Fields):
            return self.cls is other.cls and self.values == other.values
        return type(other) is self.cls and fields_of(other) == self.values

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.values.items())
        return f"{self.cls.__name__}({fields})"


def _record(obj: Any, name: str, value: Any) -> None:
    watch = _local.watch.get(id(obj))
    if watch is None or name.startswith("__") or (id(obj), name) in _local.reads:
        return
    label, left_out, users_reads_only = watch
    if name in left_out or isinstance(value, nn.Module):
        return
    if users_reads_only and not _traced(value):
        # a library's object: its own code keeps caches and counters on it that no step
        # reads; what the user's code reads (frame 2: the reader, through __getattribute__)
        if not _read_by_users_code(sys._getframe(2)) or _record_computed(obj, name, value, label):
            return
    _record_value(obj, name, value, label)


def _record_value(obj: Any, name: str, value: Any, label: str) -> None:
    """``obj.<name>`` read as ``value``: where it lives, and what its value carries. A lifted
    value (a step input while build() is traced) is not recorded; where its class holds it,
    what may shadow it later (the instance, a class between) is."""
    traced = _traced(value)
    namespace = _namespace_of(obj, name)
    if namespace is not None and namespace.get(name, _record) is value:
        if traced:
            return
        kept, by_value = guard_form(value)
        _local.reads[(id(obj), name)] = AttributeRead(
            label=f"{label}.{name}", namespace=namespace, name=name, value=kept, by_value=by_value
        )
        if not by_value:
            watch_object(value, f"{label}.{name}")
    elif namespace is None or (isinstance(namespace, dict) and name not in namespace):
        _record_class_attribute(obj, namespace, name, value, label)
    if not traced:
        for read in code_settings(value, f"{label}.{name}"):
            _local.reads.setdefault((id(read.namespace.owner), read.name), read)


def _record_computed(obj: Any, name: str, value: Any, label: str) -> bool:
    """A library object's property the user's code read (diffusers' ``scheduler.config``),
    kept where its value compares by value: read again through the object at every call.
    False where ``name`` is not computed by a descriptor of its class."""
    owner = _owner_of(type(obj), name)
    descriptor = vars(owner).get(name) if owner is not None else None
    if not isinstance(descriptor, property):
        return False
    kept, by_value = guard_form(value)
    if by_value:
        _local.reads[(id(obj), name)] = AttributeRead(
            f"{label}.{name}", ObjectAttributes(obj), name, kept, by_value=True
        )
    elif is_watchable(value):
        watch_object(value, f"{label}.{name}")
    return True


def code_settings(value: Any, label: str) -> list[AttributeRead]:
    """The settings a value carries with it, each a read by value: a ``ContextVar``'s value in
    the running context (``var.get()``); for a callable, a function's default
    arguments (``__defaults__``, ``__kwdefaults__``: what a call that leaves the argument out
    uses; for functions of the user's code), a ``functools.partial``'s keywords and
    arguments and then its function's, a bound method's function's. Changed in place
    (``fn.__defaults__ = (2.5,)``, ``loss.keywords["label_smoothing"] = 0.1``), the program no
    longer serves."""
    if isinstance(value, contextvars.ContextVar):  # its value, read by ``var.get()``
        namespace = ContextValue(value)
        current = namespace.get("value", ABSENT)
        if _traced(current):  # lifted: a step input while build() is traced
            return []
        kept, by_value = guard_form(current)
        return [AttributeRead(f"{label}.get()", namespace, "value", kept, by_value)]
    reads: list[AttributeRead] = []
    for _ in range(8):  # partials of partials, at most this deep
        if isinstance(value, types.MethodType):
            value = value.__func__
        if isinstance(value, functools.partial):
            reads += _settings_of(value, ("keywords", "args"), f"{label}.")
            value = value.func
            continue
        if isinstance(value, types.FunctionType) and is_user_code(
            value.__code__.co_filename, value.__globals__
        ):
            reads += _settings_of(
                value, ("__code__", "__defaults__", "__kwdefaults__"), f"{label}."
            )
        break
    return reads


def _settings_of(owner: Any, names: tuple[str, ...], prefix: str) -> list[AttributeRead]:
    reads = []
    for name in names:
        value = getattr(owner, name, None)
        kept, by_value = guard_form(value)
        reads.append(
            AttributeRead(f"{prefix}{name}", ObjectAttributes(owner), name, kept, by_value)
        )
    return reads


def _namespace_of(obj: Any, name: str) -> dict | SlotNamespace | None:
    """Where ``obj`` keeps ``name``: its ``__dict__``, one of its slots, or None (neither: a
    class attribute's read, on an object without a ``__dict__``)."""
    try:
        namespace = object.__getattribute__(obj, "__dict__")
    except AttributeError:
        namespace = None
    if namespace is not None and name in namespace:
        return namespace
    owner = _owner_of(type(obj), name)
    slot = vars(owner)[name] if owner is not None else None
    if isinstance(slot, types.MemberDescriptorType):
        return SlotNamespace(obj, slot)
    return namespace


def _record_class_attribute(
    obj: Any, namespace: dict | None, name: str, value: Any, label: str
) -> None:
    """A data attribute of ``obj``'s class read through ``obj``: kept on the class, and the
    instance must not shadow it (a method, property or torch's own class constant is left out;
    ``namespace`` None: an object without a ``__dict__``, which cannot shadow it)."""
    owner = _owner_of(type(obj), name)
    if owner is None or vars(owner)[name] is not value or _is_torch_class(owner):
        return
    # through the object's own class: a class between it and the owner that shadows the
    # attribute later (``Sub.SCALE = 3.0`` where ``Base`` holds it) changes what it reads
    if not _record_on_class(type(obj), owner, name, value) or namespace is None:
        return
    _local.reads[(id(obj), name)] = AttributeRead(  # the instance keeps reading the class's
        label=f"{label}.{name}", namespace=namespace, name=name, value=ABSENT, by_value=False
    )


def record_class_read(cls: type, name: str) -> None:
    """build()'s code read ``cls.<name>`` off a class of the user's (``Config.kl_weight``, the
    class a global or closure variable): kept on the class in ``cls``'s MRO that holds it."""
    reads = getattr(_local, "reads", None)
    if reads is None or name.startswith("__") or not is_user_class(cls):
        return
    owner = _owner_of(cls, name)
    if owner is not None and not _is_torch_class(owner):
        _record_on_class(cls, owner, name, vars(owner)[name])


def _owner_of(cls: type, name: str) -> type | None:
    """The class in ``cls``'s MRO whose own namespace holds ``name``."""
    return next((c for c in cls.__mro__ if name in vars(c)), None)


def _record_on_class(cls: type, owner: type, name: str, value: Any) -> bool:
    """Record ``owner.<name>`` (``value``) as read through ``cls``, and that none of the classes
    between them shadows it; whether it is a setting (a function, property or other descriptor
    is code, and a class is compared by identity where it is read). A lifted value (a step
    input while build() is traced) is not recorded, the classes that may shadow it are."""
    traced = _traced(value)
    if isinstance(value, type) or (not traced and hasattr(type(value), "__get__")):
        return False
    kept, by_value = (ABSENT, False) if traced else guard_form(value)
    for c in cls.__mro__[: cls.__mro__.index(owner) + 1]:  # those between hold none: ABSENT
        if traced and c is owner:
            continue
        _local.reads.setdefault(
            (id(c), name),
            AttributeRead(
                label=f"{c.__name__}.{name}",
                namespace=ClassNamespace(c),
                name=name,
                value=kept if c is owner else ABSENT,
                by_value=by_value and c is owner,
            ),
        )
    if not by_value and not traced:
        watch_object(value, f"{owner.__name__}.{name}")
    return True


def _traced(value: Any) -> bool:
    """A value of the trace itself (a float lifted as an input is one while build() runs): the
    step's input, not a setting."""
    return isinstance(value, (FakeTensor, FunctionalTensor))


def _is_torch_class(cls: type) -> bool:
    return cls.__module__ == "torch" or cls.__module__.startswith("torch.")


_PATHS = sysconfig.get_paths()
PYTHONS_OWN = tuple({_PATHS[k].rstrip("/") + "/" for k in ("stdlib", "platstdlib")})
INSTALLED = tuple({_PATHS[k].rstrip("/") + "/" for k in ("purelib", "platlib")})


def is_user_class(cls: type) -> bool:
    """Is ``cls`` defined in the user's code (a script, a notebook, their own package), not in
    torch, graphamp, an installed package or Python's own library? Only such classes' objects
    are watched: a library's objects (a logger, a tokenizer) keep caches a step never reads."""
    module = sys.modules.get(cls.__module__)
    if module is None or isinstance(cls, enum.EnumMeta):
        return False
    return is_user_module(module)


def is_user_module(module: types.ModuleType) -> bool:
    """Is ``module`` the user's (as ``is_user_class``)?"""
    filename = getattr(module, "__file__", None)
    if filename is None or filename.startswith("<"):  # __main__ of a notebook, a console,
        return module.__name__ == "__main__"  # ``python -`` (``<stdin>``); builtins
    return _is_users_file(filename)


def is_user_code(filename: str, module_globals: dict) -> bool:
    """Is code of ``filename``, run with ``module_globals``, the user's? Code compiled from
    text (``exec``, ``python -c``, a console: ``<string>``, ``<stdin>``) has no file to tell:
    it is where its globals are a user's module's (``__main__`` included). torch.fx's
    generated forwards run in globals of their own, and a library's generated methods (a
    dataclass's ``__init__``) in the library's module: not the user's."""
    if not filename.startswith("<"):
        return _is_users_file(filename)
    module = sys.modules.get(module_globals.get("__name__", ""))
    return module is not None and vars(module) is module_globals and is_user_module(module)


@functools.lru_cache(maxsize=4096)
def _is_users_file(filename: str) -> bool:
    return not (is_library_file(filename) or filename.startswith((*PYTHONS_OWN, *INSTALLED)))


def is_user_object(value: Any) -> bool:
    """An object of a class of the user's whose attributes live in its ``__dict__`` or its
    slots."""
    return (
        not isinstance(value, (type, nn.Module, torch.Tensor))
        and is_user_class(type(value))
        and (_has_dict(value) or _has_slots(type(value)))
    )


def is_library_object(value: Any) -> bool:
    """An object of an installed package's class, or of Python's own library, that keeps its
    attributes in a ``__dict__`` or slots (a diffusers scheduler, a logging handler): its
    attributes that the user's code reads are settings as a user object's are. Not a tensor,
    module, class, function or container (those are recorded otherwise), nor graphamp's or
    torch's own, nor an optimizer's wrapper."""
    cls = type(value)
    if isinstance(value, _NOT_LIBRARY_OBJECTS) or is_user_class(cls) or is_plain(value):
        return False
    if cls.__module__.split(".")[0] in ("graphamp", "torch") or holds_param_groups(value):
        # torch's objects; an optimizer or its wrapper (Lightning's): the entries of its param
        # groups that the user's code reads are recorded instead (``optimizer_views``)
        return False
    return count_entries(value) is None and (_has_dict(value) or _has_slots(cls))


def is_watchable(value: Any) -> bool:
    """An object whose reads a capture records once a read reaches it: the user's (every
    read), a library's (the user's code's reads), an optimizer's (its param groups' entries
    the user's code reads)."""
    return is_user_object(value) or is_library_object(value) or holds_param_groups(value)


_NOT_LIBRARY_OBJECTS = (
    type,
    nn.Module,
    torch.Tensor,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    functools.partial,
)


def _read_by_users_code(frame: types.FrameType | None) -> bool:
    """Is ``frame`` (the one that made an attribute read) the user's code?"""
    return frame is not None and is_user_code(frame.f_code.co_filename, frame.f_globals)


def _has_slots(cls: type) -> bool:
    return any(
        isinstance(v, types.MemberDescriptorType) for c in cls.__mro__ for v in vars(c).values()
    )


def _has_dict(value: Any) -> bool:
    """Does ``value`` keep its attributes in a ``__dict__`` (asked without the class's own
    ``__getattr__``, which may raise anything)?"""
    try:
        object.__getattribute__(value, "__dict__")
    except AttributeError:
        return False
    return True


def _intercepted(cls: type) -> bool:
    """Reads on ``cls``'s objects are recorded from now on in this capture: its class is
    patched as the registered modules' are, until the capture ends."""
    done, stack = getattr(_local, "intercepted", None), getattr(_local, "stack", None)
    if done is None or stack is None:
        return False
    if cls not in done:
        try:
            stack.enter_context(_recording_on(cls))
        except (TypeError, AttributeError):  # a class whose attributes cannot be set
            return False
        done.add(cls)
    return True


def watch_object(obj: Any, label: str) -> None:
    """Record the attribute reads on ``obj`` from now on, for the capture in this thread (a
    module that build()'s code reaches through a global or a closure variable, an object of a
    class of the user's that it reaches in any way)."""
    watch = getattr(_local, "watch", None)
    if watch is None or id(obj) in watch:
        return
    groups = holds_param_groups(obj)
    if groups:  # its groups' entries, read by subscript
        view_param_groups(obj, label, _local.stack, _record_group_entry, _local.viewed)
    if isinstance(obj, nn.Module):
        watch[id(obj)] = (label, _MODULE_OWN, False)
    elif is_user_object(obj) and _intercepted(type(obj)):
        watch[id(obj)] = (label, _GROUPS if groups else frozenset(), False)
    elif is_library_object(obj) and _intercepted(type(obj)):
        watch[id(obj)] = (label, frozenset(), True)  # only the user's code's reads count


_GROUPS = frozenset({"param_groups"})  # an optimizer of the user's: its groups are viewed


def _record_group_entry(
    group: dict, key: Any, value: Any, label: str, frame: types.FrameType | None
) -> None:
    """A param group's entry the user's code read (``optimizer_views``): a read of the
    group's own dict."""
    if _read_by_users_code(frame):
        _record_at(group, key, value, label, group)


def _record_at(owner: Any, name: str, value: Any, label: str, namespace: Any) -> bool:
    """Record ``value``, read as ``owner``'s ``name`` through ``namespace``, once per capture
    (not a lifted value: that is a step input); whether it is kept by value."""
    reads = getattr(_local, "reads", None)
    if reads is None or (id(owner), name) in reads or _traced(value):
        return True
    kept, by_value = guard_form(value)
    reads[(id(owner), name)] = AttributeRead(label, namespace, name, kept, by_value)
    return by_value


def _recorded_last_lrs(scheduler: Any, lrs: list, frame: types.FrameType | None) -> list:
    """``get_last_lr()``'s list, to a capture's user code: its items read are recorded."""
    if getattr(_local, "reads", None) is None or not _read_by_users_code(frame):
        return lrs
    label = f"{type(scheduler).__name__}.get_last_lr()"

    def on_item(index: int, value: Any) -> None:
        _record_at(scheduler, str(index), value, f"{label}[{index}]", LastLrs(scheduler))

    return RecordedList(lrs, on_item)


_LAST_LRS = last_lrs_patch(_recorded_last_lrs)


def _recording(original: Any) -> Any:
    def __getattribute__(self: Any, name: str) -> Any:  # the slot it fills
        value = original(self, name)
        if getattr(_local, "reads", None) is not None:
            _record(self, name, value)
        return value

    return __getattribute__


def _recording_fallback(original: Any) -> Any:
    def __getattr__(self: Any, name: str) -> Any:  # what Python calls when the lookup fails
        value = original(self, name)
        if getattr(_local, "reads", None) is not None:
            _record_served(self, name, value)
        return value

    return __getattr__


def _record_served(obj: Any, name: str, value: Any) -> None:
    """An attribute a class's own ``__getattr__`` served (ml_collections' ``ConfigDict``
    keeps its fields in a dict of its own and serves ``cfg.loss.weight`` from it): read again
    through the object at every call, by value, or by identity where the value is an object
    (watched in turn: its own reads are recorded)."""
    watch = _local.watch.get(id(obj))
    if watch is None or name.startswith("__") or (id(obj), name) in _local.reads:
        return
    label, left_out, users_reads_only = watch
    if name in left_out or isinstance(value, nn.Module) or _traced(value):
        return
    # frame 2: the reader (Python calls __getattr__ from the failed lookup's own frame)
    if users_reads_only and not _read_by_users_code(sys._getframe(2)):
        return
    if not _record_at(obj, name, value, f"{label}.{name}", ObjectAttributes(obj)):
        watch_object(value, f"{label}.{name}")


def _serves_missing_attributes(cls: type) -> bool:
    """Does ``cls`` define a ``__getattr__`` of its own (not a module's: parameters, buffers
    and submodules are read as the module's state)?"""
    return not issubclass(cls, nn.Module) and any("__getattr__" in vars(c) for c in cls.__mro__)


_patches: dict[tuple[type, str], SharedPatch] = {}  # what some capture records reads on now
_patches_lock = threading.Lock()


@contextlib.contextmanager
def _recording_on(cls: type) -> Iterator[None]:
    """The recording ``__getattribute__`` on ``cls`` for the block: it wraps the one the class
    has, its own (transformers' configs define one) or inherited. Captures in several threads
    share one patch per class; the last to leave forgets it, so a class defined in a function
    (a Graph made by a factory, a notebook cell run again) is not kept alive with its closure."""
    hooks = [("__getattribute__", _recording)]
    if _serves_missing_attributes(cls):
        hooks.append(("__getattr__", _recording_fallback))
    with contextlib.ExitStack() as stack:
        for name, recording in hooks:
            stack.enter_context(_patched(cls, name, recording))
        yield


@contextlib.contextmanager
def _patched(cls: type, name: str, recording: Any) -> Iterator[None]:
    with _patches_lock:
        patch = _patches.get((cls, name))
        if patch is None:
            patch = _patches[(cls, name)] = SharedPatch(cls, name, recording(getattr(cls, name)))
        applied = patch.applied()
        applied.__enter__()
    try:
        yield
    finally:
        with _patches_lock:
            applied.__exit__(None, None, None)
            if not patch.in_use:
                del _patches[(cls, name)]


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
    modules: list[tuple[str, nn.Module]], graph: Any, graph_own: frozenset[str] = frozenset()
) -> tuple[dict[int, tuple], list[type]]:
    """({id(obj): (label, names left out, False)}, the classes to intercept reads on) for the
    registered modules (``self.<path>``), the Graph (``self``) and the transformers configs the
    modules hold."""
    watch: dict[int, tuple] = {}
    classes: list[type] = [nn.Module]
    config_class = transformers_config_class()
    if config_class is not None:
        classes.append(config_class)
    for path, module in modules:
        watch[id(module)] = (f"self.{path}", _MODULE_OWN, False)
    for label, config in held_configs([(f"self.{path}", m) for path, m in modules]):
        watch[id(config)] = (label, frozenset(), False)
    if graph is not None and hasattr(graph, "__dict__"):
        watch[id(graph)] = ("self", graph_own, False)
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
            stack.enter_context(_recording_on(cls))
        # the user's classes whose objects the capture reaches are patched as it goes, on the
        # same stack (``watch_object``)
        _local.watch, _local.reads = watch, {}
        _local.stack, _local.intercepted = stack, set(classes)
        _local.viewed = set()  # the param-group lists viewed (``optimizer_views``)
        stack.enter_context(_LAST_LRS.applied())
        try:
            yield reads
        finally:
            reads.extend(_local.reads.values())
            _local.watch, _local.reads = {}, None
            _local.stack, _local.intercepted = None, None
