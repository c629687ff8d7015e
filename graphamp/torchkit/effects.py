"""Ops torch marks as having an ordered side effect, traced by graphamp as plain graph nodes.

torch registers a few operators as effectful (``aten::_linalg_check_errors``, which
``torch.linalg.solve``, ``inv``, ``cholesky`` and the other checking linalg functions call to
raise on a singular input; ``aten::_print``; custom ops a library marks so). Under Python
functionalization such an op needs an *effect token* threaded through the graph, which
AOTAutograd sets up for torch.compile and graphamp's own functionalization does not: tracing
fails with torch's "Could not find a token for effect".

graphamp traces them as ordinary nodes instead: their registration is lifted while
``trace_functional`` runs (capture and step assembly), and restored afterwards, so dead-code
elimination keeps the node (an effectful op is impure) and the backend compiler, which is
AOTAutograd for ``aot_eager`` and ``inductor``, threads the tokens itself when it compiles
the step. The check then runs inside the compiled step and raises as in eager mode (a
singular matrix raises ``torch.linalg.LinAlgError``) before the step writes any state.

The registry is process-wide: the lift is reference-counted across threads, and another
thread's ``torch.compile`` tracing at the same moment would see these ops as effect-free.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

_lock = threading.Lock()
_users = 0
_lifted: list[tuple[Any, Any]] = []  # (the registry entry's effect holder, the effect it had)


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


@contextlib.contextmanager
def effects_as_plain_ops() -> Iterator[None]:
    """Inside the block, the effectful operators are traced like any other op."""
    global _users
    with _lock:
        if _users == 0:
            _lifted[:] = [(holder, holder.effect) for holder in _effectful_ops()]
            for holder, _ in _lifted:
                holder.register(None)
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                for holder, effect in _lifted:
                    holder.register(effect)
                _lifted.clear()
