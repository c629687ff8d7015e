"""The subgraphs of the assembled step: the tag on each of its nodes.

Every node the step's assembly traces carries ``meta[SUBGRAPH]``, the part of the training step
it belongs to; dumps colour by it, reports count by it and the passes after assembly find the
forward, the backward or the optimizer by it. The tag is the member's plain string value (the
step cache stores node metadata, and its unpickler reads plain values only).
"""

from __future__ import annotations

from enum import Enum
from typing import Any

SUBGRAPH = "graphamp_subgraph"  # the node metadata key


class Subgraph(str, Enum):
    """Where in the training step a node is. A ``str``: a node's tag equals its member."""

    PARAMETER_CASTS = "parameter_casts"  # the low-precision copies of the parameters
    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"  # activation checkpointing's second forward, in the backward
    GRAD_SCALER = "grad_scaler"  # loss scaling, unscale and check, the skip, the scale update
    CLIP_GRAD = "clip_grad"
    DATA_PARALLEL = "data_parallel"  # averaging and the ranks' agreement
    ZERO = "zero"  # sharded parameters and gradients: gathers and scatters
    OPTIMIZER = "optimizer"
    FORENSICS = "forensics"  # overflow tracing's probes and record
    PASS_STATE = "pass_state"  # the AMP passes' state kept from step to step (PassState)
    HISTORY = "history"  # the step's row of the device history

    def __str__(self) -> str:
        return self.value

    def tag(self) -> dict[str, str]:
        """The node metadata that marks this subgraph (``NodeTagger(Subgraph.X.tag())``)."""
        return {SUBGRAPH: self.value}


def subgraph_of(node: Any) -> str | None:
    """The subgraph tag of an FX node (None: untagged)."""
    return node.meta.get(SUBGRAPH)
