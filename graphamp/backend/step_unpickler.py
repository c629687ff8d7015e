"""The step cache's unpickler: it builds only what a step entry holds.

An entry is authenticated before it is unpickled (``cache_directory.py``); this is the second
wall, for an entry that passes the first (the user's own, from a graphamp that pickled more
than it should): unpickling can call only the classes and functions below, so even an authenticated
entry can build nothing else (``torch.load(weights_only=True)``'s approach). The list is what
torch's ``GraphPickler`` writes for graphamp's steps (fx graph pieces, traced tensors' metadata,
dtypes and sizes, a ShapeEnv's symbols) and graphamp's own records; an entry asking for
anything else fails to load and is rebuilt.

Entries are written by the standard library's pickler whatever is installed: torch's
``GraphPickler`` derives from ``dill``'s pickler where ``dill`` is importable (the ``datasets``
package brings it), which writes dill's own constructors (``dill._dill._create_namedtuple``,
``_load_type``) that the list above rightly refuses, so no entry ever loaded there. ``dumps``
runs GraphPickler's own reduction (``reducer_override``, ``persistent_id``) on a plain
``pickle.Pickler``: one entry format, the same bytes with or without dill.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._guards, torch._subclasses, torch._utils, torch.fx._graph_pickler,
#   torch.fx._graph_pickler.GraphPickler._PASSTHROUGH_TYPES, torch.fx._graph_pickler._UnpickleState,
#   torch.serialization._get_layout, torch.utils._ordered_set, torch.utils._pytree,
#   torch.utils._sympy, torch.utils._traceback
import contextlib
import dataclasses
import io
import pickle
import types
from typing import Any

import torch
import torch.fx._graph_pickler as graph_pickler
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

# modules whose classes an entry may build (and, for GraphPickler, its data classes' methods)
_CLASS_MODULES = frozenset(
    {
        "torch.fx._graph_pickler",
        "torch._subclasses.meta_utils",
        "torch.fx.immutable_collections",
        "torch.fx.passes.shape_prop",
        "torch.fx.traceback",
        "torch.fx.graph",
        "torch.fx.experimental.symbolic_shapes",
        "torch._guards",
        "torch.utils._ordered_set",
        "torch.utils._pytree",
        "torch.utils._sympy.value_ranges",
        # torch's sympy functions and numbers in symbolic sizes (ToFloat, FloorDiv, int_oo)
        "torch.utils._sympy.functions",
        "torch.utils._sympy.numbers",
        "torch.utils._traceback",
    }
)
_BUILTINS = frozenset(
    {"set", "frozenset", "slice", "complex", "range", "tuple", "list", "dict", "int", "float"}
    | {"bool", "str", "bytes"}
)
_FUNCTIONS = {
    ("collections", "OrderedDict"),
    ("collections", "Counter"),  # a ShapeEnv's counters, with inductor
    ("collections", "defaultdict"),
    ("traceback", "FrameSummary"),
    ("torch.serialization", "_get_layout"),
}


def dumps(obj: Any) -> bytes:
    """``GraphPickler.dumps`` (every op allowed: the key holds what the step is made of), on
    the standard library's pickler (module docstring)."""
    patch = getattr(graph_pickler, "patch_pytree_map_over_slice", contextlib.nullcontext)
    with patch(), io.BytesIO() as stream:
        _PlainGraphPickler(stream, graph_pickler.Options(ops_filter=None)).dump(obj)
        return stream.getvalue()


class _PlainGraphPickler(pickle.Pickler):
    """torch's GraphPickler with the standard library's pickler as its base, whatever that of
    GraphPickler is (``dill``'s where dill is importable)."""

    # read by GraphPickler's reducer_override from torch 2.13 (torch 2.11's has no such set)
    _PASSTHROUGH_TYPES: frozenset[type] = getattr(
        graph_pickler.GraphPickler, "_PASSTHROUGH_TYPES", frozenset()
    )
    persistent_id = graph_pickler.GraphPickler.persistent_id

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor and not is_fake(obj):
            # its pickle rebuilds storage through torch.load, which the unpickler refuses: an
            # entry holding one would never load, so the step is not saved (said in the log)
            raise pickle.PicklingError(
                f"the step holds a tensor constant ({tuple(obj.shape)} {obj.dtype})"
            )
        # GraphPickler's own reduction, run on this pickler (it reads only the fields
        # __init__ copied from one)
        reduced = graph_pickler.GraphPickler.reducer_override(self, obj)  # type: ignore[arg-type]
        if reduced is NotImplemented and _by_name(obj):
            _check_loadable(obj)
        return reduced

    def __init__(self, file: io.BytesIO, options: Any) -> None:
        super().__init__(file)
        # GraphPickler's own fields (its options, the unpickling state's token, the tensor
        # describer), taken from one made for the purpose: what it sets beyond its base
        # pickler's fields, whichever torch release this is
        own = graph_pickler.GraphPickler(io.BytesIO(), options)
        base = type(own).__mro__[1]
        inherited = set(getattr(base(io.BytesIO()), "__dict__", ()))
        for name, value in vars(own).items():
            if name not in inherited:
                setattr(self, name, value)


