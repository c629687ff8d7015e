"""fold_cast_chains: remove casts that do nothing and collapse chains of casts.

- ``cast(x, d)`` where x already has dtype d disappears;
- ``cast(cast(x, a), b)`` of a floating x becomes ``cast(x, b)``, or x itself when x has dtype
  b. Under AMP, graphamp owns precision decisions: a round trip such as ``x.half().float()`` on
  an fp32 value is removed, so x is used at full precision. A bool or an integer x keeps its
  first cast (the user's conversion to a number: ``(h > 0).to(x.dtype)`` in MoE routing);
- afterwards each value has at most one cast per dtype (duplicates merged).

User casts count as casts here (``aten._to_copy`` / ``prims.convert_element_type`` that change
only the dtype); casts that also move devices or change layout are left alone.
"""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch.ops.aten._to_copy
from typing import cast

import torch
import torch.fx as fx

from .base import AmpContext, PassResult, dtype_after_amp

aten = torch.ops.aten
_CAST_TARGETS = (aten._to_copy.default, torch.ops.prims.convert_element_type.default)


def cast_target_dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype a pure dtype cast converts to, or None if ``node`` is not one."""
    if node.target not in _CAST_TARGETS or node.op != "call_function":
        return None
    if node.target is aten._to_copy.default:
        extra = {k: v for k, v in node.kwargs.items() if k != "dtype" and v is not None}
        if extra.get("memory_format") in (None, torch.preserve_format):
            extra.pop("memory_format", None)
        dtype = node.kwargs.get("dtype")
        return dtype if not extra and isinstance(dtype, torch.dtype) else None
    dtype = node.args[1]
    return dtype if isinstance(dtype, torch.dtype) else None


def _replace(node: fx.Node, with_node: fx.Node) -> None:
    node.replace_all_uses_with(with_node)
    node.graph.erase_node(node)


def fold_cast_chains(gm: fx.GraphModule, ctx: AmpContext) -> PassResult:
    graph = gm.graph
    removed = sum(_fold(graph, node) for node in list(graph.nodes))
    removed += _merge_duplicates(graph)
    ctx.stats["casts_folded"] = removed
    return PassResult(gm, removed > 0)


def _fold(graph: fx.Graph, node: fx.Node) -> int:
    """Remove ``node`` if it casts to the dtype its value has; read a chain's origin directly.
    Returns how many casts were removed."""
    target = cast_target_dtype(node)
    if target is None or not node.args:
        return 0
    src = node.args[0]
    if not isinstance(src, fx.Node) or dtype_after_amp(src) is None:
        return 0
    if dtype_after_amp(src) == target:
        _replace(node, src)
        return 1
    if cast_target_dtype(src) is None:
        return 0
    origin = cast(fx.Node, src.args[0])  # the value the inner cast casts
    if dtype_after_amp(origin) is None:
        # a bool or an integer cast to a float, then to another float: the first cast is the
        # user's conversion to a number and stays (an int cast straight to float16 would round
        # once where eager rounds twice; an AMP cast only ever takes a float)
        return 0
    if dtype_after_amp(origin) == target:
        _replace(node, origin)
    else:
        node.args = (origin, *node.args[1:])
    if src.users:
        return 1
    graph.erase_node(src)
    return 2


def _merge_duplicates(graph: fx.Graph) -> int:
    """One cast per (value, dtype): later duplicates read the first."""
    removed = 0
    seen: dict[tuple[fx.Node, torch.dtype], fx.Node] = {}
    for node in list(graph.nodes):
        target = cast_target_dtype(node)
        if target is None or not node.meta.get("amp_cast"):
            continue
        key = (node.args[0], target)
        first = seen.get(key)
        if first is None:
            seen[key] = node
        else:
            _replace(node, first)
            removed += 1
    return removed
