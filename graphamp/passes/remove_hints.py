"""remove_hints: delete graphamp.low_precision / full_precision nodes once they did their job.

The hints steer colouring (they are allow / deny ops); after casts are placed they are
identities, so their users read the hinted value directly.
"""

from __future__ import annotations

import torch.fx as fx

from ..torchkit.ops import FULL_PRECISION_HINT, LOW_PRECISION_HINT
from .base import AmpContext, PassResult

HINTS = (LOW_PRECISION_HINT, FULL_PRECISION_HINT)


def remove_hints(gm: fx.GraphModule, ctx: AmpContext | None = None) -> PassResult:  # noqa: ARG001 - every pass takes (gm, ctx)
    removed = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in HINTS:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            removed += 1
    return PassResult(gm, removed > 0)
