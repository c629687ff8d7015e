"""colour_by_lists: decide, once for the whole graph, which ops run in low precision.

The algorithm is OneFlow's ``auto_mixed_precision`` pass (after TF grappler's painter), in
three named steps on a networkx view of the FX graph (float-valued edges only; tuple unpacking
merged into the op that produced the tuple):

1. fill_deny_set: deny ops, and the infer/clear ops downstream of them (through clear ops that
   lead to deny or infer ops).
2. fill_allow_set: allow ops, and the infer/clear ops that sit between allow ops (downstream of
   one, upstream of another) or lead from an allow op to a graph output.
3. propagate_allow_through_clear: a clear op whose float inputs are all low precision, or whose
   consumers all are, joins them.

Everything else runs in fp32. Writes ``meta["amp_list"]`` (list category), ``meta["amp_colour"]``
("allow": low precision, "deny": fp32, "promote": the widest input dtype, "fixed": dtype set by
the op), ``meta["amp_reason"]``, and ``meta["amp_widen"]`` on the deny set of step 1: those ops
compute in fp32 even where their inputs arrive in low precision (autocast's fp32 rule; the
other deny-coloured ops keep the dtype they were captured with).
"""

from __future__ import annotations

import operator
from collections import Counter
from typing import Callable, Iterable, cast

import networkx as nx
import torch.fx as fx

from ..torchkit.fxutil import op_name
from .base import (
    AmpContext,
    Classifier,
    PassResult,
    captured_dtype,
    carries_float,
    is_compute_node,
    packet_of,
)
from .op_dtypes import MIXED_ARGS


class DataFlow:
    """Compute nodes and the float values between them, as a networkx DiGraph."""

    def __init__(self, graph: fx.Graph, category: dict[fx.Node, str]):
        self.category = category
        self.order = [n for n in graph.nodes if n in category]
        g = nx.DiGraph()
        g.add_nodes_from(self.order)
        self.feeds_output: set[fx.Node] = set()
        edges = []
        for node in graph.nodes:
            if node.op == "output":
                for src in node.all_input_nodes:
                    src = _producer(src)
                    if src in category and carries_float(captured_dtype(src)):
                        self.feeds_output.add(src)
                continue
            if node not in category:
                continue
            for value in _precision_inputs(node):
                if captured_dtype(value) is None:
                    continue
                src = _producer(value)
                if src in category:
                    edges.append((src, node))
        g.add_edges_from(edges)
        self.g = g
        # networkx's own algorithms read these dict-of-dicts directly; its public views build an
        # AtlasView object per lookup, which costs a third of colouring on a 100k-node graph.
        self.succ, self.pred = g._succ, g._pred

    def reach(
        self, starts: Iterable[fx.Node], traversable: Callable[[fx.Node], bool], reverse: bool
    ) -> dict[fx.Node, fx.Node]:
        """Nodes reachable from ``starts`` through traversable nodes: {node: start it came from}."""
        neighbours = self.pred if reverse else self.succ
        origin = {s: s for s in starts}
        stack = list(origin)
        while stack:
            node = stack.pop()
            for nxt in neighbours[node]:
                if nxt not in origin and traversable(nxt):
                    origin[nxt] = origin[node]
                    stack.append(nxt)
        return origin


def _precision_inputs(node: fx.Node) -> list[fx.Node]:
    """The inputs whose precision follows the op's: all of them, except the fp32-only positions
    of mixed-precision kernels (BatchNorm's weight, bias and statistics), which take no part in
    colouring (a value that only feeds them stays fp32, with no round trip through fp16)."""
    fp32_only = MIXED_ARGS.get(packet_of(node))
    if fp32_only is None:
        return node.all_input_nodes
    return [a for i, a in enumerate(node.args) if i not in fp32_only and isinstance(a, fx.Node)]


def _producer(value: fx.Node) -> fx.Node:
    """The op behind a value: the tuple-producing op for ``getitem`` nodes."""
    if value.op == "call_function" and value.target is operator.getitem:
        return cast(fx.Node, value.args[0])
    return value


