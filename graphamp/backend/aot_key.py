"""AOTAutograd's cache key of a cached step, remembered beside the step cache's entry.

A restart loads the step from graphamp's step cache and hands it to inductor, whose lookup in
AOTAutograd's cache starts by hashing the whole step graph: its code, every input's metadata and
the compile's context (inductor's and AOTAutograd's settings, torch's build, the system, grad
mode, thread count...). For a 6-layer GPT-2 step (3,100 nodes) that hash was 0.68 s of a 2.5 s
restart on the CPU, more than anything else graphamp does on a restart.

The step graph is known before that hash: the step cache's key (``step_key.py``) holds
everything the step was made from, and a loaded step reproduces it node for node. What the key
does not hold is the compile's context. So the first compile under a step key writes a note
beside the step's entry: AOTAutograd's key, and the key AOTAutograd gives a graph of the step's
inputs alone (no ops) in the same compile, which covers the whole context and costs
milliseconds. A later compile of the same step computes that small key again; where it matches
the note's, AOTAutograd's key is the note's and the step is not hashed; where it does not (an
inductor setting, the thread count, torch, anything AOTAutograd's key reads changed), the step
is hashed as before and the note replaced. The note is authenticated like the entry
(``step_cache.save_note``), so a planted or edited one is ignored with a warning.

Only the key computation is replaced: AOTAutograd still looks the key up, and an entry missing
from inductor's cache (cleared, evicted) is compiled and saved under it, which is the key the
step's hash would have given.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._functorch._aot_autograd
import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from ..torchkit.process_state import SharedPatch
from . import step_cache
from .compile import default_inductor_options

_NOTE = "aot"  # the note's kind, beside the step's entry


@dataclass
class KeyMemo:
    """What happened to AOTAutograd's key during one compile."""

    remembered: bool = False  # the note's key was used: the step was not hashed


@dataclass(frozen=True)
class _StandIn:
    """A restart's stand-in for a step it did not load (``noted_step.py``): the note whose key
    it takes, and the inputs-only graph of the note's names its context is computed on."""

    note: dict
    inputs_only: fx.GraphModule


@dataclass(frozen=True)
class _Compiling:
    """A graph being compiled now whose AOTAutograd key may come from a note."""

    graph: fx.GraphModule
    step_key: str  # "" for a stand-in (its note is given)
    graph_name: str
    memo: KeyMemo
    stand_in: _StandIn | None = None
    extra: tuple[tuple[str, Any], ...] = ()  # written into the note beside what it reads


class NotNoted(BaseException):
    """A stand-in's compile stopped: the note does not hold this compile's context, or
    inductor's caches do not hold the step. A BaseException, so that no ``except Exception``
    of torch's between the key (or the stand-in's trace) and the caller turns it into a
    fallback that would compile the stand-in."""


@contextmanager
def remembered_key(
    gm: fx.GraphModule, step_key: str | None, graph_name: str, extra: dict | None = None
) -> Iterator[KeyMemo]:
    """While inductor compiles ``gm`` (the step saved or loaded under ``step_key``), its
    AOTAutograd cache key comes from the note when the compile's context matches the note's.
    Other graphs compiled meanwhile (the blocks' update kernels, other threads' graphs) are
    keyed as usual. ``extra``: JSON values a new note keeps besides (what else a compile from
    the note needs)."""
    if step_key is None:
        yield KeyMemo()
        return
    more = tuple((extra or {}).items())
    with _registered(_Compiling(gm, step_key, graph_name, KeyMemo(), extra=more)) as compiling:
        yield compiling.memo


@contextmanager
def noted_key(stand_in: fx.GraphModule, note: dict, graph_name: str) -> Iterator[KeyMemo]:
    """While inductor compiles ``stand_in`` (``noted_step.py``), its AOTAutograd key is
    ``note``'s, where the context computed on a graph of the note's inputs matches the note's;
    otherwise the compile stops with ``NotNoted``."""
    inputs_only = _inputs_only([(name, None) for name in note["inputs"]])
    compiling = _Compiling(stand_in, "", graph_name, KeyMemo(), _StandIn(note, inputs_only))
    with _registered(compiling):
        yield compiling.memo


