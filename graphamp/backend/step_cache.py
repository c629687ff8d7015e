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
and the payload) and the step graph pickled by torch's ``GraphPickler``, node metadata included (the dumps and ``step_memory`` read it). The traced
values (``meta["val"]``) of static sizes are stored as (shape, strides, dtype, device) and made
fake tensors again on load: GraphPickler's general form of them was 0.4 s of a 0.46 s load of a
6-layer GPT-2 step (2,000 nodes); ``meta["tensor_meta"]``, which nothing after assembly reads,
is left out. A step traced with symbolic sizes stores its sizes as sympy expressions over the
batch's size symbols, and the guards its ShapeEnv held: a build that loads it checks them against
its own sizes, makes its values over its own ShapeEnv (the key names the same symbols) and
assumes the guards as its assembly would have. A data-dependent size (a boolean mask's) has no
name a later trace would give it, so such a step is not saved.

Trust. An entry is a pickle, and unpickling runs code, so nothing is unpickled before it is
authenticated: the HMAC's key is a secret of 32 random bytes made on first use in the cache's
own directory (``secret``, mode 0600), and an entry whose HMAC does not match (planted, edited
and re-digested, copied from another key's file, written by another user or another graphamp)
is ignored with a warning and rebuilt, as is one that is unreadable, truncated or of another
format. An authenticated entry is unpickled by an allow-listed unpickler
(``step_unpickler.py``) that builds only what a step holds. The directory must be the user's own: it, the directories graphamp creates in it and
the secret are checked to be owned by the user, not symbolic links, and writable by no one else
(``private_directory``); otherwise the step cache is off for the process, with a warning.
Entries are written to a temporary file, flushed to disk and renamed into place, so two
processes saving one entry at once leave one whole entry and a reader never sees half of one;
temporary files a killed process left for over an hour are removed.

Size. Every graphamp source, torch build and model change keys new entries, and the old ones
are never read again: when a process first opens the directory it removes the entries and notes
not read for 30 days (``GRAPHAMP_CACHE_DAYS`` to change; reading one marks it used), logged at
INFO. A removed entry is a rebuild, never a wrong step.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import stat
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from ..errors import GraphampError
from ..torchkit.compat import backed_sizes
from ..torchkit.fxutil import graph_modules
from . import step_unpickler
from .inductor_cache import cache_directory
from .step_key import graphamp_source

log = logging.getLogger("graphamp")

_MAGIC = b"graphamp-step-cache 2\n"
_DIGEST = 32  # bytes of HMAC-SHA256
_STALE_TMP_S = 3600  # a temporary file older than this was left by a killed writer
_UNUSED_DAYS = 30.0  # an entry or note not read for longer is removed (GRAPHAMP_CACHE_DAYS)
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


def root() -> str:
    return os.environ.get("GRAPHAMP_CACHE_DIR") or os.path.join(cache_directory(), "graphamp")


def directory() -> str:
    return os.path.join(root(), "steps")


def entry_path(key: str) -> str:
    return os.path.join(directory(), f"{key}.step")


def load(graph_name: str, key: str, fake_mode: FakeTensorMode) -> CachedStep | None:
    """The step saved under ``key`` (its tensors' metadata as fakes of ``fake_mode``), or None
    when there is none; a damaged entry is None too, with a warning."""
    path = entry_path(key)
    payload = _authenticated_payload(graph_name, key, path)
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
    payload = _authenticated_payload(graph_name, key, path)
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
        _warn(graph_name, path, f"it does not load ({type(e).__name__}: {e})")
        return None
    return _restored(graph_name, path, step, fake_mode)


def _restored(graph_name: str, path: str, step: Any, fake_mode: FakeTensorMode) -> Any:
    """An unpickled entry made a step again: its values as fakes of ``fake_mode``, its size
    guards assumed; None, with a warning, when it does not hold a step."""
    if not isinstance(step, CachedStep) or not isinstance(step.step_gm, fx.GraphModule):
        _warn(graph_name, path, f"it holds a {type(step).__name__}, not a step")
        return None
    if not _guards_hold(step.shape_guards, fake_mode):
        log.info("%s: step cache: the entry's size guards do not hold for this batch", graph_name)
        return None
    try:
        _put_values(step.step_gm, step.values, fake_mode)
        _assume(step.shape_guards, fake_mode)
    except Exception as e:  # as above
        _warn(graph_name, path, f"its values do not load ({type(e).__name__}: {e})")
        return None
    for gm in graph_modules(step.step_gm):
        gm.recompile()  # GraphPickler leaves the graph modules without their forward()
    return CachedStep(step.step_gm, step.outline)


def _authenticated_payload(
    graph_name: str, mac_key: str, path: str, then: str = _REBUILD
) -> bytes | None:
    """The payload of the file at ``path``, once its HMAC under ``mac_key`` is checked
    (nothing is unpickled before); None when there is no file, or (with a warning ending in
    ``then``) when it is unreadable or not authentic."""
    secret = _secret(graph_name)
    if secret is None:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        _warn(graph_name, path, f"unreadable ({e})", then)
        return None
    head = len(_MAGIC)
    if not data.startswith(_MAGIC) or len(data) < head + _DIGEST:
        _warn(
            graph_name, path, "not a graphamp step cache file of this version, or truncated", then
        )
        return None
    digest, payload = data[head : head + _DIGEST], data[head + _DIGEST :]
    if not hmac.compare_digest(digest, _mac(secret, mac_key, payload)):
        _warn(
            graph_name,
            path,
            "it is not authenticated (truncated, altered, copied from another entry or "
            "written by someone else); it was not unpickled",
            then,
        )
        return None
    _mark_used(path)
    return payload


def save(graph_name: str, key: str, step: CachedStep) -> bool:
    """Write ``step`` under ``key`` (atomically); False, logged, when it cannot be written or
    pickled (the program runs all the same)."""
    guards = _shape_guards(step.step_gm)  # read from the placeholders, before they are taken
    taken = _take_values(step.step_gm)
    if guards and _left_symbolic(step.step_gm):
        # symbolic batch sizes and a data-dependent one: GraphPickler's form of the latter
        # would bring the tracing ShapeEnv along, which a build with symbols of its own cannot
        # take (with static batch sizes it can, and does)
        _put_back(taken)
        log.info("%s: step cache: not saved (symbolic sizes and data-dependent ones)", graph_name)
        return False
    try:
        from torch.fx._graph_pickler import GraphPickler, Options

        values = [(path, name, _encode(meta["val"])) for path, name, _, meta in taken]
        entry = replace(step, values=values, shape_guards=guards)
        payload = GraphPickler.dumps(entry, Options(ops_filter=None))
    except Exception as e:  # a graph the pickler does not support is not cached
        log.info("%s: step cache: not saved (%s: %s)", graph_name, type(e).__name__, e)
        return False
    finally:
        _put_back(taken)
    return _write(graph_name, key, entry_path(key), payload)


def save_note(graph_name: str, key: str, kind: str, note: dict) -> bool:
    """Write a note of ``kind`` (a JSON object) about the step under ``key``, authenticated as
    entries are (``aot_key.py``, ``source_keys.py``); False, logged, when it cannot be
    written."""
    payload = json.dumps(note, sort_keys=True).encode()
    return _write(graph_name, _note_mac_key(key, kind), _note_path(key, kind), payload)


def load_note(graph_name: str, key: str, kind: str) -> dict | None:
    """The note of ``kind`` about the step under ``key``; None when there is none, or (with a
    warning) when it is damaged or not authentic. Its fields are the caller's to check."""
    path = _note_path(key, kind)
    payload = _authenticated_payload(graph_name, _note_mac_key(key, kind), path, "replacing it")
    if payload is None:
        return None
    try:
        note = json.loads(payload)
    except ValueError:  # authentic, so written by another graphamp: replaced when next saved
        return None
    return note if isinstance(note, dict) else None


def _note_path(key: str, kind: str) -> str:
    return os.path.join(directory(), f"{key}.{kind}")


def _note_mac_key(key: str, kind: str) -> str:
    return f"{key}.{kind}"  # a note is never taken for an entry, nor for another kind of note


def _write(graph_name: str, mac_key: str, path: str, payload: bytes) -> bool:
    """``payload`` authenticated under ``mac_key`` in ``path``: written to a temporary file,
    flushed and renamed into place; False, logged, when it cannot be written."""
    secret = _secret(graph_name)
    if secret is None:
        return False
    folder = directory()
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".step")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + _mac(secret, mac_key, payload) + payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        log.warning("%s: step cache: could not write to %s (%s)", graph_name, folder, e)
        return False
    return True


# -- trust ---------------------------------------------------------------------------------------

_opened: dict[str, bytes | None] = {}  # cache root -> its secret (None: not private), per process
_opened_lock = threading.Lock()


def _mac(secret: bytes, key: str, payload: bytes) -> bytes:
    """What authenticates an entry: the key it is saved under, graphamp's source, the payload."""
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for part in (key.encode(), graphamp_source().encode(), payload):
        mac.update(len(part).to_bytes(8, "little"))
        mac.update(part)
    return mac.digest()


def _secret(graph_name: str) -> bytes | None:
    """The secret of the cache's directory (made on first use), after checking that the
    directory is the user's own; None, with a warning once per directory, when it is not."""
    top = root()
    with _opened_lock:
        if top not in _opened:
            try:
                _opened[top] = _open_directory(top)
            except (OSError, PermissionError) as e:
                log.warning(
                    "%s: step cache: off for this process: %s (set GRAPHAMP_CACHE_DIR to a "
                    "directory of your own, or delete this one)",
                    graph_name,
                    e,
                )
                _opened[top] = None
        return _opened[top]


def _open_directory(top: str) -> bytes:
    """Check (or make) the cache's directories, clear stale temporary files, read (or make) the
    secret."""
    for folder in (top, os.path.join(top, "steps")):
        os.makedirs(folder, mode=0o700, exist_ok=True)
    for folder in (os.path.dirname(top), top, os.path.join(top, "steps")):
        private_directory(folder)
    _remove_old_files(os.path.join(top, "steps"))
    path = os.path.join(top, "secret")
    if not os.path.lexists(path):
        _write_secret(top, path)
    _check_private(path, os.lstat(path), "the secret")
    with open(path, "rb") as f:
        secret = f.read()
    if len(secret) != 32:  # damaged: a new secret, so every entry made with the old is rebuilt
        log.warning("step cache: the secret %s is damaged; making a new one", path)
        secret = _write_secret(top, path, replace=True)
    return secret


def _write_secret(top: str, path: str, *, replace: bool = False) -> bytes:
    """32 random bytes in ``path``, mode 0600, written whole; the secret ``path`` then holds.

    A new secret is linked into place only if none is there: processes starting together on a
    fresh directory (the ranks of a data-parallel job) all end up with the first one's.
    ``replace``: a damaged secret is replaced (every entry made with it is rebuilt once)."""
    fd, tmp = tempfile.mkstemp(dir=top, prefix=".secret-")  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(32))
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:  # another process made it first: use that one
                pass
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    with open(path, "rb") as f:
        return f.read()


