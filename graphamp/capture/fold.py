"""Values of a captured forward computed for real, where they need no batch input.

A cache a library builds on first use (rotary cos/sin tables, inverse frequencies) is a
function of parameters, buffers and constants only. Eager's first call computes it once from
the state of that moment and keeps it; ``steady_state.py`` does the same with the first
trace's graph: the nodes that compute it are run eagerly, on the user's real tensors, once.
Where the batch's sizes are symbolic (``torchkit/shapes.py``), a size node is this call's size:
a cache sized by the sequence length is computed for the length of this call, as eager's is.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx

from ..records.spec import CapturedForward
from ..torchkit.compat import guarding_hint_or_throw, has_guarding_hint


def values_without_batch(
    captured: CapturedForward,
    params: Sequence[torch.Tensor],
    buffers: Sequence[torch.Tensor],
    wanted: list[fx.Node],
) -> list[torch.Tensor | None]:
    """Each wanted node's real value, or None where it depends on g(...)'s inputs or the loss
    scale. Runs only the nodes the wanted ones need, without autograd."""
    gm = captured.gm
    groups = captured.layout.split([n for n in gm.graph.nodes if n.op == "placeholder"])
    known: dict[fx.Node, Any] = dict(zip(groups.params, params))
    known.update(zip(groups.buffers, buffers))
    known.update(zip(groups.constants, captured.constants))
    sizes = _batch_sizes(gm)
    free = _batch_free(gm, known, sizes)
    needed = _ancestors([n for n in wanted if free.get(n)], sizes)
    env: dict[fx.Node, Any] = dict(sizes)
    with torch.no_grad():
        for node in gm.graph.nodes:
            if node not in needed or node in sizes:
                continue
            if node.op == "placeholder":
                env[node] = known[node].detach()
            elif node.op == "get_attr":
                env[node] = getattr(gm, str(node.target))
            else:
                args = fx.map_arg(node.args, env.__getitem__)
                kwargs = fx.map_arg(node.kwargs, env.__getitem__)
                env[node] = node.target(*args, **kwargs)  # type: ignore[operator]
    return [env[n] if free.get(n) else None for n in wanted]


def _batch_sizes(gm: fx.GraphModule) -> dict[fx.Node, int | bool]:
    """The size nodes (``sym_size``, arithmetic on sizes) of the batch's symbolic dimensions,
    each with its value in this call; sizes that depend on tensor values are left out."""
    sizes: dict[fx.Node, int | bool] = {}
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "call_function" and isinstance(val, (torch.SymInt, torch.SymBool)):
            if has_guarding_hint(val):
                sizes[node] = guarding_hint_or_throw(val)
    return sizes


def _batch_free(
    gm: fx.GraphModule, known: dict[fx.Node, Any], sizes: dict[fx.Node, Any]
) -> dict[fx.Node, bool]:
    """Node -> computed from known placeholders, constants and this call's sizes only."""
    free: dict[fx.Node, bool] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            free[node] = node in known
        elif node in sizes:
            free[node] = True
        elif node.op in ("call_function", "get_attr"):
            free[node] = all(free.get(a, False) for a in node.all_input_nodes)
    return free


def _ancestors(nodes: list[fx.Node], known: dict[fx.Node, Any]) -> set[fx.Node]:
    """The nodes ``nodes`` are computed from, stopping at the ``known`` ones."""
    seen: set[fx.Node] = set()
    todo = list(nodes)
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            if node not in known:
                todo.extend(node.all_input_nodes)
    return seen