def fill_deny_set(flow: DataFlow) -> dict[fx.Node, fx.Node]:
    cat = flow.category
    deny_or_infer = [n for n in flow.order if cat[n] in ("deny", "infer")]
    upstream = flow.reach(deny_or_infer, lambda n: cat[n] == "clear", reverse=True)
    return flow.reach(
        [n for n in flow.order if cat[n] == "deny"], lambda n: n in upstream, reverse=False
    )


def fill_allow_set(flow: DataFlow, deny_set: dict) -> dict[fx.Node, fx.Node]:
    cat = flow.category

    def follows(n: fx.Node) -> bool:
        return cat[n] in ("infer", "clear") and n not in deny_set

    allow = [n for n in flow.order if cat[n] == "allow"]
    sinks = [n for n in flow.order if n in flow.feeds_output and follows(n)]
    upstream = flow.reach(allow + sinks, follows, reverse=True)
    return flow.reach(allow, lambda n: n in upstream, reverse=False)


def propagate_allow_through_clear(flow: DataFlow, deny_set: dict, allow_set: dict) -> list:
    cat = flow.category
    joined = []

    def candidate(n: fx.Node) -> bool:
        return cat[n] == "clear" and n not in allow_set and n not in deny_set

    for node in flow.order:  # downward: all producers low
        preds = flow.pred[node]
        if candidate(node) and preds and all(p in allow_set for p in preds):
            allow_set[node] = node
            joined.append(node)
    for node in reversed(flow.order):  # upward: all consumers low
        succs = flow.succ[node]
        if (
            candidate(node)
            and succs
            and node not in flow.feeds_output
            and all(s in allow_set for s in succs)
        ):
            allow_set[node] = node
            joined.append(node)
    return joined


def colour_by_lists(gm: fx.GraphModule, ctx: AmpContext) -> PassResult:
    graph = gm.graph
    category, why = _classify(graph, Classifier(ctx))
    flow = DataFlow(graph, category)
    deny_set = fill_deny_set(flow)
    allow_set = fill_allow_set(flow, deny_set)
    joined = set(propagate_allow_through_clear(flow, deny_set, allow_set))
    for node in flow.order:
        node.meta["amp_colour"] = "allow" if node in allow_set else "deny"
        node.meta["amp_widen"] = node in deny_set
        node.meta["amp_reason"] = _reason(
            node, category[node], why[node], allow_set, deny_set, joined
        )
        if node not in allow_set and category[node] == "unknown":
            name = op_name(node)
            ctx.unknown_ops[name] = ctx.unknown_ops.get(name, 0) + 1
    # getitem nodes show the colour of the op whose tuple they unpack
    for node in graph.nodes:
        if node.op == "call_function" and node.target is operator.getitem:
            src = node.args[0]
            for key in ("amp_list", "amp_colour", "amp_reason"):
                if key in src.meta:
                    node.meta[key] = src.meta[key]
    colours = Counter(n.meta["amp_colour"] for n in flow.order)
    ctx.stats["ops_low"] = colours.get("allow", 0)
    ctx.stats["ops_fp32"] = colours.get("deny", 0)
    ctx.stats["ops_coloured"] = len(flow.order)
    return PassResult(gm, True)


def _classify(graph: fx.Graph, classify: Classifier):
    """List category and reason of every compute node that takes part in colouring; nodes
    without floating-point data, with a fixed dtype or on the promote list are annotated and
    left out."""
    category: dict[fx.Node, str] = {}
    why: dict[fx.Node, str] = {}
    for node in graph.nodes:
        if not is_compute_node(node):
            continue
        cat, reason = classify(node)
        node.meta["amp_list"] = cat
        if cat in ("n/a", "fixed", "promote"):
            node.meta["amp_colour"] = cat if cat != "n/a" else None
            node.meta["amp_reason"] = reason
            continue
        category[node] = cat
        why[node] = reason
    return category, why


def _reason(
    node: fx.Node, cat: str, listed: str, allow_set: dict, deny_set: dict, joined: set
) -> str:
    """One sentence: why the colouring gave ``node`` its precision."""
    if node in allow_set:
        if node in joined:
            return "clear op next to low-precision ops"
        if cat != "allow":
            return f"{cat} op between low-precision ops (from {allow_set[node].name})"
        return listed
    if cat in ("deny", "unknown"):
        return listed
    if node in deny_set:
        return f"{cat} op downstream of fp32 op {deny_set[node].name}"
    return f"{cat} op not between low-precision ops"
