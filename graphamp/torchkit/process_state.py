"""Everything graphamp holds for the whole process, declared in one place with its bound and why.

graphamp's state is per Graph (its records, programs and compiled steps) or per thread (a
capture's thread-locals). What cannot be is here: torch's own attributes, registries and hooks
are process-wide, and a few caches are worth more than one Graph's life. This module owns the
machinery for each kind, and ``PROCESS_STATE`` (below) lists every such thing graphamp holds,
here or in the module that needs it, with its bound and its reason:

- **patches** of torch's attributes (``SharedPatch``): capture replaces
  ``torch.autograd.Function.apply``, ``nn.Module.__setattr__``, classes' ``__getattribute__``
  and host random generators while build() is traced, ``torch.compiler._is_compiling_flag``
  while build() or an optimizer's ``step()`` is (``COMPILING``, ``compiling()``), and the step
  cache AOTAutograd's key function while a noted step compiles. Captures may run in several
  threads at once, so each is reference-counted (``SharedUse``): the first to enter installs
  it, the last to leave puts back what was there before, on every path. What a replacement does
  for the capture of *this* thread is the caller's business (thread-locals).
- **torch's effect registry** (``EFFECTS_LIFTED``): the effectful ops' entries are lifted
  while graphamp's functionalization traces (``torchkit/effects.py`` says why).
- **hooks**: torch's global module, parameter and buffer registration hooks, installed once and
  never removed (``REGISTRATIONS``, read by ``runtime/structure_key.py``); torch's global
  forward hooks for the length of a capture (``module_forward_hooks``); the interpreter's trace
  function for the length of build()'s trace (``trace_function``, ``capture/scope_reads.py``).
- **caches**: bounded by a count (``BoundedCache``: the oldest entry goes), by their keys'
  lives (weak dictionaries), or by something finite (the source files of the process).
- **registrations**: graphamp's torch ops, all registered at import by one module,
  ``torchkit/ops.py`` (``graphamp::``), and inductor's lowering of ``update_region``.

Rules (``tests/test_architecture.py`` checks them): torch's attributes are replaced only
through a ``SharedPatch``; ``sys.settrace`` and torch's global ``register_module_*`` hooks are
called only here; ``torch.library`` only in ``torchkit/ops.py``; and every module-level
container that graphamp mutates after import, every global a function rebinds and every
``functools.cache`` of a module-level function is an entry of ``PROCESS_STATE``.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._library, torch._library.simple_registry.singleton._data,
#   torch.compiler._is_compiling_flag
import contextlib
import itertools
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar

import torch.compiler
from torch.nn.modules import module as module_hooks

K = TypeVar("K")
V = TypeVar("V")
_MISSING = object()


@dataclass(frozen=True)
class Held:
    """One thing graphamp holds for the whole process (an entry of ``PROCESS_STATE``)."""

    where: str  # "graphamp/<module path>:<module-level name>"
    what: str
    bound: str  # how much of it there can be (or how long it lasts)
    why: str  # why it is process-wide and not per Graph or per thread


# -- reference-counted changes to the process ----------------------------------------------------


class SharedUse:
    """A change to the process made while at least one ``applied()`` block is open, in any
    thread: the first to enter makes it (``_install``), the last to leave undoes it
    (``_restore``), on every path."""

    def __init__(self) -> None:
        self._users = 0
        self._lock = threading.Lock()

    @property
    def in_use(self) -> bool:
        """Is the change made (some ``applied()`` block open)?"""
        return self._users > 0

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        with self._lock:
            if self._users == 0:
                self._install()
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    self._restore()

    def _install(self) -> None:
        raise NotImplementedError

    def _restore(self) -> None:
        raise NotImplementedError


class SharedPatch(SharedUse):
    """``owner.name = replacement`` while at least one ``applied()`` block is open."""

    def __init__(self, owner: Any, name: str, replacement: Any) -> None:
        super().__init__()
        self.owner = owner
        self.name = name
        self.replacement = replacement
        self.original: Any = _MISSING  # what the first user found (the raw class attribute)

    @property
    def available(self) -> bool:
        """Does the attribute exist in this torch release?"""
        return hasattr(self.owner, self.name)

    def _install(self) -> None:
        self.original = vars(self.owner).get(self.name, _MISSING)
        setattr(self.owner, self.name, self.replacement)

    def _restore(self) -> None:
        if self.original is _MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.original)


# torch's optimizers (and other library code) take their traced path (tensors for step counts,
# no host reads, no device checks meant for eager capturable steps) while
# ``torch.compiler.is_compiling()``, which reads this flag (torch 2.13-2.15): what
# torch.compile sets while Dynamo traces
COMPILING = SharedPatch(torch.compiler, "_is_compiling_flag", True)


def compiling() -> contextlib.AbstractContextManager[None]:
    """``torch.compiler.is_compiling()`` True for the block (``COMPILING``): while build() is
    captured (libraries skip host-side checks of tensor values, as under torch.compile) and
    while an optimizer's ``step()`` is traced or tried (its traced path). A release without the
    flag has nothing to set."""
    return COMPILING.applied() if COMPILING.available else contextlib.nullcontext()


class _EffectsLifted(SharedUse):
    """torch's effect registry with the effectful operators' entries lifted
    (``torchkit/effects.py``)."""

    def __init__(self) -> None:
        super().__init__()
        self._lifted: list[tuple[Any, Any]] = []  # (an entry's effect holder, the effect it had)

    def _install(self) -> None:
        self._lifted = [(holder, holder.effect) for holder in _effectful_ops()]
        for holder, _ in self._lifted:
            holder.register(None)

    def _restore(self) -> None:
        for holder, effect in self._lifted:
            holder.register(effect)
        self._lifted = []


def _effectful_ops() -> list[Any]:
    """The effect holders of the operators (not higher-order ops) torch marks effectful."""
    try:
        from torch._library.simple_registry import singleton
    except ImportError:  # a torch without the effect registry: nothing to lift
        return []
    entries = getattr(singleton, "_data", {})
    return [
        entry.effect
        for name, entry in list(entries.items())
        if not name.startswith("higher_order::") and getattr(entry.effect, "effect", None)
    ]


EFFECTS_LIFTED = _EffectsLifted()


# -- hooks -------------------------------------------------------------------------------------


class RegistrationEpoch:
    """A number that moves whenever torch registers a module, parameter or buffer anywhere in
    the process (``model.fc = nn.Linear(...)``, ``seq.append(...)``, ``model.weight =
    nn.Parameter(...)``), from torch's global registration hooks, installed by the first
    ``watch()`` and never removed (three hooks that count; graphamp's own capture writes the
    dicts directly and moves nothing)."""

    def __init__(self) -> None:
        self._count = itertools.count()
        self.epoch = next(self._count)
        self._watching = False
        self._lock = threading.Lock()

    def _bump(self, *_hook_args: Any) -> None:
        self.epoch = next(self._count)

    def watch(self) -> None:
        with self._lock:
            if self._watching:
                return
            module_hooks.register_module_module_registration_hook(self._bump)
            module_hooks.register_module_parameter_registration_hook(self._bump)
            module_hooks.register_module_buffer_registration_hook(self._bump)
            self._watching = True


REGISTRATIONS = RegistrationEpoch()


@contextlib.contextmanager
def module_forward_hooks(pre: Callable[..., Any], post: Callable[..., Any]) -> Iterator[None]:
    """torch's global forward pre-hook ``pre`` and forward hook ``post`` (always called, on an
    exception too) for the block: every module call in the process runs them, removed on
    leaving (capture's module stack, ``capture/intercept.py``)."""
    handles = [
        module_hooks.register_module_forward_pre_hook(pre),
        module_hooks.register_module_forward_hook(post, always_call=True),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def trace_function(tracer: Callable[..., Any] | None) -> Iterator[None]:
    """``sys.settrace(tracer)`` for the block (None: no trace function), what was set before
    put back on leaving. The interpreter's trace function is per thread, but it is also what
    debuggers and coverage tools use: graphamp sets it only here, and always puts theirs back."""
    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        yield
    finally:
        sys.settrace(previous)


# -- caches ------------------------------------------------------------------------------------


class BoundedCache(dict[K, V]):
    """A process-wide cache of at most ``bound`` entries: storing a new key in a full cache
    drops the oldest entry (dicts keep insertion order), which is made again if it is needed.
    Entries go in by ``cache[key] = value`` only."""

    def __init__(self, bound: int) -> None:
        super().__init__()
        self.bound = bound

    def __setitem__(self, key: K, value: V) -> None:
        if key not in self:
            while len(self) >= self.bound:
                del self[next(iter(self))]
        super().__setitem__(key, value)


# -- what graphamp holds -----------------------------------------------------------------------

_CAPTURE = "a class attribute of torch's, replaced for as long as any thread's capture runs"
PROCESS_STATE: tuple[Held, ...] = (
    Held(
        "graphamp/torchkit/process_state.py:COMPILING",
        "torch.compiler._is_compiling_flag, True",
        "one attribute, while build() or an optimizer's step() is traced in any thread",
        "torch reads the flag process-wide (is_compiling())",
    ),
    Held(
        "graphamp/capture/functions.py:_PATCH",
        "torch.autograd.Function.apply (custom Functions kept whole)",
        "one attribute, while any capture runs",
        _CAPTURE,
    ),
    Held(
        "graphamp/capture/state_writes.py:_PATCH",
        "nn.Module.__setattr__ (build()'s writes to module attributes)",
        "one attribute, while any capture runs",
        _CAPTURE,
    ),
    Held(
        "graphamp/capture/reads.py:_patches",
        "__getattribute__ of the classes whose reads a capture records, and the __getattr__ "
        "of those that define one (one SharedPatch each)",
        "the classes captures now in progress watch; the last to leave forgets its class",
        "a class attribute is process-wide; captures in several threads share one patch",
    ),
    Held(
        "graphamp/capture/optimizer_views.py:last_lrs_patch",
        "LRScheduler.get_last_lr (the lrs a capture's user code reads are recorded), the one "
        "SharedPatch it makes, held by capture/reads.py",
        "one attribute, while any capture runs",
        _CAPTURE,
    ),
    Held(
        "graphamp/capture/scope_reads.py:_WATCHED_MODULES",
        "the class of the user's plain modules in sys.modules (_RecordingModule: their reads)",
        "the user's modules at the first capture's start; put back when the last one ends",
        "a module's class is process-wide; captures in several threads share one swap",
    ),
    Held(
        "graphamp/capture/host_randomness.py:_PATCHES",
        "numpy's and random's host generators (host randomness in build() refused)",
        "a fixed list, made at import; installed while any capture runs",
        "module attributes of numpy and random are process-wide",
    ),
    Held(
        "graphamp/backend/aot_key.py:_key_patch",
        "AOTAutograd's autograd_cache_key (functools.cache: the one SharedPatch)",
        "one attribute, while any noted step compiles",
        "torch's module attribute is process-wide",
    ),
    Held(
        "graphamp/backend/aot_key.py:_active",
        "the steps being compiled now by a noted key, by id of their graph",
        "the compiles in progress (removed as each ends)",
        "the patched key function, process-wide, finds its step here from any thread",
    ),
    Held(
        "graphamp/torchkit/process_state.py:EFFECTS_LIFTED",
        "torch's effect registry, effectful ops' entries lifted (torchkit/effects.py)",
        "the registry's entries, while graphamp's functionalization traces in any thread",
        "torch's operator registry is process-wide",
    ),
    Held(
        "graphamp/torchkit/process_state.py:REGISTRATIONS",
        "torch's global module, parameter and buffer registration hooks (an epoch)",
        "three hooks, installed when the first Graph is made, never removed",
        "torch has only global registration hooks; the structure key reads the epoch each call",
    ),
    Held(
        "graphamp/torchkit/process_state.py:module_forward_hooks",
        "torch's global module forward pre-hook and forward hook (capture's module stack)",
        "two hooks, for the length of a capture",
        "the modules build() calls are the user's: only global hooks see them all",
    ),
    Held(
        "graphamp/torchkit/process_state.py:trace_function",
        "the interpreter's trace function, sys.settrace (capture/scope_reads.py)",
        "this thread, for the length of build()'s trace; the previous one put back",
        "shared with debuggers and coverage tools: set in one place, always restored",
    ),
    Held(
        "graphamp/runtime/interrupts.py:_deferral",
        "SIGINT's handler while a step commits its state (the interrupt is held back)",
        "one handler, installed at the first commit in the main thread, kept",
        "signal handlers are the process's",
    ),
    Held(
        "graphamp/torchkit/ops.py:_LIBRARY",
        "the graphamp:: torch library: every graphamp op (torchkit/ops.py)",
        "a fixed set of ops, registered once at import",
        "torch's dispatcher is process-wide; an unpickled step calls the ops by name",
    ),
    Held(
        "graphamp/torchkit/ops.py:_block_update_kernel",
        "the kernel graphamp::update_block_ runs, provided by step/block_update.py",
        "one function, set once at import",
        "the op is registered in torchkit, its math lives in the step layer",
    ),
    Held(
        "graphamp/torchkit/function_calls.py:_CALLS",
        "the custom autograd Function calls captured, by key (WeakValueDictionary)",
        "weak: the calls live captured forwards hold",
        "the graphamp::autograd_function op finds its call by an int key in the graph",
    ),
    Held(
        "graphamp/torchkit/update_region.py:_registered",
        "inductor's lowering of graphamp's update_region (registered once)",
        "one registration, at the first compile that uses it",
        "inductor's lowering table is process-wide",
    ),
    Held(
        "graphamp/step/block_update.py:_KERNELS",
        "the compiled kernels of block updates, by spec and strides (BoundedCache)",
        "256 kernels (block_update.MAX_KERNELS), the oldest dropped",
        "equal blocks of every Graph share one kernel; a restart finds none",
    ),
    Held(
        "graphamp/passes/fp32_where_faster.py:_TIMINGS",
        "an op's timings in low precision and fp32, by its sizes and arguments (BoundedCache)",
        "1024 sizes, the oldest dropped",
        "a size is timed once per process: every Graph and rebuild gets the same choice",
    ),
    Held(
        "graphamp/torchkit/fxutil.py:_is_library_cache",
        "whether a source file is torch's or graphamp's, by file name",
        "one bool per source file a traced frame came from (finite)",
        "asked for every frame capture names; the answer never changes",
    ),
    Held(
        "graphamp/capture/reads.py:_is_users_file",
        "whether a source file is the user's (functools.lru_cache)",
        "4096 file names",
        "asked for every attribute read capture records; the answer never changes",
    ),
    Held(
        "graphamp/capture/watched_code.py:_traced_code",
        "the reads and writes to watch in each code object (WeakKeyDictionary)",
        "weak: code objects alive (a notebook cell run again makes new ones)",
        "the same functions are traced by every capture",
    ),
    Held(
        "graphamp/sharding/rows.py:_ROWS",
        "the sharded parameters' rows, by storage (StorageWeakRef keys)",
        "weak: live storages; released ones dropped at each sharding (forget_released_rows)",
        "module.to() and swap_tensors keep the storage but not the parameter's attributes",
    ),
    Held(
        "graphamp/sharding/zero_state.py:_REGISTRY",
        "the sharded optimizers whose state_dict() gathers rows (WeakKeyDictionary)",
        "weak: optimizers alive",
        "state_dict() is the user's call on the optimizer, outside any Graph",
    ),
    Held(
        "graphamp/torchkit/rank_store.py:_LINKED",
        "how many data-parallel Graphs of each name this process linked (a Counter)",
        "one int per Graph name",
        "every rank numbers its Graphs of one name alike, whichever object made them",
    ),
    Held(
        "graphamp/backend/cache_directory.py:_opened",
        "the step cache's directories checked, and their secrets",
        "one entry per cache directory used",
        "a directory is checked once per process (a warning once)",
    ),
    Held(
        "graphamp/backend/step_key.py:graphamp_source",
        "a digest of graphamp's own source (functools.cache)",
        "one string",
        "the source does not change while the process runs",
    ),
    Held(
        "graphamp/passes/fp32_where_faster.py:_cpu_model",
        "the CPU's model name, read from /proc/cpuinfo once (functools.cache)",
        "one string",
        "the CPU does not change under a running process",
    ),
    Held(
        "graphamp/backend/source_keys.py:_settled",
        "whether torch's source hashes are settled for this process",
        "one bool",
        "torch's hashes are its own process-wide caches",
    ),
    Held(
        "graphamp/runner/host_memory.py:_kept",
        "glibc's malloc thresholds, set once (keep freed memory)",
        "one setting, never undone",
        "malloc's settings are the process's",
    ),
)
