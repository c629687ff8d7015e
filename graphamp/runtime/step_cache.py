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

An entry is a header (format, the payload's sha256) and the step graph pickled by torch's
``GraphPickler``, node metadata included (the dumps and ``step_memory`` read it). The traced
values (``meta["val"]``) of static sizes are stored as (shape, strides, dtype, device) and made
fake tensors again on load: GraphPickler's general form of them was 0.4 s of a 0.46 s load of a
6-layer GPT-2 step (2,000 nodes); ``meta["tensor_meta"]``, which nothing after assembly reads,
is left out. A file that
is unreadable, truncated, of another format, or whose payload does not match its digest is
ignored with a warning and rebuilt (then written again). Entries are written to a temporary file
and renamed into place, so two processes saving one entry at once leave one whole entry, and a
reader never sees half of one. Like inductor's cache, entries are pickles: the directory must be
writable only by people whose code you would run.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from .inductor_cache import cache_directory

log = logging.getLogger("graphamp")

_MAGIC = b"graphamp-step-cache 1\n"
_DIGEST = 32  # bytes of sha256


@dataclass
class CachedStep:
    step_gm: fx.GraphModule
    outline: Any  # step.outline.OutlineResult, or None when outlining did not run
    # in an entry only: (graph module path, node name, value) for the values taken out of the
    # graph's metadata (``save``), put back on load
    values: list[tuple[str, str, Any]] = field(default_factory=list)


def directory() -> str:
    root = os.environ.get("GRAPHAMP_CACHE_DIR") or os.path.join(cache_directory(), "graphamp")
    return os.path.join(root, "steps")


def entry_path(key: str) -> str:
    return os.path.join(directory(), f"{key}.step")


def load(graph_name: str, key: str, fake_mode: FakeTensorMode) -> CachedStep | None:
    """The step saved under ``key`` (its tensors' metadata as fakes of ``fake_mode``), or None
    when there is none; a damaged entry is None too, with a warning."""
    path = entry_path(key)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        _warn(graph_name, path, f"unreadable ({e})")
        return None
    head = len(_MAGIC)
    if not data.startswith(_MAGIC) or len(data) < head + _DIGEST:
        _warn(graph_name, path, "not a graphamp step cache entry of this version, or truncated")
        return None
    digest, payload = data[head : head + _DIGEST], data[head + _DIGEST :]
    if hashlib.sha256(payload).digest() != digest:
        _warn(graph_name, path, "its contents do not match its checksum (truncated or altered)")
        return None
    try:
        from torch.fx._graph_pickler import GraphPickler

        step = GraphPickler.loads(payload, fake_mode)
    except Exception as e:  # noqa: BLE001 - a damaged or foreign pickle can raise anything
        _warn(graph_name, path, f"it does not load ({type(e).__name__}: {e})")
        return None
    if not isinstance(step, CachedStep) or not isinstance(step.step_gm, fx.GraphModule):
        _warn(graph_name, path, f"it holds a {type(step).__name__}, not a step")
        return None
    try:
        _put_values(step.step_gm, step.values, fake_mode)
    except Exception as e:  # noqa: BLE001 - as above
        _warn(graph_name, path, f"its values do not load ({type(e).__name__}: {e})")
        return None
    for gm in _graph_modules(step.step_gm):
        gm.recompile()  # GraphPickler leaves the graph modules without their forward()
    return CachedStep(step.step_gm, step.outline)


def save(graph_name: str, key: str, step: CachedStep) -> bool:
    """Write ``step`` under ``key`` (atomically); False, logged, when it cannot be written or
    pickled (the program runs all the same)."""
    taken = _take_values(step.step_gm)
    try:
        from torch.fx._graph_pickler import GraphPickler, Options

        values = [(path, name, _encode(meta["val"])) for path, name, _, meta in taken]
        payload = GraphPickler.dumps(replace(step, values=values), Options(ops_filter=None))
    except Exception as e:  # noqa: BLE001 - a graph the pickler does not support is not cached
        log.info("%s: step cache: not saved (%s: %s)", graph_name, type(e).__name__, e)
        return False
    finally:
        _put_back(taken)
    folder = directory()
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".step")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + hashlib.sha256(payload).digest() + payload)
            os.replace(tmp, entry_path(key))
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        log.warning("%s: step cache: could not write to %s (%s)", graph_name, folder, e)
        return False
    return True


# -- traced values, stored compactly ----------------------------------------------------------------

_TAKEN_META = ("val", "tensor_meta")


def _graph_modules(gm: fx.GraphModule) -> list[fx.GraphModule]:
    return [m for m in gm.modules() if isinstance(m, fx.GraphModule)]


def _encodable(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.layout is torch.strided and all(
            type(x) is int for x in (*value.shape, *value.stride(), value.storage_offset())
        )
    if isinstance(value, (tuple, list)):
        return all(map(_encodable, value))
    return value is None or type(value) in (int, float, bool)


def _encode(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (
            "tensor",
            tuple(value.shape),
            value.stride(),
            value.storage_offset(),
            value.dtype,
            str(value.device),
            value.requires_grad,
        )
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, [_encode(v) for v in value])
    return ("value", value)


def _decode(code: Any, mode: FakeTensorMode) -> Any:
    kind = code[0]
    if kind == "tensor":
        _, shape, stride, offset, dtype, device, requires_grad = code
        meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        if offset:
            meta = meta.as_strided(shape, stride, offset)
        fake = FakeTensor(mode, meta, torch.device(device))
        return fake.requires_grad_(True) if requires_grad else fake
    if kind in ("tuple", "list"):
        items = [_decode(c, mode) for c in code[1]]
        return tuple(items) if kind == "tuple" else items
    return code[1]


_Taken = list[tuple[str, str, fx.Node, dict]]


def _take_values(gm: fx.GraphModule) -> _Taken:
    """Take the encodable values (and tensor_meta) of the non-placeholder nodes out of their
    metadata, for ``_put_back``: (graph module path, node name, node, what was taken)."""
    taken = []
    paths = {id(m): path for path, m in gm.named_modules()}
    for m in _graph_modules(gm):
        for node in m.graph.nodes:
            if node.op != "placeholder" and "val" in node.meta and _encodable(node.meta["val"]):
                meta = {k: node.meta.pop(k) for k in _TAKEN_META if k in node.meta}
                taken.append((paths[id(m)], node.name, node, meta))
    return taken


def _put_back(taken: _Taken) -> None:
    for _, _, node, meta in taken:
        node.meta.update(meta)


def _put_values(gm: fx.GraphModule, values: list, mode: FakeTensorMode) -> None:
    modules = dict(gm.named_modules())
    nodes: dict[tuple[str, str], fx.Node] = {}
    for path, name, code in values:
        if (path, name) not in nodes:
            graph = modules[path].graph
            nodes.update({(path, n.name): n for n in graph.nodes})
        nodes[(path, name)].meta["val"] = _decode(code, mode)


def _warn(graph_name: str, path: str, why: str) -> None:
    log.warning(
        "%s: step cache: ignoring %s: %s; assembling the step again and replacing it",
        graph_name,
        path,
        why,
    )
