"""Repeated blocks compiled once (issue 31, item 2; ``config.set_outline_blocks``, off by
default): the assembled step's forward and backward regions of N identical blocks become calls
of one shared subgraph each (``torch.ops.higher_order.invoke_subgraph``), so inductor compiles
each distinct block's forward and backward once. The step stays one graph and one program.

- Blocks are found automatically: the module paths ``parent.<index>`` of a ModuleList or
  Sequential with at least two children that produced forward nodes (``model.h.3``,
  ``model.layer1.0``); the outermost such paths.
- A block's forward region is its nodes by module path; its backward region the backward nodes
  whose autograd ``seq_nr`` is one of its forward ops' (assembly records it when asked:
  ``assemble_step(..., record_origins=True)``), plus gradient sums that read from and feed only
  that region.
- Regions whose subgraph code and input metadata are equal share one subgraph; a region with no
  equal is left inline, and so is one that is not contiguous in the step's order.
- Outputs that alias an input of the subgraph are returned as copies: inductor (torch 2.14.1,
  CPU) computes wrong results for them (``benchmarks/outline_blocks_probe.py --alias-repro``).

Every precision decision was made before (the regions are copied node for node, metadata kept),
so the precision report is the same.
"""

from __future__ import annotations

import hashlib
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from ..records.fxutil import module_path

Region = tuple[str, str]  # ("fw" | "bw", block path)


@dataclass
class OutlineResult:
    blocks: int = 0  # block instances found
    outlined: int = 0  # regions replaced by a shared subgraph call
    distinct: int = 0  # shared subgraphs (each compiled once)
    left_inline: list[str] = field(default_factory=list)  # regions kept inline, and why


def outline_blocks(gm: fx.GraphModule) -> OutlineResult:
    """Outline ``gm``'s repeated block regions in place (see the module docstring)."""
    blocks = find_blocks(gm)
    result = OutlineResult(blocks=len(blocks))
    if len(blocks) < 2:
        return result
    regions = block_regions(gm, blocks)
    extracted = {key: _extract(gm, nodes) for key, nodes in regions.items()}
    groups: dict[str, list[Region]] = {}
    for key, (sub, inputs, _) in extracted.items():
        groups.setdefault(f"graphamp_{key[0]}_{_signature(sub, inputs)}", []).append(key)
    order = {n: float(i) for i, n in enumerate(gm.graph.nodes)}
    replaced: dict[fx.Node, fx.Node] = {}  # an outlined output -> the getitem standing for it
    shared = {key: ident for ident, keys in groups.items() if len(keys) > 1 for key in keys}
    result.left_inline += [f"{k[0]} {k[1]}: no equal block" for k in regions if k not in shared]
    used: set[str] = set()
    for key in sorted(shared, key=lambda k: order[regions[k][0]]):
        ident = shared[key]
        sub, inputs, outputs = extracted[key]
        inputs = [replaced.get(a, a) for a in inputs]
        first_user = _first_outside_user(regions[key], outputs, order)
        if first_user is None or any(order[a] >= order[first_user] for a in inputs):
            result.left_inline.append(f"{key[0]} {key[1]}: not contiguous")
            continue
        if ident not in used:
            gm.register_module(ident, sub)
            used.add(ident)
        _replace(gm, regions[key], ident, inputs, outputs, first_user, order, replaced)
        result.outlined += 1
    result.distinct = len(used)
    gm.graph.lint()
    gm.recompile()
    return result


def find_blocks(gm: fx.GraphModule) -> list[str]:
    """The outermost module paths ``parent.<index>`` whose parent has two or more of them."""
    children: dict[str, set[str]] = {}
    for node in gm.graph.nodes:
        parts = module_path(node).split(".")
        for i, part in enumerate(parts):
            if part.isdigit() and i > 0:
                children.setdefault(".".join(parts[:i]), set()).add(".".join(parts[: i + 1]))
    candidates = sorted(p for kids in children.values() if len(kids) > 1 for p in kids)
    outer: list[str] = []
    for path in candidates:  # sorted: a parent path comes before the paths inside it
        if not any(path.startswith(o + ".") for o in outer):
            outer.append(path)
    return outer


def _block_of(path: str, blocks: list[str]) -> str | None:
    for block in blocks:
        if path == block or path.startswith(block + "."):
            return block
    return None


