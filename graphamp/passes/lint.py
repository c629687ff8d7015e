"""Invariants every AMP pass keeps (see README.md), checked after the pipeline."""

from __future__ import annotations

# torch private names read here (checked on torch 2.11.0, 2.14.1, 2.15.0: .ci/run's legs):
#   torch._guards
from collections import Counter
from typing import cast

import torch
import torch.fx as fx

from ..errors import GraphampError
from ..records.validate import LOW_PRECISION_DTYPES
from .base import AmpContext, captured_dtype, dtype_after_amp, output_values
from .fold_casts import cast_target_dtype
from .op_dtypes import MIXED_ARGS


class AmpInvariantError(GraphampError, RuntimeError):
    """An AMP pass broke one of the invariants in README.md (a graphamp bug)."""


def check_amp_invariants(gm: fx.GraphModule, ctx: AmpContext | None = None) -> None:
    graph = gm.graph
    user_outputs = ctx.user_outputs if ctx is not None else 0
    graph.lint()
    problems: list[str] = []
    per_value: Counter = Counter()
    for node in graph.nodes:
        problems += _cast_problems(node, per_value)
        if node.op == "call_function":
            problems += _compute_problems(node)
        if node.op == "output":
            problems += _output_problems(node, user_outputs)
    problems += [f"{src.name} has {n} casts to {dt}" for (src, dt), n in per_value.items() if n > 1]
    if problems:
        raise AmpInvariantError("AMP invariants broken:\n  " + "\n  ".join(problems))


def _casts_a_float(cast_node: fx.Node) -> bool:
    """Does this cast take a floating value (a chain of it folds; the conversion of a bool or
    an integer to a number stays, ``fold_casts``)?"""
    origin = cast_node.args[0]
    return isinstance(origin, fx.Node) and dtype_after_amp(origin) is not None


def _cast_problems(node: fx.Node, per_value: Counter) -> list[str]:
    """An inserted cast: of a floating value, to another dtype, not of a cast; counted per
    (value, dtype) in ``per_value``."""
    target = cast_target_dtype(node)
    if target is None or not node.meta.get("amp_cast"):
        return []
    src = cast(fx.Node, node.args[0])  # a cast's first argument is the value it casts
    per_value[(src, target)] += 1
    problems = []
    if dtype_after_amp(src) is None:
        problems.append(f"{node.name} casts non-float value {src.name}")
    if dtype_after_amp(src) == target:
        problems.append(f"{node.name} casts {src.name} to the dtype it already has")
    if cast_target_dtype(src) is not None and _casts_a_float(src):
        problems.append(f"{node.name} casts the cast {src.name} (chain not folded)")
    return problems


def _compute_problems(node: fx.Node) -> list[str]:
    """A widened op computes in fp32; fp32-only argument positions take no cast."""
    problems = []
    if node.meta.get("amp_widen"):
        low = [d for d in _dtypes(dtype_after_amp(node)) if d in (torch.float16, torch.bfloat16)]
        if low:
            problems.append(f"{node.name} must compute in fp32 but gives {low[0]}")
    packet = getattr(node.target, "overloadpacket", None)
    for pos in MIXED_ARGS.get(packet, ()):
        arg = node.args[pos] if pos < len(node.args) else None
        if isinstance(arg, fx.Node) and arg.meta.get("amp_cast"):
            problems.append(f"{node.name} takes a cast in fp32-only position {pos}")
    return problems


def _output_problems(output: fx.Node, user_outputs: int) -> list[str]:
    """The graph's outputs keep their captured dtypes; build()'s results (the first
    ``user_outputs``) may instead be wider: fp32 where they were captured in low precision."""
    problems = []
    for i, value in enumerate(output_values(output)):
        orig = captured_dtype(value)  # a cast records its source's captured dtype
        now = dtype_after_amp(value)
        widened = i < user_outputs and orig in LOW_PRECISION_DTYPES and now == torch.float32
        if orig is not None and now != orig and not widened:
            problems.append(f"output {value.name} is {now}, captured as {orig}")
    return problems


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
        if node.op == "output":
            continue
        want, got = expected[node], node.meta.get("val")
        if isinstance(got, (tuple, list)):  # every floating output of a tuple-producing op
            wants = want if isinstance(want, tuple) else (want,) * len(got)
            pairs = [(f"{node.name}[{i}]", w, g) for i, (w, g) in enumerate(zip(wants, got))]
        else:
            pairs = [(node.name, want, got)]
        for name, w, g in pairs:
            if isinstance(g, torch.Tensor) and g.dtype.is_floating_point and w != g.dtype:
                mismatches.append(f"{name}: passes say {w}, the op gives {g.dtype}")
    return mismatches


def _dtypes(dtype) -> tuple:
    return dtype if isinstance(dtype, tuple) else (dtype,)