def private_directory(folder: str) -> None:
    """Raise PermissionError unless ``folder`` is a directory (not a symbolic link) owned by
    this user that no one else can write into (OpenSSH's rule for its key files)."""
    info = os.lstat(folder)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise PermissionError(f"{folder} is a symbolic link or not a directory")
    _check_private(folder, info, "the directory")


def _check_private(path: str, info: os.stat_result, what: str) -> None:
    if not hasattr(os, "getuid"):  # no POSIX owners (Windows): the user's profile is private
        return
    if info.st_uid != os.getuid():
        raise PermissionError(f"{what} {path} belongs to another user (uid {info.st_uid})")
    others = stat.S_IWGRP | stat.S_IWOTH
    if info.st_mode & others and not (stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_ISVTX):
        raise PermissionError(f"{what} {path} is writable by other users")
    if what == "the secret" and (info.st_mode & 0o077 or not stat.S_ISREG(info.st_mode)):
        raise PermissionError(f"the secret {path} is readable by other users or not a file")


def _mark_used(path: str) -> None:
    """An entry or note just read: its modification time is now, so ``_remove_old_files``
    keeps it."""
    try:
        os.utime(path)
    except OSError:
        pass  # a read-only cache keeps its entries as they are


def _remove_old_files(folder: str) -> None:
    """Remove, in one listing of ``folder``, the temporary files a killed writer left (over an
    hour old) and the entries and notes not read for ``GRAPHAMP_CACHE_DAYS`` days."""
    days, now = _unused_days(), time.time()
    removed, freed = 0, 0
    for name in os.listdir(folder):
        temporary = name.startswith(".tmp-") and name.endswith(".step")
        if name.startswith(".") and not temporary:
            continue
        path = os.path.join(folder, name)
        try:
            info = os.lstat(path)
            age_limit = _STALE_TMP_S if temporary else days * 86400
            if stat.S_ISREG(info.st_mode) and now - info.st_mtime > age_limit:
                os.unlink(path)
                if not temporary:
                    removed, freed = removed + 1, freed + info.st_size
        except OSError:
            pass  # another process removed, renamed or read it since
    if removed:
        log.info(
            "step cache: removed %d entries and notes not used for %g days (%.1f MB) from %s",
            removed,
            days,
            freed / 1e6,
            folder,
        )


