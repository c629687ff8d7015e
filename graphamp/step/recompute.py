"""Activation checkpointing in a one-graph step: recompute marked regions for the backward.

The step is one FX graph (forward, backward, optimizer), compiled as an inference graph: no
min-cut partitioner ever sees it, so torch's recompute tags would change nothing. Memory is
held by values that the backward reads long after the forward made them. This pass gives the
backward its own copies of the values computed inside a checkpointed module instance (one
*region*): the region's nodes are duplicated right before the first backward node that reads
any of them, and every backward read is moved to the copies. The forward originals then die at
the end of the region's forward; only the region's inputs stay alive until the recompute.

Copies are made of the AMP-rewritten nodes, so a recomputed region keeps its precision
decisions (the same casts, no new ones). Ops that draw random numbers (dropout) are not
recomputed: the backward keeps reading the forward's mask, as torch.utils.checkpoint's RNG
replay guarantees by other means.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._ops
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..records.subgraphs import SUBGRAPH, Subgraph, subgraph_of
from .gradients import MICRO_BATCH


@dataclass
class RecomputeResult:
    regions: dict[str, list[str]] = field(default_factory=dict)  # region -> forward node names
    copies: int = 0  # nodes copied (each micro-batch recomputes its own instance of a region)


def recompute_checkpointed(gm: fx.GraphModule, regions: frozenset[str]) -> RecomputeResult:
    """Duplicate each region's forward nodes that the backward reads; rewires in place."""
    result = RecomputeResult()
    if not regions:
        return result
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    # an instance of a region: its module path and the micro-batch whose forward ran it (under
    # gradient accumulation each micro-batch's forward and backward come before the next one's)
    marked = {
        n: (r, n.meta.get(MICRO_BATCH, 0))
        for n in gm.graph.nodes
        if (r := _region(n, regions)) and _recomputable(n)
    }
    by_instance: dict[tuple[str, int], list[fx.Node]] = {}
    for n, instance in marked.items():
        if _late_users(n):
            by_instance.setdefault(instance, []).append(n)
    for (region, _), needed in by_instance.items():
        members = sorted(_with_marked_inputs(needed, marked), key=order.__getitem__)
        first_use = min((u for n in needed for u in _late_users(n)), key=order.__getitem__)
        copies = _copy_before(gm.graph, members, first_use, region)
        result.copies += len(copies)
        for n in needed:
            for user in _late_users(n):
                user.replace_input_with(n, copies[n])
        named = result.regions.setdefault(region, [])  # each micro-batch recomputes the same
        named += [f for n in members if (f := n.meta.get("fwd_node", n.name)) not in named]
    gm.graph.lint()
    gm.recompile()
    return result


def _region(node: fx.Node, regions: frozenset[str]) -> str | None:
    """The outermost checkpointed module this forward node was computed in."""
    if node.op != "call_function" or subgraph_of(node) != Subgraph.FORWARD:
        return None
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        if path in regions:
            return path
    return None


def _recomputable(node: fx.Node) -> bool:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        schema = target._schema
        if schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags:
            return False
    return True


def _late_users(node: fx.Node) -> list[fx.Node]:
    """Users after the forward (backward, scaler, optimizer): they read saved activations.
    The step's outputs keep the forward's value (recomputing it would only add work)."""
    return [
        u
        for u in node.users
        if u.op == "call_function" and subgraph_of(u) not in (Subgraph.FORWARD, Subgraph.RECOMPUTE)
    ]


def _with_marked_inputs(needed: list[fx.Node], marked: dict) -> set[fx.Node]:
    """``needed`` (nodes of one region instance) and every node of that instance they are
    computed from."""
    instance = marked[needed[0]]
    members, todo = set(), list(needed)
    while todo:
        n = todo.pop()
        if n in members:
            continue
        members.add(n)
        todo.extend(a for a in n.all_input_nodes if marked.get(a) == instance)
    return members


def _copy_before(graph: fx.Graph, members: list[fx.Node], anchor: fx.Node, region: str) -> dict:
    copies: dict[fx.Node, fx.Node] = {}
    with graph.inserting_before(anchor):
        for n in members:
            new = graph.node_copy(n, lambda a: copies.get(a, a))
            new.meta[SUBGRAPH] = Subgraph.RECOMPUTE.value
            new.meta["recomputed_from"] = n.name
            new.meta["recompute_region"] = region
            copies[n] = new
    return copies
