"""ZeRO-3: each block's all-gather just before the block runs, gathered again for its backward;
each block's gradient reduce-scatter as soon as its gradients are made.

Assembly traces the step with every block's gather at the start (``assemble._gather_shards``:
one all-gather per block of parameters, its nodes tagged ``graphamp_gather`` with the block's
number). Left there, every whole parameter would live from the start of the step to its last
use in the backward, as many bytes as ZeRO-2 holds. This pass moves each block's gather (with
the low-precision casts AMP makes of its parameters and the ``detach`` that makes each whole a
leaf, so a block's wholes are cast where they are gathered) to just before the first node that reads it, and gives every later stretch of
the step that reads it (its backward, the next micro-batch's forward) a gather of its own
before that stretch's first reader, the way FSDP2 re-gathers for the backward
(``reshard_after_forward=True``). Each whole then lives from its gather to the end of one
stretch: the step's peak holds about one block's wholes at a time beside the activations.

Gradients go the other way: assembly traces one reduce-scatter per block after the whole
backward (nodes tagged ``graphamp_scatter``); each is moved to just after the last gradient it
reads, so a block's whole gradients live only until its own backward ends, FSDP2's
reduce-scatter per block.

A stretch is a maximal run of nodes with the same subgraph tag (``records/subgraphs.py``) (forward,
backward, ...), in graph order.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.fx as fx

from ..records.subgraphs import subgraph_of

# views of a whole (or of its cast) that a later stretch may read instead of the whole itself
_VIEWS = {
    torch.ops.aten.t.default,
    torch.ops.aten.permute.default,
    torch.ops.aten.transpose.int,
    torch.ops.aten.view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten.expand.default,
    torch.ops.aten.unsqueeze.default,
    torch.ops.aten.squeeze.dim,
    torch.ops.aten.alias.default,
    torch.ops.aten.detach.default,
}
GATHER = "graphamp_gather"  # meta key: the block number of a node of that block's gather
# meta key on a block's gather: its wholes stay from the forward to the backward (FSDP2's
# reshard_after_forward=False), gathered once a step instead of again for each later stretch
KEEP_GATHERED = "graphamp_keep_gathered"
SCATTER = "graphamp_scatter"  # meta key: the bucket number of a node of a gradient scatter
_CASTS = "parameter_casts"


def place_collectives(gm: fx.GraphModule) -> int:
    """Move each block's gather before its first reader and gather again for each later
    stretch that reads it; move each gradient scatter to just after its last gradient.
    Returns how many gathers the step has now."""
    graph = gm.graph
    for chain in _chains(graph, SCATTER).values():
        _scatter_early(chain)
    total = _place_gathers(graph)
    graph.lint()
    gm.recompile()
    return total


def _chains(graph: fx.Graph, key: str) -> dict[int, list[fx.Node]]:
    chains: dict[int, list[fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if key in node.meta:
            chains[node.meta[key]].append(node)
    return chains


def _scatter_early(chain: list[fx.Node]) -> None:
    """The chain right after the last node it reads from outside itself."""
    members = set(chain)
    position = {n: i for i, n in enumerate(chain[0].graph.nodes)}
    outside = {i for n in chain for i in n.all_input_nodes if i not in members}
    anchor = max(outside, key=position.__getitem__)
    for node in chain:
        anchor.append(node)
        anchor = node


def _place_gathers(graph: fx.Graph) -> int:
    stretch_of = _stretches(graph)
    total = 0
    for chain in _chains(graph, GATHER).values():
        movable = _with_casts(chain)
        readers = _readers(movable)
        by_stretch: dict[int, list[fx.Node]] = defaultdict(list)
        for reader in readers:
            by_stretch[stretch_of[reader]].append(reader)
        order = sorted(by_stretch)
        if not order:
            continue
        first = by_stretch[order[0]]
        for node in movable:  # in graph order, so the chain stays topologically sorted
            first[0].prepend(node)
        total += 1
        if chain[0].meta.get(KEEP_GATHERED):
            continue
        for stretch in order[1:]:
            _gather_again(graph, movable, by_stretch[stretch])
            total += 1
    return total


def _stretches(graph: fx.Graph) -> dict[fx.Node, int]:
    """Each node's stretch: the number of the run of same-tagged nodes it is in. Readers are
    found in graph order, so a stretch's first reader is its earliest node in the list."""
    stretch_of, number, tag = {}, -1, object()
    for node in graph.nodes:
        here = subgraph_of(node)
        if here != tag:
            number, tag = number + 1, here
        stretch_of[node] = number
    return stretch_of


def _with_casts(chain: list[fx.Node]) -> list[fx.Node]:
    """The chain and what prepares its wholes for the forward, reading nothing else: AMP's
    parameter casts, the untagged ``detach`` that makes each a leaf to differentiate, and the
    views the forward takes of them (a Linear's transposed weight, which its backward reads
    again: left in the forward, it would keep the forward's whole alive), in graph order."""
    members = set(chain)
    out = list(chain)
    grown = True
    while grown:
        grown = False
        for node in list(out):
            for user in node.users:
                tag = subgraph_of(user)
                if user in members or user.op != "call_function":
                    continue
                if tag not in (_CASTS, None) and user.target not in _VIEWS:
                    continue
                if all(i in members for i in user.all_input_nodes):
                    members.add(user)
                    out.append(user)
                    grown = True
    position = {n: i for i, n in enumerate(chain[0].graph.nodes)}
    return sorted(out, key=position.__getitem__)


def _readers(movable: list[fx.Node]) -> list[fx.Node]:
    """The nodes outside ``movable`` that read it, in graph order."""
    members = set(movable)
    position = {n: i for i, n in enumerate(movable[0].graph.nodes)}
    readers = {u for n in movable for u in n.users if u not in members}
    return sorted(readers, key=position.__getitem__)


def _gather_again(graph: fx.Graph, movable: list[fx.Node], readers: list[fx.Node]) -> None:
    """A copy of the gather before the first of ``readers``, which read the copy from now on."""
    copies: dict[fx.Node, fx.Node] = {}
    with graph.inserting_before(readers[0]):
        for node in movable:
            copies[node] = graph.node_copy(node, lambda n: copies.get(n, n))
    for reader in readers:
        for old, new in copies.items():
            reader.replace_input_with(old, new)
