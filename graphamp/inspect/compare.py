"""graphamp's precision decisions against torch.autocast's, op by op (see capture/oracle.py)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from ..records.spec import STRUCTURAL_OPS, AutocastTrace, OracleOp
from ..torchkit.fxutil import dtype_after_amp, is_compute_node, module_path, op_name


@dataclass
class OpComparison:
    op: str
    module: str
    ordinal: int
    graphamp_node: str
    graphamp_low: bool
    autocast_low: bool
    reason: str  # graphamp's amp_reason

    @property
    def agrees(self) -> bool:
        return self.graphamp_low == self.autocast_low


@dataclass
class Comparison:
    pairs: list[OpComparison]
    unmatched_graphamp: list[str]
    unmatched_autocast: list[str]
    graphamp_casts: int
    autocast_casts: int

    @property
    def differences(self) -> list[OpComparison]:
        return [p for p in self.pairs if not p.agrees]


def compare(forward: fx.GraphModule, trace: AutocastTrace) -> Comparison:
    """Pair graphamp's compute ops with autocast's by (module, op, occurrence) and compare."""
    ours: dict[tuple[str, str], list[fx.Node]] = defaultdict(list)
    for node in forward.graph.nodes:
        if not is_compute_node(node) or node.meta.get("amp_cast"):
            continue
        name = op_name(node)
        if name in STRUCTURAL_OPS or node.meta.get("amp_colour") in (None, "fixed"):
            continue
        ours[(module_path(node), name)].append(node)
    theirs: dict[tuple[str, str], list[OracleOp]] = defaultdict(list)
    for op in trace.ops:
        if op.dtype is not None:
            theirs[(op.module, op.op)].append(op)
    pairs, lone_ours, lone_theirs = [], [], []
    for key in sorted(set(ours) | set(theirs)):
        a, b = ours.get(key, []), theirs.get(key, [])
        for i, (node, op) in enumerate(zip(a, b)):
            low = _low(dtype_after_amp(node), node, trace.dtype)
            pairs.append(
                OpComparison(
                    key[1],
                    key[0],
                    i,
                    node.name,
                    low,
                    op.dtype == trace.dtype,
                    str(node.meta.get("amp_reason", "")),
                )
            )
        lone_ours += [n.name for n in a[len(b) :]]
        lone_theirs += [f"{key[0]}:{key[1]}" for _ in b[len(a) :]]
    casts = sum(1 for n in forward.graph.nodes if n.meta.get("amp_cast"))
    return Comparison(pairs, lone_ours, lone_theirs, casts, trace.casts)


def _low(dtype: Any, node: fx.Node, low: torch.dtype) -> bool:
    if isinstance(dtype, tuple):
        dtype = dtype[0]
    if dtype is None:  # a non-float result (argmax, comparisons): the dtype it read
        inputs = [dtype_after_amp(n) for n in node.all_input_nodes]
        dtype = next((d for d in inputs if isinstance(d, torch.dtype)), None)
    return dtype == low
