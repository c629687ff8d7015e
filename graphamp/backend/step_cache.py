"""graphamp's step cache: the assembled (and outlined) step on disk, so a restart skips
assembly and outlining.

A new process still captures build() (that is what reads the user's code), runs the AMP passes
and plans the step; then, where the last run saved a step under the same key
(``step_key.py``), it loads that step graph instead of tracing the forward, backward and
optimizer update again, and compiles it. The compile is inductor's, served by inductor's
FX-graph cache and AOTAutograd's cache as before: their keys read the step's code, which a
loaded step reproduces node for node.

Where: ``graphamp/steps`` under inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR``), so one
setting moves or clears both; ``GRAPHAMP_CACHE_DIR`` moves graphamp's alone (the tests give each
test its own). ``config.set_step_cache(False)`` turns it off for a Graph.

An entry is a header (format, an HMAC-SHA256 of the key it was saved under, graphamp's source
and the payload) and the step graph pickled by torch's ``GraphPickler``, node metadata included
(the dumps and ``step_memory`` read it), its traced values in a compact form
(``step_values.py``). A data-dependent size (a boolean mask's) has no name a later trace would
give it, so a step with one and symbolic sizes is not saved.

Trust and size: the directory is checked to be the user's own, entries are authenticated
before anything is unpickled, and entries not read for 30 days are removed
(``cache_directory.py``). An authenticated entry is unpickled by an allow-listed unpickler
(``step_unpickler.py``) that builds only what a step holds.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._subclasses
import json
import logging
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from ..errors import GraphampError
from ..torchkit.fxutil import graph_modules
from . import cache_directory, step_unpickler, step_values

log = logging.getLogger("graphamp")

_REBUILD = "assembling the step again and replacing it"  # what follows a refused entry


@dataclass
class CachedStep:
    step_gm: fx.GraphModule
    outline: Any  # step.outline.OutlineResult, or None when outlining did not run
    # in an entry only: (graph module path, node name, value) for the values taken out of the
    # graph's metadata (``save``), put back on load
    values: list[tuple[str, str, Any]] = field(default_factory=list)
    # in an entry of a step traced with symbolic sizes: the guards (sympy expressions over the
    # batch's size symbols) its ShapeEnv held, which the build that loads it assumes too
    shape_guards: list[Any] = field(default_factory=list)


def entry_path(key: str) -> str:
    return os.path.join(cache_directory.directory(), f"{key}.step")


def load(graph_name: str, key: str, fake_mode: FakeTensorMode) -> CachedStep | None:
    """The step saved under ``key`` (its tensors' metadata as fakes of ``fake_mode``), or None
    when there is none; a damaged entry is None too, with a warning."""
    path = entry_path(key)
    payload = cache_directory.read_authenticated(graph_name, key, path, _REBUILD)
    if payload is None:
        return None
    return _unpickled(graph_name, path, payload, fake_mode)


def load_later(
    graph_name: str, key: str, fake_mode: FakeTensorMode
) -> Callable[[], fx.GraphModule] | None:
    """The step saved under ``key``, authenticated now and unpickled by the function returned
    when it is called (``noted_step.py``: a restart may never need the graph); None as
    ``load``. The entry's bytes are kept meanwhile: what is unpickled later is what was
    authenticated, whatever happens to the file."""
    path = entry_path(key)
    payload = cache_directory.read_authenticated(graph_name, key, path, _REBUILD)
    if payload is None:
        return None

    def unpickle() -> fx.GraphModule:
        step = _unpickled(graph_name, path, payload, fake_mode)
        if step is None:  # authenticated, so graphamp's own fault; the warning said why
            raise GraphampError(
                f"{graph_name}: the step cache's entry {path} was authenticated when the step "
                "was built, but its graph does not load now; the compiled step runs as built. "
                "Please report this"
            )
        return step.step_gm

    return unpickle


def _unpickled(
    graph_name: str, path: str, payload: bytes, fake_mode: FakeTensorMode
) -> CachedStep | None:
    try:
        step = step_unpickler.loads(payload, fake_mode)  # what a step holds, nothing else
    except Exception as e:  # a damaged or foreign pickle can raise anything
        cache_directory.warn_ignored(
            graph_name, path, f"it does not load ({type(e).__name__}: {e})", _REBUILD
        )
        return None
    return _restored(graph_name, path, step, fake_mode)


def _restored(graph_name: str, path: str, step: Any, fake_mode: FakeTensorMode) -> Any:
    """An unpickled entry made a step again: its values as fakes of ``fake_mode``, its size
    guards assumed; None, with a warning, when it does not hold a step."""
    if not isinstance(step, CachedStep) or not isinstance(step.step_gm, fx.GraphModule):
        cache_directory.warn_ignored(
            graph_name, path, f"it holds a {type(step).__name__}, not a step", _REBUILD
        )
        return None
    if not step_values.guards_hold(step.shape_guards, fake_mode):
        log.info("%s: step cache: the entry's size guards do not hold for this batch", graph_name)
        return None
    try:
        step_values.put_values(step.step_gm, step.values, fake_mode)
        step_values.assume(step.shape_guards, fake_mode)
    except Exception as e:  # as above
        cache_directory.warn_ignored(
            graph_name, path, f"its values do not load ({type(e).__name__}: {e})", _REBUILD
        )
        return None
    for gm in graph_modules(step.step_gm):
        gm.recompile()  # GraphPickler leaves the graph modules without their forward()
    return CachedStep(step.step_gm, step.outline)


def save(graph_name: str, key: str, step: CachedStep) -> bool:
    """Write ``step`` under ``key`` (atomically); False, logged, when it cannot be written or
    pickled (the program runs all the same)."""
    guards = step_values.shape_guards(
        step.step_gm
    )  # read from the placeholders, before they are taken
    taken = step_values.take_values(step.step_gm)
    if guards and step_values.left_symbolic(step.step_gm):
        # symbolic batch sizes and a data-dependent one: GraphPickler's form of the latter
        # would bring the tracing ShapeEnv along, which a build with symbols of its own cannot
        # take (with static batch sizes it can, and does)
        step_values.put_back(taken)
        log.info("%s: step cache: not saved (symbolic sizes and data-dependent ones)", graph_name)
        return False
    try:
        values = [(path, name, step_values.encode(meta["val"])) for path, name, _, meta in taken]
        entry = replace(step, values=values, shape_guards=guards)
        payload = step_unpickler.dumps(entry)
    except step_unpickler.UnloadableGlobal as e:  # the two halves of one list disagree
        # the record says what it is (``unloadable_global``), whatever the wording: the test
        # suite fails any test that meets it
        log.warning(
            "%s: step cache: not saved: %s", graph_name, e, extra={"unloadable_global": str(e)}
        )
        return False
    except Exception as e:  # a graph the pickler does not support is not cached
        log.info("%s: step cache: not saved (%s: %s)", graph_name, type(e).__name__, e)
        return False
    finally:
        step_values.put_back(taken)
    return cache_directory.write_authenticated(graph_name, key, entry_path(key), payload)


def save_note(graph_name: str, key: str, kind: str, note: dict) -> bool:
    """Write a note of ``kind`` (a JSON object) about the step under ``key``, authenticated as
    entries are (``aot_key.py``, ``source_keys.py``); False, logged, when it cannot be
    written."""
    payload = json.dumps(note, sort_keys=True).encode()
    return cache_directory.write_authenticated(
        graph_name, _note_mac_key(key, kind), _note_path(key, kind), payload
    )


def load_note(graph_name: str, key: str, kind: str) -> dict | None:
    """The note of ``kind`` about the step under ``key``; None when there is none, or (with a
    warning) when it is damaged or not authentic. Its fields are the caller's to check."""
    path = _note_path(key, kind)
    payload = cache_directory.read_authenticated(
        graph_name, _note_mac_key(key, kind), path, "replacing it"
    )
    if payload is None:
        return None
    try:
        note = json.loads(payload)
    except ValueError:  # authentic, so written by another graphamp: replaced when next saved
        return None
    return note if isinstance(note, dict) else None


def _note_path(key: str, kind: str) -> str:
    return os.path.join(cache_directory.directory(), f"{key}.{kind}")


def _note_mac_key(key: str, kind: str) -> str:
    return f"{key}.{kind}"  # a note is never taken for an entry, nor for another kind of note
