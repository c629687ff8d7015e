"""A compile that fails on an unreadable entry of inductor's cache directory is rebuilt.

graphamp keeps no cache of its own on disk: a restart is served by inductor's FX-graph cache and
AOTAutograd's cache in ``TORCHINDUCTOR_CACHE_DIR`` (see ``compile.py``). Their keys hold the
whole step graph, its inputs' metadata, the inductor configuration and torch's build, so a
changed model, config, pin or torch never matches an old entry. What they do not survive is a
damaged file: inductor skips a corrupt cache entry itself, but the generated code next to it is
written once per content hash and imported as found, so a truncated or scribbled-over ``.py``
or ``.so`` fails the compile (measured with torch 2.14.1: ``Failed to import ...py``,
``UnicodeDecodeError``; an emptied one: ``module ... has no attribute 'call'``). A compile that
failed while reading from the cache directory is retried once in a fresh private cache
directory, with a warning naming the directory; a failure the retry repeats is raised as it is.
A failure raised in the compiler's own work on the graph, where no file is read (inductor's
scheduler asserting while fusing, seen with torch 2.11 on an H200), is raised at once: a retry
would only double the time to the error.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._dynamo, torch._inductor
import logging
import os
import traceback
from typing import Callable, TypeVar

import torch

from ..errors import GraphampError
from ..torchkit.cache_root import inductor_cache_directory

log = logging.getLogger("graphamp")

T = TypeVar("T")


def compile_from_cache(
    graph_name: str, backend: str, compile_once: Callable[[], T]
) -> tuple[T, str]:
    """``compile_once()`` (rebuilt if inductor's cache directory has a damaged file), and what
    inductor's caches did meanwhile, for the compile's log line (e.g. ``AOTAutograd's cache:
    1 miss, 1 saved; the FX-graph cache: 2 hits, 1 miss``: an outlined block's graphs are looked
    up on their own; ``""`` for the other backends, which keep no cache)."""
    if backend != "inductor":
        return compile_once(), ""
    before = inductor_cache_counts()
    compiled = rebuild_if_cache_unreadable(graph_name, compile_once)
    after = inductor_cache_counts()
    return compiled, cache_words({k: v - before.get(k, 0) for k, v in after.items()})


_CACHES = (("autograd_cache_", "AOTAutograd's cache"), ("fxgraph_cache_", "the FX-graph cache"))
_PLURALS = {"hit": "hits", "miss": "misses"}


def cache_words(changes: dict[str, int]) -> str:
    """Counter changes (``inductor_cache_counts`` names) in words, each cache's events counted."""
    parts = []
    for prefix, cache in _CACHES:
        events = [
            _counted(key[len(prefix) :], n)
            for key, n in sorted(changes.items())
            if key.startswith(prefix) and n > 0
        ]
        if events:
            parts.append(f"{cache}: {', '.join(events)}")
    return "; ".join(parts)


def _counted(event: str, n: int) -> str:
    return f"{n} {_PLURALS.get(event, event) if n > 1 else event}"


def inductor_cache_counts() -> dict[str, int]:
    """inductor's FX-graph cache and AOTAutograd's cache counters, as torch keeps them for the
    whole process (the compile stage reports the change over its own run)."""
    from torch._dynamo.utils import counters

    return {
        key: value
        for group in ("inductor", "aot_autograd")
        for key, value in counters[group].items()
        if key.startswith(("fxgraph_cache_", "autograd_cache_"))
    }


def rebuild_if_cache_unreadable(graph_name: str, compile_once: Callable[[], T]) -> T:
    """``compile_once()``; if it fails, warn and run it once more outside the cache directory
    (in a fresh temporary one, kept: the program may load from it later).

    Any failure raised while inductor read its cache directory is retried, not only the errors
    a damaged file raised in the cases tried (``UnicodeDecodeError``, ``Failed to import``, an
    imported module without ``call``): which error a damaged file gives depends on where it is
    damaged. A failure that is the compiler's own is raised by the retry as it was; one raised in
    the compiler's graph work with no cache file read is raised at once (``read_the_cache``).
    Running out of memory is not retried."""
    try:
        return compile_once()
    except (GraphampError, torch.OutOfMemoryError):
        raise
    except Exception as e:  # a damaged file can raise anything
        if not read_the_cache(e):
            raise
        cause = e
    from torch._inductor.utils import fresh_cache

    log.warning(
        "%s: compiling the step failed (%s: %s); compiling it again in a fresh directory, in "
        "case a damaged file in inductor's cache directory %s caused it. If the retry "
        "succeeds, delete that directory (or set TORCHINDUCTOR_CACHE_DIR to another one): "
        "until then every restart compiles from scratch",
        graph_name,
        type(cause).__name__,
        _first_line(cause),
        inductor_cache_directory(),
    )
    with fresh_cache(delete=False):
        return compile_once()


# torch's modules that read files of inductor's cache directory: generated code, compiled
# kernels, and the FX-graph and AOTAutograd cache entries (their loads run through these files)
_CACHE_READERS = (
    "_inductor/codecache.py",
    "_inductor/compile_worker",
    "_inductor/runtime/compile_tasks.py",
    "_inductor/async_compile.py",
    "_inductor/output_code.py",
    "_functorch/_aot_autograd/autograd_cache.py",
    "<frozen importlib",
)
# the compiler's own work on the graph, which reads no file: a failure raised here is a bug or a
# limit of the compiler, and compiling again in another directory raises it again
_COMPILER_OWN = (
    "_inductor/scheduler.py",
    "_inductor/lowering.py",
    "_inductor/ir.py",
    "_inductor/dependencies.py",
    "_inductor/loop_body.py",
    "_inductor/pattern_matcher.py",
    "_inductor/fx_passes/",
    "_inductor/codegen/",
    "_functorch/partitioners.py",
)


def read_the_cache(error: BaseException) -> bool:
    """Whether a damaged file of inductor's cache directory can have caused ``error``: unless
    it was raised in the compiler's own work on the graph (its innermost frame there) and no
    error of its chain passed through code that reads the cache directory. Unknown places
    count as readers: a damaged file fails wherever its content is first used (an emptied
    module in ``compile_fx.py``, where its ``call`` is looked up)."""
    chain = _error_chain(error)
    frames = [
        [frame.filename.replace(os.sep, "/") for frame in traceback.extract_tb(e.__traceback__)]
        for e in chain
    ]
    if any(reader in name for names in frames for name in names for reader in _CACHE_READERS):
        return True
    innermost = [names[-1] for names in frames if names]
    return not any(own in name for name in innermost for own in _COMPILER_OWN)


def _error_chain(error: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    pending: list[BaseException | None] = [error]
    while pending:
        e = pending.pop()
        if e is not None and all(e is not c for c in chain):
            chain.append(e)
            pending += [e.__cause__, e.__context__]
    return chain


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else ""
