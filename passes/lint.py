"""Invariants every AMP pass keeps (see README.md), checked after the pipeline."""

from __future__ import annotations

import operator
from collections import Counter

import torch
import torch.fx as fx

from ..errors import GraphampError
from .base import AmpContext, dtype_after_amp, float_dtype
from .fold_casts import cast_target_dtype
from .lists import MIXED_ARGS


class AmpInvariantError(GraphampError, RuntimeError):
    """An AMP pass broke one of the invariants in passes/README.md (a graphamp bug)."""


def check_amp_invariants(gm: fx.GraphModule, ctx: AmpContext | None = None) -> None:
    graph = gm.graph
    graph.lint()
    problems: list[str] = []
    per_value = Counter()
    for node in graph.nodes:
        target = cast_target_dtype(node)
        if target is not None and node.meta.get("amp_cast"):
            src = node.args[0]
            per_value[(src, target)] += 1
            if dtype_after_amp(src) is None:
                problems.append(f"{node.name} casts non-float value {src.name}")
            if dtype_after_amp(src) == target:
                problems.append(f"{node.name} casts {src.name} to the dtype it already has")
            if cast_target_dtype(src) is not None:
                problems.append(f"{node.name} casts the cast {src.name} (chain not folded)")
        if node.op == "call_function":
            packet = getattr(node.target, "overloadpacket", None)
            for pos in MIXED_ARGS.get(packet, ()):
                arg = node.args[pos] if pos < len(node.args) else None
                if isinstance(arg, fx.Node) and arg.meta.get("amp_cast"):
                    problems.append(f"{node.name} takes a cast in fp32-only position {pos}")
        if node.op == "output":
            for value in node.all_input_nodes:
                orig = float_dtype(value.meta.get("val"))
                if value.meta.get("amp_cast"):
                    orig = float_dtype(value.args[0].meta.get("val"))
                if orig is not None and dtype_after_amp(value) != orig:
                    problems.append(f"output {value.name} is {dtype_after_amp(value)}, "
                                    f"captured as {orig}")
    problems += [f"{src.name} has {n} casts to {dt}" for (src, dt), n in per_value.items() if n > 1]
    if problems:
        raise AmpInvariantError("AMP invariants broken:\n  " + "\n  ".join(problems))


def verify_dtypes(gm: fx.GraphModule) -> list[str]:
    """Re-run the graph on fake tensors and list values whose dtype differs from amp_dtype.

    Slow (one fake dispatch per node): for tests and debug level 3, not the normal path.
    """
    from torch._guards import detect_fake_mode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    vals = [n.meta["val"] for n in placeholders]
    mode = detect_fake_mode(vals)
    expected = {n: dtype_after_amp(n) for n in gm.graph.nodes}
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*vals)
    mismatches = []
    for node in gm.graph.nodes:
        want = expected[node]
        got = node.meta.get("val")
        if node.op == "call_function" and node.target is operator.getitem:
            continue
        if isinstance(got, torch.Tensor) and got.dtype.is_floating_point and want != got.dtype:
            mismatches.append(f"{node.name}: passes say {want}, the op gives {got.dtype}")
    return mismatches