def loads(payload: bytes, fake_mode: FakeTensorMode) -> Any:
    """``GraphPickler.loads`` with the allow-listed unpickler."""
    # torch 2.13 onwards patches pytree while unpickling; torch 2.11 had no such patch
    patch = getattr(graph_pickler, "patch_pytree_map_over_slice", contextlib.nullcontext)
    with patch():
        state = graph_pickler._UnpickleState(fake_mode)  # GraphPickler's own
        with io.BytesIO(payload) as stream:
            return _StepUnpickler(stream, state).load()


class _StepUnpickler(pickle.Unpickler):
    """GraphPickler's unpickler on the standard library's (not dill's), allow-listed."""

    def __init__(self, stream: io.BytesIO, unpickle_state: Any) -> None:
        super().__init__(stream)
        self._unpickle_state = unpickle_state

    def persistent_load(self, pid: Any) -> Any:
        if pid == "unpickle_state":  # the one persistent id GraphPickler writes
            return self._unpickle_state
        raise pickle.UnpicklingError("a step entry may not name other persistent objects")

    def find_class(self, module: str, name: str) -> Any:
        substitute = _SUBSTITUTES.get((module, name))
        if substitute is not None:
            return substitute
        found = super().find_class(module, name)
        if _allowed(module, name, found):
            return found
        raise pickle.UnpicklingError(f"a step entry may not build {module}.{name}")


def _by_name(obj: Any) -> bool:
    """Whether the pickler writes ``obj`` as a global (module and qualified name): a class or
    function; a builtin only where it is a module's (a bound one is pickled as getattr)."""
    if isinstance(obj, types.BuiltinFunctionType):
        return obj.__self__ is None or isinstance(obj.__self__, types.ModuleType)
    return isinstance(obj, (type, types.FunctionType))


def _check_loadable(obj: Any) -> None:
    """The writer's half of the list: a class or function the unpickler would refuse is refused
    when the step is saved, by name, so that no entry is written that can never load (an entry
    that cannot load costs every restart a full build, and said so only when read)."""
    name = obj.__qualname__
    module = getattr(obj, "__module__", None)
    if module is None:  # the pickler then looks for it, as here
        module = pickle.whichmodule(obj, name)  # type: ignore[attr-defined]
    if (module, name) in _SUBSTITUTES or _allowed(module, name, obj):
        return
    raise UnloadableGlobal(
        f"the step holds {module}.{name}, which the step cache's loader does not build "
        "(a graphamp bug: please report it)"
    )


class UnloadableGlobal(pickle.PicklingError):
    """A step names a class or function the unpickler's list leaves out (``_check_loadable``)."""


def _allowed(module: str, name: str, found: Any) -> bool:
    if module == "builtins":
        return name in _BUILTINS
    if (module, name) in _FUNCTIONS:
        return True
    if module == "torch":  # dtypes, layouts, memory formats, sizes, devices
        kinds = (torch.dtype, torch.layout, torch.memory_format)
        return found in (torch.Size, torch.device) or isinstance(found, kinds)
    if module == "torch._utils":  # memory formats by their dotted name
        return isinstance(found, torch.memory_format)
    if module in _CLASS_MODULES or module.startswith("sympy."):
        data_method = module == "torch.fx._graph_pickler" and ".unpickle" in name
        return isinstance(found, type) or data_method
    if module.split(".")[0] == "graphamp":  # graphamp's records: dataclasses
        return isinstance(found, type) and dataclasses.is_dataclass(found)
    return False


def _pickle_data_getattr(obj: Any, name: str) -> Any:
    """GraphPickler reduces an op to ``getattr(<its pickle data>, "unpickle")``: that, and
    nothing else (a general getattr reaches any module through ``__globals__``)."""
    if type(obj).__module__ != "torch.fx._graph_pickler" or name.startswith("_"):
        raise pickle.UnpicklingError(f"a step entry may not read {type(obj).__name__}.{name}")
    return getattr(obj, name)


def _torch_logger(name: str) -> Any:
    """A ShapeEnv pickles its logger by name: torch's loggers only."""
    import logging

    if name != "torch" and not name.startswith("torch."):
        raise pickle.UnpicklingError(f"a step entry may not get the logger {name!r}")
    return logging.getLogger(name)


# globals GraphPickler writes that the unpickler answers with narrower stand-ins
_SUBSTITUTES = {
    ("builtins", "getattr"): _pickle_data_getattr,
    ("logging", "getLogger"): _torch_logger,
}
