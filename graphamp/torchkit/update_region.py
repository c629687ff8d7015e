"""Inductor pass: the optimizer update handed to inductor's lowering as one node.

Inductor lowers a graph node by node, and registers each node's value as a reader of every
buffer it reads, its inlined producers' reads included (``GraphLowering.register_users_of``).
When it lowers a write into one of the graph's inputs, it first realizes every registered
reader of that input, as a buffer of its own: a value still pending would otherwise be computed
after the write and read the new contents (``GraphLowering.mark_buffer_mutated``). AOTAutograd
puts a step's writes into its inputs (the new parameters, the optimizer's moments, the scaler's
state) at the end of the graph. So each write realizes every intermediate of the update that
read the input: with AdamW, the decayed parameter, each piece of ``lerp``'s decomposition, the
squared-gradient sum, the quotient, about 12 buffers a parameter. Nothing reads them (the new
values inline their computation), and the scheduler drops them, but only after building each:
a 6-layer GPT-2 step reached the scheduler as 1,499 nodes.

This pass (inductor's ``post_grad_custom_post_pass``) gathers the update's nodes, tagged at
assembly (``UPDATE_TAG``, carried by AOTAutograd in ``meta["custom"]``), into one call of a
subgraph. Its lowering lowers the subgraph's nodes with inductor's own lowerings and the
reuse rules ``run_node`` applies, but registers none of them as readers: only the call's
outputs, the values the writes take, are registered. The writes still come at the end, after
the whole update, and the new values still inline their computation, so the kernels are the
ones inductor made without the pass; only the dead buffers are never made. That step reaches
the scheduler as 891 nodes (``benchmarks/results/first_call_cpu.md``, round 10).

A graph the pass cannot gather safely (an update op that writes in place, a node that is not
an aten op, a value between the update's nodes that both reads the update and feeds it) is
left as it is: inductor then compiles it as it would without graphamp's pass.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._inductor, torch._ops, torch.utils._ordered_set
import logging
import operator

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from .fxutil import region_boundary

log = logging.getLogger("graphamp")

UPDATE_TAG = "graphamp_update"
_SUBGRAPH = "graphamp_update_region"


class GatherUpdate(CustomGraphPass):
    """Gathers the nodes tagged ``UPDATE_TAG`` into one call of ``update_region``."""

    def __call__(self, graph: fx.Graph) -> None:
        gather_update(graph)

    def uuid(self) -> bytes:
        # inductor's FX-graph cache keys on this: the pass's code, so an edit recompiles
        return get_hash_for_files((__file__,))


def update_region(subgraph: fx.GraphModule, *args: object) -> tuple:
    """The call the pass makes: runs the gathered nodes (inductor's fake-tensor propagation
    calls it; inductor lowers it with ``_lower_region``)."""
    return tuple(subgraph(*args))


def is_update(node: fx.Node) -> bool:
    return bool((node.meta.get("custom") or {}).get(UPDATE_TAG))


def gather_update(graph: fx.Graph) -> int:
    """Gathers the update's nodes of ``graph`` in place; returns how many were gathered."""
    region = [n for n in graph.nodes if n.op == "call_function" and is_update(n)]
    owner = graph.owning_module  # holds the subgraph
    if owner is None or not region:
        return 0
    odd = next((n for n in region if not _gatherable(n)), None)
    if odd is not None:
        return _left(f"{odd.format_node()} is not an aten op making tensors without writes")
    if not _register_lowering():
        return _left("this torch's inductor lacks what the update's lowering uses")
    inside = set(region)
    after = _reached_from(graph, inside)
    if not _convex(graph, inside, after):
        return _left("a value outside the update both reads it and feeds it")
    inputs, outputs = region_boundary(region)
    last = _insert_call(owner, region, inputs, outputs, inside)
    position = {node: i for i, node in enumerate(graph.nodes)}
    for node in [n for n in graph.nodes if n in after and position[n] < position[last]]:
        last.append(node)  # a reader of the update placed among its nodes: after the call
        last = node
    for node in reversed(region):
        graph.erase_node(node)
    graph.lint()
    log.debug("inductor gets the optimizer update (%d nodes) as one call", len(region))
    return len(region)


def _left(why: str) -> int:
    log.debug("inductor gets the optimizer update node by node: %s", why)
    return 0


def _gatherable(node: fx.Node) -> bool:
    """A tensor (or tensors) made by an aten op that writes nothing, or an item of a list an
    op returned. Sizes, scalars and other values are lowered by ``run_node`` in ways of their
    own, so a region with one is left alone."""
    value = node.meta.get("val")
    values = value if isinstance(value, (list, tuple)) else [value]
    if not values or not all(isinstance(v, torch.Tensor) for v in values):
        return False
    if node.target is operator.getitem:
        return True
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and not target._schema.is_mutable