def block_regions(gm: fx.GraphModule, blocks: list[str]) -> dict[Region, list[fx.Node]]:
    """{("fw" | "bw", block): the region's nodes in graph order}."""
    regions: dict[Region, list[fx.Node]] = {}
    seq_to_block: dict[int, str] = {}
    for node in gm.graph.nodes:
        if node.meta.get("graphamp_subgraph") != "forward" or node.op != "call_function":
            continue
        block = _block_of(module_path(node), blocks)
        if block is not None:
            regions.setdefault(("fw", block), []).append(node)
            if "seq_nr" in node.meta:
                seq_to_block.setdefault(node.meta["seq_nr"], block)
    backward = [n for n in gm.graph.nodes if n.meta.get("graphamp_subgraph") == "backward"]
    block_of = {
        n: seq_to_block[n.meta["seq_nr"]] for n in backward if n.meta.get("seq_nr") in seq_to_block
    }
    _attribute_gradient_sums(backward, block_of)
    for node in gm.graph.nodes:
        if node in block_of and node.op == "call_function":
            regions.setdefault(("bw", block_of[node]), []).append(node)
    return regions


def _attribute_gradient_sums(backward: list[fx.Node], block_of: dict[fx.Node, str]) -> None:
    """A gradient sum (the two gradients of a residual stream, of a value read twice) carries
    the seq_nr of no block op: it belongs to the block whose backward nodes are the only ones
    it reads, when it feeds that block's backward and no other's. Repeated until nothing
    changes (sums feed sums)."""
    changed = True
    while changed:
        changed = False
        for node in backward:
            if node in block_of:
                continue
            before = {block_of[a] for a in node.all_input_nodes if a in block_of}
            after = {block_of[u] for u in node.users if u in block_of}
            if len(before) == 1 and after and after <= before:
                block_of[node] = before.pop()
                changed = True


def _extract(gm: fx.GraphModule, nodes: list[fx.Node]):
    """(subgraph with canonical names, its inputs, the region's outputs used outside)."""
    inside = set(nodes)
    inputs: list[fx.Node] = []
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg not in inside and arg not in inputs:
                inputs.append(arg)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, arg in enumerate(inputs):
        env[arg] = graph.placeholder(f"in{i}")
        env[arg].meta = dict(arg.meta)
    for i, node in enumerate(nodes):
        env[node] = graph.node_copy(node, lambda a: env[a])
        env[node]._rename(f"n{i}")  # noqa: SLF001 - canonical names: equal blocks, equal code
    results = []
    for out in outputs:
        result = env[out]
        if _aliases_an_input(out, inputs):
            result = graph.call_function(torch.ops.aten.clone.default, (result,))
            result.meta["val"] = out.meta["val"].clone()
        results.append(result)
    graph.output(tuple(results))
    return fx.GraphModule(gm, graph), inputs, outputs


def _aliases_an_input(node: fx.Node, inputs: list[fx.Node]) -> bool:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return False
    mine = StorageWeakRef(val.untyped_storage())
    return any(
        isinstance(a.meta.get("val"), torch.Tensor)
        and StorageWeakRef(a.meta["val"].untyped_storage()) == mine
        for a in inputs
    )


def _signature(sub: fx.GraphModule, inputs: list[fx.Node]) -> str:
    metas = [
        (tuple(v.shape), str(v.dtype), tuple(v.stride()))
        if isinstance(v := a.meta.get("val"), torch.Tensor)
        else repr(v)
        for a in inputs
    ]
    return hashlib.sha1((sub.code + repr(metas)).encode()).hexdigest()[:16]


def _first_outside_user(nodes, outputs, order) -> fx.Node | None:
    inside = set(nodes)
    users = [u for o in outputs for u in o.users if u not in inside]
    return min(users, key=order.__getitem__) if users else None


def _replace(gm, nodes, ident, inputs, outputs, first_user, order, replaced) -> None:
    """The region's nodes become one invoke_subgraph call before its first outside user."""
    inside = set(nodes)
    with gm.graph.inserting_before(first_user):
        sub_ref = gm.graph.get_attr(ident)
        call = gm.graph.call_function(
            torch.ops.higher_order.invoke_subgraph, (sub_ref, ident, *inputs)
        )
        call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
        order[sub_ref] = order[call] = order[first_user] - 0.5  # a later region may read it
        for i, out in enumerate(outputs):
            item = gm.graph.call_function(operator.getitem, (call, i))
            item.meta = dict(out.meta)
            order[item] = order[first_user] - 0.5
            replaced[out] = item
            out.replace_all_uses_with(item, delete_user_cb=lambda u: u not in inside)
    for node in reversed(nodes):
        gm.graph.erase_node(node)
