"""Globals and closure variables that build()'s code reads at capture: what a step assumes.

A KL weight annealed by the training loop (``beta = min(1.0, step / 1000)`` read in forward), a
loss made by a factory (``lambda out, y: ... * w``), what a ``graphamp.training_step`` function
closes over: build() reads them as Python values, so the traced step holds their values of the
first call. While build() is traced, a trace function (``sys.settrace``, opcode events) watches
the frames of the user's code (not torch's, graphamp's or Python's standard library: which
instructions of which code, ``watched_code.py``) and records
each global (``LOAD_GLOBAL``) and closure variable (``LOAD_DEREF`` of a free variable) they
read, with its value, as an ``AttributeRead`` of the module's globals or of the closure's cell;
the program runs only while they hold (``records/guards.py``).

What is recorded, by the value's kind (``reads.guard_form`` for data):
- numbers, strings, flags, dtypes and small containers of them: by value (contents copied;
  a container holding functions or tensors beside its numbers: those by identity,
  ``contents.Contents``);
- tensors, functions (``functools.partial`` objects too) and classes: by identity (a global
  rebound to another function or tensor captures again; a tensor's values are read live by the
  step, ``cleanup.lift_constants``);
- ``nn.Module`` objects: by identity, and their attributes are recorded from then on as a
  registered module's are (a loss module closed over but never registered);
- objects of the user's own classes (a hand-written options object): the same;
- an attribute read straight off a class of the user's (``Config.kl_weight``: the instruction
  after the load reads it): on the class that holds it (``reads.record_class_read``); off a
  module of the user's (``import config`` then ``config.kl_weight``): as a global of it.
Left out: imported modules (``import torch as t`` is not a setting), builtins, and other
objects (a library's logger, tokenizer or registry), whose contents cannot be compared cheaply
and whose caches change as they are used. A closure variable of a
function defined while build() runs is a local of the traced code, not a setting.

Writes are the other half: a global that build() assigns (``STORE_GLOBAL``; a step counter) is
handed to the state-write machinery with its value before and after (``state_changes``), which
replays a value that settles after the first call and refuses one that changes on every call,
as for attributes (``steady_state.py``). So is an entry build() sets to a tensor of the trace
in a dict a global or closure variable holds (``metrics["ce"] = ce.detach()``): eager leaves
that call's tensor there, and so does the runtime after every call. A list or set they hold
that build() adds such a tensor to is refused (``_refuse_traced_contents``). A ``nonlocal``
variable of a closure that build() assigns is refused by name.

A trace function another tool installed (a debugger, coverage) keeps receiving its events: it
is called for every frame as before and its local trace function gets every event but the
opcode events this module asks for.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._subclasses
import contextlib
import functools
import gc
import logging
import os
import sys
import threading
import types
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from ..errors import CaptureError
from ..records.frames import UserFrame
from ..records.guards import AttributeRead, CellNamespace
from ..records.replays import MISSING, Place
from ..torchkit.process_state import SharedUse, trace_function
from .reads import (
    INSTALLED,
    code_settings,
    guard_form,
    is_user_module,
    is_watchable,
    record_class_read,
    watch_object,
)
from .state_writes import Change
from .watched_code import loaded, ops_of

log = logging.getLogger("graphamp")
_active = threading.local()  # .tracer: the trace function of this thread's capture


class ScopeReads:
    """The trace function of one capture, and what it recorded."""

    def __init__(self, graph_name: str, skip: frozenset | set = frozenset()) -> None:
        self.graph_name = graph_name
        self.skip = skip  # places of values traced as inputs (lifted): not settings
        self.reads: dict[tuple, AttributeRead] = {}
        self.written: dict[tuple[int, str], tuple[Place, Any, UserFrame]] = {}
        self.refused: CaptureError | None = None
        self._previous: Callable | None = None
        self._started: set[int] = set()  # frames of user code with cells, begun while tracing
        self._entries_before: dict[int, dict] = {}  # id of a dict read -> its entries then
        self._entries: list[tuple[Place, Any]] = []  # dict entries build() set, and before

    # -- the trace function ----------------------------------------------------------------
    def _global_trace(self, frame: types.FrameType, event: str, arg: Any) -> Callable | None:
        previous = self._previous(frame, event, arg) if self._previous else None
        ops = ops_of(frame.f_code, frame.f_globals)
        if not ops:
            return previous
        if frame.f_code.co_cellvars:  # its functions' closures are locals of traced code
            self._started.add(id(frame))
        frame.f_trace_opcodes = True
        return self._local_trace(ops, previous)

    def _local_trace(self, ops: dict, previous: Callable | None) -> Callable:
        def local(frame: types.FrameType, event: str, arg: Any) -> Callable | None:
            nonlocal previous
            if event == "opcode":
                op = ops.get(frame.f_lasti)
                if op is not None:
                    self._on_op(frame, *op)
            elif previous is not None:
                previous = previous(frame, event, arg)
            return local

        return local

    def _on_op(self, frame: types.FrameType, opname: str, name: str, attribute: str | None) -> None:
        try:
            if opname == "CLASS_IN" or opname.startswith("CLASS_OF_"):
                load = "LOAD_FAST" if opname == "CLASS_IN" else opname.removeprefix("CLASS_OF_")
                value = loaded(frame, load, name)
                cls = value if opname == "CLASS_IN" else type(value)
                if isinstance(cls, type) and value is not MISSING and attribute is not None:
                    record_class_read(cls, attribute)
            elif opname == "LOAD_GLOBAL":
                self._read_global(frame, name, attribute)
            elif opname == "STORE_GLOBAL":
                self._write_global(frame, name)
            elif name in frame.f_code.co_freevars:
                if opname == "STORE_DEREF":
                    self._refuse_nonlocal_write(frame, name)
                else:
                    self._read_free(frame, name, attribute)
        except CaptureError as e:
            self.refused = self.refused or e

    # -- globals ---------------------------------------------------------------------------
    def _read_global(self, frame: types.FrameType, name: str, attribute: str | None) -> None:
        value = self._read_in(frame.f_globals, name)
        if attribute is None:
            return
        if isinstance(value, type):
            record_class_read(value, attribute)  # Config.kl_weight: kept on the class
        elif isinstance(value, types.ModuleType) and is_user_module(value):
            self._read_in(vars(value), attribute)  # config.kl_weight: a global of config
        elif isinstance(value, types.ModuleType):  # os.environ, math.pi: a library's data
            self._read_library_data(value, attribute)

    def _read_library_data(self, module: types.ModuleType, name: str) -> None:
        """``module.name`` read off a library module: recorded where it is data (a number, a
        container: ``os.environ``), not code (its functions and classes, whose reads are
        countless and which a training loop does not change). ``os.getenv`` reads
        ``os.environ``: recorded as that."""
        namespace = vars(module)
        value = namespace.get(name, MISSING)
        if value is os.getenv:
            namespace, name, value = vars(os), "environ", os.environ
        if value is MISSING or not guard_form(value)[1]:
            return
        key = (id(namespace), name)
        if key not in self.reads and key not in self.written:
            kept, _ = guard_form(value)
            label = f"{namespace.get('__name__', '?')}.{name}"
            self.reads[key] = AttributeRead(label, namespace, name, kept, by_value=True)

    def _read_in(self, namespace: dict, name: str) -> Any:
        """Record the read of the global ``name`` of ``namespace``; its value (MISSING for a
        builtin)."""
        key = (id(namespace), name)
        if key in self.written or name not in namespace or key in self.skip:
            return MISSING  # builtins are not settings
        value = namespace[name]
        if key not in self.reads:
            label = f"global {name} ({namespace.get('__name__', '?')})"
            read = _read(label, namespace, name, value)
            if read is not None:
                self.reads[key] = read
                self._keep_entries(value)
            if value is os.getenv:  # from os import getenv
                self._read_library_data(os, "getenv")
            self._record_code_settings(value, name)
        return value

    def _record_code_settings(self, value: Any, label: str) -> None:
        """A function's defaults, a partial's keywords (``reads.code_settings``)."""
        for read in code_settings(value, label):
            self.reads.setdefault((id(read.namespace.owner), read.name), read)

    def _write_global(self, frame: types.FrameType, name: str) -> None:
        namespace = frame.f_globals
        key = (id(namespace), name)
        if key in self.written:
            return
        module = sys.modules.get(namespace.get("__name__", ""))
        if module is None or vars(module) is not namespace:
            raise CaptureError(
                f"{self.graph_name}.build() assigns the global {name!r}{_where(frame)} in code "
                "whose module graphamp cannot find: assign it outside build()"
            )
        place = Place(module, name, "attribute", label=module.__name__)
        self.written[key] = (place, namespace.get(name, MISSING), _frame_of(frame))
        self.reads.pop(key, None)  # what the trace reads of it afterwards is its own value

    # -- closures --------------------------------------------------------------------------
    def _read_free(self, frame: types.FrameType, name: str, attribute: str | None) -> None:
        if name == "__class__":  # the cell zero-argument super() reads
            return
        if self._defined_in_traced_code(frame, name):
            return  # made by build() itself (traced values among them): not a setting
        value = frame.f_locals.get(name, MISSING)
        self._record_code_settings(value, name)  # a helper a closure holds: its defaults
        read_off = attribute if isinstance(value, type) else None  # Config.kl_weight
        if value is MISSING or not (read_off or _is_setting(value)):
            return
        if read_off is not None:  # kept on the class (the class itself is code, not a setting)
            record_class_read(value, read_off)
            return
        cell = _cell_of(frame, name, value)
        if cell is None:
            return
        key = (id(cell), name)
        if key in self.reads or (id(cell), name) in self.skip:
            return
        label = f"closure variable {name} of {frame.f_code.co_qualname}"
        read = _read(label, CellNamespace(cell), name, value)
        if read is not None:
            self.reads[key] = read
            self._keep_entries(value)

    def _refuse_nonlocal_write(self, frame: types.FrameType, name: str) -> None:
        if self._defined_in_traced_code(frame, name):
            return
        raise CaptureError(
            f"{self.graph_name}.build() assigns the closure variable {name!r} of "
            f"{frame.f_code.co_qualname}{_where(frame)} (nonlocal): the compiled step runs "
            "without Python, so the assignment would happen on the first call only. Keep the "
            "value on a registered module or the Graph (a buffer for a tensor), or assign it "
            "outside build()"
        )

    def _defined_in_traced_code(self, frame: types.FrameType, name: str) -> bool:
        """Is the variable a local of a function that began while build() was traced (a
        function defined inside build()'s code closes over it)? The innermost running frame
        that holds it as a cell owns it."""
        outer = frame.f_back
        while outer is not None:
            if name in outer.f_code.co_cellvars:
                return id(outer) in self._started
            outer = outer.f_back
        return False

    def _keep_entries(self, value: Any) -> None:
        """A dict a global or closure variable holds, as it is before build() writes it (read
        first, written after): what ``state_changes`` finds an entry was."""
        if isinstance(value, dict) and id(value) not in self._entries_before:
            self._entries_before[id(value)] = dict(value)

    # -- results ---------------------------------------------------------------------------
    def state_changes(self) -> list[Change]:
        """The globals build() assigned, and the entries it set to tensors of the trace in a
        dict a global or closure variable holds (``metrics["ce"] = ce.detach()``, a cache a
        helper fills), as state changes (value before and now): eager leaves that call's
        tensors there, so the step outputs them and the runtime puts them there after every
        call (``steady_state.py``). Called inside the trace; ``restoring`` puts them back."""
        changes = []
        for place, before, where in self.written.values():
            changes.append(Change(place, before, place.read(), where))
        for read in self.reads.values():
            table = read.current()
            before = self._entries_before.get(id(table))
            if before is None:
                continue
            for key, value in table.items():
                if not _holds_traced(value):
                    continue
                was = before.get(key, MISSING)
                if was is value:  # a container it held, changed inside
                    self.refused = self.refused or _nested_write(self.graph_name, read, key)
                    continue
                owner = getattr(read.namespace, "owner", read.namespace)
                place = Place(owner, read.name, "entry", key, read.label, read.namespace)
                self._entries.append((place, was))
                changes.append(Change(place, was, value))
        return changes

    def recorded(self) -> list[AttributeRead]:
        """The globals and closure variables read (raises the refusal of a write, if any, and
        of a traced tensor left in a container they hold)."""
        if self.refused is not None:
            raise self.refused
        for read in self.reads.values():
            _refuse_traced_contents(self.graph_name, read)
        return list(self.reads.values())

    @contextlib.contextmanager
    def restoring(self) -> Iterator[None]:
        """On leaving, the globals build() assigned are put back (as ``StateWatch`` puts back
        the attributes)."""
        try:
            yield
        finally:
            for place, before, _ in self.written.values():
                place.write(before)
            for place, before in reversed(self._entries):
                place.write(before)

    @contextlib.contextmanager
    def tracing(self) -> Iterator[ScopeReads]:
        """The trace function, on this thread, for the block; the user's modules record the
        attribute reads made on them however they are made (``_WATCHED_MODULES``)."""
        self._previous = sys.gettrace()  # chained to (_global_trace)
        tracer = self._global_trace  # one bound method: untraced() compares it by identity
        with trace_function(tracer), _WATCHED_MODULES.applied():  # process_state's helpers
            _active.tracer, _active.scope = tracer, self
            try:
                yield self
            finally:
                _active.tracer = _active.scope = None
        if self.refused is not None:
            raise self.refused

    def _module_read(self, module: types.ModuleType, name: str) -> None:
        """``module.name`` read on a user's module by any path (``getattr(config, name)``,
        ``sys.modules[...]``): recorded as a global of that module, as ``config.name`` is."""
        if self.refused is None:
            self._read_in(vars(module), name)


class _RecordingModule(types.ModuleType):
    """The class of a user's module while a capture runs: an attribute read on it, in the
    capturing thread, is recorded (``ScopeReads._module_read``). The code build() runs reads a
    module's attributes statically too (``config.kl_weight``: a global, then the attribute),
    but ``getattr(config, name)`` or a module found in ``sys.modules`` reads no global of it."""

    def __getattribute__(self, name: str) -> Any:
        value = types.ModuleType.__getattribute__(self, name)
        scope = getattr(_active, "scope", None)
        if scope is not None and not name.startswith("__") and sys.gettrace() is _active.tracer:
            scope._module_read(self, name)
        return value


class _WatchedModules(SharedUse):
    """Every user's module of ``sys.modules`` (a plain module: not one whose class it set
    itself) has ``_RecordingModule`` as its class while some capture runs (``applied()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.modules: list[types.ModuleType] = []

    def _install(self) -> None:
        self.modules = [
            m
            for m in list(sys.modules.values())
            if type(m) is types.ModuleType and is_user_module(m)
        ]
        for m in self.modules:
            _set_class(m, _RecordingModule)

    def _restore(self) -> None:
        for m in self.modules:
            if type(m) is _RecordingModule:  # not set to another class meanwhile
                _set_class(m, types.ModuleType)
        self.modules = []


def _set_class(module: types.ModuleType, cls: type) -> None:
    module.__class__ = cls


_WATCHED_MODULES = _WatchedModules()


@contextlib.contextmanager
def untraced() -> Iterator[None]:
    """torch's own work for a function build() calls (the op's dispatch, fake and proxy
    tensors, functionalization) runs without the trace function: it reads none of the user's
    globals, and its many Python calls made capture twice as slow when traced."""
    tracer = getattr(_active, "tracer", None)
    if tracer is None or sys.gettrace() is not tracer:
        yield
        return
    with trace_function(None):  # put back on leaving
        yield


def _refuse_traced_contents(graph_name: str, read: AttributeRead) -> None:
    """A list or set that a global or closure variable holds, now holding a tensor of the
    trace (``LOG.append(out)`` in build(), a hook collecting activations): the compiled step
    would never add its real values there, and eager's adds them every call. Such tensors are
    taken out again (the container is as before) and the capture is refused. (A dict's entries
    are state changes, replayed: ``ScopeReads.state_changes``.)"""
    value = read.current()
    if not isinstance(value, (list, set)) or not any(map(_traced, value)):
        return
    _take_out_traced(value)
    raise CaptureError(
        f"{graph_name}.build() adds a tensor it computes to {read.label} (a "
        f"{type(value).__name__} outside the Graph and its modules): the compiled step runs "
        "without Python, so that container would keep a placeholder of the capture and never "
        "this step's values. Return the tensor from build(), set it as a dict entry "
        "(metrics['ce'] = ce), or assign it to an attribute of the Graph or a registered module "
        "(self.last = out, or self.last = [a, b]): those are put back after every call with "
        "that call's tensors"
    )


def _holds_traced(value: Any) -> bool:
    """Is ``value``, or anything the dicts, lists, tuples and sets in it hold, a tensor of the
    trace? Each container is walked once: a dict that holds itself is no endless walk."""
    stack, seen = [value], set()
    while stack:
        item = stack.pop()
        if _traced(item):
            return True
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
    return False


def _traced(value: Any) -> bool:
    return isinstance(value, (FakeTensor, FunctionalTensor))


def _nested_write(graph_name: str, read: AttributeRead, key: Any) -> CaptureError:
    """The refusal of a tensor of the trace put inside a container that an entry of a global's
    or closure's dict already held (``STATE["metrics"]["ce"] = ce``): the step could only replay
    a new container there, where eager changed the old one. The tensors are taken out again."""
    _take_out_traced(read.current()[key])
    return CaptureError(
        f"{graph_name}.build() puts a tensor it computes inside {read.label}[{key!r}] (a "
        "container that was there before the call): the compiled step runs without Python and "
        "can only set entries of the dict itself. Set it as an entry of that dict "
        "(metrics['ce'] = ce), return it from build(), or assign it to an attribute of the "
        "Graph. Your objects were put back as they were"
    )


def _take_out_traced(container: Any) -> None:
    """Remove the tensors of the trace from ``container`` and the dicts, lists and sets in it."""
    if isinstance(container, dict):
        for k in [k for k, v in container.items() if _traced(v)]:
            del container[k]
        children = list(container.values())
    elif isinstance(container, list):
        container[:] = [v for v in container if not _traced(v)]
        children = list(container)
    elif isinstance(container, set):
        container.difference_update([v for v in container if _traced(v)])
        children = []
    else:
        return
    for child in children:
        _take_out_traced(child)


def _is_setting(value: Any) -> bool:
    """A closure variable worth checking: data, a tensor or a module. A function or class a
    closure holds (a decorator's wrapped function) is code: finding its cell costs a search of
    every object, at every wrapper."""
    if isinstance(value, (torch.Tensor, nn.Module)):
        return True
    return guard_form(value)[1] or is_watchable(value)


def _read(label: str, namespace: Any, name: str, value: Any) -> AttributeRead | None:
    """The record of one global or closure read, or None where the value is not a setting."""
    if isinstance(value, types.ModuleType):
        return None
    if isinstance(value, nn.Module):
        watch_object(value, label)
        return AttributeRead(label, namespace, name, value, by_value=False)
    if isinstance(value, (torch.Tensor, type, types.FunctionType, types.BuiltinFunctionType)) or (
        isinstance(value, functools.partial)  # a loss made with partial(F.cross_entropy, ...)
    ):
        return AttributeRead(label, namespace, name, value, by_value=False)
    kept, by_value = guard_form(value)
    if not by_value and is_watchable(value):
        watch_object(value, name)  # an options object of the user's, a library's scheduler
        return AttributeRead(label, namespace, name, value, by_value=False)
    if not by_value:
        return None  # an object whose contents cannot be compared cheaply
    return AttributeRead(label, namespace, name, kept, by_value=True)


def _cell_of(frame: types.FrameType, name: str, value: Any) -> types.CellType | None:
    """The cell holding ``name`` for the function running in ``frame``: that function is found
    where its callers got it (their locals and globals, the objects among them and their
    classes, a bound method's function); for the user's own code, among all objects when that
    fails (a search of the whole heap, too slow for every library's decorators)."""
    code = frame.f_code
    index = code.co_freevars.index(name)
    seen: set[int] = set()
    outer = frame.f_back
    for _ in range(4):  # the callers that may hold it: build(), a module's __call__, ...
        if outer is None:
            break
        for holder in (outer.f_locals, outer.f_globals):
            for candidate in _functions_in(holder.values(), seen):
                cell = _matching_cell(candidate, code, index, value)
                if cell is not None:
                    return cell
        outer = outer.f_back
    if code.co_filename.startswith(INSTALLED):
        return None
    for candidate in gc.get_referrers(code):
        if isinstance(candidate, types.FunctionType):
            cell = _matching_cell(candidate, code, index, value)
            if cell is not None:
                return cell
    return None


def _functions_in(values: Iterable[Any], seen: set[int]) -> Iterator[types.FunctionType]:
    """The functions among ``values``, the functions of bound methods among them, and the ones
    one attribute or class attribute away."""
    for value in values:
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, types.MethodType):
            value = value.__func__
        if isinstance(value, types.FunctionType):
            yield value
        elif hasattr(value, "__dict__") and not isinstance(value, (types.ModuleType, type)):
            for inner in (*vars(value).values(), *vars(type(value)).values()):
                inner = inner.__func__ if isinstance(inner, types.MethodType) else inner
                if isinstance(inner, types.FunctionType):
                    yield inner


def _matching_cell(
    function: types.FunctionType, code: types.CodeType, index: int, value: Any
) -> types.CellType | None:
    if function.__code__ is not code or not function.__closure__:
        return None
    cell = function.__closure__[index]
    try:
        return cell if cell.cell_contents is value else None
    except ValueError:  # an empty cell
        return None


def _frame_of(frame: types.FrameType) -> UserFrame:
    return UserFrame(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)


def _where(frame: types.FrameType) -> str:
    at = _frame_of(frame)
    return f" at {at.short()} ({at.code})"
