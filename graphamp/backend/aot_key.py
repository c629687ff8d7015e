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

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from . import step_cache

_NOTE = "aot"  # the note's kind, beside the step's entry


@dataclass
class KeyMemo:
    """What happened to AOTAutograd's key during one compile."""

    remembered: bool = False  # the note's key was used: the step was not hashed


@contextmanager
def remembered_key(gm: fx.GraphModule, step_key: str | None, graph_name: str) -> Iterator[KeyMemo]:
    """While inductor compiles ``gm`` (the step saved or loaded under ``step_key``), its
    AOTAutograd cache key comes from the note when the compile's context matches the note's.
    Other graphs compiled meanwhile (the blocks' update kernels, other threads' graphs) are
    keyed as usual."""
    memo = KeyMemo()
    if step_key is None:
        yield memo
        return
    with _lock:
        if not _active:
            _install()
        _active[id(gm)] = (gm, step_key, graph_name, memo)
    try:
        yield memo
    finally:
        with _lock:
            del _active[id(gm)]
            if not _active:
                _uninstall()


# the steps being compiled now, by id: (graph, step key, graph name, memo); the key function
# is replaced while any is, and torch's is put back when the last one is done
_active: dict[int, tuple[fx.GraphModule, str, str, KeyMemo]] = {}
_lock = threading.Lock()
_torch_key_fn: list[Any] = []  # torch's autograd_cache_key, kept from the first install


def _install() -> None:
    from torch._functorch._aot_autograd import autograd_cache

    if not _torch_key_fn:
        _torch_key_fn.append(autograd_cache.autograd_cache_key)
    autograd_cache.autograd_cache_key = _key_of  # type: ignore[assignment]


def _uninstall() -> None:
    from torch._functorch._aot_autograd import autograd_cache

    autograd_cache.autograd_cache_key = _torch_key_fn[0]


def _key_of(mod: Any, example_inputs: Any, *rest: Any) -> Any:
    """AOTAutograd's ``autograd_cache_key``, from the note for a step being compiled (a call
    that began while ours was installed may end after: torch's is kept for it)."""
    compute = _torch_key_fn[0]
    graph = getattr(mod, "gm", mod)
    with _lock:
        found = _active.get(id(graph))
    if found is None or found[0] is not graph:
        return compute(mod, example_inputs, *rest)
    gm, step_key, graph_name, memo = found
    try:
        context = _context(compute, gm, example_inputs, rest)
    except Exception:  # the small key failed: the step is hashed, and no note kept
        return compute(mod, example_inputs, *rest)
    note = _read(graph_name, step_key)
    if note is not None and note.get("context") == context:
        memo.remembered = True
        return note["key"], []
    key, lines = compute(mod, example_inputs, *rest)
    step_cache.save_note(graph_name, step_key, _NOTE, {"context": context, "key": key})
    return key, lines


def _context(compute: Any, gm: fx.GraphModule, example_inputs: Any, rest: tuple) -> list:
    """What AOTAutograd's key reads besides the step's ops: its key of a graph of the step's
    inputs alone, in this compile; and the thread count, which inductor's key reads only where
    the graph makes CPU code (the inputs-only graph may not show it)."""
    inputs_only = _inputs_only(gm)
    key, _ = compute(inputs_only, example_inputs, *rest)
    return [key, torch.get_num_threads()]


def _inputs_only(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    for node in gm.graph.find_nodes(op="placeholder"):
        copy = graph.placeholder(node.target, type_expr=node.type)
        copy.meta.update(node.meta)
    graph.output(())
    return fx.GraphModule(torch.nn.Module(), graph)


def _read(graph_name: str, step_key: str) -> dict | None:
    note = step_cache.load_note(graph_name, step_key, _NOTE)
    if note is None or not isinstance(note.get("key"), str):
        return None
    return note
