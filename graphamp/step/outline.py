"""Repeated blocks compiled once (issue 31, item 2; ``config.set_outline_blocks``, on by
default where the steady step costs nothing, ``pipeline/stages.outlined_by_default``): the step's
forward and backward regions of N identical blocks become calls of one shared subgraph each
(``torch.ops.higher_order.invoke_subgraph``), so inductor compiles each distinct block's forward
and backward once. The step stays one graph and one program.

- Blocks are found automatically: the module paths of a run of numbered siblings that
  produced forward nodes, at least two under one parent: a ModuleList's or Sequential's
  ``parent.<index>`` (``model.h.3``, ``model.layer1.0``) or ``parent.<name>_<index>``
  (torchvision's ViT: ``encoder.layers.encoder_layer_3``; a named run must hold modules of
  its own: ``ln_1`` and ``ln_2`` are two layers, not blocks). The outermost such paths, of
  which those whose forward has an equal are outlined; where none has (a network's stages of
  different widths, each a run of blocks), the outermost runs inside them, and so on down.
- A block's forward region is its nodes by module path (one region per micro-batch under
  gradient accumulation); its backward region the backward nodes
  whose autograd ``seq_nr`` is one of its forward ops' (assembly records it when asked:
  ``assemble_step(..., record_origins=True)``), plus gradient sums that read from and feed only
  that region.
- Each block's backward recomputes the cheap values it reads from the block's forward instead
  of having the forward's subgraph store them (``block_saves.py``): inside one inlined step the
  compiler makes that choice per kernel, across a subgraph's boundary it cannot.
- The optimizer update is not part of a subgraph: a subgraph's writes into the state came back
  outside it as a copy kernel per tensor (issue 40). Where blocks repeat at least 3 times (the
  CPU's default; ``config.set_block_updates``), assembly gives each one's update its own op
  instead, whose kernel is compiled once per distinct block (``block_update.py``).
- Regions whose subgraph code and input metadata are equal share one subgraph; a region with no
  equal is left inline, and so is one that is not contiguous in the step's order.
- No output of a subgraph shares memory with its inputs or its other outputs (invoke_subgraph's
  contract, which inductor's buffer reuse relies on): outputs that are views (q, k and v
  split from one projection too) are rebuilt outside the call from their source, and
  anything still shared is returned as a copy.

Every precision decision was made before (the regions are copied node for node, metadata kept),
so the precision report is the same.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._ops
import hashlib
import operator
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from ..records.subgraphs import Subgraph, subgraph_of
from ..torchkit.fxutil import module_path, region_boundary
from .block_saves import BACKWARD_OF, SavedBytes, recompute_cheap_saves
from .gradients import MICRO_BATCH

Region = tuple[str, str]  # ("fw" | "bw", block path)


@dataclass
class OutlineResult:
    blocks: int = 0  # block instances found
    outlined: int = 0  # regions replaced by a shared subgraph call
    distinct: int = 0  # shared subgraphs (each compiled once)
    # regions with an equal that stayed inline, and why (a region with no equal is not listed)
    left_inline: list[str] = field(default_factory=list)
    # what the blocks' forwards store for their backwards (block_saves)
    saves: SavedBytes = field(default_factory=SavedBytes)


def outline_blocks(gm: fx.GraphModule) -> OutlineResult:
    """Outline ``gm``'s repeated block regions in place (see the module docstring)."""
    _share_getitems(gm)
    blocks, signatures = find_blocks(gm)
    result = OutlineResult(blocks=len(blocks))
    if len(blocks) < 2:
        return result
    regions = block_regions(gm, blocks)
    # a block without an equal (here: in another micro-batch too) stays inline as it is
    repeated = _with_equal(_forward_signatures(gm, regions, signatures))
    result.saves = recompute_cheap_saves(
        gm, {key: nodes for key, nodes in regions.items() if key[1] in repeated}
    )
    regions = block_regions(gm, blocks)
    extracted = {key: _extract(gm, nodes) for key, nodes in regions.items()}
    groups: dict[str, list[Region]] = {}
    for key, ex in extracted.items():
        groups.setdefault(f"graphamp_{key[0]}_{_signature(ex.sub, ex.inputs)}", []).append(key)
    order = {n: float(i) for i, n in enumerate(gm.graph.nodes)}
    replaced: dict[fx.Node, fx.Node] = {}  # an outlined output -> the getitem standing for it
    shared = {key: ident for ident, keys in groups.items() if len(keys) > 1 for key in keys}
    used: set[str] = set()
    for key in sorted(shared, key=lambda k: order[regions[k][0]]):
        ident = shared[key]
        ex = extracted[key]
        inputs = [replaced.get(a, a) for a in ex.inputs]
        first_user = _first_outside_user(regions[key], ex.outputs, order)
        if first_user is None or any(order[a] >= order[first_user] for a in inputs):
            result.left_inline.append(f"{key[0]} {key[1]}: not contiguous")
            continue
        if ident not in used:
            gm.register_module(ident, ex.sub)
            used.add(ident)
        _replace(gm, ex, regions[key], ident, inputs, first_user, order, replaced)
        result.outlined += 1
    result.distinct = len(used)
    gm.graph.lint()
    gm.recompile()
    return result


