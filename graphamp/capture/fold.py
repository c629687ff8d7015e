"""Values of a captured forward computed for real, where they need no batch input.

A cache a library builds on first use (rotary cos/sin tables, inverse frequencies) is a
function of parameters, buffers and constants only. Eager's first call computes it once from
the state of that moment and keeps it; ``steady_state.py`` does the same with the first
trace's graph: the nodes that compute it are run eagerly, on the user's real tensors, once.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx

from ..records.spec import CapturedForward


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
    free = _batch_free(gm, known)
    needed = _ancestors([n for n in wanted if free.get(n)])
    env: dict[fx.Node, Any] = {}
    with torch.no_grad():
        for node in gm.graph.nodes:
            if node not in needed:
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


def _batch_free(gm: fx.GraphModule, known: dict[fx.Node, Any]) -> dict[fx.Node, bool]:
    """Node -> computed from known placeholders and constants only."""
    free: dict[fx.Node, bool] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            free[node] = node in known
        elif node.op in ("call_function", "get_attr"):
            free[node] = all(free.get(a, False) for a in node.all_input_nodes)
    return free


def _ancestors(nodes: list[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = list(nodes)
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(node.all_input_nodes)
    return seen
