"""torch's and triton's source hashes, kept across processes while their files are unchanged.

Every key inductor computes (AOTAutograd's, the FX-graph cache's, ``aot_key.py``'s context)
holds ``torch_key()``, a hash of torch's 2,400 Python files, and ``triton_key()``, a hash of
triton's compiler files and of libtriton (hundreds of MB). A process computes each once, at its
first compile: 0.43 s of a 2.3 s restart on the CPU machine, every restart, for files that
have not changed since the last one.

So the values a compile computed are kept in graphamp's cache directory with a fingerprint of
the files they read, taken before they were computed: each file's path, size and modification
time under torch's and triton's package directories (30 ms). A later process whose
fingerprint is the same gives torch the kept values (torch's own ``set`` of these caches);
any file added, removed, rewritten or touched makes the fingerprint differ, and torch hashes
its files as before. The file is authenticated like the step cache's entries. Where torch's
caches cannot be set (a torch without ``set``), nothing is kept.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._inductor
import hashlib
import importlib.util
import logging
import os
from typing import Any

import torch

from . import step_cache
from .step_key import graphamp_source

log = logging.getLogger("graphamp")

_MODULES = (".py", ".so", ".pyd")  # what torch_key and triton_key read as modules
_INDUCTOR_FILES = (".cpp", ".h", ".ld")  # and besides, in inductor's folder (aoti_runtime...)


# this process's hashes are settled (given to torch, or kept after a compile computed them):
# later builds in it neither walk the files again nor read or write the note
_settled = False


def preset(graph_name: str) -> str | None:
    """Give torch the kept hashes if the files are unchanged; the fingerprint of the files as
    they are now (for ``keep``), or None where torch's caches cannot be set or this process's
    hashes are already settled."""
    global _settled
    hashes = _torch_hashes()
    if hashes is None or _settled:
        return None
    try:
        fingerprint = _fingerprint()
    except OSError as e:  # a file vanished or cannot be read: torch hashes its files itself
        log.info("%s: torch's source hashes not kept (%s)", graph_name, e)
        return None
    kept = _kept(graph_name)
    if kept is not None and kept.get("fingerprint") == fingerprint:
        for name, fn in hashes.items():
            _set(fn, kept["values"].get(name))
        _settled = True
        return None  # nothing for ``keep`` to write
    return fingerprint


def keep(graph_name: str, fingerprint: str | None) -> None:
    """Keep the hashes this process computed, under the fingerprint taken before (``preset``);
    call only after a compile that computed them (an inductor cache was looked up)."""
    global _settled
    hashes = _torch_hashes()
    if fingerprint is None or hashes is None:
        return
    values = {name: _encode(fn()) for name, fn in hashes.items()}
    step_cache.save_note(graph_name, *_note(), {"fingerprint": fingerprint, "values": values})
    _settled = True


def _note() -> tuple[str, str]:
    """(key, kind) of the note in the step cache's directory. One note per graphamp source, as
    for the step entries: another graphamp (an upgrade, an edited checkout) authenticates
    under its own source, so it would take this one's note for a damaged file and warn."""
    return f"installed-{graphamp_source()[:16]}", "sources"


def _torch_hashes() -> dict[str, Any] | None:
    """torch's cached source hashes, where each can be set (``prefetchable_cache``)."""
    try:
        from torch._inductor import codecache
    except ImportError:
        return None
    hashes = {"torch": getattr(codecache, "torch_key", None)}
    hashes["triton"] = getattr(codecache, "triton_key", None)
    if not all(callable(fn) and hasattr(fn, "set") for fn in hashes.values()):
        return None
    return hashes


def _set(fn: Any, encoded: Any) -> None:
    if not isinstance(encoded, list) or len(encoded) != 2:
        return
    kind, text = encoded
    value = bytes.fromhex(text) if kind == "bytes" else text
    try:
        fn.set(value)
    except RuntimeError:  # already computed in this process: nothing to save
        pass


def _encode(value: Any) -> list:
    if isinstance(value, bytes):
        return ["bytes", value.hex()]
    return ["str" if isinstance(value, str) else "none", value]


def _kept(graph_name: str) -> dict | None:
    kept = step_cache.load_note(graph_name, *_note())
    if kept is None or not isinstance(kept.get("values"), dict):
        return None
    return kept


def _fingerprint() -> str:
    """Path, size and modification time of every Python and extension file under torch's and
    triton's package directories, with torch's version: what ``torch_key`` and ``triton_key``
    read is among them."""
    h = hashlib.sha256(torch.__version__.encode())
    for name in ("torch", "triton"):
        spec = importlib.util.find_spec(name)  # triton is not imported for this
        for folder in (spec.submodule_search_locations or []) if spec else []:
            h.update(f"{name}\0{folder}\n".encode())
            _walk(folder, h)
    return h.hexdigest()


def _walk(root: str, h: Any) -> None:
    pending = [root]
    while pending:
        folder = pending.pop()
        try:
            with os.scandir(folder) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                pending.append(entry.path)
            elif entry.name.endswith(_MODULES) or (
                "_inductor" in entry.path and entry.name.endswith(_INDUCTOR_FILES)
            ):
                info = entry.stat()
                h.update(f"{entry.path}\0{info.st_size}\0{info.st_mtime_ns}\n".encode())