@contextmanager
def _registered(compiling: _Compiling) -> Iterator[_Compiling]:
    with _key_patch().applied():
        with _lock:
            _active[id(compiling.graph)] = compiling
        try:
            yield compiling
        finally:
            with _lock:
                del _active[id(compiling.graph)]


# the steps being compiled now, by id; AOTAutograd's key function is replaced while any is
# (a SharedPatch: the last one done puts torch's back)
_active: dict[int, _Compiling] = {}
_lock = threading.Lock()


@functools.cache
def _key_patch() -> SharedPatch:
    from torch._functorch._aot_autograd import autograd_cache

    return SharedPatch(autograd_cache, "autograd_cache_key", _key_of)


def _key_of(mod: Any, example_inputs: Any, *rest: Any) -> Any:
    """AOTAutograd's ``autograd_cache_key``, from the note for a step being compiled (a call
    that began while ours was installed may end after: torch's is kept for it)."""
    compute = _key_patch().original  # torch's, kept from the first install
    graph = getattr(mod, "gm", mod)
    with _lock:
        found = _active.get(id(graph))
    if found is None or found.graph is not graph:
        return compute(mod, example_inputs, *rest)
    if found.stand_in is not None:
        return _stand_in_key(compute, found.stand_in, found.memo, example_inputs, rest)
    try:
        context = _context(compute, _inputs_only(_inputs(graph)), example_inputs, rest)
    except Exception:  # the small key failed: the step is hashed, and no note kept
        return compute(mod, example_inputs, *rest)
    note = read_note(found.graph_name, found.step_key)
    if note is not None and note.get("context") == context:
        found.memo.remembered = True
        return note["key"], []
    key, lines = compute(mod, example_inputs, *rest)
    step_cache.save_note(
        found.graph_name,
        found.step_key,
        _NOTE,
        {**_note(graph, example_inputs, context, key), **dict(found.extra)},
    )
    return key, lines


def _stand_in_key(
    compute: Any, stand_in: _StandIn, memo: KeyMemo, example_inputs: Any, rest: tuple
) -> Any:
    try:
        context = _context(compute, stand_in.inputs_only, example_inputs, rest)
    except Exception as e:
        raise NotNoted(f"the compile's context could not be keyed ({type(e).__name__})") from e
    if stand_in.note.get("context") != context:
        raise NotNoted("the compile's context is not the note's")
    memo.remembered = True
    return stand_in.note["key"], []


def _note(graph: fx.GraphModule, example_inputs: Any, context: list, key: str) -> dict:
    """The note: the context and the key, and what a restart needs to compile the step from
    the note alone (``noted_step.py``): the step's input names (where all are untyped), its
    node count, and the inductor settings graphamp derived from its graph."""
    note: dict[str, Any] = {"context": context, "key": key}
    placeholders = graph.graph.find_nodes(op="placeholder")
    if all(n.type is None for n in placeholders):
        note["inputs"] = [n.target for n in placeholders]
        note["nodes"] = len(graph.graph.nodes)
        note["defaults"] = default_inductor_options(graph, list(example_inputs))
    return note


def _context(compute: Any, inputs_only: fx.GraphModule, example_inputs: Any, rest: tuple) -> list:
    """What AOTAutograd's key reads besides the step's ops: its key of a graph of the step's
    inputs alone, in this compile; and the thread count, which inductor's key reads only where
    the graph makes CPU code (the inputs-only graph may not show it)."""
    key, _ = compute(inputs_only, example_inputs, *rest)
    return [key, torch.get_num_threads()]


def _inputs(gm: fx.GraphModule) -> list[tuple[str, Any]]:
    return [(n.target, n.type) for n in gm.graph.find_nodes(op="placeholder")]


def _inputs_only(inputs: list[tuple[str, Any]]) -> fx.GraphModule:
    """A graph of these inputs (name, type) and no ops: what the context is computed on, made
    the same way from a step and from a note's names."""
    graph = fx.Graph()
    for name, type_expr in inputs:
        graph.placeholder(name, type_expr=type_expr)
    graph.output(())
    return fx.GraphModule(torch.nn.Module(), graph)


def read_note(graph_name: str, step_key: str) -> dict | None:
    note = step_cache.load_note(graph_name, step_key, _NOTE)
    if note is None or not isinstance(note.get("key"), str):
        return None
    return note
