"""The step cache's directory: where it is, that it is the user's own, the secret that
authenticates its files, their atomic writes, and its tidying.

Trust. A step cache entry is a pickle, and unpickling runs code, so nothing is unpickled
before it is authenticated: the HMAC's key is a secret of 32 random bytes made on first use in
the cache's own directory (``secret``, mode 0600), and an entry whose HMAC does not match
(planted, edited and re-digested, copied from another key's file, written by another user or
another graphamp) is ignored with a warning and rebuilt, as is one that is unreadable,
truncated or of another format. The directory must be the user's own: it, the directories
graphamp creates in it and the secret are checked to be owned by the user, not symbolic links,
and writable by no one else (``private_directory``); otherwise the step cache is off for the
process, with a warning. Files are written to a temporary file, flushed to disk and renamed
into place, so two processes saving one entry at once leave one whole entry and a reader never
sees half of one; temporary files a killed process left for over an hour are removed.

Size. Every graphamp source, torch build and model change keys new entries, and the old ones
are never read again: when a process first opens the directory it removes the entries and notes
not read for 30 days (``GRAPHAMP_CACHE_DAYS`` to change; reading one marks it used), logged at
INFO. A removed entry is a rebuild, never a wrong step.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
import tempfile
import threading
import time

from ..torchkit.cache_root import graphamp_cache_root, write_atomically
from .step_key import graphamp_source

log = logging.getLogger("graphamp")

_MAGIC = b"graphamp-step-cache 2\n"
_DIGEST = 32  # bytes of HMAC-SHA256
_STALE_TMP_S = 3600  # a temporary file older than this was left by a killed writer
_UNUSED_DAYS = 30.0  # an entry or note not read for longer is removed (GRAPHAMP_CACHE_DAYS)


def directory() -> str:
    return os.path.join(graphamp_cache_root(), "steps")


def read_authenticated(graph_name: str, mac_key: str, path: str, then: str) -> bytes | None:
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
        warn_ignored(graph_name, path, f"unreadable ({e})", then)
        return None
    head = len(_MAGIC)
    if not data.startswith(_MAGIC) or len(data) < head + _DIGEST:
        warn_ignored(
            graph_name, path, "not a graphamp step cache file of this version, or truncated", then
        )
        return None
    digest, payload = data[head : head + _DIGEST], data[head + _DIGEST :]
    if not hmac.compare_digest(digest, _mac(secret, mac_key, payload)):
        warn_ignored(
            graph_name,
            path,
            "it is not authenticated (truncated, altered, copied from another entry or "
            "written by someone else); it was not unpickled",
            then,
        )
        return None
    _mark_used(path)
    return payload


def write_authenticated(graph_name: str, mac_key: str, path: str, payload: bytes) -> bool:
    """``payload`` authenticated under ``mac_key`` in ``path``: written to a temporary file,
    flushed and renamed into place; False, logged, when it cannot be written."""
    secret = _secret(graph_name)
    if secret is None:
        return False
    folder = directory()
    try:
        entry = _MAGIC + _mac(secret, mac_key, payload) + payload
        write_atomically(path, entry, ".tmp-", ".step")  # _remove_old_files knows the names
    except OSError as e:
        log.warning("%s: step cache: could not write to %s (%s)", graph_name, folder, e)
        return False
    return True


# -- trust and tidying -------------------------------------------------------------------------

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
    top = graphamp_cache_root()
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


def warn_ignored(graph_name: str, path: str, why: str, then: str) -> None:
    """A file of the cache refused: which, why, and what follows (``then``)."""
    log.warning("%s: step cache: ignoring %s: %s; %s", graph_name, path, why, then)
