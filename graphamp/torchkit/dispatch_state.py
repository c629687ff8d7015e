"""torch's thread-local dispatch state, put back after a call that an interrupt cut short.

A build runs inside torch's context managers (fake tensor and proxy modes, functionalization,
the Python dispatcher), each of which sets thread-local dispatch state on entry and unsets it
on exit. A KeyboardInterrupt is raised between Python bytecodes, so one can land inside such a
manager's ``__enter__`` or ``__exit__``, and the state is then left half set: seen once in the
test lane, a Ctrl-C during a first build left the ``PythonDispatcher`` key included with no
Python dispatcher set, and every tensor op of the process raised an internal assert after it
("Hit PythonDispatcher dispatch key but PythonDispatcherTLS was not set"). graphamp cannot
hold interrupts back for a whole build (a user must be able to stop a long compile), so a
call takes a ``snapshot`` of that state first and, where it raised, ``restore`` puts back what
differs: the keys included and excluded, and the modes pushed, at the call's entry.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._C, torch._C._TorchDispatchModeKey, torch._C._dispatch_tls_local_exclude_set,
#   torch._C._dispatch_tls_local_include_set, torch._C._dispatch_tls_set_dispatch_key_excluded,
#   torch._C._dispatch_tls_set_dispatch_key_included, torch._C._get_dispatch_mode,
#   torch._C._len_torch_dispatch_stack, torch._C._len_torch_function_stack,
#   torch._C._pop_torch_function_stack, torch._C._unset_dispatch_mode,
#   torch.utils._python_dispatch._pop_mode
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import _pop_mode

_KEYS = tuple(torch._C.DispatchKey.__members__.values())
_INFRA_MODES = tuple(torch._C._TorchDispatchModeKey.__members__.values())


@dataclass(frozen=True)
class DispatchState:
    """Taken at every call (about 3 microseconds): the key sets as torch's own objects,
    compared key by key only where they differ."""

    included: Any  # torch._C.DispatchKeySet
    excluded: Any
    dispatch_modes: int  # the length of the torch dispatch mode stack
    function_modes: int  # and of the torch function mode stack
    infra_modes: frozenset  # the fake, proxy and functional mode slots that were set


def snapshot() -> DispatchState:
    return DispatchState(
        included=torch._C._dispatch_tls_local_include_set(),
        excluded=torch._C._dispatch_tls_local_exclude_set(),
        dispatch_modes=torch._C._len_torch_dispatch_stack(),
        function_modes=torch._C._len_torch_function_stack(),
        infra_modes=_infra_modes(),
    )


def restore(before: DispatchState) -> list[str]:
    """Put back what differs from ``before`` in this thread; what was put back, in words
    (empty where nothing differed: the usual case, a call that raised and unwound cleanly).
    Modes first: leaving one changes the keys."""
    repaired: list[str] = []
    for mode in _infra_modes() - before.infra_modes:
        torch._C._unset_dispatch_mode(mode)
        repaired.append(f"the {mode.name.lower()} mode unset")
    for _ in range(torch._C._len_torch_dispatch_stack() - before.dispatch_modes):
        _pop_mode()
        repaired.append("a dispatch mode popped")
    for _ in range(torch._C._len_torch_function_stack() - before.function_modes):
        torch._C._pop_torch_function_stack()
        repaired.append("a function mode popped")
    now = snapshot()
    for key in _KEYS:
        was, now_in = before.included.has(key), now.included.has(key)
        if was != now_in:
            torch._C._dispatch_tls_set_dispatch_key_included(key, was)
            repaired.append(f"{key.name} {'included' if was else 'not included'}")
        was, now_in = before.excluded.has(key), now.excluded.has(key)
        if was != now_in:
            torch._C._dispatch_tls_set_dispatch_key_excluded(key, was)
            repaired.append(f"{key.name} {'excluded' if was else 'not excluded'}")
    return repaired


def _infra_modes() -> frozenset:
    return frozenset(m for m in _INFRA_MODES if torch._C._get_dispatch_mode(m) is not None)
