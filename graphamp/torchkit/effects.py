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

The registry is process-wide: the lift is reference-counted across threads
(``process_state.EFFECTS_LIFTED``, where graphamp's process-wide state is declared), and another
thread's ``torch.compile`` tracing at the same moment would see these ops as effect-free.
"""

from __future__ import annotations

import contextlib

from .process_state import EFFECTS_LIFTED


def effects_as_plain_ops() -> contextlib.AbstractContextManager[None]:
    """Inside the block, the effectful operators are traced like any other op."""
    return EFFECTS_LIFTED.applied()