def _share_getitems(gm: fx.GraphModule) -> None:
    """One ``getitem`` per output of a multi-output op: later reads of the same output (the
    recomputation of a checkpointed block reads the attention's outputs from the forward) use
    the first. A region then returns that tensor, never the op's tuple, which a subgraph
    cannot return to inductor."""
    first: dict[tuple[fx.Node, int], fx.Node] = {}
    for node in list(gm.graph.nodes):
        if node.target is not operator.getitem or not isinstance(node.args[0], fx.Node):
            continue
        key = (node.args[0], node.args[1])
        if key in first:
            node.replace_all_uses_with(first[key])
            gm.graph.erase_node(node)
        else:
            first[key] = node


def _forward_signatures(
    gm: fx.GraphModule, regions: dict[Region, list[fx.Node]], known: dict[str, str]
) -> dict[str, str]:
    """{block: its forward region's signature (subgraph code and inputs)}, taken from
    ``known`` where it has the block."""
    signatures: dict[str, str] = {}
    for (kind, block), nodes in regions.items():
        if kind == "fw" and block in known:
            signatures[block] = known[block]
        elif kind == "fw":
            ex = _extract(gm, nodes)
            signatures[block] = _signature(ex.sub, ex.inputs)
    return signatures


def _with_equal(signatures: dict[str, str]) -> set[str]:
    """The blocks whose forward has an equal."""
    count = Counter(signatures.values())
    return {block for block, sig in signatures.items() if count[sig] > 1}


def find_blocks(gm: fx.GraphModule) -> tuple[list[str], dict[str, str]]:
    """The blocks to outline (module paths): the outermost runs of numbered siblings whose
    forwards have equals, else the outermost inside them (see the module docstring); with
    their forwards' signatures."""
    candidates = _candidates([module_path(n) for n in gm.graph.nodes])
    level = _outermost(candidates)
    while len(level) > 1:
        # equal to another block, not only to itself in another micro-batch
        regions = {k: v for k, v in block_regions(gm, level).items() if "@" not in k[1]}
        signatures = _forward_signatures(gm, regions, {})
        repeated = _with_equal(signatures)
        if repeated:
            chosen = [b for b in level if b in repeated]
            return chosen, {b: signatures[b] for b in chosen}
        inside = tuple(b + "." for b in level)
        level = _outermost([c for c in candidates if c.startswith(inside)])
    return [], {}


def numbered(part: str) -> str | None:
    """The name a run of numbered sibling modules shares: ``""`` for an index (``3``, a
    ModuleList's or Sequential's child), ``"encoder_layer_"`` for ``encoder_layer_3``; None for
    a name that is not numbered (``layer1`` and ``conv2`` are names, not positions)."""
    stem = part.rstrip("0123456789")
    if stem == part or (stem and not stem.endswith("_")):
        return None
    return stem