def _unused_days() -> float:
    text = os.environ.get("GRAPHAMP_CACHE_DAYS")
    if text is None:
        return _UNUSED_DAYS
    try:
        days = float(text)
    except ValueError:
        days = -1.0
    if not days > 0:  # NaN too
        log.warning(
            "GRAPHAMP_CACHE_DAYS=%r is not a positive number of days; using %g",
            text,
            _UNUSED_DAYS,
        )
        return _UNUSED_DAYS
    return days


# -- traced values, stored compactly ----------------------------------------------------------------

_TAKEN_META = ("val", "tensor_meta")


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _size(x: Any) -> bool:
    """An int, or a symbolic one over the batch's (backed) size symbols."""
    return type(x) is int or (isinstance(x, torch.SymInt) and _backed(x))


def _backed(x: Any) -> bool:
    """Every symbol of ``x`` has a value in its ShapeEnv (no data-dependent size: those are
    made afresh by each trace, so an entry could not name them)."""
    node = x.node
    return all(s in backed_sizes(node.shape_env) for s in node.expr.free_symbols)


def _encodable(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.layout is torch.strided and all(
            map(_size, (*value.shape, *value.stride(), value.storage_offset()))
        )
    if isinstance(value, (tuple, list)):
        return all(map(_encodable, value))
    if isinstance(value, _SYMBOLIC):
        return _backed(value)
    return value is None or type(value) in (int, float, bool)


def _symbolic(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return any(isinstance(x, torch.SymInt) for x in (*value.shape, *value.stride()))
    if isinstance(value, (tuple, list)):
        return any(map(_symbolic, value))
    return isinstance(value, _SYMBOLIC)


def _int_code(x: Any) -> Any:
    """An int as it is; a symbolic one as ("sym", its sympy expression)."""
    return ("sym", x.node.expr) if isinstance(x, torch.SymInt) else x


def _encode(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (
            "tensor",
            tuple(map(_int_code, value.shape)),
            tuple(map(_int_code, value.stride())),
            _int_code(value.storage_offset()),
            value.dtype,
            str(value.device),
            value.requires_grad,
        )
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, [_encode(v) for v in value])
    if isinstance(value, _SYMBOLIC):
        return ("symbol", type(value).__name__, value.node.expr)
    return ("value", value)


def _decode(code: Any, mode: FakeTensorMode) -> Any:
    kind = code[0]
    if kind == "tensor":
        _, shape, stride, offset, dtype, device, requires_grad = code
        shape, stride = [_int(x, mode) for x in shape], [_int(x, mode) for x in stride]
        offset = _int(offset, mode)
        fake: torch.Tensor
        if all(type(x) is int for x in (*shape, *stride)):
            meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
            if offset:
                meta = meta.as_strided(shape, stride, offset)
            fake = FakeTensor(mode, meta, torch.device(device))
        else:  # symbolic sizes: made by the fake mode itself, over its ShapeEnv's symbols
            with mode:
                fake = torch.empty_strided(shape, stride, dtype=dtype, device=device)
                if not (type(offset) is int and offset == 0):
                    fake = fake.as_strided(shape, stride, offset)
        return fake.requires_grad_(True) if requires_grad else fake
    if kind in ("tuple", "list"):
        items = [_decode(c, mode) for c in code[1]]
        return tuple(items) if kind == "tuple" else items
    if kind == "symbol":
        return _symbol(code[1], code[2], mode)
    return code[1]


def _int(code: Any, mode: FakeTensorMode) -> Any:
    return _symbol("SymInt", code[1], mode) if isinstance(code, tuple) else code


def _symbol(kind: str, expr: Any, mode: FakeTensorMode) -> Any:
    """A SymInt (SymFloat, SymBool) of ``mode``'s ShapeEnv for ``expr``: the entry's symbols
    are this build's (the key holds the example inputs' sizes, symbols included, by name)."""
    env = _shape_env(mode)
    hint = expr.xreplace(backed_sizes(env))
    if kind == "SymInt":
        return env.create_symintnode(expr, hint=int(hint))
    if kind == "SymFloat":
        return env.create_symfloatnode(expr, hint=float(hint))
    return env.create_symboolnode(expr)


def _shape_guards(gm: fx.GraphModule) -> list[Any]:
    """The guards of the ShapeEnv the step was traced in, when its sizes are symbolic."""
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            for x in (*value.shape, *value.stride()):
                if isinstance(x, torch.SymInt) and x.node.shape_env is not None:
                    return [guard.expr for guard in x.node.shape_env.guards]
    return []


def _left_symbolic(gm: fx.GraphModule) -> bool:
    """Whether a symbolic value is left in the metadata (``_take_values`` took the others)."""
    return any(_symbolic(n.meta.get("val")) for m in graph_modules(gm) for n in m.graph.nodes)


def _guards_hold(guards: list[Any], mode: FakeTensorMode) -> bool:
    """Whether the entry's guards hold for this build's sizes (the hints of its symbols)."""
    if not guards:
        return True
    env = mode.shape_env
    if env is None:
        return False
    return all(bool(g.xreplace(backed_sizes(env))) for g in guards)


def _assume(guards: list[Any], mode: FakeTensorMode) -> None:
    """Add the entry's guards to this build's ShapeEnv, as its assembly would have."""
    if not guards:
        return
    env = _shape_env(mode)
    for guard in guards:
        env.evaluate_expr(guard)


def _shape_env(mode: FakeTensorMode) -> Any:
    """The build's ShapeEnv, which an entry with symbolic sizes needs (``_restored`` turns the
    error into a warning and a rebuilt step)."""
    if mode.shape_env is None:
        raise ValueError("the entry has symbolic sizes, but this build's fake mode has no ShapeEnv")
    return mode.shape_env


_Taken = list[tuple[str, str, fx.Node, dict]]


def _take_values(gm: fx.GraphModule) -> _Taken:
    """Take the encodable values (and tensor_meta) of the non-placeholder nodes out of their
    metadata, for ``_put_back``: (graph module path, node name, node, what was taken)."""
    taken = []
    paths = {id(m): path for path, m in gm.named_modules()}
    for m in graph_modules(gm):
        for node in m.graph.nodes:
            value = node.meta.get("val")
            if node.op == "placeholder" and not _symbolic(value):
                continue  # GraphPickler's own form (static sizes need no ShapeEnv)
            if "val" in node.meta and _encodable(value):
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


def _warn(graph_name: str, path: str, why: str, then: str = _REBUILD) -> None:
    log.warning("%s: step cache: ignoring %s: %s; %s", graph_name, path, why, then)
