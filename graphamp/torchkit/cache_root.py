"""Where graphamp keeps what it writes to disk: ``GRAPHAMP_CACHE_DIR``, or a ``graphamp``
directory in inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR``, or inductor's default
under the temporary directory), so that clearing inductor's cache clears graphamp's too."""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._inductor
import os
import tempfile


def inductor_cache_directory() -> str:
    """The directory inductor's caches use now."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.abspath(cache_dir())


def graphamp_cache_root() -> str:
    """The directory graphamp's on-disk records live under (the step cache, timings)."""
    return os.environ.get("GRAPHAMP_CACHE_DIR") or os.path.join(
        inductor_cache_directory(), "graphamp"
    )


def write_atomically(path: str, payload: bytes, prefix: str, suffix: str = "") -> None:
    """``payload`` in ``path``, whole or not at all: written to a temporary file (named
    ``prefix``...``suffix`` in the same directory, mode 0600), flushed to disk and renamed into place, so
    a reader never sees half a file and two writers leave one whole one. OSError where it
    cannot be written; no temporary file is left."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=prefix, suffix=suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