def _reached_from(graph: fx.Graph, inside: set) -> set:
    """The nodes outside ``inside`` that read a value of it, directly or not."""
    reached: set = set()
    for node in graph.nodes:
        if node not in inside and any(a in inside or a in reached for a in node.all_input_nodes):
            reached.add(node)
    return reached


def _convex(graph: fx.Graph, inside: set, after: set) -> bool:
    """No node outside the region both reads it and feeds it (one call could not stand for it)."""
    feeding: set = set()
    for node in reversed(graph.nodes):
        if node not in inside and any(u in inside or u in feeding for u in node.users):
            feeding.add(node)
    return not (feeding & after)


def _insert_call(
    owner: fx.GraphModule, region: list, inputs: list, outputs: list, inside: set
) -> fx.Node:
    """The subgraph of ``region`` as a submodule, called after the region's last node; the
    outputs' readers outside the region read the call's items. Returns the last item."""
    sub = fx.Graph()
    env: dict = {}
    for value in inputs:
        env[value] = sub.placeholder(value.name)
        env[value].meta = dict(value.meta)
    for node in region:
        env[node] = sub.node_copy(node, env.__getitem__)
    sub.output(tuple(env[o] for o in outputs))
    graph = owner.graph
    name = _SUBGRAPH
    while hasattr(owner, name):
        name += "_"
    owner.register_module(name, fx.GraphModule(owner, sub))
    with graph.inserting_after(region[-1]):
        attr = graph.get_attr(name)
    with graph.inserting_after(attr):
        call = graph.call_function(update_region, (attr, *inputs))
    call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
    last = call
    for i, value in enumerate(outputs):
        with graph.inserting_after(last):
            last = graph.call_function(operator.getitem, (call, i))
        last.meta = {k: v for k, v in value.meta.items() if k != "custom"}  # not the update's
        value.replace_all_uses_with(last, delete_user_cb=lambda user: user not in inside)
    return last


_registered: bool | None = None


def _register_lowering() -> bool:
    """Registers ``_lower_region`` as inductor's lowering of ``update_region``, once; False
    where this torch lacks what it uses (the graph is then left as it is)."""
    global _registered
    if _registered is None:
        from torch._inductor import ir
        from torch._inductor.graph import GraphLowering
        from torch._inductor.lowering import register_lowering
        from torch._inductor.virtualized import V

        _registered = all(
            hasattr(owner, name)
            for owner, name in (
                (GraphLowering, "set_current_node"),
                (V, "set_current_node"),
                (GraphLowering, "call_function"),
                (ir.IRNode, "current_origins"),
                (ir.TensorBox, "mark_reuse"),
                (ir.TensorBox, "has_exceeded_max_reads"),
            )
        )
        if _registered:
            register_lowering(update_region, type_promotion_kind=None)(_lower_region)
    return _registered


def _lower_region(subgraph, *args):
    """Lowers the gathered nodes one by one, as ``GraphLowering.run_node`` would, without
    registering them as readers of the buffers they read."""
    from torch._inductor import ir
    from torch._inductor.virtualized import V
    from torch.utils._ordered_set import OrderedSet

    env: dict = {}
    values = iter(args)
    for node in subgraph.graph_module.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(values)
        elif node.op == "output":
            return tuple(fx.node.map_arg(node.args[0], env.__getitem__))
        else:
            node_args = fx.node.map_arg(node.args, env.__getitem__)
            node_kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
            with (
                ir.IRNode.current_origins(OrderedSet([node])),
                V.graph.set_current_node(node),
                V.set_current_node(node),
            ):
                env[node] = V.graph.call_function(node.target, node_args, node_kwargs)
            _reuse_rules(node, env[node])
    raise AssertionError("a subgraph without an output")


def _reuse_rules(node: fx.Node, result: object) -> None:
    """``GraphLowering.run_node``'s rules for a value read more than once or read from many
    buffers: realized where inlining it again would cost more than a buffer."""
    from torch._inductor import ir
    from torch._inductor.lowering import needs_realized_inputs

    if not isinstance(result, ir.TensorBox):
        return
    users = len(node.users)
    if users > 1:
        if any(user.target in needs_realized_inputs for user in node.users):
            result.realize_hint()
        result.mark_reuse(users)
    if result.has_exceeded_max_reads():
        result.realize_hint()
    data = result.data
    if isinstance(data, ir.StorageBox) and isinstance(data.data, ir.Pointwise):
        if data.data.has_large_inner_fn(threshold=100):
            result.realize()
