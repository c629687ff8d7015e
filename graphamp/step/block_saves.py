"""What an outlined block's backward reads from its forward: cheap values are recomputed.

In one inlined step, inductor decides per kernel whether a pointwise value the backward reads
is stored by the forward or recomputed by the backward's kernel from what it was made of (a
GELU's four float32 intermediates come back from one bfloat16 matmul output). Once a block is
outlined, its forward is a subgraph of its own: every value its backward reads is an output of
that subgraph and must be written to memory, whatever it costs. On transformers' GPT-2 that made
the outlined step 31% slower than the inlined one on the CPU and 13% slower on an H200 (issue 40).

So before outlining, each block's backward gets its own copies of the pointwise and view ops
that produce the values it reads (as activation checkpointing does for a whole module, see
``recompute.py``), back to values that are not cheap to recompute (a matmul's output, a
normalisation's statistics, random numbers) or that the step reads after the block anyway. Only
values that the backward reads in pointwise ops are recomputed, where the compiler fuses the
recomputation into the kernel that reads them; an operand of a backward matmul stays stored. A
block's plan is applied only where it stores fewer bytes than before. The copies are the same
ops on the same values, so the block computes what it computed: precision decisions are kept.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._ops, torch.ops.aten._to_copy
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from ..records.subgraphs import SUBGRAPH, Subgraph
from ..torchkit.shapes import size_hint

BACKWARD_OF = "graphamp_backward_of"  # meta of a copy: the block whose backward reads it


@dataclass
class SavedBytes:
    """What the blocks' forwards store for their backwards, before and after the pass."""

    recomputed: int = 0  # forward values no longer stored
    before: int = 0  # bytes stored by all blocks
    after: int = 0


def recompute_cheap_saves(
    gm: fx.GraphModule, regions: dict[tuple[str, str], list[fx.Node]]
) -> SavedBytes:
    """Rewire each block's backward (``regions[("bw", block)]``) to recompute the cheap values
    it reads from the block's forward (``regions[("fw", block)]``); in place. The caller
    computes the regions again: the copies carry ``BACKWARD_OF``."""
    result = SavedBytes()
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for (kind, block), forward in regions.items():
        backward = set(regions.get(("bw", block), ()))
        if kind != "fw" or not backward:
            continue
        stored = _stored(forward)
        members, leaves = _recomputable(forward, stored, backward)
        kept = [n for n in stored if n not in members] + sorted(leaves, key=order.__getitem__)
        before, after = _bytes(stored), _bytes(kept)
        result.before += before
        if not members or after >= before:
            result.after += before
            continue
        result.after += after
        result.recomputed += sum(1 for n in stored if n in members)
        _copy_into_backward(gm, sorted(members, key=order.__getitem__), backward, order, block)
    if result.recomputed:
        gm.graph.lint()
        gm.recompile()
    return result


def _stored(forward: list[fx.Node]) -> list[fx.Node]:
    """The forward region's values read after it: what its subgraph returns."""
    inside = set(forward)
    return [n for n in forward if any(u not in inside for u in n.users)]


def _recomputable(
    forward: list[fx.Node], stored: list[fx.Node], backward: set[fx.Node]
) -> tuple[set[fx.Node], set[fx.Node]]:
    """(the cheap forward nodes the backward can recompute, the region values they start
    from). A value read outside the block's backward too stays stored and is a start."""
    inside = set(forward)

    def only_backward_reads(n: fx.Node) -> bool:
        return all(u in inside or u in backward for u in n.users)

    def fused_where_read(n: fx.Node) -> bool:
        # a matmul or convolution of the backward reads its operands from memory: a value it
        # reads would be recomputed and written again, paying the compute for nothing
        return all(_cheap(u) for u in n.users if u in backward)

    members: set[fx.Node] = set()
    leaves: set[fx.Node] = set()
    todo = [n for n in stored if only_backward_reads(n) and _cheap(n) and fused_where_read(n)]
    while todo:
        n = todo.pop()
        if n in members:
            continue
        members.add(n)
        for a in n.all_input_nodes:
            if a in inside and _cheap(a) and only_backward_reads(a):
                todo.append(a)
            elif a in inside:
                leaves.add(a)
    return members, leaves - members


def _cheap(node: fx.Node) -> bool:
    """A deterministic pointwise op, a view or a dtype cast producing one tensor: recomputing
    it in a backward kernel costs less than storing and loading it."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if not isinstance(node.meta.get("val"), torch.Tensor):
        return False
    if target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags:
        return False
    if target is torch.ops.aten._to_copy.default:
        return set(node.kwargs) <= {"dtype"}  # a cast, not a move to another device or layout
    return target.is_view or torch.Tag.pointwise in target.tags


def _bytes(nodes: list[fx.Node]) -> int:
    """Bytes of the distinct memory the values use (views of one tensor count once)."""
    seen: set[StorageWeakRef] = set()
    total = 0
    for n in nodes:
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        storage = StorageWeakRef(val.untyped_storage())
        if storage not in seen:
            seen.add(storage)
            # a step with symbolic sizes counts at the sizes it was traced with: comparing
            # symbolic byte counts would add guards that specialise the step
            total += size_hint(val.untyped_storage().nbytes())
    return total


def _copy_into_backward(
    gm: fx.GraphModule, members: list[fx.Node], backward: set[fx.Node], order: dict, block: str
) -> None:
    """Copies of ``members`` (in graph order) before the first backward node reading one of
    them; the backward reads the copies."""
    readers = [u for n in members for u in n.users if u in backward]
    first = min(readers, key=order.__getitem__)
    copies: dict[fx.Node, fx.Node] = {}
    with gm.graph.inserting_before(first):
        for n in members:
            new = gm.graph.node_copy(n, lambda a: copies.get(a, a))
            new.meta[SUBGRAPH] = Subgraph.BACKWARD.value
            new.meta[BACKWARD_OF] = block
            new.meta["recomputed_from"] = n.name
            copies[n] = new
    for n in members:
        for user in [u for u in n.users if u in backward]:
            user.replace_input_with(n, copies[n])