def numbered_on(parts: list[str]) -> list[tuple[int, str]]:
    """(position, shared name) of each module on a module path's ``parts`` that numbers a
    block: numbered, not the root, and, if named, holding modules of its own (``ln_1`` at the
    end of a path is a layer, not a block)."""
    found = []
    for i, part in enumerate(parts):
        stem = numbered(part)
        if stem is not None and i > 0 and (stem == "" or i < len(parts) - 1):
            found.append((i, stem))
    return found


def _candidates(paths: list[str]) -> list[str]:
    """Every module path that is one of two or more numbered siblings of one name, sorted."""
    runs: dict[tuple[str, str], set[str]] = {}
    for path in paths:
        parts = path.split(".")
        for i, stem in numbered_on(parts):
            runs.setdefault((".".join(parts[:i]), stem), set()).add(".".join(parts[: i + 1]))
    return sorted(p for kids in runs.values() if len(kids) > 1 for p in kids)


def _outermost(candidates: list[str]) -> list[str]:
    outer: list[str] = []
    for path in sorted(candidates):  # a parent path comes before the paths inside it
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
        if subgraph_of(node) != Subgraph.FORWARD or node.op != "call_function":
            continue
        block = _block_of(module_path(node), blocks)
        if block is not None:
            block = _instance(block, node.meta.get(MICRO_BATCH, 0))
            regions.setdefault(("fw", block), []).append(node)
            if "seq_nr" in node.meta:
                seq_to_block.setdefault(node.meta["seq_nr"], block)
    backward = [n for n in gm.graph.nodes if subgraph_of(n) == Subgraph.BACKWARD]
    block_of = {
        n: seq_to_block[n.meta["seq_nr"]] for n in backward if n.meta.get("seq_nr") in seq_to_block
    }
    block_of.update({n: n.meta[BACKWARD_OF] for n in backward if BACKWARD_OF in n.meta})
    _attribute_gradient_sums(backward, block_of)
    for node in gm.graph.nodes:
        if node in block_of and node.op == "call_function":
            regions.setdefault(("bw", block_of[node]), []).append(node)
    return regions


def _instance(block: str, micro_batch: int) -> str:
    """A block's region in one micro-batch: gradient accumulation runs each block's forward
    and backward once per micro-batch, each instance a region of its own (all equal, so one
    subgraph)."""
    return block if micro_batch == 0 else f"{block}@{micro_batch}"


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


@dataclass
class _Extracted:
    """A region as a subgraph: what it reads, what it returns, and what is rebuilt outside."""

    sub: fx.GraphModule
    inputs: list[fx.Node]  # outer values the subgraph reads, in order of first use
    outputs: list[fx.Node]  # region nodes used outside the region
    results: list[fx.Node]  # region nodes the subgraph returns (each its own memory)
    views: dict[fx.Node, tuple[fx.Node, list[fx.Node]]]  # output -> (source, view chain)


def _extract(gm: fx.GraphModule, nodes: list[fx.Node]) -> _Extracted:
    """The region as a subgraph with canonical names (equal blocks, equal code).

    invoke_subgraph's contract is that no output shares memory with an input or with another
    output. Inductor relies on it: it frees and reuses each output's buffer on its own, so an
    output sharing memory with a live one is overwritten (seen on the CPU with torch 2.14.1:
    three views of one LayerNorm output saved for q, k and v; after the step's buffers were
    reused, Adam moved some weights the wrong way). So an output that is a chain of views of
    another value is rebuilt outside, after the call, from that value: the subgraph returns the
    chain's source once (or nothing, when the source is an input). Whatever still shares
    memory is returned as a copy."""
    inside = set(nodes)
    inputs, outputs = region_boundary(nodes)
    views: dict[fx.Node, tuple[fx.Node, list[fx.Node]]] = {}
    results: list[fx.Node] = []
    for out in outputs:
        source, chain = _view_chain(out, inside)
        if chain:
            views[out] = (source, chain)
        if source in inside and source not in results:
            results.append(source)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, arg in enumerate(inputs):
        env[arg] = graph.placeholder(f"in{i}")
        env[arg].meta = dict(arg.meta)
    for i, node in enumerate(nodes):
        env[node] = graph.node_copy(node, lambda a: env[a])
        env[node]._rename(f"n{i}")  # canonical names: equal blocks, equal code
    returned = []
    # the storages already taken (an input that is no tensor, a size or a flag, has none)
    seen = [storage for a in inputs if (storage := _storage(a)) is not None]
    for result in results:
        value = env[result]
        storage = _storage(result)
        if storage is not None and storage in seen:
            value = graph.call_function(torch.ops.aten.clone.default, (value,))
            value.meta["val"] = result.meta["val"].clone()
        if storage is not None:
            seen.append(storage)
        returned.append(value)
    graph.output(tuple(returned))
    graph.eliminate_dead_code()  # views now rebuilt outside and used by nothing inside
    return _Extracted(fx.GraphModule(gm, graph), inputs, outputs, results, views)


