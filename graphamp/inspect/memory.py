"""Memory a step graph holds, counted from its nodes' sizes (no device needed).

The step's FX graph runs its nodes in order and frees each value after its last reader (FX's
generated code drops references; aot_eager and eager backends keep that order). Walking the
nodes with the sizes recorded at tracing (``meta["val"]``) gives the bytes of intermediate
values alive at each point: the peak is what activation checkpointing and sharding change.
Inputs (parameters, optimizer state, the batch) are resident and counted apart.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._ops
import operator
from dataclasses import dataclass
from typing import cast

import torch
import torch.fx as fx

from ..records.subgraphs import subgraph_of


@dataclass(frozen=True)
class StepMemory:
    resident_bytes: int  # the step's inputs: parameters, buffers, optimizer state, batch
    peak_intermediate_bytes: int  # the most bytes of values computed inside the step, at once
    peak_node: str  # the node at which that peak is reached

    def __str__(self) -> str:
        return (
            f"resident {self.resident_bytes / 2**20:.2f} MiB, peak intermediates "
            f"{self.peak_intermediate_bytes / 2**20:.2f} MiB (at {self.peak_node})"
        )


def value_bytes(value) -> int:
    """Bytes of a traced value: a tensor, or a tuple/list of them."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(value_bytes(v) for v in value)
    return 0


def step_memory(gm: fx.GraphModule, before: str | None = None) -> StepMemory:
    """Count the bytes of the step's inputs and the peak of its live intermediate values.
    ``before``: count the peak only up to the first node of that subgraph (``"optimizer"``:
    the forward, backward and collectives, without the update's temporaries)."""
    nodes = list(gm.graph.nodes)
    if before is not None:
        stop = next(
            (i for i, n in enumerate(nodes) if subgraph_of(n) == before),
            len(nodes),
        )
    else:
        stop = len(nodes)
    last_use = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last_use[_owner(a)] = i
    resident = sum(value_bytes(n.meta.get("val")) for n in nodes if n.op == "placeholder")
    live, peak, peak_node = 0, 0, ""
    for i, n in enumerate(nodes[:stop]):
        made = _new_bytes(n)
        live += made
        if live > peak:
            peak, peak_node = live, n.name
        if made and n not in last_use:  # never read: freed at once
            live -= made
        for a in {_owner(a) for a in n.all_input_nodes}:
            if last_use.get(a) == i:
                live -= _new_bytes(a)
    return StepMemory(resident, peak, peak_node)


def _new_bytes(node: fx.Node) -> int:
    """Bytes a node allocates: none for getitem (part of its owner) or an in-place write."""
    if node.op != "call_function" or node is not _owner(node):
        return 0
    target = node.target
    if isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
        return 0
    return value_bytes(node.meta.get("val"))


def _owner(node: fx.Node) -> fx.Node:
    """The node whose value a getitem unpacks (itself otherwise)."""
    if node.op == "call_function" and node.target is operator.getitem:
        return cast(fx.Node, node.args[0])
    return node
