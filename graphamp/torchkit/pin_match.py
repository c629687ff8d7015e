"""Where an fp32 pin (``records/pins.AmpPin``) lands in a traced graph, and the pin that names a
node: a pin names (module path, op, occurrence), counted in graph order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch.fx as fx

from ..records.pins import AmpPin
from .fxutil import module_path, op_name

__all__ = ["PinMatch", "op_occurrences", "pin_identity", "resolve_pins"]


def pin_identity(node: fx.Node, occurrence: int) -> AmpPin:
    """The pin that names ``node`` (the ``occurrence``-th op of its name in its module)."""
    return AmpPin(module_path(node), op_name(node), occurrence)


def op_occurrences(nodes: Iterable[fx.Node]) -> dict[str, int]:
    """node name -> its index among the nodes with the same module path and op, in order.

    Casts the AMP passes inserted are left out: the count then matches the captured graph, so a
    pin made on one build names the same op in the next."""
    seen: dict[tuple[str, str], int] = {}
    out = {}
    for node in nodes:
        if node.op != "call_function" or node.meta.get("amp_cast"):
            continue
        key = (module_path(node), op_name(node))
        out[node.name] = seen.get(key, 0)
        seen[key] = out[node.name] + 1
    return out


@dataclass
class PinMatch:
    """What the pins name in one captured forward graph."""

    nodes: dict[str, str]  # node name -> why it is pinned
    modules: set[str]  # module paths pinned whole
    unmatched: list[AmpPin]  # pins naming nothing in this graph (model code changed?)


def resolve_pins(
    gm: fx.GraphModule, pins: Iterable[AmpPin], module_paths: Iterable[str]
) -> PinMatch:
    """The nodes and modules of ``gm`` that ``pins`` name; ``module_paths`` are the registered
    modules' paths (a module pin must name one of them)."""
    pins = list(pins)
    known_modules = set(module_paths)
    occurrence = op_occurrences(gm.graph.nodes)
    by_identity = {}
    for node in gm.graph.nodes:
        if node.name in occurrence:
            by_identity[(module_path(node), op_name(node), occurrence[node.name])] = node.name
    match = PinMatch({}, set(), [])
    for pin in pins:
        why = "pinned to fp32" + (f" ({pin.reason})" if pin.reason else "")
        if pin.op is None:
            if pin.module in known_modules:
                match.modules.add(pin.module)
            else:
                match.unmatched.append(pin)
            continue
        name = by_identity.get((pin.module, pin.op, pin.index))
        if name is None:
            match.unmatched.append(pin)
        else:
            match.nodes[name] = why
    return match