def _view_chain(node: fx.Node, inside: set[fx.Node]) -> tuple[fx.Node, list[fx.Node]]:
    """(source, [views from the source out to ``node``]): the region's view ops leading to
    ``node`` whose other arguments come from outside the region."""
    chain: list[fx.Node] = []
    while step := _view_step(node, inside):
        views, node = step
        chain += views
    return node, chain[::-1]


def _view_step(node: fx.Node, inside: set[fx.Node]) -> tuple[list[fx.Node], fx.Node] | None:
    """(the nodes of the one view ending in ``node``, last first; the value it views): a view
    op, or an element of a view op's list of views (q, k and v split from one projection);
    None where ``node`` is no such view."""
    if node.target is operator.getitem and node in inside and isinstance(node.args[1], int):
        views = node.args[0]
        if not isinstance(views, fx.Node):
            return None
        source = _viewed(views, inside, (list, tuple))
        return ([node, views], source) if source is not None else None
    source = _viewed(node, inside, torch.Tensor)
    return ([node], source) if source is not None else None


def _viewed(
    node: fx.Node, inside: set[fx.Node], returns: type | tuple[type, ...]
) -> fx.Node | None:
    """The value ``node`` views, where it is a region op returning views (of type ``returns``)
    of its first argument with its other arguments from outside the region; else None."""
    source = node.args[0] if node.args else None
    if (
        node in inside
        and isinstance(node.target, torch._ops.OpOverload)
        and node.target.is_view
        and isinstance(node.meta.get("val"), returns)
        and isinstance(source, fx.Node)
        and not any(a in inside for a in node.all_input_nodes if a is not source)
    ):
        return source
    return None


def _storage(node: fx.Node) -> StorageWeakRef | None:
    val = node.meta.get("val")
    return StorageWeakRef(val.untyped_storage()) if isinstance(val, torch.Tensor) else None


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


def _replace(gm, ex: _Extracted, nodes, ident, inputs, first_user, order, replaced) -> None:
    """The region's nodes become one invoke_subgraph call before its first outside user; the
    outputs that are views are rebuilt after it."""
    inside = set(nodes)
    with gm.graph.inserting_before(first_user):
        sub_ref = gm.graph.get_attr(ident)
        call = gm.graph.call_function(
            torch.ops.higher_order.invoke_subgraph, (sub_ref, ident, *inputs)
        )
        call.meta["val"] = tuple(_returned_vals(ex.sub))
        env: dict[fx.Node, fx.Node] = {}  # a region node -> what stands for it outside
        for i, result in enumerate(ex.results):
            env[result] = gm.graph.call_function(operator.getitem, (call, i))
            env[result].meta = dict(result.meta)
        for out in ex.outputs:
            source, chain = ex.views.get(out, (out, []))
            for view in chain:
                if view not in env:
                    env[view] = gm.graph.node_copy(view, lambda a: env.get(a, replaced.get(a, a)))
        for node in [sub_ref, call, *env.values()]:
            order[node] = order[first_user] - 0.5  # a later region may read them
        for out in ex.outputs:
            replaced[out] = env[out]
            out.replace_all_uses_with(env[out], delete_user_cb=lambda u: u not in inside)
    for node in reversed(nodes):
        gm.graph.erase_node(node)


def _returned_vals(sub: fx.GraphModule) -> list:
    output = next(n for n in sub.graph.nodes if n.op == "output")
    return [a.meta.get("val") for a in output.args[0]]
